"""The scheduler + runner + model end to end, in process (no HTTP): greedy tokens equal Hugging Face
transformers' `generate(do_sample=False)` on the same weights, through chunked prefill, the radix
cache, batching, retraction and aborts; after every test the pools are back at their start."""

from __future__ import annotations

import pytest
import torch

from common.config import ServerArgs
from common.layers import native
from common.protocol import AbortRequest, SamplingParams, StatsQuery, StatsReport, TokenizedRequest
from common.scheduler.req import Stage
from common.scheduler.scheduler import Scheduler
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)

# ------------------------------------------------------------------------------------------------
# harness


class Engine:
    """A Scheduler driven by direct calls; collects what it sends to the front end."""

    def __init__(self, model_dir: str, **overrides) -> None:
        kw = dict(model=model_dir, page_size=4, max_total_tokens=4096, chunked_prefill_size=32,
                  max_running_requests=32)
        kw.update(overrides)
        self.args = ServerArgs(**kw)
        self.args.validate()
        self.sent: list = []
        self.sched = Scheduler(self.args, model_dir, send_fn=self.sent.append)
        self.start = self.free_counts()

    def free_counts(self) -> tuple[int, int, int]:
        s = self.sched
        return (s.allocator.available_size() + s.tree_cache.evictable_size(),
                s.req_to_token_pool.available_size(), s.tree_cache.protected_size())

    def assert_restored(self) -> None:
        s = self.sched
        assert not s.has_work() and not s.live_reqs
        assert self.free_counts() == self.start
        # and nothing is leaked outside the cache: evicting everything frees every page
        s.tree_cache.evict(10**9)
        assert s.allocator.available_size() == s.allocator.capacity

    def submit(self, rid: str, ids: list[int], max_new: int = 12, **kw) -> None:
        sp = kw.pop("sampling", None) or SamplingParams(max_new_tokens=max_new,
                                                        temperature=0, ignore_eos=True)
        self.sched.process_input_requests([TokenizedRequest(rid=rid, input_ids=ids, sampling=sp, **kw)])

    def updates(self) -> dict[str, list]:
        self.sched.stream_output()  # refusals and aborts are sent with the iteration's BatchOut
        out: dict[str, list] = {}
        for msg in self.sent:
            for u in getattr(msg, "updates", []):
                out.setdefault(u.rid, []).append(u)
        return out

    def tokens(self) -> dict[str, list[int]]:
        return {rid: [t for u in ups for t in u.new_token_ids] for rid, ups in self.updates().items()}

    def final(self, rid: str):
        ups = self.updates()[rid]
        assert ups[-1].finish_reason is not None
        return ups[-1]

    def run(self) -> dict[str, list[int]]:
        self.sched.run_until_idle()
        return self.tokens()


def prompts_of(lengths, vocab, seed=0, lo=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, vocab, (n,), generator=g).tolist() for n in lengths]


_ref_cache: dict[tuple, list[int]] = {}


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    # keyed by the model's directory, not id(model): a model freed by one test and the next test's model
    # can share an id, and the architectures' tests send the same prompts (a stale reference failed CI once)
    key = (model.name_or_path, tuple(ids), n)
    if key not in _ref_cache:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        _ref_cache[key] = out[0, len(ids):].tolist()
    return _ref_cache[key]


# ------------------------------------------------------------------------------------------------
# greedy correctness


@pytest.mark.parametrize("page_size", [4, 16])
def test_greedy_matches_hf_with_chunked_prefill(tiny_model_dir, hf_model, vocab, page_size):
    eng = Engine(tiny_model_dir, page_size=page_size, chunked_prefill_size=32)
    prompts = prompts_of([5, 31, 33, 70, 101], vocab, seed=page_size)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new=10)
    got = eng.run()
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf_model, p, 10), f"prompt of {len(p)} tokens"
        fin = eng.final(f"r{i}")
        assert fin.finish_reason == {"type": "length", "length": 10}
        assert fin.prompt_tokens == len(p) and fin.completion_tokens == 10
    eng.assert_restored()


