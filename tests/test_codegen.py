"""Code generation on the CPU: generate, compile with nvcc, and execute on the host emulator.

No GPU here, so correctness is checked by running the generated source itself on the CPU
(kernels_templates/mlso_host_emu.h: one host thread per CUDA thread, PTX fragment semantics for
ldmatrix / mma.sync) against the float64 reference, at unit scale and with softmax logits of
about +-100. nvcc compiles every graph once, in one translation unit (nvcc dominates runtime).

Snapshots: tests/snapshots/codegen/<name>.cu hold the generated source of a few graphs, so that
a change of the generated code is seen in review. After an intended change, regenerate with

    MLSO_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/test_codegen.py -k snapshot
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mlso_cli import knobs as knobs_mod
from mlso_cli.codegen import CodegenError, CompileError, compile_program, generate, hostemu
from mlso_cli.codegen import nvcc as nvcc_mod
from mlso_cli.codegen.arch import SMEM_BUDGET
from mlso_cli.codegen.blockstorage import _acc_strides
from mlso_cli.codegen.cfmt import c_float
from mlso_cli.codegen.scale import BINARY, Scale
from mlso_cli.codegen.stabilise import consumers_of, stabilisers
from mlso_cli.codegen.synthetic import RowMax
from mlso_cli.codegen.views import view_strides
from mlso_cli.errors import EnvironmentProblem, ExitCode
from mlso_cli.ir import DType, Op
from mlso_cli.ir import build as b
from tests import test_codegen_graphs as T
from tests.helpers import fresh_cache

ROOT = Path(__file__).resolve().parent.parent
SNAPSHOTS = ROOT / "tests" / "snapshots" / "codegen"
SNAPSHOT_GRAPHS = ("split_kv_f16", "rmsnorm_matmul_f16", "plain_attention_f32")
WORKERS = max(2, os.cpu_count() or 2)


# ---- session setup: one cache, all programs generated once, emulators built in parallel ----------


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    with fresh_cache(tmp_path_factory):
        yield


def _lifted() -> dict[str, object]:
    try:
        from mlso_cli.frontend.lift import lift_model
    except ImportError:  # the lifting module is written elsewhere; skip only if it is absent
        return {}
    out = {}
    for p in sorted((ROOT / "models" / "small").glob("*.onnx")):
        for i, kg in enumerate(lift_model(str(p))):
            out[f"lifted_{p.stem}_{i}"] = kg
    for i, kg in enumerate(
        lift_model(str(ROOT / "models" / "transformer_tiny.onnx"), {"hidden": (1, 16, 64)})
    ):
        out[f"lifted_transformer_{i}"] = kg
    return out


def _fixtures(full: bool) -> dict[str, object]:
    try:
        from tests.fixtures import ugraphs
    except ImportError:
        return {}
    if full:
        return {f"fixture_{k}": f() for k, f in ugraphs.FIXTURES.items()}
    return {f"small_{k}": f() for k, f in ugraphs.SMALL_FIXTURES.items()}


@pytest.fixture(scope="session")
def graphs() -> dict[str, object]:
    out = {k: f() for k, f in T.GRAPHS.items()}
    out.update(_fixtures(full=False))
    out.update(_lifted())
    return out


@pytest.fixture(scope="session")
def programs(graphs):
    return {k: generate(kg, constants=T.constants(kg)) for k, kg in graphs.items()}


@pytest.fixture(scope="session")
def emulator(programs):
    return hostemu.Bundle(programs, binaries=WORKERS)


def _inputs(name: str, kg, large: bool = False) -> list[np.ndarray]:
    ins = T.make_inputs(kg, name, large=large)
    # norm statistics (BatchNorm var) must be positive for a finite reference
    return [np.abs(x) + 0.5 if "var" in nm else x for x, nm in zip(ins, kg.input_names)]


def _check(name: str, kg, emulator, large: bool) -> None:
    ins = _inputs(name, kg, large)
    want = T.reference(kg, ins)
    got = emulator.run(name, ins)
    tol = T.TOLERANCE[T.out_dtype(kg)]
    fmax = float(np.finfo(np.float32).max)
    for k, (g, w) in enumerate(zip(got, want)):
        g = np.asarray(g, dtype=np.float64)
        ok = np.abs(w) <= fmax  # exact values beyond fp32 must come out as inf of the same sign
        assert np.all(np.isinf(g[~ok]) & (np.sign(g[~ok]) == np.sign(w[~ok]))), (
            f"{name} output {k}: overflow"
        )
        assert not np.isnan(g[ok]).any(), f"{name} output {k}: NaN (unwritten or unstable)"
        err = T.rel_error(g[ok], w[ok])
        assert err <= tol, f"{name} output {k}: relative error {err:.2e} > {tol:.0e}"


# ---- correctness on the host emulator ------------------------------------------------------------


@pytest.mark.parametrize("name", list(T.GRAPHS))
def test_emulated_matches_reference(name, graphs, emulator):
    _check(name, graphs[name], emulator, large=False)


@pytest.mark.parametrize("name", list(T.LOGIT_SCALE))
def test_emulated_large_logits(name, graphs, emulator):
    _check(name, graphs[name], emulator, large=True)


def test_small_fixtures_emulated(graphs, emulator):
    names = [k for k in graphs if k.startswith("small_")]
    if not names:
        pytest.skip("tests/fixtures/ugraphs.py is not there yet")
    for name in names:
        _check(name, graphs[name], emulator, large=False)


def test_lifted_models_emulated(graphs, emulator):
    names = [k for k in graphs if k.startswith("lifted_")]
    if not names:
        pytest.skip("mlso_cli.frontend.lift is not there yet")
    assert any(k.startswith("lifted_transformer") for k in names)
    for name in names:
        _check(name, graphs[name], emulator, large=False)


# ---- plans and compilation ---------------------------------------------------------------------------


def test_plans_are_consistent(graphs, programs):
    try:
        from mlso_cli.runtime.plan import validate_plan
    except ImportError:
        validate_plan = None
    for name, gp in programs.items():
        plan = gp.plan
        if validate_plan is not None:
            validate_plan(plan)
        library = [launch for launch in plan["launches"] if launch.get("kind") == "gemm"]
        kernels = [launch for launch in plan["launches"] if launch.get("kind") != "gemm"]
        # version 2 exactly when a library GEMM is in the plan, 3 with a bias epilogue, 4 with a
        # residual one (codegen/program.py)
        want = (
            4
            if any("residual" in g for g in library)
            else 3
            if any("bias" in g for g in library)
            else 2
            if library
            else 1
        )
        assert plan["version"] == want and plan["targets"] == ["sm_80", "sm_90a"]
        assert len(set(gp.kernel_names)) == len(gp.kernel_names) == len(kernels)
        assert plan["smem_max"] == max([launch["smem"] for launch in kernels] + [0])
        for launch in kernels:
            sig = re.search(
                rf"void __launch_bounds__\(\d+\) {launch['kernel']}\(([^)]*)\)", gp.source
            )
            assert sig, launch["kernel"]
            params = [p.strip().split()[-1] for p in sig.group(1).split(",") if p.strip()]
            prefix = {"input": "in", "output": "out", "scratch": "sc"}
            assert params == [f"{prefix[a['kind']]}{a['index']}" for a in launch["args"]], name
            assert launch["smem"] <= SMEM_BUDGET["sm_90"]
            assert launch["block"][0] * launch["block"][1] * launch["block"][2] <= 1024
        kg = graphs[name]
        assert [t["shape"] for t in plan["inputs"]] == [list(n.shape) for n in kg.inputs]
        assert [t["dtype"] for t in plan["outputs"]] == [n.dtype.value for n in kg.outputs]


def _fatbin_entries(data: bytes) -> set[tuple[str, int]]:
    magic, _, header, size = struct.unpack_from("<IHHQ", data, 0)
    assert magic == 0xBA55ED50
    out, off = set(), header
    while off < header + size:
        kind, _, hsize, psize = struct.unpack_from("<HHII", data, off)
        arch = struct.unpack_from("<I", data, off + 28)[0]
        out.add(({1: "ptx", 2: "elf"}[kind], arch))
        off += hsize + psize
    return out


# slow (21 s on 2 cores): every generated source through nvcc. `make test` still compiles
# programs through nvcc (the cache, launcher and stabilise tests); CI runs the slow set too.
@pytest.mark.slow
def test_everything_compiles_with_nvcc(graphs, programs):
    """Every test graph, every fixture (small, and full size at every batch size) and every lifted
    region, compiled by nvcc in a few batched translation units."""
    parts = list(programs.items()) + [(k, generate(kg)) for k, kg in _fixtures(full=True).items()]
    renamed = [
        re.sub(r"\bmlso_k(\d+)\b", rf"g{i}_k\1", gp.source) for i, (_, gp) in enumerate(parts)
    ]
    units = ["\n".join(renamed[i::WORKERS]) for i in range(WORKERS)]
    with cf.ThreadPoolExecutor(WORKERS) as ex:
        fatbins = list(ex.map(lambda src: nvcc_mod.compile_source(src, ("sm_80", "sm_90a")), units))
    for fatbin in fatbins:
        assert {("elf", 80), ("elf", 90), ("ptx", 90)} <= _fatbin_entries(fatbin)


def test_compile_program_is_cached(monkeypatch):
    kg = T.GRAPHS["split_kv_f32"]()
    first = compile_program(kg)
    assert first.source_sha256 and first.plan["launches"]
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("nvcc ran again"))
    nvcc_mod.nvcc_version.cache_clear()
    monkeypatch.setattr(nvcc_mod, "nvcc_version", lambda path: _version)
    again = compile_program(kg)
    assert again.fatbin == first.fatbin


_version = None


@pytest.fixture(autouse=True)
def _nvcc_version_value():
    global _version
    _version = nvcc_mod.nvcc_version(nvcc_mod.nvcc_path())


def test_missing_nvcc_is_an_environment_problem(monkeypatch):
    monkeypatch.setenv("MLSO_NVCC", "/nonexistent/nvcc")
    knobs_mod.cache_clear()
    nvcc_mod.nvcc_path.cache_clear()
    try:
        with pytest.raises(EnvironmentProblem) as err:
            nvcc_mod.compile_source("// nothing", ("sm_80",))
        assert err.value.exit_code == ExitCode.ENVIRONMENT and "MLSO_NVCC" in err.value.one_line()
    finally:
        monkeypatch.delenv("MLSO_NVCC")
        knobs_mod.cache_clear()
        nvcc_mod.nvcc_path.cache_clear()


def test_nvcc_failure_names_command_source_and_errors():
    bad = '#include "mlso.cuh"\nextern "C" __global__ void k() { this_is_not_cuda; }\n'
    with pytest.raises(CompileError) as err:
        nvcc_mod.compile_source(bad, ("sm_80",))
    text = err.value.one_line()
    assert "-gencode=arch=compute_80,code=sm_80" in text and "this_is_not_cuda" in text
    kept = Path(re.search(r"source kept at: (\S+)", text).group(1))
    assert kept.read_text() == bad


def test_gencode_flags():
    assert nvcc_mod.gencode_flags(("sm_80", "sm_90a")) == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_90a,code=compute_90a",
    ]


# ---- snapshots -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SNAPSHOT_GRAPHS)
def test_snapshot(name):
    source = generate(T.GRAPHS[name]()).source
    path = SNAPSHOTS / f"{name}.cu"
    if os.environ.get("MLSO_UPDATE_SNAPSHOTS"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    assert path.is_file(), f"missing snapshot {path}; create it with MLSO_UPDATE_SNAPSHOTS=1"
    assert source == path.read_text(), (
        f"generated code of {name} changed; review, then MLSO_UPDATE_SNAPSHOTS=1"
    )


# ---- units -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, padded",
    [((32, 192), 200), ((16, 32), 40), ((4, 32, 48), 72), ((8, 64), 72), ((16, 40), 40)],
)
def test_accumulator_rows_start_eight_banks_apart(shape, padded):
    """A block_mma accumulator's rows are padded so that 4 rows of 8 floats (a half-warp's
    8-byte accesses to C fragments) fill the 32 banks once; narrow or short ones stay as is."""
    strides = _acc_strides(shape)
    assert strides[-2] == padded and strides[-2] % 32 == 8 and strides[-1] == 1
    assert strides[:-2] == tuple(shape[-2] * padded * s for s in (1,) * (len(shape) - 2))
    for short in ((2, 192), (16, 16), (7, 64)):
        assert _acc_strides(short) == (short[1], 1)


def test_padded_accumulators_are_emulated(programs):
    """The gated MLP's accumulators are padded (ldc 40 for 32 columns), so the emulator run of
    test_emulated_matches_reference checks padded C tiles: block_mma, the zeroing and the reads
    after the loop all use the padded row stride."""
    src = programs["gated_mlp_f16"].source
    calls = re.findall(r"block_mma<[^,]*, \d+, \d+, \d+, (\d+), .*?\}, sm\d+, (\d+), (\d+)\)", src)
    assert calls and all(int(ldc) % 32 == 8 and int(ldc) > int(n) for n, ldc, _ in calls), calls


def test_split_kv_combine_folds_partials_with_a_team(programs):
    """64 partials per output: the combine kernel gives each output a team of lanes that stride
    the partials and all-reduce (test_emulated_matches_reference runs it); 2 partials: one lane."""
    wide = programs["split_kv_wide_f16"]
    combine = next(k for k in wide.kernels if "split" not in k.what and "graph" not in k.what)
    assert "lanes per element" in combine.what
    assert "warp_allreduce<mlso::MaxOp, 8>" in combine.source
    assert "warp_allreduce<mlso::SumOp, 8>" in combine.source
    assert "if (tl == 0)" in combine.source
    assert combine.grid[0] * combine.block[0] >= 8 * 16 * 16
    narrow = programs["split_kv_f16"]
    assert not any("lanes per element" in k.what for k in narrow.kernels)


def test_team_size_rule():
    from mlso_cli.codegen.kernels import team_size

    assert team_size(8192, []) == 1  # nothing folded in place
    assert team_size(8192, [64, 64]) == 8  # 8 partials per lane
    assert team_size(8192, [32]) == 4
    assert team_size(8192, [64, 8]) == 1  # the shortest fold decides
    assert team_size(1 << 20, [64]) == 1  # the grid already fills a wave
    assert team_size(8190, [64]) == 1  # warps must leave the output loop together
    assert team_size(8196, [64]) == 8  # 4 elements per warp
    assert team_size(16, [4096]) == 32


def test_softmax_exp_gets_a_row_max_and_others_do_not():
    kg = T.GRAPHS["plain_attention_f32"]()
    nodes = kg.nodes()
    stab = stabilisers(nodes, consumers_of(nodes))
    assert len(stab) == 1 and isinstance(next(iter(stab.values())).arg, RowMax)
    x = b.input_(0, (4, 8), DType.F32)
    lone = b.kernel_graph([x], [b.reduce(Op.REDUCE_MAX, b.unary(Op.EXP, x), 1)])
    assert not stabilisers(lone.nodes(), consumers_of(lone.nodes()))
    masked = T.GRAPHS["masked_softmax_f32"]().nodes()
    (m,) = stabilisers(masked, consumers_of(masked)).values()
    assert m.arg.weighted and m.arg.axis == 1


def test_scale_rules():
    key = b.input_(0, (4, 1), DType.F32)
    s = Scale(key, 1, ("c0", "0"))
    assert BINARY[Op.DIV](s, s) == (None, False, False)  # num / den with one max: cancels
    assert BINARY[Op.MUL](s, None) == (s, False, False)
    scaled, ma, mb = BINARY[Op.ADD](s, None)
    assert scaled is None and ma and not mb  # adding an unscaled value materialises the scaled one
    other = Scale(key, 1, ("c1", "0"))
    assert BINARY[Op.DIV](s, other)[2]  # different rows: no cancellation


@pytest.mark.parametrize(
    "shape,new",
    [
        ((2, 3, 4), (6, 4)),
        ((2, 3, 4), (2, 12)),
        ((4, 6), (2, 2, 6)),
        ((1, 5, 1), (5,)),
        ((3, 1, 2), (3, 2, 1)),
    ],
)
def test_view_strides_match_numpy(shape, new):
    a = np.zeros(shape, dtype=np.float32)
    st = view_strides(shape, tuple(s // 4 for s in a.strides), new)
    want = a.reshape(new).strides
    assert st is not None
    assert all(x * 4 == y for x, y, d in zip(st, want, new) if d != 1)
    assert (
        view_strides((6, 4), (1, 6), (24,)) is None
    )  # a transposed tensor flattens only by copying


def test_float_literals_round_trip():
    for v in (0.1, 1 / 3, 1e-6, 65504.0, 3.0, -2.5e-40, float("inf")):
        lit = c_float(v)
        if "inf" in lit:
            continue
        assert np.float32(float(lit.rstrip("f"))) == np.float32(v)


def test_unsupported_op_reports_codegen_error():
    from mlso_cli.codegen.emitter import Emitter

    x = b.input_(0, (4, 8), DType.F32)
    em = Emitter({}, {}, __import__("mlso_cli.codegen.cfmt", fromlist=["Names"]).Names())
    with pytest.raises(CodegenError):
        em.value(b.matmul(x, b.transpose(x, (1, 0))), ("c0", "c1"))


def test_online_softmax_row_template_on_emulator():
    """mlso::OnlineSoftmaxRow (raise / add / merge) against the exact softmax average, logits +-150."""
    from mlso_cli.codegen.program import GeneratedProgram

    source = """#include "mlso.cuh"
