"""Priority scheduling (common/scheduler/priority.py) driven in process on a tiny model through the
scheduler's contract: the waiting order under every policy (both directions; exactly arrival order when
no request names a priority), preemption for running slots and for KV memory under `--schedule-policy
priority` (the victims finish with the tokens of an unloaded run), a full queue turning away its lowest
priority, and the flags' validation."""

from __future__ import annotations

import pytest

from common.config import ConfigError, ServerArgs
from common.scheduler.req import Stage
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)
from tests.unit.test_scheduler_contract import Driver

PRIO = dict(schedule_policy="priority")
PREEMPT = dict(schedule_policy="priority", enable_priority_preemption=True)


def add(d: Driver, rid: str, n: int, max_new: int, seed: int, priority: int = 0) -> None:
    d.sched.process_input_requests([d.msg(rid, n, max_new, seed, priority=priority)])


def tokens(d: Driver, rid: str) -> list[int]:
    return [t for u in d.updates(rid) for t in u.new_token_ids]


def finish_order(d: Driver) -> list[str]:
    return [u.rid for o in d.outputs for u in o.updates if u.finish_reason is not None]


def unloaded(model_dir: str, rid: str, n: int, max_new: int, seed: int) -> list[int]:
    d = Driver(model_dir)
    add(d, rid, n, max_new, seed)
    d.run()
    return tokens(d, rid)


@pytest.mark.parametrize("policy", ["priority", "fcfs", "lpm"])
@pytest.mark.parametrize("low_first", [False, True])
def test_waiting_queue_orders_by_priority_then_arrival(tiny_model_dir, low_first, policy):
    d = Driver(tiny_model_dir, max_running_requests=1, max_queued_requests=8,
               schedule_low_priority_values_first=low_first, schedule_policy=policy)
    for rid, p in [("a", 0), ("b", 5), ("c", -3), ("d", 5), ("e", 0)]:
        add(d, rid, 6, 2, seed=ord(rid), priority=p)
    d.run()
    order = finish_order(d)
    assert order == (["c", "a", "e", "b", "d"] if low_first else ["b", "d", "a", "e", "c"]), order


def test_fcfs_without_priorities_is_arrival_order(tiny_model_dir):
    d = Driver(tiny_model_dir, max_running_requests=1, max_queued_requests=8)
    for rid in "qwerty":
        add(d, rid, 6, 2, seed=ord(rid))
    d.run()
    assert finish_order(d) == list("qwerty")


def test_preemption_for_a_running_slot(tiny_model_dir):
    d = Driver(tiny_model_dir, max_running_requests=2, **PREEMPT)
    add(d, "low0", 8, 24, seed=1)
    add(d, "low1", 8, 24, seed=2, priority=5)
    for _ in range(4):
        d.step()
    assert {r.rid for r in d.sched.running_batch.reqs} == {"low0", "low1"}
    add(d, "mid", 8, 4, seed=3, priority=12)  # outranks low0 (0) by more than 10, low1 (5) by less
    add(d, "high", 8, 4, seed=4, priority=100)
    d.step()
    s = d.sched
    assert {r.rid for r in s.running_batch.reqs} == {"high", "low1"}
    assert s.live_reqs["low0"].is_retracted and s.live_reqs["low0"].stage is Stage.WAITING
    assert s.get_stats()["num_priority_preemptions"] == 1
    d.run()
    order = finish_order(d)
    assert order.index("high") < order.index("low1") and order.index("mid") < order.index("low0"), order
    for rid, seed in [("low0", 1), ("low1", 2)]:
        assert tokens(d, rid) == unloaded(tiny_model_dir, rid, 8, 24, seed), rid
    d.assert_restored()


def test_preemption_for_kv_memory(tiny_model_dir):
    # 128 tokens of KV: two running requests (20 + 40 each) leave too little for a third
    small = dict(max_total_tokens=128, max_running_requests=8, decode_offload_size=0)
    d = Driver(tiny_model_dir, **small, **PREEMPT)
    add(d, "low0", 20, 40, seed=1)
    add(d, "low1", 20, 40, seed=2)
    for _ in range(3):
        d.step()
    assert len(d.sched.running_batch.reqs) == 2
    add(d, "high", 40, 30, seed=3, priority=50)  # 40 + 30 tokens: more than is left
    d.run()
    order = finish_order(d)
    assert order[0] == "high", order
    assert d.sched.get_stats()["num_priority_preemptions"] >= 1
    for rid, seed in [("low0", 1), ("low1", 2)]:
        assert tokens(d, rid) == unloaded(tiny_model_dir, rid, 20, 40, seed), rid
    assert tokens(d, "high") == unloaded(tiny_model_dir, "high", 40, 30, 3)
    d.assert_restored()


