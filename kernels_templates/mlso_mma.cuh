// mlso_mma.cuh -- tensor-core matmul building blocks: ldmatrix, mma.sync m16n8k16, warp strips.
//
// Why: fp16/bf16 tiles in shared memory multiply on tensor cores with fp32 accumulation. Tiles
// may be stored either way round ("K-major" = k is the contiguous index); ldmatrix and
// ldmatrix.trans turn both layouts into the fragments mma.sync wants, so a transposed view costs
// nothing. Row strides (ld, in elements) must be multiples of 8 (16-byte rows) for ldmatrix.
// This is the sm_80 baseline; it also runs on sm_90. A wgmma variant would live beside it and be
// chosen with `#if MLSO_HOPPER` (mlso_arch.cuh).
#pragma once

#include "mlso_common.cuh"
#include "mlso_reduce.cuh"
#include "mlso_softmax.cuh"

namespace mlso {

// ---- ldmatrix ------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
#if defined(MLSO_HOST_EMU)
  mlso_emu::ldmatrix<4>(r, p, false);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
#endif
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
#if defined(MLSO_HOST_EMU)
  mlso_emu::ldmatrix<4>(r, p, true);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
#endif
}
__device__ __forceinline__ void ldmatrix_x2(unsigned (&r)[2], const void* p) {
#if defined(MLSO_HOST_EMU)
  mlso_emu::ldmatrix<2>(r, p, false);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
#endif
}
__device__ __forceinline__ void ldmatrix_x2_trans(unsigned (&r)[2], const void* p) {
#if defined(MLSO_HOST_EMU)
  mlso_emu::ldmatrix<2>(r, p, true);
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(static_cast<unsigned>(__cvta_generic_to_shared(p))));
#endif
}

// ---- mma.sync m16n8k16, fp32 accumulate -----------------------------------------------------
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]);

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#if defined(MLSO_HOST_EMU)
  mlso_emu::mma_16816<__half>(d, a, b);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const unsigned (&a)[4],
                                                         const unsigned (&b)[2]) {
#if defined(MLSO_HOST_EMU)
  mlso_emu::mma_16816<__nv_bfloat16>(d, a, b);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// ---- fragments from shared memory ------------------------------------------------------------
// A fragment (16 x 16 at rows m0, cols k0). AK: A[m][k] at s[m*ld + k]; else at s[k*ld + m].
template <bool AK, typename T>
__device__ __forceinline__ void load_a_frag(unsigned (&a)[4], const T* s, int ld, int m0, int k0) {
  static_assert(is_mma_type<T>::value, "tensor-core fragments need fp16 or bf16");
  const int lane = threadIdx.x & 31;
  if (AK) {
    ldmatrix_x4(a, s + (m0 + (lane & 15)) * ld + k0 + (lane >> 4) * 8);
  } else {
    const int j = lane >> 3;
    ldmatrix_x4_trans(a, s + (k0 + (lane & 7) + (j >> 1) * 8) * ld + m0 + (j & 1) * 8);
  }
}

// B fragment (16 x 8 at rows k0, cols n0). BK: B[k][n] at s[n*ld + k]; else at s[k*ld + n].
template <bool BK, typename T>
__device__ __forceinline__ void load_b_frag(unsigned (&b)[2], const T* s, int ld, int k0, int n0) {
  static_assert(is_mma_type<T>::value, "tensor-core fragments need fp16 or bf16");
  const int lane = threadIdx.x & 15;  // x2: lanes 0..15 give the addresses
  if (BK) {
    ldmatrix_x2(b, s + (n0 + (lane & 7)) * ld + k0 + (lane >> 3) * 8);
  } else {
    ldmatrix_x2_trans(b, s + (k0 + (lane & 7) + (lane >> 3) * 8) * ld + n0);
  }
}

// ---- accumulator fragments <-> fp32 shared memory ----------------------------------------------
// Fragment layout of m16n8: d0,d1 at (row lane/4, cols 2*(lane%4)+{0,1}); d2,d3 at row + 8.
// Rows >= m_valid are treated as absent (not read, not written): M padding for small row counts.
template <int NB>
__device__ __forceinline__ void zero_acc(float (&acc)[NB][4]) {
#pragma unroll
  for (int j = 0; j < NB; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
}

// Each thread's two neighbouring columns move as one 8-byte access (c, ldc and n0 even): with
// rows that start 8 banks apart (blockstorage.py pads accumulators so) a half-warp's 4 rows fill
// the 32 banks once, where 4-byte accesses to rows a multiple of 32 floats long conflict 8 ways.
template <int NB>
__device__ __forceinline__ void load_acc(float (&acc)[NB][4], const float* c, int ldc, int m0, int n0, int m_valid) {
  const int lane = threadIdx.x & 31, r = m0 + (lane >> 2), col = n0 + (lane & 3) * 2;
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    const float* p = c + r * ldc + col + j * 8;
    const vec<float, 2> lo = r < m_valid ? *reinterpret_cast<const vec<float, 2>*>(p) : vec<float, 2>{{0.0f, 0.0f}};
    const vec<float, 2> hi =
        r + 8 < m_valid ? *reinterpret_cast<const vec<float, 2>*>(p + 8 * ldc) : vec<float, 2>{{0.0f, 0.0f}};
    acc[j][0] = lo.v[0];
    acc[j][1] = lo.v[1];
    acc[j][2] = hi.v[0];
    acc[j][3] = hi.v[1];
  }
}

template <int NB>
__device__ __forceinline__ void store_acc(const float (&acc)[NB][4], float* c, int ldc, int m0, int n0, int m_valid) {
  const int lane = threadIdx.x & 31, r = m0 + (lane >> 2), col = n0 + (lane & 3) * 2;
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    float* p = c + r * ldc + col + j * 8;
    if (r < m_valid) *reinterpret_cast<vec<float, 2>*>(p) = vec<float, 2>{{acc[j][0], acc[j][1]}};
    if (r + 8 < m_valid) *reinterpret_cast<vec<float, 2>*>(p + 8 * ldc) = vec<float, 2>{{acc[j][2], acc[j][3]}};
  }
}

