"""Incremental detokenizer: UTF-8 split across tokens, special tokens, stop trimming (real tokenizer)."""

from __future__ import annotations

import pytest

from common.server.detokenizer import IncrementalDetokenizer, decode_ids, trim_stop


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def run(detok: IncrementalDetokenizer, ids: list[int], finish: dict | None, per_step: int = 1) -> list[str]:
    """Feed ids a few at a time (the finish reason comes with the last ones); return the deltas and
    check that the released text only ever grows."""
    deltas = []
    for i in range(0, len(ids), per_step):
        chunk = ids[i:i + per_step]
        last = i + per_step >= len(ids)
        before = detok.text
        deltas.append(detok.step(chunk, finish if last else None))
        assert detok.text.startswith(before)
        assert detok.text == before + deltas[-1]
    return deltas


def test_multibyte_utf8_split_across_tokens(tok):
    text = " héllo 世界 😀 naïve — ok"
    ids = tok.encode(text, add_special_tokens=False)
    singles = [tok.decode([i]) for i in ids]
    # precondition: this tokenizer really splits some character over several tokens
    assert any("\ufffd" in s for s in singles), singles
    prompt = tok.encode("Say:", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    deltas = run(d, ids, {"type": "length", "length": len(ids)})
    assert all("\ufffd" not in x for x in deltas), deltas
    assert "".join(deltas) == tok.decode(ids) == d.text
    # held back while incomplete: some steps released nothing
    assert sum(1 for x in deltas if x == "") >= 1
    assert "😀" in deltas[[i for i, x in enumerate(deltas) if "😀" in x][0]]


def test_matches_full_decode_for_mixed_text(tok):
    text = "Paris is the capital of France. Ünïcödé ✓ 東京 12345 \n\tend"
    ids = tok.encode(text, add_special_tokens=False)
    for per_step in (1, 2, 3):
        d = IncrementalDetokenizer(tok, tok.encode("Q:", add_special_tokens=False))
        deltas = run(d, ids, {"type": "length", "length": len(ids)}, per_step)
        assert "".join(deltas) == tok.decode(ids)


def test_special_tokens_skipped_or_kept(tok):
    specials = sorted(set(tok.all_special_ids))
    assert specials, "the test tokenizer has special tokens"
    sp = specials[0]
    body = tok.encode("hello world", add_special_tokens=False)
    ids = [sp, *body, sp]
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    run(d, ids, {"type": "length", "length": len(ids)})
    assert d.text == tok.decode(body)
    sp_text = tok.convert_ids_to_tokens(sp)
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=False, spaces_between_special_tokens=False)
    run(d, ids, {"type": "length", "length": len(ids)})
    assert d.text == sp_text + tok.decode(body) + sp_text
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=False, spaces_between_special_tokens=True)
    run(d, ids, {"type": "length", "length": len(ids)})
    assert d.text == sp_text + " " + tok.decode(body) + " " + sp_text
    assert decode_ids(tok, ids, skip_special_tokens=False, spaces_between_special_tokens=True) == d.text


def test_stop_string_trimmed_and_never_streamed(tok):
    out = " The answer is 42. END of story"
    ids = tok.encode(out, add_special_tokens=False)
    # the scheduler finishes on the token that completes "END"
    cut = next(n for n in range(1, len(ids) + 1) if "END" in tok.decode(ids[:n]))
    ids = ids[:cut]
    d = IncrementalDetokenizer(tok, [], stop_strings=["END"])
    deltas = run(d, ids, {"type": "stop", "matched": "END"})
    assert d.text == " The answer is 42. "
    assert "".join(deltas) == d.text
    assert all("E" not in x for x in deltas)
    # no_stop_trim keeps the stop string
    d = IncrementalDetokenizer(tok, [], stop_strings=["END"], no_stop_trim=True)
    run(d, ids, {"type": "stop", "matched": "END"})
    assert d.text == tok.decode(ids)
    assert "END" in d.text


def test_stop_prefix_released_when_it_does_not_complete(tok):
    ids = tok.encode(" a b c d", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop_strings=[" c x"])
    deltas = run(d, ids, {"type": "length", "length": len(ids)})
    assert d.text == " a b c d"
    # " c" was held while it could still start the stop string
    assert "".join(deltas[:-1]) == " a b"


def test_stop_token_id_trimmed(tok):
    eos = tok.eos_token_id if tok.eos_token_id is not None else sorted(tok.all_special_ids)[0]
    body = tok.encode(" hi there", add_special_tokens=False)
    ids = [*body, eos]
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    run(d, ids, {"type": "stop", "matched": eos})
    assert d.text == tok.decode(body)
    d = IncrementalDetokenizer(tok, [], skip_special_tokens=False, spaces_between_special_tokens=False,
                               no_stop_trim=True)
    run(d, ids, {"type": "stop", "matched": eos})
    assert d.text == tok.decode(ids)
    # a plain-word stop token id is trimmed as well
    d = IncrementalDetokenizer(tok, [])
    run(d, body, {"type": "stop", "matched": body[-1]})
    assert d.text == tok.decode(body[:-1])


def test_trim_stop_helper():
    assert trim_stop("abc STOP def", {"type": "stop", "matched": "STOP"}, False) == "abc "
    assert trim_stop("abc STOP def", {"type": "stop", "matched": "STOP"}, True) == "abc STOP def"
    assert trim_stop("abc", {"type": "length", "length": 3}, False) == "abc"
    assert trim_stop("abc", None, False) == "abc"
