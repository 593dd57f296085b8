"""The scheduler process of one TP rank (of one DP group).

Rank 0 hears the front end over ZMQ (it connects a PULL to `to_scheduler`, which the front end binds)
and reports back over the Unix socket `from_scheduler`, one frame per message written from the loop's
own thread (`common/frames.py`: no I/O thread to wake for each streamed token). It broadcasts every
batch of received messages to the other ranks over the consensus group, so all ranks schedule
identically; only rank 0 sends `BatchOut` / `StatsReport`. SIGTERM (or SIGINT) ends the loop
cleanly: rank 0 broadcasts the stop so the other ranks leave too.

With --dp-size N the node runs N such groups, each with its own `IpcConfig` (its own `to_scheduler`
socket and rendezvous; `from_scheduler` is shared) and its own share of the node's cores
(`group_cores`).
"""

from __future__ import annotations

import gc
import logging
import os
import select
import signal
import traceback
from dataclasses import dataclass

import msgspec
import zmq

from common import core_loan
from common.config import ServerArgs
from common.frames import FrameSender
from common.log import exit_now, setup_logging
from common.protocol import BatchOut, ReqUpdate, ToScheduler
from common.scheduler import role_switch
from common.scheduler.watchdog import Watchdog

logger = logging.getLogger("scheduler")

CONNECT_TIMEOUT = 300.0  # seconds rank 0 waits for the front end's report socket (bound after its tokenizer)


@dataclass
class IpcConfig:
    to_scheduler: str  # ZMQ ipc:// address: front end binds a PUSH, rank 0 connects a PULL
    from_scheduler: str  # a Unix socket path: the front end listens, rank 0 connects (common/frames.py)
    dist_init_method: str  # torch.distributed rendezvous: file://<private run dir>/dist_store (or tcp://)
    front_end_pid: int = 0  # the front end's process (0: this process's parent): when it ends, the ranks stop


class ProcessWatch:
    """Tells whether process `pid` has ended, through a pidfd (no pid-reuse race). A rank's parent is not
    always its front end (a fork server starts several ranks), so the rank watches the front end itself."""

    def __init__(self, pid: int):
        self.pid = pid
        self._poll = None
        self._gone = False
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
            return
        except OSError:  # no pidfd (Linux before 5.3): `_exists` below
            return
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    def _exists(self) -> bool:
        """Without a pidfd: whether a process with that pid is there (a reused pid reads as alive)."""
        try:
            os.kill(self.pid, 0)
        except (ProcessLookupError, PermissionError):  # gone, or the pid reused by someone else's process
            return False
        return True

    def gone(self) -> bool:
        if not self._gone:
            self._gone = bool(self._poll.poll(0)) if self._poll is not None else not self._exists()
        return self._gone


