"""The Triton attention backend under Triton's interpreter (CPU tensors), against a dense float64
reference and against the torch backend: extend without and with a cached prefix (chunked prefill),
decode, verify, GQA groups 1/3/4/7, a sliding window, float32 / bfloat16 / float16, a KV cache dtype
other than q's, page sizes 1, 4 and 16, head sizes 16, 80 and 256, strided inputs, the CUDA tile
sizes, and the CUDA-graph metadata path. That they compile for sm_90:
tests/fresh_process/test_triton_compile.py.

Shapes are tiny (the interpreter runs every program in Python) but cross the kernels' 16-wide query
and key blocks and their split boundaries."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton and the kernel module are imported
pytest.importorskip("triton", reason="triton is not installed (make setup installs triton==3.6.0)")

from common.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from common.layers.attention_backend import create_attention_backend  # noqa: E402
from common.layers.triton_attention import TritonAttentionBackend  # noqa: E402
from common.layers.triton_kernels import interpreted  # noqa: E402
from common.memory.kv_pool import KVPool  # noqa: E402
from tests.model_harness import (  # noqa: E402
    Harness,
    one_torch_thread,  # noqa: F401  (autouse)
)

if not interpreted():
    pytest.skip(f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} when triton was imported: no interpreter "
                "for CPU tensors", allow_module_level=True)

LAYERS = 2
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def make_harness(kv_heads: int, d: int, page_size: int, kv_dtype: torch.dtype, seed: int = 0) -> Harness:
    h = Harness(LAYERS, kv_heads, d, page_size=page_size, num_pages=256 // page_size + 4, scramble_seed=seed)
    h.kv = KVPool(h.kv.num_pages, page_size, LAYERS, kv_heads, d, dtype=kv_dtype)
    return h


def dense(q, keys, values, q_pos, window, scale) -> torch.Tensor:
    """q [n, H, D], keys/values [S, KVH, D] (positions 0..S-1) -> [n, H * D], float64, causal + window."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,shd->hns", q.double(), k) * scale
    kpos = torch.arange(keys.shape[0])[None, :]
    allowed = kpos <= q_pos[:, None]
    if window is not None:
        allowed &= kpos > q_pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hns,shd->nhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


class Seq:
    """One request: its table row and, per layer, the K/V history as the pool holds it."""

    def __init__(self, row: int, kv_heads: int, d: int):
        self.row = row
        self.k = [torch.empty(0, kv_heads, d, dtype=torch.float64) for _ in range(LAYERS)]
        self.v = [torch.empty(0, kv_heads, d, dtype=torch.float64) for _ in range(LAYERS)]


def layer_inputs(q, k, v, layer: int):
    """Different values per layer, so a read of the wrong layer shows."""
    return q * (layer + 1), k + layer, v - layer


