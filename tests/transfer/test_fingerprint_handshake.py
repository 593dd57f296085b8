"""The transfer handshake refuses a peer of another compatibility fingerprint (common/fingerprint.py): the
prefill's RegisterPeer check, the bootstrap server's layout (a real server on a local port) and the decode's
resolver. The fingerprint itself, without sockets: tests/unit/test_fingerprint.py."""

from __future__ import annotations

import time

import pytest

from common.memory.kv_pool import KVPool
from tests.transfer.kv_harness import free_port
from transfer.base import KVArgs, KVPoll
from transfer.bootstrap import BootstrapClient, BootstrapError, BootstrapServer
from transfer.control import peer_registration
from transfer.metadata import MetadataBuffers
from transfer.peer_checks import check_layout, check_registration
from transfer.receiver import DecodeKVManager


def _args(fingerprint: str) -> KVArgs:
    return KVArgs.from_pool(KVPool(8, 4, 2, 2, 16), MetadataBuffers(2), model="test-model",
                            fingerprint=fingerprint)


def test_the_prefill_refuses_a_decode_of_another_fingerprint():
    prefill = _args("a" * 32)
    same = peer_registration(_args("a" * 32), "tcp://127.0.0.1:5555", b"")
    assert check_registration(prefill, same) is None
    problem = check_registration(prefill, peer_registration(_args("b" * 32), "tcp://127.0.0.1:5555", b""))
    assert problem.startswith(f"compatibility fingerprint mismatch: prefill {'a' * 16}, decode {'b' * 16}")
    # a node that sends none (an older one) is not compared
    assert check_registration(prefill, peer_registration(_args(""), "tcp://127.0.0.1:5555", b"")) is None


def _info(**kw) -> dict:
    return {"role": "prefill", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
            "pp_size": 1,
            "rank_ip": "127.0.0.1", "rank_port": 5555, "page_size": 4, "model": "test-model",
            "kv_layout": "page,head,token,dim", "kv_heads_total": 2, **kw}


@pytest.fixture
def server():
    srv = BootstrapServer("127.0.0.1", free_port())
    srv.start()
    yield f"127.0.0.1:{srv.port}"
    srv.stop()


def test_the_bootstrap_layout_carries_the_fingerprint(server):
    client = BootstrapClient(timeout=30.0)
    client.register(server, _info(tp_size=2, fingerprint="a" * 32))
    layout = client.layout(server)
    assert layout["fingerprint"] == "a" * 32 and check_layout(layout) is None
    with pytest.raises(BootstrapError, match="409.*fingerprint mismatch"):
        client.register(server, _info(tp_size=2, tp_rank=1, rank_port=5556, fingerprint="b" * 32))
    assert "fingerprint = 5" in check_layout({**layout, "fingerprint": 5})


def test_the_decode_refuses_a_prefill_of_another_fingerprint(server):
    BootstrapClient(timeout=30.0).register(server, _info(fingerprint="a" * 32))
    mgr = DecodeKVManager(_args("b" * 32), "fake")
    try:
        recv = mgr.create_receiver(server, room=77)
        recv.init([1, 2], 0)
        for _ in range(500):
            if recv.poll() == KVPoll.Failed:
                break
            time.sleep(0.02)
        assert recv.poll() == KVPoll.Failed
        assert "compatibility fingerprint mismatch" in recv.failure_exception().reason
    finally:
        mgr.close()
