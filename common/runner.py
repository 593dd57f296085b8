"""ModelRunner: the model, its memory pools and the sampler of one TP rank.

`run(batch) -> RunnerOutput`: one forward of a batch the scheduler built, then sampling (the
requests whose prefill completes, every request of a decode step) and the logprobs asked for, prompt
logprobs included. `forward(fb) -> logits` and `sample(logits, info, ...)` are its two halves.
Pools: the KV pool holds `max_total_tokens` tokens in pages of `page_size` (plus the padding
page 0) with this rank's share of the KV heads; the req pool has `max_running_requests +
REQ_POOL_HEADROOM` rows (room for requests being prefilled while the running batch is full) of
`context_length` columns, unless the node gives its own (`make_req_pool`: a decode node's
`DecodeReqToTokenPool`, with rows for preallocated requests).

Device (`common/device.py`): the model, the KV pool, the request table and the state pool live on the
rank's device in the dtypes its flags chose, with the attention backend it chose (handed to the model);
`forward` moves a host-built batch there with one copy, and on CUDA replays captured graphs for decode
batches that fit (`common/cuda_graph.py`). Sampling runs where the logits are.

Pipeline parallelism (`pp_rank` of `--pp-size`): the model and the KV pool hold this stage's layers
only; every stage runs the same forward (each its layers, the hidden state passed on in
`LlamaForCausalLM.forward`), the last stage samples, and `run` hands its `RunnerOutput` to every
rank of the group, so all schedulers go on with the same tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.config import ServerArgs
from common.device import Placement, kv_tokens_for_fraction
from common.draft_layers import DraftLayers
from common.fingerprint import KV_LAYOUT, PROTOCOL_VERSION, Compatibility, pairing_key
from common.forward_batch import ForwardBatch, ForwardMode
from common.grammar import apply_grammars
from common.hybrid import HybridSupport
from common.layers.sampling import SampleOutput, Sampler, SamplingBatchInfo
from common.memory.allocator import TokenToKVPoolAllocator
from common.memory.kv_pool import KVPool
from common.memory.req_to_token import ReqToTokenPool

logger = logging.getLogger(__name__)

REQ_POOL_HEADROOM = 8


@dataclass
class RunnerOutput:
    """What one forward produced, per request of the batch (None where nothing was sampled)."""

    next_token_ids: list[int | None]
    token_logprobs: list[float | None]
    top_logprobs: list[list[tuple[float, int]] | None]
    # extend only: per request, (logprobs of prompt tokens, their top logprobs) computed this chunk
    input_logprobs: list[list[tuple[float, int]] | None] | None = None
    input_top_logprobs: list[list[list[tuple[float, int]]] | None] | None = None


class ModelRunner:
    def __init__(self, args: ServerArgs, model_dir: str, tp_rank: int = 0, tp_size: int = 1,
                 tp_group=None, pp_rank: int = 0, dp_rank: int = 0,
                 make_req_pool: Callable[[int, torch.device], ReqToTokenPool] | None = None) -> None:
        """`make_req_pool(max_context_len, device)` builds the request table (default: a `ReqToTokenPool` of
        `max_running_requests + REQ_POOL_HEADROOM` rows; a decode node gives its `DecodeReqToTokenPool`)."""
        from common.models.loader import load_model

        self.args = args
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.tp_group = tp_group
        self.pp_rank, self.pp_size = pp_rank, getattr(args, "pp_size", 1)
        # the node's ranks take consecutive GPUs: DP group, then pipeline stage, then TP rank
        device_rank = (dp_rank * self.pp_size + pp_rank) * tp_size + tp_rank
        self.placement = placement = Placement.resolve(args, device_rank, checkpoint_dtype(model_dir))
        self.device, self.dtype = placement.device, placement.dtype
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model, self.model_config = load_model(model_dir, tp_rank=tp_rank, tp_size=tp_size,
                                                   tp_group=tp_group, dtype=self.dtype,
                                                   quantization=args.weight_quantization, pp_rank=pp_rank,
                                                   pp_size=self.pp_size, draft_layers=args.draft_layers,
                                                   device=self.device,
                                                   attention_backend=placement.attention_backend,
                                                   load_format=args.load_format,
                                                   ep_size=getattr(args, "ep_size", 1),
                                                   eplb=getattr(args, "eplb", None))
        self.model.eval()
        self._sparse_blocks = None  # DP attention's idle forward runs these (idle_forward)
        self.attn_backend = self.model.attn_backend
        cfg = self.model_config
        self.context_length = min(args.context_length or cfg.context_length, cfg.context_length)
        self.page_size = args.page_size
        num_pages = self._kv_tokens(args, cfg, tp_size) // self.page_size + 1  # + the padding page 0
        self.max_total_tokens = (num_pages - 1) * self.page_size
        self.max_running_requests = args.max_running_requests
        self.allocator = TokenToKVPoolAllocator(num_pages, self.page_size)
        # hybrid models keep KV only for their attention layers (cfg.kv_layer_ids), and a state slot
        # per request row for the others (common/hybrid.py)
        self.hybrid = HybridSupport(self.model, self.dtype, self.device)
        # a pipeline stage keeps the KV of its own layers (of a hybrid model: its full-attention ones, maybe
        # none)
        layer_ids = cfg.kv_layer_ids or None
        if self.pp_size > 1:
            start, end = self.model.layer_range
            layer_ids = [i for i in (cfg.kv_layer_ids or range(cfg.num_layers)) if start <= i < end]
        # EAGLE / MTP: the draft layer keeps its KV as one more layer (id num_layers) of the same pages
        self.draft = None
        if args.draft_layers:
            self.draft = DraftLayers(self.model)
            layer_ids = [*(cfg.kv_layer_ids or range(cfg.num_layers)), cfg.num_layers]
        self.kv_pool = KVPool(num_pages, self.page_size, cfg.num_layers, cfg.local_kv_heads(tp_size),
                              cfg.head_dim, dtype=placement.kv_dtype, layer_ids=layer_ids, device=self.device,
                              shared_kv=cfg.kv_shared)  # latent attention: K and V are one row
        self.model_dir = model_dir
        self.graphs = None  # captured decode graphs (cuda): they read the request table's rows
        self._build_req_pool(args, make_req_pool)
        self.sampler = Sampler(seed=args.seed)
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = list(cfg.eos_token_ids or [])  # min_new_tokens masks them
        logger.info("model %s (%s): %d layers, kv heads %d/rank, KV pool %d tokens in %d pages of %d "
                    "(%.1f MiB, %s), context %d, on %s", cfg.name, cfg.architecture, cfg.num_layers,
                    cfg.local_kv_heads(tp_size), self.max_total_tokens, num_pages - 1, self.page_size,
                    self.kv_pool.nbytes() / 2**20, str(placement.kv_dtype).removeprefix("torch."),
                    self.context_length, self.device)

    def _build_req_pool(self, args: ServerArgs, make_req_pool) -> None:
        """The request table (with a hybrid model's state slots), the decode graphs over it and this node's
        compatibility for its role."""
        row_len = self.context_length + self.page_size
        self.req_to_token_pool = make_req_pool(row_len, self.device) if make_req_pool is not None else \
            ReqToTokenPool(args.max_running_requests + REQ_POOL_HEADROOM, row_len, device=self.device)
        self.hybrid.attach(self.req_to_token_pool)  # a hybrid model's state slots go with the rows
        if self.placement.cuda_graph_max_bs:
            from common.cuda_graph import CudaGraphRunner

            self.graphs = None  # the old graphs' memory goes before the new capture
            self.graphs = CudaGraphRunner(self.model, self.attn_backend, self.kv_pool,
                                          self.req_to_token_pool.req_to_token,
                                          min(self.placement.cuda_graph_max_bs, self.max_running_requests),
                                          self.device, state_pool=self.hybrid.state_pool)
            self.graphs.capture_all()
        # what a prefill and a decode node must share to pair (common/fingerprint.py), the same on every rank
        self.args = args
        self.compatibility = self._compatibility(args, self.model_dir)
        self.fingerprint = pairing_key(self.compatibility)

    def switch_role(self, args: ServerArgs, make_req_pool=None) -> None:
        """A role switch (common/scheduler/role_switch.py): the new role's request table, graphs and
        compatibility; the weights and the KV pool stay. Only when no row and no page is in use."""
        pages = self.allocator.num_pages - 1 - self.allocator.available_pages()
        rows = self.req_to_token_pool.size - ReqToTokenPool.available_size(self.req_to_token_pool)
        if pages or rows:
            raise RuntimeError(f"a role switch needs an idle runner: {pages} KV pages and {rows} request "
                               "rows are still in use")
        self._build_req_pool(args, make_req_pool)

    def _kv_tokens(self, args: ServerArgs, cfg, tp_size: int) -> int:
        """--max-total-tokens, or on cuda with --mem-fraction-static what the fraction leaves after the
        weights (at most --max-total-tokens when that was given)."""
        if args.mem_fraction_static is None or self.device.type != "cuda":
            return args.max_total_tokens
        layers = len(cfg.kv_layer_ids or range(cfg.num_layers)) + (1 if args.draft_layers else 0)
        planes = 1 if cfg.kv_shared else 2  # latent attention: K and V are one row
        per_token = planes * layers * cfg.local_kv_heads(tp_size) * cfg.head_dim \
            * self.placement.kv_dtype.itemsize
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters()
                      if p.device.type == "cuda")
        tokens = kv_tokens_for_fraction(args.mem_fraction_static, self.device, weights,
                                        per_token, args.page_size)
        default = ServerArgs.__dataclass_fields__["max_total_tokens"].default
        return tokens if args.max_total_tokens == default else min(tokens, args.max_total_tokens)

    def _compatibility(self, args: ServerArgs, model_dir: str) -> Compatibility:
        """This node's compatibility facts: its weights as loaded, dtypes, KV pages, shape and transfer."""
        from common.models.loader import weights_digest

        cfg, p = self.model_config, self.placement
        role = getattr(args, "disaggregation_mode", "null")
        return Compatibility(
            weights=weights_digest(model_dir, args.load_format, self.tp_size, self.pp_size), model=cfg.name,
            dtype=str(p.dtype).removeprefix("torch."), kv_cache_dtype=str(p.kv_dtype).removeprefix("torch."),
            kv_layout=KV_LAYOUT, page_size=self.page_size, head_dim=cfg.head_dim,
            # as the transfer layer counts them (a latent row: one head, replicated on every rank)
            kv_heads=cfg.num_kv_heads if cfg.kv_shared else cfg.local_kv_heads(self.tp_size) * self.tp_size,
            layers=cfg.num_layers, quantization=args.weight_quantization or "none",
            draft_layers=bool(args.draft_layers), tp_size=self.tp_size, pp_size=self.pp_size,
            dp_size=getattr(args, "dp_size", 1),
            decode_tp=(getattr(args, "disaggregation_decode_tp", None) or 0) if role == "prefill" else 0,
            transfer_backend=getattr(args, "transfer_backend", "") or "", protocol=PROTOCOL_VERSION)

    def device_info(self) -> dict:
        """What /server_info shows of where this rank computes."""
        return {**self.placement.describe(),
                "cuda_graph_batch_sizes": self.graphs.batch_sizes if self.graphs else []}

    @property
    def supports_radix_cache(self) -> bool:
        """False for models with recurrent state (a cached KV prefix does not restore the state)."""
        return self.hybrid.supports_radix_cache

    @torch.inference_mode()
    def work_done(self):
        """The completion of the work launched on the device so far, an event recorded now on the
        current stream (the KV of every forward launched before is written once it has completed); None
        on the CPU, whose forwards return with their KV written. The prefill role hands it to the KV
        sender, whose worker waits on it before reading the pages."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [len(fb.logits_indices), vocab], on the rank's device."""
        fb.to_device(self.device)
        if fb.state_indices is None and self.hybrid.has_state:
            fb.state_indices = self.hybrid.state_indices(self.req_to_token_pool, fb)
        if self.graphs is not None and self.graphs.can_run(fb):
            return self.graphs.replay(fb)
        return self.model.forward(fb)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, info: SamplingBatchInfo,
               top_logprobs_nums: list[int] | None = None,
               return_logprob: bool | None = None) -> SampleOutput:
        """Sample where the logits are: the batch's sampling tensors follow them to the device."""
        return self.sampler(logits, info.to(logits.device), top_logprobs_nums, return_logprob=return_logprob)

    @torch.inference_mode()
    def idle_forward(self) -> None:
        """DP attention: a forward with nothing of this group's to run, taking part in every sparse block's
        collectives while other groups run theirs (common/layers/dp_attention.py)."""
        from common.layers.dp_attention import idle_forward, sparse_blocks

        if self._sparse_blocks is None:  # found once: an idle group runs this every step
            self._sparse_blocks = sparse_blocks(self.model)
        idle_forward(self._sparse_blocks, self.model_config.hidden_size, self.dtype, self.device)

    def run(self, batch) -> RunnerOutput:
        """Forward a prepared `ScheduleBatch`, sample its next tokens and gather the logprobs (with
        pipeline stages: the last stage's, on every rank)."""
        if self.pp_size == 1:
            return self._run(batch)
        from common.distributed import broadcast_from_stage

        last = self.pp_size - 1
        if self.pp_rank < last:
            self.forward(batch.forward_batch)  # this stage's layers; the hidden state goes on
            return broadcast_from_stage(None, last)
        return broadcast_from_stage(self._run(batch), last)

    def _run(self, batch) -> RunnerOutput:
        fb = batch.forward_batch
        if self.draft is not None:
            self.draft.prepare(fb)
            if fb.mode == ForwardMode.VERIFY:
                self.draft.chain(batch)  # the rest of each chain, drafted into the batch
        out = self._forward_and_sample(batch)
        if self.draft is not None:
            self.draft.follow(batch, out)  # the draft layers' KV, and each request's next d1
        return out

    def _forward_and_sample(self, batch) -> RunnerOutput:
        fb = batch.forward_batch
        if fb.logits_indices.numel():
            logits = self.forward(fb)
        else:
            # only middle chunks: no logits are needed, the forward just fills the KV
            fb.logits_indices = fb.last_token_indices()[:1]
            self.forward(fb)
            logits = None
        reqs = batch.reqs
        b = len(reqs)
        out = RunnerOutput([None] * b, [None] * b, [None] * b)
        if fb.mode == ForwardMode.VERIFY:
            self._sample_verify(reqs, batch.drafts, logits, out)
            return out
        if fb.mode == ForwardMode.DECODE:
            sample_idx = rows = list(range(b))
        else:
            sample_idx, rows = [], []
            for i, (r, (_first, count, off), done) in enumerate(
                    zip(reqs, batch.extend_info.rows, batch.extend_info.completes, strict=True)):
                if done and count and len(r.output_ids) < r.max_new_tokens:
                    sample_idx.append(i)
                    rows.append(off + count - 1)
        if sample_idx:
            sreqs = [reqs[i] for i in sample_idx]
            if fb.mode == ForwardMode.DECODE and rows == list(range(logits.shape[0])):
                picked = logits  # every row, in order: no copy (logits are not used after sampling)
            else:
                picked = logits[torch.tensor(rows, dtype=torch.int64, device=logits.device)]
            ids, lp, tops = self._draw(sreqs, [r.output_ids for r in sreqs], picked)
            for j, i in enumerate(sample_idx):
                out.next_token_ids[i] = ids[j]
                if lp is not None and reqs[i].return_logprob:
                    out.token_logprobs[i] = lp[j]
                    out.top_logprobs[i] = tops[j] if tops is not None else None
        if fb.mode == ForwardMode.EXTEND:
            self._input_logprobs(batch, logits, out)
        return out

    def _draw(self, reqs, outputs: list[list[int]], logits: torch.Tensor):
        """Sample one token per logits row; row j belongs to `reqs[j]` with `outputs[j]` produced so far.
        Returns (token ids, their logprobs or None, their top logprobs or None)."""
        info = SamplingBatchInfo.build([r.sampling for r in reqs], outputs, logits.shape[-1],
                                       [r.generator for r in reqs], self.eos_token_ids,
                                       prompt_ids=[r.origin_input_ids for r in reqs])
        want_lp = any(r.return_logprob for r in reqs)
        nums = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs] if want_lp else None
        grammars = [r.grammar for r in reqs]
        if any(g is not None for g in grammars):
            apply_grammars(logits, grammars)  # only what each grammar allows next can be drawn
        s = self.sample(logits, info, nums, return_logprob=want_lp)
        lp = s.logprobs.tolist() if s.logprobs is not None else None
        return s.next_token_ids.tolist(), lp, s.top_logprobs

    def _sample_verify(self, reqs, drafts: list[list[int]], logits: torch.Tensor, out: RunnerOutput) -> None:
        """Speculative decoding: a target token for every row, row j of request i drawn as if its drafts
        d1..dj were already output. Each request gets the list of its 1 + len(drafts) targets (and their
        logprobs); the scheduler keeps the confirmed run (common/scheduler/speculative.py)."""
        row_reqs, outputs, spans = [], [], []
        for r, d in zip(reqs, drafts, strict=True):
            spans.append((len(row_reqs), len(d) + 1))
            for j in range(len(d) + 1):
                row_reqs.append(r)
                outputs.append(r.output_ids + d[:j])
        ids, lp, tops = self._draw(row_reqs, outputs, logits)
        for i, (a, n) in enumerate(spans):
            out.next_token_ids[i] = ids[a:a + n]
            if lp is not None and reqs[i].return_logprob:
                out.token_logprobs[i] = lp[a:a + n]
                out.top_logprobs[i] = tops[a:a + n] if tops is not None else [None] * n

    @staticmethod
    def _input_logprobs(batch, logits: torch.Tensor | None, out: RunnerOutput) -> None:
        """Logprobs of prompt tokens from this chunk's logits (position p -> token p+1)."""
        b = len(batch.reqs)
        out.input_logprobs = [None] * b
        out.input_top_logprobs = [None] * b
        for i, (r, (first, count, off)) in enumerate(zip(batch.reqs, batch.extend_info.rows, strict=True)):
            if i >= batch.extend_info.num_prefill:  # a mixed chunk's decode rows come last
                break
            if not (r.want_input_logprobs and not r.input_logprobs_done) or logits is None:
                continue
            prompt = r.origin_input_ids
            # positions first..first+count-1; those < len(prompt)-1 predict prompt tokens
            n = max(min(first + count, len(prompt) - 1) - first, 0)
            if n == 0:
                out.input_logprobs[i] = []
                continue
            logp = torch.log_softmax(logits[off : off + n].float(), dim=-1)
            targets = torch.tensor(prompt[first + 1 : first + 1 + n], dtype=torch.int64, device=logits.device)
            vals = logp.gather(1, targets[:, None]).squeeze(1).tolist()
            out.input_logprobs[i] = list(zip(vals, targets.tolist(), strict=True))
            if r.top_logprobs_num > 0:
                k = min(r.top_logprobs_num, logp.shape[-1])
                tv, ti = torch.topk(logp, k, dim=-1)
                out.input_top_logprobs[i] = [list(zip(a, c, strict=True))
                                             for a, c in zip(tv.tolist(), ti.tolist(), strict=True)]

    def model_config_dict(self) -> dict:
        cfg = self.model_config
        out = {k: getattr(cfg, k) for k in ("architecture", "vocab_size", "hidden_size", "num_layers",
                                             "num_heads", "num_kv_heads", "head_dim", "context_length",
                                             "eos_token_ids", "name") if hasattr(cfg, k)}
        out["eos_token_ids"] = list(out.get("eos_token_ids") or [])
        return out


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype config.json names (`torch_dtype`, or `dtype` in newer files), for `--dtype auto` on cuda."""
    import json
    import os

    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    text = raw.get("text_config") or {}
    return raw.get("torch_dtype") or raw.get("dtype") or text.get("torch_dtype") or text.get("dtype")
