// The few CUDA driver entry points the op uses, resolved from libcuda.so.1 with dlopen.
//
// Why: the library must load on machines without a GPU (ONNX Runtime loads it into CPU-only
// processes too) and must build without the CUDA toolkit, so it neither links libcuda nor
// includes cuda.h. The prototypes below follow the driver's stable C ABI (CUdeviceptr is 64-bit;
// the `_v2` symbols are the current ones).
#pragma once

#include <dlfcn.h>

#include <cstddef>
#include <mutex>
#include <string>
#include <type_traits>

namespace mlso {
namespace cu {

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef unsigned long long CUdeviceptr;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_NO_BINARY_FOR_GPU = 209;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97;
constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
constexpr unsigned kDefaultDynamicSmemLimit = 48 * 1024;

struct Driver {
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*cuCtxPushCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxPopCurrent)(CUcontext*) = nullptr;
  CUresult (*cuModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*cuModuleUnload)(CUmodule) = nullptr;
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*cuFuncSetAttribute)(CUfunction, int, int) = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, unsigned, CUstream, void**, void**) = nullptr;
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;
  // Optional (only library GEMMs need them, for their workspace; mlso_gemm.h checks).
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  // Optional (only the timed choice of a library GEMM's algorithm uses them; without any of
  // them the heuristic's first choice is kept).
  CUresult (*cuStreamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*cuStreamDestroy)(CUstream) = nullptr;
  CUresult (*cuStreamSynchronize)(CUstream) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventElapsedTime)(float*, CUevent, CUevent) = nullptr;

  bool can_time() const {
    return cuStreamCreate && cuStreamDestroy && cuStreamSynchronize && cuEventCreate &&
           cuEventDestroy && cuEventRecord && cuEventElapsedTime && cuMemAlloc && cuMemFree;
  }

  std::string describe(CUresult r) const {
    const char* name = nullptr;
    const char* text = nullptr;
    if (cuGetErrorName) cuGetErrorName(r, &name);
    if (cuGetErrorString) cuGetErrorString(r, &text);
    std::string s = name ? name : ("CUresult " + std::to_string(r));
    if (text) s += std::string(": ") + text;
    return s;
  }
};

// Loads libcuda once per process. Returns nullptr and sets *error when it cannot.
inline const Driver* driver(std::string* error) {
  static std::once_flag once;
  static Driver drv;
  static std::string load_error;
  static bool ok = false;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      load_error = std::string("cannot open libcuda.so.1 (") + (e ? e : "unknown error") +
                   "); the NVIDIA driver is not installed or not on the loader path";
      return;
    }
    bool all = true;
    std::string missing;
    auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn) {
        all = false;
        missing += std::string(missing.empty() ? "" : ", ") + name;
      }
    };
    bind(drv.cuInit, "cuInit");
    bind(drv.cuDeviceGet, "cuDeviceGet");
    bind(drv.cuDeviceGetAttribute, "cuDeviceGetAttribute");
    bind(drv.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    bind(drv.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    bind(drv.cuCtxGetCurrent, "cuCtxGetCurrent");
    bind(drv.cuCtxPushCurrent, "cuCtxPushCurrent_v2");
    bind(drv.cuCtxPopCurrent, "cuCtxPopCurrent_v2");
    bind(drv.cuModuleLoadData, "cuModuleLoadData");
    bind(drv.cuModuleUnload, "cuModuleUnload");
    bind(drv.cuModuleGetFunction, "cuModuleGetFunction");
    bind(drv.cuFuncSetAttribute, "cuFuncSetAttribute");
    bind(drv.cuLaunchKernel, "cuLaunchKernel");
    bind(drv.cuMemsetD8Async, "cuMemsetD8Async");
    bind(drv.cuGetErrorName, "cuGetErrorName");
    bind(drv.cuGetErrorString, "cuGetErrorString");
    drv.cuMemAlloc = reinterpret_cast<decltype(drv.cuMemAlloc)>(dlsym(lib, "cuMemAlloc_v2"));
    drv.cuMemFree = reinterpret_cast<decltype(drv.cuMemFree)>(dlsym(lib, "cuMemFree_v2"));
    auto optional = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    };
    optional(drv.cuStreamCreate, "cuStreamCreate");
    optional(drv.cuStreamDestroy, "cuStreamDestroy_v2");
    optional(drv.cuStreamSynchronize, "cuStreamSynchronize");
    optional(drv.cuEventCreate, "cuEventCreate");
    optional(drv.cuEventDestroy, "cuEventDestroy_v2");
    optional(drv.cuEventRecord, "cuEventRecord");
    optional(drv.cuEventElapsedTime, "cuEventElapsedTime");
    if (!all) {
      load_error = "libcuda.so.1 lacks " + missing + "; the NVIDIA driver is too old";
      return;
    }
    CUresult r = drv.cuInit(0);
    if (r != CUDA_SUCCESS) {
      load_error = "cuInit failed: " + drv.describe(r);
      return;
    }
    ok = true;  // the handle stays open for the life of the process
  });
  if (!ok) {
    if (error) *error = load_error;
    return nullptr;
  }
  return &drv;
}

}  // namespace cu
}  // namespace mlso
