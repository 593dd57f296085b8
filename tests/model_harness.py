"""Drive a model by hand: KV pools + ForwardBatch construction for extend and decode steps
(what the scheduler does, minus scheduling). Shared by the model, loader, attention and hybrid tests;
`one_torch_thread`, imported into a test module, runs that module single-threaded."""

from __future__ import annotations

import random

import pytest
import torch

from common.forward_batch import ForwardBatch, ForwardMode
from common.memory.allocator import TokenToKVPoolAllocator
from common.memory.kv_pool import KVPool
from common.memory.req_to_token import ReqToTokenPool


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine every parallel
    region waits for a descheduled thread: run these modules single-threaded, then restore."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Harness:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, *, page_size: int = 16,
                 num_pages: int = 128, max_reqs: int = 16, max_context: int = 2048,
                 scramble_seed: int | None = 0, layer_ids: list[int] | None = None,
                 shared_kv: bool = False) -> None:
        self.page_size = page_size
        self.kv = KVPool(num_pages, page_size, num_layers, kv_heads, head_dim, layer_ids=layer_ids,
                         shared_kv=shared_kv)
        self.alloc = TokenToKVPoolAllocator(num_pages, page_size)
        if scramble_seed is not None:  # hand pages out in a random order: non-contiguous requests
            pages = self.alloc.alloc_pages(self.alloc.available_pages())
            random.Random(scramble_seed).shuffle(pages)
            self.alloc.free_pages(pages)
        self.r2t = ReqToTokenPool(max_reqs, max_context)
        self.lens: dict[int, int] = {}

    @classmethod
    def for_model(cls, cfg, tp_size: int = 1, **kw) -> Harness:
        return cls(cfg.num_layers, cfg.local_kv_heads(tp_size), cfg.head_dim,
                   shared_kv=getattr(cfg, "kv_shared", False), **kw)

    def new_req(self) -> int:
        row = self.r2t.alloc()
        assert row is not None
        self.lens[row] = 0
        return row

    def _grow(self, row: int, n: int) -> torch.Tensor:
        cur = self.lens[row]
        last = int(self.r2t.req_to_token[row, cur - 1]) if cur else 0
        slots = self.alloc.alloc_extend(cur, last, n)
        self.r2t.write(row, cur, slots)
        self.lens[row] = cur + n
        return slots

    def _state_indices(self, rows: list[int]) -> torch.Tensor | None:
        """Per-request state slots of a hybrid model (HybridHarness); none here."""
        return None

    def extend_batch(self, reqs: list[tuple[int, list[int]]], all_logits: bool = False) -> ForwardBatch:
        ids, pos, locs, prefix, new = [], [], [], [], []
        for row, toks in reqs:
            p = self.lens[row]
            locs.append(self._grow(row, len(toks)))
            ids.extend(toks)
            pos.extend(range(p, p + len(toks)))
            prefix.append(p)
            new.append(len(toks))
        fb = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            out_cache_loc=torch.cat(locs),
            req_pool_indices=torch.tensor([r for r, _ in reqs], dtype=torch.int64),
            seq_lens=[p + n for p, n in zip(prefix, new, strict=True)],
            extend_prefix_lens=prefix,
            extend_seq_lens=new,
            kv_pool=self.kv,
            req_to_token=self.r2t.req_to_token,
            state_indices=self._state_indices([r for r, _ in reqs]),
        )
        if all_logits:
            fb.logits_indices = torch.arange(len(ids), dtype=torch.int64)
        return fb

    def decode_batch(self, reqs: list[tuple[int, int]]) -> ForwardBatch:
        pos = [self.lens[row] for row, _ in reqs]
        locs = torch.cat([self._grow(row, 1) for row, _ in reqs])
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=torch.tensor([t for _, t in reqs], dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            out_cache_loc=locs,
            req_pool_indices=torch.tensor([r for r, _ in reqs], dtype=torch.int64),
            seq_lens=[p + 1 for p in pos],
            extend_prefix_lens=pos,
            extend_seq_lens=[1] * len(reqs),
            kv_pool=self.kv,
            req_to_token=self.r2t.req_to_token,
            state_indices=self._state_indices([r for r, _ in reqs]),
        )


def teacher_forced_logits(model, cfg, ids: list[int], prefill: int, tp_size: int = 1,
                          page_size: int = 4) -> torch.Tensor:
    """Logits of every position of `ids`: an extend of `ids[:prefill]` (all rows), then one decode
    step per remaining token."""
    h = Harness.for_model(cfg, tp_size=tp_size, page_size=page_size)
    row = h.new_req()
    outs = [model(h.extend_batch([(row, ids[:prefill])], all_logits=True))]
    for tok in ids[prefill:]:
        outs.append(model(h.decode_batch([(row, tok)])))
    return torch.cat(outs)


def _rank_main(fn, rank: int, world: int, init_method: str, args: tuple, queue, init: dict) -> None:
    """One rank (a spawned process, one torch thread): join the gloo group (`init`: more of
    `init_distributed`'s arguments), run `fn(rank, tp_group, *args)` and report its result, or the error
    with its traceback, so a test fails with the reason, not a timeout."""
    try:
        torch.set_num_threads(1)
        from common.distributed import destroy_distributed, init_distributed

        tp_group, _ = init_distributed(rank, world, init_method, **init)
        queue.put((rank, fn(rank, tp_group, *args), None))
        destroy_distributed()
    except BaseException as e:
        import traceback

        queue.put((rank, None, f"{e!r}\n{traceback.format_exc()}"))


def run_ranks(fn, *args, world: int = 2, timeout: float = 300.0, init: dict | None = None) -> dict:
    """`fn(rank, tp_group, *args)` on `world` real gloo ranks in spawned processes; {rank: its result}.
    `init`: more arguments of `init_distributed` (`tp_size`, `dp_attention`).
    `fn` is a module-level function (it is pickled by name); return plain data (numpy, lists), not tensors,
    which would be shared through the rank's process, gone by then."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, init_method, args, queue, init or {}))
             for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world):
            rank, result, err = queue.get(timeout=timeout)
            assert err is None, f"rank {rank} failed: {err}"
            got[rank] = result
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def tp_logits(rank: int, tp_group, model_dirs: list[str], ids: list[int], prefill: int) -> list:
    """One TP rank's teacher-forced logits (numpy) of each model, loaded sliced for it (`run_ranks`)."""
    from common.models.loader import load_model

    world = tp_group.size() if tp_group is not None else 1
    out = []
    for d in model_dirs:
        model, cfg = load_model(d, tp_rank=rank, tp_size=world, tp_group=tp_group)
        out.append(teacher_forced_logits(model, cfg, ids, prefill, tp_size=world).numpy())
    return out
