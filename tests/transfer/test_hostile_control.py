"""Hostile peers against the cluster's own planes: a real bootstrap server over HTTP and real prefill
and decode KV managers (built as `kv_harness` builds them, the fake engine and ucx, with and without
a cluster secret) in this process, talking over real ZMQ sockets; the attacker is a plain HTTP
client and a plain ZMQ PUSH socket that knows every address but not the secret.

After each attack a real transfer between the same managers still completes (byte-exact with ucx),
the managers' receiver, timer and resolver threads and the bootstrap server's are alive, and the
process's open file descriptors stay bounded. The counters each attack must move are checked too.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from common.cluster_secret import ClusterSecret, load_secret
from common.server.metrics import Metrics
from disaggregation.role import PDRole
from tests.transfer import kv_harness as h
from tests.transfer.inproc_pair import wait as wait_for
from transfer.auth import CONTROL, Authenticator
from transfer.base import KVPoll
from transfer.bootstrap import BootstrapClient, BootstrapError, BootstrapServer
from transfer.control import Abort, ControlPlane, Ping, Status, TransferInfo
from transfer.engine import BackendUnavailable
from transfer.receiver import KVReceiver
from transfer.sender import KVSender

MAX_PEERS = 64
MAX_DECODE_PEERS = 32
SPEC = {"seed": 21, "src_pages": [3, 4, 5, 9, 11, 17], "dst_pages": [7, 8, 2, 20, 21, 30], "chunks": [2, 4],
        "src_meta": 1, "dst_meta": 2, "src_state": [1, 3], "dst_state": [4, 0]}
ROOMS = itertools.count(5_000_001)
OTHER = ClusterSecret([b"not-the-cluster-secret-at-all"])
ENCODE = msgspec.msgpack.Encoder().encode


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Cluster(SimpleNamespace):
    """srv, addr, pm (prefill manager), dm (decode manager), their buffers, secret, backend."""

    def stats(self, mgr) -> dict[str, int]:
        return mgr.guard_stats()

    def transfer(self, room: int | None = None, started=None) -> int:
        """One real transfer of SPEC's pages in a fresh room; `started(room)` runs once the sender
        has every decode rank's TransferInfo and before the chunks go. Asserts Success (byte-exact)."""
        room = next(ROOMS) if room is None else room
        spec = {**SPEC, "backend": self.backend, "room": room}
        for b in self.dpool.buffers():
            b.zero_()
        self.dstate.zero_()
        self.pmeta.set_buf(spec["src_meta"], first_token_id=4242, cached_tokens=7, logprob_val=-0.5,
                           logprob_idx=4242, top_vals=[-0.5, -1.5, -2.5], top_idxs=[4242, 17, 99], room=room,
                           topk_p=[0.75, 0.25], topk_index=[4242, 17], hidden_state=list(range(8)))
        sender = KVSender(self.pm, room)
        sender.init(len(spec["src_pages"]), spec["src_meta"])
        recv = KVReceiver(self.dm, self.addr, room)
        recv.init(spec["dst_pages"], spec["dst_meta"], spec["dst_state"])
        assert wait_for(lambda: sender.poll() != KVPoll.Bootstrapping), recv.poll()
        if started is not None:
            started(room)
        off = 0
        for i, n in enumerate(spec["chunks"]):
            last = i == len(spec["chunks"]) - 1
            sender.send(spec["src_pages"][off:off + n], spec["src_state"] if last else None, last=last)
            off += n
        done = (KVPoll.Success, KVPoll.Failed)
        assert wait_for(lambda: sender.poll() in done and recv.poll() in done)
        assert sender.poll() == KVPoll.Success, sender.failure_exception()
        assert recv.poll() == KVPoll.Success, recv.failure_exception()
        if self.dm.moves_bytes:
            ok, detail = h._verify(spec, 0, 1, self.dpool, self.dmeta, self.dstate)
            assert ok, detail
        return room

    def assert_healthy(self, fds_before: int) -> None:
        """Every thread alive, a transfer completes, open fds and sockets bounded."""
        threads = [self.pm.control._thread, self.dm.control._thread, self.pm._timer, self.dm._timer,
                   self.dm._resolver, self.srv._thread]
        assert all(t.is_alive() for t in threads), [t.name for t in threads if not t.is_alive()]
        self.transfer()
        assert self.pm.control.peers_open <= MAX_PEERS and self.dm.control.peers_open <= MAX_PEERS
        assert wait_for(lambda: fds() - fds_before <= 2 * MAX_PEERS + 32, 10.0), (fds_before, fds())


