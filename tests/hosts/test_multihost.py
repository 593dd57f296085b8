"""The cluster across hosts: router, prefill and decode nodes each in a network namespace of its own (own
address, joined by a bridge; deploy/netns.py), each listening on its own address only. Through the
router, greedy answers equal a colocated node's (2 prefill + 2 decode hosts on mooncake over TCP, and on ucx
with a TP-2 host among them: prompts across chunk and page boundaries, a shared prefix through the
prefill radix cache, streamed and chat answers), faults on the links keep them exact, and a partition of the
decode host mid-stream ends the stream with an error within the
router's idle window, after which the healed host frees what it held."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from deploy.netns import Hosts, usable
from tests.harness.backends import backend_params
from tests.harness.client import http_json, stream
from tests.harness.cluster import CHUNK, NODE_SETTINGS, PAGE_SIZE, ROUTER_ARGS, cluster_pools, wait_pools
from tests.harness.nodes import RoleNode, RouterProcess, free_port, start_together, stop_all

why = usable()
pytestmark = pytest.mark.skipif(why is not None, reason=why or "")

PROMPTS = ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", "Hello"]


class HostCluster:
    """A router on host 0, then `prefill` prefill hosts and `decode` decode hosts."""

    def __init__(self, model: str, log_dir, net: int, backend: str, prefill: int, decode: int,
                 router_args: list[str] = (), env: dict | None = None, settings: dict | None = None,
                 tp: dict[str, int] | None = None):
        """`tp` gives a node (by name, e.g. "prefill-0") its TP size; the others run TP 1."""
        self.hosts = Hosts(1 + prefill + decode, net)
        self.nodes: list[RoleNode] = []
        try:
            for k in range(prefill + decode):
                role = "prefill" if k < prefill else "decode"
                extra = {"disaggregation_bootstrap_port": free_port()} if role == "prefill" else {}
                self.nodes.append(RoleNode(role, model, name=f"{role}-{k}", netns=self.hosts.names[k + 1],
                                           host=self.hosts.addrs[k + 1], transfer_backend=backend, env=env,
                                           log_path=log_dir / f"{net}-{role}-{k}.log",
                                           tp=(tp or {}).get(f"{role}-{k}", 1),
                                           **{**NODE_SETTINGS, **(settings or {})}, **extra))
            self.router = RouterProcess([n for n in self.nodes if n.role == "prefill"],
                                        [n for n in self.nodes if n.role == "decode"],
                                        *ROUTER_ARGS, *router_args,
                                        netns=self.hosts.names[0], host=self.hosts.addrs[0],
                                        log_path=log_dir / f"{net}-router.log")
            start_together(self.nodes)
            start_together([self.router])
            self.url = self.router.url
            self.baseline = cluster_pools(self)
        except BaseException:
            self.close()
            raise

    def child(self, name: str):
        return next(n for n in self.nodes if n.name == name)

    def close(self) -> None:
        stop_all([s for s in (getattr(self, "router", None), *self.nodes) if s is not None])
        self.hosts.close()
        assert not self.hosts.left_behind(), self.hosts.left_behind()


@pytest.fixture(scope="module")
def colocated(tiny_model_dir, module_launcher):
    return module_launcher.colocated(tiny_model_dir, **NODE_SETTINGS)


@pytest.fixture(scope="module")
def mooncake_hosts(tiny_model_dir, tmp_path_factory):
    c = HostCluster(tiny_model_dir, tmp_path_factory.mktemp("hosts"), 1, "mooncake", 2, 2,
                    env={"PDSERVE_TRANSFER_PROTOCOL": "tcp"},
                    router_args=["--health-check-timeout-secs", "2", "--worker-connect-timeout-secs", "3"])
    yield c
    c.close()


# ucx: one prefill host and two decode hosts, one of them TP 2 (1 -> 2 and 1 -> 1); the engine keeps to its
# host's interface (transfer/engine.py). nixl across hosts runs in `pdserve bench netfaults` (`--prefill-tp 2`
# for a TP-2 prefill host), to keep make test within its budget
LAYOUTS = {"ucx": {"decode-2": 2}}


@pytest.fixture(scope="module", params=backend_params(*LAYOUTS))
def ucx_family_hosts(request, tiny_model_dir, tmp_path_factory):
    c = HostCluster(tiny_model_dir, tmp_path_factory.mktemp("hosts"), 2, request.param, 1, 2,
                    tp=LAYOUTS[request.param])
    yield c
    c.close()


@pytest.fixture(scope="module")
def fake_hosts(tiny_model_dir, tmp_path_factory):
    """`pdserve cluster --hosts`: the launcher's own multi-host cluster (fake backend)."""
    from deploy.cluster_cli import cluster_from_args

    c = cluster_from_args(["--hosts", "--prefill", "1", "--decode", "1", "--transfer-backend", "fake",
                           "--model", tiny_model_dir, "--log-dir", str(tmp_path_factory.mktemp("launcher")),
                           "--page-size", "16", "--max-total-tokens", "8192", "--num-threads", "1",
                           "--stream-keepalive-secs", "0.5", "--router-args",
                           "--stream-idle-timeout-secs 3 --worker-silence-timeout-secs 4"])
    c.quiet = True
    try:
        c.start()
        c.hosts = c.net
        assert c.router.url.startswith("http://10.77.") and len({x.netns for x in c.children}) == 3
        c.baseline = cluster_pools(c)
        yield c
    finally:
        net = c.net
        c.stop()
        assert net is None or not net.left_behind()


