// mlso_gemm.cuh -- kernel-level tiled matmul C[b] = A[b] * B[b] (one output tile per block).
//
// Why two kernels: fp16/bf16 operands run on tensor cores (gemm_mma_64x64: 4 warps, 64x64x32
// tiles, cp.async double buffering); anything else (fp32 graphs, which must meet a 1e-5 error
// limit) runs in fp32 on the SIMT cores (gemm_simt_64x64). Operands arrive as functors so the
// same template serves plain tensors, strided views (transposes, broadcast batches) and fused
// elementwise prologues:
//   ptr(b, m, k) -> const T*   address of an element (used only when *_VEC: the operand is a
//                              16-byte aligned, contiguous-along-the-smem-row view of type T)
//   at(b, m, k)  -> float      the element's value (any operand)
//   store(b, m, n, float)      writes one result element (conversion and layout are its job)
// Grid: x = column tiles, y = row tiles, z = batch. Tails are zero-filled, so any M, N, K works.
#pragma once

#include "mlso_common.cuh"
#include "mlso_cp_async.cuh"
#include "mlso_mma.cuh"

namespace mlso {

constexpr int kGemmMmaThreads = 128;
constexpr int kGemmSimtThreads = 256;

// Shared memory the tensor-core gemm needs for element type of size `bytes`.
template <bool A_K, bool B_K>
constexpr int gemm_mma_smem_elems() {
  return 2 * (A_K ? 64 * (32 + 8) : 32 * (64 + 8)) + 2 * (B_K ? 64 * (32 + 8) : 32 * (64 + 8));
}

template <typename T, int M, int N, int K, bool A_VEC, bool A_K, bool B_VEC, bool B_K, class APtr, class AAt,
          class BPtr, class BAt, class CStore>
__device__ __forceinline__ void gemm_mma_64x64(unsigned char* smem, APtr aptr, AAt aat, BPtr bptr, BAt bat,
                                               CStore cst) {
  static_assert(is_mma_type<T>::value, "gemm_mma needs fp16 or bf16 operands");
  static_assert(M > 0 && N > 0 && K > 0, "empty matmul");
  static_assert(!A_VEC || (A_K ? K % 8 == 0 : M % 8 == 0), "vector A loads need 8-element rows");
  static_assert(!B_VEC || (B_K ? K % 8 == 0 : N % 8 == 0), "vector B loads need 8-element rows");
  constexpr int BM = 64, BN = 64, BK = 32, NT = kGemmMmaThreads;
  constexpr int LDA = A_K ? BK + 8 : BM + 8, A_TILE = A_K ? BM * LDA : BK * LDA;
  constexpr int LDB = B_K ? BK + 8 : BN + 8, B_TILE = B_K ? BN * LDB : BK * LDB;
  constexpr int KT = (K + BK - 1) / BK;
  T* As = reinterpret_cast<T*>(smem);
  T* Bs = As + 2 * A_TILE;
  const int bz = blockIdx.z, m_blk = blockIdx.y * BM, n_blk = blockIdx.x * BN;

  auto load = [&](int stage, int k0) {
    T* as = As + stage * A_TILE;
    T* bs = Bs + stage * B_TILE;
    if (A_VEC) {
      if (A_K) {
        for (int c = threadIdx.x; c < BM * BK / 8; c += NT) {
          const int r = c / (BK / 8), kc = (c % (BK / 8)) * 8, gm = m_blk + r, gk = k0 + kc;
          const bool p = gm < M && gk < K;
          cp_async_16(as + r * LDA + kc, p ? aptr(bz, gm, gk) : aptr(bz, 0, 0), p);
        }
      } else {
        for (int c = threadIdx.x; c < BK * BM / 8; c += NT) {
          const int r = c / (BM / 8), mc = (c % (BM / 8)) * 8, gk = k0 + r, gm = m_blk + mc;
          const bool p = gm < M && gk < K;
          cp_async_16(as + r * LDA + mc, p ? aptr(bz, gm, gk) : aptr(bz, 0, 0), p);
        }
      }
    } else {
      for (int e = threadIdx.x; e < BM * BK; e += NT) {
        const int r = A_K ? e / BK : e % BM, kk = A_K ? e % BK : e / BM;
        const int gm = m_blk + r, gk = k0 + kk;
        const float v = (gm < M && gk < K) ? aat(bz, gm, gk) : 0.0f;
        as[A_K ? r * LDA + kk : kk * LDA + r] = from_f32<T>(v);
      }
    }
    if (B_VEC) {
      if (B_K) {
        for (int c = threadIdx.x; c < BN * BK / 8; c += NT) {
          const int r = c / (BK / 8), kc = (c % (BK / 8)) * 8, gn = n_blk + r, gk = k0 + kc;
          const bool p = gn < N && gk < K;
          cp_async_16(bs + r * LDB + kc, p ? bptr(bz, gk, gn) : bptr(bz, 0, 0), p);
        }
      } else {
        for (int c = threadIdx.x; c < BK * BN / 8; c += NT) {
          const int r = c / (BN / 8), nc = (c % (BN / 8)) * 8, gk = k0 + r, gn = n_blk + nc;
          const bool p = gn < N && gk < K;
          cp_async_16(bs + r * LDB + nc, p ? bptr(bz, gk, gn) : bptr(bz, 0, 0), p);
        }
      }
    } else {
      for (int e = threadIdx.x; e < BN * BK; e += NT) {
        const int c = B_K ? e / BK : e % BN, kk = B_K ? e % BK : e / BN;
        const int gn = n_blk + c, gk = k0 + kk;
        const float v = (gn < N && gk < K) ? bat(bz, gk, gn) : 0.0f;
        bs[B_K ? c * LDB + kk : kk * LDB + c] = from_f32<T>(v);
      }
    }
  };

  const int warp = threadIdx.x >> 5, wm = warp >> 1, wn = warp & 1;
  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i) zero_acc<4>(acc[i]);

