"""The cluster secret and the authenticator (`common/cluster_secret.py`, `transfer/auth.py`): what a
verifier accepts and refuses, that its memory stays bounded, and how the secret file is read by the
nodes and the router."""

from __future__ import annotations

import logging
import pickle

import pytest

from common.cluster_secret import ClusterSecret, ClusterSecretError, load_secret
from transfer.auth import CONTROL, HEADER_BYTES, Authenticator, AuthError

SECRET = ClusterSecret([b"s" * 32])
OTHER = ClusterSecret([b"o" * 32])
CTX = CONTROL + b"tcp://127.0.0.1:5000\0"


class Clock:
    """Wall clock in microseconds that the test moves."""

    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.us = int(t * 1e6)

    def __call__(self) -> int:
        return self.us

    def advance(self, seconds: float) -> None:
        self.us += int(seconds * 1e6)


def pair(window: float = 30.0, max_nonces: int = 100_000, secret: ClusterSecret = SECRET):
    """(signer, verifier, the verifier's clock); the signer shares the clock."""
    clock = Clock()
    return Authenticator(secret, window,
                         clock=clock), Authenticator(SECRET, window, max_nonces, clock=clock), clock


def kind(fn) -> str | None:
    try:
        fn()
    except AuthError as e:
        return e.kind
    return None


def test_a_good_message_opens_once():
    signer, verifier, _ = pair()
    frame = signer.seal(CTX, b"hello")
    assert len(frame) == HEADER_BYTES + 5
    assert verifier.open(CTX, frame) == b"hello"


@pytest.mark.parametrize("where", [0, 5, 13, 30, HEADER_BYTES, HEADER_BYTES + 2])
def test_any_tampered_byte_is_refused(where):
    signer, verifier, _ = pair()
    frame = bytearray(signer.seal(CTX, b"hello"))
    frame[where] ^= 0x01
    assert kind(lambda: verifier.open(CTX, bytes(frame))) == "unauthenticated"


def test_wrong_secret_other_receiver_and_bare_frames_are_refused():
    signer, verifier, _ = pair(secret=OTHER)
    assert kind(lambda: verifier.open(CTX, signer.seal(CTX, b"x"))) == "unauthenticated"
    good, verifier, _ = pair()
    # a MAC made for another receiver (or another plane) is worthless here
    assert kind(lambda: verifier.open(CTX, good.seal(CONTROL + b"tcp://127.0.0.1:5001\0", b"x"))) \
        == "unauthenticated"
    assert kind(lambda: verifier.open(CTX, b"\x81\xa3src\xa1x")) == "unauthenticated"  # bare msgpack
    assert kind(lambda: verifier.open(CTX, b"")) == "unauthenticated"


def test_stale_and_future_timestamps_are_refused():
    signer, verifier, clock = pair(window=30.0)
    old = signer.seal(CTX, b"x")
    clock.advance(31)
    assert kind(lambda: verifier.open(CTX, old)) == "stale"
    clock.advance(-62)  # the verifier's clock is now 31 s behind the signer's
    assert kind(lambda: verifier.open(CTX, old)) == "stale"
    clock.advance(2)  # 29 s behind: within the window
    assert verifier.open(CTX, old) == b"x"


def test_replay_within_the_window_is_refused_and_after_it_is_stale():
    signer, verifier, clock = pair(window=30.0)
    frame = signer.seal(CTX, b"x")
    assert verifier.open(CTX, frame) == b"x"
    assert kind(lambda: verifier.open(CTX, frame)) == "replayed"
    clock.advance(29)
    assert kind(lambda: verifier.open(CTX, frame)) == "replayed"
    clock.advance(2)  # its nonce is forgotten now, and the frame is refused as stale
    assert kind(lambda: verifier.open(CTX, frame)) == "stale"
    assert verifier.nonces_held == 0


def test_nonces_are_forgotten_as_they_leave_the_window():
    signer, verifier, clock = pair(window=1.0)
    for _ in range(20):
        for _ in range(500):
            verifier.open(CTX, signer.seal(CTX, b"x"))
        clock.advance(0.5)
    assert verifier.nonces_held <= 1500  # the batches of the last window (3 at most), not 10,000


def test_a_full_nonce_store_evicts_the_oldest_and_refuses_what_it_forgot():
    signer, verifier, clock = pair(window=30.0, max_nonces=100)
    frames = []
    for _ in range(1000):
        frames.append(signer.seal(CTX, b"x"))
        clock.advance(0.001)
        verifier.open(CTX, frames[-1])
    assert verifier.nonces_held == 100
    # every frame is refused again: the remembered ones as replays, the evicted ones as stale
    kinds = {kind(lambda f=f: verifier.open(CTX, f)) for f in frames}
    assert kinds == {"replayed", "stale"}
    assert verifier.open(CTX, signer.seal(CTX, b"new")) == b"new"  # fresh messages still pass


def test_rotation_two_secrets_verify_the_first_signs():
    rotating = ClusterSecret([b"n" * 32, b"s" * 32])  # new first, old second
    clock = Clock()
    old_node, new_node = Authenticator(SECRET, clock=clock), Authenticator(rotating, clock=clock)
    assert new_node.open(CTX, old_node.seal(CTX, b"a")) == b"a"  # old signer, rotating verifier
    assert kind(lambda: old_node.open(CTX, new_node.seal(CTX, b"b"))) == "unauthenticated"  # old verifier
    half = Authenticator(ClusterSecret([b"s" * 32, b"n" * 32]), clock=clock)  # step 1: still signs with old
    assert old_node.open(CTX, half.seal(CTX, b"c")) == b"c"
    assert half.open(CTX, new_node.seal(CTX, b"d")) == b"d"


