"""The requests `pdserve bench gpu` runs through a `ModelRunner` (bench/gpu/run.py says what it measures)."""

from __future__ import annotations

import time

import torch

PREFILL_CHUNK_TOKENS = 16384  # tokens of one EXTEND forward while the decode contexts are prefilled


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)



class Workload:
    """One `ModelRunner` and its requests: `requests` rows of `context` random prompt tokens (KV slots for
    `context + steps` tokens each, written into `req_to_token` once), and one row for the long prefill."""

    def __init__(self, runner, requests: int, context: int, steps: int, prefill_tokens: int, seed: int = 0):
        self.runner = r = runner
        self.context, self.steps = context, steps
        self.device = r.device
        g = torch.Generator().manual_seed(seed)
        low = min(100, r.vocab_size // 2)  # away from the special tokens at the start of a vocabulary
        self.prompts = torch.randint(low, r.vocab_size, (requests, context), generator=g)
        self.long_prompt = torch.randint(low, r.vocab_size, (prefill_tokens,), generator=g)
        self.rows, slots = [], []
        for _ in range(requests):
            row, s = self._take(context + steps)
            self.rows.append(row)
            slots.append(s)
        self.slots = torch.stack(slots)  # host copy [requests, context + steps]
        self.long_row, self.long_slots = self._take(prefill_tokens)
        self.first_ids = torch.zeros(requests, dtype=torch.int64)  # each request's token after its prompt

    def _take(self, n: int) -> tuple[int, torch.Tensor]:
        r = self.runner
        row = r.req_to_token_pool.alloc()
        if row is None:
            raise RuntimeError("the runner's request table is full")
        slots = r.allocator.alloc_extend(0, 0, n)
        r.req_to_token_pool.write(row, 0, slots.to(r.req_to_token_pool.req_to_token.device))
        return row, slots

    def _batch(self, mode, input_ids, positions, out_cache_loc, rows, seq_lens, prefix_lens, new_lens):
        from common.forward_batch import ForwardBatch

        r = self.runner
        return ForwardBatch(mode=mode, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
                            req_pool_indices=rows, seq_lens=seq_lens, extend_prefix_lens=prefix_lens,
                            extend_seq_lens=new_lens, kv_pool=r.kv_pool,
                            req_to_token=r.req_to_token_pool.req_to_token)

    def _greedy_info(self, b: int):
        from common.layers.sampling import SamplingBatchInfo
        from common.protocol import SamplingParams

        info = SamplingBatchInfo.build([SamplingParams(temperature=0.0)] * b, [[] for _ in range(b)],
                                       self.runner.vocab_size, [None] * b, [])
        return info.to(self.device)  # moved once per batch, not at every step's sample

    def prefill_contexts(self) -> None:
        """Every request's prompt into the KV pool, a few requests per EXTEND forward."""
        from common.forward_batch import ForwardMode

        ctx, n = self.context, len(self.rows)
        per = max(1, PREFILL_CHUNK_TOKENS // ctx)
        for i in range(0, n, per):
            idx = list(range(i, min(n, i + per)))
            k = len(idx)
            fb = self._batch(ForwardMode.EXTEND, self.prompts[idx].reshape(-1), torch.arange(ctx).repeat(k),
                             self.slots[idx, :ctx].reshape(-1), torch.tensor([self.rows[j] for j in idx]),
                             [ctx] * k, [0] * k, [ctx] * k)
            out = self.runner.sample(self.runner.forward(fb), self._greedy_info(k))
            self.first_ids[idx] = out.next_token_ids.cpu()
        sync(self.device)

    def decode(self, b: int, warmup: int, repeats: int) -> list[float]:
        """Seconds of `steps` decode steps of the first `b` requests, once per repeat (after `warmup`
        steps)."""
        from common.forward_batch import ForwardMode

        if b > len(self.rows):
            raise ValueError(f"batch {b} is larger than the {len(self.rows)} prefilled requests")
        ctx, r = self.context, self.runner
        info = self._greedy_info(b)
        rows = torch.tensor(self.rows[:b])
        positions = [torch.full((b,), ctx + j, dtype=torch.int64) for j in range(self.steps)]
        locs = [self.slots[:b, ctx + j].contiguous() for j in range(self.steps)]
        first = self.first_ids[:b].to(self.device)

        def run(n: int) -> None:
            ids = first
            for j in range(n):
                fb = self._batch(ForwardMode.DECODE, ids, positions[j], locs[j], rows, [ctx + j + 1] * b,
                                 [ctx + j] * b, [1] * b)
                ids = r.sample(r.forward(fb), info).next_token_ids

        run(warmup)
        times = []
        for _ in range(repeats):
            sync(self.device)
            t0 = time.perf_counter()
            run(self.steps)
            sync(self.device)
            times.append(time.perf_counter() - t0)
        return times

    def release(self) -> None:
        """Give every row and KV slot back, so a scheduler can run on the same runner."""
        r = self.runner
        for row, slots in [*zip(self.rows, self.slots, strict=True), (self.long_row, self.long_slots)]:
            r.allocator.free_slots(slots)
            r.req_to_token_pool.free(row)
        self.rows = []

    def prefill(self, repeats: int) -> list[float]:
        """Seconds of one EXTEND forward (and its sampling) of the long prompt, once per repeat after a
        warmup run; each run writes the same KV slots."""
        from common.forward_batch import ForwardMode

        n = self.long_prompt.numel()
        info = self._greedy_info(1)
        times = []
        for i in range(repeats + 1):
            fb = self._batch(ForwardMode.EXTEND, self.long_prompt, torch.arange(n), self.long_slots,
                             torch.tensor([self.long_row]), [n], [0], [n])
            sync(self.device)
            t0 = time.perf_counter()
            self.runner.sample(self.runner.forward(fb), info)
            sync(self.device)
            if i:
                times.append(time.perf_counter() - t0)
        return times
