"""Row fusion (codegen/rowfuse.py, rowkernel.py): a reduction over the innermost axis and its one
row-wise reader run as one kernel, a warp per row reducing it and then writing the reader's
value with the reduced value in a register.

Checked here: the decision (which pairs form, and which must not: a second reader, a strided
axis, a short row, a reader that reads another row), the lowering plan and the launch plan agree,
the cost model prices one launch, a library GEMM's staged operand is a reader (RMSNorm -> q/k/v),
and the kernels compute what the interpreter does on the host emulator.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from mlso_cli import knobs as knobs_mod
from mlso_cli.codegen import generate, rowfuse, rowkernel, siblings
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


@pytest.fixture(autouse=True)
def _library_on(monkeypatch):
    """Library GEMMs on (the default) unless a test turns them off; knobs are read once."""
    knobs_mod.cache_clear()
    yield
    knobs_mod.cache_clear()


def _kinds(kg) -> list[str]:
    return [k.kind for k in plan(kg).kernels]


def _launches(kg) -> int:
    return len(generate(kg).plan["launches"])


def _no_rows(monkeypatch) -> None:
    monkeypatch.setattr(rowfuse, "ROW_LEN", (0, -1))


def rmsnorm(dt: DType = F16, rows: int = 12, n: int = 96, op: Op = Op.REDUCE_MEAN):
    """x * rsqrt(mean(x^2) + eps) * w, an output: the reduction and one elementwise reader."""
    x, w = b.input_(0, (2, rows, n), dt), b.input_(1, (n,), dt)
    xf = b.cast(x, F32)
    ms = b.reduce(op, b.mul(xf, xf), 2)
    y = b.mul(b.mul(xf, b.unary(Op.RSQRT, b.add(ms, b.const(Fraction(1, 10**6))))), b.cast(w, F32))
    return check(b.kernel_graph([x, w], [b.cast(y, dt)], ["x", "w"], ["y"]))


def centred(dt: DType = F32, rows: int = 8, n: int = 40):
    """x - max(x) along the row (REDUCE_MAX): one reader, a sum of an unrelated input."""
    x, z = b.input_(0, (rows, n), dt), b.input_(1, (rows, n), dt)
    m = b.reduce(Op.REDUCE_MAX, x, 1)
    return check(b.kernel_graph([x, z], [b.add(b.sub(x, m), z)], ["x", "z"], ["y"]))


def norm_linear(dt: DType = F16, m: int = 16, k: int = 64, n: int = 32):
    """RMSNorm, Cast, then @ W: the reader is the library GEMM's staged operand."""
    x, w = b.input_(0, (m, k), dt), b.input_(1, (k, n), dt)
    xf = b.cast(x, F32)
    ms = b.reduce(Op.REDUCE_MEAN, b.mul(xf, xf), 1)
    y = b.mul(xf, b.unary(Op.RSQRT, b.add(ms, b.const(Fraction(1, 10**6)))))
    return check(b.kernel_graph([x, w], [b.matmul(b.cast(y, dt), w)], ["x", "W"], ["y"]))


def layernorm_flat(
    dt: DType = F16, batch: int = 1, t: int = 12, k: int = 96, n: int = 48, flat=None
):
    """LayerNorm over (batch, t, k) (mean, then the variance of the centred row), scale and
    shift, then a view to (batch * t, k) and @ W + bias: GPT-2's ln_1 -> c_attn as its exporter
    writes it (the Gemm takes 2-D operands). `flat` replaces the view's shape."""
    x, g, c = b.input_(0, (batch, t, k), dt), b.input_(1, (k,), dt), b.input_(2, (k,), dt)
    flat = flat or (batch * t, k)
    w, bias = b.input_(3, (flat[-1], n), dt), b.input_(4, (n,), dt)
    inv = b.const(Fraction(1, k))
    xf = b.cast(x, F32)
    d = b.sub(xf, b.mul(b.reduce(Op.REDUCE_SUM, xf, 2), inv))
    var = b.mul(b.reduce(Op.REDUCE_SUM, b.mul(d, d), 2), inv)
    y = b.mul(d, b.unary(Op.RSQRT, b.add(var, b.const(Fraction(1, 10**5)))))
    y = b.add(b.mul(y, b.cast(g, F32)), b.cast(c, F32))
    y2 = b.reshape(b.cast(y, dt), flat)
    out = b.add(b.matmul(y2, w), bias)
    return check(b.kernel_graph([x, g, c, w, bias], [out], ["x", "g", "c", "W", "b"], ["y"]))


