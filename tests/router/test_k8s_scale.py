"""router/k8s_scale.py: the SLO planner's Kubernetes actuator, through the real `kubernetes` client against a
stand-in API server that answers the apps/v1 scale subresource in the wire format (autoscaling/v1 Scale
objects, Status objects for errors, merge patches checked against the resourceVersion) and records every
request. Also the RBAC it needs (deploy/k8s/planner-rbac.yaml) and the overlay that turns it on."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import secrets
import shutil
import subprocess

import pytest
import yaml
from aiohttp import web

from router import k8s_scale
from router.k8s_scale import DeploymentScaler, ScaleError, ScaleRefused
from tests.harness.api_server import ApiServer

pytest.importorskip("kubernetes")
NS = "serving"
PREFILL, DECODE = "pdserve-prefill", "pdserve-decode"
RESOURCES = {"statefulsets": "StatefulSet", "deployments": "Deployment"}


def status(code: int, reason: str, message: str) -> web.Response:
    return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                              "message": message, "reason": reason, "code": code}, status=code)


class FakeApiServer(ApiServer):
    """/apis/apps/v1/namespaces/NS/{statefulsets,deployments}/NAME/scale: GET a Scale, PATCH it with a
    merge patch (409 when its resourceVersion is not the current one). `fail[(method, resource, name)]`
    answers that request with an error; `replicas_override[name]` is what spec.replicas reads as."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict] = {}  # (resource, name) -> {"replicas", "rv"}
        self.requests: list[dict] = []
        self.fail: dict[tuple[str, str, str], tuple[int, str, str]] = {}
        self.replicas_override: dict[str, object] = {}
        self.meddle: set[str] = set()  # names someone else re-scales right after each read
        self.garble: set[str] = set()  # names whose patch is applied but answered with no Scale
        self.rv = 100
        super().__init__()

    def add(self, resource: str, name: str, replicas: int) -> None:
        self.rv += 1
        self.objects[(resource, name)] = {"replicas": replicas, "rv": self.rv}

    def replicas(self, resource: str, name: str) -> int:
        return self.objects[(resource, name)]["replicas"]

    def routes(self, app: web.Application) -> None:
        path = "/apis/apps/v1/namespaces/{ns}/{resource}/{name}/scale"
        app.router.add_get(path, self.handle)
        app.router.add_patch(path, self.handle)

    def scale(self, ns: str, resource: str, name: str) -> dict:
        obj = self.objects[(resource, name)]
        replicas = self.replicas_override.get(name, obj["replicas"])
        spec = {"replicas": replicas} if replicas != 0 else {}  # omitempty, as the API server writes it
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}",
                             "resourceVersion": str(obj["rv"]), "creationTimestamp": "2025-01-01T00:00:00Z"},
                "spec": spec, "status": {"replicas": obj["replicas"],
                                         "selector": f"app.kubernetes.io/name={name}"}}

    async def handle(self, request: web.Request) -> web.Response:
        ns, resource, name = (request.match_info[k] for k in ("ns", "resource", "name"))
        body = None
        if request.method == "PATCH":
            body = json.loads(await request.read())
        self.requests.append({"method": request.method, "path": request.path,
                              "content_type": request.headers.get("Content-Type"), "body": body})
        if (request.method, resource, name) in self.fail:
            return status(*self.fail[(request.method, resource, name)])
        if ns != NS or resource not in RESOURCES or (resource, name) not in self.objects:
            return status(404, "NotFound", f'{resource}.apps "{name}" not found')
        obj = self.objects[(resource, name)]
        if request.method == "GET":
            answer = self.scale(ns, resource, name)
            if name in self.meddle:  # someone else scales it between our read and our patch
                self.rv += 1
                obj["rv"] = self.rv
            return web.json_response(answer)
        if request.headers.get("Content-Type") != "application/merge-patch+json":
            return status(415, "UnsupportedMediaType", "not a merge patch")
        version = (body.get("metadata") or {}).get("resourceVersion")
        if version is not None and version != str(obj["rv"]):
            return status(409, "Conflict", "Operation cannot be fulfilled: the object has been modified")
        replicas = body.get("spec", {}).get("replicas")
        if type(replicas) is not int or replicas < 0:
            return status(422, "Invalid", "spec.replicas: Invalid value")
        self.rv += 1
        obj.update(replicas=replicas, rv=self.rv)
        if name in self.garble:
            return web.Response(text="<html>a proxy's page</html>", content_type="text/html")
        return web.json_response(self.scale(ns, resource, name))

    def patches(self) -> list[dict]:
        return [r for r in self.requests if r["method"] == "PATCH"]


