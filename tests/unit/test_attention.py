"""TorchAttentionBackend over the paged KV pool vs a dense float64 reference: extend on top of a
cached prefix, decode of a batch of different lengths, several page sizes, scrambled pages, GQA.
Decode runs both the native kernel (paged_attention.c) and the torch path."""

from __future__ import annotations

import pytest
import torch

from common.forward_batch import ForwardBatch, ForwardMode
from common.layers.attention import TorchAttentionBackend
from common.memory.kv_pool import KVPool
from tests.model_harness import (
    Harness,
    one_torch_thread,  # noqa: F401  (autouse)
)

HEADS, KV_HEADS, D, LAYERS = 6, 2, 8, 2


def make_backend(path: str, heads: int = HEADS, kv_heads: int = KV_HEADS,
                 d: int = D) -> TorchAttentionBackend:
    backend = TorchAttentionBackend(heads, kv_heads, d)
    if path == "torch":
        backend.native = backend.native_prefill = backend.native_store = None
    else:
        assert backend.native is not None, "the native kernel did not build (see common/layers/native.py)"
    return backend


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


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_extend_and_decode(page_size, path):
    gen = torch.Generator().manual_seed(page_size)
    backend = make_backend(path)
    h = Harness(LAYERS, KV_HEADS, D, page_size=page_size, num_pages=512 // page_size + 8,
                scramble_seed=page_size)
    seqs = [Seq(h.new_req()) for _ in range(4)]
    # first extend: no prefix; lengths around page boundaries
    lens = [7, 1, page_size + 1, 3 * page_size]
    run_step(backend, h,
             h.extend_batch([(s.row, [5] * n) for s, n in zip(seqs, lens, strict=True)]), seqs, lens, gen)
    # extend on top of cached prefixes (chunked prefill), mixed with a single-token extend
    lens = [9, 5, 1, page_size]
    run_step(backend, h,
             h.extend_batch([(s.row, [5] * n) for s, n in zip(seqs, lens, strict=True)]), seqs, lens, gen)
    # batched decode of requests with different lengths
    for _ in range(page_size + 2):
        run_step(backend, h, h.decode_batch([(s.row, 5) for s in seqs]), seqs, [1] * len(seqs), gen)
    # pages really are scattered
    pages = (h.r2t.req_to_token[seqs[3].row, :seqs[3].k.shape[0]] // page_size).unique_consecutive()
    assert (pages.diff() != 1).any()


@pytest.mark.parametrize("path", ["native", "torch"])
def test_decode_single_request_equal_lengths(path):
    gen = torch.Generator().manual_seed(7)
    backend = make_backend(path)
    h = Harness(LAYERS, KV_HEADS, D, page_size=4, num_pages=64)
    seqs = [Seq(h.new_req()), Seq(h.new_req())]
    run_step(backend, h, h.extend_batch([(s.row, [1] * 6) for s in seqs]), seqs, [6, 6], gen)
    for _ in range(3):  # same lengths: the no-mask path
        fb = h.decode_batch([(s.row, 1) for s in seqs])
        run_step(backend, h, fb, seqs, [1, 1], gen)
        assert fb.attn_metadata.mask is None
        assert (fb.attn_metadata.rows is not None) == (path == "native")


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


@pytest.mark.parametrize("group,d", [(1, 64), (3, 64), (4, 128), (6, 40), (2, 24)])  # 2x24: the generic loop
def test_native_decode_matches_torch_path(group, d):
    """Head sizes of the AVX2 path (multiples of 8; 40 ends P.V in a partial chunk) and of the generic
    loop (24); lengths 1..70 over scattered pages (vector blocks and scalar tails), a query tensor
    with a row stride (a slice of q|k), layers at different offsets, this step's K/V written by the
    kernel itself."""
    kv_heads, ps, layers, b = 2, 16, 3, 5
    gen = torch.Generator().manual_seed(group * d)
    pool = KVPool(40, ps, layers, kv_heads, d)
    pool.data.copy_(torch.randn(pool.data.shape, generator=gen))
    lens = [1, 16, 17, 70, 33]
    pages = torch.randperm(39, generator=gen)[:b * 5].view(b, 5) + 1
    r2t = (pages.unsqueeze(-1) * ps + torch.arange(ps)).view(b, -1)
    fb_args = dict(mode=ForwardMode.DECODE, input_ids=torch.zeros(b, dtype=torch.int64),
                   positions=torch.tensor(lens) - 1,
                   out_cache_loc=torch.stack([r2t[i, n - 1] for i, n in enumerate(lens)]),
                   req_pool_indices=torch.arange(b), seq_lens=lens, extend_prefix_lens=[n - 1 for n in lens],
                   extend_seq_lens=[1] * b, kv_pool=pool, req_to_token=r2t)
    qk = torch.randn(b, (group + 1) * kv_heads * d, generator=gen)
    q = qk[:, :group * kv_heads * d]
    k = torch.randn(b, kv_heads * d, generator=gen)
    v = torch.randn(b, kv_heads * d, generator=gen)
    outs = {}
    for path in ("native", "torch"):
        backend = make_backend(path, group * kv_heads, kv_heads, d)
        fb = ForwardBatch(**fb_args)
        backend.init_forward_metadata(fb)
        outs[path] = [backend.forward(q, k, v, layer, fb) for layer in range(layers)]
    for a, t in zip(outs["native"], outs["torch"], strict=True):
        assert (a - t).abs().max().item() < 1e-5
    assert not torch.equal(outs["torch"][0], outs["torch"][1])  # layers really differ


def _decode_outputs(lens: list[int], pool: KVPool, r2t: torch.Tensor, q, k, v, path: str, group: int):
    b = len(lens)
    fb = ForwardBatch(mode=ForwardMode.DECODE, input_ids=torch.zeros(b, dtype=torch.int64),
                      positions=torch.tensor(lens) - 1,
                      out_cache_loc=torch.stack([r2t[i, n - 1] for i, n in enumerate(lens)]),
                      req_pool_indices=torch.arange(b), seq_lens=lens,
                      extend_prefix_lens=[n - 1 for n in lens], extend_seq_lens=[1] * b, kv_pool=pool,
                      req_to_token=r2t)
    backend = make_backend(path, group * pool.kv_heads, pool.kv_heads, pool.head_dim)
    backend.init_forward_metadata(fb)
    return backend.forward(q, k, v, 0, fb)


def test_native_decode_splits_long_contexts_into_spans():
    """Contexts past one span (256 tokens) are split into spans whose unnormalised softmaxes are combined:
    one span and one token, two whole spans, one span, a short one, four spans with a tail, with peaked
    scores (a large query), against the torch path; and a request gets the same bits alone as in the
    batch (the spans depend on its length alone)."""
    kv_heads, ps, d, group = 3, 16, 64, 3
    gen = torch.Generator().manual_seed(9)
    lens = [257, 512, 256, 5, 1000]
    per = -(-max(lens) // ps)
    pool = KVPool(len(lens) * per + 1, ps, 1, kv_heads, d)
    pool.data.copy_(torch.randn(pool.data.shape, generator=gen))
    pages = torch.randperm(len(lens) * per, generator=gen).view(len(lens), per) + 1
    r2t = (pages.unsqueeze(-1) * ps + torch.arange(ps)).view(len(lens), -1)
    q = torch.randn(len(lens), group * kv_heads * d, generator=gen) * 4
    k, v = (torch.randn(len(lens), kv_heads * d, generator=gen) for _ in range(2))
    native = _decode_outputs(lens, pool, r2t, q, k, v, "native", group)
    torch_out = _decode_outputs(lens, pool, r2t, q, k, v, "torch", group)
    assert (native - torch_out).abs().max().item() < 1e-5
    for i in (0, 2, 4):
        one = slice(i, i + 1)
        alone = _decode_outputs([lens[i]], pool, r2t[one], q[one], k[one], v[one], "native", group)
        assert torch.equal(alone, native[i:i + 1])


@pytest.mark.parametrize("heads,kv_heads,d", [(6, 2, 64), (4, 4, 32), (8, 1, 128)])
def test_native_extend_matches_torch_path(heads, kv_heads, d):
    """Extend through `prefill_attention.c` (head sizes its block divides) against SDPA: requests
    without a prefix (K/V read in place from a strided slice of q|k|v), then on top of their cached
    prefixes, one of them a single token; query blocks that end part-way (13, 40), GQA and not."""
    layers = 2
    outs = {}
    for path in ("native", "torch"):
        backend = make_backend(path, heads, kv_heads, d)
        if path == "native":
            assert backend.native_prefill is not None, "prefill_attention.c did not build"
        h = Harness(layers, kv_heads, d, page_size=4, num_pages=64, scramble_seed=5)
        rows = [h.new_req() for _ in range(3)]
        g = torch.Generator().manual_seed(d)
        outs[path] = []
        for lens in ([1, 13, 40], [25, 1, 12]):
            t = sum(lens)
            qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g)
            q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
            fb = h.extend_batch([(r, [3] * n) for r, n in zip(rows, lens, strict=True)])
            backend.init_forward_metadata(fb)
            # layer 0 reads the slices of qkv as they are (strided rows); layer 1 sees other values
            outs[path] += [backend.forward(q, k, v, 0, fb), backend.forward(q * 2, k + 1, v - 1, 1, fb)]
    for a, t in zip(outs["native"], outs["torch"], strict=True):
        assert (a - t).abs().max().item() < 1e-5
    assert not torch.equal(outs["torch"][0], outs["torch"][1])


@pytest.mark.parametrize("shared_kv", [False, True], ids=["k_and_v", "one_plane"])
def test_native_kv_store_writes_what_set_kv_rows_writes(shared_kv):
    """`kv_store.c` (an extend's K/V into a float32 pool, on every thread past 16 Ki floats) against
    `set_kv_rows`: strided views of one projection output as the model passes them, scattered slots,
    two layers, K and V planes or one plane (V is K); nothing else in the pool changes."""
    kv_heads, d, ps, layers = (1, 32, 4, 2) if shared_kv else (3, 64, 16, 2)
    backend = make_backend("native", 3 * kv_heads, kv_heads, d)
    assert backend.native_store is not None
    gen = torch.Generator().manual_seed(7)
    for t in (5, 300):
        pools = [KVPool(-(-t // ps) * 2 + 2, ps, layers, kv_heads, d, shared_kv=shared_kv) for _ in range(2)]
        for p in pools:
            p.data.copy_(torch.arange(p.data.numel(), dtype=torch.float32).view(p.data.shape))
        slots = torch.randperm(pools[0].num_pages * ps - ps, generator=gen)[:t] + ps
        qkv = torch.randn(t, (3 + 2) * kv_heads * d, generator=gen)
        k = qkv[:, 3 * kv_heads * d:4 * kv_heads * d].view(t, kv_heads, d)
        v = qkv[:, 4 * kv_heads * d:].view(t, kv_heads, d)
        pools[0].set_kv_rows = None  # the native write alone touches this pool
        for layer in range(layers):
            rows = pools[0].flat_rows(slots)
            backend._store_kv(pools[0], layer, rows, k, v)
            pools[1].set_kv_rows(layer, rows, k, v)
        assert torch.equal(pools[0].data, pools[1].data), t
