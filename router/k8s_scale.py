"""Move one pod of capacity between the prefill and the decode pool through the Kubernetes API.

The SLO planner (router/planner.py) decides that a pool needs a pod more and the other can give one;
on Kubernetes `DeploymentScaler.move(from_role, to_role)` carries that out by changing the replica
counts of the two workloads (deploy/k8s: the StatefulSets pdserve-prefill and pdserve-decode) through
their scale subresource, the same call as `kubectl scale`: each is read, then merge-patched with
`{"spec": {"replicas": N}}` and the resourceVersion it was read at, so a count someone else changed in
between (a person, an autoscaler) fails with 409 Conflict instead of being overwritten. StatefulSets
and Deployments are both handled; the kind is told, or found by reading the StatefulSet first and the
Deployment when there is none (then remembered).

Grow, then shrink: the receiving pool is grown before the giving pool is shrunk. The replica total the
cluster is asked for therefore never drops below the old total, and when the second patch fails (the API
server away, a conflict, RBAC) the cluster is left with one pod more than before, never one fewer; the
exception then says which pool was already grown (and, when the API server did not answer, that the
outcome of that call is not known). `move` does not wait for the new pod to become Ready:
on a cluster with no spare room (one GPU node per pod, say) that pod can only be scheduled once the
giving pool's pod has gone, so waiting for it first would never end. The returned `seconds` are those of
the API calls, not of the pods starting.

The router's service discovery (`--service-discovery` with `--prefill-selector` / `--decode-selector`,
router/discovery.py) is what registers the new pod once it is Running and Ready, and removes the pod the
scale-down deletes (a StatefulSet removes its highest ordinal); this module only changes the counts.

RBAC (deploy/k8s/planner-rbac.yaml): in the workloads' namespace, `get` and `patch` on
`statefulsets/scale` and `deployments/scale` (group apps); the service discovery adds `get`, `list`,
`watch` on pods. Values from the API server are checked like any wire input: a Scale object whose
`spec.replicas` is a non-negative integer, else the move stops with an error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

log = logging.getLogger("router.k8s_scale")

NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"  # the pod's own namespace
ROLES = ("prefill", "decode")
KINDS = ("statefulset", "deployment")
KIND_NAMES = {"statefulset": "StatefulSet", "deployment": "Deployment"}
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT = 30  # seconds one API call may take
MAX_REPLICAS = 2**31 - 1  # replicas is an int32 in the API


class ScaleError(RuntimeError):
    """A move that failed; `done` lists what was already changed (empty: nothing)."""

    def __init__(self, message: str, *, status: int | None = None, done: list[str] | None = None) -> None:
        super().__init__(message)
        self.status = status  # the API server's HTTP status, when it answered one
        self.done = list(done or [])


class ScaleRefused(ScaleError):
    """The move would take the giving pool below min_replicas; nothing was changed."""


def own_namespace(path: str | None = None) -> str:
    """The namespace of the pod this runs in (its service account's namespace file), else "default"."""
    try:
        value = Path(path or NAMESPACE_FILE).read_text().strip()
    except OSError:
        return "default"
    return value or "default"


def parse_scale(raw: bytes, where: str) -> tuple[int, str | None]:
    """(spec.replicas, metadata.resourceVersion) of an autoscaling/v1 Scale as the API server sent it."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ScaleError(f"{where}: the API server's answer is not JSON") from None
    if not isinstance(doc, dict) or doc.get("kind") != "Scale":
        raise ScaleError(f"{where}: the API server's answer is not a Scale object")
    spec = doc.get("spec", {})
    meta = doc.get("metadata", {})
    if not isinstance(spec, dict) or not isinstance(meta, dict):
        raise ScaleError(f"{where}: the Scale's spec or metadata is not an object")
    replicas = spec.get("replicas", 0)  # omitted when 0 (the API's omitempty)
    if type(replicas) is not int or not 0 <= replicas <= MAX_REPLICAS:
        raise ScaleError(f"{where}: spec.replicas {str(replicas)[:40]!r} is not a non-negative integer")
    version = meta.get("resourceVersion")
    if version is not None and (not isinstance(version, str) or not version or len(version) > 128):
        raise ScaleError(f"{where}: metadata.resourceVersion {str(version)[:40]!r} is not a version")
    return replicas, version


def _api_message(body) -> str:
    """The `message` of a Kubernetes Status answer, shortened (it is the API server's text)."""
    try:
        message = json.loads(body).get("message") if body else None
    except (ValueError, AttributeError):
        return ""
    return f": {message[:200]}" if isinstance(message, str) else ""


class DeploymentScaler:
    """Moves a replica between the prefill and the decode workload of one namespace (see the module)."""

    def __init__(self, namespace: str | None, prefill: str, decode: str, *, kind: str | None = None,
                 api=None, min_replicas: int = 1) -> None:
        for what, name in (("prefill", prefill), ("decode", decode)):
            if not isinstance(name, str) or not name:
                raise ValueError(f"the {what} workload needs a name, got {name!r}")
        if prefill == decode:
            raise ValueError(f"the prefill and decode workloads must differ, both are {prefill!r}")
        if kind is not None:
            kind = kind.lower()
            if kind not in KINDS:
                raise ValueError(f"kind must be one of {', '.join(KINDS)} (or None to detect), got {kind!r}")
        if type(min_replicas) is not int or min_replicas < 1:
            raise ValueError(f"min_replicas must be an integer >= 1 (a pool of no pod serves nothing), "
                             f"got {min_replicas!r}")
        self.namespace = namespace or own_namespace()
        self.names = {"prefill": prefill, "decode": decode}
        self.min_replicas = min_replicas
        self.kinds: dict[str, str | None] = {prefill: kind, decode: kind}  # None until detected
        self._api = api
        self._lock = asyncio.Lock()  # one move at a time: each reads the counts the other changes

    # ------------------------------------------------------------------------------ blocking calls
    def _apps(self):
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.AppsV1Api()
        return self._api

    def _request(self, kind: str, name: str, body: dict | None = None) -> bytes:
        """GET (body None) or merge-PATCH the workload's scale subresource; the raw answer."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        api = self._apps()
        if kind == "statefulset":
            read, patch = api.read_namespaced_stateful_set_scale, api.patch_namespaced_stateful_set_scale
        else:
            read, patch = api.read_namespaced_deployment_scale, api.patch_namespaced_deployment_scale
        what = f"{'patch' if body is not None else 'read'} {KIND_NAMES[kind]} {self.namespace}/{name} scale"
        try:
            if body is None:
                resp = read(name, self.namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT)
            else:
                resp = patch(name, self.namespace, body, _content_type=MERGE_PATCH, _preload_content=False,
                             _request_timeout=REQUEST_TIMEOUT)
            return resp.data
        except ApiException as e:
            message = f"{what}: {e.status} {e.reason}{_api_message(e.body)}"
            raise ScaleError(message, status=e.status) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise ScaleError(f"{what}: the API server did not answer ({type(e).__name__})") from None

    # ------------------------------------------------------------------------------ async steps
    async def _read(self, name: str) -> tuple[str, int, str | None]:
        """(kind, replicas, resourceVersion) of one workload, finding its kind the first time."""
        kind = self.kinds[name]
        if kind is not None:
            raw = await asyncio.to_thread(self._request, kind, name)
        else:
            try:
                kind, raw = "statefulset", await asyncio.to_thread(self._request, "statefulset", name)
            except ScaleError as e:
                if e.status != 404:
                    raise
                try:
                    kind, raw = "deployment", await asyncio.to_thread(self._request, "deployment", name)
                except ScaleError as e2:
                    if e2.status != 404:
                        raise
                    raise ScaleError(f"no StatefulSet or Deployment named {name!r} in namespace "
                                     f"{self.namespace!r}", status=404) from None
            self.kinds[name] = kind
            log.info("scaling %s %s/%s", KIND_NAMES[kind], self.namespace, name)
        replicas, version = parse_scale(raw, f"{KIND_NAMES[kind]} {self.namespace}/{name}")
        return kind, replicas, version

    async def _patch(self, kind: str, name: str, replicas: int, version: str | None) -> int:
        body: dict = {"spec": {"replicas": replicas}}
        if version is not None:  # optimistic concurrency: 409 if the count changed since it was read
            body["metadata"] = {"resourceVersion": version}
        raw = await asyncio.to_thread(self._request, kind, name, body)
        return parse_scale(raw, f"{KIND_NAMES[kind]} {self.namespace}/{name}")[0]

    # ------------------------------------------------------------------------------ the planner's calls
    async def replicas(self) -> tuple[int, int]:
        """(prefill replicas, decode replicas) as their workloads' spec says."""
        _, prefill, _ = await self._read(self.names["prefill"])
        _, decode, _ = await self._read(self.names["decode"])
        return prefill, decode

    async def move(self, from_role: str, to_role: str) -> dict:
        """One replica from the `from_role` pool to the `to_role` pool: grow the receiver, then shrink the
        giver. ScaleRefused when the giver would drop below min_replicas (nothing changed), ScaleError
        when a call fails (its `done` says whether the receiver was already grown)."""
        if from_role not in ROLES or to_role not in ROLES or from_role == to_role:
            raise ValueError(f"a move goes from one of {ROLES} to the other, got {from_role!r} -> "
                             f"{to_role!r}")
        giver, receiver = self.names[from_role], self.names[to_role]
        async with self._lock:
            start = time.monotonic()
            giver_kind, giver_n, giver_version = await self._read(giver)
            receiver_kind, receiver_n, receiver_version = await self._read(receiver)
            if giver_n - 1 < self.min_replicas:
                raise ScaleRefused(f"moving a {from_role} pod to {to_role} would leave {giver} with "
                                   f"{giver_n - 1} replicas, below the minimum of {self.min_replicas}; "
                                   "nothing was changed")
            if receiver_n >= MAX_REPLICAS:
                raise ScaleRefused(f"{receiver} already has {receiver_n} replicas; nothing was changed")
            try:
                grown = await self._patch(receiver_kind, receiver, receiver_n + 1, receiver_version)
            except ScaleError as e:  # refused by the API server: not applied; else (no answer) not known
                outcome = "nothing was changed" if e.status else f"whether {receiver} grew is not known"
                raise ScaleError(f"growing {receiver} failed, {outcome}: {e}", status=e.status) from e
            where = f"{KIND_NAMES[receiver_kind]} {self.namespace}/{receiver}"
            done = [f"grew {where} from {receiver_n} to {grown}"]
            log.info("planner: %s", done[0])
            try:
                shrunk = await self._patch(giver_kind, giver, giver_n - 1, giver_version)
            except ScaleError as e:
                outcome = f"it keeps its {giver_n}: one pod more than before the move" if e.status \
                    else "whether it shrank is not known"
                raise ScaleError(f"{done[0]}, but shrinking {giver} from {giver_n} failed ({outcome}): {e}",
                                 status=e.status, done=done) from e
            log.info("planner: shrank %s %s/%s from %d to %d", KIND_NAMES[giver_kind], self.namespace, giver,
                     giver_n, shrunk)
        counts = {to_role: grown, from_role: shrunk}
        return {"prefill_replicas": counts["prefill"], "decode_replicas": counts["decode"], "grew": receiver,
                "shrank": giver, "seconds": round(time.monotonic() - start, 3)}
