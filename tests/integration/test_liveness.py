"""Every request ends: the per-request deadline (--request-timeout) and the scheduler watchdog
(--watchdog-timeout), on a real colocated node whose forward is made to hang
(`tests/pd/node_hooks`: the `hang_forward` hook)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from common.scheduler.watchdog import Watchdog
from tests.harness.client import http_get, http_post
from tests.harness.nodes import NodeProcess

HOOKS = str(Path(__file__).resolve().parents[1] / "pd" / "node_hooks")


def generate(node, max_new_tokens: int = 3) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    code, raw = http_post(node.url + "/generate", {"text": "hello", "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}, timeout=120)
    return code, json.loads(raw), time.monotonic() - t0


def test_watchdog_fires_once_the_loop_stops_beating():
    fired = threading.Event()
    dog = Watchdog(0.4, "test", on_stuck=fired.set).start()
    try:
        for _ in range(10):  # a loop that beats is left alone
            dog.beat()
            time.sleep(0.1)
        assert not fired.is_set()
        assert fired.wait(5)  # then it stops beating
    finally:
        dog.stop()
    assert Watchdog(0, "off").start()._thread is None  # 0 turns it off


def test_a_hung_forward_ends_in_a_504_then_the_watchdog_turns_the_node_503(tiny_model_dir, tmp_path):
    control = tmp_path / "hooks"
    control.mkdir()
    env = {"PYTHONPATH": HOOKS, "PDSERVE_TEST_HOOKS_DIR": str(control)}
    with NodeProcess(tiny_model_dir, env=env, log_path=tmp_path / "node.log", max_total_tokens=2048,
                     request_timeout=2.0, watchdog_timeout=6.0) as node:
        code, body, _ = generate(node)
        assert code == 200 and body["meta_info"]["completion_tokens"] == 3, body

        (control / "hang_forward").write_text("")
        code, body, took = generate(node)
        # the deadline answers although the scheduler is stuck in its forward
        assert code == 504, body
        assert "request timed out after 2s (--request-timeout)" in body["error"]["message"]
        assert took < 10, took

        deadline = time.monotonic() + 60
        while http_get(node.url + "/health")[0] != 503:
            assert time.monotonic() < deadline, node.log_tail()
            time.sleep(0.2)
        code, body, _ = generate(node)
        assert code == 503 and "--watchdog-timeout" in body["error"]["message"], body
        log = node.log_text()
        assert "no loop iteration for" in log and "thread stacks" in log
        assert "in hung_run" in log, "the stack dump shows where the forward hangs"
