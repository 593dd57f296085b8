"""Float32 weights that are exactly a quantized checkpoint's blocks of 32, packed as those blocks.

A GGUF checkpoint's Q4_1 and Q8_0 tensors become float32 when `pdserve convert` (or `--model x.gguf`)
turns them into a Hugging Face directory: w = d * q + m (Q4_1, q in 0..15) or w = d * q (Q8_0, q in
-127..127), d and m one per 32 input channels of an output row. SmolLM2-135M's file, the default model,
has every projection in Q4_1 and the tied embedding (the lm_head) in Q8_0. `find_blocks` recovers
(q, d, m) from the float32 weight and keeps them only when `weight_blocks.c` expands them back to the
same float32 bits, for every weight of the tensor; `gemm.c` then reads the blocks and computes on the
expanded float32 panel, so the matmul's results are the float32 panels' bits while a decode step streams
~6 (4-bit) or ~9 (8-bit) bits a weight instead of 32. Any other weight, or `PDSERVE_WEIGHT_BLOCKS=0`,
keeps float32 panels. This is not quantization: nothing is rounded that the checkpoint had not rounded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from common.layers import native

BLOCK = 32  # input channels per (d, m), as GGUF's Q4_1 and Q8_0
PANEL = 16  # output columns per panel (gemm.c)
SAMPLE_ROWS = 16  # rows tried first, so a weight of another kind is turned down cheaply


@dataclass(frozen=True)
class WeightBlocks:
    bits: int  # 4 or 8
    packed: torch.Tensor  # uint8, `weight_blocks.c`'s layout


def enabled() -> bool:
    return os.environ.get("PDSERVE_WEIGHT_BLOCKS", "1") != "0" and native.expand_block_panels() is not None


def _split(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q, d, m) for `v` [rows, blocks, 32] as Q4_1 (bits 4) or Q8_0 (bits 8) would have stored it."""
    if bits == 4:
        m = v.amin(-1, keepdim=True)
        d = ((v.amax(-1, keepdim=True) - m) / 15).half().float()  # GGUF keeps d and m in float16
        lo, hi = 0, 15
    else:
        m = None
        d = v.abs().amax(-1, keepdim=True) / 127
        lo, hi = -127, 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((v if m is None else v - m) / safe).clamp_(lo, hi)
    return q.to(torch.int16), d.squeeze(-1), None if m is None else m.squeeze(-1)


def _pack(bits: int, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """`weight_blocks.c`'s layout of q [out, blocks, 32], d and m [out, blocks]."""
    out, nb, _ = q.shape
    panels = -(-out // PANEL)
    pad = panels * PANEL - out
    if pad:
        q = torch.cat([q, q.new_zeros(pad, nb, BLOCK)])
        d = torch.cat([d, d.new_zeros(pad, nb)])
        m = None if m is None else torch.cat([m, m.new_zeros(pad, nb)])

    def per_block(t: torch.Tensor) -> torch.Tensor:  # [panels * 16, nb] float -> [panels, nb, 64] bytes
        return t.view(panels, PANEL, nb).transpose(1, 2).contiguous().view(torch.uint8)

    qk = q.view(panels, PANEL, nb, BLOCK).permute(0, 2, 3, 1)  # [panels, nb, k, column]
    if bits == 4:
        qb = (qk[..., :8] | (qk[..., 8:] << 4)).to(torch.uint8).reshape(panels, nb, BLOCK * 8)
        parts = [per_block(d), per_block(m), qb]
    else:
        qb = qk.to(torch.int8).reshape(panels, nb, BLOCK * 16).view(torch.uint8)
        parts = [per_block(d), qb]
    return torch.cat(parts, dim=2).reshape(-1)


def _try(weight: torch.Tensor, panels: torch.Tensor, bits: int) -> torch.Tensor | None:
    """The blocks of `weight`'s rows if they widen to `panels` (those rows' float32 panels), else None."""
    out, inp = weight.shape
    packed = _pack(bits, *_split(weight.view(out, inp // BLOCK, BLOCK), bits))
    expanded = torch.empty(panels.shape)
    native.expand_block_panels()(bits, packed.data_ptr(), panels.shape[0], inp, expanded.data_ptr())
    return packed if torch.equal(expanded.view(torch.int32), panels.view(torch.int32)) else None


def find_blocks(weight: torch.Tensor, panels: torch.Tensor) -> WeightBlocks | None:
    """The weight ([out, in] float32 on CPU) as 4-bit or 8-bit blocks of 32 that widen to `panels` (its
    float32 panels, `[ceil(out / 16), in, 16]`, as `linear.pack_weight` made them) bit for bit, or None (it is
    not such a weight, `in` is not a multiple of 32, or blocks are turned off)."""
    if (weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or weight.shape[1] % BLOCK or not enabled()):
        return None
    weight, panels = weight.detach().contiguous(), panels.contiguous()
    for bits in (4, 8):
        if _try(weight[:SAMPLE_ROWS], panels[:SAMPLE_ROWS // PANEL], bits) is None:
            continue
        packed = _try(weight, panels, bits)
        if packed is not None:
            return WeightBlocks(bits, packed)
    return None

