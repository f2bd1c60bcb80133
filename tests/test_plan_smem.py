"""The spec checker's shared-memory figure is the byte count code generation allocates.

Why: a graph the spec accepts must compile. Before the layout was one function, the spec summed
an estimate that left out padding, staging copies and P buffers, so `relu(X) @ W` in one block
passed the check and then failed in codegen. Now both read blocklayout.smem_layout; these tests
compare the figure with what the generated kernels actually declare, for every test graph and
fixture, and generate random block graphs that the spec accepts.
"""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlso_cli.codegen import CodegenError, generate
from mlso_cli.codegen.arch import SMEM_BUDGET
from mlso_cli.codegen.blocklayout import smem_layout
from mlso_cli.codegen.budget import SpecError, block_smem, check, problems
from mlso_cli.ir import DType, InputMap, KernelGraph, Op
from mlso_cli.ir import build as b
from mlso_cli.ir.spec import tile_shape
from tests import test_codegen_graphs as T
from tests import test_codegen_stabilise as S
from tests.fixtures import ugraphs

F16, BF16, F32 = DType.F16, DType.BF16, DType.F32
POINTER = re.compile(r"(\w+)\* const (\w+) = reinterpret_cast<\1\*>\(smem \+ (\d+)\);")


def _graphs() -> dict[str, KernelGraph]:
    out = {f"graph_{k}": f() for k, f in T.GRAPHS.items()}
    out.update({f"fixture_{k}": f() for k, f in ugraphs.FIXTURES.items()})
    out.update({f"small_{k}": f() for k, f in ugraphs.SMALL_FIXTURES.items()})
    out.update({f"stabilise_{k}": f(dt) for k, (f, dt) in S.CASES.items()})
    return out


GRAPHS = _graphs()


def _graph_defs(kg: KernelGraph) -> list:
    return [n for n in kg.nodes() if n.op is Op.GRAPH_DEF]


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_spec_figure_is_what_the_kernels_allocate(name):
    kg = GRAPHS[name]
    check(kg)
    gds = _graph_defs(kg)
    kernels = [k for k in generate(kg).kernels if k.what.startswith("graph-defined kernel")]
    assert len(kernels) == len(gds)
    want = sorted(block_smem(gd.arg, gd.src, "sm_90") for gd in gds)
    assert sorted(k.smem for k in kernels) == want
    # and the pointers each kernel declares are the layout's buffers, byte for byte
    layouts = {tuple(smem_layout(gd.arg).buffers) for gd in gds}
    for k in kernels:
        declared = tuple((c, n, int(o)) for c, n, o in POINTER.findall(k.source))
        assert declared in layouts, f"{name}: {k.name} declares buffers no layout planned"
        assert all(off < k.smem for _, _, off in declared)


def _single_block(x_shape: tuple[int, int], w_shape: tuple[int, int], grid: int) -> KernelGraph:
    """relu(X) @ W with the rows of X split over `grid` blocks, no loop."""
    x, w = b.input_(0, x_shape, F16), b.input_(1, w_shape, F16)
    maps = [InputMap((0, None, None)), InputMap((None, None, None))]
    g = (grid, 1, 1)
    bx = b.iter_(0, tile_shape(x.shape, maps[0], g, 1), F16, False)
    bw = b.iter_(1, tile_shape(w.shape, maps[1], g, 1), F16, False)
    save = b.save(b.matmul(b.unary(Op.RELU, bx), bw), 0, (0, None, None), F16)
    return b.kernel_graph([x, w], b.graph_def([x, w], b.block_graph(g, 1, maps, [save])))


def test_relu_matmul_in_one_block_is_rejected_by_the_spec_not_by_codegen():
    big = _single_block((128, 384), (384, 128), 1)
    gd = _graph_defs(big)[0]
    need = block_smem(gd.arg, gd.src, "sm_90")
    assert need > SMEM_BUDGET["sm_90"]  # X, W and C (relu runs in place on X): over 227 KB
    with pytest.raises(SpecError, match=f"needs {need} bytes"):
        check(big)
    half = _single_block((128, 384), (384, 128), 2)
    check(half)
    assert generate(half).kernels[0].smem == block_smem(_graph_defs(half)[0].arg, (), "sm_90")


