// mlso's ONNX Runtime custom-op library: one generic op, ai.mlso::MlsoKernel, on the CUDA EP.
//
// Why it looks like this (see docs/architecture.md, "Runtime"):
// - Built against the ORT C API headers only, at API version 21, and not linked to onnxruntime:
//   the OrtApiBase that ORT passes to RegisterCustomOps is the only way in.
// - Not linked to libcuda (dlopen, see mlso_cuda_driver.h), so it loads on machines without a GPU.
// - Everything that can fail slowly or allocate driver state (plan parsing, the binary's
//   SHA-256, cuModuleLoadData, cuFuncGetFunction, raising the shared-memory limit) happens when
//   ORT creates the kernel. Compute only checks shapes, allocates through ORT and launches on
//   ORT's stream, which keeps it safe under ORT's CUDA-graph capture.
// - Compute refuses inputs whose shape or dtype differ from the plan *before* anything is
//   launched: the kernels are compiled for static shapes and would read or write out of bounds.
//   A node whose declared shapes differ from the plan only in their dims is refused at kernel
//   creation as a shape mismatch (the model's inputs were given other shapes), not as tampering.
//   Both messages name the shapes and the fix (package/shapes.py: mlso.input_shapes).
//
// Op contract: input 0 is the kernel binary (uint8 initializer, CPU memory), then a variadic,
// heterogeneous list of tensors; variadic heterogeneous outputs. Attributes: plan (JSON, see
// mlso_plan.h), binary_sha256, ugraph (ignored here), source_sha256 (ignored here).

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "onnxruntime_c_api.h"

#include "mlso_cuda_driver.h"
#include "mlso_gemm.h"
#include "mlso_plan.h"
#include "mlso_sha256.h"

#if !defined(ORT_API_VERSION) || ORT_API_VERSION < 21
#error "mlso_ort needs the ONNX Runtime C API headers of API version 21 or newer"
#endif

#define MLSO_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// The API version the op is written against. Newer headers are fine: the OrtApi table only
// grows, and OrtCustomOp::version tells ORT which fields of the op struct to read.
constexpr uint32_t kOrtApiVersion = 21;
constexpr const char* kDomain = "ai.mlso";
constexpr const char* kOpName = "MlsoKernel";
// Tests build a variant on the CPU EP against a fake libcuda (tests/test_runtime_fakecuda.py).
#ifndef MLSO_EXECUTION_PROVIDER
#define MLSO_EXECUTION_PROVIDER "CUDAExecutionProvider"
#endif
constexpr const char* kProvider = MLSO_EXECUTION_PROVIDER;
constexpr const char* kRerunFix =
    " Fix: re-run `mlso optimize` on the original model; do not edit MlsoKernel nodes by hand.";

using mlso::BufKind;
namespace cu = mlso::cu;

const OrtApi* g_api = nullptr;

OrtStatus* error(OrtErrorCode code, const std::string& msg) {
  return g_api->CreateStatus(code, msg.c_str());
}

