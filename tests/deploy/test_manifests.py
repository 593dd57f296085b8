"""Every Kubernetes manifest and multi-machine example in deploy/ loads, and every container / script
command runs a real `pdserve` subcommand with flags its parser accepts (values rendered from the
ConfigMap or env file, then parsed and validated by the same code the command runs)."""

from __future__ import annotations

import argparse
import re
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


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_docs() -> dict[str, list[dict]]:
    return {str(p.relative_to(DEPLOY)): load_docs(p) for p in sorted(K8S.rglob("*.yaml"))}


def config_maps() -> dict[str, dict]:
    """file -> the pdserve-config data it defines (configmap.yaml and each values/*.yaml)."""
    out = {}
    for name, docs in all_docs().items():
        for d in docs:
            if d.get("kind") == "ConfigMap" and d["metadata"]["name"] == "pdserve-config":
                out[name] = d["data"]
    return out


def containers(docs: list[dict]):
    for d in docs:
        if d.get("kind") not in WORKLOADS:
            continue
        spec = d["spec"] if d["kind"] == "Pod" else d["spec"]["template"]["spec"]
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            yield d, c


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


@pytest.mark.parametrize("values", ["k8s/configmap.yaml", "k8s/values/mooncake.yaml", "k8s/values/nixl.yaml"])
def test_container_commands_use_only_accepted_flags(values):
    env = config_maps()[values]
    seen = {}
    for docs in all_docs().values():
        for d, c in containers(docs):
            cenv = dict(env)
            cenv.update({e["name"]: str(e.get("value", "")) for e in c.get("env", []) if "value" in e})
            argv = render(list(c.get("command", [])) + [str(a) for a in c.get("args", [])], cenv)
            role, parsed = check_command(argv)
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
        assert spec.url.startswith(f"http://{host}:") and spec.bootstrap_port == pargs.disaggregation_bootstrap_port
    for i, url in enumerate(router_cfg.decode):
        assert url.startswith(f"http://{decode_set['metadata']['name']}-{i}.{decode_set['spec']['serviceName']}:")


def test_probes_ports_and_resources():
    docs = {Path(n).name: ds for n, ds in all_docs().items()}
    services = {d["metadata"]["name"]: d for ds in docs.values() for d in ds if d["kind"] == "Service"}
    env = config_maps()["k8s/configmap.yaml"]
    for name in ("prefill.yaml", "decode.yaml", "router.yaml"):
        for d, c in containers(docs[name]):
            probe = c["readinessProbe"]["httpGet"]
            assert probe["path"] == "/health"
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert probe["port"] in ports
            assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
            role, parsed = check_command(render(c["command"] + [str(a) for a in c["args"]], env))
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


def test_multi_machine_examples():
    env = {}
    for line in (EXAMPLES / "cluster.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    roles = {}
    for script in sorted(EXAMPLES.glob("*.sh")):
        text = script.read_text()
        assert text.startswith("#!/usr/bin/env bash") and "cluster.env" in text
        cmds = script_commands(script, env)
        assert len(cmds) == 1, f"{script.name}: one launch command per machine"
        role, parsed = check_command(cmds[0])
        roles.setdefault(role, []).append(parsed)
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
