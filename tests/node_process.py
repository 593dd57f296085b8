"""Start a real node (`launch_server`, i.e. what `pdserve serve` runs) as a subprocess on 127.0.0.1.

    with NodeProcess(model_dir, max_total_tokens=2048) as node:
        requests go to node.url

The node runs in its own process group; its log goes to a file whose tail is shown when it fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = (
    "import json, sys\n"
    "from common.config import ServerArgs\n"
    "from common.server.launch import launch_server\n"
    "args = ServerArgs(**json.loads(sys.argv[1]))\n"
    "args.validate()\n"
    "launch_server(args)\n"
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, headers: dict | None = None, timeout: float = 30.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post(url: str, body: bytes | dict | list | str, headers: dict | None = None,
              timeout: float = 120.0) -> tuple[int, bytes]:
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=body, headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class NodeProcess:
    def __init__(self, model: str, *, startup_timeout: float = 300.0, env: dict | None = None, **settings):
        self.port = settings.pop("port", None) or free_port()
        self.settings = {"model": model, "host": "127.0.0.1", "port": self.port, "log_level": "info",
                         **settings}
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.log_path = tempfile.mkstemp(prefix="pdserve-node-", suffix=".log")[1]
        self.proc: subprocess.Popen | None = None

    def start(self) -> NodeProcess:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", _SCRIPT, json.dumps(self.settings)], cwd=ROOT,
                                     env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited with code {self.proc.returncode} during start-up:\n{self.log_tail()}")
            try:
                status, _ = http_get(self.url + "/health", timeout=2)
                if status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"node not healthy after {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def log_text(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait for a clean exit (returns the exit code); SIGKILL the group if it hangs."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        try:  # scheduler children left behind by a crash: same process group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.returncode

    def __enter__(self) -> NodeProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
