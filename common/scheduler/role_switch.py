"""A DP group's role switch, prefill <-> decode, with its weights and KV pool kept (`SwitchRole`).

The front end asks every group (`POST /switch_role`, common/server/app.py) and refuses new requests from
then on; a group drains, then its scheduler process builds the new role's scheduler over the same runner.

1. `begin` (the message arrives, on every rank in the same iteration: it came in the broadcast input):
   what has not started the old role's work is handed back at once — the role's unstarted requests
   (`hooks.unstarted()`: a prefill's bootstrap queue, a decode's requests that sent no TransferInfo yet)
   and the scheduler's waiting requests that have produced nothing. They end with a 503 naming
   `ROLE_SWITCH`, which a router answers by running the request again on another pair: nothing of
   them reached a client. Everything else (a prefill being computed or sent, a decode running or
   receiving its KV) runs to its end.
2. `ready`, every iteration after the step: the group may switch when nothing is left on any rank (the
   MAX of "work left" over the consensus group, so every rank leaves its loop in the same iteration)
   and the prefix cache let go of every page. After `drain_timeout` seconds (rank 0's clock, shared
   in the same MAX) what is left is ended with the same 503 first; a stream already answering sees
   an error, which is why the deadline is generous.
3. The loop ends (`Scheduler.close` closes the old role's transfer side and bootstrap server), and
   `rebuild` makes the new scheduler (or, when that fails on any rank, the old role's again, and the
   answer says why): the role's scheduler class by its import path
   (`common/role_rules.py: scheduler_path`), `ModelRunner.switch_role` giving it a fresh request table
   of its kind (CUDA graphs captured again over it) and the compatibility of its new role. The new
   scheduler answers the query: the group now serves the new role.

Why drain instead of migrating requests: a request in flight is tied to its peer by a room and a
transfer in progress; ending only what has not started and letting the rest finish keeps every
request answered once, by the pair it began with, with no state to carry across the switch.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import time

from common.protocol import ROLE_SWITCH, StatsReport, SwitchRole
from common.scheduler.req import FinishStatus

logger = logging.getLogger("scheduler")


@dataclasses.dataclass
class PendingSwitch:
    """A switch the group is draining for."""

    qid: int
    role: str
    deadline: float  # time.monotonic() after which what is left is ended
    started: float
    handed_back: int = 0
    ended_at_deadline: int = 0

    @classmethod
    def of(cls, msg: SwitchRole) -> PendingSwitch:
        now = time.monotonic()
        return cls(msg.qid, msg.role, now + max(0.0, msg.drain_timeout), now)


def begin(sched, msg: SwitchRole) -> PendingSwitch | None:
    """Start draining for `msg.role` (None: refused, with the answer sent; a switch in progress goes on)."""
    mode = sched.args.disaggregation_mode
    refusal = None
    if sched.switch is not None:
        refusal = f"already switching to {sched.switch.role}"
    elif msg.role == mode:
        refusal = f"already serving the {mode} role"
    elif mode not in ("prefill", "decode") or msg.role not in ("prefill", "decode"):
        refusal = f"a {mode} node cannot switch to {msg.role!r}"
    if refusal is not None:
        sched.send(StatsReport(qid=msg.qid, stats={"switched": False, "error": refusal}))
        return None
    pending = PendingSwitch.of(msg)
    back = list(dict.fromkeys([*sched.hooks.unstarted(),
                               *(r.rid for r in sched.waiting_queue if not r.output_ids)]))
    pending.handed_back = len(back)
    sched.finish_requests(back, FinishStatus.abort(f"this node is switching to the {msg.role} role; the "
                                                   "request never started here", 503, err_type=ROLE_SWITCH))
    logger.info("role switch %s -> %s: draining (%d requests handed back, deadline %.0fs)", mode, msg.role,
                len(back), msg.drain_timeout)
    return pending


def ready(sched) -> bool:
    """Whether the group leaves its loop now to switch (the same answer on every rank)."""
    pending = sched.switch
    left, expired = sched.has_work(), time.monotonic() >= pending.deadline
    if sched.comm is not None and getattr(sched.comm, "tp_size", 1) > 1:
        left, expired = agree_any(sched.comm.group, left, expired and sched.comm.tp_rank == 0)
    if left and expired:
        rids = list(sched.live_reqs)
        if rids:
            pending.ended_at_deadline += len(rids)
            why = f"this node switched to the {pending.role} role before the request ended"
            sched.finish_requests(rids, FinishStatus.abort(why, 503, err_type=ROLE_SWITCH))
            logger.warning("role switch to %s: drain deadline passed, %d requests ended", pending.role,
                           len(rids))
        return False  # the role lets go of what it held in the coming iterations (a quarantine drains)
    if left:
        return False
    if not sched.tree_cache.flush():
        return False  # a page still locked: the next iteration tries again
    return True


def agree_any(group, *flags: bool) -> list[bool]:
    """Each flag, true when it is true on any rank of `group` (one MAX all-reduce)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [bool(v) for v in t.tolist()]


