"""Hybrid (Qwen3.5-style: Gated DeltaNet + gated full attention; dense and Qwen3.5-MoE) and sliding-window
models against Hugging Face transformers on the same tiny random weights, fp32: teacher-forced logits to
1e-4 in one extend, in chunks (the recurrent and conv state carry across chunks; windowed keys are gathered
from the cache), in decode steps and in mixed batches; greedy continuations token-identical to
`generate`. The pools are back at their start after every test."""

from __future__ import annotations

import pytest
import torch

from common.memory.state_pool import OutOfStateSlots, StatePool
from common.models.qwen3_5 import chunk_gated_delta_rule, recurrent_gated_delta_step
from tests.hybrid.hybrid_harness import (
    HybridHarness,
    hf_logits,
    load_ours,
    make_mistral_swa,
    make_qwen3_5,
    make_qwen3_5_moe,
    make_qwen3_swa,
    random_prompt,
)
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)

TOL = 1e-4


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen35"))
    hf = make_qwen3_5(path, initializer_range=0.08)
    model, cfg = load_ours(path)
    return hf, model, cfg


@pytest.fixture(scope="module")
def qwen35_moe(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen35_moe"))
    hf = make_qwen3_5_moe(path, initializer_range=0.08)
    model, cfg = load_ours(path)
    return hf, model, cfg


@pytest.fixture(scope="module")
def mistral_swa(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mistral_swa"))
    hf = make_mistral_swa(path, window=24, initializer_range=0.08)
    model, cfg = load_ours(path)
    return hf, model, cfg


@pytest.fixture(scope="module")
def qwen3_swa(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_swa"))
    hf = make_qwen3_swa(path, window=20, initializer_range=0.08)
    model, cfg = load_ours(path)
    return hf, model, cfg


ALL = ["qwen35", "qwen35_moe", "mistral_swa", "qwen3_swa"]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    err = (a - b).abs().max().item()
    assert err < TOL, f"max abs diff {err}"


# ------------------------------------------------------------------------------------------------
# the model layouts


def test_qwen35_layout(qwen35):
    _, model, cfg = qwen35
    assert cfg.kv_layer_ids == [2]
    spec = model.state_spec()
    assert spec.layer_ids == [0, 1, 3]
    assert spec.conv_shape == (2, 2 * 8 + 2 * 8, 3)  # key heads, [q | k | 2 value heads] channels, K-1
    assert spec.recurrent_shape == (4, 8, 8)


@pytest.mark.parametrize("moe,arch", [(False, "Qwen3_5ForConditionalGeneration"),
                                      (True, "Qwen3_5MoeForConditionalGeneration")], ids=["dense", "moe"])
def test_multimodal_checkpoint_served_text_only(tmp_path, moe, arch):
    from tests.hybrid.hybrid_harness import make_qwen3_5_multimodal

    hf = make_qwen3_5_multimodal(str(tmp_path), seed=2, moe=moe)
    model, cfg = load_ours(str(tmp_path))
    assert cfg.architecture == arch and cfg.kv_layer_ids == [2]
    ids = random_prompt(40, 8)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    h = HybridHarness(model, cfg)
    row = h.new_req()
    _close(model.forward(h.extend_batch([(row, ids)], all_logits=True)), ref)
    h.free_req(row)


def test_qwen35_moe_layout(qwen35_moe):
    """Qwen3.5's layers and state, every MLP a sparse block with a shared expert; the multimodal checkpoint's
    text model is the same."""
    from common.models.qwen3_5_moe import SharedExpertMoE

    _, model, cfg = qwen35_moe
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM" and model.is_hybrid
    assert cfg.kv_layer_ids == [2] and model.state_spec().layer_ids == [0, 1, 3]
    for layer in model.model.layers:
        assert isinstance(layer.mlp, SharedExpertMoE) and not layer.mlp.reduce
        assert tuple(layer.mlp.experts.w13.shape) == (4, 64, 64) and layer.mlp.rule.renormalize


def test_moe_stacked_experts_checkpoint(qwen35_moe, tmp_path):
    """The experts saved stacked (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`, as
    transformers holds them) load as the per-expert tensors transformers 5 writes."""
    import os
    import re

    from safetensors.torch import load_file, save_file

    hf = qwen35_moe[0]
    hf.save_pretrained(str(tmp_path))
    file = os.path.join(str(tmp_path), "model.safetensors")
    per_expert = load_file(file)
    stacked = {k: v for k, v in per_expert.items() if ".experts." not in k}
    blocks = sorted({m.group(1) for k in per_expert if (m := re.match(r"(.*\.experts)\.\d+\.", k))})
    assert len(blocks) == 4
    for b in blocks:
        def w(e, part, b=b):
            return per_expert[f"{b}.{e}.{part}.weight"]
        stacked[f"{b}.gate_up_proj"] = torch.stack([torch.cat([w(e, "gate_proj"), w(e, "up_proj")])
                                                    for e in range(4)])
        stacked[f"{b}.down_proj"] = torch.stack([w(e, "down_proj") for e in range(4)])
    save_file(stacked, file, metadata={"format": "pt"})
    model, cfg = load_ours(str(tmp_path))
    ids = random_prompt(30, 9)
    h = HybridHarness(model, cfg)
    row = h.new_req()
    _close(model.forward(h.extend_batch([(row, ids)], all_logits=True)), hf_logits(hf, ids))
    h.free_req(row)


def test_window_layers(mistral_swa, qwen3_swa):
    assert mistral_swa[1].window_layers == [0, 1] and mistral_swa[1].kv_window() == 24
    # Qwen3: layers from max_window_layers (1) on are windowed; layer 0 attends to everything
    assert qwen3_swa[1].window_layers == [1, 2] and qwen3_swa[1].kv_window() is None
    assert mistral_swa[2].context_length == 1024  # no longer capped to the window


def test_window_matters(mistral_swa):
    """The reference itself differs from full attention beyond the window (the test can fail)."""
    hf, _, _ = mistral_swa
    ids = random_prompt(60, 3)
    windowed = hf_logits(hf, ids)
    hf.config.sliding_window = None
    try:
        full = hf_logits(hf, ids)
    finally:
        hf.config.sliding_window = 24
    assert (windowed[:24] - full[:24]).abs().max() < TOL
    assert (windowed[30:] - full[30:]).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------
# teacher-forced logits


@pytest.mark.parametrize("name", ALL)
def test_one_extend(name, request):
    hf, model, cfg = request.getfixturevalue(name)
    ids = random_prompt(90, 1)
    h = HybridHarness(model, cfg)
    row = h.new_req()
    out = model.forward(h.extend_batch([(row, ids)], all_logits=True))
    _close(out, hf_logits(hf, ids))
    h.free_req(row)
    assert h.free_counts() == h.start


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("chunk", [1, 7, 32])
def test_chunked_extend(name, chunk, request):
    hf, model, cfg = request.getfixturevalue(name)
    ids = random_prompt(75, 2)
    ref = hf_logits(hf, ids)
    h = HybridHarness(model, cfg)
    row = h.new_req()
    outs = [model.forward(h.extend_batch([(row, ids[a:a + chunk])], all_logits=True))
            for a in range(0, len(ids), chunk)]
    _close(torch.cat(outs), ref)
    h.free_req(row)
    assert h.free_counts() == h.start


@pytest.mark.parametrize("name", ALL)
def test_mixed_batch_then_decode(name, request):
    """Three requests of different lengths extend together (one of them continues an earlier
    chunk), then decode together; each matches its own HF forward."""
    hf, model, cfg = request.getfixturevalue(name)
    prompts = [random_prompt(n, 10 + n) for n in (70, 9, 41)]
    full = [p + random_prompt(12, 50 + i) for i, p in enumerate(prompts)]
    refs = [hf_logits(hf, f) for f in full]
    h = HybridHarness(model, cfg)
    rows = [h.new_req() for _ in prompts]
    model.forward(h.extend_batch([(rows[0], prompts[0][:30])]))  # an earlier chunk of request 0
    out = model.forward(h.extend_batch([(rows[0], prompts[0][30:]), (rows[1], prompts[1]),
                                        (rows[2], prompts[2])], all_logits=True))
    _close(out[:40], refs[0][30:70])
    _close(out[40:49], refs[1][:9])
    _close(out[49:], refs[2][:41])
    for step in range(12):
        batch = [(rows[i], full[i][len(prompts[i]) + step]) for i in range(3)]
        logits = model.forward(h.decode_batch(batch))
        for i in range(3):
            _close(logits[i], refs[i][len(prompts[i]) + step])
    for row in rows:
        h.free_req(row)
    assert h.free_counts() == h.start


@pytest.mark.parametrize("name", ALL)
def test_greedy_matches_generate(name, request):
    hf, model, cfg = request.getfixturevalue(name)
    prompt = random_prompt(50, 7)
    hf.generation_config.eos_token_id = None  # exactly 20 tokens
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                          pad_token_id=0)[0, len(prompt):].tolist()
    h = HybridHarness(model, cfg)
    row = h.new_req()
    out = []
    for a in range(0, len(prompt), 16):  # chunked prefill
        logits = model.forward(h.extend_batch([(row, prompt[a:a + 16])]))
    tok = int(logits[0].argmax())
    out.append(tok)
    while len(out) < 20:
        tok = int(model.forward(h.decode_batch([(row, tok)]))[0].argmax())
        out.append(tok)
    assert out == ref
    h.free_req(row)
    assert h.free_counts() == h.start


def test_state_restarts_at_position_zero(qwen35):
    """A slot reused by a new request (dirty state from the old one) starts from zero state."""
    hf, model, cfg = qwen35
    h = HybridHarness(model, cfg, max_reqs=1)
    row = h.new_req()
    model.forward(h.extend_batch([(row, random_prompt(40, 4))]))
    slot = h.slot(row)
    h.free_req(row)
    assert any(bool(b[slot].abs().sum() > 0) for b in h.states.buffers())  # left dirty on purpose
    row = h.new_req()
    assert h.slot(row) == slot
    ids = random_prompt(33, 5)
    _close(model.forward(h.extend_batch([(row, ids)], all_logits=True)), hf_logits(hf, ids))
    h.free_req(row)


# ------------------------------------------------------------------------------------------------
# the gated delta rule kernels and the state pool


def test_chunked_rule_equals_recurrence():
    gen = torch.Generator().manual_seed(0)
    h, n, dk, dv = 3, 150, 8, 5
    q = torch.nn.functional.normalize(torch.randn(h, n, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(h, n, dk, generator=gen), dim=-1)
    v = torch.randn(h, n, dv, generator=gen)
    g = -torch.rand(h, n, generator=gen)
    beta = torch.rand(h, n, generator=gen)
    s0 = torch.randn(h, dk, dv, generator=gen)
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, s0, chunk=64)
    st = s0.unsqueeze(0)
    for i in range(n):
        o, st = recurrent_gated_delta_step(q[:, i][None], k[:, i][None], v[:, i][None], g[:, i][None],
                                           beta[:, i][None], st)
        assert (o[0] - out[:, i]).abs().max() < 1e-4
    assert (st[0] - s).abs().max() < 1e-4


def test_the_rule_runs_in_float32_for_bfloat16_inputs():
    """A bfloat16 model (on a GPU) hands the rule bfloat16 q, k, v and beta beside float32 decays: both forms
    compute in float32, return the output in v's dtype and the state in float32, close to float32 inputs'
    result (the mixed dtypes once stopped the chunked form's matmul: seen on the GPU machine)."""
    gen = torch.Generator().manual_seed(1)
    h, n, dk, dv = 2, 70, 8, 4
    q = torch.nn.functional.normalize(torch.randn(h, n, dk, generator=gen), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(h, n, dk, generator=gen), dim=-1)
    v, g, beta = torch.randn(h, n, dv, generator=gen), -torch.rand(h, n, generator=gen), torch.rand(h, n)
    s0 = torch.randn(h, dk, dv, generator=gen)
    want, want_s = chunk_gated_delta_rule(q, k, v, g, beta, s0)
    bf = [x.bfloat16() for x in (q, k, v)]
    out, s = chunk_gated_delta_rule(*bf, g, beta.bfloat16(), s0.bfloat16())
    assert out.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert (out.float() - want).abs().max() < 0.1 and (s - want_s).abs().max() < 0.1
    first = [x[:, 0][None] for x in bf]
    o, st = recurrent_gated_delta_step(*first, g[:, 0][None], beta[:, 0][None].bfloat16(), s0[None].half())
    assert o.dtype == torch.bfloat16 and st.dtype == torch.float32


def test_state_pool():
    pool = StatePool(3, [0, 2], (2, 5, 3), (4, 2, 2))
    assert pool.available_size() == 3
    assert [tuple(b.shape) for b in pool.buffers()] == [(4, 2, 5, 3)] * 2 + [(4, 4, 2, 2)] * 2
    assert all(b.is_contiguous() for b in pool.buffers())
    assert pool.item_bytes == [2 * 5 * 3 * 4] * 2 + [4 * 2 * 2 * 4] * 2
    assert pool.leading_dims() == [2, 2, 4, 4]
    slots = [pool.alloc() for _ in range(3)]
    assert sorted(slots) == [1, 2, 3]  # slot 0 is padding
    with pytest.raises(OutOfStateSlots):
        pool.alloc()
    pool.conv(2)[slots[0]].fill_(1.0)
    pool.recurrent(0)[slots[0]].fill_(2.0)
    pool.free(slots[0])
    with pytest.raises(ValueError):
        pool.free(slots[0])
    again = pool.alloc()
    assert again == slots[0]
    assert all(float(b[again].abs().sum()) == 0 for b in pool.buffers())  # handed out zeroed
    for s in (again, *slots[1:]):
        pool.free(s)
    assert pool.available_size() == 3


# ------------------------------------------------------------------------------------------------
# tensor parallelism: key/value heads, attention heads and the MLP split over 2 ranks


def _run_tp2(jobs: list[tuple]) -> list[tuple[list, bool]]:
    import multiprocessing as mp

    from tests.harness.client import free_port
    from tests.hybrid.hybrid_harness import tp_worker

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=tp_worker, args=(r, 2, port, jobs, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        status, results = q.get(timeout=240)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert status == "ok", results
    return results


def test_tp2_matches_hf(qwen35, qwen35_moe, mistral_swa, tmp_path_factory):
    jobs, refs = [], []
    # Qwen3.5-MoE: each rank holds half of every expert's and of the shared expert's features
    for name, (hf, _, _) in (("qwen35", qwen35), ("qwen35_moe", qwen35_moe), ("mistral_swa", mistral_swa)):
        path = str(tmp_path_factory.mktemp(f"{name}_tp"))
        hf.save_pretrained(path)
        seq = random_prompt(60, 21)
        jobs.append((path, seq[:50], seq[50:]))
        refs.append(hf_logits(hf, seq))
    for (out, restored), ref in zip(_run_tp2(jobs), refs, strict=True):
        _close(torch.tensor(out), ref)
        assert restored


def test_moe_ep2_matches_hf(qwen35_moe, tmp_path):
    """Expert parallelism over the 2 TP ranks: each rank holds 2 of the 4 routed experts whole (and half of
    the shared expert's features); with EPLB too, rebalancing every 2 forwards into one spare slot a rank
    while the request decodes. The logits stay transformers'."""
    from common.layers.eplb import EplbSettings

    hf = qwen35_moe[0]
    hf.save_pretrained(str(tmp_path))
    seq = random_prompt(40, 22)
    ref = hf_logits(hf, seq)
    eplb = EplbSettings(interval=2, redundant_per_rank=1)
    jobs = [(str(tmp_path), seq[:30], seq[30:], {"ep_size": 2}),
            (str(tmp_path), seq[:30], seq[30:], {"ep_size": 2, "eplb": eplb})]
    for out, restored in _run_tp2(jobs):
        _close(torch.tensor(out), ref)
        assert restored
