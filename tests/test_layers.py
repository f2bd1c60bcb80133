"""Import arrows between layers run one way: a lower layer never imports a higher one.

Why a test: verify/ once imported bench's `region_model` (model surgery) and frontend/lift.py
verify's constants; both arrows ran back up, so optimize could not call the checks without
pulling in the benchmark harness. The table says which packages each may not import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "mlso_cli"

FORBIDDEN = {
    "verify": ("mlso_cli.bench", "mlso_cli.commands", "mlso_cli.pipeline"),
    "frontend": ("mlso_cli.verify", "mlso_cli.bench", "mlso_cli.commands", "mlso_cli.pipeline"),
    "ir": ("mlso_cli.verify", "mlso_cli.frontend", "mlso_cli.bench", "mlso_cli.search"),
    "package": ("mlso_cli.bench", "mlso_cli.commands", "mlso_cli.verify"),
}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_arrow_runs_back_up(layer: str) -> None:
    bad = [
        f"{path.relative_to(ROOT)} imports {mod}"
        for path in sorted((ROOT / layer).rglob("*.py"))
        for mod in sorted(_imports(path))
        if mod.startswith(FORBIDDEN[layer])
    ]
    assert bad == []


def test_region_model_lives_in_package() -> None:
    from mlso_cli.bench import harness
    from mlso_cli.package import regionmodel

    assert harness.region_model is regionmodel.region_model
