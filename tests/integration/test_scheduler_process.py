"""`run_scheduler_process` in real processes: the test plays the front end (binds the ZMQ request
socket and the report socket, reads the ready messages), sends msgpack requests, reads BatchOuts
(frames, `common/frames.py`), and stops the ranks
with SIGTERM. With TP=2 the ranks schedule identically over gloo and produce the same tokens as
the in-process scheduler at TP=1."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import tempfile

import msgspec
import pytest
import torch
import zmq

from common.config import ServerArgs
from common.frames import read_frame
from common.protocol import (
    AbortRequest,
    FromScheduler,
    SamplingParams,
    StatsQuery,
    StatsReport,
    TokenizedRequest,
)
from common.scheduler.process import IpcConfig, run_scheduler_process
from common.scheduler.scheduler import Scheduler


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FrontEnd:
    def __init__(self, tmp: str) -> None:
        self.ipc = IpcConfig(to_scheduler=f"ipc://{tmp}/to", from_scheduler=f"{tmp}/from",
                             dist_init_method=f"tcp://127.0.0.1:{_free_port()}")
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.bind(self.ipc.to_scheduler)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.ipc.from_scheduler)
        self.listener.listen(1)
        self.reports = None  # rank 0's connection, accepted at the first recv
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(FromScheduler)

    def send(self, msg) -> None:
        self.push.send(self.enc.encode(msg))

    def recv(self, timeout_s: float = 120.0):
        if self.reports is None:
            self.listener.settimeout(timeout_s)
            self.reports, _ = self.listener.accept()
        self.reports.settimeout(timeout_s)
        try:
            return self.dec.decode(read_frame(self.reports))
        except TimeoutError:
            raise TimeoutError("no message from the scheduler") from None

    def collect(self, rids: set[str]) -> dict[str, list]:
        """Updates until every rid has finished."""
        out: dict[str, list] = {}
        done: set[str] = set()
        while done != rids:
            msg = self.recv()
            for u in getattr(msg, "updates", []):
                out.setdefault(u.rid, []).append(u)
                if u.finish_reason is not None:
                    done.add(u.rid)
        return out

    def close(self) -> None:
        self.push.close(0)
        for s in (self.reports, self.listener):
            if s is not None:
                s.close()
        self.ctx.term()


def _start(args: ServerArgs, model_dir: str, fe: FrontEnd):
    ctx = mp.get_context("spawn")
    procs, infos = [], []
    for rank in range(args.tp):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=run_scheduler_process, args=(args, model_dir, rank, fe.ipc, child))
        p.start()
        child.close()
        procs.append((p, parent))
    for _, conn in procs:
        if not conn.poll(180):
            raise TimeoutError("scheduler not ready")
        infos.append(conn.recv())
    return [p for p, _ in procs], infos


def _stop(procs) -> list[int | None]:
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    codes = []
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
        codes.append(p.exitcode)
    return codes


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 40, 19)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("tp", [2])
def test_scheduler_processes_serve_over_zmq(tiny_model_dir, tp):
    args = ServerArgs(model=tiny_model_dir, tp=tp, page_size=4, max_total_tokens=1024,
                      chunked_prefill_size=16, num_threads=1, log_level="warning")
    # the reference: the same scheduler in this process at TP=1
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref_sent: list = []
        ref = Scheduler(ServerArgs(model=tiny_model_dir, page_size=4, max_total_tokens=1024,
                                   chunked_prefill_size=16),
                        tiny_model_dir, send_fn=ref_sent.append)
    finally:
        torch.set_num_threads(n)
    vocab = ref.vocab_size
    prompts = _prompts(vocab)
    reqs = [TokenizedRequest(rid=f"r{i}", input_ids=p, sampling=_greedy(8), stream=(i == 0))
            for i, p in enumerate(prompts)]
    ref.process_input_requests(reqs)
    ref.run_until_idle()
    want: dict[str, list[int]] = {}
    for m in ref_sent:
        for u in m.updates:
            want.setdefault(u.rid, []).extend(u.new_token_ids)

    with tempfile.TemporaryDirectory() as tmp:
        fe = FrontEnd(tmp)
        procs = []
        try:
            procs, infos = _start(args, tiny_model_dir, fe)
            for info in infos:
                assert info["status"] == "ready", info
                assert info["page_size"] == 4 and info["max_total_tokens"] == 1024
                assert info["model_config"]["vocab_size"] == vocab
            for r in reqs:
                fe.send(r)
            got = fe.collect({r.rid for r in reqs})
            for r in reqs:
                assert [t for u in got[r.rid] for t in u.new_token_ids] == want[r.rid]
            assert len(got["r0"]) == 8  # streamed token by token
            # a refused request, an abort of a long one, stats
            fe.send(TokenizedRequest(rid="long", input_ids=[5] * 2000, sampling=_greedy(4)))
            fe.send(TokenizedRequest(rid="ab", input_ids=prompts[1], sampling=_greedy(400)))
            fe.send(AbortRequest(rid="ab"))
            got = fe.collect({"long", "ab"})
            assert got["long"][-1].error_status == 400
            assert got["ab"][-1].finish_reason["type"] == "abort"
            fe.send(StatsQuery(qid=3))
            rep = fe.recv()
            while not isinstance(rep, StatsReport):
                rep = fe.recv()
            assert rep.qid == 3 and rep.stats["num_running_reqs"] == 0
            assert rep.stats["kv_free_tokens"] + rep.stats["kv_evictable_tokens"] == 1024
        finally:
            codes = _stop(procs)
            fe.close()
        assert codes == [0] * tp