def run_step(backend, fb: ForwardBatch, seqs: list[Seq], gen: torch.Generator, dtype: torch.dtype,
             others=()) -> list[torch.Tensor]:
    """One forward of every layer: compare with the dense reference and check the pool rows written.
    `others`: more (backend, batch) pairs run on the same inputs; their outputs are returned too."""
    pool = fb.kv_pool
    hkv, d = pool.kv_heads, pool.head_dim
    lens = fb.extend_seq_lens
    t = sum(lens)
    q = torch.randn(t, backend.num_heads, d, generator=gen).to(dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype)
    backend.init_forward_metadata(fb)
    for other, ofb in others:
        other.init_forward_metadata(ofb)
    outs = []
    for layer in range(LAYERS):
        ql, kl, vl = layer_inputs(q, k, v, layer)
        out = backend.forward(ql.reshape(t, -1), kl.reshape(t, -1), vl.reshape(t, -1), layer, fb)
        assert out.dtype == dtype and out.shape == (t, backend.num_heads * d)
        outs.append(out)
        for other, ofb in others:
            outs.append(other.forward(ql.reshape(t, -1), kl.reshape(t, -1), vl.reshape(t, -1), layer, ofb))
        start = 0
        for seq, n in zip(seqs, lens, strict=True):
            prefix = seq.k[layer].shape[0]
            # decode reads this step's K/V back from the pool; extend takes them from k and v as given
            cast = pool.dtype if fb.mode == ForwardMode.DECODE else dtype
            kk = torch.cat([seq.k[layer], kl[start:start + n].to(cast).double()])
            vv = torch.cat([seq.v[layer], vl[start:start + n].to(cast).double()])
            q_pos = torch.arange(prefix, prefix + n)
            ref = dense(ql[start:start + n], kk, vv, q_pos, backend.layer_window(layer), backend.scaling)
            err = (out[start:start + n].double() - ref).abs().max().item()
            assert err < TOL[dtype], f"layer {layer}: error {err}"
            start += n
        # the new K/V are in their slots, in the pool's dtype
        for i, slot in enumerate(fb.out_cache_loc.tolist()):
            page, off = divmod(slot, pool.page_size)
            assert torch.equal(pool.k(layer)[page, :, off], kl[i].to(pool.dtype))
            assert torch.equal(pool.v(layer)[page, :, off], vl[i].to(pool.dtype))
    start = 0
    for seq, n in zip(seqs, lens, strict=True):
        for layer in range(LAYERS):
            _, kl, vl = layer_inputs(q, k, v, layer)
            seq.k[layer] = torch.cat([seq.k[layer], kl[start:start + n].to(pool.dtype).double()])
            seq.v[layer] = torch.cat([seq.v[layer], vl[start:start + n].to(pool.dtype).double()])
        start += n
    return outs


CASES = [
    # group, kv_heads, page_size, head_dim, dtype, kv cache dtype, window
    (1, 2, 1, 16, torch.float32, torch.float32, None),
    (3, 1, 16, 80, torch.float32, torch.float32, None),
    (4, 2, 16, 16, torch.bfloat16, torch.bfloat16, None),
    (7, 1, 1, 16, torch.float16, torch.float16, None),
    (2, 2, 4, 16, torch.float32, torch.bfloat16, None),
    (2, 1, 4, 16, torch.float32, torch.float32, 5),
    (4, 1, 16, 16, torch.bfloat16, torch.bfloat16, 7),
    (2, 1, 16, 256, torch.float16, torch.float16, None),
]


@pytest.mark.parametrize("group,kv_heads,page_size,d,dtype,kv_dtype,window", CASES)
def test_extend_chunked_then_decode(group, kv_heads, page_size, d, dtype, kv_dtype, window):
    """Three requests: a first extend (one of a single token, one longer than a query block), a second
    extend on top of the cached prefixes (chunked prefill), then decode steps; on the windowed layer
    (layer 1) the window cuts into the prefix and into the new tokens."""
    gen = torch.Generator().manual_seed(group * 100 + d)
    backend = TritonAttentionBackend(group * kv_heads, kv_heads, d, window=window,
                                     window_layers=[1] if window else (), device="cpu")
    h = make_harness(kv_heads, d, page_size, kv_dtype, seed=group)
    seqs = [Seq(h.new_req(), kv_heads, d) for _ in range(3)]
    for lens in ([5, 1, 19], [3, 18, 1]):
        fb = h.extend_batch([(s.row, [1] * n) for s, n in zip(seqs, lens, strict=True)])
        run_step(backend, fb, seqs, gen, dtype)
    for _ in range(2):
        run_step(backend, h.decode_batch([(s.row, 1) for s in seqs]), seqs, gen, dtype)


def test_decode_splits_and_blocks():
    """Decode of lengths that leave splits empty (1, 2) and that give every split several key blocks
    (70), with three splits (a split count that is not a power of two) and with one."""
    gen = torch.Generator().manual_seed(3)
    h = make_harness(2, 16, 16, torch.float32)
    backend = TritonAttentionBackend(6, 2, 16, device="cpu")
    seqs = [Seq(h.new_req(), 2, 16) for _ in range(3)]
    run_step(backend, h.extend_batch([(s.row, [1] * n) for s, n in zip(seqs, [1, 69, 2], strict=True)]),
             seqs, gen, torch.float32)
    for splits in (3, 1):
        backend.num_kv_splits = splits
        run_step(backend, h.decode_batch([(s.row, 1) for s in seqs]), seqs, gen, torch.float32)


