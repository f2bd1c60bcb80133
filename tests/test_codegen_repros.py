"""Every saved code generation repro (tests/data/codegen_repros/*.json) as a regression test.

Why: a generated graph that code generation got wrong is worth keeping after its bug is fixed,
and worth tracking while it is not (a record with "xfail" is a strict xfail: fixing the bug
makes the test fail until the mark is removed). The first case writes a fresh generated graph
in the repro format and loads it back the same way, so the format and the loader are tested
even while the directory holds no repro.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlso_cli.codegen import generate, hostemu
from mlso_cli.ir import check, serialize
from tests import graphgen
from tests.test_codegen_properties import REPRO_DIR, emu_cache, mismatch, save_repro

__all__ = ["emu_cache"]  # the fixture, imported for pytest


def _params() -> list:
    out = [pytest.param(None, id="format-roundtrip")]
    for path in sorted(REPRO_DIR.glob("*.json")):
        reason = json.loads(path.read_text()).get("xfail")
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        out.append(pytest.param(path, id=path.stem, marks=marks))
    return out


def check_repro(path: Path) -> None:
    """The record's graph is still spec-valid, generates, and matches fp64 on the emulator."""
    rec = json.loads(path.read_text())
    kg = check(serialize.from_dict(rec["graph"]))
    ins = graphgen.inputs_for(kg, rec["seed"])
    why = mismatch(kg, ins, hostemu.run(generate(kg), ins))
    assert why is None, f"{path.name} ({rec['name']}): {why}"


@pytest.mark.parametrize("path", _params())
def test_saved_repro_generates_and_matches_float64(path, emu_cache, tmp_path):
    if path is None:
        g = graphgen.seeded(5, 1)[0]
        path = save_repro(g, 3, "format check", tmp_path)
        assert serialize.from_dict(json.loads(path.read_text())["graph"]) == g.kg
    check_repro(path)