// ---- the fragments of ILP consecutive k-steps of one strip, loaded ahead of their mma ----------
// Why: ldmatrix and mma.sync are volatile asm, issued in program order. An mma right behind the
// loads of its own operands waits out their shared-memory latency at every k-step, whatever the
// number of independent sums. Loading the next group of k-steps before the mma of the current
// one keeps the loads in flight while the tensor cores work (as CUTLASS's fragment pipeline does).
template <int NB, int ILP, bool AK, bool BK, typename T>
struct MmaFrags {
  static_assert(NB >= 1 && NB <= 16 && ILP >= 1 && ILP * NB <= 16, "MmaFrags: 1..16 fragment tiles");
  unsigned a[ILP][4];
  unsigned b[ILP][NB][2];

  __device__ __forceinline__ void load(const T* A, int lda, const T* B, int ldb, int m0, int n0, int k0) {
#pragma unroll
    for (int i = 0; i < ILP; ++i) {
      load_a_frag<AK>(a[i], A, lda, m0, k0 + 16 * i);
#pragma unroll
      for (int j = 0; j < NB; ++j) load_b_frag<BK>(b[i][j], B, ldb, k0 + 16 * i, n0 + 8 * j);
    }
  }
  // k-step i of the group into acc
  __device__ __forceinline__ void mma(float (&acc)[NB][4], int i) const {
#pragma unroll
    for (int j = 0; j < NB; ++j) mma_16816<T>(acc[j], a[i], b[i][j]);
  }
};

// ---- one warp: a 16 x (8*NB) strip over the whole K -----------------------------------------------
template <int NB, int K, bool AK, bool BK, typename T>
__device__ __forceinline__ void warp_mma_strip(float (&acc)[NB][4], const T* A, int lda, const T* B, int ldb,
                                               int m0, int n0) {
  static_assert(NB >= 1 && NB <= 16, "NB: 1..16 n8 tiles per strip");
  static_assert(K % 16 == 0, "K must be a multiple of 16");
  MmaFrags<NB, 1, AK, BK, T> cur;
  cur.load(A, lda, B, ldb, m0, n0, 0);
#pragma unroll 2
  for (int k0 = 16; k0 < K; k0 += 16) {
    MmaFrags<NB, 1, AK, BK, T> nxt;
    nxt.load(A, lda, B, ldb, m0, n0, k0);
    cur.mma(acc, 0);
    cur = nxt;
  }
  cur.mma(acc, 0);
}

