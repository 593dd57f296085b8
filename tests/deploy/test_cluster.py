"""`pdserve cluster` as a user runs it: a real launcher process with real children (tiny model, fake
backend), a chat request through the printed router URL, CPU pinning, Ctrl-C, and start-up failures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from common.cores import parse_cores
from deploy import cluster_cli as cl
from deploy import procs
from deploy.placement import plan
from tests.harness.client import http_json

ROOT = Path(__file__).resolve().parents[2]


def launch(args: list[str], log_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deploy.cli", "cluster", "--log-dir", str(log_dir), "--port", "0", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def read_until(proc: subprocess.Popen, marker: str, timeout: float = 600) -> list[str]:
    lines = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError("launcher exited before '" + marker + "':\n" + "".join(lines))
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"no '{marker}' within {timeout}s:\n" + "".join(lines))


def test_cluster_command_serves_pins_and_stops_on_ctrl_c(tiny_model_dir, tmp_path):
    """With no --cpu-affinity every node gets cores of its own (deploy/placement.py) and as many torch
    threads."""
    cores = sorted(os.sched_getaffinity(0))
    want = plan(1, 1, cores)
    args = ["--prefill", "1", "--decode", "1", "--transfer-backend", "fake", "--model", tiny_model_dir,
            "--max-total-tokens", "2048"]
    proc = launch(args, tmp_path)
    try:
        out = read_until(proc, "Ctrl-C stops every process")
        text = "".join(out)
        url = next(line.split()[1] for line in out if line.startswith("router:"))
        assert url.startswith("http://127.0.0.1:") and "curl -s " + url + "/v1/chat/completions" in text
        assert want.describe() in text  # it says what it chose
        manifest = json.loads((tmp_path / "cluster.json").read_text())
        assert manifest["router"] == url
        children = {c["name"]: c for c in manifest["children"]}
        assert set(children) == {"prefill-0", "decode-0", "router"}
        assert children["prefill-0"]["bootstrap_port"] and "--disaggregation-bootstrap-port" in \
            children["prefill-0"]["cmd"]

        status, body = http_json("POST", url + "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                                  "max_tokens": 5, "ignore_eos": True})
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 5

        for name in ("prefill-0", "decode-0"):  # every process of a node, its scheduler too, on its cores
            assert children[name]["cores"] == want.cores[name]
            node = psutil.Process(children[name]["pid"])
            procs = [node, *node.children(recursive=True)]
            assert len(procs) >= 2
            for p in procs:
                assert p.cpu_affinity() == want.cores[name], (name, p.pid, p.cmdline()[:3])
                assert p.environ().get("OMP_WAIT_POLICY") == want.env.get("OMP_WAIT_POLICY",
                                                                          os.environ.get("OMP_WAIT_POLICY"))
            status, info = http_json("GET", children[name]["url"] + "/server_info")
            assert status == 200 \
                and info["stats"]["torch_threads"] == len(want.cores[name]), info.get("stats")
            # what --device / --dtype / --attention-backend auto resolved to on this CPU machine
            assert (info["device"], info["dtype"], info["attention_backend"]) == ("cpu", "float32", "native")
            assert info["disable_cuda_graph"] is True and info["cuda_graph_batch_sizes"] == []
        if len(cores) >= 2:
            assert not set(want.cores["prefill-0"]) & set(want.cores["decode-0"])
            # the decode node borrowed the prefill node's core while it idled (common/core_loan.py)
            stats = {n: http_json("GET", children[n]["url"] + "/server_info")[1]["stats"] for n in children
                     if n != "router"}
            assert stats["prefill-0"]["core_loan_role"] == "lender" \
                and stats["prefill-0"]["core_loan_idle_seconds"] > 0
            assert stats["decode-0"]["core_loan_role"] == "borrower"
            assert 1 <= stats["decode-0"]["core_loan_lent_forwards"] \
                <= stats["decode-0"]["core_loan_forwards"]
            scheduler = psutil.Process(children["decode-0"]["pid"]).children(recursive=True)
            lent = ",".join(map(str, want.cores["prefill-0"]))
            pinned = [_allowed(p.pid, t.id) for p in scheduler for t in p.threads()]
            assert lent in pinned, pinned  # its extra OpenMP thread runs on the lent core only
        pids = [c["pid"] for c in manifest["children"]]
        descendants = [q.pid for pid in pids for q in psutil.Process(pid).children(recursive=True)]

        proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal does
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, rest
        assert "stopping the cluster" in rest and "stopped" in rest
        for pid in pids + descendants:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
        for name in children:
            assert (tmp_path / f"{name}.log").stat().st_size > 0
        assert "serving on" in (tmp_path / "decode-0.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _allowed(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            return next(line for line in f if line.startswith("Cpus_allowed_list")).split(":")[1].strip()
    except (OSError, StopIteration):
        return ""


def test_core_loan_flags_and_when_the_launcher_leaves_them_out(tiny_model_dir, tmp_path):
    c = cl.cluster_from_args(["--model", tiny_model_dir])
    assert c.core_loan and c._no_core_loan() is None
    c.log_dir, c.placement = str(tmp_path), plan(1, 1, [0, 1])
    path = str(tmp_path / "core-loan-prefill-0")
    assert c._loan_args("prefill-0") == ["--core-loan-file", path]
    assert c._loan_args("decode-0") == ["--core-loan-file", path, "--core-loan-cores", "0"]
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.path.getsize(path) == 1
    assert c._loan_args("router") == []
    for argv, why in ((["--no-core-loan"], "turned off"), (["--decode-args=--tp 2"], "--tp-size"),
                      (["--decode-args=--enable-overlap-schedule"], "overlap"),
                      (["--prefill-args=--dp-size 2"], "--dp-size"),
                      (["--decode-args=--core-loan-file x --core-loan-cores 0"], "themselves")):
        assert why in cl.cluster_from_args(["--model", tiny_model_dir, *argv])._no_core_loan(), argv


def test_child_dying_at_start_is_named_with_its_log(tiny_model_dir, tmp_path):
    # a node setting the node itself rejects: the prefill node exits during start-up
    proc = launch(["--prefill", "1", "--decode", "1", "--transfer-backend", "fake", "--model", tiny_model_dir,
                   "--prefill-args=--max-total-tokens 8", "--startup-timeout", "300"], tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "prefill-0 exited with code" in out and "during start-up" in out
    assert "max-total-tokens" in out  # the tail of the child's log explains why
    assert str(tmp_path / "prefill-0.log") in out
    # the launcher stopped what it had started
    manifest = json.loads((tmp_path / "cluster.json").read_text())
    for child in manifest["children"]:
        pid = child["pid"]
        assert not psutil.pid_exists(pid) \
            or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, child["name"]


def test_launcher_rejects_bad_flags_before_starting_anything(tmp_path):
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "cluster", "--log-dir", str(tmp_path),
                        "--transfer-backend", "fake", "--no-such-node-flag", "3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--no-such-node-flag" in r.stderr
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "cluster", "--router-args=--bogus-router-flag"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--bogus-router-flag" in r.stderr
    assert not any(tmp_path.iterdir())  # nothing was started


def test_affinity_and_core_parsing():
    assert parse_cores("0-2,5,5") == [0, 1, 2, 5]
    with pytest.raises(ValueError):
        parse_cores("3-1")
    first = min(os.sched_getaffinity(0))
    assert procs.parse_affinity(f"prefill={first}; decode={first}") == {"prefill": [first], "decode": [first]}
    assert procs.parse_affinity(None) == {}
    with pytest.raises(ValueError, match="ROLE=CORES"):
        procs.parse_affinity("gpu=0")
    with pytest.raises(ValueError, match="not available"):
        procs.parse_affinity("decode=4096")


def test_cluster_args_reach_every_node(tiny_model_dir):
    c = cl.cluster_from_args(["--prefill", "2", "--decode", "3", "--transfer-backend", "nixl", "--model",
                              tiny_model_dir, "--tp", "1", "--page-size", "32",
                              "--chunked-prefill-size", "64",
                              "--max-running-requests", "7", "--policy", "power_of_two",
                              "--decode-args", "--max-total-tokens 4096"])
    assert (c.num_prefill, c.num_decode, c.transfer_backend) == (2, 3, "nixl")
    assert c.node_args == ["--max-running-requests", "7", "--tp", "1", "--page-size", "32",
                           "--chunked-prefill-size", "64"]
    assert c.decode_args == ["--max-total-tokens", "4096"] and c.router_args == ["--policy", "power_of_two"]
    assert c.auto_placement and not c.cpu_affinity  # the default: deploy/placement.py picks the cores
    cmd = c._node_cmd("prefill", 1234, 5678)
    assert cmd[1:3] == ["-m", "prefill_node"]
    assert cmd[cmd.index("--disaggregation-bootstrap-port") + 1] == "5678"
    assert "--max-total-tokens" not in cmd and "--max-running-requests" in cmd
    # the node sizes its torch threads from the cores it is pinned to
    assert "--num-threads" not in c._node_cmd("decode", 1, 0)
    assert not cl.cluster_from_args(["--model", tiny_model_dir, "--cpu-affinity", "none"]).auto_placement


def test_conditional_disaggregation_is_on_by_default(tiny_model_dir):
    """Decode nodes take requests without a rendezvous, in small chunks unless a chunk size is given; the
    router sends them while the prefill node has three prefills in flight; --local-prefill-queue 0 turns it
    off."""
    c = cl.cluster_from_args(["--model", tiny_model_dir])
    assert c.local_prefill_queue == cl.DEFAULT_LOCAL_PREFILL_QUEUE == 3
    decode = c._node_cmd("decode", 1, 0)
    assert "--disaggregation-local-prefill" in decode
    assert decode[decode.index("--chunked-prefill-size") + 1] == str(cl.LOCAL_PREFILL_CHUNK)
    assert "--enable-mixed-chunk" in decode  # the running batch decodes inside each local chunk
    prefill = c._node_cmd("prefill", 1, 2)
    assert "--disaggregation-local-prefill" not in prefill and "--enable-mixed-chunk" not in prefill
    router = c._router_cmd(3)
    assert router[router.index("--local-prefill-queue") + 1] == "3"
    # a chunk size given for every node or for decode nodes comes later on the command line, so it wins
    for argv in (["--chunked-prefill-size", "256"], ["--decode-args", "--chunked-prefill-size 256"]):
        cmd = cl.cluster_from_args(["--model", tiny_model_dir, *argv])._node_cmd("decode", 1, 0)
        assert cmd[len(cmd) - 1 - cmd[::-1].index("--chunked-prefill-size") + 1] == "256"
    spec = cl.cluster_from_args(["--model", tiny_model_dir, "--decode-args", "--speculative-algorithm NGRAM"])
    assert "--enable-mixed-chunk" not in spec._node_cmd("decode", 1, 0)  # the two exclude each other
    given = cl.cluster_from_args(["--model", tiny_model_dir, "--router-args", "--local-prefill-queue 5"])
    assert given._router_cmd(3).count("--local-prefill-queue") == 1
    off = cl.cluster_from_args(["--model", tiny_model_dir, "--local-prefill-queue", "0"])
    assert not {"--disaggregation-local-prefill", "--enable-mixed-chunk"} & set(off._node_cmd("decode", 1, 0))
    assert "--local-prefill-queue" not in off._router_cmd(3)
    with pytest.raises(SystemExit):
        cl.cluster_from_args(["--model", tiny_model_dir, "--local-prefill-queue", "-1"])


def test_the_planner_starts_nodes_that_can_switch_roles(tiny_model_dir, capsys):
    """--planner slo: the router gets the planner and both SLOs; every node a bootstrap port and only flags
    both roles take (no conditional disaggregation, no core loan); flags one role refuses are refused here,
    named, before any child starts."""
    c = cl.cluster_from_args(["--model", tiny_model_dir, "--prefill", "2", "--decode", "2",
                              "--planner", "slo", "--ttft-slo", "1.5", "--itl-slo", "0.05"])
    assert c.switchable and not c.core_loan and c.local_prefill_queue == 0
    router = c._router_args()
    assert router[router.index("--planner") + 1] == "slo"
    assert router[router.index("--ttft-slo") + 1] == "1.5" and router[router.index("--itl-slo") + 1] == "0.05"
    decode = c._node_cmd("decode", 1, 7)
    assert decode[decode.index("--disaggregation-bootstrap-port") + 1] == "7"
    assert not {"--disaggregation-local-prefill", "--enable-mixed-chunk"} & set(decode)
    refused = {
        ("--planner", "slo", "--ttft-slo", "1"): "--itl-slo",
        ("--ttft-slo", "1", "--itl-slo", "0.1"): "need --planner slo",
        ("--planner", "slo", "--ttft-slo", "1", "--itl-slo", "0.1", "--local-prefill-queue", "3"):
            "--local-prefill-queue",
        ("--planner", "slo", "--ttft-slo", "1", "--itl-slo", "0.1", "--decode-args=--enable-mixed-chunk"):
            "enable-mixed-chunk",
    }
    for argv, why in refused.items():
        with pytest.raises(SystemExit):
            cl.cluster_from_args(["--model", tiny_model_dir, *argv])
        assert why in capsys.readouterr().err, argv
