"""Every Kubernetes manifest and multi-machine example in deploy/ loads, and every container / script
command runs a real `pdserve` subcommand with flags its parser accepts (values rendered from the
ConfigMap or env file, then parsed and validated by the same code the command runs, with the secret
files they name present). Keys and the cluster secret reach every process as files from one Secret /
secrets directory, never as values; the router and the nodes share the cluster secret and the node key;
the pools take traffic from pdserve pods only."""

from __future__ import annotations

import argparse
import copy
import os
import re
import secrets
import shlex
from pathlib import Path

import pytest
import yaml

from common.config import ServerArgs
from router import cli as router_cli

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "k8s"
EXAMPLES = DEPLOY / "examples" / "multi-node"
NODE_COMMANDS = {"serve": "null", "prefill": "prefill", "decode": "decode"}
MODULES = {"prefill_node": "prefill", "decode_node": "decode", "router": "router"}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Pod", "Job")
SECRET_NAME = "pdserve-secrets"
# flag -> what the file holds; which role passes which (the router: every key; a node: what it checks)
SECRET_FLAGS = {"--cluster-secret-file": "cluster secret", "--api-key-file": "client key",
                "--admin-api-key-file": "admin key", "--node-api-key-file": "node key"}
ROLE_SECRET_FLAGS = {"router": set(SECRET_FLAGS), "prefill": {"--cluster-secret-file", "--node-api-key-file"},
                     "decode": {"--cluster-secret-file", "--node-api-key-file"}}
VALUE_FLAGS = ("--api-key",)  # a key on the command line shows in `ps`


@pytest.fixture
def secret_files(tmp_path):
    """A directory standing in for the mounted Secret: every key the manifests name, mode 600."""
    def make(keys) -> Path:
        folder = tmp_path / f"secrets-{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        for key in keys:
            (folder / key).write_text(secrets.token_hex(24) + "\n")
            os.chmod(folder / key, 0o600)
        return folder
    return make


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_docs() -> dict[str, list[dict]]:
    """The base's files (deploy/k8s/*.yaml)."""
    return {str(p.relative_to(DEPLOY)): load_docs(p) for p in sorted(K8S.glob("*.yaml"))}


def merge(dst: dict, src: dict) -> None:
    """The strategic-merge subset the overlays use: maps merge, lists of named maps merge by name, the
    rest replaces."""
    for k, v in src.items():
        old = dst.get(k)
        if isinstance(v, dict) and isinstance(old, dict):
            merge(old, v)
        elif isinstance(v, list) and isinstance(old, list) and all(isinstance(x, dict) and "name" in x
                                                                  for x in v + old):
            by_name = {x["name"]: x for x in old}
            for x in v:
                if x["name"] in by_name:
                    merge(by_name[x["name"]], x)
                else:
                    old.append(copy.deepcopy(x))
        else:
            dst[k] = copy.deepcopy(v)


def kustomize(folder: Path) -> list[dict]:
    """What `kubectl kustomize folder` renders, for the resources + patches the overlays use."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(k) <= {"apiVersion", "kind", "resources",
                      "patches"}, f"{folder}: a kustomize feature not rendered here"
    docs: list[dict] = []
    for res in k.get("resources", []):
        path = (folder / res).resolve()
        docs += kustomize(path) if path.is_dir() else load_docs(path)
    for patch in k.get("patches", []):
        (doc,) = load_docs((folder / patch["path"]).resolve())
        target = patch.get("target") or {"kind": doc["kind"], "name": doc["metadata"]["name"]}
        hits = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(hits) == 1, f"{folder}: patch {patch['path']} matches {len(hits)} objects"
        merge(hits[0], doc)
    return docs


VARIANTS = ["base", "overlays/rdma-nixl", "overlays/rdma-mooncake"]


def rendered(variant: str) -> list[dict]:
    return kustomize(K8S if variant == "base" else K8S / variant)


def config_maps() -> dict[str, dict]:
    """variant -> the pdserve-config data it renders."""
    return {v: next(d["data"] for d in rendered(v) if d["kind"] == "ConfigMap" and d["metadata"]["name"] ==
                    "pdserve-config") for v in VARIANTS}


def containers(docs: list[dict]):
    for d in docs:
        if d.get("kind") not in WORKLOADS:
            continue
        spec = d["spec"] if d["kind"] == "Pod" else d["spec"]["template"]["spec"]
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            yield d, c


def secret_volume(d: dict, c: dict) -> tuple[str, dict, dict]:
    """(mount path, volume, mount) of the container's one volume from the pdserve Secret."""
    spec = d["spec"] if d["kind"] == "Pod" else d["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes", [])
               if v.get("secret", {}).get("secretName") == SECRET_NAME}
    mounts = [m for m in c.get("volumeMounts", []) if m["name"] in volumes]
    assert len(mounts) == 1, f"{c['name']}: expected one mount of the {SECRET_NAME} Secret, got {mounts}"
    return mounts[0]["mountPath"], volumes[mounts[0]["name"]], mounts[0]


