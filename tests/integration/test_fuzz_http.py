"""HTTP fuzzing of every route of a node and of the router, from their own `GET /openapi.json`
(schemathesis generates schema-valid and schema-invalid requests from the msgspec request structs).

Properties, for every generated request:
* no 5xx (503 only where documented: probes that report an unhealthy peer, and `POST /workers` for a
  worker that never answers /health);
* every 4xx is OpenAI's error shape with `code` equal to the status, and a 400 names what was wrong
  (a field in backticks or the request body);
* afterwards the server still answers a normal request.

The node is a real colocated node (tiny random model) with all three keys set; the fuzzer sends the
node key, which a node accepts on every route. The router sits in front of recording workers
(tests/router/workers.py) and gets the admin key on admin routes and the client key elsewhere.
Worker URLs in `POST /workers` bodies are pointed at 127.0.0.1 before sending, so the router never
reaches past this machine.

Budget: `PDSERVE_FUZZ_EXAMPLES` examples per route and mode (default 4) within
`PDSERVE_FUZZ_SECONDS` per target (default 50); the seed is fixed (derandomized). A longer run:
`PDSERVE_FUZZ_EXAMPLES=200 PDSERVE_FUZZ_SECONDS=1800 pytest tests/integration/test_fuzz_http.py`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from tests.harness.client import free_port, http_get, http_post  # noqa: E402
from tests.harness.nodes import NodeProcess, RouterProcess, ServerProcess, start_together  # noqa: E402
from tests.integration.test_trust_edge import key_env  # noqa: E402

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "4"))
SECONDS = float(os.environ.get("PDSERVE_FUZZ_SECONDS", "35"))
KEYS = {"client": "fuzz-client-3b9d", "admin": "fuzz-admin-3b9d", "node": "fuzz-node-3b9d"}
PROBES_503 = {"/readiness", "/health_generate", "/health"}
NAMES_SOMETHING = re.compile(r"`[^`]+`|request body|JSON")
WORKERS_SCRIPT = Path(__file__).resolve().parents[1] / "router" / "workers.py"

pytestmark = pytest.mark.timeout(600)


class RecordingWorker(ServerProcess):
    """tests/router/workers.py: answers every node route the router calls, instantly."""

    def __init__(self, role: str, log_path: Path, bootstrap_port: int | None = None):
        super().__init__(role, log_path=log_path)
        self.role, self.bootstrap_port = role, bootstrap_port

    def command(self) -> list[str]:
        cmd = [sys.executable, str(WORKERS_SCRIPT), "--port", str(self.port), "--role",
               self.role, "--no-record"]
        return cmd + (["--bootstrap-port", str(self.bootstrap_port)] if self.bootstrap_port else [])


def _loopback_worker_urls(case) -> None:
    """Keep the router's registration probes on this machine: any worker URL goes to 127.0.0.1:9."""
    body = case.body
    if isinstance(body, dict) and isinstance(body.get("url"), str):
        try:
            host = urlsplit(body["url"]).hostname
        except ValueError:
            host = None
        if host not in (None, "127.0.0.1", "localhost"):
            body["url"] = "http://127.0.0.1:9"


def _problem(case, resp) -> str | None:
    status, path = resp.status_code, case.operation.path
    where = (f"{case.method} {case.formatted_path} body={str(case.body)[:300]!r} -> {status} "
             f"{resp.text[:300]!r}")
    if status >= 500:
        documented = status == 503 and (path in PROBES_503 or (case.method == "POST" and path == "/workers"))
        return None if documented else "server error: " + where
    if status >= 400:
        try:
            err = resp.json()["error"]
            ok = isinstance(err["code"], str | None) and "param" in err and isinstance(err["message"], str) \
                and isinstance(err["type"], str)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            return "4xx not in OpenAI's error shape: " + where
        if status == 400 and not NAMES_SOMETHING.search(err["message"]):
            return "400 names no field: " + where
    return None


def fuzz(base_url: str, token_for, prepare=None) -> tuple[list[str], dict[str, int]]:
    """Fuzz every operation of the server's own OpenAPI document; (problems, count of each status)."""
    status, raw = http_get(base_url + "/openapi.json")
    assert status == 200, raw
    schema = schemathesis.openapi.from_dict(json.loads(raw))
    deadline = time.monotonic() + SECONDS
    problems: list[str] = []
    seen: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                if time.monotonic() > deadline or len(problems) >= 20:
                    return
                if prepare is not None:
                    prepare(case)
                case.headers = {**(case.headers or {}),
                                "Authorization": f"Bearer {token_for(case.operation.path)}"}
                resp = case.call(base_url=base_url, timeout=60)
                seen[str(resp.status_code)] = seen.get(str(resp.status_code), 0) + 1
                p = _problem(case, resp)
                if p is not None and p not in problems:
                    problems.append(p)

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid in a route without inputs
                pass
    return problems, seen


def test_fuzz_node(tiny_model_dir, tmp_path):
    env = key_env(tmp_path, KEYS)
    node = NodeProcess(tiny_model_dir, env=env, log_path=tmp_path / "node.log", context_length=128,
                       max_total_tokens=4096, max_running_requests=8, num_threads=1)
    with node:
        problems, seen = fuzz(node.url, lambda path: KEYS["node"])
        print(f"fuzzed: statuses {seen}")
        assert not problems, "\n".join(problems)
        assert sum(seen.values()) > 50 and "200" in seen and "400" in seen, seen
        auth = {"Authorization": f"Bearer {KEYS['client']}"}
        status, body = http_post(node.url + "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, auth)
        assert status == 200, body
        log = node.log_text()
    assert "Traceback" not in log and "status=500" not in log
    assert not any(k in log for k in KEYS.values())


def test_fuzz_router(tmp_path):
    env = key_env(tmp_path, KEYS)
    prefill = RecordingWorker("prefill", tmp_path / "p.log", bootstrap_port=free_port())
    decode = RecordingWorker("decode", tmp_path / "d.log")
    start_together([prefill, decode])
    router = RouterProcess([prefill], [decode], "--policy", "round_robin",
                           "--worker-startup-timeout-secs", "0.5",
                           "--worker-startup-check-interval", "0.1", "--retry-initial-backoff-ms", "1",
                           env=env, log_path=tmp_path / "router.log")
    try:
        router.start()
        admin = {"/workers", "/workers/{id}", "/flush_cache"}
        problems, seen = fuzz(router.url, lambda path: KEYS["admin"] if path in admin else KEYS["client"],
                              prepare=_loopback_worker_urls)
        print(f"fuzzed: statuses {seen}")
        assert not problems, "\n".join(problems)
        assert sum(seen.values()) > 50 and "200" in seen and "400" in seen, seen
        status, body = http_post(router.url + "/generate", {"text": "hi"},
                                 {"Authorization": f"Bearer {KEYS['client']}"})
        assert status == 200, body
        log = router.log_text()
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
    assert "Traceback" not in log and not any(k in log for k in KEYS.values())
