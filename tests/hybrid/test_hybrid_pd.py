"""Hybrid (Qwen3.5-style, dense and MoE) and sliding-window models disaggregated: a prefill node and a decode
node on 127.0.0.1 (real processes, real transfer engines). Greedy tokens equal transformers' `generate` for
prompts spanning several chunks (and longer than the window); the hybrid model's conv and recurrent state
travel with the last chunk (mooncake, nixl, ucx; prefill tp 2 -> decode tp 1 slices the state by heads;
speculating decode nodes roll it back, with n-grams and with the checkpoint's draft layers; a prefill node
of two pipeline stages sends each stage's layers, one of them without any KV layer), the sliding-window
model's transfer carries only the window's pages (from a prefill node of two pipeline stages too, each
sending its own layer's window). After every test both nodes are back at their starting free KV pages,
request rows, metadata slots and state slots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness.backends import backend_params
from tests.harness.nodes import Launcher, PDPair
from tests.harness.pd import assert_restored, greedy
from tests.hybrid.hybrid_harness import (
    add_draft_layers,
    make_mistral_swa,
    make_qwen3_5,
    make_qwen3_5_moe,
    random_prompt,
)

CHUNK = 16  # prefill chunk size of both nodes
HOOKS = str(Path(__file__).resolve().parents[1] / "pd" / "node_hooks")
WINDOW = 24


def _with_tokenizer(make, path: Path, **kw):
    from transformers import AutoTokenizer

    from common.models.default_model import resolve_model_path
    from common.server.tokenizer_load import load_tokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path("default"))
    hf = make(str(path), vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
              initializer_range=0.1, **kw)
    tok.save_pretrained(path)
    load_tokenizer(str(path))  # its first load and check here, not in a node (as tests/conftest.py's models)
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens, like ignore_eos
    return str(path), hf


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return _with_tokenizer(make_qwen3_5, tmp_path_factory.mktemp("pd_qwen35"), seed=5)


@pytest.fixture(scope="module")
def swa(tmp_path_factory):
    return _with_tokenizer(make_mistral_swa, tmp_path_factory.mktemp("pd_swa"), window=WINDOW, seed=6)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def prompts(n: int, seed: int) -> list[list[int]]:
    # 5 .. 75 tokens: up to five chunks, partial last pages, longer than the window
    return [random_prompt(5 + (17 * i + seed) % 71, seed * 100 + i) for i in range(n)]


def _pair(launcher: Launcher, model: str, backend: str, prefill_tp: int = 1, dp_size: int = 1,
          prefill_pp: int = 1, decode_extra: dict | None = None, env: dict | None = None) -> PDPair:
    settings = {"chunked_prefill_size": CHUNK, "dp_size": dp_size}
    # two groups per node put four scheduler processes and their engines on the test machine's cores: a
    # heartbeat window of 9 s (not the fast suite's 1.2 s) so a busy moment is not a dead peer. With
    # `make test`'s two pytest workers a ucx prefill group was seen frozen for 3 s (its own timer noted
    # the gap) in two runs of seven, and the decode side, hearing nothing for 3 s, failed the room
    if max(dp_size, (decode_extra or {}).get("dp_size", 1)) > 1:
        env = {**(env or {}), "PDSERVE_HEARTBEAT_MAX_FAILURES": "30"}
    return launcher.pair(model, backend, prefill_tp=prefill_tp, decode_tp=1, env=env,
                         prefill_settings={**settings, "pp_size": prefill_pp},
                         decode_settings={**settings, **(decode_extra or {})})


def _state_free(pair: PDPair) -> tuple[int, int]:
    return pair.prefill.stats()["state_slots_free"], pair.decode.stats()["state_slots_free"]


def _check_greedy(pair: PDPair, hf, ps: list[list[int]], n: int = 8) -> None:
    for p in ps:
        (s1, pb), (s2, db) = pair.generate({"input_ids": p, "sampling_params": greedy(n)})
        assert s1 == 200 and s2 == 200, (pb, db)
        want = hf_greedy(hf, p, n)
        assert pb["output_ids"] == want[:1]
        assert db["output_ids"] == want, f"prompt of {len(p)} tokens"


@pytest.fixture(scope="module", params=backend_params("mooncake", "nixl", "ucx"))
def qwen35_pair(request, qwen35, module_launcher):
    # mooncake and ucx: both nodes with two DP groups (consecutive rooms alternate between them), each group
    # pinned to one core while the engine's own threads may use both (transfer/engine.py: spread_over_node;
    # confined with the group, UCX's spinning threads stalled about half of these ucx runs)
    pair = _pair(module_launcher, qwen35[0], request.param,
                 dp_size=2 if request.param in ("mooncake", "ucx") else 1)
    yield pair
    pair.stop()  # now, not at the end of the module: one backend's pair at a time


def test_qwen35_greedy_and_state_slots(qwen35_pair, qwen35):
    pair = qwen35_pair
    start = pair.start_counts()
    states = _state_free(pair)
    info = pair.decode.stats()
    assert info["radix_cache"] is False and states[0] == pair.prefill.stats()["state_slots_total"]
    _check_greedy(pair, qwen35[1], prompts(3, seed=1))
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
    assert _state_free(pair) == states


# the node frees a request's state slot whatever moved its state: one backend shows it
@pytest.mark.parametrize("qwen35_pair", backend_params("mooncake"), indirect=True)
def test_qwen35_abort_frees_state(qwen35_pair, qwen35):
    """A request aborted on the decode side while decoding, then a normal one: slots all come back."""
    import concurrent.futures
    import json
    import time

    from tests.harness.client import http_post

    pair = qwen35_pair
    start = pair.start_counts()
    states = _state_free(pair)
    body = pair.body({"input_ids": random_prompt(40, 77), "sampling_params": greedy(200), "rid": "hyb-abort"})
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        fp = ex.submit(http_post, pair.prefill.url + "/generate", body)
        fd = ex.submit(http_post, pair.decode.url + "/generate", body)
        deadline = time.time() + 60
        while pair.decode.stats()["num_queue_reqs"].get("running", 0) == 0 and time.time() < deadline:
            time.sleep(0.05)
        status, _ = http_post(pair.decode.url + "/abort_request", {"rid": "hyb-abort"})
        assert status == 200
        assert fp.result(timeout=60)[0] == 200
        status, raw = fd.result(timeout=60)
    meta = json.loads(raw)["meta_info"]
    assert status == 200 and meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 200
    _check_greedy(pair, qwen35[1], prompts(1, seed=2))
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
    assert _state_free(pair) == states


# slicing the state by heads is the transfer planner's (transfer/plan.py), the same for every backend. The
# decode node speculates: its first verify step starts from the state the transfer wrote, and rejected
# drafts roll it back. A random model never repeats itself, so n-grams would draft nothing: the `drafts`
# hook (tests/pd/node_hooks) has the drafter propose transformers' tokens, some of them wrong
@pytest.mark.backend("mooncake")
def test_qwen35_prefill_tp2_to_decode_tp1(qwen35, launcher, tmp_path):
    import json

    env = {"PYTHONPATH": HOOKS, "PDSERVE_TEST_HOOKS_DIR": str(tmp_path)}
    pair = _pair(launcher, qwen35[0], "mooncake", prefill_tp=2,
                 decode_extra={"speculative_algorithm": "NGRAM"}, env=env)
    start = pair.start_counts()
    states = _state_free(pair)
    ps = prompts(3, seed=3)
    want = {f"spec-{i}": hf_greedy(qwen35[1], p, 12) for i, p in enumerate(ps)}
    (tmp_path / "drafts").write_text(json.dumps(want))
    for i, p in enumerate(ps):
        (s1, pb), (s2,
                   db) = pair.generate({"input_ids": p, "sampling_params": greedy(12), "rid": f"spec-{i}"})
        assert s1 == 200 and s2 == 200, (pb, db)
        assert pb["output_ids"] == want[f"spec-{i}"][:1]
        assert db["output_ids"] == want[f"spec-{i}"], f"prompt of {len(p)} tokens"
    info = pair.decode.stats()
    assert 0 < info["spec_accepted_tokens"] < info["spec_draft_tokens"]
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
    assert _state_free(pair) == states


# EAGLE / MTP on both sides: the prefill runs the draft layer (one more KV layer of the pool) over the prompt
# and sends the first draft and its hidden state with the first token and the state; the decode's first
# step verifies a chain from them, and rejected chains roll the recurrent state back (mooncake carries MTP
# in tests/pd/test_pd_mtp.py). The dense model over ucx; Qwen3.5-MoE (whose draft layer has the sparse block
# too) over every backend, over nixl from a prefill of two ranks, each holding half of every routed expert's
# and of the shared expert's features and half of the state's heads, to a decode rank that gets all of the
# state
@pytest.mark.parametrize("make,backend,prefill_tp", [
    pytest.param(make_qwen3_5, "ucx", 1, marks=pytest.mark.backend("ucx"), id="dense"),
    pytest.param(make_qwen3_5_moe, "nixl", 2, marks=pytest.mark.backend("nixl"), id="moe-prefill-tp2"),
    pytest.param(make_qwen3_5_moe, "mooncake", 1, marks=pytest.mark.backend("mooncake"), id="moe-mooncake"),
    pytest.param(make_qwen3_5_moe, "ucx", 1, marks=pytest.mark.backend("ucx"), id="moe-ucx")])
def test_qwen35_draft_layers_across_pd(make, backend, prefill_tp, tmp_path, launcher):
    path, hf = _with_tokenizer(make, tmp_path, seed=7)
    add_draft_layers(path, seed=7)
    mtp = {"speculative_algorithm": "MTP", "speculative_num_steps": 2}
    pair = launcher.pair(path, backend, prefill_tp=prefill_tp,
                         prefill_settings={"chunked_prefill_size": CHUNK, **mtp},
                         decode_settings={"chunked_prefill_size": CHUNK, **mtp})
    start = pair.start_counts()
    states = _state_free(pair)
    _check_greedy(pair, hf, prompts(2, seed=4), n=10)
    assert pair.decode.stats()["spec_verify_steps"] > 0
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
    assert _state_free(pair) == states


# a prefill node of two pipeline stages (4 layers: linear, linear | full, linear): stage 0 holds no KV layer
# and sends only its two layers' state, stage 1 layer 2's KV and layer 3's state; the decode's pools pair them
# by layer id. With tp 2 each stage's ranks send their halves of the heads and of the state. Chunks of 16 run
# as micro-batches of 8, so a request's state crosses micro-batches inside a forward as well as chunks
# Over ucx, to a decode node of two DP groups (stages over nixl: tests/pd/test_pd_pp.py; over mooncake: the
# sliding-window test below)
@pytest.mark.backend("ucx")
def test_qwen35_prefill_stages_send_their_own_layers(qwen35, launcher):
    pair = _pair(launcher, qwen35[0], "ucx", prefill_tp=2, prefill_pp=2, decode_extra={"dp_size": 2},
                 env={"PDSERVE_PP_MICRO_TOKENS": "8"})
    start = pair.start_counts()
    states = _state_free(pair)
    _check_greedy(pair, qwen35[1], prompts(3, seed=8))
    assert pair.prefill.stats()["pp_micro_batches"] > 0
    assert all(g["forward_ct"] > 0 for g in pair.decode.stats()["dp"])  # consecutive rooms: both groups
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
    assert _state_free(pair) == states


# the same two stages serving on their own (colocated): decode steps cross both stages, each stage's rows keep
# the state of its own linear-attention layers
def test_qwen35_colocated_stages(qwen35, launcher):
    import json

    from tests.harness.client import http_post

    node = launcher.colocated(qwen35[0], pp_size=2, chunked_prefill_size=CHUNK,
                              env={"PDSERVE_PP_MICRO_TOKENS": "8"})
    for p in prompts(2, seed=9):
        status, raw = http_post(node.url + "/generate", {"input_ids": p, "sampling_params": greedy(8)})
        assert status == 200 and json.loads(raw)["output_ids"] == hf_greedy(qwen35[1], p, 8), (len(p), raw)
    assert node.stats()["pp_micro_batches"] > 0


# nixl with prefill tp 2 (each rank sends its half of the heads), mooncake with two pipeline stages on the
# prefill node (each sends its own layer's window); the window's pages are the planner's choice, the same
# for every backend (ucx moves the hybrid model's state above)
@pytest.mark.parametrize("backend,prefill_tp,prefill_pp", [
    pytest.param(b, tp, pp, marks=pytest.mark.backend(b), id=f"{b}-tp{tp}-pp{pp}")
    for b, tp, pp in (("mooncake", 1, 2), ("nixl", 2, 1))])
def test_sliding_window_sends_only_the_window(swa, launcher, backend, prefill_tp, prefill_pp):
    pair = _pair(launcher, swa[0], backend, prefill_tp=prefill_tp, prefill_pp=prefill_pp)
    start = pair.start_counts()
    long = random_prompt(100, 4)  # 25 pages of 4; the window (24 tokens) spans pages 19..24
    before = pair.prefill.stats()["transfer_bytes"]
    _check_greedy(pair, swa[1], [long])
    sent = pair.prefill.stats()["transfer_bytes"] - before
    # rank 0's sends: K+V x its layers x its KV heads x 4 tokens x 16 dims x fp32 per page
    page_bytes = 2 * (2 // prefill_pp) * (2 // prefill_tp) * 4 * 16 * 4
    assert 6 * page_bytes <= sent < 10 * page_bytes, sent
    _check_greedy(pair, swa[1], prompts(3, seed=5))
    assert_restored((pair.prefill, start[0]), (pair.decode, start[1]))
