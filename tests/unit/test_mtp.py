"""EAGLE / MTP speculation with a checkpoint's draft layers (common/models/mtp.py, common/draft_layers.py)
through the real scheduler and runner, on tiny random Llama / Qwen2 / Qwen3 checkpoints with `mtp.*`
weights: greedy output equals decoding without speculation and transformers (chunked prefill, the radix
cache, retraction with and without the host store); the draft layer's KV kept across chunks, decode and
verify steps gives the same draft as a dense computation over the whole sequence; draft layers that
predict the target exactly get every draft accepted; flags and checkpoints without draft layers are
refused."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.config import ConfigError, ServerArgs
from common.models.llama import ModelLoadError
from common.models.tiny_model import exact_draft_head
from common.protocol import SamplingParams
from common.scheduler.hooks import SchedulerHooks
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)
from tests.unit.test_engine_correctness import Engine, hf_greedy, prompts_of

MTP = dict(speculative_algorithm="MTP", speculative_num_steps=3)
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def mtp_model(request, make_tiny_model):
    from transformers import AutoModelForCausalLM

    d = make_tiny_model(request.param, mtp_num_hidden_layers=1)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return d, hf


def _run(model_dir, prompts, spec=True, sampling=GREEDY, **kw):
    """Tokens per request, and each request's (draft token, draft hidden, all tokens) when it finished."""
    eng = Engine(model_dir, **(MTP if spec else {}), **kw)
    ends = {}

    class Recording(SchedulerHooks):
        def on_finished(self, req) -> bool:
            ends[req.rid] = (req.draft_token, req.draft_hidden, req.all_token_ids())
            return False

    eng.sched.hooks = Recording()
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, sampling=sampling)
    toks = eng.run()
    eng.assert_restored()
    return eng, toks, ends


def _prompts(vocab, seed):
    a = prompts_of([3, 7, 5], vocab, seed=seed)
    return [a[0] * 12, a[1] * 5 + a[0]] + prompts_of([5, 40, 70], vocab, seed=seed + 1)


def test_greedy_tokens_equal_no_speculation_and_hf(mtp_model):
    d, hf = mtp_model
    prompts = _prompts(hf.config.vocab_size, 4)
    eng, got, _ = _run(d, prompts)
    s = eng.sched.get_stats()
    assert s["spec_verify_steps"] > 0 and s["spec_draft_tokens"] > 0
    _, plain, _ = _run(d, prompts, spec=False)
    assert got == plain
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, p, 24), f"prompt {i}"


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def dense_draft(model_dir, hf, tokens: list[int]) -> tuple[int, torch.Tensor]:
    """The draft layers over the whole sequence at once (transformers' decoder layer, a causal mask):
    the draft and hidden state at the last position whose next token is known."""
    w = load_file(f"{model_dir}/model.safetensors")
    eps = hf.config.rms_norm_eps
    ids = torch.tensor([tokens])
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state[0]  # after the final norm
        e = _rms(hf.model.embed_tokens.weight[ids[0, 1:]], w["mtp.pre_fc_norm_embedding.weight"], eps)
        x = torch.cat([e, _rms(h[:-1], w["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ w["mtp.fc.weight"].T
        layer = type(hf.model.layers[0])(hf.config, layer_idx=0).eval()
        layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in w.items()
                               if k.startswith("mtp.layers.0.")})
        n = x.shape[0]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x[None], attention_mask=mask, position_ids=pos,
                    position_embeddings=hf.model.rotary_emb(x[None], pos))
        out = out[0] if isinstance(out, tuple) else out
        g = _rms(out[0, -1], w["mtp.norm.weight"], eps)
        return int((g @ hf.lm_head.weight.T).argmax()), g


def test_the_draft_layers_kv_equals_a_dense_run(mtp_model, monkeypatch):
    """After prefill chunks, decode and verify steps (drafts rejected, slots rolled back) and a retraction,
    each request's last draft and hidden state equal a dense run over its tokens: the draft layer's KV
    was written at every position with the right inputs."""
    monkeypatch.setattr("common.scheduler.speculative.MAX_DRAFT_SKIP", 0)  # a d1 at every step, to compare
    d, hf = mtp_model
    prompts = prompts_of([5, 37, 61, 9], hf.config.vocab_size, seed=16)
    sampling = SamplingParams(max_new_tokens=17, temperature=0, ignore_eos=True)
    eng, _, ends = _run(d, prompts, sampling=sampling, chunked_prefill_size=16, disable_radix_cache=True,
                        max_total_tokens=160, init_new_token_ratio=0.05, min_new_token_ratio=0.01,
                        decode_offload_size=0)
    assert eng.sched.num_retractions > 0, "the pool was meant to run out"
    for rid, (tok, g, tokens) in ends.items():
        want_tok, want_g = dense_draft(d, hf, tokens)
        assert torch.allclose(g, want_g, atol=1e-4), rid
        assert tok == want_tok, rid


def test_retraction_through_the_host_store_keeps_the_tokens(make_tiny_model, hf_model):
    d, hf = make_tiny_model("llama", mtp_num_hidden_layers=1), hf_model  # the same target weights
    prompts = _prompts(hf.config.vocab_size, 9)
    sampling = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    eng, got, _ = _run(d, prompts, sampling=sampling, max_total_tokens=224, init_new_token_ratio=0.05,
                       min_new_token_ratio=0.01)
    assert eng.sched.num_retractions > 0
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, p, 40), f"prompt {i}"


