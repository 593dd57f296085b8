"""CUDA graphs of the decode forward: captured once per batch size, replayed with a batch padded to the
next captured size.

A decode step of a small batch is a few hundred small kernels whose launches take longer than their
work; a captured graph launches them all at once. A graph replays fixed addresses, so everything the
forward reads lives in static buffers (`max_bs` rows, on the device): input ids, positions, KV slots of
the new tokens, request rows and, for hybrid models, state slots; the logits go to one static
`[max_bs, vocab]` buffer. What the attention kernels read per batch (page tables, lengths) is the
backend's: `init_cuda_graph_state` sizes it once, `init_forward_metadata_capture` fills it for a
capture, `init_forward_metadata_replay` rewrites it in place before each replay (outside the graph).

Sizes: 1, 2, 4, 8, then every multiple of 8 up to `max_bs`, and `max_bs` itself (SGLang's scheme); a
batch of b requests runs in the smallest captured size >= b. Padded rows read and write harmlessly:
input id 0, position 0, KV slot 0 (the pool's padding page), request row 0 with one token (any row is
a valid table row; the row's first slot is only read), state slot 0 (the state pool's scratch slot).

Capture (`capture_all`): largest size first, so the smaller graphs fit in the memory the larger one
reserved in the private pool that every size shares; each after warm-up forwards (the first runs of a
kernel compile or autotune it, and allocations settle), under `torch.inference_mode`. The forward
must not read device values on the host while it is captured (no `.item()`, `int(t)`, `.tolist()`).

`capture`: how a graph is made from the forward; None is `TorchGraphCapture` (torch.cuda.CUDAGraph).
A stand-in takes the same call, `capture(fn) -> (graph, out)` with `graph.replay()` running `fn` again
into `out`, so the buffers, the padding and the metadata replay are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.forward_batch import ForwardBatch, ForwardMode

WARMUP_RUNS = 2


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, multiples of 8 up to `max_bs`, and `max_bs`."""
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be at least 1, got {max_bs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class TorchGraphCapture:
    """Captures with torch.cuda.graph, every graph on one private memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out


class CudaGraphRunner:
    def __init__(self, model, attn_backend, kv_pool, req_to_token: torch.Tensor, max_bs: int,
                 device: torch.device | str, state_pool=None, capture=None) -> None:
        if not attn_backend.supports_cuda_graph:
            raise ValueError(f"the {attn_backend.name} attention backend cannot run in a CUDA graph: use "
                             "--attention-backend triton or flashinfer, or --disable-cuda-graph")
        self.model = model
        self.attn_backend = attn_backend
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.device = torch.device(device)
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = max_bs
        self.capture = TorchGraphCapture(self.device) if capture is None else capture

        def rows() -> torch.Tensor:
            return torch.zeros(max_bs, dtype=torch.int64, device=self.device)

        self.input_ids = rows()
        self.positions = rows()
        self.out_cache_loc = rows()
        self.req_pool_indices = rows()
        self.state_indices = rows() if state_pool is not None else None
        self.logits: torch.Tensor | None = None  # [max_bs, vocab], made by the first (largest) capture
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        attn_backend.init_cuda_graph_state(max_bs, req_to_token.shape[1])

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture_all(self) -> None:
        for bs in reversed(self.batch_sizes):
            self._capture(bs)

    def _static_batch(self, bs: int, seq_lens: list[int], prefix_lens: list[int]) -> ForwardBatch:
        """A decode batch of the first `bs` rows of the static buffers."""
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[:bs], positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=seq_lens, extend_prefix_lens=prefix_lens, extend_seq_lens=[1] * bs, kv_pool=self.kv_pool,
            req_to_token=self.req_to_token,
            state_indices=None if self.state_indices is None else self.state_indices[:bs])

    def _capture(self, bs: int) -> None:
        for buf in (self.input_ids, self.positions, self.out_cache_loc,
                    self.req_pool_indices, self.state_indices):
            if buf is not None:
                buf[:bs].zero_()
        fb = self._static_batch(bs, [1] * bs, [0] * bs)
        self.attn_backend.init_forward_metadata_capture(fb)
        md = fb.attn_metadata

        def run_once() -> torch.Tensor:
            fb.attn_metadata = md
            logits = self.model.forward(fb)
            if self.logits is None:
                self.logits = torch.empty(self.max_bs, logits.shape[-1],
                                          dtype=logits.dtype, device=self.device)
            out = self.logits[:bs]
            out.copy_(logits)
            return out

        for _ in range(WARMUP_RUNS):
            run_once()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.graphs[bs], self.outputs[bs] = self.capture(run_once)

    # ------------------------------------------------------------------ replay
    def can_run(self, fb: ForwardBatch) -> bool:
        """Whether `fb` can replay a graph: a decode batch of at most `max_bs` requests that wants every
        row's logits in order and nothing else (a batch with extras, such as the draft layers' hidden
        states, runs eagerly). A host `logits_indices` is checked to be 0..bs-1; a device one only for
        its length (one row per request, as a decode batch has), so that asking costs no device read."""
        if fb.mode != ForwardMode.DECODE or not 1 <= fb.batch_size <= self.max_bs or fb.extras:
            return False
        if self.state_indices is not None and fb.state_indices is None:
            return False
        idx = fb.logits_indices
        if idx is None:
            return True
        bs = fb.batch_size
        if idx.numel() != bs:
            return False
        return idx.device.type != "cpu" or torch.equal(idx.reshape(-1), torch.arange(bs, dtype=idx.dtype))

    def padded_size(self, bs: int) -> int:
        for s in self.batch_sizes:
            if s >= bs:
                return s
        raise ValueError(f"a decode batch of {bs} exceeds --cuda-graph-max-bs {self.max_bs}")

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """The logits `[bs, vocab]` of a decode batch (`can_run`), a view of the static buffer that the
        next replay overwrites."""
        bs = fb.batch_size
        size = self.padded_size(bs)
        if self.state_indices is not None and fb.state_indices is None:
            raise ValueError("a hybrid model's decode batch needs fb.state_indices to replay a CUDA graph")
        if size not in self.graphs:
            raise RuntimeError(f"no CUDA graph captured for batch size {size}: call capture_all() first")
        real = [(self.input_ids, fb.input_ids), (self.positions, fb.positions),
                (self.out_cache_loc, fb.out_cache_loc), (self.req_pool_indices, fb.req_pool_indices)]
        if self.state_indices is not None:
            real.append((self.state_indices, fb.state_indices))
        for buf, src in real:
            buf[:bs].copy_(src, non_blocking=True)
            if size > bs:
                buf[bs:size].zero_()  # id 0, position 0, slot 0, row 0, state slot 0
        pad = size - bs
        padded = self._static_batch(size, list(fb.seq_lens) + [1] * pad,
                                    list(fb.extend_prefix_lens) + [0] * pad)
        self.attn_backend.init_forward_metadata_replay(padded)
        self.graphs[size].replay()
        return self.outputs[size][:bs]
