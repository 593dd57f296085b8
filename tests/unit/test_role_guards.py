"""What keeps one bad request from taking a node down, in process:

* the scheduler survives an exception in any role hook: that request ends with 500 (a refusal for
  `validate`), the others finish with their tokens, the pools come back, and the next request is served;
* the PD roles refuse bootstrap values that cannot be carried, and count every transfer failure once
  (also one the poll had not seen when the request ended) and every healthy transfer they give up;
* the decode quarantine hands rooms back only when their drain polls Success.
"""

from __future__ import annotations

import pytest

from common.scheduler.hooks import SchedulerHooks
from decode_node.quarantine import Quarantine, QuarantinedRoom
from tests.unit.test_pd_queues import Conn, Role, prefill_state, req
from tests.unit.test_scheduler_contract import Driver
from transfer.base import KVPoll
from transfer.peer_checks import check_bootstrap_addr

HOOKS = ["validate", "on_new_request", "on_chunk_done", "on_prefill_done", "on_finished", "on_release"]


def _raising(name: str, result=None):
    """A hook that raises for rid "bad" when it is the hook under test, else returns `result`."""

    def hook(self, req):
        if name == self.hook and req.rid == "bad":
            raise RuntimeError(f"{name} broke for {req.rid}")
        return result

    return hook


class RaisingHooks(SchedulerHooks):
    """Raises in `hook` for rid "bad" only (and in before_schedule / stats once each)."""

    validate = _raising("validate")
    on_new_request = _raising("on_new_request", False)
    on_chunk_done = _raising("on_chunk_done")
    on_prefill_done = _raising("on_prefill_done")
    on_finished = _raising("on_finished", False)
    on_release = _raising("on_release")

    def __init__(self, hook: str) -> None:
        self.hook = hook
        self.before_raised = False
        self.stats_raised = False

    def before_schedule(self):
        if not self.before_raised:
            self.before_raised = True
            raise RuntimeError("before_schedule broke once")

    def stats(self):
        if not self.stats_raised:
            self.stats_raised = True
            raise RuntimeError("stats broke once")
        return {}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir


@pytest.mark.parametrize("hook", HOOKS)
def test_an_exception_in_a_role_hook_fails_that_request_only(tiny, hook, caplog):
    d = Driver(tiny)
    d.sched.hooks = RaisingHooks(hook)
    d.sched.send_fn = d.collect
    assert d.sched.get_stats()  # stats raising once: the scheduler's own figures still come
    d.sched.process_input_requests([d.msg("bad", 40, seed=1), d.msg("good", 40, seed=2)])
    d.run()
    bad, good = d.updates("bad")[-1], d.updates("good")[-1]
    if hook == "on_release":  # the request had ended already: it keeps its end, its memory is freed
        assert bad.finish_reason["type"] == "length"
    else:
        assert bad.error_status == 500 and bad.finish_reason["type"] == "abort", bad
        assert hook in bad.finish_reason["message"] or "validating" in bad.finish_reason["message"]
    assert good.error_status == 0 and good.completion_tokens == 8
    assert d.free_counts() == d.start
    assert any("rid=bad" in r.getMessage() and r.exc_info for r in caplog.records), "no traceback logged"
    d.sched.process_input_requests([d.msg("after", 20, seed=3)])
    d.run()
    assert d.updates("after")[-1].completion_tokens == 8 and d.free_counts() == d.start


# -------------------------------------------------------------------------------------------- PD roles
@pytest.mark.parametrize("room,ok",
                         [(0, True), ((1 << 63) - 1, True), (1 << 63, False), ((1 << 64) - 1, False),
                          (-1, False)])
def test_rooms_outside_int64_are_refused(room, ok):
    err = Role().validate(req("x", room))
    assert (err is None) == ok, err
    if not ok:
        assert err[0] == 400 and "bootstrap_room must be 0.." in err[1] and str(room) in err[1]


def test_ports_outside_1_65535_are_refused():
    r = req("x", 5)
    for port, ok in ((1, True), (65535, True), (0, False), (65536, False)):
        r.bootstrap_port = port
        err = Role().validate(r)
        assert (err is None) == ok and (ok or "bootstrap_port must be 1..65535" in err[1]), err


@pytest.mark.parametrize("addr,ok",
                         [("127.0.0.1:8998", True), ("node-3.cluster.local:1", True), ("[::1]:80", True),
                          ("a b:8998", False), ("h:0", False), ("h:70000", False), ("h", False),
                          ("http://h:80", False), (":80", False)])
def test_bootstrap_addresses(addr, ok):
    assert (check_bootstrap_addr(addr) is None) == ok


def test_each_transfer_failure_counts_once_also_when_the_request_ended_first():
    role = Role()
    a, b, c = prefill_state("a", 1), prefill_state("b", 2), prefill_state("c", 3)
    for t in (a, b, c):
        role.requests[t.rid] = t
    # a: the poll saw its failure (fail), then its release must not count it again
    a.conn.state = KVPoll.Failed
    role.poll([a])
    role.release_conn(a)
    # b: an abort ended it before the poll saw its failure: counted at release
    b.conn.state = KVPoll.Failed
    role.release_conn(b)
    # c: a healthy transfer given up
    c.conn.state = KVPoll.Transferring
    role.release_conn(c)
    s = role.transfer_stats.as_stats()
    assert (s["transfer_failures"], s["transfer_aborts"]) == (2, 1)
    assert c.conn.aborted and not b.conn.aborted


def test_the_quarantine_hands_back_only_drained_rooms():
    class Drain(Conn):
        def drain_poll(self):
            return self.state

    q = Quarantine()
    rooms = [QuarantinedRoom(f"r{i}", i, Drain(i, KVPoll.Transferring), [i * 10, i * 10 + 1], i, i)
             for i in range(3)]
    for r in rooms:
        q.add(r)
    assert q.num_pages() == 6 and q.holds_room(1) and len(q) == 3
    rooms[1].conn.state = KVPoll.Success
    done = q.release([r.poll() for r in q])
    assert done == [rooms[1]] and q.num_pages() == 4 and not q.holds_room(1)
    # the decision is the consensus one: a room drained here but not on another rank stays
    assert q.release([KVPoll.Transferring, KVPoll.Transferring]) == [] and len(q) == 2
