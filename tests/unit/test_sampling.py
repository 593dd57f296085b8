"""Sampler: greedy, temperature, top-k/top-p/min-p, penalties, seeds, logprobs, min_new_tokens."""

from __future__ import annotations

import math

import pytest
import torch

from common.layers.sampling import Sampler, SamplingBatchInfo, apply_penalties, filter_probs, make_generator
from common.protocol import SamplingParams

EOS = 2


def info_for(params, vocab, outputs=None, gens=None, prompts=None, eos=(EOS,)):
    b = len(params)
    return SamplingBatchInfo.build(params, outputs or [[] for _ in range(b)], vocab,
                                   gens or [None] * b, list(eos), prompt_ids=prompts)


def draw_many(logits_row, params, n, seed=0):
    """n samples of one request, drawn as one batch of n identical rows."""
    logits = logits_row.expand(n, -1).contiguous()
    out = Sampler(seed=seed)(logits, info_for([params] * n, logits.shape[1]))
    return out.next_token_ids


def test_greedy_is_argmax_and_fast_path_has_no_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    info = info_for([SamplingParams(temperature=0.0)] * 16, 1000)
    out = Sampler()(logits, info)
    assert torch.equal(out.next_token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None
    # repeated calls: no randomness
    assert torch.equal(Sampler()(logits, info).next_token_ids, out.next_token_ids)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_top_k_1_equals_greedy_at_any_temperature(temperature):
    torch.manual_seed(1)
    logits = torch.randn(8, 500)
    info = info_for([SamplingParams(temperature=temperature, top_k=1)] * 8, 500)
    for seed in range(5):
        out = Sampler(seed=seed)(logits, info)
        assert torch.equal(out.next_token_ids, logits.argmax(-1))


def test_mixed_batch_greedy_rows_stay_argmax():
    torch.manual_seed(2)
    logits = torch.randn(6, 300)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)]
    out = Sampler(seed=3)(logits, info_for(params, 300))
    for i in range(0, 6, 2):
        assert out.next_token_ids[i] == logits[i].argmax()


def crafted_logits():
    # probabilities ~ 0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02 and then a tail of tiny ones
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])
    tail = torch.full((57,), 1e-5)
    probs = torch.cat([p, tail])
    probs = probs / probs.sum()
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(5))
    return torch.log(probs)[perm], probs[perm], perm


def allowed_top_p(probs, top_p):
    order = torch.argsort(probs, descending=True)
    kept, mass = [], 0.0
    for t in order.tolist():
        if mass >= top_p:
            break
        kept.append(t)
        mass += float(probs[t])
    return set(kept)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_never_leaves_allowed_set(k):
    logits, probs, _ = crafted_logits()
    allowed = set(torch.topk(probs, k).indices.tolist())
    ids = draw_many(logits, SamplingParams(temperature=1.0, top_k=k), 4000)
    seen = set(ids.tolist())
    assert seen <= allowed
    assert seen == allowed  # 4000 draws reach every allowed token


@pytest.mark.parametrize("top_p", [0.3, 0.5, 0.7, 0.85, 0.95])
def test_top_p_never_leaves_allowed_set(top_p):
    logits, probs, _ = crafted_logits()
    allowed = allowed_top_p(probs, top_p)
    ids = draw_many(logits, SamplingParams(temperature=1.0, top_p=top_p), 4000)
    seen = set(ids.tolist())
    assert seen <= allowed
    assert seen == allowed


def test_top_p_over_large_vocab_needs_the_wide_path():
    # a slowly decaying distribution (no ties): the top-p cut-off (~15000 tokens) lies far beyond
    # the first topk windows
    vocab = 20000
    logits = -torch.arange(vocab, dtype=torch.float32) * 1e-4
    probs = torch.softmax(logits, 0)
    allowed = allowed_top_p(probs, 0.9)
    assert len(allowed) > 4096  # beyond both windows: exercises the full sort
    ids = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.9), 200)
    seen = set(ids.tolist())
    assert seen <= allowed
    assert max(seen) > 4096


@pytest.mark.parametrize("min_p", [0.1, 0.3, 0.7])
def test_min_p_never_leaves_allowed_set(min_p):
    logits, probs, _ = crafted_logits()
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    ids = draw_many(logits, SamplingParams(temperature=1.0, min_p=min_p), 4000)
    seen = set(ids.tolist())
    assert seen <= allowed
    assert seen == allowed


def test_top_p_applies_to_distribution_renormalised_after_top_k():
    logits, probs, _ = crafted_logits()
    # top-k 3 keeps 0.4/0.25/0.15 (renormalised 0.5/0.3125/0.1875); top-p 0.75: first two (0.8125)
    top3 = torch.topk(probs, 3).indices.tolist()
    ids = draw_many(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.75), 3000)
    assert set(ids.tolist()) == set(top3[:2])


