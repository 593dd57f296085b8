"""N-gram speculative decoding (common/scheduler/speculative.py) through the real scheduler and runner:
greedy output is token-identical to no speculation (and to transformers), with penalties, logit bias,
min_new_tokens, logprobs, stop conditions, chunked prefill, the radix cache and retraction; sampled
output keeps its distribution; every page and row is back at the end."""

from __future__ import annotations

from array import array

import pytest
import torch

from common.config import ConfigError, ServerArgs
from common.protocol import SamplingParams
from common.scheduler.req import Req
from common.scheduler.speculative import NgramDrafter, accepted_run
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)
from tests.unit.test_engine_correctness import Engine, hf_greedy, prompts_of

# the shortest window drafts most often: more drafts, more rejections to get right
SPEC = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=5,
            speculative_ngram_min_match_window_size=1)


def _bytes(tokens: list[int]) -> bytes:
    return array("i", tokens).tobytes()


def test_propose_takes_the_longest_suffix_and_its_latest_occurrence():
    d = NgramDrafter(5, 1, 3)
    # suffix [1, 2, 3] occurred at 0 (followed by 4 5) and [2, 3] later at 6 (followed by 9)
    assert d.propose(_bytes([1, 2, 3, 4, 5, 2, 3, 9, 1, 2, 3]), 2) == [4, 5]
    assert d.propose(_bytes([7, 2, 3, 4, 5, 2, 3, 9, 1, 2, 3]), 4) == [9, 1, 2, 3]  # [2, 3] at 5: latest
    assert d.propose(_bytes([5, 6, 7]), 3) == []  # nothing repeats
    assert d.propose(_bytes([5, 6, 5]), 0) == []


def test_propose_continues_a_periodic_tail():
    # the latest earlier occurrence overlaps the suffix: the draft repeats the period
    assert NgramDrafter(5, 1, 3).propose(_bytes([9, 5, 5, 5, 5]), 4) == [5, 5, 5, 5]
    assert NgramDrafter(5, 1, 4).propose(_bytes([1, 2, 1, 2, 1, 2]), 3) == [1, 2, 1]


def test_propose_ignores_matches_across_token_boundaries():
    # the bytes of [1] (01 00 00 00) occur at byte 1 of [256, 0]; that is no occurrence of token 1
    assert NgramDrafter(4, 1, 2).propose(_bytes([256, 0, 1]), 3) == []
    assert NgramDrafter(4, 1, 2).propose(_bytes([256, 0, 1, 8, 1]), 3) == [8, 1, 8]


def test_drafts_respect_the_token_budget_and_grammar():
    d = NgramDrafter(6, 1, 4)
    r = Req("a", [4, 5, 6, 4, 5, 6, 4, 5], SamplingParams(max_new_tokens=3, temperature=0))
    r.kv_len = 8
    assert d.drafts_for([r], 2048) == [[6, 4]]  # 3 new tokens at most: 1 + 2 drafts
    r.output_ids = [6, 4]  # one token left: nothing to draft
    assert d.drafts_for([r], 2048) == [[]]
    r.output_ids, r.grammar = [], object()
    assert d.drafts_for([r], 2048) == [[]]


def test_drafts_that_keep_failing_back_off():
    d = NgramDrafter(4, 1, 3)
    r = Req("a", [1, 2, 3] * 3, SamplingParams(max_new_tokens=100, temperature=0))
    r.kv_len = 9

    def steps_until_a_draft() -> int:
        n = 0
        while not (drafts := d.drafts_for([r], 2048))[0]:
            n += 1
        return n, drafts

    pauses = []
    for _ in range(6):  # every draft rejected: 0, 1, 3, 7, 15, 15 steps without drafts before the next
        n, drafts = steps_until_a_draft()
        pauses.append(n)
        d.record([r], drafts, [1])
    n, drafts = steps_until_a_draft()
    assert pauses + [n] == [0, 0, 1, 3, 7, 15, 15]
    d.record([r], drafts, [2])  # one accepted: drafting every step again
    assert steps_until_a_draft()[0] == 0 and r.draft_fails == 0


