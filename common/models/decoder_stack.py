"""Forwards of a Llama-family model through `decoder_stack.c`: every layer in one native call.

The layer modules of `common/models/llama.py` run ~10 native kernels per layer with ~40 small tensor
operations around them. At decode batch sizes that Python costs several milliseconds per step; in a
prefill the kernels are long, but the second OpenMP thread idles through the Python between them (~6 % of
a 512-token prefill of SmolLM2 on two cores). When a model qualifies, `DecoderStack.run` hands the whole
stack to the C driver, which chains the same kernels in the same order (so the logits are the same), and
leaves `h` and `residual` where the layer loop would, for `final_logits`.

A model qualifies when: the native kernels are built, one TP rank (no all-reduce between layers) and
one pipeline stage, no per-head q/k norm, every projection panel-packed (`common/layers/linear.py`;
float32 or int8 panels, the same kind throughout a layer; float32 ones with their checkpoint's blocks
where it has them), float32 norms, and the plain attention backend (not a sliding-window one). A batch
qualifies when it is
* a decode batch on the native attention path (`TorchAttentionMetadata.rows`), or a speculative verify
  batch on it (each token a query of its own);
* an extend batch on the native prefill attention (`prefill_attention.c`, a float32 pool) in which no
  request has a cached prefix (each attends to its own new tokens, read in place). Its last layer
  stores every token's K and V but runs the attention, its projection and the MLP on the rows whose
  logits are wanted only (`LlamaForCausalLM.rows_going_on`; the modules run the MLP on those rows).

Everything else runs the modules. `PDSERVE_DECODER_STACK=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os

import torch

from common.forward_batch import ForwardBatch, ForwardMode
from common.layers import native
from common.layers.attention import TorchAttentionBackend
from common.layers.linear import Panels

_P, _I64, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


PROJECTIONS = ("qkv", "o", "gate_up", "down")


class _Layer(ctypes.Structure):
    _fields_ = ([(name, _P) for name in ("input_norm", "post_norm", *PROJECTIONS)]
                + [(p + "_bias", _P) for p in PROJECTIONS] + [(p + "_scale", _P) for p in PROJECTIONS]
                + [(p + "_blocks", _P) for p in PROJECTIONS] + [(p + "_bits", _I64) for p in PROJECTIONS]
                + [("kv_offset", _I64), ("int8_activations", _I64)])


class _Step(ctypes.Structure):
    _fields_ = ([(name, _I64) for name in ("hidden", "heads", "kv_heads", "head_dim", "inter")]
                + [("eps", _F32), ("scale", _F32), ("tokens", _I64), ("cos", _P), ("sin", _P), ("pool", _P),
                   ("rows", _P), ("lens", _P), ("write_rows", _P), ("max_len", _I64), ("v_offset", _I64)]
                + [(name, _P) for name in ("qkv", "qk", "attn", "x", "gate_up", "act")]
                + [("seqs", _I64), ("seq_starts", _P), ("seq_lens", _P), ("keep", _P), ("n_keep", _I64)])


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class DecoderStack:
    """Built once per model (`for_model`); None when the model does not qualify."""

    def __init__(self, model, kernel) -> None:
        cfg = model.config
        self.kernel = kernel
        first = model.model.layers[0]
        attn = first.self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden = cfg.hidden_size
        self.inter = first.mlp.down_proj.input_size_per_partition
        self.eps = first.input_layernorm.variance_epsilon
        self.scale = model.attn_backend.scaling
        # no reference to the model
        self.layer_ids = [layer.self_attn.layer_id for layer in model.model.layers]
        self.layers = (_Layer * len(model.model.layers))()
        self._offsets_for = None  # the KV pool the layer offsets were filled for
        backend = model.attn_backend
        self.extends = backend.native_prefill is not None and backend.native_store is not None
        for i, layer in enumerate(model.model.layers):
            a, m = layer.self_attn, layer.mlp
            projs = (a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj)
            self.layers[i] = _Layer(
                _ptr(layer.input_layernorm.weight), _ptr(layer.post_attention_layernorm.weight),
                *(_ptr(p.packed.weight) for p in projs), *(_ptr(p.bias) for p in projs),
                *(_ptr(p.packed.scale) for p in projs),
                *(_ptr(p.packed.blocks and p.packed.blocks.packed) for p in projs),
                *(p.packed.blocks.bits if p.packed.blocks else 0 for p in projs),
                0, int(a.qkv_proj.packed.int8_activations))

    @classmethod
    def for_model(cls, model) -> DecoderStack | None:
        kernel = native.decoder_stack()
        if kernel is None or os.environ.get("PDSERVE_DECODER_STACK", "1") == "0":
            return None
        cfg = model.config
        layers = list(model.model.layers)
        if (model.tp_size != 1 or getattr(model, "pp_size", 1) != 1 or cfg.qk_norm or not layers
                or type(model.attn_backend) is not TorchAttentionBackend  # e.g. sliding-window backends
                # torch_native: attention through the backend's torch ops
                or model.attn_backend.native is None):
            return None
        for layer in layers:
            if not hasattr(layer.mlp, "gate_up_proj"):  # a mixture-of-experts block
                return None
            projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj)
            if any(not isinstance(p.packed, Panels) for p in projections):
                return None
            if len({(p.packed.scale is None, p.packed.int8_activations) for p in projections}) != 1:
                return None
            if any(n.weight.dtype != torch.float32
                   for n in (layer.input_layernorm, layer.post_attention_layernorm)):
                return None
        return cls(model, kernel)

    def accepts(self, fb: ForwardBatch) -> bool:
        md = fb.attn_metadata
        if md is None or fb.input_ids.numel() == 0:
            return False
        if fb.mode in (ForwardMode.DECODE, ForwardMode.VERIFY):
            return md.rows is not None
        return (fb.mode == ForwardMode.EXTEND and self.extends and fb.kv_pool.flat.dtype == torch.float32
                and bool(md.items) and all(it.prefix == 0 for it in md.items))

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
            keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over `h` (`[T, hidden]`, updated in place); returns `(h, residual)`. `keep`: the rows
        that go on past the last layer's attention, in any order (an extend's; the results are then those
        rows only, in that order)."""
        pool, md = fb.kv_pool, fb.attn_metadata
        if self._offsets_for is not pool:
            for i, layer_id in enumerate(self.layer_ids):
                self.layers[i].kv_offset = pool.layer_offset(layer_id)
            self._offsets_for = pool
        t, d, hq, hk = h.shape[0], self.head_dim, self.heads, self.kv_heads
        scratch = [torch.empty(t, n) for n in ((hq + 2 * hk) * d, (hq + hk) * d, hq * d, self.hidden,
                                               2 * self.inter, self.inter)]
        residual = torch.empty_like(h)
        step = _Step(self.hidden, hq, hk, d, self.inter, self.eps, self.scale, t,
                     cos.data_ptr(), sin.data_ptr(), pool.flat.data_ptr(), _ptr(md.rows), _ptr(md.lens),
                     md.write_rows.data_ptr(), md.max_len, pool.v_offset, *(s.data_ptr() for s in scratch))
        if md.rows is None:  # an extend
            spans = torch.tensor([[it.start, it.n] for it in md.items], dtype=torch.int64)
            starts, lens = spans.T.contiguous()  # both alive until the call returns
            step.seqs, step.seq_starts, step.seq_lens = len(md.items), starts.data_ptr(), lens.data_ptr()
            if keep is not None:
                keep = keep.to(torch.int64).contiguous()
                step.keep, step.n_keep = keep.data_ptr(), keep.numel()
        rc = self.kernel(ctypes.addressof(self.layers), len(self.layers),
                         ctypes.addressof(step), h.data_ptr(), residual.data_ptr())
        if rc != 0:
            raise RuntimeError(f"native decoder stack failed ({rc})")
        if step.keep:
            return h[:step.n_keep], residual[:step.n_keep]
        return h, residual
