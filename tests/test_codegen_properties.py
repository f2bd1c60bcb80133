"""Properties of code generation over random spec-valid μGraphs (tests/graphgen.py).

Why: hand-written graphs test the spellings someone thought of. These generate hundreds (and,
in the slow variant, thousands) of graphs the spec accepts and check, for each:
  - codegen generates it, and the program run on the CPU emulator of the CUDA source agrees with
    the fp64 interpreter within a tolerance set by the least precise dtype (test_codegen_random's
    limits) or twice the error of the interpreter's float32 mode, which computes what codegen
    computes (its staging roundings included): an error the graph itself causes in any fp32
    program is not codegen's. That mode must itself stay within OWN_BOUND limits of fp64, so a
    wrong rewrite shared by codegen and the mode cannot hide behind it.
  - codegen.plan's shared-memory figure of each graph-defined kernel is spec.block_smem, the
    plan fits an arch iff the spec accepts the graph there, and generate allocates what the plan
    says.
A graph that fails is saved as JSON (its path is in the failure message); copy it into
tests/data/codegen_repros/, where test_codegen_repros.py keeps it as a regression test.

Timings (2 shared cores): the fast variant (FAST_COUNT graphs in two emulator binaries) ~30 s;
the slow one (SLOW_COUNT graphs, `make test-slow`) ~6 min.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from mlso_cli.codegen import CodegenError, generate, hostemu
from mlso_cli.codegen.arch import SMEM_BUDGET
from mlso_cli.codegen.budget import block_smem, problems
from mlso_cli.codegen.plan import plan
from mlso_cli.ir import DType, KernelGraph, Op, graph_hash
from mlso_cli.verify.interpreter import run
from tests import graphgen
from tests.helpers import fresh_cache
from tests.test_codegen_graphs import np_dtype, rel_error

F16, BF16, F32 = DType.F16, DType.BF16, DType.F32
LIMITS = {F16: 2e-3, BF16: 1e-2, F32: 1e-4}
"""Norm-wise relative error allowed, by the least precise storage dtype (test_codegen_random)."""
OWN_BOUND = 10
"""The interpreter's float32 mode may be at most this many limits away from fp64."""
FAST_SEED, FAST_COUNT = 2024, 100
SLOW_SEED, SLOW_COUNT, SLOW_BATCH = 7, 2000, 250
REPRO_DIR = Path(__file__).resolve().parent / "data" / "codegen_repros"


# ---- checking one program ------------------------------------------------------------------------


def mismatch(kg: KernelGraph, ins: list[np.ndarray], got: list[np.ndarray]) -> str | None:
    """Why the emulator's outputs `got` are wrong for kg on `ins`, or None when they are right."""
    want = run(kg, ins, "float64")
    own = run(kg, ins, "float32")
    limit = LIMITS[graphgen.least_precise(kg)]
    for k, (g, w, f, node) in enumerate(zip(got, want, own, kg.outputs)):
        # ml_dtypes.finfo knows bfloat16 in every ml_dtypes version; numpy's finfo only where
        # ml_dtypes (0.7 on) registers it
        big = float(ml_dtypes.finfo(np_dtype(node.dtype)).max)
        if not (np.isfinite(w).all() and np.abs(w).max(initial=0) <= big):
            return (
                f"output {k}: the fp64 reference does not fit {node.dtype.value} (a generator bug)"
            )
        e_own = rel_error(f, w)
        if not e_own <= OWN_BOUND * limit:
            return f"output {k}: the float32 mode is {e_own:.2e} from fp64 (bound {OWN_BOUND * limit:.0e})"
        err = rel_error(g, w)
        if not err <= max(limit, 2 * e_own):
            return f"output {k}: relative error {err:.2e} (limit {limit:.0e}, float32 mode {e_own:.2e})"
    return None


def save_repro(g: graphgen.Generated, seed: int, why: str, where: Path) -> Path:
    """The failing graph as a repro file (the format test_codegen_repros.py loads)."""
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{g.name.split('[')[0]}_{graph_hash(g.kg)[:12]}.json"
    path.write_text(json.dumps({**graphgen.describe(g), "seed": seed, "why": why}, indent=1) + "\n")
    return path


def emulate(
    cases: list[tuple[graphgen.Generated, int]], repro_dir: Path, binaries: int = 2
) -> list[str]:
    """Generate, emulate and check every (graph, input seed); one line per failure (repro saved)."""
    failures: list[str] = []

    def fail(i: int, why: str) -> None:
        g, seed = cases[i]
        failures.append(f"{g.name}: {why} [saved as {save_repro(g, seed, why, repro_dir)}]")

    programs = {}
    for i, (g, _) in enumerate(cases):
        try:
            programs[f"g{i}"] = generate(g.kg)
        except CodegenError as exc:
            fail(i, f"codegen refused a spec-valid graph: {exc}")
    emu = hostemu.Bundle(programs, binaries=binaries)
    for i, (g, seed) in enumerate(cases):
        if f"g{i}" not in programs:
            continue
        ins = graphgen.inputs_for(g.kg, seed)
        try:
            why = mismatch(g.kg, ins, emu.run(f"g{i}", ins))
        except RuntimeError as exc:  # the emulated program crashed
            why = str(exc)[:500]
        if why is not None:
            fail(i, why)
    return failures


