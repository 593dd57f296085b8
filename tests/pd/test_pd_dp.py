"""--dp-size 2: a colocated node and a decode node with two scheduler groups behind one front end, and the
router's --dp-aware in front of the decode node.

* colocated, a tiny Qwen3 (q/k norms) with two DP groups: greedy answers and prompt logprobs equal
  transformers'; requests spread
  over both groups (or go to the one `data_parallel_rank` names); /get_load, /server_info,
  /health_generate and /flush_cache cover both groups; each group publishes its own KV events (its own
  endpoint, its rank in every batch);
* PD, prefill and decode both --dp-size 2: a request runs on group bootstrap_room mod 2 of each node
  (the decode group reads from the prefill group of the same room), answers as colocated, and every
  group ends with the pages and slots it started with;
* router: with --dp-aware the router balances the decode groups itself (and honours a client's
  `data_parallel_rank`); without it a client's `data_parallel_rank` is refused. With --kv-events it
  follows each prefill group's cache and sends a prompt back to the group that holds it.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json

import msgspec
import pytest
import zmq

from tests.harness.client import error_message, http_get, http_post, wait_until
from tests.harness.pd import (
    BASE,
    FAST_ENV,
    assert_restored,
    colocated_tokens,
    greedy,
    hf_greedy,
    hf_model,
    make_prompts,
)


def group_stat(node, key: str) -> list:
    return [g[key] for g in node.stats()["dp"]]


def generate(url: str, body: dict) -> tuple[int, dict]:
    code, raw = http_post(url + "/generate", body)
    return code, json.loads(raw)


@pytest.fixture(scope="module")
def qwen3_dir(make_tiny_model) -> str:
    return make_tiny_model("qwen3")


@pytest.fixture(scope="module")
def dp_node(qwen3_dir, module_launcher, tmp_path_factory):
    events = tmp_path_factory.mktemp("dp-node-events")  # ipc endpoints: group k adds `_dp<k>` to the path
    return module_launcher.colocated(qwen3_dir, env=FAST_ENV, dp_size=2, kv_events_config=json.dumps(
        {"endpoint": f"ipc://{events}/pub"}), **BASE)


def test_colocated_groups_answer_as_transformers(dp_node, qwen3_dir, pd_tok):
    import torch

    hf = hf_model(qwen3_dir)
    prompts = make_prompts(pd_tok, 6, seed=5, lo=3, hi=110)  # up to four 32-token chunks
    want = [hf_greedy(hf, p) for p in prompts]
    before = group_stat(dp_node, "total_prompt_tokens")
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda p: generate(dp_node.url,
                                                 {"input_ids": p, "sampling_params": greedy()}), prompts))
    for (code, body), w in zip(answers, want, strict=True):
        assert code == 200, body
        assert body["output_ids"] == w
    after = group_stat(dp_node, "total_prompt_tokens")
    assert all(a > b for a, b in zip(after, before, strict=True)), f"both groups prefill: {before} -> {after}"
    assert sum(after) - sum(before) == sum(map(len, prompts))
    # prompt logprobs, computed by the last stage
    body = {"input_ids": prompts[0], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": greedy(1)}
    meta = generate(dp_node.url, body)[1]["meta_info"]
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompts[0]])).logits[0].float(), dim=-1)
    hf_lp = logp[:-1].gather(1, torch.tensor(prompts[0][1:])[:, None]).squeeze(1).tolist()
    got = [v for v, *_ in meta["input_token_logprobs"]]
    assert got[0] is None and got[1:] == pytest.approx(hf_lp, abs=1e-4)
    assert meta["output_token_logprobs"][0][0] == pytest.approx(logp[-1].max().item(), abs=1e-4)


def test_data_parallel_rank_picks_the_group(dp_node):
    before = group_stat(dp_node, "total_prompt_tokens")
    code, body = generate(dp_node.url, {"input_ids": [5, 6, 7], "data_parallel_rank": 1,
                                        "sampling_params": greedy(3)})
    assert code == 200, body
    after = group_stat(dp_node, "total_prompt_tokens")
    assert (after[0] - before[0], after[1] - before[1]) == (0, 3)
    code, raw = http_post(dp_node.url + "/v1/completions", {"prompt": [5, 6], "max_tokens": 2,
                                                             "data_parallel_rank": 2})
    assert code == 400 and "`data_parallel_rank` = 2" in error_message(raw), raw


def test_node_routes_cover_every_group(dp_node):
    code, raw = http_get(dp_node.url + "/get_load")
    assert code == 200
    assert [e["dp_rank"] for e in json.loads(raw)] == [0, 1]
    code, raw = http_get(dp_node.url + "/server_info")
    info = json.loads(raw)
    assert info["dp_size"] == 2 and len(info["internal_states"]) == 2
    assert info["max_total_num_tokens"] == 2 * BASE["max_total_tokens"]
    assert len(info["kv_events_endpoints"]) == 2
    forwards = group_stat(dp_node, "forward_ct")
    code, _ = http_get(dp_node.url + "/health_generate")
    assert code == 200
    assert all(a > b for a, b in zip(group_stat(dp_node, "forward_ct"), forwards, strict=True))
    code, raw = http_post(dp_node.url + "/flush_cache", b"")
    assert code == 200 and json.loads(raw)["flushed"] is True, raw
    assert group_stat(dp_node, "radix_cache_tokens") == [0, 0]


def test_each_group_publishes_its_own_kv_events(dp_node):
    info = json.loads(http_get(dp_node.url + "/server_info")[1])
    ctx = zmq.Context()
    subs = []
    try:
        for endpoint in info["kv_events_endpoints"]:
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(endpoint)
            subs.append(s)
        seen: dict[int, set] = {0: set(), 1: set()}

        def drain() -> bool:
            for k, s in enumerate(subs):
                while s.poll(0):
                    _, _, payload = s.recv_multipart()
                    _, events, dp_rank = msgspec.msgpack.decode(payload)  # vLLM 0.32's batch: an array
                    # its events maps tagged by "type"; a store names the one cache group and its kind
                    assert all(isinstance(ev, dict) and "type" in ev for ev in events), events
                    assert all((ev["group_idx"], ev["kv_cache_spec_kind"]) == (0, "full_attention")
                               for ev in events if ev["type"] == "BlockStored"), events
                    seen[k].add(dp_rank)
            return bool(seen[0] and seen[1])

        pokes = itertools.count()

        def poke() -> bool:  # the subscriptions take a moment to join: send until each group's batch arrives
            n = next(pokes)  # a new prompt each time: a repeated one hits the radix cache and stores no block
            for rank in (0, 1):
                prompt = [40 + rank, 300 + n] + list(range(60, 78))
                generate(dp_node.url,
                         {"input_ids": prompt, "data_parallel_rank": rank, "sampling_params": greedy(2)})
            return drain()

        wait_until(poke, timeout=30, what="a KV event batch from each group", interval=0.2)
        assert seen == {0: {0}, 1: {1}}
    finally:
        for s in subs:
            s.close(0)
        ctx.term()


# ---------------------------------------------------------------------------------------------- PD
@pytest.fixture(scope="module")
def dp_pair(pd_model_dir, module_launcher, tmp_path_factory):
    events = tmp_path_factory.mktemp("dp-events")  # ipc endpoints: group k adds `_dp<k>` to each path
    kv = json.dumps({"endpoint": f"ipc://{events}/pub", "replay_endpoint": f"ipc://{events}/replay"})
    return module_launcher.pair(pd_model_dir, "mooncake", settings={**BASE, "dp_size": 2},
                                prefill_settings={"kv_events_config": kv})


def test_groups_take_rooms_mod_two_on_both_sides(dp_pair, colocated, pd_tok):
    start = dp_pair.start_counts()
    prompts = make_prompts(pd_tok, 6, seed=7, lo=3, hi=70)
    want = colocated_tokens(colocated, prompts)
    rooms = [1001, 1003, 1005, 1007, 2000, 2002]  # four on group 1, two on group 0
    prefilled = group_stat(dp_pair.prefill, "total_prompt_tokens")
    decoded = group_stat(dp_pair.decode, "total_generated_tokens")
    for p, w, room in zip(prompts, want, rooms, strict=True):
        (ps, pb), (ds, db) = dp_pair.generate({"input_ids": p, "sampling_params": greedy()}, room=room)
        assert ps == 200 and ds == 200, (pb, db)
        assert db["output_ids"] == w
    for node, key, before, per_request in ((dp_pair.prefill, "total_prompt_tokens", prefilled,
                                            list(map(len, prompts))),
                                           (dp_pair.decode, "total_generated_tokens", decoded,
                                            [len(w) - 1 for w in want])):
        after = group_stat(node, key)
        assert [after[k] - before[k] for k in (0, 1)] \
            == [sum(per_request[4:]), sum(per_request[:4])], node.role
    bad = dp_pair.body({"input_ids": [1, 2, 3], "data_parallel_rank": 0,
                        "sampling_params": greedy(2)}, room=7)
    code, raw = http_post(dp_pair.decode.url + "/generate", bad)
    assert code == 400 and "contradicts `bootstrap_room` 7" in error_message(raw), raw
    assert_restored((dp_pair.prefill, start[0]), (dp_pair.decode, start[1]))


def test_dp_aware_router_balances_the_decode_groups(dp_pair, module_launcher, pd_tok):
    router = module_launcher.router([dp_pair.prefill], [dp_pair.decode], "--dp-aware")
    before = group_stat(dp_pair.decode, "total_generated_tokens")
    prompts = make_prompts(pd_tok, 8, seed=9, lo=3, hi=40)
    for p in prompts:  # one at a time: the groups take turns
        code, _, raw = router.post("/generate", {"input_ids": p, "sampling_params": greedy(4)})
        assert code == 200, raw
    after = group_stat(dp_pair.decode, "total_generated_tokens")
    # 4 requests x 3 decoded tokens each
    assert [a - b for a, b in zip(after, before, strict=True)] == [12, 12]
    code, _, raw = router.post("/generate", {"input_ids": [3, 4, 5], "data_parallel_rank": 1,
                                          "sampling_params": greedy(4)})
    assert code == 200, raw
    assert group_stat(dp_pair.decode, "total_generated_tokens")[1] == after[1] + 3
    code, _, raw = router.post("/generate", {"input_ids": [3, 4, 5], "data_parallel_rank": 2})
    assert code == 400 and "`data_parallel_rank` = 2" in error_message(raw), raw
    plain = module_launcher.router([dp_pair.prefill], [dp_pair.decode])
    code, _, raw = plain.post("/generate", {"input_ids": [3, 4, 5], "data_parallel_rank": 1})
    assert code == 400 and "--dp-aware" in error_message(raw), raw
