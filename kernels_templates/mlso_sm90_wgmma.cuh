// mlso_sm90_wgmma.cuh -- warpgroup MMA (wgmma.mma_async) from shared memory, fp16/bf16 -> fp32.
//
// Why: on sm_90a one warpgroup (4 consecutive warps, 128 threads) issues a 64 x N x 16 product
// whose A and B operands are read straight from shared memory by the tensor cores, through
// 64-bit matrix descriptors; no ldmatrix, and the issue is asynchronous, so a warpgroup can keep
// several k-steps in flight while TMA fills the next pipeline stage.
//
// Operand layouts used by mlso (both with the 128-byte swizzle that TMA's SWIZZLE_128B writes):
//   K-major   (K contiguous): rows of 64 fp16/bf16 = 128 bytes, one row per M (or N) index,
//             8-row groups of 1024 bytes. SBO = 1024 (next 8 rows); LBO is ignored by the
//             hardware for swizzled K-major layouts. A k16 step moves the start address 32 bytes
//             inside the 128-byte row (the swizzle is applied to the computed address).
//   MN-major  (M or N contiguous, "transposed"): rows of 64 M (or N) elements = 128 bytes, one
//             row per k, 8-row groups of 1024 bytes. SBO = 1024 (next 8 k rows); LBO = distance
//             between 64-element blocks along M/N (unused when the operand is exactly 64 wide).
//             A k16 step moves the start address 16 rows = 2048 bytes.
// The descriptor (PTX ISA "matrix descriptor"): bits 0-13 start address >> 4, 16-29 LBO >> 4,
// 32-45 SBO >> 4, 49-51 base offset (0: tiles are 1024-byte aligned), 62-63 swizzle mode
// (1 = 128-byte swizzle). TRANS_A/TRANS_B = 1 selects the MN-major reading of A/B (16-bit types
// only).
//
// Accumulator fragment of m64nNk16 (f32): thread t of the warpgroup (warp w = t / 32, lane l)
// holds d[v], v = v0 + 2*v1 + 4*v2 (v0, v1 in {0,1}, v2 < N/8), at
//   row = 16*w + l/4 + 8*v1,  col = 8*v2 + 2*(l%4) + v0.
//
// The wrappers below for N = 8..128 are mechanical: one per N, because the register list is part
// of the instruction text (operand k is d[k] for k < N/2, then da, db, scale_d, TRANS_A,
// TRANS_B); MLSO_SM90_WGMMA prints the bf16 and fp16 forms of each.
#pragma once

#include "mlso_sm90_mbarrier.cuh"

