"""Checks of every value a peer sends, against what the receiving rank owns or was told before.

A peer is another process on the network; what it sends is checked before anything is planned,
written or freed with it. Each check returns None or a reason naming the message, the field and
both values ("TransferInfo.metadata_index = 99, expected 0..15 (the decode's metadata rows)").

* `check_registration(args, reg)`: a decode rank's `RegisterPeer` against this prefill rank's own
  layout: TP place, page size, model and heads, the compatibility fingerprint
  (`common/fingerprint.py`: weights, dtypes, KV layout, transfer protocol; not compared when either
  side has none); 2 x layers kv buffers whose item lengths are the page size x heads x head dim
  bytes of this model, strides at least one item, a positive bounded page count, addresses that fit
  the address space, kv items that never overlap one another (interleaved in one pool, or separate
  spans) nor the metadata and state buffers, and metadata and state buffers shaped like this rank's.
* `check_info(reg, info)`: a `TransferInfo` against the registration of the rank that sent it:
  its TP place, destination pages within 1 .. pages - 1 without duplicates, the metadata row and
  the state slots within the decode's rows and slots.
* `check_layout(layout)` / `check_rank(info)`: the bootstrap server's answers (JSON of
  the right shape and types, ports 1..65535, ranks in range, strings where strings belong).
* `check_bootstrap_addr(addr)`: a "host:port" the decode side can ask at all.

`reject(mgr, what, reason)` counts a rejected value on the manager (`rejected_peer_values`, in the
role's stats) and logs it: at most `LOG_BURST` lines per second per manager, then one line saying how
many were not logged (a flood of bad messages must not become a flood of log lines).
"""

from __future__ import annotations

import logging
import re
import time
from typing import TYPE_CHECKING

import numpy as np

from transfer.memory import parse_memory
from transfer.plan import heads_per_rank, match_buffers

if TYPE_CHECKING:
    from transfer.base import KVArgs
    from transfer.control import RegisterPeer, TransferInfo

logger = logging.getLogger(__name__)

ADDRESS_LIMIT = 1 << 64  # a buffer must end inside a 64-bit address space
MAX_ITEMS = 1 << 32  # pages, metadata rows or state slots of one buffer
MAX_BUFFERS = 1 << 14
LOG_BURST = 20  # reject() lines per second per manager
MAX_TP = 1 << 12
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]{1,253})$")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _want(msg: str, field: str, got, want: str) -> str:
    return f"{msg}.{field} = {got!r}, expected {want}"


def reject(mgr, what: str, reason: str) -> None:
    """Count a rejected peer value on `mgr` and log it (one line, naming the message and the room)."""
    now = time.monotonic()
    with mgr._lock:
        mgr.rejected_peer_values = getattr(mgr, "rejected_peer_values", 0) + 1
        start, logged, quiet = getattr(mgr, "_reject_log", (now, 0, 0))
        if now - start >= 1.0:
            if quiet:
                logger.warning("kv %s: %d more rejected peer value(s) not logged in the last %.0fs", mgr.side,
                               quiet, now - start)
            start, logged, quiet = now, 0, 0
        if logged < LOG_BURST:
            logged += 1
            logger.warning("kv %s: rejected %s: %s", mgr.side, what, reason)
        else:
            quiet += 1
        mgr._reject_log = (start, logged, quiet)


# ---------------------------------------------------------------------------------------- RegisterPeer
def check_registration(a: KVArgs, reg: RegisterPeer) -> str | None:
    """None if a decode rank's registration is consistent and matches this prefill rank."""
    return (_check_place(a, reg) or _check_memory(reg) or _check_kv(a, reg) or _check_aux_state(a, reg)
            or _check_overlaps(reg))


def _check_memory(reg: RegisterPeer) -> str | None:
    """The memory kinds name host memory or a CUDA device (the engine registers and writes by kind)."""
    for name in ("kv_memory", "state_memory"):
        try:
            parse_memory(getattr(reg, name))
        except ValueError:
            return _want("RegisterPeer", name, getattr(reg, name), "'host' or 'cuda:N'")
    return None


