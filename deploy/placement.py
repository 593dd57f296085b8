"""Where each node of a local cluster runs: `pdserve cluster --cpu-affinity auto` (the default).

Nodes started unpinned on one machine each take every core for their torch threads, so a prefill
node's GEMMs and a decode node's steps fight over the same cores, and OpenMP threads that spin while
they wait for the next parallel region steal the other node's time: the decode node's inter-token
latency then shows exactly the prefill interference disaggregation exists to remove.

The automatic placement gives every node cores of its own when there are enough:
* the cores this process may run on are split into one contiguous block per node, prefill nodes
  first; each node gets `cores // nodes` of them and the leftover cores go one each to the first
  nodes, prefill nodes first (a prefill is compute-bound and scales with cores; a decode step at
  small batch is bound by memory bandwidth);
* each node's torch threads = its cores (its ranks share them: the node divides by its TP size);
* with fewer cores than nodes the nodes share cores round-robin with one thread each;
* OpenMP threads sleep between parallel regions instead of spinning (`OMP_WAIT_POLICY=PASSIVE`,
  unless the environment already sets a policy): a node's front end and scheduler processes share
  its cores, and a thread spinning on a busy core only burns the time of whoever else runs there
  (`pdserve bench compare` measured a 2-thread node 8x slower per token at load 10 with spinning).
* decode node i borrows prefill node i's cores while that node has nothing to run (`loans`;
  common/core_loan.py): in a busy run the prefill node idles a tenth of the time with every request
  at the decode node, whose steps then run on both nodes' cores (`pdserve bench placement`:
  `core_loan_output_throughput`). Never with shared cores.
The router is not pinned: it moves bytes between sockets and the kernel puts it where a core is idle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# what OpenMP threads do between parallel regions: sleep, not spin
WAIT_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
# a borrowing decode node's threads spin ~10 us between parallel regions before they sleep: a forward's
# regions follow each other within microseconds, and waking a sleeping thread for each made a forward on
# a lent core no faster than without it (common/core_loan.py)
BORROWER_ENV = {"GOMP_SPINCOUNT": "10000"}


@dataclass
class Placement:
    """Cores per node (by child name, e.g. "decode-0"), the environment every node gets, and why."""

    cores: dict[str, list[int]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    shared: bool = False  # fewer cores than nodes
    loans: dict[str, str] = field(default_factory=dict)  # borrower (decode node) -> lender (prefill node)

    def node_env(self, name: str) -> dict[str, str]:
        """The environment node `name` gets."""
        return {**self.env, **(BORROWER_ENV if name in self.loans else {})}

    def describe(self) -> str:
        nodes = ", ".join(f"{name} on {_span(c)} ({len(c)} thread{'s' * (len(c) > 1)})"
                          for name, c in self.cores.items())
        how = "fewer cores than nodes: shared round-robin" if self.shared else "a core set per node"
        env = " ".join(f"{k}={v}" for k, v in self.env.items()) or "environment unchanged"
        loans = "".join(f"; {d} borrows {p}'s {_span(self.cores[p])} while {p} has nothing to run "
                        f"({' '.join(f'{k}={v}' for k, v in BORROWER_ENV.items())})"
                        for d, p in self.loans.items())
        return f"placement ({how}; {env}; router unpinned): {nodes}{loans}"


def plan(num_prefill: int, num_decode: int, cores: list[int], loans: bool = True) -> Placement:
    """The automatic placement of `num_prefill` + `num_decode` nodes on `cores` (`loans`: decode node i
    borrows prefill node i's cores, for every i that has both)."""
    if num_prefill < 0 or num_decode < 0 or not cores:
        raise ValueError("plan needs node counts >= 0 and at least one core")
    cores = sorted(cores)
    names = [f"prefill-{i}" for i in range(num_prefill)] + [f"decode-{i}" for i in range(num_decode)]
    n = len(names)
    if n == 0:
        return Placement()
    env = {} if "OMP_WAIT_POLICY" in os.environ else dict(WAIT_ENV)
    if len(cores) < n:
        return Placement({name: [cores[i % len(cores)]] for i, name in enumerate(names)}, env, shared=True)
    share, extra = divmod(len(cores), n)
    out: dict[str, list[int]] = {}
    start = 0
    for i, name in enumerate(names):  # prefill nodes first, so they take the leftover cores first
        take = share + (i < extra)
        out[name] = cores[start:start + take]
        start += take
    lent = {f"decode-{i}": f"prefill-{i}" for i in range(min(num_prefill, num_decode))} if loans else {}
    return Placement(out, env, loans=lent)


def _span(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "cores 0-2,5"."""
    parts, i = [], 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        parts.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ("core " if len(cores) == 1 else "cores ") + ",".join(parts)
