"""Node-side backpressure and input caps on one real colocated node (tiny random model, one running
request, --max-queued-requests 2, a 128k context so that huge prompts are tokenized, not refused on
length first):

* a burst past the queue limit gets 429s with Retry-After (streaming requests too, as an HTTP status),
  every accepted request completes, and afterwards the node accepts again; a batch is admitted whole
  or answered 429 whole, and one larger than the limit is a 400;
* the caps (top logprobs, stop strings, batch size, rid) are 400s naming the field;
* `/health` answers within a second while a multi-megabyte prompt is being tokenized.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
import time

import pytest

from tests.harness.client import get_json, http, stream, wait_until

LIMIT = 2
SLOW = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 0}  # ~0.5 s on an idle tiny model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def node(tiny_model_dir, module_launcher, tmp_path_factory):
    # the tiny model with a 128k context: rotary positions are computed at load, so only the config changes
    model = tmp_path_factory.mktemp("tiny-128k")
    shutil.copytree(tiny_model_dir, model, dirs_exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 131072
    (model / "config.json").write_text(json.dumps(config))
    return module_launcher.colocated(str(model), num_threads=1, max_running_requests=1,
                                     max_queued_requests=LIMIT, max_total_tokens=4096)


def load(node) -> dict:
    return get_json(node.url + "/get_load")[0]


def post(node, path: str, body, timeout: float = 120.0) -> tuple[int, dict, dict]:
    status, headers, raw = http("POST", node.url + path, body, timeout=timeout)
    try:
        return status, headers, json.loads(raw)
    except ValueError:
        return status, headers, {"raw": raw.decode(errors="replace")}


def assert_error(status: int, body: dict, want: int, *words: str) -> str:
    assert status == want, (status, body)
    err = body["error"]
    codes = {429: ("rate_limit_exceeded",),
             400: ("invalid_value", "context_length_exceeded")}.get(want, (None,))
    assert err["code"] in codes and err["param"] is not None or want != 400, body
    assert err["type"] and err["message"], body
    for w in words:
        assert w in err["message"], (w, err["message"])
    return err["message"]


def test_burst_past_the_queue_gets_429_and_the_node_recovers(node):
    n = 8
    barrier = threading.Barrier(n)

    t0 = time.monotonic()

    def one(i: int):
        barrier.wait()
        body = {"text": f"burst {i}", "sampling_params": SLOW}
        if i % 2:  # streaming requests get the 429 as an HTTP status too, not an error event in a 200
            body["stream"] = True
            res = stream(node.url + "/generate", body, timeout=120)
            return res.status, {}, res, time.monotonic() - t0
        return (*post(node, "/generate", body), time.monotonic() - t0)

    with concurrent.futures.ThreadPoolExecutor(n) as ex:
        futs = [ex.submit(one, i) for i in range(n)]
        # while the burst runs, the load endpoint shows the limit and a queue within it
        now = load(node)
        assert now["max_queued_requests"] == LIMIT and 0 <= now["num_queued_reqs"] <= LIMIT, now
        results = [f.result() for f in futs]
    accepted = [r[:3] for r in results if r[0] == 200]
    refused = [r[:3] for r in results if r[0] == 429]
    assert len(accepted) + len(refused) == n, [r[0] for r in results]
    assert len(accepted) >= 2 and refused
    # one running + LIMIT queued at most, as long as no accepted request ended before the last refusal
    if max(r[3] for r in results if r[0] == 429) < min(r[3] for r in results if r[0] == 200):
        assert len(accepted) <= 1 + LIMIT, [r[0] for r in results]
    for _, _, body in accepted:
        if isinstance(body, dict):
            assert body["meta_info"]["completion_tokens"] == SLOW["max_new_tokens"], body["meta_info"]
        else:
            assert body.ok and body.events[-1]["meta_info"]["completion_tokens"] == SLOW["max_new_tokens"]
    for status, headers, body in refused:
        if isinstance(body, dict):
            assert headers.get("retry-after") == "1", headers
            assert_error(status, body, 429, "--max-queued-requests=2")
        else:  # a streaming request: the body is the JSON error, no SSE
            assert "--max-queued-requests=2" in body.error and not body.events, body
    # nothing left queued; the refusals are counted; the node takes requests again
    info = get_json(node.url + "/server_info")
    assert info["max_queued_requests"] == LIMIT and info["num_queued_reqs"] == 0, info
    assert info["num_queue_full_refused"] >= len(refused)
    status, _, body = post(node, "/generate", {"text": "after", "sampling_params": {"max_new_tokens": 4}})
    assert status == 200 and body["meta_info"]["completion_tokens"] == 4, body


def test_a_batch_is_admitted_whole_or_refused_whole(node):
    # larger than the queue can ever hold: 400 before anything is tokenized
    status, _, body = post(node, "/generate", {"text": ["x"] * (LIMIT + 1)})
    assert_error(status, body, 400, "`text`", "--max-queued-requests")
    status, _, body = post(node, "/v1/completions", {"prompt": [[1, 2]] * (LIMIT + 1)})
    assert_error(status, body, 400, "`prompt`", str(LIMIT + 1))
    # one request runs, one waits: a batch of 2 does not fit the queue and is refused as a whole
    long = dict(SLOW, max_new_tokens=3000)
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        running = ex.submit(post, node, "/generate", {"text": "busy", "rid": "busy", "sampling_params": long})
        wait_until(lambda: load(node)["num_reqs"] == 1
                   and load(node)["num_queued_reqs"] == 0, what="one running")
        waiting = ex.submit(post, node, "/generate", {"text": "wait", "rid": "wait", "sampling_params": long})
        wait_until(lambda: load(node)["num_queued_reqs"] == 1, what="one queued")
        status, headers, body = post(node, "/generate",
                                     {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}})
        assert_error(status, body, 429, "a batch of 2 requests")
        assert headers.get("retry-after") == "1"
        for rid in ("wait", "busy"):
            assert post(node, "/abort_request", {"rid": rid})[2]["success"]
        for f in (running, waiting):
            assert f.result()[2]["meta_info"]["finish_reason"]["type"] == "abort"
    wait_until(lambda: load(node)["num_reqs"] == 0, what="an idle node")
    status, _, body = post(node, "/generate", {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and [o["meta_info"]["completion_tokens"] for o in body] == [2, 2], body


CAPS = [
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 21}, "`top_logprobs_num`"),
    ("/generate", {"text": ["a", "b"], "return_logprob": True, "top_logprobs_num": [1, 50]},
     "`top_logprobs_num[1]`"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 21}, "`top_logprobs`"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "`logprobs`"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": [f"s{i}" for i in range(17)]}},
     "`sampling_params.stop`"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": ["ok", "x" * 257]}},
     "`sampling_params.stop[1]`"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": "y" * 257}}, "`sampling_params.stop`"),
    ("/generate", {"text": "hi", "sampling_params": {"stop_token_ids": list(range(257))}},
     "`sampling_params.stop_token_ids`"),
    ("/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "`stop`"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "stop": ["z" * 300]}, "`stop[0]`"),
    ("/generate", {"text": "hi", "rid": "r" * 257}, "$.rid"),
    ("/generate", {"text": "hi", "rid": "a\u2028b"}, "`rid`"),
    ("/generate", {"text": "hi", "rid": "a\x85b"}, "$.rid"),
    ("/v1/completions", {"prompt": ["a", "b"], "rid": ["ok", "bad\nline"]}, "$.rid[1]"),
]


@pytest.mark.parametrize("path,body,field", CAPS, ids=[f"{p}:{f}" for p, _, f in CAPS])
def test_caps_are_400s_naming_the_field(node, path, body, field):
    status, _, out = post(node, path, body)
    assert_error(status, out, 400, field)


def test_prompt_logprobs_stay_within_the_cap(node):
    status, _, out = post(node, "/generate", {"text": "one two three four five", "return_logprob": True,
                                              "logprob_start_len": 0, "top_logprobs_num": 20,
                                              "sampling_params": {"max_new_tokens": 2}})
    assert status == 200, out
    rows = [r for r in out["meta_info"]["input_top_logprobs"] if r is not None]
    assert rows and all(len(r) == 20 for r in rows)
    assert all(len(r) == 20 for r in out["meta_info"]["output_top_logprobs"])


def test_health_answers_while_a_huge_prompt_is_tokenized(node):
    text = "lorem ipsum dolor sit amet " * 75_000  # 2 MB: ~2 s of tokenization on an idle core
    result: dict = {}

    def huge():
        t0 = time.monotonic()
        result["answer"] = post(node, "/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})
        result["secs"] = time.monotonic() - t0

    worker = threading.Thread(target=huge)
    worker.start()
    time.sleep(0.3)  # the body is sent and being tokenized
    latencies = []
    while worker.is_alive():
        t0 = time.monotonic()
        status, _, _ = http("GET", node.url + "/health", timeout=10)
        latencies.append(time.monotonic() - t0)
        assert status == 200
        time.sleep(0.05)
    worker.join()
    status, _, body = result["answer"]
    # too long for the context once tokenized: a 400 naming the field, after the tokenizer ran
    assert_error(status, body, 400, "`text`", "context length")
    assert result["secs"] > 0.5 and len(latencies) >= 3, (result["secs"], latencies)
    assert max(latencies) < 1.0, latencies
