"""The FlashInfer backend's CPU-testable parts: the clear errors when flashinfer is missing or the device
is not CUDA, the page-table arithmetic (`paged_kv_layout`) against a brute-force walk of the request
table, and the backend's use of FlashInfer's wrappers against a dense float64 reference.

For the last, `flashinfer` is a pure-torch double of the three documented behaviours the backend relies
on (flashinfer/decode.py and prefill.py of flashinfer-python 0.7.4): a paged cache given as a
`(k_cache, v_cache)` tuple in "HND" layout, read at the tensors' own strides; page tables as
`indptr` / `indices` / `last_page_len`; a causal prefill mask aligned to the end of each request's keys
and `window_left` keys before each query; the dtype checks of `plan` against `run`; and CUDA-graph
decode wrappers with a fixed batch size that plan into the buffers given at construction and read them
at run time. The real kernels are checked on a GPU by tests/gpu/."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from common.forward_batch import ForwardBatch, ForwardMode
from common.layers import flashinfer_attention as fia
from common.layers.attention_backend import create_attention_backend
from common.memory.kv_pool import KVPool
from tests.model_harness import (
    Harness,
    one_torch_thread,  # noqa: F401  (autouse)
)

LAYERS = 2
HALF = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------- errors
def test_missing_flashinfer_names_the_flag_and_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises ImportError
    with pytest.raises(RuntimeError, match=r"--attention-backend flashinfer needs the flashinfer-python "
                                           r"package \(pip install 'pdserve\[gpu\]'\)"):
        fia.import_flashinfer()
    with pytest.raises(RuntimeError, match="flashinfer-python"):
        fia.FlashInferAttentionBackend(4, 2, 64, device="cuda")


def test_factory_refuses_cpu():
    with pytest.raises(ValueError, match="CUDA only"):
        create_attention_backend("flashinfer", 4, 2, 64, device="cpu")


# ---------------------------------------------------------------------------------------------- page table
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_kv_layout_matches_the_request_table(page_size):
    h = Harness(1, 1, 8, page_size=page_size, num_pages=200 // page_size + 8, scramble_seed=page_size)
    lens = [1, page_size, page_size + 1, 3 * page_size - 1, 37]
    rows = []
    for n in lens:
        row = h.new_req()
        h._grow(row, n)
        rows.append(row)
    order = [3, 0, 4, 2, 1]  # the batch's rows in another order than the table's
    b_rows, b_lens = [rows[i] for i in order], [lens[i] for i in order]
    lay = fia.paged_kv_layout(h.r2t.req_to_token, torch.tensor(b_rows), b_lens, page_size)
    assert lay.indptr.dtype == lay.indices.dtype == lay.last_page_len.dtype == torch.int32
    r2t = h.r2t.req_to_token
    want_ptr, want_idx, want_last = [0], [], []
    for row, n in zip(b_rows, b_lens, strict=True):
        pages = [int(r2t[row, p]) // page_size for p in range(0, n, page_size)]
        want_idx += pages
        want_ptr.append(want_ptr[-1] + len(pages))
        want_last.append(n - (len(pages) - 1) * page_size)
    assert lay.indptr.tolist() == want_ptr
    assert lay.indices.tolist() == want_idx
    assert lay.last_page_len.tolist() == want_last
    assert all(1 <= x <= page_size for x in want_last)
    # every token's slot is (its page) * page_size + its offset: what FlashInfer will read
    for b, (row, n) in enumerate(zip(b_rows, b_lens, strict=True)):
        pages = lay.indices[lay.indptr[b]:lay.indptr[b + 1]].long()
        slots = (pages.unsqueeze(1) * page_size + torch.arange(page_size)).reshape(-1)[:n]
        assert torch.equal(slots, r2t[row, :n])


def test_paged_kv_layout_refuses_empty_requests():
    r2t = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="at least one token"):
        fia.paged_kv_layout(r2t, torch.tensor([0, 1]), [3, 0], 4)


def test_token_indptr():
    assert fia.token_indptr([3, 1, 4]).tolist() == [0, 3, 4, 8]
    assert fia.token_indptr([]).tolist() == [0]


# ------------------------------------------------------------------------------- a torch double of flashinfer
def _paged_attention(q, k_cache, v_cache, qo_indptr, indptr, indices, last, page_size,
                     window_left, scale, causal):
    """q [T, H, D] over each request's pages of an HND cache [pages, KVH, page_size, D], float32 math."""
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    out = torch.empty(q.shape, dtype=torch.float32)
    group = q.shape[1] // k_cache.shape[1]
    for b in range(len(last)):
        pages = indices[int(indptr[b]):int(indptr[b + 1])].long()
        kv_len = (pages.numel() - 1) * page_size + int(last[b])
        keys = k_cache[pages].permute(0, 2, 1, 3).reshape(-1, k_cache.shape[1], k_cache.shape[3])[:kv_len]
        values = v_cache[pages].permute(0, 2, 1, 3).reshape(-1, v_cache.shape[1], v_cache.shape[3])[:kv_len]
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        qb = q[lo:hi].float()
        q_abs = kv_len - (hi - lo) + torch.arange(hi - lo)
        kv_idx = torch.arange(kv_len)
        allowed = torch.ones(hi - lo, kv_len, dtype=torch.bool)
        if causal:
            allowed &= kv_idx[None, :] <= q_abs[:, None]
        if window_left >= 0:
            allowed &= kv_idx[None, :] >= q_abs[:, None] - window_left
        kk = keys.float().repeat_interleave(group, 1)
        vv = values.float().repeat_interleave(group, 1)
        s = torch.einsum("nhd,shd->hns", qb, kk) * scale
        s = s.masked_fill(~allowed, float("-inf"))
        out[lo:hi] = torch.einsum("hns,shd->nhd", s.softmax(-1), vv)
    return out