def scheduler_class(role: str):
    """The scheduler class of a role, by the import path `common/role_rules.py` names."""
    from common.role_rules import scheduler_path

    module, _, name = scheduler_path(role).partition(":")
    return getattr(importlib.import_module(module), name)


def build(old, role: str, comm, tp_group):
    """A scheduler of `role` over `old`'s runner (`ModelRunner.switch_role` first: it refuses a runner with a
    page or a row in use)."""
    args = dataclasses.replace(old.args, disaggregation_mode=role)
    cls = scheduler_class(role)
    old.runner.switch_role(args, cls.make_req_pool(args))
    return cls(args, old.model_dir, old.tp_rank, old.tp_size, tp_group, runner=old.runner,
               tokenizer=old.tokenizer, send_fn=old.send_fn, comm=comm, dp_rank=old.dp_rank,
               pp_rank=old.pp_rank)


def rebuild(old, comm=None, tp_group=None):
    """The scheduler of the role `old` drained for, over `old`'s runner (its loop has ended and closed the
    old role); it answers the switch query. A build that fails on any rank (the new role's transfer engine
    does not start, say) leaves every rank of the group in the old role, rebuilt the same way, and the
    answer says why; only a failure to rebuild the old role too ends the process."""
    pending = old.switch
    new, error = None, None
    try:
        new = build(old, pending.role, comm, tp_group)
    except Exception as e:
        logger.exception("role switch to %s failed; this group goes back to the %s role", pending.role,
                         old.args.disaggregation_mode)
        error = f"{type(e).__name__}: {e}"
    failed = error is not None
    if comm is not None and getattr(comm, "tp_size", 1) > 1:
        (failed,) = agree_any(comm.group, failed)
    if failed:
        if new is not None:  # this rank built it, another did not
            new.close()
        new = build(old, old.args.disaggregation_mode, comm, tp_group)
        why = error or "it failed on another rank of the group: see that rank's log"
        new.send(StatsReport(qid=pending.qid, stats={
            "switched": False, "error": f"the {pending.role} role did not start on this node ({why}); it "
                                        f"serves the {old.args.disaggregation_mode} role again"}))
        return new
    seconds = time.monotonic() - pending.started
    logger.info("role switch to %s done in %.2fs: %d requests handed back, %d ended at the deadline",
                pending.role, seconds, pending.handed_back, pending.ended_at_deadline)
    new.send(StatsReport(qid=pending.qid, stats={
        "switched": True, "role": pending.role, "seconds": round(seconds, 3),
        "handed_back": pending.handed_back, "ended_at_deadline": pending.ended_at_deadline,
        "ready": ready_info(new)}))
    return new


def ready_info(scheduler) -> dict:
    """What the front end learns of a group once it serves (its ready message, and after a switch)."""
    import msgspec

    runner = scheduler.runner
    return {
        "status": "ready",
        "model_config": runner.model_config_dict(),
        "max_total_tokens": scheduler.allocator.capacity,
        "context_length": scheduler.context_length,
        "page_size": scheduler.page_size,
        "max_running_requests": scheduler.max_running_requests,
        "placement": runner.device_info(),  # the device, dtypes and kernels the flags resolved to
        # what a peer must share to pair with this node (common/fingerprint.py), the same on every rank
        "compatibility": msgspec.to_builtins(runner.compatibility)
        if hasattr(runner, "compatibility") else None, "fingerprint": getattr(runner, "fingerprint", None),
    }
