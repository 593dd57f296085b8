"""The decode node's flag rules (common/role_rules.py says how they are found and when they run).

A decode node receives every prompt's KV from a prefill node, so it keeps no prefix cache, and it
runs one token per request per step, which pipeline stages could not overlap. It borrows the cores
of the prefill node of its pair while that one idles (`--core-loan-file` with `--core-loan-cores`,
common/core_loan.py), which only a scheduler whose forwards run on its own pinned thread can do.
"""

from __future__ import annotations

from common.role_rules import RoleRules


class DecodeRules(RoleRules):
    transfers_kv = True
    radix_cache = False  # every prompt's KV arrives from a prefill node: a prefix cache would never be hit

    def check(self, args, bad) -> None:
        if args.pp_size > 1:
            raise bad("pp-size", "a decode node runs one token per request per step, which would cross every "
                      "stage in turn with nothing to overlap; scale decode with --tp-size or --dp-size")
        if args.core_loan_file:
            if args.core_loan_cores is None:
                raise bad("core-loan-file", "a decode node borrows only with --core-loan-cores (the prefill "
                          "node's cores)")
            why = self.core_loan_unsupported(args)
            if why:
                raise bad("core-loan-file", why)

    def core_loan_unsupported(self, args) -> str | None:
        why = super().core_loan_unsupported(args)
        if why:
            return why
        if args.tp > 1:
            return "a decode node borrows cores only at --tp-size 1"
        if args.enable_overlap_schedule:
            return ("cannot be combined with --enable-overlap-schedule on a decode node (its forwards would "
                    "run on another thread than the one whose threads are pinned)")
        return None


RULES = DecodeRules()
