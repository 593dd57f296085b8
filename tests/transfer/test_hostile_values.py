"""Hostile peer values against real prefill and decode KV managers (mooncake, in this process).

The attacker is a control plane of its own on the same host: it knows every address, registers as a
decode rank when it needs to (copying the real decode's layout, so only the values under test are
wrong), and sends crafted RegisterPeer / TransferInfo / Abort / Status / AbortAck messages; a
bootstrap server of its own answers garbage. Every bad value must fail its room only, with a reason
naming the field and both values, or be dropped, and be counted (`rejected_peer_values`); the
decode's memory is not touched. After each attack a correct transfer between the same managers is
byte-exact, no manager thread died, and no room is left live or draining on either side.
"""

from __future__ import annotations

import itertools
import json

import msgspec
import pytest

from tests.transfer.inproc_pair import Garbage, GatedEngine, Pair, engine_or_skip, wait
from transfer.base import KVPoll
from transfer.control import (
    Abort,
    AbortAck,
    ControlPlane,
    RegisterPeer,
    Status,
    TransferInfo,
    peer_registration,
)
from transfer.receiver import KVReceiver
from transfer.sender import KVSender

_rooms = itertools.count(1000)
_fresh = itertools.cycle([([1, 2, 3], [4, 5, 6]), ([7, 8], [9, 10]), ([11, 12, 13, 14], [15, 16, 17, 18])])


class Attacker:
    """A control plane that records what it receives."""

    def __init__(self) -> None:
        self.got: list = []
        self.control = ControlPlane("127.0.0.1", self.got.append, name="attacker")
        self.address = self.control.address

    def send(self, to: str, msg) -> None:
        assert self.control.send(to, msg)

    def statuses(self, room: int) -> list[Status]:
        return [m for m in self.got if isinstance(m, Status) and m.room == room]


@pytest.fixture(scope="module")
def pair():
    gate = GatedEngine(engine_or_skip("mooncake"))
    p = Pair(gate, engine_or_skip("mooncake"))
    p.gate = gate
    p.attacker = Attacker()
    yield p
    gate.fail()
    p.attacker.control.close()
    p.close()


def healthy(p: Pair) -> None:
    """A fresh room moves its bytes exactly; no thread died; nothing is left live or draining."""
    src, dst = next(_fresh)
    send, recv = p.transfer(next(_rooms), src, dst, src_state=2, dst_state=4)
    assert send.poll() == KVPoll.Success and recv.poll() == KVPoll.Success, recv.failure_exception()
    assert p.pages_hold(dst, src) and p.state_holds(4, 2)
    assert wait(p.idle), "a room stayed live or draining"
    assert p.threads_alive()


def zero_decode(p: Pair) -> None:
    for b in p.dpool.buffers():
        b.zero_()
    p.dstate.zero_()


def decode_untouched(p: Pair) -> bool:
    return all(not bool(b.any()) for b in p.dpool.buffers()) and not bool(p.dstate.any())


def register_attacker(p: Pair, **changes) -> RegisterPeer:
    """The attacker registers with the real decode's layout (and engine), changed by `changes`."""
    reg = peer_registration(p.decode.args, p.attacker.address, p.decode.engine.describe())
    reg = msgspec.structs.replace(reg, **changes)
    p.attacker.send(p.prefill.address, reg)
    assert wait(lambda: p.attacker.address in p.prefill._decode_peers
                and p.prefill._decode_peers[p.attacker.address].reg == reg
                and p.prefill._decode_peers[p.attacker.address].ready)
    return reg


def good_info(p: Pair, room: int, n: int, **changes) -> TransferInfo:
    info = TransferInfo(src=p.attacker.address, room=room, tp_rank=0, tp_size=1,
                        dst_page_indices=list(range(20, 20 + n)), metadata_index=3, state_indices=[1],
                        expects_metadata=True)
    return msgspec.structs.replace(info, **changes)


def counted(mgr, before: int) -> bool:
    return wait(lambda: mgr.rejected_peer_values > before)