class _Planned:
    plans = 0

    def _plan_common(self, num_qo_heads, num_kv_heads, head_dim, page_size, window_left, q_data_type,
                     kv_data_type, sm_scale):
        if q_data_type not in HALF or kv_data_type not in HALF:
            raise ValueError(f"no kernel for {q_data_type} / {kv_data_type}")
        self.heads, self.kv_heads = num_qo_heads, num_kv_heads
        self.head_dim, self.page_size = head_dim, page_size
        self.window_left, self.q_dtype = window_left, q_data_type
        self.kv_dtype, self.scale = kv_data_type, sm_scale
        type(self).plans += 1
        self.plans_here = getattr(self, "plans_here", 0) + 1

    def _check_run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache
        if q.dtype != self.q_dtype or k_cache.dtype != self.kv_dtype:
            raise ValueError("dtypes differ from the plan's")
        assert q.shape[1:] == (self.heads, self.head_dim) and q.stride(-1) == 1
        assert k_cache.shape[1:] == (self.kv_heads, self.page_size, self.head_dim)  # HND
        return k_cache, v_cache


class FakeDecodeWrapper(_Planned):
    instances: list = []

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None):
        assert kv_layout == "HND"
        self.use_cuda_graph, self.use_tensor_cores = use_cuda_graph, use_tensor_cores
        self.indptr, self.indices, self.last = paged_kv_indptr_buffer, paged_kv_indices_buffer, \
            paged_kv_last_page_len_buffer
        if use_cuda_graph:
            assert len(self.indptr) == len(self.last) + 1
        FakeDecodeWrapper.instances.append(self)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             window_left=-1, q_data_type=torch.float16, kv_data_type=None, sm_scale=None):
        self._plan_common(num_qo_heads, num_kv_heads, head_dim, page_size, window_left, q_data_type,
                          kv_data_type or q_data_type, sm_scale)
        if self.use_cuda_graph:
            if len(last_page_len) != len(self.last):
                raise ValueError("The batch size should be fixed in cudagraph mode")
            if len(indices) > len(self.indices):
                raise ValueError("indices exceed the buffer")
            self.indptr.copy_(indptr)
            self.last.copy_(last_page_len)
            self.indices[:len(indices)].copy_(indices)
        else:
            self.indptr, self.indices, self.last = indptr.clone(), indices.clone(), last_page_len.clone()

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = self._check_run(q, paged_kv_cache)
        b = len(self.last)
        assert q.shape[0] == b
        out = _paged_attention(q, k_cache, v_cache, torch.arange(b + 1), self.indptr, self.indices, self.last,
                               self.page_size, self.window_left, self.scale, causal=False)
        return out.to(self.q_dtype)


