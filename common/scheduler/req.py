"""Req: one request's scheduling state, from arrival to its final update.

Token bookkeeping (positions are token indices of `all_token_ids()` = prompt + output):
* `kv_len` tokens have KV in the cache (slots `req_to_token[req_pool_idx, :kv_len]`);
* `prefix_indices` are the slots the next extend starts from (a radix-cache hit, or the chunks
  computed so far); `locked_len` leading tokens of them belong to the radix tree (locked through
  `last_node`), the rest are the request's own;
* `fill_ids` are the tokens to have KV after the whole prefill (the prompt, or prompt + output so
  far after a retraction); each extend computes `fill_ids[len(prefix_indices):][:extend_input_len]`.
"""

from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass
from typing import Any

import torch

from common.protocol import SamplingParams

_EMPTY = torch.empty(0, dtype=torch.int64)
# a stop_regex match is looked for in the text of this many last output tokens
STOP_REGEX_WINDOW = 64


class Stage(enum.Enum):
    NEW = "new"  # arrived; a node role holds it until it adds it to the scheduler
    WAITING = "waiting"
    CHUNKED = "chunked"  # part of its prompt is prefilled
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class FinishStatus:
    """How `Scheduler.finish_requests` ends a request: the finish reason reported, and the HTTP status
    (0: none)."""

    reason: dict[str, Any]
    error_status: int = 0

    @classmethod
    def abort(cls, message: str, error_status: int = 0, err_type: str | None = None) -> FinishStatus:
        """`err_type` names a cause a router acts on (`common.protocol.ERR_TYPE_HEADER`)."""
        reason = {"type": "abort", "message": message}
        if err_type:
            reason["err_type"] = err_type
        return cls(reason, error_status)


