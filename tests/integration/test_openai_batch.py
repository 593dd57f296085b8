"""A batched `/v1/completions` (`prompt` is a list) answers every prompt, each choice with its index, in
order, streaming and not: through the router of a real cluster (tiny random model), which sends the
nodes one room and one rid per prompt, and straight to a colocated node (`pdserve serve`).

The fake transfer backend moves no KV, so its decode nodes' tokens mean nothing: through it the test
checks the shape of the answers (and that every node's pools come back). Greedy texts of a batch must
equal those of the same prompts sent one by one on a colocated node and on a cluster whose backend
moves the KV (mooncake over TCP), which also shows each prompt's KV reached its own decode item."""

from __future__ import annotations

import pytest

from tests.harness.client import http_json, stream
from tests.harness.cluster import wait_pools

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "1 2 3 4 5 6 7 8"]
IDS = [list(range(100, 140)), list(range(300, 310))]  # token-id prompts; the first spans two chunks
MAX_TOKENS = 6


def complete(url: str, prompt, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **kw}
    status, out = http_json("POST", url + "/v1/completions", body)
    assert status == 200, out
    return out


def check_batch(url: str, prompts: list, same_text: bool) -> None:
    """Every prompt answered with its index, in order, plain and streamed; with `same_text` the texts
    are those of the prompts sent one by one."""
    singles = [complete(url, p)["choices"][0]["text"] for p in prompts]

    out = complete(url, prompts)
    choices = out["choices"]
    assert [c["index"] for c in choices] == list(range(len(prompts)))
    assert all(c["finish_reason"] == "length" for c in choices)
    assert out["usage"]["completion_tokens"] == MAX_TOKENS * len(prompts)
    if same_text:
        assert [c["text"] for c in choices] == singles

    res = stream(url + "/v1/completions", {"prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0,
                                           "ignore_eos": True, "stream": True})
    assert res.ok, res.error
    texts, finishes = [""] * len(prompts), [[] for _ in prompts]
    for event in res.events:
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
            finishes[c["index"]].append(c["finish_reason"])
    assert all(f and f[-1] == "length" and not any(f[:-1]) for f in finishes), finishes
    if same_text:
        assert texts == singles


def test_batch_through_router(pools_restored):
    check_batch(pools_restored.url, PROMPTS, same_text=False)
    check_batch(pools_restored.url, IDS, same_text=False)


@pytest.mark.backend("mooncake")
def test_batch_through_router_moving_kv(mooncake_cluster):
    check_batch(mooncake_cluster.url, PROMPTS, same_text=True)
    check_batch(mooncake_cluster.url, IDS, same_text=True)
    wait_pools(mooncake_cluster, mooncake_cluster.baseline)


def test_batch_to_colocated_node(colocated):
    check_batch(colocated.url, PROMPTS, same_text=True)
    check_batch(colocated.url, IDS, same_text=True)
