"""The prefill node's flag rules (common/role_rules.py says how they are found and when they run).

A prefill node computes each prompt's KV, samples the first token and hands the request to a decode
node: it runs no decode steps, so the flags of decoding (mixed chunks, n-gram drafting, the decode
node's own options) are refused. It may lend its cores to the decode node of its pair while it has
nothing to run (`--core-loan-file`, common/core_loan.py).
"""

from __future__ import annotations

from common.role_rules import RoleRules, refuse_decode_flags


class PrefillRules(RoleRules):
    transfers_kv = True
    decodes = False  # it samples a request's first token only

    def check(self, args, bad) -> None:
        refuse_decode_flags(args, bad)
        if args.enable_mixed_chunk:
            raise bad("enable-mixed-chunk", "is for nodes that decode (colocated or --disaggregation-mode "
                      "decode); a prefill node has no running requests to mix in")
        if (args.speculative_algorithm or "").upper() == "NGRAM":
            raise bad("speculative-algorithm", "a prefill node only samples the first token, so it has "
                      "nothing to draft; give it to the decode node")
        if args.core_loan_file:
            why = self.core_loan_unsupported(args)
            if why:
                raise bad("core-loan-file", why)


RULES = PrefillRules()
