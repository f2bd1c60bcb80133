"""optimize runs the verification library on what it is about to write (pipeline/verifying.py).

Why: optimize used to check less than `mlso verify` (the search's field check only), so it could
write a model that mlso's own check refuses. Each test injects a program or a code generation
bug that the search's check cannot see, and shows that the region is kept original with the
reason, that the bound written is the one obtained, and that verify accepts what was written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from mlso_cli.cli import main
from mlso_cli.package import META_BOUND, write_model_atomic
from mlso_cli.pipeline import PipelineOptions, optimize
from mlso_cli.search.api import Candidate, SearchOptions, SearchResult
from mlso_cli.search.cost import program_cost
from tests.fixtures.ugraphs import SMALL_FIXTURES
from tests.helpers import SMALL

NAME = "rmsnorm_linear"
SRC = next(p for p in SMALL if p.stem == NAME)


class FixtureSearch:
    """Returns the hand-written fused program claiming a search bound, and the target."""

    def __init__(self, program=None, bound: float = 2.0**-62, lifted_bound: float = 0.0) -> None:
        self.program, self.bound, self.lifted_bound = program, bound, lifted_bound
        self.__qualname__ = "FixtureSearch"

    def __call__(self, target, options: SearchOptions, progress=None) -> SearchResult:
        lifted = Candidate(
            target, program_cost(target).us, program_cost(target).launches, self.lifted_bound
        )
        cands = (lifted,)
        if self.program is not None:
            p = self.program
            cands = (Candidate(p, program_cost(p).us, program_cost(p).launches, self.bound), lifted)
        return SearchResult(cands, 10, 2, 1, 0.01, self.bound, False, ())


def _opts(tmp_path: Path, **kw) -> PipelineOptions:
    return PipelineOptions(
        search=SearchOptions(max_states=10, seed=0),
        min_speedup=0.0,
        cache_dir=tmp_path / "search-cache",
        use_cache=False,
        **kw,
    )


def _kernels(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == "ai.mlso"]


def _verify(a, b) -> tuple[int, list[dict], str]:
    args = ["verify", str(a), str(b), "--samples", "1", "--trust-binary", "--json"]
    res = CliRunner().invoke(main, args)
    rows = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    return res.exit_code, rows, res.stderr


def test_a_code_generation_bug_is_kept_original_not_written(tmp_path, monkeypatch):
    """codegen divides rmsnorm's sum of squares by 6.4 instead of 64. The search's field check
    compares μGraphs and cannot see it; the emulator, run before writing, does. The region is
    kept original with the reason, and what is written passes verify."""
    import mlso_cli.codegen as codegen

    right = codegen.generate

    def wrong(kg, *args, **kwargs):
        gp = right(kg, *args, **kwargs)
        return dataclasses.replace(gp, source=gp.source.replace("1.5625e-2f", "1.5625e-1f"))

    monkeypatch.setattr(codegen, "generate", wrong)
    fused = SMALL_FIXTURES[NAME]()
    out = optimize(str(SRC), None, _opts(tmp_path), search=FixtureSearch(fused))
    (rep,) = out.regions
    assert not rep.choice.packaged
    assert "verification before writing refused its program" in rep.choice.why
    assert "host emulator" in rep.choice.why
    assert _kernels(out.model) == [] and out.bound == 0.0
    monkeypatch.setattr(codegen, "generate", right)
    path = tmp_path / "o.onnx"
    write_model_atomic(out.model, str(path), input_path=str(SRC))
    code, _, err = _verify(SRC, path)
    assert code == 0, err


def test_a_wrong_program_the_search_vouched_for_is_kept_original(tmp_path):
    """A search result (here a stand-in) that claims a bound for a program computing another
    function: the field check before writing finds the witness."""
    other = SMALL_FIXTURES["rmsnorm_linear"]()
    # the same interface, another function: the mean of squares divided by 32, not 64
    from mlso_cli.ir.serialize import dumps, loads

    text = dumps(other)
    assert '"arg":"1/64"' in text
    wrong = loads(text.replace('"arg":"1/64"', '"arg":"1/32"'))
    out = optimize(str(SRC), None, _opts(tmp_path), search=FixtureSearch(wrong))
    (rep,) = out.regions
    assert not rep.choice.packaged, rep.choice.why
    assert "does not compute its region" in rep.choice.why


def test_an_unbounded_program_is_never_chosen(tmp_path, monkeypatch):
    """Where the field check cannot bound a program (per-trial bound 1), the select stage
    finds out before it chooses it: the region is kept original with that reason, and no
    bound of 0 is written for a program that was never verified."""
    import mlso_cli.verify.equivalence as equivalence

    monkeypatch.setattr(equivalence, "trial_bound", lambda *a, **k: 1.0)
    out = optimize(str(SRC), None, _opts(tmp_path), search=FixtureSearch())
    (rep,) = out.regions
    assert not rep.choice.packaged
    assert "cannot bound it" in rep.choice.why
    assert _kernels(out.model) == []


@pytest.mark.slow  # 11 s: a whole optimize; CI runs it in test-slow
def test_kernel_names_are_region_ids_in_model_report_and_table(tmp_path, monkeypatch):
    """The MlsoKernel node of region r is mlso_region_<r> in the model, in optimize's --json
    and in verify's report, even when a region before it is kept original (packaged regions
    were renumbered from 0, so verify's mlso_region_0 was optimize's region 1)."""
    import mlso_cli.verify.equivalence as equivalence
    from mlso_cli.commands.optimize import _region_row
    from tests.helpers import MODELS

    src = MODELS / "transformer_tiny.onnx"
    first = []
    real = equivalence.unbounded

    def unbounded_first(a, b, **kw):
        first.append(a) if not first else None
        return "stand-in: unbounded" if a == first[0] else real(a, b, **kw)

    monkeypatch.setattr(equivalence, "unbounded", unbounded_first)
    out = optimize(
        str(src), {"hidden": (1, 16, 64)}, _opts(tmp_path), search=FixtureSearch(lifted_bound=0.0)
    )
    assert not out.regions[0].choice.packaged
    packaged = [r.choice.region for r in out.regions if r.choice.packaged]
    assert packaged and packaged[0] > 0
    names = sorted(n.name for n in _kernels(out.model))
    assert names == sorted(f"mlso_region_{r}" for r in packaged)
    rows = [_region_row(r) for r in out.regions]
    assert sorted(r["node"] for r in rows if r["packaged"]) == names
    path = tmp_path / "t.onnx"
    write_model_atomic(out.model, str(path), input_path=str(src))
    res = CliRunner().invoke(
        main,
        ["verify", str(src), str(path), "--input-shape", "hidden=1,16,64", "--samples", "1"]
        + ["--scales", "1", "--trust-binary", "--no-emulate", "--json"],
    )
    assert res.exit_code == 0, res.stderr
    got = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert sorted(r["node"] for r in got if r["type"] == "kernel") == names
    meta = {p.key: p.value for p in out.model.metadata_props}
    assert float(meta[META_BOUND]) == out.bound > 0


@pytest.mark.slow
def test_optimize_then_verify_on_the_transformer_passes(tmp_path):
    """The real search on the transformer demo: whatever optimize writes, verify accepts."""
    from tests.helpers import MODELS, run_cli

    out = tmp_path / "t.onnx"
    r = run_cli(
        "optimize",
        str(MODELS / "transformer_tiny.onnx"),
        "-o",
        str(out),
        "--input-shape",
        "hidden=1,16,64",
        "--max-states",
        "2000",
        "--min-speedup",
        "0",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    summary = rows[-1]
    r = run_cli(
        "verify",
        str(MODELS / "transformer_tiny.onnx"),
        str(out),
        "--input-shape",
        "hidden=1,16,64",
        "--samples",
        "1",
        "--trust-binary",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    vsum = json.loads(r.stdout.splitlines()[-1])
    assert vsum["kernels"] == summary["packaged"]
    assert (vsum["false_accept_bound"] is None) == (summary["packaged"] == 0)


def test_a_model_onnx_runtime_cannot_load_is_checked_kernel_by_kernel(tmp_path):
    """An op of an unknown domain (com.example::FancyOp) after the attention: ONNX Runtime
    cannot run the model, so no whole-model comparison is possible for any B; optimize still
    checks each kernel (field, float, lifting, emulator) and packages what passes."""
    from tests.helpers import attention_model, save

    src = save(attention_model(extra_unknown=True), tmp_path / "u.onnx")
    out = optimize(str(src), None, _opts(tmp_path), search=FixtureSearch(lifted_bound=1e-20))
    packaged = [r.choice for r in out.regions if r.choice.packaged]
    assert packaged and all(c.bound is not None and c.bound > 0 for c in packaged)
    assert len(_kernels(out.model)) == len(packaged)
