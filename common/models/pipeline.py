"""Pipeline parallelism inside a model (`--pp-size`): which layers a stage holds and how a stage runs
its part of a forward.

The stage `pp_rank` of `pp_size` holds the consecutive layers `layer_range(num_layers, pp_rank,
pp_size)`; the others are parameterless `MissingLayer`s, so their checkpoint tensors have no place
and are skipped. In `forward_stage` the first stage embeds, the others receive the hidden state and
residual from the same TP rank of the previous stage; every stage but the last sends them on and
returns None, the last returns the logits. An extend batch runs as micro-batches of consecutive
tokens (`micro_batches`, `ForwardBatch.token_slices`): a stage sends one on without waiting and starts
the next, so while stage 1 runs micro-batch 1, stage 0 runs micro-batch 2. A request cut between two
micro-batches goes on in the second with the first part as its prefix (its KV, and a hybrid model's
recurrent state, are in the pools by then).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.distributed import pp_isend, pp_recv
from common.forward_batch import ForwardBatch, ForwardMode

# tokens of one micro-batch at least when a pipeline stage splits an extend batch
# (PDSERVE_PP_MICRO_TOKENS); at most MAX_MICRO_BATCHES per forward
PP_MICRO_TOKENS = int(os.environ.get("PDSERVE_PP_MICRO_TOKENS", "64"))
MAX_MICRO_BATCHES = 8

# (h, residual, cos, sin, fb) -> (h, residual) over the stage's own layers
RunLayers = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, ForwardBatch],
                     tuple[torch.Tensor, torch.Tensor]]


def layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers [start, end) of pipeline stage `pp_rank`: consecutive, the first stages one longer when
    they do not divide evenly."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"{num_layers} layers cannot be split into {pp_size} pipeline stages")
    per, extra = divmod(num_layers, pp_size)
    start = pp_rank * per + min(pp_rank, extra)
    return start, start + per + (pp_rank < extra)


class MissingLayer(nn.Module):
    """A layer another pipeline stage runs: no parameters here."""


def micro_batches(fb: ForwardBatch, pp_size: int) -> int:
    """How many micro-batches a pipelined forward of `fb` runs: extend batches of at least two micro-batches'
    tokens, whose logits rows are in increasing order; 1 otherwise."""
    if fb.mode != ForwardMode.EXTEND or pp_size == 1:
        return 1
    idx = fb.logits_indices
    if idx is not None and idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
        return 1
    return max(1, min(MAX_MICRO_BATCHES, fb.input_ids.numel() // max(PP_MICRO_TOKENS, 1)))


def forward_stage(model: nn.Module, fb: ForwardBatch, run_layers: RunLayers,
                  final_logits) -> torch.Tensor | None:
    """This stage's part of a forward of `model` (its `pp_rank`, `pp_size`, `attn_backend`, `rotary` and
    `model.embed_tokens`); `final_logits(model, h, residual, fb)` on the last stage."""
    if fb.mode == ForwardMode.EXTEND and fb.logits_indices is None:
        fb.logits_indices = fb.last_token_indices()
    parts = [fb]
    n = micro_batches(fb, model.pp_size)
    if n > 1:
        parts = fb.token_slices(n)
        model.micro_batches += n
    last = model.pp_rank == model.pp_size - 1
    weight = model.model.embed_tokens.weight
    sent, logits = [], []
    for part in parts:
        if part.attn_metadata is None:
            model.attn_backend.init_forward_metadata(part)
        cos, sin = model.rotary.cos_sin(part.positions)
        if model.pp_rank == 0:
            h, residual = F.embedding(part.input_ids, weight), None
        else:  # the previous stage's hidden state and residual
            h = torch.empty(part.input_ids.numel(), weight.shape[1], dtype=weight.dtype)
            residual = torch.empty_like(h)
            pp_recv([h, residual], model.pp_rank - 1)
        h, residual = run_layers(h, residual, cos, sin, part)
        if not last:
            sent.append(pp_isend([h, residual], model.pp_rank + 1))
        elif part.logits_indices is None or part.logits_indices.numel():
            logits.append(final_logits(model, h, residual, part))
    for pending in sent:
        pending.wait()
    if not last:
        return None
    return logits[0] if len(logits) == 1 else torch.cat(logits)