def test_budget_false_drops_only_the_budget():
    """The search's reduced-shape check: everything but the shared-memory budget."""
    big = _single_block((128, 384), (384, 128), 1)
    assert any("bytes of shared memory" in p for p in problems(big))
    assert problems(big, budget=False) == []


def test_the_budget_is_per_arch():
    kg = _single_block((128, 256), (256, 128), 2)
    gd = _graph_defs(kg)[0]
    assert block_smem(gd.arg, gd.src, "sm_90") <= SMEM_BUDGET["sm_90"]
    sm80 = block_smem(gd.arg, gd.src, "sm_80")
    assert (sm80 <= SMEM_BUDGET["sm_80"]) == (not problems(kg, "sm_80"))


# ---- random block graphs: whatever the spec accepts, codegen lays out --------------------------

UNARY_OPS = (Op.RELU, Op.EXP, Op.SQUARE, Op.SILU, Op.NEG)


@st.composite
def block_graphs(draw) -> KernelGraph:
    """A one-kernel graph: X (M, K) and W (K, N) tiles of random sizes (rows split over the grid,
    K walked by the loop or not), an elementwise prologue on X, a matmul (accumulated when
    looped), an optional row reduction and elementwise epilogue."""
    dt = draw(st.sampled_from([F16, BF16, F32]))
    m = draw(st.sampled_from([8, 16, 32, 64, 128]))
    k = draw(st.sampled_from([16, 32, 64, 128, 256]))
    n = draw(st.sampled_from([8, 16, 32, 64, 128]))
    grid = draw(st.sampled_from([1, 2]))
    loop = draw(st.sampled_from([1, 2, 4]))
    rows = m * grid
    x, w = b.input_(0, (rows, k * loop), dt), b.input_(1, (k * loop, n), dt)
    looped = loop > 1
    maps = [
        InputMap((0, None, None), 1 if looped else None),
        InputMap((None, None, None), 0 if looped else None),
    ]
    g = (grid, 1, 1)
    bx = b.iter_(0, tile_shape(x.shape, maps[0], g, loop), dt, looped)
    bw = b.iter_(1, tile_shape(w.shape, maps[1], g, loop), dt, looped)
    a = bx
    for op in draw(st.lists(st.sampled_from(UNARY_OPS), max_size=2)):
        a = b.unary(op, a)
    c = b.matmul(a, bw)
    if looped:
        c = b.accumulate(Op.ACC_SUM, c)
    if draw(st.booleans()):
        c = b.div(c, b.add(b.reduce(Op.REDUCE_SUM, b.unary(Op.SQUARE, c), 1), b.const(Fraction(1))))
    save = b.save(c, 0, (0, None, None), dt)
    return b.kernel_graph([x, w], b.graph_def([x, w], b.block_graph(g, loop, maps, [save])))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_graphs())
def test_every_block_graph_the_spec_accepts_generates(kg):
    gd = _graph_defs(kg)[0]
    need = block_smem(gd.arg, gd.src, "sm_90")
    if problems(kg, "sm_90"):
        assert need > SMEM_BUDGET["sm_90"]  # the only way these graphs can be invalid
        with pytest.raises(CodegenError, match="shared memory"):
            _generate_unchecked(kg)
        return
    (kernel,) = generate(kg).kernels
    assert kernel.smem == need <= SMEM_BUDGET["sm_90"]


def _generate_unchecked(kg: KernelGraph):
    """generate() without its spec check: what codegen would do with a graph the spec rejects."""
    from mlso_cli.codegen.lower import Lowering

    return Lowering(kg, ("sm_80", "sm_90a")).generate()


# ---- the lowering plan -------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_lowering_plan_is_what_generate_does(name):
    import json

    from mlso_cli.codegen.plan import plan

    kg = GRAPHS[name]
    p = plan(kg)
    gp = generate(kg)
    assert [k.kind == "graph_def" for k in p.kernels] == [
        k.what.startswith("graph-defined") for k in gp.kernels
    ]
    for kp, k in zip(p.kernels, gp.kernels):
        if kp.layout is not None:
            assert (kp.layout.smem, kp.layout.threads) == (k.smem, k.block[0])
    assert p.smem_max == max(
        (k.smem for k in gp.kernels if k.what.startswith("graph-defined")), default=0
    )
    assert json.loads(json.dumps(p.to_json())) == p.to_json() == plan(kg).to_json()
