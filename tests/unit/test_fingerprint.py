"""The compatibility fingerprint (common/fingerprint.py): the weights digest of a checkpoint as read,
the pairing key and the named difference. The transfer handshake's refusal of another key:
tests/transfer/test_fingerprint_handshake.py."""

from __future__ import annotations

import json
import os
import shutil

import msgspec
import pytest
import torch
from msgspec.structs import replace
from safetensors.torch import load_file, save_file

from common.fingerprint import (
    PROTOCOL_VERSION,
    SAMPLE_BYTES,
    Compatibility,
    checkpoint_digest,
    dummy_digest,
    mismatch,
    pair_problem,
    pairing_key,
    parse,
)
from common.models.loader import safetensors_files, weights_digest

BASE = Compatibility(weights="ab" * 32, model="model", dtype="float32", kv_cache_dtype="float32",
                     kv_layout="page,head,token,dim", page_size=1, head_dim=16, kv_heads=2, layers=4,
                     transfer_backend="fake")


def _copy(src: str, dst) -> str:
    """A copy of model directory `src` at `dst` (a directory named as the caller likes)."""
    shutil.copytree(src, dst)
    return str(dst)


def _rewrite(model_dir: str, change) -> None:
    """Rewrite the checkpoint of `model_dir` with `change(tensors)` applied."""
    (path,) = safetensors_files(model_dir)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------- the weights digest
def test_the_digest_follows_the_tensors_not_the_path(tiny_model_dir, tmp_path):
    a = _copy(tiny_model_dir, tmp_path / "a" / "model")
    b = _copy(tiny_model_dir, tmp_path / "b" / "weights")
    assert weights_digest(a) == weights_digest(b) == weights_digest(tiny_model_dir)
    # other random weights of the same shape under the same directory name
    other = _copy(tiny_model_dir, tmp_path / "c" / "model")
    g = torch.Generator().manual_seed(1)
    _rewrite(other,
             lambda ts: ts.update({k: torch.randn(v.shape, generator=g) * 0.05 for k, v in ts.items()}))
    assert weights_digest(other) != weights_digest(a)


def test_the_digest_reads_the_start_middle_and_end_of_each_tensor(tiny_model_dir, tmp_path):
    base = weights_digest(tiny_model_dir)
    name = "model.embed_tokens.weight"  # large: sampled, not read whole
    n = load_file(safetensors_files(tiny_model_dir)[0])[name].numel()
    assert n * 4 > 3 * SAMPLE_BYTES
    for where in (0, n // 2, n - 1):
        d = _copy(tiny_model_dir, tmp_path / f"at{where}" / "model")

        def bump(ts, where=where):
            ts[name].view(-1)[where] += 1.0
        _rewrite(d, bump)
        assert weights_digest(d) != base, where


def test_the_digest_does_not_depend_on_sharding_and_covers_the_config(tiny_model_dir, tmp_path):
    tensors = load_file(safetensors_files(tiny_model_dir)[0])
    names = sorted(tensors)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(os.path.join(tiny_model_dir, "config.json"), sharded / "config.json")
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({k: tensors[k] for k in part}, str(sharded / file))
    index = {"weight_map": {k: f for f, part in halves.items() for k in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weights_digest(str(sharded)) == weights_digest(tiny_model_dir)
    cfg = json.loads((sharded / "config.json").read_text())
    (sharded / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-3}))
    assert weights_digest(str(sharded)) != weights_digest(tiny_model_dir)


def test_a_tensor_named_twice_or_a_bad_header_is_refused(tmp_path):
    save_file({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ValueError, match="named twice"):
        checkpoint_digest([str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")], {})
    (tmp_path / "c.safetensors").write_bytes(b"\x01")
    with pytest.raises(ValueError, match="not a safetensors file"):
        checkpoint_digest([str(tmp_path / "c.safetensors")], {})


def test_dummy_weights_digest_their_config_seed_and_shard_shape(tiny_model_dir):
    d = weights_digest(tiny_model_dir, "dummy")
    assert d == weights_digest(tiny_model_dir, "dummy") != weights_digest(tiny_model_dir)
    # each rank fills its own shard from the same seed: another TP / PP shape is other weights
    assert weights_digest(tiny_model_dir, "dummy", tp_size=2) != d
    assert weights_digest(tiny_model_dir, "dummy", pp_size=2) != d
    assert dummy_digest({"a": 1}, 0, 0.02, 1, 1) != dummy_digest({"a": 1}, 1, 0.02, 1, 1)


# ------------------------------------------------------------------------------------------ pairing
def test_the_pairing_key_ignores_the_parallel_shape_only():
    key = pairing_key(BASE)
    assert pairing_key(replace(BASE, tp_size=2, pp_size=2, dp_size=4, model="other")) == key
    for change in ({"weights": "cd" * 32}, {"page_size": 4}, {"dtype": "bfloat16"},
                   {"kv_cache_dtype": "bfloat16"},
                   {"kv_heads": 4}, {"transfer_backend": "nixl"}, {"protocol": PROTOCOL_VERSION + 1},
                   {"quantization": "int8wo"}, {"draft_layers": True}):
        assert pairing_key(replace(BASE, **change)) != key, change


def test_the_difference_is_named_with_both_values():
    assert mismatch(BASE, replace(BASE, tp_size=2)) is None
    other = replace(BASE, weights="9f" * 32)
    assert mismatch(BASE, other) == (f"weights differ: prefill {'ab' * 6}…, decode {'9f' * 6}… "
                                     "(same model name 'model')")
    assert mismatch(BASE, replace(BASE, page_size=4)) == "page_size differs: prefill 1, decode 4"
    assert mismatch(BASE, replace(BASE, dtype="bfloat16")) == \
        "dtype differs: prefill 'float32', decode 'bfloat16'"


def test_decode_shapes_a_prefill_cannot_serve():
    assert pair_problem(BASE, replace(BASE, tp_size=2)) is None  # M:N TP
    assert "pp_size 2" in pair_problem(BASE, replace(BASE, pp_size=2))
    assert "--disaggregation-decode-tp" in pair_problem(replace(BASE, decode_tp=1),
                                                        replace(BASE, tp_size=2))


def test_a_peer_compatibility_is_checked_field_by_field():
    good = msgspec.to_builtins(BASE)
    assert parse(good) == BASE
    assert parse({**good, "from_a_newer_node": 1}) == BASE
    with pytest.raises(ValueError, match="page_size"):
        parse({**good, "page_size": "1"})
    with pytest.raises(ValueError, match="weights"):
        parse({**good, "weights": "not hex"})
    with pytest.raises(ValueError, match="JSON object"):
        parse([good])


def test_the_runner_reports_what_it_loaded(tiny_model_dir):
    from common.config import ServerArgs
    from common.runner import ModelRunner

    args = ServerArgs(model=tiny_model_dir, max_total_tokens=256, max_running_requests=4, context_length=64,
                      page_size=4)
    r = ModelRunner(args, tiny_model_dir)
    c = r.compatibility
    assert (c.weights, c.page_size, c.kv_heads, c.layers, c.head_dim) \
        == (weights_digest(tiny_model_dir), 4, 2, 4, 16)
    assert (c.dtype, c.kv_cache_dtype, c.protocol) == ("float32", "float32", PROTOCOL_VERSION)
    assert r.fingerprint == pairing_key(c)
    # what a rank of another TP shape computes: its shard does not enter the weights digest
    assert weights_digest(tiny_model_dir, args.load_format, 2, 1) == c.weights
