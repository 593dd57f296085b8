"""Speculative decoding: the verify step both algorithms share, and n-gram drafting
(`--speculative-algorithm NGRAM`). EAGLE / MTP chains come from the checkpoint's
draft layers, which the model runner runs (common/draft_layers.py; `DraftLayerDrafter` here only asks for
a chain of the right length starting at the request's first draft).

Each decode step, a request drafts up to `--speculative-num-draft-tokens - 1` tokens from its own
history: the longest suffix of its tokens (prompt + output, between
`--speculative-ngram-min-match-window-size` and `--speculative-ngram-max-match-window-size` tokens)
that occurred before, and the tokens that followed its latest earlier occurrence. No draft model.

One forward verifies every draft chain (`ScheduleBatch.prepare_for_verify`, `ForwardMode.VERIFY`):
request i puts in its last output token and its drafts d1..dk at the next k+1 positions and gets
k+1 logits rows. The sampler draws a target token t_j from row j as if d1..dj were already output
(penalties, `min_new_tokens` and logprobs see them), so t_j is exactly what step j of plain decoding
would draw after those tokens. The request keeps t_0, and t_j while d_j == t_(j-1): the longest run
of drafts the model agrees with, plus one token of its own. Greedy output is token-identical to no
speculation. For sampling, keeping t_j only when it equals a one-token draft is rejection sampling
with a one-hot draft distribution (accept d with probability p(d), else draw from p without d), so
every output token still follows the target distribution; seeded requests draw more uniforms than
without speculation, so their exact tokens differ from a run without it.

A request's chain is at most one longer than its last confirmed run (`record`), so drafts that keep
failing cost one token per step. A request gets no drafts when it has a grammar (its matcher would have to
roll back), when fewer than
two new tokens remain, or when the step's KV pages for the drafts are not free; a step where no
request drafts anything is a plain decode step. KV slots of rejected drafts are given back
(`rollback`); the pages past the request's new length return to the allocator.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from common.scheduler.req import Req

DEFAULT_NUM_DRAFT_TOKENS = 4  # --speculative-num-draft-tokens when not given
_ITEM = 4  # bytes per token in a request's draft history (int32)


@dataclass
class SpecStats:
    """Counters since start: verify steps, drafts proposed and accepted, tokens output by verify steps."""

    verify_steps: int = 0
    requests_verified: int = 0
    drafted: int = 0
    accepted: int = 0
    output_tokens: int = 0

    def as_dict(self) -> dict[str, float]:
        n = self.requests_verified
        return {"spec_verify_steps": self.verify_steps, "spec_draft_tokens": self.drafted,
                "spec_accepted_tokens": self.accepted,
                # tokens a request gets per verify forward (1 = nothing accepted)
                "spec_accept_length": round(self.output_tokens / n, 3) if n else 0.0,
                "spec_accept_rate": round(self.accepted / self.drafted, 3) if self.drafted else 0.0}


MAX_DRAFT_SKIP = 15  # decode steps a request goes without drafts at most after failures in a row


class Drafter:
    """What NGRAM and EAGLE / MTP share: each step's chain lengths (`drafts_for`) and the budget and
    counters updated after a verify step (`record`).

    Back-off: a request whose drafts were all rejected in `n` verify steps in a row drafts nothing for
    the next 2**(n-1) - 1 decode steps (0, 1, 3, 7, at most 15); one accepted draft ends it. Drafts that
    keep failing then cost little more than plain decoding: the verify is no wider, and the draft layers
    (EAGLE / MTP) skip the lm_head for a request that will not draft next step."""

    def __init__(self, num_draft_tokens: int, disable_by_batch_size: int | None = None) -> None:
        self.max_drafts = num_draft_tokens - 1
        self.disable_by_batch_size = disable_by_batch_size
        self.stats = SpecStats()

    def chain_for(self, req: Req, limit: int) -> list[int]:
        raise NotImplementedError

    def drafts_for(self, reqs: list[Req], context_length: int) -> list[list[int]]:
        """Each request's draft chain for this step (empty where it may not or cannot draft; all empty
        while more requests run than --speculative-disable-by-batch-size)."""
        if self.disable_by_batch_size is not None and len(reqs) > self.disable_by_batch_size:
            return [[] for _ in reqs]
        out = []
        for r in reqs:
            if r.draft_skip > 0:
                r.draft_skip -= 1
                out.append([])
                continue
            budget = self.max_drafts if r.draft_budget is None else r.draft_budget
            room = min(budget, r.max_new_tokens - len(r.output_ids) - 1, context_length - r.kv_len - 1)
            out.append(self.chain_for(r, room) if r.grammar is None and room > 0 else [])
        return out

    def record(self, reqs: list[Req], drafts: list[list[int]], kept: list[int]) -> None:
        """A verify step: per request its drafts and the tokens it kept. A request's next chain is one
        longer than the run it just had confirmed (at most the maximum): one whose drafts keep failing
        drafts one token a step, so a wrong guess costs little of a wide forward."""
        for r, d, k in zip(reqs, drafts, kept, strict=True):
            if d:
                r.draft_budget = min(self.max_drafts, max(k - 1, 0) + 1)
                r.draft_fails = 0 if k > 1 else r.draft_fails + 1
                r.draft_skip = min(2 ** max(r.draft_fails - 1, 0) - 1, MAX_DRAFT_SKIP)
        s = self.stats
        s.verify_steps += 1
        s.requests_verified += len(drafts)
        s.drafted += sum(len(d) for d in drafts)
        s.accepted += sum(max(k - 1, 0) for k in kept)
        s.output_tokens += sum(kept)


class DraftLayerDrafter(Drafter):
    """EAGLE / MTP: a chain starts from the request's d1 (left by the draft layers after its last
    forward, or sent by the prefill node); the model runner drafts the rest of it right before the verify
    forward (common/draft_layers.py), so here the chain is d1 and placeholders."""

    def chain_for(self, req: Req, limit: int) -> list[int]:
        return [] if req.draft_token is None else [req.draft_token] * limit


class NgramDrafter(Drafter):
    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int,
                 disable_by_batch_size: int | None = None) -> None:
        # ranges: ServerArgs.validate
        super().__init__(num_draft_tokens, disable_by_batch_size)
        self.min_window = min_window
        self.max_window = max_window

    def chain_for(self, req: Req, limit: int) -> list[int]:
        return self.propose(self._history(req), limit)

    @staticmethod
    def _history(req: Req) -> bytearray:
        """The request's tokens as int32 bytes, kept on the request and extended as it grows (its
        tokens only ever grow: a retracted request keeps its output)."""
        hist = req.draft_history
        have = len(hist) // _ITEM
        prompt = len(req.origin_input_ids)
        if have < prompt:
            hist.extend(array("i", req.origin_input_ids[have:]).tobytes())
            have = prompt
        if have < req.seqlen:
            hist.extend(array("i", req.output_ids[have - prompt:]).tobytes())
        return hist

    def propose(self, tokens: bytes | bytearray, limit: int) -> list[int]:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest suffix."""
        n = len(tokens) // _ITEM
        if limit <= 0 or n < 2:
            return []
        for w in range(min(self.max_window, n - 1), self.min_window - 1, -1):
            key = tokens[(n - w) * _ITEM:]
            end = (n - 1) * _ITEM  # an occurrence must end before the last token
            while True:
                pos = tokens.rfind(key, 0, end)
                if pos < 0:
                    break
                if pos % _ITEM == 0:  # aligned on a token boundary
                    start = pos + w * _ITEM
                    follow = array("i", tokens[start:start + limit * _ITEM]).tolist()
                    # a match that overlaps the suffix ends where the history ends: the text repeats
                    # with this period, so the draft goes on repeating it
                    period = len(follow)
                    while len(follow) < limit:
                        follow.append(follow[len(follow) - period])
                    return follow
                end = pos + len(key) - 1
        return []


