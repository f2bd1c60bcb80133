"""The sm_90a weight-streaming GEMM (kernels_templates/mlso_sm90_*.cuh, benchmarks/sm90_gemm.py)
and the host-side tensor maps (mlso_cli/runtime/tensormap.py).

CPU (nvcc only): every instantiation `choose` can return compiles for sm_90a with no local-memory
spill and with the shared-memory size the Python mirror computes; the headers build into an
sm_80 + sm_90a fatbin; bad template parameters fail with the header's static_assert messages;
tensor map arguments are checked before the driver sees them. The ptxas output is cached
(MLSO cache dir), so a second run takes seconds.

GPU (@pytest.mark.gpu, an sm_90 card): results against numpy fp32 for M in {1, 16, 64, 128} at
real layer widths and at ragged ones, fp16 and bf16, with and without split-K, with bias.
"""

from __future__ import annotations

import math
import subprocess
from dataclasses import replace

import numpy as np
import pytest

from benchmarks import sm90_gemm as G
from mlso_cli.errors import EnvironmentProblem
from mlso_cli.runtime import tensormap as TM


def _need_nvcc() -> None:
    from mlso_cli.codegen import nvcc

    try:
        nvcc.nvcc_path()
    except EnvironmentProblem as exc:
        pytest.skip(str(exc))


# ---- CPU: compilation ------------------------------------------------------------------------
def _sweep_source() -> str:
    """Every supported instantiation, plus static_asserts that the header's shared-memory and
    thread counts equal the Python mirror's (the launcher sizes launches from the mirror)."""
    configs = G.supported_configs()
    lines = [G.kernel_source(configs)]
    for c in configs:
        args = (
            f"{G.CPP_TYPES[c.dtype]}, {c.mt}, {c.consumers}, {c.bk}, {c.stages}, "
            f"{'true' if c.splitk else 'false'}, {G.BIAS_MODES[c.bias]}"
        )
        cfg = f"mlso::sm90::WsGemmConfig<{args}>"
        lines.append(
            f'static_assert({cfg}::kSmemBytes == {c.smem_bytes}, "smem mirror: {c.name}");'
        )
        lines.append(f'static_assert({cfg}::kThreads == {c.threads}, "threads mirror: {c.name}");')
        lines.append(
            f"static_assert({cfg}::kPartialFloats == {c.partial_floats}, "
            f'"partial mirror: {c.name}");'
        )
    for addr, lbo, sbo in ((0x1400, 16384, 1024), (0x3FC20, 16, 1024), (0x400, 8192, 1024)):
        lines.append(
            f"static_assert(mlso::sm90::wgmma_desc_sw128({addr}u, {lbo}u, {sbo}u) == "
            f'{desc_sw128(addr, lbo, sbo)}ull, "descriptor twin");'
        )
    return "\n".join(lines) + "\n"


def test_supported_instantiations_compile_for_sm90a_without_spills():
    _need_nvcc()
    report, text = G.ptxas_report(_sweep_source(), "sm_90a")
    configs = G.supported_configs()
    assert {c.name for c in configs} <= set(report), text[-2000:]
    for c in configs:
        r = report[c.name]
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, (c.name, r)
        # one block per SM must be launchable: registers x threads within the 64K register file
        assert r["registers"] * c.threads <= 65536, (c.name, r)
        assert c.smem_bytes <= G.SMEM_LIMIT
    # ptxas says so when a compiler-inserted register move forces wgmma to wait for each other
    assert "serialized" not in text, text


def test_headers_build_into_an_sm80_and_sm90a_fatbin():
    _need_nvcc()
    from mlso_cli.codegen import nvcc

    cfgs = [G.base_config(16, "float16", splitk=True), G.base_config(64, "bfloat16", "float32")]
    fatbin = nvcc.compile_source(G.kernel_source(cfgs), ("sm_80", "sm_90a"))
    assert len(fatbin) > 1000
    # the sm_80 build is the trap body only: no registers to speak of, nothing spilled
    report, _ = G.ptxas_report(G.kernel_source(cfgs), "sm_80")
    for c in cfgs:
        assert report[c.name]["spill_stores"] == 0


def test_not_part_of_generated_kernels_yet():
    from mlso_cli.codegen import nvcc

    text = (nvcc.TEMPLATES_DIR / "mlso.cuh").read_text()
    assert "sm90" not in text


