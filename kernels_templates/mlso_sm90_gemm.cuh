// mlso_sm90_gemm.cuh -- weight-streaming GEMM for sm_90a: Y[M,N] = X[M,K] @ W[K,N] (+ bias[N]).
//
// Why a separate kernel for this shape: with M = 1..128 tokens and W at layer width, the time is
// the time to read W from DRAM once (2*K*N bytes); the sm_80 path (mma.sync + cp.async, 64x64
// tiles) wastes most of a 64-row MMA on a handful of tokens and keeps too few bytes in flight.
// Here:
//   * swap-AB: the kernel computes Y^T = W^T X^T. 64 columns of W fill wgmma's M = 64, and the
//     token tile MT (8..128, M rounded up) is wgmma's N, so no MMA row is wasted on padding
//     beyond rounding M up to a multiple of 8.
//   * W's [BK x 64] slabs are read by TMA with the 128-byte swizzle, N contiguous: that is the
//     MN-major A operand (TRANS_A = 1). X's [MT x 64] boxes are K contiguous: the K-major B
//     operand (TRANS_B = 0). Neither operand is ever rewritten by threads.
//   * one producer warp (one elected lane) issues TMA for every stage through an S-stage ring of
//     mbarriers ("full": bytes landed, "empty": all consumers done reading); CONSUMERS
//     warpgroups each own 64 columns of W and issue wgmma, keeping one stage's group in flight.
//   * split-K over blockIdx.z for tall-skinny W (few column tiles, long K): every split writes
//     its fp32 partial tile to a workspace, and the last split block to arrive at the tile's
//     counter (atomicAdd) sums all partials in split order and writes Y. Chosen over a second
//     reduce kernel because a launch costs ~2-4 us against a ~10 us GEMM, and over fp32 atomics
//     into Y because the fixed summation order keeps results bitwise reproducible. The last
//     block resets its counter, so the workspace can be reused (graph replays) without a memset;
//     two launches must not share a workspace concurrently.
//
// Block: 128*CONSUMERS consumer threads (warpgroups 0..CONSUMERS-1, so each is warpgroup-aligned)
// then one producer warp. Grid: x = ceil(N / (64*CONSUMERS)), y = ceil(M / MT), z = splits.
// Host side (benchmarks/sm90_gemm.py): two 2-D tensor maps, both SWIZZLE_128B, zero OOB fill:
//   W: dims {N, K}, row stride N*sizeof(T), box {64, BK}
//   X: dims {K, M}, row stride K*sizeof(T), box {64, MT}
// which needs N % 8 == 0 and K % 8 == 0 (16-byte row strides) and 16-byte aligned bases.
//
// Everything is inside `#if MLSO_SM90A`; other targets get a kernel body that traps, so a fatbin
// built for sm_80 and sm_90a together still links (the launcher only runs it on sm_90).
#pragma once

#include "mlso_common.cuh"
#include "mlso_sm90_mbarrier.cuh"
#include "mlso_sm90_tma.cuh"
#include "mlso_sm90_wgmma.cuh"

namespace mlso {
namespace sm90 {

// Bias modes of the epilogue.
constexpr int kBiasNone = 0;
constexpr int kBiasF32 = 1;   // bias is float[N]
constexpr int kBiasSame = 2;  // bias is T[N] (fp16 or bf16, like the operands)

// True for bf16, false for fp16 (selects the wgmma type suffix).
template <typename T>
struct is_bf16 {
  static constexpr bool value = false;
};
template <>
struct is_bf16<__nv_bfloat16> {
  static constexpr bool value = true;
};

// Compile-time shape of one instantiation; the host reads the same numbers (threads, smem) from
// benchmarks/sm90_gemm.py's mirror of these formulas.
template <typename T, int MT, int CONSUMERS, int BK, int STAGES, bool SPLITK, int BIAS>
struct WsGemmConfig {
  static_assert(is_mma_type<T>::value, "sm90 ws_gemm: T must be fp16 (__half) or bf16 (__nv_bfloat16)");
  static_assert(wgmma_n_supported<MT>::value, "sm90 ws_gemm: MT (token tile) must be 8, 16, 32, 64 or 128");
  static_assert(CONSUMERS == 1 || CONSUMERS == 2, "sm90 ws_gemm: CONSUMERS must be 1 or 2 warpgroups");
  static_assert(BK == 64 || BK == 128 || BK == 192 || BK == 256,
                "sm90 ws_gemm: BK must be a multiple of 64 (one swizzle row of X) up to 256 (TMA box limit)");
  static_assert(STAGES >= 2 && STAGES <= 12, "sm90 ws_gemm: STAGES must be 2..12");
  static_assert(BIAS == kBiasNone || BIAS == kBiasF32 || BIAS == kBiasSame, "sm90 ws_gemm: BIAS is 0, 1 or 2");