def _check_place(a: KVArgs, reg: RegisterPeer) -> str | None:
    m = "RegisterPeer"
    if reg.page_size != a.page_size:
        return f"page size mismatch: prefill {a.page_size}, decode {reg.page_size}"
    if a.model and reg.model and a.model != reg.model:
        return f"model mismatch: prefill {a.model!r}, decode {reg.model!r}"
    if reg.total_kv_heads != a.total_kv_heads:
        return f"kv head count mismatch: prefill {a.total_kv_heads}, decode {reg.total_kv_heads}"
    if not 1 <= reg.tp_size <= MAX_TP:
        return _want(m, "tp_size", reg.tp_size, f"1..{MAX_TP}")
    if a.decode_tp and reg.tp_size != a.decode_tp:
        return f"decode tp {reg.tp_size} registered; this prefill node serves decode tp {a.decode_tp} only " \
               "(--disaggregation-decode-tp)"
    per_rank = heads_per_rank(reg.total_kv_heads, reg.tp_size)
    if per_rank is None:
        return f"{reg.total_kv_heads} kv heads cannot be split over decode tp {reg.tp_size}"
    if not 0 <= reg.tp_rank < reg.tp_size:
        return _want(m, "tp_rank", reg.tp_rank, f"0..{reg.tp_size - 1} (its tp_size {reg.tp_size})")
    if reg.kv_head_num != per_rank:
        return _want(m, "kv_head_num", reg.kv_head_num, f"{per_rank} "
                     f"({reg.total_kv_heads} kv heads over tp {reg.tp_size})")
    return fingerprint_problem(a.fingerprint, reg.fingerprint)


def fingerprint_problem(prefill: str, decode: str) -> str | None:
    """None unless both nodes name a compatibility fingerprint and they differ."""
    if not prefill or not decode or prefill == decode:
        return None
    return (f"compatibility fingerprint mismatch: prefill {prefill[:16]}, decode {decode[:16]} (other "
            "weights, dtype, KV cache dtype or transfer protocol: compare the nodes' /server_info "
            "`compatibility`)")


def _check_kv(a: KVArgs, reg: RegisterPeer) -> str | None:
    m = "RegisterPeer"
    n = len(reg.kv_ptrs)
    if n == 0 or n % 2 or n > MAX_BUFFERS:
        return _want(m, "kv_ptrs", f"{n} buffers", "K and V of every layer (2 x layers)")
    ids = reg.kv_layer_ids
    if len(ids) != n // 2 or len(set(ids)) != len(ids) \
            or not all(_int(i) and 0 <= i < MAX_BUFFERS for i in ids):
        return _want(m, "kv_layer_ids", ids if len(ids) <= 16 else f"{len(ids)} ids",
                     f"{n // 2} distinct layer ids (one per kv layer)")
    if match_buffers(a.kv_layer_ids, ids) is None or (a.pp_size == 1 and len(ids) != a.num_layers):
        return f"decode holds kv layers {_few(ids)}, prefill kv layers {_few(a.kv_layer_ids)}" + (
            " (each pipeline stage sends its own: the decode must hold every one of them)"
            if a.pp_size > 1 else "")
    if len(reg.kv_item_lens) != n or len(reg.kv_item_strides) != n:
        return (f"decode kv buffer description is inconsistent ({n} pointers, {len(reg.kv_item_lens)} item "
                f"lengths, {len(reg.kv_item_strides)} strides)")
    item = reg.kv_head_num * a.head_bytes
    for i, (ln, st) in enumerate(zip(reg.kv_item_lens, reg.kv_item_strides, strict=True)):
        if ln != item:
            return _want(m, f"kv_item_lens[{i}]", ln, f"{item} (page size x {reg.kv_head_num} heads x head "
                         f"dim bytes: head bytes mismatch, prefill {a.head_bytes})")
        if st < ln:
            return _want(m, f"kv_item_strides[{i}]", st, f">= the item length {ln}")
    if not 2 <= reg.kv_num_pages <= MAX_ITEMS:
        return _want(m, "kv_num_pages", reg.kv_num_pages, f"2..{MAX_ITEMS} (page 0 is padding)")
    for i, (p, st) in enumerate(zip(reg.kv_ptrs, reg.kv_item_strides, strict=True)):
        if p <= 0 or p + (reg.kv_num_pages - 1) * st + item > ADDRESS_LIMIT:
            return _want(m, f"kv_ptrs[{i}]", p,
                         f"a buffer of {reg.kv_num_pages} pages inside the address space")
    return None


