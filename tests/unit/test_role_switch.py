"""A DP group's role switch (common/scheduler/role_switch.py) in process, over real prefill and decode
schedulers and the tiny model: what `begin` hands back and refuses, when `ready` lets the loop go, the
drain deadline, and `rebuild` over the same runner (`ModelRunner.switch_role`).

The transfer side is a stand-in (`StubKVManager`, `StubConn`): a unit test serves on no socket, and the
bootstrap server and the KV managers' control planes would (tests/pd/test_pd_role_switch.py switches real
nodes). A test moves a request's transfer on by setting its conn's state.
"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

import decode_node.role
import prefill_node.role
from common.config import ServerArgs
from common.memory.radix_cache import ChunkCache, RadixCache
from common.memory.req_to_token import ReqToTokenPool
from common.protocol import ROLE_SWITCH, BatchOut, SamplingParams, StatsReport, SwitchRole, TokenizedRequest
from common.scheduler import role_switch
from decode_node.req_pool import DecodeReqToTokenPool
from decode_node.role import DecodeScheduler
from prefill_node.queues import PrefillStage
from prefill_node.role import PrefillScheduler
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)
from transfer.base import KVPoll


class StubConn:
    """A room's sender or receiver: its state is what the test sets."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.state = KVPoll.Bootstrapping
        self.aborted = False
        self.sent: list = []
        self.bytes_sent = 0
        self.peer_traceparent = None
        self.drained = KVPoll.Success  # a decode room in quarantine: whether no prefill rank still writes

    def init(self, *args, **kw) -> None:
        pass

    def send(self, pages, **kw) -> None:
        self.sent.append((list(pages), kw.get("last", False)))

    def poll(self) -> KVPoll:
        return self.state

    def failure_exception(self) -> Exception:
        return RuntimeError(f"room {self.room} failed")

    def abort(self) -> None:
        self.aborted = True
        self.state = KVPoll.Failed

    def drain_poll(self) -> KVPoll:
        return self.drained


class StubKVManager:
    moves_bytes = False
    rejected_peer_values = 0

    def __init__(self, conns: dict[int, StubConn]) -> None:
        self.conns = conns
        self.closed = False

    def create_sender(self, room: int) -> StubConn:
        self.conns[room] = StubConn(room)
        return self.conns[room]

    def create_receiver(self, addr: str, room: int) -> StubConn:
        return self.create_sender(room)

    def close(self) -> None:
        self.closed = True


class StubBootstrapServer:
    port = 8998

    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


class Transfer:
    """What the roles built of the transfer side: every manager, bootstrap server and conn, by room."""

    def __init__(self) -> None:
        self.conns: dict[int, StubConn] = {}
        self.managers: list[StubKVManager] = []
        self.servers: list[StubBootstrapServer] = []

    def manager(self, *args, **kw) -> StubKVManager:
        self.managers.append(StubKVManager(self.conns))
        return self.managers[-1]

    def server(self, args) -> StubBootstrapServer:
        self.servers.append(StubBootstrapServer())
        return self.servers[-1]


@pytest.fixture
def transfer(monkeypatch) -> Transfer:
    t = Transfer()
    monkeypatch.setattr(prefill_node.role, "build_kv_manager", t.manager)
    monkeypatch.setattr(prefill_node.role, "start_bootstrap_server", t.server)
    monkeypatch.setattr(decode_node.role, "build_kv_manager", t.manager)
    return t


def node_args(model_dir: str, mode: str) -> ServerArgs:
    # --disaggregation-decode-tp is in a prefill's compatibility only: a switch drops it and brings it back
    args = ServerArgs(model=model_dir, disaggregation_mode=mode, transfer_backend="fake", page_size=4,
                      max_total_tokens=256, chunked_prefill_size=64, max_running_requests=4,
                      disaggregation_decode_tp=2)
    args.validate()
    return args


