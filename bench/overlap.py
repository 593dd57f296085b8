"""The decode step through the real scheduler loop, with overlap scheduling on and off (part of
`pdserve bench engine`).

Each run (`decode_loop_run`, which `bench/speculative.py` uses too) builds a `Scheduler` over one shared
`ModelRunner` (radix cache off, so each run leaves the pools as it found them), submits `batch` streaming
greedy requests that ignore EOS, runs the loop until every prompt is prefilled, then times the loop
(`process_input_requests`, `step`, each
iteration's `BatchOut` encoded with msgpack as the scheduler process sends it) until every request
has its tokens. Step time = that time / the decode steps. Tokens must be identical on and off.
On a CPU the forward's OpenMP threads and the loop share the cores, so the runs are repeated with one
torch thread fewer when the bench's threads take every core.

The runs in sequence also time the forwards (`ModelRunner.run`: the model and the sampling): the rest
of a step is the loop's own work, all that overlap could hide, so `overlap_ceiling` = step time in
sequence / forward time is the most overlap could gain at that batch.
"""

from __future__ import annotations

import dataclasses
import os
import time

import msgspec
import torch

from common.protocol import SamplingParams, TokenizedRequest
from common.runner import ModelRunner
from common.scheduler.scheduler import Scheduler


def decode_loop_run(runner: ModelRunner, model_dir: str, prompts: list[list[int]], steps: int,
                    forward_times: list[float] | None = None,
                    **overrides) -> tuple[float, float, dict[str, list[int]], Scheduler]:
    """(wall seconds, CPU seconds of this process, tokens by rid, the scheduler) of decoding `prompts` to
    `steps` + 1 tokens each, timed from when every prompt is prefilled. `overrides`: server args of this
    run (overlap scheduling, speculation); the radix cache is off, so each run leaves the pools as it found
    them. `forward_times`: gets the wall time of each timed forward (`ModelRunner.run`)."""
    encoder = msgspec.msgpack.Encoder()
    tokens: dict[str, list[int]] = {}

    def send(msg) -> None:
        encoder.encode(msg)
        for u in getattr(msg, "updates", ()):
            tokens.setdefault(u.rid, []).extend(u.new_token_ids)

    args = dataclasses.replace(runner.args, **{"disable_radix_cache": True, "enable_overlap_schedule": False,
                                               **overrides})
    args.validate()
    sched = Scheduler(args, model_dir, runner=runner, send_fn=send)
    sp = SamplingParams(max_new_tokens=steps + 1, temperature=0, ignore_eos=True)
    sched.process_input_requests([TokenizedRequest(rid=f"r{i}", input_ids=p, sampling=sp, stream=True)
                                  for i, p in enumerate(prompts)])
    while (len(tokens) < len(prompts) or any(not t for t in tokens.values())) and sched.has_work():
        sched.step()  # until every prompt is prefilled
    if len(tokens) < len(prompts) or any(not t for t in tokens.values()):
        raise SystemExit("a request of the scheduler-loop bench ended without a token (see the log)")
    if forward_times is not None:
        run = runner.run

        def timed(batch):
            t = time.perf_counter()
            result = run(batch)
            forward_times.append(time.perf_counter() - t)
            return result

        runner.run = timed  # an instance attribute over the method, removed below
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        while sched.has_work():
            sched.process_input_requests([])
            sched.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        if forward_times is not None:
            del runner.run
    if sched.overlap is not None:
        sched.overlap.close()
    return wall, cpu, tokens, sched


def measure(runner: ModelRunner, model_dir: str, prompts_by_batch: dict[int, list[list[int]]], steps: int,
            repeats: int, log) -> tuple[dict, dict]:
    """Figures and ratios per batch size: `overlap_b<B>` = step time in sequence / overlapped at the
    bench's torch threads (higher is better); when those take every core, also at one thread fewer
    (`overlap_free_core_b<B>`, the setting where overlap is on by default)."""
    threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    settings = [("", threads)] + ([("free_core_", cores - 1)] if threads >= cores > 1 else [])
    figures, ratios = {}, {}
    try:
        for tag, t in settings:
            torch.set_num_threads(t)
            for b, prompts in prompts_by_batch.items():
                fig = _measure_one(runner, model_dir, prompts, steps, repeats, log, f"b{b}, {t} threads")
                figures[f"loop_decode_{tag}b{b}"] = {"torch_threads": t, **fig}
                ratios[f"overlap_{tag}b{b}"] = fig["step_ms_sequential"] / fig["step_ms_overlap"]
    finally:
        torch.set_num_threads(threads)
    return figures, ratios


def _measure_one(runner, model_dir, prompts, steps, repeats, log, label) -> dict:
    for overlap in (True, False):  # warm both paths
        decode_loop_run(runner, model_dir, prompts, 4, enable_overlap_schedule=overlap)
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    forwards: list[float] = []  # per run in sequence: the seconds its forwards took
    same = True
    for rep in range(repeats):
        got = {}
        for overlap in (True, False):
            fwd: list[float] = []
            wall, cpu, toks, _ = decode_loop_run(runner, model_dir, prompts, steps, None if overlap else fwd,
                                                 enable_overlap_schedule=overlap)
            times[overlap].append((wall, cpu))
            got[overlap] = toks
            if not overlap:
                forwards.append(sum(fwd))
        same = same and got[True] == got[False]
        on, off = times[True][-1][0], times[False][-1][0]
        log(f"scheduler loop {label}, run {rep + 1}/{repeats}: step {1e3 * on / steps:6.2f} ms overlapped, "
            f"{1e3 * off / steps:6.2f} ms in sequence")
    if not same:
        raise SystemExit(f"{label}: tokens differ with overlap on and off")
    best = min(range(repeats), key=lambda i: times[False][i][0])  # the fastest run in sequence, whole
    wall, forward = times[False][best][0], forwards[best]
    return {"step_ms_overlap": 1e3 * min(w for w, _ in times[True]) / steps,
            "step_ms_sequential": 1e3 * wall / steps,
            "loop_ms_sequential": 1e3 * (wall - forward) / steps,
            "overlap_ceiling": wall / forward,
            "cpu_step_ms_overlap": 1e3 * min(c for _, c in times[True]) / steps,
            "cpu_step_ms_sequential": 1e3 * min(c for _, c in times[False]) / steps,
            "tokens_identical": same}
