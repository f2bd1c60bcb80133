// mlso_sm90_mbarrier.cuh -- shared-memory mbarriers: the handshake of Hopper's async pipelines.
//
// Why: a TMA load completes asynchronously and reports its bytes to an mbarrier (complete_tx);
// a consumer learns that a pipeline stage is full by waiting on that barrier's phase, and hands
// the stage back by arriving on a second ("empty") barrier the producer waits on. An mbarrier is
// a 64-bit word in shared memory holding an arrival count, a transaction (byte) count and a phase
// bit; a phase completes when both counts reach zero, and waiters name the phase by its parity.
//
// Everything here is sm_90a-only (MLSO_SM90A). These headers are not part of mlso.cuh: nothing
// generated uses them yet (see docs/hopper.md); they compile to nothing for other targets so a
// kernel source that includes them still builds into mlso's sm_80 + sm_90a fatbins.
#pragma once

#include "mlso_common.cuh"

// 1 when compiling device code for the arch-specific sm_90a target (wgmma and setmaxnreg exist
// only there; TMA and mbarrier tx-counts exist on sm_90 too, but one switch keeps it simple).
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLSO_SM90A 1
#else
#define MLSO_SM90A 0
#endif

namespace mlso {
namespace sm90 {

#if MLSO_SM90A

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Initialise a barrier that completes a phase after `arrivals` arrive() calls (plus whatever
// transaction bytes were announced with arrive_expect_tx). One thread initialises; the caller
// then runs init_fence() and a block-wide __syncthreads() before anyone uses the barrier.
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(arrivals)
               : "memory");
}

// Make initialised barriers visible to the async proxy (the TMA unit's complete_tx) before
// any copy can signal them; the __syncthreads() that follows publishes them to the threads.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// One arrival that also raises the phase's expected transaction count by `bytes`: the phase
// completes only when the async copies signalling this barrier have delivered that many bytes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

// A plain arrival (release semantics at CTA scope: the caller's earlier shared-memory reads,
// including those of completed wgmma, are ordered before the producer's next overwrite).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)) : "memory");
}

// True once the phase with parity `parity` has completed. try_wait may suspend the thread for
// a hardware-chosen time before returning false, so a loop around it does not spin hot.
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Block until the phase of parity `parity` has completed (acquire: the bytes a TMA delivered
// for that phase are visible afterwards). A freshly initialised barrier is in phase 0, so a
// wait on parity 1 returns at once: producers start their "empty" waits at parity 1.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// Order this thread's generic-proxy shared-memory accesses before later async-proxy ones
// (TMA, wgmma operand reads) and vice versa. Needed when threads write smem that wgmma or a
// TMA store then reads; not needed between a TMA load and the wgmma that reads it (both are
// async proxy, ordered through the mbarrier).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Named barrier for a subset of the block (`threads` a multiple of 32; id 0 is __syncthreads).
// Producer/consumer kernels let the producer warp leave early, so a block-wide barrier after
// the role split would hang; consumers synchronise among themselves with this instead.
template <int ID>
__device__ __forceinline__ void named_barrier_sync(int threads) {
  static_assert(ID >= 1 && ID < 16, "named barrier ids are 1..15 (0 is __syncthreads)");
  asm volatile("bar.sync %0, %1;\n" ::"n"(ID), "r"(threads) : "memory");
}

#endif  // MLSO_SM90A

}  // namespace sm90
}  // namespace mlso