class Node:
    """One DP group's scheduler of one rank, with everything it sent."""

    def __init__(self, model_dir: str, mode: str) -> None:
        self.sent: list = []
        cls = PrefillScheduler if mode == "prefill" else DecodeScheduler
        self.sched = cls(node_args(model_dir, mode), model_dir, send_fn=self.sent.append)

    def msg(self, rid: str, room: int, n: int = 10) -> TokenizedRequest:
        ids = torch.randint(3, self.sched.vocab_size, (n,), generator=torch.Generator().manual_seed(room))
        return TokenizedRequest(rid=rid, input_ids=ids.tolist(), bootstrap_host="127.0.0.1",
                                bootstrap_port=8998, bootstrap_room=room,
                                sampling=SamplingParams(max_new_tokens=4, temperature=0))

    def switch(self, role: str, drain_timeout: float = 60.0, qid: int = 1) -> None:
        self.sched.process_input_requests([SwitchRole(qid=qid, role=role, drain_timeout=drain_timeout)])
        self.sched.stream_output()  # what `begin` ended goes out as the loop's next send would

    def updates(self, rid: str) -> list:
        return [u for m in self.sent if isinstance(m, BatchOut) for u in m.updates if u.rid == rid]

    def report(self, qid: int) -> dict:
        (stats,) = [m.stats for m in self.sent if isinstance(m, StatsReport) and m.qid == qid]
        return stats

    def all_free(self) -> bool:
        s = self.sched
        return (s.allocator.available_pages() == s.allocator.num_pages - 1
                and ReqToTokenPool.available_size(s.req_to_token_pool) == s.req_to_token_pool.size)


def assert_handed_back(node: Node, rid: str) -> None:
    *_, last = node.updates(rid)
    assert last.error_status == 503, last
    assert last.finish_reason["type"] == "abort" and last.finish_reason["err_type"] == ROLE_SWITCH, last


def start_inflight(node: Node, transfer: Transfer, rid: str, room: int) -> None:
    """A request prefilled and held while its KV is on its way (stage inflight)."""
    s = node.sched
    s.process_input_requests([node.msg(rid, room)])
    transfer.conns[room].state = KVPoll.WaitingForInput  # the decode's TransferInfo came
    for _ in range(10):
        s.step()
        if rid in s.held:
            break
    assert s.hooks.requests[rid].stage is PrefillStage.INFLIGHT and transfer.conns[room].sent[-1][1]
    transfer.conns[room].state = KVPoll.Transferring


@pytest.fixture
def prefill(tiny_model_dir, transfer) -> Node:
    return Node(tiny_model_dir, "prefill")


@pytest.fixture
def decode(tiny_model_dir, transfer) -> Node:
    return Node(tiny_model_dir, "decode")


# ----------------------------------------------------------------------------------------------- begin
def test_begin_hands_back_the_requests_that_have_not_started(prefill, transfer):
    s = prefill.sched
    s.process_input_requests([prefill.msg("boot", 1), prefill.msg("wait", 2)])
    transfer.conns[2].state = KVPoll.WaitingForInput  # its TransferInfo came: it joins the waiting queue
    s.hooks.before_schedule()
    assert [t.rid for t in s.hooks.bootstrap] == ["boot"] and [r.rid for r in s.waiting_queue] == ["wait"]

    prefill.switch("decode")
    assert s.switch is not None and s.switch.role == "decode" and s.switch.handed_back == 2
    for rid in ("boot", "wait"):
        assert_handed_back(prefill, rid)
    assert not s.live_reqs and not s.waiting_queue and not s.hooks.requests and not s.hooks.bootstrap
    assert transfer.conns[1].aborted and transfer.conns[2].aborted  # their decode peers learn it
    assert prefill.all_free() and s.hooks.metadata_alloc.available() == s.hooks.num_metadata_slots