# ------------------------------------------------------------------------------------- RegisterPeer
def _reg_cases():
    def base(p):
        return peer_registration(p.decode.args, "x", b"")

    return {
        "odd buffer count": (lambda p: {"kv_ptrs": base(p).kv_ptrs[:-1],
                                        "kv_item_lens": base(p).kv_item_lens[:-1],
                                         "kv_item_strides": base(p).kv_item_strides[:-1]}, "kv_ptrs"),
        "item length": (lambda p: {"kv_item_lens": [n + 64 for n in base(p).kv_item_lens]},
                        "kv_item_lens[0]"),
        "stride below item": (lambda p: {"kv_item_strides": [16] * len(base(p).kv_ptrs)},
                              "kv_item_strides[0]"),
        "no pages": (lambda p: {"kv_num_pages": 0}, "kv_num_pages = 0"),
        "2**40 pages": (lambda p: {"kv_num_pages": 1 << 40}, "kv_num_pages = 1099511627776"),
        "buffers overlap": (lambda p: {"kv_ptrs": [base(p).kv_ptrs[0] + 64] + base(p).kv_ptrs[1:]},
                            "overlap"),
        "past the address space": (lambda p: {"kv_ptrs": [(1 << 64) - 4096] + base(p).kv_ptrs[1:]},
                                   "kv_ptrs[0]"),
        "aux on the kv pool": (lambda p: {"aux_ptrs": [base(p).kv_ptrs[0]] + base(p).aux_ptrs[1:]},
                               "overlaps"),
        "no metadata rows": (lambda p: {"aux_num_rows": 0}, "aux_num_rows = 0"),
        "no state slots": (lambda p: {"state_num_slots": 0}, "state_num_slots = 0"),
        "aux item lengths": (lambda p: {"aux_item_lens": [n * 2 for n in base(p).aux_item_lens]},
                             "metadata buffer"),
        "tp rank": (lambda p: {"tp_rank": 5}, "tp_rank = 5"),
        "heads per rank": (lambda p: {"kv_head_num": 3}, "kv_head_num = 3"),
        "state shape": (lambda p: {"state_item_lens": [n + 4 for n in base(p).state_item_lens]},
                        "state buffer"),
        "kv layer ids repeated": (lambda p: {"kv_layer_ids": [0] * len(base(p).kv_layer_ids)},
                                  "kv_layer_ids"),
        "kv layer ids short": (lambda p: {"kv_layer_ids": base(p).kv_layer_ids[1:]}, "kv_layer_ids"),
        "kv layer id negative": (lambda p: {"kv_layer_ids": [-1] + base(p).kv_layer_ids[1:]}, "kv_layer_ids"),
        "other kv layers": (lambda p: {"kv_layer_ids": [i + 1 for i in base(p).kv_layer_ids]},
                            "decode holds kv layers"),
        "state of another layer": (lambda p: {"state_layer_ids": [9] * len(base(p).state_layer_ids)},
                                   "lack the prefill"),
        "state layer ids short": (lambda p: {"state_layer_ids": []}, "layer ids)"),
    }


@pytest.mark.parametrize("case", list(_reg_cases()))
def test_inconsistent_register_peer_fails_the_rooms_naming_it(pair, case):
    changes, word = _reg_cases()[case]
    before = pair.prefill.rejected_peer_values
    register_attacker(pair, **changes(pair))
    room = next(_rooms)
    send = KVSender(pair.prefill, room)
    send.init(2, 0)
    pair.attacker.send(pair.prefill.address, good_info(pair, room, 2))
    assert wait(lambda: send.poll() == KVPoll.Failed)
    reason = send.failure_exception().reason
    assert "registration was rejected" in reason and word in reason, reason
    assert wait(lambda: any(not s.ok and word in s.reason for s in pair.attacker.statuses(room)))
    assert counted(pair.prefill, before)
    healthy(pair)


def test_a_decode_tp_other_than_the_prefill_serves_is_refused(pair):
    """--disaggregation-decode-tp on the prefill side: a registration of another decode TP size is refused."""
    pair.prefill.args.decode_tp = 2  # the pair's decode ranks are tp 1
    try:
        register_attacker(pair)
        room = next(_rooms)
        send = KVSender(pair.prefill, room)
        send.init(2, 0)
        pair.attacker.send(pair.prefill.address, good_info(pair, room, 2))
        assert wait(lambda: send.poll() == KVPoll.Failed)
        assert "serves decode tp 2 only (--disaggregation-decode-tp)" in send.failure_exception().reason
    finally:
        pair.prefill.args.decode_tp = 0
    healthy(pair)


