"""Who may call what, for the router and the nodes alike (torch-free: the router imports it).

Keys by role, each read from a file or the environment (never printed, compared in constant time):

* client: `--api-key-file`, `PDSERVE_API_KEY(_FILE)` or `--api-key VALUE`; accepted on the public routes
  (generation, `/v1/*`, info);
* admin: `--admin-api-key-file`, `PDSERVE_ADMIN_API_KEY(_FILE)`; accepted on the admin routes (`/workers`,
  `/flush_cache`, abort-all);
* node: `--node-api-key-file`, `PDSERVE_NODE_API_KEY(_FILE)`; accepted on every route of a node: the router
  sends it on every hop.

Open routes (liveness/readiness probes, `/metrics`, `/openapi.json`) need no key. A public route is
open while its server has none of the keys that route accepts. Without an admin key, admin routes are
served to loopback clients only (and still need the client or node key when one is set). A key sent
as `Authorization: Bearer KEY`; refusals are 401 (403 for the loopback rule) and never say which key
would have worked.

TLS: `server_ssl_context` (`--ssl-certfile` / `--ssl-keyfile`) and `client_ssl_context` (the router's
client to `https://` workers, verified against `--ssl-ca-certs` or the system's CAs).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import ssl
import stat
from collections.abc import Mapping

log = logging.getLogger("security")

OPEN, PUBLIC, ADMIN = "open", "public", "admin"
BY_BODY = "by_body"  # the handler picks PUBLIC or ADMIN once it has read the body (abort one rid / all)
MAX_KEY_LENGTH = 4096

# role -> (flag of the key file, environment variable of the value; `_FILE` appended: of a file)
KEY_SOURCES = {"client": ("--api-key-file", "PDSERVE_API_KEY"),
               "admin": ("--admin-api-key-file", "PDSERVE_ADMIN_API_KEY"),
               "node": ("--node-api-key-file", "PDSERVE_NODE_API_KEY")}

_warned: set[str] = set()


def warn_once(logger: logging.Logger, message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s", message)


class KeySourceError(ValueError):
    """A key could not be read; the message names the flag, variable or file, never the key."""


def _check_key(raw: str, where: str) -> bytes:
    key = raw.strip()
    if not key:
        raise KeySourceError(f"{where}: the key is empty")
    if len(key) > MAX_KEY_LENGTH or not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise KeySourceError(f"{where}: a key is 1-{MAX_KEY_LENGTH} printable ASCII characters "
                             "without spaces")
    return key.encode()


def _read_key_file(path: str, where: str) -> bytes:
    try:
        with open(path, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            raw = f.read(MAX_KEY_LENGTH + 2)
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise KeySourceError(f"{where}: cannot read key file {path!r}: {reason}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warn_once(log,
                  f"key file {path} can be read by other users (mode {stat.S_IMODE(mode):o}); chmod 600 it")
    return _check_key(raw, f"{where} ({path})")


def load_key(role: str, *, path: str | None = None, value: str | None = None,
             env: Mapping[str, str] | None = None) -> bytes | None:
    """The `role` key: the flag's file (`path`) or value beats the environment's value or file."""
    flag, var = KEY_SOURCES[role]
    env = os.environ if env is None else env
    if path and value:
        raise KeySourceError(f"give {flag} or --api-key, not both")
    if path:
        return _read_key_file(path, flag)
    if value:
        return _check_key(value, "--api-key")
    if env.get(var) and env.get(var + "_FILE"):
        raise KeySourceError(f"set {var} or {var}_FILE, not both")
    if env.get(var):
        return _check_key(env[var], var)
    if env.get(var + "_FILE"):
        return _read_key_file(env[var + "_FILE"], var + "_FILE")
    return None


class Keys:
    """The keys of one server (None: not set). Its repr says which are set, never their values."""

    __slots__ = ("client", "admin", "node")

    def __init__(self, client: bytes | None = None, admin: bytes | None = None, node: bytes | None = None):
        self.client, self.admin, self.node = client, admin, node

    def __repr__(self) -> str:
        return "Keys(" \
            + ", ".join(f"{r}={'set' if getattr(self, r) else 'unset'}" for r in self.__slots__) + ")"

    @classmethod
    def load(cls, *, api_key: str | None = None, api_key_file: str | None = None,
             admin_api_key_file: str | None = None, node_api_key_file: str | None = None,
             env: Mapping[str, str] | None = None, logger: logging.Logger | None = None) -> Keys:
        if api_key:
            warn_once(logger or log, "--api-key puts the key on the command line, where `ps` shows it to "
                      "every user; use --api-key-file or PDSERVE_API_KEY(_FILE)")
        return cls(load_key("client", path=api_key_file, value=api_key, env=env),
                   load_key("admin", path=admin_api_key_file, env=env),
                   load_key("node", path=node_api_key_file, env=env))

    def outgoing(self) -> bytes | None:
        """What the router sends to nodes: the node key; without one the client key, as sglang-router
        does with its single --api-key."""
        return self.node or self.client

    def announce(self, logger: logging.Logger, admin_routes: str) -> None:
        """One start-up line about the admin routes when no admin key is set."""
        if self.admin is None:
            logger.warning("no admin key (--admin-api-key-file / PDSERVE_ADMIN_API_KEY): %s are served to "
                           "loopback clients only", admin_routes)


def bearer_header(key: bytes | None) -> dict[str, str]:
    return {"Authorization": "Bearer " + key.decode()} if key else {}


def bearer_token(headers: Mapping[str, str]) -> bytes | None:
    value = headers.get("Authorization", "")
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip().encode("utf-8", "replace")


def key_matches(token: bytes | None, key: bytes | None) -> bool:
    """Constant time, and the length of the key does not leak either (both sides hashed first)."""
    if token is None or key is None:
        return False
    return hmac.compare_digest(hashlib.sha256(token).digest(), hashlib.sha256(key).digest())


def is_loopback(remote: str | None) -> bool:
    if not remote:
        return False
    try:
        ip = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


class Denied(Exception):
    """The caller may not use the route: served as `status` with `message` in OpenAI's error shape."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message

    @property
    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}


