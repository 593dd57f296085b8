"""Import rules of the layers. From the top: the node roles (prefill_node/, decode_node/), the PD role layer
they share (disaggregation/), the KV transfer (transfer/), the engine (common/). A layer imports only those
below it: common/ no layer above it (it names a role's scheduler and flag rules by import path), transfer/
neither the roles nor the scheduler. No module of common/server imports one that imports it back, and the
router stays torch-free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path, package: str = "") -> set[str]:
    """Modules of `package` (all: "") that a file imports (at the top or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in out if not package or m.startswith(package + ".")}


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_layers_import_only_those_below():
    above_transfer = ("disaggregation", "prefill_node", "decode_node", "common.scheduler")
    rules = [("common", ("transfer", "disaggregation", "prefill_node", "decode_node")),
             ("transfer", above_transfer),
             ("disaggregation", ("prefill_node", "decode_node"))]
    wrong = []
    for layer, banned in rules:
        for path in sorted((ROOT / layer).rglob("*.py")):
            bad = sorted(m for m in _imports(path) if _under(m, banned))
            if bad:
                wrong.append(f"{path.relative_to(ROOT)} imports {', '.join(bad)}")
    assert not wrong, "\n".join(wrong)


def test_checking_a_pd_nodes_flags_loads_neither_torch_nor_transfer():
    code = ("import sys; from common.config import ServerArgs; "
            "[ServerArgs(disaggregation_mode=m).validate() for m in ('null', 'prefill', 'decode')]; "
            "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transfer'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == []


def test_common_server_has_no_import_cycle():
    package = "common.server"
    graph = {f"{package}.{p.stem}": _imports(p, package) for p in (ROOT / "common" / "server").glob("*.py")}
    graph = {m: deps & graph.keys() for m, deps in graph.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for dep in graph[start] - seen:
            seen.add(dep)
            if dep == goal or reaches(dep, goal, seen):
                return True
        return False

    cycles = [m for m in graph if reaches(m, m, set())]
    assert not cycles, f"modules on an import cycle: {sorted(cycles)}"


def test_router_imports_no_torch():
    code = ("import sys, router.app, router.cli; "
            "assert 'torch' not in sys.modules, 'the router imported torch'; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('common'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # common/server/security.py (keys, TLS), openapi.py (route tables) and data_parallel.py (DP group choice)
    # are torch-free and shared with nodes, as are common/api_fields.py (the request field table) and
    # common/sampling_defaults.py (which common/openai_params.py applies)
    assert set(out.stdout.split()) <= {"common", "common.protocol",
                                       "common.api_fields", "common.openai_params",
                                       "common.sampling_defaults", "common.log",
                                       "common.server", "common.server.security", "common.server.openapi",
                                       "common.server.data_parallel",
                                       "common.cluster_secret", "common.version", "common.fingerprint"}
