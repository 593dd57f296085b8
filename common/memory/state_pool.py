"""Per-request state slots for hybrid models (linear-attention layers keep a fixed-size state
instead of a KV cache that grows with the sequence).

Every linear-attention layer owns two buffers:
* conv state `[size + 1, *conv_shape]`: the last `kernel - 1` inputs of the causal conv1d;
* recurrent state `[size + 1, *recurrent_shape]`: the gated delta rule's `[heads, k_dim, v_dim]` matrix.

A slot is one row of every buffer; each buffer is contiguous, so one slot of one buffer is one
contiguous region of `item_bytes[i]` bytes (what the transfer layer moves), and the leading dimension
of a slot (`leading_dims()`: heads on this TP rank) is the dimension split across TP ranks.
Slot 0 is the padding slot (never handed out); real slots are 1..size.
"""

from __future__ import annotations

import torch


class OutOfStateSlots(RuntimeError):
    """Every state slot is taken (the caller waits or retracts)."""


class StatePool:
    def __init__(self, size: int, layers: list[int], conv_shape: tuple[int, ...],
                 recurrent_shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if size < 1:
            raise ValueError("the state pool needs at least one slot")
        if not layers:
            raise ValueError("a state pool without linear-attention layers holds nothing")
        self.size = size
        self.layer_ids = list(layers)
        self._index = {lid: i for i, lid in enumerate(self.layer_ids)}
        self.conv_shape = tuple(conv_shape)
        self.recurrent_shape = tuple(recurrent_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.conv_buffers = [torch.zeros((size + 1, *self.conv_shape), dtype=dtype, device=self.device)
                             for _ in self.layer_ids]
        self.recurrent_buffers = [torch.zeros((size + 1, *self.recurrent_shape),
                                              dtype=dtype, device=self.device)
                                  for _ in self.layer_ids]
        self._free: list[int] = list(range(size, 0, -1))  # pop() hands out low slots first
        self._taken: set[int] = set()

    # ---- slots
    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """Take a zeroed slot."""
        if not self._free:
            raise OutOfStateSlots(f"all {self.size} state slots are in use")
        slot = self._free.pop()
        self._taken.add(slot)
        self.clear(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._taken:
            raise ValueError(f"state slot {slot} is not allocated")
        self._taken.remove(slot)
        self._free.append(slot)

    def clear(self, slot: int) -> None:
        """Zero one slot in every layer (a request starting from an empty sequence)."""
        for buf in self.conv_buffers:
            buf[slot].zero_()
        for buf in self.recurrent_buffers:
            buf[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        for buf in self.conv_buffers + self.recurrent_buffers:
            buf[dst].copy_(buf[src])

    # ---- model access
    def conv(self, layer_id: int) -> torch.Tensor:
        return self.conv_buffers[self._index[layer_id]]

    def recurrent(self, layer_id: int) -> torch.Tensor:
        return self.recurrent_buffers[self._index[layer_id]]

    # ---- transfer registration
    def buffers(self) -> list[torch.Tensor]:
        """All buffers in a fixed order: conv of each layer, then recurrent of each layer."""
        return self.conv_buffers + self.recurrent_buffers

    def buffer_layer_ids(self) -> list[int]:
        """The layer id of each buffer of `buffers()`."""
        return self.layer_ids + self.layer_ids

    @property
    def item_bytes(self) -> list[int]:
        """Bytes of one slot of each buffer of `buffers()`."""
        return [b[0].numel() * b.element_size() for b in self.buffers()]

    def leading_dims(self) -> list[int]:
        """Leading dimension of one slot of each buffer (the TP-split dimension: heads on this rank)."""
        return [int(b.shape[1]) for b in self.buffers()]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())
