"""A prefill/decode pair started with `--cluster-secret-file`: the secret reaches the scheduler ranks
(the bootstrap server and both KV managers sign and check), requests complete, the prefill's
bootstrap port refuses an unsigned look-up (401) and counts it in the node's /server_info stats and
/metrics, and the secret itself shows in neither."""

from __future__ import annotations

import os

import pytest

from tests.harness.client import http, http_get
from tests.harness.pd import BASE, greedy, make_prompts


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> tuple[str, str]:
    value = os.urandom(24).hex()
    path = tmp_path_factory.mktemp("secret") / "cluster.secret"
    path.write_text(value + "\n")
    return str(path), value


@pytest.fixture(scope="module")
def pair(pd_model_dir, module_launcher, secret):
    return module_launcher.pair(pd_model_dir, "fake", settings={**BASE, "cluster_secret_file": secret[0]})


def test_pd_pair_with_a_cluster_secret(pair, pd_tok, secret):
    for prompt in make_prompts(pd_tok, 3, seed=11):
        (ps, pb), (ds, db) = pair.generate({"input_ids": prompt, "sampling_params": greedy(4)})
        assert ps == 200 and ds == 200, (pb, db)
        assert len(db["output_ids"]) == 4
    route = f"http://127.0.0.1:{pair.bootstrap_port}/route?engine_rank=-1&target_dp_group=-1&target_pp_rank=-1"
    assert http("GET", route)[0] == 401  # the layout is not public any more
    assert http_get(f"http://127.0.0.1:{pair.bootstrap_port}/health") == (200, b"OK")
    stats = pair.prefill.stats()
    assert stats["bootstrap_dropped_unauthenticated"] >= 1
    assert stats["control_dropped_unauthenticated"] == 0 and stats["control_dropped_stale_or_replayed"] == 0
    assert pair.decode.stats()["control_dropped_unauthenticated"] == 0
    _, info = http_get(pair.prefill.url + "/server_info")
    assert secret[0].encode() in info and secret[1].encode() not in info
    _, metrics = http_get(pair.prefill.url + "/metrics")
    assert b"pdserve_bootstrap_dropped_unauthenticated_total{" in metrics \
        and secret[1].encode() not in metrics
    assert b"pdserve_transfer_paused_seconds_total{" in metrics  # how long the heartbeat timer was kept off
    for node in (pair.prefill, pair.decode):  # the secret is never logged, and nothing says it is missing
        log = node.log_path.read_bytes()
        assert secret[1].encode() not in log and b"no cluster secret" not in log