# ------------------------------------------------------------------------------------- TransferInfo
INFO_CASES = {
    "page past the pool": ({"dst_page_indices": [20, 32]}, "dst_page_indices[1] = 32, expected 1..31"),
    "padding page": ({"dst_page_indices": [0, 21]}, "dst_page_indices[0] = 0, expected 1..31"),
    "negative page": ({"dst_page_indices": [20, -1]}, "dst_page_indices[1] = -1, expected 1..31"),
    "uint64 page": ({"dst_page_indices": [(1 << 64) - 1, 21]}, f"dst_page_indices[0] = {(1 << 64) - 1}"),
    "duplicate pages": ({"dst_page_indices": [25, 25]}, "dst_page_indices = '25 twice'"),
    "metadata row past the rows": ({"metadata_index": 8}, "metadata_index = 8, expected 0..7"),
    "negative metadata row": ({"metadata_index": -1}, "metadata_index = -1, expected 0..7"),
    "state slot past the slots": ({"state_indices": [6]}, "state_indices[0] = 6, expected 0..5"),
    "duplicate state slots": ({"state_indices": [2, 2]}, "state_indices = '2 twice'"),
    "tp rank not the registered one": ({"tp_rank": 1}, "tp_rank = 1, expected 0"),
    "tp size not the registered one": ({"tp_size": 2}, "tp_size = 2, expected 1"),
    "page count": ({"dst_page_indices": [20, 21, 22]}, "page count mismatch: prefill sends 2 pages"),
}


@pytest.mark.parametrize("case", list(INFO_CASES))
def test_bad_transfer_info_fails_its_room_and_writes_nothing(pair, case):
    changes, want = INFO_CASES[case]
    zero_decode(pair)
    register_attacker(pair)
    before = pair.prefill.rejected_peer_values
    room = next(_rooms)
    send = KVSender(pair.prefill, room)
    send.init(2, 0)
    pair.attacker.send(pair.prefill.address, good_info(pair, room, 2, **changes))
    send.send([5, 6], [0], last=True)
    assert wait(lambda: send.poll() == KVPoll.Failed)
    assert want in send.failure_exception().reason, send.failure_exception().reason
    assert wait(lambda: any(not s.ok and want in s.reason for s in pair.attacker.statuses(room)))
    if case != "page count":  # counted where the value arrives; the page count is the sender's own check
        assert counted(pair.prefill, before)
    assert decode_untouched(pair)
    healthy(pair)


def test_transfer_info_from_an_unregistered_rank_is_refused(pair):
    stranger = Attacker()
    try:
        before = pair.prefill.rejected_peer_values
        room = next(_rooms)
        stranger.send(pair.prefill.address,
                      msgspec.structs.replace(good_info(pair, room, 2), src=stranger.address))
        assert wait(lambda: any(not s.ok and "not registered" in s.reason for s in stranger.statuses(room)))
        assert counted(pair.prefill, before)
    finally:
        stranger.control.close()
    healthy(pair)


def test_a_second_rank_claiming_a_started_rooms_place_is_dropped(pair):
    register_attacker(pair)
    room = next(_rooms)
    send, recv = pair.start(room, [1, 2], [3, 4])
    assert wait(lambda: send.poll() == KVPoll.WaitingForInput)
    before = pair.prefill.rejected_peer_values
    pair.attacker.send(pair.prefill.address, good_info(pair, room, 2))  # the same tp place, another rank
    assert counted(pair.prefill, before)
    send.send([1, 2], [0], last=True)
    assert wait(lambda: recv.poll() == KVPoll.Success) and pair.pages_hold([3, 4], [1, 2])
    healthy(pair)


# ------------------------------------------------------------------------------------- Abort
def test_forged_abort_from_a_non_owner_does_not_kill_the_room(pair):
    register_attacker(pair)
    room = next(_rooms)
    send, recv = pair.start(room, [1, 2, 3], [4, 5, 6])
    assert wait(lambda: send.poll() == KVPoll.WaitingForInput)
    before = pair.prefill.rejected_peer_values
    pair.attacker.send(pair.prefill.address, Abort(src=pair.attacker.address, room=room, reason="forged"))
    assert counted(pair.prefill, before)
    # the ack is truthful: nothing of this room writes into the attacker's (claimed) memory
    assert wait(lambda: any(isinstance(m, AbortAck) and m.room == room for m in pair.attacker.got))
    send.send([1, 2, 3], [0], last=True)
    assert wait(lambda: recv.poll() == KVPoll.Success) and send.poll() == KVPoll.Success
    assert pair.pages_hold([4, 5, 6], [1, 2, 3])
    healthy(pair)


