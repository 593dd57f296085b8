"""The suite's own rules: no test imports bench/ (the benches' tests are in bench/tests; what both use
lives in common/ or tests/harness/), and a unit test that starts a process or serves on a socket fails
(tests/unit/conftest.py)."""

from __future__ import annotations

import ast
import multiprocessing
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.conftest import ProcessInUnitTest

TESTS = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_no_test_imports_bench():
    found = {str(path.relative_to(TESTS.parent)): sorted(m for m in imported_modules(path)
                                                         if m == "bench" or m.startswith("bench."))
             for path in sorted(TESTS.rglob("*.py"))}
    assert not {path: mods for path, mods in found.items() if mods}


def test_the_import_check_sees_a_bench_import(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text("def test():\n    from bench.serve import summarize\n")
    assert "bench.serve" in imported_modules(path)


def test_a_subprocess_fails_a_unit_test():
    with pytest.raises(ProcessInUnitTest, match="tests/integration"):
        subprocess.run([sys.executable, "-c", "pass"])


def test_a_multiprocessing_process_fails_a_unit_test():
    with pytest.raises(ProcessInUnitTest):
        multiprocessing.get_context("spawn").Process(target=print).start()


def test_a_listening_socket_fails_a_unit_test():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        with pytest.raises(ProcessInUnitTest):
            s.listen()