def test_bad_template_parameters_fail_with_the_headers_message():
    _need_nvcc()
    src = (
        '#include "mlso_sm90_gemm.cuh"\n'
        "MLSO_SM90_WS_GEMM_KERNEL(bad_mt, __half, 24, 1, 128, 4, false, 0)\n"
        "MLSO_SM90_WS_GEMM_KERNEL(bad_smem, __half, 128, 2, 128, 8, false, 0)\n"
        "MLSO_SM90_WS_GEMM_KERNEL(bad_type, float, 8, 1, 128, 4, false, 0)\n"
    )
    with pytest.raises(RuntimeError) as info:
        G.ptxas_report(src, "sm_90a")
    msg = str(info.value)
    assert "MT (token tile) must be 8, 16, 32, 64 or 128" in msg
    assert "exceed 227 KB of shared memory" in msg
    assert "T must be fp16 (__half) or bf16" in msg


# ---- CPU: host-side choices ------------------------------------------------------------------
def test_token_tile_and_config_choice():
    assert [G.token_tile(m) for m in (1, 8, 9, 16, 17, 64, 100, 128, 300)] == [
        8, 8, 16, 16, 32, 64, 128, 128, 128,
    ]  # fmt: skip
    for m in (1, 16, 64, 128):
        cfg = G.base_config(m, "float16")
        assert cfg.smem_bytes <= G.SMEM_LIMIT
        assert (
            replace(cfg, stages=cfg.stages + 1).smem_bytes > G.SMEM_LIMIT
            or cfg.stages == G.MAX_STAGES
        )
        assert cfg.stages >= 3  # at least two stages in flight while one is consumed


def test_split_k_only_where_it_fills_the_machine():
    # tall-skinny W: 16-32 column tiles on 132 SMs -> split K
    cfg, splits = G.choose(128, 2048, 8192, sms=132)
    assert splits > 1 and cfg.splitk
    cfg, splits = G.choose(1, 2048, 8192, sms=132)
    assert splits > 1
    # wide W at decode: 128 column tiles already fill the machine
    cfg, splits = G.choose(1, 8192, 2048, sms=132)
    assert splits == 1 and not cfg.splitk
    # every chosen split count leaves no split empty
    for m, n, k in ((1, 2048, 8192), (128, 11008, 4096), (16, 4096, 1000)):
        cfg, s = G.choose(m, n, k)
        kt = math.ceil(k / cfg.bk)
        assert math.ceil(kt / math.ceil(kt / s)) == s
    cfg = G.base_config(16, "float16")
    assert [G.valid_splits(8192, cfg, s) for s in (1, 3, 63, 64, 500)] == [1, 3, 32, 64, 64]
    assert G.choose(16, 2048, 8192, splits=63)[1] == 32


def test_ptxas_parser():
    text = (
        "ptxas info    : Compiling entry function 'k1' for 'sm_90a'\n"
        "ptxas info    : Function properties for k1\n"
        "    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 168 registers, used 2 barriers\n"
    )
    assert G.parse_ptxas(text) == {
        "k1": {"registers": 168, "stack": 8, "spill_stores": 4, "spill_loads": 4}
    }


