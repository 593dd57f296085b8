"""Test-only hooks inside real node processes (prefill, decode and their scheduler processes).

A test puts this directory on the nodes' PYTHONPATH and names a control directory in
PDSERVE_TEST_HOOKS_DIR; Python imports this module at start-up in every process of the node. Each
hook is driven by a file the test creates in the control directory, and taken by the first process
that acts on it (renamed to `<name>.taken`), so it fires once:

* `gate_armed`: the next engine `write` creates `gate_entered` and waits, before it reaches the
  engine, until `gate_release` exists (a write in progress, held as long as the test needs);
* `hold_work` (read, not taken): while it exists, every completion a prefill rank hands its KV sender
  (`ModelRunner.work_done`) is signalled only once `work_done` exists; its `synchronize()` creates
  `work_waited` first. Every engine write creates `written`;
* `bad_token` (holding a number): the next metadata row a prefill writes carries that first token;
* `raise`: the next metadata row write raises (an exception inside the role's on_prefill_done).
* `hang_forward`: the next forward of a scheduler rank never returns (a hung kernel or collective).
* `slow_forward` (holding seconds; read, not taken): while it exists every forward of a scheduler rank
  sleeps that long first (a request keeps decoding for as long as a test needs it to).
* `drafts` (JSON: request id -> the tokens it should output; read, not taken): a speculating
  scheduler's drafter proposes those tokens instead of its own, wrong at the second draft when the
  request has an output length of 1 mod 3 and at the first when 2 mod 3, so verify steps keep all,
  some or none of their drafts whatever the model (a tiny random one never repeats itself).

PDSERVE_TEST_NO_QUARANTINE=1 makes a decode node free an aborted room's memory at once, as before the
quarantine existed (to show that a test catches what the quarantine prevents).
"""

import os
import sys
import time

_DIR = os.environ.get("PDSERVE_TEST_HOOKS_DIR")


def _take(name: str) -> str | None:
    """The file's content if this process is the one that takes it, else None."""
    path = os.path.join(_DIR, name)
    try:
        os.rename(path, path + ".taken")
    except OSError:
        return None
    with open(path + ".taken") as f:
        return f.read()


def _wait_for(name: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(os.path.join(_DIR, name)) and time.monotonic() < end:
        time.sleep(0.01)


class _HeldCompletion:
    """A forward's completion that is signalled when the test creates `work_done` (a GPU event that the
    device has not reached yet): `synchronize()` creates `work_waited`, then waits."""

    def synchronize(self) -> None:
        open(os.path.join(_DIR, "work_waited"), "w").close()
        _wait_for("work_done")


def _install() -> None:
    # the repository root is on PYTHONPATH ahead of this directory (tests.harness.nodes.ServerProcess)
    import transfer.backends as backends
    import transfer.metadata as metadata

    create = backends.create_engine

    def create_engine(*args, **kwargs):
        engine = create(*args, **kwargs)
        write = engine.write

        def gated_write(peer, src, dst, lengths, *kinds):
            open(os.path.join(_DIR, "written"), "w").close()
            if _take("gate_armed") is not None:
                open(os.path.join(_DIR, "gate_entered"), "w").close()
                _wait_for("gate_release")
            return write(peer, src, dst, lengths, *kinds)

        engine.write = gated_write
        return engine

    backends.create_engine = create_engine
    set_buf = metadata.MetadataBuffers.set_buf

    def hooked_set_buf(self, slot, first_token_id, *args, **kwargs):
        if _take("raise") is not None:
            raise RuntimeError("metadata write failed (injected by the test)")
        bad = _take("bad_token")
        return set_buf(self, slot, int(bad) if bad is not None else first_token_id, *args, **kwargs)

    metadata.MetadataBuffers.set_buf = hooked_set_buf
    if os.environ.get("PDSERVE_TEST_NO_QUARANTINE") == "1":
        import decode_node.quarantine as quarantine
        from transfer.base import KVPoll

        quarantine.QuarantinedRoom.poll = lambda self: KVPoll.Success


def _install_in_scheduler() -> None:
    import common.runner as runner

    run = runner.ModelRunner.run

    def hung_run(self, batch):
        if batch is not None and _take("hang_forward") is not None:
            while True:
                time.sleep(1)
        try:
            with open(os.path.join(_DIR, "slow_forward")) as f:
                time.sleep(float(f.read()))
        except (OSError, ValueError):
            pass
        return run(self, batch)

    runner.ModelRunner.run = hung_run
    work_done = runner.ModelRunner.work_done

    def held_work_done(self):
        return _HeldCompletion() if os.path.exists(os.path.join(_DIR, "hold_work")) else work_done(self)

    runner.ModelRunner.work_done = held_work_done

    import json

    import common.scheduler.speculative as speculative

    def given_chain(self, req, limit):
        try:
            with open(os.path.join(_DIR, "drafts")) as f:
                want = json.load(f).get(req.rid)
        except OSError:
            want = None
        if want is None:
            return ngram_chain(self, req, limit)
        at = len(req.output_ids)
        chain = want[at:at + limit]
        if chain and at % 3:
            wrong = min(2 - at % 3, len(chain) - 1)
            chain[wrong] = chain[wrong] - 1 if chain[wrong] else 1  # another token, still in the vocabulary
        return chain

    ngram_chain = speculative.NgramDrafter.chain_for
    speculative.NgramDrafter.chain_for = given_chain


if _DIR:
    _install()
    if "--multiprocessing-fork" in sys.argv:  # a scheduler rank
        _install_in_scheduler()
