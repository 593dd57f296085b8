"""CudaGraphRunner on CPU: the batch sizes, `can_run`, and capture + padded replay of real tiny models
(Llama, Qwen3.5-hybrid) with the Triton backend under Triton's interpreter, the graph replaced by an
eager stand-in that records the forward as a closure and runs it again on replay (what a CUDA graph
does, minus the launch savings). Replay must give the eager forward's logits and greedy tokens step
after step while the batch shrinks (3 requests padded to 4, then 2, then 1). The real CUDA graphs are
tested on a GPU by tests/gpu/."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton and the kernel module are imported
pytest.importorskip("triton", reason="triton is not installed (make setup installs triton==3.6.0)")

from common.config import ServerArgs  # noqa: E402
from common.cuda_graph import CudaGraphRunner, capture_batch_sizes  # noqa: E402
from common.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from common.layers.attention_backend import create_attention_backend  # noqa: E402
from common.layers.triton_kernels import interpreted  # noqa: E402
from common.memory.kv_pool import KVPool  # noqa: E402
from common.runner import ModelRunner  # noqa: E402
from tests.model_harness import one_torch_thread  # noqa: E402, F401  (autouse)

if not interpreted():
    pytest.skip(f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']} when triton was imported: no interpreter "
                "for CPU tensors", allow_module_level=True)


class EagerCapture:
    """The graph stand-in: `capture(fn)` runs `fn` once and returns a graph whose `replay()` runs it
    again into the same output tensor. Records the order of the captured sizes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def __call__(self, fn):
        out = fn()
        self.sizes.append(out.shape[0])
        return _Replay(fn, out), out


class _Replay:
    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out = fn, out
        self.replays = 0

    def replay(self) -> None:
        result = self.fn()
        if result.data_ptr() != self.out.data_ptr():
            self.out.copy_(result)
        self.replays += 1


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(3) == [1, 2, 3]
    assert capture_batch_sizes(8) == [1, 2, 4, 8]
    assert capture_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_batch_sizes(45) == [1, 2, 4, 8, 16, 24, 32, 40, 45]
    with pytest.raises(ValueError, match="cuda-graph-max-bs"):
        capture_batch_sizes(0)


def _decode_fb(pool, r2t, bs: int, **kw) -> ForwardBatch:
    z = torch.zeros(bs, dtype=torch.int64)
    return ForwardBatch(ForwardMode.DECODE, z, z, z, z, [1] * bs, [0] * bs, [1] * bs, pool, r2t, **kw)


def test_refuses_a_backend_without_graphs_and_can_run():
    pool = KVPool(4, 4, 1, 1, 16)
    r2t = torch.zeros(2, 16, dtype=torch.int64)
    with pytest.raises(ValueError, match="torch_native attention backend cannot run in a CUDA graph"):
        CudaGraphRunner(None, create_attention_backend("torch_native", 2, 1, 16), pool, r2t, 4, "cpu",
                        capture=EagerCapture())
    g = CudaGraphRunner(None, create_attention_backend("triton", 2, 1, 16), pool, r2t, 6, "cpu",
                        capture=EagerCapture())
    assert g.batch_sizes == [1, 2, 4, 6]
    assert [g.padded_size(b) for b in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]
    assert g.can_run(_decode_fb(pool, r2t, 3))
    assert g.can_run(_decode_fb(pool, r2t, 3, logits_indices=torch.arange(3)))
    assert not g.can_run(_decode_fb(pool, r2t, 3, logits_indices=torch.tensor([0, 2, 1])))
    assert not g.can_run(_decode_fb(pool, r2t, 3, logits_indices=torch.arange(2)))
    assert not g.can_run(_decode_fb(pool, r2t, 7))
    fb = _decode_fb(pool, r2t, 2)
    fb.extras["keep_hidden"] = True
    assert not g.can_run(fb)
    fb = _decode_fb(pool, r2t, 2)
    fb.mode = ForwardMode.EXTEND
    assert not g.can_run(fb)
    with pytest.raises(RuntimeError, match="capture_all"):
        g.replay(_decode_fb(pool, r2t, 2))
    hybrid = CudaGraphRunner(None, create_attention_backend("triton", 2, 1, 16), pool, r2t, 2, "cpu",
                             state_pool=object(), capture=EagerCapture())
    assert not hybrid.can_run(_decode_fb(pool, r2t, 2))
    assert hybrid.can_run(_decode_fb(pool, r2t, 2, state_indices=torch.tensor([1, 2])))