// ---- one warp: a 16 x (8*NB) strip over K rows [kb, kb + KLEN), ILP independent sums ----------
// Why: a strip of one n8 tile over a deep K (a GEMV-like step: 2 rows times a 1024 x 32 weight
// tile) is one dependent chain of K/16 mma.sync, each waiting on the last; ILP partial sums,
// dealt k-step by k-step and added in a fixed order at the end, keep ILP mma in flight, and the
// next ILP k-steps' fragments load while these run (MmaFrags).
template <int NB, int KLEN, int ILP, bool AK, bool BK, typename T>
__device__ __forceinline__ void warp_mma_partial(float (&p)[NB][4], const T* A, int lda, const T* B, int ldb,
                                                 int m0, int n0, int kb) {
  static_assert(NB >= 1 && NB <= 16, "NB: 1..16 n8 tiles per strip");
  static_assert(ILP >= 1 && KLEN % (16 * ILP) == 0, "KLEN must be a multiple of 16 * ILP");
  float q[ILP][NB][4];
#pragma unroll
  for (int i = 0; i < ILP; ++i) zero_acc<NB>(q[i]);
  MmaFrags<NB, ILP, AK, BK, T> cur;
  cur.load(A, lda, B, ldb, m0, n0, kb);
#pragma unroll 2
  for (int k0 = kb + 16 * ILP; k0 < kb + KLEN; k0 += 16 * ILP) {
    MmaFrags<NB, ILP, AK, BK, T> nxt;
    nxt.load(A, lda, B, ldb, m0, n0, k0);
#pragma unroll
    for (int i = 0; i < ILP; ++i) cur.mma(q[i], i);
    cur = nxt;
  }
#pragma unroll
  for (int i = 0; i < ILP; ++i) cur.mma(q[i], i);
#pragma unroll
  for (int j = 0; j < NB; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float s = q[0][j][e];
#pragma unroll
      for (int i = 1; i < ILP; ++i) s += q[i][j][e];
      p[j][e] = s;
    }
  }
}

// How many warps share one strip's K (a power of two that divides the k-steps), so that a block
// with fewer strips than warps keeps its warps busy. Each slice keeps at least MMA_MIN_SLICE
// k-steps: adding a slice to C costs a barrier, more than a short chain saves (a 4-step loop of
// K = 64 split 4 ways measured 11% slower). And how many partial sums each warp keeps (at most
// 8 accumulator tiles per thread: NB tiles already run side by side).
constexpr int MMA_MIN_SLICE = 8;
__host__ __device__ constexpr int mma_ksplit(int strips, int nw, int ksteps) {
  int s = 1;
  while (strips * s * 2 <= nw && ksteps % (s * 2) == 0 && ksteps / (s * 2) >= MMA_MIN_SLICE) s *= 2;
  return s;
}
__host__ __device__ constexpr int mma_ilp(int nb, int ksteps) {
  return (nb <= 2 && ksteps % 4 == 0) ? 4 : ((nb <= 4 && ksteps % 2 == 0) ? 2 : 1);
}

// C strip (+)= partial sum p: with rs (ACCUM only), C's row r of batch bt is first scaled by
// rs[bt * M + r].
template <int NB, int M, bool ACCUM>
__device__ __forceinline__ void add_partial(const float (&p)[NB][4], float* cb, int ldc, int m0, int n0, int bt,
                                            const float* rs) {
  if (!ACCUM) {
    store_acc<NB>(p, cb, ldc, m0, n0, M);
    return;
  }
  float acc[NB][4];
  load_acc<NB>(acc, cb, ldc, m0, n0, M);
  float f0 = 1.0f, f1 = 1.0f;
  if (rs != nullptr) {  // rescale rows of C first: C[b][r] *= rs[b * M + r]
    const int r = m0 + ((threadIdx.x & 31) >> 2);
    f0 = r < M ? rs[bt * M + r] : 0.0f;
    f1 = r + 8 < M ? rs[bt * M + r + 8] : 0.0f;
  }
#pragma unroll
  for (int j = 0; j < NB; ++j) {
    acc[j][0] = acc[j][0] * f0 + p[j][0];
    acc[j][1] = acc[j][1] * f0 + p[j][1];
    acc[j][2] = acc[j][2] * f1 + p[j][2];
    acc[j][3] = acc[j][3] * f1 + p[j][3];
  }
  store_acc<NB>(acc, cb, ldc, m0, n0, M);
}