def _require(token: bytes | None, keys: list[bytes]) -> None:
    if not keys or any(key_matches(token, k) for k in keys):
        return
    if token is None:
        raise Denied(401, "missing API key: send `Authorization: Bearer <key>`")
    raise Denied(401, "the API key sent is not accepted on this route")


def check_access(access: str, path: str, token: bytes | None, remote: str | None, keys: Keys,
                 accept_node_key: bool) -> None:
    """Raise Denied unless the caller may use a route of class `access`. A node accepts its node key on
    every route (`accept_node_key`); the router accepts no node key from its callers."""
    if access == OPEN:
        return
    if access not in (PUBLIC, ADMIN):
        raise ValueError(f"check_access: access class {access!r} is decided by its handler")
    node = [keys.node] if accept_node_key and keys.node else []
    if node and key_matches(token, node[0]):
        return
    public = [k for k in (keys.client, *node) if k]
    if access == PUBLIC:
        _require(token, public)
        return
    if keys.admin is not None:
        _require(token, [keys.admin])
        return
    if not is_loopback(remote):
        raise Denied(403, f"`{path}` is an admin route and this server serves it to loopback clients only")
    _require(token, public)


# ---------------------------------------------------------------------------------------------- TLS
def server_ssl_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """TLS for a listening socket (None: plain HTTP). Both files or neither."""
    if not certfile and not keyfile:
        return None
    if not (certfile and keyfile):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile: cannot load {certfile} / {keyfile}: {e}") from None
    return ctx


def client_ssl_context(cafile: str | None = None) -> ssl.SSLContext:
    """TLS to `https://` workers: certificates and host names verified against `cafile` (PEM) or the
    system's CAs."""
    try:
        ctx = ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"--ssl-ca-certs: cannot load {cafile}: {e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
