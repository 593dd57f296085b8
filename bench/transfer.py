"""`pdserve bench transfer`: KV transfer throughput per backend on loopback.

For each backend two processes (a prefill rank and a decode rank) hold KV pools in the default
model's layout (SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64, fp32, page size 16). For a
512-token and a 4096-token request it measures, in the same run and with the same engine:

* `pagelist` — the full protocol path: KVSender/KVReceiver, bootstrap, TransferInfo, chunked
  page-list writes of a fragmented (non-contiguous) page list, Success status. Timed on the prefill
  side from the first `send()` to Success.
* `engine_pagelist` — the same regions written by one bare engine `write()` (no protocol).
* `raw` — the engine writing one contiguous buffer of the same size.
* `memcpy` — torch copy of the same number of bytes in one process.

Ratios `<backend>_<tokens>` = pagelist GB/s / raw GB/s (target >= 0.8), taken as the median over
repeats of raw time / pagelist time of the same repeat (both timed back to back).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import time

import numpy as np

LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE, DTYPE_BYTES = 30, 3, 64, 16, 4
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
REAL_BACKENDS = ("mooncake", "nixl", "ucx")
CHUNK_PAGES = 128  # chunked prefill of 2048 tokens


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


def _build(role: str, backend: str, pool_pages: int, bootstrap_addr: str | None, contiguous_bytes: int):
    from transfer.base import KVArgs
    from transfer.manager import KVManager

    shape = (pool_pages, KV_HEADS, PAGE_SIZE, HEAD_DIM)
    # np.full writes every page: untouched (lazily mapped) destination pages would charge page faults
    # to whichever transfer touches them first
    bufs = [np.full(shape, 0.5, dtype=np.float32) for _ in range(2 * LAYERS)]
    if role == "prefill":
        rng = np.random.default_rng(1)
        for b in bufs:
            b[...] = rng.standard_normal(shape, dtype=np.float32)
    rooms = np.zeros((8, 8), dtype=np.int64)
    args = KVArgs(kv_data_ptrs=[b.ctypes.data for b in bufs], kv_data_lens=[b.nbytes for b in bufs],
                  kv_item_lens=[page_bytes()] * len(bufs), kv_head_num=KV_HEADS, page_size=PAGE_SIZE,
                  aux_data_ptrs=[rooms.ctypes.data], aux_data_lens=[rooms.nbytes], aux_item_lens=[64],
                  aux_room_index=0, model=MODEL)
    mgr = KVManager(args, role, backend, host="127.0.0.1", bootstrap_addr=bootstrap_addr)
    flat = np.ones(contiguous_bytes, dtype=np.uint8)
    mgr.engine.register(flat.ctypes.data, flat.nbytes)
    return mgr, bufs, rooms, flat


def _plan(tokens_list: list[int], repeats: int, pool_pages: int) -> list[dict]:
    rng = random.Random(1234)
    jobs = []
    for tokens in tokens_list:
        n = -(-tokens // PAGE_SIZE)
        for rep in range(repeats + 1):  # the first run of each size warms connections and is not timed
            jobs.append({"tokens": tokens, "timed": rep > 0, "room": 10_000 + len(jobs),
                         "src": fragmented_pages(n, pool_pages, rng), "dst": fragmented_pages(n, pool_pages, rng)})
    return jobs


def _decode_main(backend, addr, jobs, pool_pages, contiguous_bytes, to_prefill, out) -> None:
    from transfer.base import KVPoll
    from transfer.manager import KVReceiver

    mgr, bufs, rooms, flat = _build("decode", backend, pool_pages, None, contiguous_bytes)
    to_prefill.put((mgr.engine.describe(), flat.ctypes.data, [b.ctypes.data for b in bufs]))
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


def _prefill_main(backend, addr, jobs, pool_pages, contiguous_bytes, from_decode, out) -> None:
    from transfer.base import KVPoll
    from transfer.control import RegisterPeer
    from transfer.manager import KVSender, _PairPlan

    mgr, bufs, rooms, flat = _build("prefill", backend, pool_pages, addr, contiguous_bytes)
    desc, dst_flat, dst_bufs = from_decode.get(timeout=600)
    peer = mgr.engine.add_peer(desc)
    a = mgr.args
    reg = RegisterPeer(src="bench", engine_desc=desc, tp_rank=0, tp_size=1, kv_head_num=KV_HEADS,
                       total_kv_heads=KV_HEADS, start_layer=0, kv_ptrs=dst_bufs, kv_item_lens=a.kv_item_lens,
                       aux_ptrs=[0], aux_item_lens=a.aux_item_lens, state_ptrs=[], state_item_lens=[],
                       state_dims=[], page_size=PAGE_SIZE, model=MODEL)
    plan = _PairPlan(a, reg)  # the same region planning the sender uses, for the bare-engine figure
    results = []
    for job in jobs:
        n_pages = len(job["src"])
        nbytes = n_pages * page_bytes() * 2 * LAYERS
        rooms[0, 0] = job["room"]
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
        src, dst, lens = plan.kv_regions(np.array(job["src"], dtype=np.int64), np.array(job["dst"], dtype=np.int64))
        t0 = time.perf_counter()
        mgr.engine.write(peer, src, dst, lens)
        t_engine = time.perf_counter() - t0
        t0 = time.perf_counter()
        mgr.engine.write(peer, [flat.ctypes.data], [dst_flat], [nbytes])
        t_raw = time.perf_counter() - t0
        if job["timed"]:
            results.append({"tokens": job["tokens"], "bytes": nbytes, "regions": len(lens), "pagelist_s": t_pagelist,
                            "engine_pagelist_s": t_engine, "raw_s": t_raw})
    out.put({"side": "prefill", "results": results})
    mgr.close()


def run_backend(backend: str, tokens_list: list[int], repeats: int) -> dict:
    from transfer.bootstrap import BootstrapServer

    pool_pages = max(-(-t // PAGE_SIZE) for t in tokens_list) + 64
    contiguous_bytes = max(-(-t // PAGE_SIZE) for t in tokens_list) * page_bytes() * 2 * LAYERS
    jobs = _plan(tokens_list, repeats, pool_pages)
    server = BootstrapServer("127.0.0.1", 0)
    server.start()
    addr = f"127.0.0.1:{server.port}"
    ctx = mp.get_context("spawn")
    link, out = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_prefill_main, args=(backend, addr, jobs, pool_pages, contiguous_bytes, link, out)),
             ctx.Process(target=_decode_main, args=(backend, addr, jobs, pool_pages, contiguous_bytes, link, out))]
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
    figures = {}
    for tokens in tokens_list:
        rows = [r for r in prefill["results"] if r["tokens"] == tokens]
        nbytes = rows[0]["bytes"]
        figures[str(tokens)] = {
            "bytes": nbytes, "regions": rows[0]["regions"],
            "pagelist_gbps": nbytes / statistics.median(r["pagelist_s"] for r in rows) / 1e9,
            "engine_pagelist_gbps": nbytes / statistics.median(r["engine_pagelist_s"] for r in rows) / 1e9,
            "raw_gbps": nbytes / statistics.median(r["raw_s"] for r in rows) / 1e9,
            # the two are timed back to back in each repeat; the median of per-repeat ratios resists
            # load changes on a shared machine better than a ratio of medians
            "pagelist_over_raw": statistics.median(r["raw_s"] / r["pagelist_s"] for r in rows),
            "repeats": len(rows),
        }
    return figures


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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="pdserve bench transfer", description=__doc__.split("\n")[0])
    ap.add_argument("--backend", action="append", default=None,
                    help="mooncake, nixl, ucx (repeatable) or 'all' (default: all)")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    names = args.backend or ["all"]
    backends = list(REAL_BACKENDS) if "all" in names else names
    from bench.report import write_report

    figures: dict = {"layout": {"model": MODEL, "layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                "page_size": PAGE_SIZE, "dtype": "float32", "chunk_pages": CHUNK_PAGES},
                     "backends": {}, "memcpy_gbps": {}}
    ratios: dict[str, float] = {}
    for tokens in args.tokens:
        nbytes = -(-tokens // PAGE_SIZE) * page_bytes() * 2 * LAYERS
        figures["memcpy_gbps"][str(tokens)] = memcpy_gbps(nbytes, args.repeats)
    for backend in backends:
        try:
            figs = run_backend(backend, args.tokens, args.repeats)
        except Exception as e:
            print(f"{backend}: {e}", file=sys.stderr)
            figures["backends"][backend] = {"error": str(e)}
            continue
        figures["backends"][backend] = figs
        for tokens, f in figs.items():
            ratios[f"{backend}_{tokens}"] = f["pagelist_over_raw"]
    print(f"\n{'backend':<10}{'tokens':>7}{'MB':>8}{'regions':>9}{'pagelist':>10}{'engine pl':>11}{'raw':>8}"
          f"{'memcpy':>8}   (GB/s)")
    for backend, figs in figures["backends"].items():
        if "error" in figs:
            print(f"{backend:<10} error: {figs['error']}")
            continue
        for tokens, f in figs.items():
            print(f"{backend:<10}{tokens:>7}{f['bytes'] / 1e6:>8.1f}{f['regions']:>9}{f['pagelist_gbps']:>10.2f}"
                  f"{f['engine_pagelist_gbps']:>11.2f}{f['raw_gbps']:>8.2f}{figures['memcpy_gbps'][tokens]:>8.2f}")
    return write_report(args.json, "transfer", figures, ratios)


if __name__ == "__main__":
    main()
