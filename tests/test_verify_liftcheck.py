"""verify's checks that do not go through the lifter (mlso_cli/verify/liftcheck.py).

The lifting check compares each kernel's μGraph (fp64) with onnx's reference evaluator on its
original nodes and its constants with A's values; the emulator check runs its generated source
on the CPU. The attacks simulate the bugs the other checks cannot see: a lifting rule that is
wrong on both sides of the field check, a constant altered where kernel and fallback body both
read it, and a code generation bug that the chain check regenerates faithfully.

Packaged models carry a placeholder binary and are verified with --trust-binary (no nvcc time);
the runs that monkeypatch mlso go through click's CliRunner, in this process.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper

from mlso_cli.cli import main
from mlso_cli.verify import liftcheck
from tests.fixtures.packaging import package_fixture, placeholder
from tests.fixtures.ugraphs import SMALL_FIXTURES
from tests.helpers import MODELS, run_cli

CHECKS = ("chain", "field", "float", "lifting", "emulator", "ort")


def _small(name: str):
    return MODELS / "small" / f"{name}.onnx"


def _package(a_path, program, out):
    onnx.save(package_fixture(a_path, program, placeholder(program)), str(out))
    return out


def _verify(a, b, *extra: str):
    """verify in this process (monkeypatches apply); the result and its JSON rows."""
    args = ["verify", str(a), str(b), "--samples", "1", "--scales", "1", "--trust-binary"]
    res = CliRunner().invoke(main, [*args, "--json", "--seed", "5", *extra])
    rows = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    return res, rows


def _one(rows, kind: str) -> dict:
    (row,) = [r for r in rows if r["type"] == kind]
    return row


def _failed_cleanly(res) -> str:
    """Exit 3 through the CLI's error path: one error line, no exception escaped."""
    assert res.exit_code == 3, (res.exit_code, res.stderr, res.exception)
    assert isinstance(res.exception, SystemExit)
    assert "Traceback" not in res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.startswith("mlso: error:")]
    return line


def _lifted(path) -> onnx.ModelProto:
    """The unfused lifted graph of a one-region model: a valid μGraph (it generates code)."""
    from mlso_cli.frontend.lift import lift_whole_graph
    from mlso_cli.frontend.load import load_model

    return lift_whole_graph(load_model(str(path))).graph


# ---- a correct B passes, and the report says which checks ran --------------------------------


