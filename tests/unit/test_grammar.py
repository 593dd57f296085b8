"""Constrained decoding pieces (`common/grammar.py`, `common/scheduler/grammar_queue.py`), logit bias in
the sampler and `stop_regex` in `Req.check_finished`, on SmolLM2's tokenizer: random logits, masked by a
grammar, always make an answer the grammar accepts."""

from __future__ import annotations

import json
import re
import shutil
import time

import pytest
import torch
from transformers import AutoTokenizer

from common.grammar import GrammarCompiler, GrammarError, apply_grammars, tokenizer_info
from common.layers.sampling import Sampler, SamplingBatchInfo
from common.protocol import SamplingParams
from common.scheduler.grammar_queue import GrammarQueue
from common.scheduler.req import Req

SCHEMA = {"type": "object", "required": ["ok", "n"], "additionalProperties": False,
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def compiler(tok, tokenizer_dir):
    c = GrammarCompiler(tokenizer_dir, 49152, [tok.eos_token_id])
    yield c
    c.close()


def run(compiler, tok, kind, source, seed):
    g = compiler.matcher(compiler.submit(kind, source).result())
    gen, out = torch.Generator().manual_seed(seed), []
    for _ in range(100):
        logits = torch.randn(2, 49152, generator=gen)
        apply_grammars(logits, [None, g])  # row 0 has no grammar: untouched
        assert torch.isfinite(logits[0]).all()
        t = int(torch.multinomial(torch.softmax(logits[1], -1), 1, generator=gen))
        assert g.accept(t)
        if g.terminated:
            return tok.decode(out)
        out.append(t)
    raise AssertionError("the grammar did not end")


@pytest.mark.parametrize("seed", range(3))
def test_random_logits_under_a_grammar_follow_it(compiler, tok, seed):
    obj = json.loads(run(compiler, tok, "json_schema", json.dumps(SCHEMA), seed))
    assert set(obj) == {"ok", "n"} and isinstance(obj["ok"], bool) and 0 <= obj["n"] <= 99
    assert re.fullmatch(r"[ab]{2}-[0-9]", run(compiler, tok, "regex", r"[ab]{2}-[0-9]", seed))
    assert run(compiler, tok, "ebnf", 'root ::= "x" ("y" | "z")', seed) in ("xy", "xz")


@pytest.mark.parametrize("vocab_size", [49152, 49160])  # the model's vocabulary, padded or not
def test_tokenizer_info_without_transformers_is_xgrammars_own(tok, tokenizer_dir, tmp_path, vocab_size):
    """What the grammar thread builds from tokenizer.json equals xgrammar's own reading of the Hugging Face
    tokenizer, token for token; one it cannot read that way (an added token tokenizer.json lacks) goes to
    transformers."""
    import xgrammar as xgr

    want = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size, stop_token_ids=[tok.eos_token_id])
    got = tokenizer_info(tokenizer_dir, vocab_size, [tok.eos_token_id])
    assert json.loads(got.serialize_json()) == json.loads(want.serialize_json())
    assert got.vocab_type == want.vocab_type and got.add_prefix_space == want.add_prefix_space
    # the tokenizer the scheduler already holds for stop strings gives the same info, not parsed again
    from tokenizers import Tokenizer

    held = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    again = tokenizer_info("/nonexistent", vocab_size, [tok.eos_token_id], held)
    assert json.loads(again.serialize_json()) == json.loads(want.serialize_json())
    # tokenizer_config.json names an added token tokenizer.json lacks: that one is left to transformers
    odd = tmp_path / "odd"
    shutil.copytree(tokenizer_dir, odd)
    cfg = json.loads((odd / "tokenizer_config.json").read_text())
    cfg.setdefault("added_tokens_decoder",
                   {})[str(vocab_size - 1)] = {"content": "<|padding|>", "special": True}
    (odd / "tokenizer_config.json").write_text(json.dumps(cfg))
    from common.grammar import _fast_vocab

    assert _fast_vocab(str(odd), xgr) is None and _fast_vocab(tokenizer_dir, xgr) is not None


def test_compiled_once_and_errors_named(compiler):
    before = compiler.hits
    compiler.submit("regex", "abc").result()
    compiler.submit("regex", "abc").result()
    assert compiler.hits == before + 1
    for kind, source in (("json_schema", "{nope"), ("regex", "(a"), ("ebnf", "root ::= ")):
        with pytest.raises(GrammarError, match=f"`{kind}` cannot be compiled: [^\\[]"):
            compiler.submit(kind, source).result()


def test_grammar_queue_admits_when_ready(compiler):
    q = GrammarQueue(lambda: compiler, tp_size=1)
    good = Req("a", [1], SamplingParams(regex="a+"))
    bad = Req("b", [1], SamplingParams(regex="(a"))
    q.add(good)
    q.add(bad)
    ready, failed = [], []
    for _ in range(200):
        q.poll(ready.append, lambda r, m: failed.append((r, m)))
        if not q:
            break
        time.sleep(0.01)  # the compiler's thread works
    assert ready == [good] and good.grammar is not None
    assert failed[0][0] is bad and "regex" in failed[0][1]


def test_logit_bias_moves_the_argmax():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 1.0
    params = [SamplingParams(temperature=0, logit_bias={"7": 5.0}), SamplingParams(temperature=0)]
    info = SamplingBatchInfo.build(params, [[], []], 10, [None, None], [0])
    assert Sampler()(logits, info).next_token_ids.tolist() == [7, 3]


def test_stop_regex_ends_and_names_the_match(tok):
    ids = tok.encode("the order 1234 is ready", add_special_tokens=False)
    req = Req("r", [1], SamplingParams(stop_regex=[r"[0-9]{4}"], max_new_tokens=50), tokenizer=tok)
    for t in ids:
        req.output_ids.append(t)
        if req.check_finished():
            break
    assert req.finished_reason == {"type": "stop", "matched": "1234"}
