"""Region planning: which (source address, destination address, length) regions move a chunk.

Pure address arithmetic, no I/O: the prefill sender asks a `PairPlan` for the regions of every
chunk it writes to one decode rank, and `union` gives a manager the spans it registers.
A plan also knows the memory kind of each family on both sides (kv, state, aux), since the engine
writes one pair of kinds per batch (`transfer/memory.py`).

Buffers and items. A KV buffer holds one item per page (the page of one layer's K or V), item k
of buffer b at `base[b] + k * stride[b]`; state buffers hold one item per state slot; aux
(metadata) buffers one row per metadata slot. Each side has its own bases and strides.

Head slices. Rank r of tp T holds kv heads [r*H/T, (r+1)*H/T). A (prefill, decode) pair of ranks
whose head ranges overlap moves the overlapping heads of every page: a byte offset and length
inside the item, the same for every page (pages are head-major, so a head slice is contiguous).
State buffers are split along their leading dimension the same way.

Replicated heads. With fewer heads than ranks (H < T, T a multiple of H; multi-head latent attention's
one latent row per token is the usual case) rank r holds head r*H // T, the same as the other T/H ranks
of its replica group. Each decode rank needs the whole head, so every replica of a prefill group is a
source for it; to move each byte once, the g = T/H prefill replicas split the head's bytes of every item
into g equal parts, replica r % g writing part r % g (`replica_share`).

Layers. Buffers pair up by model layer id (`KVArgs.kv_layer_ids`, `state_layer_ids`; the k-th state
buffer of a layer with the k-th of that layer on the other side), not by position: a prefill pipeline
stage writes its own layers into the decode rank's full set, and a hybrid model's pools, which hold
only some of the layers, line up whatever their positions.

Merging. The regions of a chunk are (page or head slice of a page) x (buffer), placed by each
side's stride; sorted by source address, every region that starts where the previous one ends on
both sides is merged into it. Runs of pages merge in a per-layer layout; in the page-first pool
all layers' K and V of a run of pages become one region. Head slices of M:N TP are not adjacent
and stay apart. Buffers whose items follow each other on both sides for every page (same strides)
are fused once per peer (`fuse_buffers`), so a chunk does the per-page merge over 1 buffer instead
of 60.

Batches. The engine writes one (source, destination) pair of memory kinds per batch, so the
regions of a chunk's families (kv pages, state slots, metadata row) are joined into one batch per
run of families that share their kinds (`write_batches`; on the host: one batch).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from transfer.memory import HOST

if TYPE_CHECKING:
    from transfer.base import KVArgs
    from transfer.control import RegisterPeer


def overlap(a0: int, a1: int, b0: int, b1: int) -> tuple[int, int]:
    """The intersection [lo, hi) of [a0, a1) and [b0, b1) (empty when lo >= hi)."""
    return max(a0, b0), min(a1, b1)


def heads_per_rank(total: int, tp: int) -> int | None:
    """KV heads one rank of tp `tp` holds of `total`: an even split, 1 when the heads are replicated
    (fewer heads than ranks, the ranks a multiple of them); None when neither."""
    if total >= tp:
        return total // tp if total % tp == 0 else None
    return 1 if total > 0 and tp % total == 0 else None


def head_range(rank: int, tp: int, total: int) -> tuple[int, int]:
    """The heads [lo, hi) rank `rank` of tp `tp` holds of `total` (a replicated head: its group's one)."""
    if total >= tp:
        per = total // tp
        return rank * per, (rank + 1) * per
    h = rank * total // tp
    return h, h + 1


def replica_share(rank: int, tp: int, total: int) -> tuple[int, int]:
    """(this rank's part, parts) of a replicated head's bytes it sends: (0, 1) without replicas."""
    if total >= tp:
        return 0, 1
    g = tp // total
    return rank % g, g


def ranks_overlapping(lo: int, hi: int, total: int, tp: int) -> list[int]:
    """Ranks of a tp-`tp` split of `total` units whose range overlaps [lo, hi)."""
    out = []
    for r in range(tp):
        a, b = head_range(r, tp, total)
        if a < hi and b > lo:
            out.append(r)
    return out


def match_buffers(src_ids: list[int], dst_ids: list[int]) -> list[int] | None:
    """For each source buffer (by its layer id), the index of the destination buffer of the same layer
    (the k-th source buffer of a layer pairs with the k-th destination buffer of it); None when a layer
    has fewer buffers on the destination side."""
    places = {key: i for i, key in enumerate(_numbered(dst_ids))}
    out = [places.get(key) for key in _numbered(src_ids)]
    return None if None in out else out


def _numbered(ids: list[int]):
    """(layer id, how many buffers of that layer came before) for each buffer."""
    seen: Counter = Counter()
    for lid in ids:
        yield lid, seen[lid]
        seen[lid] += 1


def union(ptrs: list[int], lens: list[int]) -> list[tuple[int, int]]:
    """(ptr, len) of the union of the [ptr, ptr+len) ranges: overlapping or touching ones merged."""
    out: list[tuple[int, int]] = []
    for p, n in sorted((p, n) for p, n in zip(ptrs, lens, strict=True) if n):
        if out and p <= out[-1][0] + out[-1][1]:
            q, m = out[-1]
            out[-1] = (q, max(m, p + n - q))
        else:
            out.append((p, n))
    return out


def merge(src: np.ndarray, dst: np.ndarray, lens: np.ndarray):
    """Sort regions by source address and merge each into the previous one when it starts where
    the previous one ends on the source side and on the destination side; returns lists."""
    order = np.argsort(src, kind="stable")
    src, dst, lens = src[order], dst[order], lens[order]
    joined = (src[:-1] + lens[:-1] == src[1:]) & (dst[:-1] + lens[:-1] == dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], ~joined)))
    return src[starts].tolist(), dst[starts].tolist(), np.add.reduceat(lens, starts).tolist()


