"""The host emulator's fibers (kernels_templates/mlso_host_emu.h): exchange, deadlock, overflow.

Why: the emulator runs each block's CUDA threads as cooperative fibers on one OS thread, and
switches only where a thread waits at a barrier. These kernels check that values exchanged
through shared memory across several __syncthreads, through warp shuffles and __syncwarp come
out exactly as on a GPU (integer-valued floats, so any order of the sums is exact), that shared
memory is NaN-poisoned again for every block, that a barrier some threads never reach ends the
run with a report naming who waits where (it used to hang until the timeout), and that a
kernel overflowing its fiber stack is stopped by the guard pages with a message. The exchange
also runs with -DMLSO_EMU_UCONTEXT, the portable switch used off x86-64.
"""

from __future__ import annotations

import numpy as np
import pytest

from mlso_cli.codegen import hostemu
from mlso_cli.codegen.program import GeneratedProgram
from tests.helpers import fresh_cache

BLOCK = (64, 2, 1)  # 4 warps, threadIdx.y used
GRID = 3
N = BLOCK[0] * BLOCK[1]
TIMEOUT = 120  # seconds; a hang fails the test instead of stalling the suite

EXCHANGE = """
extern "C" __global__ void mlso_k0(const float* __restrict__ in0, float* __restrict__ out0,
                                   float* __restrict__ out1) {
  MLSO_DYNAMIC_SMEM(raw);
  float* s = reinterpret_cast<float*>(raw);
  const int n = blockDim.x * blockDim.y;
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  const int base = blockIdx.x * n;
  float v = in0[base + t];
  for (int r = 1; r <= 3; ++r) {
    s[t] = v;
    __syncthreads();
    v = s[(t + 37 * r) % n] * r + s[n - 1 - t];
    __syncthreads();
    v += __shfl_xor_sync(0xffffffffu, v, 1 << r);
    __syncwarp();
    v -= t;
  }
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  out0[base + t] = v;
  const float unwritten = s[n + t];  // this block never wrote it yet: NaN, whatever came before
  __syncthreads();
  s[n + t] = 1.0f;
  out1[base + t] = unwritten;
}
"""

# Warp 1 skips the first barrier and returns before the second: warps 0, 2, 3 wait forever.
SKIPPED_SYNCTHREADS = """
extern "C" __global__ void mlso_k0(const float* __restrict__ in0, float* __restrict__ out0) {
  MLSO_DYNAMIC_SMEM(raw);
  float* s = reinterpret_cast<float*>(raw);
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  s[t] = in0[t];
  if (t / 32 == 1) return;
  __syncthreads();
  out0[t] = s[(t + 1) % (blockDim.x * blockDim.y)];
  __syncthreads();
}
"""

# Lane 7 of every warp returns before a shuffle the other 31 lanes wait in.
SKIPPED_SHUFFLE = """
extern "C" __global__ void mlso_k0(const float* __restrict__ in0, float* __restrict__ out0) {
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  if (threadIdx.x % 32 == 7) return;
  out0[t] = __shfl_xor_sync(0xffffffffu, in0[t], 1);
}
"""

# 512 KiB of locals, twice the default fiber stack.
OVERFLOW = """
extern "C" __global__ void mlso_k0(const float* __restrict__ in0, float* __restrict__ out0) {
  volatile float big[1 << 17];
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  big[t] = in0[t];
  big[(1 << 17) - 1 - t] = in0[t];
  out0[t] = big[t] + big[(1 << 17) - 1 - t];
}
"""


def _program(body: str, outputs: int, grid: int, smem: int) -> GeneratedProgram:
    shape = [grid * N]
    plan = {
        "version": 1,
        "targets": ["sm_80"],
        "smem_max": smem,
        "inputs": [{"dtype": "float32", "shape": shape}],
        "outputs": [{"dtype": "float32", "shape": shape} for _ in range(outputs)],
        "scratch": [],
        "zero": [],
        "launches": [
            {
                "kernel": "mlso_k0",
                "grid": [grid, 1, 1],
                "block": list(BLOCK),
                "smem": smem,
                "args": [{"kind": "input", "index": 0}]
                + [{"kind": "output", "index": i} for i in range(outputs)],
            }
        ],
    }
    return GeneratedProgram('#include "mlso.cuh"\n' + body, plan, ["mlso_k0"])


