"""The scheduler's contract (the shape of vLLM's scheduler interface), driven through it alone, in process on
a tiny model: `schedule()` → `runner.run()` → `update_from_output()`, `add_request`, `finish_requests`,
`get_request_counts`, `has_unfinished_requests`, and the hooks a node role plugs in through.

Promises checked: finishing is idempotent (twice, or an unknown id, is a no-op); every request's end
is reported exactly once across all outputs, and nothing after it; after aborts at every stage
(waiting, chunked mid-prefill, running, retracted) the counts are consistent and the pools are back
at their starting free counts."""

from __future__ import annotations

import pytest
import torch

from common.config import ServerArgs
from common.core_loan import BUSY, Lender
from common.protocol import SamplingParams, TokenizedRequest
from common.scheduler.hooks import SchedulerHooks
from common.scheduler.req import FinishStatus, Stage
from common.scheduler.scheduler import Scheduler, SchedulerOutput
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)

ABORT = FinishStatus.abort("test abort")


class Driver:
    """A Scheduler driven only through its contract; keeps every output it returned."""

    def __init__(self, model_dir: str, **overrides) -> None:
        kw = dict(model=model_dir, page_size=4, max_total_tokens=1024, chunked_prefill_size=16,
                  max_running_requests=8)
        kw.update(overrides)
        args = ServerArgs(**kw)
        args.validate()
        self.sched = Scheduler(args, model_dir)
        self.outputs: list = []
        self.start = self.free_counts()

    def free_counts(self) -> tuple[int, int, int]:
        s = self.sched
        return (s.allocator.available_size() + s.tree_cache.evictable_size(),
                s.req_to_token_pool.available_size(), s.tree_cache.protected_size())

    def msg(self, rid: str, n: int, max_new: int = 8, seed: int = 0, **kw) -> TokenizedRequest:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, self.sched.vocab_size, (n,), generator=g).tolist()
        return TokenizedRequest(rid=rid, input_ids=ids, sampling=SamplingParams(
            max_new_tokens=max_new, temperature=0, ignore_eos=True), **kw)

    def add(self, rid: str, n: int, max_new: int = 8, seed: int = 0) -> None:
        self.sched.add_request(self.sched.make_req(self.msg(rid, n, max_new, seed)))

    def step(self) -> SchedulerOutput:
        s = self.sched
        out = s.schedule()
        result = s.runner.run(out.batch) if out.batch is not None else None
        self.collect(s.update_from_output(out, result))
        return out

    def collect(self, batch_out) -> None:
        if batch_out is not None:
            self.outputs.append(batch_out)

    def flush(self) -> None:
        """An update without a batch: what finish_requests recorded comes out, nothing is scheduled."""
        self.collect(self.sched.update_from_output(SchedulerOutput(), None))

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                self.flush()
                return
            self.step()
        raise AssertionError("still busy")

    def updates(self, rid: str) -> list:
        return [u for o in self.outputs for u in o.updates if u.rid == rid]

    def ends(self) -> dict[str, int]:
        """rid -> how many updates reported its end."""
        out: dict[str, int] = {}
        for o in self.outputs:
            for u in o.updates:
                if u.finish_reason is not None:
                    out[u.rid] = out.get(u.rid, 0) + 1
        return out

    def assert_ended_once(self, rids) -> None:
        ends = self.ends()
        for rid in rids:
            assert ends.get(rid) == 1, f"{rid}: end reported {ends.get(rid, 0)} times"
            ups = self.updates(rid)
            assert ups[-1].finish_reason is not None, f"{rid}: an update after its end"

    def assert_restored(self) -> None:
        s = self.sched
        assert s.get_request_counts() == (0, 0)
        assert not s.has_unfinished_requests() and not s.has_work() and not s.live_reqs and not s.held
        assert self.free_counts() == self.start
        s.tree_cache.evict(10**9)
        assert s.allocator.available_size() == s.allocator.capacity


def test_step_through_the_contract(tiny_model_dir):
    d = Driver(tiny_model_dir)
    s = d.sched
    out = s.schedule()
    assert out.batch is None and s.update_from_output(out, None) is None  # nothing to do, nothing to say
    d.add("a", 10, max_new=5)
    d.add("b", 30, max_new=3)  # two chunks of 16
    with pytest.raises(ValueError):
        d.add("a", 4)  # a live rid
    assert s.get_request_counts() == (0, 2) and s.has_unfinished_requests()
    d.step()  # a (whole) + the first chunk of b
    assert s.chunked_req is not None and s.chunked_req.rid == "b"
    assert s.get_request_counts() == (2, 0)
    d.run()
    assert [len(u.new_token_ids) for u in d.updates("a")] == [5]  # not streaming: one update at the end
    assert d.updates("b")[-1].completion_tokens == 3
    d.assert_ended_once(["a", "b"])
    d.assert_restored()


