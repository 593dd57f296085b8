"""Every listener of a node binds the address it was given, or the node says why not and does not start.

A hand-started prefill node (`python -m prefill_node --host 127.0.0.1`, no transfer backend on its command
line, so the default applies) must have no listening TCP socket and no unconnected UDP socket on 0.0.0.0 or
:: in any process of its tree. Mooncake cannot be confined (transfer/mooncake.py names the places in its
sources): on a specific host it is refused unless acknowledged, both as an engine in this process and as a
node's start-up failure that names the flag and the alternative; acknowledged, it starts and warns. The
suite acknowledges it for every test (tests/conftest.py), so these tests take that away first.
"""

from __future__ import annotations

import argparse
import logging
import socket

import psutil
import pytest

from common.config import ServerArgs
from disaggregation.kv import node_settings
from tests.harness.client import free_port
from tests.harness.nodes import RoleNode
from transfer.backends import create_engine
from transfer.base import TransferSettings

ACK_ENV = "PDSERVE_TRANSFER_ALLOW_WILDCARD_LISTEN"
NODE = {"page_size": 4, "max_total_tokens": 2048, "max_running_requests": 4, "num_threads": 1}


@pytest.fixture
def no_ack(monkeypatch):
    """The suite's acknowledgement of mooncake's wildcard listeners taken away (here and in children)."""
    monkeypatch.delenv(ACK_ENV, raising=False)


def wildcard(ip: str) -> bool:
    return ip.split("%", 1)[0] in ("0.0.0.0", "::")


def tree_sockets(pid: int) -> list[tuple[int, str, str, int]]:
    """(pid, kind, ip, port) of every listening TCP and unconnected UDP socket in the process tree."""
    root = psutil.Process(pid)
    found = []
    for proc in (root, *root.children(recursive=True)):
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            if c.type == socket.SOCK_STREAM and c.status == psutil.CONN_LISTEN:
                found.append((proc.pid, "tcp", c.laddr.ip, c.laddr.port))
            elif c.type == socket.SOCK_DGRAM and not c.raddr:
                found.append((proc.pid, "udp", c.laddr.ip, c.laddr.port))
    return found


def listening_here() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def mooncake_or_skip():
    pytest.importorskip("mooncake.engine", reason="mooncake is not installed")


def parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(list(argv)))


def test_hand_started_node_has_no_wildcard_listener_by_default(tiny_model_dir, launcher, no_ack):
    assert ServerArgs().transfer_backend == "nixl"
    node = RoleNode("prefill", tiny_model_dir, log_path=launcher.log_path("prefill"), host="127.0.0.1",
                    disaggregation_bootstrap_port=free_port(), **NODE)
    assert "--transfer-backend" not in node.command()  # the node's own default applies
    launcher.start(node)
    found = tree_sockets(node.proc.pid)
    wild = [f for f in found if wildcard(f[2])]
    assert not wild, f"listening on every interface (pid, kind, ip, port): {wild}"
    # the scan saw what it had to: the HTTP and bootstrap ports, and sockets of the scheduler rank itself
    ports = {port for *_, port in found}
    assert {node.port, node.bootstrap_port} <= ports, found
    assert {pid for pid, *_ in found} - {node.proc.pid}, f"no socket found in the scheduler rank: {found}"
    assert "mooncake" not in node.log_text().lower()


def test_mooncake_on_a_specific_host_is_refused_without_the_flag(no_ack):
    mooncake_or_skip()
    from transfer.mooncake import UnconfinedListener

    before = listening_here()
    with pytest.raises(UnconfinedListener) as e:
        create_engine("mooncake", "127.0.0.1", TransferSettings.from_env())
    msg = str(e.value)
    assert "--transfer-allow-wildcard-listen" in msg and "--transfer-backend nixl" in msg, msg
    assert "0.0.0.0:" in msg or "[::]:" in msg, msg
    assert "still open" not in msg, msg
    assert listening_here() <= before, "the refused engine left its listeners open"


def test_mooncake_acknowledged_starts_and_warns(no_ack, caplog):
    mooncake_or_skip()
    before = listening_here()
    with caplog.at_level(logging.WARNING, logger="transfer.mooncake"):
        engine = create_engine("mooncake", "127.0.0.1", TransferSettings.from_env(allow_wildcard_listen=True))
    try:
        opened = listening_here() - before
        # what Mooncake 0.3.13 does, and why the flag exists: if a release confines it, this goes red
        assert opened and all(wildcard(ip) for ip, _ in opened), opened
        assert set(engine.listeners) == opened
        warnings = [r.getMessage() for r in caplog.records if "listens on all interfaces" in r.getMessage()]
        assert len(warnings) == 1 and all(str(port) in warnings[0] for _, port in opened), warnings
    finally:
        engine.close()


def test_the_flag_and_a_wildcard_host_reach_the_engine(no_ack, monkeypatch):
    mooncake_or_skip()
    from transfer.mooncake import UnconfinedListener

    assert parse("--transfer-allow-wildcard-listen").transfer_allow_wildcard_listen is True
    assert node_settings(parse("--host", "127.0.0.1")).allow_wildcard_listen is False
    # asked for every interface
    assert node_settings(parse("--host", "0.0.0.0")).allow_wildcard_listen is True
    assert node_settings(parse("--host", "::")).allow_wildcard_listen is True
    monkeypatch.setenv(ACK_ENV, "1")
    assert node_settings(parse("--host", "127.0.0.1")).allow_wildcard_listen is True
    monkeypatch.setenv(ACK_ENV, "yes")
    with pytest.raises(ValueError, match=ACK_ENV):
        node_settings(parse())
    monkeypatch.delenv(ACK_ENV)

    flagged = parse("--host", "127.0.0.1", "--transfer-backend", "mooncake",
                    "--transfer-allow-wildcard-listen")
    create_engine(flagged.transfer_backend, flagged.host, node_settings(flagged)).close()
    plain = parse("--host", "127.0.0.1", "--transfer-backend", "mooncake")
    with pytest.raises(UnconfinedListener):
        create_engine(plain.transfer_backend, plain.host, node_settings(plain))
    with pytest.raises(UnconfinedListener):  # no settings: the environment's, which no longer acknowledge it
        create_engine("mooncake", "127.0.0.1")


def test_a_mooncake_node_on_a_specific_host_refuses_to_start(tiny_model_dir, launcher, no_ack):
    mooncake_or_skip()
    node = RoleNode("prefill", tiny_model_dir,
                    log_path=launcher.log_path("prefill-mooncake"), host="127.0.0.1",
                    disaggregation_bootstrap_port=free_port(), transfer_backend="mooncake", **NODE)
    with pytest.raises(RuntimeError, match="exited with code"):
        launcher.start(node)
    log = node.log_text()
    assert "UnconfinedListener" in log and "--transfer-allow-wildcard-listen" in log, node.log_tail()
    assert "--transfer-backend nixl" in log, node.log_tail()
