"""Disaggregation on one GPU: a prefill node and a decode node sharing the device (`--mem-fraction-static`
shares), their KV pages and hybrid state in VRAM moved by nixl (transfer/memory.py), give a colocated CUDA
node's greedy tokens exactly, in float32: a tiny random-weight Llama (with CUDA graphs on the decode and
without), and the Qwen3.5-style hybrid (linear-attention state in VRAM too). The models are built around the
default model's tokenizer, carried to the GPU machine by `make gpu-wheels` (`PDSERVE_GPU_TOKENIZER`, default
`.whl/tokenizer`); without it, or without nixl, the tests skip with the reason."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.gpu.conftest import write_result
from tests.harness.client import get_json
from tests.harness.nodes import Launcher
from tests.harness.pd import BASE, colocated_tokens, greedy, make_prompts

ROOT = Path(__file__).resolve().parents[2]
CUDA = {"device": "cuda", "dtype": "float32", "mem_fraction_static": 0.2}


def _tokenizer_dir() -> str:
    path = os.environ.get("PDSERVE_GPU_TOKENIZER", str(ROOT / ".whl" / "tokenizer"))
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        pytest.skip(f"no tokenizer at {path} (make gpu-wheels carries one; PDSERVE_GPU_TOKENIZER names "
                    "another)")
    return path


def _needs_nixl() -> None:
    try:
        import nixl._api  # noqa: F401
    except ImportError as e:
        pytest.skip(f"nixl is not importable here ({e}): make gpu-wheels carries it")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoTokenizer

    from common.models.tiny_model import TOKENIZER_FILES, build_tiny_model
    from tests.hybrid.hybrid_harness import make_qwen3_5

    tok_dir = _tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    llama = str(tmp_path_factory.mktemp("gpu-pd-llama"))
    build_tiny_model(llama, "llama", tok_dir, {"head_dim": 64})
    hybrid = str(tmp_path_factory.mktemp("gpu-pd-qwen3_5"))
    make_qwen3_5(hybrid, seed=1, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                 bos_token_id=tok.bos_token_id)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tok_dir, name)):
            shutil.copy(os.path.join(tok_dir, name), os.path.join(hybrid, name))
    return {"llama": llama, "qwen3_5": hybrid, "tok": tok}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("gpu-pd-procs"))
    yield launcher
    launcher.close()


@pytest.mark.parametrize("arch,graphs", [("llama", True), ("llama", False), ("qwen3_5", True)])
def test_pd_on_one_gpu_over_nixl_equals_a_colocated_cuda_node(models, launch, arch, graphs):
    _needs_nixl()
    settings = {**BASE, **CUDA, "disable_cuda_graph": not graphs}
    colocated = launch.colocated(models[arch], **settings)
    pair = launch.pair(models[arch], "nixl", settings=settings)
    try:
        prompts = make_prompts(models["tok"], 6, seed=5, lo=5, hi=90)  # across pages and prefill chunks
        want = colocated_tokens(colocated, prompts, n=16)
        got = []
        for p in prompts:
            (ps, pb), (ds, db) = pair.generate({"input_ids": p, "sampling_params": greedy(16)})
            assert ps == 200 and ds == 200, (pb, db)
            got.append(db["output_ids"])
        stats = get_json(pair.decode.url + "/server_info")["stats"]
        write_result(f"pd_{arch}_{'graphs' if graphs else 'eager'}",
                     {"identical": got == want, "prompts": len(prompts),
                      "decode_transfer_successes": stats.get("transfer_successes"),
                      "decode_transfer_failures": stats.get("transfer_failures")})
        assert got == want
    finally:
        pair.stop()
        colocated.stop()


def test_the_pair_swaps_roles_on_the_gpu_with_its_weights_loaded(models, launch):
    """A role switch on the GPU (common/scheduler/role_switch.py): the prefill node becomes the decode node
    and the decode node the prefill node, each rebuilding its request table and recapturing its CUDA graphs
    over the KV pool and weights it kept; the swapped pair gives the colocated node's greedy tokens again."""
    _needs_nixl()
    from tests.harness.client import free_port, http_json
    from tests.harness.nodes import PDPair

    settings = {**BASE, **CUDA, "disable_cuda_graph": False}
    colocated = launch.colocated(models["llama"], **settings)
    pair = launch.pair(models["llama"], "nixl", settings=settings,
                       decode_settings={"disaggregation_bootstrap_port": free_port()})
    try:
        prompts = make_prompts(models["tok"], 4, seed=9, lo=5, hi=90)
        want = colocated_tokens(colocated, prompts, n=16)
        pids = (pair.prefill.proc.pid, pair.decode.proc.pid)
        switched = {}
        for node, role in ((pair.prefill, "decode"), (pair.decode, "prefill")):
            status, out = http_json("POST", node.url + "/switch_role", {"role": role}, timeout=300)
            assert status == 200 and out["switched"], out
            switched[role] = out["seconds"]
        swapped = PDPair(pair.decode, pair.prefill)
        got = []
        for p in prompts:
            (ps, pb), (ds, db) = swapped.generate({"input_ids": p, "sampling_params": greedy(16)})
            assert ps == 200 and ds == 200, (pb, db)
            got.append(db["output_ids"])
        info = get_json(pair.prefill.url + "/server_info")
        write_result("pd_role_swap", {"identical": got == want, "prompts": len(prompts),
                                      "switch_seconds": switched,
                                      "decode_graphs": info.get("cuda_graph_batch_sizes")})
        assert got == want
        assert (pair.prefill.proc.pid, pair.decode.proc.pid) == pids  # the same processes: nothing reloaded
        assert info["disaggregation_mode"] == "decode"
    finally:
        pair.stop()
        colocated.stop()