def greedy_against_hf(model_dir: str, lengths: list[int], seed: int, check=None, **engine_args) -> None:
    """Greedy tokens of prompts of `lengths` equal transformers' (8 each), chunks of 32; `check(engine)`
    first; `engine_args` are more ServerArgs."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    eng = Engine(model_dir, page_size=16, chunked_prefill_size=32, **engine_args)
    if check is not None:
        check(eng)
    prompts = prompts_of(lengths, hf.config.vocab_size, seed=seed)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new=8)
    got = eng.run()
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, p, 8)
    eng.assert_restored()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_greedy_matches_hf_other_architectures(make_tiny_model, arch):
    greedy_against_hf(make_tiny_model(arch), [6, 45], seed=50)


def test_greedy_matches_hf_through_the_native_prefill_attention(make_tiny_model):
    """Head size 32: extend runs `prefill_attention.c` (its block is 32 with AVX-512, 16 with AVX2)
    without a prefix and, past the first chunk of 32, over the cached prefix gathered from the pool."""
    if native.prefill_attention() is None:
        pytest.skip("no native prefill attention in this build")

    def runs_the_kernel(eng) -> None:
        assert eng.sched.runner.model.attn_backend.native_prefill is not None

    greedy_against_hf(make_tiny_model("llama", hidden_size=128, head_dim=32), [7, 45, 90], seed=51,
                      check=runs_the_kernel)


def test_shared_prefix_through_radix_cache(tiny_model_dir, hf_model, vocab):
    eng = Engine(tiny_model_dir, page_size=4, chunked_prefill_size=32)
    base = prompts_of([45], vocab, seed=3)[0]
    a = base
    b = base[:38] + prompts_of([9], vocab, seed=4)[0]
    eng.submit("a", a, max_new=8)
    eng.run()
    eng.submit("b", b, max_new=8)
    got = eng.run()
    assert eng.final("a").cached_tokens == 0
    assert eng.final("b").cached_tokens == 36  # 38 shared tokens, whole pages of 4
    assert got["a"] == hf_greedy(hf_model, a, 8)
    assert got["b"] == hf_greedy(hf_model, b, 8)
    # the same prompt again is served (almost) entirely from the cache
    eng.submit("a2", a, max_new=8)
    got = eng.run()
    assert eng.final("a2").cached_tokens == 44 and got["a2"] == got["a"]
    assert eng.sched.get_stats()["cache_hit_rate"] > 0
    eng.assert_restored()


def test_prefix_shared_within_one_batch_and_disabled_cache(tiny_model_dir, hf_model, vocab):
    base = prompts_of([40], vocab, seed=5)[0]
    prompts = [base + [7 + i] * 3 for i in range(3)]
    ref = [hf_greedy(hf_model, p, 6) for p in prompts]
    for disable in (False, True):
        eng = Engine(tiny_model_dir, disable_radix_cache=disable)
        for i, p in enumerate(prompts):
            eng.submit(f"r{i}", p, max_new=6)
        got = eng.run()
        assert [got[f"r{i}"] for i in range(3)] == ref
        if disable:
            assert all(eng.final(f"r{i}").cached_tokens == 0 for i in range(3))
        eng.assert_restored()


def test_batch_of_16_equals_solo(tiny_model_dir, hf_model, vocab):
    lengths = [3, 9, 17, 24, 31, 33, 40, 47, 5, 64, 12, 70, 28, 36, 8, 55]
    max_new = [4, 9, 12, 6, 10, 3, 8, 12, 11, 5, 7, 12, 2, 9, 12, 6]
    prompts = prompts_of(lengths, vocab, seed=7)
    solo = []
    eng = Engine(tiny_model_dir, disable_radix_cache=True)
    for i, p in enumerate(prompts):
        eng.submit(f"s{i}", p, max_new=max_new[i])
        solo.append(eng.run()[f"s{i}"])
    eng.assert_restored()
    batch = Engine(tiny_model_dir, page_size=16, chunked_prefill_size=64)
    for i, p in enumerate(prompts):
        batch.submit(f"b{i}", p, max_new=max_new[i])
    got = batch.run()
    for i in range(16):
        assert got[f"b{i}"] == solo[i], f"request {i} ({lengths[i]} prompt tokens)"
    # and the solo runs are the reference's
    for i in (0, 5, 11):
        assert solo[i] == hf_greedy(hf_model, prompts[i], max_new[i])
    batch.assert_restored()


def test_decode_between_chunks(tiny_model_dir, hf_model, vocab):
    """A decode node's scheduler (`decode_between_chunks`) runs a decode step of the running batch after
    each chunk of a prompt it prefills (a local prefill, a re-prefill), instead of every chunk first; the
    tokens are the same."""
    from common.forward_batch import ForwardMode

    short, long = prompts_of([6, 100], vocab, seed=5)  # the long prompt: 4 chunks of 32
    runs = {}
    for between in (False, True):
        eng = Engine(tiny_model_dir, chunked_prefill_size=32, disable_radix_cache=True)
        eng.sched.decode_between_chunks = between
        modes = []
        run = eng.sched.runner.run
        eng.sched.runner.run = lambda batch, run=run, modes=modes: (modes.append(
            "E" if batch.mode == ForwardMode.EXTEND else "D"), run(batch))[1]
        eng.submit("a", short, max_new=20)
        eng.sched.step()  # a is running
        eng.submit("b", long, max_new=6)
        runs[between] = (eng.run(), "".join(modes))
        eng.assert_restored()
    (plain, plain_modes), (mixed, mixed_modes) = runs[False], runs[True]
    assert plain_modes.startswith("EEEEED")  # a's prefill, then b's four chunks before a decodes again
    assert mixed_modes.startswith("EEDEDEDE")  # a decode step after every chunk but b's last
    assert plain == mixed
    assert mixed["a"] == hf_greedy(hf_model, short, 20) and mixed["b"] == hf_greedy(hf_model, long, 6)


def _record_modes(eng) -> list[str]:
    """The forwards the scheduler runs from now on: E (an extend; E+n: with n decode rows mixed in) or D."""
    from common.forward_batch import ForwardMode

    modes: list[str] = []
    run = eng.sched.runner.run

    def recording(batch):
        info = batch.extend_info
        modes.append("D" if batch.mode != ForwardMode.EXTEND else f"E+{info.decode_rows}"
                     if info.decode_rows else "E")
        return run(batch)

    eng.sched.runner.run = recording
    return modes


@pytest.mark.parametrize("between", [False, True], ids=["colocated", "decode-node"])
def test_mixed_chunk(tiny_model_dir, hf_model, vocab, between):
    """--enable-mixed-chunk: the running requests decode one token in each chunk's forward (after the prompt
    rows), instead of waiting for every chunk (a colocated node) or taking a decode step of their own between
    two chunks (a decode node's `decode_between_chunks`). Tokens and their logprobs are the ones of an unmixed
    run and HF's; the pools come back whole."""
    short, other, long = prompts_of([6, 9, 100], vocab, seed=5)  # the long prompt: 4 chunks of 32
    runs = {}
    for mixed in (False, True):
        eng = Engine(tiny_model_dir, chunked_prefill_size=32, disable_radix_cache=True,
                     enable_mixed_chunk=mixed)
        eng.sched.decode_between_chunks = between
        modes = _record_modes(eng)
        eng.submit("a", short, max_new=20, return_logprob=True, top_logprobs_num=2)
        eng.submit("c", other, max_new=3)  # ends during b's chunks: its memory comes back mid-way
        eng.sched.step()  # a and c are running
        eng.submit("b", long, max_new=6, return_logprob=True)
        tokens = eng.run()
        runs[mixed] = (tokens, "".join(modes), eng.final("a").output_logprobs, eng.sched.num_mixed_steps)
        eng.assert_restored()
    (plain, plain_modes, plain_lp, plain_mixed), (got, mixed_modes, lp, n_mixed) = runs[False], runs[True]
    assert plain_mixed == 0 and n_mixed == 4
    # b's four chunks carry a and c (c ends after its third token: the last two carry a alone), then decode
    # steps
    assert mixed_modes.startswith("EE+2E+2E+1E+1D"), mixed_modes
    assert plain_modes.startswith("EEDEDEDE" if between else "EEEEED"), plain_modes
    assert got == plain
    assert got["a"] == hf_greedy(hf_model, short, 20) and got["b"] == hf_greedy(hf_model, long, 6)
    assert got["c"] == hf_greedy(hf_model, other, 3)
    assert [t for _, t in lp] == [t for _, t in plain_lp] == got["a"]
    assert [v for v, _ in lp] == pytest.approx([v for v, _ in plain_lp], abs=1e-4)


def test_mixed_chunk_with_overlap_and_retraction(tiny_model_dir, hf_model, vocab):
    """Mixed chunks under a KV pool that runs out (retracted requests prefill again while others decode in
    those forwards) and with overlap scheduling: the same tokens as HF."""
    prompts = prompts_of([20, 22, 18, 25, 21, 19], vocab, seed=11)
    for overlap in (False, True):
        eng = Engine(tiny_model_dir, page_size=4, max_total_tokens=160, chunked_prefill_size=16,
                     init_new_token_ratio=0.05, min_new_token_ratio=0.01, enable_mixed_chunk=True,
                     enable_overlap_schedule=overlap)
        for i, p in enumerate(prompts):
            eng.submit(f"r{i}", p, max_new=30)
            eng.sched.step()  # arrivals spread over the first steps: later prompts find requests running
        got = eng.run()
        assert eng.sched.num_retractions > 0, "the pool was meant to run out"
        assert eng.sched.num_mixed_steps > 0
        for i, p in enumerate(prompts):
            assert got[f"r{i}"] == hf_greedy(hf_model, p, 30), f"request {i}, overlap {overlap}"
        eng.assert_restored()


def test_retraction_under_tiny_kv_pool_gives_same_tokens(tiny_model_dir, hf_model, vocab):
    prompts = prompts_of([20, 22, 18, 25, 21, 19], vocab, seed=11)
    eng = Engine(tiny_model_dir, page_size=4, max_total_tokens=160, chunked_prefill_size=32,
                 init_new_token_ratio=0.05, min_new_token_ratio=0.01)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new=30)
    got = eng.run()
    assert eng.sched.num_retractions > 0, "the pool was meant to run out"
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf_model, p, 30), f"request {i}"
        assert eng.final(f"r{i}").completion_tokens == 30
    eng.assert_restored()