// ---- the whole block: C[b] (+)= A[b] * B[b] on shared-memory tiles ------------------------------
// MP rows (a multiple of 16; rows >= M are padding and never stored), N columns, K depth, BATCH
// independent products. aoff(b) / boff(b) give element offsets of batch b's A and B; C batch b
// starts at c + b * cbs. With ACCUM and rs != nullptr, C's row r of batch b is first multiplied
// by rs[b * M + r] (the online-softmax rescale, fused into the accumulator load). Strips of
// 16 x 8*NB are dealt round-robin to the NW warps. With fewer strips than warps, KSPLIT warps
// share each strip's K: each sums its slice in registers, and the slices are added to C one
// after another, slice 0 first, a barrier between (a fixed order: results do not depend on
// timing). So every thread of the block must call it; callers __syncthreads() before reading C.
template <typename T, int BATCH, int MP, int M, int N, int K, int NB, bool AK, bool BK, bool ACCUM, int NW,
          class AOff, class BOff>
__device__ __forceinline__ void block_mma(const T* A, int lda, AOff aoff, const T* B, int ldb, BOff boff, float* c,
                                          int ldc, int cbs, const float* rs = nullptr) {
  static_assert(MP % 16 == 0 && MP >= M && N % (8 * NB) == 0 && K % 16 == 0, "block_mma tile shape");
  constexpr int SM = MP / 16, SN = N / (8 * NB), STRIPS = BATCH * SM * SN;
  constexpr int KSPLIT = mma_ksplit(STRIPS, NW, K / 16), KLEN = K / KSPLIT;
  constexpr int ILP = mma_ilp(NB, KLEN / 16);
  static_assert(KSPLIT == 1 || STRIPS * KSPLIT <= NW, "a k-split strip has one warp per slice");
  const int w = threadIdx.x >> 5;
  if constexpr (KSPLIT == 1) {
    for (int s = w; s < STRIPS; s += NW) {
      const int bt = s / (SM * SN), rest = s % (SM * SN);
      const int m0 = (rest / SN) * 16, n0 = (rest % SN) * (8 * NB);
      float p[NB][4];
      warp_mma_partial<NB, KLEN, ILP, AK, BK, T>(p, A + aoff(bt), lda, B + boff(bt), ldb, m0, n0, 0);
      add_partial<NB, M, ACCUM>(p, c + bt * cbs, ldc, m0, n0, bt, rs);
    }
  } else {
    const int s = w % STRIPS, slice = w / STRIPS;
    const bool active = w < STRIPS * KSPLIT;
    const int bt = s / (SM * SN), rest = s % (SM * SN);
    const int m0 = (rest / SN) * 16, n0 = (rest % SN) * (8 * NB);
    float p[NB][4];
    if (active) {
      warp_mma_partial<NB, KLEN, ILP, AK, BK, T>(p, A + aoff(bt), lda, B + boff(bt), ldb, m0, n0, slice * KLEN);
    }
#pragma unroll 1
    for (int r = 0; r < KSPLIT; ++r) {
      if (active && slice == r) {
        if (r == 0) {
          add_partial<NB, M, ACCUM>(p, c + bt * cbs, ldc, m0, n0, bt, rs);
        } else {
          add_partial<NB, M, true>(p, c + bt * cbs, ldc, m0, n0, bt, nullptr);
        }
      }
      if (r + 1 < KSPLIT) __syncthreads();
    }
  }
}

