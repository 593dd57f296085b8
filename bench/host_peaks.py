"""What this host can do, measured the moment it is asked, for the benches that divide by it: memory
bandwidth (in order, and in the scattered page runs decode attention reads), float32 matmul peak (the
best torch.mm rate), the cores' float32 FMA rate (above any matmul's: what the arithmetic alone allows),
and a prefill's operation count. `pdserve bench engine` and `pdserve bench quant` sample these beside
their own runs, as a host's speed drifts within the hour."""

from __future__ import annotations

import time

import torch


def memory_bandwidth(run_bytes: int, nbytes: int = 512 * 2**20, repeats: int = 7) -> dict:
    """Best memcpy and read (sum) rates over buffers on huge pages, as the packed weights are; and the best
    read rate over runs of `run_bytes` of the same buffer taken in random order, as decode attention reads
    the KV pool (one page of one layer and head per run, the pages scattered). Each 4 MiB of runs is
    gathered into one buffer that stays in the cache, so that traffic is the reads."""
    from common.memory.huge_pages import huge_zeros

    n = nbytes // 4
    src = huge_zeros(n).fill_(1.0)
    dst = huge_zeros(n)
    dst.copy_(src)
    floats = max(1, run_bytes // 4)
    runs = src[:n // floats * floats].view(-1, floats)
    order = torch.randperm(runs.shape[0])
    step = max(1, 4 * 2**20 // (floats * 4))
    gathered = torch.empty(step, floats)
    copy_times, read_times, run_times = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        float(src.sum())
        read_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(0, runs.shape[0], step):
            idx = order[i:i + step]
            torch.index_select(runs, 0, idx, out=gathered[:len(idx)])
        run_times.append(time.perf_counter() - t0)
    copy_gbps = nbytes / min(copy_times) / 1e9
    return {"buffer_mib": nbytes / 2**20, "memcpy_gbps": copy_gbps, "memcpy_traffic_gbps": 2 * copy_gbps,
            "read_gbps": nbytes / min(read_times) / 1e9,
            "page_run_read_gbps": runs.numel() * 4 / min(run_times) / 1e9}


def fma_peak_gflops(threads: int = 0, repeats: int = 5) -> float | None:
    """The best of `repeats` runs of the native kernels' FMA loop (`common/layers/fma_peak.c`) on `threads`
    threads (0: torch's), in GFLOP/s; None without the native kernels."""
    from common.layers import native

    fn = native.fma_peak_gflops()
    if fn is None:
        return None
    steps = 2_000_000  # ~10 ms a run
    return max(fn(steps, threads) for _ in range(repeats))


def prefill_work(cfg, weights: float, p_len: int) -> tuple[float, float]:
    """A `p_len`-token prefill's operations: (the projections' on every prompt token, the lm_head's on the
    last one plus causal attention's 2 x layers x heads x head_dim x len^2)."""
    lm = cfg.vocab_size * cfg.hidden_size
    return 2 * (weights - lm) * p_len, 2 * lm \
        + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * p_len * p_len


def matmul_peak_gflops(repeats: int = 5, sizes: tuple[int, ...] = (1024, 2048)) -> float:
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t0) / 1e9)
    return best