def test_streaming_updates_and_stream_interval(tiny_model_dir, vocab):
    eng = Engine(tiny_model_dir, stream_interval=3)
    p = prompts_of([10], vocab, seed=12)[0]
    eng.submit("s", p, max_new=10, stream=True)
    eng.submit("n", p, max_new=10)
    got = eng.run()
    ups = eng.updates()
    sizes = [len(u.new_token_ids) for u in ups["s"]]
    assert sizes == [1, 3, 3, 3]  # first token at once, then every 3, the rest with the finish
    assert [u.finish_reason is not None for u in ups["s"]] == [False, False, False, True]
    assert len(ups["n"]) == 1 and got["n"] == got["s"]
    eng.assert_restored()


# ------------------------------------------------------------------------------------------------
# stops, logprobs, refusals


def test_stop_token_ids_and_eos(tiny_model_dir, hf_model, vocab):
    eng = Engine(tiny_model_dir)
    p = prompts_of([12], vocab, seed=13)[0]
    ref = hf_greedy(hf_model, p, 16)
    stop_tok = ref[5]
    first = ref.index(stop_tok)
    # the model's EOS ends a request unless ignore_eos: make this prompt's 4th token the "EOS"
    eng.sched.eos_token_ids = [ref[3]]
    eng.submit("stop", p, sampling=SamplingParams(max_new_tokens=16, temperature=0, stop_token_ids=[stop_tok],
                                                  ignore_eos=True))
    eng.submit("eos", p, sampling=SamplingParams(max_new_tokens=16, temperature=0))
    eng.submit("ign", p, sampling=SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True))
    # min_new_tokens masks the stop token until reached
    eng.submit("min", p, sampling=SamplingParams(max_new_tokens=16, temperature=0, min_new_tokens=8,
                                                 stop_token_ids=[stop_tok], ignore_eos=True))
    got = eng.run()
    assert got["stop"] == ref[: first + 1]
    assert eng.final("stop").finish_reason == {"type": "stop", "matched": stop_tok}
    assert got["eos"] == ref[: ref.index(ref[3]) + 1]
    assert eng.final("eos").finish_reason == {"type": "stop", "matched": ref[3]}
    assert got["ign"] == ref
    # identical to the reference until the first masked token (the stop token or the "EOS")
    k = min(first, ref.index(ref[3]))
    assert len(got["min"]) >= 8 and stop_tok not in got["min"][:8] and got["min"][:k] == ref[:k]
    if eng.final("min").finish_reason["type"] == "stop":
        assert got["min"][-1] == stop_tok
    eng.assert_restored()


