"""Shared output of every `pdserve bench ...`: the machine (with the commit the bench ran from), raw figures
and a `ratios` object.

A ratio is ours / reference measured in the same run, oriented so that higher is better.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import psutil


def source_commit() -> str | None:
    """The checkout's commit, with `-dirty` when its tree has changes; None outside a git checkout."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], capture_output=True,
                             text=True, timeout=10, cwd=Path(__file__).resolve().parents[1])
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def machine_info() -> dict:
    try:
        import torch

        torch_version = torch.__version__
        threads = torch.get_num_threads()
    except ImportError:  # the router bench does not need torch
        torch_version, threads = None, None
    cpu_model, flags, ids = platform.processor(), set(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:  # the first processor's lines, up to its flags
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "model name":
                    cpu_model = value
                elif key in ("cpu family", "model"):
                    ids[key] = value
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {
        "cpu": cpu_model,
        # which generation: a cloud "AMD EPYC" has been a Zen 3, a Zen 4 (family 25) and a Zen 5 (26)
        "cpu_family_model": f"{ids.get('cpu family', '?')}/{ids.get('model', '?')}",
        # the widest vector extensions the CPU has, and what the native kernels were built for
        "cpu_vectors": [f for f in ("avx2", "avx512f", "avx512_vnni") if f in flags],
        "native_isa": os.environ.get("PDSERVE_NATIVE_ISA", "native"),
        "logical_cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch_version,
        "torch_threads": threads,
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": source_commit(),
    }


def write_report(path: str | None, bench: str, figures: dict, ratios: dict[str, float]) -> dict:
    """Print the ratios and, when `path` is given, write the whole report as JSON."""
    report = {"bench": bench, "machine": machine_info(), "figures": figures,
              "ratios": {k: round(float(v), 4) for k, v in ratios.items()}}
    width = max((len(k) for k in ratios), default=0)
    print(f"\n{bench}: ratios (ours / reference, higher is better)")
    for name, value in report["ratios"].items():
        print(f"  {name:<{width}}  {value:.3f}")
    save_json(path, report)
    return report


RESULT_KEYS = ("bench", "machine", "device", "command", "config", "ratios")


def as_result(report: dict) -> dict:
    """A report in bench/results/'s shape: its own keys (`RESULT_KEYS`) at the top, every measured part under
    `figures`."""
    out = {k: report[k] for k in RESULT_KEYS if k in report}
    out["figures"] = {k: v for k, v in report.items() if k not in RESULT_KEYS}
    return out


def save_json(path: str | None, report: dict) -> None:
    """Write a bench's report (its directory made first) and say where; nothing without a path."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {path}", flush=True)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the description's line breaks and shows every flag's default."""
