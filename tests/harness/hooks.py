"""Driving `tests/pd/node_hooks` (test-only hooks inside node processes) from a test.

* `HOOKS`: the directory to put on a node's PYTHONPATH (with PDSERVE_TEST_HOOKS_DIR naming the control
  directory the test drives the hooks through);
* `slow_forwards(control_dir, seconds)`: a context in which every forward of the node's scheduler ranks
  sleeps `seconds` first, so a request of N tokens runs for at least N * seconds on any host;
* `decode_during(url, ids, new, control_dir, during)`: a greedy streamed request of `new` tokens that is
  still decoding while `during()` runs: the node's forwards are slowed (`slow_forward`, 50 ms each) from
  before it starts until `during()` returns, so no host is fast enough to finish it first. Returns
  `(during()'s result, the stream's StreamResult)`.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.harness.client import stream
from tests.harness.pd import greedy

HOOKS = str(Path(__file__).resolve().parents[1] / "pd" / "node_hooks")


@contextlib.contextmanager
def slow_forwards(control_dir: Path, seconds: float):
    slow = control_dir / "slow_forward"
    slow.write_text(str(seconds))
    try:
        yield
    finally:
        slow.unlink(missing_ok=True)


def decode_during(url: str, ids: list[int], new: int, control_dir: Path, during):
    body = {"input_ids": ids, "stream": True, "sampling_params": greedy(new)}
    decoding = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        with slow_forwards(control_dir, 0.05):
            running = pool.submit(stream, url + "/generate", body, on_event=lambda i, _e: decoding.set())
            assert decoding.wait(60), "the running request never produced a token"
            got = during()
        return got, running.result()