@pytest.fixture
def api():
    server = FakeApiServer()
    yield server
    server.close()


@pytest.fixture
def apps(api):
    """The real client's AppsV1Api, configured to the stand-in server."""
    from kubernetes import client

    conf = client.Configuration(host=f"http://127.0.0.1:{api.port}")
    api_client = client.ApiClient(conf)
    yield client.AppsV1Api(api_client)
    api_client.close()


def scale_path(resource: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NS}/{resource}/{name}/scale"


def run(coro):
    return asyncio.run(coro)


def test_move_grows_the_receiver_then_shrinks_the_giver(api, apps):
    api.add("statefulsets", PREFILL, 2)
    api.add("statefulsets", DECODE, 2)
    scaler = DeploymentScaler(NS, PREFILL, DECODE, api=apps)
    result = run(scaler.move("prefill", "decode"))
    assert result["prefill_replicas"] == 1 and result["decode_replicas"] == 3
    assert result["grew"] == DECODE and result["shrank"] == PREFILL and result["seconds"] >= 0
    assert api.replicas("statefulsets", PREFILL) == 1 and api.replicas("statefulsets", DECODE) == 3
    sts = "statefulsets"
    assert [(r["method"], r["path"]) for r in api.requests] == [
        ("GET", scale_path(sts, PREFILL)), ("GET", scale_path(sts, DECODE)),
        ("PATCH", scale_path(sts, DECODE)), ("PATCH", scale_path(sts, PREFILL))]  # grow first
    grow, shrink = api.patches()
    assert grow["content_type"] == shrink["content_type"] == "application/merge-patch+json"
    # the counts read, +1 / -1, conditional on the resourceVersions read
    assert grow["body"] == {"spec": {"replicas": 3}, "metadata": {"resourceVersion": "102"}}
    assert shrink["body"] == {"spec": {"replicas": 1}, "metadata": {"resourceVersion": "101"}}
    assert run(scaler.replicas()) == (1, 3)
    # and back: decode gives, prefill receives (grown first again)
    api.requests.clear()
    result = run(scaler.move("decode", "prefill"))
    assert (result["prefill_replicas"], result["decode_replicas"]) == (2, 2)
    assert [(r["path"], r["body"]["spec"]) for r in api.patches()] == [
        (scale_path(sts, PREFILL), {"replicas": 2}), (scale_path(sts, DECODE), {"replicas": 2})]


def test_refused_below_min_replicas_with_no_patch_sent(api, apps):
    api.add("statefulsets", PREFILL, 1)
    api.add("statefulsets", DECODE, 3)
    scaler = DeploymentScaler(NS, PREFILL, DECODE, api=apps)
    with pytest.raises(ScaleRefused, match="would leave pdserve-prefill with 0 replicas.*nothing was "
                                           "changed"):
        run(scaler.move("prefill", "decode"))
    strict = DeploymentScaler(NS, PREFILL, DECODE, api=apps, min_replicas=3)
    with pytest.raises(ScaleRefused, match="below the minimum of 3"):
        run(strict.move("decode", "prefill"))
    assert api.patches() == []
    assert api.replicas("statefulsets", PREFILL) == 1 and api.replicas("statefulsets", DECODE) == 3
    assert run(scaler.move("decode", "prefill"))["prefill_replicas"] == 2  # the other way is allowed


def test_a_deployment_is_found_when_there_is_no_statefulset_and_remembered(api, apps):
    api.add("deployments", PREFILL, 2)
    api.add("deployments", DECODE, 0)  # spec.replicas is omitted at 0
    scaler = DeploymentScaler(NS, PREFILL, DECODE, api=apps)
    result = run(scaler.move("prefill", "decode"))
    assert (result["prefill_replicas"], result["decode_replicas"]) == (1, 1)
    assert [(r["method"], r["path"]) for r in api.requests] == [
        ("GET", scale_path("statefulsets", PREFILL)), ("GET", scale_path("deployments", PREFILL)),
        ("GET", scale_path("statefulsets", DECODE)), ("GET", scale_path("deployments", DECODE)),
        ("PATCH", scale_path("deployments", DECODE)), ("PATCH", scale_path("deployments", PREFILL))]
    assert scaler.kinds == {PREFILL: "deployment", DECODE: "deployment"}
    api.requests.clear()
    assert run(scaler.replicas()) == (1, 1)
    assert [r["path"] for r in api.requests] == [scale_path("deployments", PREFILL),
                                                 scale_path("deployments", DECODE)]
    # told the kind: no StatefulSet is looked for
    api.requests.clear()
    told = DeploymentScaler(NS, PREFILL, DECODE, kind="Deployment", api=apps)
    assert run(told.replicas()) == (1, 1)
    assert all("/deployments/" in r["path"] for r in api.requests)
    # neither exists
    gone = DeploymentScaler(NS, "nothing-p", "nothing-d", api=apps)
    with pytest.raises(ScaleError, match="no StatefulSet or Deployment named 'nothing-p' in namespace "
                                         "'serving'"):
        run(gone.replicas())