def test_a_correct_kernel_passes_every_check_and_the_report_says_which_ran(tmp_path):
    """rmsnorm_linear: a weight input (gamma) and constants absorbed into the body (axes, eps)."""
    b = _package(_small("rmsnorm_linear"), SMALL_FIXTURES["rmsnorm_linear"](), tmp_path / "b.onnx")
    r = run_cli(
        "verify",
        str(_small("rmsnorm_linear")),
        str(b),
        "--samples",
        "1",
        "--trust-binary",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    checks = _one(rows, "kernel_checks")
    assert all(checks[c].startswith("ok") for c in CHECKS), checks
    assert "binary not checked (--trust-binary)" in checks["chain"]
    for kind in ("random", "large(x1000)", "cancel(x1000)", "offset(+100)"):
        assert kind in checks["lifting"] and kind in checks["emulator"]
    assert checks["lifting_error"] <= liftcheck.FP64_TOLERANCE
    assert checks["emulator_error"] <= 1e-5
    summary = rows[-1]
    assert summary["pass"] and summary["lifting_checked"] == 1 and summary["emulated"] == 1


def test_skipped_checks_say_why(tmp_path, monkeypatch):
    a = _small("gated_mlp")
    b = _package(a, SMALL_FIXTURES["gated_mlp"](), tmp_path / "b.onnx")
    res, rows = _verify(a, b, "--no-lift", "--no-emulate", "--no-field")
    assert res.exit_code == 0, res.stderr
    checks = _one(rows, "kernel_checks")
    assert checks["lifting"] == "skipped: --no-lift"
    assert checks["emulator"] == "skipped: --no-emulate"
    assert checks["field"] == "skipped: --no-field" and checks["float"].startswith("skipped")
    assert rows[-1]["lifting_checked"] == 0 and rows[-1]["emulated"] == 0
    # above the size limits: said with the numbers; the constants are still compared
    monkeypatch.setattr(liftcheck, "LIFT_CHECK_ELEMENTS", 100)
    res, rows = _verify(a, b, "--no-field")
    assert res.exit_code == 0, res.stderr
    checks = _one(rows, "kernel_checks")
    assert (
        checks["lifting"].startswith("skipped: ")
        and "(limit 100); constants compared" in (checks["lifting"])
    )
    assert checks["emulator"].startswith("skipped: ") and "(limit 100)" in checks["emulator"]
    monkeypatch.setattr(liftcheck, "LIFT_CHECK_ELEMENTS", 1 << 22)
    monkeypatch.setattr(liftcheck, "EMULATOR_THREADS", 64)
    res, rows = _verify(a, b, "--no-field")
    checks = _one(rows, "kernel_checks")
    assert checks["lifting"].startswith("ok")
    assert checks["emulator"] == "skipped: 1024 CUDA threads to emulate (limit 64)"


def test_help_lists_the_checks():
    res = CliRunner().invoke(main, ["verify", "--help"])
    assert res.exit_code == 0
    for word in ("chain", "field", "float", "lifting", "emulator", "--no-lift", "--no-emulate"):
        assert word in res.stdout


def test_pre_opset_13_softmax_is_compared_with_its_own_semantics(tmp_path):
    """Opset 11 Softmax(axis=1) of a 3-D tensor normalises over dims 1 and 2; onnx's evaluator
    applies the opset-13 rule to every opset (reference64.py rewrites it), so without that the
    lifting check would fail a correct kernel."""
    m = helper.make_model(
        helper.make_graph(
            [helper.make_node("Softmax", ["x"], ["y"], axis=1)],
            "sm11",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 8])],
        ),
        opset_imports=[helper.make_opsetid("", 11)],
    )
    m.ir_version = 8
    a = tmp_path / "a.onnx"
    onnx.save(m, str(a))
    b = _package(a, _lifted(a), tmp_path / "b.onnx")
    res, rows = _verify(a, b, "--no-emulate")
    assert res.exit_code == 0, res.stderr
    assert _one(rows, "kernel_checks")["lifting"].startswith("ok")


def test_the_canonical_gelu_is_within_the_erf_tolerance(tmp_path):
    """Lifting snaps erf(x * 0.70710677) to erf(x / sqrt(2)) exactly; the μGraph then differs
    from the original nodes by ~1e-8, above fp64's 2^-30 but by design (ERF_TOLERANCE)."""

    def c(name, v):
        return numpy_helper.from_array(np.array(v, np.float32), name)

    m = helper.make_model(
        helper.make_graph(
            [
                helper.make_node("Mul", ["x", "k"], ["xk"]),
                helper.make_node("Erf", ["xk"], ["e"]),
                helper.make_node("Add", ["e", "one"], ["e1"]),
                helper.make_node("Mul", ["x", "e1"], ["p"]),
                helper.make_node("Mul", ["p", "half"], ["y"]),
            ],
            "gelu",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 64])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [16, 64])],
            [c("k", 0.70710677), c("one", 1.0), c("half", 0.5)],
        ),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    m.ir_version = 10
    a = tmp_path / "a.onnx"
    onnx.save(m, str(a))
    b = _package(a, _lifted(a), tmp_path / "b.onnx")
    res, rows = _verify(a, b, "--no-emulate")
    assert res.exit_code == 0, res.stderr
    checks = _one(rows, "kernel_checks")
    assert liftcheck.FP64_TOLERANCE < checks["lifting_error"] <= liftcheck.ERF_TOLERANCE


# ---- attacks: each must fail with exit 3, one line, no traceback ----------------------------


