"""The import structure of docs/architecture.md, held: no import cycle, no function-local import of a ckptdoctor
module outside the Click layer (but for the listed ones), every module in a layer of the contract, and no
heavy third-party package imported by importing ckptdoctor. Fast: no torch, one child interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
import tomllib
from conftest import REPO

PACKAGE = REPO / "ckptdoctor"

# Function-local imports of ckptdoctor modules outside commands/ and cli.py: (importer, imported) -> why. Only for
# keeping torch, numpy, fsspec or MSC unimported until needed (no ckptdoctor module imports them at module level
# today, so none is needed); a lazy import that only breaks a cycle hides it: move the shared piece lower.
ALLOWED_LOCAL_IMPORTS: dict[tuple[str, str], str] = {}

# Imported by nothing of ckptdoctor at module level (the C extensions and the metadata reads need none of them).
HEAVY = ("torch", "numpy", "megatron", "fsspec", "multistorageclient", "yaml")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    # every import: module level, function-local and under TYPE_CHECKING
    return grimp.build_graph("ckptdoctor", include_external_packages=False, cache_dir=None)


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle(graph):
    cycles = _cycles(graph)
    assert not cycles, "import cycles (function-local and TYPE_CHECKING imports count): " + "; ".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_finder_finds_a_cycle():
    g = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c"):
        g.add_module(module)
    g.add_import(importer="p.a", imported="p.b")
    g.add_import(importer="p.b", imported="p.a")
    g.add_import(importer="p.c", imported="p.a")
    assert _cycles(g) == [["p.a", "p.b"]]


def _local_imports(path: Path, modules: set[str], source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of each import of a ckptdoctor module inside a function of ``path`` (or of ``source``, as if
    it were that file)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if in_function and isinstance(child, ast.Import):
                found.extend((child.lineno, a.name) for a in child.names if a.name.split(".")[0] == "ckptdoctor")
            elif in_function and isinstance(child, ast.ImportFrom):
                if child.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - child.level + 1])
                    source = f"{base}.{child.module}" if child.module else base
                else:
                    source = child.module or ""
                if source.split(".")[0] == "ckptdoctor":
                    for alias in child.names:  # `from ckptdoctor.formats import torch_dist` names a module
                        imported = f"{source}.{alias.name}"
                        found.append((child.lineno, imported if imported in modules else source))
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8") if source is None else source), False)
    return found


def test_function_local_imports_only_in_the_click_layer(graph):
    modules = set(graph.modules)
    unlisted = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        if name == "ckptdoctor.cli" or name.startswith("ckptdoctor.commands"):
            continue  # commands import their operation when they run (start-up time)
        for line, imported in _local_imports(path, modules):
            if (name, imported) not in ALLOWED_LOCAL_IMPORTS:
                unlisted.append(f"{path.relative_to(REPO)}:{line} imports {imported} inside a function")
    assert not unlisted, "\n".join(unlisted)


def test_the_local_import_finder_sees_relative_and_nested_imports():
    source = (
        "import ckptdoctor.errors\n"
        "def f():\n"
        "    from ckptdoctor.formats import torch_dist\n"
        "    def g():\n"
        "        from . import check\n"
        "        import ckptdoctor.locate\n"
        "    return lambda: None\n"
    )
    modules = {"ckptdoctor.formats.torch_dist", "ckptdoctor.ops.check"}
    assert _local_imports(PACKAGE / "ops" / "example.py", modules, source) == [
        (3, "ckptdoctor.formats.torch_dist"),
        (5, "ckptdoctor.ops.check"),
        (6, "ckptdoctor.locate"),
    ]


def _contracts() -> list[dict]:
    return tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]["contracts"]


def _layer_entries(contract: dict) -> list[str]:
    container = contract.get("containers", [None])[0]
    entries = []
    for layer in contract["layers"]:
        for entry in layer.replace("|", ":").split(":"):
            entry = entry.strip().removesuffix("(optional)").strip()
            entries.append(f"{container}.{entry}" if container else entry)
    return entries


def test_every_module_is_in_a_layer(graph):
    """The package's layers (docs/architecture.md) name every module; ops' families name every part of ops."""
    contracts = [c for c in _contracts() if c["type"] == "layers"]
    main = next(c for c in contracts if not c.get("containers"))
    entries = _layer_entries(main)
    outside = [
        m
        for m in sorted(graph.modules)
        if m != "ckptdoctor" and not any(m == e or m.startswith(e + ".") for e in entries)
    ]
    assert not outside, f"modules in no layer of the contract in pyproject.toml: {outside}"

    ops = next(c for c in contracts if c.get("containers") == ["ckptdoctor.ops"])
    ops_entries = set(_layer_entries(ops))
    parts = {".".join(m.split(".")[:3]) for m in graph.modules if m.startswith("ckptdoctor.ops.")}
    assert parts <= ops_entries, f"parts of ops in no layer of ops' contract: {sorted(parts - ops_entries)}"


def test_importing_ckptdoctor_imports_nothing_heavy():
    """Every module of the package imported (a metadata read's as much as diff --values's): torch, numpy, fsspec,
    MSC and PyYAML stay unimported until a function needs them."""
    code = (
        "import importlib, pkgutil, sys, ckptdoctor\n"
        "for m in pkgutil.walk_packages(ckptdoctor.__path__, 'ckptdoctor.'):\n"
        "    if m.name not in ckptdoctor.NATIVE_MODULES or ckptdoctor.native(m.name):  # built, not blocked\n"
        "        importlib.import_module(m.name)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
