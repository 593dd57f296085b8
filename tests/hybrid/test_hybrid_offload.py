"""A hybrid model's retracted requests keep their KV and their recurrent/conv state in the host store
(`--decode-offload-size`): resumed without a prefill, they give transformers' greedy tokens."""

from __future__ import annotations

from tests.hybrid.hybrid_harness import random_prompt
from tests.hybrid.test_hybrid_engine import Engine, hf_greedy, qwen35_dir  # noqa: F401  (fixture)
from tests.model_harness import one_torch_thread  # noqa: F401  (autouse: single-threaded module)


def test_hybrid_retraction_restores_kv_and_state(qwen35_dir):  # noqa: F811
    path, hf = qwen35_dir
    lens = (20, 22, 18, 25, 21, 19)
    prompts = [random_prompt(n, 200 + n) for n in lens]
    eng = Engine(path, max_total_tokens=160, init_new_token_ratio=0.05, min_new_token_ratio=0.01,
                 decode_offload_size=2048)
    for i, p in enumerate(prompts):
        eng.submit(f"r{i}", p, max_new=30)
    got = eng.run()
    s = eng.sched.get_stats()
    assert s["num_retractions"] > 0, "the pool was meant to run out"
    assert s["num_retract_restored"] == s["num_retractions"] and s["num_retract_recomputed"] == 0
    assert s["total_prefill_tokens"] == sum(lens)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == hf_greedy(hf, p, 30), f"request {i}"
    eng.assert_restored()
    assert len(eng.sched.host_store) == 0