class Attacker:
    """A ZMQ PUSH socket per target that sends whatever bytes it is given."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.socks: dict[str, zmq.Socket] = {}

    def send(self, addr: str, frame: bytes) -> None:
        if addr not in self.socks:
            s = self.ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 2000)
            s.connect(addr)
            self.socks[addr] = s
        self.socks[addr].send(frame)

    def close(self) -> None:
        for s in self.socks.values():
            s.close()
        self.ctx.term()


@pytest.fixture(scope="module", params=[("fake", False), ("fake", True), ("ucx", False), ("ucx", True)],
                ids=["fake", "fake-secret", "ucx", "ucx-secret"])
def cluster(request, tmp_path_factory):
    backend, with_secret = request.param
    secret = None
    if with_secret:
        path = tmp_path_factory.mktemp("secret") / "cluster.secret"
        path.write_text(os.urandom(24).hex() + "\n")
        secret = load_secret(str(path))
    srv = BootstrapServer("127.0.0.1", 0, secret=secret)
    srv.start()
    addr = f"127.0.0.1:{srv.port}"
    settings = {**h.FAST, "control_max_peers": MAX_PEERS, "max_decode_peers": MAX_DECODE_PEERS,
                "cluster_secret": secret}
    spec = {**SPEC, "backend": backend}
    built = []
    try:
        try:
            pm, ppool, pmeta, pstate = h._build("prefill", 0, 1, spec, addr, settings)
            built.append(pm)
            dm, dpool, dmeta, dstate = h._build("decode", 0, 1, spec, None, settings)
            built.append(dm)
        except BackendUnavailable as e:
            pytest.skip(str(e))
        # the prefill's pool and state must outlive its manager's registration of them
        c = Cluster(srv=srv, addr=addr, pm=pm, dm=dm, ppool=ppool, pmeta=pmeta, pstate=pstate, dpool=dpool,
                    dmeta=dmeta, dstate=dstate, secret=secret, backend=backend)
        c.transfer()  # warm: the pair registered, the engines connected
        yield c
    finally:
        for m in built:
            m.close()
        srv.stop()


def raw_http(addr: str, method: str, path: str, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{addr}{path}", data=data, method=method)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def registration(pm, **over) -> dict:
    a = pm.args
    info = {"role": "prefill", "tp_rank": a.engine_rank, "tp_size": a.tp_size, "dp_rank": a.dp_rank,
            "dp_size": a.dp_size, "pp_rank": a.pp_rank, "pp_size": a.pp_size, "rank_ip": "127.0.0.1",
            "rank_port": pm.control.port, "page_size": a.page_size, "model": a.model,
            "kv_layout": a.kv_layout, "kv_heads_total": a.total_kv_heads}
    info.update(over)
    return info


# ---------------------------------------------------------------------------------------------- bootstrap
def test_forged_put_route_cannot_hijack_a_rank(cluster):
    c, fds0 = cluster, fds()
    real = dict(c.srv._ranks[(0, 0, 0)])
    with socket.socket() as listener:  # the attacker's own "control port", alive
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        evil_port = listener.getsockname()[1]
        before = c.srv.guard_stats()
        status, text = raw_http(c.addr, "PUT", "/route", registration(c.pm, rank_port=evil_port))
        after = c.srv.guard_stats()
    if c.secret is not None:
        assert status == 401, text
        assert raw_http(c.addr, "GET", "/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1")[0] == 401
        assert raw_http(c.addr, "GET", "/health") == (200, "OK")  # stays open
        wrong = BootstrapClient(auth=Authenticator(OTHER))
        with pytest.raises(BootstrapError, match="401"):
            wrong.register(c.addr, registration(c.pm, rank_port=evil_port))
        assert wrong.layout(c.addr) is None
        assert c.srv.guard_stats()["bootstrap_dropped_unauthenticated"] \
            - before["bootstrap_dropped_unauthenticated"] == 4
    else:
        assert status == 409, text
        assert "dp 0 tp 0 pp 0" in text and f"127.0.0.1:{real['rank_port']}" in text \
            and str(evil_port) in text
        assert after["bootstrap_registrations_refused"] == before["bootstrap_registrations_refused"] + 1
    assert c.srv._ranks[(0, 0, 0)] == real
    c.dm.bootstrap.invalidate(c.addr)  # the decode looks the rank up again, after the attack
    c.assert_healthy(fds0)


def test_a_dead_ranks_registration_is_replaced_and_the_same_address_is_idempotent(caplog):
    srv = BootstrapServer("127.0.0.1", 0)
    srv.start()
    addr, client = f"127.0.0.1:{srv.port}", BootstrapClient()
    base = {"role": "prefill", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
            "pp_rank": 0, "pp_size": 1,
            "rank_ip": "127.0.0.1", "page_size": 4, "model": "m", "kv_layout": "x", "kv_heads_total": 4}
    try:
        with socket.socket() as dead:
            dead.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
            client.register(addr, {**base, "rank_port": dead.getsockname()[1]})
            client.register(addr, {**base, "rank_port": dead.getsockname()[1]})  # same address: a no-op
            with socket.socket() as live:
                live.bind(("127.0.0.1", 0))
                live.listen()
                client.register(addr, {**base, "rank_port": live.getsockname()[1]})  # replaces the dead one
                assert srv.guard_stats()["bootstrap_registrations_replaced"] == 1
                with pytest.raises(BootstrapError, match="409.*alive"):
                    client.register(addr, {**base, "rank_port": dead.getsockname()[1]})
        assert sum("replacing" in r.getMessage() for r in caplog.records) == 1
        assert raw_http(addr, "PUT", "/route", {**base, "rank_port": "x"})[0] == 400
        assert raw_http(addr, "PUT", "/route", None)[0] == 400
        status, _ = raw_http(addr, "PUT", "/route", {**base, "pad": "x" * 100_000})
        assert status == 413
        stats = srv.guard_stats()
        assert stats["bootstrap_dropped_undecodable"] == 2 and stats["bootstrap_dropped_oversized"] == 1
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------------------- control plane
def test_spoofed_register_peer_with_a_live_decodes_src_is_refused(cluster):
    c, fds0, attacker = cluster, fds(), Attacker()
    real = c.pm._decode_peers[c.dm.address].reg
    before = c.stats(c.pm)

    def spoof(room: int) -> None:
        forged = msgspec.structs.replace(real, kv_ptrs=[p + 4096 for p in real.kv_ptrs])
        attacker.send(c.pm.address, ENCODE(forged))
        key = "control_dropped_unauthenticated" if c.secret else "control_registrations_refused"
        assert wait_for(lambda: c.stats(c.pm)[key] == before[key] + 1, 10.0), c.stats(c.pm)

    try:
        c.transfer(started=spoof)  # the spoof lands while the room is live; the transfer is still exact
    finally:
        attacker.close()
    assert c.pm._decode_peers[c.dm.address].reg == real
    c.assert_healthy(fds0)


def test_forged_status_and_abort_without_the_mac_are_dropped(cluster):
    c, fds0, attacker = cluster, fds(), Attacker()
    if c.secret is None:
        pytest.skip("without a cluster secret a forged Status is indistinguishable from a real one")
    before_p, before_d = c.stats(c.pm), c.stats(c.dm)

    def forge(room: int) -> None:
        attacker.send(c.dm.address, ENCODE(Status(src=c.pm.address, room=room, ok=False, reason="forged",
                                                  tp_rank=0, pp_rank=0)))
        attacker.send(c.pm.address, ENCODE(Abort(src=c.dm.address, room=room, reason="forged")))
        wrong = Authenticator(OTHER)  # sealed, with the wrong secret
        attacker.send(c.pm.address, wrong.seal(CONTROL + c.pm.address.encode() + b"\0",
                                               ENCODE(Abort(src=c.dm.address, room=room, reason="forged"))))
        assert wait_for(lambda: c.stats(c.pm)["control_dropped_unauthenticated"]
                        == before_p["control_dropped_unauthenticated"] + 2
                        and c.stats(c.dm)["control_dropped_unauthenticated"]
                        == before_d["control_dropped_unauthenticated"] + 1, 10.0)

    try:
        c.transfer(started=forge)
    finally:
        attacker.close()
    c.assert_healthy(fds0)


def test_a_replayed_captured_message_is_dropped(cluster):
    c, fds0, attacker = cluster, fds(), Attacker()
    if c.secret is None:
        pytest.skip("without a cluster secret a replay is indistinguishable from a resend")
    auth, captured = c.dm.control._auth, []
    seal = auth.seal
    auth.seal = lambda ctx, body: captured.append(seal(ctx, body)) or captured[-1]  # the wire, as seen
    try:
        c.transfer()
    finally:
        del auth.seal
    assert captured  # at least the room's TransferInfo
    before_p, before_d = c.stats(c.pm), c.stats(c.dm)
    try:
        for frame in captured:
            attacker.send(c.pm.address, frame)
        attacker.send(c.dm.address, captured[0])  # to another receiver: its MAC does not hold there
        assert wait_for(lambda: c.stats(c.pm)["control_dropped_stale_or_replayed"]
                        == before_p["control_dropped_stale_or_replayed"] + len(captured)
                        and c.stats(c.dm)["control_dropped_unauthenticated"]
                        == before_d["control_dropped_unauthenticated"] + 1, 10.0), c.stats(c.pm)
    finally:
        attacker.close()
    c.assert_healthy(fds0)


def test_malformed_oversized_and_random_frames_are_dropped(cluster):
    c, fds0, attacker = cluster, fds(), Attacker()
    rng = random.Random(7)
    junk = [rng.randbytes(rng.randrange(1, 3000)) for _ in range(60)] + [
        b"\xc1", ENCODE({"type": "nope"}), ENCODE(Ping(src="not-an-address")),
        ENCODE(Ping(src="tcp://" + "a" * 5000)),
        ENCODE(TransferInfo(src=c.dm.address, room=1, tp_rank=0, tp_size=1,
                            dst_page_indices=[1], metadata_index=0,
                            state_indices=[], expects_metadata=True))[:-3]]
    before = {m: c.stats(m) for m in (c.pm, c.dm)}
    try:
        for target in (c.pm, c.dm):
            for frame in junk:
                attacker.send(target.address, frame)
            attacker.send(target.address, b"\0" * (9 << 20))  # over the 8 MiB limit: dropped, counted
        expected = {"control_dropped_oversized": 1}
        if c.secret is not None:
            expected["control_dropped_unauthenticated"] = len(junk)
            for target in (c.pm, c.dm):  # authentic but undecodable
                ctx = CONTROL + target.address.encode() + b"\0"
                attacker.send(target.address, Authenticator(c.secret).seal(ctx, b"\xc1garbage"))
            expected["control_dropped_undecodable"] = 1
        else:
            expected["control_dropped_undecodable"] = len(junk)

        def reached() -> bool:
            return all(c.stats(m)[k] - before[m][k] == n for m in (c.pm, c.dm) for k, n in expected.items())

        assert wait_for(reached, 20.0), [c.stats(m) for m in (c.pm, c.dm)]
        for target in (c.pm, c.dm):  # beyond zmq's own cap (16 MiB) the attacker's connection is cut
            attacker.send(target.address, b"\0" * (17 << 20))
        time.sleep(0.5)
    finally:
        attacker.close()
    c.assert_healthy(fds0)


def test_thousands_of_bogus_peers_keep_sockets_and_fds_bounded(cluster):
    c, fds0, attacker = cluster, fds(), Attacker()
    real = c.pm._decode_peers[c.dm.address].reg
    n = 3000
    sent = {c.pm.address: 0, c.dm.address: 0}

    def send(target: str, msg) -> None:
        attacker.send(target, ENCODE(msg))
        sent[target] += 1

    # ports bound on every interface but never listening: a connection to any 127.x.y.z of them is
    # refused at once, and nothing leaves this host
    closed = [socket.socket() for _ in range(10)]
    for s in closed:
        s.bind(("0.0.0.0", 0))
    ports = [s.getsockname()[1] for s in closed]
    before = {m: c.stats(m) for m in (c.pm, c.dm)}
    rejected0 = getattr(c.pm, "rejected_peer_values", 0)
    try:
        for i in range(n):
            src = f"tcp://127.{1 + i // 2500}.{i // 10 % 250}.{1 + i % 10}:{ports[i % 10]}"
            if i % 3 == 0:  # pings from strangers
                send(c.pm.address, Ping(src=src))
                send(c.dm.address, Ping(src=src))
            elif i % 3 == 1:  # a registration, then a ping as a "known" peer
                send(c.pm.address, msgspec.structs.replace(real, src=src, engine_desc=b"bogus"))
                send(c.pm.address, Ping(src=src))
            else:  # a TransferInfo from an unregistered rank: the prefill answers it with a Status
                send(c.pm.address, TransferInfo(src=src, room=9_000_000 + i, tp_rank=0, tp_size=1,
                                                dst_page_indices=[1], metadata_index=0, state_indices=[],
                                                expects_metadata=True))
        # a final stranger's ping marks the end of the flood on each side
        last = f"tcp://127.0.0.1:{ports[0]}"
        send(c.pm.address, Ping(src=last))
        send(c.dm.address, Ping(src=last))
        if c.secret is not None:
            def done() -> bool:
                return all(c.stats(m)["control_dropped_unauthenticated"]
                           - before[m]["control_dropped_unauthenticated"]
                           == sent[m.address] for m in (c.pm, c.dm))
        else:
            def grew() -> int:  # registrations dealt with: pushed out again, or refused
                return sum(c.stats(c.pm)[k] - before[c.pm][k]
                           for k in ("control_registrations_evicted", "control_registrations_refused"))

            def done() -> bool:  # the decode ignored every ping; the prefill refused the last TransferInfo
                # and dealt with the registrations (the engine thread adds and removes peers after the control
                # thread)
                return (c.stats(c.dm)["control_pings_ignored"]
                        - before[c.dm]["control_pings_ignored"] == n // 3 + 1
                        and c.pm.rejected_peer_values - rejected0 >= n // 3
                        and c.stats(c.pm)["control_pings_ignored"]
                        - before[c.pm]["control_pings_ignored"] >= n // 3 + 1
                        and grew() >= n // 3 - MAX_DECODE_PEERS)
        assert wait_for(done, 60.0), [c.stats(m) for m in (c.pm, c.dm)]
        if c.secret is not None:
            assert c.stats(c.pm)["control_peers_open"] == before[c.pm]["control_peers_open"]  # none opened
        else:
            assert c.stats(c.pm)["control_peers_evicted"] > before[c.pm]["control_peers_evicted"]
            # a thousand registrations keep at most MAX_DECODE_PEERS (refused ones make room for new
            # ones, the rest are refused) and never push out the real decode's
            assert grew() >= n // 3 - MAX_DECODE_PEERS
            assert c.dm.address in c.pm._decode_peers
        assert len(c.pm._decode_peers) <= MAX_DECODE_PEERS
        assert max(c.stats(m)["control_peers_open"] for m in (c.pm, c.dm)) <= MAX_PEERS
    finally:
        attacker.close()
        for s in closed:
            s.close()
    c.assert_healthy(fds0)


def test_guard_counters_reach_the_stats_and_metrics(cluster):
    c = cluster
    stats = PDRole.guard_stats(SimpleNamespace(kv_manager=c.pm, bootstrap_server=c.srv))
    for key in ("control_dropped_unauthenticated", "control_dropped_stale_or_replayed",
                "control_dropped_oversized",
                "control_dropped_undecodable", "bootstrap_dropped_unauthenticated",
                "bootstrap_dropped_oversized", "bootstrap_registrations_refused", "control_peers_open"):
        assert key in stats
    metrics = Metrics()
    metrics.set_stats({**stats, "control_dropped_oversized": 5})
    assert 'pdserve_control_dropped_oversized_total{model_name=""} 5.0' in metrics.render()


# ---------------------------------------------------------------------------------------------- sockets
def test_close_flushes_a_last_message_sent_on_a_new_socket():
    """A prefill's last Status can be the first message on a socket whose connection is not up yet
    when the manager closes: `close()` still delivers it (here the receiver only binds 0.3 s after
    the send), and returns within about the linger when the peer never shows up."""
    port = h.free_port()
    got: list[bytes] = []

    def late_receiver() -> None:
        time.sleep(0.3)
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(f"tcp://127.0.0.1:{port}")
        if pull.poll(3000):
            got.append(pull.recv())
        pull.close(0)
        ctx.term()

    receiver = threading.Thread(target=late_receiver)
    receiver.start()
    sender = ControlPlane("127.0.0.1", lambda m: None)
    assert sender.send(f"tcp://127.0.0.1:{port}", Status(src=sender.address, room=7, ok=True, reason="",
                                                         tp_rank=0, pp_rank=0))
    sender.close()
    receiver.join()
    assert len(got) == 1 and msgspec.msgpack.decode(got[0], type=Status).room == 7
    lonely = ControlPlane("127.0.0.1", lambda m: None)
    lonely.send(f"tcp://127.0.0.1:{h.free_port()}", Ping(src=lonely.address))  # nobody will ever listen
    start = time.monotonic()
    lonely.close()
    assert time.monotonic() - start < 2.0


def test_send_never_raises_and_peer_sockets_stay_bounded(caplog, monkeypatch):
    cp = ControlPlane("127.0.0.1", lambda m: None, max_peers=4)
    ping = Ping(src=cp.address)
    closed = socket.socket()
    closed.bind(("0.0.0.0", 0))  # never listening: connections to it are refused
    peers = [f"tcp://127.0.0.{k}:{closed.getsockname()[1]}" for k in range(1, 11)]
    try:
        assert cp.send("not an address", ping) is False
        assert cp.send("tcp://127.0.0.1:99999", ping) is False  # no such port
        for addr in peers:
            cp.send(addr, ping)
        assert cp.peers_open == 4 and cp.peers_evicted == 6
        cp.drop(peers[-1])
        assert cp.peers_open == 3

        def full(kind):
            raise zmq.ZMQError(errno.EMFILE)

        monkeypatch.setattr(cp._ctx, "socket", full)  # the context is full
        assert cp.send("tcp://127.0.0.99:1", ping) is False
        assert cp.send("tcp://127.0.0.99:1", ping) is False
        assert sum("127.0.0.99:1" in r.getMessage() for r in caplog.records) == 1  # logged once per peer
        assert cp.send_failures == 4
    finally:
        monkeypatch.undo()
        cp.close()
        closed.close()
    assert cp.send(peers[0], ping) is False  # closed