def test_a_failed_second_patch_says_what_was_already_done(api, apps):
    api.add("statefulsets", PREFILL, 2)
    api.add("statefulsets", DECODE, 2)
    api.fail[("PATCH", "statefulsets", PREFILL)] = (403, "Forbidden", "cannot patch statefulsets/scale")
    scaler = DeploymentScaler(NS, PREFILL, DECODE, api=apps)
    with pytest.raises(ScaleError) as info:
        run(scaler.move("prefill", "decode"))
    message = str(info.value)
    assert "grew StatefulSet serving/pdserve-decode from 2 to 3" in message
    assert "shrinking pdserve-prefill from 2 failed" in message and "one pod more" in message
    assert "403 Forbidden: cannot patch statefulsets/scale" in message
    assert info.value.status == 403
    assert info.value.done == ["grew StatefulSet serving/pdserve-decode from 2 to 3"]
    assert api.replicas("statefulsets", DECODE) == 3 and api.replicas("statefulsets", PREFILL) == 2
    assert [r["path"] for r in api.patches()] == [scale_path("statefulsets", DECODE),
                                                  scale_path("statefulsets", PREFILL)]


def test_a_failed_first_patch_changes_nothing(api, apps):
    api.add("statefulsets", PREFILL, 2)
    api.add("statefulsets", DECODE, 2)
    api.fail[("PATCH", "statefulsets", DECODE)] = (500, "InternalError", "etcd is away")
    scaler = DeploymentScaler(NS, PREFILL, DECODE, api=apps)
    with pytest.raises(ScaleError, match="growing pdserve-decode failed, nothing was changed") as info:
        run(scaler.move("prefill", "decode"))
    assert info.value.done == [] and len(api.patches()) == 1
    assert api.replicas("statefulsets", PREFILL) == 2  # the giver is not touched


def test_a_patch_whose_answer_is_not_understood_has_an_unknown_outcome(api, apps):
    api.add("statefulsets", PREFILL, 2)
    api.add("statefulsets", DECODE, 2)
    api.garble.add(DECODE)
    scaler = DeploymentScaler(NS, PREFILL, DECODE, api=apps)
    with pytest.raises(ScaleError, match="growing pdserve-decode failed, whether pdserve-decode grew is not "
                                         "known: .*not JSON") as info:
        run(scaler.move("prefill", "decode"))
    assert info.value.done == [] and len(api.patches()) == 1  # the giver is left alone
    api.garble = {PREFILL}
    with pytest.raises(ScaleError) as info:
        run(scaler.move("prefill", "decode"))
    assert ("grew StatefulSet serving/pdserve-decode from 3 to 4, but shrinking pdserve-prefill from 2 "
            "failed (whether it shrank is not known)") in str(info.value)


def test_a_count_changed_since_it_was_read_is_not_overwritten(api, apps):
    api.add("statefulsets", PREFILL, 2)
    api.add("statefulsets", DECODE, 2)
    api.meddle.add(DECODE)
    scaler = DeploymentScaler(NS, PREFILL, DECODE, api=apps)
    with pytest.raises(ScaleError, match="409 Conflict") as info:
        run(scaler.move("prefill", "decode"))
    assert info.value.status == 409 and info.value.done == []
    assert api.replicas("statefulsets", DECODE) == 2 and api.replicas("statefulsets", PREFILL) == 2


