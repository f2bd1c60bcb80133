"""The verification library (verify/packaged.py): one entry point, plain data, honest wording.

Why: the checks lived in commands/verify.py, so optimize could not run them, and verify said a
kernel "does not compute its region: agreed, but there is no useful bound", and summed the
refusals' bounds (1 each) into a "false_accept_bound" of 2.0.
"""

from __future__ import annotations

import json

import onnx
from click.testing import CliRunner

from mlso_cli.cli import main
from mlso_cli.frontend.load import load_model, with_weights
from mlso_cli.verify.packaged import VerifyOptions, VerifyReport, verify_models
from tests.fixtures.packaging import package_fixture, placeholder
from tests.fixtures.ugraphs import SMALL_FIXTURES
from tests.helpers import SMALL

NAME = "rmsnorm_linear"
SRC = next(p for p in SMALL if p.stem == NAME)


def _packaged(tmp_path):
    program = SMALL_FIXTURES[NAME]()
    out = tmp_path / "b.onnx"
    onnx.save(package_fixture(SRC, program, placeholder(program)), str(out))
    return out


def _loaded(path) -> onnx.ModelProto:
    return with_weights(load_model(str(path), fold=False))


def test_the_library_returns_the_whole_report_as_data(tmp_path):
    b = _packaged(tmp_path)
    opts = VerifyOptions(seed=3, samples=1, scales=(1.0,), trust_binary=True)
    report = verify_models(_loaded(SRC), _loaded(b), opts)
    assert isinstance(report, VerifyReport) and report.passed and report.failure is None
    (k,) = report.kernels
    assert k.failure is None and k.bound is not None and 0 < k.bound <= 2.0**-60
    assert k.lifting.status == "ok" and k.emulator.status == "ok"
    assert report.summary["false_accept_bound"] == k.bound and report.summary["pass"]
    assert {r["type"] for r in report.rows} == {"output"}
    assert [r["status"] for r in report.alg_rows] == ["equal"]


def test_no_usable_bound_is_could_not_be_verified_not_a_difference(tmp_path, monkeypatch):
    import mlso_cli.verify.equivalence as equivalence

    monkeypatch.setattr(equivalence, "trial_bound", lambda *a, **k: 1.0)
    b = _packaged(tmp_path)
    args = ["verify", str(SRC), str(b), "--samples", "1", "--trust-binary", "--json", "--seed", "3"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 3
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("mlso: error:")]
    assert "could not be verified" in line and "does not compute" not in line
    rows = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    summary = rows[-1]
    assert summary["false_accept_bound"] is None and summary["pass"] is False
    (kernel,) = [r for r in rows if r["type"] == "kernel"]
    assert kernel["status"] == "unbounded"


def test_the_fp64_reference_promotes_a_default_constant_of_shape():
    """ConstantOfShape without a value attribute makes float32 zeros; the fp64 reference must
    promote them like every float constant, or onnx's evaluator refuses a MatMul of float64 by
    float32 (deepseek's zoo export: verify crashed before comparing anything)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    from mlso_cli.verify.reference64 import reference_outputs

    g = helper.make_graph(
        [
            helper.make_node("ConstantOfShape", ["shape"], ["z"]),
            helper.make_node("Add", ["z", "x"], ["zx"]),
            helper.make_node("MatMul", ["zx", "x"], ["y"]),
        ],
        "cos",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
        [numpy_helper.from_array(np.array([2, 2], np.int64), "shape")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    (y,) = reference_outputs(m, {"x": x}).values()
    assert y.dtype == np.float64 and np.array_equal(y, x.astype(np.float64) @ x)


def test_outputs_are_compared_with_one_evaluator_alive_at_a_time(tmp_path, monkeypatch):
    """A's session, B's session and A's fp64 reference each hold a copy of the weights (float32
    copies of float16 weights in ORT's CPU sessions, float64 in the reference); alive together
    they took 13x the weights' size on a 478 MB export. compare_outputs builds one, runs it on
    every sample and scale, and lets it go before the next; the rows are the same as before."""
    import gc

    import mlso_cli.verify.packaged as P

    alive, peak = set(), [0]

    def tracked(make):
        def build(*args, **kw):
            obj = make(*args, **kw)
            key = object()
            alive.add(key)
            peak[0] = max(peak[0], len(alive))
            holder = _Holder(obj, lambda: alive.discard(key))
            return holder

        return build

    class _Holder:
        """Forwards to the real evaluator; leaves `alive` when collected."""

        def __init__(self, obj, on_del) -> None:
            self._obj, self._on_del = obj, on_del

        def __getattr__(self, name):
            return getattr(self._obj, name)

        def __call__(self, *a, **k):
            return self._obj(*a, **k)

        def __del__(self) -> None:
            self._on_del()

    b = _packaged(tmp_path)
    a_model, b_model = _loaded(SRC), _loaded(b)
    opts = VerifyOptions(seed=3, samples=2, scales=(1.0, 100.0), trust_binary=True)
    plain = P.compare_outputs(a_model, b_model, opts)
    monkeypatch.setattr(P, "_session", tracked(P._session))
    monkeypatch.setattr(P, "Reference", tracked(P.Reference))
    gc.disable()  # only reference counting may free them: what the code lets go, goes at once
    try:
        rows = P.compare_outputs(a_model, b_model, opts)
    finally:
        gc.enable()
    assert peak[0] == 1 and not alive
    assert rows == plain and len(rows) == 4  # 2 samples x 2 scales, one output
