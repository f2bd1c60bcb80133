"""A constant selection (Slice, Split, rotate-half as lifted) is a read in generated code
(codegen/selection.py).

Why: lifting writes a Split of a fused projection, or RoPE's rotate-half, as a sum over a
constant 0/±1 matrix; folded as written, each element of a query read every block of the fused
output. Given the constant, code generation reads the selected element only. The decision is an
exact check of the constant, so the emulated program must give the same numbers either way, and a
constant that is not a selection (two nonzeros in a row, a 0.5) keeps the fold.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from mlso_cli.codegen import generate, hostemu
from mlso_cli.codegen.indexmask import mask_constants
from mlso_cli.codegen.selection import SELECT_PREFIX, _rows, _table, known_selections
from mlso_cli.frontend.analyse import analyse
from mlso_cli.frontend.load import load_model
from mlso_cli.ir import check
from mlso_cli.ir.ops import DType, Op
from mlso_cli.verify import interpreter
from tests.helpers import save

ROPE_ZOO = ["llama_tiny_fp32", "gemma3_tiny_fp32", "deepseek_v3_tiny_fp32"]
NP = {DType.F32: np.float32, DType.F16: np.float16}


def _kernel_params(source: str) -> list[str]:
    return re.findall(r"__global__ void __launch_bounds__\(\d+\) \w+\(([^)]*)\)", source)


def _inputs(lr, seed: int = 0) -> list[np.ndarray]:
    """Random normal values for the region's inputs, its lifted constants as they are."""
    rng = np.random.default_rng(seed)
    out = []
    for n, nm in zip(lr.graph.inputs, lr.graph.input_names):
        if nm in lr.extra_inputs:
            out.append(np.asarray(lr.extra_inputs[nm]).astype(NP[n.dtype]))
        else:
            out.append(rng.standard_normal(n.shape).astype(NP[n.dtype]))
    return out


def _selecting_regions(path, shapes: dict) -> list:
    a = analyse(load_model(str(path), shapes))
    return [
        lr for lr in a.lifted if any(nm.startswith(SELECT_PREFIX) for nm in lr.graph.input_names)
    ]


def _assert_same_numbers_fewer_reads(lr) -> None:
    """With the constants, no kernel takes a selection input, the emulated outputs equal the
    folding program's, and both agree with the float64 interpreter."""
    check(lr.graph)
    kg = lr.graph
    sels = known_selections(kg, lr.extra_inputs)
    assert sels, "the region's selections are recognised"
    plain, picked = generate(kg), generate(kg, constants=lr.extra_inputs)
    assert picked.source != plain.source
    names = [f"in{i}" for i in sels]
    folded = [
        nm for nm in names if any(re.search(rf"\b{nm}\b", p) for p in _kernel_params(plain.source))
    ]
    assert folded, "without the constants some kernel folds over a selection input"
    for p in _kernel_params(picked.source):
        for nm in folded:
            assert not re.search(rf"\b{nm}\b", p), f"{nm} is still read: {p}"
    ins = _inputs(lr)
    got, want = hostemu.run(picked, ins), hostemu.run(plain, ins)
    ref = interpreter.run(kg, ins, mode="float64")
    for g, w, r in zip(got, want, ref, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(w))
        g64, r64 = np.asarray(g, np.float64), np.asarray(r, np.float64)
        scale = max(np.abs(r64).max(), 1e-30)
        assert np.abs(g64 - r64).max() / scale < (2e-3 if g.dtype == np.float16 else 1e-5)


@pytest.mark.parametrize("name", ROPE_ZOO)
def test_rotate_half_reads_one_element(name):
    from tests.test_zoo import SMALL_DIR

    regions = _selecting_regions(str(SMALL_DIR / f"{name}.onnx"), {"input_ids": (1, 16)})
    assert regions
    _assert_same_numbers_fewer_reads(regions[0])