class SchedulerComm:
    """Receive (rank 0: ZMQ, then broadcast; other ranks: the broadcast) and send (rank 0 only); the
    ranks are every rank of the DP group (all TP ranks of all pipeline stages)."""

    def __init__(self, ipc: IpcConfig, tp_rank: int, tp_size: int, group=None) -> None:
        self.tp_rank = tp_rank  # the rank in the DP group's world
        self.tp_size = tp_size  # that world's size
        self.group = group
        self.stop_requested = False
        self.front_end_closed = False
        self.front_end = ProcessWatch(ipc.front_end_pid or os.getppid())  # when it ends, this rank stops
        self.decoder = msgspec.msgpack.Decoder(ToScheduler)
        self.encoder = msgspec.msgpack.Encoder()
        self.ctx = self.pull = self.push = None
        if tp_rank == 0:
            self.ctx = zmq.Context()
            self.pull = self.ctx.socket(zmq.PULL)
            self.pull.connect(ipc.to_scheduler)
            self.push = FrameSender(ipc.from_scheduler, CONNECT_TIMEOUT)

    def _drain(self, timeout_ms: int) -> list[bytes]:
        frames: list[bytes] = []
        if timeout_ms > 0 and not self.pull.poll(timeout_ms):
            return frames
        while True:
            try:
                frames.append(self.pull.recv(zmq.NOBLOCK))
            except zmq.Again:
                return frames

    def recv(self, timeout_ms: int) -> list | None:
        """Messages received since the last call (blocking up to timeout_ms when none are
        waiting); None when the scheduler should stop."""
        frames: list[bytes] = []
        stop = self.stop_requested
        if self.tp_rank == 0 and not stop:
            try:
                frames = self._drain(timeout_ms)
            except zmq.ZMQError as e:
                if e.errno != zmq.EINTR:  # a signal interrupted the poll: just loop
                    raise
            stop = self.stop_requested
            if self.front_end.gone():
                logger.warning("the front end (pid %d) is gone; stopping", self.front_end.pid)
                stop = True
        if self.tp_size > 1:
            import torch.distributed as dist

            box = [(frames, stop)]
            try:
                dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
            except RuntimeError as e:  # rank 0 is gone
                logger.warning("broadcast from rank 0 failed (%s); stopping", e)
                return None
            frames, stop = box[0]
        if stop:
            return None
        msgs = []
        for f in frames:
            try:
                msgs.append(self.decoder.decode(f))
            except msgspec.DecodeError as e:
                logger.error("dropping an undecodable message (%d bytes): %s", len(f), e)
        return msgs

    def send(self, msg) -> None:
        if self.push is None or self.front_end_closed:
            return
        try:
            self.push.send(self.encoder.encode(msg))
        except OSError as e:  # the front end closed its end: nobody is left to answer
            logger.warning("sending to the front end failed (%s); stopping", e)
            self.front_end_closed = self.stop_requested = True

    def close(self) -> None:
        for s in (self.pull, self.push):
            if s is not None:
                s.close()
        if self.ctx is not None:
            self.ctx.term()


def group_cores(cores: list[int], dp_rank: int, dp_size: int) -> list[int]:
    """The cores DP group `dp_rank` of `dp_size` runs on: a contiguous share of `cores` (all of them when
    there are fewer cores than groups)."""
    if dp_size <= 1 or len(cores) < dp_size:
        return cores
    per, extra = divmod(len(cores), dp_size)
    start = dp_rank * per + min(dp_rank, extra)
    return cores[start:start + per + (dp_rank < extra)]


