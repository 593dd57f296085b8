"""Float32 weights that are exactly a quantized checkpoint's blocks of 32, packed as those blocks.

A GGUF checkpoint's Q4_1 and Q8_0 tensors become float32 when `pdserve convert` (or `--model x.gguf`)
turns them into a Hugging Face directory: w = d * q + m (Q4_1, q in 0..15) or w = d * q (Q8_0, q in
-127..127), d and m one per 32 input channels of an output row. SmolLM2-135M's file, the default model,
has every projection in Q4_1 and the tied embedding (the lm_head) in Q8_0. `find_blocks` recovers
(q, d, m) from the float32 weight in one pass (`gemm_blocks.c: pack_weight_blocks`) and keeps them only
when they widen back to the same float32 bits (`block_panels_equal`), for every weight of the tensor;
`packed_gemm_blocks` then reads the blocks and computes on the widened float32 panel, so the matmul's
results are the float32 panels' bits while a decode step streams 5 (4-bit) or 8.5 (8-bit) bits a weight
instead of 32. Any other weight, or `PDSERVE_WEIGHT_BLOCKS=0`, keeps float32 panels. This is not quantization:
nothing is rounded that the checkpoint had not rounded.
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
    packed: torch.Tensor  # uint8, `gemm_blocks.c`'s layout


def enabled() -> bool:
    return os.environ.get("PDSERVE_WEIGHT_BLOCKS", "1") != "0" and native.block_panels_equal() is not None


def block_bytes(bits: int) -> int:
    """Bytes of one block of 16 columns by 32 input channels in `gemm_blocks.c`'s layout."""
    return 2 * PANEL * 2 + BLOCK * 8 if bits == 4 else PANEL * 2 + BLOCK * PANEL  # float16 scales


def _try(weight: torch.Tensor, panels: torch.Tensor, bits: int) -> torch.Tensor | None:
    """The blocks of `weight`'s rows if they widen to `panels` (those rows' float32 panels), else None."""
    out, inp = weight.shape
    packed = torch.empty(panels.shape[0] * (inp // BLOCK) * block_bytes(bits), dtype=torch.uint8)
    native.pack_weight_blocks()(bits, weight.data_ptr(), out, inp, packed.data_ptr())
    return packed if native.block_panels_equal()(bits, packed.data_ptr(), panels.shape[0], inp,
                                                 panels.data_ptr()) else None


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

