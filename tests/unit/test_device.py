"""The device flags (`common/device.py`, ServerArgs): what auto resolves to on this CPU machine, the clear
errors for what needs a GPU, `--load-format dummy`, and the GPU engine's torch_native attention path
through the same device plumbing on the CPU: the scheduler's greedy tokens equal transformers', and the
hybrid and sliding-window models' logits equal theirs."""

from __future__ import annotations

import json

import pytest
import torch

from common.config import ConfigError, ServerArgs
from common.device import DeviceError, Placement, resolve_device, resolve_dtype
from common.forward_batch import ForwardBatch, ForwardMode
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)

NO_CUDA = not torch.cuda.is_available()


def test_auto_resolves_to_the_cpu_engine():
    p = Placement.resolve(ServerArgs())
    if NO_CUDA:
        assert (p.device.type, p.dtype, p.kv_dtype, p.attention_backend) \
            == ("cpu", torch.float32, torch.float32,
                "native")
        assert p.cuda_graph_max_bs == 0
        assert p.describe() == {"device": "cpu", "dtype": "float32", "kv_cache_dtype": "float32",
                                "attention_backend": "native", "disable_cuda_graph": True}
    p = Placement.resolve(ServerArgs(device="cpu", attention_backend="torch_native"))
    assert p.attention_backend == "torch_native" and p.device == torch.device("cpu")


@pytest.mark.parametrize("flags, named", [
    (dict(device="cpu", dtype="bfloat16"), "--dtype bfloat16 needs --device cuda"),
    (dict(device="cpu", dtype="half"), "--dtype half needs --device cuda"),
    (dict(device="cpu", kv_cache_dtype="float16"), "--kv-cache-dtype float16 needs --device cuda"),
    (dict(device="cpu", attention_backend="flashinfer"), "--attention-backend flashinfer runs on CUDA only"),
    (dict(device="cpu", mem_fraction_static=0.5), "--mem-fraction-static: applies to --device cuda"),
    (dict(mem_fraction_static=1.5), "--mem-fraction-static: must be in (0, 1]"),
    (dict(base_gpu_id=-1), "--base-gpu-id: must be >= 0"),
    (dict(gpu_id_step=0), "--gpu-id-step: must be >= 1"),
    (dict(cuda_graph_max_bs=0), "--cuda-graph-max-bs: must be >= 1"),
])
def test_flags_that_need_a_gpu_are_refused_on_cpu(flags, named):
    with pytest.raises(ConfigError) as e:
        ServerArgs(**flags).validate()
    assert named in str(e.value)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_says_so():
    with pytest.raises(ConfigError, match="--device cuda: torch .* sees no CUDA device"):
        ServerArgs(device="cuda").validate()
    with pytest.raises(DeviceError, match="sees no CUDA device"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


def test_dtype_names():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu, "bfloat16") == torch.float32  # the CPU computes in float32
    assert resolve_dtype("float", cpu) == torch.float32
    cuda = torch.device("cuda", 0)  # resolving names needs no GPU
    assert resolve_dtype("auto", cuda, "float16") == torch.float16
    assert resolve_dtype("auto", cuda, "float32") == torch.bfloat16
    assert resolve_dtype("auto", cuda, None) == torch.bfloat16
    assert resolve_dtype("float32", cuda) == torch.float32
    with pytest.raises(DeviceError, match="unknown dtype 'int4'"):
        resolve_dtype("int4", cuda)


def test_native_backend_only_on_cpu():
    from common.layers.attention_backend import create_attention_backend

    with pytest.raises(ValueError, match="native runs the CPU kernels"):
        create_attention_backend("native", 4, 2, 16, device="cuda")
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        create_attention_backend("xformers", 4, 2, 16)
    b = create_attention_backend("torch_native", 4, 2, 16, window=8, window_layers=[1])
    assert (b.name, b.native, b.layer_window(1), b.layer_window(0)) == ("torch_native", None, 8, None)


def test_forward_batch_stays_put_on_cpu(tmp_path):
    from common.memory.kv_pool import KVPool

    pool = KVPool(4, 4, 1, 1, 8)
    ids = torch.tensor([5, 6], dtype=torch.int64)
    fb = ForwardBatch(ForwardMode.DECODE, ids, ids.clone(), ids.clone(), torch.tensor([0, 1]), [3, 3], [2, 2],
                      [1, 1], pool, torch.zeros(2, 8, dtype=torch.int64))
    fb.to_device(torch.device("cpu"))
    assert fb.input_ids is ids  # no copy on the CPU


