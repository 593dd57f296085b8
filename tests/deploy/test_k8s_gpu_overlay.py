"""deploy/k8s/overlays/gpu: every file loads, the kustomization names files that exist and the base's
resources, and the rendered node pods ask for one NVIDIA GPU (requests = limits = TP), tolerate the GPU
taint, have a memory-backed /dev/shm and run `--device cuda` with nixl, with flags the node parser
accepts. Rendered here the way tests/deploy/test_manifests.py renders the other variants (resources and
strategic-merge patches), plus the JSON patches this overlay uses; with kubectl installed, its own
kustomize must render the same objects."""

from __future__ import annotations

import argparse
import copy
import shutil
import subprocess

import pytest
import yaml

from common.config import ServerArgs
from tests.deploy.test_manifests import K8S, check_object, containers, load_docs, merge, render
from tests.deploy.test_manifests import role_and_flags as command_role

OVERLAY = K8S / "overlays" / "gpu"
NODE_SETS = {"pdserve-prefill": "prefill", "pdserve-decode": "decode"}


def kustomization() -> dict:
    return yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())


def json_patch(doc: dict, ops: list[dict]) -> None:
    """The RFC 6902 subset the overlay uses: `add` at a map key, a list index or the end of a list (`-`)."""
    for op in ops:
        assert op["op"] == "add", f"JSON patch op {op['op']!r} is not rendered here"
        *parents, last = op["path"].lstrip("/").split("/")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node.insert(len(node) if last == "-" else int(last), copy.deepcopy(op["value"]))
        else:
            node[last] = copy.deepcopy(op["value"])


def rendered() -> list[dict]:
    k = kustomization()
    docs: list[dict] = []
    for res in k["resources"]:
        docs += load_docs((OVERLAY / res).resolve())
    for patch in k["patches"]:
        loaded = yaml.safe_load((OVERLAY / patch["path"]).read_text())
        target = patch.get("target") or {"kind": loaded["kind"], "name": loaded["metadata"]["name"]}
        hits = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"patch {patch['path']} matches {len(hits)} objects"
        if isinstance(loaded, list):
            json_patch(hits[0], loaded)
        else:
            merge(hits[0], loaded)
    return docs


def node_pods(docs: list[dict]):
    """(role, pod spec, node container) of the prefill and decode StatefulSets."""
    found = {}
    for d, c in containers(docs):
        if d["metadata"]["name"] in NODE_SETS:
            found[NODE_SETS[d["metadata"]["name"]]] = (d["spec"]["template"]["spec"], c)
    assert set(found) == {"prefill", "decode"}, sorted(found)
    return found


def test_every_file_loads_and_the_kustomization_names_files_that_exist():
    files = sorted(OVERLAY.glob("*.yaml"))
    assert {p.name for p in files} >= {"kustomization.yaml", "config.yaml"}
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path.name} is empty"
    k = kustomization()
    assert set(k) <= {"apiVersion", "kind", "resources", "patches"}, "a kustomize feature not rendered here"
    named = list(k["resources"]) + [p["path"] for p in k["patches"]]
    for rel in named:
        assert (OVERLAY / rel).is_file(), f"kustomization.yaml names {rel}, which does not exist"
    used = {(OVERLAY / rel).resolve() for rel in named}
    assert not [p.name for p in files
                if p.name != "kustomization.yaml" and p.resolve() not in used], "unused patch"
    # the base's resources, one by one (kustomize refuses the parent folder itself as a resource)
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted((OVERLAY / r).resolve() for r in k["resources"]) \
        == sorted((K8S / r).resolve() for r in base)


def test_node_pods_get_a_gpu_the_taint_toleration_and_shared_memory():
    docs = rendered()
    config = next(d["data"] for d in docs
                  if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "pdserve-config")
    for role, (spec, c) in node_pods(docs).items():
        res = c["resources"]
        assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "1", role
        assert res["limits"]["nvidia.com/gpu"] == config["TP"], f"{role}: one GPU per TP rank"
        assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"], "base kept"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        shm = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert len(shm) == 1, role
        (volume,) = [v for v in spec["volumes"] if v["name"] == shm[0]["name"]]
        assert volume["emptyDir"]["medium"] == "Memory", role
        assert len(c["volumeMounts"]) == len({m["mountPath"] for m in c["volumeMounts"]}), "a mount twice"
    # the router is not a GPU pod
    router = [c for d, c in containers(docs) if d["metadata"]["name"] == "pdserve-router"]
    assert router and all("nvidia.com/gpu" not in str(c.get("resources")) for c in router)


def test_node_commands_run_on_cuda_with_nixl_and_only_node_flags():
    docs = rendered()
    config = next(d["data"] for d in docs
                  if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "pdserve-config")
    assert config["TRANSFER_BACKEND"] == "nixl"
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for role, (_, c) in node_pods(docs).items():
        argv = render(list(c["command"]) + [str(a) for a in c["args"]], config)
        assert command_role(argv)[0] == role
        ns, unknown = parser.parse_known_args(command_role(argv)[1])
        assert not unknown, f"{role}: not node flags: {unknown}"
        assert ns.device == "cuda" and ns.transfer_backend == "nixl", role
        assert ns.base_gpu_id == 0, f"{role}: the device plugin shows the pod its GPU as GPU 0"
        assert argv.count("--device") == 1, role


def test_rendered_objects_validate_against_the_kubernetes_schemas():
    pytest.importorskip("kubernetes")
    for d in rendered():
        check_object(d, "overlays/gpu")


def test_kubectl_kustomize_renders_the_same_objects():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", str(OVERLAY)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr

    def by_name(docs):
        return {(d["kind"], d["metadata"]["name"]): d for d in docs if d}

    theirs, ours = by_name(yaml.safe_load_all(out.stdout)), by_name(rendered())
    assert set(theirs) == set(ours)
    for key, doc in ours.items():
        assert theirs[key] == doc, key


def test_the_json_patch_renderer_adds_where_it_is_told():
    doc = {"a": {"xs": [1, 2]}}
    json_patch(doc,
               [{"op": "add", "path": "/a/xs/-", "value": 3}, {"op": "add", "path": "/a/xs/0", "value": 0},
                {"op": "add", "path": "/a/k", "value": "v"}])
    assert doc == {"a": {"xs": [0, 1, 2, 3], "k": "v"}}
    with pytest.raises(AssertionError, match="not rendered here"):
        json_patch(doc, [{"op": "remove", "path": "/a/k"}])