def with_secret_files(argv: list[str], d: dict, c: dict, make_files) -> list[str]:
    """The command with the Secret's mount path moved to a folder holding the projected keys."""
    mount, volume, _ = secret_volume(d, c)
    folder = make_files([item["path"] for item in volume["secret"]["items"]])
    return [w.replace(mount, str(folder)) for w in argv]


def flag_values(argv: list[str]) -> dict[str, str]:
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}


def render(words: list[str], env: dict[str, str]) -> list[str]:
    def sub(m: re.Match) -> str:
        if m.group(1) not in env:
            raise AssertionError(f"$({m.group(1)}) is not defined by the ConfigMap or the container env")
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, w) for w in words]


def role_and_flags(argv: list[str]) -> tuple[str, list[str]]:
    """('prefill'|'decode'|'null'|'router', flags) of a pdserve / python -m command line."""
    if argv[0] == "pdserve":
        sub = argv[1]
        assert sub in (*NODE_COMMANDS, "router"), f"unknown pdserve subcommand {sub!r}"
        return (NODE_COMMANDS.get(sub, "router"), argv[2:])
    if len(argv) > 2 and argv[0].startswith("python") and argv[1] == "-m":
        assert argv[2] in MODULES, f"unknown module {argv[2]!r}"
        return MODULES[argv[2]], argv[3:]
    raise AssertionError(f"not a pdserve command: {argv}")


def check_command(argv: list[str]) -> tuple[str, object]:
    """Parse with the real parser; nothing unknown; then the same validation the command does."""
    role, flags = role_and_flags(argv)
    if role == "router":
        parser = router_cli.build_parser()
        ns, unknown = parser.parse_known_args(flags)
        assert not unknown, f"router does not accept {unknown}"
        return role, router_cli.config_from_args(ns)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns, unknown = parser.parse_known_args(flags)
    assert not unknown, f"pdserve {role} does not accept {unknown}"
    ns.disaggregation_mode = role
    return role, ServerArgs.from_cli_args(ns)


def test_every_manifest_loads_and_has_kind():
    docs = all_docs()
    assert {"configmap.yaml", "prefill.yaml", "decode.yaml", "router.yaml"} <= {Path(n).name for n in docs}
    for name, ds in docs.items():
        assert ds, f"{name} is empty"
        for d in ds:
            assert d.get("apiVersion") and d.get("kind"), (name, d)
            if d["kind"] != "Kustomization":
                assert d.get("metadata", {}).get("name"), (name, d)
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for res in kust["resources"]:
        assert (K8S / res).is_file(), res


@pytest.mark.parametrize("variant", VARIANTS)
def test_container_commands_use_only_accepted_flags(variant, secret_files):
    env = config_maps()[variant]
    seen = {}
    for docs in [rendered(variant)]:
        for d, c in containers(docs):
            cenv = dict(env)
            cenv.update({e["name"]: str(e.get("value", "")) for e in c.get("env", []) if "value" in e})
            argv = render(list(c.get("command", [])) + [str(a) for a in c.get("args", [])], cenv)
            role, parsed = check_command(with_secret_files(argv, d, c, secret_files))
            seen[role] = (d, c, parsed)
    assert set(seen) == {"prefill", "decode", "router"}
    backend = env["TRANSFER_BACKEND"]
    assert seen["prefill"][2].transfer_backend == backend == seen["decode"][2].transfer_backend
    assert seen["prefill"][2].page_size == seen["decode"][2].page_size  # must agree at the KV handshake
    # the router's workers are the pools' stable pod names, with the prefill bootstrap port
    prefill_set, _, pargs = seen["prefill"]
    decode_set, _, _ = seen["decode"]
    router_cfg = seen["router"][2]
    assert len(router_cfg.prefill) == prefill_set["spec"]["replicas"]
    assert len(router_cfg.decode) == decode_set["spec"]["replicas"]
    for i, spec in enumerate(router_cfg.prefill):
        host = f"{prefill_set['metadata']['name']}-{i}.{prefill_set['spec']['serviceName']}"
        assert spec.url.startswith(f"http://{host}:") \
            and spec.bootstrap_port == pargs.disaggregation_bootstrap_port
    for i, url in enumerate(router_cfg.decode):
        assert url.startswith(f"http://{decode_set['metadata']['name']}-{i}.{decode_set['spec']['serviceName']}:")


