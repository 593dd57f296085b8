"""A lean HTTP/1.1 client for the generation legs and their aborts (router/legs.py): keep-alive connection
pools per worker, requests written in one syscall, responses (Content-Length, chunked or until close) parsed
incrementally; `https://` workers through an `ssl.SSLContext` (asyncio's TLS transport).

aiohttp's ClientSession costs several times more CPU per request; the legs are the router's hot path.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from urllib.parse import urlsplit

_CRLF2 = b"\r\n\r\n"


class UpstreamError(ConnectionError):
    """The connection to a worker failed or broke before the response was complete."""


class UpstreamTimeout(UpstreamError, TimeoutError):
    pass


class _Conn(asyncio.Protocol):
    __slots__ = ("pool", "transport", "closed", "resp")

    def __init__(self, pool: Pool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.resp: Response | None = None

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        resp = self.resp
        if resp is None:  # bytes nobody asked for: the connection is not reusable
            self.close()
            return
        resp._feed(data)

    def connection_lost(self, exc):
        self.closed = True
        resp = self.resp
        if resp is not None:
            resp._lost(exc)

    def close(self):
        self.closed = True
        self.pool.busy.discard(self)
        if self.transport is not None:
            self.transport.abort()


class Response:
    """Status and headers once awaited from `Pool.request`; then `read()` or repeated `readany()`."""

    __slots__ = ("conn", "status", "headers", "_buf", "_mode", "_left", "_chunks",
                 "_waiter", "_eof", "_error", "_head_waiter", "_timer", "_keep_alive")

    def __init__(self, conn: _Conn, loop: asyncio.AbstractEventLoop):
        self.conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._buf = b""
        # 0 head, 1 content-length, 2/3/6 chunked size line/data/trailer, 4 until close, 5 done
        self._mode = 0
        self._left = 0
        self._chunks: list[bytes] = []
        self._waiter: asyncio.Future | None = None
        self._eof = False
        self._error: BaseException | None = None
        self._head_waiter: asyncio.Future = loop.create_future()
        self._timer = None
        self._keep_alive = True

    # ------------------------------------------------------------------ parsing (protocol callbacks)

    def _feed(self, data: bytes) -> None:
        if self._mode == 0:
            data = self._buf + data
            i = data.find(_CRLF2)
            if i < 0:
                self._buf = data
                return
            lines = data[:i].split(b"\r\n")
            try:
                self.status = int(lines[0][9:12])
            except ValueError:
                self._fail(UpstreamError(f"bad status line {lines[0][:80]!r}"))
                return
            h = self.headers
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                h[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
            self._buf = b""
            if h.get("connection", "").lower() == "close":
                self._keep_alive = False
            if "chunked" in h.get("transfer-encoding", "").lower():
                self._mode = 2
            elif "content-length" in h:
                self._left = int(h["content-length"])
                self._mode = 1 if self._left else 5
            elif self.status in (204, 304) or self.status < 200:
                self._mode = 5
            else:
                self._mode, self._keep_alive = 4, False
            if not self._head_waiter.done():
                self._head_waiter.set_result(None)
            data = data[i + 4:]
            if self._mode == 5:
                self._finish()
                return
            if not data:
                return
        self._body(data)

    def _body(self, data: bytes) -> None:
        mode = self._mode
        if mode == 1:
            if len(data) >= self._left:
                self._push(data[:self._left])
                self._left = 0
                self._finish()
            else:
                self._left -= len(data)
                self._push(data)
            return
        if mode == 4:
            self._push(data)
            return
        data = self._buf + data if self._buf else data
        out = []
        while data:
            if self._mode == 2:
                j = data.find(b"\r\n")
                if j < 0:
                    break
                size_s = data[:j].split(b";", 1)[0].strip()
                if not size_s:  # the CRLF that ends a chunk's data
                    data = data[j + 2:]
                    continue
                try:
                    size = int(size_s, 16)
                except ValueError:
                    self._fail(UpstreamError("bad chunk size"))
                    return
                if size == 0:
                    self._mode = 6
                    data = data[j + 2:]
                    continue
                self._left = size
                self._mode = 3
                data = data[j + 2:]
            elif self._mode == 6:  # optional trailers, then the empty line that ends the body
                j = data.find(b"\r\n")
                if j < 0:
                    break
                data = data[j + 2:]
                if j == 0:
                    if out:
                        self._push(b"".join(out))
                    self._buf = b""
                    self._finish()
                    return
            else:
                take = data[:self._left]
                out.append(take)
                self._left -= len(take)
                data = data[len(take):]
                if self._left == 0:
                    self._mode = 2
        self._buf = data
        if out:
            self._push(b"".join(out))

    def _push(self, data: bytes) -> None:
        self._chunks.append(data)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _finish(self) -> None:
        self._mode = 5
        self._eof = True
        if self._timer is not None:
            self._timer.cancel()
        conn = self.conn
        conn.resp = None
        if self._keep_alive and not conn.closed:
            conn.pool._put(conn)
        else:
            conn.close()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._eof:
            return
        self._error = exc
        self._eof = True
        self.conn.resp = None
        self.conn.close()
        if self._timer is not None:
            self._timer.cancel()
        if not self._head_waiter.done():
            self._head_waiter.set_exception(exc)
            self._head_waiter.exception()  # mark retrieved: the caller may have gone
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _lost(self, exc) -> None:
        if self._mode == 4 and exc is None:  # body delimited by the connection's end
            self._mode = 5
            self._eof = True
            if self._timer is not None:
                self._timer.cancel()
            w = self._waiter
            if w is not None and not w.done():
                w.set_result(None)
            return
        self._fail(UpstreamError(f"connection lost: {exc!r}" if exc else "connection closed by the worker"))

    def _timeout(self) -> None:
        self._fail(UpstreamTimeout("request timed out"))

    # ------------------------------------------------------------------ reading (caller side)

    async def readany(self) -> bytes:
        """Next body bytes; b"" at the end; raises UpstreamError if the response broke."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunks = self._chunks
        if len(chunks) == 1:
            data = chunks[0]
        else:
            data = b"".join(chunks)
        chunks.clear()
        return data

    async def read(self) -> bytes:
        parts = []
        while True:
            data = await self.readany()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def close(self) -> None:
        """Give up on the response (the connection is dropped, the worker sees a disconnect)."""
        if not self._eof:
            self._fail(UpstreamError("closed by the router"))