  static constexpr bool kBF16 = is_bf16<T>::value;
  static constexpr int kBN = 64 * CONSUMERS;                  // W columns per block
  static constexpr int kConsumerThreads = 128 * CONSUMERS;
  static constexpr int kThreads = kConsumerThreads + 32;      // + the producer warp
  static constexpr int kWSlabBytes = BK * 64 * 2;             // one warpgroup's W tile per stage
  static constexpr int kXBoxBytes = MT * 64 * 2;              // one 64-wide K box of X
  static constexpr int kXBoxes = BK / 64;
  static constexpr int kStageBytes = CONSUMERS * kWSlabBytes + kXBoxes * kXBoxBytes;
  static constexpr int kBarrierBytes = 2 * STAGES * 8 + 16;   // full[], empty[], split flag
  static constexpr int kSmemBytes = 1024 + STAGES * kStageBytes + kBarrierBytes;  // 1024: alignment
  static constexpr int kAcc = MT / 2;                         // fp32 accumulators per thread
  static constexpr int kPartialFloats = kConsumerThreads * kAcc;  // = kBN * MT per tile and split
  static_assert(kWSlabBytes % 1024 == 0 && kXBoxBytes % 1024 == 0,
                "sm90 ws_gemm: every TMA box must start 1024-byte aligned (128-byte swizzle atoms)");
  static_assert(kSmemBytes <= 227 * 1024, "sm90 ws_gemm: STAGES * stage bytes exceed 227 KB of shared memory");
  static_assert(kStageBytes < (1 << 20), "sm90 ws_gemm: a stage exceeds the mbarrier transaction count");
};

// The kernel body. `ktiles_per_split` BK-wide k tiles per blockIdx.z (the last split may have
// fewer; the host chooses gridDim.z = ceil(ceil(K / BK) / ktiles_per_split) so none is empty).
// ws: gridDim.z * gridDim.x * gridDim.y * kPartialFloats floats; counters: gridDim.x * gridDim.y
// ints, zero before the first launch (each launch leaves them zero). Both unused when
// gridDim.z == 1 (may be null).
template <typename T, int MT, int CONSUMERS, int BK, int STAGES, bool SPLITK, int BIAS>
__device__ __forceinline__ void ws_gemm(const CUtensorMap* tmap_w, const CUtensorMap* tmap_x, T* __restrict__ y,
                                        const void* __restrict__ bias, float* __restrict__ ws,
                                        int* __restrict__ counters, int M, int N, int K, int ktiles_per_split) {
  using C = WsGemmConfig<T, MT, CONSUMERS, BK, STAGES, SPLITK, BIAS>;
#if MLSO_SM90A
  MLSO_DYNAMIC_SMEM(smem_raw);
  // TMA with the 128-byte swizzle and wgmma's descriptors (base offset 0) need 1024-byte
  // aligned tiles; dynamic shared memory is only guaranteed 16, hence the 1024 bytes of slack.
  unsigned char* tiles = reinterpret_cast<unsigned char*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(tiles + STAGES * C::kStageBytes);
  uint64_t* empty = full + STAGES;
  int* last_flag = reinterpret_cast<int*>(empty + STAGES);

  const int n0 = blockIdx.x * C::kBN;  // first W column (Y column) of this block
  const int m0 = blockIdx.y * MT;      // first token (Y row)
  const int ktiles = (K + BK - 1) / BK;
  const int kt_begin = SPLITK ? blockIdx.z * ktiles_per_split : 0;
  const int kt_end = SPLITK ? min(ktiles, kt_begin + ktiles_per_split) : ktiles;
  const int nkt = max(0, kt_end - kt_begin);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);           // the producer's arrive_expect_tx (+ the TMA bytes)
      mbar_init(&empty[s], CONSUMERS);  // one arrival per consumer warpgroup
    }
    mbar_init_fence();
  }
  if (warp == 4 * CONSUMERS && lane == 0) {
    tma_prefetch_descriptor(tmap_w);
    tma_prefetch_descriptor(tmap_x);
  }
  __syncthreads();  // the last block-wide barrier: the producer warp leaves after its loop

  if (warp == 4 * CONSUMERS) {
    // ---- producer: one lane streams W and X tiles into the ring --------------------------
    if (lane == 0) {
      const uint64_t pol_w = l2_policy_evict_first();
      const uint64_t pol_x = l2_policy_evict_last();
      for (int i = 0; i < nkt; ++i) {
        const int s = i % STAGES;
        const uint32_t round = static_cast<uint32_t>(i / STAGES);
        mbar_wait(&empty[s], (round & 1u) ^ 1u);  // round 0 passes at once (fresh barrier)
        mbar_arrive_expect_tx(&full[s], C::kStageBytes);
        unsigned char* stage = tiles + s * C::kStageBytes;
        const int k0 = (kt_begin + i) * BK;
#pragma unroll
        for (int c = 0; c < CONSUMERS; ++c) {
          tma_load_2d(stage + c * C::kWSlabBytes, tmap_w, &full[s], n0 + 64 * c, k0, pol_w);
        }
#pragma unroll
        for (int b = 0; b < C::kXBoxes; ++b) {
          tma_load_2d(stage + CONSUMERS * C::kWSlabBytes + b * C::kXBoxBytes, tmap_x, &full[s], k0 + 64 * b, m0,
                      pol_x);
        }
      }
    }
    return;
  }

  // ---- consumers: warpgroup wg multiplies its 64 W columns by the token tile -------------------
  const int wg = warp / 4;
  float acc[C::kAcc];
