"""Benchmark models rewritten with their hand-written fixtures: fallback runs, verify checks kernels."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from tests.fixtures.mutations import MUTATIONS
from tests.fixtures.packaging import package_fixture
from tests.fixtures.ugraphs import SMALL_FIXTURES
from tests.helpers import MODELS, run_cli

NAMES = sorted(SMALL_FIXTURES)


def _small(name):
    return MODELS / "small" / f"{name}.onnx"


@pytest.mark.parametrize("name", NAMES)
def test_packaged_fixture_runs_in_stock_ort(name):
    import onnxruntime as ort

    from models.build_models import random_inputs

    orig = onnx.load(str(_small(name)))
    packed = package_fixture(_small(name), SMALL_FIXTURES[name]())
    onnx.checker.check_model(packed)
    assert 10 <= packed.ir_version <= 13
    kinds = [n for n in packed.graph.node if n.domain == "ai.mlso"]
    assert len(kinds) == 1 and kinds[0].op_type == "MlsoKernel"
    assert {p.key for p in packed.metadata_props} >= {"mlso.version", "mlso.executable_code"}
    feeds = random_inputs(orig, seed=3)
    want = ort.InferenceSession(orig.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = ort.InferenceSession(packed.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)


@pytest.mark.parametrize("name", ["gqa", "rmsnorm_linear", "gated_mlp"])
def test_verify_checks_each_kernel_in_the_field(tmp_path, name):
    packed = tmp_path / f"{name}.mlso.onnx"
    onnx.save(package_fixture(_small(name), SMALL_FIXTURES[name]()), str(packed))
    r = run_cli("verify", str(_small(name)), str(packed), "--json", "--samples", "1")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    kernels = [x for x in rows if x["type"] == "kernel"]
    assert len(kernels) == 1 and kernels[0]["equivalent"] and kernels[0]["bound"] <= 2.0**-60
    assert rows[-1]["kernels_equivalent"] == 1 and rows[-1]["pass"]


def test_verify_rejects_a_wrong_kernel_whose_fallback_is_right(tmp_path):
    """The fallback body still computes the right answer; only the field check can see the bug."""
    name = "gated_mlp"
    mutate = next(m for m in MUTATIONS[name] if m.kind == "dropped_term")
    wrong = mutate(SMALL_FIXTURES[name]())
    packed = tmp_path / "wrong.onnx"
    onnx.save(package_fixture(_small(name), wrong), str(packed))
    r = run_cli("verify", str(_small(name)), str(packed), "--samples", "1")
    assert r.returncode == 3
    assert b"does not compute its region" in r.stderr