def test_logprobs_match_hf(tiny_model_dir, hf_model, vocab):
    eng = Engine(tiny_model_dir, chunked_prefill_size=16)
    p = prompts_of([40], vocab, seed=14)[0]
    eng.submit("lp", p, max_new=5, return_logprob=True, logprob_start_len=0, top_logprobs_num=3)
    eng.submit("lp5", p, max_new=5, return_logprob=True, logprob_start_len=25, top_logprobs_num=0)
    eng.submit("out", p, max_new=5, return_logprob=True)
    got = eng.run()
    full = p + got["lp"]
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([full])).logits[0].float(), dim=-1)
    fin = eng.final("lp")
    # input: token 0 has no logprob; token i's comes from position i-1
    assert fin.input_logprobs[0] == (None, p[0]) or list(fin.input_logprobs[0]) == [None, p[0]]
    assert len(fin.input_logprobs) == 40 and len(fin.input_top_logprobs) == 40
    for i in range(1, 40):
        lp, tok = fin.input_logprobs[i]
        assert tok == p[i] and lp == pytest.approx(float(logp[i - 1, p[i]]), abs=1e-4)
        top = fin.input_top_logprobs[i]
        want = torch.topk(logp[i - 1], 3)
        assert [t for _, t in top] == want.indices.tolist()
    assert len(fin.output_logprobs) == 5 and len(fin.output_top_logprobs) == 5
    for j, (lp, tok) in enumerate(fin.output_logprobs):
        pos = 40 + j - 1
        assert tok == got["lp"][j] and lp == pytest.approx(float(logp[pos, tok]), abs=1e-4)
        assert fin.output_top_logprobs[j][0][1] == tok  # greedy: the chosen token is the top one
    fin5 = eng.final("lp5")
    assert [t for _, t in fin5.input_logprobs] == p[25:]
    assert fin5.input_logprobs[0][0] == pytest.approx(float(logp[24, p[25]]), abs=1e-4)
    assert fin5.input_top_logprobs is None
    fo = eng.final("out")
    assert fo.input_logprobs is None and len(fo.output_logprobs) == 5
    assert got["lp5"] == got["out"] == got["lp"]
    eng.assert_restored()


