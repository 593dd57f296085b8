"""Tensor-parallel linear layers with weight loaders that slice full Hugging Face weights.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that copies this
rank's part of a full (unsharded) checkpoint tensor into it:

* `ColumnParallelLinear`: output features split over ranks (weight `[out / tp, in]`).
* `MergedColumnParallelLinear`: several column-parallel outputs fused in one matmul
  (gate_proj + up_proj); `shard_id` is the index of the part.
* `QKVParallelLinear`: q, k and v projections fused; `shard_id` is "q", "k" or "v". When there are
  fewer KV heads than ranks, each rank holds one KV head, replicated over `tp / kv_heads` ranks.
* `RowParallelLinear`: input features split over ranks (weight `[out, in / tp]`); the partial
  outputs are summed with an all-reduce, and the bias is added once, after the reduce.

Packed weights: once the checkpoint is loaded, `pack_linears(model)` repacks every fp32 CPU weight
(and a tied lm_head) and drops the plain copy (the parameter stays, on the meta device, for its
shape). With the native kernels (`common/layers/native.py`, AVX2 + FMA) the weight is cut into
16-column panels, `[ceil(out / 16), in, 16]`, for `gemm.c`, which reads each weight once per matmul
whatever the batch; without them it goes to oneDNN's blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`). On the SmolLM2 decode shapes here, with the weights
streaming from DRAM, the panel GEMM does a batch-16 step's matmuls at ~160 GFLOPS with AVX-512's
two-panel tile (SmolLM2's 30 layers of projections, 425 MB: 21 ms; ~100-130 GFLOPS with one panel, when
oneDNN did ~75 and F.linear ~40; `bench/engine.py` measures the whole step). `PDSERVE_PACKED_LINEAR=onednn`
picks oneDNN, `PDSERVE_PACKED_LINEAR=0` keeps the plain `F.linear` path.

Weights that are exactly a GGUF checkpoint's blocks of 32 (Q4_1 or Q8_0, as the default model's): each
such float32 panel weight also keeps those blocks (`weight_blocks.py`, `Panels.blocks`, gathered in one
huge-page allocation in forward order), and matmuls of at most `native.block_rows()` rows read them
(`gemm_blocks.c`), with the float32 panels' bits; larger matmuls read the float32 panels.

Int8 weights (`--torchao-config int8wo`, SGLang's name for torchao's int8 weight-only scheme): each
output row is quantized symmetrically at load, `scale = max|w| / 127`, `q = round(w / scale)`, into
int8 panels of the same layout, and `gemm.c` widens each byte to float32 in registers, so activations
and accumulation stay float32 while a decode step, bound by memory bandwidth, streams a quarter of the
bytes. A tied lm_head is quantized too (the embedding keeps its float32 copy). It needs the native
kernels; the checks against transformers stay on float32, and `pdserve bench quant` measures what
int8 costs in perplexity and greedy agreement.

Int8 weights and activations (`--quantization w8a8_int8`, SGLang's name): the weights are quantized per
output row as above but within [-64, 64] (so AVX2's byte multiply-add never saturates), laid out in
groups of four steps of k, with AVX2 each block led by its weight sums (`w8a8_panels`), and each row of
activations is quantized as it enters the matmul, per token and per block of 64 input channels, so the
products are exact int32 sums, scaled once per block (the same bits from the AVX2 and the AVX-512 VNNI
build; `gemm_w8a8.c`). The lm_head stays weight-only
int8 (the path above): its activations remain float32, so the logits see no activation rounding.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from common.distributed import tensor_model_parallel_all_reduce
from common.layers import native
from common.layers.weight_blocks import BLOCK, WeightBlocks, find_blocks
from common.memory.huge_pages import huge_zeros

logger = logging.getLogger(__name__)

PANEL = 16  # output columns per panel of the native GEMM's weight layout
QUANTIZATIONS = ("int8wo", "w8a8_int8")  # --torchao-config int8wo, --quantization w8a8_int8
W8A8 = "w8a8_int8"


@dataclass(frozen=True)
class Panels:
    """A weight in the native GEMM's layout, `[ceil(out / 16), in, 16]`: float32, or int8 with one
    float32 `scale` per output column (padded to whole panels); with `int8_activations`, int8 in groups
    of k (`w8a8_panels`), for `gemm_w8a8.c`. A float32 weight that is exactly a checkpoint's blocks of 32
    also has them as `blocks` (`weight_blocks.py`), which matmuls of at most `native.block_rows()` rows
    read instead."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    int8_activations: bool = False
    blocks: WeightBlocks | None = None


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor parallel size ({b})")
    return a // b


