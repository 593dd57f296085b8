"""The Triton attention kernels (and FlashInfer's, where importable) against the torch_native backend on
CUDA: a shape sweep of GQA groups, page sizes, head sizes, a sliding window and float32 / bfloat16 /
float16 (a KV cache dtype other than q's too), over extend, extend on a cached prefix (chunked prefill),
decode and verify batches of requests that cross the kernels' query and key blocks.

The outputs are compared with torch_native run in float32 on the same inputs (K/V rounded to the cache's
dtype) over a float32 pool: torch_native in bfloat16 rounds its scores to bfloat16 and would be the
coarser of the two. torch_native also runs in the case's own dtypes, on a pool of its own: after every
batch each backend's pool must hold the same bytes as that one (the store kernel)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.forward_batch import ForwardMode
from common.layers.attention_backend import create_attention_backend
from common.memory.kv_pool import KVPool
from tests.gpu.conftest import needs_flashinfer
from tests.model_harness import Harness

LAYERS = 2
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}
CASES = [
    # group, kv_heads, page_size, head_dim, q dtype, kv cache dtype, window (on layer 1)
    (1, 2, 1, 64, torch.float32, torch.float32, None),
    (4, 2, 16, 128, torch.bfloat16, torch.bfloat16, None),
    (7, 1, 16, 80, torch.float16, torch.float16, None),
    (2, 2, 16, 64, torch.float32, torch.bfloat16, None),
    (4, 1, 16, 128, torch.bfloat16, torch.bfloat16, 24),
    (8, 1, 1, 256, torch.bfloat16, torch.bfloat16, None),
]


def _sweep(names, group, kv_heads, page_size, d, dtype, kv_dtype, window):
    dev = torch.device("cuda")
    heads = group * kv_heads
    def backend(name):
        return create_attention_backend(name, heads, kv_heads, d, window=window,
                                        window_layers=[1] if window else (), device=dev)

    backends = {n: backend(n) for n in names}
    backends["reference"] = backend("torch_native")
    h = Harness(LAYERS, kv_heads, d, page_size=page_size,
                num_pages=1024 // page_size + 8, scramble_seed=group)
    pools = {n: KVPool(h.kv.num_pages, page_size, LAYERS, kv_heads, d, dtype=torch.float32 if n == "reference"
                       else kv_dtype, device=dev) for n in backends}
    gen = torch.Generator(device=dev).manual_seed(group * 1000 + d)
    rows = [h.new_req() for _ in range(3)]
    batches = [h.extend_batch([(r, [1] * n) for r, n in zip(rows, (5, 70, 130), strict=True)]),
               h.extend_batch([(r, [1] * n) for r, n in zip(rows, (3, 64, 1), strict=True)])]
    batches += [h.decode_batch([(r, 1) for r in rows]) for _ in range(2)]
    verify = h.extend_batch([(r, [1] * 4) for r in rows])
    verify.mode = ForwardMode.VERIFY
    batches.append(verify)
    for host_fb in batches:
        t = host_fb.input_ids.numel()
        q = torch.randn(t, heads * d, device=dev, generator=gen).to(dtype)
        k = torch.randn(t, kv_heads * d, device=dev, generator=gen).to(dtype)
        v = torch.randn(t, kv_heads * d, device=dev, generator=gen).to(dtype)
        r2t = h.r2t.req_to_token.to(dev)
        outs = {}
        for n, b in backends.items():
            fb = dataclasses.replace(host_fb, kv_pool=pools[n], req_to_token=r2t,
                                     attn_metadata=None, extras={})
            fb.to_device(dev)
            b.init_forward_metadata(fb)
            if n == "reference":
                outs[n] = [b.forward((q * (i + 1)).float(), (k + i).to(kv_dtype).float(),
                                     (v - i).to(kv_dtype).float(), i, fb) for i in range(LAYERS)]
            else:
                outs[n] = [b.forward(q * (i + 1), k + i, v - i, i, fb) for i in range(LAYERS)]
        ref = outs["reference"]
        # a cache coarser than q: backends may attend to the new tokens' K/V as given or as stored
        tol = max(TOL[dtype], TOL[kv_dtype])
        for n in names:
            if n == "torch_native":
                continue  # (its bfloat16 scores are the coarse ones: the pool bytes are what it is here for)
            for i in range(LAYERS):
                assert outs[n][i].dtype == dtype and outs[n][i].shape == (t, heads * d)
                # relative to the outputs' size: a half-precision output is rounded at its own scale
                scale = max(1.0, ref[i].abs().max().item())
                err = (outs[n][i].float() - ref[i].float()).abs().max().item() / scale
                assert err < tol, f"{n} layer {i} {host_fb.mode.name}: error {err} of the largest output"
            assert torch.equal(pools[n].data, pools["torch_native"].data), f"{n}: the pools differ"


@pytest.mark.parametrize("group,kv_heads,page_size,d,dtype,kv_dtype,window", CASES)
def test_triton_matches_torch_native(group, kv_heads, page_size, d, dtype, kv_dtype, window):
    _sweep(["torch_native", "triton"], group, kv_heads, page_size, d, dtype, kv_dtype, window)


@pytest.mark.parametrize("group,kv_heads,page_size,d,dtype,kv_dtype,window",
                         [c for c in CASES if c[5] != torch.float32 and c[3] in (64, 128, 256)])
def test_flashinfer_matches_torch_native(group, kv_heads, page_size, d, dtype, kv_dtype, window):
    needs_flashinfer()
    _sweep(["torch_native", "flashinfer"], group, kv_heads, page_size, d, dtype, kv_dtype, window)
