"""A prefill node and a decode node over each real transfer backend: token identity with a colocated node
(many prompts, several chunks, concurrent requests, seeded sampling, logprobs), the PD stats, aborts at
every stage, retraction on a decode node short of KV, a killed peer, and the real sglang-router in front.

Each backend runs with its own TP layout, so between them the three cover 1->1, 2->1 and 1->2:

    mooncake  prefill tp 1 -> decode tp 1, the decode node with two DP groups (--dp-size 2; the pair
              sends consecutive rooms, so consecutive requests alternate between them)
    nixl      prefill tp 2 -> decode tp 1, a decode KV pool of 256 tokens with almost no decode
              headroom (concurrent requests must retract)
    ucx       prefill tp 1 -> decode tp 2

Every test runs on all three unless its `@on(...)` says otherwise, and why. One pair per backend is
shared by the module; after every test that does not kill a node both nodes are back at their starting
free pages, request slots and metadata slots."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import pytest

from tests.harness.backends import backend_params
from tests.harness.client import free_port, http_get, http_post, stream
from tests.harness.hooks import HOOKS, slow_forwards
from tests.harness.pd import (
    assert_restored,
    colocated_tokens,
    free_counts,
    greedy,
    make_prompts,
    wait_stage,
)

# the TP-1 decode nodes run overlap scheduling (--enable-overlap-schedule): their answers are
# compared with a colocated node's, which runs every step in sequence
SETUPS = {
    "mooncake": {"decode_settings": {"enable_overlap_schedule": True, "dp_size": 2}},
    # the decode's host KV store is off: its retracted requests re-prefill (tests/pd/test_pd_offload.py
    # has the store on)
    "nixl": {"prefill_tp": 2, "decode_settings": {"max_total_tokens": 256, "num_reserved_decode_tokens": 4,
                                                  "decode_offload_size": 0, "enable_overlap_schedule": True}},
    # the TP-2 decode node speculates (--speculative-algorithm NGRAM): greedy answers stay the colocated ones
    "ucx": {"decode_tp": 2,
            "decode_settings": {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5}},
}


def on(*backends: str):
    """Run the test on these backends only."""
    return pytest.mark.parametrize("backend", backend_params(*backends), indirect=True)


@pytest.fixture(scope="module", params=backend_params(*SETUPS))
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def control_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("node-hooks")


@pytest.fixture(scope="module")
def pair(backend, pd_model_dir, module_launcher, control_dir):
    # the test-only hooks let a test slow the nodes' forwards (tests/pd/node_hooks)
    env = {"PYTHONPATH": HOOKS, "PDSERVE_TEST_HOOKS_DIR": str(control_dir)}
    p = module_launcher.pair(pd_model_dir, backend, env=env, **SETUPS[backend])
    yield p
    p.stop()  # now, not at the end of the module: one backend's pair at a time


@pytest.fixture
def restored(pair):
    start = pair.start_counts()
    yield
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))


# ---------------------------------------------------------------------------------------------- answers
def test_greedy_matches_colocated(pair, colocated, pd_tok, restored):
    # 3..120 tokens: up to four 32-token chunks, partial last pages of every size (page size 4)
    prompts = make_prompts(pd_tok, 10, seed=1, lo=3, hi=120)
    want = colocated_tokens(colocated, prompts)
    for p, w in zip(prompts, want, strict=True):
        (ps, pb), (ds, db) = pair.generate({"input_ids": p, "sampling_params": greedy()})
        assert ps == 200 and ds == 200, (pb, db)
        assert pb["output_ids"] == w[:1]  # the prefill's answer: its first token
        assert db["output_ids"] == w, len(p)
        assert db["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    for node in pair.servers():  # a node with DP groups ran these requests on every group
        assert all(g["forward_ct"] > 0 for g in node.stats().get("dp", [])), node.role


@on("mooncake", "nixl")  # ucx's decode node speculates: it keeps the distribution, not a seed's exact draws
def test_seeded_sampling_matches_colocated(pair, colocated, pd_tok, restored):
    # the decode node continues the seeded generator past the draw the prefill node made
    prompt = make_prompts(pd_tok, 1, seed=3, lo=40, hi=41)[0]
    body = {"input_ids": prompt,
            "sampling_params": {"max_new_tokens": 12, "temperature": 1.5, "seed": 1234, "ignore_eos": True}}
    status, raw = http_post(colocated.url + "/generate", body)
    assert status == 200, raw
    want = json.loads(raw)["output_ids"]
    (ps, pb), (ds, db) = pair.generate(body)
    assert ps == 200 and ds == 200, (pb, db)
    assert db["output_ids"] == want


def test_logprobs_travel_with_the_first_token(pair, colocated, pd_tok, restored):
    prompt = make_prompts(pd_tok, 1, seed=7, lo=70, hi=71)[0]
    body = {"input_ids": prompt, "sampling_params": greedy(4), "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 3}
    status, raw = http_post(colocated.url + "/generate", body)
    assert status == 200, raw
    ref = json.loads(raw)["meta_info"]
    (ps, pb), (ds, db) = pair.generate(body)
    assert ps == 200 and ds == 200, (pb, db)
    pm, dm = pb["meta_info"], db["meta_info"]
    # prompt logprobs come from the prefill node (a router merges them), output ones from decode
    assert len(pm["input_token_logprobs"]) == len(prompt)
    for (a, ta, _), (b, tb, _) in zip(pm["input_token_logprobs"][1:],
                                      ref["input_token_logprobs"][1:], strict=True):
        assert ta == tb and a == pytest.approx(b, abs=1e-4)
    assert [t for _, t, _ in dm["output_token_logprobs"]] == [t for _, t, _ in ref["output_token_logprobs"]]
    for (a, _, _), (b, _, _) in zip(dm["output_token_logprobs"], ref["output_token_logprobs"], strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    assert [[t for _, t, _ in row] for row in dm["output_top_logprobs"]] == \
        [[t for _, t, _ in row] for row in ref["output_top_logprobs"]]


# the TP layouts that put a matcher on several ranks (compiling one costs ~5 s per process)
@on("nixl", "ucx")
def test_grammar_answers_match_colocated(pair, colocated, pd_tok, restored):
    # the prefill node samples the first token under the grammar; the decode node's matcher (on every TP
    # rank: 2 -> 1 and 1 -> 2 layouts) accepts it and goes on: the same valid answer as one engine
    prompt = make_prompts(pd_tok, 1, seed=5, lo=20, hi=21)[0]
    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}}}
    for sp in ({"json_schema": json.dumps(schema), "temperature": 0}, {"regex": "[xyz]{3}-[0-9]{2}",
                                                                       "temperature": 1.2, "seed": 9}):
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 24, **sp}}
        status, raw = http_post(colocated.url + "/generate", body)
        assert status == 200, raw
        want = json.loads(raw)
        (ps, pb), (ds, db) = pair.generate(body)
        assert ps == 200 and ds == 200, (pb, db)
        assert db["output_ids"] == want["output_ids"] and db["text"] == want["text"]
        assert db["meta_info"]["finish_reason"]["type"] == "stop"


# nixl's setup has a decode pool too small for 32 requests at once: its concurrent test is the
# retraction one below
@on("ucx")
def test_speculative_decode_node_matches_colocated(pair, colocated, pd_tok, restored):
    # repetitive prompts: the decode node's n-gram drafts are accepted, and the answers are a colocated
    # node's (which does not speculate), on both decode TP ranks
    prompts = [p * 6 for p in make_prompts(pd_tok, 4, seed=21, lo=3, hi=9)]
    sp = greedy(32)
    want = colocated_tokens(colocated, prompts, 32)
    before = json.loads(http_get(pair.decode.url + "/server_info")[1])["stats"]
    for p, w in zip(prompts, want, strict=True):
        (ps, pb), (ds, db) = pair.generate({"input_ids": p, "sampling_params": sp})
        assert ps == 200 and ds == 200, (pb, db)
        assert db["output_ids"] == w
    stats = json.loads(http_get(pair.decode.url + "/server_info")[1])["stats"]
    assert stats["speculative_algorithm"] == "NGRAM"
    assert stats["spec_accepted_tokens"] > before["spec_accepted_tokens"]
    status, text = http_get(pair.decode.url + "/metrics")
    assert status == 200 and b"sglang:spec_accept_length" in text


@on("mooncake", "ucx")
def test_32_concurrent_requests(pair, colocated, pd_tok, restored):
    prompts = make_prompts(pd_tok, 32, seed=2, lo=3, hi=90)
    want = colocated_tokens(colocated, prompts, n=6)
    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        got = list(ex.map(lambda p: pair.generate({"input_ids": p, "sampling_params": greedy(6)}), prompts))
    for (ps, pb), (ds, db) in got:
        assert ps == 200 and ds == 200, (pb, db)
    assert [db["output_ids"] for _, (_, db) in got] == want


# needs nixl's setup: a decode KV pool of 256 tokens with almost no decode headroom
@on("nixl")
def test_retracted_requests_finish_with_the_same_tokens(pair, colocated, pd_tok, restored):
    prompts = make_prompts(pd_tok, 6, seed=12, lo=20, hi=40)
    # 100 tokens each: two requests decoding at once outgrow the pool, however the six arrive
    want = colocated_tokens(colocated, prompts, n=100)
    before = pair.decode.stats()["num_retractions"]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        got = list(ex.map(lambda p: pair.generate({"input_ids": p, "sampling_params": greedy(100)}), prompts))
    for (ps, pb), (ds, db) in got:
        assert ps == 200 and ds == 200, (pb, db)
    after = pair.decode.stats()
    assert after["num_retractions"] > before
    assert after["num_retract_recomputed"] > 0 and after["num_retract_restored"] == 0  # the store is off here
    assert after["overlap_schedule"] and after["num_overlapped_steps"] > 0
    assert [db["output_ids"] for _, (_, db) in got] == want


# the HTTP front end refuses these before any transfer starts: one backend shows it
@on("mooncake")
def test_requests_without_bootstrap_fields_are_refused(pair):
    for node, role in ((pair.prefill, "prefill"), (pair.decode, "decode")):
        status, raw = http_post(node.url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": greedy()})
        assert status == 400, raw
        assert f"this is a {role} node" in json.loads(raw)["error"]["message"]


def test_server_info_and_metrics(pair):
    status, raw = http_get(pair.prefill.url + "/server_info")
    info = json.loads(raw)
    assert status == 200 and info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == pair.bootstrap_port
    assert set(info["stats"]["num_queue_reqs"]) == {"bootstrap", "waiting", "inflight"}
    dinfo = json.loads(http_get(pair.decode.url + "/server_info")[1])
    assert dinfo["disaggregation_mode"] == "decode"
    assert set(dinfo["stats"]["num_queue_reqs"]) == {"prealloc", "transfer", "waiting", "running"}
    for key in ("num_prealloc_tokens", "transfer_failures", "transfer_bytes", "transfer_latency_avg_s"):
        assert key in dinfo["stats"]
    assert dinfo["stats"]["transfer_bytes"] > 0 and info["stats"]["transfer_bytes"] > 0
    status, text = http_get(pair.decode.url + "/metrics")
    assert status == 200 and b'queue="prealloc"' in text and b"pdserve_queue_reqs{" in text
    status, load = http_get(pair.decode.url + "/get_load")
    assert status == 200 and json.loads(load)[0]["num_reqs"] == 0


# ---------------------------------------------------------------------------------------------- aborts
def _post_async(ex, url, body):
    return ex.submit(http_post, url + "/generate", body, None, 60)


def _abort(node, rid: str) -> None:
    status, raw = http_post(node.url + "/abort_request", {"rid": rid})
    assert status == 200 and json.loads(raw)["success"], raw


def test_abort_on_prefill_in_bootstrap_then_decode_fails_fast(pair, restored):
    body = pair.body({"input_ids": list(range(100, 140)), "sampling_params": greedy(), "rid": "ab-boot"})
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        fp = _post_async(ex, pair.prefill.url, body)
        wait_stage(pair.prefill, "bootstrap")
        _abort(pair.prefill, "ab-boot")
        status, raw = fp.result()
        assert status == 200 and json.loads(raw)["meta_info"]["finish_reason"]["type"] == "abort"
        # the decode leg arrives late: the prefill side tells it the room is gone
        status, raw = _post_async(ex, pair.decode.url, body).result()
    assert status == 500, raw
    assert "aborted by the prefill side" in json.loads(raw)["error"]["message"]


def test_abort_on_decode_in_prealloc(pair, restored):
    # a bootstrap server nobody runs: the receiver stays in prealloc (resolving)
    body = {"input_ids": [7, 8, 9, 10, 11], "sampling_params": greedy(), "rid": "ab-pre",
            "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(), "bootstrap_room": 424242}
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fd = _post_async(ex, pair.decode.url, body)
        wait_stage(pair.decode, "prealloc")
        _abort(pair.decode, "ab-pre")
        status, raw = fd.result()
    assert status == 200 and json.loads(raw)["meta_info"]["finish_reason"]["type"] == "abort"


def test_abort_on_decode_in_transfer_then_prefill_fails_fast(pair, restored):
    body = pair.body({"input_ids": list(range(200, 260)), "sampling_params": greedy(), "rid": "ab-xfer"})
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        fd = _post_async(ex, pair.decode.url, body)
        wait_stage(pair.decode, "transfer")  # TransferInfo sent; no prefill request yet
        _abort(pair.decode, "ab-xfer")
        status, raw = fd.result()
        assert status == 200 and json.loads(raw)["meta_info"]["finish_reason"]["type"] == "abort"
        status, raw = _post_async(ex, pair.prefill.url, body).result()
    assert status == 500, raw
    assert "aborted by the decode side" in json.loads(raw)["error"]["message"]


def test_abort_on_decode_while_running(pair, control_dir, restored):
    """The abort goes out at the decode's first streamed token. The nodes' forwards are slowed to 20 ms
    each meanwhile (the `slow_forward` hook), so the 200 tokens take at least 4 s: however fast the host
    decodes the tiny model, the request is still running when the abort lands."""
    body = pair.body({"input_ids": list(range(300, 330)), "rid": "ab-run",
                      "sampling_params": {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}})

    replies = []

    def abort_once(i, event):
        if i == 1:
            replies.append((event, http_post(pair.decode.url + "/abort_request", {"rid": "ab-run"})))

    with concurrent.futures.ThreadPoolExecutor(1) as ex, slow_forwards(control_dir, 0.02):
        fp = _post_async(ex, pair.prefill.url, body)
        res = stream(pair.decode.url + "/generate", {**body, "stream": True}, timeout=60, on_event=abort_once)
        ps, praw = fp.result()
    # the first event (a token, or an error if the request failed first) and the abort's answer
    (first, (status, raw)), = replies
    assert status == 200 and json.loads(raw) == {"success": True, "aborted": 1}, (raw, first, res.error, praw)
    assert ps == 200, praw
    assert res.status == 200 and res.events, res.error
    meta = res.events[-1]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 200, meta


# ---------------------------------------------------------------------------------------------- router
# what this shows is the nodes' compatibility with sglang-router, not a backend: one backend is enough
@on("mooncake")
def test_behind_sglang_router(pair, colocated, pd_tok, restored):
    pytest.importorskip("sglang_router")
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
           "--prefill", pair.prefill.url, str(pair.bootstrap_port), "--decode", pair.decode.url,
           "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        prompts = make_prompts(pd_tok, 4, seed=3, lo=5, hi=80)
        want = colocated_tokens(colocated, prompts)
        deadline = time.time() + 60
        got = None
        while time.time() < deadline:
            try:
                status, raw = http_post(url + "/generate",
                                        {"input_ids": prompts[0], "sampling_params": greedy()}, timeout=60)
            except OSError:
                status = 0
            if status == 200:
                got = json.loads(raw)["output_ids"]
                break
            time.sleep(0.5)
        assert got == want[0]
        for p, w in zip(prompts[1:], want[1:], strict=True):
            status, raw = http_post(url + "/generate", {"input_ids": p, "sampling_params": greedy()})
            assert status == 200, raw
            assert json.loads(raw)["output_ids"] == w
    finally:
        proc.terminate()
        proc.wait(10)


# ---------------------------------------------------------------------------------------------- dead peers
# These end their backend's pair, so they stay the last tests of the module (pytest keeps a module's
# order within one backend's tests). One side per backend: every kill costs a pair, and the heartbeat
# that notices a dead peer is the control plane's, the same for every backend.
def _wait_transfer_stage(pair, fd) -> None:
    deadline = time.time() + 120  # generous: a loaded machine resolves the prefill ranks slowly
    while time.time() < deadline and not free_counts(pair.decode)["queues"].get("transfer"):
        assert not fd.done(), fd.result()
        time.sleep(0.05)
    # only from the transfer stage on has the prefill node got this room's TransferInfo
    assert free_counts(pair.decode)["queues"].get("transfer"), "the decode node never reached transfer"


@on("nixl")
def test_killed_decode_node_frees_the_prefill_request(pair):
    start = free_counts(pair.prefill)
    body = pair.body({"input_ids": list(range(500, 560)), "sampling_params": greedy()})
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fd = ex.submit(http_post, pair.decode.url + "/generate", body, None, 60)
        _wait_transfer_stage(pair, fd)
        # the decode node waits for this room's KV, its TransferInfo is at the prefill node: kill it
        pair.decode.kill()
        assert fd.exception() is not None or fd.result()[0] != 200
    status, raw = http_post(pair.prefill.url + "/generate", body, timeout=60)
    assert status == 500, raw
    assert "KV transfer failed" in json.loads(raw)["error"]["message"]
    assert_restored((pair.prefill, start))


@on("ucx")
def test_killed_prefill_node_frees_the_decode_request(pair):
    start = free_counts(pair.decode)
    body = pair.body({"input_ids": list(range(600, 650)), "sampling_params": greedy()})
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        fd = ex.submit(http_post, pair.decode.url + "/generate", body, None, 60)
        _wait_transfer_stage(pair, fd)
        pair.prefill.kill()
        status, raw = fd.result()
    assert status == 500, raw
    msg = json.loads(raw)["error"]["message"]
    # the rank that noticed names the dead peer; the other rank reports the consensus
    assert "KV transfer failed" in msg and ("dead" in msg or "another TP rank" in msg), msg
    assert_restored((pair.decode, start))
