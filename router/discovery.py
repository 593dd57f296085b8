"""`--service-discovery`: the router follows the prefill and decode pods of a Kubernetes cluster.

sglang-router's flags and meaning: `--prefill-selector` / `--decode-selector` (label `key=value` pairs)
pick the pods, `--service-discovery-port` is the port their HTTP server listens on, and
`--service-discovery-namespace` limits the watch to one namespace (otherwise every namespace, which
needs cluster-wide read access to pods). A prefill pod's bootstrap port is its `sglang.ai/bootstrap-port`
annotation (else the one its /server_info reports).

For each selector a thread lists the pods and then watches them from that list's resourceVersion (the
Kubernetes list+watch protocol, through the official `kubernetes` client: in-cluster credentials in a
pod, else the kubeconfig). A pod that is Running, Ready and not being deleted joins the registry as
`http://POD_IP:PORT` through the same path as `POST /workers` (its /health must pass first); one that
stops being so, or goes away, leaves it as `DELETE /workers` would. Every list re-reads the whole set,
so a pod that vanished while the watch was down is removed too. Values from the API server are checked
like any wire input: the registry checks the URL, the annotation must be a port number.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from router.registry import DECODE, PREFILL, RegistryError

log = logging.getLogger("router.discovery")

BOOTSTRAP_PORT_ANNOTATION = "sglang.ai/bootstrap-port"
WATCH_SECONDS = 60  # a watch is renewed this often (from a fresh list)


def parse_selector(pairs: list[str] | None, flag: str) -> str:
    """`["app=x", "role=prefill"]` -> "app=x,role=prefill" (a Kubernetes label selector)."""
    out = []
    for p in pairs or []:
        key, sep, value = p.partition("=")
        if not sep or not key or "," in p:
            raise ValueError(f"{flag} takes key=value pairs, got {p!r}")
        out.append(f"{key}={value}")
    return ",".join(out)


def _ready(pod) -> bool:
    status = pod.status
    if status is None or pod.metadata.deletion_timestamp is not None or status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def _bootstrap_port(pod) -> int | None:
    value = (pod.metadata.annotations or {}).get(BOOTSTRAP_PORT_ANNOTATION)
    if value is None:
        return None
    if value.isdigit() and 1 <= int(value) <= 65535:
        return int(value)
    log.warning("pod %s: annotation %s=%r is not a port; using the one its /server_info reports",
                pod.metadata.name, BOOTSTRAP_PORT_ANNOTATION, value[:32])
    return None


class PodWatcher:
    def __init__(self, cfg, registry, loop: asyncio.AbstractEventLoop) -> None:
        self.cfg, self.registry, self.loop = cfg, registry, loop
        self.selectors = {PREFILL: cfg.prefill_selector, DECODE: cfg.decode_selector}
        self.known: dict[str, tuple[str, str]] = {}  # namespace/name -> (kind, url)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.api = client.CoreV1Api()
        for kind, selector in self.selectors.items():
            t = threading.Thread(target=self._run, args=(kind, selector),
                                 name=f"discovery-{kind}", daemon=True)
            t.start()
            self._threads.append(t)
        where = self.cfg.service_discovery_namespace or "every namespace"
        log.info("service discovery: prefill pods %r, decode pods %r in %s, port %d", self.selectors[PREFILL],
                 self.selectors[DECODE], where, self.cfg.service_discovery_port)

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------------------ the watch
    def _calls(self):
        ns = self.cfg.service_discovery_namespace
        if ns:
            return self.api.list_namespaced_pod, (ns,)
        return self.api.list_pod_for_all_namespaces, ()

    def _run(self, kind: str, selector: str) -> None:
        from kubernetes import watch

        backoff = 1.0
        while not self._stop.is_set():
            try:
                fn, args = self._calls()
                pods = fn(*args, label_selector=selector)
                self._reconcile(kind, pods.items)
                w = watch.Watch()
                for event in w.stream(fn, *args, label_selector=selector,
                                      resource_version=pods.metadata.resource_version,
                                      timeout_seconds=WATCH_SECONDS):
                    if self._stop.is_set():
                        w.stop()
                        return
                    self._on_event(kind, event.get("type"), event.get("object"))
                backoff = 1.0
            except Exception as e:  # the API server is away or refuses: try again, never die
                log.warning("service discovery (%s pods): %s; again in %.0f s", kind, e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _reconcile(self, kind: str, pods) -> None:
        present = {}
        for pod in pods:
            if _ready(pod):
                present[f"{pod.metadata.namespace}/{pod.metadata.name}"] = pod
        with self._lock:
            gone = [k for k, (kd, _) in self.known.items() if kd == kind and k not in present]
        for key in gone:
            self._drop(key)
        for pod in present.values():
            self._on_event(kind, "ADDED", pod)

    def _on_event(self, kind: str, type_: str | None, pod) -> None:
        if pod is None or getattr(pod, "metadata", None) is None:
            return
        key = f"{pod.metadata.namespace}/{pod.metadata.name}"
        if type_ == "DELETED" or not _ready(pod):
            self._drop(key)
            return
        ip = pod.status.pod_ip
        if not ip:
            return
        host = f"[{ip}]" if ":" in ip else ip
        url = f"http://{host}:{self.cfg.service_discovery_port}"
        with self._lock:
            if key in self.known:
                return
            self.known[key] = (kind, url)
        log.info("service discovery: %s pod %s is ready at %s", kind, key, url)
        self._submit(self._add(key, kind, url, _bootstrap_port(pod)))

    def _drop(self, key: str) -> None:
        with self._lock:
            entry = self.known.pop(key, None)
        if entry is not None:
            log.info("service discovery: pod %s (%s) is gone or not ready", key, entry[1])
            self._submit(self._remove(entry[1]))

    def _submit(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _add(self, key: str, kind: str, url: str, port: int | None) -> None:
        try:
            await self.registry.add(url, kind, port)
        except RegistryError as e:
            if e.status != 409:  # 409: already registered (by its flag, or an earlier event)
                log.error("service discovery: pod %s at %s not registered: %s", key, url, e)
                with self._lock:
                    if self.known.get(key) == (kind, url):
                        self.known.pop(key)  # the next list tries again

    async def _remove(self, url: str) -> None:
        try:
            self.registry.remove(url)
        except RegistryError:
            pass  # never registered (its /health never passed), or removed by hand

