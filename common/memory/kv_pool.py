"""The KV cache: one allocation, laid out page-first, then K/V, then layer, then head.

`data` has shape `[num_pages, 2, num_layers, kv_heads, page_size, head_dim]`, contiguous. So:
* one page of every layer's K and V is one contiguous region (`page_stride` bytes), and a run of
  consecutive pages is one region too: a transfer engine moves a request's KV as one descriptor per
  page run instead of one per page run, layer and K/V;
* one page of one layer's K (or V) is one contiguous region (`page_bytes`), and so is a head slice
  of it (`head_bytes` each), which is what moves when prefill and decode use different TP sizes.

The layer views `k(layer_id)` / `v(layer_id)` (`[num_pages, kv_heads, page_size, head_dim]`) are
strided. Attention reads and writes through the flat view `[rows, head_dim]` of the whole pool:
`token_rows(slots)` gives the rows of K of the first layer, and a layer's K / V rows are those plus
`layer_offset(layer_id)` / plus `v_offset` more.

Single plane (`shared_kv=True`, multi-head latent attention: common/models/deepseek_v3.py): K and V are
the same row, so the pool is `[num_pages, 1, num_layers, 1, page_size, head_dim]`, `v_offset` is 0 and
every V read of an attention backend lands on the K row; nothing is stored twice. The transfer layer pairs
a K and a V buffer per layer (transfer/base.py's `KVArgs`), so `buffers()` presents each layer's page of a
single-plane pool as two halves of its bytes, back to back: the planner fuses them, a run of pages still
moves as one region, and exactly the stored rows move.

On the CPU the pool is one huge-page mapping (`huge_zeros`); on a GPU (`device`) one device allocation
of the same layout, so page runs, layer views and head slices mean the same bytes on either.
"""

from __future__ import annotations

import math

import torch

from common.memory.huge_pages import huge_zeros
from common.memory.paging import PageLayout


class KVPool(PageLayout):
    def __init__(self, num_pages: int, page_size: int, num_layers: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, layer_ids: list[int] | None = None,
                 device: torch.device | str = "cpu", shared_kv: bool = False) -> None:
        super().__init__(page_size)
        if shared_kv and kv_heads != 1:
            raise ValueError(f"a single-plane (shared K/V) pool holds one KV head, not {kv_heads}")
        self.shared_kv = shared_kv
        self.planes = 1 if shared_kv else 2
        self.num_pages = num_pages
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        # model layer id -> layer index in the pool (hybrid models keep KV only for their attention layers)
        self.layer_ids = list(range(num_layers)) if layer_ids is None else list(layer_ids)
        self._index = {lid: i for i, lid in enumerate(self.layer_ids)}
        n = len(self.layer_ids)
        shape = (num_pages, self.planes, n, kv_heads, page_size, head_dim)
        self.device = torch.device(device)
        if self.device.type == "cpu":
            self.data = huge_zeros(math.prod(shape), dtype).view(shape)
        else:
            self.data = torch.zeros(shape, dtype=dtype, device=self.device)
        self.flat = self.data.view(-1, head_dim)
        self.buffer_rows = kv_heads * page_size  # flat rows of one page of one layer's K
        self.page_rows = self.planes * n * self.buffer_rows  # flat rows of one page of the pool
        # V rows of a layer are its K rows + this (0: the same rows)
        self.v_offset = 0 if shared_kv else n * self.buffer_rows

    @property
    def head_bytes(self) -> int:
        """Bytes of one head's slice of one page of one layer's K (or V)."""
        return self.page_size * self.head_dim * self.data.element_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.kv_heads * self.head_bytes

    @property
    def page_stride(self) -> int:
        """Bytes from a page of a layer's K to the next page of it: one page of the whole pool."""
        return self.planes * len(self.layer_ids) * self.page_bytes

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def k(self, layer_id: int) -> torch.Tensor:
        return self.data[:, 0, self._index[layer_id]]

    def v(self, layer_id: int) -> torch.Tensor:
        return self.data[:, self.planes - 1, self._index[layer_id]]

    def layer_offset(self, layer_id: int) -> int:
        """Add to `token_rows` to get a layer's K rows."""
        return self._index[layer_id] * self.buffer_rows

    def token_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Flat rows of the first layer's K for `slots` `[..., L]`, every KV head: `[..., kv_heads, L]`."""
        pages = self.page_of(slots).unsqueeze(-2)
        offs = self.offset_of(slots).unsqueeze(-2)
        heads = torch.arange(self.kv_heads, dtype=torch.int64,
                             device=slots.device).view(-1, 1) * self.page_size
        return pages * self.page_rows + heads + offs

    def flat_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows `[n * kv_heads]` (`[n, kv_heads]` order) of `slots` `[n]`, first layer's K."""
        return self.token_rows(slots.view(-1, 1)).reshape(-1)

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new tokens' K/V ([n, kv_heads, head_dim]) into their slots."""
        self.set_kv_rows(layer_id, self.flat_rows(slots), k, v)

    def set_kv_rows(self, layer_id: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`set_kv` with the slots' `flat_rows` computed once per batch; k/v are `[n, kv_heads, head_dim]`."""
        d = self.head_dim
        rows = rows + self.layer_offset(layer_id)
        self.flat.index_copy_(0, rows, k.reshape(-1, d).to(self.dtype))
        if not self.shared_kv:  # one plane: v is k
            self.flat.index_copy_(0, rows + self.v_offset, v.reshape(-1, d).to(self.dtype))

    def kv_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """K rows then V rows of the first layer, for one `gather_kv` per layer (one plane: the rows once)."""
        return rows if self.shared_kv else torch.cat([rows, rows + self.v_offset])

    def gather_kv(self, layer_id: int, kv_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One gather of a layer's K and V at `kv_rows` (`kv_rows(rows)`): two `[len(rows), head_dim]`."""
        out = self.flat.index_select(0, kv_rows + self.layer_offset(layer_id))
        return (out, out) if self.shared_kv else out.chunk(2)

    def buffers(self) -> list[torch.Tensor]:
        """Every layer's K, then every layer's V (strided views; `page_stride` apart per page). One plane:
        the first and the second half of the bytes of each layer's page (byte views)."""
        if not self.shared_kv or not self.layer_ids:
            return [self.k(lid) for lid in self.layer_ids] + [self.v(lid) for lid in self.layer_ids]
        pages = self.data.view(self.num_pages, len(self.layer_ids), -1).view(torch.uint8)
        if pages.shape[-1] % 2:
            raise ValueError(f"a layer's page of {pages.shape[-1]} bytes does not halve")
        half = pages.shape[-1] // 2
        return [pages[:, i, :half] for i in range(len(self.layer_ids))] \
            + [pages[:, i, half:] for i in range(len(self.layer_ids))]
