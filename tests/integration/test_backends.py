"""A real transfer backend end to end: a cluster (router + 2 prefill + 2 decode, tiny random model) on
nixl, the default backend (mooncake and ucx are checked token-identical in a PD pair each, in
tests/pd/test_pd_backends.py, which keeps this suite within its time budget), whose greedy answers
must be token-identical to one colocated node's (the KV pages really
moved), for /generate (plain and streamed, prompts across chunk boundaries, a shared prefix through the
prefill radix cache) and the OpenAI endpoints; pools back at their starting figures afterwards."""

from __future__ import annotations

import os

import pytest

from tests.harness.backends import backend_params
from tests.harness.client import http_json, stream
from tests.harness.cluster import CHUNK, NODE_SETTINGS, PAGE_SIZE, cluster_pools, wait_pools

BACKENDS = ["nixl"]
LENGTHS = [5, CHUNK + 8, 3 * CHUNK + PAGE_SIZE + 1, 300]


def prompts() -> list[list[int]]:
    out = [[200 + (31 * n + 7 * j) % 15000 for j in range(n)] for n in LENGTHS]
    shared = [500 + (13 * j) % 9000 for j in range(4 * PAGE_SIZE)]
    out += [shared + [42, 43, 44], shared + [7000 + j for j in range(CHUNK + 3)]]
    return out


def body(ids: list[int], stream_mode: bool = False) -> dict:
    return {"input_ids": ids, "stream": stream_mode,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, module_launcher):
    """Greedy answers of one colocated node with the same memory and chunk settings."""
    node = module_launcher.colocated(tiny_model_dir, page_size=PAGE_SIZE, chunked_prefill_size=CHUNK,
                                     max_total_tokens=NODE_SETTINGS["max_total_tokens"], num_threads=1)
    gen = []
    for ids in prompts():
        status, out = http_json("POST", node.url + "/generate", body(ids))
        assert status == 200, out
        gen.append(out["output_ids"])
    status, chat = http_json("POST", node.url + "/v1/chat/completions",
                             {"messages": CHAT, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
    assert status == 200, chat
    node.stop()  # the answers are all it was for
    return {"generate": gen, "chat": chat["choices"][0]["message"]["content"]}


@pytest.fixture(scope="module", params=backend_params(*BACKENDS))
def backend_cluster(request, tiny_model_dir, module_launcher):
    c = module_launcher.cluster(tiny_model_dir, backend=request.param,
                                role_env={r: {"PDSERVE_TRANSFER_PROTOCOL": "tcp"} for r in ("prefill", "decode")})
    c.baseline = cluster_pools(c)
    yield c
    c.stop()  # now, not at the end of the module: one backend's cluster at a time


def test_greedy_tokens_match_a_colocated_node(backend_cluster, reference):
    url = backend_cluster.url + "/generate"
    # twice over: round robin sends each prompt through both prefill and both decode nodes
    for _ in range(2):
        for ids, want in zip(prompts(), reference["generate"], strict=True):
            status, out = http_json("POST", url, body(ids))
            assert status == 200, out
            assert out["output_ids"] == want, (len(ids), out["output_ids"], want)
    wait_pools(backend_cluster, backend_cluster.baseline)


def test_streamed_and_openai_answers_match(backend_cluster, reference):
    url = backend_cluster.url
    for ids, want in list(zip(prompts(), reference["generate"], strict=True))[:3]:
        res = stream(url + "/generate", body(ids, stream_mode=True))
        assert res.ok, res.error
        assert res.events[-1]["output_ids"] == want  # cumulative in every event, as in SGLang
    status, chat = http_json("POST", url + "/v1/chat/completions",
                             {"messages": CHAT, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
    assert status == 200, chat
    assert chat["choices"][0]["message"]["content"] == reference["chat"]
    wait_pools(backend_cluster, backend_cluster.baseline)


def test_backend_transfers_really_ran(backend_cluster):
    """The nodes report the bytes their engine moved: nonzero on both sides for a real backend."""
    for c in backend_cluster.prefills + backend_cluster.decodes:
        status, info = http_json("GET", c.url + "/server_info")
        assert status == 200
        assert info["stats"].get("transfer_successes", 0) > 0, (c.name, info["stats"])
        assert info["stats"].get("transfer_bytes", 0) > 0, (c.name, info["stats"])
    assert os.path.isdir(backend_cluster.log_dir)
