"""Import rules of the HTTP layers: no module of common/server imports one that imports it back, and the
router stays torch-free."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path, package: str) -> set[str]:
    """Modules of `package` that a file imports (at the top or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in out if m.startswith(package + ".")}


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
    # are torch-free and shared with nodes, as is common/api_fields.py (the request field table)
    assert set(out.stdout.split()) <= {"common", "common.protocol", "common.api_fields", "common.openai_params",
                                       "common.log",
                                       "common.server", "common.server.security", "common.server.openapi",
                                       "common.server.data_parallel",
                                       "common.cluster_secret", "common.version", "common.fingerprint"}