// Takes ownership of `s` and returns its message.
std::string consume(OrtStatus* s) {
  std::string msg = g_api->GetErrorMessage(s);
  g_api->ReleaseStatus(s);
  return msg;
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Sets `*out` to a string attribute. Returns an error message, empty on success.
std::string string_attr(const OrtKernelInfo* info, const char* name, std::string* out) {
  size_t size = 0;
  OrtStatus* s = g_api->KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (s) return "has no string attribute '" + std::string(name) + "' (" + consume(s) + ")";
  std::string buf(size, '\0');
  s = g_api->KernelInfoGetAttribute_string(info, name, size ? &buf[0] : nullptr, &size);
  if (s) return "cannot read attribute '" + std::string(name) + "' (" + consume(s) + ")";
  buf.resize(size ? size - 1 : 0);
  *out = std::move(buf);
  return std::string();
}

// Makes a context current for a scope, restoring the previous one after (no-op if current).
class ContextScope {
 public:
  ContextScope(const cu::Driver* drv, cu::CUcontext ctx) : drv_(drv) {
    cu::CUcontext current = nullptr;
    drv_->cuCtxGetCurrent(&current);
    if (current != ctx) {
      result_ = drv_->cuCtxPushCurrent(ctx);
      pushed_ = result_ == cu::CUDA_SUCCESS;
    }
  }
  ~ContextScope() {
    if (pushed_) {
      cu::CUcontext popped = nullptr;
      drv_->cuCtxPopCurrent(&popped);
    }
  }
  cu::CUresult result() const { return result_; }
  ContextScope(const ContextScope&) = delete;
  ContextScope& operator=(const ContextScope&) = delete;

 private:
  const cu::Driver* drv_;
  bool pushed_ = false;
  cu::CUresult result_ = cu::CUDA_SUCCESS;
};

struct Kernel {
  std::string node;  // for messages
  mlso::Plan plan;
  std::vector<std::string> input_names;  // the variadic inputs' tensor names
  const cu::Driver* drv = nullptr;
  cu::CUdevice device = 0;
  bool device_retained = false;
  cu::CUcontext ctx = nullptr;
  cu::CUmodule module = nullptr;
  std::vector<cu::CUfunction> functions;  // one per launch, in plan order (null: a GEMM)
  OrtAllocator* allocator = nullptr;      // the EP's device allocator, for scratch
  std::unique_ptr<mlso::blas::Runner> gemms;  // the plan's library GEMMs, made at creation

  std::string where() const { return std::string(kOpName) + " node '" + node + "': "; }

  ~Kernel() {
    if (gemms && drv) {
      ContextScope scope(drv, ctx);
      gemms.reset();
    }
    if (module && drv) {
      ContextScope scope(drv, ctx);
      drv->cuModuleUnload(module);
    }
    if (device_retained && drv) drv->cuDevicePrimaryCtxRelease(device);
    if (allocator) g_api->ReleaseAllocator(allocator);
  }
};

// How to get a model for other shapes, or run this one: ends every shape-mismatch message.
constexpr const char* kShapeFix =
    " Fix: feed the shapes the model was optimized for (its metadata lists them as "
    "mlso.input_shapes), or re-run `mlso optimize` on the original model with --input-shape for "
    "the shapes you feed.";

// The first declared input or output whose shape differs from the plan's only in its dims: same
// dtype, same rank, every dim known. That is what ORT declares when the model's graph inputs were
// given other static shapes than mlso optimized for (an edited model, or a tool that fixes input
// shapes), so it is reported as a shape mismatch before check_declared would call the plan
// tampered. Empty when there is none.
std::string reshaped(const Kernel& k, const std::vector<mlso::Declared>& ins,
                     const std::vector<mlso::Declared>& outs) {
  auto differs = [](const mlso::TensorSpec& spec, const mlso::Declared& d) {
    if (d.dtype != spec.dtype || !d.has_shape || d.dims.size() != spec.shape.size()) return false;
    bool other = false;
    for (size_t i = 0; i < d.dims.size(); ++i) {
      if (d.dims[i] < 0) return false;
      other = other || d.dims[i] != spec.shape[i];
    }
    return other;
  };
  for (int side = 0; side < 2; ++side) {
    const auto& specs = side == 0 ? k.plan.inputs : k.plan.outputs;
    const auto& declared = side == 0 ? ins : outs;
    for (size_t i = 0; i < specs.size() && i < declared.size(); ++i) {
      if (!differs(specs[i], declared[i])) continue;
      const auto& spec = specs[i];
      std::string what = side == 0 ? "input '" + k.input_names[i] + "' (tensor input " +
                                         std::to_string(i) + ")"
                                   : "output " + std::to_string(i);
      return std::string(kOpName) + " node '" + k.node + "' was optimized for " + what +
             " of shape " + mlso::shape_str(spec.shape.data(), spec.shape.size()) + " " +
             spec.dtype_str + ", but the graph gives it shape " +
             mlso::shape_str(declared[i].dims.data(), declared[i].dims.size()) +
             "; its kernels are compiled for static shapes, so the session was refused." +
             kShapeFix +
             " (If the model's shapes were not changed, the node was edited after mlso wrote "
             "it: tampered?)";
    }
  }
  return std::string();
}

std::string arch_list(const std::vector<std::string>& targets) {
  std::string s;
  for (const auto& t : targets) s += (s.empty() ? "" : ", ") + t;
  return s;
}

// The node's declared type of input or output `index`, as ORT knows it at kernel creation.
// Unknown parts stay unknown (dtype 0, dim -1). ORT reports a value without shape information
// as rank 0, so a declared rank of 0 only counts when the plan's rank is 0 too.
mlso::Declared declared_type(const OrtKernelInfo* info, bool is_input, size_t index,
                             size_t plan_rank) {
  mlso::Declared d;
  OrtTypeInfo* type_info = nullptr;
  OrtStatus* s = is_input ? g_api->KernelInfo_GetInputTypeInfo(info, index, &type_info)
                          : g_api->KernelInfo_GetOutputTypeInfo(info, index, &type_info);
  if (s || !type_info) {
    if (s) g_api->ReleaseStatus(s);
    return d;
  }
  const OrtTensorTypeAndShapeInfo* tensor = nullptr;
  s = g_api->CastTypeInfoToTensorInfo(type_info, &tensor);
  if (!s && tensor) {
    ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    size_t ndims = 0;
    if (!(s = g_api->GetTensorElementType(tensor, &type))) d.dtype = static_cast<int>(type);
    if (!s) s = g_api->GetDimensionsCount(tensor, &ndims);
    if (!s && (ndims > 0 || plan_rank == 0)) {
      d.dims.assign(ndims, -1);
      if (ndims) s = g_api->GetDimensions(tensor, d.dims.data(), ndims);
      d.has_shape = !s;
      for (auto& dim : d.dims) dim = dim < 0 ? -1 : dim;
    }
  }
  if (s) g_api->ReleaseStatus(s);
  g_api->ReleaseTypeInfo(type_info);
  return d;
}

OrtStatus* create_kernel(const OrtKernelInfo* info, Kernel* k) {
  // --- node and attributes -------------------------------------------------------------
  {
    size_t size = 0;
    OrtStatus* s = g_api->KernelInfo_GetNodeName(info, nullptr, &size);
    if (!s && size > 0) {
      std::string buf(size, '\0');
      s = g_api->KernelInfo_GetNodeName(info, &buf[0], &size);
      if (!s) k->node.assign(buf.c_str());
    }
    if (s) g_api->ReleaseStatus(s);
  }
  size_t n_in = 0, n_out = 0;
  if (OrtStatus* s = g_api->KernelInfo_GetInputCount(info, &n_in)) return s;
  if (OrtStatus* s = g_api->KernelInfo_GetOutputCount(info, &n_out)) return s;
  if (n_in < 2) {
    return error(ORT_INVALID_ARGUMENT,
                 k->where() + "needs the kernel binary and at least one tensor input." + kRerunFix);
  }
  for (size_t i = 1; i < n_in; ++i) {
    size_t size = 0;
    std::string name = "#" + std::to_string(i - 1);
    OrtStatus* s = g_api->KernelInfo_GetInputName(info, i, nullptr, &size);
    if (!s && size > 0) {
      std::string buf(size, '\0');
      s = g_api->KernelInfo_GetInputName(info, i, &buf[0], &size);
      if (!s) name.assign(buf.c_str());
    }
    if (s) g_api->ReleaseStatus(s);
    k->input_names.push_back(name);
  }

  std::string plan_text, binary_sha;
  std::string problem = string_attr(info, "plan", &plan_text);
  if (problem.empty()) problem = string_attr(info, "binary_sha256", &binary_sha);
  if (!problem.empty()) return error(ORT_INVALID_ARGUMENT, k->where() + problem + "." + kRerunFix);
  if (!mlso::parse_plan(plan_text, static_cast<long>(n_in - 1), static_cast<long>(n_out), &k->plan,
                        &problem)) {
    return error(ORT_INVALID_ARGUMENT,
                 k->where() + "attribute 'plan' " + problem + " (tampered?)." + kRerunFix);
  }
  {
    std::vector<mlso::Declared> ins, outs;
    for (size_t i = 0; i < k->plan.inputs.size(); ++i) {
      ins.push_back(declared_type(info, true, i + 1, k->plan.inputs[i].shape.size()));
    }
    for (size_t j = 0; j < k->plan.outputs.size(); ++j) {
      outs.push_back(declared_type(info, false, j, k->plan.outputs[j].shape.size()));
    }
    std::string shape_problem = reshaped(*k, ins, outs);
    if (!shape_problem.empty()) return error(ORT_INVALID_ARGUMENT, shape_problem);
    if (!mlso::check_declared(k->plan, ins, outs, &problem)) {
      return error(ORT_INVALID_ARGUMENT,
                   k->where() + "attribute 'plan' " + problem + " (tampered?)." + kRerunFix);
    }
  }

  // --- the binary, read once, here ------------------------------------------------------
  int is_constant = 0;
  const OrtValue* bin_value = nullptr;
  OrtStatus* s = g_api->KernelInfoGetConstantInput_tensor(info, 0, &is_constant, &bin_value);
  if (s || !is_constant || !bin_value) {
    std::string why = s ? " (" + consume(s) + ")" : "";
    return error(ORT_INVALID_ARGUMENT,
                 k->where() + "input 0 (the kernel binary) must be a constant uint8 initializer" +
                     why + "." + kRerunFix);
  }
  OrtTensorTypeAndShapeInfo* ti = nullptr;
  if ((s = g_api->GetTensorTypeAndShape(bin_value, &ti))) return s;
  ONNXTensorElementDataType bin_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  size_t bin_len = 0;
  s = g_api->GetTensorElementType(ti, &bin_type);
  if (!s) s = g_api->GetTensorShapeElementCount(ti, &bin_len);
  g_api->ReleaseTensorTypeAndShapeInfo(ti);
  if (s) return s;
  if (bin_type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || bin_len == 0) {
    return error(ORT_INVALID_ARGUMENT,
                 k->where() + "input 0 (the kernel binary) must be a non-empty uint8 tensor." +
                     kRerunFix);
  }
  const OrtMemoryInfo* bin_location = nullptr;
  if ((s = g_api->GetTensorMemoryInfo(bin_value, &bin_location))) return s;
  OrtMemoryInfoDeviceType bin_device = OrtMemoryInfoDeviceType_CPU;
  g_api->MemoryInfoGetDeviceType(bin_location, &bin_device);
  if (bin_device != OrtMemoryInfoDeviceType_CPU) {
    return error(ORT_FAIL, k->where() + "ONNX Runtime placed the kernel binary in device memory, "
                                        "but the op declares it as a CPU input.");
  }
  void* bin_data = nullptr;
  if ((s = g_api->GetTensorMutableData(const_cast<OrtValue*>(bin_value), &bin_data))) return s;
  // Copy: the driver wants an aligned image, and ORT may release the initializer later.
  std::vector<unsigned char> image(static_cast<const unsigned char*>(bin_data),
                                   static_cast<const unsigned char*>(bin_data) + bin_len);
  std::string actual = mlso::Sha256::of(image.data(), image.size());
  if (actual != lower(binary_sha)) {
    return error(ORT_INVALID_ARGUMENT,
                 k->where() + "the kernel binary does not match attribute binary_sha256 "
                              "(recorded " + binary_sha + ", binary hashes to " + actual +
                     "); the binary or the attribute was changed after mlso wrote the model "
                     "(tampered)." + kRerunFix);
  }

  // --- device, context, module ----------------------------------------------------------
  if ((s = g_api->KernelInfoGetAllocator(info, OrtMemTypeDefault, &k->allocator))) return s;
  const OrtMemoryInfo* mem_info = nullptr;
  int device_ordinal = 0;
  if ((s = g_api->AllocatorGetInfo(k->allocator, &mem_info))) return s;
  if ((s = g_api->MemoryInfoGetId(mem_info, &device_ordinal))) return s;
  OrtMemoryInfoDeviceType ep_device = OrtMemoryInfoDeviceType_CPU;
  g_api->MemoryInfoGetDeviceType(mem_info, &ep_device);
#ifndef MLSO_TEST_HOST_MEMORY
  if (ep_device != OrtMemoryInfoDeviceType_GPU) {
    return error(ORT_FAIL, k->where() + "the node was assigned to an execution provider whose "
                                        "memory is not on a GPU; the op runs on " +
                               std::string(kProvider) + " only.");
  }
#endif

  std::string driver_error;
  k->drv = cu::driver(&driver_error);
  if (!k->drv) {
    return error(ORT_FAIL, k->where() + driver_error +
                               ". Fix: install the NVIDIA driver, or open the session without "
                               "the mlso library so the original subgraph runs.");
  }
  const cu::Driver* drv = k->drv;
  cu::CUresult r = drv->cuDeviceGet(&k->device, device_ordinal);
  if (r != cu::CUDA_SUCCESS) {
    return error(ORT_FAIL, k->where() + "cuDeviceGet(" + std::to_string(device_ordinal) +
                               ") failed: " + drv->describe(r));
  }
  int major = 0, minor = 0, smem_optin = 0;
  drv->cuDeviceGetAttribute(&major, cu::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, k->device);
  drv->cuDeviceGetAttribute(&minor, cu::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, k->device);
  drv->cuDeviceGetAttribute(&smem_optin, cu::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                            k->device);
  std::string arch = "sm_" + std::to_string(major) + std::to_string(minor);
  if (k->plan.smem_needed() > smem_optin) {
    return error(ORT_FAIL, k->where() + "the plan needs " +
                               std::to_string(static_cast<long long>(k->plan.smem_needed())) +
                               " bytes of shared memory per block, but GPU " +
                               std::to_string(device_ordinal) + " (" + arch + ") allows " +
                               std::to_string(smem_optin) +
                               ". Fix: re-run `mlso optimize` for this GPU, or open the session "
                               "without the mlso library.");
  }
  r = drv->cuDevicePrimaryCtxRetain(&k->ctx, k->device);
  if (r != cu::CUDA_SUCCESS) {
    return error(ORT_FAIL, k->where() + "cannot retain the primary CUDA context of GPU " +
                               std::to_string(device_ordinal) + ": " + drv->describe(r));
  }
  k->device_retained = true;
  ContextScope scope(drv, k->ctx);
  if (scope.result() != cu::CUDA_SUCCESS) {
    return error(ORT_FAIL, k->where() + "cannot make the primary context current: " +
                               drv->describe(scope.result()));
  }
  r = drv->cuModuleLoadData(&k->module, image.data());
  if (r != cu::CUDA_SUCCESS) {
    k->module = nullptr;
    std::string msg = k->where() + "cannot load the kernel binary: " + drv->describe(r);
    if (r == cu::CUDA_ERROR_NO_BINARY_FOR_GPU) {
      msg += ". It holds code for " + arch_list(k->plan.targets) + ", this GPU is " + arch +
             ". Fix: re-run `mlso optimize` with a target that includes " + arch + ".";
    }
    return error(ORT_FAIL, msg);
  }
  std::map<std::string, std::pair<cu::CUfunction, unsigned>> by_name;  // function, max smem
  for (const auto& launch : k->plan.launches) {
    if (launch.is_gemm) {
      k->functions.push_back(nullptr);
      continue;
    }
    auto it = by_name.find(launch.kernel);
    if (it == by_name.end()) {
      cu::CUfunction fn = nullptr;
      r = drv->cuModuleGetFunction(&fn, k->module, launch.kernel.c_str());
      if (r != cu::CUDA_SUCCESS) {
        return error(ORT_INVALID_ARGUMENT, k->where() + "the kernel binary has no kernel '" +
                                               launch.kernel + "' (" + drv->describe(r) +
                                               "); the plan and the binary disagree." +
                                               kRerunFix);
      }
      it = by_name.emplace(launch.kernel, std::make_pair(fn, 0u)).first;
    }
    it->second.second = std::max(it->second.second, launch.smem);
    k->functions.push_back(it->second.first);
  }
  for (const auto& entry : by_name) {
    unsigned smem = entry.second.second;
    if (smem > cu::kDefaultDynamicSmemLimit) {
      r = drv->cuFuncSetAttribute(entry.second.first,
                                  cu::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                  static_cast<int>(smem));
      if (r != cu::CUDA_SUCCESS) {
        return error(ORT_FAIL, k->where() + "cannot raise the shared-memory limit of kernel '" +
                                   entry.first + "' to " + std::to_string(smem) +
                                   " bytes: " + drv->describe(r));
      }
    }
  }
  if (k->plan.has_gemm()) {
    // Handle, descriptors, algorithms and the workspace now, before ORT captures a CUDA graph.
    k->gemms.reset(new mlso::blas::Runner());
    std::string why;
    if (!k->gemms->init(k->plan, drv, &why)) {
      k->gemms.reset();
      return error(ORT_FAIL, k->where() + "cannot set up its library GEMMs: " + why + ".");
    }
  }
  return nullptr;
}

// Frees scratch blocks when Compute returns (ORT's own CUDA kernels free temporaries the same
// way: later users of the memory are ordered after this launch on the same stream).
struct ScratchBlocks {
  OrtAllocator* allocator = nullptr;
  std::vector<void*> blocks;
  ~ScratchBlocks() {
    for (void* p : blocks) {
      if (p) allocator->Free(allocator, p);
    }
  }
};

cu::CUdeviceptr as_devptr(void* p) {
  return static_cast<cu::CUdeviceptr>(reinterpret_cast<uintptr_t>(p));
}

OrtStatus* compute(Kernel* k, OrtKernelContext* context) {
  const mlso::Plan& plan = k->plan;
  size_t n_in = 0, n_out = 0;
  if (OrtStatus* s = g_api->KernelContext_GetInputCount(context, &n_in)) return s;
  if (OrtStatus* s = g_api->KernelContext_GetOutputCount(context, &n_out)) return s;
  if (n_in != plan.inputs.size() + 1 || n_out != plan.outputs.size()) {
    return error(ORT_INVALID_ARGUMENT, k->where() + "got " + std::to_string(n_in) +
                                           " inputs and " + std::to_string(n_out) +
                                           " outputs, the plan describes " +
                                           std::to_string(plan.inputs.size() + 1) + " and " +
                                           std::to_string(plan.outputs.size()) + ".");
  }

  // 1. Check every input before anything else: nothing is launched on a mismatch.
  std::vector<void*> inputs(plan.inputs.size(), nullptr);
  for (size_t i = 0; i < plan.inputs.size(); ++i) {
    const OrtValue* value = nullptr;
    if (OrtStatus* s = g_api->KernelContext_GetInput(context, i + 1, &value)) return s;
    if (!value) {
      return error(ORT_INVALID_ARGUMENT,
                   k->where() + "input '" + k->input_names[i] + "' is missing.");
    }
    OrtTensorTypeAndShapeInfo* ti = nullptr;
    if (OrtStatus* s = g_api->GetTensorTypeAndShape(value, &ti)) return s;
    ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    size_t ndims = 0;
    OrtStatus* s = g_api->GetTensorElementType(ti, &type);
    if (!s) s = g_api->GetDimensionsCount(ti, &ndims);
    std::vector<int64_t> dims(ndims);
    if (!s && ndims) s = g_api->GetDimensions(ti, dims.data(), ndims);
    g_api->ReleaseTensorTypeAndShapeInfo(ti);
    if (s) return s;
    std::string problem =
        mlso::check_tensor(plan.inputs[i], static_cast<int>(type), dims.data(), dims.size());
    if (!problem.empty()) {
      bool same_shape = dims == plan.inputs[i].shape;  // then only the dtype differs
      std::string why = same_shape ? std::string("; the node was not launched.") + kRerunFix
                                   : std::string(". The node was optimized for that shape and its "
                                                 "kernels are compiled for static shapes, so it "
                                                 "was not launched.") +
                                         kShapeFix;
      return error(ORT_INVALID_ARGUMENT, k->where() + "input '" + k->input_names[i] +
                                             "' (tensor input " + std::to_string(i) + ") " +
                                             problem + why);
    }
    if ((s = g_api->GetTensorMutableData(const_cast<OrtValue*>(value), &inputs[i]))) return s;
  }

  // 2. Outputs, with the plan's shapes.
  std::vector<void*> outputs(plan.outputs.size(), nullptr);
  for (size_t j = 0; j < plan.outputs.size(); ++j) {
    const auto& spec = plan.outputs[j];
    OrtValue* value = nullptr;
    if (OrtStatus* s = g_api->KernelContext_GetOutput(context, j, spec.shape.data(),
                                                      spec.shape.size(), &value)) {
      return s;
    }
    if (!value) {
      return error(ORT_FAIL, k->where() + "ONNX Runtime returned no buffer for output " +
                                 std::to_string(j) + ".");
    }
    // ORT allocated the output with the node's output type; a plan dtype of another size
    // would make the kernels write past it.
    OrtTensorTypeAndShapeInfo* ti = nullptr;
    if (OrtStatus* s = g_api->GetTensorTypeAndShape(value, &ti)) return s;
    ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    OrtStatus* s = g_api->GetTensorElementType(ti, &type);
    g_api->ReleaseTensorTypeAndShapeInfo(ti);
    if (s) return s;
    if (static_cast<int>(type) != spec.dtype) {
      return error(ORT_INVALID_ARGUMENT,
                   k->where() + "output " + std::to_string(j) + " is " +
                       mlso::dtype_name(static_cast<int>(type)) + " in the graph, but the plan "
                       "writes " + spec.dtype_str + "; nothing was launched." + kRerunFix);
    }
    if ((s = g_api->GetTensorMutableData(value, &outputs[j]))) return s;
  }

  void* stream_handle = nullptr;
  if (OrtStatus* s = g_api->KernelContext_GetGPUComputeStream(context, &stream_handle)) return s;
  cu::CUstream stream = static_cast<cu::CUstream>(stream_handle);

  // 3. Scratch from ORT's device allocator.
  ScratchBlocks scratch;
  scratch.allocator = k->allocator;
  scratch.blocks.assign(plan.scratch.size(), nullptr);
  for (size_t i = 0; i < plan.scratch.size(); ++i) {
    if (plan.scratch[i] == 0) continue;
    scratch.blocks[i] = k->allocator->Alloc(k->allocator, plan.scratch[i]);
    if (!scratch.blocks[i]) {
      return error(ORT_FAIL, k->where() + "cannot allocate " + std::to_string(plan.scratch[i]) +
                                 " bytes of scratch memory on the GPU.");
    }
  }

  auto pointer = [&](const mlso::BufRef& ref, size_t* bytes) -> void* {
    switch (ref.kind) {
      case BufKind::Input:
        *bytes = plan.inputs[ref.index].bytes;
        return inputs[ref.index];
      case BufKind::Output:
        *bytes = plan.outputs[ref.index].bytes;
        return outputs[ref.index];
      case BufKind::Scratch:
      default:
        *bytes = plan.scratch[ref.index];
        return scratch.blocks[ref.index];
    }
  };

  const cu::Driver* drv = k->drv;
  ContextScope scope(drv, k->ctx);
  if (scope.result() != cu::CUDA_SUCCESS) {
    return error(ORT_FAIL, k->where() + "cannot make the primary context current: " +
                               drv->describe(scope.result()));
  }

  // 4. Zero what the plan asks for, then launch in order, all on ORT's stream.
  for (const auto& ref : plan.zero) {
    size_t bytes = 0;
    void* p = pointer(ref, &bytes);
    if (!p || bytes == 0) continue;
    cu::CUresult r = drv->cuMemsetD8Async(as_devptr(p), 0, bytes, stream);
    if (r != cu::CUDA_SUCCESS) {
      return error(ORT_FAIL, k->where() + "cuMemsetD8Async failed: " + drv->describe(r));
    }
  }
  std::vector<cu::CUdeviceptr> values;
  std::vector<void*> params;
  for (size_t l = 0; l < plan.launches.size(); ++l) {
    const auto& launch = plan.launches[l];
    if (launch.is_gemm) {
      size_t bytes = 0;
      const mlso::Gemm& g = launch.gemm;
      void* a = pointer(g.a.buf, &bytes);
      void* b = pointer(g.b.buf, &bytes);
      void* c = pointer(g.c.buf, &bytes);
      void* bias = g.has_bias ? pointer(g.bias_buf, &bytes) : nullptr;
      void* residual = g.has_residual ? pointer(g.residual.buf, &bytes) : nullptr;
      std::string why;
      if (!k->gemms || !k->gemms->run(l, a, b, c, bias, residual, stream, &why)) {
        return error(ORT_FAIL, k->where() + "launch " + std::to_string(l) +
                                   " (a library GEMM) failed: " + why);
      }
      continue;
    }
    values.assign(launch.args.size(), 0);
    params.assign(launch.args.size(), nullptr);
    for (size_t a = 0; a < launch.args.size(); ++a) {
      size_t bytes = 0;
      values[a] = as_devptr(pointer(launch.args[a], &bytes));
      params[a] = &values[a];
    }
    cu::CUresult r = drv->cuLaunchKernel(
        k->functions[l], launch.grid[0], launch.grid[1], launch.grid[2], launch.block[0],
        launch.block[1], launch.block[2], launch.smem, stream,
        params.empty() ? nullptr : params.data(), nullptr);
    if (r != cu::CUDA_SUCCESS) {
      return error(ORT_FAIL, k->where() + "launch " + std::to_string(l) + " ('" + launch.kernel +
                                 "') failed: " + drv->describe(r));
    }
  }
  return nullptr;
}

// ---- OrtCustomOp callbacks ---------------------------------------------------------------

OrtStatus* ORT_API_CALL CreateKernelV2(const OrtCustomOp*, const OrtApi* api,
                                       const OrtKernelInfo* info, void** kernel) {
  if (!g_api) g_api = api;
  *kernel = nullptr;
  std::unique_ptr<Kernel> k(new Kernel());
  if (OrtStatus* s = create_kernel(info, k.get())) return s;
  *kernel = k.release();
  return nullptr;
}

OrtStatus* ORT_API_CALL KernelComputeV2(void* kernel, OrtKernelContext* context) {
  return compute(static_cast<Kernel*>(kernel), context);
}

void ORT_API_CALL KernelDestroy(void* kernel) { delete static_cast<Kernel*>(kernel); }

const char* ORT_API_CALL GetName(const OrtCustomOp*) { return kOpName; }
const char* ORT_API_CALL GetExecutionProviderType(const OrtCustomOp*) { return kProvider; }

size_t ORT_API_CALL GetInputTypeCount(const OrtCustomOp*) { return 2; }
ONNXTensorElementDataType ORT_API_CALL GetInputType(const OrtCustomOp*, size_t index) {
  return index == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}
OrtCustomOpInputOutputCharacteristic ORT_API_CALL GetInputCharacteristic(const OrtCustomOp*,
                                                                         size_t index) {
  return index == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_VARIADIC;
}
OrtMemType ORT_API_CALL GetInputMemoryType(const OrtCustomOp*, size_t index) {
  return index == 0 ? OrtMemTypeCPUInput : OrtMemTypeDefault;
}
int ORT_API_CALL GetVariadicInputMinArity(const OrtCustomOp*) { return 1; }
int ORT_API_CALL GetVariadicInputHomogeneity(const OrtCustomOp*) { return 0; }

size_t ORT_API_CALL GetOutputTypeCount(const OrtCustomOp*) { return 1; }
ONNXTensorElementDataType ORT_API_CALL GetOutputType(const OrtCustomOp*, size_t) {
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
}
OrtCustomOpInputOutputCharacteristic ORT_API_CALL GetOutputCharacteristic(const OrtCustomOp*,
                                                                          size_t) {
  return INPUT_OUTPUT_VARIADIC;
}
int ORT_API_CALL GetVariadicOutputMinArity(const OrtCustomOp*) { return 1; }
int ORT_API_CALL GetVariadicOutputHomogeneity(const OrtCustomOp*) { return 0; }

const OrtCustomOp* the_op() {
  static OrtCustomOp op;
  static std::once_flag once;
  std::call_once(once, [] {
    std::memset(&op, 0, sizeof(op));
    op.version = kOrtApiVersion;
    op.GetName = GetName;
    op.GetExecutionProviderType = GetExecutionProviderType;
    op.GetInputType = GetInputType;
    op.GetInputTypeCount = GetInputTypeCount;
    op.GetOutputType = GetOutputType;
    op.GetOutputTypeCount = GetOutputTypeCount;
    op.KernelDestroy = KernelDestroy;
    op.GetInputCharacteristic = GetInputCharacteristic;
    op.GetOutputCharacteristic = GetOutputCharacteristic;
    op.GetInputMemoryType = GetInputMemoryType;
    op.GetVariadicInputMinArity = GetVariadicInputMinArity;
    op.GetVariadicInputHomogeneity = GetVariadicInputHomogeneity;
    op.GetVariadicOutputMinArity = GetVariadicOutputMinArity;
    op.GetVariadicOutputHomogeneity = GetVariadicOutputHomogeneity;
    op.CreateKernelV2 = CreateKernelV2;
    op.KernelComputeV2 = KernelComputeV2;
  });
  return &op;
}

void copy_message(const std::string& msg, char* out, size_t len) {
  if (!out || len == 0) return;
  size_t n = std::min(msg.size(), len - 1);
  std::memcpy(out, msg.data(), n);
  out[n] = '\0';
}

}  // namespace

