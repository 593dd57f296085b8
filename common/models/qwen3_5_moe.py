"""Qwen3.5-MoE text model (transformers' `Qwen3_5MoeForCausalLM`, or the text part of
`Qwen3_5MoeForConditionalGeneration`).

It is the Qwen3.5 decoder of `common/models/qwen3_5.py` unchanged (Gated DeltaNet linear-attention layers
interleaved with gated full attention, the same per-request conv and recurrent state, the same norms and
rotary embedding) with the dense MLP of every layer replaced by a mixture-of-experts block that also has a
shared expert. For each token x the block (`SharedExpertMoE`) computes:
* routed: the router (`mlp.gate`, a `[num_experts, hidden]` linear) scores the `num_experts` experts by a
  softmax in float32, keeps the `num_experts_per_tok` best and renormalises their weights to sum to one
  (always: this family's config has no switch for it). Each expert is a SiLU-gated MLP of
  `moe_intermediate_size` features; the result is the weighted sum of the chosen experts' outputs
  (`common/layers/moe.py`'s `SparseMoE`).
* shared: one more SiLU-gated MLP, of `shared_expert_intermediate_size` features (`mlp.shared_expert`),
  that every token goes through, scaled per token by `sigmoid(shared_expert_gate(x))` (a `[1, hidden]`
  linear).
* out = routed + shared.

Checkpoints: transformers 5 saves the experts one by one (`mlp.experts.<e>.gate_proj/up_proj/down_proj`);
stacked ones (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`) load as well. The
multimodal checkpoint keeps the text weights under `model.language_model.` (its vision tower is not
loaded). The draft layer (`mtp.*`, common/models/mtp.py) is a gated full-attention layer whose MLP is the
same sparse block with a shared expert.

Tensor parallelism: attention and linear attention as in Qwen3.5. Every routed expert and the shared
expert split their intermediate features over the TP ranks (with expert parallelism, `ep_size` > 1, the
routed experts are split over the EP ranks instead, see `GroupedExperts`); each rank adds its partial
routed and shared outputs and the block all-reduces that sum once. The sigmoid gate is a per-token scale
(its `[1, hidden]` weight is on every rank), so it applies to each rank's partial sum as to the total.
"""

from __future__ import annotations

import torch
from torch import nn

from common.distributed import tensor_model_parallel_all_reduce
from common.layers.activation import silu_and_mul
from common.layers.eplb import Eplb
from common.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from common.layers.moe import RoutingRule, SparseMoE
from common.models.config import ModelConfig, ModelConfigError
from common.models.qwen3_5 import Qwen3_5ForCausalLM

MOE_KEYS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


class SharedExpert(nn.Module):
    """The shared expert: a SiLU-gated MLP split over TP as `LlamaMLP` is, its row-parallel down projection
    left unreduced (the block reduces it with the routed experts' output)."""

    def __init__(self, hidden: int, inter: int, *, tp_rank: int, tp_size: int, tp_group,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], tp_rank=tp_rank,
                                                       tp_size=tp_size, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, hidden, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                                           reduce_results=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class SharedExpertMoE(SparseMoE):
    """`SparseMoE` (router `gate`, `experts`, with its expert parallelism `ep_size` / `eplb`) plus the gated
    `shared_expert`; one TP all-reduce for both."""

    def __init__(self, num_experts: int, hidden: int, inter: int, shared_inter: int, rule: RoutingRule, *,
                 tp_rank: int = 0, tp_size: int = 1, tp_group=None, ep_size: int = 1, eplb=None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(num_experts, hidden, inter, rule, tp_rank=tp_rank, tp_size=tp_size,
                         tp_group=tp_group, ep_size=ep_size, eplb=eplb, dtype=dtype, reduce=False)
        if shared_inter % tp_size:
            raise ModelConfigError(f"shared expert intermediate size {shared_inter} does not split over TP "
                                   f"size {tp_size}")
        self.shared_expert = SharedExpert(hidden, shared_inter, tp_rank=tp_rank, tp_size=tp_size,
                                          tp_group=tp_group, dtype=dtype)
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)  # this rank's partial sum, not reduced
        shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
        return tensor_model_parallel_all_reduce(routed + shared, self.tp_group)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """See the module docstring. `ep_size` / `eplb`: expert parallelism over the TP ranks and its balancer
    (`common/layers/eplb.py`'s settings), for the routed experts of every layer."""

    expert_parallel = True  # the loader's test for a model that takes ep_size / eplb

    def __init__(self, config: ModelConfig, *, ep_size: int = 1, eplb=None, **kw) -> None:
        missing = [k for k in MOE_KEYS if not config.raw.get(k)]
        if missing:
            raise ModelConfigError(f"{config.name}: a Qwen3.5-MoE config needs {', '.join(missing)}")
        # read by make_mlp, which the base constructor calls for each layer: set before nn.Module's setup
        self.__dict__.update(ep_size=ep_size, eplb_settings=eplb)
        super().__init__(config, **kw)

    def make_mlp(self, cfg: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, tp_group,
                 dtype: torch.dtype) -> SharedExpertMoE:
        raw = cfg.raw
        if cfg.hidden_act not in ("silu", "swish"):
            raise ModelConfigError(f"unsupported hidden_act {cfg.hidden_act!r} (supported: silu)")
        eplb = Eplb.for_layer(self.eplb_settings, layer_id)
        rule = RoutingRule(top_k=int(raw["num_experts_per_tok"]), renormalize=True)
        return SharedExpertMoE(int(raw["num_experts"]), cfg.hidden_size, int(raw["moe_intermediate_size"]),
                               int(raw["shared_expert_intermediate_size"]), rule, tp_rank=tp_rank,
                               tp_size=tp_size, tp_group=tp_group, ep_size=self.ep_size, eplb=eplb,
                               dtype=dtype)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The multimodal checkpoint served text-only (its `text_config`, `model.language_model.*` weights)."""