def two_readers(dt: DType = F32):
    """A row sum read by two output kernels: it stays a kernel of its own."""
    x = b.input_(0, (8, 64), dt)
    s = b.reduce(Op.REDUCE_SUM, x, 1)
    return check(b.kernel_graph([x], [b.div(x, s), b.mul(x, s)], ["x"], ["p", "q"]))


def strided_axis(dt: DType = F32):
    """A column sum (a strided axis, longer than the in-place limit) and its reader."""
    x = b.input_(0, (96, 40), dt)
    s = b.reduce(Op.REDUCE_SUM, x, 0)
    return check(b.kernel_graph([x], [b.div(x, s)], ["x"], ["p"]))


def other_row(dt: DType = F32):
    """The reader reads the reduction transposed (row i's element j uses row j's sum)."""
    x = b.input_(0, (48, 48), dt)
    s = b.reduce(Op.REDUCE_SUM, x, 1)
    st = b.transpose(b.broadcast_to(s, (48, 48)), (1, 0))
    return check(b.kernel_graph([x], [b.mul(x, st)], ["x"], ["p"]))


# ---- the decision ---------------------------------------------------------------------------------


@pytest.mark.parametrize("build", [rmsnorm, centred])
def test_a_row_reduction_and_its_reader_are_one_kernel(build, monkeypatch):
    kg = build()
    assert _kinds(kg) == ["row"] and _launches(kg) == 1
    (kp,) = plan(kg).kernels
    assert [p.kind for p in kp.parts] == ["reduce", "elementwise"]
    assert kp.to_json()["parts"][0]["kind"] == "reduce"
    validate_plan(generate(kg).plan, len(kg.inputs), len(kg.outputs))
    _no_rows(monkeypatch)
    assert _kinds(kg) == ["reduce", "elementwise"] and _launches(kg) == 2


def test_the_staged_operand_of_a_library_gemm_is_a_reader(monkeypatch):
    kg = norm_linear()
    assert _kinds(kg) == ["row", "gemm"]
    (row,) = [k for k in plan(kg).kernels if k.kind == "row"]
    assert [p.kind for p in row.parts] == ["reduce", "stage"]
    gp = generate(kg)
    assert [x.get("kind", "kernel") for x in gp.plan["launches"]] == ["kernel", "gemm"]
    assert "then stage a library GEMM operand" in gp.kernels[0].what


@pytest.mark.parametrize("batch", [1, 3])
def test_a_layernorm_read_through_a_flattening_view_is_one_row_kernel(batch, monkeypatch):
    """The staged operand is a (batch * t, k) view of the (batch, t, k) norm: the same rows, so
    the mean, the variance and the staging are one kernel (three launches when only equal shapes
    were rows: the mean with the centred row, the variance, the staging), and the value pass
    reads both reduced values from registers."""
    kg = layernorm_flat(batch=batch)
    assert _kinds(kg)[:2] == ["row", "gemm"]  # (then the bias add, printed as the epilogue)
    (row,) = [k for k in plan(kg).kernels if k.kind == "row"]
    assert [p.kind for p in row.parts] == ["reduce", "reduce", "stage"]
    gp = generate(kg)
    assert [x.get("kind", "kernel") for x in gp.plan["launches"]] == ["kernel", "gemm"]
    validate_plan(gp.plan, len(kg.inputs), len(kg.outputs))
    src = gp.kernels[0].source
    value_pass = src[src.index("const int i = o *") :]
    assert "acc0" in value_pass and "acc1" in value_pass and "sc" not in value_pass.split("=")[1]
    _no_rows(monkeypatch)  # no row kernels: two reductions, the centred row, the staging, the GEMM
    assert _launches(kg) == 5