def test_no_preemption_within_the_threshold_or_without_the_flag(tiny_model_dir):
    for kw, prio in [(PREEMPT, 10), (PRIO, 100)]:
        d = Driver(tiny_model_dir, max_running_requests=1, **kw)
        add(d, "low", 8, 12, seed=1)
        d.step()
        add(d, "high", 8, 2, seed=2, priority=prio)
        d.run()
        assert finish_order(d) == ["low", "high"], kw
        assert d.sched.get_stats()["num_priority_preemptions"] == 0


def test_full_queue_turns_away_the_lowest_priority(tiny_model_dir):
    d = Driver(tiny_model_dir, max_running_requests=1, max_queued_requests=2, **PRIO)
    add(d, "run", 8, 6, seed=1)
    d.step()
    add(d, "w-low", 8, 2, seed=2, priority=1)
    add(d, "w-lowest", 8, 2, seed=3, priority=-4)
    add(d, "same", 8, 2, seed=4, priority=-4)  # does not outrank the lowest: turned away itself
    add(d, "high", 8, 2, seed=5, priority=7)  # takes w-lowest's place
    d.flush()
    refused = {u.rid: (u.error_status, u.finish_reason["message"]) for o in d.outputs for u in o.updates
               if u.finish_reason is not None}
    assert refused["same"][0] == 429 and "queue is full" in refused["same"][1]
    assert refused["w-lowest"][0] == 429 and "higher priority (7)" in refused["w-lowest"][1]
    d.run()
    assert finish_order(d)[-3:] == ["run", "high", "w-low"]
    s = d.sched.get_stats()
    assert s["num_queue_full_displaced"] == 1 and s["num_queue_full_refused"] == 2
    d.assert_restored()


@pytest.mark.parametrize("kw, flag", [
    (dict(enable_priority_preemption=True), "--enable-priority-preemption"),
    (dict(schedule_policy="priority", priority_scheduling_preemption_threshold=3),
     "--priority-scheduling-preemption-threshold"),
    (dict(schedule_policy="priority", enable_priority_preemption=True,
          priority_scheduling_preemption_threshold=-1),
     "--priority-scheduling-preemption-threshold"),
])
def test_priority_flags_are_checked(kw, flag):
    with pytest.raises(ConfigError, match=flag):
        ServerArgs(**kw).validate()


def test_every_policy_takes_the_field():
    from common.protocol import GenerateRequest
    from common.server.http import item_fields

    req = GenerateRequest(text="a", priority=3)
    for policy in ("fcfs", "lpm", "priority"):
        assert item_fields(ServerArgs(schedule_policy=policy), req, 1, False)[0]["priority"] == 3
    assert item_fields(ServerArgs(), GenerateRequest(text="a"), 1, False)[0]["priority"] == 0


def test_decode_prealloc_and_waiting_queues_serve_the_highest_priority_first():
    from common.protocol import SamplingParams
    from common.scheduler.priority import PriorityScheduling
    from common.scheduler.req import Req
    from decode_node.queues import DecodeRequest, PreallocQueue, WaitingQueue
    from transfer.base import KVPoll

    rank = PriorityScheduling(ServerArgs(schedule_policy="priority")).rank
    reqs = []
    for i, p in enumerate([0, 7, -2, 7]):
        r = Req(f"r{i}", [1, 2], SamplingParams())
        r.priority = p
        reqs.append(DecodeRequest(req=r, room=i, conn=None))
    prealloc, waiting = PreallocQueue(), WaitingQueue()
    for t in reqs:
        prealloc.add(t)
        waiting.add(t)
    polls = {t.rid: KVPoll.WaitingForInput for t in reqs}
    assert [t.rid for t in prealloc.resolved(polls)] == ["r0", "r1", "r2", "r3"]  # FCFS without a rank
    assert [t.rid for t in prealloc.resolved(polls, rank)] == ["r1", "r3", "r0", "r2"]
    admitted = []
    for t in waiting.admit(lambda: len(admitted) < 2, rank):
        admitted.append(t.rid)
    assert admitted == ["r1", "r3"] and [t.rid for t in waiting] == ["r0", "r2"]