def _packing(weight: torch.Tensor) -> str | None:
    """How `pack_weight` packs this weight: "panels", "onednn", or None (plain F.linear)."""
    mode = os.environ.get("PDSERVE_PACKED_LINEAR", "1")
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or mode == "0":
        return None
    if mode != "onednn" and native.packed_gemm() is not None:
        return "panels"
    return "onednn" if torch.backends.mkldnn.is_available() else None


def panel_numel(weight: torch.Tensor, quantization: str | None = None) -> int:
    out, inp = weight.shape
    if quantization == W8A8:  # K padded to whole blocks; with AVX2 each block led by its sums (int32)
        _, block, _, comp_lines = native.w8a8_layout()
        inp = -(-inp // block) * block
        return -(-out // PANEL) * (PANEL * inp + comp_lines * PANEL * 4 * inp // block)
    return -(-out // PANEL) * PANEL * inp


def _flag(quantization: str) -> str:
    return f"--quantization {quantization}" if quantization == W8A8 else f"--torchao-config {quantization}"


def quantize_int8(weight: torch.Tensor, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric int8 within [-levels, levels]: (q [out, in] int8, scale [out] float32),
    weight ~ q * scale."""
    w = weight.detach().to(torch.float32)
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / levels
    q = torch.round(w / scale[:, None]).clamp_(-levels, levels).to(torch.int8)
    return q, scale


def pack_weight(weight: torch.Tensor, into: torch.Tensor | None = None,
                quantization: str | None = None) -> Panels | torch.Tensor | None:
    """The packed copy of an `[out, in]` weight: `Panels` for the native GEMM (written into `into`,
    `panel_numel(weight)` elements of the panels' dtype, when given; int8 with `quantization="int8wo"`),
    else oneDNN's blocked layout; None where the plain path is used (not fp32 on CPU, or
    `PDSERVE_PACKED_LINEAR=0`)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"weight quantization {quantization!r} is not one of {QUANTIZATIONS}")
    how = _packing(weight)
    if quantization is not None and how != "panels":
        raise ValueError(f"{_flag(quantization)} needs the native kernels (AVX2 + FMA and a C compiler) "
                         "and PDSERVE_PACKED_LINEAR unset")
    weight = weight.detach()
    if how == "panels":
        out, inp = weight.shape
        panels = -(-out // PANEL)
        scale = None
        if quantization is not None:
            levels = native.w8a8_layout()[2] if quantization == W8A8 else 127
            weight, row_scale = quantize_int8(weight, levels)
            scale = torch.ones(panels * PANEL)
            scale[:out] = row_scale
        dst = torch.empty(panel_numel(weight, quantization), dtype=weight.dtype) if into is None else into
        if quantization == W8A8:
            return Panels(w8a8_panels(weight, native.w8a8_layout(), dst), scale, int8_activations=True)
        if out % PANEL:  # the last panel's missing columns are zeros
            padded = weight.new_zeros(panels * PANEL, inp)
            padded[:out] = weight
        else:  # no padded copy of a whole weight (SmolLM2's are all whole panels)
            padded = weight.contiguous()
        dst = dst.view(panels, inp, PANEL)
        dst.copy_(padded.view(panels, PANEL, inp).transpose(1, 2))
        return Panels(dst, scale, blocks=None if quantization else find_blocks(weight, dst))
    if how == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight)
    return None


def w8a8_panels(q: torch.Tensor, layout: tuple[int, ...], into: torch.Tensor | None = None) -> torch.Tensor:
    """Int8 `[out, in]` as `gemm_w8a8.c` reads it, for `layout` = (group, block, ...)
    (`native.w8a8_layout()`): `[ceil(out / 16), in' / block, B]` int8, the input padded with zeros to
    `in'` (whole blocks of the activation scales), each panel's block of B bytes: where the layout asks
    for it, 16 int32, -128 times the block's sum of each column's weights (where the kernel's sums start,
    as its activations are x + 128), then its weights as `[block / group, 16, group]` (`group` steps of k
    of 16 columns per line)."""
    group, block, _, comp_lines = layout
    out, inp = q.shape
    kp = -(-inp // block) * block
    panels, blocks = -(-out // PANEL), kp // block
    padded = q.new_zeros(panels * PANEL, kp)
    padded[:out, :inp] = q
    lead = comp_lines * PANEL * 4  # the block's sums, 16 int32
    size = panels * blocks * (lead + PANEL * block)
    dst = torch.empty(size, dtype=torch.int8) if into is None else into
    dst = dst.view(panels, blocks, lead + PANEL * block)
    by_block = padded.view(panels, PANEL, blocks, block)
    dst[:, :, lead:].view(panels, blocks, block // group, PANEL, group).copy_(
        by_block.view(panels, PANEL, blocks, block // group, group).permute(0, 2, 3, 1, 4))
    if lead:
        dst[:, :, :lead].view(torch.int32).copy_(by_block.to(torch.int32).sum(3).transpose(1, 2) * -128)
    return dst


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias` on whichever copy `pack_weight` made (`weight` gives the output size)."""
    if packed is None:
        return F.linear(x, weight, bias)
    if isinstance(packed, Panels):
        return _panel_linear(x, packed, weight.shape[0], bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _panel_linear(x: torch.Tensor, packed: Panels, out: int, bias: torch.Tensor | None) -> torch.Tensor:
    # called ~120 times per decode step: keep the Python side to the minimum
    w = packed.weight
    inp = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, inp)
    if rows.stride(1) != 1 or rows.dtype != torch.float32:
        rows = rows.to(torch.float32).contiguous()
    y = torch.empty(rows.shape[0], out)
    b = None if bias is None else bias.data_ptr()
    if packed.blocks is not None and rows.shape[0] <= native.block_rows():
        blocks = packed.blocks
        rc = native.packed_gemm_blocks()(rows.data_ptr(), rows.stride(0),
                                         blocks.packed.data_ptr(), blocks.bits, b,
                                         y.data_ptr(), out, rows.shape[0], out, inp)
    elif packed.scale is None:
        rc = native.packed_gemm()(rows.data_ptr(), rows.stride(0), w.data_ptr(), b,
                                  y.data_ptr(), out, rows.shape[0], out, inp)
    else:
        gemm = native.packed_gemm_w8a8() if packed.int8_activations else native.packed_gemm_i8()
        rc = gemm(rows.data_ptr(), rows.stride(0), w.data_ptr(),
                  packed.scale.data_ptr(), b, y.data_ptr(), out, rows.shape[0], out, inp)
    if rc:
        raise MemoryError(f"panel matmul: no memory for {rows.shape[0]} x {inp} packed activations")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], out)


def _packed_weight_loader(param, loaded, shard_id=None) -> None:
    raise RuntimeError("this layer's weight was packed for oneDNN; load checkpoints before pack_linears()")


class PackableLinear(nn.Module):
    """A linear layer whose `weight` may be swapped for oneDNN's packed copy (`pack()`)."""

    packed: Panels | torch.Tensor | None = None

    def pack(self, into: torch.Tensor | None = None, quantization: str | None = None) -> None:
        packed = pack_weight(self.weight, into, quantization)
        if packed is None:
            return
        self.packed = packed
        # the plain copy is freed; a meta parameter keeps the shape for introspection
        meta = nn.Parameter(torch.empty(self.weight.shape, dtype=self.weight.dtype, device="meta"),
                            requires_grad=False)
        meta.weight_loader = _packed_weight_loader
        self.weight = meta

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, self.weight, self.packed, bias)


def pack_linears(model: nn.Module, quantization: str | None = None) -> None:
    """Pack every linear layer of a loaded model, and a tied lm_head (kept plain for the embedding,
    packed as `model.lm_head_packed`), as int8 with `quantization` ("int8wo" or "w8a8_int8"; the lm_head
    is weight-only int8 with either). Panel-packed weights share one huge-page allocation, in forward
    order, so a decode step streams them as one sequential run."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"weight quantization {quantization!r} is not one of {QUANTIZATIONS}")
    layers = [m for m in model.modules() if isinstance(m, PackableLinear)]
    head = getattr(model, "lm_head", False)
    tied = head is None
    head_quantization = "int8wo" if quantization else None
    schemes = [head_quantization if m is head else quantization for m in layers] \
        + ([head_quantization] if tied else [])
    weights = [m.weight for m in layers] + ([model.lm_head_weight] if tied else [])
    sizes = [panel_numel(w, q) if _packing(w) == "panels" else 0
             for w, q in zip(weights, schemes, strict=True)]
    dtype = torch.int8 if quantization else torch.float32
    arena = huge_zeros(sum(sizes), dtype) if sum(sizes) else None
    views, offset = [], 0
    for n in sizes:
        views.append(arena[offset:offset + n] if n else None)
        offset += n
    for m, into, q in zip(layers, views[:len(layers)], schemes[:len(layers)], strict=True):
        m.pack(into, q)
    if tied:
        model.lm_head_packed = pack_weight(model.lm_head_weight, views[-1], head_quantization)
    _gather_blocks(layers, model if tied else None)


def _gather_blocks(layers: list[PackableLinear], tied_model: nn.Module | None) -> None:
    """Move every weight's blocks into one huge-page allocation, in forward order (as the panels), and say
    what was found."""
    owners = [(m, "packed") for m in layers] + ([(tied_model, "lm_head_packed")]
                                                if tied_model is not None else [])
    packed = [(o, attr, getattr(o, attr)) for o, attr in owners if isinstance(getattr(o, attr), Panels)]
    found = [(o, attr, p) for o, attr, p in packed if p.blocks is not None]
    if not found:
        return
    align = 64
    sizes = [-(-p.blocks.packed.numel() // align) * align for _, _, p in found]
    arena = huge_zeros(sum(sizes), torch.uint8)
    offset = 0
    for (owner, attr, p), n in zip(found, sizes, strict=True):
        view = arena[offset:offset + p.blocks.packed.numel()]
        view.copy_(p.blocks.packed)
        setattr(owner, attr, replace(p, blocks=WeightBlocks(p.blocks.bits, view)))
        offset += n
    by_bits = {bits: sum(1 for *_, p in found if p.blocks.bits == bits) for bits in (4, 8)}
    logger.info("weights: %d of %d packed matmuls are exactly 4-bit (%d) or 8-bit (%d) blocks of %d; small "
                "matmuls (at most %d rows at %d threads) read those (%.1f MB) instead of float32",
                len(found), len(packed),
                by_bits[4], by_bits[8], BLOCK, native.block_rows(), torch.get_num_threads(), sum(sizes) / 1e6)


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def _copy_checked(param: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: checkpoint slice has shape {tuple(src.shape)}, "
                         f"the model expects {tuple(param.shape)}")
    param.data.copy_(src.to(param.dtype))


class ColumnParallelLinear(PackableLinear):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, tp_rank: int = 0,
                 tp_size: int = 1, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size = input_size
        self.output_size_per_partition = _divide(output_size, tp_size, "output size")
        self.weight = _param(self.output_size_per_partition, input_size, dtype=dtype)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(self.output_size_per_partition, dtype=dtype)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.output_size_per_partition
        _copy_checked(param, loaded.narrow(0, self.tp_rank * n, n), type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel outputs of several projections in one weight: `[part0 | part1 | ...]` per rank."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, *, tp_rank: int = 0,
                 tp_size: int = 1, dtype: torch.dtype = torch.float32) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)
        self.local_sizes = [_divide(s, tp_size, "output size") for s in output_sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs the index of the part being loaded")
        n = self.local_sizes[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        _copy_checked(param.data.narrow(0, offset, n), loaded.narrow(0, self.tp_rank * n, n),
                      f"merged part {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections fused: this rank's output is `[q heads | k heads | v heads]`."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32) -> None:
        self.head_dim = head_dim
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp_size, "number of attention heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size, "number of KV heads")
            self.kv_head_start = tp_rank * self.num_kv_heads
        else:
            _divide(tp_size, total_num_kv_heads, "TP size over KV heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank // (tp_size // total_num_kv_heads)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id == "q":
            dst = param.data.narrow(0, 0, self.q_size)
            src = loaded.narrow(0, self.tp_rank * self.q_size, self.q_size)
        elif shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            dst = param.data.narrow(0, offset, self.kv_size)
            src = loaded.narrow(0, self.kv_head_start * self.head_dim, self.kv_size)
        else:
            raise ValueError(f"QKVParallelLinear shard id must be q, k or v, got {shard_id!r}")
        _copy_checked(dst, src, f"{shard_id}_proj")


class RowParallelLinear(PackableLinear):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, tp_rank: int = 0,
                 tp_size: int = 1, tp_group=None, reduce_results: bool = True,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp_rank, self.tp_size, self.tp_group = tp_rank, tp_size, tp_group
        self.reduce_results = reduce_results
        self.input_size_per_partition = _divide(input_size, tp_size, "input size")
        self.weight = _param(output_size, self.input_size_per_partition, dtype=dtype)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _param(output_size, dtype=dtype)
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.input_size_per_partition
        _copy_checked(param, loaded.narrow(1, self.tp_rank * n, n), type(self).__name__)

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param, loaded, "row parallel bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # nothing to reduce: the bias goes in with the matmul
            return self.matmul(x, self.bias)
        y = self.matmul(x)
        if self.reduce_results:
            y = tensor_model_parallel_all_reduce(y, self.tp_group)
        if self.bias is not None:
            y = y + self.bias
        return y


class ReplicatedLinear(PackableLinear):
    """Same full weight on every rank (the lm_head)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = _param(output_size, input_size, dtype=dtype)
        self.weight.weight_loader = self.weight_loader
        self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)