def test_finish_requests_is_idempotent(tiny_model_dir):
    d = Driver(tiny_model_dir)
    s = d.sched
    d.add("x", 12, max_new=20)
    d.add("y", 12, max_new=20, seed=1)
    d.step()
    d.step()
    s.finish_requests("x", ABORT)
    d.flush()
    s.finish_requests(["x", "x", "no-such-rid"], FinishStatus.abort("again", 500))  # no-ops
    s.finish_requests([], ABORT)
    assert s.get_request_counts() == (1, 0) and "x" not in s.live_reqs
    d.flush()
    fin = d.updates("x")[-1]
    assert fin.finish_reason == {"type": "abort", "message": "test abort"} and fin.error_status == 0
    d.run()
    s.finish_requests("y", ABORT)  # finished normally already: a no-op
    d.flush()
    assert d.updates("y")[-1].finish_reason["type"] == "length"
    d.assert_ended_once(["x", "y"])
    d.assert_restored()


def _retract(d: Driver) -> str:
    """Step until a retraction happens; returns a retracted rid (back in the waiting queue)."""
    for i in range(6):
        d.add(f"r{i}", 20 + i, max_new=30, seed=10 + i)
    for _ in range(500):
        out = d.step()
        if out.retracted:
            return out.retracted[0]
    raise AssertionError("the pool was meant to run out")


@pytest.mark.parametrize("stage", ["waiting", "chunked", "running", "retracted", "new"])
def test_abort_at_every_stage_restores_counts_and_pools(tiny_model_dir, stage):
    small = dict(max_total_tokens=160, init_new_token_ratio=0.05, min_new_token_ratio=0.01)
    d = Driver(tiny_model_dir, **(small if stage == "retracted" else {"max_running_requests": 2}))
    s = d.sched
    if stage == "retracted":
        victim = _retract(d)
        assert s.live_reqs[victim].is_retracted and s.live_reqs[victim].stage is Stage.WAITING
    elif stage == "new":  # registered on arrival, not in a scheduler queue yet (what a role holds)
        victim = "v"
        req = s.make_req(d.msg(victim, 9))
        s.live_reqs[victim] = req
        d.add("other", 9, seed=1)
        d.step()
    else:
        d.add("run", 10, max_new=20)
        d.add("chunk", 40, max_new=20, seed=1)
        d.add("wait", 10, max_new=20, seed=2)
        d.step()
        assert s.chunked_req.rid == "chunk" and s.live_reqs["wait"].stage is Stage.WAITING
        d.step()
        assert s.live_reqs["run"].stage is Stage.RUNNING
        victim = {"waiting": "wait", "chunked": "chunk", "running": "run"}[stage]
    running, waiting = s.get_request_counts()
    where = s.live_reqs[victim].stage
    s.finish_requests(victim, ABORT)
    d.flush()
    s.finish_requests(victim, ABORT)
    if where is Stage.WAITING:
        waiting -= 1
    elif where in (Stage.RUNNING, Stage.CHUNKED):
        running -= 1
    assert s.get_request_counts() == (running, waiting)
    assert victim not in s.live_reqs
    assert all(r is not s.live_reqs.get(victim) for r in s.waiting_queue + s.running_batch.reqs)
    d.run()
    assert d.updates(victim)[-1].finish_reason == {"type": "abort", "message": "test abort"}
    d.assert_ended_once(list({u.rid for o in d.outputs for u in o.updates}))
    d.assert_restored()


def test_abort_all_with_requests_everywhere(tiny_model_dir):
    d = Driver(tiny_model_dir, max_running_requests=3)
    s = d.sched
    for i, n in enumerate((10, 60, 12, 14, 11, 9)):
        d.add(f"x{i}", n, max_new=20, seed=i)
    d.step()
    d.step()
    s.finish_requests(list(s.live_reqs), ABORT)
    assert s.get_request_counts() == (0, 0)
    d.flush()
    d.assert_ended_once([f"x{i}" for i in range(6)])
    d.assert_restored()


