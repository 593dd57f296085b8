"""The attention backend interface, and the choice of one (`--attention-backend`).

A model's attention layers hand their new tokens' q, k and v to the backend the runner gave the
model; the backend stores k and v in the paged KV pool and attends over each request's tokens.
Per batch the runner (or the model's forward) calls `init_forward_metadata(fb)` once: it builds
whatever the layers share (gather rows, masks, page tables, a FlashInfer plan) and leaves it in
`fb.attn_metadata`. Each layer then calls `forward(q, k, v, layer_id, fb)`, which goes to
`forward_decode` (one new token per request) or `forward_extend` (new tokens on top of a cached
prefix, chunked prefill and speculative verify included).

Shapes: q `[T, heads * head_dim]`, k and v `[T, kv_heads * head_dim]` (the T new tokens of the
batch, requests one after the other), the result `[T, heads * head_dim]`. GQA: query head `h`
reads KV head `h // (heads // kv_heads)`. Sliding window: on `window_layers` a query at position i
sees keys j with `i - window < j <= i`; other layers see every earlier key.

CUDA graphs (`common/cuda_graph.py`): a backend with `supports_cuda_graph` keeps its decode
metadata in buffers sized once (`init_cuda_graph_state`), so a captured decode step reads new
metadata after `init_forward_metadata_replay` wrote it in place.

Backends:
* `native` (CPU): the C kernels of `common/layers/native.py` for decode and prefill, torch where
  they do not apply (`common/layers/attention.py`); the CPU default;
* `torch_native`: the same batches through torch ops only, on any device: the reference;
* `triton`: Triton kernels over the paged pool (`common/layers/triton_attention.py`), on CUDA, or
  on CPU tensors under `TRITON_INTERPRET=1`;
* `flashinfer`: FlashInfer's paged decode and prefill wrappers (`common/layers/flashinfer_attention.py`),
  CUDA only, with the optional `flashinfer-python` package.
"""

from __future__ import annotations

from typing import Any

import torch

from common.forward_batch import ForwardBatch, ForwardMode

ATTENTION_BACKENDS = ("native", "torch_native", "triton", "flashinfer")


class AttentionBackend:
    name = ""
    supports_cuda_graph = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float | None = None, *,
                 window: int | None = None, window_layers=(), device: torch.device | str = "cpu") -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads} KV heads")
        if window is not None and window < 1:
            raise ValueError(f"sliding window must be at least 1 token, got {window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim ** -0.5 if scaling is None else scaling
        self.window = window if window_layers else None
        self.window_layers = frozenset(window_layers) if window else frozenset()
        self.device = torch.device(device)

    def layer_window(self, layer_id: int) -> int | None:
        """The sliding window of a layer, None where it sees every earlier key."""
        return self.window if layer_id in self.window_layers else None

    # ---- per batch
    def init_forward_metadata(self, fb: ForwardBatch) -> Any:
        raise NotImplementedError

    # ---- per layer
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                fb: ForwardBatch) -> torch.Tensor:
        if fb.mode == ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer_id, fb)
        return self.forward_extend(q, k, v, layer_id, fb)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       fb: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                       fb: ForwardBatch) -> torch.Tensor:
        raise NotImplementedError

    # ---- CUDA graphs (decode only)
    def init_cuda_graph_state(self, max_bs: int, max_context_len: int) -> None:
        raise NotImplementedError(f"the {self.name} attention backend cannot run in a CUDA graph")

    def init_forward_metadata_capture(self, fb: ForwardBatch) -> None:
        """Metadata for a decode batch about to be captured, in the buffers of `init_cuda_graph_state`."""
        raise NotImplementedError(f"the {self.name} attention backend cannot run in a CUDA graph")

    def init_forward_metadata_replay(self, fb: ForwardBatch) -> None:
        """Write a (padded) decode batch's metadata into the captured buffers, in place."""
        raise NotImplementedError(f"the {self.name} attention backend cannot run in a CUDA graph")


def create_attention_backend(name: str, num_heads: int, num_kv_heads: int, head_dim: int, *,
                             scaling: float | None = None, window: int | None = None, window_layers=(),
                             device: torch.device | str = "cpu") -> AttentionBackend:
    """The backend `--attention-backend` names, for this rank's heads; a sliding window on `window_layers`."""
    device = torch.device(device)
    kw = dict(scaling=scaling, window=window, window_layers=window_layers, device=device)
    if name in ("native", "torch_native"):
        if name == "native" and device.type != "cpu":
            raise ValueError(f"--attention-backend native runs the CPU kernels; on {device.type} choose "
                             "torch_native, triton or flashinfer")
        native = name == "native"
        if window_layers:
            from common.layers.sliding_window import SlidingWindowAttentionBackend

            return SlidingWindowAttentionBackend(num_heads, num_kv_heads, head_dim, native=native, **kw)
        from common.layers.attention import TorchAttentionBackend

        return TorchAttentionBackend(num_heads, num_kv_heads, head_dim, native=native, **kw)
    if name == "triton":
        from common.layers.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, **kw)
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("--attention-backend flashinfer runs on CUDA only (--device cuda)")
        from common.layers.flashinfer_attention import FlashInferAttentionBackend

        return FlashInferAttentionBackend(num_heads, num_kv_heads, head_dim, **kw)
    raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(ATTENTION_BACKENDS)})")
