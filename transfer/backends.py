"""Backend registry: transfer engines by name, imported lazily.

`get_engine_class("mooncake")` imports only `transfer/mooncake.py`; the library itself is imported
when the engine is constructed, which raises `BackendUnavailable` naming the pip package to install
if it is missing. `create_engine(name, hostname, settings)` builds one with the transfer settings
(mooncake's `allow_wildcard_listen` comes from the environment's settings when none are given).
"""

from __future__ import annotations

import importlib

from transfer.base import TransferSettings
from transfer.engine import BackendUnavailable, TransferEngine, spread_over_node, thread_ids

BACKENDS = {
    "fake": ("transfer.fake", "FakeEngine"),
    "mooncake": ("transfer.mooncake", "MooncakeEngine"),
    "nixl": ("transfer.nixl", "NixlEngine"),
    "ucx": ("transfer.ucx", "UcxEngine"),
}


def get_engine_class(name: str) -> type[TransferEngine]:
    if name not in BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; choose one of {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise BackendUnavailable(f"transfer backend {name!r} could not be loaded: {exc}") from exc
    return getattr(mod, cls)


def create_engine(name: str, hostname: str = "127.0.0.1", settings=None) -> TransferEngine:
    """Construct the named engine; `settings` (TransferSettings) supplies device names / protocol."""
    cls = get_engine_class(name)
    device = (settings.device_name or None) if settings is not None else None
    extra = {}
    if name == "mooncake":  # it cannot be confined to `hostname`: starts only where that is acknowledged
        allow = (settings if settings is not None else TransferSettings.from_env()).allow_wildcard_listen
        extra = {"protocol": settings.protocol if settings is not None else "tcp",
                 "allow_wildcard_listen": allow}
    before = thread_ids()
    engine = cls(hostname=hostname, device_name=device, **extra)
    spread_over_node(thread_ids() - before)  # the engine's own threads: off a DP group's core share
    return engine