def test_dummy_load_format_needs_only_config_json(tmp_path, make_tiny_model):
    """Random weights of the checkpoint's shape, seeded (the same model twice), nothing but config.json
    read."""
    from common.models.loader import load_model

    src = make_tiny_model("llama")
    (tmp_path / "config.json").write_text(open(f"{src}/config.json").read())
    a, cfg = load_model(str(tmp_path), load_format="dummy")
    b, _ = load_model(str(tmp_path), load_format="dummy")
    assert not list(tmp_path.glob("*.safetensors"))
    wa, wb = dict(a.named_parameters()), dict(b.named_parameters())
    assert torch.equal(wa["model.embed_tokens.weight"], wb["model.embed_tokens.weight"])
    assert bool((wa["model.norm.weight"] == 1).all())
    std = json.loads((tmp_path / "config.json").read_text()).get("initializer_range", 0.02)
    assert abs(wa["model.embed_tokens.weight"].std().item() - std) < 0.2 * std
    with pytest.raises(Exception, match="safetensors"):
        load_model(str(tmp_path))  # auto still wants the weights


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_torch_native_greedy_matches_hf_through_the_scheduler(make_tiny_model, arch):
    from tests.unit.test_engine_correctness import greedy_against_hf

    def uses_torch_native(eng) -> None:
        backend = eng.sched.runner.attn_backend
        assert backend.name == "torch_native" and backend.native is None and backend.native_prefill is None
        from common.models.decoder_stack import DecoderStack

        assert DecoderStack.for_model(eng.sched.runner.model) is None  # the whole-stack C kernel stays out

    greedy_against_hf(make_tiny_model(arch), [6, 45], seed=60, check=uses_torch_native,
                      attention_backend="torch_native", device="cpu")


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
@pytest.mark.parametrize("maker", ["make_qwen3_5", "make_mistral_swa"])
def test_hybrid_and_window_models_match_hf(tmp_path, maker, backend):
    """Chunked extend then decode steps, teacher-forced, on the hybrid (state slots) and sliding-window
    models with the GPU engine's backends (triton's kernels in the interpreter here)."""
    from tests.hybrid import hybrid_harness as hh

    kw = {"window": 12} if maker == "make_mistral_swa" else {}
    hf = getattr(hh, maker)(str(tmp_path), initializer_range=0.08, **kw)
    model, cfg = hh.load_ours(str(tmp_path), attention_backend=backend)
    assert model.attn_backend.name == backend
    ids = hh.random_prompt(40, 3)
    ref = hh.hf_logits(hf, ids)
    h = hh.HybridHarness(model, cfg)
    row = h.new_req()
    out = [model.forward(h.extend_batch([(row, ids[a:a + 16])], all_logits=True)) for a in (0, 16)]
    for p in range(32, 40):
        out.append(model.forward(h.decode_batch([(row, ids[p])])))
    err = (torch.cat(out) - ref).abs().max().item()
    assert err < 1e-4, err
    h.free_req(row)


def test_triton_greedy_matches_hf_through_the_scheduler(make_tiny_model):
    """The triton backend in the whole engine (its kernels in the interpreter on CPU tensors): prefill in
    chunks over a cached prefix, batched decode steps, greedy tokens equal to transformers'."""
    from common.layers.triton_kernels import interpreted
    from tests.unit.test_engine_correctness import greedy_against_hf

    if not interpreted() and NO_CUDA:
        pytest.fail("triton kernels on CPU tensors need TRITON_INTERPRET=1 (tests/conftest.py sets it)")

    def uses_triton(eng) -> None:
        assert eng.sched.runner.attn_backend.name == "triton"

    greedy_against_hf(make_tiny_model("qwen2", num_hidden_layers=2), [5, 40], seed=61, check=uses_triton,
                      attention_backend="triton", device="cpu")


def test_placement_on_a_gpu_machine(monkeypatch):
    """What the flags resolve to where torch sees GPUs (faked here: resolving touches no device)."""
    import common.device as dev

    monkeypatch.setattr(dev, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    p = Placement.resolve(ServerArgs(base_gpu_id=1, gpu_id_step=2), rank=1)
    assert (p.device, p.dtype, p.kv_dtype, p.attention_backend, p.cuda_graph_max_bs) == (
        torch.device("cuda", 3), torch.bfloat16, torch.bfloat16, "triton", 256)
    p = Placement.resolve(ServerArgs(attention_backend="torch_native", kv_cache_dtype="float32"))
    assert (p.attention_backend, p.cuda_graph_max_bs, p.kv_dtype) == ("torch_native", 0, torch.float32)
    assert Placement.resolve(ServerArgs(disable_cuda_graph=True)).cuda_graph_max_bs == 0
    with pytest.raises(DeviceError, match="rank 2 would run on GPU 4, and this machine has 4"):
        Placement.resolve(ServerArgs(base_gpu_id=2, gpu_id_step=1), rank=2)
    with pytest.raises(DeviceError, match="native runs the CPU kernels"):
        Placement.resolve(ServerArgs(attention_backend="native"))
    with pytest.raises(ConfigError, match="--quantization: w8a8_int8 runs on the CPU's int8 kernels"):
        ServerArgs(quantization="w8a8_int8").validate()
    for mode in ("prefill", "decode"):  # a PD node's KV is registered as device memory (transfer/memory.py)
        ServerArgs(disaggregation_mode=mode, transfer_backend="nixl").validate()
    with pytest.raises(ConfigError, match="--pp-size: runs on the CPU engine only"):
        ServerArgs(pp_size=2).validate()
