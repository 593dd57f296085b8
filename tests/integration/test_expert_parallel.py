"""Expert parallelism in two real gloo processes: with `ep_size` 2 each rank holds half the experts (whole)
and computes their share of every token; the TP all-reduce sums the halves. Logits equal the TP-1 model's
for Qwen3-MoE and Mixtral, with and without EPLB moving replicas between the ranks mid-sequence."""

from __future__ import annotations

import multiprocessing as mp
import socket

import torch

from common.layers.eplb import EplbSettings
from common.models.loader import load_model
from tests.model_harness import (
    one_torch_thread,  # noqa: F401  (autouse)
    teacher_forced_logits,
)

IDS = list(range(200, 236))
PREFILL = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, init: str, dirs: list[str], ep_size: int, eplb, queue) -> None:
    try:
        torch.set_num_threads(1)
        from common.distributed import destroy_distributed, init_distributed
        from common.layers.moe import expert_load_stats

        tp_group, _ = init_distributed(rank, 2, init)
        out = []
        for d in dirs:
            model, cfg = load_model(d, tp_rank=rank, tp_size=2, tp_group=tp_group, ep_size=ep_size, eplb=eplb)
            logits = teacher_forced_logits(model, cfg, IDS, PREFILL, tp_size=2).numpy()
            out.append((logits, expert_load_stats(model)))
        queue.put((rank, out, None))
        destroy_distributed()
    except BaseException as e:
        import traceback

        queue.put((rank, None, f"{e!r}\n{traceback.format_exc()}"))


def _run_pair(dirs: list[str], ep_size: int, eplb=None) -> dict[int, list]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_worker, args=(r, init, dirs, ep_size, eplb, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(2):
            rank, results, err = queue.get(timeout=300)
            assert err is None, f"rank {rank} failed: {err}"
            got[rank] = results
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got


def _check(dirs: list[str], got: dict[int, list]) -> None:
    for i, d in enumerate(dirs):
        ref = teacher_forced_logits(*load_model(d), IDS, PREFILL)
        r0, r1 = torch.from_numpy(got[0][i][0]), torch.from_numpy(got[1][i][0])
        assert torch.equal(r0, r1), "ranks disagree"
        assert (r0 - ref).abs().max().item() < 1e-4, d


def test_ep2_matches_tp1(make_tiny_model):
    dirs = [make_tiny_model("qwen3_moe"), make_tiny_model("mixtral")]
    got = _run_pair(dirs, ep_size=2)
    _check(dirs, got)
    stats = got[0][0][1]
    assert stats["moe_ep_size"] == 2
    loads = stats["moe_expert_load"]
    # every layer saw each of the 36 tokens pick top_k = 2 experts
    assert loads and all(sum(v) == len(IDS) * 2 for v in loads.values()), loads
    assert got[1][0][1]["moe_expert_load"] == loads, "the ranks count the same routing"


def test_eplb_replicas_keep_logits(make_tiny_model):
    """Rebalances every 2 forwards (7 forwards: a prefill and 6 decode steps), one spare slot per rank:
    the first fills both spares over the wire, later ones may move them; the logits stay exact."""
    dirs = [make_tiny_model("qwen3_moe")]
    got = _run_pair(dirs, ep_size=2, eplb=EplbSettings(interval=2, redundant_per_rank=1))
    _check(dirs, got)
    stats = got[0][0][1]
    layers = len(stats["moe_expert_load"])
    assert stats["moe_eplb_rebalances"] == 3 * layers
    assert all(sum(c) == 4 + 2 for c in stats["moe_expert_replicas"].values()), stats["moe_expert_replicas"]


def test_dense_model_refuses_ep(make_tiny_model):
    import pytest

    from common.models.llama import ModelLoadError

    with pytest.raises(ModelLoadError, match="--ep-size"):
        load_model(make_tiny_model("llama"), ep_size=2)
