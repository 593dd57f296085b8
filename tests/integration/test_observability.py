"""Observability of a router + prefill + decode cluster.

Metrics: every endpoint's exposition parses with prometheus_client's parser, counters are counters, and
every series SGLang's published Grafana dashboard queries is there, labelled with the model name.

Tracing: OpenTelemetry spans across router → prefill → transfer → decode, received by a real OTLP/HTTP
endpoint in the test (protobuf `ExportTraceServiceRequest`s decoded with opentelemetry-proto): one trace
per request, the client's traceparent at its root, every hop and every queue stage a span in it, and the
prefill's transfer span linked to the decode's request through the TransferInfo."""

from __future__ import annotations

import http.server as httpserver
import threading
import time

import pytest

pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402

from tests.harness.client import http  # noqa: E402

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP traces endpoint: every span received, as dicts."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(httpserver.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                outer.add(req, self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = httpserver.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, req: ExportTraceServiceRequest, path: str) -> None:
        assert path == "/v1/traces", path
        with self.lock:
            for rs in req.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes
                               if a.key == "service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        attrs = {a.key: a.value for a in s.attributes}
                        self.spans.append({
                            "service": service, "name": s.name,
                            "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano, "status": s.status.code,
                            "links": [(x.trace_id.hex(), x.span_id.hex()) for x in s.links],
                            "rid": attrs["pdserve.rid"].string_value if "pdserve.rid" in attrs else None})

    def of_trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture(scope="module")
def collector():
    c = Collector()
    yield c
    c.close()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, module_launcher, collector):
    endpoint = f"http://127.0.0.1:{collector.port}"
    return module_launcher.cluster(tiny_model_dir, backend="fake", prefill=1, decode=1,
                                   router_args=["--enable-trace", "--otlp-traces-endpoint", endpoint],
                                   node_settings={"enable_trace": True, "otlp_traces_endpoint": endpoint})


