"""Silent and full workers. Silent (router/liveness.py): a worker that answers nothing for
--worker-silence-timeout-secs leaves
rotation and the requests it holds are cut off and run again elsewhere, non-streaming ones included; it comes
back once it answers again. The decision rule on made-up times, then through a real router and recording
workers (a worker whose health endpoint stops answering is a host cut off, as the router sees it). Full
(router/capacity.py): the decode choice skips a decode with no preallocation row or KV left, and answers 429
when every decode is full."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

from router.liveness import SilenceWatch
from tests.harness.client import get_json, metric_total, wait_until


def test_a_worker_silent_for_the_window_leaves_rotation_and_comes_back_when_it_answers():
    cut = []
    metrics = SimpleNamespace(silent_workers=0)
    watch = SilenceWatch(None, None, window=4.0, on_silent=cut.append, metrics=metrics)
    w = SimpleNamespace(url="http://w", healthy=True)
    watch.observe(w, 200, 0.0)
    watch.observe(w, None, 2.0)
    watch.observe(w, None, 3.9)
    assert w.healthy and not cut  # silent for 3.9 s < 4 s
    watch.observe(w, None, 4.0)
    assert not w.healthy and cut == [w] and metrics.silent_workers == 1
    watch.observe(w, None, 9.0)
    assert cut == [w]  # declared once
    watch.observe(w, 503, 10.0)
    assert not w.healthy  # it answers, but not as healthy: the health checks decide
    watch.observe(w, 200, 11.0)
    assert w.healthy and watch.silenced == set()
    watch.observe(w, None, 14.0)
    assert w.healthy  # silent for 3 s since its last answer


def test_an_unhealthy_worker_the_watch_did_not_silence_is_not_readmitted_by_it():
    watch = SilenceWatch(None, None, window=4.0)
    w = SimpleNamespace(url="http://w", healthy=False)  # the health checks took it out
    watch.observe(w, 200, 0.0)
    assert not w.healthy


def _worker(router, url):
    return next(w for w in get_json(router.url + "/workers")["workers"] if w["url"] == url)


def test_a_non_streaming_request_on_a_silent_decode_runs_again_on_the_other(workers, make_router):
    p, (d0, d1) = workers["p"][0], workers["d"]
    r = make_router([p], [d0, d1], "--policy", "round_robin", "--worker-silence-timeout-secs", "1")
    d0.config(hold=-1)
    d1.config(hold=-1)
    out = {}
    t = threading.Thread(target=lambda: out.update(res=r.post("/generate", {"text": "hi"})))
    t.start()
    wait_until(lambda: d0.requests() or d1.requests(), what="the decode leg at a worker")
    held, other = (d0, d1) if d0.requests() else (d1, d0)
    other.config(hold=0)
    held.config(silent=True)  # its host is cut off: nothing answers, the held leg never will
    t.join(30)
    assert not t.is_alive(), "the request still waits on the silent worker"
    status, _, body = out["res"]
    assert status == 200 and json.loads(body)["meta_info"]["worker"] == f"decode:{other.port}", body
    assert metric_total(r.url, "pdserve_router_silent_workers_total") == 1
    assert not _worker(r, held.url)["is_healthy"]
    held.config(silent=False, hold=0)
    wait_until(lambda: _worker(r, held.url)["is_healthy"], 20, "the worker back in rotation")
    assert r.post("/generate", {"text": "again"})[0] == 200


# ---------------------------------------------------------------------------------------------- capacity
def test_the_decode_choice_skips_full_decodes_and_answers_429_when_every_one_is_full(workers, make_router):
    """Decode capacity (router/capacity.py): a decode that reports no free preallocation row gets no request
    while another has room, and when none has room the router answers 429 with Retry-After before sending
    any leg (no prefill work queued for a decode that cannot take it)."""
    p, (d0, d1) = workers["p"][0], workers["d"]
    d0.config(prealloc_free=0)
    d1.config(prealloc_free=64)
    r = make_router([p], [d0, d1], "--policy", "round_robin", "--load-check-interval-secs", "0.2")
    time.sleep(1.0)  # a few capacity polls
    for _ in range(6):
        assert r.post("/generate", {"text": "x"})[0] == 200
    assert not d0.requests() and len(d1.requests()) == 6
    d1.config(prealloc_free=0)
    time.sleep(1.0)  # a few capacity polls
    sent = len(p.requests())
    status, headers, body = r.post("/generate", {"text": "x"})
    assert status == 429 and headers.get("retry-after") == "1" \
        and b"every decode worker is full" in body, body
    assert len(p.requests()) == sent  # no prefill leg for a request no decode can take
    assert metric_total(r.url, "pdserve_router_decodes_full_answers_total") == 1
    d1.config(prealloc_free=8)
    wait_until(lambda: r.post("/generate", {"text": "x"})[0] == 200, 10, "the decode's room seen again")


def test_a_capacity_report_is_checked_and_summed_over_dp_groups():
    from router.capacity import DecodeCapacity, Report, parse_report

    g = {"prealloc_slots_free": 3, "num_prealloc_reqs": 1, "kv_available_tokens": 100}
    assert parse_report([g, g]) == Report(6, 2, 200)
    for bad in ([], [{"prealloc_slots_free": -1, "kv_available_tokens": 1}], [{"kv_available_tokens": 5}],
                [{"prealloc_slots_free": True, "kv_available_tokens": 5}], {"a": 1}, [3]):
        assert parse_report(bad) is None, bad
    cap = DecodeCapacity(None, None, 1.0, 1.0)
    w = SimpleNamespace(url="http://d", active=3)
    assert not cap.full(w)  # nothing reported: not full
    cap.observe(w, Report(2, 0, 100))  # it held 3 of this router's requests then
    w.active = 4
    assert not cap.full(w)
    w.active = 5
    assert cap.full(w)  # the two sent since its report took both rows
    w.active = 3
    assert not cap.full(w)  # they ended: their rows are back
    cap.observe(w, Report(2, 2, 100))
    assert cap.full(w)  # two requests already wait there for a row
    cap.observe(w, Report(5, 0, 0))
    assert cap.full(w)  # no KV token left
