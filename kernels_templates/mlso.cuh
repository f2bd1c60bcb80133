// mlso.cuh -- everything a generated mlso kernel includes, in dependency order.
#pragma once

#include "mlso_common.cuh"
#include "mlso_elementwise.cuh"
#include "mlso_cp_async.cuh"
#include "mlso_reduce.cuh"
#include "mlso_softmax.cuh"
#include "mlso_mma.cuh"
#include "mlso_gemm.cuh"
#include "mlso_arch.cuh"
