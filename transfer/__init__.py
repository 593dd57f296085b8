"""KV transfer between prefill and decode ranks.

Modules: `base` (states, settings, KVArgs), `bootstrap` (rendezvous server/client), `control`
(ZMQ control plane and its messages), `metadata` (first-token metadata rows), `plan` (page runs ->
transfer regions), `manager` (the KVManager base both sides share: engine, control plane, peer
liveness), `sender` (prefill side: PrefillKVManager; its decode peers in `decode_peers`, its
KVSender in `kv_sender`), `receiver` (decode side:
DecodeKVManager, KVReceiver), `consensus` (TP-wide poll agreement), `node` (what a node builds from
them), `engine` (the byte-mover interface) and one engine module per backend (`fake`, `mooncake`,
`nixl`, `ucx`), chosen by name through `backends.get_engine_class`.
"""

from transfer.backends import BACKENDS, create_engine, get_engine_class

__all__ = ["BACKENDS", "create_engine", "get_engine_class"]