// Called by ONNX Runtime (SessionOptions.register_custom_ops_library).
MLSO_EXPORT OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options,
                                                      const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(kOrtApiVersion);
  if (!api) {
    const OrtApi* any = api_base->GetApi(1);
    std::string msg = std::string("the mlso runtime library needs ONNX Runtime >= 1.21 (C API ") +
                      std::to_string(kOrtApiVersion) + "), this is " +
                      api_base->GetVersionString() + ". Fix: upgrade onnxruntime-gpu.";
    return any ? any->CreateStatus(ORT_FAIL, msg.c_str()) : nullptr;
  }
  static std::mutex mutex;
  // ORT requires a domain to outlive every session that uses it, so domains are kept for the
  // life of the process (one per registration).
  static std::vector<OrtCustomOpDomain*> domains;
  std::lock_guard<std::mutex> lock(mutex);
  g_api = api;
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* s = api->CreateCustomOpDomain(kDomain, &domain)) return s;
  if (OrtStatus* s = api->CustomOpDomain_Add(domain, the_op())) {
    api->ReleaseCustomOpDomain(domain);
    return s;
  }
  if (OrtStatus* s = api->AddCustomOpDomain(options, domain)) {
    api->ReleaseCustomOpDomain(domain);
    return s;
  }
  domains.push_back(domain);
  return nullptr;
}

