"""Memory kinds in the transfer contract, through the host path (transfer/memory.py): what a rank
registers per kind, the kinds each backend hands its library (NIXL's "DRAM"/"VRAM" with the device id,
UCX's memory type, Mooncake's CPU build refusing device memory), the fake engine refusing a region written
with the wrong kind, a room whose KV and state are declared device memory moving them apart from the
host metadata row, and the ordering rule: a chunk's job writes nothing before the forward's completion
it was handed is signalled."""

from __future__ import annotations

import dataclasses
import threading

import msgspec
import pytest
import torch

from common.memory.kv_pool import KVPool
from tests.transfer.inproc_pair import FIRST_TOKEN, GatedEngine, Pair, engine_or_skip, wait
from transfer.base import KVArgs, KVPoll
from transfer.control import peer_registration
from transfer.engine import BackendUnavailable, TransferEngine, TransferError
from transfer.fake import FakeEngine
from transfer.manager import registrations
from transfer.memory import HOST, memory_of, parse_memory
from transfer.metadata import MetadataBuffers
from transfer.peer_checks import check_registration


def test_kinds_parse_and_name_tensors():
    assert parse_memory("host") == ("host", 0)
    assert parse_memory("cuda:3") == ("cuda", 3)
    for bad in ("cuda", "cuda:-1", "cuda:x", "gpu:0", "", "cuda:99999"):
        with pytest.raises(ValueError, match="is not 'host' or 'cuda:N'"):
            parse_memory(bad)
    assert memory_of(torch.zeros(2)) == HOST


def _args(kv_memory: str = HOST, state_memory: str = HOST) -> KVArgs:
    pool = KVPool(8, 4, 2, 2, 8)
    meta = MetadataBuffers(4)
    state = torch.zeros(3, 2, 4)
    args = KVArgs.from_pool(pool, meta, [state], state_type="mamba", model="m")
    return dataclasses.replace(args, kv_memory=kv_memory, state_memory=state_memory)


def test_a_rank_registers_each_kind_on_its_own_and_the_metadata_rows_as_host_memory():
    args = _args()
    assert (args.kv_memory, args.state_memory) == (HOST, HOST)  # from_pool names the tensors' memory
    host = registrations(args)
    assert {kind for *_, kind in host} == {HOST}
    on_gpu = registrations(dataclasses.replace(args, kv_memory="cuda:0", state_memory="cuda:0"))
    kinds = {kind for *_, kind in on_gpu}
    assert kinds == {HOST, "cuda:0"}
    rows = [(p, n) for p, n, kind in on_gpu if kind == HOST]
    aux = sorted(zip(args.aux_data_ptrs, args.aux_data_lens, strict=True))
    assert sum(n for _, n in rows) == sum(n for _, n in aux)  # only the metadata rows are host memory
    assert all(any(p <= a and a + m <= p + n for p, n in rows) for a, m in aux)
    with pytest.raises(ValueError, match="memory kind 'tpu:0'"):
        dataclasses.replace(args, kv_memory="tpu:0")


def test_a_registration_names_its_kinds_and_a_bad_kind_is_refused():
    args = _args(kv_memory="cuda:1")
    reg = peer_registration(args, "tcp://127.0.0.1:1", b"desc")
    assert (reg.kv_memory, reg.state_memory) == ("cuda:1", HOST)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(reg), type=type(reg))
    assert wire.kv_memory == "cuda:1"
    assert check_registration(_args(), reg) is None  # a host prefill may write into a device decode
    bad = msgspec.structs.replace(reg, state_memory="cuda:x")
    assert "RegisterPeer.state_memory" in check_registration(_args(), bad)


def test_the_fake_engine_refuses_a_region_of_another_kind():
    src, dst = FakeEngine(), FakeEngine()
    try:
        src.register(0x10000, 4096, "cuda:0")
        src.register(0x90000, 256, HOST)
        dst.register(0x20000, 4096, "cuda:0")
        peer = src.add_peer(dst.describe())
        src.write(peer, [0x10000, 0x10800], [0x20000, 0x20100], [256, 256], "cuda:0", "cuda:0")
        src.write(peer, [0x90000], [0x20000], [64], HOST, "cuda:0")
        with pytest.raises(TransferError,
                           match="local region 0x10000\\+256 is not in memory registered as 'host'"):
            src.write(peer, [0x10000], [0x20000], [256], HOST, "cuda:0")
        with pytest.raises(TransferError,
                           match="remote region 0x20000\\+64 is not in memory registered as 'host'"):
            src.write(peer, [0x90000], [0x20000], [64], HOST, HOST)
        with pytest.raises(TransferError, match="remote region 0x20f80\\+256"):  # runs past the registration
            src.write(peer, [0x10000], [0x20f80], [256], "cuda:0", "cuda:0")
        with pytest.raises(TransferError, match="malformed"):
            src.add_peer(b"not a description")
        assert src.bytes_skipped == 576
    finally:
        src.close()
        dst.close()


def test_a_room_in_device_memory_moves_its_pages_and_state_apart_from_the_host_metadata_row():
    """Both sides declare their KV and state as cuda:0 (host tensors underneath: the fake engine reads
    nothing and checks every region against the kind it was registered with): the room succeeds, its
    kv + state regions go in one device batch, its metadata row in a host batch after it."""
    prefill, decode = _Recording(FakeEngine()), FakeEngine()
    pair = Pair(prefill, decode, memory={"kv_memory": "cuda:0", "state_memory": "cuda:0"})
    try:
        send, recv = pair.transfer(7, [1, 2, 3], [4, 5, 6], src_state=1, dst_state=2)
        assert (send.poll(), recv.poll()) == (KVPoll.Success, KVPoll.Success), recv.failure_exception()
        kinds = [(s, d) for s, d, _ in prefill.batches]
        assert kinds == [("cuda:0", "cuda:0"), (HOST, HOST)]
        rows = prefill.batches[1][2]
        assert rows == len(pair.pmeta.buffers())  # one region per metadata field: the row
    finally:
        pair.close()


