"""OutputBatcher: what the front end is told in one iteration, as one `BatchOut`.

`add(req)` records a request's news (its new tokens and logprobs, or its end) and `take()` hands out
everything recorded since the last `take()`, one `ReqUpdate` per request, and marks it as sent.
Streaming requests report their first token at once and then every `stream_interval` tokens;
non-streaming requests report once, when they finish.
"""

from __future__ import annotations

from common.protocol import BatchOut, ReqUpdate
from common.scheduler.req import Req


class OutputBatcher:
    def __init__(self, stream_interval: int) -> None:
        self.stream_interval = stream_interval
        self._updates: dict[str, ReqUpdate] = {}  # rid -> update, in the order first added
        self._offsets: dict[str, tuple[Req, int]] = {}  # rid -> (req, output tokens the update covers)

    def __bool__(self) -> bool:
        return bool(self._updates)

    def add(self, req: Req) -> None:
        """Record the request's news, if it has any worth sending now."""
        done = req.finished()
        new = len(req.output_ids) - req.sent_token_offset
        if not done:
            if not req.stream or new <= 0:
                return
            if req.sent_token_offset > 0 and new < self.stream_interval:
                return
        upd = ReqUpdate(
            rid=req.rid,
            new_token_ids=req.output_ids[req.sent_token_offset:],
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            finish_reason=req.finished_reason,
            error_status=req.error_status,
        )
        if req.return_logprob:
            upd.output_logprobs = req.output_logprobs[req.sent_token_offset:]
            if req.top_logprobs_num > 0:
                upd.output_top_logprobs = req.output_top_logprobs[req.sent_token_offset:]
            if req.want_input_logprobs and req.input_logprobs_done and not req.sent_input_logprobs:
                upd.input_logprobs = req.input_logprobs
                if req.top_logprobs_num > 0:
                    upd.input_top_logprobs = req.input_top_logprobs
        # one update per request per iteration: a later one replaces the earlier (same start offset)
        # and moves to the end, where the earlier one would have been dropped and this one appended
        self._updates.pop(req.rid, None)
        self._updates[req.rid] = upd
        self._offsets[req.rid] = (req, len(req.output_ids))

    def take(self) -> BatchOut | None:
        """Everything recorded since the last call (None if nothing), marked as sent."""
        if not self._updates:
            return None
        for req, offset in self._offsets.values():
            req.sent_token_offset = offset
            if req.input_logprobs_done:
                req.sent_input_logprobs = True
        out = BatchOut(updates=list(self._updates.values()))
        self._updates = {}
        self._offsets = {}
        return out
