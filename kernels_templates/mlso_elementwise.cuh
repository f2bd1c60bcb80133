// mlso_elementwise.cuh -- the elementwise ops of the μGraph as fp32 device functions and functors.
//
// Why explicit precise functions: the float check compares with an fp64 reference at logits of
// +-100 and fp32 limits of 1e-5, so nothing here may use the approximate __expf / fast-math
// forms (exp(x) via ex2.approx loses about |x| * 2^-22 relative). rsqrtf (<= 2 ulp) is fine.
// Codegen calls the functions (mlso::ew::exp(x)); templates that take an op use the functors.
#pragma once

#include "mlso_common.cuh"

namespace mlso {
namespace ew {

// ---- unary -------------------------------------------------------------------------------
__device__ __forceinline__ float exp(float x) { return expf(x); }
__device__ __forceinline__ float square(float x) { return x * x; }
__device__ __forceinline__ float sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ float rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ float reciprocal(float x) { return 1.0f / x; }
__device__ __forceinline__ float neg(float x) { return -x; }
// sigmoid(x) = 1 / (1 + exp(-x)); exp overflows to inf for x < -88, giving the right limit 0.
__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float tanh(float x) { return tanhf(x); }
__device__ __forceinline__ float erf(float x) { return erff(x); }
// Exact (erf) GELU: 0.5 x (1 + erf(x / sqrt 2)).
__device__ __forceinline__ float gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float relu(float x) { return x > 0.0f ? x : 0.0f; }

// Casts round through the narrower type; generated code keeps values in fp32 between stores
// (a CAST is exact in the IR), so these are for stores and for explicit rounding only.
__device__ __forceinline__ float cast_f16(float x) { return __half2float(__float2half_rn(x)); }
__device__ __forceinline__ float cast_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }
__device__ __forceinline__ float cast_f32(float x) { return x; }

// ---- binary ------------------------------------------------------------------------------
__device__ __forceinline__ float add(float a, float b) { return a + b; }
__device__ __forceinline__ float sub(float a, float b) { return a - b; }
__device__ __forceinline__ float mul(float a, float b) { return a * b; }
__device__ __forceinline__ float div(float a, float b) { return a / b; }
__device__ __forceinline__ float max(float a, float b) { return fmaxf(a, b); }

// ---- functors (for templates parameterised by an op) ---------------------------------------
#define MLSO_UNARY_FUNCTOR(Name, fn) \
  struct Name {                      \
    __device__ __forceinline__ float operator()(float x) const { return fn(x); } \
  };
MLSO_UNARY_FUNCTOR(Exp, exp)
MLSO_UNARY_FUNCTOR(Square, square)
MLSO_UNARY_FUNCTOR(Sqrt, sqrt)
MLSO_UNARY_FUNCTOR(Rsqrt, rsqrt)
MLSO_UNARY_FUNCTOR(Reciprocal, reciprocal)
MLSO_UNARY_FUNCTOR(Neg, neg)
MLSO_UNARY_FUNCTOR(Sigmoid, sigmoid)
MLSO_UNARY_FUNCTOR(Silu, silu)
MLSO_UNARY_FUNCTOR(Tanh, tanh)
MLSO_UNARY_FUNCTOR(Erf, erf)
MLSO_UNARY_FUNCTOR(Gelu, gelu)
MLSO_UNARY_FUNCTOR(Relu, relu)
MLSO_UNARY_FUNCTOR(CastF16, cast_f16)
MLSO_UNARY_FUNCTOR(CastBF16, cast_bf16)
MLSO_UNARY_FUNCTOR(Identity, cast_f32)
#undef MLSO_UNARY_FUNCTOR

#define MLSO_BINARY_FUNCTOR(Name, fn) \
  struct Name {                       \
    __device__ __forceinline__ float operator()(float a, float b) const { return fn(a, b); } \
  };
MLSO_BINARY_FUNCTOR(Add, add)
MLSO_BINARY_FUNCTOR(Sub, sub)
MLSO_BINARY_FUNCTOR(Mul, mul)
MLSO_BINARY_FUNCTOR(Div, div)
MLSO_BINARY_FUNCTOR(Max, max)
#undef MLSO_BINARY_FUNCTOR

}  // namespace ew
}  // namespace mlso
