"""A request table on a GPU keeps a host copy that the books read (the allocator, the radix cache, the
transfer layer): every slot the scheduler writes must reach both. On the CPU the two are one tensor, so
here the copy is split off by hand before the first request, as a device table has it, and the scheduler
runs its paths (chunked prefill, decode, speculative verify with its rollback, overlap, retraction,
mixed chunks, the radix cache): after every step the copy equals the table, the tokens equal a run with
one table, and every page comes back. A decode step that wrote the table alone left zeros in the copy, and
a finished request then freed page 0 (seen on the GPU machine: `freeing pages outside the pool: [0]`)."""

from __future__ import annotations

import pytest
import torch

from common.config import ServerArgs
from common.protocol import SamplingParams, TokenizedRequest
from common.scheduler.scheduler import Scheduler
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 21, 40, 13)]
    out.append([5, 6, 7, 8] * 9)  # a repeating prompt: n-gram drafts that the target confirms
    return out


def _run(model_dir: str, split: bool, **overrides) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}

    def send(msg) -> None:
        for u in getattr(msg, "updates", ()):
            tokens.setdefault(u.rid, []).extend(u.new_token_ids)

    kw = dict(model=model_dir, page_size=4, max_total_tokens=1024, chunked_prefill_size=16,
              max_running_requests=8)
    kw.update(overrides)
    args = ServerArgs(**kw)
    args.validate()
    sched = Scheduler(args, model_dir, send_fn=send)
    pool = sched.req_to_token_pool
    if split:
        pool._host = pool.req_to_token.clone()  # what a table on a device has
    sp = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    sched.process_input_requests([TokenizedRequest(rid=f"r{i}", input_ids=p, sampling=sp, stream=True)
                                  for i, p in enumerate(_prompts(sched.vocab_size))])
    steps = 0
    while sched.has_work():
        sched.process_input_requests([])
        sched.step()
        steps += 1
        assert steps < 2000, "still busy"
        if split:
            assert torch.equal(pool._host, pool.req_to_token), f"the host copy fell behind at step {steps}"
    if sched.overlap is not None:
        sched.overlap.close()
    sched.tree_cache.evict(10**9)
    assert sched.allocator.available_size() == sched.allocator.capacity
    assert pool.available_size() == pool.size
    return tokens


@pytest.mark.parametrize("settings", [
    {},
    {"enable_overlap_schedule": True},
    {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4},
    {"enable_mixed_chunk": True},
    {"max_total_tokens": 96, "max_running_requests": 5},  # too little KV for all five: retraction
], ids=["decode", "overlap", "ngram", "mixed", "retract"])
def test_the_host_copy_follows_every_write(tiny_model_dir, settings):
    want = _run(tiny_model_dir, False, **settings)
    got = _run(tiny_model_dir, True, **settings)
    assert got == want
    assert all(len(t) == 24 for t in got.values())
