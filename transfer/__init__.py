"""KV transfer between prefill and decode ranks.

Modules: `base` (states, settings, KVArgs, interfaces), `bootstrap` (rendezvous server/client),
`control` (ZMQ control plane), `metadata` (first-token metadata rows), `manager` (KVManager,
KVSender, KVReceiver on any engine), `consensus` (TP-wide poll agreement), `engine` (the byte-mover
interface) and one engine module per backend (`fake`, `mooncake`, `nixl`, `ucx`), chosen by name
through `backends.get_engine_class`.
"""

from transfer.backends import BACKENDS, create_engine, get_engine_class

__all__ = ["BACKENDS", "create_engine", "get_engine_class"]