def _check_aux_state(a: KVArgs, reg: RegisterPeer) -> str | None:
    m = "RegisterPeer"
    if len(reg.aux_ptrs) != len(a.aux_data_ptrs) or list(reg.aux_item_lens) != list(a.aux_item_lens):
        return ("metadata buffer layout differs between prefill and decode (is --speculative-algorithm "
                "EAGLE/MTP given to one side only?)")
    if reg.aux_ptrs and not 1 <= reg.aux_num_rows <= MAX_ITEMS:
        return _want(m, "aux_num_rows", reg.aux_num_rows, f"1..{MAX_ITEMS}")
    for i, (p, ln) in enumerate(zip(reg.aux_ptrs, reg.aux_item_lens, strict=True)):
        if p <= 0 or p + reg.aux_num_rows * ln > ADDRESS_LIMIT:
            return _want(m, f"aux_ptrs[{i}]", p,
                         f"a buffer of {reg.aux_num_rows} rows inside the address space")
    ns = len(reg.state_ptrs)
    if (ns != len(a.state_data_ptrs) and a.pp_size == 1) or ns < len(a.state_data_ptrs):
        return f"state buffer count mismatch: prefill {len(a.state_data_ptrs)}, decode {ns}"
    if len(reg.state_item_lens) != ns or len(reg.state_dims) != ns or len(reg.state_layer_ids) != ns:
        return (f"decode state buffer description is inconsistent ({ns} pointers, {len(reg.state_item_lens)} "
                f"item lengths, {len(reg.state_dims)} leading dimensions, {len(reg.state_layer_ids)} "
                "layer ids)")
    if not all(_int(i) and 0 <= i < MAX_BUFFERS for i in reg.state_layer_ids):
        return _want(m, "state_layer_ids", _few(reg.state_layer_ids), f"layer ids in 0..{MAX_BUFFERS - 1}")
    pairs = match_buffers(a.state_layer_ids, reg.state_layer_ids)
    if pairs is None:
        return (f"decode state buffers of layers {_few(reg.state_layer_ids)} lack the prefill's "
                f"{_few(a.state_layer_ids)}")
    if ns and not 1 <= reg.state_num_slots <= MAX_ITEMS:
        return _want(m, "state_num_slots", reg.state_num_slots, f"1..{MAX_ITEMS}")
    for j in range(ns):
        dd, dl = reg.state_dims[j], reg.state_item_lens[j]
        if dd < 1 or dl < 1 or dl % dd:
            return f"decode state buffer {j} is inconsistent ({dl} bytes a slot, leading dimension {dd})"
        p = reg.state_ptrs[j]
        if p <= 0 or p + reg.state_num_slots * dl > ADDRESS_LIMIT:
            return _want(m, f"state_ptrs[{j}]", p,
                         f"a buffer of {reg.state_num_slots} slots inside the address space")
    for j, k in enumerate(pairs):
        ds, dd, dl = a.state_dim_per_tensor[j], reg.state_dims[k], reg.state_item_lens[k]
        if ds * a.tp_size != dd * reg.tp_size or a.state_item_lens[j] // ds != dl // dd:
            return f"state buffer of layer {a.state_layer_ids[j]} differs in shape between prefill and decode"
    return None


def _few(ids: list[int]) -> str:
    """Layer ids for a message: all of a short list, the count of a long one."""
    return str(list(ids)) if len(ids) <= 16 else f"{len(ids)} layers"


def _check_overlaps(reg: RegisterPeer) -> str | None:
    """kv items of different buffers never share a byte (one interleaved pool, or separate spans), and
    no kv, metadata or state buffer overlaps another."""
    item, pages = reg.kv_item_lens[0], reg.kv_num_pages
    spans = sorted((p, p + (pages - 1) * st + item, st, i)
                   for i, (p, st) in enumerate(zip(reg.kv_ptrs, reg.kv_item_strides, strict=True)))
    groups: list[list[tuple[int, int, int, int]]] = []
    for s in spans:
        if groups and s[0] < max(e for _, e, _, _ in groups[-1]):
            groups[-1].append(s)
        else:
            groups.append([s])
    regions = []
    for g in groups:
        stride = g[0][2]
        ptrs = [p for p, _, _, _ in g]
        if len(g) > 1:
            # an interleaved pool: every buffer has the pool's stride and one page of all of them fits in it
            if any(st != stride for _, _, st, _ in g) or ptrs[-1] - ptrs[0] + item > stride \
                    or any(b - a < item for a, b in zip(ptrs, ptrs[1:], strict=False)):
                return (f"RegisterPeer.kv_ptrs: buffers {sorted(i for *_, i in g)} overlap (their pages "
                        "would share bytes)")
        regions.append((ptrs[0], max(e for _, e, _, _ in g), "kv"))
    regions += [(p, p + reg.aux_num_rows * ln, f"aux {i}")
                for i, (p, ln) in enumerate(zip(reg.aux_ptrs, reg.aux_item_lens, strict=True))]
    regions += [(p, p + reg.state_num_slots * ln, f"state {j}")
                for j, (p, ln) in enumerate(zip(reg.state_ptrs, reg.state_item_lens, strict=True))]
    regions.sort()
    for (a0, a1, an), (b0, _, bn) in zip(regions, regions[1:], strict=False):
        if b0 < a1:
            return f"RegisterPeer: the {an} buffer [{a0:#x}, {a1:#x}) overlaps the {bn} buffer at {b0:#x}"
    return None