def test_refused_requests_get_400(tiny_model_dir, vocab):
    eng = Engine(tiny_model_dir, max_total_tokens=128, context_length=100)
    eng.submit("empty", [], max_new=4)
    eng.submit("ctx", [5] * 90, max_new=20)
    eng.submit("vocab", [vocab + 5], max_new=4)
    eng.submit("ok", [5] * 20, max_new=4)
    eng.submit("ok", [6] * 20, max_new=4)  # duplicate rid while the first is live
    eng2 = Engine(tiny_model_dir, max_total_tokens=64)
    eng2.submit("kv", [5] * 60, max_new=20)
    for e, rid, words in ((eng, "empty", "empty"), (eng, "ctx", "context length"),
                          (eng, "vocab", "vocabulary"), (eng2, "kv", "KV cache")):
        fin = e.final(rid)
        assert fin.error_status == 400 and fin.finish_reason["type"] == "abort"
        assert words in fin.finish_reason["message"]
    eng.run()
    # a request that exactly fills the KV pool (57 + 7 = 64 tokens) runs
    eng2.submit("full", [5] * 57, max_new=7)
    assert len(eng2.run()["full"]) == 7 and eng2.final("full").error_status == 0
    ups = eng.updates()["ok"]
    assert [u.error_status for u in ups] == [400, 0]
    assert ups[-1].completion_tokens == 4
    eng.assert_restored()
    eng2.assert_restored()


