"""SchedulerHooks: what the scheduler tells a node role, and asks it (a PD role's KV-connector side).

The scheduler calls these; the defaults do nothing, which is a colocated node. A PD role subclasses
this, keeps a reference to its scheduler and drives it only through the contract (`add_request`,
`add_prebuilt_reqs`, `finish_requests`, `release_held`); it never overrides the scheduler's loop.

Admission
* `validate(req)` -> `(status, message)` (or `(status, message, err_type)`, a cause the router acts on)
  or None: the role's checks, before the scheduler's own;
* `on_new_request(req)` -> bool: a validated request arrived; True if the role keeps it (its
  queues hold it until it calls `add_request` / `add_prebuilt_reqs`), False for the waiting queue.

Every iteration
* `before_schedule()`: first thing in `schedule()`: poll transfers, move requests between the
  role's queues, add the ready ones to the scheduler, end the failed ones.

Prefill progress
* `on_chunk_done(req)`: a chunk of the prompt (not the last) is in the KV pool;
* `on_prefill_done(req)`: the prefill is complete and the first token (if any) appended.

Ending
* `on_finished(req)` -> bool: the request finished normally; True makes the scheduler hold its
  memory and its final update until the role calls `release_held(rid)` (say, the KV transfer is
  done) or `finish_requests(rid, status)` (the transfer failed);
* `on_release(req)`: the request is leaving (finished, aborted, failed, refused): drop it from the
  role's queues and free what the role holds for it. Called before the scheduler frees its memory.

Loop and stats
* `has_work()`: requests in the role's queues (the loop keeps polling instead of blocking);
* `unstarted()` -> rids the role holds that have not begun its work (a role switch hands them back);
* `has_ready_work()`: some of them will run a forward without waiting for anything but a slot;
* `queue_counts()` -> stage -> count for the stats (None: the scheduler's own), `stats()` -> extra
  stats, `close()` when the loop ends.
"""

from __future__ import annotations

from typing import Any

from common.scheduler.req import Req


class SchedulerHooks:
    def validate(self, req: Req) -> tuple[int, str] | None:
        return None

    def on_new_request(self, req: Req) -> bool:
        return False

    def before_schedule(self) -> None:
        pass

    def on_chunk_done(self, req: Req) -> None:
        pass

    def on_prefill_done(self, req: Req) -> None:
        pass

    def on_finished(self, req: Req) -> bool:
        return False

    def on_release(self, req: Req) -> None:
        pass

    def has_work(self) -> bool:
        return False

    def has_ready_work(self) -> bool:
        return False

    def unstarted(self) -> list[str]:
        return []

    def queue_counts(self) -> dict[str, int] | None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