def run_scheduler_process(args: ServerArgs, model_dir: str, rank: int, ipc: IpcConfig, ready_conn,
                          scheduler_cls=None, dp_rank: int = 0) -> None:
    """Entry point of a scheduler process (started by `launch.RankStarter`): rank `rank` of its DP
    group's `pp_size * tp` ranks (pipeline stage rank // tp, TP rank rank % tp).

    `scheduler_cls` (a Scheduler subclass, or its import path "package.module:Class") lets the PD
    roles reuse this entry point."""
    tp_rank, pp_rank = rank % args.tp, rank // args.tp
    name = "scheduler" + (f"-dp{dp_rank}" if args.dp_size > 1 else "") + (f"-pp{pp_rank}" if args.pp_size > 1
                                                                         else "") + f"-tp{tp_rank}"
    setup_logging(name, args.log_level)
    cores = sorted(os.sched_getaffinity(0))  # the cores this process may run on (a launcher may pin it)
    core_loan.widen_for_openmp(args, cores)  # before OpenMP loads with torch (common/core_loan.py says why)
    if scheduler_cls is None:
        from common.scheduler.scheduler import Scheduler

        scheduler_cls = Scheduler
    elif isinstance(scheduler_cls, str):
        import importlib

        module, _, cls_name = scheduler_cls.partition(":")
        scheduler_cls = getattr(importlib.import_module(module), cls_name)
    import torch  # here, not at the top: the front end imports this module to spawn the ranks

    os.sched_setaffinity(0, cores)
    share = group_cores(cores, dp_rank, args.dp_size)
    if share != cores:
        # the node's cores, for threads that must not share the group's (transfer/engine.py: spread_over_node)
        os.environ["PDSERVE_NODE_CORES"] = ",".join(map(str, cores))
        os.sched_setaffinity(0, share)
    torch.set_num_threads(args.num_threads or max(1, len(share) // (args.tp * args.pp_size)))
    logger.info("dp rank %d pp rank %d tp rank %d: %d torch threads on cores %s "
                "(OMP_WAIT_POLICY=%s)", dp_rank,
                pp_rank, tp_rank, torch.get_num_threads(), share, os.environ.get("OMP_WAIT_POLICY", "unset"))
    comm = None
    scheduler = None

    def on_signal(signum, frame):
        logger.info("signal %d: stopping", signum)
        if comm is not None:
            comm.stop_requested = True
        if scheduler is not None:
            scheduler.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        from common.device import resolve_device
        from common.distributed import init_distributed

        world = args.tp * args.pp_size
        device = resolve_device(args.device, dp_rank * world + rank, args.base_gpu_id, args.gpu_id_step)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before NCCL: each rank's communicator on its own GPU
        dpa = args.enable_dp_attention  # one world of every DP group's ranks (common/layers/dp_attention.py)
        _, consensus_group = init_distributed(dp_rank * world + rank if dpa else rank,
                                              world * args.dp_size if dpa else world, ipc.dist_init_method,
                                              tp_size=args.tp, device=device, dp_attention=dpa)
        from common.distributed import get_tp_group

        comm = SchedulerComm(ipc, rank, world, consensus_group)
        scheduler = scheduler_cls(args, model_dir, tp_rank, args.tp, get_tp_group(),
                                  send_fn=comm.send if rank == 0 else None, comm=comm, dp_rank=dp_rank,
                                  pp_rank=pp_rank)
    except Exception as e:
        logger.error("start-up failed: %s\n%s", e, traceback.format_exc())
        try:
            ready_conn.send({"status": "error", "message": f"{name}: {type(e).__name__}: {e}"})
        finally:
            if comm is not None:
                comm.close()
        raise SystemExit(1) from None
    from common.memory.huge_pages import fault_in

    # the pool's first touches here, not in the first requests' time (common/memory/huge_pages.py)
    fault_in(scheduler.runner.kv_pool.data, "KV pool", torch.get_num_threads())
    ready_conn.send(role_switch.ready_info(scheduler))
    logger.info("ready: %d KV tokens, page size %d, context %d", scheduler.allocator.capacity,
                scheduler.page_size, scheduler.context_length)
    # The model and pools live as long as the process: moving them out of the collector's reach keeps
    # the full collections that the loop's allocations trigger from walking them (~3% of a decode
    # step's CPU time before).
    gc.collect()
    gc.freeze()
    code = 0
    watchdog = Watchdog(args.watchdog_timeout, name).start()
    try:
        scheduler.event_loop(beat=watchdog.beat)
        while scheduler.switch is not None and not scheduler.stopping:  # drained for a role switch
            scheduler = role_switch.rebuild(scheduler, comm, get_tp_group())
            gc.unfreeze()  # the old role's scheduler (its request table, metadata rows) is collected now
            gc.collect()
            gc.freeze()
            scheduler.event_loop(beat=watchdog.beat)
    except Exception as e:
        code = 1
        logger.error("scheduler loop crashed: %s\n%s", e, traceback.format_exc())
        # tell the front end so no client waits forever
        updates = [ReqUpdate(rid=r.rid, new_token_ids=[], prompt_tokens=len(r.origin_input_ids),
                             completion_tokens=len(r.output_ids),
                             finish_reason={"type": "abort", "message": f"scheduler error: {e}"},
                             error_status=500)
                   for r in scheduler.live_reqs.values()]
        if updates:
            try:
                comm.send(BatchOut(updates=updates))
            except Exception:
                pass
    finally:
        watchdog.stop()
        comm.close()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        logger.info("stopped")
    exit_now(code)  # everything is closed: no interpreter teardown of torch and the engines' modules
