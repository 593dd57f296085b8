"""tests/gpu/: the GPU engine on a CUDA device. Every test here is skipped, with the reason, when torch
sees no CUDA device, and never skipped on a machine that has one (the FlashInfer cases alone also skip
when `flashinfer` cannot be imported, saying so).

The GPU machine has no network and need not have the default model's tokenizer, so the tiny models are
built here from their configs alone (`make_model`): transformers' own classes with seeded random
float32 weights, a 256-token vocabulary and head size 64 (FlashInfer's kernels are built for 64, 128,
256 and 512), saved as config.json + safetensors, all that `ModelRunner` reads.

`Engine` drives a `ModelRunner` the way bench/engine.py's OurEngine does: one EXTEND forward for the
prompts, then DECODE steps, each sampled on the device by the runner's sampler; it counts the decode
steps that replayed a CUDA graph. `hf_greedy` is transformers' `generate(do_sample=False)` on the same
directory, per prompt (no padding), on the device. `write_result(name, data)` leaves a JSON file under
`$PDSERVE_GPU_RESULTS` when that is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
VOCAB = 256
HEAD_DIM = 64


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"tests/gpu needs a CUDA device; torch {torch.__version__} sees none "
                                   f"(built for CUDA {torch.version.cuda or 'none: a CPU build'})")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


def needs_flashinfer() -> None:
    """Skip (with the reason) when flashinfer cannot be imported here."""
    try:
        import flashinfer  # noqa: F401
    except ImportError as e:
        pytest.skip(f"flashinfer is not importable ({e}); pip install 'pdserve[gpu]'")


@pytest.fixture(scope="session", autouse=True)
def exact_float32():
    """float32 means float32 on the GPU too (no TF32 matmuls or convolutions), for both engines."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _build(path: str, arch: str, seed: int = 0) -> None:
    import transformers

    from common.models.tiny_model import ARCHS, MOE_BASE, TINY_BASE

    torch.manual_seed(seed)
    if arch == "qwen3_5":
        from tests.hybrid.hybrid_harness import make_qwen3_5

        make_qwen3_5(path, seed=seed, head_dim=HEAD_DIM, max_position_embeddings=2048)
        return
    config_name, model_name = ARCHS[arch]
    kw = dict(TINY_BASE, **MOE_BASE.get(arch, {}), vocab_size=VOCAB, head_dim=HEAD_DIM, bos_token_id=1,
              eos_token_id=VOCAB - 1, pad_token_id=0)
    model = getattr(transformers,
                    model_name)(getattr(transformers, config_name)(**kw)).to(torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="session")
def make_model(tmp_path_factory):
    """`make_model(arch)` for arch in llama, qwen2, qwen3, qwen3_5, qwen3_moe: the tiny model's directory (one
    per session and arch)."""
    cache: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in cache:
            out = str(tmp_path_factory.mktemp(f"gpu-tiny-{arch}"))
            _build(out, arch)
            cache[arch] = out
        return cache[arch]

    return make


