"""CUDA graph replay against the eager forward on the device: decode batches of 1, 2 and 3 requests
(3 replays the 4-row graph with one row of padding) give the eager forward's logits, for the triton
backend in float32 and bfloat16, FlashInfer in bfloat16, and a hybrid model (its state slots restored
between the two runs: a decode step advances them)."""

from __future__ import annotations

import pytest
import torch

from common.forward_batch import ForwardBatch, ForwardMode
from tests.gpu.conftest import Engine, needs_flashinfer, prompts

TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2e-2, atol=5e-2)}


def _prefill(eng: Engine, ps: list[list[int]]) -> tuple[list[int], list[int]]:
    r = eng.r
    pool = r.req_to_token_pool
    rows, slots = eng.take(ps)
    lens = [len(p) for p in ps]
    r.forward(ForwardBatch(ForwardMode.EXTEND, torch.tensor([t for p in ps for t in p]),
                           torch.cat([torch.arange(n) for n in lens]), torch.cat(slots), torch.tensor(rows),
                           list(lens), [0] * len(ps), list(lens), r.kv_pool, pool.req_to_token))
    return rows, lens


def _decode_batch(eng: Engine, rows: list[int], lens: list[int], tokens: list[int]) -> ForwardBatch:
    r = eng.r
    pool = r.req_to_token_pool
    new = []
    for i, (row, n) in enumerate(zip(rows, lens, strict=True)):
        s = r.allocator.alloc_extend(n, int(pool.slots(row, n - 1, n)[0]), 1)
        pool.write(row, n, s)
        new.append(s)
        lens[i] = n + 1
    fb = ForwardBatch(ForwardMode.DECODE, torch.tensor(tokens), torch.tensor([n - 1 for n in lens]),
                      torch.cat(new), torch.tensor(rows), list(lens), [n - 1 for n in lens], [1] * len(rows),
                      r.kv_pool, pool.req_to_token, logits_indices=torch.arange(len(rows)))
    fb.to_device(r.device)
    if r.hybrid.has_state:
        fb.state_indices = r.hybrid.state_indices(pool, fb)
    return fb


@pytest.mark.parametrize("arch,backend,dtype",
                         [("llama", "triton", "float32"), ("llama", "triton", "bfloat16"),
                          ("llama", "flashinfer", "bfloat16"),
                          ("qwen3_5", "triton", "float32")])
def test_replay_equals_eager(make_model, arch, backend, dtype):
    if backend == "flashinfer":
        needs_flashinfer()
    eng = Engine(make_model(arch), backend, dtype, graphs=True)
    r, g = eng.r, eng.r.graphs
    assert g.batch_sizes == [1, 2, 4]
    states = r.hybrid.state_pool
    for bs in (3, 2, 1):
        rows, lens = _prefill(eng, prompts(bs, seed=bs))
        for step in range(2):
            fb = _decode_batch(eng, rows, lens, [7 + step] * bs)
            assert g.can_run(fb) and g.padded_size(bs) == (4 if bs == 3 else bs)
            saved = None if states is None else [t.clone()
                                                 for t in states.conv_buffers + states.recurrent_buffers]
            with torch.inference_mode():
                replayed = g.replay(fb).clone()
                if saved is not None:
                    for t, s in zip(states.conv_buffers + states.recurrent_buffers, saved, strict=True):
                        t.copy_(s)
                fb.attn_metadata = None
                eager = r.model.forward(fb)  # writes the same K/V again
            assert replayed.shape == eager.shape == (bs, r.vocab_size)
            torch.testing.assert_close(replayed.float(), eager.float(), **TOL[dtype])
        for row, n in zip(rows, lens, strict=True):
            r.allocator.free_slots(r.req_to_token_pool.slots(row, 0, n))
            r.req_to_token_pool.free(row)