@pytest.fixture(scope="module")
def emu_cache(tmp_path_factory) -> Iterator[None]:
    """A fresh emulator cache (so timings include the compiles), unless MLSO_CACHE_DIR is set."""
    with fresh_cache(tmp_path_factory):
        yield


def _cases(seed: int, count: int) -> list[tuple[graphgen.Generated, int]]:
    return [(g, seed * 100_003 + i) for i, g in enumerate(graphgen.seeded(seed, count))]


# ---- the emulator property ---------------------------------------------------------------------


def test_generated_graphs_match_float64_on_the_emulator(emu_cache, tmp_path):
    cases = _cases(FAST_SEED, FAST_COUNT)
    # the batch covers what it claims to: every family and dtype, splits, both attention phases,
    # and the register-resident online softmax
    names = [g.name for g, _ in cases]
    assert Counter(n.split("[")[0] for n in names).keys() == graphgen.FAMILIES.keys()
    assert {graphgen.least_precise(g.kg) for g, _ in cases} == {F16, BF16, F32}
    assert any("split=2" in n for n in names) and any(n.startswith("split_k") for n in names)
    assert any("phase=pre" in n for n in names) and any("phase=loop" in n for n in names)
    assert (
        sum(
            any(k.layout is not None and k.layout.register_path for k in plan(g.kg).kernels)
            for g, _ in cases
        )
        >= 3
    )
    failures = emulate(cases, tmp_path / "repros")
    assert not failures, f"{len(failures)} of {len(cases)} generated graphs fail:\n" + "\n".join(
        failures
    )


@pytest.mark.slow
def test_thousands_of_generated_graphs_match_float64_on_the_emulator(emu_cache, tmp_path):
    cases = _cases(SLOW_SEED, SLOW_COUNT)
    failures: list[str] = []
    for start in range(0, len(cases), SLOW_BATCH):
        failures += emulate(cases[start : start + SLOW_BATCH], tmp_path / "repros")
    assert not failures, f"{len(failures)} of {len(cases)} generated graphs fail:\n" + "\n".join(
        failures
    )


def test_the_check_rejects_wrong_outputs():
    """mismatch() is what the properties rest on: it must accept fp64's own answer and reject
    answers off by a few limits, or with rows swapped (a tile saved in the wrong place)."""
    checked = 0
    for g in graphgen.seeded(FAST_SEED + 1, 12):
        ins = graphgen.inputs_for(g.kg, 0)
        want = run(g.kg, ins, "float64")
        assert mismatch(g.kg, ins, want) is None, g.name
        if not any(np.any(w != 0) for w in want):
            continue  # a random walk may cancel to zero: nothing to scale
        checked += 1
        limit = LIMITS[graphgen.least_precise(g.kg)]
        assert mismatch(g.kg, ins, [w * (1 + 3 * OWN_BOUND * limit) for w in want]) is not None, (
            g.name
        )
        k = max(range(len(want)), key=lambda i: float(np.ptp(want[i])))
        rows = [w.copy() for w in want]
        rows[k] = np.roll(rows[k], 1, axis=0 if rows[k].shape[0] > 1 else -1)
        if not np.allclose(rows[k], want[k]):
            assert mismatch(g.kg, ins, rows) is not None, g.name
    assert checked >= 8


# ---- the plan property -------------------------------------------------------------------------


def _graph_defs(kg: KernelGraph) -> list:
    return [n for n in kg.nodes() if n.op is Op.GRAPH_DEF]


def _plan_agrees_with_the_spec(kg: KernelGraph) -> dict[str, bool]:
    """Asserts the plan property for each arch; returns arch -> whether the spec accepts kg."""
    valid = {}
    for arch in ("sm_90", "sm_80"):
        p = plan(kg, arch)
        layouts = [k.layout for k in p.kernels if k.layout is not None]
        gds = _graph_defs(kg)
        assert sorted(lay.smem for lay in layouts) == sorted(
            block_smem(gd.arg, gd.src, arch) for gd in gds
        )
        ok = not problems(kg, arch)
        assert all(lay.fits for lay in layouts) == ok
        assert ok == all(lay.smem <= SMEM_BUDGET[arch] for lay in layouts)
        valid[arch] = ok
    assert valid["sm_90"]  # the generator builds within sm_90's budget
    generated = sorted(k.smem for k in generate(kg).kernels if k.what.startswith("graph-defined"))
    assert generated == sorted(k.layout.smem for k in plan(kg).kernels if k.layout is not None)
    return valid


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphgen.graphs(small=False))
def test_plan_smem_is_the_spec_figure_and_fits_iff_the_spec_accepts(g):
    _plan_agrees_with_the_spec(g.kg)


def test_the_plan_property_sees_both_sides_of_a_budget():
    """Seeded big graphs: some are too big for sm_80 and the plan says so, the rest fit."""
    seen = Counter(
        _plan_agrees_with_the_spec(g.kg)["sm_80"] for g in graphgen.seeded(11, 60, small=False)
    )
    assert seen[True] > 0 and seen[False] > 0