// ---- online-softmax attention rows held in registers (flash-attention style) ----------------------
// One warp owns 16 rows (m0..m0+15) of a score tile S = A (16 x KQ) * B (KQ x NS) per loop step and
// of the weighted sum O (16 x NV) = sum over steps of exp(S - m) * V (NS x NV). The running max m,
// the sum l and O stay in registers across steps: no S or O round trip through shared memory.
// Each thread holds rows r = m0 + lane/4 and r + 8 (the mma C layout); the C fragments of S are
// the A fragments of P (m16n8k16), so exp(S - m) goes to the second mma without leaving registers.
// Semantics are those of the shared-memory row pass: m' = max(m, rowmax S), alpha = rescale(m, m'),
// l = l * alpha + sum exp_rel(S, m'), O = O * alpha + fp16(exp_rel(S, m')) * V. flush() writes
// O, l and m in the layout of the shared-memory accumulators (O row-major with row stride ldo).
template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  const T v[2] = {from_f32<T>(lo), from_f32<T>(hi)};
  unsigned r;
  __builtin_memcpy(&r, v, 4);
  return r;
}

// The score may be a form of matmuls: S = sc * (A B + A2 B2) * ks[column], with the second term
// present when KQ2 > 0 (MLA's nope and rope scores), sc a constant and ks a per-key factor in
// shared memory (or nullptr): each multiplies the fp32 C fragments before the row max.
// n0 is the first column of V (and of O) this warp owns: when V is wider than one warp's register
// tile, several warps take the same 16 rows and split V's columns; only the n0 == 0 warp writes l
// and m. The strip's scores are then either recomputed by each of those warps (KSPLIT == 1), or
// (KSPLIT warps per strip, part n0 / NV) each warp multiplies one KQ / KSPLIT slice of the depth
// and the partial scores meet in `red` (KSPLIT x 16 x NS fp32 per strip, two barriers a step).
// Every warp sums the partials in the same order, so all of them see bit-identical scores, maxima
// and exps, and their column slices of O agree with the l and m that part 0 writes.
template <typename T, int NS, int KQ, int NV, bool AK, bool BK, bool VK, int KSPLIT = 1, int KQ2 = 0,
          bool AK2 = true, bool BK2 = false>