def regions(src_base: np.ndarray, dst_base: np.ndarray, src_stride: np.ndarray, dst_stride: np.ndarray,
            s: np.ndarray, t: np.ndarray, src_off: int, dst_off: int, length):
    """Merged regions moving bytes [off, off + length) of item s[i] -> t[i] of every buffer b, where
    item k of buffer b starts at base[b] + k * stride[b] (bases, strides and optionally length are
    per-buffer arrays)."""
    length = np.broadcast_to(np.asarray(length, dtype=np.int64), src_base.shape)
    if s.size == 0 or src_base.size == 0 or (length <= 0).any():
        return [], [], []
    src = (src_base[:, None] + s[None, :] * src_stride[:, None] + src_off).ravel()
    dst = (dst_base[:, None] + t[None, :] * dst_stride[:, None] + dst_off).ravel()
    return merge(src, dst, np.repeat(length, s.size))


def fuse_buffers(src_base: np.ndarray, dst_base: np.ndarray, src_stride: np.ndarray, dst_stride: np.ndarray,
                 length: int):
    """Buffers whose items sit back to back on both sides for every item index (the next buffer starts
    `length` after this one on both sides, with the same strides) fused into one wider buffer: the
    merge `regions` would do for every page, done once per peer (page-first pool: 60 buffers -> 1).
    Returns the fused bases, strides and per-buffer lengths, in source order."""
    if src_base.size == 0:  # a pipeline stage without kv layers
        return src_base, dst_base, src_stride, dst_stride, np.zeros(0, dtype=np.int64)
    o = np.argsort(src_base, kind="stable")
    sb, db, ss, ds = src_base[o], dst_base[o], src_stride[o], dst_stride[o]
    follows = ((sb[:-1] + length == sb[1:]) & (db[:-1] + length == db[1:])
               & (ss[:-1] == ss[1:]) & (ds[:-1] == ds[1:]))
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return sb[starts], db[starts], ss[starts], ds[starts], np.diff(np.append(starts, sb.size)) * length


Batch = tuple[str, str, list, list, list]  # (source kind, destination kind, src, dst, lengths)


def write_batches(families: list[tuple[tuple[str, str], tuple[list, list, list]]]) -> list[Batch]:
    """((source kind, destination kind), (src, dst, lengths)) of each family, in order → one batch
    per run of families with the same pair of kinds."""
    batches: list[Batch] = []
    for (src_kind, dst_kind), (src, dst, lens) in families:
        if batches and batches[-1][:2] == (src_kind, dst_kind):
            batches[-1][2].extend(src)
            batches[-1][3].extend(dst)
            batches[-1][4].extend(lens)
        else:
            batches.append((src_kind, dst_kind, list(src), list(dst), list(lens)))
    return batches