def _softmax_over_axis_1(monkeypatch) -> None:
    """A lifting bug: the Softmax rule ignores the node's axis and normalises over axis 1."""
    from mlso_cli.frontend import lift

    right = lift.RULES["Softmax"]

    def wrong(ctx, node):
        c = onnx.NodeProto()
        c.CopyFrom(node)
        del c.attribute[:]
        c.attribute.append(helper.make_attribute("axis", 1))
        return right(ctx, c)

    monkeypatch.setitem(lift.RULES, "Softmax", wrong)


def test_a_lifting_bug_is_caught_though_the_field_check_passes(tmp_path, monkeypatch):
    """gqa lifted with the buggy rule (as optimize would, with that bug) and packaged against its
    right fallback body: the field check lifts the body with the same bug, so it passes; only the
    comparison with onnx's evaluator on the original nodes sees the wrong axis."""
    a = _small("gqa")
    _softmax_over_axis_1(monkeypatch)
    b = _package(a, _lifted(a), tmp_path / "b.onnx")
    res, rows = _verify(a, b, "--no-lift", "--no-emulate")
    assert res.exit_code == 0, res.stderr  # every other check on the CPU passes this B
    res, rows = _verify(a, b)
    line = _failed_cleanly(res)
    assert "mlso kernel 'mlso_region_0' fails the lifting check" in line
    assert "output 'O' differs from onnx's reference evaluator" in line
    assert _one(rows, "kernel")["equivalent"]  # the field check was fooled
    assert _one(rows, "kernel_checks")["lifting"].startswith("FAILED")


def test_an_altered_weight_is_caught_as_a_value(tmp_path):
    """gamma altered in B: the kernel and its fallback body both read it, so the field and
    lifting comparisons agree; only comparing it with A's gamma sees it."""
    a = _small("rmsnorm_linear")
    b = package_fixture(
        a, SMALL_FIXTURES["rmsnorm_linear"](), placeholder(SMALL_FIXTURES["rmsnorm_linear"]())
    )
    init = next(t for t in b.graph.initializer if t.name == "gamma")
    gamma = numpy_helper.to_array(init).copy()
    gamma[3] += 0.5
    init.CopyFrom(numpy_helper.from_array(gamma, "gamma"))
    path = tmp_path / "b.onnx"
    onnx.save(b, str(path))
    res, rows = _verify(a, path)
    line = _failed_cleanly(res)
    assert "fails the lifting check: constants that are not the original model's" in line
    assert "constant 'gamma': 1 of 64 elements differ from the original's (largest by 0.5)" in line
    assert _one(rows, "kernel")["equivalent"]


