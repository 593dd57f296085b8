"""What a node's role allows: its flag rules, checked when `ServerArgs` are validated, and the facts
other settings follow from.

There are three roles: the colocated node (`--disaggregation-mode null`, whose rules are this base
class), the prefill node and the decode node. A PD role states its own rules in its package
(prefill_node/flags.py, decode_node/flags.py: a `RoleRules` subclass and its instance `RULES`).
common/ never imports a role, so `rules_for(mode)` finds them by import path, as `scheduler_path(mode)`
names the role's scheduler class to the scheduler process (`prefill_node.role:PrefillScheduler`).
A rules module imports no more than common/config.py does, so checking a node's flags loads neither
torch nor the transfer layer.

`check(args, bad)` raises `bad(flag, why)` (a `ConfigError` naming the flag) for a flag the role does
not take or a combination it cannot run. `ServerArgs.validate` calls it, so a node's flags are refused
when they are parsed, however the node was started (`pdserve decode`, `pdserve serve
--disaggregation-mode decode`, `ServerArgs(...).validate()` in code). `core_loan_unsupported(args)`
says why a node of the role cannot take part in a core loan (common/core_loan.py); `pdserve cluster`
asks it too before it gives a pair the loan flags.
"""

from __future__ import annotations

import importlib

from common import core_loan

# the PD roles' rules, by import path ("package.module:NAME"); the colocated node's are `RoleRules()`
ROLE_RULES = {"prefill": "prefill_node.flags:RULES", "decode": "decode_node.flags:RULES"}
# the scheduler class each role's ranks run, by import path (the colocated node's: the common one)
ROLE_SCHEDULERS = {"prefill": "prefill_node.role:PrefillScheduler",
                   "decode": "decode_node.role:DecodeScheduler"}


def scheduler_path(mode: str) -> str:
    """The import path of the scheduler class of the role `mode` names (a role switch builds one too)."""
    return ROLE_SCHEDULERS.get(mode, "common.scheduler.scheduler:Scheduler")


def refuse_decode_flags(args, bad) -> None:
    """The flags only a decode node takes, given to another node."""
    if args.disaggregation_local_prefill:
        raise bad("disaggregation-local-prefill", "is a decode node's option (--disaggregation-mode decode); "
                  "a colocated node prefills every request itself")
    if args.core_loan_cores is not None:
        raise bad("core-loan-cores", "is a decode node's option (it borrows the prefill node's cores)")


class RoleRules:
    """The colocated node's rules; a PD role's subclass states its own."""

    transfers_kv = False  # bootstrap and control-plane traffic with the peers of a prefill-decode pair
    decodes = True  # runs decode steps, so a retracted request's KV may wait in the host store
    radix_cache = True  # a prompt's KV computed here may serve the next prompt with the same prefix

    def check(self, args, bad) -> None:
        """Raise `bad(flag, why)` for the first flag of `args` this role refuses."""
        refuse_decode_flags(args, bad)
        if args.core_loan_file:
            raise bad("core-loan-file", "is for the prefill and decode nodes of a pair "
                      "(--disaggregation-mode)")

    def core_loan_unsupported(self, args) -> str | None:
        """Why a node of this role and shape cannot lend or borrow cores (None: it can)."""
        return core_loan.unsupported(args)


def rules_for(mode: str) -> RoleRules:
    """The rules of the role `mode` names (a `--disaggregation-mode` value)."""
    path = ROLE_RULES.get(mode)
    if path is None:
        return RoleRules()
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)