def test_abort_before_any_info_stands_only_for_the_rank_that_sent_it(pair):
    register_attacker(pair)
    room = next(_rooms)
    pair.attacker.send(pair.prefill.address, Abort(src=pair.attacker.address, room=room, reason="early"))
    assert wait(lambda: room in pair.prefill._early_aborts)
    stranger = Attacker()  # not registered: dropped
    try:
        before = pair.prefill.rejected_peer_values
        stranger.send(pair.prefill.address, Abort(src=stranger.address, room=room, reason="x"))
        assert counted(pair.prefill, before)
    finally:
        stranger.control.close()
    _, recv = pair.transfer(room, [1, 2], [3, 4])
    assert recv.poll() == KVPoll.Success and pair.pages_hold([3, 4], [1, 2])
    # the rank that aborted the room cannot claim it afterwards
    room2 = next(_rooms)
    pair.attacker.send(pair.prefill.address, Abort(src=pair.attacker.address, room=room2, reason="early"))
    assert wait(lambda: room2 in pair.prefill._early_aborts)
    send2 = KVSender(pair.prefill, room2)
    send2.init(2, 0)
    pair.attacker.send(pair.prefill.address, good_info(pair, room2, 2))
    assert wait(lambda: send2.poll() == KVPoll.Failed) and "aborted by the decode side: early" in \
        send2.failure_exception().reason
    healthy(pair)


# ------------------------------------------------------------------------------------- Status, AbortAck
@pytest.mark.parametrize("ok", [True, False])
def test_forged_status_from_a_non_target_is_dropped(pair, ok):
    room = next(_rooms)
    send, recv = pair.start(room, [1, 2], [3, 4])
    assert wait(lambda: recv.poll() == KVPoll.Transferring)
    before = pair.decode.rejected_peer_values
    forged = [Status(src=pair.attacker.address, room=room, ok=ok, reason="forged", tp_rank=0, pp_rank=0),
              Status(src=pair.prefill.address, room=room, ok=ok, reason="forged", tp_rank=1, pp_rank=0),
              Status(src=pair.prefill.address, room=room, ok=ok, reason="forged", tp_rank=0, pp_rank=3)]
    for msg in forged:
        pair.attacker.send(pair.decode.address, msg)
    assert wait(lambda: pair.decode.rejected_peer_values >= before + 3)
    assert recv.poll() == KVPoll.Transferring  # neither decoding garbage nor killed
    send.send([1, 2], [0], last=True)
    assert wait(lambda: recv.poll() == KVPoll.Success) and pair.pages_hold([3, 4], [1, 2])
    healthy(pair)


def test_forged_abort_ack_does_not_end_a_drain(pair):
    gate = pair.gate
    room = next(_rooms)
    send, recv = pair.start(room, [1, 2], [3, 4])
    gate.entered.clear()
    gate.done.clear()
    gate._open.clear()
    gate.arm()
    send.send([1, 2], [0], last=True)
    assert gate.entered.wait(20)
    recv.abort()
    assert wait(lambda: send.poll() == KVPoll.Failed)
    before = pair.decode.rejected_peer_values
    pair.attacker.send(pair.decode.address,
                       AbortAck(src=pair.attacker.address, room=room, tp_rank=0, pp_rank=0))
    pair.attacker.send(pair.decode.address,
                       AbortAck(src=pair.prefill.address, room=room, tp_rank=2, pp_rank=0))
    assert wait(lambda: pair.decode.rejected_peer_values >= before + 2)
    assert recv.drain_poll() == KVPoll.Transferring
    gate.release()
    assert gate.done.wait(20) and wait(lambda: recv.drain_poll() == KVPoll.Success)
    healthy(pair)


# ------------------------------------------------------------------------------------- metadata row
ROW_CASES = {
    "first token past the vocabulary": (lambda m, s: None, {}, "first_token_id = 4242, expected 0..999"),
    "cached tokens past the prompt": (lambda m, s: m.tensor("cached_tokens")[s].fill_(99), {"vocab": 5000},
                                      "cached_tokens = 99, expected 0..10"),
    "top logprob id": (lambda m, s: m.tensor("top_logprobs_idx")[s, 1].fill_(-7), {"vocab": 5000, "top_k": 2},
                       "top_logprobs_idx[1] = -7"),
    "NaN logprob": (lambda m, s: m.tensor("logprob_val")[s].fill_(float("nan")),
                    {"vocab": 5000, "logprob": True}, "logprob_val = nan"),
}


