"""Shared types of the KV transfer layer: poll states, the failure exception, settings, and the
description of one rank's buffers and place (`KVArgs`).

A prefill rank owns one `PrefillKVManager` (`transfer/sender.py`) and creates a `KVSender` per
request (room); a decode rank owns one `DecodeKVManager` (`transfer/receiver.py`) and creates a
`KVReceiver` per request. Both managers share `transfer/manager.py`; a backend only supplies the
byte mover (`transfer/engine.py: TransferEngine`).

Settings (`TransferSettings.from_env()`, each overridable by constructor keyword):

=============================  =====================================  =======
env var                        meaning                                default
=============================  =====================================  =======
PDSERVE_BOOTSTRAP_TIMEOUT      prefill: seconds a room waits for the  300
                               decode's TransferInfo; decode: seconds
                               to resolve the prefill ranks
PDSERVE_WAITING_TIMEOUT        decode: seconds to wait for Success    300
                               after sending TransferInfo
PDSERVE_ABORT_ACK_TIMEOUT      decode: seconds a failed room's pages  60
                               wait for the prefill's AbortAck before
                               that prefill rank is declared dead
PDSERVE_HEARTBEAT_INTERVAL     seconds between pings to live peers    1.0
PDSERVE_HEARTBEAT_MAX_FAILURES missed intervals before a peer is dead 3
DISAGGREGATION_TEST_FAILURE_PROB  share of rooms the sender fails     0.0
                               on purpose ("injected failure")
PDSERVE_TRANSFER_WORKERS       worker threads per manager             4
PDSERVE_TRANSFER_PROTOCOL      mooncake protocol: tcp | rdma          tcp
PDSERVE_TRANSFER_DEVICES       engine device names (e.g. mlx5_0,...)  ""
PDSERVE_TRANSFER_ALLOW_WILDCARD_LISTEN  1: mooncake may start on a     0
                               specific host although it listens on
                               every interface (transfer/mooncake.py)
PDSERVE_CLUSTER_SECRET_FILE    file of the cluster secret that signs  none
                               the control plane and bootstrap
                               traffic (`common/cluster_secret.py`)
PDSERVE_AUTH_WINDOW            seconds a signed message stays valid   30
                               (clock skew + delivery); replays within
                               it are refused by nonce
PDSERVE_CONTROL_MAX_PEERS      control-plane PUSH sockets open at     256
                               most (least recently used closed)
PDSERVE_MAX_DECODE_PEERS       prefill: decode ranks registered at    1024
                               most; when full a refused one makes
                               room, else the new one is refused
PDSERVE_PEER_IDLE_TIMEOUT      seconds a peer's registration stays    300
                               without any room before it is dropped
                               (a dead or restarted peer's goes then;
                               a live one registers again)
=============================  =====================================  =======
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field

from common.cluster_secret import ClusterSecret, load_configured
from common.fingerprint import KV_LAYOUT as _KV_LAYOUT
from transfer.memory import HOST, memory_of, parse_memory
from transfer.plan import heads_per_rank

# How KV buffers are laid out; both sides of a transfer must agree (checked at bootstrap).
KV_LAYOUT = _KV_LAYOUT  # "page,head,token,dim", kept in common/fingerprint.py (part of a node's fingerprint)

STATE_TYPES = ("none", "mamba", "swa")


class KVPoll(enum.IntEnum):
    """Transfer state of one room. Ordered so that MIN over ranks is the most pessimistic state."""

    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class KVTransferError(RuntimeError):
    """Why a room failed; `failure_exception()` returns one of these."""

    def __init__(self, room: int, reason: str) -> None:
        super().__init__(f"room {room}: {reason}")
        self.room = room
        self.reason = reason


def _env(name: str, cast, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return cast(raw)
    except ValueError as e:
        raise ValueError(f"bad value for {name}: {raw!r}") from e


@dataclass
class TransferSettings:
    bootstrap_timeout: float = 300.0
    waiting_timeout: float = 300.0
    abort_ack_timeout: float = 60.0
    heartbeat_interval: float = 1.0
    heartbeat_max_failures: int = 3
    failure_prob: float = 0.0
    num_workers: int = 4
    protocol: str = "tcp"
    device_name: str = ""
    allow_wildcard_listen: bool = False  # mooncake may listen on every interface (it cannot be confined)
    cluster_secret: ClusterSecret | None = None
    auth_window: float = 30.0
    control_max_peers: int = 256
    max_decode_peers: int = 1024
    peer_idle_timeout: float = 300.0

    @classmethod
    def from_env(cls, **overrides) -> TransferSettings:
        """Settings from the environment; keyword arguments that are not None win."""
        s = cls(
            bootstrap_timeout=_env("PDSERVE_BOOTSTRAP_TIMEOUT", float, cls.bootstrap_timeout),
            waiting_timeout=_env("PDSERVE_WAITING_TIMEOUT", float, cls.waiting_timeout),
            abort_ack_timeout=_env("PDSERVE_ABORT_ACK_TIMEOUT", float, cls.abort_ack_timeout),
            heartbeat_interval=_env("PDSERVE_HEARTBEAT_INTERVAL", float, cls.heartbeat_interval),
            heartbeat_max_failures=_env("PDSERVE_HEARTBEAT_MAX_FAILURES", int, cls.heartbeat_max_failures),
            failure_prob=_env("DISAGGREGATION_TEST_FAILURE_PROB", float, cls.failure_prob),
            num_workers=_env("PDSERVE_TRANSFER_WORKERS", int, cls.num_workers),
            protocol=_env("PDSERVE_TRANSFER_PROTOCOL", str, cls.protocol),
            device_name=_env("PDSERVE_TRANSFER_DEVICES", str, cls.device_name),
            allow_wildcard_listen=_env("PDSERVE_TRANSFER_ALLOW_WILDCARD_LISTEN", lambda v: bool(int(v)),
                                       cls.allow_wildcard_listen),
            auth_window=_env("PDSERVE_AUTH_WINDOW", float, cls.auth_window),
            control_max_peers=_env("PDSERVE_CONTROL_MAX_PEERS", int, cls.control_max_peers),
            max_decode_peers=_env("PDSERVE_MAX_DECODE_PEERS", int, cls.max_decode_peers),
            peer_idle_timeout=_env("PDSERVE_PEER_IDLE_TIMEOUT", float, cls.peer_idle_timeout),
        )
        names = {f.name for f in dataclasses.fields(cls)}
        for key, value in overrides.items():
            if key not in names:
                raise TypeError(f"unknown transfer setting {key!r}")
            if value is not None:
                setattr(s, key, value)
        if not 0.0 <= s.failure_prob <= 1.0:
            raise ValueError(f"DISAGGREGATION_TEST_FAILURE_PROB must be in [0, 1], got {s.failure_prob}")
        if s.heartbeat_interval <= 0 or s.heartbeat_max_failures < 1:
            raise ValueError("heartbeat interval must be > 0 and max failures >= 1")
        if s.auth_window <= 0 or s.control_max_peers < 1:
            raise ValueError("PDSERVE_AUTH_WINDOW must be > 0 and PDSERVE_CONTROL_MAX_PEERS >= 1")
        if s.peer_idle_timeout <= 0:
            raise ValueError("PDSERVE_PEER_IDLE_TIMEOUT must be > 0")
        if s.cluster_secret is None:
            s.cluster_secret = load_configured(None)  # $PDSERVE_CLUSTER_SECRET_FILE
        return s

    @property
    def heartbeat_window(self) -> float:
        """Seconds of silence after which a peer with live transfers is declared dead."""
        return self.heartbeat_interval * self.heartbeat_max_failures


@dataclass
class KVArgs:
    """Everything the transfer layer needs to know about one rank's buffers and place.

    KV buffers: `kv_data_ptrs` lists K of each local layer, then V of each local layer; each buffer
    is `[num_pages, kv_head_num, page_size, head_dim]` with every page contiguous, so
    `kv_item_lens[i]` is the bytes of one page and `kv_item_lens[i] // kv_head_num` of one head within
    a page. Page p of buffer i starts at `kv_data_ptrs[i] + p * kv_item_strides[i]`; the strides
    default to the item lengths (separate contiguous buffers). In the page-first pool the stride is
    a page of all layers' K and V, so the buffers interleave and `kv_data_lens[i]` (the span of
    buffer i) overlap; registration takes the union of the spans.
    Aux buffers hold the per-request metadata rows (`aux_item_lens[i]` bytes a row); the row of
    `aux_room_index` starts with the int64 bootstrap room, which the receiver checks.
    State buffers (hybrid models) hold one item per state slot (`state_item_lens[i]` bytes); the
    item's leading dimension (`state_dim_per_tensor[i]` on this rank) is split across TP ranks.
    Layer ids: `kv_layer_ids[i]` is the model layer whose K and V are kv buffers i and layers + i
    (default: 0, 1, ...), `state_layer_ids[j]` the layer state buffer j belongs to (the buffers of
    one layer in the same order on every node). Transfers pair buffers by layer id, so a pipeline
    stage, or a hybrid pool that holds only some layers, writes each layer into its place in the
    decode rank's pools. A stage may hold no KV layer at all (`kv_head_bytes` then says what a head
    of a page would be).
    """

    kv_data_ptrs: list[int]
    kv_data_lens: list[int]
    kv_item_lens: list[int]
    kv_head_num: int
    page_size: int
    kv_item_strides: list[int] = field(default_factory=list)  # empty: equal to kv_item_lens
    aux_data_ptrs: list[int] = field(default_factory=list)
    aux_data_lens: list[int] = field(default_factory=list)
    aux_item_lens: list[int] = field(default_factory=list)
    aux_room_index: int = -1
    state_data_ptrs: list[int] = field(default_factory=list)
    state_data_lens: list[int] = field(default_factory=list)
    state_item_lens: list[int] = field(default_factory=list)
    state_type: str = "none"
    state_dim_per_tensor: list[int] = field(default_factory=list)
    engine_rank: int = 0  # TP rank
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    kv_layer_ids: list[int] = field(default_factory=list)  # empty: 0 .. layers - 1
    state_layer_ids: list[int] = field(default_factory=list)  # empty: 0 .. state buffers - 1
    kv_head_bytes: int = 0  # 0: from kv_item_lens (needed without kv buffers)
    total_kv_heads: int = 0  # 0: kv_head_num * tp_size
    model: str = ""
    kv_layout: str = KV_LAYOUT
    # a prefill rank's --disaggregation-decode-tp: decode ranks of another TP are refused (0: any)
    decode_tp: int = 0
    kv_memory: str = HOST  # where the kv buffers live: "host" or "cuda:N" (transfer/memory.py)
    state_memory: str = HOST  # where the state buffers live; aux (metadata) rows are always host memory
    fingerprint: str = ""  # the node's pairing key (common/fingerprint.py); "": none, not compared

    def __post_init__(self) -> None:
        if self.total_kv_heads == 0:
            self.total_kv_heads = self.kv_head_num * self.tp_size
        if len(self.kv_data_ptrs) % 2:
            raise ValueError("kv_data_ptrs must list K then V buffers of each layer")
        if not (len(self.kv_data_ptrs) == len(self.kv_data_lens) == len(self.kv_item_lens)):
            raise ValueError("kv_data_ptrs, kv_data_lens and kv_item_lens must have equal length")
        if not self.kv_item_strides:
            self.kv_item_strides = list(self.kv_item_lens)
        if len(self.kv_item_strides) != len(self.kv_item_lens):
            raise ValueError("kv_item_strides must give one stride per kv buffer")
        if any(st < n for st, n in zip(self.kv_item_strides, self.kv_item_lens, strict=True)):
            raise ValueError("kv_item_strides must not be smaller than kv_item_lens (pages would overlap)")
        if not (len(self.aux_data_ptrs) == len(self.aux_data_lens) == len(self.aux_item_lens)):
            raise ValueError("aux_data_ptrs, aux_data_lens and aux_item_lens must have equal length")
        n_state = len(self.state_data_ptrs)
        if not (n_state == len(self.state_data_lens) == len(self.state_item_lens)):
            raise ValueError("state_data_ptrs, state_data_lens and state_item_lens must have equal length")
        if n_state and len(self.state_dim_per_tensor) != n_state:
            raise ValueError("state_dim_per_tensor needs one leading dimension per state buffer")
        parse_memory(self.kv_memory)
        parse_memory(self.state_memory)
        if self.state_type not in STATE_TYPES:
            raise ValueError(f"state_type must be one of {STATE_TYPES}, got {self.state_type!r}")
        if heads_per_rank(self.total_kv_heads, self.tp_size) != self.kv_head_num:
            raise ValueError(f"{self.total_kv_heads} kv heads cannot be split evenly over tp {self.tp_size} "
                             f"into {self.kv_head_num} heads per rank")
        if any(n % self.kv_head_num for n in self.kv_item_lens):
            raise ValueError("kv_item_lens must be a multiple of kv_head_num (head-major pages)")
        if self.kv_item_lens:
            per_head = self.kv_item_lens[0] // self.kv_head_num
            if self.kv_head_bytes not in (0, per_head):
                raise ValueError(f"kv_head_bytes {self.kv_head_bytes} differs from the pages' {per_head}")
            self.kv_head_bytes = per_head
        elif self.kv_head_bytes <= 0:
            raise ValueError("kv_head_bytes is needed when the rank holds no kv buffers")
        self.kv_layer_ids = list(self.kv_layer_ids) or list(range(self.num_layers))
        self.state_layer_ids = list(self.state_layer_ids) or list(range(n_state))
        if len(self.kv_layer_ids) != self.num_layers or len(set(self.kv_layer_ids)) != self.num_layers:
            raise ValueError("kv_layer_ids must give one distinct layer id per kv layer")
        if len(self.state_layer_ids) != n_state:
            raise ValueError("state_layer_ids must give a layer id per state buffer")

    @property
    def num_layers(self) -> int:
        return len(self.kv_data_ptrs) // 2

    @property
    def head_bytes(self) -> int:
        return self.kv_head_bytes

    @classmethod
    def from_runner(cls, runner, metadata=None, **rank) -> KVArgs:
        """Describe a `common.runner.ModelRunner`'s KV pool and, for hybrid / sliding-window models,
        the state its `hybrid` reports (state buffers, state type, their leading dimensions), with
        the model's name and the node's pairing key; `rank` as in `from_pool`."""
        hybrid = runner.hybrid
        rank.setdefault("model", runner.model_config.name)
        rank.setdefault("fingerprint", getattr(runner, "fingerprint", "") or "")
        rank.setdefault("state_layer_ids", hybrid.state_layer_ids())
        if getattr(runner.kv_pool, "shared_kv", False):  # the latent row: one head on every rank
            rank.setdefault("total_kv_heads", runner.kv_pool.kv_heads)
        return cls.from_pool(runner.kv_pool, metadata, hybrid.state_buffers(), hybrid.state_type,
                             hybrid.state_leading_dims() or None, **rank)

    @classmethod
    def from_pool(cls, kv_pool, metadata=None, state_buffers=None, state_type: str = "none",
                  state_dim_per_tensor: list[int] | None = None, **rank) -> KVArgs:
        """Describe a `common.memory.kv_pool.KVPool`, an optional `transfer.metadata.MetadataBuffers`
        and optional state tensors (`[num_slots, leading_dim, ...]` contiguous, one item per slot).

        `rank` takes the remaining fields: engine_rank, tp_size, dp_rank, dp_size, pp_rank, pp_size,
        state_layer_ids, model (and total_kv_heads if the pool's heads are not total / tp_size). The kv
        layer ids are the pool's."""
        bufs = kv_pool.buffers()
        if any(not b[0].is_contiguous() for b in bufs):
            raise ValueError("each page of a kv buffer must be contiguous")
        strides = [b.stride(0) * b.element_size() for b in bufs]  # the pool's page_stride
        # bytes of one page of a buffer (a single-plane pool's buffers are halves of its layer pages)
        item = bufs[0][0].numel() * bufs[0].element_size() if bufs else \
            kv_pool.page_bytes // (2 if getattr(kv_pool, "shared_kv", False) else 1)
        aux = metadata.buffers() if metadata is not None else []
        states = list(state_buffers or [])
        for t in states:
            if not t.is_contiguous():
                raise ValueError("state buffers must be contiguous")
        dims = state_dim_per_tensor or [int(t.shape[1]) if t.dim() > 1 else 1 for t in states]
        if states and state_type == "none":
            raise ValueError("state buffers given with state_type 'none'")
        kv_memory = _one_kind("kv", bufs)
        state_memory = _one_kind("state", states)
        return cls(
            kv_data_ptrs=[b.data_ptr() for b in bufs],
            kv_data_lens=[(b.shape[0] - 1) * st + item for b, st in zip(bufs, strides, strict=True)],
            kv_item_lens=[item] * len(bufs),
            kv_head_num=kv_pool.kv_heads,
            kv_head_bytes=item // kv_pool.kv_heads,
            kv_layer_ids=list(kv_pool.layer_ids),
            page_size=kv_pool.page_size,
            kv_item_strides=strides,
            aux_data_ptrs=[a[0] for a in aux],
            aux_data_lens=[a[1] for a in aux],
            aux_item_lens=[a[2] for a in aux],
            aux_room_index=metadata.room_index if metadata is not None else -1,
            state_data_ptrs=[t.data_ptr() for t in states],
            state_data_lens=[t.numel() * t.element_size() for t in states],
            state_item_lens=[t[0].numel() * t.element_size() for t in states],
            state_type=state_type,
            state_dim_per_tensor=dims,
            kv_memory=kv_memory,
            state_memory=state_memory,
            **rank,
        )


def _one_kind(what: str, tensors) -> str:
    """The memory kind all of `tensors` share ("host" for none)."""
    kinds = {memory_of(t) for t in tensors}
    if len(kinds) > 1:
        raise ValueError(f"{what} buffers must all live in one memory, got {sorted(kinds)}")
    return kinds.pop() if kinds else HOST
