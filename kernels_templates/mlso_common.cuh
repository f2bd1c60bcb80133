// mlso_common.cuh -- storage types, fp32 conversions and the arch switch every template shares.
//
// Why: generated kernels compute in fp32 registers and store fp16 / bf16 / fp32, so every load
// and store goes through to_f32 / from_f32; one overload set keeps the generated code uniform.
#pragma once

#if defined(MLSO_HOST_EMU)
#include "mlso_host_emu.h"  // CPU emulation for tests: types, intrinsics, thread indices
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#endif

// The kernel's dynamic shared memory (emulation gives each emulated block its own buffer).
#ifndef MLSO_DYNAMIC_SMEM
#define MLSO_DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

// MLSO_HOPPER is 1 when compiling device code for sm_90 and newer. Templates that have a Hopper
// variant (wgmma, TMA) select it with `#if MLSO_HOPPER`; the sm_80 baseline runs on both.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define MLSO_HOPPER 1
#else
#define MLSO_HOPPER 0
#endif

namespace mlso {

typedef __half f16;
typedef __nv_bfloat16 bf16;

// Widen a stored element to fp32.
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

// Narrow an fp32 register to a storage type, round-to-nearest-even.
template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// True for the 16-bit types the tensor-core path accepts.
template <typename T>
struct is_mma_type { static constexpr bool value = false; };
template <>
struct is_mma_type<__half> { static constexpr bool value = true; };
template <>
struct is_mma_type<__nv_bfloat16> { static constexpr bool value = true; };

// W neighbouring elements moved by one aligned shared-memory access (the vector passes of
// generated kernels read and write tile rows this way; W * sizeof(T) is 4, 8 or 16 bytes).
template <typename T, int W>
struct alignas(sizeof(T) * W) vec {
  static_assert(W >= 1 && (W & (W - 1)) == 0 && sizeof(T) * W <= 16, "vec: 4, 8 or 16 bytes");
  T v[W];
};

// A read-only tile whose element e a functor computes (a PRE tile read in place through a view
// that is not a plain pointer: generated code indexes it like a buffer).
template <typename F>
struct Indexed {
  F f;
  __device__ __forceinline__ float operator[](int e) const { return f(e); }
};
template <typename F>
__device__ __forceinline__ Indexed<F> indexed(F f) { return Indexed<F>{f}; }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

}  // namespace mlso
