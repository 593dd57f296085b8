"""What the PD node tests share: node settings, request helpers, and the free-resource checks.

Nodes serve a tiny random-weight llama with the default model's tokenizer (`pd_model_dir`); a colocated
node with the same settings gives the reference answers. After a test both nodes of a pair must be back
at their starting free KV pages (radix-cached pages count as free), request slots and metadata slots,
with empty queues (`assert_restored`).
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import time

from tests.harness.client import http_post

# settings every node of the suite shares (prefill and decode must agree on page size)
BASE = {"page_size": 4, "chunked_prefill_size": 32, "max_total_tokens": 2048, "max_running_requests": 16,
        "context_length": 256}
FAST_ENV = {"PDSERVE_HEARTBEAT_INTERVAL": "0.3", "PDSERVE_HEARTBEAT_MAX_FAILURES": "4",
            "PDSERVE_TRANSFER_WORKERS": "2", "OMP_NUM_THREADS": "1"}

FREE_KEYS = ("kv_free_tokens", "req_slots_free", "metadata_slots_free")


def free_counts(node) -> dict:
    s = node.stats()
    out = {k: s.get(k, 0) for k in FREE_KEYS}  # a colocated node has no metadata slots
    out["evictable"] = s.get("kv_evictable_tokens", 0)
    out["queues"] = {k: v for k, v in s["num_queue_reqs"].items() if v}
    return out


def wait_restored(node, start: dict, timeout: float = 30.0) -> dict:
    """Wait until the node's free KV (counting radix-cached pages as free), request slots and metadata
    slots are back at `start` and its queues are empty; returns the last counts."""
    deadline = time.time() + timeout
    while True:
        now = free_counts(node)
        ok = (now["kv_free_tokens"] + now["evictable"] == start["kv_free_tokens"] + start["evictable"]
              and now["req_slots_free"] == start["req_slots_free"]
              and now["metadata_slots_free"] == start["metadata_slots_free"] and not now["queues"])
        if ok or time.time() > deadline:
            return now
        time.sleep(0.2)


def assert_restored(*pairs) -> None:
    """`assert_restored((node, start_counts), ...)`"""
    for node, start in pairs:
        now = wait_restored(node, start)
        assert now["kv_free_tokens"] + now["evictable"] == start["kv_free_tokens"] + start["evictable"], \
            (node.role, now, start)
        assert now["req_slots_free"] == start["req_slots_free"], (node.role, now, start)
        assert now["metadata_slots_free"] == start["metadata_slots_free"], (node.role, now, start)
        assert not now["queues"], (node.role, now)


def wait_stage(node, stage: str, n: int = 1, timeout: float = 30.0) -> None:
    """Wait until `n` requests sit in the node's `stage` queue (bootstrap, prealloc, transfer, running...)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if free_counts(node)["queues"].get(stage, 0) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"{node.role} never had {n} request(s) in {stage}: {free_counts(node)}")


def greedy(n: int = 8) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}


def make_prompts(tok, n: int, seed: int = 0, lo: int = 3, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = len(tok)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def colocated_tokens(node, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    """The greedy output ids of each prompt on a colocated node (8 requests at a time)."""

    def one(p):
        status, body = http_post(node.url + "/generate", {"input_ids": p, "sampling_params": greedy(n)})
        assert status == 200, body
        return json.loads(body)["output_ids"]

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        return list(ex.map(one, prompts))


def hf_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # exactly max_new_tokens, like ignore_eos
    return hf


def hf_greedy(hf, prompt: list[int], n: int = 8) -> list[int]:
    import torch

    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()
