"""The cluster secret: one file shared by every node and the router, read once at start.

`--cluster-secret-file PATH` (or `$PDSERVE_CLUSTER_SECRET_FILE`) names a file with one secret per
line, surrounding whitespace stripped, blank lines ignored. The first line signs; every line is
accepted when verifying, so a file with two lines ("new" then "old") lets a cluster rotate its
secret with rolling restarts. Each secret must have at least `MIN_SECRET_BYTES` bytes.

A `ClusterSecret` never shows its bytes: its repr and str name the file and the number of secrets,
and errors name the file, never its content. Without a secret the cluster's own planes are
unauthenticated; `warn_unauthenticated()` says so once per process.
"""

from __future__ import annotations

import logging
import os

ENV_VAR = "PDSERVE_CLUSTER_SECRET_FILE"
MIN_SECRET_BYTES = 16
MAX_SECRETS = 2  # the current one and, during a rotation, the previous one
MAX_FILE_BYTES = 64 * 1024

_warned = False


class ClusterSecretError(ValueError):
    """The secret file is missing, unreadable, empty, or holds a secret that is too short."""


class ClusterSecret:
    """The loaded secrets: `signing` (the first line) and `keys` (every line, for verifying)."""

    __slots__ = ("keys", "source")

    def __init__(self, keys: list[bytes] | tuple[bytes, ...], source: str = "<memory>") -> None:
        keys = tuple(keys)
        if not keys:
            raise ClusterSecretError(f"cluster secret {source}: no secret given")
        if len(keys) > MAX_SECRETS:
            raise ClusterSecretError(f"cluster secret file {source}: {len(keys)} secrets, at most "
                                     f"{MAX_SECRETS} (the current one first, then the previous one during a "
                                     "rotation)")
        for i, key in enumerate(keys):
            if len(key) < MIN_SECRET_BYTES:
                raise ClusterSecretError(f"cluster secret file {source}: secret on line {i + 1} has "
                                         f"{len(key)} bytes, need at least {MIN_SECRET_BYTES}")
        self.keys = keys
        self.source = source

    @property
    def signing(self) -> bytes:
        return self.keys[0]

    def __repr__(self) -> str:
        return f"ClusterSecret(<{len(self.keys)} secret(s) from {self.source}>)"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSecret) and self.keys == other.keys

    def __hash__(self) -> int:
        return hash(self.keys)


def load_secret(path: str) -> ClusterSecret:
    """Read the secret file at `path`; raises `ClusterSecretError` with a message naming the file."""
    try:
        size = os.path.getsize(path)
        if size > MAX_FILE_BYTES:
            raise ClusterSecretError(f"cluster secret file {path}: {size} bytes, a secret file holds at most "
                                     f"{MAX_FILE_BYTES}")
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ClusterSecretError(f"cluster secret file {path}: cannot read it ({e.strerror or e})") from None
    keys = [line.strip() for line in raw.splitlines() if line.strip()]
    if not keys:
        raise ClusterSecretError(f"cluster secret file {path} is empty")
    return ClusterSecret(keys, path)


def secret_file_from(flag_value: str | None) -> str | None:
    """The secret file to use: the flag's value, else `$PDSERVE_CLUSTER_SECRET_FILE`, else None."""
    return flag_value or os.environ.get(ENV_VAR) or None


def load_configured(flag_value: str | None) -> ClusterSecret | None:
    """The cluster secret named by the flag or the environment (None when neither names a file)."""
    path = secret_file_from(flag_value)
    return load_secret(path) if path else None


def warn_unauthenticated(logger: logging.Logger, what: str) -> None:
    """Say once per process that the cluster's planes run without authentication."""
    global _warned
    if _warned:
        return
    _warned = True
    logger.warning("no cluster secret (--cluster-secret-file / $%s): %s is not authenticated; run the "
                   "cluster only on a network the deployment isolates", ENV_VAR, what)