// ---- self-test entry points (CPU tests call these through ctypes; no ORT, no CUDA) --------

MLSO_EXPORT int mlso_api_version(void) { return static_cast<int>(kOrtApiVersion); }

MLSO_EXPORT void mlso_selftest_sha256(const unsigned char* data, size_t n, char* out65) {
  std::string hex = mlso::Sha256::of(data, n);
  copy_message(hex, out65, 65);
}

// 0: the plan is valid for a node with n_inputs tensor inputs and n_outputs outputs; 1: it is
// not, with the reason in err.
MLSO_EXPORT int mlso_selftest_plan(const char* plan_json, long n_inputs, long n_outputs, char* err,
                                   size_t err_len) {
  mlso::Plan plan;
  std::string problem;
  if (!mlso::parse_plan(plan_json ? plan_json : "", n_inputs, n_outputs, &plan, &problem)) {
    copy_message(problem, err, err_len);
    return 1;
  }
  copy_message("", err, err_len);
  return 0;
}

// ---- library GEMMs for the PyCUDA launcher (runtime/launcher.py): the very code the op runs ----

namespace {
struct GemmHandle {
  mlso::Plan plan;
  mlso::blas::Runner runner;
};
}  // namespace

// Parses the plan and sets up all its library GEMMs in the calling thread's current CUDA context
// (the launcher pushes the device's primary context). Returns a handle, or null with the reason
// in err.
MLSO_EXPORT void* mlso_gemm_create(const char* plan_json, char* err, size_t err_len) {
  std::unique_ptr<GemmHandle> h(new GemmHandle());
  std::string problem;
  if (!mlso::parse_plan(plan_json ? plan_json : "", -1, -1, &h->plan, &problem)) {
    copy_message("the plan " + problem, err, err_len);
    return nullptr;
  }
  const cu::Driver* drv = cu::driver(&problem);
  if (!drv || !h->runner.init(h->plan, drv, &problem)) {
    copy_message(problem, err, err_len);
    return nullptr;
  }
  copy_message("", err, err_len);
  return h.release();
}

