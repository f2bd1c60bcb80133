"""mlso::block_mma on the host emulator, in the shapes where it splits K over idle warps.

Why: a GEMV-like loop step (2 or 8 rows times a deep, narrow weight tile) has fewer 16 x 8
output strips than the block has warps. block_mma then gives each strip's K to several warps,
which sum their slices in registers (several partial sums each) and add them to C one slice at
a time. The cases below cover the split (2, 4 and 8 warps per strip), no split with partial
sums, batches, ACCUM off, and the row rescale of the online softmax; each is checked against
numpy in float64.
"""

from __future__ import annotations

import numpy as np

from mlso_cli.codegen import hostemu
from mlso_cli.codegen.mmawork import mma_work
from mlso_cli.codegen.program import GeneratedProgram

# (batch, m, n, k, nb, a_kmajor, b_kmajor, accumulate, with_rs)
CASES = [
    (1, 2, 32, 256, 1, True, False, True, False),  # 4 strips: 2 warps per strip
    (1, 8, 16, 512, 1, True, False, True, True),  # 2 strips: 4 warps per strip, rescaled rows
    (1, 5, 8, 1024, 1, False, True, False, False),  # 1 strip: 8 warps, no accumulator
    (2, 3, 16, 256, 1, True, True, True, False),  # batched: 4 strips, 2 warps each
    (1, 16, 16, 64, 1, True, False, True, False),  # 2 strips of 4 k-steps: too short to split
    (1, 16, 128, 96, 2, True, False, True, False),  # 8 strips: no split, 2 partial sums
]
NW = 8


def _ksplit(strips: int, ksteps: int) -> int:
    s = 1
    while strips * s * 2 <= NW and ksteps % (s * 2) == 0 and ksteps // (s * 2) >= 8:
        s *= 2
    return s


def _source() -> str:
    lines = ['#include "mlso.cuh"', 'extern "C" __global__ void __launch_bounds__(256) mlso_k0(']
    params = []
    for i in range(len(CASES)):
        params += [
            f"const __half* __restrict__ a{i}",
            f"const __half* __restrict__ b{i}",
            f"const float* __restrict__ c{i}",
            f"const float* __restrict__ r{i}",
        ]
    params += [f"float* __restrict__ o{i}" for i in range(len(CASES))]
    lines.append(", ".join(params) + ") {")
    lines.append("  MLSO_DYNAMIC_SMEM(smem);")
    for i, (bt, m, n, k, nb, ak, bk, acc, rs) in enumerate(CASES):
        mp = -(-m // 16) * 16
        na, nbb, nc = bt * mp * k, bt * k * n, bt * m * n
        lines += [
            "  {",
            "    __half* sa = reinterpret_cast<__half*>(smem);",
            f"    __half* sb = sa + {na};",
            f"    float* sc = reinterpret_cast<float*>(sb + {nbb});",
            f"    float* sr = sc + {nc};",
            f"    for (int e = threadIdx.x; e < {na}; e += 256) sa[e] = a{i}[e];",
            f"    for (int e = threadIdx.x; e < {nbb}; e += 256) sb[e] = b{i}[e];",
            f"    for (int e = threadIdx.x; e < {nc}; e += 256) sc[e] = c{i}[e];",
            f"    for (int e = threadIdx.x; e < {bt * m}; e += 256) sr[e] = r{i}[e];",
            "    __syncthreads();",
            f"    mlso::block_mma<__half, {bt}, {mp}, {m}, {n}, {k}, {nb}, {str(ak).lower()}, "
            f"{str(bk).lower()}, {str(acc).lower()}, {NW}>(sa, {k if ak else mp}, "
            f"[&](int b) -> int {{ return b * {mp * k}; }}, sb, {k if bk else n}, "
            f"[&](int b) -> int {{ return b * {k * n}; }}, sc, {n}, {m * n}"
            + (", sr" if rs else "")
            + ");",
            "    __syncthreads();",
            f"    for (int e = threadIdx.x; e < {nc}; e += 256) o{i}[e] = sc[e];",
            "    __syncthreads();",
            "  }",
        ]
    lines.append("}")
    return "\n".join(lines)


def _plan() -> dict:
    inputs, args = [], []
    for bt, m, n, k, _nb, _ak, _bk, _acc, _rs in CASES:
        mp = -(-m // 16) * 16
        for shape, dtype in (
            ([bt * mp * k], "float16"),
            ([bt * k * n], "float16"),
            ([bt * m * n], "float32"),
            ([bt * m], "float32"),
        ):
            args.append({"kind": "input", "index": len(inputs)})
            inputs.append({"dtype": dtype, "shape": shape})
    outputs = [{"dtype": "float32", "shape": [bt * m * n]} for bt, m, n, *_ in CASES]
    args += [{"kind": "output", "index": i} for i in range(len(CASES))]
    smem = max(
        2 * bt * (-(-m // 16) * 16 * k + k * n) + 4 * (bt * m * n + bt * m)
        for bt, m, n, k, *_ in CASES
    )
    launch = {"kernel": "mlso_k0", "grid": [1, 1, 1], "block": [256, 1, 1], "smem": smem}
    launch["args"] = args
    return {
        "version": 1,
        "targets": ["sm_80"],
        "smem_max": smem,
        "inputs": inputs,
        "outputs": outputs,
        "scratch": [],
        "zero": [],
        "launches": [launch],
    }


def test_the_cases_cover_every_split():
    splits = [_ksplit(bt * -(-m // 16) * (n // (8 * nb)), k // 16) for bt, m, n, k, nb, *_ in CASES]
    assert splits == [2, 4, 8, 2, 1, 1]
    assert splits == [
        mma_work(bt, m, n, k, NW).ksplit for bt, m, n, k, *_ in CASES
    ]  # the cost model's copy of the rule


def test_block_mma_matches_numpy_with_k_split_over_warps():
    rng = np.random.default_rng(11)
    feeds, want = [], []
    for bt, m, n, k, _nb, ak, bk, acc, rs in CASES:
        mp = -(-m // 16) * 16
        a = rng.standard_normal((bt, mp, k)).astype(np.float16)
        a[:, m:, :] = 0  # padding rows
        b = rng.standard_normal((bt, k, n)).astype(np.float16)
        c = rng.standard_normal((bt, m, n)).astype(np.float32)
        r = rng.uniform(0.5, 2.0, (bt, m)).astype(np.float32)
        stored_a = a if ak else a.transpose(0, 2, 1)
        stored_b = b.transpose(0, 2, 1) if bk else b
        feeds += [stored_a.ravel().copy(), stored_b.ravel().copy(), c.ravel(), r.ravel()]
        prod = a[:, :m, :].astype(np.float64) @ b.astype(np.float64)
        base = c.astype(np.float64) * (r[:, :, None] if rs else 1.0)
        want.append((prod + base if acc else prod).ravel())
    got = hostemu.run(GeneratedProgram(_source(), _plan(), ["mlso_k0"]), feeds)
    for i, (g, w) in enumerate(zip(got, want)):
        err = np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max()
        assert err < 1e-5, (CASES[i], err)
