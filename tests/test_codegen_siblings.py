"""Horizontal fusion (codegen/siblings.py, siblingkernel.py): consecutive independent elementwise
kernels run as one launch whose grid is the sum of theirs.

Checked here: the decision (which kernels share a launch, and which must not: a kernel reading
another, more than MAX_PARTS), the lowering plan and the launch plan agree on the launch count,
the cost model prices the shared launch as one, the runtime validator accepts the plan, and the
fused kernel computes what the interpreter does on the host emulator, for a hand-built graph
(one part with a team of lanes per element) and for transformer_tiny's first lifted region
(RMSNorm -> q/k/v -> rotary, the shape of Qwen2's and Llama's region 0: 6 launches -> 4).
"""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from mlso_cli.codegen import generate, rowfuse, siblings
from mlso_cli.codegen.plan import plan
from mlso_cli.codegen.roots import kernel_roots
from mlso_cli.ir import DType, Op, check
from mlso_cli.ir import build as b
from mlso_cli.runtime.plan import validate_plan
from mlso_cli.search.cost import program_cost
from tests import test_codegen_graphs as T
from tests.helpers import fresh_cache

F16, F32 = DType.F16, DType.F32


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with fresh_cache(tmp_path_factory):
        yield


def _launches(kg) -> int:
    return len(generate(kg).plan["launches"])


def three_siblings(dt: DType = F16):
    """Three outputs computed from the inputs alone, none reading another: a scaled GELU of x,
    x + y broadcast, and a sum over x's short strided leading axis (inlined: a team of lanes per
    element), three kernels before horizontal fusion."""
    x, y = b.input_(0, (16, 8, 64), dt), b.input_(1, (64,), dt)
    x32, y32 = b.cast(x, F32), b.cast(y, F32)
    a = b.mul(b.unary(Op.GELU, x32), b.const(Fraction(3, 2)))
    s = b.add(x32, y32)
    r = b.mul(b.reduce(Op.REDUCE_SUM, x32, 0), y32)
    outs = [b.cast(a, dt), b.cast(s, dt), b.cast(r, dt)]
    return check(b.kernel_graph([x, y], outs, ["x", "y"], ["a", "s", "r"]))


def shared_producer(dt: DType = F32):
    """exp(x) read by two elementwise outputs: its kernel (a root: two kernels need it) runs
    alone, since both readers depend on it; the two readers share the next launch."""
    x = b.input_(0, (4, 96), dt)
    e = b.unary(Op.EXP, x)
    return check(b.kernel_graph([x], [b.add(e, x), b.mul(e, x)], ["x"], ["f", "g"]))


def many_siblings(count: int):
    """`count` independent outputs, each a different scaling of x."""
    x = b.input_(0, (8, 32), F32)
    outs = [b.mul(x, b.const(Fraction(k + 1))) for k in range(count)]
    return check(b.kernel_graph([x], outs, ["x"], [f"y{k}" for k in range(count)]))


def _no_fusion(monkeypatch) -> None:
    monkeypatch.setattr(siblings, "MAX_PARTS", 1)


# ---- the decision ---------------------------------------------------------------------------------


def test_independent_elementwise_kernels_share_one_launch(monkeypatch):
    kg = three_siblings()
    (group,) = kernel_roots(kg).launches
    assert len(group) == 3
    assert [k.kind for k in plan(kg).kernels] == ["siblings"]
    gp = generate(kg)
    (launch,) = gp.plan["launches"]
    starts = [int(g) for g in re.findall(r"\(blocks (\d+)-", gp.kernels[0].what)]
    assert starts[0] == 0 and len(starts) == 3
    assert launch["block"] == [256, 1, 1] and launch["smem"] == 0
    assert "(2 lanes per element)" in gp.kernels[0].what  # the reduction's part has a team
    _no_fusion(monkeypatch)
    unfused = generate(kg)
    assert len(unfused.plan["launches"]) == 3
    # the shared grid is the parts' grids end to end
    assert launch["grid"][0] == sum(k["grid"][0] for k in unfused.plan["launches"])


def test_a_kernel_read_by_its_siblings_gets_its_own_launch():
    kg = shared_producer()
    exp, readers = kernel_roots(kg).launches
    assert [n.op for n in exp] == [Op.EXP] and sorted(n.op.value for n in readers) == ["add", "mul"]
    assert _launches(kg) == 2


def test_a_launch_holds_at_most_max_parts():
    kg = many_siblings(siblings.MAX_PARTS + 3)
    assert [len(g) for g in kernel_roots(kg).launches] == [siblings.MAX_PARTS, 3]
    assert _launches(kg) == 2 == len(plan(kg).kernels)


def test_siblings_plan_json_names_its_parts():
    kg = three_siblings()
    (kp,) = plan(kg).kernels
    js = kp.to_json()
    assert js["kind"] == "siblings" and [p["kind"] for p in js["parts"]] == ["elementwise"] * 3
    assert js["shape"] == [sum(n.numel for n in kg.outputs)]
    assert kp.roots == kernel_roots(kg).launches[0] and kp.root is None


# ---- cost model and runtime plan ---------------------------------------------------------------


@pytest.mark.parametrize("build", [three_siblings, T.transformer_region0])
def test_cost_model_prices_one_launch(build, monkeypatch):
    kg = build()
    fused = program_cost(kg)
    assert fused.launches == _launches(kg)
    _no_fusion(monkeypatch)
    apart = program_cost(kg)
    assert apart.launches == _launches(kg) == fused.launches + 2
    assert fused.seconds < apart.seconds


def test_runtime_validator_accepts_a_sibling_launch():
    kg = three_siblings()
    gp = generate(kg)
    validate_plan(gp.plan, len(kg.inputs), len(kg.outputs))


# ---- transformer_tiny's region 0 (the Qwen2 / Llama region 0 pattern) ---------------------------


def test_rotary_region_goes_from_six_launches_to_four(monkeypatch):
    monkeypatch.setattr(rowfuse, "ROW_LEN", (0, -1))  # horizontal fusion alone (no row kernel)
    kg = T.transformer_region0()
    kinds = [k.kind for k in plan(kg).kernels]
    assert kinds == ["reduce", "stage", "gemm", "siblings"]
    assert _launches(kg) == 4
    _no_fusion(monkeypatch)
    assert _launches(kg) == 6


# ---- results on the host emulator ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, build",
    [
        ("three_siblings_f16", three_siblings),
        ("three_siblings_f32", lambda: three_siblings(F32)),
        ("shared_producer", shared_producer),
        ("transformer_region0", T.transformer_region0),
    ],
)
def test_emulated_sibling_launch_matches_the_interpreter(name, build):
    T.assert_emulated_matches(name, build())
