"""Hybrid (Qwen3.5-style) and sliding-window models through the real scheduler + runner, in process:
greedy tokens equal transformers' `generate`, through chunked prefill (prompts spanning several
chunks, longer than the window), batching, retraction and aborts. After every test the KV pages,
request rows and state slots are back at their start."""

from __future__ import annotations

import weakref

import pytest
import torch

from common.config import ServerArgs
from common.protocol import SamplingParams, TokenizedRequest
from common.scheduler.scheduler import Scheduler
from tests.hybrid.hybrid_harness import (
    add_draft_layers,
    make_mistral_swa,
    make_qwen3_5,
    make_qwen3_5_moe,
    random_prompt,
)
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen35_engine"))
    return path, make_qwen3_5(path, seed=3, initializer_range=0.1)


@pytest.fixture(scope="module")
def swa_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("swa_engine"))
    return path, make_mistral_swa(path, window=20, seed=4, initializer_range=0.1)


_refs: dict[tuple, tuple[weakref.ref, list[int]]] = {}


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    key = (id(model), tuple(ids), n)
    hit = _refs.get(key)
    # an id() can be a later model's once the first is freed: an answer counts only for the model it came from
    if hit is None or hit[0]() is not model:
        model.generation_config.eos_token_id = None  # exactly n tokens, like ignore_eos
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        hit = _refs[key] = (weakref.ref(model), out[0, len(ids):].tolist())
    return hit[1]


class Engine:
    def __init__(self, model_dir: str, **overrides) -> None:
        kw = dict(model=model_dir, page_size=4, max_total_tokens=2048, chunked_prefill_size=16,
                  max_running_requests=8, context_length=512)
        kw.update(overrides)
        self.args = ServerArgs(**kw)
        self.args.validate()
        self.sent: list = []
        self.sched = Scheduler(self.args, model_dir, send_fn=self.sent.append)
        self.start = self.free_counts()

    @property
    def state_pool(self):
        return self.sched.runner.hybrid.state_pool

    def free_counts(self) -> tuple[int, int, int]:
        s = self.sched
        states = self.state_pool.available_size() if self.state_pool is not None else -1
        return (s.allocator.available_size() + s.tree_cache.evictable_size(),
                s.req_to_token_pool.available_size(), states)

    def assert_restored(self) -> None:
        s = self.sched
        assert not s.has_work() and not s.live_reqs
        assert self.free_counts() == self.start
        s.tree_cache.evict(10**9)
        assert s.allocator.available_size() == s.allocator.capacity
        if self.state_pool is not None:
            assert self.state_pool.available_size() == self.state_pool.size

    def submit(self, rid: str, ids: list[int], max_new: int) -> None:
        sp = SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)
        self.sched.process_input_requests([TokenizedRequest(rid=rid, input_ids=ids, sampling=sp)])

    def tokens(self) -> dict[str, list[int]]:
        self.sched.stream_output()
        out: dict[str, list[int]] = {}
        for msg in self.sent:
            for u in getattr(msg, "updates", []):
                out.setdefault(u.rid, []).extend(u.new_token_ids)
        return out

    def finish_reason(self, rid: str):
        self.sched.stream_output()
        reasons = [u.finish_reason for m in self.sent for u in getattr(m, "updates", []) if u.rid == rid]
        return reasons[-1]

    def run(self) -> dict[str, list[int]]:
        self.sched.run_until_idle()
        return self.tokens()


MODELS = ["qwen35_dir", "swa_dir"]


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_hf_batched_and_chunked(name, request):
    path, hf = request.getfixturevalue(name)
    lengths = [5, 16, 17, 45, 70]  # up to five 16-token chunks, longer than the 20-token window
    prompts = [random_prompt(n, 100 + n) for n in lengths]
    eng = Engine(path)
    if name == "qwen35_dir":
        assert not eng.sched.tree_cache.enabled  # no prefix reuse for a model with recurrent state
        assert eng.sched.kv_pool.layer_ids == [2]  # KV only for the full-attention layer
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new=10)
    got = eng.run()
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, p, 10), f"prompt of {len(p)} tokens"
    eng.assert_restored()


@pytest.mark.parametrize("name", MODELS)
def test_mixed_chunk(name, request):
    """--enable-mixed-chunk: running requests decode inside the chunks of a longer prompt with HF's tokens
    (a sliding-window model reads their window from the pool as a decode step does; a model with
    recurrent state advances their state by one token from their slot, as a decode step does)."""
    path, hf = request.getfixturevalue(name)
    short, long = random_prompt(30, 3), random_prompt(70, 4)  # 30 > the 20-token window; 70: five chunks
    eng = Engine(path, enable_mixed_chunk=True)
    eng.submit("a", short, 12)
    eng.sched.step()
    eng.sched.step()  # a's prompt in two chunks: it is running
    eng.submit("b", long, 5)
    got = eng.run()
    assert eng.sched.num_mixed_steps == 5
    assert got["a"] == hf_greedy(hf, short, 12) and got["b"] == hf_greedy(hf, long, 5)
    eng.assert_restored()


