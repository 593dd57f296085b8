"""Helpers for the PD node tests: real prefill / decode / colocated nodes on 127.0.0.1.

Nodes run as subprocesses (`python -m prefill_node`, `python -m decode_node`, and a colocated node
through `common.server.launch.launch_server`) on a tiny random-weight llama that uses the default
model's tokenizer. `PDPair` is what a PD router does, minimally: the same body with
bootstrap_host/port/room to both nodes at once, the decode answer back.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import os
import random
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(TESTS))  # the node_process helper
from node_process import ROOT, NodeProcess, free_port, http_get, http_post  # noqa: E402

# settings every node of the suite shares (prefill and decode must agree on page size)
BASE = {"page_size": 4, "chunked_prefill_size": 32, "max_total_tokens": 2048, "max_running_requests": 16,
        "context_length": 256}
FAST_ENV = {"PDSERVE_HEARTBEAT_INTERVAL": "0.3", "PDSERVE_HEARTBEAT_MAX_FAILURES": "4",
            "PDSERVE_TRANSFER_WORKERS": "2", "OMP_NUM_THREADS": "1"}


def _flags(settings: dict) -> list[str]:
    out = []
    for k, v in settings.items():
        if v is None:
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            if v:
                out.append(flag)
        else:
            out += [flag, str(v)]
    return out


class RoleNode(NodeProcess):
    """A prefill or decode node started with `python -m prefill_node` / `python -m decode_node`."""

    def __init__(self, role: str, model: str, **settings):
        self.role = role
        super().__init__(model, **settings)

    def start(self) -> RoleNode:
        import subprocess

        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", f"{self.role}_node", *_flags(self.settings)], cwd=ROOT,
                                     env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} node exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if http_get(self.url + "/health", timeout=2)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.role} node not healthy after {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def stats(self) -> dict:
        status, body = http_get(self.url + "/server_info", timeout=30)
        assert status == 200, body
        return json.loads(body)["stats"]

    def kill(self) -> None:
        """SIGKILL the whole node (front end and schedulers): a dead peer."""
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


FREE_KEYS = ("kv_free_tokens", "req_slots_free", "metadata_slots_free")


def free_counts(node: RoleNode) -> dict:
    s = node.stats()
    out = {k: s[k] for k in FREE_KEYS}
    out["evictable"] = s.get("kv_evictable_tokens", 0)
    out["queues"] = {k: v for k, v in s["num_queue_reqs"].items() if v}
    return out


def wait_restored(node: RoleNode, start: dict, timeout: float = 30.0) -> dict:
    """Wait until the node's free KV (counting radix-cached pages as free), request slots and metadata
    slots are back at `start` and its queues are empty; returns the last counts."""
    deadline = time.time() + timeout
    while True:
        now = free_counts(node)
        ok = (now["kv_free_tokens"] + now["evictable"] == start["kv_free_tokens"] + start["evictable"]
              and now["req_slots_free"] == start["req_slots_free"]
              and now["metadata_slots_free"] == start["metadata_slots_free"] and not now["queues"])
        if ok or time.time() > deadline:
            return now
        time.sleep(0.2)


def assert_restored(*pairs) -> None:
    for node, start in pairs:
        now = wait_restored(node, start)
        assert now["kv_free_tokens"] + now["evictable"] == start["kv_free_tokens"] + start["evictable"], \
            (node.role, now, start)
        assert now["req_slots_free"] == start["req_slots_free"], (node.role, now, start)
        assert now["metadata_slots_free"] == start["metadata_slots_free"], (node.role, now, start)
        assert not now["queues"], (node.role, now)


_rooms = itertools.count(random.Random().randrange(1 << 40))


class PDPair:
    """A prefill and a decode node, and the dual dispatch a PD router does."""

    def __init__(self, prefill: RoleNode, decode: RoleNode):
        self.prefill = prefill
        self.decode = decode
        self.bootstrap_port = prefill.settings["disaggregation_bootstrap_port"]

    def body(self, body: dict, room: int | None = None) -> dict:
        return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port,
                "bootstrap_room": next(_rooms) if room is None else room}

    def generate(self, body: dict, timeout: float = 120.0) -> tuple[tuple[int, dict], tuple[int, dict]]:
        """(prefill status, json), (decode status, json) of one request sent to both at once."""
        full = self.body(body)
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            fp = ex.submit(http_post, self.prefill.url + "/generate", full, None, timeout)
            fd = ex.submit(http_post, self.decode.url + "/generate", full, None, timeout)
            (ps, pb), (ds, db) = fp.result(), fd.result()
        return (ps, json.loads(pb)), (ds, json.loads(db))

    def start_counts(self) -> tuple[dict, dict]:
        return wait_restored(self.prefill, free_counts(self.prefill)), wait_restored(self.decode, free_counts(self.decode))


def greedy(n: int = 8) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def make_prompts(tok, n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(tok)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]




def start_pair(model: str, backend: str, prefill_tp: int = 1, decode_tp: int = 1, env: dict | None = None,
               prefill_settings: dict | None = None, decode_settings: dict | None = None) -> PDPair:
    env = {**FAST_ENV, **(env or {})}
    bport = free_port()
    prefill = RoleNode("prefill", model, env=env, tp=prefill_tp, transfer_backend=backend,
                       disaggregation_bootstrap_port=bport, disaggregation_decode_tp=decode_tp,
                       **{**BASE, **(prefill_settings or {})})
    decode = RoleNode("decode", model, env=env, tp=decode_tp, transfer_backend=backend,
                      **{**BASE, **(decode_settings or {})})
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        fs = [ex.submit(prefill.start), ex.submit(decode.start)]
        errors = [f.exception() for f in fs]
    if any(errors):
        prefill.stop()
        decode.stop()
        raise next(e for e in errors if e)
    return PDPair(prefill, decode)


def colocated_tokens(node: NodeProcess, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    def one(p):
        status, body = http_post(node.url + "/generate", {"input_ids": p, "sampling_params": greedy(n)})
        assert status == 200, body
        return json.loads(body)["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        return list(ex.map(one, prompts))
