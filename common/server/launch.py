"""`launch_server(args)`: one node = this HTTP front-end process + one scheduler process per TP rank
of each DP group (--dp-size groups of --tp-size ranks).

1. resolve the model directory (the default model is converted once into the cache);
2. start `dp_size * pp_size * tp` scheduler processes (`rank_context`); while they load the
   model, load the tokenizer and bind the sockets they connect to (a ZMQ `to_scheduler` per DP
   group, one shared Unix socket `from_scheduler`); wait until every rank reports ready (or exit
   with its error);
3. serve HTTP until SIGINT/SIGTERM: then abort running requests, stop the schedulers, exit 0.
A scheduler process that dies while serving turns `/health` into 503 and fails live requests (with
several DP groups too: a node serves whole or not at all).

Nothing between the front end and its ranks listens on the network: the ZMQ ipc sockets, the report
socket and the torch.distributed rendezvous (a `file://` store) live in a run directory only this user
can enter (`common/server/run_dir.py`: mode 0700, removed at exit, and swept by the next node to start
when a crash left it), and gloo stays on loopback (`common/distributed.py`).
`--dist-port` brings back a TCP store on that port, which torch binds on every interface.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time

from aiohttp import web

from common.log import exit_now, setup_logging
from common.models.hub import HubError
from common.scheduler.watchdog import describe_exit
from common.server.run_dir import RunDir

logger = logging.getLogger("server")

READY_TIMEOUT = float(os.environ.get("PDSERVE_READY_TIMEOUT", "900"))
# seconds for ready ranks to connect to the sockets the front end bound after spawning them
CONNECT_TIMEOUT = 30.0


class LaunchError(RuntimeError):
    pass


def dist_init_method(run_dir: str, dist_port: int | None) -> str:
    if dist_port:
        logger.warning("--dist-port %d: torch's TCP store for the TP ranks listens on every interface; "
                       "without the flag the ranks meet through a file in %s", dist_port, run_dir)
        return f"tcp://127.0.0.1:{dist_port}"
    return f"file://{run_dir}/dist_store"


def rank_context(ranks: int, scheduler_cls) -> mp.context.BaseContext:
    """How the scheduler ranks are started. One rank: "spawn" (a fresh interpreter). Several: "forkserver"
    with torch and the scheduler's modules imported once in the server and each rank a fork of it (no
    thread runs there, so the fork is safe): those imports are most of a rank's start-up (~3 s of a core
    here), paid once per node instead of once per rank, and the ranks share their pages."""
    if ranks <= 1:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    modules = ["torch", "common.scheduler.process", "common.scheduler.scheduler"]
    if isinstance(scheduler_cls, str):
        modules.append(scheduler_cls.partition(":")[0])
    ctx.set_forkserver_preload(modules)
    return ctx


class RankStarter(threading.Thread):
    """Starts the node's scheduler ranks on a thread, so the front end loads its tokenizer meanwhile (with a
    fork server the first `start()` waits until the server has imported torch). `procs`, `conns` and
    `names` list the ranks started so far; `finish()` waits for the thread and re-raises what starting a
    rank raised, as a LaunchError."""

    def __init__(self, args, model_dir: str, ipcs: list, scheduler_cls, ctx: mp.context.BaseContext):
        super().__init__(name="rank-starter", daemon=True)
        self.args, self.model_dir, self.ipcs, self.scheduler_cls = args, model_dir, ipcs, scheduler_cls
        self.ctx = ctx  # `rank_context`'s
        self.procs: list = []
        self.conns: list = []
        self.names: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        from common.scheduler.process import run_scheduler_process

        args = self.args
        try:
            ctx = self.ctx
            for dp, ipc in enumerate(self.ipcs):
                for rank in range(args.tp * args.pp_size):  # pipeline stage rank // tp, TP rank rank % tp
                    name = ("scheduler " + (f"dp {dp} " if args.dp_size > 1 else "")
                            + (f"pp {rank // args.tp} tp {rank % args.tp}"
                               if args.pp_size > 1 else f"rank {rank}"))
                    parent, child = ctx.Pipe(duplex=False)
                    p = ctx.Process(target=run_scheduler_process,
                                    args=(args, self.model_dir, rank, ipc, child, self.scheduler_cls, dp),
                                    name=f"pdserve-scheduler-{dp}-{rank}", daemon=False)
                    p.start()
                    child.close()
                    self.procs.append(p)
                    self.conns.append(parent)
                    self.names.append(name)
                    logger.info("started %s (pid %d)", name, p.pid)
        except Exception as e:  # handed to the main thread by finish()
            self.error = e

    def finish(self) -> None:
        if self.ident is not None:
            self.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise LaunchError(f"cannot start the scheduler ranks: {type(error).__name__}: {error}")


def _wait_ready(procs: list, conns: list, timeout: float, names: list[str]) -> list[dict]:
    """Wait for a ready message from every rank; raise LaunchError naming the rank that failed."""
    ready: dict[int, dict] = {}
    deadline = time.time() + timeout
    while len(ready) < len(procs):
        left = deadline - time.time()
        if left <= 0:
            missing = [names[r] for r in range(len(procs)) if r not in ready]
            raise LaunchError(f"{', '.join(missing)} not ready after {timeout:.0f}s")
        waitables = []
        for r, (p, c) in enumerate(zip(procs, conns, strict=True)):
            if r not in ready:
                waitables += [c, p.sentinel]
        mp.connection.wait(waitables, timeout=min(left, 5.0))
        for r, (p, c) in enumerate(zip(procs, conns, strict=True)):
            if r in ready:
                continue
            if c.poll():
                try:
                    msg = c.recv()
                except EOFError:
                    msg = None
                if not isinstance(msg, dict):
                    raise LaunchError(f"{names[r]} closed its ready pipe without a status")
                if msg.get("status") != "ready":
                    raise LaunchError(f"{names[r]} failed to start: {msg.get('message', msg)}")
                ready[r] = msg
                logger.info("%s ready (pid %d)", names[r], p.pid)
            elif not p.is_alive():
                raise LaunchError(f"{names[r]} (pid {p.pid}) exited with code {p.exitcode} "
                                  "before it was ready; see its log above")
    return [ready[r] for r in range(len(procs))]


def _stop_procs(procs: list, grace: float = 10.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.time() + grace
    for p in procs:
        p.join(max(deadline - time.time(), 0.1))
    for p in procs:
        if p.is_alive():
            logger.warning("scheduler pid %d did not stop; killing it", p.pid)
            p.kill()
            p.join(5)


async def _serve(args, tm, procs, names, model_dir: str, keys, ssl_context) -> None:
    from common.server.app import create_app

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await tm.start()
    # served under the name it was started with (`--model` as given: "default", a Hub id, a path), as vLLM and
    # SGLang do, unless --served-model-name says otherwise
    app = create_app(tm, model_path=model_dir, keys=keys,
                     served_model_name=args.served_model_name or args.model)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, ssl_context=ssl_context)
    await site.start()
    logger.info("serving on %s://%s:%d (model %s, tp %d, dp %d, mode %s, %r)",
                "https" if ssl_context else "http",
                args.host, args.port, model_dir, args.tp, args.dp_size, args.disaggregation_mode, keys)

    async def watch() -> None:
        while True:
            for r, p in enumerate(procs):
                if not p.is_alive():
                    why = describe_exit(p.exitcode, args.watchdog_timeout) or f"exited with code {p.exitcode}"
                    reason = f"{names[r]} (pid {p.pid}) {why}"
                    if tm.healthy:
                        logger.error("%s; /health now answers 503", reason)
                        tm.mark_dead(reason)
                    return
            await asyncio.sleep(0.5)

    watcher = asyncio.create_task(watch())
    await stop.wait()
    logger.info("shutting down: aborting %d running requests", len(tm.states))
    watcher.cancel()
    if tm.healthy:
        tm.abort_all("server shutting down")
        # let handlers send their final (aborted) answers
        for _ in range(20):
            if not tm.states:
                break
            await asyncio.sleep(0.05)
    await runner.cleanup()
    await tm.close()
    if tm.tracer is not None:
        await asyncio.get_running_loop().run_in_executor(None, tm.tracer.close)


def launch_server(args, scheduler_cls: str | None = None) -> None:
    """Run a node until SIGINT/SIGTERM (returns normally then); exits 1 with a clear error when the
    scheduler processes cannot start.

    `scheduler_cls` is the import path ("package.module:Class") of the Scheduler subclass every rank
    runs; the PD roles pass theirs, so `common/` never imports them."""
    setup_logging("server", args.log_level)
    from common.server.app import load_node_keys
    from common.server.security import KeySourceError, server_ssl_context

    try:  # before any process starts: a bad key file or certificate is a start-up error
        keys = load_node_keys(args)
        ssl_context = server_ssl_context(args.ssl_certfile, args.ssl_keyfile)
    except (KeySourceError, ValueError) as e:
        logger.error("%s", e)
        sys.exit(2)
    keys.announce(logger, "/flush_cache and abort-all (/abort_request with abort_all)")
    from common.models.default_model import resolve_model_path
    from common.sampling_defaults import describe as describe_sampling
    from common.scheduler.process import IpcConfig
    from common.scheduler.trace import make_tracer
    from common.server.tokenizer_manager import TokenizerManager

    try:
        model_dir = resolve_model_path(args.model, args.revision)
    except HubError as e:
        logger.error("%s", e)
        sys.exit(2)
    run_dir = RunDir()
    ctx = rank_context(args.dp_size * args.tp * args.pp_size, scheduler_cls)
    if ctx.get_start_method() == "forkserver":
        run_dir.note_mp_temp_dir()  # the fork server's socket directory goes with the run directory
    tmp = run_dir.path
    ipcs = [IpcConfig(to_scheduler=f"ipc://{tmp}/to_scheduler{dp}", from_scheduler=f"{tmp}/from_scheduler",
                      dist_init_method=dist_init_method(tmp, args.dist_port)
                      if args.dp_size == 1 or args.enable_dp_attention  # DP attention: one world
                      else f"file://{tmp}/dist_store{dp}", front_end_pid=os.getpid())
            for dp in range(args.dp_size)]
    starter = RankStarter(args, model_dir, ipcs, scheduler_cls, ctx)
    procs = starter.procs  # the ranks started so far, stopped on the way out
    tm = None
    # a signal before we serve: stop cleanly too
    stop_early = {"sig": None}

    def early(signum, _frame):
        stop_early["sig"] = signum
        raise KeyboardInterrupt

    old = {s: signal.signal(s, early) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        starter.start()
        # the tokenizer loads while the ranks start and load the model (they connect to sockets it binds:
        # ZMQ waits)
        tm = TokenizerManager(args, model_dir, [ipc.to_scheduler for ipc in ipcs], ipcs[0].from_scheduler)
        tm.tracer = make_tracer(args)
        logger.info("sampling defaults (--sampling-defaults %s): %s", args.sampling_defaults,
                    describe_sampling(tm.sampling_defaults))
        starter.finish()
        conns, names = starter.conns, starter.names
        infos = _wait_ready(procs, conns, READY_TIMEOUT, names)
        if not tm.wait_connected(CONNECT_TIMEOUT):
            raise LaunchError(f"the scheduler ranks did not connect to the front end's sockets within "
                              f"{CONNECT_TIMEOUT:.0f}s")
        tm.configure(infos[0], groups=infos[::args.tp * args.pp_size])
        # the early handler stays until the event loop installs its own (no unguarded window)
        asyncio.run(_serve(args, tm, procs, names, model_dir, keys, ssl_context))
        logger.info("stopped")
    except LaunchError as e:
        logger.error("%s", e)
        _stop_procs(procs)
        sys.exit(1)
    except KeyboardInterrupt:
        logger.info("interrupted before serving (signal %s); stopping", stop_early["sig"])
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if starter.is_alive():  # interrupted while a rank was starting: wait for it, then stop them all
            starter.join()
        _stop_procs(procs)
        if tm is not None:
            tm.close_sockets()
        run_dir.remove()


def serve_main(argv: list[str], mode: str = "null", scheduler_cls: str | None = None) -> None:
    """Parse node flags (`ServerArgs`) from `argv` and run a node in `mode` ("null" = colocated); the process
    ends with it (`exit_now`)."""
    import argparse

    from common.config import ConfigError, ServerArgs
    from common.role_rules import scheduler_path

    parser = argparse.ArgumentParser(prog=f"pdserve {'serve' if mode == 'null' else mode}",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    if mode != "null":
        ns.disaggregation_mode = mode
    try:
        args = ServerArgs.from_cli_args(ns)
    except ConfigError as e:
        parser.error(str(e))
    launch_server(args, scheduler_cls or scheduler_path(args.disaggregation_mode))
    exit_now(0)
