"""Authentication of the cluster's own planes: HMAC-SHA256 with a timestamp and a random nonce.

Every authenticated message carries `ts` (sender's wall clock, integer microseconds since the
epoch), a 16-byte random `nonce` and `mac` = HMAC-SHA256(secret, context || ts (8 bytes, big
endian) || nonce || message). `context` names the plane (and, on the control plane, the receiving
address), so a MAC made for one plane or one receiver is worthless on another.

The verifier (`Authenticator.verify`) checks, in this order:
1. the MAC, against every key of the `ClusterSecret` (the current one and, during a rotation, the
   previous one), with `hmac.compare_digest`;
2. the timestamp: more than `window` seconds in the past or the future is refused (`stale`);
3. the nonce: one seen before within the window is refused (`replayed`).
Only a message whose MAC is good reaches the nonce store, so forgeries cannot fill it. Nonces are
kept until their timestamp leaves the window (a replay after that is refused as stale), and at most
`max_nonces` of them: when full, the oldest is evicted and its timestamp becomes a floor below which
every message is refused as stale, so an evicted nonce can never be replayed either.

Wire formats built on this:
* control plane (`transfer/control.py`): `seal()` / `open()`, a frame of
  MAGIC "PDA1" | ts 8 B | nonce 16 B | mac 32 B | msgpack body, context CONTROL + receiver address.
* bootstrap HTTP (`transfer/bootstrap.py`): `request_header()` / `check_request()`, header
  `X-PDServe-Auth: v1 ts=<int> nonce=<32 hex> mac=<64 hex>` over METHOD "\\n" request-target (path and
  query as sent) "\\n" body; the answer carries `X-PDServe-Auth: v1 mac=<64 hex>` over the request's
  nonce, the status and the body (`response_header()` / `check_response()`).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import os
import threading
import time

from common.cluster_secret import ClusterSecret

MAGIC = b"PDA1"
NONCE_BYTES = 16
MAC_BYTES = 32
HEADER_BYTES = len(MAGIC) + 8 + NONCE_BYTES + MAC_BYTES  # 60
HTTP_HEADER = "X-PDServe-Auth"

CONTROL = b"pdserve/control/v1\0"
BOOTSTRAP_REQUEST = b"pdserve/bootstrap-request/v1\0"
BOOTSTRAP_RESPONSE = b"pdserve/bootstrap-response/v1\0"

DEFAULT_WINDOW = 30.0
DEFAULT_MAX_NONCES = 100_000  # ~20 MB at most; see the module docstring for what happens when full


class AuthError(Exception):
    """A message failed verification; `kind` is "unauthenticated", "stale" or "replayed"."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


def _now_us() -> int:
    return time.time_ns() // 1000


