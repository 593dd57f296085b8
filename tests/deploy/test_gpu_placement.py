"""`pdserve cluster --device cuda --gpu-ids ...`: which GPUs each node gets (deploy/gpu_placement.py), the
flags that carry it to the nodes, and the errors before anything starts. No GPU here: the GPU count is a
parameter (or the module's `visible_gpu_count`, replaced)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deploy import cluster_cli as cl
from deploy import gpu_placement as gp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plan(num_prefill=1, num_decode=1, gpus=2, ids=None, node=(), prefill=(), decode=(), device="cuda"):
    return gp.plan_from_flags(device, ids, num_prefill, num_decode, list(node), list(prefill), list(decode),
                              cl.node_parser(), gpu_count=gpus)


def where(p: gp.GpuPlan) -> dict[str, list[int]]:
    return {name: n.gpus for name, n in p.nodes.items()}


def test_enough_gpus_give_every_node_its_own_in_gpu_ids_order():
    p = plan(2, 2, gpus=4)
    assert where(p) == {"prefill-0": [0], "prefill-1": [1], "decode-0": [2], "decode-1": [3]}
    assert not p.shared
    assert p.node_flags("decode-1") == ["--device", "cuda", "--base-gpu-id", "3", "--gpu-id-step", "1"]
    assert all(n.fraction is None and not n.shared_with for n in p.nodes.values())
    # the order of --gpu-ids is kept; GPUs left over are said to be unused
    p = plan(1, 1, gpus=4, ids="3,1,2")
    assert where(p) == {"prefill-0": [3], "decode-0": [1]}
    lines = p.describe().splitlines()
    assert lines[0].startswith("GPU placement (GPUs of its own per node; --gpu-ids 3,1,2)")
    assert lines[1:] == ["  prefill-0: cuda:3", "  decode-0: cuda:1", "  unused: cuda:2"]


def test_fewer_gpus_than_nodes_share_them_round_robin_with_memory_shares():
    p = plan(1, 1, gpus=1)
    assert p.shared and where(p) == {"prefill-0": [0], "decode-0": [0]}
    assert p.node_flags("prefill-0") == ["--device", "cuda", "--base-gpu-id", "0", "--gpu-id-step", "1",
                                         "--mem-fraction-static", "0.44"]
    assert p.describe().splitlines()[1:] == [
        "  prefill-0: cuda:0 (shared with decode-0, --mem-fraction-static 0.44)",
        "  decode-0: cuda:0 (shared with prefill-0, --mem-fraction-static 0.44)"]
    # three on one GPU: 0.88 / 3 floored to a hundredth
    assert {n.fraction for n in plan(2, 1, gpus=1).nodes.values()} == {0.29}
    # three on two: decode-0 comes round to GPU 0; prefill-1 keeps GPU 1 to itself and gets no fraction
    p = plan(2, 1, gpus=2)
    assert where(p) == {"prefill-0": [0], "prefill-1": [1], "decode-0": [0]}
    assert (p.nodes["prefill-0"].fraction, p.nodes["prefill-1"].fraction) == (0.44, None)
    assert "--mem-fraction-static" not in p.node_flags("prefill-1")
    assert p.nodes["decode-0"].shared_with == ["prefill-0"]


def test_tp_nodes_take_evenly_spaced_gpu_groups():
    p = plan(1, 1, gpus=4, prefill=["--tp", "2"])
    assert where(p) == {"prefill-0": [0, 1], "decode-0": [2]}
    assert p.node_flags("prefill-0")[:6] == ["--device", "cuda", "--base-gpu-id", "0", "--gpu-id-step", "1"]
    # a group of every other GPU is expressible with --gpu-id-step 2
    p = plan(1, 1, gpus=4, ids="0,2,1,3", node=["--tp-size", "2"])
    assert where(p) == {"prefill-0": [0, 2], "decode-0": [1, 3]}
    assert p.node_flags("decode-0") == ["--device", "cuda", "--base-gpu-id", "1", "--gpu-id-step", "2"]
    # the role's own flags win over the common ones, and --dp-size counts too
    p = plan(1, 1, gpus=8, node=["--tp", "2"], decode=["--tp", "1", "--dp-size", "4"])
    assert where(p) == {"prefill-0": [0, 1], "decode-0": [2, 3, 4, 5]}
    # TP 2 nodes on two GPUs share both
    p = plan(1, 1, gpus=2, node=["--tp", "2"])
    assert where(p) == {"prefill-0": [0, 1], "decode-0": [0, 1]}
    assert p.nodes["decode-0"].fraction == 0.44
    # going round: a wrapped group that is evenly spaced is kept, one that is not starts at the front
    assert where(plan(1, 1, gpus=3, node=["--tp", "2"])) == {"prefill-0": [0, 1], "decode-0": [0, 2]}
    assert where(plan(1, 1, gpus=4, node=["--tp", "3"])) == {"prefill-0": [0, 1, 2], "decode-0": [0, 1, 2]}
    with pytest.raises(ValueError, match="would run on GPUs 0,1,3, which are not evenly spaced"):
        plan(1, 1, gpus=4, ids="0,1,3", node=["--tp", "3"])
    with pytest.raises(ValueError, match=r"--gpu-ids: prefill-0 needs 4 GPUs .* gives 2"):
        plan(1, 1, gpus=2, prefill=["--tp", "4"])


def test_given_fractions_are_kept_and_must_fit_on_their_gpu():
    p = plan(1, 1, gpus=1, node=["--mem-fraction-static", "0.4"])
    assert [n.fraction for n in p.nodes.values()] == [None, None]  # the nodes already have theirs
    assert "--mem-fraction-static" not in p.node_flags("decode-0")
    assert p.describe().splitlines()[2] \
        == "  decode-0: cuda:0 (shared with prefill-0, --mem-fraction-static 0.4 given)"
    # only the prefill nodes have one: the decode node takes what is left of the budget
    p = plan(1, 1, gpus=1, prefill=["--mem-fraction-static=0.6"])
    assert p.nodes["decode-0"].fraction == 0.28
    with pytest.raises(ValueError,
                       match=r"--mem-fraction-static: cuda:0 holds prefill-0 0\.5 \+ decode-0 0\.5 = 1\.00"):
        plan(1, 1, gpus=1, node=["--mem-fraction-static", "0.5"])
    with pytest.raises(ValueError, match="leave no memory .* for decode-0, decode-1"):
        plan(1, 2, gpus=1, prefill=["--mem-fraction-static", "0.9"], decode=[])
    # on a GPU of its own a node's fraction is its business alone
    assert plan(1, 1, gpus=2, node=["--mem-fraction-static", "0.97"]).nodes["prefill-0"].fraction is None


@pytest.mark.parametrize("ids, why", [("0,0", "GPU 0 is listed twice"), ("-1", "GPU ids are >= 0"),
                                      ("0,x", "'x' is not a GPU id"), ("", "'' is not a GPU id"),
                                      ("2", "no GPU 2: torch sees 2")])
def test_bad_gpu_ids_name_the_flag(ids, why):
    with pytest.raises(ValueError, match=f"--gpu-ids: {why}"):
        plan(gpus=2, ids=ids)


def test_conflicts_and_what_needs_a_gpu():
    with pytest.raises(ValueError, match="--gpu-ids: .* give --device too"):
        plan(device=None, ids="0")
    with pytest.raises(ValueError, match="--device cuda: torch sees no GPU"):
        plan(gpus=0)
    with pytest.raises(ValueError, match="--gpu-ids: no GPU to choose from with --device cpu"):
        plan(device="cpu", ids="0")
    with pytest.raises(ValueError, match="--base-gpu-id: set by the GPU placement"):
        plan(decode=["--base-gpu-id", "1"])
    with pytest.raises(ValueError, match="--device: given to the launcher and in the prefill nodes' flags"):
        plan(prefill=["--device", "cpu"])
    # no --device: nothing placed; cpu, or auto without a GPU: the flag reaches the nodes unchanged
    assert plan(device=None) is None
    assert plan(device="cpu", gpus=4).node_flags("prefill-0") == ["--device", "cpu"]
    auto = plan(device="auto", gpus=0)
    assert auto.node_flags("decode-0") == ["--device", "auto"] and auto.describe() == ""
    assert where(plan(device="auto", gpus=2)) == {"prefill-0": [0], "decode-0": [1]}


def test_cluster_flags_become_each_nodes_device_flags(monkeypatch, capsys):
    monkeypatch.setattr(gp, "visible_gpu_count", lambda: 1)
    c = cl.cluster_from_args(["--device", "cuda", "--prefill", "1", "--decode", "2",
                              "--transfer-backend", "fake"])
    assert c.node_args == []  # --device is the launcher's flag now, placed per node
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
        cmd = c._node_cmd(role, 1, 2, None, name)
        i = cmd.index("--device")
        assert cmd[i:i + 8] == ["--device", "cuda", "--base-gpu-id", "0", "--gpu-id-step", "1",
                                "--mem-fraction-static", "0.29"], name
    assert c.gpu_plan.describe().splitlines()[1] == \
        "  prefill-0: cuda:0 (shared with decode-0, decode-1, --mem-fraction-static 0.29)"
    # the node flags given to the launcher come after the placement's
    c = cl.cluster_from_args(["--device", "cuda", "--gpu-ids", "0", "--max-running-requests", "4"])
    cmd = c._node_cmd("decode", 1, 0, None, "decode-0")
    assert cmd.index("--device") < cmd.index("--max-running-requests")
    # --device cpu goes to every node as before; without --device no node gets one from the launcher
    c = cl.cluster_from_args(["--device", "cpu"])
    assert c._node_cmd("prefill", 1, 2)[-2:] == ["--device", "cpu"]
    assert "--device" not in cl.cluster_from_args([])._node_cmd("decode", 1, 0)
    monkeypatch.setattr(gp, "visible_gpu_count", lambda: 0)
    with pytest.raises(SystemExit) as e:
        cl.cluster_from_args(["--device", "cuda"])
    assert e.value.code == 2 and "--device cuda: torch sees no GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cl.cluster_from_args(["--device", "cuda", "--gpu-ids", "1,1"])


def test_device_cuda_without_a_gpu_fails_before_any_child_starts(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # torch sees no GPU, on any machine
    r = subprocess.run([sys.executable, "-m", "deploy.cli", "cluster", "--log-dir", str(tmp_path / "logs"),
                        "--transfer-backend", "fake", "--device", "cuda"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--device cuda: torch sees no GPU" in r.stderr and "CUDA_VISIBLE_DEVICES=''" in r.stderr
    assert not (tmp_path / "logs").exists()  # nothing was started
