"""A KV-event consumer's view of the wire, as vLLM 0.32 defines it (written against vLLM 0.32's schema,
not pdserve's): events are msgpack maps tagged by "type", batched as `[ts, events, data_parallel_rank]`.

* `KVEventBatch` and its events `BlockStored`, `BlockRemoved`, `AllBlocksCleared`: msgspec structs to decode
  a batch with; `REQUIRED`: the keys each event must carry (no default in the schema), "type" included
* `raw_events(payload)`: a batch's events as plain maps, each checked for its required keys
* `Recorder(page_size)`: the block set rebuilt from events, checking their order
"""

from __future__ import annotations

import msgspec


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# the keys of each event that the schema requires (no default), the "type" tag included
REQUIRED = {"BlockStored": {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                            "medium", "lora_name"},
            "BlockRemoved": {"type", "block_hashes", "medium"},
            "AllBlocksCleared": {"type"}}


def raw_events(payload: bytes) -> list[dict]:
    """The events of a batch as plain msgpack: the batch an array of three, each event a map."""
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) == 3, batch
    for ev in batch[1]:
        assert isinstance(ev, dict), f"an event is a map, not {ev!r}"
        assert REQUIRED[ev["type"]] <= ev.keys(), ev
    return batch[1]


class Recorder:
    """The block set a consumer keeps from the events, checking that they arrive in an order that makes
    sense: a block's parent before it, only stored blocks removed."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.blocks: set[int] = set()

    def stored(self, hashes, parent, tokens) -> None:
        assert parent is None or parent in self.blocks, "a block's parent is stored before it"
        assert len(tokens) == self.page_size * len(hashes)
        self.blocks |= set(hashes)

    def removed(self, hashes) -> None:
        assert set(hashes) <= self.blocks, "only stored blocks are removed"
        self.blocks -= set(hashes)

    def cleared(self) -> None:
        self.blocks.clear()
