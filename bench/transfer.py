"""`pdserve bench transfer`: KV transfer throughput per backend on loopback.

For each backend two processes (a prefill rank and a decode rank) hold the nodes' page-first
`KVPool` in the default model's shape (SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64, fp32, page
size 16), described by `KVArgs.from_pool` as the nodes do. For a 512-token and a 4096-token request
it measures, in the same run and with the same engine:

* `pagelist` — the full protocol path: KVSender/KVReceiver, bootstrap, TransferInfo, chunked
  page-list writes of a fragmented (non-contiguous) page list, Success status. Timed on the prefill
  side from the first `send()` to Success.
* `engine_pagelist` — the same regions written by one bare engine `write()` (no protocol); `regions`
  is their count (a page-first page run with all layers' K and V is one region).
* `raw` — the engine writing one contiguous buffer of the same size: the same number of pages as
  one run of the pool, starting at a random page in each repeat. It lives in the pool's own
  allocation on purpose: a separate numpy buffer gets transparent huge pages (numpy madvises them,
  torch does not), which nixl/ucx copy about twice as fast on loopback; and it moves with the
  repeats because the same 24 MB written every time stay cached (~20% faster at 512 tokens).
  Both are memory effects, not page-list costs.
* `memcpy` — torch copy of the same number of bytes in one process.

Ratios `<backend>_<tokens>` = pagelist GB/s / raw GB/s (target >= 0.8), taken as the median over
repeats of raw time / pagelist time of the same repeat (both timed back to back). On a 2-core host
single transfers vary by up to 2x with thread placement, which tends to hold for a whole process
pair's life, so the repeats are spread over several rounds of fresh processes (3 x 7 by default).

`--device cuda` puts both sides' pools on the GPU (`cuda:0`; two processes on one device, as on the
CPU), registered and written as "cuda:0" memory (`transfer/memory.py`); the metadata rows stay in host
memory, pinned, as on a GPU node. Besides the figures above it measures, in the same run, the device's
own copy rate for the same bytes: one `dst.copy_(src)` of a contiguous buffer of equal size,
between `torch.cuda.synchronize()` calls, best of max(3, repeats). GB/s counts the bytes moved once,
for the copy as for the transfers. Ratios `<backend>_<tokens>_vram` = the best `engine_pagelist`
GB/s (the page-list regions in one bare engine write) / that copy GB/s (target >= 0.8), and
`transfer_vram` is that ratio for the first backend measured, at the largest size. The fake backend
moves no bytes, so on cuda it is recorded as skipped. Without a CUDA device `--device cuda` exits 2.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import shlex
import statistics
import sys
import time

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE_BYTES = 30, 3, 64, 16, 4
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
REAL_BACKENDS = ("mooncake", "nixl", "ucx")
CHUNK_PAGES = 128  # chunked prefill of 2048 tokens
CUDA_DEVICE = "cuda:0"
NO_CUDA = "--device cuda: no CUDA device (torch.cuda.is_available() is False)"
NO_BYTES = "moves no bytes: no bandwidth to measure"


def page_bytes() -> int:
    return KV_HEADS * PAGE_SIZE * HEAD_DIM * DTYPE_BYTES


def fragmented_pages(n: int, pool_pages: int, rng: random.Random) -> list[int]:
    """A page list like a busy allocator hands out: runs of 1-8 consecutive pages, scattered."""
    free = list(range(1, pool_pages))
    runs, i = [], 0
    while i < len(free):
        k = rng.randint(1, 8)
        runs.append(free[i:i + k])
        i += k
    rng.shuffle(runs)
    return [p for run in runs for p in run][:n]


def _build(role: str, backend: str, pool_pages: int, bootstrap_addr: str | None, device: str):
    import torch

    from common.memory.kv_pool import KVPool
    from transfer.base import KVArgs
    from transfer.metadata import MetadataBuffers
    from transfer.receiver import DecodeKVManager
    from transfer.sender import PrefillKVManager

    torch.set_num_threads(1)
    pool = KVPool(pool_pages, PAGE_SIZE, LAYERS, KV_HEADS, HEAD_DIM, dtype=torch.float32, device=device)
    # write every page: untouched (lazily mapped) destination pages would charge page faults to
    # whichever transfer touches them first
    gen = torch.Generator(device=pool.device).manual_seed(1)
    for b in pool.buffers():
        if role == "prefill":
            b.normal_(generator=gen)
        else:
            b.fill_(0.5)
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)
    meta = MetadataBuffers(8, pinned=pool.device.type == "cuda")  # host rows, pinned beside a GPU pool
    args = KVArgs.from_pool(pool, meta, model=MODEL)
    if role == "prefill":
        mgr = PrefillKVManager(args, backend, host="127.0.0.1", bootstrap_addr=bootstrap_addr)
    else:
        mgr = DecodeKVManager(args, backend, host="127.0.0.1")
    return mgr, pool, meta


def _plan(tokens_list: list[int], repeats: int, pool_pages: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    jobs = []
    for tokens in tokens_list:
        n = -(-tokens // PAGE_SIZE)
        for rep in range(repeats + 1):  # the first run of each size warms connections and is not timed
            jobs.append({"tokens": tokens, "timed": rep > 0, "room": 10_000 + len(jobs),
                         "src": fragmented_pages(n, pool_pages, rng),
                         "dst": fragmented_pages(n, pool_pages, rng),
                         "raw_start": rng.randint(1, pool_pages - n)})
    return jobs


def _decode_main(backend, addr, jobs, pool_pages, device, to_prefill, out) -> None:
    from transfer.base import KVPoll
    from transfer.control import peer_registration
    from transfer.receiver import KVReceiver

    mgr, pool, meta = _build("decode", backend, pool_pages, None, device)
    to_prefill.put((peer_registration(mgr.args, "bench", mgr.engine.describe()), pool.data.data_ptr()))
    ok = True
    for job in jobs:
        recv = KVReceiver(mgr, addr, job["room"])
        recv.init(job["dst"], 0)
        while recv.poll() not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(0.0005)
        if recv.poll() != KVPoll.Success:
            ok = False
            out.put({"side": "decode", "error": recv.failure_exception().reason})
            break
    out.put({"side": "decode", "ok": ok})
    to_prefill.get(timeout=600)  # keep the buffers registered until the prefill side is done
    mgr.close()


def _prefill_main(backend, addr, jobs, pool_pages, device, from_decode, out) -> None:
    import torch

    from transfer.base import KVPoll
    from transfer.plan import PairPlan
    from transfer.sender import KVSender

    mgr, pool, meta = _build("prefill", backend, pool_pages, addr, device)
    reg, dst_pool = from_decode.get(timeout=600)
    peer = mgr.engine.add_peer(reg.engine_desc)
    plan = PairPlan(mgr.args, reg)  # the same region planning the sender uses, for the bare-engine figure
    kinds = plan.kv_memory  # (source, destination) memory kind of the pools: "host" or "cuda:0"

    def settle() -> None:  # nothing of this process's own may still run on the device when a timer starts
        if pool.device.type == "cuda":
            torch.cuda.synchronize(pool.device)

    results = []
    for job in jobs:
        n_pages = len(job["src"])
        nbytes = n_pages * page_bytes() * 2 * LAYERS
        meta.set_buf(0, first_token_id=1, room=job["room"])
        sender = KVSender(mgr, job["room"])
        sender.init(n_pages, 0)
        while sender.poll() == KVPoll.Bootstrapping:
            time.sleep(0.0005)
        t0 = time.perf_counter()
        for off in range(0, n_pages, CHUNK_PAGES):
            last = off + CHUNK_PAGES >= n_pages
            sender.send(job["src"][off:off + CHUNK_PAGES], last=last)
        while sender.poll() not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(0.0002)
        t_pagelist = time.perf_counter() - t0
        if sender.poll() != KVPoll.Success:
            out.put({"side": "prefill", "error": sender.failure_exception().reason})
            return
        src, dst, lens = plan.kv_regions(np.array(job["src"], dtype=np.int64),
                                         np.array(job["dst"], dtype=np.int64))
        settle()
        t0 = time.perf_counter()
        mgr.engine.write(peer, src, dst, lens, *kinds)
        t_engine = time.perf_counter() - t0
        settle()
        t0 = time.perf_counter()
        k = job["raw_start"]
        mgr.engine.write(peer, [pool.data[k].data_ptr()], [dst_pool + k * pool.page_stride], [nbytes], *kinds)
        t_raw = time.perf_counter() - t0
        if job["timed"]:
            results.append({"tokens": job["tokens"], "bytes": nbytes, "regions": len(lens),
                            "pagelist_s": t_pagelist, "engine_pagelist_s": t_engine, "raw_s": t_raw})
    out.put({"side": "prefill", "results": results})
    mgr.close()


def _run_round(backend: str, tokens_list: list[int], repeats: int, seed: int,
               device: str = "cpu") -> list[dict]:
    """One prefill and one decode process; the timed rows of every repeat."""
    from transfer.bootstrap import BootstrapServer

    pool_pages = max(-(-t // PAGE_SIZE) for t in tokens_list) + 64
    jobs = _plan(tokens_list, repeats, pool_pages, seed)
    server = BootstrapServer("127.0.0.1", 0)
    server.start()
    addr = f"127.0.0.1:{server.port}"
    ctx = mp.get_context("spawn")
    link, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_prefill_main, args=(backend, addr, jobs, pool_pages, device, link, out)),
             ctx.Process(target=_decode_main, args=(backend, addr, jobs, pool_pages, device, link, out))]
    try:
        for p in procs:
            p.start()
        prefill = None
        errors = []
        end = time.monotonic() + 900
        while prefill is None and time.monotonic() < end:
            try:
                msg = out.get(timeout=1)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    errors.append(f"a {backend} bench process exited with {[p.exitcode for p in procs]}")
                    break
                continue
            if "error" in msg:
                errors.append(f"{msg['side']}: {msg['error']}")
                break
            if msg["side"] == "prefill":
                prefill = msg
        link.put("done")
        if prefill is None:
            raise RuntimeError(f"{backend} transfer bench failed: {'; '.join(errors) or 'timed out'}")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        server.stop()
    return prefill["results"]


def summarize(rows: list[dict], tokens_list: list[int], best: bool = False) -> dict:
    """A backend's figures per size from the timed rows of all its rounds; `best` adds the fastest
    engine page-list write (what `--device cuda` sets against the device's best copy)."""
    figures = {}
    for tokens in tokens_list:
        mine = [r for r in rows if r["tokens"] == tokens]
        nbytes = mine[0]["bytes"]
        figures[str(tokens)] = {
            "bytes": nbytes, "regions": statistics.median_low(r["regions"] for r in mine),
            "pagelist_gbps": nbytes / statistics.median(r["pagelist_s"] for r in mine) / 1e9,
            "engine_pagelist_gbps": nbytes / statistics.median(r["engine_pagelist_s"] for r in mine) / 1e9,
            "raw_gbps": nbytes / statistics.median(r["raw_s"] for r in mine) / 1e9,
            # the two are timed back to back in each repeat; the median of per-repeat ratios resists
            # load changes on a shared machine better than a ratio of medians
            "pagelist_over_raw": statistics.median(r["raw_s"] / r["pagelist_s"] for r in mine),
            "repeats": len(mine),
        }
        if best:
            figures[str(tokens)]["engine_pagelist_best_gbps"] = nbytes \
                / min(r["engine_pagelist_s"] for r in mine) / 1e9
    return figures


def run_backend(backend: str, tokens_list: list[int], repeats: int, rounds: int, device: str = "cpu") -> dict:
    rows = [row for i in range(rounds) for row in _run_round(backend, tokens_list, repeats, 1234 + i, device)]
    return summarize(rows, tokens_list, best=device != "cpu")


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def device_copy_gbps(nbytes: int, repeats: int, device: str = CUDA_DEVICE) -> float:
    """The device's own copy rate for `nbytes`: one copy of a contiguous buffer, synchronized on both
    sides, best of max(3, repeats); bytes moved once per second."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # the first copy pays for the kernel's first launch
    best = float("inf")
    for _ in range(max(3, repeats)):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()  # leave the device's memory to the bench's processes
    return nbytes / best / 1e9


def vram_ratios(backends: dict, copy_gbps: dict[str, float]) -> dict[str, float]:
    """For `--device cuda`: each measured backend's best engine page-list GB/s over the copy GB/s of the
    same size, written into its figures (`copy_gbps`, `transfer_vram`) and returned as ratios
    `<backend>_<tokens>_vram`, plus `transfer_vram`: the first measured backend's at the largest size.
    Backends that failed (`error`) or were skipped (`skipped`) have none."""
    ratios: dict[str, float] = {}
    headline = None
    for backend, figs in backends.items():
        if "error" in figs or "skipped" in figs:
            continue
        for tokens, f in figs.items():
            f["copy_gbps"] = copy_gbps[tokens]
            f["transfer_vram"] = f["engine_pagelist_best_gbps"] / copy_gbps[tokens]
            ratios[f"{backend}_{tokens}_vram"] = f["transfer_vram"]
        if headline is None and figs:
            headline = figs[max(figs, key=int)]["transfer_vram"]
    if headline is not None:
        ratios["transfer_vram"] = headline
    return ratios


def _device_info(device: str) -> dict:
    if device == "cpu":
        return {"kind": "cpu"}
    import torch

    props = torch.cuda.get_device_properties(CUDA_DEVICE)
    return {"kind": CUDA_DEVICE, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda}


def _print_table(figures: dict, reference: str) -> None:
    print(f"\n{'backend':<10}{'tokens':>7}{'MB':>8}{'regions':>9}{'pagelist':>10}{'engine pl':>11}{'raw':>8}"
          f"{'copy' if reference == 'device_copy_gbps' else 'memcpy':>8}   (GB/s)")
    for backend, figs in figures["backends"].items():
        if "error" in figs or "skipped" in figs:
            print(f"{backend:<10} "
                  f"{'error: ' + figs['error'] if 'error' in figs else 'skipped: ' + figs['skipped']}")
            continue
        for tokens, f in figs.items():
            print(f"{backend:<10}{tokens:>7}{f['bytes'] / 1e6:>8.1f}{f['regions']:>9}"
                  f"{f['pagelist_gbps']:>10.2f}{f['engine_pagelist_gbps']:>11.2f}{f['raw_gbps']:>8.2f}{figures[reference][tokens]:>8.2f}")


def main(argv: list[str] | None = None) -> dict | int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # mooncake listens on every interface whatever its host (transfer/mooncake.py) and is refused on a
    # specific host unless acknowledged: a measurement inside this process acknowledges it
    os.environ.setdefault("PDSERVE_TRANSFER_ALLOW_WILDCARD_LISTEN", "1")
    ap = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--backend", action="append", default=None,
                    help="mooncake, nixl, ucx, fake (repeatable) or 'all' (default: all real ones)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where both sides' KV pools live: host memory, or the first GPU (cuda:0)")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096],
                    help="KV lengths in tokens to transfer, one run each")
    ap.add_argument("--repeats", type=int, default=7, help="timed transfers per size and round")
    ap.add_argument("--rounds", type=int, default=3, help="fresh process pairs per backend")
    args = ap.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        ap.error(f"--tokens: every length must be >= 1, got {args.tokens}")
    if args.repeats < 1 or args.rounds < 1:
        ap.error(f"--repeats and --rounds must be >= 1, got {args.repeats} and {args.rounds}")
    names = args.backend or ["all"]
    backends = list(REAL_BACKENDS) if "all" in names else names
    cuda = args.device == "cuda"
    if cuda:
        import torch

        if not torch.cuda.is_available():
            print(NO_CUDA, file=sys.stderr)
            return 2
    from bench.report import write_report

    reference = "device_copy_gbps" if cuda else "memcpy_gbps"
    figures: dict = {"command": "pdserve bench transfer " + shlex.join(argv),
                     "device": _device_info(args.device),
                     "layout": {"model": MODEL, "layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                "page_size": PAGE_SIZE, "dtype": "float32", "chunk_pages": CHUNK_PAGES},
                     "backends": {}, reference: {}}
    ratios: dict[str, float] = {}
    for tokens in args.tokens:
        nbytes = -(-tokens // PAGE_SIZE) * page_bytes() * 2 * LAYERS
        figures[reference][str(tokens)] = (device_copy_gbps(nbytes, args.repeats) if cuda
                                           else memcpy_gbps(nbytes, args.repeats))
    for backend in backends:
        if cuda and backend == "fake":
            figures["backends"][backend] = {"skipped": NO_BYTES}
            continue
        try:
            figs = run_backend(backend, args.tokens, args.repeats, args.rounds,
                               CUDA_DEVICE if cuda else "cpu")
        except Exception as e:
            print(f"{backend}: {e}", file=sys.stderr)
            figures["backends"][backend] = {"error": str(e)}
            continue
        figures["backends"][backend] = figs
        for tokens, f in figs.items():
            ratios[f"{backend}_{tokens}"] = f["pagelist_over_raw"]
    if cuda:
        ratios.update(vram_ratios(figures["backends"], figures[reference]))
    _print_table(figures, reference)
    return write_report(args.json, "transfer", figures, ratios)


if __name__ == "__main__":
    rc = main()
    sys.exit(rc if isinstance(rc, int) else 0)
