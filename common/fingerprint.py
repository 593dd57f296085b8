"""A node's compatibility fingerprint: what a prefill and a decode node must share to pair.

A prefill node's KV is only meaningful to a decode node that runs the same weights, reads the KV in
the same dtype and layout, pages it the same way and speaks the same transfer protocol. A model's
name or path says none of that (two checkpoints of one shape in directories both named `model` pair
by name and answer garbage), so every node describes what it loaded, once at start-up
(`common/runner.py`), and shows it in `/server_info`:

* `compatibility`: a `Compatibility`, the facts one by one (the fields below);
* `fingerprint`: `pairing_key(compatibility)`, a digest of the fields that must be equal between a
  prefill and a decode node (`PAIRING_FIELDS`: everything but the parallel shape and the name).

The router (`router/registry.py`) refuses a worker whose compatibility cannot pair with its pool and
names the first difference (`mismatch`); the transfer handshake (`RegisterPeer`, the bootstrap layout)
carries the key, so two nodes paired by hand refuse each other too.

The weights digest (`checkpoint_digest`) is computed from the checkpoint as read, not from its path:
per tensor its name, dtype, shape, byte length and `SAMPLE_BYTES` from its start, middle and end (the
whole tensor when it is that small), in sorted name order, with the model config as parsed. It reads a
few KiB per tensor (the safetensors header gives every tensor's place), so it costs the same on every
rank of every shape of node (TP, PP and file sharding do not change it). It tells checkpoints apart that
differ anywhere a fine-tune or a re-initialisation touches; two that differ only in bytes it never
samples look equal. `--load-format dummy` reads no tensor: its digest (`dummy_digest`) is of the config,
the seed and spread of the random fill and the TP / PP shape, since each rank fills its own shard.

This module imports no torch (the router uses it).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Annotated, Any

import msgspec

PROTOCOL_VERSION = 1  # the KV transfer protocol (control messages, metadata rows); bumped when it changes
KV_LAYOUT = "page,head,token,dim"  # how a KV buffer's page is laid out (transfer/base.py KVArgs)
SAMPLE_BYTES = 4096  # bytes read from each of a tensor's start, middle and end
KEY_CHARS = 32  # hex digits of a pairing key
MAX_HEADER_BYTES = 100 << 20  # a safetensors header larger than this is not a checkpoint's

_Name = Annotated[str, msgspec.Meta(max_length=256)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
_Size = Annotated[int, msgspec.Meta(ge=1, le=1 << 12)]


class Compatibility(msgspec.Struct, frozen=True, kw_only=True):
    """What one node loaded and how it moves KV (as `/server_info` shows it under `compatibility`)."""

    weights: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16,128}$")]  # checkpoint_digest / dummy_digest
    model: _Name  # the model's name (its directory's): shown in messages, not compared
    dtype: _Name  # compute dtype
    kv_cache_dtype: _Name
    kv_layout: _Name
    page_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    head_dim: _Count
    kv_heads: _Count  # in total, over the node's TP ranks
    layers: _Count
    quantization: _Name = "none"  # how the linear weights are stored (part of the weights as loaded)
    draft_layers: bool = False  # EAGLE / MTP: the draft layer's KV moves too
    tp_size: _Size = 1
    pp_size: _Size = 1
    dp_size: _Size = 1
    # a prefill's --disaggregation-decode-tp (0: any)
    decode_tp: Annotated[int, msgspec.Meta(ge=0, le=1 << 12)] = 0
    transfer_backend: _Name = ""
    protocol: Annotated[int, msgspec.Meta(ge=0)] = PROTOCOL_VERSION


# what must be equal on both sides of a transfer (the parallel shape may differ: M:N TP pairs)
PAIRING_FIELDS = ("weights", "dtype", "kv_cache_dtype", "kv_layout", "page_size",
                  "head_dim", "kv_heads", "layers",
                  "quantization", "draft_layers", "transfer_backend", "protocol")


def as_dict(c: Compatibility) -> dict[str, Any]:
    return msgspec.to_builtins(c)


def parse(value) -> Compatibility:
    """A peer's `compatibility` (decoded JSON) as a `Compatibility`; ValueError naming the bad field."""
    if not isinstance(value, dict):
        raise ValueError(f"compatibility must be a JSON object, got {type(value).__name__}")
    try:
        return msgspec.convert(value, Compatibility)
    except msgspec.ValidationError as e:
        raise ValueError(f"compatibility: {e}") from None


def pairing_key(c: Compatibility) -> str:
    """A digest of the fields a prefill and a decode node must share (equal keys: they can pair)."""
    facts = {f: getattr(c, f) for f in PAIRING_FIELDS}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:KEY_CHARS]


def _shown(field: str, value) -> str:
    if field == "weights":
        return value[:12] + "…"
    return repr(value) if isinstance(value, str) else str(value)