#pragma unroll
  for (int v = 0; v < C::kAcc; ++v) acc[v] = 0.0f;
  wgmma_fence_operands(acc);

  for (int i = 0; i < nkt; ++i) {
    const int s = i % STAGES;
    mbar_wait(&full[s], static_cast<uint32_t>(i / STAGES) & 1u);
    __syncwarp();  // lanes may leave the wait loop apart; wgmma (.sync.aligned) needs them together
    const unsigned char* stage = tiles + s * C::kStageBytes;
    const uint32_t a_base = smem_u32(stage + wg * C::kWSlabBytes);
    const uint32_t b_base = smem_u32(stage + CONSUMERS * C::kWSlabBytes);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < BK / 16; ++j) {
      // A: W^T slab, MN-major: k step j starts 16 rows (of 128 bytes) further; LBO = distance
      // to the next 64-column slab (unused: the slab is exactly 64 wide), SBO = 8 rows.
      const uint64_t da = wgmma_desc_sw128(a_base + j * 16 * 128, C::kWSlabBytes, 1024);
      // B: X^T, K-major: box j/4, 32 bytes (16 k) further inside each 128-byte row per step.
      const uint64_t db = wgmma_desc_sw128(b_base + (j / 4) * C::kXBoxBytes + (j % 4) * 32, 16, 1024);
      wgmma_ss<MT, C::kBF16, 1, 0>(acc, da, db, 1);
    }
    wgmma_commit();
    // Keep this stage's group in flight; the previous stage's group is complete after this
    // wait, so its slot goes back to the producer (one arrival per warpgroup).
    wgmma_wait<1>();
    wgmma_fence_operands(acc);
    if (i > 0 && threadIdx.x % 128 == 0) mbar_arrive(&empty[(i - 1) % STAGES]);
  }
  wgmma_wait<0>();
  wgmma_fence_operands(acc);

  // Fragment coordinates: row r of wgmma's 64 = W column n0 + 64*wg + r; column c = token m0 + c.
  const int t = threadIdx.x % 128;
  const int row0 = 16 * (t / 32) + (t % 32) / 4;
  const int col0 = 2 * (t % 4);

  if constexpr (SPLITK) {
    if (gridDim.z > 1) {
      const int ct = threadIdx.x;  // 0 .. kConsumerThreads-1
      const int tile = blockIdx.y * gridDim.x + blockIdx.x;
      const size_t tiles_total = static_cast<size_t>(gridDim.x) * gridDim.y;
      float* mine = ws + (static_cast<size_t>(blockIdx.z) * tiles_total + tile) * C::kPartialFloats;
      // fragment-major layout [v][thread]: each v is one coalesced row of kConsumerThreads floats
#pragma unroll
      for (int v = 0; v < C::kAcc; ++v) __stcg(&mine[v * C::kConsumerThreads + ct], acc[v]);
      __threadfence();  // this thread's partial is visible device-wide before the count
      named_barrier_sync<1>(C::kConsumerThreads);
      if (ct == 0) {
        const int before = atomicAdd(&counters[tile], 1);
        *last_flag = before == static_cast<int>(gridDim.z) - 1;
      }
      named_barrier_sync<1>(C::kConsumerThreads);
      if (!*last_flag) return;
      __threadfence();  // acquire side: the other splits' partials are read after the count
      // Sum every split's partial (this block's own included, re-read from L2) in split order,
      // so the result does not depend on which split arrived last.
#pragma unroll
      for (int v = 0; v < C::kAcc; ++v) acc[v] = 0.0f;
#pragma unroll 1
      for (int z = 0; z < static_cast<int>(gridDim.z); ++z) {
        const float* part = ws + (static_cast<size_t>(z) * tiles_total + tile) * C::kPartialFloats;
#pragma unroll
        for (int v = 0; v < C::kAcc; ++v) acc[v] += __ldcg(&part[v * C::kConsumerThreads + ct]);
      }
      if (ct == 0) counters[tile] = 0;  // every split of this tile has counted: re-arm for the next launch
    }
  }

  // ---- epilogue: Y[m, n] = acc (+ bias[n]); each thread holds 2 columns n x MT/4 tokens m -------