def _masked_softmax(path) -> None:
    """Where(mask, x, -inf) then Softmax, the mask causal with key 1 hidden too (padding): no
    index predicate, so the kernel reads it (a causal mask alone is computed in the kernel, and
    the chain check refuses a change to it first: test_codegen_indexmask)."""
    mask = np.tril(np.ones((8, 16), dtype=bool))
    mask[:, 1] = False
    graph = helper.make_graph(
        [
            helper.make_node("Where", ["mask", "x", "ninf"], ["m"]),
            helper.make_node("Softmax", ["m"], ["y"], axis=-1),
        ],
        "masked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8, 16])],
        [
            numpy_helper.from_array(mask, "mask"),
            numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    onnx.save(model, str(path))


def test_an_altered_mask_is_caught_as_a_value(tmp_path):
    """The 0/1 mask lifting derives from Where(mask, x, -inf) is a kernel input only: the field
    check lifts it from the body under the same name and treats it as an input, so it agrees."""
    a = tmp_path / "a.onnx"
    _masked_softmax(a)
    b = package_fixture(a, _lifted(a), placeholder(_lifted(a)))
    init = next(t for t in b.graph.initializer if t.name.startswith("mlso_mask_"))
    mask = numpy_helper.to_array(init).copy()
    mask[0, 5, 9] = 1.0  # one future position let through
    init.CopyFrom(numpy_helper.from_array(mask, init.name))
    path = tmp_path / "b.onnx"
    onnx.save(b, str(path))
    # --no-emulate: not what this test is about
    res, rows = _verify(a, path, "--no-emulate")
    line = _failed_cleanly(res)
    assert f"constant '{init.name}': 1 of 256 elements differ" in line
    assert _one(rows, "kernel")["equivalent"]


def test_an_altered_body_constant_is_named():
    """A constant the fallback body holds (eps, absorbed as eps__mlso_r0) compared with A's."""
    a = onnx.load(str(_small("rmsnorm_linear")))
    b = package_fixture(
        _small("rmsnorm_linear"),
        SMALL_FIXTURES["rmsnorm_linear"](),
        placeholder(SMALL_FIXTURES["rmsnorm_linear"]()),
    )
    (node,) = [n for n in b.graph.node if n.domain == "ai.mlso"]
    assert liftcheck.constant_problems(a, b, node) == []
    eps = next(n for n in b.functions[0].node if n.output[0] == "eps__mlso_r0")
    eps.attribute[0].t.CopyFrom(numpy_helper.from_array(np.array(1e-3, np.float32)))
    (problem,) = liftcheck.constant_problems(a, b, node)
    assert "fallback body's constant 'eps__mlso_r0': 1 of 1 elements differ" in problem


def test_a_code_generation_bug_is_caught_on_the_emulator(tmp_path, monkeypatch):
    """codegen divides rmsnorm's sum of squares by 6.4 instead of 64: B is packaged with that
    source and the chain check regenerates the same source (the bug is in codegen), so only
    running the source finds it."""
    import mlso_cli.codegen as codegen

    right = codegen.generate

    def wrong(kg, *args, **kwargs):
        gp = right(kg, *args, **kwargs)
        assert "1.5625e-2f" in gp.source
        return dataclasses.replace(gp, source=gp.source.replace("1.5625e-2f", "1.5625e-1f"))

    monkeypatch.setattr(codegen, "generate", wrong)
    a = _small("rmsnorm_linear")
    b = _package(a, SMALL_FIXTURES["rmsnorm_linear"](), tmp_path / "b.onnx")
    res, rows = _verify(a, b)
    line = _failed_cleanly(res)
    assert "its generated source, run on the host emulator, does not compute" in line
    assert "output 'O' at random inputs has error" in line
    checks = _one(rows, "kernel_checks")
    assert checks["chain"].startswith("ok") and checks["lifting"].startswith("ok")
    assert checks["emulator"].startswith("FAILED")


# ---- the inputs ---------------------------------------------------------------------------------


def test_integer_inputs_cover_their_whole_range():
    """Index inputs span the table from -size to size - 1 (negative indices count from the end);
    no lifting rule takes an integer input today, so this is the drawing function alone."""
    table = numpy_helper.from_array(np.zeros((50, 4), np.float32), "table")
    m = helper.make_model(
        helper.make_graph(
            [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0)],
            "g",
            [helper.make_tensor_value_info("ids", TensorProto.INT64, [4000])],
            [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [4000, 4])],
            [table],
        )
    )
    bounds = liftcheck.index_bounds(m)
    assert bounds == {"ids": 50}
    rng = np.random.default_rng(0)
    ids = liftcheck.draw_input("random", (4000,), np.dtype(np.int64), rng, bound=bounds["ids"])
    assert ids.min() == -50 and ids.max() == 49
    flags = liftcheck.draw_input("random", (100,), np.dtype(bool), rng)
    assert set(np.unique(flags)) == {False, True}
    small = liftcheck.draw_input("random", (20000,), np.dtype(np.int8), rng)
    assert small.min() == -128 and small.max() == 127


@pytest.mark.parametrize(
    ("kind", "check"),
    [
        ("large", lambda x: np.abs(x).max() > 500),
        ("cancel", lambda x: np.abs(x.sum(axis=-1)).max() < 0.05 * np.abs(x).sum(axis=-1).min()),
        ("offset", lambda x: 95 < x.mean() < 105),
    ],
)
def test_float_input_kinds(kind, check):
    rng = np.random.default_rng(1)
    mag = 100.0 if kind == "offset" else 1e3
    x = liftcheck.draw_input(kind, (8, 64), np.dtype(np.float32), rng, mag)
    assert x.dtype == np.float32 and check(x.astype(np.float64))