class Engine:
    """A ModelRunner driven as bench/engine.py's OurEngine does: prefill with one EXTEND, then DECODE
    steps; `graphs` replays the decode steps instead of the eager forward."""

    def __init__(self, model_dir: str, graphs_max_bs: int = 0) -> None:
        args = ServerArgs(model=model_dir, device="cpu", attention_backend="triton", max_total_tokens=512,
                          max_running_requests=4, page_size=4, context_length=64)
        self.r = ModelRunner(args, model_dir)
        self.graphs = self.capture = None
        if graphs_max_bs:
            self.capture = EagerCapture()
            r = self.r
            self.graphs = CudaGraphRunner(r.model, r.attn_backend, r.kv_pool,
                                          r.req_to_token_pool.req_to_token,
                                          graphs_max_bs, r.device, state_pool=r.hybrid.state_pool,
                                          capture=self.capture)
            self.graphs.capture_all()
        self.rows: list[int] = []
        self.lens: list[int] = []

    def prefill(self, prompts: list[list[int]]) -> torch.Tensor:
        r = self.r
        slots = []
        for p in prompts:
            row = r.req_to_token_pool.alloc()
            s = r.allocator.alloc_extend(0, 0, len(p))
            r.req_to_token_pool.write(row, 0, s)
            self.rows.append(row)
            self.lens.append(len(p))
            slots.append(s)
        lens = [len(p) for p in prompts]
        fb = ForwardBatch(ForwardMode.EXTEND, torch.tensor([t for p in prompts for t in p]),
                          torch.cat([torch.arange(n) for n in lens]), torch.cat(slots),
                          torch.tensor(self.rows),
                          list(lens), [0] * len(lens), list(lens), r.kv_pool,
                          r.req_to_token_pool.req_to_token)
        return r.forward(fb)

    def decode(self, tokens: list[int]) -> torch.Tensor:
        r = self.r
        slots = []
        for i, (row, n) in enumerate(zip(self.rows, self.lens, strict=True)):
            s = r.allocator.alloc_extend(n, int(r.req_to_token_pool.req_to_token[row, n - 1]), 1)
            r.req_to_token_pool.write(row, n, s)
            slots.append(s)
            self.lens[i] = n + 1
        fb = ForwardBatch(ForwardMode.DECODE, torch.tensor(tokens), torch.tensor([n - 1 for n in self.lens]),
                          torch.cat(slots), torch.tensor(self.rows), list(self.lens),
                          [n - 1 for n in self.lens],
                          [1] * len(self.rows), r.kv_pool, r.req_to_token_pool.req_to_token)
        if self.graphs is None:
            return r.forward(fb)
        if r.hybrid.has_state:
            fb.state_indices = r.hybrid.state_indices(r.req_to_token_pool, fb)
        assert self.graphs.can_run(fb)
        return self.graphs.replay(fb).clone()  # a view of the static buffer: the next replay overwrites it

    def finish(self, i: int) -> None:
        r = self.r
        row, n = self.rows.pop(i), self.lens.pop(i)
        r.allocator.free_slots(r.req_to_token_pool.slots(row, 0, n))
        r.req_to_token_pool.free(row)


def _compare(model_dir: str) -> None:
    eager, graphed = Engine(model_dir), Engine(model_dir, graphs_max_bs=4)
    assert graphed.capture.sizes == [4, 2, 1]  # largest first
    assert graphed.graphs.logits.shape[0] == 4
    gen = torch.Generator().manual_seed(0)
    vocab = eager.r.vocab_size
    prompts = [torch.randint(3, vocab - 1, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    toks = eager.prefill(prompts).argmax(-1).tolist()
    assert graphed.prefill(prompts).argmax(-1).tolist() == toks
    # 3 requests (padded to 4) for three steps, then 2 (one finished), then 1
    for step in range(6):
        if step in (3, 5):
            eager.finish(0)
            graphed.finish(0)
            toks = toks[1:]
        a, b = eager.decode(toks), graphed.decode(toks)
        assert a.shape == b.shape == (len(toks), vocab)
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        toks = a.argmax(-1).tolist()
        assert b.argmax(-1).tolist() == toks
    replays = {size: g.replays for size, g in graphed.graphs.graphs.items()}
    assert replays == {4: 3, 2: 2, 1: 1}


def test_llama_replay_matches_eager(make_tiny_model):
    _compare(make_tiny_model("llama", num_hidden_layers=2))


def test_qwen3_5_replay_matches_eager(tmp_path):
    from tests.hybrid.hybrid_harness import make_qwen3_5

    make_qwen3_5(str(tmp_path))
    _compare(str(tmp_path))