def prompts(n: int = 3, seed: int = 0, lengths=(5, 19, 33)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB - 2, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


class Engine:
    def __init__(self, model_dir: str, backend: str, dtype: str = "float32", graphs: bool = False,
                 max_reqs: int = 4, context: int = 320, kv_cache_dtype: str = "auto") -> None:
        from common.config import ServerArgs
        from common.runner import ModelRunner

        page = 16
        args = ServerArgs(model=model_dir, device="cuda", dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                          attention_backend=backend, disable_cuda_graph=not graphs,
                          cuda_graph_max_bs=max_reqs,
                          max_total_tokens=max_reqs * (context + page) + 4 * page,
                          max_running_requests=max_reqs, page_size=page, context_length=context)
        self.r = ModelRunner(args, model_dir)
        self.replays = 0
        if graphs:
            assert self.r.graphs is not None, "CUDA graphs were asked for and not captured"
            replay = self.r.graphs.replay

            def counted(fb):
                self.replays += 1
                return replay(fb)

            self.r.graphs.replay = counted

    def take(self, prompt_ids: list[list[int]]) -> tuple[list[int], list[torch.Tensor]]:
        """A request row and KV slots for each prompt, written into the request table."""
        r = self.r
        rows, slots = [], []
        for p in prompt_ids:
            row = r.req_to_token_pool.alloc()
            s = r.allocator.alloc_extend(0, 0, len(p))
            r.req_to_token_pool.write(row, 0, s)
            rows.append(row)
            slots.append(s)
        return rows, slots

    def generate(self, prompt_ids: list[list[int]], steps: int, params=None, seeds=None,
                 forced: list[list[int]] | None = None, logits_out: list | None = None) -> list[list[int]]:
        """`steps` tokens per prompt (the prefill's and steps - 1 decode steps), greedy unless `params`
        (one SamplingParams for all) with per-request `seeds`. `forced`: the tokens fed back are these
        (teacher forcing: another run's tokens) instead of the sampled ones, which are still returned;
        `logits_out` gets each step's logits (float32, on the host)."""
        from common.forward_batch import ForwardBatch, ForwardMode
        from common.layers.sampling import SamplingBatchInfo, make_generator
        from common.protocol import SamplingParams

        r = self.r
        pool = r.req_to_token_pool
        b = len(prompt_ids)
        params = params or SamplingParams(temperature=0.0)
        gens = [make_generator(s) for s in seeds] if seeds else [None] * b
        lens = [len(p) for p in prompt_ids]
        rows, slots = self.take(prompt_ids)
        outputs: list[list[int]] = [[] for _ in range(b)]

        fed: list[list[int]] = [[] for _ in range(b)]

        def draw(logits):
            if logits_out is not None:
                logits_out.append(logits.float().cpu())
            info = SamplingBatchInfo.build([params] * b, outputs, r.vocab_size, gens, [])
            for i, t in enumerate(r.sample(logits, info).next_token_ids.tolist()):
                outputs[i].append(t)
                fed[i].append(forced[i][len(fed[i])] if forced else t)

        fb = ForwardBatch(ForwardMode.EXTEND, torch.tensor([t for p in prompt_ids for t in p]),
                          torch.cat([torch.arange(n) for n in lens]), torch.cat(slots), torch.tensor(rows),
                          list(lens), [0] * b, list(lens), r.kv_pool, pool.req_to_token)
        draw(r.forward(fb))
        for _ in range(steps - 1):
            new = []
            for row, n in zip(rows, lens, strict=True):
                last = int(pool.slots(row, n - 1, n)[0])
                s = r.allocator.alloc_extend(n, last, 1)
                pool.write(row, n, s)
                new.append(s)
            fb = ForwardBatch(ForwardMode.DECODE, torch.tensor([f[-1] for f in fed]), torch.tensor(lens),
                              torch.cat(new), torch.tensor(rows), [n + 1 for n in lens], list(lens), [1] * b,
                              r.kv_pool, pool.req_to_token, logits_indices=torch.arange(b))
            lens = [n + 1 for n in lens]
            draw(r.forward(fb))
        for row, n in zip(rows, lens, strict=True):
            r.allocator.free_slots(pool.slots(row, 0, n))
            pool.free(row)
        return outputs


def hf_greedy(model_dir: str, prompt_ids: list[list[int]], steps: int,
              dtype=torch.float32) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to("cuda").eval()
    model.generation_config.eos_token_id = None  # exactly `steps` tokens
    out = []
    with torch.inference_mode():
        for p in prompt_ids:
            ids = torch.tensor([p], device="cuda")
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=steps, pad_token_id=0,
                                 temperature=None, top_p=None, top_k=None)
            out.append(gen[0, len(p):].tolist())
    del model
    torch.cuda.empty_cache()
    return out


def write_result(name: str, data: dict) -> None:
    where = os.environ.get("PDSERVE_GPU_RESULTS")
    if not where:
        return
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