class Authenticator:
    """Signs and verifies with one cluster secret; one nonce store per instance (per receiver)."""

    def __init__(self, secret: ClusterSecret, window: float = DEFAULT_WINDOW,
                 max_nonces: int = DEFAULT_MAX_NONCES, clock=_now_us) -> None:
        if not isinstance(secret, ClusterSecret):
            raise TypeError("Authenticator needs a ClusterSecret")
        if window <= 0 or max_nonces < 1:
            raise ValueError("the authentication window must be > 0 s and max_nonces >= 1")
        self._keys = secret.keys
        self.window_us = int(window * 1e6)
        self.max_nonces = max_nonces
        self._clock = clock
        self._seen: set[bytes] = set()
        self._expiry: list[tuple[int, bytes]] = []  # min-heap of (ts, nonce) for the seen nonces
        self._floor = -1  # messages with ts <= floor are refused (their nonces may have been evicted)
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- core
    def _mac(self, key: bytes, context: bytes, ts: int, nonce: bytes, message: bytes) -> bytes:
        h = hmac.new(key, context, hashlib.sha256)
        h.update(ts.to_bytes(8, "big"))
        h.update(nonce)
        h.update(message)
        return h.digest()

    def sign(self, context: bytes, message: bytes) -> tuple[int, bytes, bytes]:
        """(ts, nonce, mac) for `message` in `context`, signed with the current secret."""
        ts, nonce = self._clock(), os.urandom(NONCE_BYTES)
        return ts, nonce, self._mac(self._keys[0], context, ts, nonce, message)

    def verify(self, context: bytes, message: bytes, ts: int, nonce: bytes, mac: bytes) -> None:
        """Raise `AuthError` unless the MAC is good, `ts` within the window and `nonce` new."""
        if len(nonce) != NONCE_BYTES or len(mac) != MAC_BYTES or not 0 <= ts < 2**64:
            raise AuthError("unauthenticated", "malformed authenticator")
        good = False
        for key in self._keys:  # every key is tried, so the time taken does not say which one matched
            good |= hmac.compare_digest(self._mac(key, context, ts, nonce, message), mac)
        if not good:
            raise AuthError("unauthenticated", "bad MAC")
        now = self._clock()
        with self._lock:
            self._evict(now)
            if now - ts > self.window_us:
                raise AuthError("stale", f"timestamp {(now - ts) / 1e6:.1f}s old")
            if ts - now > self.window_us:
                raise AuthError("stale", f"timestamp {(ts - now) / 1e6:.1f}s in the future")
            if ts <= self._floor:
                raise AuthError("stale", "older than the oldest remembered nonce (nonce store full)")
            if nonce in self._seen:
                raise AuthError("replayed", "nonce seen before")
            self._seen.add(nonce)
            heapq.heappush(self._expiry, (ts, nonce))
            while len(self._seen) > self.max_nonces:
                old_ts, old = heapq.heappop(self._expiry)
                self._seen.discard(old)
                self._floor = max(self._floor, old_ts)

    def _evict(self, now: int) -> None:
        """Under the lock: forget nonces whose timestamp left the window (they are refused as stale)."""
        horizon = now - self.window_us
        while self._expiry and self._expiry[0][0] < horizon:
            self._seen.discard(heapq.heappop(self._expiry)[1])

    @property
    def nonces_held(self) -> int:
        return len(self._seen)

    # ---------------------------------------------------------------- control-plane frames
    def seal(self, context: bytes, body: bytes) -> bytes:
        """A frame carrying `body` and its authenticator."""
        ts, nonce, mac = self.sign(context, body)
        return b"".join((MAGIC, ts.to_bytes(8, "big"), nonce, mac, body))

    def open(self, context: bytes, frame: bytes) -> bytes:
        """The body of a sealed frame; raises `AuthError` (the body is not looked at otherwise)."""
        if len(frame) < HEADER_BYTES or frame[:4] != MAGIC:
            raise AuthError("unauthenticated", "no authenticator")
        view = memoryview(frame)
        ts = int.from_bytes(view[4:12], "big")
        nonce, mac = bytes(view[12:28]), bytes(view[28:60])
        body = bytes(view[HEADER_BYTES:])
        self.verify(context, body, ts, nonce, mac)
        return body

    # ---------------------------------------------------------------- bootstrap HTTP
    @staticmethod
    def _request_bytes(method: str, target: str, body: bytes) -> bytes:
        return b"\n".join((method.upper().encode(), target.encode("utf-8", "surrogateescape"), body))

    def request_header(self, method: str, target: str, body: bytes) -> tuple[str, bytes]:
        """(header value, nonce) for a request to `target` (path and query, as sent)."""
        ts, nonce, mac = self.sign(BOOTSTRAP_REQUEST, self._request_bytes(method, target, body))
        return f"v1 ts={ts} nonce={nonce.hex()} mac={mac.hex()}", nonce

    def check_request(self, method: str, target: str, body: bytes, header: str | None) -> bytes:
        """Verify a request's header; returns its nonce (the answer is bound to it)."""
        fields = _parse_header(header)
        try:
            ts, nonce, mac = int(fields["ts"]), bytes.fromhex(fields["nonce"]), bytes.fromhex(fields["mac"])
        except (KeyError, ValueError):
            raise AuthError("unauthenticated", "missing or malformed authenticator header") from None
        self.verify(BOOTSTRAP_REQUEST, self._request_bytes(method, target, body), ts, nonce, mac)
        return nonce

    def _response_mac(self, key: bytes, nonce: bytes, status: int, body: bytes) -> bytes:
        h = hmac.new(key, BOOTSTRAP_RESPONSE, hashlib.sha256)
        h.update(nonce)
        h.update(status.to_bytes(2, "big"))
        h.update(body)
        return h.digest()

    def response_header(self, request_nonce: bytes, status: int, body: bytes) -> str:
        return f"v1 mac={self._response_mac(self._keys[0], request_nonce, status, body).hex()}"

    def check_response(self, request_nonce: bytes, status: int, body: bytes, header: str | None) -> None:
        """Raise `AuthError` unless the answer was made by a secret holder for this very request."""
        try:
            mac = bytes.fromhex(_parse_header(header)["mac"])
        except (KeyError, ValueError):
            raise AuthError("unauthenticated", "answer without a valid authenticator header") from None
        good = False
        for key in self._keys:
            good |= hmac.compare_digest(self._response_mac(key, request_nonce, status, body), mac)
        if not good:
            raise AuthError("unauthenticated", "bad MAC on the answer")


def _parse_header(header: str | None) -> dict[str, str]:
    if not header or len(header) > 512:
        return {}
    parts = header.split()
    if not parts or parts[0] != "v1":
        return {}
    return dict(p.split("=", 1) for p in parts[1:] if "=" in p)


class DropCounters:
    """Messages a plane dropped, by cause, with a warning at most every `LOG_EVERY` seconds per cause
    (a flood of forgeries must not flood the log too)."""

    KINDS = ("unauthenticated", "stale_or_replayed", "oversized", "undecodable")
    LOG_EVERY = 10.0

    def __init__(self, plane: str, logger) -> None:
        self.plane = plane
        self._logger = logger
        self.counts = dict.fromkeys(self.KINDS, 0)
        self._logged_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def drop(self, kind: str, detail: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[kind] += 1
            n = self.counts[kind]
            last = self._logged_at.get(kind)
            log = last is None or now - last >= self.LOG_EVERY
            if log:
                self._logged_at[kind] = now
        if log:
            self._logger.warning("%s: dropped a message (%s: %s); %d dropped for this "
                                 "cause so far", self.plane, kind, detail[:200], n)

    def drop_auth(self, err: AuthError) -> None:
        self.drop("unauthenticated" if err.kind == "unauthenticated" else "stale_or_replayed", str(err))

    def as_stats(self, prefix: str) -> dict[str, int]:
        with self._lock:
            return {f"{prefix}dropped_{k}": v for k, v in self.counts.items()}
