"""Library GEMMs (codegen/libgemm.py) on the CPU: which kernel-level matmuls become cuBLASLt
launches and which stay generated, how operands are read (in place, transposed, batch-broadcast,
or staged in their own dtype), which bias and residual epilogues they take, that the plans
validate in Python and C++, that the host emulator runs them as the interpreter's "as codegen
computes" mode says, and how the cost model prices them. GPU runs are in test_libgemm_gpu.py."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest

from mlso_cli import knobs as knobs_mod
from mlso_cli.codegen import generate, hostemu, rowfuse
from mlso_cli.codegen.plan import plan as lowering_plan
from mlso_cli.ir import DType, Op
from mlso_cli.ir import build as b
from mlso_cli.runtime.plan import PlanProblem, parse_plan, plan_json
from mlso_cli.search.cost import H200, library_gemm_s, program_cost
from mlso_cli.verify import interpreter

F16, BF16, F32 = DType.F16, DType.BF16, DType.F32


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path_factory):
    if not knobs_mod.knobs().cache_dir.name.startswith("mlso-test"):
        monkeypatch.setenv("MLSO_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "mlso-test"))
    monkeypatch.delenv("MLSO_LIBRARY_GEMM", raising=False)
    knobs_mod.cache_clear()
    yield
    knobs_mod.cache_clear()


# ---- graphs -------------------------------------------------------------------------------------


def plain(dt=F16, batch=2, m=8, k=32, n=24):
    """x[batch, m, k] @ W[k, n] broadcast over the batch: both read in place, W with stride 0."""
    x = b.input_(0, (batch, m, k), dt)
    w = b.input_(1, (k, n), dt)
    return b.kernel_graph([x, w], [b.matmul(x, b.broadcast_to(w, (batch, k, n)))])


def transposed(dt=F16, batch=2, m=8, k=32, n=24):
    """A stored [batch, k, m] and W stored [n, k] (a Linear's weight): both read transposed."""
    xt = b.input_(0, (batch, k, m), dt)
    w = b.input_(1, (n, k), dt)
    a = b.transpose(xt, (0, 2, 1))
    wt = b.broadcast_to(b.transpose(w, (1, 0)), (batch, k, n))
    return b.kernel_graph([xt, w], [b.matmul(a, wt)])


def norm_linear(dt=F16, m=4, k=32, n=16):
    """RMSNorm in fp32, Cast to the matmul's dtype, then @ W: the operand is staged in dt."""
    x = b.input_(0, (m, k), dt)
    w = b.input_(1, (k, n), dt)
    xf = b.cast(x, F32)
    ms = b.reduce(Op.REDUCE_MEAN, b.mul(xf, xf), 1)
    y = b.mul(xf, b.unary(Op.RSQRT, b.add(ms, b.const(1e-6))))
    return b.kernel_graph([x, w], [b.matmul(b.cast(y, dt), w)])


def norm_projections(dt=F16, m=4, k=32, n=(16, 8, 8), also_read: bool = False):
    """RMSNorm(x) * gamma in dt, read by three projections (q, k, v with weights as inputs):
    the normed value is kept in dt and each GEMM reads it in place. also_read: the value is an
    output too (a reader that is no GEMM), so it is not the GEMMs' alone."""
    x = b.input_(0, (m, k), dt)
    g = b.input_(1, (k,), dt)
    ws = [b.input_(2 + i, (k, w), dt) for i, w in enumerate(n)]
    xf = b.cast(x, F32)
    ms = b.reduce(Op.REDUCE_MEAN, b.mul(xf, xf), 1)
    y = b.mul(b.cast(b.mul(xf, b.unary(Op.RSQRT, b.add(ms, b.const(1e-6)))), dt), g)
    outs = [b.matmul(y, w) for w in ws] + ([b.unary(Op.NEG, y)] if also_read else [])
    return b.kernel_graph([x, g, *ws], outs)


def linear_then_gelu_like(dt=F16, m=4, k=32, n=16):
    """An output computed from the matmul: C goes to scratch (in the matmul's dtype) that the
    next kernel reads."""
    x = b.input_(0, (m, k), dt)
    w = b.input_(1, (k, n), dt)
    h = b.cast(b.matmul(x, w), F32)
    return b.kernel_graph([x, w], [b.cast(b.mul(h, b.unary(Op.SIGMOID, h)), dt)])


def broadcast_batch(dt=F32):
    """Batch (2, 1) x (3,): neither operand's batch is one stride (A varies along the first dim
    only, W along the second only), so both are staged whole (6 entries each)."""
    a = b.input_(0, (2, 1, 5, 7), dt)
    w = b.input_(1, (3, 7, 4), dt)
    a6 = b.broadcast_to(a, (2, 3, 5, 7))
    w6 = b.broadcast_to(w, (2, 3, 7, 4))
    return b.kernel_graph([a, w], [b.matmul(a6, w6)])


def biased(dt=F16, batch=2, m=8, k=32, n=24):
    """x @ W + bias (ONNX MatMul + Add), the sum the output: one GEMM with a bias epilogue that
    writes the output directly."""
    x = b.input_(0, (batch, m, k), dt)
    w = b.input_(1, (k, n), dt)
    bias = b.input_(2, (n,), dt)
    mm = b.matmul(x, b.broadcast_to(w, (batch, k, n)))
    return b.kernel_graph([x, w, bias], [b.add(mm, b.broadcast_to(bias, (batch, m, n)))])


def biased_row(dt=F32, m=8, k=32, n=24):
    """Gemm's C as a [1, n] row broadcast over the rows, added on the left: still a bias."""
    x = b.input_(0, (m, k), dt)
    w = b.input_(1, (k, n), dt)
    bias = b.input_(2, (1, n), dt)
    return b.kernel_graph([x, w, bias], [b.add(b.broadcast_to(bias, (m, n)), b.matmul(x, w))])


def biased_silu(dt=F32, bias_dt=None, m=8, k=32, n=24):
    """h = x @ W + bias, then h * sigmoid(h): the ADD is inlined into the next kernel, which then
    reads the GEMM's C (bias included) instead of adding the bias itself."""
    x = b.input_(0, (m, k), dt)
    w = b.input_(1, (k, n), dt)
    bias = b.input_(2, (n,), bias_dt or dt)
    bb = b.broadcast_to(bias, (m, n))
    if bias_dt is not None and bias_dt != dt:
        bb = b.cast(bb, dt)
    h = b.add(b.matmul(x, w), bb)
    return b.kernel_graph([x, w, bias], [b.mul(h, b.unary(Op.SIGMOID, h))])


def residual(dt=F16, batch=2, m=8, k=32, n=24, left=False):
    """x @ W + R (o_proj or down_proj + the residual stream), the sum the output: one GEMM with
    the residual as cuBLASLt's C (beta 1) and the output as its D. batch=0: unbatched 2-D."""
    lead = (batch,) if batch else ()
    x = b.input_(0, (*lead, m, k), dt)
    w = b.input_(1, (k, n), dt)
    r = b.input_(2, (*lead, m, n), dt)
    mm = b.matmul(x, b.broadcast_to(w, (*lead, k, n)))
    return b.kernel_graph([x, w, r], [b.add(r, mm) if left else b.add(mm, r)])


def residual_strided(dt=F16, batch=2, m=8, k=32, n=24):
    """The residual stored [m, batch, n] (sequence-major) and read as [batch, m, n]: rows
    batch * n apart, entries n apart, still read in place (ld > n)."""
    x = b.input_(0, (batch, m, k), dt)
    w = b.input_(1, (k, n), dt)
    r = b.input_(2, (m, batch, n), dt)
    mm = b.matmul(x, b.broadcast_to(w, (batch, k, n)))
    return b.kernel_graph([x, w, r], [b.add(mm, b.transpose(r, (1, 0, 2)))])


def residual_transposed(dt=F16, m=8, k=32, n=24):
    """The residual stored [n, m] and read transposed: cuBLASLt's C is never transposed, so the
    ADD stays an add (a kernel after the GEMM)."""
    x = b.input_(0, (m, k), dt)
    w = b.input_(1, (k, n), dt)
    rt = b.input_(2, (n, m), dt)
    return b.kernel_graph([x, w, rt], [b.add(b.matmul(x, w), b.transpose(rt, (1, 0)))])


def residual_cast(dt=F16, m=8, k=32, n=24):
    """An fp32 residual cast to the matmul's dtype: not C's dtype as stored, so it stays an add."""
    x = b.input_(0, (m, k), dt)
    w = b.input_(1, (k, n), dt)
    r = b.input_(2, (m, n), F32)
    return b.kernel_graph([x, w, r], [b.add(b.matmul(x, w), b.cast(r, dt))])


def residual_computed(dt=F16, m=8, k=32, n=24):
    """A residual computed in the program (sigmoid of an input), not a program input: it stays
    an add, since the GEMM could run before the residual's kernel has written it."""
    x = b.input_(0, (m, k), dt)
    w = b.input_(1, (k, n), dt)
    r = b.input_(2, (m, n), dt)
    return b.kernel_graph([x, w, r], [b.add(b.matmul(x, w), b.unary(Op.SIGMOID, r))])


def residual_silu(dt=F32, m=8, k=32, n=24):
    """h = x @ W + R, then h * sigmoid(h): the GEMM adds R (in C's dtype: the matmul's own, fp32
    or 16-bit) and the next kernel reads C."""
    x = b.input_(0, (m, k), dt)
    w = b.input_(1, (k, n), dt)
    r = b.input_(2, (m, n), dt)
    h = b.add(b.matmul(x, w), r)
    return b.kernel_graph([x, w, r], [b.mul(h, b.unary(Op.SIGMOID, h))])


def bias_then_residual(dt=F32, m=8, k=32, n=24):
    """(x @ W + bias) + R: one epilogue per GEMM, the matmul's reader (the bias ADD) decides, so
    the GEMM adds the bias (into fp32 scratch: in fp32 only, see biased_silu) and the residual
    ADD is a kernel of its own."""
    x = b.input_(0, (m, k), dt)
    w = b.input_(1, (k, n), dt)
    bias = b.input_(2, (n,), dt)
    r = b.input_(3, (m, n), dt)
    h = b.add(b.matmul(x, w), b.broadcast_to(bias, (m, n)))
    return b.kernel_graph([x, w, bias, r], [b.add(h, r)])


def softmax_scores(dt=F16, bias: bool = False, heads=2, m=8, k=16, n=12):
    """softmax(q @ k (+ bias)) over the keys: the scores feed a stabilised EXP, so C stays fp32
    (a logit of 100 in fp16 is off by 0.03)."""
    q = b.input_(0, (heads, m, k), dt)
    kt = b.input_(1, (heads, k, n), dt)
    s = b.matmul(q, kt)
    ins = [q, kt]
    if bias:
        bv = b.input_(2, (n,), dt)
        ins.append(bv)
        s = b.add(s, b.broadcast_to(bv, (heads, m, n)))
    e = b.unary(Op.EXP, b.cast(s, F32))
    den = b.reduce(Op.REDUCE_SUM, e, 2)
    return b.kernel_graph(ins, [b.cast(b.div(e, b.broadcast_to(den, (heads, m, n))), dt)])


def heads_out(dt=F16, h=3, m=8, k=32, d=16):
    """P @ V per head, handed on as [m, h * d] (transpose then reshape), as an attention core
    writes its output: the GEMM stores C through the views (roots.through_views)."""
    p, v = b.input_(0, (h, m, k), dt), b.input_(1, (h, k, d), dt)
    o = b.reshape(b.transpose(b.matmul(p, v), (1, 0, 2)), (m, h * d))
    return b.kernel_graph([p, v], [o], ["P", "V"], ["O"])


GRAPHS = {
    "heads_out_f16": heads_out,
    "heads_out_f32": lambda: heads_out(F32, h=2, m=5, k=12, d=8),
    "plain_f16": plain,
    "plain_bf16": lambda: plain(BF16),
    "plain_f32": lambda: plain(F32),
    "transposed_f16": transposed,
    "norm_linear_f16": norm_linear,
    "norm_linear_bf16": lambda: norm_linear(BF16),
    "linear_sigmoid_f16": linear_then_gelu_like,
    "norm_projections_f16": norm_projections,
    "norm_projections_bf16": lambda: norm_projections(BF16),
    "norm_projections_also_read_f16": lambda: norm_projections(also_read=True),
    "broadcast_batch_f32": broadcast_batch,
    "bias_f16": biased,
    "bias_bf16": lambda: biased(BF16),
    "bias_f32": lambda: biased(F32),
    "bias_row_f32": biased_row,
    "bias_silu_f32": biased_silu,
    "bias_silu_f16_bias": lambda: biased_silu(F16),
    "residual_f16": residual,
    "residual_bf16": lambda: residual(BF16),
    "residual_f32": lambda: residual(F32, batch=0),
    "residual_left_f32": lambda: residual(F32, batch=3, left=True),
    "residual_2d_f16": lambda: residual(F16, batch=0),
    "residual_strided_f16": residual_strided,
    "residual_silu_f32": residual_silu,
    "residual_silu_f16": lambda: residual_silu(F16),
    "softmax_scores_f16": softmax_scores,
    "softmax_scores_bias_f16": lambda: softmax_scores(bias=True),
    "refused_residual_transposed_f16": residual_transposed,
    "refused_residual_transposed_f32": lambda: residual_transposed(F32),
    "refused_residual_cast_f16": residual_cast,
    "refused_residual_computed_f16": residual_computed,
    "refused_residual_computed_f32": lambda: residual_computed(F32),
    "bias_then_residual_f32": bias_then_residual,
    "bias_then_residual_f16": lambda: bias_then_residual(F16),
}


def gemms(gp):
    return [launch for launch in gp.plan["launches"] if launch.get("kind") == "gemm"]


# ---- the lowering choice ------------------------------------------------------------------------


def test_plain_operands_are_read_in_place_with_a_broadcast_stride():
    gp = generate(plain())
    (g,) = gemms(gp)
    assert gp.plan["version"] == 2 and len(gp.plan["launches"]) == 1 and gp.plan["scratch"] == []
    assert (g["m"], g["n"], g["k"], g["batch"]) == (8, 24, 32, 2)
    assert g["a"] == {
        "buf": {"kind": "input", "index": 0},
        "offset": 0,
        "ld": 32,
        "stride": 256,
        "trans": False,
    }
    assert g["b"]["buf"] == {"kind": "input", "index": 1} and g["b"]["stride"] == 0
    assert g["c"]["buf"] == {"kind": "output", "index": 0} and g["c"]["stride"] == 8 * 24
    assert g["dtype_ab"] == g["dtype_c"] == "float16"
    assert gp.kernel_names == [] and "gemm_mma" not in gp.source


def test_transposed_operands_become_cublas_transposes_not_copies():
    gp = generate(transposed())
    (g,) = gemms(gp)
    assert len(gp.plan["launches"]) == 1
    assert g["a"]["trans"] and g["a"]["ld"] == 8 and g["a"]["stride"] == 32 * 8
    assert g["b"]["trans"] and g["b"]["ld"] == 32 and g["b"]["stride"] == 0


@pytest.mark.parametrize("dt", [F16, BF16])
def test_an_elementwise_chain_is_staged_in_the_operands_own_dtype(dt):
    gp = generate(norm_linear(dt))
    (g,) = gemms(gp)
    assert gp.plan["launches"][-1] is g  # the GEMM runs after its staging kernel
    ref = g["a"]["buf"]
    assert ref["kind"] == "scratch"
    staged = gp.plan["scratch"][ref["index"]]
    assert staged == {"bytes": 4 * 32 * 2, "dtype": dt.value, "shape": [4, 32]}
    writer = [
        launch
        for launch in gp.plan["launches"]
        if launch.get("kind") != "gemm" and ref in launch["args"]
    ]
    assert len(writer) == 1
    assert "stage a library GEMM operand" in gp.source
    assert g["b"]["buf"] == {"kind": "input", "index": 1}


@pytest.mark.parametrize("dt", [F16, BF16])
def test_the_norms_input_cast_is_recomputed_by_its_readers_not_stored(dt):
    """RMSNorm reads Cast(x) twice (sum of squares, scaling). The cast gets no kernel: the
    reduction and the staging each convert the 16-bit x they load, so the program is the row
    kernel (the reduction, then the staging: codegen/rowfuse.py) and the GEMM, and no fp32 copy
    of x is written (emulated against the interpreter in
    test_emulated_library_gemm_matches_the_interpreter[norm_linear_*])."""
    gp = generate(norm_linear(dt))
    kinds = [launch.get("kind", "kernel") for launch in gp.plan["launches"]]
    assert len(kinds) == 2 and kinds[-1] == "gemm"
    assert {"bytes": 4 * 32 * 4, "dtype": "float32", "shape": [4, 32]} not in gp.plan["scratch"]
    # a cast of a computed value read twice, by the reduction and the staging only, is
    # recomputed in both passes of the row kernel (rowfuse.RowPair.inlined): no kernel of its
    # own, no fp32 scratch (the row kernel, the GEMM)
    x = b.input_(0, (4, 32), dt)
    w = b.input_(1, (32, 16), dt)
    hf = b.cast(b.mul(x, x), F32)
    ms = b.reduce(Op.REDUCE_MEAN, b.mul(hf, hf), 1)
    y = b.mul(hf, b.unary(Op.RSQRT, b.add(ms, b.const(1e-6))))
    gp2 = generate(b.kernel_graph([x, w], [b.matmul(b.cast(y, dt), w)]))
    assert len(gp2.plan["launches"]) == 2
    assert all(sc["bytes"] != 4 * 32 * 4 for sc in gp2.plan["scratch"])  # no fp32 (4, 32)


def test_heads_handed_on_as_rows_are_written_by_the_gemm_through_the_views(monkeypatch):
    """[h, m, d] products transposed and reshaped to [m, h * d]: C's leading dimension is the
    row of all heads and each head's batch stride is d, so no copy kernel follows the GEMM."""
    gp = generate(heads_out())
    assert len(gp.plan["launches"]) == 1
    (g,) = gemms(gp)
    assert g["batch"] == 3 and g["c"]["ld"] == 3 * 16 and g["c"]["stride"] == 16
    assert g["c"]["buf"] == {"kind": "output", "index": 0}
    assert gp.plan["scratch"] == []
    # without the library a generated matmul stores each element through the same strides
    monkeypatch.setenv("MLSO_LIBRARY_GEMM", "0")
    knobs_mod.cache_clear()
    kg = heads_out()
    gen = generate(kg)
    assert len(gen.plan["launches"]) == 1 and not gemms(gen)
    ins = [np.random.default_rng(3).standard_normal(n.shape).astype(np.float16) for n in kg.inputs]
    (got,) = hostemu.run(gen, ins)
    want = interpreter.run(kg, ins, "float64")[0]
    assert np.abs(np.asarray(got, np.float64) - want).max() <= 4 * TOL[F16] * np.abs(want).max()


def test_a_matmul_read_by_later_kernels_writes_scratch_in_its_own_16bit_dtype():
    """C is rounded where ONNX Runtime rounds the MatMul's output (libgemm.c_dtype): the GEMM
    writes half the bytes and the next kernel reads half."""
    gp = generate(linear_then_gelu_like())
    (g,) = gemms(gp)
    assert g["dtype_ab"] == "float16" and g["dtype_c"] == "float16"
    assert g["c"]["buf"]["kind"] == "scratch"
    assert gp.plan["scratch"][g["c"]["buf"]["index"]]["dtype"] == "float16"
    assert "const __half* __restrict__ sc" in gp.source
    # the lowering plan's storage sketch says the same
    from mlso_cli.codegen.plan import _storage_sketch
    from mlso_cli.codegen.roots import kernel_roots

    kg = linear_then_gelu_like()
    kr = kernel_roots(kg)
    mm = next(n for n in kr.order if n.op is Op.MATMUL)
    assert _storage_sketch(kg, kr)[mm].dtype is F16


@pytest.mark.parametrize("bias", [False, True])
def test_scores_read_by_a_softmax_keep_fp32_scratch(bias):
    """Logits stay fp32; a 16-bit bias cuBLASLt would read in C's type then stays an add."""
    gp = generate(softmax_scores(bias=bias))
    (g,) = gemms(gp)
    assert g["dtype_c"] == "float32" and "bias" not in g
    assert "dtype" not in gp.plan["scratch"][g["c"]["buf"]["index"]]  # plain fp32 scratch
    if bias:
        assert "ew::add" in gp.source


def test_c_dtype_follows_readers_through_elementwise_ops_but_not_matmuls():
    from mlso_cli.codegen.libgemm import c_dtype
    from mlso_cli.codegen.stabilise import consumers_of, stabilisers

    for kg, want in ((softmax_scores(), F32), (linear_then_gelu_like(), F16)):
        nodes = kg.nodes()
        cons = consumers_of(nodes)
        mm = next(n for n in nodes if n.op is Op.MATMUL)
        assert c_dtype(mm, cons, stabilisers(nodes, cons)) is want
    # fp32 operands keep fp32; so does a product handed to another matmul's softmax only through
    # that matmul (its operand is rounded to 16 bits there anyway): 16-bit
    assert c_dtype(plain(F32).outputs[0], {}, {}) is F32
    x = b.input_(0, (2, 8, 16), F16)
    w = b.input_(1, (16, 16), F16)
    q = b.matmul(x, b.broadcast_to(w, (2, 16, 16)))
    kt = b.input_(2, (2, 16, 12), F16)
    s = b.matmul(q, kt)
    e = b.unary(Op.EXP, b.cast(s, F32))
    out = b.cast(b.div(e, b.broadcast_to(b.reduce(Op.REDUCE_SUM, e, 2), (2, 8, 12))), F16)
    kg = b.kernel_graph([x, w, kt], [out])
    nodes = kg.nodes()
    cons = consumers_of(nodes)
    stab = stabilisers(nodes, cons)
    assert c_dtype(q, cons, stab) is F16 and c_dtype(s, cons, stab) is F32


def test_a_value_only_gemms_read_is_kept_in_their_dtype_and_read_in_place():
    """A norm feeding three projections: one kernel writes the normed value in fp16 and the three
    GEMMs read it in place (4 launches); each used to stage its own rounded copy (7). When
    something else reads the value too it stays fp32 and each GEMM stages it."""
    gp = generate(norm_projections())
    kinds = [launch.get("kind", "kernel") for launch in gp.plan["launches"]]
    assert kinds == ["kernel", "gemm", "gemm", "gemm"]
    srcs = {json.dumps(g["a"]["buf"]) for g in gemms(gp)}
    assert len(srcs) == 1 and '"scratch"' in srcs.pop()
    assert "stage a library GEMM operand" not in gp.source
    other = generate(norm_projections(also_read=True))
    assert sum(1 for k in other.kernels if "stage a library GEMM operand" in k.what) == 3


def test_a_batch_broadcast_that_is_not_one_stride_is_staged_whole():
    gp = generate(broadcast_batch())
    (g,) = gemms(gp)
    assert g["batch"] == 6 and g["a"]["buf"]["kind"] == "scratch" and g["a"]["stride"] == 35
    assert g["b"]["buf"]["kind"] == "scratch" and g["b"]["stride"] == 28
    assert len(gp.plan["launches"]) == 3
    assert g["dtype_ab"] == "float32"


def test_the_switch_keeps_generated_matmuls(monkeypatch):
    """MLSO_LIBRARY_GEMM=0: every matmul generated, the plan exactly as before (version 1).
    (Operands of different dtypes, the other case cuBLASLt could not take, fail the spec.)"""
    monkeypatch.setenv("MLSO_LIBRARY_GEMM", "0")
    knobs_mod.cache_clear()
    off = generate(plain())
    assert not gemms(off) and off.plan["version"] == 1 and "gemm_mma_64x64" in off.source
    assert lowering_plan(plain()).kernels[0].kind == "matmul"


def test_a_scaled_softmax_numerator_stays_in_the_generated_matmul():
    """exp(s - max) kept relative to its row max feeds the matmul directly (no division before
    it): the generated kernel carries the scale into C, the library could not."""
    s = b.input_(0, (8, 16), F32)
    v = b.input_(1, (16, 4), F32)
    e = b.unary(Op.EXP, s)
    o = b.div(b.matmul(e, v), b.reduce(Op.REDUCE_SUM, e, 1))
    gp = generate(b.kernel_graph([s, v], [o]))
    kinds = [launch.get("kind", "kernel") for launch in gp.plan["launches"]]
    assert "gemm" not in kinds and "gemm_simt_64x64" in gp.source


def test_a_bias_becomes_the_gemms_epilogue_writing_the_output():
    gp = generate(biased())
    (g,) = gemms(gp)
    assert gp.plan["version"] == 3 and len(gp.plan["launches"]) == 1 and gp.plan["scratch"] == []
    assert g["bias"] == {"buf": {"kind": "input", "index": 2}, "offset": 0}
    assert g["c"]["buf"] == {"kind": "output", "index": 0} and g["dtype_c"] == "float16"
    assert "+ bias" in gp.source


def test_a_row_bias_on_the_left_is_a_bias_too():
    (g,) = gemms(generate(biased_row()))
    assert g["bias"]["buf"] == {"kind": "input", "index": 2}


def test_an_inlined_bias_add_reads_the_gemms_c_instead():
    gp = generate(biased_silu())
    g, k = gp.plan["launches"]
    assert g["bias"]["buf"] == {"kind": "input", "index": 2} and g["dtype_c"] == "float32"
    assert {"kind": "input", "index": 2} not in k["args"] and g["c"]["buf"] in k["args"]
    assert "ew::add" not in gp.source


def test_a_16bit_bias_into_16bit_scratch_is_an_epilogue():
    """cuBLASLt reads the bias in C's type: with C in the matmul's 16-bit dtype an fp16 bias
    qualifies, and the next kernel reads C (bias included) instead of adding it."""
    gp = generate(biased_silu(F16))
    (g,) = gemms(gp)
    assert g["bias"]["buf"] == {"kind": "input", "index": 2}
    assert g["dtype_c"] == "float16"
    assert "ew::add" not in gp.source


def test_no_epilogue_where_the_product_alone_is_read_or_the_addend_is_no_bias():
    x = b.input_(0, (8, 32), F32)
    w = b.input_(1, (32, 24), F32)
    bias = b.input_(2, (24,), F32)
    full = b.input_(2, (8, 24), F32)
    mm = b.matmul(x, w)
    twice = b.kernel_graph([x, w, bias], [b.add(mm, b.broadcast_to(bias, (8, 24))), mm])
    assert all("bias" not in g for g in gemms(generate(twice)))
    full_sum = b.kernel_graph([x, w, full], [b.add(b.matmul(x, w), full)])
    (g,) = gemms(generate(full_sum))
    assert "bias" not in g and "residual" in g  # a full matrix is a residual, not a bias
    col = b.input_(2, (8, 1), F32)  # one value per row: cuBLASLt's bias is one per column
    rows = b.kernel_graph([x, w, col], [b.add(b.matmul(x, w), b.broadcast_to(col, (8, 24)))])
    assert all("bias" not in g for g in gemms(generate(rows)))


@pytest.mark.parametrize("dt", [F16, BF16, F32])
def test_a_residual_becomes_cublas_c_with_beta_one_writing_the_output(dt):
    gp = generate(residual(dt))
    (g,) = gemms(gp)
    assert gp.plan["version"] == 4 and len(gp.plan["launches"]) == 1 and gp.plan["scratch"] == []
    assert g["residual"] == {
        "buf": {"kind": "input", "index": 2},
        "offset": 0,
        "ld": 24,
        "stride": 8 * 24,
    }
    assert g["beta"] == 1.0 and g["alpha"] == 1.0 and "bias" not in g
    assert g["c"]["buf"] == {"kind": "output", "index": 0} and g["dtype_c"] == dt.value
    assert "+ residual" in gp.source and gp.kernel_names == []


def test_an_unbatched_residual_added_on_the_left_is_a_residual_too():
    for kg in (residual(F32, batch=0), residual(F16, batch=0, left=True)):
        (g,) = gemms(generate(kg))
        assert g["batch"] == 1 and g["residual"]["stride"] == 0 and g["residual"]["ld"] == 24


def test_a_strided_residual_is_read_in_place_with_its_leading_dimension():
    gp = generate(residual_strided())
    (g,) = gemms(gp)
    assert len(gp.plan["launches"]) == 1
    assert g["residual"] == {
        "buf": {"kind": "input", "index": 2},
        "offset": 0,
        "ld": 48,
        "stride": 24,
    }


@pytest.mark.parametrize("dt", [F32, F16])
def test_an_inlined_residual_add_reads_the_gemms_c_instead(dt):
    """A residual in C's dtype (fp32 with fp32 scratch, fp16 with the 16-bit scratch a 16-bit
    matmul now gets) is cuBLASLt's C; the next kernel reads the sum."""
    gp = generate(residual_silu(dt))
    g, k = gp.plan["launches"]
    assert g["residual"]["buf"] == {"kind": "input", "index": 2} and g["dtype_c"] == dt.value
    assert {"kind": "input", "index": 2} not in k["args"] and g["c"]["buf"] in k["args"]
    assert "ew::add" not in gp.source


@pytest.mark.parametrize(
    "make",
    [
        residual_transposed,  # cuBLASLt's C is never transposed
        residual_cast,  # fp32 residual cast to fp16: another dtype as stored
        residual_computed,  # not a program input
    ],
    ids=["transposed", "cast", "computed"],
)
def test_a_residual_the_library_cannot_read_as_c_stays_an_add(make):
    gp = generate(make())
    (g,) = gemms(gp)
    assert "residual" not in g and g["beta"] == 0.0 and gp.plan["version"] == 2
    assert len(gp.plan["launches"]) == 2 and "ew::add" in gp.source


def test_a_residual_broadcast_over_the_batch_or_the_rows_stays_an_add():
    x = b.input_(0, (2, 8, 32), F32)
    w = b.input_(1, (32, 24), F32)
    mm = b.matmul(x, b.broadcast_to(w, (2, 32, 24)))
    shared = b.input_(2, (8, 24), F32)  # one matrix for both batch entries: C batch stride 0
    kg = b.kernel_graph([x, w, shared], [b.add(mm, b.broadcast_to(shared, (2, 8, 24)))])
    assert all("residual" not in g for g in gemms(generate(kg)))
    per_entry = b.input_(2, (2, 1, 24), F32)  # one row per entry: no leading dimension, no bias
    kg = b.kernel_graph([x, w, per_entry], [b.add(mm, b.broadcast_to(per_entry, (2, 8, 24)))])
    (g,) = gemms(generate(kg))
    assert "residual" not in g and "bias" not in g


def test_a_bias_then_a_residual_takes_the_bias_and_keeps_the_residual_add():
    gp = generate(bias_then_residual())
    g, k = gp.plan["launches"]
    assert g["bias"]["buf"] == {"kind": "input", "index": 2} and "residual" not in g
    assert gp.plan["version"] == 3 and {"kind": "input", "index": 3} in k["args"]


def test_a_plan_with_a_residual_and_a_bias_gemm_is_version_4():
    """Two GEMMs, one epilogue each: the plan is version 4 (which holds every version 3 field)."""
    x = b.input_(0, (8, 32), F16)
    w = b.input_(1, (32, 24), F16)
    bias = b.input_(2, (24,), F16)
    r = b.input_(3, (8, 24), F16)
    w2 = b.input_(4, (32, 24), F16)
    out1 = b.add(b.matmul(x, w), b.broadcast_to(bias, (8, 24)))
    out2 = b.add(b.matmul(x, w2), r)
    gp = generate(b.kernel_graph([x, w, bias, r, w2], [out1, out2]))
    assert gp.plan["version"] == 4 and len(gp.plan["launches"]) == 2
    assert [("bias" in g, "residual" in g) for g in gemms(gp)] == [(True, False), (False, True)]
    text = plan_json(gp.plan)
    parse_plan(text, 5, 2)


# ---- plans: valid in Python and in C++ -----------------------------------------------------------


def test_generated_plans_validate_on_both_sides(monkeypatch):
    from mlso_cli.runtime import library_path
    from tests.test_package_support import use_cache

    use_cache(monkeypatch)
    lib = ctypes.CDLL(str(library_path()))
    lib.mlso_selftest_plan.argtypes = [
        ctypes.c_char_p,
        ctypes.c_long,
        ctypes.c_long,
        ctypes.c_char_p,
        ctypes.c_size_t,
    ]
    for name, make in GRAPHS.items():
        gp = generate(make())
        text = plan_json(gp.plan)
        parse_plan(text, len(gp.plan["inputs"]), len(gp.plan["outputs"]))
        err = ctypes.create_string_buffer(512)
        n_out = len(gp.plan["outputs"])
        rc = lib.mlso_selftest_plan(text.encode(), len(gp.plan["inputs"]), n_out, err, 512)
        assert rc == 0, f"{name}: {err.value.decode()}"
    # heads side by side in C's rows: disjoint only while each head's columns fit its stride
    # and all of them the row; both sides refuse an overlap
    gp = generate(heads_out())
    for c in ({"stride": 8}, {"ld": 40}):
        bad = json.loads(plan_json(gp.plan))
        bad["launches"][0]["c"].update(c)
        text = json.dumps(bad)
        with pytest.raises(PlanProblem, match="overlap"):
            parse_plan(text, 2, 1)
        err = ctypes.create_string_buffer(512)
        assert lib.mlso_selftest_plan(text.encode(), 2, 1, err, 512) != 0
        assert "overlap" in err.value.decode()


# ---- the host emulator against the interpreter ------------------------------------------------------


@pytest.fixture(scope="module")
def bundle():
    programs = {name: generate(make()) for name, make in GRAPHS.items()}
    assert all(gemms(gp) for gp in programs.values())
    return hostemu.Bundle(programs, binaries=2)


TOL = {F16: 2e-3, BF16: 1.6e-2, F32: 1e-5}


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_emulated_library_gemm_matches_the_interpreter(name, bundle):
    kg = GRAPHS[name]()
    rng = np.random.default_rng(7)
    ins = [rng.standard_normal(n.shape).astype(np.float32) for n in kg.inputs]
    got = bundle.run(name, ins)
    want = interpreter.run(kg, ins, "float32")
    exact = interpreter.run(kg, ins, "float64")
    for g, w, e, out in zip(got, want, exact, kg.outputs):
        g = np.asarray(g, np.float64)
        assert not np.isnan(g).any(), f"{name}: unwritten elements"
        scale = np.abs(e).max()
        assert np.abs(g - w).max() <= TOL[out.dtype] * scale, name
        assert np.abs(g - e).max() <= 4 * TOL[out.dtype] * scale, name


# ---- the cost model ------------------------------------------------------------------------------


def test_lifted_linear_is_priced_as_one_library_call():
    kg = plain(F16, batch=1, m=128, k=896, n=4864)
    (kp,) = lowering_plan(kg).kernels
    assert kp.kind == "gemm"
    cost = program_cost(kg)
    assert cost.launches == 1
    n = kg.outputs[0]
    flops = 2 * 128 * 896 * 4864
    want = max(flops / H200.library_tensor_flops, 0) + H200.library_call_s
    moved = (128 * 896 + 896 * 4864) * 2 + 128 * 4864 * 4
    want = max(flops / H200.library_tensor_flops, moved / H200.library_bytes_per_s)
    assert library_gemm_s(n) == pytest.approx(want + H200.library_call_s)
    assert cost.seconds == pytest.approx(library_gemm_s(n))


def test_a_bias_epilogue_is_priced_as_the_gemm_alone():
    kg = biased(F16, batch=1, m=128, k=896, n=896)
    kinds = [k.kind for k in lowering_plan(kg).kernels]
    assert kinds == ["gemm", "elementwise"]  # the lowering plan still lists the ADD
    cost = program_cost(kg)
    assert cost.launches == 1 and len(generate(kg).kernels) == 1
    (add,) = kg.outputs
    mm = next(s for s in add.src if s.op is Op.MATMUL)
    assert cost.seconds == pytest.approx(library_gemm_s(mm))


@pytest.mark.parametrize("dt", [F16, F32])
def test_a_residual_epilogue_is_priced_as_the_gemm_alone(dt):
    kg = residual(dt, batch=0, m=128, k=4864, n=896)
    kinds = [k.kind for k in lowering_plan(kg).kernels]
    assert kinds == ["gemm", "elementwise"]  # the lowering plan still lists the ADD
    cost = program_cost(kg)
    assert cost.launches == 1 and len(generate(kg).kernels) == 1
    (add,) = kg.outputs
    mm = next(s for s in add.src if s.op is Op.MATMUL)
    assert cost.seconds == pytest.approx(library_gemm_s(mm))


def test_a_refused_residual_keeps_its_add_in_the_cost():
    kg = residual_transposed(F16, m=128, k=896, n=896)
    cost = program_cost(kg)
    assert cost.launches == 2 == len(generate(kg).kernels)
    mm = next(s for s in kg.outputs[0].src if s.op is Op.MATMUL)
    assert cost.seconds > library_gemm_s(mm)


def test_a_staged_operand_costs_one_more_kernel_and_the_library_beats_codegen(monkeypatch):
    kg = norm_linear(F16, m=128, k=896, n=4864)
    # the norm's reduction computed by the staging kernel (codegen/rowfuse.py): one kernel less
    assert [k.kind for k in lowering_plan(kg).kernels] == ["row", "gemm"]
    assert program_cost(kg).launches == 2 == len(generate(kg).kernels)
    fused = program_cost(kg)
    monkeypatch.setattr(rowfuse, "ROW_LEN", (0, -1))  # the staging as a kernel of its own
    cost = program_cost(kg)
    assert cost.seconds > fused.seconds
    kinds = [k.kind for k in lowering_plan(kg).kernels]
    assert kinds[-2:] == ["stage", "gemm"] and "reduce" in kinds
    launches = generate(kg).kernels
    assert len(launches) == len(kinds) and launches[-2].what.startswith("stage a library GEMM")
    assert cost.launches == len(kinds)
    assert cost.seconds > library_gemm_s(kg.outputs[0]) + H200.launch_s
    monkeypatch.setenv("MLSO_LIBRARY_GEMM", "0")
    knobs_mod.cache_clear()
    generated = program_cost(kg)
    assert generated.launches == len(kinds) - 1 and generated.seconds > 3 * cost.seconds


def test_the_lowering_plan_agrees_with_generate_on_a_scaled_operand():
    """The plan reads generate's own decision where a softmax numerator reaches a matmul."""
    s = b.input_(0, (8, 16), F32)
    v = b.input_(1, (16, 4), F32)
    e = b.unary(Op.EXP, s)
    kg = b.kernel_graph([s, v], [b.div(b.matmul(e, v), b.reduce(Op.REDUCE_SUM, e, 1))])
    kinds = [k.kind for k in lowering_plan(kg).kernels]
    assert "matmul" in kinds and "gemm" not in kinds
    assert len(kinds) == len(generate(kg).kernels)
