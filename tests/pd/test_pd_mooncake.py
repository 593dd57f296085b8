"""Prefill tp 1 -> decode tp 1 over mooncake: token identity with a colocated node (many prompts, several
chunks, 32 concurrent requests, logprobs), aborts at every stage, and the real sglang-router in front.
After every test both nodes are back at their starting free pages, request slots and metadata slots."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time

import pytest
from node_process import free_port, http_get, http_post
from pd_harness import (
    PDPair,
    assert_restored,
    colocated_tokens,
    free_counts,
    greedy,
    make_prompts,
    start_pair,
)


@pytest.fixture(scope="module")
def pair(pd_model_dir):
    p = start_pair(pd_model_dir, "mooncake")
    yield p
    p.prefill.stop()
    p.decode.stop()


@pytest.fixture
def restored(pair: PDPair):
    start = pair.start_counts()
    yield
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))


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
    for (a, ta, _), (b, tb, _) in zip(pm["input_token_logprobs"][1:], ref["input_token_logprobs"][1:], strict=True):
        assert ta == tb and a == pytest.approx(b, abs=1e-4)
    assert [t for _, t, _ in dm["output_token_logprobs"]] == [t for _, t, _ in ref["output_token_logprobs"]]
    for (a, _, _), (b, _, _) in zip(dm["output_token_logprobs"], ref["output_token_logprobs"], strict=True):
        assert a == pytest.approx(b, abs=1e-4)
    assert [[t for _, t, _ in row] for row in dm["output_top_logprobs"]] == \
        [[t for _, t, _ in row] for row in ref["output_top_logprobs"]]


def test_32_concurrent_requests(pair, colocated, pd_tok, restored):
    prompts = make_prompts(pd_tok, 32, seed=2, lo=3, hi=90)
    want = colocated_tokens(colocated, prompts, n=6)
    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        got = list(ex.map(lambda p: pair.generate({"input_ids": p, "sampling_params": greedy(6)}), prompts))
    for (ps, pb), (ds, db) in got:
        assert ps == 200 and ds == 200, (pb, db)
    assert [db["output_ids"] for _, (_, db) in got] == want


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
    assert status == 200 and b'pdserve_num_queue_reqs{queue="prealloc"}' in text
    status, load = http_get(pair.decode.url + "/get_load")
    assert status == 200 and json.loads(load)[0]["num_reqs"] == 0


# ---------------------------------------------------------------------------------------------- aborts
def _post_async(ex, url, body):
    return ex.submit(http_post, url + "/generate", body, None, 60)


def _wait_stage(node, stage: str, n: int = 1, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if free_counts(node)["queues"].get(stage, 0) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{node.role} never had {n} request(s) in {stage}: {free_counts(node)}")


def _abort(node, rid: str) -> None:
    status, raw = http_post(node.url + "/abort_request", {"rid": rid})
    assert status == 200 and json.loads(raw)["success"], raw


def test_abort_on_prefill_in_bootstrap_then_decode_fails_fast(pair, restored):
    body = pair.body({"input_ids": list(range(100, 140)), "sampling_params": greedy(), "rid": "ab-boot"})
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        fp = _post_async(ex, pair.prefill.url, body)
        _wait_stage(pair.prefill, "bootstrap")
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
        _wait_stage(pair.decode, "prealloc")
        _abort(pair.decode, "ab-pre")
        status, raw = fd.result()
    assert status == 200 and json.loads(raw)["meta_info"]["finish_reason"]["type"] == "abort"


def test_abort_on_decode_in_transfer_then_prefill_fails_fast(pair, restored):
    body = pair.body({"input_ids": list(range(200, 260)), "sampling_params": greedy(), "rid": "ab-xfer"})
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        fd = _post_async(ex, pair.decode.url, body)
        _wait_stage(pair.decode, "transfer")  # TransferInfo sent; no prefill request yet
        _abort(pair.decode, "ab-xfer")
        status, raw = fd.result()
        assert status == 200 and json.loads(raw)["meta_info"]["finish_reason"]["type"] == "abort"
        status, raw = _post_async(ex, pair.prefill.url, body).result()
    assert status == 500, raw
    assert "aborted by the decode side" in json.loads(raw)["error"]["message"]


def test_abort_on_decode_while_running(pair, restored):
    body = pair.body({"input_ids": list(range(300, 330)), "rid": "ab-run",
                      "sampling_params": {"max_new_tokens": 200, "temperature": 0.0, "ignore_eos": True}})
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        fp = _post_async(ex, pair.prefill.url, body)
        fd = _post_async(ex, pair.decode.url, body)
        _wait_stage(pair.decode, "running")
        _abort(pair.decode, "ab-run")
        (ps, _), (ds, draw) = fp.result(), fd.result()
    assert ps == 200
    meta = json.loads(draw)["meta_info"]
    assert ds == 200 and meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 200


# ---------------------------------------------------------------------------------------------- router
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
                status, raw = http_post(url + "/generate", {"input_ids": prompts[0], "sampling_params": greedy()},
                                        timeout=60)
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