class FakePrefillWrapper(_Planned):
    def __init__(self, workspace, kv_layout="NHD"):
        assert kv_layout == "HND"

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, *, causal=False, sm_scale=None, window_left=-1,
             q_data_type="float16", kv_data_type=None):
        self._plan_common(num_qo_heads, num_kv_heads, head_dim_qk, page_size, window_left, q_data_type,
                          kv_data_type or q_data_type, sm_scale)
        self.causal = causal
        self.args = [t.clone()
                     for t in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)]

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = self._check_run(q, paged_kv_cache)
        qo, ptr, idx, last = self.args
        assert q.shape[0] == int(qo[-1])
        return _paged_attention(q, k_cache, v_cache, qo, ptr, idx, last, self.page_size, self.window_left,
                                self.scale, self.causal).to(self.q_dtype)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = FakeDecodeWrapper
    mod.BatchPrefillWithPagedKVCacheWrapper = FakePrefillWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(fia, "WORKSPACE_BYTES", 1024)
    FakeDecodeWrapper.instances = []
    _Planned.plans = FakeDecodeWrapper.plans = FakePrefillWrapper.plans = 0
    return mod


# ------------------------------------------------------------------------------------------- backend vs dense
def dense(q, keys, values, q_pos, window, scale) -> torch.Tensor:
    """q [n, H, D], keys/values [S, KVH, D] (positions 0..S-1) -> [n, H * D], float64, causal + window."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    s = torch.einsum("nhd,shd->hns", q.double(), k) * scale
    kpos = torch.arange(keys.shape[0])[None, :]
    allowed = kpos <= q_pos[:, None]
    if window is not None:
        allowed &= kpos > q_pos[:, None] - window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hns,shd->nhd", s.softmax(-1), v).reshape(q.shape[0], -1)


class Seq:
    def __init__(self, row: int, kv_heads: int, d: int):
        self.row = row
        self.k = [torch.empty(0, kv_heads, d, dtype=torch.float64) for _ in range(LAYERS)]
        self.v = [torch.empty(0, kv_heads, d, dtype=torch.float64) for _ in range(LAYERS)]


def make_harness(kv_heads, d, page_size, kv_dtype, seed=0) -> Harness:
    h = Harness(LAYERS, kv_heads, d, page_size=page_size, num_pages=256 // page_size + 4, scramble_seed=seed)
    h.kv = KVPool(h.kv.num_pages, page_size, LAYERS, kv_heads, d, dtype=kv_dtype)
    return h


def run_step(backend, fb, seqs, gen, q_dtype):
    """Every layer of one batch through the backend, each checked against the dense reference over the
    K/V history (as the pool holds it); rows past the requests of `seqs` are padding."""
    pool = fb.kv_pool
    hkv, d = pool.kv_heads, pool.head_dim
    t = fb.input_ids.numel()
    q = torch.randn(t, backend.num_heads, d, generator=gen).to(q_dtype)
    k = torch.randn(t, hkv, d, generator=gen).to(q_dtype)
    v = torch.randn(t, hkv, d, generator=gen).to(q_dtype)
    lens = fb.extend_seq_lens[:len(seqs)]
    for layer in range(LAYERS):
        ql, kl, vl = q * (layer + 1), k + layer, v - layer  # a read of the wrong layer shows
        out = backend.forward(ql.reshape(t, -1), kl.reshape(t, -1), vl.reshape(t, -1), layer, fb)
        assert out.dtype == q_dtype and out.shape == (t, backend.num_heads * d)
        start = 0
        for seq, n in zip(seqs, lens, strict=True):
            prefix = seq.k[layer].shape[0]
            kk = torch.cat([seq.k[layer], kl[start:start + n].to(pool.dtype).double()])
            vv = torch.cat([seq.v[layer], vl[start:start + n].to(pool.dtype).double()])
            ref = dense(ql[start:start + n].to(pool.dtype), kk, vv, torch.arange(prefix, prefix + n),
                        backend.layer_window(layer), backend.scaling)
            err = (out[start:start + n].double() - ref).abs().max().item()
            assert err < 3e-2, f"layer {layer}: error {err}"
            start += n
    start = 0
    for seq, n in zip(seqs, lens, strict=True):
        for layer in range(LAYERS):
            seq.k[layer] = torch.cat([seq.k[layer], (k + layer)[start:start + n].to(pool.dtype).double()])
            seq.v[layer] = torch.cat([seq.v[layer], (v - layer)[start:start + n].to(pool.dtype).double()])
        start += n


CASES = [
    # heads, kv_heads, page_size, q dtype, kv cache dtype, window (on layer 1)
    (4, 2, 4, torch.bfloat16, torch.bfloat16, None),
    (8, 1, 16, torch.float16, torch.float16, 5),
    (16, 2, 1, torch.float32, torch.bfloat16, 6),  # group 8: the tensor-core decode; q cast to the cache's
]


@pytest.mark.parametrize("heads,kv_heads,page_size,q_dtype,kv_dtype,window", CASES)
def test_extend_chunked_decode_and_verify(fake_flashinfer, heads, kv_heads, page_size,
                                          q_dtype, kv_dtype, window):
    d = 16
    gen = torch.Generator().manual_seed(heads + page_size)
    backend = fia.FlashInferAttentionBackend(heads, kv_heads, d, window=window,
                                             window_layers=[1] if window else (), device="cpu")
    assert backend.use_tensor_cores == (heads // kv_heads > 4)
    assert all(w.use_tensor_cores == backend.use_tensor_cores for w in FakeDecodeWrapper.instances)
    h = make_harness(kv_heads, d, page_size, kv_dtype, seed=heads)
    seqs = [Seq(h.new_req(), kv_heads, d) for _ in range(3)]
    for lens in ([5, 1, 19], [3, 18, 1]):  # a first extend, then one on top of the cached prefixes
        fb = h.extend_batch([(s.row, [1] * n) for s, n in zip(seqs, lens, strict=True)])
        backend.init_forward_metadata(fb)
        run_step(backend, fb, seqs, gen, q_dtype)
    for _ in range(3):
        fb = h.decode_batch([(s.row, 1) for s in seqs])
        backend.init_forward_metadata(fb)
        run_step(backend, fb, seqs, gen, q_dtype)
    fb = h.extend_batch([(s.row, [1] * 4) for s in seqs])
    fb.mode = ForwardMode.VERIFY
    backend.init_forward_metadata(fb)
    run_step(backend, fb, seqs, gen, q_dtype)


def test_each_wrapper_planned_once_per_batch(fake_flashinfer):
    """Two layers, one windowed: a batch plans its full and its windowed wrapper once each, whatever the
    number of layers; a backend whose every layer is windowed never plans a full-attention wrapper."""
    gen = torch.Generator().manual_seed(1)
    backend = fia.FlashInferAttentionBackend(4, 2, 16, window=4, window_layers=[1], device="cpu")
    h = make_harness(2, 16, 4, torch.bfloat16)
    seqs = [Seq(h.new_req(), 2, 16)]
    fb = h.extend_batch([(seqs[0].row, [1] * 9)])
    backend.init_forward_metadata(fb)
    run_step(backend, fb, seqs, gen, torch.bfloat16)
    assert [w.plans_here for w in backend._prefill.values()] == [1, 1]
    for wl in (-1, 3):  # asked again for the same batch: its plan is still in the wrapper
        assert backend._wrapper(fb.attn_metadata, wl) is backend._prefill[wl]
    assert [w.plans_here for w in backend._prefill.values()] == [1, 1]
    assert all(w.window_left == wl for wl, w in backend._prefill.items()) \
        and sorted(backend._prefill) == [-1, 3]
    fb = h.decode_batch([(seqs[0].row, 1)])
    backend.init_forward_metadata(fb)
    run_step(backend, fb, seqs, gen, torch.bfloat16)
    assert [w.plans_here for w in backend._decode.values()] == [1, 1]

    windowed = fia.FlashInferAttentionBackend(4, 2, 16, window=4, window_layers=[0, 1], device="cpu")
    h2 = make_harness(2, 16, 4, torch.bfloat16)
    seqs2 = [Seq(h2.new_req(), 2, 16)]
    fb = h2.extend_batch([(seqs2[0].row, [1] * 6)])
    windowed.init_forward_metadata(fb)
    run_step(windowed, fb, seqs2, gen, torch.bfloat16)
    assert getattr(windowed._prefill[-1], "plans_here", 0) == 0
    assert windowed._prefill[3].plans_here == 1


def test_float32_cache_is_refused_with_the_flags(fake_flashinfer):
    backend = fia.FlashInferAttentionBackend(4, 2, 16, device="cpu")
    h = make_harness(2, 16, 4, torch.float32)
    fb = h.extend_batch([(h.new_req(), [1, 2, 3])])
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16"):
        backend.init_forward_metadata(fb)


def test_cuda_graph_capture_and_padded_replay(fake_flashinfer):
    """Capture a 4-row decode batch, then replay three real requests padded to 4 rows twice, as the graph
    runner does: the captured metadata (its wrappers over the graph buffers, refilled by each replay's
    plan) gives the dense reference's rows, the padding row writing slot 0 only."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, d, ps = 4, 2, 16, 4
    backend = fia.FlashInferAttentionBackend(heads, kv_heads, d, window=3, window_layers=[0], device="cpu")
    h = make_harness(kv_heads, d, ps, torch.bfloat16)
    seqs = [Seq(h.new_req(), kv_heads, d) for _ in range(3)]
    fb = h.extend_batch([(s.row, [1] * n) for s, n in zip(seqs, [7, 2, 13], strict=True)])
    backend.init_forward_metadata(fb)
    run_step(backend, fb, seqs, gen, torch.bfloat16)

    max_bs, size = 6, 4
    backend.init_cuda_graph_state(max_bs=max_bs, max_context_len=64)
    static = {n: torch.zeros(max_bs, dtype=torch.int64) for n in ("ids", "pos", "loc", "rows")}

    def static_batch(seq_lens):
        return ForwardBatch(ForwardMode.DECODE, static["ids"][:size],
                            static["pos"][:size], static["loc"][:size],
                            static["rows"][:size], seq_lens, [0] * size, [1] * size, h.kv, h.r2t.req_to_token)

    captured_fb = static_batch([1] * size)
    backend.init_forward_metadata_capture(captured_fb)
    captured = captured_fb.attn_metadata
    assert captured.write_rows is None and set(captured.graph) == {-1, 2}
    graph_wrappers = [w for w in FakeDecodeWrapper.instances if w.use_cuda_graph]
    assert len(graph_wrappers) == 2 and all(len(w.last) == size for w in graph_wrappers)
    with pytest.raises(ValueError, match="no CUDA graph was captured"):
        backend.init_forward_metadata_replay(ForwardBatch(
            ForwardMode.DECODE, static["ids"][:2], static["pos"][:2], static["loc"][:2], static["rows"][:2],
            [1, 1], [0, 0], [1, 1], h.kv, h.r2t.req_to_token))

    for _ in range(2):
        real = h.decode_batch([(s.row, 1) for s in seqs])
        for name, src in (("ids", real.input_ids), ("pos", real.positions), ("loc", real.out_cache_loc),
                          ("rows", real.req_pool_indices)):
            static[name][:3].copy_(src)
            static[name][3:size].zero_()
        backend.init_forward_metadata_replay(static_batch(list(real.seq_lens) + [1]))
        before = h.kv.data.clone()
        captured_fb.attn_metadata = captured  # what the captured forward reads
        run_step(backend, captured_fb, seqs, gen, torch.bfloat16)
        # only the real rows' slots and the padding slot 0 changed
        changed = (h.kv.data != before).any(dim=(1, 2, 3, 4, 5)).nonzero().reshape(-1).tolist()
        pages = {int(s) // ps for s in real.out_cache_loc} | {0}
        assert set(changed) <= pages
