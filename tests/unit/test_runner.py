"""ModelRunner: pool sizing from the settings and the model, forward + sample on a real tiny model."""

from __future__ import annotations

import torch

from common.config import ServerArgs
from common.forward_batch import ForwardBatch, ForwardMode
from common.layers.sampling import SamplingBatchInfo
from common.protocol import SamplingParams
from common.runner import REQ_POOL_HEADROOM, ModelRunner


def test_runner_pools_and_greedy_step(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    args = ServerArgs(model=tiny_model_dir, page_size=8, max_total_tokens=100, max_running_requests=5,
                      context_length=10**6)
    r = ModelRunner(args, tiny_model_dir)
    cfg = r.model_config
    assert r.context_length == cfg.context_length  # min(args, model)
    assert r.allocator.page_size == 8 and r.allocator.num_pages == 100 // 8 + 1
    assert r.max_total_tokens == r.allocator.capacity == 96
    assert r.kv_pool.kv_heads == cfg.num_kv_heads and len(r.kv_pool.layer_ids) == cfg.num_layers
    assert r.req_to_token_pool.size == 5 + REQ_POOL_HEADROOM
    assert r.req_to_token_pool.max_context_len >= r.context_length
    r2 = ModelRunner(ServerArgs(model=tiny_model_dir, context_length=64), tiny_model_dir)
    assert r2.context_length == 64

    ids = [5, 9, 13, 2, 7, 11]
    row = r.req_to_token_pool.alloc()
    slots = r.allocator.alloc_extend(0, 0, len(ids))
    r.req_to_token_pool.write(row, 0, slots)
    fb = ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.tensor(ids), positions=torch.arange(len(ids)),
                      out_cache_loc=slots, req_pool_indices=torch.tensor([row]), seq_lens=[len(ids)],
                      extend_prefix_lens=[0], extend_seq_lens=[len(ids)], kv_pool=r.kv_pool,
                      req_to_token=r.req_to_token_pool.req_to_token)
    logits = r.forward(fb)
    assert logits.shape == (1, cfg.vocab_size) and logits.dtype == torch.float32
    info = SamplingBatchInfo.build([SamplingParams(temperature=0)], [[]], cfg.vocab_size,
                                   [None], cfg.eos_token_ids)
    out = r.sample(logits, info, [2])
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert torch.allclose(logits[0], ref, atol=1e-4)
    assert int(out.next_token_ids[0]) == int(ref.argmax())
    assert out.top_logprobs[0][0][1] == int(ref.argmax())
    r.allocator.free_slots(slots)
    r.req_to_token_pool.free(row)
