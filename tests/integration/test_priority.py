"""Priority scheduling on real processes (tiny random model, 127.0.0.1):

* one colocated node with `--schedule-policy priority --enable-priority-preemption` and a small KV
  budget (512 tokens): a late high-priority request finishes first while two long low-priority ones
  run, one of them is preempted, and both still produce the tokens of an unloaded run; a full queue
  (`--max-queued-requests 2`) turns away its lowest priority (429 with Retry-After) for a newcomer of
  higher priority, and the newcomer itself when it outranks nobody; bad `priority` values are 400s
  naming the field, through HTTP and the OpenAI SDK;
* a router in front of a prefill and a decode node (fake backend), both with the priority policy:
  `priority` travels to both legs (each node logs it; the fake backend moves no KV bytes, so tokens are
  not compared here), on /generate and the OpenAI chat API; the router refuses a bad value itself.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import re
import time

import pytest

from tests.harness.client import http, http_json, wait_until
from tests.harness.cluster import MODEL

pytestmark = pytest.mark.timeout(300)
openai = pytest.importorskip("openai")

# no chunked prefill: a chunk is admitted on the KV it needs itself, so a waiting prompt would start
PRIORITY_NODE = dict(schedule_policy="priority", enable_priority_preemption=True, page_size=4,
                     chunked_prefill_size=-1, max_total_tokens=512, max_running_requests=8,
                     max_queued_requests=2, num_threads=1, disable_radix_cache=True,
                     # the share of max_new_tokens reserved for running requests stays at 0.7 (no decay),
                     # so what fits next to two running requests does not depend on what ran before
                     init_new_token_ratio=0.7, min_new_token_ratio=0.7, served_model_name=MODEL)
LOW = 150  # decode steps of a low-priority request: ~1-2 s on the tiny model


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def body(prompt: list[int], max_new: int, **extra) -> dict:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                                     "ignore_eos": True}, **extra}


@pytest.fixture(scope="module")
def node(tiny_model_dir, module_launcher):
    return module_launcher.colocated(tiny_model_dir, **PRIORITY_NODE)


def generate(url: str, b: dict, timeout: float = 120.0) -> tuple[int, dict, dict, float]:
    status, headers, raw = http("POST", url + "/generate", b, timeout=timeout)
    return status, headers, json.loads(raw), time.monotonic()


def running(node) -> int:
    return node.stats()["num_running_reqs"]


def test_late_high_priority_request_preempts_and_finishes_first(node):
    lows = [ids(100, 1), ids(100, 2)]
    high = ids(100, 3)
    # unloaded answers, one request at a time
    ref = [generate(node.url, body(p, LOW))[2]["output_ids"] for p in lows]
    ref_high = generate(node.url, body(high, 60, priority=50))[2]["output_ids"]
    before = node.stats()["num_priority_preemptions"]

    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(generate, node.url, body(p, LOW, priority=0)) for p in lows]
        wait_until(lambda: running(node) == 2, what="both low-priority requests running")
        # 100 + 60 tokens do not fit next to the two running ones (100 + 150 each in 512 tokens)
        fut_high = ex.submit(generate, node.url, body(high, 60, priority=50))
        status_h, _, out_h, t_high = fut_high.result()
        results = [f.result() for f in futs]
    assert status_h == 200, out_h
    assert out_h["output_ids"] == ref_high
    for (status, _, out, t_low), want in zip(results, ref, strict=True):
        assert status == 200, out
        assert t_high < t_low, "the high-priority request finished after a low-priority one"
        assert out["output_ids"] == want  # the preempted one resumed with the same greedy tokens
    assert node.stats()["num_priority_preemptions"] > before
    assert re.search(r"preempted by rid=\S+ \(priority 50 over 0\)", node.log_text())


def test_full_queue_turns_away_the_lowest_priority(node):
    wait_until(lambda: running(node) == 0, what="an idle node")
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        # two long requests take the KV; the next two wait (same priority: no preemption) and fill the queue
        runs = [ex.submit(generate, node.url, body(ids(100, 10 + i), LOW)) for i in range(2)]
        wait_until(lambda: running(node) == 2, what="two running requests")
        waits = [ex.submit(generate, node.url, body(ids(100, 20 + i), LOW, priority=p))
                 for i, p in enumerate((3, 1))]
        wait_until(lambda: (lambda st: st["num_waiting_reqs"] == st["num_queued_reqs"] == 2
                            and st["num_running_reqs"] == 2)(node.stats()), what="a full queue")
        # the scheduler sends its admissions before any stats: the front end has read both, so its own guard
        # (requests sent but not admitted yet) leaves the newcomers below to the scheduler's priorities
        assert http_json("GET", node.url + "/server_info")[1]["num_pending_admission"] == 0
        # outranks nobody waiting (1 is the lowest): turned away itself
        status, headers, out, _ = generate(node.url, body(ids(8, 30), 4, priority=1))
        assert status == 429 and headers.get("retry-after"), out
        assert "queue is full" in out["error"]["message"]
        # outranks the lowest waiting one (priority 1, below the threshold of preemption): takes its place
        newcomer = ex.submit(generate, node.url, body(ids(8, 31), 4, priority=9))
        status, headers, out, _ = waits[1].result()
        assert status == 429 and headers.get("retry-after"), out
        assert "higher priority (9)" in out["error"]["message"] and "priority 1" in out["error"]["message"]
        assert newcomer.result()[0] == 200 and waits[0].result()[0] == 200
        assert all(f.result()[0] == 200 for f in runs)
    assert node.stats()["num_queue_full_displaced"] >= 1


@pytest.mark.parametrize("extra, words", [
    ({"priority": "high"}, ["priority"]),
    ({"priority": 2**40}, ["priority"]),
    ({"priority": 1.5}, ["priority"]),
    ({"priority": [1, 2]}, ["priority", "not a batch"]),
])
def test_bad_priority_is_a_400_naming_it(node, extra, words):
    status, out = http_json("POST", node.url + "/generate", body(ids(4, 40), 2, **extra))
    assert status == 400, out
    for w in words:
        assert w in out["error"]["message"], out


def test_priority_on_the_openai_apis(node, tiny_model_dir):
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0,
                                    extra_body={"priority": 4})
    assert out.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError, match="priority"):
        client.chat.completions.create(model=MODEL,
                                       messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"priority": "urgent"})
    # a batch carries one priority per prompt
    status, out = http_json("POST", node.url + "/generate", {"text": ["a", "b"], "priority": [1],
                                                              "sampling_params": {"max_new_tokens": 1}})
    assert status == 400 and "`priority` has 1 entries for a batch of 2" in out["error"]["message"], out


def test_pd_pair_with_priorities_through_the_router(tiny_model_dir, module_launcher):
    cluster = module_launcher.cluster(tiny_model_dir, backend="fake", prefill=1, decode=1,
                                      node_settings={"schedule_policy": "priority"})
    prompt = ids(40, 50)
    status, out = http_json("POST", cluster.url + "/generate", body(prompt, 12, priority=7, rid="prio-pd"))
    assert status == 200 and out["meta_info"]["completion_tokens"] == 12, out
    for node in cluster.nodes:  # both legs took the request with its priority
        assert re.search(r"rid=prio-pd received: .*priority=7", node.log_text()), node.name
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(model=MODEL,
                                          messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, extra_body={"priority": -3})
    assert chat.usage.completion_tokens == 4
    # a bad value is refused by the router itself, naming the field
    status, _, raw = http("POST", cluster.url + "/generate", body(prompt, 2, priority=2**35))
    assert status == 400 and b"priority" in raw
