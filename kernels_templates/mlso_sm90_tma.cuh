// mlso_sm90_tma.cuh -- 2-D TMA tile loads (cp.async.bulk.tensor) that complete on an mbarrier.
//
// Why TMA for weight streaming: one thread issues a whole tile (up to 256 x 256 elements) and
// the copy engine walks the addresses, applies the shared-memory swizzle that wgmma expects and
// zero-fills whatever falls outside the tensor (tails need no predicates). The tile's geometry
// lives in a 128-byte CUtensorMap encoded on the host (mlso_cli/runtime/tensormap.py) and passed
// to the kernel by value as `const __grid_constant__ CUtensorMap` so that its address is a
// param-space address the TMA unit can read.
//
// Coordinates are in elements, innermost (contiguous) dimension first, and may be negative or
// past the end: out-of-bounds elements arrive as zeros and still count toward the transaction
// bytes, so a stage's expect_tx is always the full box size.
#pragma once

#include <cuda.h>  // CUtensorMap

#include "mlso_sm90_mbarrier.cuh"

namespace mlso {
namespace sm90 {

#if MLSO_SM90A

// Pull the descriptor into the constant cache ahead of the first copy that uses it.
__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// L2 eviction priorities for TMA loads. A streamed weight is read once: evict_first keeps it
// from pushing out the activations, which every block of the grid re-reads (evict_last).
__device__ __forceinline__ uint64_t l2_policy_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ uint64_t l2_policy_evict_last() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// Load the box at (c0, c1) of `map` into shared memory at `dst` and report its bytes to `bar`.
// dst must be aligned as the map's swizzle requires (1024 bytes for 128-byte swizzle). The
// caller announces the bytes with mbar_arrive_expect_tx on the same barrier and phase.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar, int c0,
                                            int c1, uint64_t l2_policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "l"(l2_policy)
      : "memory");
}

#endif  // MLSO_SM90A

}  // namespace sm90
}  // namespace mlso
