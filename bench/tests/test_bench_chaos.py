"""The short chaos soak (`pdserve bench chaos`, issue 14): a real 2 prefill + 2 decode cluster on nixl
with a tiny model, ~6 s of traffic (longer until both restarted nodes have served) with disconnects,
explicit aborts, 20 % injected transfer failures, bursts past the router's limits and a kill -9 of a decode
and a prefill node that the launcher restarts.
Every request must end (0 hung), every error must name its cause, every node must be back at rest
(0 leaked) and healthy; injected transfer failures and the kills reach no client that had no token yet (the
router runs those requests again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.backend("nixl")
@pytest.mark.timeout(420)
def test_short_chaos_soak_no_hang_no_leak(tiny_model_dir, tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "deploy.cli", "bench", "chaos", "--model", tiny_model_dir, "--duration", "6",
           "--concurrency", "4", "--abort-prob", "0.03", "--burst-every", "5",
           "--burst-size", "60", "--kills",
           "decode-1@0.1,prefill-1@0.3", "--after-heal", "2", "--warmup", "4", "--hang-wait", "30",
           "--drain-timeout", "60",
           "--peer-idle-timeout", "8", "--progress-every", "5", "--log-dir", str(tmp_path / "logs"),
           "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    f = report["figures"]
    detail = json.dumps({"figures": f, "nodes": report["nodes"], "causes": report["error_causes"],
                         "hung": report["hung_requests"],
                         "unexplained": report["unexplained_errors"]}, indent=1)
    assert f["hung"] == 0, detail
    assert f["nodes_leaked"] == 0 and f["nodes_unhealthy"] == 0, detail
    assert r.returncode == 0 and "chaos: OK" in r.stdout, r.stdout[-3000:]
    assert f["error_unexplained"] == 0, detail
    # every fault kind happened
    assert f["sent"] >= 200 and f["completed"] > 0, detail
    assert f["disconnected"] > 0 and f["aborted"] > 0 and f["rejected_429"] > 0, detail
    # the injected transfer failures happened on the nodes; the router ran those requests again, so a client
    # sees one only after five in a row (the retry limit)
    assert sum(n["counters"].get("transfer_failures", 0) for n in report["nodes"].values()) > 0, detail
    assert f["kv_transfer_errors"] <= 2 and f["fault_errors_before_first_token"] == 0, detail
    assert [x["what"] for x in report["faults"]] == ["kill -9 decode-1", "kill -9 prefill-1"], detail
    healed = {e["child"] for e in report["events"] if e["event"] == "healthy"}
    assert healed == {"decode-1", "prefill-1"}, report["events"]
    # restarted once each (whether the router already sends them traffic depends on its circuit
    # breaker, opened by the crash for --cb-timeout-duration-secs: tests/deploy/test_cluster_restart.py)
    for name in ("decode-1", "prefill-1"):
        assert report["nodes"][name]["restarts"] == 1, detail
    assert "chaos: t=" in r.stdout  # progress lines


def test_kills_naming_a_node_the_cluster_lacks_are_refused_before_it_starts(capsys):
    from bench import chaos

    assert chaos.parse_kills("decode-0@0.3, prefill-1", 2, 1) == [(0.3, "decode-0"), (0.5, "prefill-1")]
    # the default (decode-1, prefill-1) on a 1 + 1 cluster crashed mid-run with a KeyError before
    assert chaos.main(["--prefill", "1", "--decode", "1"]) == 2
    assert "no node 'decode-1'" in capsys.readouterr().err
    for bad in ("decode-0@2", "decode-0@x"):
        with pytest.raises(ValueError, match="--kills"):
            chaos.parse_kills(bad, 1, 1)
