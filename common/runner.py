"""ModelRunner: the model, its memory pools and the sampler of one TP rank.

`forward(fb) -> logits` and `sample(logits, info, ...)`; the scheduler builds the batches.
Pools: the KV pool holds `max_total_tokens` tokens in pages of `page_size` (plus the padding
page 0) with this rank's share of the KV heads; the req pool has `max_running_requests +
REQ_POOL_HEADROOM` rows (room for requests being prefilled, or preallocated by a decode node,
while the running batch is full) of `context_length` columns.
"""

from __future__ import annotations

import logging

import torch

from common.config import ServerArgs
from common.forward_batch import ForwardBatch
from common.hybrid import HybridSupport
from common.layers.sampling import SampleOutput, Sampler, SamplingBatchInfo
from common.memory.allocator import TokenToKVPoolAllocator
from common.memory.kv_pool import KVPool
from common.memory.req_to_token import ReqToTokenPool

logger = logging.getLogger(__name__)

REQ_POOL_HEADROOM = 8


class ModelRunner:
    def __init__(self, args: ServerArgs, model_dir: str, tp_rank: int = 0, tp_size: int = 1,
                 tp_group=None) -> None:
        from common.models.loader import load_model

        self.args = args
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.dtype = torch.float32
        self.model, self.model_config = load_model(model_dir, tp_rank=tp_rank, tp_size=tp_size,
                                                   tp_group=tp_group, dtype=self.dtype)
        self.model.eval()
        cfg = self.model_config
        self.context_length = min(args.context_length or cfg.context_length, cfg.context_length)
        self.page_size = args.page_size
        num_pages = args.max_total_tokens // self.page_size + 1  # + the padding page 0
        self.max_total_tokens = (num_pages - 1) * self.page_size
        self.max_running_requests = args.max_running_requests
        self.allocator = TokenToKVPoolAllocator(num_pages, self.page_size)
        # hybrid models keep KV only for their attention layers (cfg.kv_layer_ids), and a state slot
        # per request row for the others (common/hybrid.py)
        self.hybrid = HybridSupport(self.model, self.dtype)
        self.kv_pool = KVPool(num_pages, self.page_size, cfg.num_layers, cfg.local_kv_heads(tp_size),
                              cfg.head_dim, dtype=self.dtype, layer_ids=cfg.kv_layer_ids or None)
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests + REQ_POOL_HEADROOM,
                                                self.context_length + self.page_size)
        self.sampler = Sampler(seed=args.seed)
        self.vocab_size = cfg.vocab_size
        logger.info("model %s (%s): %d layers, kv heads %d/rank, KV pool %d tokens in %d pages of %d "
                    "(%.1f MiB), context %d", cfg.name, cfg.architecture, cfg.num_layers,
                    cfg.local_kv_heads(tp_size), self.max_total_tokens, num_pages - 1, self.page_size,
                    self.kv_pool.nbytes() / 2**20, self.context_length)

    @property
    def req_to_token_pool(self):
        return self._req_to_token_pool

    @req_to_token_pool.setter
    def req_to_token_pool(self, pool) -> None:
        # a hybrid model's state slots go with the rows: a new pool (a decode node's) gets its own
        self.hybrid.attach(pool)
        self._req_to_token_pool = pool

    @property
    def supports_radix_cache(self) -> bool:
        """False for models with recurrent state (a cached KV prefix does not restore the state)."""
        return self.hybrid.supports_radix_cache

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [len(fb.logits_indices), vocab] float32."""
        if fb.state_indices is None and self.hybrid.has_state:
            fb.state_indices = self.hybrid.state_indices(self.req_to_token_pool, fb)
        return self.model.forward(fb)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo, top_logprobs_nums: list[int] | None = None,
               return_logprob: bool | None = None) -> SampleOutput:
        return self.sampler(logits, info, top_logprobs_nums, return_logprob=return_logprob)

    def model_config_dict(self) -> dict:
        cfg = self.model_config
        out = {k: getattr(cfg, k) for k in ("architecture", "vocab_size", "hidden_size", "num_layers",
                                             "num_heads", "num_kv_heads", "head_dim", "context_length",
                                             "eos_token_ids", "name") if hasattr(cfg, k)}
        out["eos_token_ids"] = list(out.get("eos_token_ids") or [])
        return out