class HoldingRole(SchedulerHooks):
    """A stand-in for a PD role: keeps new requests for one iteration before adding them, and holds
    the memory of finished ones until told to release them. Records every call."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.pending: list = []
        self.events: list[tuple[str, str]] = []

    def validate(self, req):
        return (400, "this role refuses it") if req.rid.startswith("bad") else None

    def on_new_request(self, req) -> bool:
        self.pending.append(req)
        return True

    def before_schedule(self) -> None:
        for req in self.pending:
            self.sched.add_request(req)
        self.pending = []

    def on_chunk_done(self, req) -> None:
        self.events.append(("chunk", req.rid))

    def on_prefill_done(self, req) -> None:
        self.events.append(("prefill", req.rid))

    def on_finished(self, req) -> bool:
        self.events.append(("finished", req.rid))
        return True

    def on_release(self, req) -> None:
        self.events.append(("release", req.rid))
        self.pending = [r for r in self.pending if r is not req]

    def has_work(self) -> bool:
        return bool(self.pending) or bool(self.sched.held)


def test_hooks_hold_finished_requests_until_released(tiny_model_dir):
    d = Driver(tiny_model_dir)
    s = d.sched
    role = s.hooks = HoldingRole(s)
    s.process_input_requests([d.msg("a", 40, max_new=1), d.msg("b", 8, max_new=1, seed=1),
                              d.msg("c", 8, max_new=1, seed=2), d.msg("bad", 8)])
    assert s.live_reqs["a"].stage is Stage.NEW and s.get_request_counts() == (0, 0)
    assert not s.has_unfinished_requests() and s.has_work()
    s.finish_requests("c", ABORT)  # still in the role's queue
    assert role.pending == [s.live_reqs["a"], s.live_reqs["b"]]
    for _ in range(3):  # a: 16 + 16 + 8
        d.step()
    assert role.events.count(("chunk", "a")) == 2
    assert ("prefill", "a") in role.events and ("finished", "b") in role.events
    assert set(s.held) == {"a", "b"} and s.get_request_counts() == (0, 0)
    assert d.free_counts() != d.start  # their memory is held
    assert not d.updates("a") and not d.updates("b")  # and so is their answer
    s.release_held("a")
    s.finish_requests("b", FinishStatus.abort("transfer failed", 500))
    d.flush()
    s.finish_requests(["a", "b"], ABORT)
    d.flush()
    assert d.updates("a")[-1].finish_reason == {"type": "length", "length": 1}
    assert d.updates("a")[-1].completion_tokens == 1
    fb = d.updates("b")[-1]
    assert fb.finish_reason == {"type": "abort", "message": "transfer failed"} and fb.error_status == 500
    assert d.updates("bad")[-1].error_status == 400 and "bad" not in s.live_reqs
    assert d.updates("c")[-1].finish_reason["type"] == "abort"
    assert sorted(r for e, r in role.events if e == "release") == ["a", "b", "c"]
    d.assert_ended_once(["a", "b", "c", "bad"])
    d.assert_restored()


class ReleasingRole(SchedulerHooks):
    """Holds a finished request, as a prefill node does while its KV transfers, and releases it in the
    next iteration's `before_schedule` (the transfer polled Success there)."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.to_release: list[str] = []

    def before_schedule(self) -> None:
        for rid in self.to_release:
            self.sched.release_held(rid)
        self.to_release = []

    def on_finished(self, req) -> bool:
        if req.rid == "short":
            self.to_release.append(req.rid)
            return True
        return False


@pytest.mark.parametrize("overlap", [False, True])
def test_news_from_the_schedule_goes_out_before_the_forward(tiny_model_dir, tmp_path, overlap):
    """A request the role releases in `before_schedule` (a prefill node's transfer done; a decode node's
    first token arrives the same way) is answered before that iteration's forward, not after it: while a
    long prompt is prefilled in chunks, the short request's end is sent before the next chunk runs. A
    core-loan lender that idled before says BUSY before every forward runs, with overlap too."""
    d = Driver(tiny_model_dir, enable_overlap_schedule=overlap)
    s = d.sched
    s.hooks = ReleasingRole(s)
    s.send_fn = d.collect
    s.lender = Lender(str(tmp_path / "loan"))
    s.lender.set_idle(True)
    sent_at_forward: list[bool] = []
    loan_byte_at_forward: list[int] = []
    run = s.runner.run

    def recording_run(batch):
        sent_at_forward.append(bool(d.ends().get("short")))
        loan_byte_at_forward.append(s.lender._mm[0])
        return run(batch)

    s.runner.run = recording_run
    s.process_input_requests([d.msg("short", 8, max_new=1), d.msg("long", 64, max_new=2, seed=1)])
    while s.has_work():
        s.step()
    s.stream_output()
    # forward 1 prefills "short" (and the first chunk of "long"); the role releases "short" in the next
    # schedule, and the forward after that already finds its end sent
    assert sent_at_forward[:2] == [False, True], sent_at_forward
    assert loan_byte_at_forward == [BUSY] * len(sent_at_forward)
    d.assert_ended_once(["short", "long"])
    if s.overlap is not None:
        s.overlap.close()


def test_components_are_given_their_collaborators_not_the_scheduler(tiny_model_dir):
    """Each part of the scheduler is built with what it needs (queues, pools, retraction, ...), never with
    the scheduler itself, so none reaches back into it."""
    d = Driver(tiny_model_dir, enable_overlap_schedule=True)
    s = d.sched
    for part in (s.queues, s.intake, s.prefill, s.decode, s.retraction, s.results, s.stats, s.overlap,
                 s.priority, s.policy, s.output, s.counters):
        assert all(v is not s for v in vars(part).values()), type(part).__name__
    s.overlap.close()
