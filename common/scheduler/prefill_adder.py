"""PrefillAdder: picks the requests of the next prefill batch under three token budgets.

* `rem_total_tokens`: KV the new batch may take = free + evictable tokens, minus what the running
  requests are expected to still need (`(max_new_tokens - len(output)) * new_token_ratio` each,
  clipped), minus what the requests added so far take (prompt + clipped max_new_tokens each);
* `rem_input_tokens`: new (non-cached) prompt tokens of one prefill batch (`max_prefill_tokens`);
* `rem_chunk_tokens`: tokens of one request per forward (`chunked_prefill_size`); a longer prompt
  is cut at a page boundary and becomes the (single) chunked request.

Every budget counts whole pages, since the allocator hands out pages. A retracted request whose KV
waits in the host store (`add_restored_req`) counts against the KV budget only: it is copied back,
not prefilled.
"""

from __future__ import annotations

import enum

from common.memory.allocator import TokenToKVPoolAllocator
from common.scheduler.req import Req

# a request's max_new_tokens counts at most this much in the budgets (a huge max_new_tokens
# should not block admission; retraction handles the rare overrun)
CLIP_MAX_NEW_TOKENS = 4096


class AddResult(enum.Enum):
    CONTINUE = 1  # added; try the next request
    NO_TOKEN = 2  # out of KV memory: stop adding
    OTHER = 3  # another budget is exhausted: stop adding


class PrefillAdder:
    def __init__(self, tree_cache, allocator: TokenToKVPoolAllocator, running_reqs: list[Req],
                 new_token_ratio: float, max_prefill_tokens: int, chunked_prefill_size: int) -> None:
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = None if chunked_prefill_size in (-1, None) else chunked_prefill_size
        self.running_reserved = sum(self.reserve_running(r) for r in running_reqs)
        self.added_tokens = 0
        self.can_run_list: list[Req] = []
        self.restore_list: list[Req] = []  # retracted requests whose KV comes back from the host store
        self.new_chunked_req: Req | None = None
        self.locked_nodes: list = []

    # ------------------------------------------------------------------ budgets
    def reserve_running(self, r: Req) -> int:
        left = min(max(r.max_new_tokens - len(r.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        return int(left * self.new_token_ratio)

    @property
    def rem_total_tokens(self) -> int:
        avail = self.allocator.available_size() + self.tree_cache.evictable_size()
        return avail - self.running_reserved - self.added_tokens

    def budget_state(self) -> AddResult:
        if self.rem_total_tokens <= 0:
            return AddResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddResult.OTHER
        return AddResult.CONTINUE

    def _chunk_len(self, extend: int) -> int:
        """Tokens of this extend that fit the chunk budget (page aligned when cut)."""
        if self.rem_chunk_tokens is None or extend <= self.rem_chunk_tokens:
            return extend
        return self.rem_chunk_tokens - self.rem_chunk_tokens % self.page_size

    def _need(self, req: Req, extend: int, reserve_output: int) -> int:
        """KV tokens (whole pages) the request takes for `extend` more tokens plus its output."""
        pre = len(req.prefix_indices)
        return self.allocator.pages_needed(pre, extend + reserve_output) * self.page_size

    def _take(self, req: Req, extend: int, reserve_output: int) -> None:
        req.extend_input_len = extend
        self.can_run_list.append(req)
        self.added_tokens += self._need(req, extend, reserve_output)
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend

    def _lock(self, req: Req) -> None:
        self.tree_cache.inc_lock_ref(req.last_node)
        self.locked_nodes.append(req.last_node)

    # ------------------------------------------------------------------ adding
    def add_chunked_req(self, req: Req) -> AddResult:
        """Schedule the next chunk of the request being chunked (it already holds its KV and its
        lock). If no memory is left for even one page it is not added (it waits for decode to free
        some); if more chunks remain after this one it becomes `new_chunked_req` again."""
        remaining = len(req.fill_ids) - len(req.prefix_indices)
        extend = self._chunk_len(remaining)
        room = self.rem_total_tokens
        if self._need(req, extend, 0) > room:
            extend = max(room, 0) // self.page_size * self.page_size
        if extend <= 0:
            return AddResult.NO_TOKEN
        truncated = extend < remaining
        reserve = 0 if truncated else min(max(req.max_new_tokens - len(req.output_ids), 0),
                                          CLIP_MAX_NEW_TOKENS)
        self._take(req, extend, reserve)
        if truncated:
            self.new_chunked_req = req
        return self.budget_state()

    def add_one_req(self, req: Req) -> AddResult:
        """Try to add a waiting request (already matched against the cache by the scheduler)."""
        state = self.budget_state()
        if state is not AddResult.CONTINUE:
            return state
        extend = req.extend_input_len
        reserve = min(max(req.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        # lock first so the prefix it reuses is not counted as evictable
        self._lock(req)
        cut = self._chunk_len(extend)
        if cut == extend:
            if self._need(req, extend, reserve) > self.rem_total_tokens:
                self._unlock_last()
                return AddResult.NO_TOKEN
            if extend > self.rem_input_tokens and self.can_run_list:
                self._unlock_last()
                return AddResult.OTHER
            self._take(req, extend, reserve)
            return self.budget_state()
        # needs chunking: only one chunked request at a time
        if self.new_chunked_req is not None or cut <= 0:
            self._unlock_last()
            return AddResult.OTHER
        if self._need(req, cut, 0) > self.rem_total_tokens:
            self._unlock_last()
            return AddResult.NO_TOKEN
        self._take(req, cut, 0)
        self.new_chunked_req = req
        return AddResult.OTHER

    def add_restored_req(self, req: Req, kv_len: int) -> AddResult:
        """Try to add a retracted request whose `kv_len` tokens of KV wait in the host store: it takes
        pages for them and its output (the KV budget), and no prefill tokens (the other budgets)."""
        if self.rem_total_tokens <= 0:
            return AddResult.NO_TOKEN
        reserve = min(max(req.max_new_tokens - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
        need = self.allocator.pages_for(kv_len + reserve) * self.page_size
        if need > self.rem_total_tokens:
            return AddResult.NO_TOKEN
        self.restore_list.append(req)
        self.added_tokens += need
        return AddResult.CONTINUE

    def _unlock_last(self) -> None:
        node = self.locked_nodes.pop()
        self.tree_cache.dec_lock_ref(node)