class PairPlan:
    """Address arithmetic for one (this prefill rank, one decode rank) pair: `args` describes the
    prefill rank's buffers, `reg` the decode rank's."""

    def __init__(self, args: KVArgs, reg: RegisterPeer) -> None:
        hb = args.head_bytes
        p_lo, p_hi = head_range(args.engine_rank, args.tp_size, args.total_kv_heads)
        d_lo, d_hi = head_range(reg.tp_rank, reg.tp_size, reg.total_kv_heads)
        g0, g1 = overlap(p_lo, p_hi, d_lo, d_hi)
        self.kv_src_off = (g0 - p_lo) * hb
        self.kv_dst_off = (g0 - d_lo) * hb
        self.kv_len = (g1 - g0) * hb
        part, parts = replica_share(args.engine_rank, args.tp_size, args.total_kv_heads)
        if parts > 1:  # this replica's share of the head: the group's other replicas send the rest
            if self.kv_len % parts:
                raise ValueError(f"a replicated kv head of {self.kv_len} bytes a page does not split over "
                                 f"{parts} prefill replicas")
            self.kv_len //= parts
            self.kv_src_off += part * self.kv_len
            self.kv_dst_off += part * self.kv_len
        n_dst = len(reg.kv_ptrs) // 2
        layers = match_buffers(args.kv_layer_ids, reg.kv_layer_ids)  # checked at registration
        dst_idx = layers + [n_dst + j for j in layers]
        self.kv = fuse_buffers(np.array(args.kv_data_ptrs, dtype=np.int64),
                               np.array([reg.kv_ptrs[j] for j in dst_idx], dtype=np.int64),
                               np.array(args.kv_item_strides, dtype=np.int64),
                               np.array([reg.kv_item_strides[j] for j in dst_idx],
                                        dtype=np.int64), self.kv_len)
        # state buffers: slice of the leading dimension, per buffer (contiguous: stride = item)
        self.state = []
        for j, m in enumerate(match_buffers(args.state_layer_ids, reg.state_layer_ids)):
            ptr = args.state_data_ptrs[j]
            ds, dd = args.state_dim_per_tensor[j], reg.state_dims[m]
            unit = args.state_item_lens[j] // ds
            s_lo, d_lo_ = args.engine_rank * ds, reg.tp_rank * dd
            u0, u1 = overlap(s_lo, s_lo + ds, d_lo_, d_lo_ + dd)
            self.state.append((np.array([ptr], dtype=np.int64), np.array([reg.state_ptrs[m]], dtype=np.int64),
                               np.array([args.state_item_lens[j]], dtype=np.int64),
                               np.array([reg.state_item_lens[m]], dtype=np.int64),
                               (u0 - s_lo) * unit, (u0 - d_lo_) * unit, (u1 - u0) * unit))
        self.aux = list(zip(args.aux_data_ptrs, args.aux_item_lens, reg.aux_ptrs,
                            reg.aux_item_lens, strict=True))
        # (source, destination) memory kinds of each family: the engine writes a batch of one pair of kinds
        self.kv_memory = (args.kv_memory, reg.kv_memory)
        self.state_memory = (args.state_memory, reg.state_memory)
        self.aux_memory = (HOST, HOST)

    def kv_regions(self, src_pages: np.ndarray, dst_pages: np.ndarray):
        """Regions moving this pair's head slice of pages src_pages[i] -> dst_pages[i], all layers."""
        sb, db, ss, ds, lens = self.kv
        return regions(sb, db, ss, ds, src_pages, dst_pages, self.kv_src_off, self.kv_dst_off, lens)

    def state_regions(self, src_idx: np.ndarray, dst_idx: np.ndarray):
        """Regions moving this pair's slice of state slots src_idx[i] -> dst_idx[i], every buffer."""
        src, dst, lens = [], [], []
        for sb, db, si, di, so, do, ln in self.state:
            a, b, c = regions(sb, db, si, di, src_idx, dst_idx, so, do, ln)
            src += a
            dst += b
            lens += c
        return src, dst, lens

    def aux_regions(self, src_slot: int, dst_slot: int):
        """Regions moving metadata row `src_slot` to row `dst_slot` of every aux buffer."""
        return ([p + src_slot * n for p, n, _, _ in self.aux], [q + dst_slot * m for _, _, q, m in self.aux],
                [n for _, n, _, _ in self.aux])
