"""Benchmark models rewritten with their hand-written fixtures: fallback runs, verify checks kernels."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from tests.fixtures.mutations import MUTATIONS
from tests.fixtures.packaging import package_fixture, placeholder
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
    packed = package_fixture(
        _small(name), SMALL_FIXTURES[name](), placeholder(SMALL_FIXTURES[name]())
    )
    onnx.checker.check_model(packed)
    assert 10 <= packed.ir_version <= 13
    kinds = [n for n in packed.graph.node if n.domain == "ai.mlso"]
    assert len(kinds) == 1 and kinds[0].op_type == "MlsoKernel"
    assert {p.key for p in packed.metadata_props} >= {"mlso.version", "mlso.executable_code"}
    feeds = random_inputs(orig, seed=3)
    want = ort.InferenceSession(orig.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
    got = ort.InferenceSession(packed.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feeds
    )
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


# ---- the chain from μGraph to binary: spliced parts are refused -----------------------------------


def _mlso_node(model):
    return next(n for n in model.graph.node if n.domain == "ai.mlso")


def _set_attr(node, name, value) -> None:
    for a in node.attribute:
        if a.name == name:
            a.s = value.encode() if isinstance(value, str) else value
            return
    raise AssertionError(f"no attribute {name}")


def _splice_binary(model, fatbin: bytes) -> None:
    import hashlib

    import numpy as np
    from onnx import numpy_helper

    node = _mlso_node(model)
    init = next(t for t in model.graph.initializer if t.name == node.input[0])
    init.CopyFrom(numpy_helper.from_array(np.frombuffer(fatbin, np.uint8).copy(), init.name))
    _set_attr(node, "binary_sha256", hashlib.sha256(fatbin).hexdigest())


@pytest.mark.parametrize(
    "attack", ["binary_of_another_program", "random_binary", "source_hash", "plan_grid"]
)
def test_verify_refuses_parts_not_made_from_the_ugraph(tmp_path, attack):
    """A binary, hash or plan spliced in (with binary_sha256 updated to match) passed verify before:
    the field check proves only the μGraph. verify now regenerates and recompiles it."""
    import hashlib
    import os

    from mlso_cli.codegen import compile_program

    name = "gated_mlp"
    packed = package_fixture(_small(name), SMALL_FIXTURES[name]())
    node = _mlso_node(packed)
    if attack == "binary_of_another_program":
        _splice_binary(packed, compile_program(SMALL_FIXTURES["lora"]()).fatbin)
    elif attack == "random_binary":
        _splice_binary(packed, os.urandom(4096))
    elif attack == "source_hash":
        _set_attr(node, "source_sha256", hashlib.sha256(b"other source").hexdigest())
    else:
        plan = json.loads(next(a.s for a in node.attribute if a.name == "plan"))
        plan["launches"][0]["grid"][0] += 1
        _set_attr(node, "plan", json.dumps(plan))
    path = tmp_path / "spliced.onnx"
    onnx.save(packed, str(path))
    r = run_cli("verify", str(_small(name)), str(path), "--samples", "1")
    assert r.returncode == 3, r.stderr
    assert b"is not what its" in r.stderr and b"Traceback" not in r.stderr


def test_verify_without_nvcc_says_binary_not_checked(tmp_path):
    name = "lora"
    path = tmp_path / "packed.onnx"
    onnx.save(package_fixture(_small(name), SMALL_FIXTURES[name]()), str(path))
    env = {"MLSO_NVCC": str(tmp_path / "no-nvcc"), "MLSO_CACHE_DIR": str(tmp_path / "cache")}
    r = run_cli("verify", str(_small(name)), str(path), "--samples", "1", env=env)
    assert r.returncode == 4 and b"binary not checked" in r.stderr and b"--trust-binary" in r.stderr
    r = run_cli(
        "verify",
        str(_small(name)),
        str(path),
        "--samples",
        "1",
        "--trust-binary",
        "--json",
        env=env,
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.decode().splitlines()[-1])
    assert summary["binaries_trusted"] == 1 and summary["binaries_checked"] == 0


def test_verify_float_checks_a_ugraph_that_rounds_its_row_sums(tmp_path):
    """The field treats CAST as the identity, so a μGraph rounding gqa's softmax row sums to bf16
    in its block is "equivalent" there; in the interpreter's float32 mode the error is ~1.5e-3
    against fp32's 1e-5 limit, and verify must say so (exit 3)."""
    from mlso_cli.ir import build as b
    from mlso_cli.ir.ops import DType, Op
    from tests.fixtures.mutations import rewrite

    def round_denominator(n):
        if n.op is Op.SAVE and n.src[0].op is Op.ACC_EXP_SUM:
            return n.replace(src=(b.cast(b.cast(n.src[0], DType.BF16), DType.F32),))
        return None

    name = "gqa"
    rounded = rewrite(SMALL_FIXTURES[name](), round_denominator)
    assert any(
        n.op is Op.CAST for k in rounded.kernels() if k.op is Op.GRAPH_DEF for n in k.arg.nodes()
    )
    path = tmp_path / "rounded.onnx"
    onnx.save(package_fixture(_small(name), rounded), str(path))
    r = run_cli("verify", str(_small(name)), str(path), "--samples", "1", "--json")
    assert r.returncode == 3, r.stderr
    assert b"as code generation computes it" in r.stderr
    rows = [json.loads(x) for x in r.stdout.decode().splitlines()]
    assert any(x["type"] == "kernel" and not x["equivalent"] for x in rows)


def test_the_kernel_node_alone_computes_what_its_region_alone_computes():
    """bench/harness.py times a region as served by cutting out (a) the original nodes and (b)
    the MlsoKernel node with its function and binary; both standalone models must compute the
    same thing (here in stock ONNX Runtime, where the node runs its fallback function)."""
    import onnxruntime as ort

    from mlso_cli.bench.harness import kernel_model, random_feeds, region_model

    packed = package_fixture(
        _small("rmsnorm_linear"),
        SMALL_FIXTURES["rmsnorm_linear"](),
        placeholder(SMALL_FIXTURES["rmsnorm_linear"]()),
    )
    (node,) = [n for n in packed.graph.node if n.domain == "ai.mlso"]
    km, rm = kernel_model(packed, node), region_model(packed, node)
    onnx.checker.check_model(km)
    assert [n.op_type for n in km.graph.node] == ["MlsoKernel"] and km.functions
    feeds = random_feeds(rm)
    assert set(feeds) == set(random_feeds(km))
    cpu = ["CPUExecutionProvider"]
    got = ort.InferenceSession(km.SerializeToString(), providers=cpu).run(None, feeds)
    want = ort.InferenceSession(rm.SerializeToString(), providers=cpu).run(None, feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
