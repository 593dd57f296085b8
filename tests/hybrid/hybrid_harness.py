"""Tiny random-weight hybrid (Qwen3.5-style) and sliding-window models saved as Hugging Face
directories, and a hand-driven harness (pools + ForwardBatch) for extend and decode steps with one
state slot per request, as the scheduler does it."""

from __future__ import annotations

import os
import random

import torch

from common.hybrid import HybridSupport
from common.models.config import ModelConfig
from tests.model_harness import Harness

VOCAB = 256
QWEN35_LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def _perturb_norms(model, seed: int) -> None:
    """Random-init norms are all ones/zeros; perturb them so a wrong norm formula shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)


def make_qwen3_5(path: str, seed: int = 0, **overrides):
    """A tiny Qwen3.5 text model (3 linear-attention layers, 1 full-attention layer); returns the HF model."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4,
              layer_types=list(QWEN35_LAYER_TYPES), max_position_embeddings=1024, tie_word_embeddings=False,
              eos_token_id=VOCAB - 1, bos_token_id=1)
    kw.update(overrides)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kw)).eval()
    _perturb_norms(model, seed)
    model.save_pretrained(path)
    return model


def make_qwen3_5_moe(path: str, seed: int = 0, **overrides):
    """`make_qwen3_5`'s layout with Qwen3.5-MoE's sparse block on every layer: top-2 of 4 experts of 32
    features, a shared expert of 48 behind its sigmoid gate; returns the HF model."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              layer_types=list(QWEN35_LAYER_TYPES), num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=48, max_position_embeddings=1024,
              tie_word_embeddings=False, eos_token_id=VOCAB - 1, bos_token_id=1)
    kw.update(overrides)
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**kw)).eval()
    _perturb_norms(model, seed)
    model.save_pretrained(path)
    return model


def add_draft_layers(path: str, seed: int = 0) -> None:
    """Give a `make_qwen3_5` checkpoint Qwen3.5's draft layers (`mtp.*`): a gated full-attention layer (the
    model's own, perturbed), a random fc and zero-centred norms, declared by `mtp_num_hidden_layers`.
    Transformers does not run them; the tokens must not depend on them anyway."""
    import json

    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    own = f"model.layers.{QWEN35_LAYER_TYPES.index('full_attention')}."
    for name, w in list(weights.items()):
        if name.startswith(own):
            weights["mtp.layers.0." + name[len(own):]] = w + torch.randn(w.shape, generator=gen) * 0.02
    h = weights["model.embed_tokens.weight"].shape[1]
    weights["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.1
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{norm}.weight"] = torch.randn(h, generator=gen) * 0.2
    save_file(weights, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["mtp_num_hidden_layers"] = 1
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def make_mistral_swa(path: str, window: int = 24, seed: int = 0, **overrides):
    """A tiny Mistral with a sliding window on every layer."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
              max_position_embeddings=1024, tie_word_embeddings=False, eos_token_id=VOCAB - 1, bos_token_id=1)
    kw.update(overrides)
    model = MistralForCausalLM(MistralConfig(**kw)).eval()
    _perturb_norms(model, seed)
    model.save_pretrained(path)
    return model


def make_qwen3_swa(path: str, window: int = 24, seed: int = 0, **overrides):
    """A tiny Qwen3 with `use_sliding_window`: layers from `max_window_layers` on are windowed."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_sliding_window=True,
              sliding_window=window, max_window_layers=1, max_position_embeddings=1024,
              tie_word_embeddings=False, eos_token_id=VOCAB - 1, bos_token_id=1)
    kw.update(overrides)
    model = Qwen3ForCausalLM(Qwen3Config(**kw)).eval()
    _perturb_norms(model, seed)
    model.save_pretrained(path)
    return model


def load_ours(path: str, tp_rank: int = 0, tp_size: int = 1, tp_group=None,
              attention_backend: str = "native", **kw):
    """Our model for the directory, through the loader (architecture registry, weight checks); `kw`: more
    of `load_model`'s keywords (ep_size, eplb)."""
    from common.models.loader import load_model

    return load_model(path, tp_rank=tp_rank, tp_size=tp_size, tp_group=tp_group,
                      attention_backend=attention_backend, **kw)


