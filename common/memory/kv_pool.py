"""The KV cache: per layer one K and one V buffer, laid out page-major then head-major.

Each buffer has shape `[num_pages, kv_heads, page_size, head_dim]`, contiguous. So:
* one page of one layer is one contiguous region (`page_bytes`), which transfer engines move as
  a single descriptor, and runs of consecutive pages coalesce into one region;
* within a page, the heads are contiguous too (`head_bytes` each), so a head slice of a page
  (needed when prefill and decode use different TP sizes) is also one contiguous region.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_pages: int, page_size: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, layer_ids: list[int] | None = None) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        # model layer id -> buffer index (hybrid models keep KV only for their attention layers)
        self.layer_ids = list(range(num_layers)) if layer_ids is None else list(layer_ids)
        self._index = {lid: i for i, lid in enumerate(self.layer_ids)}
        shape = (num_pages, kv_heads, page_size, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype) for _ in self.layer_ids]
        self.v_buffers = [torch.zeros(shape, dtype=dtype) for _ in self.layer_ids]

    @property
    def head_bytes(self) -> int:
        """Bytes of one head's slice of one page."""
        return self.page_size * self.head_dim * self.k_buffers[0].element_size()

    @property
    def page_bytes(self) -> int:
        return self.kv_heads * self.head_bytes

    def nbytes(self) -> int:
        return 2 * len(self.layer_ids) * self.num_pages * self.page_bytes

    def k(self, layer_id: int) -> torch.Tensor:
        return self.k_buffers[self._index[layer_id]]

    def v(self, layer_id: int) -> torch.Tensor:
        return self.v_buffers[self._index[layer_id]]

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ([n, kv_heads, head_dim]) into their slots."""
        pages = slots // self.page_size
        offs = slots % self.page_size
        i = self._index[layer_id]
        # advanced indices around a slice: the result is indexed [n, heads, dim]
        self.k_buffers[i][pages, :, offs, :] = k.to(self.dtype)
        self.v_buffers[i][pages, :, offs, :] = v.to(self.dtype)

    def set_kv_rows(self, layer_id: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fast path of `set_kv`: `rows` `[n * kv_heads]` are the flat buffer rows (see `flat_rows`)
        of the new tokens' heads, in `[n, kv_heads]` order; k/v are `[n, kv_heads, head_dim]`."""
        i = self._index[layer_id]
        d = self.head_dim
        self.k_buffers[i].view(-1, d).index_copy_(0, rows, k.reshape(-1, d).to(self.dtype))
        self.v_buffers[i].view(-1, d).index_copy_(0, rows, v.reshape(-1, d).to(self.dtype))

    def flat_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows `[n * kv_heads]` (`[n, kv_heads]` order) of `slots` `[n]` in a buffer viewed as
        `[num_pages * kv_heads * page_size, head_dim]`."""
        ps = self.page_size
        heads = torch.arange(self.kv_heads, dtype=torch.int64)
        rows = ((slots // ps).unsqueeze(1) * self.kv_heads + heads) * ps + (slots % ps).unsqueeze(1)
        return rows.reshape(-1)

    def buffers(self) -> list[torch.Tensor]:
        """All buffers in a fixed order (K of each layer, then V of each layer), for registration."""
        return self.k_buffers + self.v_buffers