def test_http_request_and_answer_are_bound_together():
    clock = Clock()
    client, server = Authenticator(SECRET, clock=clock), Authenticator(SECRET, clock=clock)
    header, nonce = client.request_header("PUT", "/route", b'{"a": 1}')
    assert server.check_request("PUT", "/route", b'{"a": 1}', header) == nonce
    assert kind(lambda: server.check_request("PUT", "/route", b'{"a": 1}', header)) == "replayed"
    for method, target, body in (("GET", "/route", b'{"a": 1}'), ("PUT", "/route?x=1", b'{"a": 1}'),
                                 ("PUT", "/route", b'{"a": 2}')):
        h, _ = client.request_header("PUT", "/route", b'{"a": 1}')
        assert kind(lambda m=method, t=target, b=body, hh=h: server.check_request(m, t, b, hh)) \
            == "unauthenticated"
    assert kind(lambda: server.check_request("GET", "/route", b"", None)) == "unauthenticated"
    assert kind(lambda: server.check_request("GET", "/route", b"", "v1 ts=x nonce=zz mac=")) \
        == "unauthenticated"
    answer = server.response_header(nonce, 200, b"OK")
    client.check_response(nonce, 200, b"OK", answer)
    other_header, other_nonce = client.request_header("GET", "/route", b"")
    for args in ((other_nonce, 200, b"OK"), (nonce, 404, b"OK"), (nonce, 200, b"KO")):
        assert kind(lambda a=args: client.check_response(*a, answer)) == "unauthenticated"
    assert kind(lambda: client.check_response(nonce, 200, b"OK", None)) == "unauthenticated"


# ---------------------------------------------------------------------------------------------- the file
def test_secret_file_is_stripped_and_never_shown(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"  0123456789abcdef0123  \n\n")
    secret = load_secret(str(path))
    assert secret.keys == (b"0123456789abcdef0123",)
    assert "0123456789abcdef" not in repr(secret) and "0123456789abcdef" not in str(secret)
    assert pickle.loads(pickle.dumps(secret)) == secret  # the node's args carry it to the scheduler ranks


@pytest.mark.parametrize("content,match", [(b"", "is empty"), (b" \n\t\n", "is empty"),
                                           (b"short-secret", "at least 16"),
                                           (b"a" * 20 + b"\n" + b"b" * 20 + b"\n" + b"c" * 20, "at most 2")])
def test_bad_secret_files_are_refused_without_showing_them(tmp_path, content, match):
    path = tmp_path / "secret"
    path.write_bytes(content)
    with pytest.raises(ClusterSecretError, match=match) as err:
        load_secret(str(path))
    assert str(path) in str(err.value) and "short-secret" not in str(err.value)
    with pytest.raises(ClusterSecretError, match="cannot read"):
        load_secret(str(tmp_path / "missing"))


def test_node_and_router_flags_read_the_secret_once(tmp_path, monkeypatch, caplog):
    from common.config import ConfigError, ServerArgs
    from router.cli import build_parser, config_from_args

    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET_FILE", raising=False)
    good, short = tmp_path / "good", tmp_path / "short"
    good.write_text("0123456789abcdef0123456789abcdef\n")
    short.write_text("tooshort\n")
    args = ServerArgs(disaggregation_mode="prefill", cluster_secret_file=str(good))
    args.validate()
    assert args.cluster_secret.keys == (b"0123456789abcdef0123456789abcdef",)
    assert "0123456789abcdef" not in repr(args)
    assert pickle.loads(pickle.dumps(args)).cluster_secret == args.cluster_secret
    with pytest.raises(ConfigError, match="--cluster-secret-file: .*at least 16"):
        ServerArgs(cluster_secret_file=str(short)).validate()
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET_FILE", str(good))  # the environment, when no flag is given
    env_args = ServerArgs(disaggregation_mode="decode")
    env_args.validate()
    assert env_args.cluster_secret == args.cluster_secret
    cfg = config_from_args(build_parser().parse_args(["--cluster-secret-file", str(good)]))
    assert cfg.cluster_secret == args.cluster_secret and "0123456789abcdef" not in repr(cfg)
    with pytest.raises(ValueError, match="at least 16"):
        config_from_args(build_parser().parse_args(["--cluster-secret-file", str(short)]))


def test_one_warning_per_process_without_a_secret(monkeypatch, caplog):
    import common.cluster_secret as cs
    from common.config import ServerArgs
    from transfer.bootstrap import BootstrapServer

    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET_FILE", raising=False)
    monkeypatch.setattr(cs, "_warned", False)
    with caplog.at_level(logging.WARNING):
        ServerArgs(disaggregation_mode="prefill").validate()
        ServerArgs(disaggregation_mode="decode").validate()
        BootstrapServer("127.0.0.1", 0)
    warnings = [r for r in caplog.records if "no cluster secret" in r.getMessage()]
    assert len(warnings) == 1