  load(0, 0);
  cp_async_commit();
  for (int kt = 0; kt < KT; ++kt) {
    if (kt + 1 < KT) load((kt + 1) & 1, (kt + 1) * BK);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const T* as = As + (kt & 1) * A_TILE;
    const T* bs = Bs + (kt & 1) * B_TILE;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
      unsigned a[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) load_a_frag<A_K>(a[i], as, LDA, wm * 32 + i * 16, kk);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        unsigned bf[2];
        load_b_frag<B_K>(bf, bs, LDB, kk, wn * 32 + j * 8);
#pragma unroll
        for (int i = 0; i < 2; ++i) mma_16816<T>(acc[i][j], a[i], bf);
      }
    }
    __syncthreads();
  }

  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = m_blk + wm * 32 + i * 16 + (lane >> 2), c = n_blk + wn * 32 + j * 8 + (lane & 3) * 2;
      if (r < M) {
        if (c < N) cst(bz, r, c, acc[i][j][0]);
        if (c + 1 < N) cst(bz, r, c + 1, acc[i][j][1]);
      }
      if (r + 8 < M) {
        if (c < N) cst(bz, r + 8, c, acc[i][j][2]);
        if (c + 1 < N) cst(bz, r + 8, c + 1, acc[i][j][3]);
      }
    }
  }
}

// fp32 SIMT matmul: 256 threads, 64x64 tile, BK 16, each thread 4x4 outputs (rows ty+16i,
// cols tx+16j, so shared reads are broadcasts or consecutive). A_K / B_K say which index is
// contiguous in global memory, so consecutive threads read consecutive addresses.
template <int M, int N, int K, bool A_K, bool B_K, class AAt, class BAt, class CStore>
__device__ __forceinline__ void gemm_simt_64x64(unsigned char* smem, AAt aat, BAt bat, CStore cst) {
  static_assert(M > 0 && N > 0 && K > 0, "empty matmul");
  constexpr int BM = 64, BN = 64, BK = 16, NT = kGemmSimtThreads;
  float* As = reinterpret_cast<float*>(smem);  // [BK][BM]
  float* Bs = As + BK * BM;                    // [BK][BN]
  const int bz = blockIdx.z, m_blk = blockIdx.y * BM, n_blk = blockIdx.x * BN;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  float acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
  for (int k0 = 0; k0 < K; k0 += BK) {
    for (int e = threadIdx.x; e < BM * BK; e += NT) {
      const int r = A_K ? e / BK : e % BM, kk = A_K ? e % BK : e / BM;
      const int gm = m_blk + r, gk = k0 + kk;
      As[kk * BM + r] = (gm < M && gk < K) ? aat(bz, gm, gk) : 0.0f;
    }
    for (int e = threadIdx.x; e < BN * BK; e += NT) {
      const int c = B_K ? e / BK : e % BN, kk = B_K ? e % BK : e / BN;
      const int gn = n_blk + c, gk = k0 + kk;
      Bs[kk * BN + c] = (gn < N && gk < K) ? bat(bz, gk, gn) : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BK; ++kk) {
      float a[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) a[i] = As[kk * BM + ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) bv[j] = Bs[kk * BN + tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = m_blk + ty + 16 * i, c = n_blk + tx + 16 * j;
      if (r < M && c < N) cst(bz, r, c, acc[i][j]);
    }
}

}  // namespace mlso
