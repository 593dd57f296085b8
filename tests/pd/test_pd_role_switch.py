"""A node's role switch under load (router/role_switch.py, common/scheduler/role_switch.py): a 2 + 2 cluster
of the tiny model over mooncake serves a steady stream of requests, streamed and not, while the
router moves a decode node to the prefill pool and then a prefill node to the decode pool. Every request
gets one answer, with the greedy tokens a colocated node gives; every node, switched or not, ends with
all its KV pages, request rows and metadata slots free; the switched nodes serve their new role with
the weights they had (no reload: the same processes), and a node asked to take a
role its flags do not fit refuses with the flag named."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest

from tests.harness.client import http_json, stream
from tests.harness.pd import colocated_tokens, greedy, make_prompts

pytestmark = pytest.mark.timeout(600)


def node_stats(url: str) -> dict:
    status, info = http_json("GET", url + "/server_info", timeout=10)
    assert status == 200, info
    return info


def assert_all_free(url: str, timeout: float = 30.0) -> None:
    """Every KV page (radix-cached ones count as free), request row and metadata slot is free."""
    deadline = time.time() + timeout
    while True:
        s = node_stats(url)["stats"]
        free = {"kv": s["kv_free_tokens"] + s.get("kv_evictable_tokens", 0) == s["kv_total_tokens"],
                "rows": s["req_rows_free"] == s["req_rows_total"],
                "metadata": s["metadata_slots_free"] == s["metadata_slots_total"],
                "queues": not any(s["num_queue_reqs"].values())}
        if all(free.values()):
            return
        if time.time() > deadline:
            raise AssertionError(f"{url} did not free everything: {free} {s}")
        time.sleep(0.2)


class Load:
    """Requests sent through the router from 4 threads until stopped; each one's answer kept by its index."""

    def __init__(self, url: str, prompts: list[list[int]], n: int):
        self.url, self.prompts, self.n = url, prompts, n
        self.answers: dict[int, list] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(4)
        self.futures = [self.pool.submit(self._run, k) for k in range(4)]

    def _one(self, i: int) -> tuple[int, list[int] | str]:
        body = {"input_ids": self.prompts[i % len(self.prompts)], "sampling_params": greedy(self.n)}
        if i % 2:
            res = stream(self.url + "/generate", {**body, "stream": True}, timeout=120)
            if not res.ok:
                return res.status, res.error
            return 200, res.events[-1]["output_ids"]
        status, out = http_json("POST", self.url + "/generate", body, timeout=120)
        return status, out["output_ids"] if status == 200 else json.dumps(out)

    def _run(self, k: int) -> None:
        i = k
        while not self.stop.is_set():
            answer = self._one(i)
            with self.lock:
                self.answers.setdefault(i, []).append(answer)
            i += 4

    def finish(self) -> dict[int, list]:
        self.stop.set()
        for f in self.futures:
            f.result()
        self.pool.shutdown()
        return self.answers


@pytest.mark.backend("mooncake")
def test_role_switch_under_load_loses_nothing(launcher, pd_model_dir, pd_tok, colocated):
    cluster = launcher.cluster(pd_model_dir, backend="mooncake", prefill=2, decode=2, switchable=True)
    prompts = make_prompts(pd_tok, 12, seed=7, lo=20, hi=90)
    want = colocated_tokens(colocated, prompts, 12)
    router = cluster.url
    pids = {n.url: n.proc.pid for n in cluster.nodes}

    load = Load(router, prompts, 12)
    time.sleep(2.0)
    moved = []
    for node, role in ((cluster.decodes[1], "prefill"), (cluster.prefills[0], "decode")):
        status, out = http_json("POST", f"{router}/workers/{node.url}/role", {"role": role}, timeout=300)
        assert status == 200, out
        assert out["to"] == role and out["worker"] == node.url, out
        moved.append((node.url, role))
        time.sleep(1.5)  # traffic over the new layout
    answers = load.finish()

    assert len(answers) >= 16, "the load did not run"
    bad = [(i, got) for i, got in sorted(answers.items()) if got != [(200, want[i % len(prompts)])]]
    assert not bad, (len(bad), len(answers), [(i, g[0][1][:3] if g[0][0] == 200 else g) for i, g in bad])

    status, workers = http_json("GET", router + "/workers")
    kinds = {w["url"]: w["worker_type"] for w in workers["workers"]}
    for url, role in moved:
        assert kinds[url] == role, kinds
        info = node_stats(url)
        assert info["disaggregation_mode"] == role
        assert info["stats"]["disaggregation_mode"] == role
    assert sorted(kinds.values()) == ["decode", "decode", "prefill", "prefill"]
    for n in cluster.nodes:  # the same processes: nothing was restarted or reloaded
        assert n.proc.pid == pids[n.url] and n.alive()

    # the new layout serves on its own: every request through each new pool member
    for i, p in enumerate(prompts[:6]):
        status, out = http_json("POST", router + "/generate", {"input_ids": p, "sampling_params": greedy(12)},
                                timeout=120)
        assert status == 200 and out["output_ids"] == want[i], out
    for n in cluster.nodes:
        assert_all_free(n.url)


def test_a_switch_the_flags_do_not_fit_is_refused(launcher, pd_model_dir):
    """A decode node with --enable-mixed-chunk cannot be a prefill node: 409 naming the flag, and it goes on
    serving as a decode node."""
    cluster = launcher.cluster(pd_model_dir, backend="fake", prefill=1, decode=1, switchable=True,
                               role_settings={"decode": {"enable_mixed_chunk": True}})
    d = cluster.decodes[0]
    status, out = http_json("POST", d.url + "/switch_role", {"role": "prefill"})
    assert status == 409 and "enable-mixed-chunk" in out["error"]["message"], out
    status, out = http_json("POST", d.url + "/switch_role", {"role": "router"})
    assert status == 400 and "role" in out["error"]["message"], out
    status, out = http_json("POST", d.url + "/switch_role", {"role": "decode", "drain_timeout_s": 5})
    assert status == 200 and out["switched"] is False, out
    # the router keeps the last worker of a pool where it is
    status, out = http_json("POST", f"{cluster.url}/workers/{d.url}/role", {"role": "prefill"})
    assert status == 409 and "last available decode worker" in out["error"]["message"], out
    status, out = http_json("POST", cluster.url + "/generate",
                            {"input_ids": [5, 6, 7, 8], "sampling_params": greedy(4)}, timeout=60)
    assert status == 200, out
    assert node_stats(d.url)["disaggregation_mode"] == "decode"