def mismatch(a: Compatibility, b: Compatibility,
             names: tuple[str, str] = ("prefill", "decode")) -> str | None:
    """None when `a` and `b` share every pairing field; else the first that differs, with both values
    ("weights differ: prefill 1a2b3c4d5e6f…, decode 9f8e7d6c5b4a… (same model name 'model')")."""
    for field in PAIRING_FIELDS:
        x, y = getattr(a, field), getattr(b, field)
        if x != y:
            verb = "differ" if field == "weights" else "differs"
            text = f"{field} {verb}: {names[0]} {_shown(field, x)}, {names[1]} {_shown(field, y)}"
            if field == "weights":
                text += (f" (same model name {a.model!r})" if a.model == b.model
                         else f" (models {a.model!r} and {b.model!r})")
            return text
    return None


def pair_problem(prefill: Compatibility, decode: Compatibility) -> str | None:
    """None when a prefill node of `prefill` can send its KV to a decode node of `decode`: the pairing
    fields equal, and the decode's parallel shape one the prefill serves (every layer on one decode
    stage; the decode TP a prefill's --disaggregation-decode-tp names)."""
    problem = mismatch(prefill, decode)
    if problem:
        return problem
    if decode.pp_size != 1:
        return f"decode pp_size {decode.pp_size}: a decode node holds every layer (pp_size 1)"
    if prefill.decode_tp and decode.tp_size != prefill.decode_tp:
        return (f"decode tp_size {decode.tp_size}: the prefill serves decode tp {prefill.decode_tp} only "
                "(--disaggregation-decode-tp)")
    if decode.kv_heads % decode.tp_size:
        return f"decode tp_size {decode.tp_size} does not split its {decode.kv_heads} kv heads"
    return None


# ----------------------------------------------------------------------------------------- the weights digest
def _config_facts(config: dict[str, Any]) -> str:
    """The model config as parsed, without its name (a directory's name is not the model)."""
    return json.dumps({k: v for k, v in config.items() if k != "name"}, sort_keys=True, default=str)


def safetensors_header(f) -> tuple[dict[str, Any], int]:
    """(the header's tensor entries, the byte where the data starts) of an open safetensors file."""
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError("not a safetensors file (shorter than its header length)")
    (size,) = struct.unpack("<Q", raw)
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"safetensors header of {size} bytes (more than {MAX_HEADER_BYTES})")
    header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + size


def _sample_offsets(nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the bytes of a tensor of `nbytes` that the digest reads."""
    if nbytes <= 3 * SAMPLE_BYTES:
        return [(0, nbytes)]
    middle = nbytes // 2 - SAMPLE_BYTES // 2
    return [(0, SAMPLE_BYTES), (middle, SAMPLE_BYTES), (nbytes - SAMPLE_BYTES, SAMPLE_BYTES)]


def checkpoint_digest(files: list[str], config: dict[str, Any]) -> str:
    """The weights digest of a safetensors checkpoint (`files`: one or its shards) loaded as `config`
    (`ModelConfig.to_dict()`); ValueError for a file that is not safetensors or a tensor named twice."""
    per_tensor: dict[str, bytes] = {}
    for path in files:
        with open(path, "rb") as f:
            header, start = safetensors_header(f)
            entries = []
            for name, entry in header.items():
                offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
                if not (isinstance(offsets, list) and len(offsets) == 2
                        and all(isinstance(o, int) for o in offsets)
                        and 0 <= offsets[0] <= offsets[1]):
                    raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets")
                if name in per_tensor:
                    raise ValueError(f"{path}: tensor {name!r} is named twice in the checkpoint")
                entries.append((offsets[0], offsets[1], name, entry))
            for begin, end, name, entry in sorted(entries):  # in file order: the reads move forward
                h = hashlib.sha256(json.dumps([name, entry.get("dtype"),
                                               entry.get("shape"), end - begin]).encode())
                for off, n in _sample_offsets(end - begin):
                    f.seek(start + begin + off)
                    h.update(f.read(n))
                per_tensor[name] = h.digest()
    total = hashlib.sha256(b"pdserve weights 1\0" + _config_facts(config).encode() + b"\0")
    for name in sorted(per_tensor):
        total.update(per_tensor[name])
    return total.hexdigest()


def dummy_digest(config: dict[str, Any], seed: int, std: float, tp_size: int, pp_size: int) -> str:
    """The weights digest of `--load-format dummy`: the random fill is a function of the config, its seed
    and spread, and the shard shapes of the node's TP / PP ranks."""
    facts = json.dumps([_config_facts(config), seed, std, tp_size, pp_size])
    return hashlib.sha256(b"pdserve dummy weights 1\0" + facts.encode()).hexdigest()