def wait_for(collector, trace_id, want, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = collector.of_trace(trace_id)
        if want(spans):
            return spans
        time.sleep(0.2)
    raise AssertionError(f"spans of trace {trace_id} never complete: {collector.of_trace(trace_id)}")


def test_one_trace_covers_every_hop_and_stage(cluster, collector):
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    status, _, body = http("POST", cluster.url + "/generate",
                           {"text": "tracing one request", "sampling_params": {"max_new_tokens": 4}},
                           headers=headers, timeout=60)
    assert status == 200, body

    def complete(spans):
        names = {(s["service"], s["name"]) for s in spans}
        return {("pdserve-router", "router /generate"), ("pdserve-prefill", "request"),
                ("pdserve-decode", "request"), ("pdserve-prefill", "inflight"),
                ("pdserve-decode", "decode")} <= names

    spans = wait_for(collector, CLIENT_TRACE, complete)
    by = {(s["service"], s["name"]): s for s in spans}
    root = by["pdserve-router", "router /generate"]
    assert root["parent"] == CLIENT_SPAN  # under the client's span
    for role in ("prefill", "decode"):
        node = by[f"pdserve-{role}", "request"]
        assert node["parent"] == root["id"], (role, node)  # both legs under the router's span
        stages = sorted((s for s in spans if s["service"] == f"pdserve-{role}" and s["name"] != "request"),
                        key=lambda s: s["start"])
        assert stages and all(s["parent"] == node["id"] for s in stages), stages
        # in order
        assert all(a["end"] <= b["start"] + 1000 for a, b in zip(stages, stages[1:], strict=False))
        assert node["start"] <= stages[0]["start"] and stages[-1]["end"] <= node["end"] + 50_000_000
    prefill_stages = [s["name"] for s in sorted((s for s in spans if s["service"] == "pdserve-prefill"
                                                 and s["name"] != "request"), key=lambda s: s["start"])]
    decode_stages = [s["name"] for s in sorted((s for s in spans if s["service"] == "pdserve-decode"
                                                and s["name"] != "request"), key=lambda s: s["start"])]
    assert prefill_stages[-3:] == ["waiting", "prefill", "inflight"], prefill_stages
    assert "bootstrap" in prefill_stages
    assert decode_stages[-4:] == ["prealloc", "transfer", "waiting", "decode"], decode_stages
    assert all(s["status"] != 2 for s in spans)  # no error anywhere
    # the decode's TransferInfo carried its request's trace context: the prefill's transfer span links to it
    assert by["pdserve-prefill", "inflight"]["links"] == [(CLIENT_TRACE,
                                                           by["pdserve-decode", "request"]["id"])]


def test_a_failed_request_is_an_error_span(cluster, collector):
    trace = "5" * 32
    status, _, _ = http("POST", cluster.url + "/generate",
                        {"input_ids": [10**9], "sampling_params": {"max_new_tokens": 2}},
                        headers={"traceparent": f"00-{trace}-{'1' * 16}-01"}, timeout=60)
    assert status == 400
    spans = wait_for(collector, trace, lambda s: any(x["service"] == "pdserve-router" for x in s))
    router = next(s for s in spans if s["service"] == "pdserve-router")
    assert router["parent"] == "1" * 16


def test_tracing_flags_are_checked(tiny_model_dir):
    from common.config import ConfigError, ServerArgs

    with pytest.raises(ConfigError, match="--otlp-traces-endpoint: is refused without --enable-trace"):
        ServerArgs(model=tiny_model_dir, otlp_traces_endpoint="localhost:4318").validate()
    with pytest.raises(ConfigError, match="--otlp-traces-endpoint: must be HOST:PORT or an http"):
        ServerArgs(model=tiny_model_dir, enable_trace=True, otlp_traces_endpoint="ftp://x").validate()


# the series SGLang's Grafana dashboard (examples/monitoring/grafana/dashboards/json/sglang-dashboard.json)
# queries: histograms by `le`, gauges by instance, the model picked by the `model_name` label
DASHBOARD_SERIES = ["sglang:e2e_request_latency_seconds_bucket", "sglang:e2e_request_latency_seconds_sum",
                    "sglang:e2e_request_latency_seconds_count", "sglang:time_to_first_token_seconds_bucket",
                    "sglang:time_to_first_token_seconds_sum", "sglang:time_to_first_token_seconds_count",
                    "sglang:num_running_reqs", "sglang:gen_throughput", "sglang:cache_hit_rate",
                    "sglang:num_queue_reqs"]


def scrape(url):
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, body = http("GET", url + "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    return list(text_string_to_metric_families(body.decode()))


def test_every_endpoint_exposes_parseable_typed_metrics(cluster):
    status, _, body = http("POST", cluster.url + "/generate", {"text": "metrics", "sampling_params":
                                                              {"max_new_tokens": 3}}, timeout=60)
    assert status == 200, body
    for node in cluster.nodes:
        families = {f.name: f for f in scrape(node.url)}
        samples = {s.name for f in families.values() for s in f.samples}
        missing = [n for n in DASHBOARD_SERIES if n not in samples]
        assert not missing, (node.name, missing)
        models = {s.labels.get("model_name") for f in families.values() for s in f.samples}
        assert len(models) == 1 and None not in models and "" not in models, models
        for name, f in families.items():  # a counter is a counter: its samples end in _total (or _created)
            if f.type == "counter":
                assert all(s.name in (name + "_total", name + "_created") for s in f.samples), name
        assert families["pdserve_kv_transfer_bytes"].type == "counter"
        assert families["pdserve_kv_transfer_failures"].type == "counter"
        causes = {s.labels["cause"] for s in families["pdserve_kv_transfer_failures"].samples}
        assert causes == {"bootstrap", "transfer"}
        assert families["pdserve_kv_transfer_latency_seconds"].type == "histogram"
        queues = {s.labels["queue"] for s in families["pdserve_queue_reqs"].samples}
        want = {"bootstrap", "waiting", "inflight"} if node.role == "prefill" \
            else {"prealloc", "transfer", "waiting"}
        assert want <= queues, (node.name, queues)
    families = {f.name: f for f in scrape(cluster.url)}
    assert families["smg_http_requests"].type == "counter"
    assert families["smg_http_request_duration_seconds"].type == "histogram"
    health = {s.labels["worker"]: s.value for s in families["smg_worker_health"].samples}
    assert health == {n.url: 1.0 for n in cluster.nodes}
    assert all(f.documentation for f in families.values())  # HELP on every family


def test_dashboard_in_a_real_browser_lists_the_workers_and_follows_the_traffic(cluster):
    """The router's /dashboard in headless Chromium (Debian's, driven by Selenium): every worker is listed
    with its health and stage queues, and the request count and TTFT change as requests flow."""
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.common.by import By

    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not browser or not driver:
        pytest.skip("no chromium / chromedriver (Debian packages chromium, chromium-driver; make setup "
                    "installs them)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    from selenium.webdriver.chrome.service import Service

    page = webdriver.Chrome(options=opts, service=Service(driver))
    try:
        page.get(cluster.url + "/dashboard")

        def text(id_):
            return page.find_element(By.ID, id_).text

        def until(cond, what, timeout=30.0):
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if cond():
                    return
                time.sleep(0.2)
            raise AssertionError(f"dashboard: {what}; page says "
                                 f"{page.find_element(By.TAG_NAME, 'body').text!r}")

        until(lambda: len(page.find_elements(By.CSS_SELECTOR, "#workers tr"))
              == len(cluster.nodes), "worker rows")
        rows = {r.get_attribute("data-url"): r.text
                for r in page.find_elements(By.CSS_SELECTOR, "#workers tr")}
        assert set(rows) == {n.url for n in cluster.nodes}
        for node in cluster.nodes:
            assert "healthy" in rows[node.url] and "closed" in rows[node.url], rows[node.url]
        assert "prealloc" in rows[cluster.decodes[0].url] and "bootstrap" in rows[cluster.prefills[0].url]
        before = int(text("req-total"))
        for _ in range(3):
            status, _, body = http("POST", cluster.url + "/generate", {
                "text": "dashboard", "stream": True, "sampling_params": {"max_new_tokens": 4}}, timeout=60)
            assert status == 200, body
        until(lambda: int(text("req-total")) >= before + 3, "request count")
        until(lambda: text("ttft").split(" / ")[0] not in ("-", ""), "TTFT")
    finally:
        page.quit()