def test_a_view_that_changes_the_row_length_is_not_a_row_reader():
    """(1, 12, 96) viewed as (24, 48): a staged row holds halves of two norm rows, so the
    reductions cannot be computed row by row in the staging kernel."""
    kg = layernorm_flat(flat=(24, 48), n=16)
    assert not any(p.operand is not None for p in kernel_roots(kg).rows.values())


def test_without_the_library_the_reduction_stays_a_kernel(monkeypatch):
    monkeypatch.setenv("MLSO_LIBRARY_GEMM", "0")
    knobs_mod.cache_clear()
    kg = norm_linear()
    assert _kinds(kg) == ["reduce", "matmul"] and _launches(kg) == 2


@pytest.mark.parametrize("build", [two_readers, strided_axis, other_row])
def test_no_row_kernel_where_the_rules_refuse(build):
    kg = build()
    assert not kernel_roots(kg).rows
    assert "row" not in _kinds(kg)


def test_a_short_row_is_not_fused():
    kg = rmsnorm(n=16)
    assert not kernel_roots(kg).rows and _launches(kg) == 2


@pytest.mark.parametrize("build", [rmsnorm, norm_linear, T.transformer_region0])
def test_cost_model_prices_one_launch(build, monkeypatch):
    kg = build()
    fused = program_cost(kg)
    assert fused.launches == _launches(kg)
    _no_rows(monkeypatch)
    apart = program_cost(kg)
    assert apart.launches == _launches(kg) == fused.launches + 1
    assert fused.seconds < apart.seconds


def test_rotary_region_takes_three_launches(monkeypatch):
    """RMSNorm -> q/k/v GEMM -> v, q rotary, k rotary: the norm's reduction and its staging are
    one kernel, the three elementwise kernels one more (6 launches before either rule)."""
    kg = T.transformer_region0()
    assert _kinds(kg) == ["row", "gemm", "siblings"] and _launches(kg) == 3
    _no_rows(monkeypatch)
    monkeypatch.setattr(siblings, "MAX_PARTS", 1)
    assert _launches(kg) == 6


# ---- results on the host emulator ------------------------------------------------------------------


BLOCK_ROWS = [
    ("rmsnorm_block_rows", lambda: rmsnorm(rows=2, n=2048)),
    ("centred_block_rows", lambda: centred(rows=3, n=1000)),
    ("norm_linear_block_rows", lambda: norm_linear(m=6, k=1536, n=32)),
    ("layernorm_flat_block_rows", lambda: layernorm_flat(batch=2, t=3, k=1536, n=32)),
]
"""Few long rows: a block per row (row_team), checked on the emulator and on the GPU."""


@pytest.mark.parametrize(
    "name, build",
    [
        ("rmsnorm_f16", rmsnorm),
        ("rmsnorm_f32_sum", lambda: rmsnorm(F32, rows=40, n=300, op=Op.REDUCE_SUM)),
        ("centred", centred),
        ("norm_linear", norm_linear),
        ("transformer_region0", T.transformer_region0),
        ("layernorm_flat", layernorm_flat),
        ("layernorm_flat_batch3", lambda: layernorm_flat(batch=3, t=5, k=640, n=24)),
        *BLOCK_ROWS,
    ],
)
def test_emulated_row_kernel_matches_the_interpreter(name, build, monkeypatch):
    kg = build()
    assert any(len(k.parts) >= 2 and k.kind == "row" for k in plan(kg).kernels)
    T.assert_emulated_matches(name, kg)