def test_filters_combined_per_row_in_one_batch():
    logits, probs, _ = crafted_logits()
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0, min_p=0.5), SamplingParams(temperature=1.0)]
    n = 1500
    rows = logits.expand(4 * n, -1).contiguous()
    info = info_for([p for p in params for _ in range(n)], 64)
    ids = Sampler(seed=9)(rows, info).next_token_ids.view(4, n)
    order = torch.argsort(probs, descending=True).tolist()
    assert set(ids[0].tolist()) == set(order[:2])
    assert set(ids[1].tolist()) == allowed_top_p(probs, 0.5)
    assert set(ids[2].tolist()) == set(torch.nonzero(probs >= 0.5 * probs.max()).flatten().tolist())
    assert set(order[:7]) <= set(ids[3].tolist())  # the unfiltered row reaches every likely token


def test_filter_probs_zeroes_exactly_the_excluded_tokens():
    logits, probs, _ = crafted_logits()
    info = info_for([SamplingParams(temperature=1.0, top_k=4, min_p=0.3)], 64)
    out = filter_probs(probs.view(1, -1).clone(), info)[0]
    keep = set(torch.nonzero(out).flatten().tolist())
    order = torch.argsort(probs, descending=True).tolist()
    assert keep == set(order[:3])  # top-4 then min-p 0.3 * 0.4 = 0.12 removes 0.1
    assert torch.equal(out[out > 0], probs[out > 0])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_distribution(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    expected = torch.softmax(logits / temperature, 0)
    n = 40000
    ids = draw_many(logits, SamplingParams(temperature=temperature), n, seed=11)
    counts = torch.bincount(ids, minlength=6).double()
    exp_counts = expected.double() * n
    chi2 = float(((counts - exp_counts) ** 2 / exp_counts).sum())
    # 5 degrees of freedom: P(chi2 > 25) ~ 1.4e-4
    assert chi2 < 25.0, (chi2, counts.tolist(), exp_counts.tolist())
    # and a wrong temperature would be far off
    wrong = torch.softmax(logits / (temperature * 1.5), 0).double() * n
    assert float(((counts - wrong) ** 2 / wrong).sum()) > 100.0


def test_frequency_and_presence_penalties_exact_values():
    vocab = 10
    logits = torch.arange(vocab, dtype=torch.float32).view(1, -1) - 4.0
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25)]
    info = info_for(params, vocab, outputs=[[3, 3, 3, 7, 1]], prompts=[[5, 5, 6]])
    out = apply_penalties(logits.clone(), info)[0]
    expected = logits[0].clone()
    expected[3] -= 0.5 * 3 + 0.25
    expected[7] -= 0.5 + 0.25
    expected[1] -= 0.5 + 0.25
    # prompt tokens (5, 6) are not penalised by frequency/presence
    assert torch.allclose(out, expected, atol=0, rtol=0)


def test_repetition_penalty_over_prompt_and_output_hf_semantics():
    vocab = 10
    logits = torch.tensor([[-2.0, 3.0, -1.0, 4.0, 0.5, -0.5, 2.0, 1.0, -3.0, 6.0]])
    info = info_for([SamplingParams(temperature=0.0, repetition_penalty=2.0)], vocab,
                    outputs=[[1, 2, 1]], prompts=[[4, 5, 9]])
    out = apply_penalties(logits.clone(), info)[0]
    expected = logits[0].clone()
    for t in (1, 2, 4, 5, 9):
        v = float(expected[t])
        expected[t] = v / 2.0 if v > 0 else v * 2.0
    assert torch.equal(out, expected)
    # greedy picks the argmax of the penalised logits: 9 (6.0 -> 3.0) loses to 3 (4.0)
    assert Sampler()(logits, info).next_token_ids.item() == 3


def test_penalties_are_per_row():
    vocab = 8
    logits = torch.zeros(2, vocab)
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0),
              SamplingParams(temperature=0.0, presence_penalty=0.5)]
    info = info_for(params, vocab, outputs=[[0, 0], [0, 0, 0]])
    out = apply_penalties(logits.clone(), info)
    assert out[0, 0].item() == -2.0 and out[1, 0].item() == -0.5
    assert torch.count_nonzero(out).item() == 2