# ---------------------------------------------------------------------------------------- TransferInfo
def _indices(values: list[int], lo: int, hi: int, field: str, what: str) -> str | None:
    """None if every value is within lo..hi - 1 and none repeats."""
    if not values:
        return None
    try:
        arr = np.asarray(values, dtype=np.int64)
    except OverflowError:
        arr = None
    if arr is None or arr.min() < lo or arr.max() >= hi:
        i = next(i for i, v in enumerate(values) if not lo <= v < hi)
        return _want("TransferInfo", f"{field}[{i}]", values[i], f"{lo}..{hi - 1} ({what})")
    uniq, counts = np.unique(arr, return_counts=True)
    if uniq.size != arr.size:
        dup = int(uniq[np.argmax(counts > 1)])
        return _want("TransferInfo", field, f"{dup} twice", f"distinct {what}")
    return None


def check_info(reg: RegisterPeer, info: TransferInfo) -> str | None:
    """None if a TransferInfo fits the registration of the decode rank that sent it."""
    m = "TransferInfo"
    if info.tp_rank != reg.tp_rank:
        return _want(m, "tp_rank", info.tp_rank, f"{reg.tp_rank} (the sender's registration)")
    if info.tp_size != reg.tp_size:
        return _want(m, "tp_size", info.tp_size, f"{reg.tp_size} (the sender's registration)")
    problem = _indices(info.dst_page_indices, 1, reg.kv_num_pages, "dst_page_indices",
                       "the decode pool's pages")
    if problem:
        return problem
    if reg.aux_ptrs and not 0 <= info.metadata_index < reg.aux_num_rows:
        return _want(m, "metadata_index", info.metadata_index,
                     f"0..{reg.aux_num_rows - 1} (the decode's metadata rows)")
    if info.state_indices and not reg.state_ptrs:
        return _want(m, "state_indices", info.state_indices, "none (the decode registered no state buffers)")
    return _indices(info.state_indices, 0, reg.state_num_slots, "state_indices", "the decode's state slots")


# ---------------------------------------------------------------------------------------- bootstrap answers
_LAYOUT_INTS = {"page_size": MAX_ITEMS, "kv_heads_total": MAX_ITEMS, "tp_size": MAX_TP, "dp_size": MAX_TP,
                "pp_size": MAX_TP}


def check_layout(layout) -> str | None:
    """None if the bootstrap server's layout answer has the right shape."""
    if not isinstance(layout, dict):
        return f"layout answer is a {type(layout).__name__}, expected a JSON object"
    for key, hi in _LAYOUT_INTS.items():
        v = layout.get(key)
        if not _int(v) or not 1 <= v <= hi:
            return f"layout {key} = {v!r}, expected an integer 1..{hi}"
    for key in ("model", "kv_layout", "fingerprint"):
        if key in layout and not isinstance(layout[key], str):
            return f"layout {key} = {layout[key]!r}, expected a string"
    if "model" not in layout:
        return "layout has no model"
    return None


def check_rank(info) -> str | None:
    """None if a rank answer is {"rank_ip": host, "rank_port": 1..65535}."""
    if not isinstance(info, dict):
        return f"rank answer is a {type(info).__name__}, expected a JSON object"
    ip, port = info.get("rank_ip"), info.get("rank_port")
    if not isinstance(ip, str) or not _HOST.match(ip):
        return f"rank_ip = {ip!r}, expected a host name or address"
    if not _int(port) or not 1 <= port <= 65535:
        return f"rank_port = {port!r}, expected an integer 1..65535"
    return None


def check_bootstrap_addr(addr: str) -> str | None:
    """None if `addr` is "host:port" with a plain host name or address and a port 1..65535."""
    host, sep, port = addr.rpartition(":")
    if not sep or not _HOST.match(host) or not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"bootstrap address {addr!r} is not host:port (port 1..65535)"
    return None