def test_launch_passes_maps_by_value_and_the_grid(monkeypatch):
    """cuLaunchKernel's kernelParams, read back through a fake driver: the two 128-byte maps by
    value, then pointers and ints in the kernel's parameter order; grid, block and smem."""
    import ctypes

    seen = {}

    def fake_driver(name, *args):
        assert name == "cuLaunchKernel"
        fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra = args
        seen.update(grid=(gx, gy, gz), block=(bx, by, bz), smem=smem, extra=extra)
        p = [params[i] for i in range(10)]
        seen["tw"] = ctypes.string_at(p[0], 128)
        seen["tx"] = ctypes.string_at(p[1], 128)
        seen["ptrs"] = [ctypes.c_uint64.from_address(a).value for a in p[2:6]]
        seen["ints"] = [ctypes.c_int32.from_address(a).value for a in p[6:10]]

    g = object.__new__(G.Sm90Gemm)
    g._drv = fake_driver
    cfg, splits = G.choose(16, 2048, 8192, "bfloat16", sms=132)
    g._funcs = {cfg.name: ctypes.c_void_p(1)}
    tw = (ctypes.c_uint8 * 128).from_buffer_copy(bytes(range(128)))
    tx = (ctypes.c_uint8 * 128).from_buffer_copy(bytes(range(128, 256)))
    ops = G._Operands(x=0x1000, w=0x2000, y=0x3000, bias=0, tmap_w=tw, tmap_x=tx)
    g._launch(cfg, ops, 0x4000, 0x5000, 16, 2048, 8192, splits, 0)
    per = math.ceil(math.ceil(8192 / cfg.bk) / splits)
    assert seen["grid"] == (2048 // cfg.bn, 1, splits)
    assert seen["block"] == (cfg.threads, 1, 1) and seen["smem"] == cfg.smem_bytes
    assert seen["tw"] == bytes(range(128)) and seen["tx"] == bytes(range(128, 256))
    assert seen["ptrs"] == [0x3000, 0, 0x4000, 0x5000]
    assert seen["ints"] == [16, 2048, 8192, per]
    with pytest.raises(ValueError, match="empty split"):
        g._launch(cfg, ops, 0, 0, 16, 2048, 8192, 63, 0)
    with pytest.raises(ValueError, match="without split-K"):
        g._launch(replace(cfg, splitk=False), ops, 0, 0, 16, 2048, 8192, 2, 0)


# ---- CPU: a byte-level model of the TMA writes and wgmma reads ---------------------------------
# What the hardware does, as documented (cuda.h for TMA's 128-byte swizzle; the PTX ISA's
# canonical layouts for wgmma descriptors, in CUTLASS's form), applied to the kernel's own
# offsets (mirrored from mlso_sm90_gemm.cuh): if a stage offset, a k-step advance, an LBO/SBO,
# the swap-AB orientation or the accumulator fragment mapping were inconsistent, the product
# below would not be X @ W. It cannot catch a misreading of the documents themselves.


def desc_sw128(addr: int, lbo: int, sbo: int) -> int:
    """Python twin of mlso::sm90::wgmma_desc_sw128 (the compile test pins them together)."""
    return (
        ((addr & 0x3FFFF) >> 4)
        | (((lbo & 0x3FFFF) >> 4) << 16)
        | (((sbo & 0x3FFFF) >> 4) << 32)
        | (1 << 62)
    )


def _swizzle128(addr: np.ndarray) -> np.ndarray:
    return addr ^ (((addr >> 7) & 7) << 4)


def _tma_box_sw128(smem: np.ndarray, base: int, tensor: np.ndarray, c0: int, c1: int, rows: int):
    """A box {64, rows} of a row-major 2-D tensor (dims {cols, rows}) at coordinates (c0, c1),
    zero outside, written with the 128-byte swizzle: row r, 16-byte chunk c -> chunk c ^ (r % 8)."""
    box = np.zeros((rows, 64), dtype=np.float32)
    r_hi, c_hi = min(tensor.shape[0], c1 + rows), min(tensor.shape[1], c0 + 64)
    if r_hi > c1 and c_hi > c0:
        box[: r_hi - c1, : c_hi - c0] = tensor[c1:r_hi, c0:c_hi]
    r, e = np.meshgrid(np.arange(rows), np.arange(64), indexing="ij")
    addr = _swizzle128(base + r * 128 + e * 2)
    smem[addr // 2] = box


def _read_desc(desc: int):
    return (
        (desc & 0x3FFF) << 4,
        ((desc >> 16) & 0x3FFF) << 4,
        ((desc >> 32) & 0x3FFF) << 4,
        desc >> 62,
    )


def _wgmma_a_mn_major(smem: np.ndarray, desc: int) -> np.ndarray:
    """A (64 x 16) read MN-major: element (m, k) at 16-byte unit m//8 + LBO*(m//64) + 8*(k%8)
    + SBO*(k//8), element m%8 inside it; then the 128-byte swizzle of the address."""
    start, lbo, sbo, layout = _read_desc(desc)
    assert layout == 1
    m, k = np.meshgrid(np.arange(64), np.arange(16), indexing="ij")
    unit = (m // 8) % 8 * 16 + (m // 64) * lbo + (k % 8) * 128 + (k // 8) * sbo
    return smem[_swizzle128(start + unit + (m % 8) * 2) // 2]


def _wgmma_b_k_major(smem: np.ndarray, desc: int, n: int) -> np.ndarray:
    """B (16 x n) read K-major: element (k, j) at 16-byte unit 8*(j%8) + SBO*(j//8) + k//8,
    element k%8 inside it; then the swizzle."""
    start, _lbo, sbo, layout = _read_desc(desc)
    assert layout == 1
    k, j = np.meshgrid(np.arange(16), np.arange(n), indexing="ij")
    unit = (j % 8) * 128 + (j // 8) * sbo + (k // 8) * 16
    return smem[_swizzle128(start + unit + (k % 8) * 2) // 2]


def _model_block(cfg, x, w, bx: int, by: int, kt_range: range) -> np.ndarray:
    """One block's Y tile as the kernel computes it, with smem as an array of elements."""
    m_total, _ = x.shape
    n_total = w.shape[1]
    smem = np.full(cfg.stage_bytes // 2, np.nan, dtype=np.float32)
    wslab, xbox = cfg.bk * 64 * 2, cfg.mt * 64 * 2
    n0, m0 = bx * cfg.bn, by * cfg.mt
    acc = np.zeros((cfg.consumers, 64, cfg.mt), dtype=np.float64)
    for kt in kt_range:  # one stage at offset 0 is enough for the model
        k0 = kt * cfg.bk
        for c in range(cfg.consumers):
            _tma_box_sw128(smem, c * wslab, w, n0 + 64 * c, k0, cfg.bk)
        for b in range(cfg.bk // 64):
            _tma_box_sw128(smem, cfg.consumers * wslab + b * xbox, x, k0 + 64 * b, m0, cfg.mt)
        for wg in range(cfg.consumers):
            a_base, b_base = wg * wslab, cfg.consumers * wslab
            for j in range(cfg.bk // 16):
                da = desc_sw128(a_base + j * 16 * 128, wslab, 1024)
                db = desc_sw128(b_base + (j // 4) * xbox + (j % 4) * 32, 16, 1024)
                acc[wg] += _wgmma_a_mn_major(smem, da) @ _wgmma_b_k_major(smem, db, cfg.mt)
    # epilogue: thread t's fragment d[v0 + 2 v1 + 4 v2] is at row 16(t/32) + (t%32)/4 + 8 v1,
    # column 8 v2 + 2 (t%4) + v0; row -> W column, column -> token
    y = np.full((m_total, n_total), np.nan)
    for wg in range(cfg.consumers):
        for t in range(128):
            frag = [0.0] * (cfg.mt // 2)
            row0, col0 = 16 * (t // 32) + (t % 32) // 4, 2 * (t % 4)
            for v in range(cfg.mt // 2):
                v0, v1, v2 = v % 2, (v // 2) % 2, v // 4
                frag[v] = acc[wg, row0 + 8 * v1, 8 * v2 + col0 + v0]
            for v1 in range(2):
                n = n0 + 64 * wg + row0 + 8 * v1
                for v2 in range(cfg.mt // 8):
                    for v0 in range(2):
                        m = m0 + 8 * v2 + col0 + v0
                        if n < n_total and m < m_total:
                            y[m, n] = frag[v0 + 2 * v1 + 4 * v2]
    return y


@pytest.mark.parametrize("mt, consumers, m, n, k", [(8, 1, 3, 72, 200), (16, 2, 16, 136, 256)])
def test_layout_model_reproduces_the_product(mt, consumers, m, n, k):
    cfg = G.GemmConfig(mt=mt, consumers=consumers, bk=128, stages=2)
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, (m, k)).astype(np.float32)  # small integers: exact in fp32
    w = rng.integers(-3, 4, (k, n)).astype(np.float32)
    ktiles = math.ceil(k / cfg.bk)
    y = np.full((m, n), np.nan)
    for bx in range(math.ceil(n / cfg.bn)):
        for by in range(math.ceil(m / cfg.mt)):
            tile = _model_block(cfg, x, w, bx, by, range(ktiles))
            done = ~np.isnan(tile)
            assert not (done & ~np.isnan(y)).any(), "two blocks wrote one element"
            y[done] = tile[done]
    np.testing.assert_array_equal(y, x @ w)


# ---- CPU: tensor map validation -------------------------------------------------------------
def _w_spec(**kw):
    base = dict(
        dtype="float16", address=0x7F0000000000, rows=4096, cols=11008, box_rows=128, box_cols=64
    )
    base.update(kw)
    return TM.row_major_2d(**base)


def test_tensormap_row_major_order_and_box_bytes():
    s = _w_spec()
    TM.validate(s)
    assert s.dims == (11008, 4096) and s.strides == (11008 * 2,) and s.box == (64, 128)
    assert s.box_bytes == 64 * 128 * 2


@pytest.mark.parametrize(
    "spec, message",
    [
        (lambda: _w_spec(address=0x7F0000000008), "not 16-byte aligned"),
        (lambda: _w_spec(cols=11004), "not a multiple of 16"),
        (lambda: _w_spec(box_rows=257), "outside 1..256"),
        (lambda: _w_spec(box_cols=128), "allows at most 128"),
        (lambda: _w_spec(box_cols=4), "inner extent is 8 bytes, not a multiple of 16"),
        (lambda: _w_spec(dtype="float8"), "dtype 'float8'"),
        (lambda: _w_spec(swizzle="256b"), "swizzle '256b'"),
        (lambda: _w_spec(rows=0), "dimension 1 has size 0"),
        (
            lambda: TM.TiledSpec("float16", 0, (64, 64), (), (64, 64)),
            "takes 1 byte strides for rank 2",
        ),
        (
            lambda: TM.TiledSpec("float16", 0, (64, 64), (64,), (64, 64)),
            "shorter than a row",
        ),
        (
            lambda: TM.TiledSpec("float16", 0, (64, 64), (128,), (64, 64), element_strides=(1, 9)),
            "element stride 1 is 9",
        ),
        (lambda: TM.TiledSpec("float16", 0, (8,) * 6, (16,) * 5, (8,) * 6), "rank 6"),
    ],
)
def test_tensormap_rejects(spec, message):
    with pytest.raises(TM.TensorMapError, match=message.replace("(", r"\(").replace(".", r"\.")):
        TM.validate(spec())


def test_tensormap_without_a_swizzle_allows_wide_boxes():
    TM.validate(_w_spec(box_cols=256, swizzle="none"))
    TM.validate(_w_spec(dtype="bfloat16", box_cols=32, swizzle="64b"))


def test_tensormap_encode_validates_before_loading_the_driver(monkeypatch):
    def boom():
        raise AssertionError("libcuda must not be loaded for an invalid spec")

    monkeypatch.setattr(TM, "_libcuda", boom)
    with pytest.raises(TM.TensorMapError):
        TM.encode_tiled(_w_spec(address=3))


def test_tensormap_missing_driver_is_an_environment_problem(monkeypatch):
    import ctypes

    def no_lib(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    TM._libcuda.cache_clear()
    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    try:
        with pytest.raises(EnvironmentProblem, match="libcuda.so.1"):
            TM.encode_tiled(_w_spec())
    finally:
        TM._libcuda.cache_clear()


# ---- GPU ---------------------------------------------------------------------------------------
SHAPES = [(2048, 8192), (4096, 11008), (8192, 2048), (1000, 200)]  # (K, N); the last is ragged
MS = [1, 16, 64, 128]


@pytest.fixture(scope="module")
def gemm():
    import pycuda.driver as cuda

    cuda.init()
    if cuda.Device(0).compute_capability() < (9, 0):
        pytest.skip("the sm_90a GEMM needs a Hopper (sm_90) GPU")
    g = G.Sm90Gemm(G.compile_configs(G.supported_configs()))
    yield g
    g.close()


def _tolerance(ref: np.ndarray, dtype: str) -> np.ndarray:
    """Y is rounded once to fp16/bf16 (half an ulp: 2^-11 / 2^-8 relative) after fp32
    accumulation, whose order differs from numpy's (~1e-6 relative to sum |x w|): allow one ulp
    of |ref| plus a floor of one ulp of the output's rms for results near zero."""
    ulp = 2.0**-10 if dtype == "float16" else 2.0**-7
    rms = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2))) or 1.0
    return ulp * np.abs(ref) + ulp * rms


def _check(g, m, n, k, dtype, splits=None, bias=None, bias_mode="none", seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    w = (rng.uniform(-1, 1, (k, n)) / math.sqrt(k)).astype(np.float32)
    cfg, s = G.choose(m, n, k, dtype, bias=bias_mode, sms=g.sms, splits=splits)
    if splits is not None:  # a forced count (made valid by choose): run the split-K kernel
        cfg = replace(cfg, splitk=True)
    known = {c.name for c in G.supported_configs()}
    if cfg.name not in known:
        pytest.skip(f"{cfg.name} is not in the compiled set")
    y = g.run(cfg, s, x, w, bias=bias).astype(np.float32)
    xr = G.to_device_dtype(x, dtype).astype(np.float32)
    wr = G.to_device_dtype(w, dtype).astype(np.float32)
    ref = xr @ wr
    if bias is not None:
        b = (
            bias.astype(np.float32)
            if bias_mode == "float32"
            else G.to_device_dtype(bias, dtype).astype(np.float32)
        )
        ref = ref + b
    assert np.isfinite(y).all(), f"unwritten (NaN) outputs: {np.argwhere(~np.isfinite(y))[:5]}"
    err = np.abs(y - ref)
    tol = _tolerance(ref, dtype)
    bad = np.argwhere(err > tol)
    assert not len(bad), (
        f"{cfg.name} splits={s}: {len(bad)} of {y.size} outside tolerance, first {bad[:5].tolist()}, "
        f"max err {err.max():.3g}"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", MS)
def test_gpu_matches_numpy(gemm, m, n, k, dtype):
    _check(gemm, m, n, k, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("k, n", SHAPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_matches_numpy_forced_splits(gemm, m, n, k, dtype, splits):
    _check(gemm, m, n, k, dtype, splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_bias(gemm, dtype):
    rng = np.random.default_rng(1)
    n, k = 2048, 8192
    _check(
        gemm, 128, n, k, dtype, bias=rng.standard_normal(n).astype(np.float32), bias_mode="float32"
    )
    _check(
        gemm,
        5,
        200,
        1000,
        dtype,
        bias=rng.standard_normal(200).astype(np.float32),
        bias_mode="same",
    )


@pytest.mark.gpu
def test_gpu_split_k_is_deterministic(gemm):
    rng = np.random.default_rng(2)
    x = rng.uniform(-1, 1, (64, 8192)).astype(np.float32)
    w = rng.uniform(-1, 1, (8192, 2048)).astype(np.float32)
    cfg, s = G.choose(64, 2048, 8192, "float16", sms=gemm.sms)
    assert s > 1
    a = gemm.run(cfg, s, x, w)
    b = gemm.run(cfg, s, x, w)
    assert np.array_equal(a.view(np.uint16), b.view(np.uint16))


def test_peer_times_under_the_dram_floor_are_dropped():
    # 1 x 2048 x 8192 fp16 reads 33.6 MB: 10.0 µs at 3.35 TB/s; 0.15 µs was an in-process artefact
    assert G.under_floor(0.15, 1, 8192, 2048, 3.35)
    assert not G.under_floor(13.6, 1, 8192, 2048, 3.35)
    assert not G.under_floor(9.5, 1, 8192, 2048, 3.35)  # within 10% of the floor: kept
    assert not G.under_floor(None, 1, 8192, 2048, 3.35) and not G.under_floor(0.1, 1, 8, 8, None)


def test_torch_times_come_from_a_child_process(monkeypatch):
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        out = '{"m": 1, "n": 8192, "k": 2048, "us": 13.6}\n{"m": 16, "n": 8192, "k": 2048, "us": null}\n'
        return subprocess.CompletedProcess(cmd, 0, stdout=out, stderr="")

    monkeypatch.setattr(G.subprocess, "run", fake_run)
    got = G.torch_times([(1, 8192, 2048), (16, 8192, 2048)], "bfloat16", 9)
    assert got == {(1, 8192, 2048): 13.6, (16, 8192, 2048): None}
    cmd = seen["cmd"]
    assert "--torch-only" in cmd and cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--shape") + 1 :] == ["2048x8192"]


def test_record_row_names_the_shape_and_keeps_the_figures():
    row = {"m": 16, "k": 2048, "n": 8192, "label": "mt16 c1 s8", "splits": 1, "us": 13.17}
    row |= {"tbs": 2.571, "pct_dram": 76.77, "torch_us": 14.29}
    name, figures = G.record_row(row, "float16")
    assert name == "16x2048x8192 float16"
    assert figures["config"] == "mt16 c1 s8" and figures["% DRAM"] == 77
    assert figures["torch / ours"] == round(14.29 / 13.17, 2)
    assert G.record_row(row | {"torch_us": None}, "float16")[1]["torch / ours"] is None
