"""Mixed chunks (`--enable-mixed-chunk`) on a node of several ranks: two TP ranks, and two pipeline
stages. A prompt prefilled in chunks of 32 while another request decodes carries that request's tokens
in its chunks' forwards; both answers are the single-rank colocated node's, and the node's memory comes
back. The decoding request is slowed down until the prompt's answer is back (`decode_during`), whatever
the host's speed."""

from __future__ import annotations

import random

import pytest

from tests.harness.client import wait_until
from tests.harness.cluster import node_stats, pool_snapshot
from tests.harness.hooks import HOOKS, decode_during
from tests.harness.pd import colocated_tokens

CHUNK = 32


@pytest.mark.parametrize("ranks", [{"tp": 2}, {"pp_size": 2}], ids=["tp2", "pp2"])
def test_mixed_chunks_on_a_node_of_two_ranks(tiny_model_dir, launcher, colocated, tmp_path, ranks):
    node = launcher.colocated(tiny_model_dir, enable_mixed_chunk=True, chunked_prefill_size=CHUNK,
                              env={"PYTHONPATH": HOOKS, "PDSERVE_TEST_HOOKS_DIR": str(tmp_path)}, **ranks)
    baseline = pool_snapshot(node.url)
    rng = random.Random(17)
    running_ids = [rng.randrange(10, 1000) for _ in range(40)]
    chunked_ids = [rng.randrange(10, 1000) for _ in range(3 * CHUNK + 5)]  # four chunks
    chunked, res = decode_during(node.url, running_ids, 200, tmp_path,
                                 lambda: colocated_tokens(node, [chunked_ids], 8)[0])
    assert res.ok, res.error
    assert node_stats(node.url)["num_mixed_steps"] >= 4  # each chunk carried the running request
    assert chunked == colocated_tokens(colocated, [chunked_ids], 8)[0]
    assert res.events[-1]["output_ids"] == colocated_tokens(colocated, [running_ids], 200)[0]
    wait_until(lambda: pool_snapshot(node.url) == baseline, 60, "the node's memory to come back")