def test_verify():
    """A VERIFY batch (each request's last token and drafts on top of its KV) attends as an extend."""
    gen = torch.Generator().manual_seed(5)
    h = make_harness(1, 16, 4, torch.float32)
    backend = TritonAttentionBackend(3, 1, 16, device="cpu")
    seqs = [Seq(h.new_req(), 1, 16) for _ in range(2)]
    run_step(backend, h.extend_batch([(s.row, [1] * n) for s, n in zip(seqs, [6, 9], strict=True)]),
             seqs, gen, torch.float32)
    fb = h.extend_batch([(s.row, [1] * 4) for s in seqs])
    fb.mode = ForwardMode.VERIFY
    run_step(backend, fb, seqs, gen, torch.float32)


def test_cuda_graph_metadata_matches_plain_path():
    """Capture with a 4-row decode batch, then replay two real requests (padded to 4 rows, the padding
    writing slot 0 only) twice: the captured metadata object, refilled in place, gives the rows of the
    plain path and leaves the same pool."""
    gen = torch.Generator().manual_seed(9)
    kv_heads, d, heads = 2, 16, 4
    backend = TritonAttentionBackend(heads, kv_heads, d, window=3, window_layers=[0], device="cpu")
    h = make_harness(kv_heads, d, 4, torch.float32)
    seqs = [Seq(h.new_req(), kv_heads, d) for _ in range(3)]
    run_step(backend, h.extend_batch([(s.row, [1] * n) for s, n in zip(seqs, [7, 2, 3], strict=True)]),
             seqs, gen, torch.float32)
    backend.init_cuda_graph_state(max_bs=6, max_context_len=64)
    # (capture runs no forward: the positions it took stay zero in the pool, the same for both paths below)
    capture_fb = h.decode_batch([(s.row, 1) for s in seqs] + [(seqs[0].row, 1)])
    backend.init_forward_metadata_capture(capture_fb)
    captured = capture_fb.attn_metadata
    assert captured.seq_lens.tolist() == capture_fb.seq_lens
    for _ in range(2):
        fb = h.decode_batch([(s.row, 1) for s in seqs[1:]])
        q = torch.randn(2, heads * d, generator=gen)
        k = torch.randn(2, kv_heads * d, generator=gen)
        v = torch.randn(2, kv_heads * d, generator=gen)
        before = h.kv.data.clone()
        backend.init_forward_metadata(fb)
        plain = [backend.forward(q, k, v, layer, fb) for layer in range(LAYERS)]
        after_plain = h.kv.data.clone()
        h.kv.data.copy_(before)
        backend.init_forward_metadata_replay(fb)
        assert captured.seq_lens.tolist() == fb.seq_lens + [1, 1]
        assert captured.out_cache_loc.tolist() == fb.out_cache_loc.tolist() + [0, 0]
        pad = torch.zeros(2, heads * d)
        graph = [backend.forward(torch.cat([q, pad]), torch.cat([k, pad[:, :kv_heads * d]]),
                                 torch.cat([v, pad[:, :kv_heads * d]]), layer, capture_fb)
                 for layer in range(LAYERS)]
        for a, b in zip(plain, graph, strict=True):
            assert torch.equal(a, b[:2])
        # the padded rows wrote slot 0 of the padding page 0; every other page is as the plain path left it
        assert torch.equal(h.kv.data[1:], after_plain[1:])
    with pytest.raises(ValueError, match="exceeds"):
        backend.init_forward_metadata_replay(h.decode_batch([(s.row, 1) for s in seqs] * 3))