class Pool:
    """Keep-alive connections to one worker."""

    def __init__(self, url: str, timeout: float, extra_headers: dict[str, str],
                 ssl_context: ssl.SSLContext | None = None, connect_timeout: float = 10.0):
        u = urlsplit(url)
        if u.scheme not in ("http", "https"):
            raise ValueError(f"the upstream client speaks http and https, not {u.scheme}")
        if u.scheme == "https" and ssl_context is None:
            raise ValueError(f"{url}: https needs an ssl context")
        self.ssl = ssl_context if u.scheme == "https" else None
        self.host = u.hostname or "localhost"
        self.port = u.port or (443 if self.ssl else 80)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        host_header = f"{u.hostname}:{self.port}" if ":" not in (u.hostname or "") \
            else f"[{u.hostname}]:{self.port}"
        extra = "".join(f"{k}: {v}\r\n" for k, v in extra_headers.items())
        self._head_tail = (f"Host: {host_header}\r\nContent-Type: application/json\r\n"
                           f"{extra}").encode("latin-1")
        self.idle: collections.deque[_Conn] = collections.deque()
        self.busy: set[_Conn] = set()  # connections carrying a request now
        self.closed = False

    def _put(self, conn: _Conn) -> None:
        self.busy.discard(conn)
        if self.closed:
            conn.close()
        else:
            self.idle.append(conn)

    async def _acquire(self) -> _Conn:
        idle = self.idle
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        if self.ssl is None:
            connect = loop.create_connection(lambda: _Conn(self), self.host, self.port)
        else:  # TLS: certificate and host name checked against the context's CAs
            connect = loop.create_connection(lambda: _Conn(self), self.host, self.port, ssl=self.ssl,
                                             server_hostname=self.host)
        try:  # a worker cut off the network drops the SYN: do not wait for the kernel's ~2 minutes
            _, conn = await asyncio.wait_for(connect, self.connect_timeout)
        except TimeoutError:
            raise OSError(f"no answer within {self.connect_timeout:g}s") from None
        return conn

    async def request(self, path: str, body: bytes, headers: bytes = b"",
                      timeout: float | None = None) -> Response:
        """POST `body` (JSON) to `path`; `headers` is extra raw header lines ending in CRLF; the whole
        exchange is bounded by `timeout` (the pool's own when None)."""
        try:
            conn = await self._acquire()
        except OSError as e:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port}: {e}") from None
        loop = asyncio.get_running_loop()
        resp = Response(conn, loop)
        conn.resp = resp
        self.busy.add(conn)
        resp._timer = loop.call_later(self.timeout if timeout is None else timeout, resp._timeout)
        conn.transport.write(b"".join((b"POST ", path.encode(), b" HTTP/1.1\r\n", self._head_tail, headers,
                                       b"Content-Length: ", str(len(body)).encode(), b"\r\n\r\n", body)))
        try:
            await resp._head_waiter
        except BaseException:
            resp.close()
            raise
        return resp

    def abort_all(self) -> int:
        """Break every connection, those carrying a request included (their readers get an
        UpstreamError at once): the worker stopped answering; returns how many requests were cut."""
        busy = list(self.busy)
        for conn in busy:
            conn.close()
        while self.idle:
            self.idle.pop().close()
        return len(busy)

    def close(self) -> None:
        self.closed = True
        while self.idle:
            self.idle.pop().close()
