"""What the runner, the scheduler and the PD roles need to know about hybrid and sliding-window models.

* Hybrid models (Qwen3.5: linear-attention layers) keep per-request state besides the KV pages. A
  `StatePool` with one slot per request row is attached to the `ReqToTokenPool` (the row's slot is
  taken and returned with the row, so a decode node's preallocated row reserves the slot the
  transfer writes into) and bound to the model; `state_indices(fb)` gives the forward its slots.
  For transfer it reports `state_type` "mamba", the pool's buffers (`state_buffers()`) and their
  leading dimensions (key heads / value heads of this rank, `state_leading_dims()`), which the
  transfer layer slices for M:N TP; the last chunk moves the request's slot into the slot of the
  decode node's preallocated row. The prebuilt request keeps that row, so its first decode step
  reads the received state in place (no copy). A retracted request gives its row and slot back like
  its KV; the host store (`common/memory/host_store.py`) keeps a copy of the slot with the KV and
  writes it into the new row's slot when it resumes; without an entry its re-prefill of prompt +
  output starts from zero state (position 0). Either way it continues with exactly the state it had.
  Prefix caching is off for them: a cached KV prefix does not give back the recurrent state at the
  end of that prefix (the state is a running summary of every earlier token, kept only for the
  position the request reached), so a radix hit would have to recompute the prefix anyway.
  Speculative decoding (NGRAM, EAGLE / MTP) rolls the state back as it rolls back KV slots: a verify forward
  advances a copy of each request's state token by token and records it after each token; once the
  scheduler knows how many tokens it kept, `keep_verified` writes the state after the last of them.
* Sliding-window models where every layer is windowed (`model.kv_window()`) only ever read the KV of
  a request's last `window` tokens: `state_type` "swa", and a prefill node sends (a decode node
  receives) only the pages from `first_window_page` on. Their pages stay allocated for the whole
  sequence (the radix cache keeps working for them); pages before the window are just never read.
"""

from __future__ import annotations

import logging

import torch

from common.forward_batch import ForwardBatch
from common.layers.sliding_window import window_start
from common.memory.req_to_token import ReqToTokenPool
from common.memory.state_pool import StatePool

logger = logging.getLogger(__name__)


def first_window_page(seq_len: int, window: int | None, page_size: int) -> int:
    """Index (within the request) of the first page a query after `seq_len` tokens can still read."""
    if not window:
        return 0
    return window_start(seq_len, window) // page_size


class HybridSupport:
    def __init__(self, model, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.dtype = dtype
        self.device = torch.device(device)
        # a model with recurrent state; `spec` is None for a pipeline stage without linear-attention layers
        self.recurrent = bool(getattr(model, "is_hybrid", False))
        self.spec = model.state_spec() if self.recurrent else None
        self.window = model.kv_window() if hasattr(model, "kv_window") else None
        self.state_pool: StatePool | None = None

    @property
    def has_state(self) -> bool:
        """Whether this rank keeps state slots (a hybrid model's pipeline stage may hold none)."""
        return self.spec is not None

    @property
    def supports_radix_cache(self) -> bool:
        return not self.recurrent

    @property
    def state_type(self) -> str:
        if self.recurrent:
            return "mamba"
        return "swa" if self.window else "none"

    def attach(self, req_pool: ReqToTokenPool) -> None:
        """Give `req_pool` (a fresh one: no row handed out) a state slot per row."""
        if self.spec is None:
            return
        pool = StatePool(req_pool.size, *self.spec.pool_args(), dtype=self.dtype, device=self.device)
        req_pool.attach_state_pool(pool)
        self.model.bind_state_pool(pool)
        self.state_pool = pool
        logger.info("state pool: %d slots x %d linear layers, conv %s + recurrent %s per layer (%.1f MiB)",
                    req_pool.size, len(self.spec.layer_ids), self.spec.conv_shape, self.spec.recurrent_shape,
                    pool.nbytes() / 2**20)

    def state_indices(self, req_pool: ReqToTokenPool, fb: ForwardBatch) -> torch.Tensor | None:
        if self.spec is None:
            return None
        return req_pool.state_indices(fb.req_pool_indices)

    def keep_verified(self, fb: ForwardBatch, kept: list[int]) -> None:
        """After a speculative verify forward: request i's state becomes the one after its first
        `kept[i]` tokens (its last token and the confirmed drafts; the verify forward left the slot
        as it was and recorded the state after each token). kept 0 (a request already finished)
        leaves the slot alone."""
        steps = fb.extras.pop("verify_states", None)
        if self.state_pool is None or steps is None:
            return
        rows = [i for i, n in enumerate(kept) if n > 0]
        if not rows:
            return
        idx = torch.tensor(rows, dtype=torch.int64)
        at = torch.tensor([kept[i] - 1 for i in rows], dtype=torch.int64)
        slots = fb.state_indices[idx]
        for layer_id, (conv, rec) in steps.items():
            conv_buf, rec_buf = self.state_pool.conv(layer_id), self.state_pool.recurrent(layer_id)
            conv_buf[slots] = conv[idx, at].reshape(len(rows), *conv_buf.shape[1:])
            rec_buf[slots] = rec[idx, at]

    def state_buffers(self) -> list[torch.Tensor]:
        """The state pool's tensors (`[slots, leading_dim, ...]`, one item per slot), empty without one."""
        return self.state_pool.buffers() if self.state_pool is not None else []

    def state_layer_ids(self) -> list[int]:
        """The model layer each state buffer belongs to (`state_buffers()` order)."""
        return self.state_pool.buffer_layer_ids() if self.state_pool is not None else []

    def state_leading_dims(self) -> list[int]:
        """Leading dimension of each state buffer's item on this rank (the one split over TP ranks)."""
        return self.state_pool.leading_dims() if self.state_pool is not None else []

    def stats(self) -> dict:
        """State slot counts for the scheduler's stats (empty for models without state)."""
        if self.state_pool is None:
            return {}
        return {"state_slots_free": self.state_pool.available_size(),
                "state_slots_total": self.state_pool.size}

    def first_sent_page(self, seq_len: int, page_size: int) -> int:
        """First page of a request (of `seq_len` tokens) that a prefill node sends (swa: the window's)."""
        return first_window_page(seq_len, self.window, page_size)
