"""Overlap scheduling (`common/scheduler/overlap.py`): decode step n+1 is built while step n computes
on the worker thread. Tokens are identical with overlap on and off, through chunked prefill,
retraction, aborts of requests whose forward is in flight, stops, seeded sampling and penalties;
the pools come back whole; and the steps really overlapped (a counter)."""

from __future__ import annotations

import pytest

from common.protocol import AbortRequest, SamplingParams
from common.scheduler.overlap import FutureMap
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)
from tests.unit.test_engine_correctness import Engine, prompts_of


def _pair(model_dir: str, **kw) -> tuple[Engine, Engine]:
    return (Engine(model_dir, enable_overlap_schedule=True, **kw),
            Engine(model_dir, **kw))


def _run_both(model_dir: str, submit, **kw):
    """Submit the same requests to an overlapped and a sequential engine, run both; their tokens."""
    on, off = _pair(model_dir, **kw)
    assert on.sched.overlap is not None and off.sched.overlap is None
    out = []
    for eng in (on, off):
        submit(eng)
        out.append(eng.run())
        eng.assert_restored()
    return on, out[0], out[1]


def test_future_map_resolves_placeholders_in_place():
    fm = FutureMap(4)
    rows = fm.reserve(3)
    assert rows == [1, 2, 3] and fm.reserve(3) == [4, 1, 2]  # cyclic, never row 0
    fm.store(rows, [7, 8, 9])
    import torch

    ids = torch.tensor([5, -2, -1, 6, -3])
    fm.resolve(ids)
    assert ids.tolist() == [5, 8, 7, 6, 9]


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_tokens_identical_with_chunked_prefill_and_mixed_lengths(tiny_model_dir, page_size):
    def submit(eng):
        prompts = prompts_of([5, 31, 33, 70, 9, 18], 256, seed=page_size)
        for i, p in enumerate(prompts):
            eng.submit(f"r{i}", p, max_new=[3, 17, 9, 24, 1, 12][i], stream=i % 2 == 0)

    on, got_on, got_off = _run_both(tiny_model_dir, submit, page_size=page_size, chunked_prefill_size=16)
    assert got_on == got_off and len(got_on) == 6
    assert on.sched.get_stats()["num_overlapped_steps"] > 10, "decode steps were meant to overlap"
    assert all(on.final(f"r{i}").completion_tokens == n for i, n in enumerate([3, 17, 9, 24, 1, 12]))


def test_retraction_gives_the_same_tokens(tiny_model_dir):
    def submit(eng):
        for i, p in enumerate(prompts_of([20, 22, 18, 25, 21, 19], 256, seed=11)):
            eng.submit(f"r{i}", p, max_new=30)

    on, got_on, got_off = _run_both(tiny_model_dir, submit, page_size=4, max_total_tokens=160,
                                    init_new_token_ratio=0.05, min_new_token_ratio=0.01)
    assert on.sched.num_retractions > 0, "the pool was meant to run out"
    assert got_on == got_off
    assert on.sched.get_stats()["num_overlapped_steps"] > 0


def test_stops_sampling_and_penalties_identical(tiny_model_dir):
    """Stop tokens end a request one step late in the loop (the step after is thrown away);
    seeded sampling draws in the same order; penalties and min_new_tokens make a step wait."""
    ref = Engine(tiny_model_dir)
    p = prompts_of([12], 256, seed=13)[0]
    ref.submit("probe", p, max_new=16)
    stop_tok = ref.run()["probe"][4]

    def submit(eng):
        eng.submit("stop", p,
                   sampling=SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=[stop_tok],
                                           ignore_eos=True))
        eng.submit("seeded", p, sampling=SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.9,
                                                        seed=7, ignore_eos=True))
        eng.submit("penalty", p, sampling=SamplingParams(max_new_tokens=20, temperature=0.8, seed=3,
                                                         frequency_penalty=0.5, repetition_penalty=1.3,
                                                         ignore_eos=True))
        eng.submit("min", p, sampling=SamplingParams(max_new_tokens=16, temperature=0, min_new_tokens=8,
                                                     stop_token_ids=[stop_tok], ignore_eos=True))

    _, got_on, got_off = _run_both(tiny_model_dir, submit)
    assert got_on == got_off
    assert got_on["stop"][-1] == stop_tok and len(got_on["stop"]) <= 5


def test_abort_while_its_forward_is_in_flight(tiny_model_dir):
    """An abort lands while the request's decode step computes: its memory is freed only after that
    forward, the others' tokens do not change, and the pools come back whole."""
    prompts = prompts_of([10, 14, 7], 256, seed=21)
    results = []
    for overlap in (True, False):
        eng = Engine(tiny_model_dir, enable_overlap_schedule=overlap)
        for i, p in enumerate(prompts):
            eng.submit(f"r{i}", p, max_new=20)
        s = eng.sched
        steps = 0
        while s.has_work():
            s.step()
            steps += 1
            if steps == 6:
                if overlap:
                    assert s.overlap.in_flight_batches, "a decode step is in flight"
                    req = s.live_reqs["r1"]
                    assert s.overlap.in_flight(req)
                s.process_input_requests([AbortRequest(rid="r1")])
                if overlap:  # its row and pages wait for the forward that writes them
                    assert req.req_pool_idx is not None and s.overlap.busy()
        got = eng.tokens()
        assert eng.final("r1").finish_reason["type"] == "abort"
        assert len(got.get("r1", [])) < 20
        eng.assert_restored()
        results.append({k: v for k, v in got.items() if k != "r1"})
    assert results[0] == results[1]


def test_on_with_the_flag_at_tp_one_only(tiny_model_dir):
    from common.config import ServerArgs
    from common.scheduler.overlap import overlap_choice

    assert overlap_choice(ServerArgs(), 1) == (False, "off (--enable-overlap-schedule turns it on)")
    assert overlap_choice(ServerArgs(enable_overlap_schedule=True), 1)[0] is True
    assert overlap_choice(ServerArgs(enable_overlap_schedule=True), 2) == (
        False, "off (TP > 1: the loop's collectives and the forward's must not interleave)")
    eng = Engine(tiny_model_dir)
    assert eng.sched.overlap is None and eng.sched.get_stats()["overlap_schedule"] is False
    assert Engine(tiny_model_dir, enable_overlap_schedule=True).sched.get_stats()["overlap_schedule"] is True


@pytest.mark.parametrize("kind", ["penalty", "min_new_tokens"])
def test_a_step_whose_sampling_reads_the_output_so_far_is_not_built_ahead(tiny_model_dir, kind):
    """Penalties (and min_new_tokens until reached) read every token generated so far, the last one
    too: such a step waits for the step in flight instead of being built ahead of it."""
    eng = Engine(tiny_model_dir, enable_overlap_schedule=True)
    p = prompts_of([12], 256, seed=14)[0]
    sp = (SamplingParams(max_new_tokens=16, temperature=0, repetition_penalty=1.2, ignore_eos=True)
          if kind == "penalty" else SamplingParams(max_new_tokens=16, temperature=0, min_new_tokens=10,
                                                   ignore_eos=True))
    eng.submit("r", p, sampling=sp)
    eng.run()
    overlapped = eng.sched.get_stats()["num_overlapped_steps"]
    if kind == "penalty":
        assert overlapped == 0
    else:  # built ahead only once 10 tokens are out: the steps of tokens 12..16 (none after the last:
        # a request the step in flight brings to max_new_tokens is left out of the next)
        assert 0 < overlapped <= 5
    eng.assert_restored()