def test_min_new_tokens_masks_eos_and_stop_ids():
    vocab = 20
    logits = torch.zeros(2, vocab)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 4] = 8.0
    p = SamplingParams(temperature=0.0, min_new_tokens=3, stop_token_ids=[7])
    info = info_for([p, p], vocab, outputs=[[5, 5], [5, 5, 5]])
    out = Sampler()(logits, info).next_token_ids.tolist()
    assert out == [4, EOS]  # row 0 has 2 < 3 tokens: EOS and stop id 7 are masked
    # sampling at a high temperature never picks a masked token before min_new_tokens
    ids = draw_many(torch.zeros(vocab).index_fill(0, torch.tensor([EOS, 7]), 5.0),
                    SamplingParams(temperature=1.0, min_new_tokens=1, stop_token_ids=[7]), 3000)
    assert EOS not in set(ids.tolist()) and 7 not in set(ids.tolist())


def test_seeded_request_reproducible_and_batch_independent():
    torch.manual_seed(3)
    vocab = 5000
    target = torch.randn(vocab) * 2
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=1234)

    def run(batch_logits, row, others_params):
        gen = make_generator(1234)
        tokens = []
        for _step in range(20):
            ps = list(others_params)
            ps.insert(row, params)
            gens = [make_generator(77) if q.seed is not None else None for q in others_params]
            gens.insert(row, gen)
            info = SamplingBatchInfo.build(ps, [[] for _ in ps], vocab, gens, [EOS])
            tokens.append(int(Sampler()(batch_logits, info).next_token_ids[row]))
        return tokens

    alone = run(target.view(1, -1), 0, [])
    assert len(set(alone)) > 3  # it really samples
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.5, top_k=3, seed=5), SamplingParams(temperature=1.3, min_p=0.1)]
    batch = torch.randn(5, vocab) * 2
    batch[2] = target
    assert run(batch, 2, others) == alone
    assert run(target.view(1, -1), 0, []) == alone
    # a different seed gives a different sequence
    other_gen = make_generator(4321)
    info = SamplingBatchInfo.build([params], [[]], vocab, [other_gen], [EOS])
    diff = [int(Sampler()(target.view(1, -1), info).next_token_ids[0]) for _ in range(20)]
    assert diff != alone


def test_logprobs_are_log_softmax_of_raw_logits_at_chosen_ids():
    torch.manual_seed(4)
    logits = torch.randn(6, 400) * 3
    params = [SamplingParams(temperature=0.7, repetition_penalty=1.3, top_k=20),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.8),
              SamplingParams(temperature=2.0, frequency_penalty=1.0),
              SamplingParams(temperature=0.0, top_k=1), SamplingParams(temperature=1.0, min_p=0.2)]
    info = info_for(params, 400, outputs=[[1, 2, 3]] * 6)
    out = Sampler(seed=0)(logits, info, top_logprobs_nums=[0] * 6)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.next_token_ids.view(-1, 1)).squeeze(1))
    assert out.top_logprobs is None or all(t == [] for t in out.top_logprobs)
    # greedy batch with return_logprob still returns them (no fast path)
    info_g = info_for([SamplingParams(temperature=0.0)] * 6, 400)
    out_g = Sampler()(logits, info_g, return_logprob=True)
    assert torch.allclose(out_g.logprobs, ref.max(-1).values)


def test_top_logprobs_sorted_correct_and_per_request_count():
    torch.manual_seed(5)
    logits = torch.randn(3, 300)
    nums = [5, 0, 2]
    out = Sampler()(logits, info_for([SamplingParams(temperature=0.0)] * 3, 300), top_logprobs_nums=nums)
    ref = torch.log_softmax(logits, -1)
    assert [len(t) for t in out.top_logprobs] == nums
    for i, n in enumerate(nums):
        vals = [v for v, _ in out.top_logprobs[i]]
        ids = [t for _, t in out.top_logprobs[i]]
        assert vals == sorted(vals, reverse=True)
        assert ids == torch.topk(ref[i], n).indices.tolist() if n else ids == []
        for v, t in out.top_logprobs[i]:
            assert math.isclose(v, float(ref[i, t]), rel_tol=0, abs_tol=1e-6)
        if n:
            assert ids[0] == out.next_token_ids[i].item()


def test_build_rejects_mismatched_lengths_and_logits_shape():
    with pytest.raises(ValueError):
        SamplingBatchInfo.build([SamplingParams()], [[], []], 10, [None], [EOS])
    info = info_for([SamplingParams()], 10)
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 10), info)


def test_make_generator_accepts_any_int_seed():
    a = torch.rand(3, generator=make_generator(-5))
    b = torch.rand(3, generator=make_generator(-5))
    c = torch.rand(3, generator=make_generator(2**70 + 3))
    assert torch.equal(a, b) and c.shape == (3,)
