"""The lm-eval row: `local-completions` loglikelihoods checked against transformers on the same weights.

lm-eval scores a multiple-choice task (a task YAML over a JSONL file written here) through the router's
/v1/completions: for each (context, continuation) it sends the text with `echo`, `logprobs=1`,
`max_tokens=1` and sums the returned prompt logprobs past the context's tokens. The reference sums the
log-softmax of each continuation token given the context with transformers in float32 on the model's own
weights (the default model straight from its GGUF, `gguf_file=`; any other from its directory), the pair
split into tokens as lm-eval splits it. Pass: every loglikelihood within 1e-3 of the reference and the
accuracy lm-eval reports equal to the reference's.
"""

from __future__ import annotations

import glob
import json
import os

from bench.clients.rows import Context, Row, ended, python, run_client

TASK = "pdserve_choices"
TOLERANCE = 1e-3
DOCS = [
    ("The capital of France is", ["Paris", "London", "Madrid"], 0),
    ("The largest planet in the solar system is", ["Mercury", "Jupiter", "Mars"], 1),
    ("Water freezes at a temperature of zero degrees", ["Fahrenheit", "Kelvin", "Celsius"], 2),
    ("The opposite of hot is", ["cold", "warm", "loud"], 0),
    ("A week has seven", ["months", "days", "years"], 1),
    ("The color of a clear sky during the day is", ["green", "purple", "blue"], 2),
    ("Bees make", ["honey", "milk", "silk"], 0),
    ("The first letter of the English alphabet is", ["Z", "A", "Q"], 1),
]


def write_task(work: str) -> str:
    """The task directory: the docs as JSONL and a task YAML over them (JSON is YAML)."""
    task_dir = os.path.join(work, "lm_eval_task")
    os.makedirs(task_dir, exist_ok=True)
    data = os.path.join(task_dir, "docs.jsonl")
    with open(data, "w") as f:
        for question, choices, answer in DOCS:
            f.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
    task = {"task": TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "choices", "doc_to_target": "answer",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0}}
    with open(os.path.join(task_dir, f"{TASK}.yaml"), "w") as f:
        json.dump(task, f, indent=1)
    return task_dir


def read_output(out_dir: str) -> tuple[list[dict], float]:
    """lm-eval's logged samples (one per doc) and the accuracy it reports."""
    samples = sorted(glob.glob(os.path.join(out_dir, "**", f"samples_{TASK}_*.jsonl"), recursive=True))
    results = sorted(glob.glob(os.path.join(out_dir, "**", "results_*.json"), recursive=True))
    if not samples or not results:
        raise FileNotFoundError(f"no samples or results file under {out_dir}")
    with open(samples[-1]) as f:
        docs = [json.loads(line) for line in f if line.strip()]
    with open(results[-1]) as f:
        acc = json.load(f)["results"][TASK]["acc,none"]
    return sorted(docs, key=lambda d: d["doc_id"]), float(acc)


def split_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-eval's `_encode_pair` makes them: the context's trailing
    spaces move to the continuation, and the continuation is the whole text's tokens past the context's."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def load_reference(ctx: Context):
    """(model, tokenizer) in float32 with transformers: the default model from its GGUF, else its
    directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()  # the bench's output is one line per event

    if ctx.model_arg == "default":
        from common.models.default_model import default_gguf_path

        src, kw = os.path.split(default_gguf_path())
        kw = {"gguf_file": kw}
    else:
        src, kw = ctx.model_dir, {}
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, **kw).eval()
    return model, AutoTokenizer.from_pretrained(ctx.model_dir)


def reference_loglikelihoods(ctx: Context, pairs: list[tuple[str, str]]) -> list[float]:
    import torch

    model, tokenizer = load_reference(ctx)
    out = []
    with torch.no_grad():
        for context, continuation in pairs:
            ctx_ids, cont_ids = split_pair(tokenizer, context, continuation)
            ids = torch.tensor([ctx_ids + cont_ids])
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            # token i is predicted by position i - 1
            out.append(sum(logprobs[len(ctx_ids) + j - 1, t].item() for j, t in enumerate(cont_ids)))
    return out


def lm_eval_row(ctx: Context, row: Row) -> tuple[bool, str]:
    task_dir = write_task(ctx.work)
    out_dir = os.path.join(ctx.work, "lm_eval_out")
    args = (f"model={ctx.model},base_url={ctx.url}/v1/completions,tokenizer={ctx.model_dir},"
            "tokenized_requests=False,num_concurrent=1,max_retries=1")
    cmd = [python("lm-eval"), "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", args,
           "--tasks", TASK, "--include_path", task_dir, "--output_path", out_dir, "--log_samples",
           "--batch_size", "1"]
    rc, out = run_client(ctx, row, cmd)
    if ended(rc, out, row):
        return False, ended(rc, out, row)
    try:
        docs, acc = read_output(out_dir)
    except (FileNotFoundError, KeyError, ValueError) as e:
        return False, f"lm-eval's output: {e}"
    if len(docs) != len(DOCS):
        return False, f"lm-eval logged {len(docs)} of {len(DOCS)} docs"
    pairs, served = [], []
    for d in docs:
        args = sorted(d["arguments"].items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1]))
        pairs += [(a["arg_0"], a["arg_1"]) for _, a in args]
        served += [float(r[0][0]) for r in d["resps"]]
    if len(served) != len(pairs):
        return False, f"{len(served)} loglikelihoods for {len(pairs)} choices"
    ref = reference_loglikelihoods(ctx, pairs)
    worst = max(range(len(ref)), key=lambda i: abs(ref[i] - served[i]))
    diff = abs(ref[worst] - served[worst])
    ref_acc, i = 0, 0
    for _, choices, answer in DOCS:
        scores = ref[i:i + len(choices)]
        ref_acc += scores.index(max(scores)) == answer
        i += len(choices)
    ref_acc /= len(DOCS)
    summary = (f"max |lm-eval - transformers| {diff:.2e} over {len(ref)} choices; acc {acc:.3f} "
               f"(reference {ref_acc:.3f})")
    if diff > TOLERANCE:
        context, continuation = pairs[worst]
        return False, (f"{summary}: {context!r} + {continuation!r} scored {served[worst]:.4f}, "
                       f"transformers {ref[worst]:.4f}")
    if abs(acc - ref_acc) > 1e-9:
        return False, f"{summary}: the accuracies differ"
    return True, summary