@pytest.mark.parametrize("value", ["2", 2.5, True, -1, None, [2], 2**31])
def test_replicas_from_the_server_must_be_a_non_negative_int(api, apps, value):
    api.add("statefulsets", PREFILL, 2)
    api.add("statefulsets", DECODE, 2)
    api.replicas_override[DECODE] = value
    scaler = DeploymentScaler(NS, PREFILL, DECODE, api=apps)
    with pytest.raises(ScaleError, match="StatefulSet serving/pdserve-decode: spec.replicas .* is not a "
                                         "non-negative integer"):
        run(scaler.move("prefill", "decode"))
    assert api.patches() == []


def test_answers_that_are_not_scale_objects_are_refused():
    with pytest.raises(ScaleError, match="not JSON"):
        k8s_scale.parse_scale(b"<html>", "x")
    with pytest.raises(ScaleError, match="not a Scale object"):
        k8s_scale.parse_scale(b'{"kind": "Status"}', "x")
    with pytest.raises(ScaleError, match="resourceVersion"):
        k8s_scale.parse_scale(b'{"kind": "Scale", "metadata": {"resourceVersion": 7}, "spec": {}}', "x")
    assert k8s_scale.parse_scale(b'{"kind": "Scale", "spec": {}}', "x") == (0, None)


def test_an_api_server_that_does_not_answer_is_an_error():
    from kubernetes import client

    conf = client.Configuration(host="http://127.0.0.1:9")  # the discard port: nothing listens
    conf.retries = 0
    with client.ApiClient(conf) as api_client:
        scaler = DeploymentScaler(NS, PREFILL, DECODE, api=client.AppsV1Api(api_client))
        with pytest.raises(ScaleError, match="did not answer"):
            run(scaler.replicas())


def test_namespace_arguments_and_roles_are_checked(tmp_path, monkeypatch):
    ns_file = tmp_path / "namespace"
    ns_file.write_text("inference\n")
    monkeypatch.setattr(k8s_scale, "NAMESPACE_FILE", str(ns_file))
    assert DeploymentScaler(None, PREFILL, DECODE, api=object()).namespace == "inference"
    assert DeploymentScaler(NS, PREFILL, DECODE, api=object()).namespace == NS
    monkeypatch.setattr(k8s_scale, "NAMESPACE_FILE", str(tmp_path / "absent"))
    assert DeploymentScaler(None, PREFILL, DECODE, api=object()).namespace == "default"
    with pytest.raises(ValueError, match="kind must be one of"):
        DeploymentScaler(NS, PREFILL, DECODE, kind="daemonset")
    with pytest.raises(ValueError, match="min_replicas"):
        DeploymentScaler(NS, PREFILL, DECODE, min_replicas=0)
    with pytest.raises(ValueError, match="must differ"):
        DeploymentScaler(NS, PREFILL, PREFILL)
    with pytest.raises(ValueError, match="needs a name"):
        DeploymentScaler(NS, "", DECODE)
    scaler = DeploymentScaler(NS, PREFILL, DECODE, api=object())
    for roles in (("prefill", "prefill"), ("prefill", "router"), ("decode", "")):
        with pytest.raises(ValueError, match="a move goes from one of"):
            run(scaler.move(*roles))


# ---------------------------------------------------------------------------------- deploy/k8s


def rbac_rules() -> tuple[dict, list[dict]]:
    from tests.deploy.test_manifests import K8S, load_docs

    docs = {d["kind"]: d for d in load_docs(K8S / "planner-rbac.yaml")}
    return docs, docs["Role"]["rules"]


def test_the_role_grants_what_the_scaler_sends_and_no_more(api, apps):
    from tests.deploy.test_manifests import check_object

    docs, rules = rbac_rules()
    assert sorted(docs) == ["Role", "RoleBinding", "ServiceAccount"]  # namespaced: no ClusterRole(Binding)
    for d in docs.values():
        check_object(d, "planner-rbac.yaml")
    granted = {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    assert not [g for g in granted if "*" in g], "a wildcard"
    assert not [r for r in rules if "nonResourceURLs" in r]
    # what the scaler sent, detecting the kind of each workload (a StatefulSet and a Deployment here)
    api.add("statefulsets", PREFILL, 2)
    api.add("deployments", DECODE, 2)
    run(DeploymentScaler(NS, PREFILL, DECODE, api=apps).move("prefill", "decode"))
    verbs = {"GET": "get", "PATCH": "patch"}
    used = set()
    for r in api.requests:
        resource, name, sub = r["path"].split("/")[-3:]
        used.add(("apps", f"{resource}/{sub}", verbs[r["method"]]))
    discovery = {("", "pods", verb) for verb in ("get", "list", "watch")}  # router/discovery.py
    assert used == {("apps", f"{res}/scale", verb) for res in RESOURCES for verb in ("get", "patch")}
    assert granted == used | discovery
    binding = docs["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": docs["Role"]["metadata"]["name"]}
    account = docs["ServiceAccount"]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]