@pytest.mark.parametrize("case", list(ROW_CASES))
def test_bad_metadata_row_fails_the_room_not_the_decode(pair, case):
    change, kw, want = ROW_CASES[case]
    room = next(_rooms)
    send, recv = pair.start(room, [1, 2], [3, 4], src_meta=2, dst_meta=5)
    change(pair.pmeta, 2)
    vocab = kw.get("vocab", 1000)
    recv.check_metadata = lambda slot: pair.dmeta.check_row(slot, vocab, 10, logprob=kw.get("logprob", False),
                                                            top_k=kw.get("top_k", 0))
    before = pair.decode.rejected_peer_values
    send.send([1, 2], [0], last=True)
    assert wait(lambda: recv.poll() == KVPoll.Failed)
    assert want in recv.failure_exception().reason, recv.failure_exception().reason
    assert counted(pair.decode, before)
    healthy(pair)


# ------------------------------------------------------------------------------------- bootstrap answers
LAYOUT = {"tp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": 4,
          "model": "test-model", "kv_heads_total": 4, "kv_layout": "page,head,token,dim", "ranks": 1}


def _json(obj):
    return "application/json", json.dumps(obj).encode()


def _layout_then(rank):
    return lambda path: _json(LAYOUT) if "engine_rank=-1" in path else _json(rank)


BOOTSTRAP_CASES = {
    "not JSON": (lambda path: ("text/plain", b"hello"), "not a JSON layout"),
    "an HTML page": (lambda path: ("text/html", b"<html><body>502 Bad Gateway</body></html>"),
                     "not a JSON layout"),
    "a JSON list": (lambda path: _json([1, 2, 3]), "layout answer is a list"),
    "page size as a string": (lambda path: _json({**LAYOUT, "page_size": "4"}), "layout page_size = '4'"),
    "negative tp size": (lambda path: _json({**LAYOUT, "tp_size": -1}), "layout tp_size = -1"),
    "model not a string": (lambda path: _json({**LAYOUT, "model": 7}), "layout model = 7"),
    "no dp rank 0": (lambda path: _json({**LAYOUT, "dp_size": 0}), "layout dp_size = 0"),
    "port out of range": (_layout_then({"rank_ip": "127.0.0.1", "rank_port": 70000}), "rank_port = 70000"),
    "port a string": (_layout_then({"rank_ip": "127.0.0.1", "rank_port": "80"}), "rank_port = '80'"),
    "host with a space": (_layout_then({"rank_ip": "a b", "rank_port": 80}), "rank_ip = 'a b'"),
    "rank answer not JSON": (lambda path: _json(LAYOUT) if "engine_rank=-1" in path else ("text/plain", b"{"),
                             "not JSON for rank tp 0"),
    "a huge body": (lambda path: ("text/plain", b"x" * (24 << 20)), "bootstrap server"),
}


def _resolver_fails(pair, addr: str, want: str) -> None:
    room = next(_rooms)
    recv = KVReceiver(pair.decode, addr, room)
    recv.init([3, 4], 0, [0])
    assert wait(lambda: recv.poll() == KVPoll.Failed, timeout=30)
    reason = recv.failure_exception().reason
    assert want in reason, reason
    assert pair.decode._resolver.is_alive()


@pytest.mark.parametrize("case", list(BOOTSTRAP_CASES))
def test_bootstrap_server_answering_garbage_fails_its_rooms_not_the_resolver(pair, case):
    answers, want = BOOTSTRAP_CASES[case]
    server = Garbage(answers)
    try:
        _resolver_fails(pair, server.addr, want)
    finally:
        server.close()
    healthy(pair)


@pytest.mark.parametrize("addr", ["a b:8998", "127.0.0.1:0", "127.0.0.1:70000", "127.0.0.1", "[::1:80"])
def test_unusable_bootstrap_address_fails_its_room_not_the_resolver(pair, addr):
    _resolver_fails(pair, addr, "is not host:port")
    healthy(pair)



def test_a_flood_of_rejections_is_counted_in_full_and_logged_in_bursts(caplog, monkeypatch):
    import threading
    from types import SimpleNamespace

    from transfer import peer_checks

    clock = [100.0]
    monkeypatch.setattr(peer_checks.time, "monotonic", lambda: clock[0])
    mgr = SimpleNamespace(_lock=threading.Lock(), side="prefill")
    with caplog.at_level("WARNING", logger="transfer.peer_checks"):
        for i in range(500):
            peer_checks.reject(mgr, f"TransferInfo for room {i}", "bad")
        assert len(caplog.records) == peer_checks.LOG_BURST
        clock[0] += 1.5
        peer_checks.reject(mgr, "TransferInfo for room 500", "bad")
    lines = [r.getMessage() for r in caplog.records]
    assert mgr.rejected_peer_values == 501
    assert f"{500 - peer_checks.LOG_BURST} more rejected peer value(s) not logged" in lines[-2]
    assert lines[-1].endswith("room 500: bad")