// Enqueues launch `index` (a library GEMM) on `stream` (a CUstream; 0 is the legacy default
// stream); a, b, c (and bias, residual: 0 when the GEMM has no such epilogue) are the base
// device pointers of the buffers its operands name. 0 on success.
MLSO_EXPORT int mlso_gemm_run(void* handle, size_t index, unsigned long long a,
                              unsigned long long b, unsigned long long c, unsigned long long bias,
                              unsigned long long residual, void* stream, char* err,
                              size_t err_len) {
  auto* h = static_cast<GemmHandle*>(handle);
  std::string problem;
  auto ptr = [](unsigned long long p) { return reinterpret_cast<void*>(static_cast<uintptr_t>(p)); };
  if (!h || !h->runner.run(index, ptr(a), ptr(b), ptr(c), ptr(bias), ptr(residual),
                           static_cast<cu::CUstream>(stream), &problem)) {
    copy_message(h ? problem : std::string("null handle"), err, err_len);
    return 1;
  }
  return 0;
}

// How launch `index`'s algorithm was chosen (the heuristic's first, or timed), into buf.
MLSO_EXPORT void mlso_gemm_describe(void* handle, size_t index, char* buf, size_t len) {
  auto* h = static_cast<GemmHandle*>(handle);
  copy_message(h ? h->runner.describe(index) : std::string("null handle"), buf, len);
}

MLSO_EXPORT void mlso_gemm_destroy(void* handle) { delete static_cast<GemmHandle*>(handle); }

// 1 when this build can run library GEMMs (it was compiled against the cuBLASLt headers).
MLSO_EXPORT int mlso_gemm_supported(void) {
#ifdef MLSO_HAVE_CUBLASLT
  return 1;
#else
  return 0;
#endif
}

// 0: tensor input `index` with this dtype/shape matches the plan; 1: it does not (reason in err);
// 2: the plan itself is invalid.
MLSO_EXPORT int mlso_selftest_check_input(const char* plan_json, size_t index, int dtype,
                                          const int64_t* dims, size_t ndims, char* err,
                                          size_t err_len) {
  mlso::Plan plan;
  std::string problem;
  if (!mlso::parse_plan(plan_json ? plan_json : "", -1, -1, &plan, &problem)) {
    copy_message(problem, err, err_len);
    return 2;
  }
  if (index >= plan.inputs.size()) {
    copy_message("index out of range", err, err_len);
    return 2;
  }
  problem = mlso::check_tensor(plan.inputs[index], dtype, dims, ndims);
  copy_message(problem, err, err_len);
  return problem.empty() ? 0 : 1;
}