def test_begin_refuses_a_second_switch_and_the_role_served(prefill):
    s = prefill.sched
    prefill.switch("prefill", qid=3)
    assert prefill.report(3) == {"switched": False, "error": "already serving the prefill role"}
    assert s.switch is None
    prefill.switch("null", qid=4)
    assert prefill.report(4)["switched"] is False and "cannot switch to 'null'" in prefill.report(4)["error"]
    assert s.switch is None

    prefill.switch("decode", qid=5)
    prefill.switch("decode", qid=6)
    assert prefill.report(6) == {"switched": False, "error": "already switching to decode"}
    assert not [m for m in prefill.sent if isinstance(m, StatsReport) and m.qid == 5]  # answered at the end


def test_a_refused_second_switch_leaves_the_first_one_draining(prefill):
    prefill.switch("decode", qid=5)
    prefill.switch("decode", qid=6)
    assert prefill.sched.switch is not None and prefill.sched.switch.qid == 5


# ----------------------------------------------------------------------------------------------- ready
def test_ready_waits_for_the_live_requests_and_the_prefix_cache(prefill, transfer):
    s = prefill.sched
    start_inflight(prefill, transfer, "live", 3)
    prefill.switch("decode")
    assert s.switch.handed_back == 0  # it had started: it runs to its end
    assert not role_switch.ready(s)
    s.step()
    assert not role_switch.ready(s) and "live" in s.live_reqs

    transfer.conns[3].state = KVPoll.Success
    s.step()  # the transfer is done: the answer goes out, the KV goes to the radix cache
    *_, last = prefill.updates("live")
    assert last.error_status == 0 and last.finish_reason["type"] == "length", last
    assert isinstance(s.tree_cache, RadixCache) and s.tree_cache.evictable_size() > 0
    assert not s.has_work()

    assert role_switch.ready(s)
    assert s.tree_cache.evictable_size() == 0 and prefill.all_free()  # the cache let its pages go
    assert s.switch.ended_at_deadline == 0


def test_at_the_deadline_what_is_left_ends_with_a_role_switch_503(prefill, transfer):
    s = prefill.sched
    start_inflight(prefill, transfer, "late", 4)
    prefill.switch("decode", drain_timeout=0)
    assert not role_switch.ready(s)  # the deadline: the request ends first, the switch comes after
    s.stream_output()
    assert_handed_back(prefill, "late")
    assert s.switch.ended_at_deadline == 1 and transfer.conns[4].aborted
    assert not s.live_reqs and not s.held and not s.hooks.requests

    assert role_switch.ready(s) and prefill.all_free()
    assert s.switch.ended_at_deadline == 1


def test_a_decode_node_hands_back_what_sent_no_transfer_info_and_waits_for_its_quarantine(decode, transfer):
    s = decode.sched
    s.process_input_requests([decode.msg("boot", 1), decode.msg("pre", 2)])
    transfer.conns[2].state = KVPoll.WaitingForInput  # resolved: row and pages reserved, TransferInfo sent
    s.hooks.before_schedule()
    assert [t.rid for t in s.hooks.prealloc] == ["boot"] and [t.rid for t in s.hooks.transfer] == ["pre"]

    decode.switch("prefill", drain_timeout=0)
    assert s.switch.handed_back == 1
    assert_handed_back(decode, "boot")
    assert "pre" in s.live_reqs  # a prefill rank may be writing into its pages: not handed back

    transfer.conns[2].drained = KVPoll.Transferring  # ... and still is when the deadline ends it
    assert not role_switch.ready(s)
    s.stream_output()
    assert_handed_back(decode, "pre")
    assert s.switch.ended_at_deadline == 1 and len(s.hooks.quarantine) == 1
    s.step()
    assert not role_switch.ready(s) and not decode.all_free()  # its pages wait in quarantine

    transfer.conns[2].drained = KVPoll.Success
    s.step()
    assert role_switch.ready(s) and decode.all_free()


# --------------------------------------------------------------------------------------------- rebuild
def switched(node: Node, role: str, qid: int):
    """The scheduler `node` runs after a switch to `role` (the loop's end and the process's rebuild)."""
    old = node.sched
    node.switch(role, qid=qid)
    assert role_switch.ready(old)
    old.close()
    node.sched = role_switch.rebuild(old)
    return node.sched