@pytest.mark.parametrize("window", [None, 4])
def test_matches_torch_backend(window):
    """The same batches through the `torch_native` backend (with a window: its sliding-window variant) on a
    pool of its own, with the same slots: the same outputs and the same pool."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, d = 6, 2, 16
    kw = dict(window=window, window_layers=[0] if window else (), device="cpu")
    triton_backend = TritonAttentionBackend(heads, kv_heads, d, **kw)
    torch_backend = create_attention_backend("torch_native", heads, kv_heads, d, **kw)
    assert not torch_backend.native
    h, h_ref = make_harness(kv_heads, d, 4, torch.float32), make_harness(kv_heads, d, 4, torch.float32)
    seqs = [Seq(h.new_req(), kv_heads, d) for _ in range(2)]
    rows_ref = [h_ref.new_req() for _ in seqs]
    steps = [("extend", [9, 3]), ("extend", [2, 5]), ("decode", None)]
    for kind, lens in steps:
        if kind == "extend":
            fb = h.extend_batch([(s.row, [1] * n) for s, n in zip(seqs, lens, strict=True)])
            fb_ref = h_ref.extend_batch([(r, [1] * n) for r, n in zip(rows_ref, lens, strict=True)])
        else:
            fb = h.decode_batch([(s.row, 1) for s in seqs])
            fb_ref = h_ref.decode_batch([(r, 1) for r in rows_ref])
        assert torch.equal(fb.out_cache_loc, fb_ref.out_cache_loc)
        outs = run_step(triton_backend, fb, seqs, gen, torch.float32, others=[(torch_backend, fb_ref)])
        for ours, theirs in zip(outs[0::2], outs[1::2], strict=True):
            assert (ours - theirs).abs().max().item() < 1e-5
        assert torch.allclose(h.kv.data, h_ref.kv.data, atol=0, rtol=0)


def test_cuda_tile_sizes():
    """The tiles and split count the backend takes on CUDA (64-row query blocks, 64-key blocks, 16
    splits), run here by the interpreter: requests shorter and longer than one block."""
    gen = torch.Generator().manual_seed(13)
    h = make_harness(2, 16, 16, torch.float32)
    backend = TritonAttentionBackend(4, 2, 16, window=40, window_layers=[1], device="cpu")
    backend.num_kv_splits, backend.decode_block_n = 16, 64
    backend.extend_block_m = backend.extend_block_n = 64
    seqs = [Seq(h.new_req(), 2, 16) for _ in range(2)]
    for lens in ([5, 70], [66, 1]):
        run_step(backend, h.extend_batch([(s.row, [1] * n) for s, n in zip(seqs, lens, strict=True)]),
                 seqs, gen, torch.float32)
    run_step(backend, h.decode_batch([(s.row, 1) for s in seqs]), seqs, gen, torch.float32)


@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_strided_inputs(mode):
    """q, k and v as column slices of one qkv tensor (rows a qkv row apart) give what contiguous copies
    give, on two pools of the same contents."""
    heads, kv_heads, d = 6, 2, 16
    backend = TritonAttentionBackend(heads, kv_heads, d, device="cpu")
    outs, pools = [], []
    for contiguous in (False, True):
        gen = torch.Generator().manual_seed(17)
        h = make_harness(kv_heads, d, 4, torch.float32)
        rows = [h.new_req() for _ in range(2)]
        fb = h.extend_batch([(r, [1] * n) for r, n in zip(rows, [3, 6], strict=True)])
        if mode == "decode":  # a cached prefix of random K/V
            h.kv.data.copy_(torch.randn(h.kv.data.shape, generator=gen))
            fb = h.decode_batch([(r, 1) for r in rows])
        qkv = torch.randn(fb.input_ids.numel(), (heads + 2 * kv_heads) * d, generator=gen)
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
        if contiguous:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        else:
            assert q.stride(0) == k.stride(0) == qkv.shape[1]
        backend.init_forward_metadata(fb)
        outs.append(torch.cat([backend.forward(q, k, v, layer, fb) for layer in range(LAYERS)]))
        pools.append(h.kv.data.clone())
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(pools[0], pools[1])
