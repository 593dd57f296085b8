"""ScheduleBatch: the requests of one forward, their memory, and the ForwardBatch built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.forward_batch import ForwardBatch, ForwardMode
from common.memory.allocator import OutOfPages, TokenToKVPoolAllocator
from common.memory.kv_pool import KVPool
from common.memory.req_to_token import ReqToTokenPool
from common.scheduler.req import Req, Stage

# a retracted request's new estimate of its remaining decode steps
RETRACT_DECODE_STEPS = 20


@dataclass
class ExtendInfo:
    """Where each request's logits rows are in an extend forward's output."""

    # per request: (first position with logits, number of rows, row offset in the logits)
    rows: list[tuple[int, int, int]] = field(default_factory=list)
    # per request: does this forward finish its prefill (so a token is sampled)
    completes: list[bool] = field(default_factory=list)
    # mixed chunk (`ScheduleBatch.mix_with_running`): the last `decode_rows` requests are running ones
    # that decode one token in this forward, not prompts
    decode_rows: int = 0

    @property
    def num_prefill(self) -> int:
        return len(self.rows) - self.decode_rows


class ScheduleBatch:
    def __init__(self, reqs: list[Req], req_to_token_pool: ReqToTokenPool,
                 allocator: TokenToKVPoolAllocator, kv_pool: KVPool, tree_cache,
                 mode: ForwardMode = ForwardMode.DECODE) -> None:
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.tree_cache = tree_cache
        self.mode = mode
        self.extend_info: ExtendInfo | None = None
        self.forward_batch: ForwardBatch | None = None
        self.drafts: list[list[int]] | None = None  # VERIFY: each request's draft tokens

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    def snapshot(self) -> ScheduleBatch:
        """The prepared forward of this batch with its own list of requests (the running batch's list
        changes while an overlapped forward of it is in flight)."""
        snap = ScheduleBatch(list(self.reqs), self.req_to_token_pool, self.allocator, self.kv_pool,
                             self.tree_cache, self.mode)
        snap.extend_info, snap.forward_batch, snap.drafts = self.extend_info, self.forward_batch, self.drafts
        return snap

    # ------------------------------------------------------------------ memory
    def ensure_free_pages(self, pages: int) -> None:
        """Make sure `pages` pages are free, evicting from the cache if needed."""
        short = pages - self.allocator.available_pages()
        if short > 0:
            self.tree_cache.evict(short * self.allocator.page_size)
        if pages > self.allocator.available_pages():
            raise OutOfPages(f"need {pages} pages, {self.allocator.available_pages()} free after eviction")

    # ------------------------------------------------------------------ extend
    def prepare_for_extend(self) -> ForwardBatch:
        """Give each request a req pool row and KV slots for its next `extend_input_len` tokens."""
        self.mode = ForwardMode.EXTEND
        need = sum(self.allocator.pages_needed(len(r.prefix_indices), r.extend_input_len) for r in self.reqs)
        self.ensure_free_pages(need)
        input_ids: list[int] = []
        positions, out_locs, logits_idx = [], [], []
        seq_lens, prefix_lens, extend_lens, rows = [], [], [], []
        info = ExtendInfo()
        offset = 0
        n_rows = 0
        for r in self.reqs:
            if r.req_pool_idx is None:
                row = self.req_to_token_pool.alloc()
                if row is None:
                    raise RuntimeError("no free req pool row (the scheduler checks this before)")
                r.req_pool_idx = row
                if r.prefix_indices.numel():
                    self.req_to_token_pool.write(row, 0, r.prefix_indices)
            pre = len(r.prefix_indices)
            n = r.extend_input_len
            last_slot = int(self.req_to_token_pool.slots(r.req_pool_idx, pre - 1, pre)[0]) if pre else 0
            slots = self.allocator.alloc_extend(pre, last_slot, n)
            self.req_to_token_pool.write(r.req_pool_idx, pre, slots)
            r.kv_len = pre + n
            input_ids.extend(r.fill_ids[pre : pre + n])
            positions.append(torch.arange(pre, pre + n, dtype=torch.int64))
            out_locs.append(slots)
            seq_lens.append(pre + n)
            prefix_lens.append(pre)
            extend_lens.append(n)
            rows.append(r.req_pool_idx)
            completes = pre + n == len(r.fill_ids)
            # logits rows: the last token when the prefill completes, plus the positions whose logits
            # give wanted input logprobs (position p -> logprob of prompt token p+1)
            end = pre + n
            if r.want_input_logprobs and not r.input_logprobs_done:
                lo = max(r.logprob_start_len - 1, 0)
                first = max(lo, pre) if completes else min(max(lo, pre), end)
            else:
                first = end - 1 if completes else end
            count = end - first
            if count:
                logits_idx.append(torch.arange(offset + first - pre, offset + n, dtype=torch.int64))
            info.rows.append((first, count, n_rows))
            info.completes.append(completes)
            n_rows += count
            offset += n
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.cat(positions),
            out_cache_loc=torch.cat(out_locs),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=seq_lens,
            extend_prefix_lens=prefix_lens,
            extend_seq_lens=extend_lens,
            kv_pool=self.kv_pool,
            req_to_token=self.req_to_token_pool.req_to_token,
            logits_indices=torch.cat(logits_idx) if logits_idx else torch.empty(0, dtype=torch.int64),
        )
        self.extend_info = info
        self.forward_batch = fb
        return fb

    # ------------------------------------------------------------------ decode
    def decode_pages_needed(self, steps: int = 1) -> int:
        return sum(self.allocator.pages_needed(r.kv_len, steps) for r in self.reqs)

    def check_decode_mem(self, steps: int = 1) -> bool:
        pages = self.decode_pages_needed(steps)
        if pages <= self.allocator.available_pages():
            return True
        evictable_pages = self.allocator.full_pages(self.tree_cache.evictable_size())
        return pages <= self.allocator.available_pages() + evictable_pages

    def prepare_for_decode(self, pending_token=None) -> ForwardBatch:
        """One new token per request: the last output token goes in, its KV slot is allocated.
        `pending_token(req)` (overlap scheduling): the placeholder of a last token a forward in flight
        is still sampling, or None."""
        self.mode = ForwardMode.DECODE
        reqs = self.reqs
        rows_t, pos_t, slots = self._next_slots(reqs)
        if pending_token is None:
            input_ids = [r.output_ids[-1] for r in reqs]
        else:
            input_ids = [r.output_ids[-1] if (p := pending_token(r)) is None else p for r in reqs]
        seq_lens = [p + 1 for p in pos_t.tolist()]
        b = len(self.reqs)
        fb = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=pos_t,
            out_cache_loc=slots,
            req_pool_indices=rows_t,
            seq_lens=seq_lens,
            extend_prefix_lens=[s - 1 for s in seq_lens],
            extend_seq_lens=[1] * b,
            kv_pool=self.kv_pool,
            req_to_token=self.req_to_token_pool.req_to_token,
            logits_indices=torch.arange(b, dtype=torch.int64),
        )
        self.extend_info = None
        self.drafts = None
        self.forward_batch = fb
        return fb

    def _next_slots(self, reqs: list[Req]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A KV slot for each request's next token (its `kv_len` grows by one): (their req pool rows,
        the positions, the slots)."""
        ps = self.allocator.page_size
        positions = [r.kv_len for r in reqs]
        fresh = [i for i, p in enumerate(positions) if p % ps == 0]  # these start a new page
        self.ensure_free_pages(len(fresh))
        pages = self.allocator.alloc_pages(len(fresh))
        pool = self.req_to_token_pool
        rows_t = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        # a request's next slot follows its last one within the page, or opens a fresh page
        slots = pool.slots_at(rows_t, (pos_t - 1).clamp(min=0)) + 1
        if fresh:
            first = self.allocator.first_slots(torch.tensor(pages, dtype=torch.int64))
            slots[torch.tensor(fresh, dtype=torch.int64)] = first
        pool.write_at(rows_t, pos_t, slots)
        for r in reqs:
            r.kv_len += 1
        return rows_t, pos_t, slots

    def mix_with_running(self, running: list[Req]) -> None:
        """Mixed chunk (`--enable-mixed-chunk`): the `running` requests decode one token each in this
        prepared extend forward, after its prompt rows: each one's last output token at its next
        position, with a logits row (an extend of one token on top of its KV, as a decode step is).
        The caller checked that the KV memory for them is there (`check_decode_mem`)."""
        fb, info = self.forward_batch, self.extend_info
        rows_t, pos_t, slots = self._next_slots(running)
        b, tokens, logits_rows = len(running), fb.input_ids.numel(), sum(count for _f, count, _o in info.rows)
        fb.input_ids = torch.cat([fb.input_ids,
                                  torch.tensor([r.output_ids[-1] for r in running], dtype=torch.int64)])
        fb.positions = torch.cat([fb.positions, pos_t])
        fb.out_cache_loc = torch.cat([fb.out_cache_loc, slots])
        fb.req_pool_indices = torch.cat([fb.req_pool_indices, rows_t])
        positions = pos_t.tolist()
        fb.seq_lens = fb.seq_lens + [p + 1 for p in positions]
        fb.extend_prefix_lens = fb.extend_prefix_lens + positions
        fb.extend_seq_lens = fb.extend_seq_lens + [1] * b
        fb.logits_indices = torch.cat([fb.logits_indices,
                                       torch.arange(tokens, tokens + b, dtype=torch.int64)])
        info.rows += [(p, 1, logits_rows + j) for j, p in enumerate(positions)]
        info.completes += [True] * b
        info.decode_rows = b
        self.reqs = self.reqs + running

    def verify_pages_needed(self, drafts: list[list[int]]) -> int:
        return sum(self.allocator.pages_needed(r.kv_len, 1 + len(d))
                   for r, d in zip(self.reqs, drafts, strict=True))

    def prepare_for_verify(self, drafts: list[list[int]]) -> ForwardBatch:
        """Speculative decoding: each request's last output token and its drafts go in at its next
        1 + len(drafts) positions, with KV slots for all of them and a logits row for each.
        `common/scheduler/speculative.py` keeps the confirmed ones and rolls the rest back."""
        self.mode = ForwardMode.VERIFY
        self.ensure_free_pages(self.verify_pages_needed(drafts))
        pool = self.req_to_token_pool
        input_ids: list[int] = []
        positions, out_locs, seq_lens, prefix_lens, extend_lens = [], [], [], [], []
        for r, d in zip(self.reqs, drafts, strict=True):
            pre, n = r.kv_len, 1 + len(d)
            last_slot = int(pool.slots(r.req_pool_idx, pre - 1, pre)[0]) if pre else 0
            slots = self.allocator.alloc_extend(pre, last_slot, n)
            pool.write(r.req_pool_idx, pre, slots)
            r.kv_len = pre + n
            input_ids.append(r.output_ids[-1])
            input_ids.extend(d)
            positions.append(torch.arange(pre, pre + n, dtype=torch.int64))
            out_locs.append(slots)
            seq_lens.append(pre + n)
            prefix_lens.append(pre)
            extend_lens.append(n)
        fb = ForwardBatch(
            mode=ForwardMode.VERIFY,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.cat(positions),
            out_cache_loc=torch.cat(out_locs),
            req_pool_indices=torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64),
            seq_lens=seq_lens,
            extend_prefix_lens=prefix_lens,
            extend_seq_lens=extend_lens,
            kv_pool=self.kv_pool,
            req_to_token=pool.req_to_token,
            logits_indices=torch.arange(len(input_ids), dtype=torch.int64),
        )
        self.extend_info = None
        self.drafts = drafts
        self.forward_batch = fb
        return fb

    # ------------------------------------------------------------------ membership
    def filter(self, keep) -> None:
        """Keep the requests for which keep(req) is true."""
        self.reqs = [r for r in self.reqs if keep(r)]

    def merge(self, other: ScheduleBatch | list[Req]) -> None:
        reqs = other.reqs if isinstance(other, ScheduleBatch) else other
        for r in reqs:
            r.stage = Stage.RUNNING
        self.reqs.extend(reqs)

    # ------------------------------------------------------------------ retraction
    @staticmethod
    def retract_order_key(r: Req) -> tuple[int, int]:
        # victims first: fewest output tokens (least decode work lost), then longest prompt (frees
        # the most memory)
        return (len(r.output_ids), -len(r.origin_input_ids))

    def retract_decode(self, steps: int = 1, before_release=None, order_key=None) -> tuple[list[Req], float]:
        """Take requests out until the rest can decode `steps` more tokens.

        Victims (fewest output tokens first, ties: longest prompt) release their KV into the cache
        (radix: full pages stay reusable until evicted) and are reset to prefill prompt + output so
        far again, so greedy decoding later produces the same tokens. `before_release(victim)` runs
        while the victim still holds its KV (the scheduler copies it to the host store there, so the
        victim can resume without that prefill). `order_key` replaces `retract_order_key` (priority
        scheduling puts the lowest priority first). Usually one request keeps running; all go when
        another holder (a chunked prefill) has the memory. Returns (victims, the new new_token_ratio
        estimate)."""
        order = sorted(self.reqs, key=order_key or self.retract_order_key)
        victims: list[Req] = []
        while self.reqs and not self.check_decode_mem(steps):
            victim = order.pop(0)
            self.reqs.remove(victim)
            if before_release is not None:
                before_release(victim)
            self.tree_cache.cache_finished_req(victim)
            victim.reset_for_retract()
            victims.append(victim)
        decoded = sum(len(r.output_ids) for r in self.reqs)
        budget = sum(r.max_new_tokens for r in self.reqs) or 1
        ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.reqs)) / budget)
        return victims, ratio