def test_rebuild_serves_the_other_role_over_the_same_runner(prefill, transfer):
    old = prefill.sched
    runner, model, kv_pool, allocator = old.runner, old.runner.model, old.kv_pool, old.allocator
    assert old.runner.compatibility.decode_tp == 2

    new = switched(prefill, "decode", qid=11)
    assert transfer.managers[0].closed and transfer.servers[0].stopped  # closed with the old hooks
    assert type(new) is DecodeScheduler and new is not old
    assert new.runner is runner and new.runner.model is model
    assert new.kv_pool is kv_pool and new.allocator is allocator
    assert isinstance(new.req_to_token_pool, DecodeReqToTokenPool)
    assert runner.req_to_token_pool is new.req_to_token_pool is not old.req_to_token_pool
    assert new.args.disaggregation_mode == "decode" and old.args.disaggregation_mode == "prefill"
    assert not new.args.radix_cache_enabled and type(new.tree_cache) is ChunkCache
    assert new.switch is None and len(transfer.managers) == 2

    stats = prefill.report(11)
    assert stats["switched"] is True and stats["role"] == "decode"
    assert stats["handed_back"] == 0 and stats["ended_at_deadline"] == 0 and stats["seconds"] >= 0
    ready = stats["ready"]
    assert ready["status"] == "ready" and ready["compatibility"]["decode_tp"] == 0
    assert ready["compatibility"] == msgspec.to_builtins(runner.compatibility)
    assert ready["max_total_tokens"] == allocator.capacity

    back = switched(prefill, "prefill", qid=12)
    assert transfer.managers[1].closed
    assert type(back) is PrefillScheduler and back.runner is runner and back.runner.model is model
    assert type(back.req_to_token_pool) is ReqToTokenPool
    assert runner.req_to_token_pool is back.req_to_token_pool
    assert back.args.disaggregation_mode == "prefill" and type(back.tree_cache) is RadixCache
    assert prefill.report(12)["ready"]["compatibility"]["decode_tp"] == 2


def test_a_role_that_does_not_start_leaves_the_node_in_its_old_one(prefill, transfer, monkeypatch):
    """The decode role's KV manager fails to start: the group is a prefill node again, rebuilt over the same
    runner, and the answer says why (the front end and the router then keep it where it was)."""
    old = prefill.sched

    def broken(*args, **kw):
        raise OSError("no transfer engine today")

    monkeypatch.setattr(decode_node.role, "build_kv_manager", broken)
    again = switched(prefill, "decode", qid=21)
    stats = prefill.report(21)
    assert stats["switched"] is False and "no transfer engine today" in stats["error"], stats
    assert "serves the prefill role again" in stats["error"]
    assert type(again) is PrefillScheduler and again is not old and again.runner is old.runner
    assert type(again.req_to_token_pool) is ReqToTokenPool and again.args.disaggregation_mode == "prefill"
    assert transfer.managers[-1] is not transfer.managers[0] and not transfer.managers[-1].closed
    prefill.sched.process_input_requests([prefill.msg("after", 31)])  # it serves as a prefill node
    assert "after" in prefill.sched.hooks.requests


def test_runner_switch_role_refuses_a_page_or_row_in_use(prefill):
    s = prefill.sched
    runner, args = s.runner, dataclasses.replace(s.args, disaggregation_mode="decode")
    pool = runner.req_to_token_pool
    pages = runner.allocator.alloc_pages(2)
    with pytest.raises(RuntimeError, match="2 KV pages and 0 request rows"):
        runner.switch_role(args, DecodeScheduler.make_req_pool(args))
    runner.allocator.free_pages(pages)
    row = pool.alloc()
    with pytest.raises(RuntimeError, match="0 KV pages and 1 request rows"):
        runner.switch_role(args, DecodeScheduler.make_req_pool(args))
    assert runner.req_to_token_pool is pool  # nothing rebuilt
    pool.free(row)
    runner.switch_role(args, DecodeScheduler.make_req_pool(args))
    assert isinstance(runner.req_to_token_pool, DecodeReqToTokenPool)