def test_max_new_tokens_zero_prefills_only(tiny_model_dir, vocab):
    eng = Engine(tiny_model_dir)
    eng.submit("z", prompts_of([9], vocab)[0], max_new=0, return_logprob=True, logprob_start_len=0)
    got = eng.run()
    fin = eng.final("z")
    assert got["z"] == [] and fin.finish_reason == {"type": "length", "length": 0}
    assert len(fin.input_logprobs) == 9
    eng.assert_restored()


# ------------------------------------------------------------------------------------------------
# aborts and stats


def test_abort_everywhere_frees_everything(tiny_model_dir, hf_model, vocab):
    eng = Engine(tiny_model_dir, chunked_prefill_size=16, max_running_requests=3)
    s = eng.sched
    prompts = prompts_of([10, 60, 12, 14, 11], vocab, seed=21)
    eng.submit("run", prompts[0], max_new=20)
    eng.submit("chunk", prompts[1], max_new=20)
    s.step()  # prefill: run (10) + the first chunk of "chunk"
    assert s.chunked_req is not None and s.chunked_req.rid == "chunk"
    eng.submit("a", prompts[2], max_new=20)
    eng.submit("b", prompts[3], max_new=20)
    eng.submit("wait", prompts[4], max_new=20)
    s.step()
    s.step()
    s.step()
    stages = {r.rid: r.stage for r in s.live_reqs.values()}
    assert stages["run"] is Stage.RUNNING and stages["wait"] is Stage.WAITING
    s.process_input_requests([AbortRequest(rid="chunk"), AbortRequest(rid="run"), AbortRequest(rid="wait"),
                              AbortRequest(rid="no-such-request")])
    s.stream_output()
    for rid in ("chunk", "run", "wait"):
        fin = eng.final(rid)
        assert fin.finish_reason["type"] == "abort" and fin.error_status == 0
    got = eng.run()
    assert got["a"] == hf_greedy(hf_model, prompts[2], 20)
    assert got["b"] == hf_greedy(hf_model, prompts[3], 20)
    eng.assert_restored()
    # abort all ("" rid) with requests in every stage
    for i, p in enumerate(prompts):
        eng.submit(f"x{i}", p, max_new=20)
    s.step()
    s.step()
    s.process_input_requests([AbortRequest(rid="")])
    s.stream_output()
    assert all(eng.final(f"x{i}").finish_reason["type"] == "abort" for i in range(5))
    eng.assert_restored()


def test_stats_report(tiny_model_dir, vocab):
    eng = Engine(tiny_model_dir)
    eng.submit("r", prompts_of([20], vocab)[0], max_new=30)
    eng.sched.step()
    eng.sched.process_input_requests([StatsQuery(qid=7)])
    rep = [m for m in eng.sent if isinstance(m, StatsReport)][-1]
    st = rep.stats
    assert rep.qid == 7
    for key in ("num_running_reqs", "num_waiting_reqs", "num_queue_reqs", "kv_free_tokens", "kv_total_tokens",
                "kv_evictable_tokens", "req_slots_free", "req_slots_total",
                "cache_hit_rate", "num_tokens_used", "gen_throughput"):
        assert key in st
    assert st["num_running_reqs"] == 1 and st["kv_total_tokens"] == 4096
    assert st["num_tokens_used"] >= 20 and st["req_slots_free"] == st["req_slots_total"] - 1
    eng.run()
    eng.assert_restored()