namespace mlso {
namespace sm90 {

// The N values of wgmma m64nNk16 that mlso instantiates (N must be a multiple of 8 up to 256 in
// the ISA; these are the token-tile widths the weight-streaming GEMM uses).
template <int N>
struct wgmma_n_supported {
  static constexpr bool value = N == 8 || N == 16 || N == 32 || N == 64 || N == 128;
};

// Descriptor of a 128-byte-swizzled operand starting at shared address `addr` (1024-aligned
// tile base plus the k-step offset). lbo/sbo in bytes.
__host__ __device__ constexpr uint64_t wgmma_desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (static_cast<uint64_t>((addr & 0x3FFFFu) >> 4)) |
         (static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16) |
         (static_cast<uint64_t>((sbo & 0x3FFFFu) >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

#if MLSO_SM90A

// Before the first wgmma of a batch: orders the warpgroup's register and shared-memory
// accesses before the async MMA reads them (required whenever accumulators were touched by
// ordinary instructions since the last wgmma).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// Close the batch of wgmma issued since the last commit into one group.
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Wait until at most N committed groups are pending; their accumulators and their shared-memory
// operands are free afterwards.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  static_assert(N >= 0 && N <= 7, "wgmma.wait_group takes 0..7");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Tell the compiler the accumulators are read and written here, so it neither moves their uses
// across a wgmma wait nor copies them between wgmma issues (which would serialise the MMAs:
// ptxas then warns "wgmma.mma_async instructions are serialized").
template <int R>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[R]) {
#pragma unroll
  for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// ---- mechanical: wgmma_m64n{8,16,32,64,128}k16<BF16, TRANS_A, TRANS_B> ---------------------
// d += A * B (scale_d != 0) or d = A * B (scale_d == 0); da/db are descriptors of A (64 x 16)
// and B (16 x N) in shared memory. MLSO_SM90_WGMMA prints one wrapper's two asm blocks (bf16
// and fp16 differ only in the type suffix): SHAPE and the operand text, then the accumulators'
// constraints; the inputs (da, db, scale_d, TRANS_A, TRANS_B) follow them, and PRED names the
// operand number of scale_d.
#define MLSO_SM90_WGMMA(SHAPE, PRED, OPERANDS, ...)                                                        \
  if constexpr (BF16) {                                                                                   \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                        \
                  "wgmma.mma_async.sync.aligned." SHAPE ".f32.bf16.bf16 " OPERANDS ";\n}\n"                  \
                 : __VA_ARGS__                                                                            \
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));                           \
  } else {                                                                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " PRED ", 0;\n"                                        \
                  "wgmma.mma_async.sync.aligned." SHAPE ".f32.f16.f16 " OPERANDS ";\n}\n"                    \
                 : __VA_ARGS__                                                                            \
                 : "l"(da), "l"(db), "r"(scale_d), "n"(TRANS_A), "n"(TRANS_B));                           \
  }

template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n8k16(float (&d)[4], uint64_t da, uint64_t db, int scale_d) {
  MLSO_SM90_WGMMA("m64n8k16", "%6",
                  "{%0, %1, %2, %3}, %4, %5, p, 1, 1, %7, %8",
                  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]))
}

template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n16k16(float (&d)[8], uint64_t da, uint64_t db, int scale_d) {
  MLSO_SM90_WGMMA("m64n16k16", "%10",
                  "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, %12",
                  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]))
}

template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], uint64_t da, uint64_t db, int scale_d) {
  MLSO_SM90_WGMMA("m64n32k16", "%18",
                  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, "
                  "1, 1, %19, %20",
                  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]))
}

template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
  MLSO_SM90_WGMMA("m64n64k16", "%34",
                  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
                  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, "
                  "%35, %36",
                  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]))
}

template <bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  MLSO_SM90_WGMMA("m64n128k16", "%66",
                  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
                  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
                  "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
                  "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68",
                  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]))
}

#undef MLSO_SM90_WGMMA

// ---- end of the mechanical wrappers ---------------------------------------------------------

// d (+)= A * B for a 64 x N x 16 step, N one of wgmma_n_supported.
template <int N, bool BF16, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
  static_assert(wgmma_n_supported<N>::value, "wgmma_ss: N must be 8, 16, 32, 64 or 128");
  static_assert((TRANS_A == 0 || TRANS_A == 1) && (TRANS_B == 0 || TRANS_B == 1),
                "wgmma_ss: transpose flags are 0 (K-major) or 1 (MN-major)");
  if constexpr (N == 8) {
    wgmma_m64n8k16<BF16, TRANS_A, TRANS_B>(d, da, db, scale_d);
  } else if constexpr (N == 16) {
    wgmma_m64n16k16<BF16, TRANS_A, TRANS_B>(d, da, db, scale_d);
  } else if constexpr (N == 32) {
    wgmma_m64n32k16<BF16, TRANS_A, TRANS_B>(d, da, db, scale_d);
  } else if constexpr (N == 64) {
    wgmma_m64n64k16<BF16, TRANS_A, TRANS_B>(d, da, db, scale_d);
  } else {
    wgmma_m64n128k16<BF16, TRANS_A, TRANS_B>(d, da, db, scale_d);
  }
}

#endif  // MLSO_SM90A

}  // namespace sm90
}  // namespace mlso