def test_keys_and_cluster_secret_come_from_the_secret_as_files(secret_files):
    env = config_maps()["base"]
    secret_key_of: dict[str, set[str]] = {}  # flag -> the Secret keys it is given, over all containers
    for docs in all_docs().values():
        for d, c in containers(docs):
            argv = render(list(c["command"]) + [str(a) for a in c["args"]], env)
            role, _ = role_and_flags(argv)
            mount, volume, m = secret_volume(d, c)
            assert m.get("readOnly") is True, f"{role}: mount the Secret read-only"
            assert volume["secret"]["defaultMode"] \
                == 0o400, f"{role}: Secret files readable by their owner only"
            items = {i["path"]: i["key"] for i in volume["secret"]["items"]}
            flags = flag_values(argv)
            assert not [f for f in VALUE_FLAGS if f in argv], f"{role}: a key as a value on the command line"
            assert set(flags) & set(SECRET_FLAGS) == ROLE_SECRET_FLAGS[role], f"{role}: {sorted(flags)}"
            for flag in ROLE_SECRET_FLAGS[role]:
                folder, _, name = flags[flag].rpartition("/")
                assert folder == mount \
                    and name in items, f"{role} {flag} {flags[flag]}: not a file of the Secret"
                secret_key_of.setdefault(flag, set()).add(items[name])
            for e in c.get("env", []):
                assert not re.search(r"KEY|SECRET", e["name"]) \
                    or "value" not in e, f"{role}: {e['name']} as a value"
            # the command starts with those files in place, and reads them
            _, parsed = check_command(with_secret_files(argv, d, c, secret_files))
            if role == "router":
                keys = parsed.resolved_keys
                assert keys.client and keys.admin and keys.node and parsed.cluster_secret is not None
            else:
                assert parsed.cluster_secret is not None
    # one cluster secret and one node key: the same Secret key wherever it is passed
    assert all(len(keys) == 1 for keys in secret_key_of.values()), secret_key_of
    assert not [k for k in config_maps()["base"] if re.search(r"KEY|SECRET", k)]


def test_pools_take_traffic_from_pdserve_pods_only():
    docs = all_docs()
    policies = {d["metadata"]["name"]: d for ds in docs.values() for d in ds if d["kind"] == "NetworkPolicy"}
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert "networkpolicy.yaml" in kust["resources"]
    pools = policies["pdserve-pools"]["spec"]
    selected = {v for e in pools["podSelector"]["matchExpressions"] for v in e["values"]}
    workloads = {d["metadata"]["name"]: d for ds in docs.values() for d in ds if d["kind"] in WORKLOADS}
    for name in ("pdserve-prefill", "pdserve-decode"):
        labels = workloads[name]["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] in selected, name
    assert pools["policyTypes"] == ["Ingress"]
    sources = [src for rule in pools["ingress"] for src in rule["from"]]
    assert sources == [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "pdserve"}}}]
    for d in workloads.values():
        assert d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pdserve"


