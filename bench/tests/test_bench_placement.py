"""`pdserve bench placement` end to end on the tiny model (fake backend, a few short requests) with the
cluster as it starts by default (the colocated node it is compared with is `bench compare`'s
`colocated_node`), and the ratios' orientation."""

from __future__ import annotations

import json

from bench import placement
from deploy.placement import plan


def test_ratios_are_oriented_so_higher_means_the_default_cluster_did_better():
    s = {"colocated": {"output_throughput": 40.0, "itl_ms": {"p99": 900.0}},
         "cluster": {"output_throughput": 50.0, "itl_ms": {"p99": 300.0}},
         "cluster_unpinned": {"output_throughput": 10.0, "itl_ms": {"p99": 1200.0}},
         "cluster_remote_prefill": {"output_throughput": 40.0, "itl_ms": {"p99": 200.0},
                                    "ttft_ms": {"p50": 3000.0}}}
    s["cluster"]["ttft_ms"] = {"p50": 1000.0}
    r = placement.compute_ratios(s)
    assert r == {"cluster_output_throughput": 1.25, "cluster_itl_p99": 3.0,
                 "placement_output_throughput": 5.0,
                 "placement_itl_p99": 4.0, "local_prefill_output_throughput": 1.25,
                 "local_prefill_ttft_p50": 3.0}
    del s["cluster_unpinned"], s["cluster_remote_prefill"]
    assert set(placement.compute_ratios(s)) == {"cluster_output_throughput", "cluster_itl_p99"}
    # rounds: each ratio's median over the rounds that have it
    assert placement.median_ratios([{"a": 1.0, "b": 2.0}, {"a": 3.0}, {"a": 2.5}]) == {"a": 2.5, "b": 2.0}


def test_bench_placement_runs_the_default_cluster(tiny_model_dir, tmp_path):
    out = tmp_path / "placement.json"
    rc = placement.main(["--model", tiny_model_dir, "--transfer-backend", "fake", "--num-prompts", "4",
                         "--random-input-len", "24", "--random-output-len", "6", "--max-concurrency", "2",
                         "--warmup-requests", "1", "--setups", "cluster", "--disable-tqdm",
                         "--local-prefill-queue", "3",
                         "--node-args", "--max-total-tokens 2048", "--log-dir", str(tmp_path / "logs"),
                         "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    [only] = report["figures"]["rounds"]
    runs = only["runs"]
    assert set(runs) == {"cluster"}
    for run in runs.values():
        assert run["summary"]["completed"] == 4 and run["summary"]["failed"] == 0
    cores = report["figures"]["config"]["cores"]
    want = plan(1, 1, cores).cores
    assert {k: v for k, v in runs["cluster"]["placement"].items() if k != "router"} == want
    assert report["ratios"] == {}  # one setup: nothing to compare
    router_cmd = (tmp_path / "logs" / "round1" / "cluster" / "router.log").read_text().splitlines()[0]
    assert "--local-prefill-queue 3" in router_cmd


def test_unknown_setups_are_refused():
    assert placement.main(["--setups", "colocated,nonsense"]) == 2
    assert placement.main(["--rounds", "0"]) == 2
    assert placement.main(["--local-prefill-queue", "0"]) == 2  # that is the cluster_remote_prefill setup