def accepted_run(drafts: list[int], targets: list[int]) -> int:
    """How many drafts the target tokens confirm: d_j is kept while it equals t_(j-1)."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


def rollback(req: Req, allocator, req_to_token_pool, reserved_len: int) -> None:
    """Give back the slots of rejected drafts: pages wholly past `req.kv_len` (the request had
    `reserved_len` positions' slots) return to the allocator; the rest of its last page stays its own
    (the next token's slot follows the last kept one)."""
    ps = allocator.page_size
    keep_to = -(-req.kv_len // ps) * ps
    if reserved_len > keep_to:
        allocator.free_slots(req_to_token_pool.slots(req.req_pool_idx, keep_to, reserved_len))


def make_drafter(args) -> Drafter | None:
    """The drafter `--speculative-algorithm` asks for (None: no speculation). EAGLE / MTP: the runner
    drafts with the checkpoint's draft layers; NGRAM: from each request's own tokens."""
    if not args.speculative_algorithm:
        return None
    if args.draft_layers:
        return DraftLayerDrafter(args.speculative_num_draft_tokens, args.speculative_disable_by_batch_size)
    return NgramDrafter(args.speculative_num_draft_tokens, args.speculative_ngram_min_match_window_size,
                        args.speculative_ngram_max_match_window_size, args.speculative_disable_by_batch_size)
