"""`pdserve bench compare`'s workload, ratio orientation and table, on hand-made results (the full
comparison starts two setups of the default model: that run is `pdserve bench compare` itself)."""

from __future__ import annotations

import argparse

from bench import compare, serve


def ns(**kw) -> argparse.Namespace:
    d = vars(compare.build_parser().parse_args([]))
    d.update(kw)
    n = argparse.Namespace(**d)
    n.prefill_cores_list, n.decode_cores_list = [0], [1]
    n.model_label, n.load_note = "tiny", "1.0 / 1.0"
    return n


def test_workload_decodes_then_long_prompts_among_them():
    n = ns(num_decodes=6, decode_rate=2.0, num_long=3, long_start=0.7, long_interval=1.0,
           decode_input_len=5, long_input_len=40, decode_output_len=9, long_output_len=2)
    reqs = compare.build_workload(serve.PromptMaker(None, 0), n)
    assert [r.send_at for r in reqs] == sorted(r.send_at for r in reqs)
    decodes = [r for r in reqs if r.tag == "decode"]
    longs = [r for r in reqs if r.tag == "long"]
    assert [r.send_at for r in decodes] == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert [r.send_at for r in longs] == [0.7, 1.7, 2.7]
    assert all(r.output_len == 9 and r.prompt_len == 5 for r in decodes)
    assert all(r.output_len == 2 and len(r.prompt.split()) == 40 for r in longs)


def fake_results(tpot: float, ttft: float, n: int = 10) -> list[serve.RequestResult]:
    out = []
    for i in range(n):
        tag = "long" if i % 5 == 0 else "decode"
        out.append(serve.RequestResult(ok=True, tag=tag, prompt_len=10, output_len=11, ttft=ttft,
                                       latency=ttft + 10 * tpot, itl=[tpot] * 10))
    return out


def test_ratios_are_oriented_so_higher_means_pd_better():
    n = ns(slo_ttft_ms=1000.0, slo_tpot_ms=60.0)
    dis = compare.by_tag(fake_results(tpot=0.05, ttft=0.5), 10.0, n)
    col = compare.by_tag(fake_results(tpot=0.1, ttft=0.25), 10.0, n)
    r = compare.compute_ratios(dis, col)
    assert abs(r["tpot_p99"] - 2.0) < 1e-6  # colocated decodes twice as slow per token
    assert abs(r["ttft_p99"] - 0.5) < 1e-6  # colocated answers first tokens faster
    assert "goodput" not in r  # no colocated request met the TPOT SLO: no finite ratio
    col_ok = compare.by_tag(fake_results(tpot=0.055, ttft=0.25, n=5), 10.0, n)
    assert abs(compare.compute_ratios(dis, col_ok)["goodput"] - 2.0) < 1e-6  # 10 vs 5 good requests
    table = compare.markdown_table(dis, col, n, ["pdserve bench compare --x"])
    assert "| TPOT p99, decode requests (ms) | 50.0 | 100.0 | 2.000x |" in table
    assert "pdserve bench compare --x" in table and "OMP_WAIT_POLICY=PASSIVE" in table


def test_default_cluster_keeps_its_local_chunk_and_divides_the_given_cores(tmp_path):
    n = ns(cluster="default", decode_args="--max-running-requests 8",
           local_prefill_queue=compare.DEFAULT_LOCAL_PREFILL_QUEUE)
    node_args = ["--chunked-prefill-size", "256", "--max-total-tokens=32768", "--chunked-prefill-size=128"]
    c = compare.disaggregated_setup(n, node_args, [0, 1], str(tmp_path))
    assert c.auto_placement and c.core_loan and c.cores == [0, 1]
    assert c.local_prefill_queue == compare.DEFAULT_LOCAL_PREFILL_QUEUE > 0
    assert c.prefill_args == node_args and c.node_args == []
    # the decode node's chunks are its local prefills: the cluster's own size, not the prefill nodes'
    assert c.decode_args == ["--max-total-tokens=32768", "--max-running-requests", "8"]
    assert "as `pdserve cluster` starts it on cores [0, 1]" in compare.markdown_table(
        *(compare.by_tag(fake_results(0.05, 0.5), 10.0, n),) * 2, n, [])
    assert compare.disaggregated_setup(ns(cluster="default", local_prefill_queue=2), [], [0, 1],
                                       str(tmp_path)).local_prefill_queue == 2
    assert compare.main(["--local-prefill-queue", "4"]) == 2  # the pinned cluster has no local prefills
    assert compare.main(["--cluster", "default", "--local-prefill-queue", "-1"]) == 2
    assert compare.main(["--min-rate", "0"]) == 2  # the sweep would halve the rate for ever
    assert compare.main(["--rounds", "0"]) == 2
    pinned = compare.disaggregated_setup(ns(), node_args, [0, 1], str(tmp_path))
    assert not pinned.auto_placement and pinned.local_prefill_queue == 0
    assert pinned.cpu_affinity == {"prefill": [0], "decode": [1]} and pinned.node_args == node_args


def test_rounds_give_each_rounds_own_crossing_beside_the_pooled_one():
    n = ns(slo_ttft_ms=1000.0, slo_tpot_ms=60.0)
    s = compare.by_tag(fake_results(tpot=0.05, ttft=0.5), 10.0, n)

    def sweep(*atts):
        return [{"rate": r, "attainment": a, "requests": 32}
                for r, a in zip((0.5, 1.0, 2.0), atts, strict=True)]

    rounds = {"disaggregated": [sweep(1.0, 0.95, 0.4), sweep(1.0, 0.85, 0.3)],
              "colocated": [sweep(0.95, 0.5, 0.2), sweep(0.0, 0.0, 0.0)]}
    assert compare.slo_rate_by_round(rounds) \
        == [round((1 + 0.05 / 0.55) / (0.5 + 0.5 * 0.05 / 0.45), 4), None]
    assert compare.slo_rate_by_round({"colocated": rounds["colocated"]}) == []
    pooled = {name: compare.pooled(rr) for name, rr in rounds.items()}
    table = compare.markdown_table(s, s, n, [], pooled, rounds)
    assert "0.5: 100% of 64, 1: 90% of 64, 2: 35% of 64" in table
    assert "| the same, each round on its own (req/s) | 1.091, 0.833 | 0.556, 0.000 | 1.964x, n/a |" in table