PROGRAMS = {
    "exchange": _program(EXCHANGE, 2, GRID, 2 * N * 4),
    "skipped_syncthreads": _program(SKIPPED_SYNCTHREADS, 1, 1, N * 4),
    "skipped_shuffle": _program(SKIPPED_SHUFFLE, 1, 1, 0),
    "overflow": _program(OVERFLOW, 1, 1, 0),
}


@pytest.fixture(scope="module", autouse=True)
def _cache_dir(tmp_path_factory):
    with fresh_cache(tmp_path_factory):
        yield


@pytest.fixture(scope="module")
def emulator():
    """All four programs in one binary (one g++ run)."""
    return hostemu.Bundle(PROGRAMS, binaries=1)


def _exchange_reference(x: np.ndarray) -> np.ndarray:
    """EXCHANGE in exact integers, block by block, as the barriers order it."""
    out = np.empty(x.shape, np.int64)
    t = np.arange(N)
    lane_base = t & ~31
    for blk in range(GRID):
        v = x[blk * N : (blk + 1) * N].astype(np.int64)
        for r in (1, 2, 3):
            s = v.copy()
            v = s[(t + 37 * r) % N] * r + s[N - 1 - t]
            v = v + v[lane_base | ((t & 31) ^ (1 << r))]
            v = v - t
        out[blk * N : (blk + 1) * N] = np.repeat(v.reshape(-1, 32).sum(1), 32)
    return out


def _exchange_input() -> np.ndarray:
    return np.random.default_rng(7).integers(-8, 9, GRID * N).astype(np.float32)


def _check_exchange(got: list[np.ndarray], x: np.ndarray) -> None:
    want = _exchange_reference(x)
    assert np.abs(want).max() < 2**24  # exact in float32 whatever the order of the sums
    np.testing.assert_array_equal(got[0], want.astype(np.float32))
    assert np.isnan(got[1]).all(), "every block starts with NaN-poisoned shared memory"


def test_exchange_through_smem_shuffles_and_syncwarp_is_exact(emulator):
    x = _exchange_input()
    _check_exchange(emulator.run("exchange", [x], timeout=TIMEOUT), x)


def test_exchange_with_the_portable_ucontext_switch(monkeypatch, tmp_path):
    monkeypatch.setattr(hostemu, "CXX_FLAGS", (*hostemu.CXX_FLAGS, "-DMLSO_EMU_UCONTEXT"))
    x = _exchange_input()
    _check_exchange(hostemu.run(PROGRAMS["exchange"], [x], timeout=TIMEOUT), x)


def _failure(emulator, program: str) -> str:
    """The error of running `program` on an arange input: it must fail, not hang."""
    x = np.arange(N, dtype=np.float32)
    with pytest.raises(RuntimeError) as err:
        emulator.run(program, [x], timeout=TIMEOUT)
    return str(err.value)


def test_a_warp_skipping_syncthreads_is_reported_not_hung(emulator):
    msg = _failure(emulator, "skipped_syncthreads")
    assert "failed (4)" in msg
    assert "deadlock in block (0, 0, 0)" in msg
    assert "threads 0-31: waiting at __syncthreads" in msg
    assert "threads 32-63: returned" in msg
    assert "threads 64-127: waiting at __syncthreads" in msg


def test_a_lane_skipping_a_shuffle_is_reported_not_hung(emulator):
    msg = _failure(emulator, "skipped_shuffle")
    assert "failed (4)" in msg
    assert "thread 7: returned" in msg
    assert "threads 8-31: waiting at a warp barrier" in msg and "of warp 0" in msg
    assert "threads 104-127: waiting at a warp barrier" in msg and "of warp 3" in msg


def test_a_fiber_stack_overflow_hits_the_guard_page(emulator):
    msg = _failure(emulator, "overflow")
    assert "failed (5)" in msg
    assert "overflowed its fiber stack" in msg