def bigram_checkpoint(model_dir: str, out_dir, draft_attention: float = 0.0) -> str:
    """The checkpoint with draft layers that predict it exactly (`tiny_model.exact_draft_head`: its
    layers' output projections zeroed, so it predicts the next token from the current one alone);
    `draft_attention` > 0 makes some drafts wrong."""
    import shutil

    shutil.copytree(model_dir, out_dir)
    path = f"{out_dir}/model.safetensors"
    w = {k: v for k, v in load_file(path).items() if not k.startswith("mtp.")}
    w.update(exact_draft_head(w, w["model.norm.weight"].shape[0], draft_attention))
    save_file(w, path, metadata={"format": "pt"})
    return str(out_dir)


def test_exact_draft_layers_have_every_draft_accepted(make_tiny_model, tmp_path, vocab):
    d = bigram_checkpoint(make_tiny_model("llama", mtp_num_hidden_layers=1), tmp_path / "bigram")
    prompts = prompts_of([6, 30], vocab, seed=2)
    sampling = SamplingParams(max_new_tokens=25, temperature=0, ignore_eos=True)
    eng, got, _ = _run(d, prompts, sampling=sampling)
    st = eng.sched.drafter.stats
    assert st.drafted > 0 and st.accepted == st.drafted
    # 1 token from the prefill, then 4 per verify (3 drafts + the target's own): 6 steps for 25
    assert st.verify_steps == 6 and eng.sched.get_stats()["spec_accept_length"] == 4.0
    _, plain, _ = _run(d, prompts, spec=False, sampling=sampling)
    assert got == plain


def test_sampling_runs_and_gives_everything_back(make_tiny_model, vocab):
    d = make_tiny_model("llama", mtp_num_hidden_layers=1)
    prompts = _prompts(vocab, 4)
    sampling = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    _, got, _ = _run(d, prompts, sampling=sampling)
    assert all(len(v) == 20 for v in got.values())


def test_a_checkpoint_without_draft_layers_is_refused(tiny_model_dir):
    with pytest.raises(ModelLoadError, match="carries no draft layers"):
        Engine(tiny_model_dir, **MTP)


@pytest.mark.parametrize("flags, message", [
    (dict(speculative_algorithm="EAGLE3"), "separate draft model"),
    (dict(speculative_algorithm="MTP", speculative_eagle_topk=2), "speculative-eagle-topk"),
    (dict(speculative_algorithm="EAGLE", speculative_num_steps=3, speculative_num_draft_tokens=3),
     "speculative-num-draft-tokens"),
    (dict(speculative_algorithm="EAGLE", speculative_num_steps=0), "speculative-num-steps"),
    (dict(speculative_algorithm="MTP", speculative_ngram_min_match_window_size=1), "is for NGRAM"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=2), "is for EAGLE/MTP"),
    (dict(speculative_num_steps=2), "needs --speculative-algorithm"),
    (dict(speculative_algorithm="MTP", enable_overlap_schedule=True), "overlap"),
])
def test_flags_are_checked(flags, message):
    with pytest.raises(ConfigError, match=message):
        ServerArgs(**flags).validate()


def test_defaults_and_the_prefill_node():
    a = ServerArgs(speculative_algorithm="nextn", disaggregation_mode="prefill")
    a.validate()  # a prefill node runs the draft layers on the prompt
    assert (a.speculative_algorithm, a.speculative_num_steps, a.speculative_num_draft_tokens,
            a.speculative_eagle_topk, a.draft_layers) == ("MTP", 3, 4, 1, True)
    b = ServerArgs(speculative_algorithm="EAGLE", speculative_num_draft_tokens=6)
    b.validate()
    assert b.speculative_num_steps == 5
