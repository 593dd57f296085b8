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
prompt ~24 MB of SmolLM2's pool, ~30 ms of its time to first token). The slow part is the host backing
guest memory the VM had never touched; memory it had touched before faults in at ~16 GB/s. So the
scheduler faults its pool in before it reports ready (`fault_in`, on as many threads as it has cores):
that time goes to start-up, where it is paid once, and no request pays it. Faulting it in from a
background thread at the lowest priority instead left the requests that came right after start-up
sharing the cores with it (a 512-token prompt's TTFT up to 1.7x).
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



def fault_in(t: torch.Tensor, what: str, threads: int, chunk: int = 32 << 20) -> float | None:
    """Fault in every page of `t` (a CPU tensor of its own mapping, as `huge_zeros` makes) now, split over
    `threads` threads (`MADV_POPULATE_WRITE`, `chunk` bytes a call; the calls release the GIL); pages
    already written keep their contents. Returns the seconds it took, or None where nothing was done (not a
    CPU tensor, smaller than a huge page, or a kernel without MADV_POPULATE_WRITE: the pages are then left
    to their first writes)."""
    nbytes = t.numel() * t.element_size()
    if t.device.type != "cpu" or nbytes < HUGE_PAGE:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    end = t.data_ptr() + nbytes
    chunks = list(range(start, end, chunk))
    errors: list[int] = []

    def run(mine: list[int]) -> None:
        for at in mine:
            if libc.madvise(at, min(chunk, end - at), MADV_POPULATE_WRITE) != 0:
                errors.append(ctypes.get_errno())
                return

    t0 = time.perf_counter()
    workers = [threading.Thread(target=run, args=(chunks[i::threads],), name=f"fault-in {what} {i}")
               for i in range(max(1, min(threads, len(chunks))))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        logger.info("%s: pages left to their first writes (madvise: %s)", what, os.strerror(errors[0]))
        return None
    took = time.perf_counter() - t0
    logger.info("%s: %.0f MiB faulted in on %d threads in %.2f s", what, nbytes / 2**20, len(workers), took)
    return took