# ---- the team: a warp per row, or a block per row when the rows are few and long -------------------


def test_short_rows_keep_a_warp_per_row():
    assert rowkernel.row_team(rows=8, length=300) == 32
    assert rowkernel.row_team(rows=65536, length=rowkernel.WARP_ROW_LENGTH_MAX) == 32
    assert rowkernel.row_team(rows=1, length=64) == 32


def test_long_rows_share_a_block_as_measured():
    """The teams that timed fastest (or within 5%) on an H100 (row_team's docstring): 128 rows of
    896-3072 and 4096 rows of 4096 get 256 threads each, 8 rows of 4096 get 512."""
    for rows, length in [(128, 896), (128, 2048), (128, 3072), (4096, 4096)]:
        assert rowkernel.row_team(rows, length) == 256, (rows, length)
    assert rowkernel.row_team(rows=8, length=4096) == rowkernel.BLOCK_THREADS_MAX
    assert rowkernel.row_team(rows=1, length=1 << 20) == rowkernel.BLOCK_THREADS_MAX
    assert rowkernel.row_team(rows=4, length=600) == 256  # halved: 512 threads would get 1.2 each
    for rows, length in [(3, 1000), (128, 512), (512, 4096), (2, 64 * 1024), (9, 513)]:
        team = rowkernel.row_team(rows, length)
        assert team % 32 == 0 and 64 <= team <= rowkernel.BLOCK_THREADS_MAX
        assert length >= team * rowkernel.MIN_PER_THREAD


def test_a_block_per_row_kernel_is_planned_and_printed_as_one():
    kg = rmsnorm(rows=64, n=2048)  # 128 rows
    gp = generate(kg)
    (kernel,) = gp.kernels
    (launch,) = gp.plan["launches"]
    assert launch["grid"] == [128, 1, 1] and launch["block"] == [256, 1, 1]
    assert launch["smem"] == 8 * 4  # a float per warp for the all-reduce
    assert "block_allreduce<mlso::SumOp, 256>" in kernel.source
    assert "a block of 256 per row" in kernel.what
    short = generate(rmsnorm(rows=2048, n=256))  # rows of 256 keep a warp each
    assert "warp_allreduce" in short.kernels[0].source and "red[" not in short.kernels[0].source


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name, build", BLOCK_ROWS + [("rmsnorm_128x3072", lambda: rmsnorm(rows=64, n=3072))]
)
def test_block_row_kernels_on_gpu(name, build):
    from tests import test_codegen_gpu as G

    kg = build()
    assert any(k.kind == "row" for k in plan(kg).kernels)
    G._compare(name, kg, T.make_inputs(kg, name))


# ---- chains: several reductions over the same rows, and the values read only between them ----------


def softmax_pv(dt: DType = F16, g: int = 4, m: int = 24, n: int = 48, d: int = 16, out2=None):
    """softmax(scale * Q K, masked) @ V as lifting writes an attention core: the scaled scores
    (read by the stabiliser's row max and by the exp), exp * mask (read by the row sum and the
    division), the division staged for the P @ V GEMM. `out2(e, s)` adds a second output."""
    q, k = b.input_(0, (g, m, d), dt), b.input_(1, (g, d, n), dt)
    v, mask = b.input_(2, (g, n, d), dt), b.input_(3, (m, n), dt)
    s = b.mul(b.cast(b.matmul(q, k), F32), b.const(Fraction(1, 4)))
    e = b.mul(b.unary(Op.EXP, s), b.cast(mask, F32))
    p = b.div(e, b.reduce(Op.REDUCE_SUM, e, 2))
    outs = [b.matmul(b.cast(p, dt), v)] + ([out2(e, s)] if out2 else [])
    names = ["O"] + (["extra"] if out2 else [])
    return check(b.kernel_graph([q, k, v, mask], outs, ["Q", "K", "V", "mask"], names))