def test_sliding_window_keeps_prefix_cache(swa_dir):
    path, hf = swa_dir
    eng = Engine(path)
    assert eng.sched.tree_cache.enabled
    base = random_prompt(50, 9)
    a, b = base, base[:41] + random_prompt(8, 10)
    eng.submit("a", a, 8)
    eng.run()
    eng.submit("b", b, 8)
    got = eng.run()
    assert got["a"] == hf_greedy(hf, a, 8) and got["b"] == hf_greedy(hf, b, 8)
    eng.assert_restored()


@pytest.mark.parametrize("name", MODELS)
def test_retraction_gives_same_tokens(name, request):
    path, hf = request.getfixturevalue(name)
    prompts = [random_prompt(n, 200 + n) for n in (20, 22, 18, 25, 21, 19)]
    eng = Engine(path, max_total_tokens=160, init_new_token_ratio=0.05, min_new_token_ratio=0.01)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new=30)
    got = eng.run()
    assert eng.sched.num_retractions > 0, "the pool was meant to run out"
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, p, 30), f"request {i}"
    eng.assert_restored()


def test_abort_mid_prefill_and_mid_decode_frees_state(qwen35_dir):
    path, hf = qwen35_dir
    eng = Engine(path)
    long = random_prompt(60, 1)
    eng.submit("chunked", long, max_new=20)
    eng.sched.step()  # first chunk: row, pages and state slot taken
    assert eng.state_pool.available_size() < eng.state_pool.size
    eng.submit("decoding", random_prompt(10, 2), max_new=50)
    for _ in range(4):
        eng.sched.step()
    eng.sched.abort_request("chunked", "test abort")
    for _ in range(3):
        eng.sched.step()
    eng.sched.abort_request("decoding", "test abort")
    assert eng.finish_reason("chunked")["type"] == "abort"
    assert eng.finish_reason("decoding")["type"] == "abort"
    # a request after the aborts reuses their (dirty) slots and still matches the reference
    p = random_prompt(33, 3)
    eng.submit("after", p, max_new=8)
    assert eng.run()["after"] == hf_greedy(hf, p, 8)
    eng.assert_restored()



def run_like_hf(eng: Engine, hf, prompts: list[list[int]], n: int) -> None:
    """The prompts batched through `eng`, `n` greedy tokens each: transformers' tokens, every page back."""
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new=n)
    got = eng.run()
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, p, n), f"request {i}"
    eng.assert_restored()