#pragma unroll
  for (int v1 = 0; v1 < 2; ++v1) {
    const int n = n0 + 64 * wg + row0 + 8 * v1;
    if (n >= N) continue;
    float b = 0.0f;
    if constexpr (BIAS == kBiasF32) b = static_cast<const float*>(bias)[n];
    if constexpr (BIAS == kBiasSame) b = to_f32(static_cast<const T*>(bias)[n]);
#pragma unroll
    for (int v2 = 0; v2 < MT / 8; ++v2) {
#pragma unroll
      for (int v0 = 0; v0 < 2; ++v0) {
        const int m = m0 + 8 * v2 + col0 + v0;
        if (m < M) y[static_cast<size_t>(m) * N + n] = from_f32<T>(acc[v0 + 2 * v1 + 4 * v2] + b);
      }
    }
  }
#else
  (void)tmap_w, (void)tmap_x, (void)y, (void)bias, (void)ws, (void)counters;
  (void)M, (void)N, (void)K, (void)ktiles_per_split;
#if defined(__CUDA_ARCH__)
  __trap();  // built for a target without wgmma/TMA: launching this is a host-side bug
#endif
#endif  // MLSO_SM90A
}

}  // namespace sm90
}  // namespace mlso

// Define an extern "C" kernel NAME for one instantiation (the test and benchmark sources are one
// line of this each). The tensor maps are by-value __grid_constant__ parameters, first, so that
// they sit 64-byte aligned at the start of the parameter space.
#define MLSO_SM90_WS_GEMM_KERNEL(NAME, T, MT, CONSUMERS, BK, STAGES, SPLITK, BIAS)                              \
  extern "C" __global__ void __launch_bounds__(                                                                \
      ::mlso::sm90::WsGemmConfig<T, MT, CONSUMERS, BK, STAGES, SPLITK, BIAS>::kThreads, 1)                      \
      NAME(const __grid_constant__ CUtensorMap tmap_w, const __grid_constant__ CUtensorMap tmap_x, T* y,        \
           const void* bias, float* ws, int* counters, int M, int N, int K, int ktiles_per_split) {            \
    ::mlso::sm90::ws_gemm<T, MT, CONSUMERS, BK, STAGES, SPLITK, BIAS>(&tmap_w, &tmap_x, y, bias, ws, counters, \
                                                                       M, N, K, ktiles_per_split);              \
  }