def layernorm(dt: DType = F16, rows: int = 12, n: int = 96):
    """(x - mean) * rsqrt(mean((x - mean)^2) + eps) * w + c: the centred value is read by the
    variance and by the output, the mean by both."""
    x, w, c = b.input_(0, (rows, n), dt), b.input_(1, (n,), dt), b.input_(2, (n,), dt)
    xf = b.cast(x, F32)
    cen = b.sub(xf, b.reduce(Op.REDUCE_MEAN, xf, 1))
    var = b.reduce(Op.REDUCE_MEAN, b.mul(cen, cen), 1)
    y = b.mul(cen, b.unary(Op.RSQRT, b.add(var, b.const(Fraction(1, 10**5)))))
    y = b.add(b.mul(y, b.cast(w, F32)), b.cast(c, F32))
    return check(b.kernel_graph([x, w, c], [b.cast(y, dt)], ["x", "w", "c"], ["y"]))


def _no_chains(monkeypatch) -> None:
    monkeypatch.setattr(rowfuse, "_grown", lambda *a: None)


def _row_parts(kg) -> list[list[str]]:
    return [[p.root.op.value for p in k.parts] for k in plan(kg).kernels if k.kind == "row"]


def test_a_softmax_before_its_gemm_is_one_row_kernel(monkeypatch):
    """Row max, row sum and the staging of P: one kernel, a pass over the row each; the scaled
    scores and exp * mask get no kernels (5 launches between the GEMMs become 1)."""
    kg = softmax_pv()
    assert _kinds(kg) == ["gemm", "row", "gemm"] and _launches(kg) == 3
    (row,) = [k for k in plan(kg).kernels if k.kind == "row"]
    assert [p.kind for p in row.parts] == ["reduce", "reduce", "stage"]
    assert row.parts[0].root.arg.weighted  # the stabiliser's masked row max first
    rows = kernel_roots(kg).rows
    (pair,) = set(rows.values())
    assert len(pair.inlined) == 2 and not pair.inlined & kernel_roots(kg).roots
    gp = generate(kg)
    validate_plan(gp.plan, len(kg.inputs), len(kg.outputs))
    (src,) = [k.source for k in gp.kernels if "softmax row max" in k.what]
    assert src.count("warp_allreduce") == 2 and "exp_rel" in src
    _no_chains(monkeypatch)
    assert _launches(kg) == 7


def test_a_layernorm_is_one_row_kernel(monkeypatch):
    kg = layernorm()
    assert _kinds(kg) == ["row"] and _launches(kg) == 1
    assert _row_parts(kg) == [["reduce_mean", "reduce_mean", "cast"]]
    _no_chains(monkeypatch)  # the mean and the centred value, then the variance and y: 2 pairs
    assert _row_parts(kg) == [["reduce_mean", "sub"], ["reduce_mean", "cast"]]
    assert _launches(kg) == 2


def test_an_elementwise_softmax_output_is_one_row_kernel():
    kg = T.masked_softmax()
    assert _kinds(kg) == ["row"] and _launches(kg) == 1
    assert [p.kind for p in plan(kg).kernels[0].parts] == ["reduce", "reduce", "elementwise"]


def test_a_value_read_elsewhere_is_not_inlined():
    """The scaled scores as a second output stay a kernel (the chain reads them); exp * mask
    read by a second output kernel keeps the softmax's kernels apart as before."""
    scores_out = softmax_pv(out2=lambda e, s: s)  # stored, then copied out (roots.py)
    assert _kinds(scores_out) == ["gemm", "elementwise", "row", "gemm", "elementwise"]
    (pair,) = set(kernel_roots(scores_out).rows.values())
    assert len(pair.inlined) == 1 and len(pair.chain) == 1
    exp_out = softmax_pv(out2=lambda e, s: b.mul(e, b.const(2)))
    assert not any(len(p) > 2 for p in _row_parts(exp_out))
    assert all(not p.inlined for p in kernel_roots(exp_out).rows.values())