def test_probes_ports_and_resources(secret_files):
    docs = {Path(n).name: ds for n, ds in all_docs().items()}
    services = {d["metadata"]["name"]: d for ds in docs.values() for d in ds if d["kind"] == "Service"}
    env = config_maps()["base"]
    for name in ("prefill.yaml", "decode.yaml", "router.yaml"):
        for d, c in containers(docs[name]):
            probe = c["readinessProbe"]["httpGet"]
            assert probe["path"] == "/health"
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert probe["port"] in ports
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
            argv = render(c["command"] + [str(a) for a in c["args"]], env)
            role, parsed = check_command(with_secret_files(argv, d, c, secret_files))
            assert ports["http"] == parsed.port
            if d["kind"] == "StatefulSet":
                svc = services[d["spec"]["serviceName"]]
                assert svc["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
                assert svc["spec"]["selector"] == d["spec"]["selector"]["matchLabels"]
                svc_ports = {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]}
                assert svc_ports["http"] == parsed.port
                if role == "prefill":
                    assert ports["bootstrap"] == parsed.disaggregation_bootstrap_port
                    assert svc_ports["bootstrap"] == parsed.disaggregation_bootstrap_port
    router_svc = services["pdserve-router"]
    assert {p["name"] for p in router_svc["spec"]["ports"]} >= {"http"}


def script_commands(path: Path, env: dict[str, str]) -> list[list[str]]:
    """The `exec pdserve ...` command of a launch script (continuation lines joined), with the env file's
    variables substituted as the shell would."""
    text = path.read_text().replace("\\\n", " ")
    cmds = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("exec pdserve"):
            expanded = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env[m.group(1)], line)
            cmds.append(shlex.split(expanded)[1:])
    return cmds


