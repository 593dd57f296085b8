"""Workers: registration (wait for /health, read /server_info and /model_info), periodic health
checks with failure/success thresholds, a circuit breaker per worker, and load polling.

Compatible pairs only. A node's `/server_info` carries its `compatibility` (common/fingerprint.py: its
weights digest, dtypes, KV layout and page size, heads and layers, parallel shape, transfer backend and
protocol). A worker is registered only when it can pair with every registered worker of the other kind
and shares the pairing fields of its own kind's (one consistent pool); otherwise it is refused with a
409 naming the first difference, logged once as an error and listed with its reason under `refused` on
`/workers` (a start-up worker is not retried). A worker that advertises none (an older node) is
registered with a warning and compared with no one."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import ipaddress
import logging
import time
from urllib.parse import urlsplit

import aiohttp
import msgspec

from common.fingerprint import Compatibility, mismatch, pair_problem, pairing_key, parse
from common.protocol import BadRequest, normalize_host
from common.server.data_parallel import DPGroups
from common.server.security import bearer_header
from router.config import RouterConfig

log = logging.getLogger("router.registry")

PREFILL, DECODE = "prefill", "decode"
MAX_REFUSED = 256  # refused workers remembered for /workers (the oldest forgotten first)


class CircuitBreaker:
    """closed -> open after `failure_threshold` failures inside the window; open -> half_open after
    `timeout`; half_open -> closed after `success_threshold` successes, back to open on a failure."""

    __slots__ = ("failure_threshold", "success_threshold", "timeout", "window", "state", "failures",
                 "half_open_successes", "opened_at", "enabled")

    def __init__(self, cfg: RouterConfig):
        self.enabled = not cfg.disable_circuit_breaker
        self.failure_threshold = max(1, cfg.cb_failure_threshold)
        self.success_threshold = max(1, cfg.cb_success_threshold)
        self.timeout = cfg.cb_timeout_duration_secs
        self.window = cfg.cb_window_duration_secs
        self.state = "closed"
        self.failures: collections.deque[float] = collections.deque()
        self.half_open_successes = 0
        self.opened_at = 0.0

    def allow(self) -> bool:
        if self.state == "closed" or not self.enabled:
            return True
        if self.state == "open":
            if time.monotonic() - self.opened_at < self.timeout:
                return False
            self.state, self.half_open_successes = "half_open", 0
        return True

    def record(self, ok: bool) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if ok:
            if self.state == "half_open":
                self.half_open_successes += 1
                if self.half_open_successes >= self.success_threshold:
                    self.state = "closed"
                    self.failures.clear()
            elif self.failures and self.state == "closed":
                self.failures.clear()  # failures must be consecutive, like sglang-router's
            return
        if self.state == "half_open":
            self._open(now)
            return
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.window:
            self.failures.popleft()
        if len(self.failures) >= self.failure_threshold:
            self._open(now)

    def recovered(self) -> None:
        """The worker passed its health checks again after failing them (a restarted node): an open breaker
        goes half-open at once instead of waiting out its timeout, so traffic finds the node again."""
        if self.state == "open":
            self.state, self.half_open_successes = "half_open", 0

    def _open(self, now: float) -> None:
        self.state, self.opened_at = "open", now
        self.failures.clear()
        log.warning("circuit breaker opened")


def bootstrap_host_of(url: str) -> str:
    host = urlsplit(url).hostname or "localhost"
    try:
        if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address):
            return f"[{host}]"
    except ValueError:
        pass
    return host


def check_worker_url(url: str, what: str = "`url`") -> str:
    """A worker URL is http(s)://HOST[:PORT] with HOST a bootstrap-valid host (the router injects it as
    `bootstrap_host`); raises ValueError naming `what` otherwise."""
    try:
        u = urlsplit(url)
        port = u.port
    except ValueError:
        u, port = None, None
    ok = (u is not None and u.scheme in ("http", "https") and u.hostname and not u.username
          and not u.password and u.path in ("", "/") and not u.query and not u.fragment and port != 0)
    if ok:
        try:
            normalize_host(u.hostname, what)
        except BadRequest:
            ok = False
    if not ok:
        shown = url if len(url) <= 80 else url[:80] + "..."
        raise ValueError(f"{what} must be http://HOST[:PORT] or https://HOST[:PORT] with HOST a host name or "
                         f"an IP address (no path, query or user), got {shown!r}")
    return url


def worker_id(url: str) -> str:
    return hashlib.sha1(url.encode()).hexdigest()[:12]


MAX_DP_SIZE = 1024  # the largest dp_size a worker may report (as `data_parallel_rank` is bounded)


class Worker:
    __slots__ = ("id", "url", "kind", "bootstrap_host", "bootstrap_port", "healthy", "breaker", "active",
                 "load", "server_info", "model_info", "fail_streak", "ok_streak",
                 "requests", "errors", "dp_groups",
                 "local_pending", "local_prefills", "local_refused", "compatibility", "draining")

    def __init__(self, url: str, kind: str, bootstrap_port: int | None, cfg: RouterConfig):
        self.id = worker_id(url)
        self.url = url
        self.kind = kind
        self.bootstrap_host = bootstrap_host_of(url)
        self.bootstrap_port = bootstrap_port
        self.healthy = True
        self.breaker = CircuitBreaker(cfg)
        self.active = 0  # requests in flight through this router
        self.load: int | None = None  # tokens from the worker's /get_load (power_of_two)
        self.server_info: dict = {}
        self.model_info: dict = {}
        self.fail_streak = 0
        self.ok_streak = 0
        self.requests = 0
        self.errors = 0
        self.dp_groups = DPGroups(1)  # --dp-aware: this router's requests in flight per DP group
        self.local_pending = 0  # --local-prefill-queue: requests it prefills itself, before their first byte
        self.local_prefills = 0  # and all it was sent so far
        self.local_refused = 0  # of those, the ones it refused as too long (sent again with both legs)
        self.compatibility: Compatibility | None = None  # what it advertised at registration (None: nothing)
        self.draining = False  # being switched to the other role (router/role_switch.py): no new requests

    @property
    def prefills_locally(self) -> bool:
        """A decode worker started with --disaggregation-local-prefill (its /server_info says so)."""
        return self.server_info.get("disaggregation_local_prefill") is True

    @property
    def available(self) -> bool:
        return not self.draining and self.healthy and self.breaker.allow()

    @property
    def dp_size(self) -> int:
        """The worker's DP groups (its /server_info `dp_size`; 1 when it names none or a value out of
        range)."""
        n = self.server_info.get("dp_size", 1)
        return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_DP_SIZE else 1

    def dp_start(self, rank: int | None, allowed: list[int] | None = None) -> int:
        """--dp-aware: the DP group a request goes to (`rank` when the client named one, else the group of
        `allowed` (default: all) with the fewest of this router's requests in flight, ties in turn),
        counted until `dp_end`."""
        if self.dp_groups.size != self.dp_size:  # first use, or the worker restarted with another dp_size
            self.dp_groups = DPGroups(self.dp_size)
        rank = self.dp_groups.choose(rank, allowed)
        self.dp_groups.started(rank)
        return rank

    def dp_end(self, rank: int) -> None:
        if rank < self.dp_groups.size:
            self.dp_groups.ended(rank)

    def describe(self) -> dict:
        return {"id": self.id, "url": self.url, "worker_type": self.kind,
                "bootstrap_port": self.bootstrap_port,
                "bootstrap_host": self.bootstrap_host, "is_healthy": self.healthy,
                "circuit_breaker": self.breaker.state, "active_requests": self.active, "load": self.load,
                "requests": self.requests, "errors": self.errors, "local_prefill": self.prefills_locally,
                "local_prefills": self.local_prefills, "local_prefills_refused": self.local_refused,
                "model_path": self.model_info.get("model_path") or self.server_info.get("model_path"),
                "disaggregation_mode": self.server_info.get("disaggregation_mode"), "dp_size": self.dp_size,
                "draining": self.draining,
                "fingerprint": pairing_key(self.compatibility) if self.compatibility is not None else None,
                **({"dp_active_requests": list(self.dp_groups.live)} if self.dp_groups.size > 1 else {})}


class RegistryError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Refused(RegistryError):
    """A worker whose compatibility cannot pair with the pool (already logged and listed as refused)."""


def parse_load(data) -> int | None:
    """sglang-router's reading of `GET /get_load`: a JSON list, one object per dp rank; the load is the
    sum of `num_tokens`. Also accepted: one such object, or `{"load": N}`."""
    if isinstance(data, list):
        return sum(int(e.get("num_tokens", 0)) for e in data if isinstance(e, dict))
    if isinstance(data, dict):
        for key in ("num_tokens", "load"):
            if isinstance(data.get(key), int | float):
                return int(data[key])
    return None


class Registry:
    def __init__(self, cfg: RouterConfig, session: aiohttp.ClientSession, on_change=None):
        self.cfg = cfg
        self.session = session
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self.pending: set[str] = set()
        self.on_change = on_change or (lambda: None)
        # async on_admit(worker): a prefill worker was registered, or came back healthy with its
        # /server_info read again (--kv-events subscribes to what it names)
        self.on_admit = None
        self.on_unhealthy = None  # on_unhealthy(worker): it just failed its health checks
        self.refused: dict[str, dict] = {}  # url -> what /workers shows of a worker refused as incompatible
        self.auth = bearer_header(cfg.resolved_keys.outgoing())  # the node key (health, info, load polls)
        self._tasks: list[asyncio.Task] = []

    # ---------------------------------------------------------------------------- lookup

    def all(self) -> list[Worker]:
        return self.prefill + self.decode

    def find(self, key: str) -> Worker | None:
        key = key.rstrip("/")
        for w in self.all():
            if w.id == key or w.url == key:
                return w
        return None

    def ready(self) -> bool:
        return any(w.available for w in self.prefill) and any(w.available for w in self.decode)

    # ---------------------------------------------------------------------------- registration

    async def _get_json(self, url: str, timeout: float):
        async with self.session.get(url, headers=self.auth,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                raise RegistryError(r.status, f"GET {url} -> {r.status}")
            return msgspec.json.decode(await r.read())

    async def _probe(self, url: str) -> bool:
        try:
            async with self.session.get(url + self.cfg.health_check_endpoint, headers=self.auth,
                                        timeout=aiohttp.ClientTimeout(
                                            total=self.cfg.health_check_timeout_secs)) as r:
                await r.read()
                return r.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def wait_healthy(self, url: str) -> None:
        deadline = time.monotonic() + self.cfg.worker_startup_timeout_secs
        interval = max(0.05, min(self.cfg.worker_startup_check_interval, 1.0))
        while not await self._probe(url):
            if time.monotonic() > deadline:
                raise RegistryError(503, f"worker {url} did not become healthy within "
                                         f"{self.cfg.worker_startup_timeout_secs:g}s")
            await asyncio.sleep(interval)
            interval = min(interval * 2, max(self.cfg.worker_startup_check_interval, 0.05))

    async def _info(self, url: str, name: str) -> dict:
        for path in (f"/{name}", f"/get_{name}"):
            try:
                data = await self._get_json(url + path, self.cfg.health_check_timeout_secs)
                return data if isinstance(data, dict) else {}
            except RegistryError as e:
                if e.status in (401, 403):
                    log.error("worker %s refused the router's credentials on %s (%d): check the node key",
                              url, path, e.status)
                    return {}
            except (TimeoutError, aiohttp.ClientError, OSError, msgspec.DecodeError):
                continue
        return {}

    async def add(self, url: str, kind: str, bootstrap_port: int | None = None,
                  explicit_none: bool = False) -> Worker:
        url = url.rstrip("/")
        if kind not in (PREFILL, DECODE):
            raise RegistryError(400, f"`worker_type` must be 'prefill' or 'decode', got {kind!r}")
        try:
            check_worker_url(url)
        except ValueError as e:
            raise RegistryError(400, str(e)) from None
        if self.find(url) or url in self.pending:
            raise RegistryError(409, f"worker {url} is already registered")
        self.pending.add(url)
        try:
            await self.wait_healthy(url)
            server_info, model_info = await asyncio.gather(self._info(url, "server_info"),
                                                           self._info(url, "model_info"))
            if self.find(url):
                raise RegistryError(409, f"worker {url} is already registered")
        finally:
            self.pending.discard(url)
        compatibility = self._check_compatibility(url, kind, server_info)  # no await from here to the append
        mode = server_info.get("disaggregation_mode")
        if mode not in (None, "null", kind):
            log.warning("worker %s registered as %s but reports disaggregation_mode=%s", url, kind, mode)
        if kind == PREFILL and bootstrap_port is None and not explicit_none:
            port = server_info.get("disaggregation_bootstrap_port")
            bootstrap_port = int(port) if isinstance(port, int) else None
        w = Worker(url, kind, bootstrap_port if kind == PREFILL else None, self.cfg)
        w.server_info, w.model_info, w.compatibility = server_info, model_info, compatibility
        self.refused.pop(url, None)
        if kind == PREFILL:
            self.prefill = self.prefill + [w]
        else:
            self.decode = self.decode + [w]
        log.info("registered %s worker %s (id %s, bootstrap_port %s, model %s)", kind, url, w.id,
                 w.bootstrap_port, model_info.get("model_path") or server_info.get("model_path"))
        self.on_change()
        await self._admitted(w)
        return w

    def _check_compatibility(self, url: str, kind: str, server_info: dict) -> Compatibility | None:
        """The worker's compatibility when it can join the pool (None: it advertises none); raises
        `Refused` (409, or 502 for a compatibility that does not parse) naming the difference."""
        if server_info.get("compatibility") is None:
            log.warning("%s worker %s advertises no compatibility fingerprint (an older node?): registered "
                        "without the pairing check", kind, url)
            return None
        try:
            mine = parse(server_info["compatibility"])
        except ValueError as e:
            raise self._refusal(url, kind, 502, f"{kind} worker {url}: its /server_info {e}") from None
        problem = self.pool_problem(url, kind, mine)
        if problem:
            raise self._refusal(url, kind, 409, problem)
        return mine

    def pool_problem(self, url: str, kind: str, mine: Compatibility) -> str | None:
        """Why a `kind` worker at `url` with `mine` cannot join the pool (None: it can): the first registered
        worker of the other kind it cannot pair with, else the first of its own kind it differs from."""
        others = [w for w in self.all() if w.compatibility is not None and w.url != url]
        for w in sorted(others, key=lambda w: w.kind == kind):  # the other kind first
            if w.kind != kind:
                prefill, decode = (mine, w.compatibility) if kind == PREFILL else (w.compatibility, mine)
                problem = pair_problem(prefill, decode)
                if problem:
                    return f"{kind} worker {url} cannot pair with {w.kind} worker {w.url}: {problem}"
            else:
                problem = mismatch(w.compatibility, mine, (f"{kind} {w.url}", f"{kind} {url}"))
                if problem:
                    return f"{kind} worker {url} differs from the pool's {kind} worker {w.url}: {problem}"
        return None

    def _refusal(self, url: str, kind: str, status: int, reason: str) -> Refused:
        """Log a refused worker once and keep it for /workers; the `Refused` to raise."""
        log.error("refused %s worker %s: %s", kind, url, reason)
        self.refused.pop(url, None)
        self.refused[url] = {"id": worker_id(url), "url": url, "worker_type": kind, "reason": reason,
                             "refused_at": time.time()}
        while len(self.refused) > MAX_REFUSED:
            self.refused.pop(next(iter(self.refused)))
        return Refused(status, reason)

    async def _admitted(self, w: Worker) -> None:
        if self.on_admit is not None and w.kind == PREFILL:
            try:
                await self.on_admit(w)
            except Exception:
                log.exception("admission hook failed for %s", w.url)

    async def _readmit(self, w: Worker) -> None:
        """A worker back in rotation may have restarted: read its server_info again."""
        info = await self._info(w.url, "server_info")
        if info and self.find(w.url) is w:
            w.server_info = info
            await self._admitted(w)

    def remove(self, key: str) -> Worker:
        w = self.find(key)
        if w is None:
            raise RegistryError(404, f"no worker with id or url {key!r}")
        if w.kind == PREFILL:
            self.prefill = [x for x in self.prefill if x is not w]
        else:
            self.decode = [x for x in self.decode if x is not w]
        log.info("removed %s worker %s", w.kind, w.url)
        self.on_change()
        return w

    async def _register_startup(self, url, kind, port, explicit_none) -> None:
        try:
            await self.add(url, kind, port, explicit_none)
        except Refused:
            pass  # logged and listed under `refused` on /workers
        except RegistryError as e:
            log.error("could not register %s worker %s: %s", kind, url, e)

    # ---------------------------------------------------------------------------- background loops

    def start(self, need_loads: bool) -> None:
        for spec in self.cfg.prefill:
            self._spawn(self._register_startup(spec.url, PREFILL, spec.bootstrap_port, spec.explicit_none))
        for url in self.cfg.decode:
            self._spawn(self._register_startup(url, DECODE, None, False))
        if not self.cfg.disable_health_check and self.cfg.health_check_interval_secs > 0:
            self._spawn(self._health_loop())
        if need_loads:
            self._spawn(self._load_loop())

    def _spawn(self, coro) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def check_once(self) -> None:
        workers = self.all()
        results = await asyncio.gather(*(self._probe(w.url) for w in workers))
        for w, ok in zip(workers, results, strict=True):
            if ok:
                w.ok_streak, w.fail_streak = w.ok_streak + 1, 0
                if not w.healthy and w.ok_streak >= self.cfg.health_success_threshold:
                    w.healthy = True
                    w.breaker.recovered()
                    log.info("worker %s is healthy again", w.url)
                    if self.on_admit is not None and w.kind == PREFILL:
                        self._spawn(self._readmit(w))
            else:
                w.fail_streak, w.ok_streak = w.fail_streak + 1, 0
                if w.healthy and w.fail_streak >= self.cfg.health_failure_threshold:
                    w.healthy = False
                    log.warning("worker %s marked unhealthy after %d failed health checks",
                                w.url, w.fail_streak)
                    if self.on_unhealthy is not None:
                        self.on_unhealthy(w)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_check_interval_secs)
            try:
                await self.check_once()
            except Exception:  # keep checking whatever one round raised
                log.exception("health check round failed")

    async def fetch_load(self, w: Worker) -> int | None:
        try:
            return parse_load(await self._get_json(w.url + "/get_load", self.cfg.health_check_timeout_secs))
        except (TimeoutError, RegistryError, aiohttp.ClientError, OSError,
                msgspec.DecodeError, ValueError, TypeError):
            return None

    async def refresh_loads(self) -> None:
        workers = self.all()
        loads = await asyncio.gather(*(self.fetch_load(w) for w in workers))
        for w, load in zip(workers, loads, strict=True):
            w.load = load

    async def _load_loop(self) -> None:
        while True:
            try:
                await self.refresh_loads()
            except Exception:
                log.exception("load refresh failed")
            await asyncio.sleep(self.cfg.load_check_interval_secs)