def test_ngram_speculation_over_a_sliding_window_matches_hf(swa_dir):
    """Verify forwards run as extends over the window: drafts past the window's edge still give HF's
    tokens."""
    path, hf = swa_dir
    prompts = [random_prompt(6, 31) * 6, random_prompt(45, 32)]  # a repetitive one drafts, past the window
    eng = Engine(path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    run_like_hf(eng, hf, prompts, 30)
    assert eng.sched.drafter.stats.accepted > 0


def test_speculation_rolls_the_recurrent_state_back(qwen35_dir):
    """Verify forwards advance a copy of each request's conv and recurrent state token by token; only the
    state after the last confirmed token is kept. This random model never repeats itself, so n-grams
    would draft nothing: the drafter here proposes transformers' next tokens, wrong at the second draft
    or at the first on some steps, so verify steps keep all, some or none of their drafts, for requests
    batched at different positions. The tokens must stay transformers'."""
    path, hf = qwen35_dir
    prompts = [random_prompt(n, 40 + n) for n in (9, 23, 4)]
    want = {f"r{i}": hf_greedy(hf, p, 24) for i, p in enumerate(prompts)}
    eng = Engine(path, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    vocab = eng.sched.runner.vocab_size

    def chain_for(req, limit):
        at = len(req.output_ids)
        chain = want[req.rid][at:at + limit]
        if chain and at % 3 == 1:
            chain[min(1, len(chain) - 1)] = (chain[min(1, len(chain) - 1)] + 1) % vocab
        elif chain and at % 3 == 2:
            chain[0] = (chain[0] + 1) % vocab
        return chain

    eng.sched.drafter.chain_for = chain_for
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new=24)
    got = eng.run()
    stats = eng.sched.drafter.stats
    assert 0 < stats.accepted < stats.drafted  # drafts kept and drafts rolled back
    assert got == want
    eng.assert_restored()


DENSE_AND_MOE = pytest.mark.parametrize("make", [make_qwen3_5, make_qwen3_5_moe], ids=["dense", "moe"])


@DENSE_AND_MOE
def test_draft_layers_with_recurrent_state(tmp_path, qwen35_dir, make):
    """MTP with Qwen3.5's own draft layers (a gated full-attention layer, offset norms; Qwen3.5-MoE's with its
    sparse block and shared expert): its KV is one more layer of the pool and the recurrent state rolls back
    as with n-grams. Random draft layers guess wrong, so every verify step rolls back; the tokens equal
    transformers'. A checkpoint without draft layers is refused."""
    from common.models.llama import ModelLoadError

    with pytest.raises(ModelLoadError, match="carries no draft layers"):
        Engine(qwen35_dir[0], speculative_algorithm="MTP")
    path = str(tmp_path)
    hf = make(path, seed=3, initializer_range=0.1)
    add_draft_layers(path, seed=3)
    eng = Engine(path, speculative_algorithm="MTP", speculative_num_steps=2)
    assert eng.sched.runner.model.mtp is not None
    run_like_hf(eng, hf, [random_prompt(n, 60 + n) for n in (9, 23)], 12)
    assert eng.sched.drafter.stats.verify_steps > 0


def _offset_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def dense_draft(path: str, hf, tokens: list[int]) -> tuple[int, torch.Tensor]:
    """Qwen3.5's draft layers over the whole sequence at once: transformers' full-attention decoder layer
    (with its sparse block for Qwen3.5-MoE) holding the `mtp.layers.0` weights, a causal mask, norms that
    scale by 1 + weight. The draft and hidden state at the last position whose next token is known."""
    import os

    from safetensors.torch import load_file

    w = load_file(os.path.join(path, "model.safetensors"))
    own = {k[len("mtp.layers.0."):]: v for k, v in w.items() if k.startswith("mtp.layers.0.")}
    n_experts = len({k.split(".")[2] for k in own if k.startswith("mlp.experts.")})
    if n_experts:  # saved one by one; transformers' layer holds them stacked
        e = [{p: own[f"mlp.experts.{i}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}
             for i in range(n_experts)]
        own = {k: v for k, v in own.items() if not k.startswith("mlp.experts.")}
        own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([x["gate_proj"], x["up_proj"]]) for x in e])
        own["mlp.experts.down_proj"] = torch.stack([x["down_proj"] for x in e])
    eps = hf.config.rms_norm_eps
    ids = torch.tensor([tokens])
    full = hf.config.layer_types.index("full_attention")
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state[0]  # after the final norm
        e = _offset_rms(hf.model.embed_tokens.weight[ids[0, 1:]], w["mtp.pre_fc_norm_embedding.weight"], eps)
        x = torch.cat([e, _offset_rms(h[:-1], w["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
        x = x @ w["mtp.fc.weight"].T
        layer = type(hf.model.layers[full])(hf.config, layer_idx=full).eval()
        layer.load_state_dict(own)
        n = x.shape[0]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x[None], position_embeddings=hf.model.rotary_emb(x[None], pos), attention_mask=mask,
                    position_ids=pos)
        g = _offset_rms(out[0, -1], w["mtp.norm.weight"], eps)
    return int((g @ hf.lm_head.weight.T).argmax()), g


@DENSE_AND_MOE
def test_the_draft_layers_kv_equals_a_dense_run(tmp_path, make, monkeypatch):
    """After prefill chunks, decode and verify steps (random drafts rejected, the state rolled back), each
    request's last draft and hidden state equal a dense run of transformers' layer over its tokens: the
    draft layer (for Qwen3.5-MoE with its experts and shared expert) computes Qwen3.5's MTP head and its KV
    was written at every position with the right inputs."""
    from common.scheduler.hooks import SchedulerHooks

    monkeypatch.setattr("common.scheduler.speculative.MAX_DRAFT_SKIP", 0)  # a draft at every step
    path = str(tmp_path)
    hf = make(path, seed=4, initializer_range=0.1)
    add_draft_layers(path, seed=4)
    eng = Engine(path, speculative_algorithm="MTP", speculative_num_steps=2)
    ends = {}

    class Recording(SchedulerHooks):
        def on_finished(self, req) -> bool:
            ends[req.rid] = (req.draft_token, req.draft_hidden, req.all_token_ids())
            return False

    eng.sched.hooks = Recording()
    run_like_hf(eng, hf, [random_prompt(n, 80 + n) for n in (9, 37, 21)], 11)
    assert len(ends) == 3
    for rid, (tok, g, tokens) in ends.items():
        want_tok, want_g = dense_draft(path, hf, tokens)
        assert torch.allclose(g.float(), want_g, atol=1e-4), rid
        assert tok == want_tok, rid
