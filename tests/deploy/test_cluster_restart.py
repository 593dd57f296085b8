"""`pdserve cluster` heals: a decode node killed with SIGKILL is restarted on its own port, the router
serves through it again, and `--max-restarts` is honoured (real launcher process, tiny model, fake
backend)."""

from __future__ import annotations

import json
import os
import signal
import time

import psutil

from tests.deploy.test_cluster import launch, read_until
from tests.harness.client import http_json

CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4, "ignore_eos": True}


def served_by(url: str, decode_url: str, timeout: float) -> None:
    """Chat requests through the router until one is answered by the decode node at `decode_url`."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        before = node_count(decode_url)
        status, body = http_json("POST", url + "/v1/chat/completions", CHAT, timeout=30)
        last = (status, body)
        if status == 200 and node_count(decode_url) > before:
            return
        time.sleep(0.5)
    raise AssertionError(f"no request served through {decode_url} within {timeout:.0f}s; last answer {last}")


def node_count(url: str) -> int:
    status, info = http_json("GET", url + "/server_info", timeout=10)
    assert status == 200, info
    return info["stats"]["transfer_successes"]


def test_killed_decode_comes_back_on_its_port_until_the_restart_limit(tiny_model_dir, tmp_path):
    proc = launch(["--prefill", "1", "--decode", "2", "--transfer-backend", "fake", "--model", tiny_model_dir,
                   "--max-total-tokens", "2048", "--num-threads", "1", "--max-restarts", "1",
                   "--router-args=--policy round_robin --health-check-interval-secs 1"], tmp_path)
    try:
        out = read_until(proc, "Ctrl-C stops every process")
        url = next(line.split()[1] for line in out if line.startswith("router:"))
        children = {c["name"]: c for c in json.loads((tmp_path / "cluster.json").read_text())["children"]}
        victim = children["decode-1"]
        status, body = http_json("POST", url + "/v1/chat/completions", CHAT, timeout=60)
        assert status == 200, body

        # a crash of the node's main process: the launcher cleans up its scheduler and starts it again
        os.kill(victim["pid"], signal.SIGKILL)
        lines = read_until(proc, "decode-1: restarted on port", timeout=60)
        assert any("decode-1: exited with code -9; restart 1/1 in 1s on port" in line
                   for line in lines), lines
        read_until(proc, "decode-1: healthy again on port", timeout=300)
        now = {c["name"]: c for c in json.loads((tmp_path / "cluster.json").read_text())["children"]}
        assert now["decode-1"]["port"] == victim["port"] and now["decode-1"]["pid"] != victim["pid"]
        assert not psutil.pid_exists(victim["pid"]) or \
            psutil.Process(victim["pid"]).status() == psutil.STATUS_ZOMBIE
        served_by(url, victim["url"], timeout=60)  # the router re-admitted it

        # the second crash within the window is over --max-restarts 1: reported, not restarted
        os.kill(now["decode-1"]["pid"], signal.SIGKILL)
        read_until(proc,
                   "decode-1: exited with code -9; not restarted: 1 restarts in the last 600s", timeout=60)
        time.sleep(2)
        assert not psutil.pid_exists(now["decode-1"]["pid"]) or \
            psutil.Process(now["decode-1"]["pid"]).status() == psutil.STATUS_ZOMBIE
        status, body = http_json("POST", url + "/v1/chat/completions", CHAT, timeout=60)
        assert status == 200, body  # decode-0 still serves

        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, rest
        assert "restarted" not in rest  # nothing was restarted while stopping
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