@pytest.mark.parametrize("build", [softmax_pv, layernorm, T.masked_softmax])
def test_cost_model_prices_a_chain_as_one_launch(build, monkeypatch):
    kg = build()
    fused = program_cost(kg)
    assert fused.launches == _launches(kg)
    _no_chains(monkeypatch)
    apart = program_cost(kg)
    assert apart.launches == _launches(kg) > fused.launches
    assert fused.seconds < apart.seconds


CHAINS = [
    ("softmax_pv_f16", softmax_pv),
    ("softmax_pv_bf16", lambda: softmax_pv(DType.BF16, g=2, m=8, n=40)),
    ("softmax_pv_block_rows", lambda: softmax_pv(g=1, m=3, n=1024)),
    ("layernorm_f16", layernorm),
    ("layernorm_block_rows", lambda: layernorm(rows=2, n=1536)),
]
"""Chains on the emulator and the GPU: warp rows, and few long rows (a block per row)."""


@pytest.mark.parametrize("name, build", CHAINS)
def test_emulated_row_chain_matches_the_interpreter(name, build):
    kg = build()
    assert any(len(k.parts) == 3 for k in plan(kg).kernels if k.kind == "row")
    T.assert_emulated_matches(name, kg)


def test_emulated_chain_keeps_huge_logits_finite():
    """Logits near 300, and masked positions far larger: the row max skips masked entries and
    each pass computes exp relative to it, so nothing overflows (fp32 exp overflows past 88)."""
    from mlso_cli.codegen import hostemu

    kg = softmax_pv(F32)
    ins = T.make_inputs(kg, "softmax_pv_huge")
    ins[0] = ins[0] * 40
    want = T.reference(kg, ins)
    (got,) = hostemu.run(generate(kg), ins)
    assert np.isfinite(got).all()
    assert T.rel_error(np.asarray(got, np.float64), want[0]) <= T.TOLERANCE[F32]


@pytest.mark.gpu
@pytest.mark.parametrize("name, build", CHAINS)
def test_row_chains_on_gpu(name, build):
    from tests import test_codegen_gpu as G

    kg = build()
    assert any(len(k.parts) == 3 for k in plan(kg).kernels if k.kind == "row")
    G._compare(name, kg, T.make_inputs(kg, name))


def test_without_the_library_a_chain_runs_as_its_reductions_and_stays_correct(monkeypatch):
    """A chain whose reader is a matmul that stays generated: its reductions run alone, in
    order, and the inlined values are recomputed where they are read (the matmul's operand
    prologue); the result still matches the interpreter on the emulator."""
    monkeypatch.setenv("MLSO_LIBRARY_GEMM", "0")
    knobs_mod.cache_clear()
    kg = softmax_pv(g=2, m=16, n=40)
    assert _kinds(kg) == ["matmul", "reduce", "reduce", "matmul"] and _launches(kg) == 4
    T.assert_emulated_matches("softmax_pv_nolib", kg)


def test_a_pair_whose_operand_is_read_in_place_still_computes_its_reduction():
    """A matmul reading a row sum broadcast along the row (fp32: a view the library reads in
    place, stride 0): no staging kernel computes the deferred reduction, so it runs alone before
    the GEMM (Lowering.flush_deferred) and the product is right."""
    x, w = b.input_(0, (8, 64), F32), b.input_(1, (64, 16), F32)
    s = b.broadcast_to(b.reduce(Op.REDUCE_SUM, x, 1), (8, 64))
    kg = check(b.kernel_graph([x, w], [b.matmul(s, w)], ["x", "w"], ["y"]))
    gp = generate(kg)
    assert [x.get("kind", "kernel") for x in gp.plan["launches"]] == ["kernel", "gemm"]
    T.assert_emulated_matches("rowsum_in_place", kg)