struct FlashRows {
  static_assert(NS % 16 == 0 && KQ % 16 == 0 && NV % 8 == 0 && KQ2 % 16 == 0, "FlashRows tile shape");
  static_assert(KSPLIT >= 1 && KQ % (16 * KSPLIT) == 0 && KQ2 % (16 * KSPLIT) == 0,
                "FlashRows: each depth slice is a multiple of 16");
  float o[NV / 8][4];
  float m[2], l[2];
  __device__ __forceinline__ FlashRows() {
#pragma unroll
    for (int j = 0; j < NV / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    m[0] = m[1] = neg_inf();
    l[0] = l[1] = 0.0f;
  }
  // vs != nullptr: the weighted operand is V scaled per key (row j of V times vs[j]); the factor
  // goes onto P's columns instead (exp(s_j - m) * vs[j]), so V is read as stored. l is unscaled.
  __device__ __forceinline__ void step(const T* A, int lda, const T* B, int ldb, const T* V, int ldv, int m0,
                                       int n0, const float* vs = nullptr, float* red = nullptr) {
    step2(A, lda, B, ldb, nullptr, 0, nullptr, 0, 1.0f, nullptr, V, ldv, m0, n0, vs, red);
  }
  __device__ __forceinline__ void step2(const T* A, int lda, const T* B, int ldb, const T* A2, int lda2,
                                        const T* B2, int ldb2, float sc, const float* ks, const T* V, int ldv,
                                        int m0, int n0, const float* vs = nullptr, float* red = nullptr) {
    float s[NS / 8][4];
    zero_acc<NS / 8>(s);
    if constexpr (KSPLIT == 1) {
      warp_mma_strip<NS / 8, KQ, AK, BK, T>(s, A, lda, B, ldb, m0, 0);
      if constexpr (KQ2 > 0) warp_mma_strip<NS / 8, KQ2, AK2, BK2, T>(s, A2, lda2, B2, ldb2, m0, 0);
    } else {
      const int part = n0 / NV;
      constexpr int D = KQ / KSPLIT, D2 = KQ2 / KSPLIT;
      warp_mma_strip<NS / 8, D, AK, BK, T>(s, A + (AK ? part * D : part * D * lda), lda,
                                           B + (BK ? part * D : part * D * ldb), ldb, m0, 0);
      if constexpr (KQ2 > 0)
        warp_mma_strip<NS / 8, D2, AK2, BK2, T>(s, A2 + (AK2 ? part * D2 : part * D2 * lda2), lda2,
                                                B2 + (BK2 ? part * D2 : part * D2 * ldb2), ldb2, m0, 0);
      reduce_parts(s, red, part);
    }
    if (sc != 1.0f || ks != nullptr) {
      const int c0 = 2 * (threadIdx.x & 3);
#pragma unroll
      for (int j = 0; j < NS / 8; ++j) {
        const float f0 = ks != nullptr ? sc * ks[j * 8 + c0] : sc, f1 = ks != nullptr ? sc * ks[j * 8 + c0 + 1] : sc;
        s[j][0] *= f0;
        s[j][1] *= f1;
        s[j][2] *= f0;
        s[j][3] *= f1;
      }
    }
    float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
    for (int j = 0; j < NS / 8; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
    }
    float mn[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = warp_allreduce<MaxOp, 4>(mx[h]);
      mn[h] = fmaxf(m[h], mx[h]);
      const float alpha = rescale(m[h], mn[h]);
      l[h] *= alpha;
#pragma unroll
      for (int j = 0; j < NV / 8; ++j) {
        o[j][2 * h] *= alpha;
        o[j][2 * h + 1] *= alpha;
      }
      m[h] = mn[h];
    }
#pragma unroll
    for (int kk = 0; kk < NS / 16; ++kk) {
      float p[2][4];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          p[t][i] = exp_rel(s[2 * kk + t][i], mn[i >> 1]);
          l[i >> 1] += p[t][i];
        }
      }
      if (vs != nullptr) {
        const int c0 = kk * 16 + 2 * (threadIdx.x & 3);
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          const float f0 = vs[c0 + 8 * t], f1 = vs[c0 + 8 * t + 1];
          p[t][0] *= f0;
          p[t][1] *= f1;
          p[t][2] *= f0;
          p[t][3] *= f1;
        }
      }
      unsigned a[4];
      a[0] = pack2<T>(p[0][0], p[0][1]);
      a[1] = pack2<T>(p[0][2], p[0][3]);
      a[2] = pack2<T>(p[1][0], p[1][1]);
      a[3] = pack2<T>(p[1][2], p[1][3]);
#pragma unroll
      for (int j = 0; j < NV / 8; ++j) {
        unsigned b[2];
        load_b_frag<VK>(b, V, ldv, kk * 16, n0 + j * 8);
        mma_16816<T>(o[j], a, b);
      }
    }
  }
  // The KSPLIT partial score strips summed in part order through red (see above).
  __device__ __forceinline__ void reduce_parts(float (&s)[NS / 8][4], float* red, int part) const {
    const int lane = threadIdx.x & 31, r = lane >> 2, c0 = 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < NS / 8; ++j) {
      float* p = red + part * 16 * NS + r * NS + j * 8 + c0;
      p[0] = s[j][0];
      p[1] = s[j][1];
      p[8 * NS] = s[j][2];
      p[8 * NS + 1] = s[j][3];
    }
    __syncthreads();
    zero_acc<NS / 8>(s);
    for (int q = 0; q < KSPLIT; ++q) {
#pragma unroll
      for (int j = 0; j < NS / 8; ++j) {
        const float* p = red + q * 16 * NS + r * NS + j * 8 + c0;
        s[j][0] += p[0];
        s[j][1] += p[1];
        s[j][2] += p[8 * NS];
        s[j][3] += p[8 * NS + 1];
      }
    }
    __syncthreads();  // the next step overwrites red
  }
  // O's columns n0.. to o_smem (row stride ldo), l to each of the nl sum buffers, m to m_smem;
  // rows m0..m0+15.
  __device__ __forceinline__ void flush(float* o_smem, int ldo, float* const* l_smem, int nl, float* m_smem,
                                        int m0, int n0) const {
    store_acc<NV / 8>(o, o_smem, ldo, m0, n0, m0 + 16);
    if (n0 != 0) return;
    const int lane = threadIdx.x & 31, r = m0 + (lane >> 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float lt = warp_allreduce<SumOp, 4>(l[h]);
      if ((lane & 3) == 0) {
        m_smem[r + 8 * h] = m[h];
        for (int i = 0; i < nl; ++i) l_smem[i][r + 8 * h] = lt;
      }
    }
  }
};

}  // namespace mlso
