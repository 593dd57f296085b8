"""Conditional disaggregation on a real cluster (1 prefill + 1 decode, nixl backend, tiny model): the
router sends a request to the decode node alone (`--local-prefill-queue 1`) while the prefill node has a
prefill in flight, and the decode node (`--disaggregation-local-prefill`, `--enable-mixed-chunk` as
`pdserve cluster` starts it) prefills it itself in chunks its running requests decode in; a prompt over its --disaggregation-local-prefill-max-tokens (64 here) is refused and
sent again with both legs. Answers equal a colocated node's on every path; memory comes back."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.harness.client import http, http_json, metric_total, stream
from tests.harness.cluster import CHUNK, cluster_pools, node_stats, wait_pools

LOCAL = "pdserve_router_local_prefills_total"
REFUSED = "pdserve_router_local_prefill_refusals_total"
MAX_LOCAL = 64
pytestmark = pytest.mark.backend("nixl")  # a backend that moves the KV: the remote answers are checked too


def greedy(n: int, **kw) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **kw}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, module_launcher):
    c = module_launcher.cluster(tiny_model_dir, backend="nixl", prefill=1, decode=1, router_args=["--local-prefill-queue", "1"],
                                role_settings={"decode": {"disaggregation_local_prefill": True,
                                                          "disaggregation_local_prefill_max_tokens": MAX_LOCAL,
                                                          "enable_mixed_chunk": True}})
    c.baseline = cluster_pools(c)
    return c


@pytest.fixture(scope="module")
def reference(colocated):
    """The suite's colocated node (the cluster's settings): the answers every path must give."""
    return colocated


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(rng.randrange(CHUNK + 5, 3 * CHUNK))] for _ in range(n)]


def generate(url: str, ids: list[int], new: int, streamed: bool, **extra) -> tuple[list[int], dict]:
    body = {"input_ids": ids, "sampling_params": greedy(new), **extra}
    if streamed:
        res = stream(url + "/generate", {**body, "stream": True})
        assert res.ok, res.error
        return res.events[-1]["output_ids"], res.events[-1]["meta_info"]
    status, out = http_json("POST", url + "/generate", body)
    assert status == 200, out
    return out["output_ids"], out["meta_info"]


def test_the_router_prefills_on_the_decode_node_while_the_prefill_node_is_busy(cluster, reference):
    decode = cluster.decodes[0]
    before = [metric_total(cluster.url, LOCAL), metric_total(cluster.url, REFUSED),
              node_stats(decode.url)["num_local_prefills"]]
    for seed in range(6):  # concurrent requests: some find the prefill node busy (it is the first's at least)
        batch = prompts(8, seed)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda a: generate(cluster.url, a[1], 10, a[0] % 2 == 0)[0], enumerate(batch)))
        want = [generate(reference.url, ids, 10, False)[0] for ids in batch]
        assert got == want
        sent_local, refused, prefilled = (metric_total(cluster.url, LOCAL) - before[0],
                                          metric_total(cluster.url, REFUSED) - before[1],
                                          node_stats(decode.url)["num_local_prefills"] - before[2])
        if prefilled and refused:
            break
    assert prefilled > 0, "no request was prefilled on the decode node"
    assert refused > 0, f"no prompt over {MAX_LOCAL} tokens was sent to the decode node alone"
    assert sent_local < 8 * (seed + 1)  # the first of each burst at least went to the prefill node
    assert prefilled == sent_local - refused
    # /workers (and the live page, which reads it) show the decode worker's local prefills
    status, workers = http_json("GET", cluster.url + "/workers")
    assert status == 200, workers
    [row] = [w for w in workers["workers"] if w["url"] == decode.url]
    assert row["local_prefill"] is True
    assert (row["local_prefills"], row["local_prefills_refused"]) == (metric_total(cluster.url, LOCAL),
                                                                      metric_total(cluster.url, REFUSED))
    wait_pools(cluster, cluster.baseline)


def test_local_chunks_carry_the_running_requests(cluster, reference):
    """--enable-mixed-chunk: a local prompt's chunks, prefilled while a request decodes on the node, carry
    that request's tokens (`num_mixed_steps`); both answers are the colocated node's."""
    decode = cluster.decodes[0]
    running_ids, local_ids = (p[:MAX_LOCAL] for p in prompts(2, 7))
    before = node_stats(decode.url)["num_mixed_steps"]
    decoding = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream, decode.url + "/generate",
                              {"input_ids": running_ids, "sampling_params": greedy(300), "stream": True},
                              on_event=lambda i, _e: decoding.set())
        assert decoding.wait(60), "the running request never produced a token"
        local, _ = generate(decode.url, local_ids, 8, False)
        res = running.result()
    assert res.ok, res.error
    assert node_stats(decode.url)["num_mixed_steps"] >= before + len(local_ids) // CHUNK
    assert local == generate(reference.url, local_ids, 8, False)[0]
    assert res.events[-1]["output_ids"] == generate(reference.url, running_ids, 300, False)[0]
    wait_pools(cluster, cluster.baseline)


def test_a_decode_node_serves_a_request_without_a_rendezvous(cluster, reference):
    decode = cluster.decodes[0]
    ids = prompts(1, 99)[0][:MAX_LOCAL]  # within the node's limit: prefilled there
    logprobs = {"return_logprob": True, "logprob_start_len": 0}
    for streamed in (False, True):
        out, meta = generate(decode.url, ids, 8, streamed, **logprobs)
        want, ref_meta = generate(reference.url, ids, 8, False, **logprobs)
        assert out == want
        assert len(meta["input_token_logprobs"]) == len(ids)
        for (a, _, _), (b, _, _) in zip(meta["input_token_logprobs"][1:], ref_meta["input_token_logprobs"][1:],
                                        strict=True):
            assert a == pytest.approx(b, abs=1e-4)
    # half a rendezvous is still refused, naming the fields
    status, body = http_json("POST", decode.url + "/generate",
                             {"input_ids": ids, "bootstrap_room": 7, "sampling_params": greedy(2)})
    assert status == 400 and "bootstrap_host/bootstrap_port/bootstrap_room" in str(body)
    # a prompt longer than the node prefills itself: a 400 naming the flag and the cause a router acts on
    status, headers, body = http("POST", decode.url + "/generate",
                                 {"input_ids": list(range(10, 11 + MAX_LOCAL)), "sampling_params": greedy(2)})
    assert status == 400 and b"--disaggregation-local-prefill-max-tokens 64" in body
    assert headers.get("x-pd-error-type") == "local_prefill_refused"
    wait_pools(cluster, cluster.baseline)


def test_prompt_logprobs_through_the_router_on_either_path(cluster, reference):
    """With the decode node prefilling, the prompt's logprobs come from it alone (nothing to merge)."""
    body = {"return_logprob": True, "logprob_start_len": 0}
    before = metric_total(cluster.url, LOCAL)
    for seed in range(10, 14):
        ids_list = prompts(6, seed)
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda ids: generate(cluster.url, ids, 4, False, **body), ids_list))
        for ids, (out, meta) in zip(ids_list, got, strict=True):
            want, ref = generate(reference.url, ids, 4, False, **body)
            assert out == want
            assert [t for _, t, _ in meta["input_token_logprobs"]] == ids
            assert [v for v, _, _ in meta["input_token_logprobs"][1:]] == pytest.approx(
                [v for v, _, _ in ref["input_token_logprobs"][1:]], abs=1e-4)
        if metric_total(cluster.url, LOCAL) > before:
            break
    assert metric_total(cluster.url, LOCAL) > before, "no request was prefilled on the decode node"
    wait_pools(cluster, cluster.baseline)
