// mlso_reduce.cuh -- warp and block reductions (sum, max) with shuffles.
//
// Why: reductions in generated kernels run as teams (a warp per output row, or the whole block
// for one long row); these are the combining steps. All-reduce variants return the result in
// every lane so no broadcast through shared memory is needed inside a warp.
#pragma once

#include "mlso_common.cuh"

namespace mlso {

struct SumOp {
  __device__ __forceinline__ static float identity() { return 0.0f; }
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

struct MaxOp {
  __device__ __forceinline__ static float identity() { return neg_inf(); }
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Reduce over the WIDTH lanes of each aligned lane group (WIDTH a power of two <= 32).
template <class Op, int WIDTH = 32>
__device__ __forceinline__ float warp_allreduce(float v) {
  static_assert(WIDTH >= 1 && WIDTH <= 32 && (WIDTH & (WIDTH - 1)) == 0, "WIDTH: power of two <= 32");
  Op op;
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

template <int WIDTH = 32>
__device__ __forceinline__ float warp_sum(float v) { return warp_allreduce<SumOp, WIDTH>(v); }
template <int WIDTH = 32>
__device__ __forceinline__ float warp_max(float v) { return warp_allreduce<MaxOp, WIDTH>(v); }

// All-reduce over the whole block of NT threads. `red` is NT/32 floats of shared memory.
// Contains __syncthreads: every thread of the block must call it.
template <class Op, int NT>
__device__ __forceinline__ float block_allreduce(float v, float* red) {
  static_assert(NT % 32 == 0 && NT <= 1024, "NT: a multiple of 32, at most 1024");
  constexpr int NW = NT / 32;
  v = warp_allreduce<Op>(v);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  Op op;
  float r = Op::identity();
#pragma unroll
  for (int w = 0; w < NW; ++w) r = op(r, red[w]);
  return r;
}

}  // namespace mlso
