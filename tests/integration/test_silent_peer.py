"""A peer that stops answering without closing its connections (a host cut off, a frozen process) must not
hold streams open: nodes send an SSE keep-alive comment while a stream has nothing to say
(--stream-keepalive-secs), and the router fails a decode stream that stays silent past
--stream-idle-timeout-secs — the client gets an error event, both legs are aborted, and once the peer
answers again its pools come back. A frozen process (SIGSTOP) is the silent peer here."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from urllib.parse import urlparse

import pytest

from tests.harness.client import http_json, stream, wait_until
from tests.harness.cluster import NODE_SETTINGS, cluster_pools, wait_pools

LONG = {"max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, module_launcher):
    settings = {**NODE_SETTINGS, "stream_keepalive_secs": 0.5}
    c = module_launcher.cluster(tiny_model_dir, backend="fake", prefill=1, decode=2, node_settings=settings,
                                router_args=["--stream-idle-timeout-secs", "3"])
    c.baseline = cluster_pools(c)
    return c


def raw_events(url: str, body: dict, n_data: int) -> list[str]:
    """The first lines of an SSE answer up to its n-th data event (comments included)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", u.path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    lines = []
    while sum(x.startswith("data:") for x in lines) < n_data:
        line = resp.readline().decode().strip()
        if line:
            lines.append(line)
    conn.close()
    return lines


def test_a_stream_waiting_in_a_queue_sends_keepalives(tiny_model_dir, module_launcher):
    node = module_launcher.colocated(tiny_model_dir, **{**NODE_SETTINGS, "max_running_requests": 1,
                                                        "stream_keepalive_secs": 0.2})
    # the first runs alone in the one running slot; 2000 tokens outlast the keep-alive interval many times
    # over even where the tiny model decodes 1500 tokens a second
    first = threading.Thread(target=stream, args=(node.url + "/v1/completions",
                                                  {"prompt": "a", **LONG, "max_tokens": 2000}))
    first.start()
    wait_until(lambda: node.stats()["num_running_reqs"] == 1, what="the first request running")
    lines = raw_events(node.url + "/generate", {"text": "b", "stream": True,
                                                "sampling_params": {"max_new_tokens": 2}}, 1)
    first.join()
    assert lines[0] == ": keep-alive", lines[:3]  # the second request waited behind the first


def test_a_frozen_decode_node_ends_its_stream_and_recovers(cluster):
    results = []
    t = threading.Thread(target=lambda: results.append(stream(cluster.url + "/v1/completions",
                                                              {"prompt": "x", **LONG},
                                                              on_event=lambda i, e: started.set())))
    started = threading.Event()
    t.start()
    assert started.wait(60)
    busy = wait_until(lambda: [d for d in cluster.decodes
                               if http_json("GET", d.url + "/server_info")[1]["stats"]["num_running_reqs"]],
                      what="a decode node running the stream")[0]
    os.kill(busy.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        t.join(30)
        assert not t.is_alive(), "the stream is still open"
        res = results[0]
        assert "sent nothing for 3s" in res.error, res.error
        assert time.monotonic() - t0 < 15
        # new streams still get answers: one sent to the frozen node is retried on the other after the idle
        # timeout (nothing reached the client yet), until health checks take the frozen node out
        for _ in range(2):
            res = stream(cluster.url + "/v1/completions", {"prompt": "y", "max_tokens": 4, "stream": True})
            assert res.ok, res.error
    finally:
        os.kill(busy.proc.pid, signal.SIGCONT)
    wait_pools(cluster, cluster.baseline)  # the abort reached the node once it answered again