def test_accepted_run():
    assert accepted_run([5, 6, 7], [5, 6, 8, 1]) == 2
    assert accepted_run([5, 6, 7], [4, 6, 7, 1]) == 0
    assert accepted_run([5, 6, 7], [5, 6, 7, 1]) == 3


def _run(model_dir, prompts, spec, sampling=None, **kw):
    eng = Engine(model_dir, **(SPEC if spec else {}), **kw)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, sampling=sampling(i) if sampling else None)
    toks = eng.run()
    finals = {f"r{i}": eng.final(f"r{i}") for i in range(len(prompts))}
    eng.assert_restored()
    return eng, toks, finals


def _repetitive(vocab, seed):
    a = prompts_of([3, 7, 5], vocab, seed=seed)
    return [a[0] * 12, a[1] * 5 + a[0], a[2] * 3]


@pytest.mark.parametrize("page_size", [4, 16])
def test_greedy_tokens_equal_no_speculation_and_hf(tiny_model_dir, hf_model, vocab, page_size):
    prompts = _repetitive(vocab, page_size) + prompts_of([5, 40, 70], vocab, seed=page_size)
    sp = lambda i: SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)  # noqa: E731
    eng, got, _ = _run(tiny_model_dir, prompts, True, sp, page_size=page_size)
    stats = eng.sched.get_stats()
    assert stats["spec_accepted_tokens"] > 0 and stats["spec_accept_length"] > 1.0
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf_model, p, 24), f"prompt {i}"


def test_sampling_options_and_stops_equal_no_speculation(tiny_model_dir, vocab):
    """Every option that depends on the tokens output so far sees the drafts as output."""
    prompts = _repetitive(vocab, 3) * 2
    base = dict(max_new_tokens=30, temperature=0)
    options = [
        dict(frequency_penalty=0.4, presence_penalty=0.2),
        dict(repetition_penalty=1.3),
        dict(logit_bias={str(prompts[2][0]): 5.0}),
        dict(min_new_tokens=20, ignore_eos=False, stop_token_ids=[prompts[3][1]]),
        dict(stop_token_ids=[prompts[4][2]]),
        dict(max_new_tokens=7),
    ]

    def sp(i):
        return SamplingParams(**{**base, **options[i]})

    eng_a, a, fa = _run(tiny_model_dir, prompts, False, sp)
    eng_b, b, fb = _run(tiny_model_dir, prompts, True, sp)
    assert eng_b.sched.drafter.stats.accepted > 0
    assert a == b
    for rid in fa:
        assert fa[rid].finish_reason == fb[rid].finish_reason, rid


def test_logprobs_equal_no_speculation(tiny_model_dir, vocab):
    prompts = _repetitive(vocab, 5)
    sp = lambda i: SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)  # noqa: E731

    def run(spec):
        eng = Engine(tiny_model_dir, **(SPEC if spec else {}))
        for i, p in enumerate(prompts):
            eng.submit(f"r{i}", p, sampling=sp(i), return_logprob=True, top_logprobs_num=3)
        eng.run()
        ups = eng.updates()
        eng.assert_restored()
        return {rid: ([x for u in us for x in (u.output_logprobs or [])],
                      [x for u in us for x in (u.output_top_logprobs or [])]) for rid, us in ups.items()}

    a, b = run(False), run(True)
    for rid in a:
        (lpa, ta), (lpb, tb) = a[rid], b[rid]
        assert [t for _, t in lpa] == [t for _, t in lpb] and len(lpa) == 20
        assert torch.allclose(torch.tensor([v for v, _ in lpa]), torch.tensor([v for v, _ in lpb]), atol=1e-4)
        assert [[t for _, t in row] for row in ta] == [[t for _, t in row] for row in tb]