def test_seeded_sampling_independent_of_batch(tiny_model_dir, vocab):
    p = prompts_of([15], vocab, seed=30)[0]
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    eng = Engine(tiny_model_dir)
    eng.submit("alone", p, sampling=sp)
    alone = eng.run()["alone"]
    eng2 = Engine(tiny_model_dir)
    for i, q in enumerate(prompts_of([7, 30, 12], vocab, seed=31)):
        eng2.submit(f"other{i}", q,
                    sampling=SamplingParams(max_new_tokens=12, temperature=0.8, ignore_eos=True))
    eng2.submit("seeded", p, sampling=sp)
    got = eng2.run()
    assert got["seeded"] == alone
    eng.assert_restored()
    eng2.assert_restored()


# ------------------------------------------------------------------------------------------------
# the default model


@pytest.mark.slow
def test_smollm2_greedy_matches_hf_and_stop_strings(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [tok(chat, add_special_tokens=False)["input_ids"],
               tok("The three primary colors are")["input_ids"]]
    eng = Engine(smollm2_dir, page_size=16, chunked_prefill_size=32, max_total_tokens=2048)
    assert eng.sched.tokenizer is not None
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new=16)
    got = eng.run()
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, p, 16)
    assert "Paris" in tok.decode(got["r0"])
    # a stop string found in the output ends the request right there
    text = tok.decode(got["r1"])
    words = text.split()
    stop = words[len(words) // 2]
    eng.submit("stop", prompts[1], sampling=SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True,
                                                           stop=[stop, "never appears ~~~"]))
    got2 = eng.run()
    fin = eng.final("stop")
    assert fin.finish_reason == {"type": "stop", "matched": stop}
    out = got2["stop"]
    assert out == got["r1"][: len(out)] and stop in tok.decode(out) and stop not in tok.decode(out[:-1])
    eng.assert_restored()


def test_prebuilt_requests_join_running_batch(tiny_model_dir, hf_model, vocab):
    """What a decode node does with received KV: a request whose prompt KV is already in the pool
    (copied here from another engine's pool, page by page) decodes without prefill compute."""
    p = prompts_of([27], vocab, seed=40)[0]
    src = Engine(tiny_model_dir, page_size=4)
    src.submit("x", p, max_new=10)
    src.sched.step()  # prefill only
    sreq = src.sched.live_reqs["x"]
    first = list(sreq.output_ids)
    src_slots = src.sched.req_to_token_pool.slots(sreq.req_pool_idx, 0, len(p))

    dst = Engine(tiny_model_dir, page_size=4)
    d = dst.sched
    d.process_input_requests([TokenizedRequest(rid="other", input_ids=prompts_of([9], vocab, seed=41)[0],
                                               sampling=SamplingParams(max_new_tokens=10, temperature=0,
                                                                       ignore_eos=True))])
    d.step()  # another request is already decoding
    req = d.make_req(TokenizedRequest(rid="x", input_ids=p, sampling=SamplingParams(
        max_new_tokens=10, temperature=0, ignore_eos=True)))
    req.req_pool_idx = d.req_to_token_pool.alloc()
    dst_slots = d.allocator.alloc_extend(0, 0, len(p))
    d.req_to_token_pool.write(req.req_pool_idx, 0, dst_slots)
    ps = 4
    for layer in range(len(d.kv_pool.layer_ids)):
        for a, b in ((src.sched.kv_pool.k(layer), d.kv_pool.k(layer)),
                     (src.sched.kv_pool.v(layer), d.kv_pool.v(layer))):
            b[dst_slots // ps, :, dst_slots % ps, :] = a[src_slots // ps, :, src_slots % ps, :]
    req.kv_len = len(p)
    req.output_ids = first
    d.add_prebuilt_reqs([req])
    got = dst.run()
    # the decode side reports every output token, the first one (sampled by the prefill) included
    assert got["x"] == hf_greedy(hf_model, p, 10) and got["x"][0] == first[0]
    src.sched.process_input_requests([AbortRequest(rid="x")])
    src.assert_restored()
    dst.assert_restored()