def random_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, VOCAB - 1) for _ in range(n)]


class HybridHarness(Harness):
    """KV pages for the attention layers, one state slot per request for the linear layers."""

    def __init__(self, model, cfg: ModelConfig, *, tp_size: int = 1, page_size: int = 4, num_pages: int = 256,
                 max_reqs: int = 8, max_context: int = 1024, scramble_seed: int = 0) -> None:
        super().__init__(cfg.num_layers, cfg.local_kv_heads(tp_size), cfg.head_dim, page_size=page_size,
                         num_pages=num_pages, max_reqs=max_reqs, max_context=max_context,
                         scramble_seed=scramble_seed, layer_ids=cfg.kv_layer_ids)
        self.hybrid = HybridSupport(model)
        self.hybrid.attach(self.r2t)  # hybrid models: each row carries a state slot
        self.states = self.hybrid.state_pool
        self.start = self.free_counts()

    def free_counts(self) -> tuple[int, int, int]:
        return (self.alloc.available_pages(), self.r2t.available_size(),
                self.states.available_size() if self.states else 0)

    def slot(self, row: int) -> int:
        return int(self.r2t.row_state[row])

    def free_req(self, row: int) -> None:
        n = self.lens.pop(row)
        self.alloc.free_slots(self.r2t.slots(row, 0, n))
        self.r2t.free(row)  # returns the row's state slot too

    def _state_indices(self, rows: list[int]) -> torch.Tensor | None:
        if self.states is None:
            return None
        return self.r2t.state_indices(torch.tensor(rows, dtype=torch.int64))


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def model_dir(tmp_path_factory, name: str) -> str:
    return os.fspath(tmp_path_factory.mktemp(name))


def tp_worker(rank: int, world: int, port: int, jobs: list[tuple], out_queue) -> None:
    """One TP rank; per job (model dir, prompt, decode ids[, load_model keywords]): extend the prompt in two
    chunks, then decode; rank 0 reports the logits of every job and whether the pools came back to their
    start."""
    from common.distributed import init_distributed

    torch.set_num_threads(1)
    try:
        tp_group, _ = init_distributed(rank, world, f"tcp://127.0.0.1:{port}")
        results = []
        for path, prompt, decode_ids, *load_kw in jobs:
            model, cfg = load_ours(path, tp_rank=rank, tp_size=world, tp_group=tp_group, **dict(*load_kw))
            h = HybridHarness(model, cfg, tp_size=world)
            row = h.new_req()
            half = len(prompt) // 2
            outs = [model.forward(h.extend_batch([(row, prompt[:half])], all_logits=True)),
                    model.forward(h.extend_batch([(row, prompt[half:])], all_logits=True))]
            outs += [model.forward(h.decode_batch([(row, t)])) for t in decode_ids]
            h.free_req(row)
            # plain lists: a tensor would be shared through this process, which may be gone by then
            results.append((torch.cat(outs).tolist(), h.free_counts() == h.start))
        if rank == 0:
            out_queue.put(("ok", results))
    except Exception as e:  # report instead of leaving the parent waiting
        out_queue.put(("error", repr(e)))
        raise


def make_qwen3_5_multimodal(path: str, seed: int = 0, moe: bool = False):
    """The Qwen3.5 checkpoint layout with a (tiny) vision tower: text weights under model.language_model;
    `moe`: Qwen3.5-MoE's (`make_qwen3_5_moe`'s sparse blocks)."""
    import transformers

    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                layer_types=list(QWEN35_LAYER_TYPES), max_position_embeddings=1024, initializer_range=0.08)
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=48)
    family = "Qwen3_5Moe" if moe else "Qwen3_5"
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForConditionalGeneration")
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    model = model_cls(config_cls(text_config=text, vision_config=vision)).eval()
    _perturb_norms(model, seed)
    model.save_pretrained(path)
    return model
