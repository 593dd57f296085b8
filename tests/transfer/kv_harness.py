"""Multi-process harness for the transfer tests: prefill and decode ranks as real processes.

Each rank runs in its own spawned process with a real KV manager, engine and ZMQ sockets; the test
process runs the bootstrap server. Prefill ranks fill their KV pool, state buffer and metadata row
from a seeded "global" tensor (all heads); decode ranks regenerate the same tensor and check that
every destination page / state slot holds exactly the source bytes of their head slice, and that no
other page was touched.

`RankPool` keeps a few spawned rank processes alive across scenarios (each scenario builds fresh
managers and engines in them), because importing torch costs seconds per process; `run()` spawns
fresh processes for scenarios that kill a rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time

SHAPE = {"layers": 4, "pages": 32, "heads": 4, "page_size": 4, "dim": 16, "state_slots": 6,
         "state_dim": 8, "state_inner": 5, "meta_slots": 8}
MODEL = "test-model"
FAST = {"heartbeat_interval": 0.5, "heartbeat_max_failures": 6, "bootstrap_timeout": 30.0,
        "waiting_timeout": 30.0, "num_workers": 3}
DEADLINE = 45.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def global_kv(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    s = SHAPE
    return torch.randn((2, s["layers"], s["pages"], s["heads"], s["page_size"], s["dim"]), generator=g)


def global_state(seed: int):
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    s = SHAPE
    return torch.randn((s["state_slots"], s["state_dim"], s["state_inner"]), generator=g)


class SplitPool:
    """The layout before the page-first pool: a separate contiguous K and V tensor per layer, so a
    page's stride is one page (`KVArgs.from_pool` gives the default strides). `spec["split"]` names
    the side that uses it, to check that the two layouts exchange pages byte-exactly."""

    def __init__(self, num_pages: int, page_size: int, num_layers: int, kv_heads: int, head_dim: int) -> None:
        import torch

        self.page_size, self.kv_heads, self.num_layers = page_size, kv_heads, num_layers
        self._bufs = [torch.zeros((num_pages, kv_heads, page_size, head_dim)) for _ in range(2 * num_layers)]
        self.page_bytes = self._bufs[0][0].numel() * self._bufs[0].element_size()
        self.head_bytes = self.page_bytes // kv_heads
        self.layer_ids = list(range(num_layers))

    def k(self, layer: int):
        return self._bufs[layer]

    def v(self, layer: int):
        return self._bufs[self.num_layers + layer]

    def buffers(self) -> list:
        return list(self._bufs)


def _build(role: str, tp_rank: int, tp_size: int, spec: dict, bootstrap_addr: str | None, settings: dict):
    """(manager, pool, metadata, state) of one rank; `spec["light"]` builds numpy buffers instead of
    torch ones (no torch import: the kill tests spawn fresh processes) with no metadata object."""
    if os.environ.get("KV_HARNESS_LOG"):
        from common.log import setup_logging

        setup_logging(f"{role}{tp_rank}", "info")
    from transfer.base import KVArgs
    from transfer.receiver import DecodeKVManager
    from transfer.sender import PrefillKVManager

    def manager(args):
        if role == "prefill":
            return PrefillKVManager(args, spec["backend"], host="127.0.0.1", bootstrap_addr=bootstrap_addr,
                                    **settings)
        return DecodeKVManager(args, spec["backend"], host="127.0.0.1", **settings)

    s = SHAPE
    heads = s["heads"] // tp_size
    if spec.get("light"):
        import numpy as np

        shape = (s["pages"], heads, s["page_size"], s["dim"])
        bufs = [np.zeros(shape, dtype=np.float32) for _ in range(2 * s["layers"])]
        rooms = np.zeros((s["meta_slots"], 8), dtype=np.int64)
        page_bytes = bufs[0][0].nbytes
        args = KVArgs(kv_data_ptrs=[b.ctypes.data for b in bufs], kv_data_lens=[b.nbytes for b in bufs],
                      kv_item_lens=[page_bytes] * len(bufs), kv_head_num=heads, page_size=s["page_size"],
                      aux_data_ptrs=[rooms.ctypes.data], aux_data_lens=[rooms.nbytes], aux_item_lens=[64],
                      aux_room_index=0, engine_rank=tp_rank, tp_size=tp_size, model=spec.get("model", MODEL))
        return manager(args), bufs, rooms, None

    import torch

    from common.memory.kv_pool import KVPool
    from transfer.metadata import MetadataBuffers

    torch.set_num_threads(1)
    kind = SplitPool if spec.get("split") == role else KVPool
    pool = kind(s["pages"], s["page_size"], s["layers"], heads, s["dim"])
    meta = MetadataBuffers(s["meta_slots"], max_top_logprobs=5, hidden_size=8, spec_topk=2)
    sd = s["state_dim"] // tp_size
    state = torch.zeros((s["state_slots"], sd, s["state_inner"]))
    if role == "prefill":
        src = global_kv(spec["seed"])
        h0 = tp_rank * heads
        for layer in range(s["layers"]):
            pool.k(layer).copy_(src[0, layer, :, h0:h0 + heads])
            pool.v(layer).copy_(src[1, layer, :, h0:h0 + heads])
        state.copy_(global_state(spec["seed"])[:, tp_rank * sd:(tp_rank + 1) * sd])
    args = KVArgs.from_pool(pool, meta, [state], state_type="mamba", engine_rank=tp_rank, tp_size=tp_size,
                            model=spec.get("model", MODEL))
    # the memory kind the buffers are declared in ("cuda:0" over host tensors: the fake engine, which reads
    # nothing, checks that every region is written with the kind it was registered with)
    kinds = {k: spec[k] for k in ("kv_memory", "state_memory") if k in spec}
    if kinds:
        import dataclasses

        args = dataclasses.replace(args, **kinds)
    return manager(args), pool, meta, state


def _wait(cond, timeout: float = DEADLINE) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def prefill_main(spec: dict, tp_rank: int, tp_size: int, bootstrap_addr: str, out, events) -> None:
    from transfer.base import KVPoll
    from transfer.sender import KVSender

    mgr, pool, meta, state = _build("prefill", tp_rank, tp_size, spec, bootstrap_addr,
                                    {**FAST, **spec.get("prefill_settings", {})})
    events["prefill_up"][tp_rank].set()
    room = spec["room"]
    if spec.get("light"):
        meta[spec["src_meta"], 0] = spec.get("meta_room", room)
    else:
        meta.set_buf(spec["src_meta"], first_token_id=4242, cached_tokens=7,
                     logprob_val=-0.5, logprob_idx=4242,
                     top_vals=[-0.5, -1.5, -2.5], top_idxs=[4242, 17, 99], room=spec.get("meta_room", room),
                     topk_p=[0.75, 0.25], topk_index=[4242, 17], hidden_state=list(range(8)))
    sender = KVSender(mgr, room)
    sender.init(len(spec["src_pages"]), spec["src_meta"])
    _wait(lambda: sender.poll() != KVPoll.Bootstrapping)
    mode = spec.get("mode", "normal")
    off = 0
    chunks = spec["chunks"]
    for i, n in enumerate(chunks):
        last = i == len(chunks) - 1
        states = spec["src_state"] if last and not spec.get("light") else None
        sender.send(spec["src_pages"][off:off + n], states, last=last)
        off += n
        if i == 0 and mode in ("kill_decode", "kill_prefill", "abort_prefill", "abort_decode"):
            _wait(lambda: sender.bytes_sent > 0 or sender.poll() == KVPoll.Failed)
            events["first_sent"].set()
            if mode == "kill_prefill":
                time.sleep(3600)  # the test kills this process here
            if mode == "abort_prefill":
                sender.abort()
                break
            if mode in ("kill_decode", "abort_decode"):
                events["go_on"].wait(DEADLINE)
    _wait(lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed))
    st = sender.poll()
    out.put({"side": "prefill", "rank": tp_rank, "poll": int(st),
             "reason": sender.failure_exception().reason if st == KVPoll.Failed else ""})
    mgr.close()


def decode_main(spec: dict, tp_rank: int, tp_size: int, bootstrap_addr: str, out, events) -> None:
    from transfer.base import KVPoll
    from transfer.receiver import KVReceiver

    mgr, pool, meta, state = _build("decode", tp_rank, tp_size, spec, None,
                                    {**FAST, **spec.get("decode_settings", {})})
    room = spec["room"]
    recv = KVReceiver(mgr, bootstrap_addr, room)
    recv.init(spec["dst_pages"], spec["dst_meta"], None if spec.get("light") else spec["dst_state"])
    events["decode_up"][tp_rank].set()
    if spec.get("mode") == "abort_decode":
        events["first_sent"].wait(DEADLINE)
        recv.abort()
        events["go_on"].set()
    _wait(lambda: recv.poll() in (KVPoll.Success, KVPoll.Failed))
    st = recv.poll()
    res = {"side": "decode", "rank": tp_rank, "poll": int(st),
           "reason": recv.failure_exception().reason if st == KVPoll.Failed else "", "bytes_ok": None}
    if st == KVPoll.Success and mgr.moves_bytes and not spec.get("light"):
        res["bytes_ok"], res["detail"] = _verify(spec, tp_rank, tp_size, pool, meta, state)
    out.put(res)
    mgr.close()


def _verify(spec: dict, tp_rank: int, tp_size: int, pool, meta, state) -> tuple[bool, str]:
    import torch

    s = SHAPE
    src = global_kv(spec["seed"])
    heads = s["heads"] // tp_size
    h0 = tp_rank * heads
    dst_set = set(spec["dst_pages"])
    for layer in range(s["layers"]):
        for kv, buf in ((0, pool.k(layer)), (1, pool.v(layer))):
            for sp, dp in zip(spec["src_pages"], spec["dst_pages"], strict=True):
                want = src[kv, layer, sp, h0:h0 + heads]
                if not torch.equal(buf[dp], want):
                    return False, f"layer {layer} kv {kv} page {sp}->{dp} differs"
            for p in range(s["pages"]):
                if p not in dst_set and bool(buf[p].any()):
                    return False, f"layer {layer} kv {kv} page {p} was written but is not a destination"
    gstate = global_state(spec["seed"])
    sd = s["state_dim"] // tp_size
    for ss, ds in zip(spec["src_state"], spec["dst_state"], strict=True):
        if not torch.equal(state[ds], gstate[ss, tp_rank * sd:(tp_rank + 1) * sd]):
            return False, f"state slot {ss}->{ds} differs"
    for slot in range(s["state_slots"]):
        if slot not in spec["dst_state"] and bool(state[slot].any()):
            return False, f"state slot {slot} written but not a destination"
    row = meta.get_buf(spec["dst_meta"])
    want = {"first_token_id": 4242, "cached_tokens": 7, "logprob_val": -0.5, "logprob_idx": 4242,
            "room": spec["room"]}
    for k, v in want.items():
        if row[k] != v:
            return False, f"metadata {k}: {row[k]} != {v}"
    if row["top_idxs"][:3].tolist() != [4242, 17, 99] or row["topk_index"].tolist() != [4242, 17] \
            or row["hidden_state"].tolist() != [float(i) for i in range(8)]:
        return False, "metadata top logprobs / spec topk / hidden state differ"
    return True, ""


def run(spec: dict, prefill_tp: int = 1, decode_tp: int = 1, kill: str | None = None,
        timeout: float = 90.0) -> list[dict]:
    """Run one scenario; returns the result dict of every surviving rank."""
    from transfer.bootstrap import BootstrapServer

    ctx = mp.get_context("spawn")
    server = BootstrapServer("127.0.0.1", 0)
    server.start()
    addr = f"127.0.0.1:{server.port}"
    out = ctx.Queue()
    events = {"prefill_up": [ctx.Event() for _ in range(prefill_tp)],
              "decode_up": [ctx.Event() for _ in range(decode_tp)],
              "first_sent": ctx.Event(), "go_on": ctx.Event()}
    prefill = [ctx.Process(target=prefill_main, args=(spec, r, prefill_tp, addr, out, events), daemon=True)
               for r in range(prefill_tp)]
    decode = [ctx.Process(target=decode_main, args=(spec, r, decode_tp, addr, out, events), daemon=True)
              for r in range(decode_tp)]
    procs = prefill + decode
    try:
        for p in procs:
            p.start()
        expected = len(procs)
        if kill is not None:
            assert events["first_sent"].wait(timeout), "the first chunk was never sent"
            victims = prefill if kill == "prefill" else decode
            for p in victims:
                os.kill(p.pid, signal.SIGKILL)
                p.join(10)
            expected -= len(victims)
            events["go_on"].set()
        results = []
        end = time.monotonic() + timeout
        while len(results) < expected and time.monotonic() < end:
            try:
                results.append(out.get(timeout=0.5))
            except Exception:
                if kill is None and any(p.exitcode not in (None, 0) for p in procs):
                    break
        return results
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        server.stop()


def _worker(jobs, out, events) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        side, spec, rank, tp, addr = job
        if side == "warm":  # a backend's first engine in a process can take seconds (plugin loading)
            try:
                from transfer.backends import create_engine

                create_engine(spec["backend"]).close()
                out.put({"side": "warm", "ok": True, "reason": ""})
            except BaseException as e:
                out.put({"side": "warm", "ok": False, "reason": f"{type(e).__name__}: {e}"})
            continue
        try:
            (prefill_main if side == "prefill" else decode_main)(spec, rank, tp, addr, out, events)
        except BaseException as e:  # report instead of hanging the test
            out.put({"side": side, "rank": rank, "poll": -1, "reason": f"{type(e).__name__}: {e}"})


class RankPool:
    """Long-lived prefill and decode rank processes that run one scenario at a time."""

    def __init__(self, n_prefill: int = 2, n_decode: int = 2) -> None:
        ctx = mp.get_context("spawn")
        self.events = {"prefill_up": [ctx.Event() for _ in range(n_prefill)],
                       "decode_up": [ctx.Event() for _ in range(n_decode)],
                       "first_sent": ctx.Event(), "go_on": ctx.Event()}
        self.out = ctx.Queue()
        self.jobs = {"prefill": [ctx.Queue() for _ in range(n_prefill)],
                     "decode": [ctx.Queue() for _ in range(n_decode)]}
        self.procs = [ctx.Process(target=_worker, args=(q, self.out, self.events), daemon=True)
                      for side in ("prefill", "decode") for q in self.jobs[side]]
        for p in self.procs:
            p.start()

    def warm(self, backend: str, timeout: float = 120.0) -> list[dict]:
        """Build and close one engine of `backend` in every process; returns their reports."""
        qs = self.jobs["prefill"] + self.jobs["decode"]
        for q in qs:
            q.put(("warm", {"backend": backend}, 0, 1, None))
        return [self.out.get(timeout=timeout) for _ in qs]

    def run(self, spec: dict, prefill_tp: int = 1, decode_tp: int = 1, timeout: float = 90.0) -> list[dict]:
        from transfer.bootstrap import BootstrapServer

        for e in self.events["prefill_up"] + self.events["decode_up"] + [self.events["first_sent"],
                                                                        self.events["go_on"]]:
            e.clear()
        server = BootstrapServer("127.0.0.1", 0)
        server.start()
        addr = f"127.0.0.1:{server.port}"
        try:
            for r in range(prefill_tp):
                self.jobs["prefill"][r].put(("prefill", spec, r, prefill_tp, addr))
            for r in range(decode_tp):
                self.jobs["decode"][r].put(("decode", spec, r, decode_tp, addr))
            results = []
            end = time.monotonic() + timeout
            while len(results) < prefill_tp + decode_tp and time.monotonic() < end:
                try:
                    results.append(self.out.get(timeout=0.5))
                except Exception:
                    if any(not p.is_alive() for p in self.procs):
                        break
            return results
        finally:
            server.stop()

    def close(self) -> None:
        for qs in self.jobs.values():
            for q in qs:
                q.put(None)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