def _fused_gate_up(n: int = 8, d: int = 32, f: int = 48, fp16: bool = True) -> onnx.ModelProto:
    """Phi-3's MLP head: one projection to 2f, Split in two, up * SiLU(gate) (x * Sigmoid(x))."""
    dt, npdt = (TensorProto.FLOAT16, np.float16) if fp16 else (TensorProto.FLOAT, np.float32)
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array((rng.standard_normal((d, 2 * f)) / np.sqrt(d)).astype(npdt), "W")
    split = numpy_helper.from_array(np.array([f, f], np.int64), "split")
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["gu"]),
        helper.make_node("Split", ["gu", "split"], ["gate", "up"], axis=-1),
        helper.make_node("Sigmoid", ["gate"], ["sg"]),
        helper.make_node("Mul", ["gate", "sg"], ["act"]),
        helper.make_node("Mul", ["up", "act"], ["Y"]),
    ]
    g = helper.make_graph(
        nodes,
        "gate_up",
        [helper.make_tensor_value_info("X", dt, [1, n, d])],
        [helper.make_tensor_value_info("Y", dt, [1, n, f])],
        [w, split],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("fp16", [True, False])
def test_a_split_of_a_fused_projection_reads_its_half(fp16, tmp_path):
    regions = _selecting_regions(save(_fused_gate_up(fp16=fp16), tmp_path / "m.onnx"), {})
    assert len(regions) == 1
    _assert_same_numbers_fewer_reads(regions[0])


def _concat_pieces(fp16: bool = True, n: int = 24) -> onnx.ModelProto:
    """Two computed pieces, of n and 16 columns, concatenated on the last axis, then squared. A
    Concat lifts to each piece cut into blocks and summed into place through a 0/1 constant;
    with pieces of one block each (n = 16) the sum is over one block and lifting leaves the
    product alone: the piece broadcast over the concatenated blocks times the constant."""
    dt, npdt = (TensorProto.FLOAT16, np.float16) if fp16 else (TensorProto.FLOAT, np.float32)
    rng = np.random.default_rng(5)
    w = numpy_helper.from_array((rng.standard_normal((16, n)) / 4).astype(npdt), "W")
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["a"]),
        helper.make_node("Sigmoid", ["X"], ["s"]),
        helper.make_node("Concat", ["a", "s"], ["c"], axis=-1),
        helper.make_node("Mul", ["c", "c"], ["Y"]),
    ]
    g = helper.make_graph(
        nodes,
        "concat",
        [helper.make_tensor_value_info("X", dt, [1, 8, 16])],
        [helper.make_tensor_value_info("Y", dt, [1, 8, n + 16])],
        [w],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("fp16", [True, False])
@pytest.mark.parametrize("n", [24, 16])
def test_a_concat_places_its_pieces_without_reading_the_constant(fp16, n, tmp_path):
    regions = _selecting_regions(save(_concat_pieces(fp16, n), tmp_path / "m.onnx"), {})
    assert len(regions) == 1
    if n == 16:  # one block a piece: products, no sums (selection.placed_product)
        ops = {m.op for m in regions[0].graph.nodes()}
        assert Op.MUL in ops and Op.REDUCE_SUM not in ops
    _assert_same_numbers_fewer_reads(regions[0])


# ---- what is a selection ---------------------------------------------------------------------


def test_rows_and_tables():
    rot = np.array([[0, -1], [1, 0]], np.float64)  # rotate-half: (-x2, x1)
    r = _rows(rot.reshape(1, 2, 2, 1), (1, 2, 2, 1), 2, ("0", "bo", "0", "0"))
    assert (r.index, r.sign, r.coord) == ((1, 0), (-1.0, 1.0), "bo")
    assert _table("bo", r.index, str) == "(1 - bo)"
    assert _table("bo", r.sign, lambda s: f"{s:.1f}f") == "(bo == 0 ? -1.0f : 1.0f)"
    assert _table("bo", (2, 0, 1), str) == "(bo == 0 ? 2 : bo == 1 ? 0 : 1)"
    third = np.array([0, 0, 1], np.float64).reshape(1, 3, 1)
    assert _rows(third, (1, 3, 1), 1, ("0", "r", "0")).index == (2,)
    # two nonzeros in a row (a sum of blocks) is not a selection: folded as written
    assert _rows(np.array([[1.0, 1.0]]), (1, 2), 1, ("0", "r")) is None


def test_only_exact_lifted_selections_are_known():
    from mlso_cli.ir import Op
    from mlso_cli.ir import build as b

    x = b.input_(0, (4, 2, 3), DType.F32)
    p = b.input_(1, (1, 2, 1), DType.F32)
    y = b.reduce(Op.REDUCE_SUM, b.mul(x, p), 1)
    name = SELECT_PREFIX + "abc"
    kg = b.kernel_graph([x, p], [y], ["X", name], ["Y"])
    one_hot = np.array([0.0, 1.0], np.float32).reshape(1, 2, 1)
    assert set(known_selections(kg, {name: one_hot})) == {1}
    assert known_selections(kg, {name: one_hot * 0.5}) == {}  # a weight, not a selection
    assert known_selections(kg, {name: one_hot.reshape(2, 1, 1)}) == {}  # another shape
    other = kg.replace(input_names=("X", "weights"))
    assert known_selections(other, {"weights": one_hot}) == {}  # only lifted names
    # verify hands the same constants to code generation (indexmask.mask_constants)
    assert set(mask_constants(kg.input_names, {name: one_hot}.get)) == {name}
    # the selected block is read, and a changed constant changes the source
    src = generate(kg, constants={name: one_hot}).source
    assert "in1" not in "".join(_kernel_params(src))
    flipped = generate(kg, constants={name: one_hot[:, ::-1].copy()}).source
    assert flipped != src
    ins = [np.random.default_rng(0).standard_normal((4, 2, 3)).astype(np.float32), one_hot]
    got = hostemu.run(generate(kg, constants={name: one_hot}), ins)[0]
    assert np.array_equal(np.asarray(got), ins[0][:, 1:2, :])


def test_the_build_key_tells_selections_apart():
    from mlso_cli.ir import Op
    from mlso_cli.ir import build as b
    from mlso_cli.pipeline.build import Builder

    x = b.input_(0, (4, 2, 3), DType.F32)
    p = b.input_(1, (1, 2, 1), DType.F32)
    name = SELECT_PREFIX + "abc"
    kg = b.kernel_graph([x, p], [b.reduce(Op.REDUCE_SUM, b.mul(x, p), 1)], ["X", name], ["Y"])
    first = np.array([1.0, 0.0], np.float32).reshape(1, 2, 1)
    builder = Builder(("sm_80",))
    keys = {builder._key(kg, {name: v}) for v in (first, first[:, ::-1].copy(), None)}
    assert len(keys) == 3


# ---- on a GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["llama_tiny_fp32", "gate_up_fp16"])
def test_selections_on_a_gpu_equal_the_emulated_program(which, tmp_path):
    """The same source on the GPU (library GEMMs and all) gives what the host emulator gives,
    and both agree with the float64 interpreter."""
    from mlso_cli.codegen import compile_program
    from mlso_cli.runtime.launcher import Program
    from tests.test_zoo import SMALL_DIR

    if which == "gate_up_fp16":
        path = save(_fused_gate_up(n=128, d=256, f=512), tmp_path / "m.onnx")
        regions = _selecting_regions(path, {})
    else:
        regions = _selecting_regions(str(SMALL_DIR / f"{which}.onnx"), {"input_ids": (1, 16)})
    for lr in regions:
        ins = _inputs(lr, seed=1)
        cp = compile_program(lr.graph, constants=lr.extra_inputs)
        with Program(cp.fatbin, cp.plan) as prog:
            got = prog.run(ins, poison_outputs=True)
        emu = hostemu.run(generate(lr.graph, constants=lr.extra_inputs), ins)
        ref = interpreter.run(lr.graph, ins, mode="float64")
        for g, e, r in zip(got, emu, ref, strict=True):
            g64, r64 = np.asarray(g, np.float64), np.asarray(r, np.float64)
            assert not np.isnan(g64).any()
            scale = max(np.abs(r64).max(), 1e-30)
            tol = 2e-3 if np.asarray(g).dtype == np.float16 else 1e-4
            assert np.abs(g64 - r64).max() / scale < tol
            assert np.abs(g64 - np.asarray(e, np.float64)).max() / scale < tol