def test_the_router_runs_as_the_account_and_only_the_planner_overlay_mounts_its_token():
    from tests.deploy.test_manifests import K8S, kustomize

    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "planner-rbac.yaml" in base["resources"]
    docs, _ = rbac_rules()
    assert docs["ServiceAccount"]["automountServiceAccountToken"] is False
    for folder, mounted in ((K8S, False), (K8S / "overlays" / "planner", True)):
        router = next(d for d in kustomize(folder) if d["kind"] == "Deployment"
                      and d["metadata"]["name"] == "pdserve-router")
        spec = router["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == docs["ServiceAccount"]["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is mounted, folder
        assert router["spec"]["replicas"] == 1  # one router, one planner


@pytest.fixture
def overlay():
    from tests.deploy.test_manifests import K8S, kustomize

    folder = K8S / "overlays" / "planner"
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted((folder / r).resolve() for r in k["resources"]) == sorted((K8S / r).resolve() for r in base)
    return folder, kustomize(folder)


def test_the_planner_overlay_finds_the_pools_by_their_labels_and_scales_them(overlay, tmp_path):
    from router import cli as router_cli
    from tests.deploy.test_manifests import check_object, containers, flag_values, render, secret_volume

    _, docs = overlay
    for d in docs:
        check_object(d, "overlays/planner")
    sets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    config = next(d["data"] for d in docs if d["kind"] == "ConfigMap")
    (d, c), = [(d, c) for d, c in containers(docs) if d["metadata"]["name"] == "pdserve-router"]
    env = dict(config)
    for e in c.get("env", []):
        if e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            env[e["name"]] = NS  # the downward API: the pod's namespace
    argv = render(list(c["command"]) + [str(a) for a in c["args"]], env)
    assert argv[:2] == ["pdserve", "router"]
    flags = flag_values(argv)
    assert flags["--service-discovery-namespace"] == NS  # the Role is of this namespace only
    assert "--prefill" not in argv and "--decode" not in argv  # no pod registered twice
    assert flags["--planner-actuator"] == "k8s"
    assert {flags["--planner-k8s-prefill"], flags["--planner-k8s-decode"]} == set(sets)
    # the Secret's files in place, as the base router has them
    mount, volume, _ = secret_volume(d, c)
    secret_dir = tmp_path / "secrets"
    secret_dir.mkdir()
    for item in volume["secret"]["items"]:
        (secret_dir / item["path"]).write_text(secrets.token_hex(24) + "\n")
        os.chmod(secret_dir / item["path"], 0o600)
    argv = [w.replace(mount, str(secret_dir)) for w in argv]
    parser = router_cli.build_parser()
    ns, unknown = parser.parse_known_args(argv[2:])
    assert not unknown, f"router does not accept {unknown}"
    cfg = router_cli.config_from_args(ns)
    assert cfg.service_discovery and cfg.planner == "slo" and cfg.planner_actuator == "k8s"
    assert (cfg.ttft_slo, cfg.itl_slo) == (2, 0.1)
    for role, selector in (("prefill", cfg.prefill_selector), ("decode", cfg.decode_selector)):
        labels = sets[flags[f"--planner-k8s-{role}"]]["spec"]["template"]["metadata"]["labels"]
        wanted = dict(pair.split("=", 1) for pair in selector.split(","))
        assert wanted.items() <= labels.items(), f"{role} selector {selector} misses the pods {labels}"
        node = next(nc for _, nc in containers([sets[flags[f"--planner-k8s-{role}"]]]))
        ports = {p["name"]: p["containerPort"] for p in node["ports"]}
        assert cfg.service_discovery_port == ports["http"]


def test_kubectl_kustomize_renders_the_planner_overlay_the_same(overlay):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    folder, ours = overlay
    out = subprocess.run([kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(folder)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr

    def by_name(docs):
        return {(d["kind"], d["metadata"]["name"]): copy.deepcopy(d) for d in docs if d}

    theirs, mine = by_name(yaml.safe_load_all(out.stdout)), by_name(ours)
    assert set(theirs) == set(mine)
    for key, doc in mine.items():
        assert theirs[key] == doc, key
