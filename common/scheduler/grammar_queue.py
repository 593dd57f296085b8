"""The grammar queue: a request with a grammar (`json_schema`, `regex`, `ebnf`) waits
here while its grammar compiles on the compiler's thread, then goes on as any other request (the role's
queues, or the waiting queue). It is admitted (the front end starts its answer) only when it leaves:
a grammar that does not compile is a 400 with xgrammar's reason, before any byte of a stream.

With tensor parallelism every rank compiles on its own; a request leaves the queue when its grammar is
ready on every rank (a MIN over the consensus group), so all ranks schedule it in the same step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from common.grammar import GrammarCompiler, GrammarError
from common.scheduler.req import Req

logger = logging.getLogger(__name__)


def all_ranks(flags: list[bool], tp_size: int) -> list[bool]:
    """Element-wise AND of `flags` over the node's ranks (every rank calls it in the same step)."""
    if tp_size <= 1 or not flags:
        return flags
    import torch
    import torch.distributed as dist

    from common.distributed import get_consensus_group

    t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=get_consensus_group())
    return [bool(x) for x in t.tolist()]


class GrammarQueue:
    def __init__(self, make_compiler: Callable[[], GrammarCompiler], tp_size: int) -> None:
        self._make_compiler = make_compiler
        self.compiler: GrammarCompiler | None = None  # built with the first grammar
        self.tp_size = tp_size
        self.queue: list[tuple[Req, object, float]] = []  # (request, future, since)

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, req: Req) -> None:
        if self.compiler is None:
            self.compiler = self._make_compiler()
        kind, source = req.sampling.grammar()
        self.queue.append((req, self.compiler.submit(kind, source), time.monotonic()))
        logger.info("rid=%s waits for its %s grammar (%d characters)", req.rid, kind, len(source))

    def remove(self, req: Req) -> None:
        self.queue = [e for e in self.queue if e[0] is not req]

    def poll(self, on_ready: Callable[[Req], None], on_failed: Callable[[Req, str], None]) -> None:
        """Move on every request whose grammar is ready on all ranks: `on_ready(req)` with `req.grammar`
        set, or `on_failed(req, message)` when it did not compile."""
        if not self.queue:
            return
        ready = all_ranks([fut.done() for _, fut, _ in self.queue], self.tp_size)
        if not any(ready):
            return
        left = []
        for (req, fut, since), ok in zip(self.queue, ready, strict=True):
            if not ok:
                left.append((req, fut, since))
                continue
            try:
                compiled = fut.result()
            except GrammarError as e:
                on_failed(req, str(e))
                continue
            except Exception as e:  # the compiler itself broke: this request fails, the node goes on
                logger.exception("rid=%s grammar compilation failed", req.rid)
                on_failed(req, f"grammar compilation failed: {type(e).__name__}")
                continue
            req.grammar = self.compiler.matcher(compiled)
            logger.info("rid=%s grammar ready after %.1f ms", req.rid, (time.monotonic() - since) * 1e3)
            on_ready(req)
        self.queue = left

    def stats(self) -> dict[str, int]:
        c = self.compiler
        return {"num_grammar_queue_reqs": len(self.queue), "grammars_compiled": c.compiled if c else 0,
                "grammar_cache_hits": c.hits if c else 0}

    def close(self) -> None:
        if self.compiler is not None:
            self.compiler.close()
