"""Mixture-of-experts models on the Llama-family decoder: Qwen3-MoE and Mixtral.

Attention is the Llama family's (Qwen3-MoE with its per-head q/k RMSNorm); the MLP of a sparse layer is
`common/layers/moe.py`'s `SparseMoE`:
* Qwen3-MoE: `num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` chosen by softmax,
  renormalised when `norm_topk_prob`. A layer is sparse when `(layer + 1) % decoder_sparse_step == 0` and
  it is not in `mlp_only_layers`; the others keep a dense MLP of `intermediate_size`.
* Mixtral: `num_local_experts` experts of `intermediate_size` on every layer, softmax top-k always
  renormalised. Its checkpoints name the block `block_sparse_moe` and the expert projections w1 / w3 /
  w2 (gate / up / down).

Both take `ep_size` (expert parallelism over the TP ranks) and `eplb` (`EplbSettings` of the balancer in
`common/layers/eplb.py`) for their sparse blocks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from common.layers.eplb import Eplb
from common.layers.moe import RoutingRule, SparseMoE
from common.models.config import ModelConfig, ModelConfigError
from common.models.llama import LlamaForCausalLM, LlamaMLP, load_checkpoint


def _sparse_layer(cfg: ModelConfig, layer_id: int) -> bool:
    raw = cfg.raw
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    return layer_id not in (raw.get("mlp_only_layers") or []) and (layer_id + 1) % step == 0


class MoeLlama(LlamaForCausalLM):
    """The Llama decoder with sparse blocks from `sparse_block`; the EP shape set before the layers are
    built (the base constructor calls `make_mlp` for each)."""

    expert_parallel = True  # the loader's test for a model that takes ep_size / eplb

    def __init__(self, config: ModelConfig, *, ep_size: int = 1, eplb=None, **kw) -> None:
        self.__dict__.update(ep_size=ep_size, eplb_settings=eplb)  # before nn.Module's own setup
        super().__init__(config, **kw)

    def sparse_block(self, experts: int, cfg: ModelConfig, layer_id: int, inter: int, rule: RoutingRule,
                     tp_rank: int, tp_size: int, tp_group, dtype: torch.dtype) -> SparseMoE:
        return SparseMoE(experts, cfg.hidden_size, inter, rule, tp_rank=tp_rank, tp_size=tp_size,
                         tp_group=tp_group, ep_size=self.ep_size, dtype=dtype,
                         eplb=Eplb.for_layer(self.eplb_settings, layer_id))


class Qwen3MoeForCausalLM(MoeLlama):
    def make_mlp(self, cfg: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, tp_group,
                 dtype: torch.dtype):
        raw = cfg.raw
        experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
        if not experts or not _sparse_layer(cfg, layer_id):
            return LlamaMLP(cfg, tp_rank, tp_size, tp_group, dtype)
        rule = RoutingRule(top_k=int(raw["num_experts_per_tok"]), renormalize=bool(raw.get("norm_topk_prob")))
        return self.sparse_block(experts, cfg, layer_id, int(raw["moe_intermediate_size"]), rule, tp_rank,
                                 tp_size, tp_group, dtype)


class MixtralForCausalLM(MoeLlama):
    def __init__(self, config: ModelConfig, **kw) -> None:
        if config.sliding_window and config.sliding_window < config.context_length:
            raise ModelConfigError(f"{config.name}: Mixtral with a sliding window of {config.sliding_window} "
                                   f"tokens under a context of {config.context_length} is not supported")
        super().__init__(config, **kw)

    def make_mlp(self, cfg: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, tp_group,
                 dtype: torch.dtype):
        rule = RoutingRule(top_k=int(cfg.raw["num_experts_per_tok"]), renormalize=True)
        return self.sparse_block(int(cfg.raw["num_local_experts"]), cfg, layer_id, cfg.intermediate_size,
                                 rule, tp_rank, tp_size, tp_group, dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, {"qkv_proj": 3, "gate_up_proj": 2},
                               rename=lambda n: n.replace(".block_sparse_moe.", ".mlp."))