def greedy(url: str, prompt: str) -> str:
    status, out = http_json("POST", url + "/v1/completions",
                            {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                              "ignore_eos": True})
    assert status == 200, out
    return out["choices"][0]["text"]


def test_answers_across_hosts_equal_a_colocated_node(mooncake_hosts, colocated):
    for _ in range(2):  # round robin: every prefill and decode host serves
        for p in PROMPTS:
            assert greedy(mooncake_hosts.url, p) == greedy(colocated.url, p), p
    for n in mooncake_hosts.nodes:  # each decode met the prefill hosts at their own addresses
        assert n.role == "prefill" or "bootstrap 10.77.1." in n.log_path.read_text(), n.name
    wait_pools(mooncake_hosts, mooncake_hosts.baseline)


def id_prompts() -> list[list[int]]:
    """Token-id prompts within one chunk, across chunk and page boundaries, and two sharing a 4-page prefix
    (the second takes it from the prefill host's radix cache)."""
    out = [[200 + (31 * n + 7 * j) % 15000 for j in range(n)]
           for n in (5, CHUNK + 8, 3 * CHUNK + PAGE_SIZE + 1, 300)]
    shared = [500 + (13 * j) % 9000 for j in range(4 * PAGE_SIZE)]
    return out + [shared + [42, 43, 44], shared + [7000 + j for j in range(CHUNK + 3)]]


def generate(url: str, ids: list[int], streamed: bool = False) -> list[int]:
    body = {"input_ids": ids, "stream": streamed,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
    if streamed:
        res = stream(url + "/generate", body)
        assert res.ok, res.error
        return res.events[-1]["output_ids"]  # cumulative in every event, as in SGLang
    status, out = http_json("POST", url + "/generate", body)
    assert status == 200, out
    return out["output_ids"]


def chat(url: str) -> str:
    status, out = http_json("POST", url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 10,
        "temperature": 0, "ignore_eos": True})
    assert status == 200, out
    return out["choices"][0]["message"]["content"]


def test_nixl_and_ucx_across_hosts_with_tp(ucx_family_hosts, colocated):
    c = ucx_family_hosts
    want = [generate(colocated.url, ids) for ids in id_prompts()]
    for _ in range(2):  # round robin: every prompt through both decode hosts
        for ids, w in zip(id_prompts(), want, strict=True):
            assert generate(c.url, ids) == w, len(ids)
        for p in PROMPTS:
            assert greedy(c.url, p) == greedy(colocated.url, p), p
    for ids, w in list(zip(id_prompts(), want, strict=True))[:3]:
        assert generate(c.url, ids, streamed=True) == w, len(ids)
    assert chat(c.url) == chat(colocated.url)
    for n in c.nodes:  # KV really moved, and reached every decode host from the prefill hosts' own addresses
        assert n.stats().get("transfer_successes", 0) > 0 and n.stats().get("transfer_bytes", 0) > 0, n.name
        if n.role == "decode":
            assert "bootstrap 10.77.2." in n.log_path.read_text(), n.name
    wait_pools(c, c.baseline)


@pytest.mark.parametrize("qdisc", ["netem delay 20ms loss 1%", "tbf rate 20mbit burst 64kb latency 500ms"])
def test_answers_stay_exact_over_a_slow_link(mooncake_hosts, colocated, qdisc):
    """20 ms each way and 1 % loss (netem), or a 20 Mbit/s cap (tbf), on both decode hosts' links: the KV
    still arrives whole; the decode nodes report what they received."""
    c = mooncake_hosts
    if not c.hosts.has_qdisc(qdisc):
        pytest.skip(f"this kernel has no {qdisc.split()[0]} qdisc")
    decodes = [k + 1 for k, n in enumerate(c.nodes) if n.role == "decode"]
    before = {n.name: n.stats().get("transfer_bytes", 0) for n in c.nodes if n.role == "decode"}
    t0 = time.monotonic()
    for k in decodes:
        c.hosts.shape(k, qdisc)
    try:
        for p in PROMPTS:
            assert greedy(c.url, p) == greedy(colocated.url, p), p
    finally:
        for k in decodes:
            c.hosts.shape(k, None)
    moved = sum(n.stats().get("transfer_bytes", 0) - before[n.name] for n in c.nodes if n.role == "decode")
    print(f"{qdisc}: {moved} KV bytes in {time.monotonic() - t0:.2f}s over {len(PROMPTS)} requests")
    assert moved > 0
    wait_pools(c, c.baseline)