def test_multi_machine_examples(secret_files):
    env = {}
    for line in (EXAMPLES / "cluster.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    assert not [k for k in env if re.search(r"KEY|SECRET", k) and k != "SECRETS_DIR"], "keys belong in files"
    env["SECRETS_DIR"] = str(secret_files(["cluster-secret", "api-key", "admin-api-key", "node-api-key"]))
    roles = {}
    for script in sorted(EXAMPLES.glob("*.sh")):
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash") and "cluster.env" in text
        cmds = script_commands(script, env)
        assert len(cmds) == 1, f"{script.name}: one launch command per machine"
        role, parsed = check_command(cmds[0])
        roles.setdefault(role, []).append(parsed)
        flags = flag_values(cmds[0])
        assert not [f for f in VALUE_FLAGS
                    if f in cmds[0]], f"{script.name}: a key as a value on the command line"
        assert set(flags) & set(SECRET_FLAGS) == ROLE_SECRET_FLAGS[role], f"{script.name}: {sorted(flags)}"
        assert all(flags[f].startswith(env["SECRETS_DIR"] + "/")
                   for f in ROLE_SECRET_FLAGS[role]), script.name
        assert flags["--host"] != "0.0.0.0", f"{script.name}: bind the machine's address, not every interface"
    assert len(roles["prefill"]) == 2 and len(roles["decode"]) == 1 and len(roles["router"]) == 1
    router_cfg = roles["router"][0]
    assert sorted(p.url for p in router_cfg.prefill) == [f"http://{env['PREFILL_A_IP']}:{env['NODE_PORT']}",
                                                         f"http://{env['PREFILL_B_IP']}:{env['NODE_PORT']}"]
    assert all(p.bootstrap_port == int(env["BOOTSTRAP_PORT"]) for p in router_cfg.prefill)
    assert all(p.disaggregation_bootstrap_port == int(env["BOOTSTRAP_PORT"]) for p in roles["prefill"])


def test_check_command_rejects_unknown_flags():
    with pytest.raises(AssertionError, match="does not accept"):
        check_command(["pdserve", "prefill", "--model", "default", "--no-such-flag", "1"])
    with pytest.raises(AssertionError, match="does not accept"):
        check_command(["pdserve", "router", "--pd-disaggregation", "--decode", "http://d:1", "--bogus"])
    with pytest.raises(AssertionError, match="not defined"):
        render(["--model", "$(NOT_SET)"], {})


def test_pods_run_unprivileged_and_no_volume_hides_the_image_cache():
    """The image's user (uid 10001) everywhere, no capabilities, no escalation; the model cache volume is
    HF_HOME, not the path where the image keeps its converted model and compiled kernels."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    image_cache = re.search(r"PDSERVE_CACHE=(\S+)", dockerfile).group(1)
    for docs in all_docs().values():
        for d, c in containers(docs):
            spec = d["spec"]["template"]["spec"]
            pod = spec.get("securityContext", {})
            assert pod.get("runAsNonRoot") is True and pod.get("runAsUser") == 10001, d["metadata"]["name"]
            sc = c.get("securityContext", {})
            assert sc.get("capabilities", {}).get("drop") == ["ALL"] \
                and not sc["capabilities"].get("add"), c["name"]
            assert sc.get("allowPrivilegeEscalation") is False, c["name"]
            for m in c.get("volumeMounts", []):
                assert not image_cache.startswith(m["mountPath"].rstrip("/") + "/") \
                    and m["mountPath"] != image_cache, \
                    f"{c['name']}: {m['mountPath']} hides the image's {image_cache}"


def test_the_image_is_cpu_only_unprivileged_and_builds_from_a_clean_context():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^USER 10001$", dockerfile, re.M), "the image runs as root"
    assert "download.pytorch.org/whl/cpu" in dockerfile and "torch==2.13.0" in dockerfile
    assert "gcc" in dockerfile  # the native kernels compile
    installs = " ".join(re.findall(r"pip install[^&]*", dockerfile))
    assert not re.search(r"nvidia-|cuda-|torch(?!==2\.13\.0)\S*cu\d", installs), installs
    ignored = set((DEPLOY.parent / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests", "bench/results"} <= ignored


def check_fields(value, type_name: str, where: str) -> None:
    """`value` against the Kubernetes API type `type_name` as the official client's models describe it
    (their openapi_types and attribute_map): an unknown field or a wrong type fails, which the client's
    own deserializer would let pass (it drops unknown fields)."""
    from kubernetes import client

    if type_name.lower().startswith("list["):
        assert isinstance(value, list), f"{where}: expected a list, got {value!r}"
        for i, x in enumerate(value):
            check_fields(x, type_name[5:-1], f"{where}[{i}]")
    elif type_name.lower().startswith(("dict(", "dict[")):
        assert isinstance(value, dict), f"{where}: expected a map, got {value!r}"
        inner = type_name[type_name.index(",") + 1:-1].strip()
        for k, x in value.items():
            check_fields(x, inner, f"{where}.{k}")
    elif type_name in ("str", "int", "bool", "float"):
        want = {"str": str, "int": int, "bool": bool, "float": (int, float)}[type_name]
        assert isinstance(value, want) and (type_name == "bool" or not isinstance(value, bool)), \
            f"{where}: expected {type_name}, got {value!r}"
    elif type_name == "object":  # int-or-string (ports), free-form
        assert isinstance(value, str | int | dict), f"{where}: {value!r}"
    else:
        model = getattr(client, type_name)
        assert isinstance(value, dict), f"{where}: expected a {type_name} object, got {value!r}"
        fields = {v: k for k, v in model.attribute_map.items()}
        for key, x in value.items():
            assert key in fields, f"{where}.{key}: not a field of {type_name}"
            check_fields(x, model.openapi_types[fields[key]], f"{where}.{key}")


def check_object(doc: dict, where: str) -> None:
    check_fields(doc, "V1" + doc["kind"], f"{where} {doc['kind']}/{doc['metadata']['name']}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_manifests_validate_against_the_kubernetes_schemas(variant):
    pytest.importorskip("kubernetes")
    docs = rendered(variant)
    assert {d["kind"] for d in docs} >= {"ConfigMap", "Service", "StatefulSet", "Deployment", "NetworkPolicy"}
    for d in docs:
        check_object(d, variant)
    if variant != "base":  # what an RDMA overlay is for: an HCA and IPC_LOCK for the node pods, devices set
        assert config_maps()[variant]["IB_DEVICE"]
        for d, c in containers(docs):
            if d["metadata"]["name"] in ("pdserve-prefill", "pdserve-decode"):
                assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
                assert c["resources"]["limits"]["rdma/hca_shared_devices_a"] == "1"
                assert c["resources"]["requests"]["memory"]  # the base's requests are kept


def test_the_schema_check_catches_a_misspelled_field_and_a_wrong_type():
    pytest.importorskip("kubernetes")
    base = rendered("base")
    sts = copy.deepcopy(next(d for d in base if d["kind"] == "StatefulSet"))
    sts["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(AssertionError, match="readinesProbe: not a field of V1Container"):
        check_object(sts, "test")
    sts = copy.deepcopy(next(d for d in base if d["kind"] == "StatefulSet"))
    sts["spec"]["replicas"] = "2"
    with pytest.raises(AssertionError, match="replicas: expected int"):
        check_object(sts, "test")