extern "C" __global__ void __launch_bounds__(32) mlso_k0(const float* __restrict__ in0,
    const float* __restrict__ in1, float* __restrict__ out0) {
  if (threadIdx.x != 0) return;
  mlso::OnlineSoftmaxRow<4> a, b;
  for (int j = 0; j < 24; ++j) { a.raise(in0[j]); a.add(in0[j], in1 + 4 * j); }
  for (int j = 24; j < 40; ++j) { b.raise(in0[j]); b.add(in0[j], in1 + 4 * j); }
  a.merge(b);
  for (int i = 0; i < 4; ++i) out0[i] = a.out(i);
}
"""
    plan = {
        "version": 1,
        "targets": ["sm_80"],
        "smem_max": 0,
        "inputs": [{"dtype": "float32", "shape": [40]}, {"dtype": "float32", "shape": [40, 4]}],
        "outputs": [{"dtype": "float32", "shape": [4]}],
        "scratch": [],
        "zero": [],
        "launches": [
            {
                "kernel": "mlso_k0",
                "grid": [1, 1, 1],
                "block": [32, 1, 1],
                "smem": 0,
                "args": [
                    {"kind": "input", "index": 0},
                    {"kind": "input", "index": 1},
                    {"kind": "output", "index": 0},
                ],
            }
        ],
    }
    rng = np.random.default_rng(3)
    s = (rng.standard_normal(40) * 60).astype(np.float32)
    s[30] = 150.0  # the max arrives late, in the second partial
    v = rng.standard_normal((40, 4)).astype(np.float32)
    (got,) = hostemu.run(GeneratedProgram(source, plan, ["mlso_k0"]), [s, v])
    w = np.exp(s.astype(np.float64) - s.max())
    want = (w[:, None] * v).sum(0) / w.sum()
    assert T.rel_error(got, want) < 1e-6


@pytest.mark.parametrize(
    "name, warps, ksplit", [("flash_wide_v_f16", 2, 2), ("flash_wide_v_bf16", 3, 1)]
)
def test_wide_values_split_columns_over_warps(name, warps, ksplit):
    """V wider than one warp's register tile (128 columns) still takes the register path: warps
    sharing a 16-row strip split V's columns (256 = 2 x 128, 264 = 3 x 88), and split the score's
    depth where it divides (64 = 2 x 32; 16 cannot be cut in 3, so those warps recompute the
    scores). The emulated results are checked with every other test graph."""
    from mlso_cli.codegen.plan import plan

    kg = T.GRAPHS[name]()
    (kernel,) = plan(kg, "sm_90").kernels
    assert kernel.layout.register_path and kernel.layout.threads == 32 * warps
    source = generate(kg).source
    width = kg.outputs[0].shape[-1] // warps
    depth = kg.inputs[0].shape[-1]
    dtype = "__nv_bfloat16" if name.endswith("bf16") else "__half"
    assert f"FlashRows<{dtype}, 32, {depth}, {width}, true, false, false, {ksplit}>" in source
    assert f"(warp / 1) * {width}" in source
    step = next(line for line in source.splitlines() if "flash.step(" in line)
    assert (", nullptr, ps" in step) == (ksplit > 1)  # the partial-score buffer


def test_masked_out_logit_far_above_the_kept_ones_leaves_no_nan():
    """A masked-out logit 200 above every kept one (the row max skips masked positions): its
    exp(s - M) overflowed to inf and the mask's 0 made the whole row NaN. exp_rel clamps at
    exp(0), so the masked term is 1 * 0 and the row is the softmax of the kept logits. Found by
    verify's emulator check on optimize's output for Where(mask, x, -inf) -> Softmax."""
    kg = T.GRAPHS["masked_softmax_f32"]()
    x = np.zeros((8, 48), np.float32)
    mask = np.ones((8, 48), np.float32)
    mask[:, 5] = 0.0
    x[:, 5] = 200.0
    x[3, 7] = 2.0
    (got,) = hostemu.run(generate(kg), [x, mask])
    assert np.isfinite(got).all()
    want = np.exp(x.astype(np.float64)) * mask
    want[:, 5] = 0.0
    want /= want.sum(1, keepdims=True)
    assert T.rel_error(got, want) < 1e-6