def test_answers_stay_exact_over_a_lossy_link(mooncake_hosts, colocated):
    """1 % of every decode host's packets lost both ways (nftables, where the kernel has no netem): TCP
    retransmits, the KV arrives whole."""
    c = mooncake_hosts
    if not c.hosts.can_lose():
        pytest.skip("nft cannot add rules here (package nftables, kernel nf_tables)")
    decodes = [k + 1 for k, n in enumerate(c.nodes) if n.role == "decode"]
    for k in decodes:
        c.hosts.lose(k, 1.0)
    try:
        for _ in range(3):
            for p in PROMPTS:
                assert greedy(c.url, p) == greedy(colocated.url, p), p
        lost = sum(c.hosts.lost(k) for k in decodes)
    finally:
        for k in decodes:
            c.hosts.lose(k, None)
    print(f"1 % loss: {lost} packets dropped")
    wait_pools(c, c.baseline)


def test_a_prefill_host_cut_off_from_the_router(mooncake_hosts):
    """The router's packets to one prefill host vanish (the decode hosts still reach it): new connections
    time out, requests on kept-alive ones are cut when its health checks fail, and every request is
    answered by the other prefill host."""
    c = mooncake_hosts
    target = c.child("prefill-0")
    c.hosts.drop(0, target.host)
    t0 = time.monotonic()
    try:
        def one(i: int) -> bool:
            if i % 2:
                return stream(c.url + "/v1/completions",
                              {"prompt": f"p{i}", "max_tokens": 4, "stream": True}).ok
            return bool(greedy(c.url, f"q{i}"))

        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            assert all(ex.map(one, range(6)))
        assert time.monotonic() - t0 < 60
    finally:
        c.hosts.drop(0, target.host, undo=True)
    wait_pools(c, c.baseline)


def test_every_listener_is_on_its_hosts_address(fake_hosts):
    """(Mooncake's engine listens on every interface whatever it is told, a documented exposure: the check
    runs on the fake backend.)"""
    hosts = fake_hosts.hosts
    for i, server in enumerate((fake_hosts.router, *fake_hosts.nodes)):
        listening = hosts.listeners(i)
        assert f"{server.host}:{server.port}" in listening, (server.name, listening)
        # nothing on a wildcard or another address; the ranks' gloo rendezvous of one node stays on loopback
        assert all(a.startswith((server.host + ":", "127.0.0.1:"))
                   for a in listening), (server.name, listening)


def test_a_partitioned_decode_host_ends_its_stream_and_comes_back(fake_hosts):
    results, started = [], threading.Event()
    body = {"prompt": "x", "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    t = threading.Thread(target=lambda: results.append(
        stream(fake_hosts.url + "/v1/completions", body, on_event=lambda i, e: started.set())))
    t.start()
    assert started.wait(60)
    decode = next(n for n in fake_hosts.nodes if n.role == "decode")
    hosts = fake_hosts.hosts
    k = fake_hosts.nodes.index(decode) + 1
    hosts.cut(k)
    t0 = time.monotonic()
    try:
        t.join(30)
        assert not t.is_alive(), "the stream is still open"
        assert "sent nothing for 3s" in results[0].error, results[0].error
        assert time.monotonic() - t0 < 15
    finally:
        hosts.mend(k)
    wait_pools(fake_hosts, fake_hosts.baseline)  # the healed host freed the aborted request
    assert greedy(fake_hosts.url, "again")



def test_a_cut_decode_host_ends_non_streaming_and_streaming_requests_within_the_window(fake_hosts):
    """Non-streaming requests have no keep-alives to miss: the router's silence watch
    (--worker-silence-timeout-secs 4 here) takes the cut decode host out of rotation and cuts off what it
    holds, so every request open on it ends (this cluster has no other decode host to run it again on), and
    the host is back in rotation once its link is mended."""
    url = fake_hosts.url
    long = {"max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    results: list = []
    running = threading.Event()

    def full(i: int):
        results.append(http_json("POST", url + "/v1/completions", {"prompt": f"n{i}", **long}, timeout=60))

    def streamed():
        results.append(stream(url + "/v1/completions", {"prompt": "s", **long, "stream": True},
                              on_event=lambda i, e: running.set()))

    threads = [threading.Thread(target=full, args=(i,)) for i in range(3)] \
        + [threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    assert running.wait(60)
    time.sleep(0.5)  # the non-streaming ones are decoding too
    decode = next(n for n in fake_hosts.nodes if n.role == "decode")
    hosts = fake_hosts.hosts
    k = fake_hosts.nodes.index(decode) + 1
    hosts.cut(k)
    t0 = time.monotonic()
    try:
        for t in threads:
            t.join(max(0.1, 20 - (time.monotonic() - t0)))
        assert not any(t.is_alive() for t in threads), "a request still waits on the cut host"
        assert time.monotonic() - t0 < 15
        statuses = [r[0] for r in results if isinstance(r, tuple)]
        assert len(statuses) == 3 and all(s >= 500 for s in statuses), statuses
        assert any(not r.ok for r in results if not isinstance(r, tuple))
    finally:
        hosts.mend(k)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # re-admitted by the watch once it answers again
        status, _ = http_json("POST", url + "/v1/completions", {"prompt": "back", "max_tokens": 4})
        if status == 200:
            break
        time.sleep(0.5)
    assert status == 200
    wait_pools(fake_hosts, fake_hosts.baseline)
