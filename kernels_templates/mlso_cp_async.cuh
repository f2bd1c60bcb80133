// mlso_cp_async.cuh -- asynchronous global->shared copies (sm_80+), with a synchronous twin.
//
// Why: loop-phase tiles are double-buffered: the copy of step i+1 is in flight while step i
// computes. cp.async moves 16 bytes per instruction, bypassing registers and L1 (.cg). A false
// predicate zero-fills the destination (src-size 0), which is how tails are padded.
#pragma once

#include "mlso_common.cuh"

namespace mlso {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; when pred is false the 16 destination bytes become zero and gmem is not read.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred = true) {
#if defined(MLSO_HOST_EMU)
  mlso_emu::copy16(smem, gmem, pred);
#else
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes)
               : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if !defined(MLSO_HOST_EMU)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most N committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  static_assert(N >= 0 && N <= 7, "cp.async.wait_group takes 0..7");
#if !defined(MLSO_HOST_EMU)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Synchronous 16-byte copy with the same zero-fill contract (fallback and tails).
__device__ __forceinline__ void copy_16_sync(void* smem, const void* gmem, bool pred = true) {
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (pred) v = *reinterpret_cast<const uint4*>(gmem);
  *reinterpret_cast<uint4*>(smem) = v;
}

// Copy CHUNKS 16-byte chunks with NT threads; gaddr(c) / saddr(c) give chunk c's addresses.
// ASYNC selects cp.async (caller commits and waits) or plain loads and stores.
template <bool ASYNC, int NT, int CHUNKS, class GAddr, class SAddr>
__device__ __forceinline__ void copy_chunks(GAddr gaddr, SAddr saddr) {
  static_assert(NT > 0 && CHUNKS >= 0, "bad chunk copy shape");
#pragma unroll 4
  for (int c = threadIdx.x; c < CHUNKS; c += NT) {
    if (ASYNC) {
      cp_async_16(saddr(c), gaddr(c));
    } else {
      copy_16_sync(saddr(c), gaddr(c));
    }
  }
}

// Copy PER 16-byte chunks per thread whose offsets (in elements) the caller computed once:
// chunk u goes from g + go[u] to s + so[u]. A loop's tile copies read the same chunks every step,
// one step further along, so per step this is an add and a cp.async per chunk.
template <bool ASYNC, int PER, typename T>
__device__ __forceinline__ void copy_offsets(const T* g, T* s, const int (&go)[PER], const int (&so)[PER]) {
  static_assert(PER > 0 && PER <= 32, "copy_offsets: 1..32 chunks per thread");
#pragma unroll
  for (int u = 0; u < PER; ++u) {
    if (ASYNC) {
      cp_async_16(s + so[u], g + go[u]);
    } else {
      copy_16_sync(s + so[u], g + go[u]);
    }
  }
}

// Element-by-element load with conversion, for tiles that are not 16-byte contiguous or whose
// shared type differs from the stored one; put(e) loads element e and writes it to shared memory.
template <int NT, int ELEMS, class Put>
__device__ __forceinline__ void copy_elements(Put put) {
  static_assert(NT > 0 && ELEMS >= 0, "bad element copy shape");
#pragma unroll 4
  for (int e = threadIdx.x; e < ELEMS; e += NT) put(e);
}

}  // namespace mlso