def test_a_room_on_the_host_is_still_one_write():
    prefill = _Recording(FakeEngine())
    pair = Pair(prefill, FakeEngine())
    try:
        send, recv = pair.transfer(8, [1, 2], [3, 4], src_state=1, dst_state=1)
        assert (send.poll(), recv.poll()) == (KVPoll.Success, KVPoll.Success)
        assert [(s, d) for s, d, _ in prefill.batches] == [(HOST, HOST)]
    finally:
        pair.close()


@pytest.mark.parametrize("backend", ["fake", "nixl"])
def test_a_chunk_is_not_sent_before_its_forward_is_signalled_done(backend):
    """The ordering rule on the CPU: `send(..., ready=done)` — the job waits on `done.synchronize()`
    before its first write; the bytes land once it returns."""
    engine = GatedEngine(engine_or_skip(backend))
    pair = Pair(engine, engine_or_skip(backend))
    done = _Completion()
    try:
        send, recv = pair.start(9, [1, 2], [5, 6])
        engine.arm()  # `entered` is set when a write reaches the engine
        send.send([1, 2], [0], last=True, ready=done)
        assert done.waited.wait(10)  # the job is waiting for the forward
        assert not engine.entered.wait(0.5), "a write started before the forward was signalled done"
        assert send.poll() != KVPoll.Success
        engine.release()
        done.signal()
        assert wait(lambda: recv.poll() == KVPoll.Success)
        assert engine.entered.is_set()
        if backend != "fake":
            assert pair.pages_hold([5, 6], [1, 2]) and pair.row_room(0) == 9
            assert pair.dmeta.get_buf(0)["first_token_id"] == FIRST_TOKEN
    finally:
        done.signal()
        engine.release()
        pair.close()


def test_nixl_registers_and_describes_each_kind_with_its_device():
    nixl = engine_or_skip("nixl")
    calls = []
    agent = nixl._agent

    class Agent:  # records what reaches NIXL; device memory is not forwarded (no GPU here)
        def register_memory(self, regions, mem_type):
            calls.append(("register", mem_type, [r[2] for r in regions]))
            return agent.register_memory(regions, mem_type) if mem_type == "DRAM" else None

        def get_xfer_descs(self, arr, mem_type):
            calls.append(("descs", mem_type, sorted({int(d) for d in arr[:, 2]})))
            raise RuntimeError("recorded")

        def __getattr__(self, name):
            return getattr(agent, name)

    buf = torch.zeros(1024, dtype=torch.uint8)
    try:
        nixl._agent = Agent()
        nixl.register(buf.data_ptr(), 1024, HOST)
        nixl.register(0x7f0000000000, 1 << 20, "cuda:2")
        nixl._peers.add("peer")
        with pytest.raises(RuntimeError, match="recorded"):
            nixl.write("peer", [buf.data_ptr()], [0x1000], [64], HOST, "cuda:3")
    finally:
        nixl._agent = agent
        nixl._reg_descs = [d for d in nixl._reg_descs if d is not None]
        nixl._peers.clear()
        nixl.close()
    assert calls == [("register", "DRAM", [0]), ("register", "VRAM", [2]), ("descs", "DRAM", [0])]


def test_ucx_maps_each_kind_with_its_memory_type():
    from transfer import ucx

    assert ucx._ucs_memory_type(HOST) == 0 and ucx._ucs_memory_type("cuda:1") == 1
    engine = engine_or_skip("ucx")
    buf = torch.zeros(4096, dtype=torch.uint8)
    try:
        engine.register(buf.data_ptr(), 4096, HOST)  # the memory type field is set and UCX accepts it
        assert len(engine._regions) == 1
    finally:
        engine.close()


def test_mooncakes_cpu_build_refuses_device_memory_naming_the_cuda_build():
    from transfer import mooncake

    if mooncake.cuda_build():
        pytest.skip("the installed Mooncake is its CUDA build")
    engine = engine_or_skip("mooncake")
    try:
        with pytest.raises(BackendUnavailable,
                           match="pip install mooncake-transfer-engine \\(its CUDA build\\)"):
            engine.register(0x7f0000000000, 4096, "cuda:0")
    finally:
        engine.close()


class _Recording(TransferEngine):
    """Records (src kind, dst kind, regions) of every write reaching the wrapped engine."""

    def __init__(self, inner) -> None:
        super().__init__(inner.hostname, inner.device_name)
        self.inner, self.name, self.moves_bytes = inner, inner.name, inner.moves_bytes
        self.batches: list[tuple[str, str, int]] = []

    def register(self, ptr, length, memory=HOST):
        self.inner.register(ptr, length, memory)

    def describe(self):
        return self.inner.describe()

    def add_peer(self, description):
        return self.inner.add_peer(description)

    def remove_peer(self, peer):
        self.inner.remove_peer(peer)

    def write(self, peer, src, dst, lengths, src_memory=HOST, dst_memory=HOST):
        self.inner.write(peer, src, dst, lengths, src_memory, dst_memory)
        self.batches.append((src_memory, dst_memory, len(src)))


class _Completion:
    """A stand-in for a CUDA event: `synchronize()` blocks until `signal()`."""

    def __init__(self) -> None:
        self.waited = threading.Event()
        self._done = threading.Event()

    def synchronize(self) -> None:
        self.waited.set()
        self._done.wait(30)

    def signal(self) -> None:
        self._done.set()
