"""The real transfer backends end to end: a cluster (router + 2 prefill + 2 decode, tiny random model)
per backend, whose greedy answers must be token-identical to one colocated node's (the KV pages really
moved), for /generate (plain and streamed, prompts across chunk boundaries, a shared prefix through the
prefill radix cache) and the OpenAI endpoints; pools back at their starting figures afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the node_process helper
from cluster_utils import (  # noqa: E402
    CHUNK,
    NODE_ARGS,
    PAGE_SIZE,
    cluster_pools,
    http_json,
    make_cluster,
    stream,
    wait_pools,
)
from node_process import NodeProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = ["mooncake", "nixl", "ucx"]
LENGTHS = [5, CHUNK + 8, 3 * CHUNK + PAGE_SIZE + 1, 300]


def backend_problem(name: str) -> str:
    """Empty when the backend's engine can be built here; else why not (the library is missing)."""
    code = ("from transfer.backends import create_engine\nfrom transfer.engine import BackendUnavailable\n"
            f"try:\n    create_engine({name!r})\nexcept BackendUnavailable as e:\n    print('UNAVAILABLE', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if "UNAVAILABLE" in out.stdout:
        return out.stdout.strip()
    return ""


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
def reference(tiny_model_dir):
    """Greedy answers of one colocated node with the same memory and chunk settings."""
    node = NodeProcess(tiny_model_dir, page_size=PAGE_SIZE, chunked_prefill_size=CHUNK,
                       max_total_tokens=int(NODE_ARGS[NODE_ARGS.index("--max-total-tokens") + 1]), num_threads=1)
    node.start()
    try:
        gen = []
        for ids in prompts():
            status, out = http_json("POST", node.url + "/generate", body(ids))
            assert status == 200, out
            gen.append(out["output_ids"])
        status, chat = http_json("POST", node.url + "/v1/chat/completions",
                                 {"messages": CHAT, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
        assert status == 200, chat
    finally:
        node.stop()
    return {"generate": gen, "chat": chat["choices"][0]["message"]["content"]}


@pytest.fixture(scope="module", params=BACKENDS)
def backend_cluster(request, tiny_model_dir, tmp_path_factory):
    problem = backend_problem(request.param)
    if problem:
        pytest.skip(f"{request.param}: {problem}")
    c = make_cluster(tiny_model_dir, tmp_path_factory.mktemp(f"cluster-{request.param}"), backend=request.param,
                     role_env={r: {"PDSERVE_TRANSFER_PROTOCOL": "tcp"} for r in ("prefill", "decode")})
    c.start()
    c.baseline = cluster_pools(c)
    yield c
    c.stop()


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