class Req:
    def __init__(self, rid: str, input_ids: list[int], sampling: SamplingParams, *,
                 stream: bool = False, return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, generator: torch.Generator | None = None,
                 eos_token_ids: list[int] | None = None, tokenizer: Any = None,
                 bootstrap_host: str | None = None, bootstrap_port: int | None = None,
                 bootstrap_room: int | None = None, arrival_time: float | None = None) -> None:
        self.rid = rid
        self.origin_input_ids = list(input_ids)
        self.output_ids: list[int] = []
        self.sampling = sampling
        self.stream = stream
        self.generator = generator
        self.eos_token_ids = set(eos_token_ids or ())
        self.stop_token_ids = set(sampling.stop_token_ids or ())
        self.stop_strs = sampling.stop_strings()
        # in UTF-8 bytes: every token decodes to at least one byte, not always to a whole character
        self.stop_str_max_len = max((len(s.encode("utf-8")) for s in self.stop_strs), default=0)
        self.stop_regexes = [re.compile(r) for r in sampling.stop_regexes()]
        self.tokenizer = tokenizer
        self.grammar: Any = None  # common.grammar.Grammar once the grammar queue compiled it

        # memory
        self.req_pool_idx: int | None = None
        self.kv_len = 0
        self.prefix_indices: torch.Tensor = _EMPTY
        self.last_node: Any = None
        self.locked_len = 0
        self.fill_ids: list[int] = list(self.origin_input_ids)
        self.extend_input_len = 0
        self.stage = Stage.NEW
        # overlap scheduling (common/scheduler/overlap.py): the last launched forward this request is
        # in, and the FutureMap row its token from that forward goes to (None: a prefill batch)
        self.inflight_seq = 0
        self.future_row: int | None = None
        # tracing (--enable-trace): the front end's span context, and when the request entered each stage
        self.traceparent: str | None = None
        self.marks: list[tuple[str, float]] = []
        self.trace_links: dict[str, str] = {}  # stage -> the peer's traceparent (PD transfer)
        # speculative decoding (common/scheduler/speculative.py): the tokens as int32 bytes, searched for
        # drafts, and the longest chain the next step may draft (None: the configured maximum)
        self.draft_history = bytearray()
        self.draft_budget: int | None = None
        # verify steps in a row whose drafts were all rejected, and decode steps left without drafts
        self.draft_fails = 0
        self.draft_skip = 0
        # EAGLE / MTP (common/draft_layers.py): the draft layers' next token and hidden state at the last
        # position (None until a forward or the prefill node gave them)
        self.draft_token: int | None = None
        self.draft_hidden = None
        self.is_retracted = False
        self.retract_count = 0
        self.scheduled_once = False
        self.priority = 0  # --schedule-policy priority (common/scheduler/priority.py)
        self.cached_tokens = 0

        # end
        self.finished_reason: dict[str, Any] | None = None
        self.error_status = 0
        self.to_abort: str | None = None

        # logprobs
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        # input logprobs are wanted for prompt tokens logprob_start_len.. (entry i: logprob of that
        # token given the tokens before it; None for token 0)
        self.want_input_logprobs = return_logprob and 0 <= logprob_start_len < len(self.origin_input_ids)
        self.input_logprobs: list[tuple[float | None, int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        self.input_logprobs_done = False
        self.output_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []

        # streaming offsets (what the front end has already been sent)
        self.sent_token_offset = 0
        self.sent_input_logprobs = False

        # disaggregation
        self.bootstrap_host = bootstrap_host
        self.bootstrap_port = bootstrap_port
        self.bootstrap_room = bootstrap_room

        # timestamps
        self.arrival_time = arrival_time or time.time()
        self.queue_time = time.monotonic()
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    # ------------------------------------------------------------------ tokens
    def all_token_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens

    def mark(self, stage: str) -> None:
        """The request entered `stage` now (kept only when it is traced; a repeat of the current stage
        is not a new one)."""
        if self.traceparent is not None and (not self.marks or self.marks[-1][0] != stage):
            self.marks.append((stage, time.time()))

    def finished(self) -> bool:
        return self.finished_reason is not None

    def max_prefix_len(self) -> int:
        """Longest prefix the next prefill may take from the cache: at least one token must be
        computed (its logits give the next token), and prompt tokens whose input logprobs are
        wanted must be computed too (position p gives the logprob of token p+1)."""
        n = len(self.fill_ids) - 1
        if self.want_input_logprobs and not self.input_logprobs_done:
            n = min(n, max(self.logprob_start_len - 1, 0))
        return max(n, 0)

    def init_next_round_input(self, tree_cache) -> None:
        """Match the cache for a request about to be (re)scheduled from the waiting queue."""
        if self.req_pool_idx is None:
            limit = self.max_prefix_len()
            slots, node = tree_cache.match_prefix(self.fill_ids[:limit])
            self.prefix_indices = slots
            self.last_node = node
            self.locked_len = slots.numel()
            if not self.scheduled_once:
                self.cached_tokens = slots.numel()
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def release_kv_state(self) -> None:
        """Forget the memory this request held (the cache freed or took it)."""
        self.req_pool_idx = None
        self.kv_len = 0
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.locked_len = 0

    def reset_for_retract(self) -> None:
        """After its KV was released: prefill prompt + output so far again, then keep decoding."""
        self.fill_ids = self.all_token_ids()
        self.extend_input_len = 0
        self.draft_token = self.draft_hidden = None  # the prefill again gives new ones
        self.stage = Stage.WAITING
        self.is_retracted = True
        self.retract_count += 1
        self.queue_time = time.monotonic()

    # ------------------------------------------------------------------ finishing
    def finish(self, reason: dict[str, Any], error_status: int = 0) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason
            self.error_status = error_status
            self.stage = Stage.FINISHED
            self.finished_time = time.monotonic()

    def check_finished(self) -> bool:
        """Set finished_reason when the request should stop; returns whether it is finished."""
        if self.finished_reason is not None:
            return True
        if self.to_abort is not None:
            self.finish({"type": "abort", "message": self.to_abort})
            return True
        n = len(self.output_ids)
        if n >= self.max_new_tokens:
            self.finish({"type": "length", "length": self.max_new_tokens})
            return True
        if n == 0 or n < self.sampling.min_new_tokens:
            return False
        last = self.output_ids[-1]
        if last in self.stop_token_ids:
            self.finish({"type": "stop", "matched": last})
            return True
        if not self.sampling.ignore_eos and last in self.eos_token_ids:
            self.finish({"type": "stop", "matched": last})
            return True
        if self.grammar is not None and self.grammar.terminated:  # it accepted its end-of-sequence token
            self.finish({"type": "stop", "matched": last})
            return True
        if self.stop_strs and self.tokenizer is not None:
            # a new match ends in the last token, so it lies within the last (bytes of the longest stop
            # string + 1) tokens: each token is at least one byte of text
            tail = self.tokenizer.decode(self.output_ids[-(self.stop_str_max_len + 1):])
            for s in self.stop_strs:
                if s in tail:
                    self.finish({"type": "stop", "matched": s})
                    return True
        if self.stop_regexes and self.tokenizer is not None:
            # a match is looked for in the text of the last STOP_REGEX_WINDOW tokens; the text is cut
            # where the matched text first occurs, as for a stop string
            tail = self.tokenizer.decode(self.output_ids[-STOP_REGEX_WINDOW:])
            for r in self.stop_regexes:
                m = r.search(tail)
                if m and m.group(0):
                    self.finish({"type": "stop", "matched": m.group(0)})
                    return True
        return False

    def accept_grammar(self, token: int) -> None:
        """Advance the grammar by an output token (one the grammar's mask allowed); a token it refuses
        ends the request with an error, as its output could no longer follow the grammar."""
        if not self.grammar.accept(token) and self.finished_reason is None:
            self.finish({"type": "abort",
                         "message": f"output token {token} is outside the request's grammar"},
                        error_status=500)

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, prompt={len(self.origin_input_ids)}, out={len(self.output_ids)}, "
                f"kv={self.kv_len}, stage={self.stage.value})")
