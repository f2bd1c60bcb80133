// mlso_softmax.cuh -- the rescaling (online-softmax) accumulator and its split-KV combine.
//
// Why: sum(exp(s)) and sum(exp(s) v) overflow fp32 for logits past ~88 (fp16 past ~11). The IR
// means the exact values; code holds them as (m, l, acc) with true = stored * exp(m): m is the
// running row max, and when a new step raises it to m', stored sums are rescaled by
// exp(m - m') <= 1 before the step's exp(s - m') terms are added. Split-KV partials keep their
// m beside them; the combine takes m* = max_i m_i and sums stored_i * exp(m_i - m*).
#pragma once

#include "mlso_common.cuh"

namespace mlso {

// A max usable as an exp() offset: -inf (an all -inf row) becomes 0 so exp(s - m) is exp(-inf) = 0,
// never NaN.
__device__ __forceinline__ float safe_max(float m) { return m == neg_inf() ? 0.0f : m; }

// Factor that rescales sums kept relative to m_old to sums relative to m_new (m_new >= m_old).
__device__ __forceinline__ float rescale(float m_old, float m_new) {
  return m_new == neg_inf() ? 1.0f : expf(m_old - m_new);
}

// exp(s - m) with the safe offset: the per-element term of a stabilised sum. Clamped at exp(0):
// m is the max over the kept positions, so a kept s never exceeds it, but a masked-out logit may
// (the row max skips positions whose mask weight is 0); its exp would overflow to inf and the
// mask's 0 would then make the row NaN. Clamped, it is 1 * 0.
__device__ __forceinline__ float exp_rel(float s, float m) {
  return expf(fminf(s - safe_max(m), 0.0f));
}

// Combine step of split-KV: weight of partial i relative to the global max. An empty partial
// (m_i = -inf) weighs exp(-inf) = 0 with no test: a branch here kept the combine loop from
// issuing its next loads before this one's weight was known (one memory latency per partial).
__device__ __forceinline__ float partial_weight(float m_i, float m_global) {
  return expf(m_i - safe_max(m_global));
}

// The running state of one row: max m and sum l (true sum = l * exp(m)).
struct OnlineSoftmax {
  float m;
  float l;
  __device__ __forceinline__ OnlineSoftmax() : m(neg_inf()), l(0.0f) {}
  // Raise the max to cover a step whose own max is m_step; returns the factor applied to l
  // (apply the same factor to any weighted sums that share this max).
  __device__ __forceinline__ float raise(float m_step) {
    const float m_new = fmaxf(m, m_step);
    const float alpha = rescale(m, m_new);
    l *= alpha;
    m = m_new;
    return alpha;
  }
  // Add exp(s - m) for one score (call raise first so that s <= m).
  __device__ __forceinline__ float add(float s) {
    const float p = exp_rel(s, m);
    l += p;
    return p;
  }
  // The true sum; overflows exactly when the exact value does.
  __device__ __forceinline__ float value() const { return l * expf(m); }
};

// Online softmax for one row with its weighted sum held in registers: (m, l, o[N]), true values
// l * exp(m) and o * exp(m). raise() rescales l and o by exp(m_old - m_new); add(s, v) adds
// exp(s - m) and exp(s - m) * v[0..N). merge() combines two partial states (split-KV).
template <int N>
struct OnlineSoftmaxRow {
  static_assert(N >= 1 && N <= 256, "OnlineSoftmaxRow: N in 1..256 registers");
  float m, l, o[N];
  __device__ __forceinline__ OnlineSoftmaxRow() : m(neg_inf()), l(0.0f) {
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = 0.0f;
  }
  __device__ __forceinline__ void raise(float m_step) {
    const float m_new = fmaxf(m, m_step);
    const float alpha = rescale(m, m_new);
    l *= alpha;
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] *= alpha;
    m = m_new;
  }
  template <typename T>
  __device__ __forceinline__ void add(float s, const T* v) {
    const float p = exp_rel(s, m);
    l += p;
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] += p * to_f32(v[i]);
  }
  __device__ __forceinline__ void merge(const OnlineSoftmaxRow& other) {
    const float m_new = fmaxf(m, other.m);
    const float a = partial_weight(m, m_new), b = partial_weight(other.m, m_new);
    l = l * a + other.l * b;
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = o[i] * a + other.o[i] * b;
    m = m_new;
  }
  // The normalised output o / l: the running max cancels.
  __device__ __forceinline__ float out(int i) const { return o[i] / l; }
};


// The exact value of a scaled number: v * exp(dm), where dm = degree * M. Computed as
// (v * e) * e with e = exp(dm / 2) so that a small v times a large exp(dm) does not overflow
// early, and 0 stays 0 (never 0 * inf = NaN).
__device__ __forceinline__ float unscale(float v, float dm) {
  if (v == 0.0f) return v;
  const float e = expf(0.5f * dm);
  return (v * e) * e;
}

}  // namespace mlso
