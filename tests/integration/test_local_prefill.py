"""Conditional disaggregation on a real cluster (1 prefill + 1 decode, nixl backend, tiny model): the
router sends a request to the decode node alone (`--local-prefill-queue 1`) while the prefill node has a
prefill in flight, and the decode node (`--disaggregation-local-prefill`, `--enable-mixed-chunk` as
`pdserve cluster` starts it) prefills it itself in chunks its running requests decode in; a prompt over its
--disaggregation-local-prefill-max-tokens (64 here) is refused and
sent again with both legs. Answers equal a colocated node's on every path; memory comes back."""

from __future__ import annotations

import contextlib
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.harness.client import http, http_json, metric_total, stream, wait_until
from tests.harness.cluster import CHUNK, cluster_pools, node_stats, wait_pools
from tests.harness.hooks import HOOKS, decode_during

LOCAL = "pdserve_router_local_prefills_total"
REFUSED = "pdserve_router_local_prefill_refusals_total"
MAX_LOCAL = 64
pytestmark = pytest.mark.backend("nixl")  # a backend that moves the KV: the remote answers are checked too


def greedy(n: int, **kw) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True, **kw}


@pytest.fixture(scope="module")
def control_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("node-hooks")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, module_launcher, control_dir):
    c = module_launcher.cluster(tiny_model_dir, backend="nixl", prefill=1, decode=1,
                                router_args=["--local-prefill-queue", "1"],
                                env={"PYTHONPATH": HOOKS, "PDSERVE_TEST_HOOKS_DIR": str(control_dir)},
                                role_settings={"decode": {
                                    "disaggregation_local_prefill": True,
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


@contextlib.contextmanager
def prefill_node_busy(cluster, reference, control_dir):
    """A request through the router whose KV write the prefill node holds (`tests/pd/node_hooks`'
    `gate_armed`) for the body of the `with`, so the router counts a prefill in flight on it; then the
    write is let go and that request's answer checked."""
    for name in ("gate_entered", "gate_release"):
        (control_dir / name).unlink(missing_ok=True)
    (control_dir / "gate_armed").write_text("")
    ids = prompts(1, 1234)[0]
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(generate, cluster.url, ids, 6, False)
        try:
            wait_until((control_dir / "gate_entered").exists, 60,
                       "the prefill node to write the held request's KV")
            yield
        finally:
            (control_dir / "gate_release").write_text("")
        assert held.result()[0] == generate(reference.url, ids, 6, False)[0]


def generate(url: str, ids: list[int], new: int, streamed: bool, **extra) -> tuple[list[int], dict]:
    body = {"input_ids": ids, "sampling_params": greedy(new), **extra}
    if streamed:
        res = stream(url + "/generate", {**body, "stream": True})
        assert res.ok, res.error
        return res.events[-1]["output_ids"], res.events[-1]["meta_info"]
    status, out = http_json("POST", url + "/generate", body)
    assert status == 200, out
    return out["output_ids"], out["meta_info"]


def test_the_router_prefills_on_the_decode_node_while_the_prefill_node_is_busy(cluster,
                                                                               reference, control_dir):
    decode = cluster.decodes[0]

    def counts() -> tuple[int, int, int]:
        return (metric_total(cluster.url, LOCAL), metric_total(cluster.url, REFUSED),
                node_stats(decode.url)["num_local_prefills"])

    short = [p[:MAX_LOCAL] for p in prompts(2, 3)]
    long = list(range(10, 11 + MAX_LOCAL))  # over the decode node's limit
    start = counts()
    with prefill_node_busy(cluster, reference, control_dir):
        for k, ids in enumerate(short):  # the decode node prefills these itself, streamed or not
            assert generate(cluster.url, ids, 10, k == 1)[0] == generate(reference.url, ids, 10, False)[0]
        busy = counts()
        assert [b - a for a, b in zip(start, busy, strict=True)] == [2, 0, 2], (start, busy)
        # too long for it: refused, then sent with both legs (the held write was the gate's only one)
        assert generate(cluster.url, long, 10, False)[0] == generate(reference.url, long, 10, False)[0]
        refused = counts()
        assert [b - a for a, b in zip(busy, refused, strict=True)] == [1, 1, 0], (busy, refused)
    # the prefill node is idle again: a short prompt goes to it
    assert generate(cluster.url, short[0], 10, True)[0] == generate(reference.url, short[0], 10, False)[0]
    assert counts() == refused
    # /workers (and the live page, which reads it) show the decode worker's local prefills
    status, workers = http_json("GET", cluster.url + "/workers")
    assert status == 200, workers
    [row] = [w for w in workers["workers"] if w["url"] == decode.url]
    assert row["local_prefill"] is True
    assert (row["local_prefills"], row["local_prefills_refused"]) == (metric_total(cluster.url, LOCAL),
                                                                      metric_total(cluster.url, REFUSED))
    wait_pools(cluster, cluster.baseline)


def test_local_chunks_carry_the_running_requests(cluster, reference, control_dir):
    """--enable-mixed-chunk: a local prompt's chunks, prefilled while a request decodes on the node, carry
    that request's tokens (`num_mixed_steps`); both answers are the colocated node's. The running request
    is slowed down until the local answer is back (`decode_during`), whatever the host's speed."""
    decode = cluster.decodes[0]
    running_ids, local_ids = (p[:MAX_LOCAL] for p in prompts(2, 7))
    before = node_stats(decode.url)["num_mixed_steps"]
    (local, _), res = decode_during(decode.url, running_ids, 300, control_dir,
                                    lambda: generate(decode.url, local_ids, 8, False))
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
        for (a, _, _), (b, _, _) in zip(meta["input_token_logprobs"][1:],
                                        ref_meta["input_token_logprobs"][1:], strict=True):
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


def test_prompt_logprobs_through_the_router_on_either_path(cluster, reference, control_dir):
    """With the decode node prefilling, the prompt's logprobs come from it alone (nothing to merge);
    through both legs, the prefill leg's and the decode leg's are merged."""
    body = {"return_logprob": True, "logprob_start_len": 0}
    ids = prompts(1, 10)[0][:MAX_LOCAL]
    want, ref = generate(reference.url, ids, 4, False, **body)

    def check() -> None:
        out, meta = generate(cluster.url, ids, 4, False, **body)
        assert out == want
        assert [t for _, t, _ in meta["input_token_logprobs"]] == ids
        assert [v for v, _, _ in meta["input_token_logprobs"][1:]] == pytest.approx(
            [v for v, _, _ in ref["input_token_logprobs"][1:]], abs=1e-4)

    before = metric_total(cluster.url, LOCAL)
    check()  # both legs
    assert metric_total(cluster.url, LOCAL) == before
    with prefill_node_busy(cluster, reference, control_dir):
        check()  # the decode node alone
    assert metric_total(cluster.url, LOCAL) == before + 1
    wait_pools(cluster, cluster.baseline)
