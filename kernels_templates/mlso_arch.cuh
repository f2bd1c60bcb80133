// mlso_arch.cuh -- where arch-specific variants are chosen.
//
// Why a separate header: kernels are compiled once per target (sm_80 SASS, sm_90a SASS and
// compute_90a PTX) from one source. Generated code calls mlso::arch::* names; this header maps
// them to the sm_80 baseline today and is the one place a Hopper path (wgmma from registers /
// shared memory, TMA bulk copies completing on an mbarrier) plugs in under `#if MLSO_HOPPER`,
// without touching the code generator.
#pragma once

#include "mlso_common.cuh"
#include "mlso_mma.cuh"

namespace mlso {
namespace arch {

// Name of the matmul path in use, for inspection (cuobjdump shows HMMA for both today).
#if MLSO_HOPPER
constexpr const char* kMatmulPath = "mma.sync (sm_90 runs the sm_80 baseline; wgmma hook)";
#else
constexpr const char* kMatmulPath = "mma.sync";
#endif

}  // namespace arch
}  // namespace mlso
