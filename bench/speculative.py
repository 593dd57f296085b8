"""N-gram speculative decoding through the real scheduler loop (part of `pdserve bench engine`).

Two workloads: `repetitive`, where n-gram drafts pay (each prompt is a passage of this project's
ARCHITECTURE.md given twice, so the model's greedy continuation copies it a third time, as in editing or
quoting text the prompt already holds), and `chat` (short questions in the model's chat template:
natural answers, where drafts are right less often and a wrong one costs a wider forward). Each run
is `bench/overlap.py`'s `decode_loop_run`: a `Scheduler` over the shared `ModelRunner`, the prompts
as greedy streaming requests, timed from when all are prefilled until every request has its tokens.
Runs with and without
`--speculative-algorithm NGRAM` alternate; tokens must be identical. Ratio `spec_ngram` = decode
tokens/s with speculation / without on the repetitive workload at batch 1 (`spec_ngram_b16` at 16;
`spec_ngram_chat`, `spec_ngram_chat_b16` on chat), with the accept length (tokens a request gets per
verify forward).
"""

from __future__ import annotations

import os

from bench.overlap import decode_loop_run
from common.runner import ModelRunner

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repetitive_prompts(tokenizer_dir: str, n: int, passage_tokens: int) -> list[list[int]]:
    """`n` prompts, each a different ARCHITECTURE.md passage of `passage_tokens` tokens given twice."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    with open(os.path.join(ROOT, "ARCHITECTURE.md"), encoding="utf-8") as f:
        ids = tok(f.read())["input_ids"]
    need = n * passage_tokens
    if len(ids) < need:
        ids = (ids * (need // max(len(ids), 1) + 1))[:need]
    return [ids[i * passage_tokens:(i + 1) * passage_tokens] * 2 for i in range(n)]


QUESTIONS = ["Write a short story about a robot learning to paint.", "Explain how a refrigerator works.",
             "List ten ideas for a birthday party.", "What are the benefits of exercise? Answer in detail."]


def chat_prompts(tokenizer_dir: str, n: int) -> list[list[int]]:
    """`n` chat prompts (the questions above in turn) in the model's chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return [list(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False))
            for i in range(n)]


def loop_run(runner: ModelRunner, model_dir: str, prompts: list[list[int]], new_tokens: int,
             spec: dict | None) -> tuple[float, dict[str, list[int]], dict]:
    """(seconds of the decode phase, tokens by rid, the scheduler's spec stats) for one run."""
    plain = {"speculative_algorithm": None, "speculative_num_draft_tokens": None}
    wall, _, tokens, sched = decode_loop_run(runner, model_dir, prompts, new_tokens - 1,
                                             **{**plain, **(spec or {})})
    stats = sched.drafter.stats.as_dict() if sched.drafter is not None else {}
    stats["decoded_tokens"] = sum(len(t) for t in tokens.values()) - len(prompts)  # less each prefill's token
    return wall, tokens, stats


def measure(runner: ModelRunner, model_dir: str,
            workloads: dict[str, dict[int, list[list[int]]]], new_tokens: int,
            draft_tokens: int, repeats: int, log) -> tuple[dict, dict]:
    """`workloads`: name -> batch size -> prompts. Figures `spec_ngram[_<name>]_b<B>`, ratios
    `spec_ngram[_<name>][_b<B>]` (the repetitive workload and batch 1 carry no suffix)."""
    figures, ratios = {}, {}
    for name, by_batch in workloads.items():
        tag = "" if name == "repetitive" else f"_{name}"
        f, r = _measure_workload(runner, model_dir, by_batch, new_tokens, draft_tokens, repeats,
                                 lambda m, name=name: log(f"{name} {m}"))
        figures.update({k.replace("spec_ngram", "spec_ngram" + tag, 1): v for k, v in f.items()})
        ratios.update({k.replace("spec_ngram", "spec_ngram" + tag, 1): v for k, v in r.items()})
    return figures, ratios


def compare_on_off(plain: ModelRunner, drafting: ModelRunner, model_dir: str, prompts: list[list[int]],
                   new_tokens: int, spec: dict, repeats: int, log, label: str) -> tuple[dict, int, dict]:
    """Decode `prompts` without speculation (on `plain`) and with `spec` (on `drafting`; may be the same
    runner), alternating, `repeats` times after a warm-up of each: the best seconds of each side
    ({False: plain, True: speculating}), the decoded tokens and the speculating run's stats. The tokens
    must be identical (else the bench ends)."""
    for runner, s in ((plain, None), (drafting, spec)):  # warm both paths
        loop_run(runner, model_dir, prompts, 8, s)
    best = {False: float("inf"), True: float("inf")}
    out, stats, decoded = {}, {}, 0
    for rep in range(repeats):
        for on in (False, True):
            wall, toks, st = loop_run(drafting if on else plain, model_dir, prompts,
                                      new_tokens, spec if on else None)
            best[on] = min(best[on], wall)
            out[on], decoded = toks, st["decoded_tokens"]
            if on:
                stats = st
        log(f"{label} run {rep + 1}/{repeats}: {decoded / best[False]:7.1f} tok/s plain, "
            f"{decoded / best[True]:7.1f} tok/s speculating (accept length "
            f"{stats['spec_accept_length']:.2f})")
        if out[True] != out[False]:
            raise SystemExit(f"{label}: greedy tokens differ with speculation on and off")
    return best, decoded, stats


def _measure_workload(runner, model_dir, prompts_by_batch, new_tokens, draft_tokens, repeats, log):
    spec = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": draft_tokens}
    figures, ratios = {}, {}
    for b, prompts in prompts_by_batch.items():
        best, decoded, stats = compare_on_off(runner, runner, model_dir, prompts,
                                              new_tokens, spec, repeats, log, f"n-gram speculation b{b}")
        figures[f"spec_ngram_b{b}"] = {"draft_tokens": draft_tokens, "decoded_tokens": decoded,
                                       "tok_s_plain": decoded / best[False],
                                       "tok_s_spec": decoded / best[True], "tokens_identical": True, **stats}
        ratios["spec_ngram" if b == 1 else f"spec_ngram_b{b}"] = best[False] / best[True]
    return figures, ratios
