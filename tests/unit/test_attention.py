"""TorchAttentionBackend over the paged KV pool vs a dense float64 reference: extend on top of a
cached prefix, decode of a batch of different lengths, several page sizes, scrambled pages, GQA."""

from __future__ import annotations

import pytest
import torch
from model_harness import (
    Harness,
    one_torch_thread,  # noqa: F401  (autouse)
)

from common.layers.attention import TorchAttentionBackend

HEADS, KV_HEADS, D, LAYERS = 6, 2, 8, 2


def dense_reference(q, k, v, prefix: int, scale: float) -> torch.Tensor:
    """q [n, H, D] for positions prefix..prefix+n-1; k, v [prefix+n, KVH, D] -> [n, H*D] (float64)."""
    group = HEADS // KV_HEADS
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    n, s = q.shape[0], k.shape[0]
    scores = torch.einsum("nhd,shd->hns", q, k) * scale
    allowed = torch.arange(s)[None, :] <= (prefix + torch.arange(n))[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hns,shd->nhd", scores.softmax(-1), v).reshape(n, -1)


class Seq:
    """One request's full K/V history (the reference keeps it densely)."""

    def __init__(self, row: int):
        self.row = row
        self.k = torch.empty(0, KV_HEADS, D)
        self.v = torch.empty(0, KV_HEADS, D)


def run_step(backend, h, fb, seqs, new_lens, gen) -> None:
    t = sum(new_lens)
    q = torch.randn(t, HEADS, D, generator=gen)
    k = torch.randn(t, KV_HEADS, D, generator=gen)
    v = torch.randn(t, KV_HEADS, D, generator=gen)
    backend.init_forward_metadata(fb)
    for layer in range(LAYERS):
        # layers see different data: scale per layer so a wrong-layer read would show
        out = backend.forward((q * (layer + 1)).reshape(t, -1), (k + layer).reshape(t, -1),
                              (v - layer).reshape(t, -1), layer, fb)
        start = 0
        for seq, n in zip(seqs, new_lens, strict=True):
            prefix = seq.k.shape[0]
            kk = torch.cat([seq.k, k[start:start + n]]) + layer
            vv = torch.cat([seq.v, v[start:start + n]]) - layer
            ref = dense_reference(q[start:start + n] * (layer + 1), kk, vv, prefix, backend.scaling)
            assert (out[start:start + n].double() - ref).abs().max().item() < 1e-5, f"layer {layer}"
            start += n
    start = 0
    for seq, n in zip(seqs, new_lens, strict=True):
        seq.k = torch.cat([seq.k, k[start:start + n]])
        seq.v = torch.cat([seq.v, v[start:start + n]])
        start += n


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_extend_and_decode(page_size):
    gen = torch.Generator().manual_seed(page_size)
    backend = TorchAttentionBackend(HEADS, KV_HEADS, D)
    h = Harness(LAYERS, KV_HEADS, D, page_size=page_size, num_pages=512 // page_size + 8, scramble_seed=page_size)
    seqs = [Seq(h.new_req()) for _ in range(4)]
    # first extend: no prefix; lengths around page boundaries
    lens = [7, 1, page_size + 1, 3 * page_size]
    run_step(backend, h, h.extend_batch([(s.row, [5] * n) for s, n in zip(seqs, lens, strict=True)]), seqs, lens, gen)
    # extend on top of cached prefixes (chunked prefill), mixed with a single-token extend
    lens = [9, 5, 1, page_size]
    run_step(backend, h, h.extend_batch([(s.row, [5] * n) for s, n in zip(seqs, lens, strict=True)]), seqs, lens, gen)
    # batched decode of requests with different lengths
    for _ in range(page_size + 2):
        run_step(backend, h, h.decode_batch([(s.row, 5) for s in seqs]), seqs, [1] * len(seqs), gen)
    # pages really are scattered
    pages = (h.r2t.req_to_token[seqs[3].row, :seqs[3].k.shape[0]] // page_size).unique_consecutive()
    assert (pages.diff() != 1).any()


def test_decode_single_request_equal_lengths():
    gen = torch.Generator().manual_seed(7)
    backend = TorchAttentionBackend(HEADS, KV_HEADS, D)
    h = Harness(LAYERS, KV_HEADS, D, page_size=4, num_pages=64)
    seqs = [Seq(h.new_req()), Seq(h.new_req())]
    run_step(backend, h, h.extend_batch([(s.row, [1] * 6) for s in seqs]), seqs, [6, 6], gen)
    for _ in range(3):  # same lengths: the no-mask path
        fb = h.decode_batch([(s.row, 1) for s in seqs])
        run_step(backend, h, fb, seqs, [1, 1], gen)
        assert fb.attn_metadata.mask is None


def test_kv_written_to_slots():
    backend = TorchAttentionBackend(HEADS, KV_HEADS, D)
    h = Harness(1, KV_HEADS, D, page_size=4, num_pages=16, scramble_seed=3)
    row = h.new_req()
    fb = h.extend_batch([(row, [1] * 6)])
    k = torch.randn(6, KV_HEADS * D)
    v = torch.randn(6, KV_HEADS * D)
    backend.init_forward_metadata(fb)
    backend.forward(torch.randn(6, HEADS * D), k, v, 0, fb)
    for i, slot in enumerate(fb.out_cache_loc.tolist()):
        page, off = divmod(slot, 4)
        assert torch.equal(h.kv.k(0)[page, :, off], k[i].view(KV_HEADS, D))
        assert torch.equal(h.kv.v(0)[page, :, off], v[i].view(KV_HEADS, D))
