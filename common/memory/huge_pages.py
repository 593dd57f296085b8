"""Large CPU buffers backed by transparent huge pages.

`huge_zeros(numel, dtype)` maps private anonymous memory (zero-filled) with `MADV_HUGEPAGE`, so the
kernel may back it with 2 MiB pages even where THP is in `madvise` mode (the default of many
distributions, and of this machine). The KV pool and the packed weights use it: decode reads the pool
in 4 KB runs spread over the whole allocation and streams every weight once per step, and with 4 KB
pages each run costs a TLB miss. Measured here (a noisy VM, alternating runs): the decode attention
kernel over 30 layers with the KV coming from DRAM ~10% faster on average, a batch-16 SmolLM2 step's
median 77 -> 63 ms. Where the advice is refused (no THP, or `PDSERVE_HUGE_PAGES=0`) the memory
is ordinary anonymous memory, so correctness never depends on it.

Such a mapping's pages are faulted in at their first write, and a first touch is slow: on this VM 0.4-0.8
GB/s, against ~28 GB/s for writing the same bytes again (the host backs the memory as well). A fresh
server's KV pool is written page after page by its first requests, so each paid for its own (a 512-token
prompt ~24 MB of SmolLM2's pool, ~30 ms of its time to first token). `fault_in_background` takes that
cost off them: a thread at the lowest priority faults the whole mapping in (`MADV_POPULATE_WRITE`, which
leaves what is already written alone) while the server waits for, or serves, its first requests.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable without touching their contents


def huge_zeros(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zeroed 1-D tensor of `numel` elements in its own mapping (freed with the tensor)."""
    nbytes = max(numel, 1) * torch.empty((), dtype=dtype).element_size()
    if os.environ.get("PDSERVE_HUGE_PAGES", "1") == "0" or nbytes < HUGE_PAGE:
        return torch.zeros(numel, dtype=dtype)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass  # THP disabled: plain pages
    # the tensor keeps the mapping alive; it is unmapped when the last view goes
    return torch.frombuffer(m, dtype=dtype, count=numel)


def fault_in_background(t: torch.Tensor, what: str, chunk: int = 32 << 20) -> threading.Thread | None:
    """Fault in every page of `t` (a CPU tensor of its own mapping, as `huge_zeros` makes) from a daemon
    thread at nice 19, `chunk` bytes per call, so the serving threads keep their cores; pages a request
    wrote meanwhile keep their contents. Returns the thread, or None where there is nothing to do (not a
    CPU tensor, or smaller than a huge page). A kernel without MADV_POPULATE_WRITE leaves the pages to their
    first writes, as before."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE:
        return None
    start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    end = t.data_ptr() + nbytes

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:
            pass
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        t0 = time.perf_counter()
        for at in range(start, end, chunk):
            if libc.madvise(at, min(chunk, end - at), MADV_POPULATE_WRITE) != 0:  # the GIL is released
                logger.info("%s: pages left to their first writes (madvise: %s)", what,
                            os.strerror(ctypes.get_errno()))
                return
        logger.info("%s: %.0f MiB faulted in, in the background, in %.1f s", what, nbytes / 2**20,
                    time.perf_counter() - t0)

    thread = threading.Thread(target=run, name=f"fault-in {what}", daemon=True)
    thread.tensor = t  # the mapping stays while the thread runs
    thread.start()
    return thread