def test_retraction_and_a_tight_pool_keep_the_tokens(tiny_model_dir, hf_model, vocab):
    prompts = _repetitive(vocab, 9) + prompts_of([20, 22, 18], vocab, seed=9)
    sp = lambda i: SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)  # noqa: E731
    eng, got, _ = _run(tiny_model_dir, prompts, True, sp, max_total_tokens=224, init_new_token_ratio=0.05,
                       min_new_token_ratio=0.01, decode_offload_size=0)
    assert eng.sched.num_retractions > 0, "the pool was meant to run out"
    assert eng.sched.drafter.stats.accepted > 0
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf_model, p, 40), f"prompt {i}"


def test_sampled_tokens_keep_their_distribution(tiny_model_dir, vocab):
    """Tokens 2..4 of 300 sampled continuations have the same distribution with and without
    speculation. A logit bias keeps every draw within the prompt's three tokens, so every step drafts
    (a scheme that kept drafts it should reject would put far more mass on the pattern's order)."""
    prompt = prompts_of([3], vocab, seed=11)[0] * 10
    bias = {str(t): 40.0 for t in prompt[:3]}
    n = 300

    def counts(spec):
        sp = lambda i: SamplingParams(max_new_tokens=4, temperature=1.0, top_k=3, seed=1000 + i + 7919 * spec,  # noqa: E731
                                      logit_bias=bias, ignore_eos=True)
        eng, got, _ = _run(tiny_model_dir, [prompt] * n, spec, sp,
                           max_running_requests=n, max_total_tokens=65536)
        if spec:
            assert eng.sched.drafter.stats.drafted >= n  # every request drafts at its first step
        return [[toks[j] for toks in got.values()] for j in (1, 2, 3)]

    a, b = counts(False), counts(True)
    for j, (xa, xb) in enumerate(zip(a, b, strict=True)):  # per position: at most 3 tokens (top_k)
        keys = set(xa) | set(xb)
        tv = sum(abs(xa.count(k) - xb.count(k)) for k in keys) / (2 * n)
        print(f"TV position {j + 1}: {tv:.3f}")
        assert tv < 0.12, (j, {k: (xa.count(k), xb.count(k)) for k in keys})


def test_wide_batches_do_not_speculate_past_the_limit(tiny_model_dir, vocab):
    prompts = _repetitive(vocab, 13)[:1] * 3
    sp = lambda i: SamplingParams(max_new_tokens=16 + 8 * (i == 0), temperature=0, ignore_eos=True)  # noqa: E731
    eng, got, _ = _run(tiny_model_dir, prompts, True, sp, speculative_disable_by_batch_size=1)
    # three requests decode together until the two short ones end; then the last one speculates alone
    assert eng.sched.drafter.stats.requests_verified == eng.sched.drafter.stats.verify_steps > 0
    _, plain, _ = _run(tiny_model_dir, prompts, False, sp)
    assert got == plain


@pytest.mark.parametrize("flags, message", [
    (dict(speculative_algorithm="MEDUSA"), "unknown algorithm"),
    (dict(speculative_num_draft_tokens=4), "needs --speculative-algorithm"),
    (dict(speculative_ngram_max_match_window_size=3), "needs --speculative-algorithm"),
    (dict(speculative_disable_by_batch_size=4), "needs --speculative-algorithm"),
    (dict(speculative_algorithm="NGRAM", speculative_disable_by_batch_size=0), "disable-by-batch-size"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1), "speculative-num-draft-tokens"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=4,
          speculative_ngram_max_match_window_size=2), "max-match-window-size"),
    (dict(speculative_algorithm="NGRAM", disaggregation_mode="prefill"), "prefill node"),
    (dict(speculative_algorithm="NGRAM", enable_overlap_schedule=True), "overlap"),
])
def test_flags_are_checked(flags, message):
    with pytest.raises(ConfigError, match=message):
        ServerArgs(**flags).validate()


def test_ngram_lowercase_is_accepted_with_defaults():
    a = ServerArgs(speculative_algorithm="ngram")
    a.validate()
    assert a.speculative_algorithm == "NGRAM" and a.speculative_num_draft_tokens == 4
    assert a.speculative_ngram_min_match_window_size == 3
