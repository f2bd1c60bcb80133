"""Imports are layered: the IR imports nothing from code generation.

Why: the IR (mlso_cli/ir) is what every other part builds on, and code generation is built on
it. When ir/ reached up into codegen (lazily, for the shared-memory figure and CodegenError) a
change to the printers could change what the IR's checker accepted. The architecture check
lives in codegen now (codegen.budget, codegen.blockbuilder); this test keeps it there by parsing
every module under mlso_cli/ir, function bodies included, for an import of mlso_cli.codegen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mlso_cli

PACKAGE = Path(mlso_cli.__file__).parent
FORBIDDEN: dict[str, tuple[str, ...]] = {"ir": ("mlso_cli.codegen",)}
"""Layer (a folder under mlso_cli) -> module prefixes no module in it may import."""


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in the tree, at any depth, and of every
    importlib.import_module / __import__ call with a literal name."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against mlso_cli.<layer> by the caller's check
                base = "." * node.level + base
            out.append((node.lineno, base))
            out.extend((node.lineno, f"{base}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
            if name in ("import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    out.append((node.lineno, arg.value))
    return out


def _resolve(module: str, layer: str) -> str:
    if not module.startswith("."):
        return module
    dots = len(module) - len(module.lstrip("."))
    parts = ["mlso_cli", layer][: max(0, 2 - (dots - 1))]
    return ".".join(parts + [module.lstrip(".")]).rstrip(".")


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports_nothing_above_it(layer):
    files = sorted((PACKAGE / layer).rglob("*.py"))
    assert files, f"no modules under mlso_cli/{layer}"
    bad = []
    for path in files:
        for line, module in _imports(ast.parse(path.read_text(), str(path))):
            full = _resolve(module, layer)
            if any(full == p or full.startswith(p + ".") for p in FORBIDDEN[layer]):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {full}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_a_lazy_import():
    tree = ast.parse("def f():\n    from mlso_cli.codegen.errors import CodegenError\n")
    assert (2, "mlso_cli.codegen.errors") in _imports(tree)
    tree = ast.parse("import importlib\nimportlib.import_module('mlso_cli.codegen')\n")
    assert (2, "mlso_cli.codegen") in _imports(tree)
    assert _resolve("..codegen", "ir") == "mlso_cli.codegen"
