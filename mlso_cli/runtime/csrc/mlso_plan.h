// The launch plan (version 1): what the op checks, allocates, zeroes and launches.
//
// Why a separate header: the rules must be identical at kernel creation and in the self-test
// entry points that CPU tests call through ctypes, and they mirror mlso_cli/runtime/plan.py.
// Nothing here touches ONNX Runtime or CUDA.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mlso_json.h"

namespace mlso {

// ONNX TensorProto element types (identical to ONNXTensorElementDataType values).
enum DType : int {
  kFloat32 = 1,
  kUint8 = 2,
  kInt8 = 3,
  kInt32 = 6,
  kInt64 = 7,
  kBool = 9,
  kFloat16 = 10,
  kFloat64 = 11,
  kBfloat16 = 16,
};

inline bool dtype_from_name(const std::string& name, int* dtype, size_t* itemsize) {
  struct Entry {
    const char* name;
    int dtype;
    size_t size;
  };
  static const Entry table[] = {
      {"float16", kFloat16, 2}, {"bfloat16", kBfloat16, 2}, {"float32", kFloat32, 4},
      {"float64", kFloat64, 8}, {"int8", kInt8, 1},         {"uint8", kUint8, 1},
      {"int32", kInt32, 4},     {"int64", kInt64, 8},       {"bool", kBool, 1},
  };
  for (const auto& e : table) {
    if (name == e.name) {
      *dtype = e.dtype;
      *itemsize = e.size;
      return true;
    }
  }
  return false;
}

inline std::string dtype_name(int dtype) {
  switch (dtype) {
    case kFloat16: return "float16";
    case kBfloat16: return "bfloat16";
    case kFloat32: return "float32";
    case kFloat64: return "float64";
    case kInt8: return "int8";
    case kUint8: return "uint8";
    case kInt32: return "int32";
    case kInt64: return "int64";
    case kBool: return "bool";
    default: return "onnx-dtype-" + std::to_string(dtype);
  }
}

inline std::string shape_str(const int64_t* dims, size_t n) {
  std::string s = "[";
  for (size_t i = 0; i < n; ++i) {
    if (i) s += ",";
    s += std::to_string(static_cast<long long>(dims[i]));
  }
  return s + "]";
}

struct TensorSpec {
  int dtype = 0;
  std::string dtype_str;
  std::vector<int64_t> shape;
  size_t bytes = 0;
};

enum class BufKind { Input, Output, Scratch };

struct BufRef {
  BufKind kind = BufKind::Input;
  size_t index = 0;
};

struct Launch {
  std::string kernel;
  unsigned grid[3] = {1, 1, 1};
  unsigned block[3] = {1, 1, 1};
  unsigned smem = 0;
  std::vector<BufRef> args;
};

struct Plan {
  int version = 0;
  std::vector<std::string> targets;
  int64_t smem_max = 0;
  std::vector<TensorSpec> inputs;
  std::vector<TensorSpec> outputs;
  std::vector<size_t> scratch;  // bytes
  std::vector<BufRef> zero;
  std::vector<Launch> launches;

  // Largest dynamic shared memory any launch asks for, or smem_max if larger.
  int64_t smem_needed() const {
    int64_t m = smem_max;
    for (const auto& l : launches) m = l.smem > m ? static_cast<int64_t>(l.smem) : m;
    return m;
  }
};

namespace plan_detail {

inline bool get_int(const json::Value* v, int64_t lo, int64_t hi, int64_t* out) {
  if (!v || v->kind != json::Value::Number || !v->is_int) return false;
  if (v->i < lo || v->i > hi) return false;
  *out = v->i;
  return true;
}

inline bool tensor_list(const json::Value& root, const char* key, std::vector<TensorSpec>* out,
                        std::string* err) {
  const json::Value* list = root.get(key);
  if (!list || list->kind != json::Value::Array) {
    *err = std::string("'") + key + "' must be a list";
    return false;
  }
  for (size_t i = 0; i < list->items.size(); ++i) {
    const json::Value& t = list->items[i];
    std::string where = std::string(key) + "[" + std::to_string(i) + "]";
    if (t.kind != json::Value::Object) {
      *err = where + " must be an object";
      return false;
    }
    TensorSpec spec;
    const json::Value* dt = t.get("dtype");
    size_t itemsize = 0;
    if (!dt || dt->kind != json::Value::String || !dtype_from_name(dt->s, &spec.dtype, &itemsize)) {
      *err = where + ".dtype must be one of float16, bfloat16, float32, float64, int8, uint8, "
                     "int32, int64, bool";
      return false;
    }
    spec.dtype_str = dt->s;
    const json::Value* shape = t.get("shape");
    if (!shape || shape->kind != json::Value::Array || shape->items.size() > 16) {
      *err = where + ".shape must be a list of at most 16 integers";
      return false;
    }
    uint64_t elems = 1;
    for (size_t k = 0; k < shape->items.size(); ++k) {
      int64_t d = 0;
      if (!get_int(&shape->items[k], 0, (int64_t(1) << 40), &d)) {
        *err = where + ".shape[" + std::to_string(k) + "] must be an integer >= 0";
        return false;
      }
      spec.shape.push_back(d);
      if (d != 0 && elems > (uint64_t(1) << 50) / static_cast<uint64_t>(d)) {
        *err = where + ".shape is too large";
        return false;
      }
      elems *= static_cast<uint64_t>(d);
    }
    spec.bytes = static_cast<size_t>(elems * itemsize);
    out->push_back(std::move(spec));
  }
  return true;
}

inline bool buf_ref(const json::Value& v, const std::string& where, bool allow_input,
                    const Plan& plan, BufRef* out, std::string* err) {
  if (v.kind != json::Value::Object) {
    *err = where + " must be an object";
    return false;
  }
  const json::Value* kind = v.get("kind");
  std::string kinds = allow_input ? "input, output or scratch" : "output or scratch";
  if (!kind || kind->kind != json::Value::String) {
    *err = where + ".kind must be " + kinds;
    return false;
  }
  size_t limit = 0;
  if (kind->s == "input" && allow_input) {
    out->kind = BufKind::Input;
    limit = plan.inputs.size();
  } else if (kind->s == "output") {
    out->kind = BufKind::Output;
    limit = plan.outputs.size();
  } else if (kind->s == "scratch") {
    out->kind = BufKind::Scratch;
    limit = plan.scratch.size();
  } else {
    *err = where + ".kind must be " + kinds + ", not \"" + kind->s + "\"";
    return false;
  }
  int64_t index = 0;
  if (!get_int(v.get("index"), 0, INT64_MAX, &index) || static_cast<size_t>(index) >= limit) {
    *err = where + ".index must be an integer in [0, " + std::to_string(limit) + ") for kind " +
           kind->s;
    return false;
  }
  out->index = static_cast<size_t>(index);
  return true;
}

inline bool dim3(const json::Value* v, const std::string& where, const int64_t* hi, unsigned* out,
                 std::string* err) {
  if (!v || v->kind != json::Value::Array || v->items.size() != 3) {
    *err = where + " must be a list of 3 integers";
    return false;
  }
  for (int k = 0; k < 3; ++k) {
    int64_t d = 0;
    if (!get_int(&v->items[k], 1, hi[k], &d)) {
      *err = where + "[" + std::to_string(k) + "] must be an integer in [1, " +
             std::to_string(static_cast<long long>(hi[k])) + "]";
      return false;
    }
    out[k] = static_cast<unsigned>(d);
  }
  return true;
}

}  // namespace plan_detail

// Parses and validates a plan. n_inputs / n_outputs are the node's variadic tensor counts
// (negative: not checked). On failure returns false with a message naming the field.
inline bool parse_plan(const std::string& text, long n_inputs, long n_outputs, Plan* plan,
                       std::string* err) {
  using plan_detail::get_int;
  json::Value root;
  std::string jerr;
  if (!json::parse(text, &root, &jerr)) {
    *err = "is not valid JSON (" + jerr + ")";
    return false;
  }
  if (root.kind != json::Value::Object) {
    *err = "must be a JSON object";
    return false;
  }
  int64_t version = 0;
  if (!get_int(root.get("version"), 1, 1, &version)) {
    *err = "'version' must be 1";
    return false;
  }
  plan->version = static_cast<int>(version);
  const json::Value* targets = root.get("targets");
  if (!targets || targets->kind != json::Value::Array || targets->items.empty()) {
    *err = "'targets' must be a non-empty list of strings such as \"sm_90a\"";
    return false;
  }
  for (const auto& t : targets->items) {
    bool ok = t.kind == json::Value::String &&
              (t.s.rfind("sm_", 0) == 0 || t.s.rfind("compute_", 0) == 0);
    if (!ok) {
      *err = "'targets' must be a non-empty list of strings such as \"sm_90a\"";
      return false;
    }
    plan->targets.push_back(t.s);
  }
  if (!get_int(root.get("smem_max"), 0, INT32_MAX, &plan->smem_max)) {
    *err = "'smem_max' must be an integer >= 0";
    return false;
  }
  if (!plan_detail::tensor_list(root, "inputs", &plan->inputs, err)) return false;
  if (!plan_detail::tensor_list(root, "outputs", &plan->outputs, err)) return false;
  if (plan->inputs.empty() || plan->outputs.empty()) {
    *err = "'inputs' and 'outputs' must each list at least one tensor";
    return false;
  }
  if (n_inputs >= 0 && plan->inputs.size() != static_cast<size_t>(n_inputs)) {
    *err = "lists " + std::to_string(plan->inputs.size()) + " inputs but the node has " +
           std::to_string(n_inputs) + " tensor inputs";
    return false;
  }
  if (n_outputs >= 0 && plan->outputs.size() != static_cast<size_t>(n_outputs)) {
    *err = "lists " + std::to_string(plan->outputs.size()) + " outputs but the node has " +
           std::to_string(n_outputs) + " outputs";
    return false;
  }
  const json::Value* scratch = root.get("scratch");
  if (!scratch || scratch->kind != json::Value::Array) {
    *err = "'scratch' must be a list";
    return false;
  }
  for (size_t i = 0; i < scratch->items.size(); ++i) {
    int64_t bytes = 0;
    const json::Value& s = scratch->items[i];
    if (s.kind != json::Value::Object || !get_int(s.get("bytes"), 0, int64_t(1) << 40, &bytes)) {
      *err = "scratch[" + std::to_string(i) + "].bytes must be an integer >= 0";
      return false;
    }
    plan->scratch.push_back(static_cast<size_t>(bytes));
  }
  const json::Value* zero = root.get("zero");
  if (!zero || zero->kind != json::Value::Array) {
    *err = "'zero' must be a list";
    return false;
  }
  for (size_t i = 0; i < zero->items.size(); ++i) {
    BufRef ref;
    if (!plan_detail::buf_ref(zero->items[i], "zero[" + std::to_string(i) + "]", false, *plan,
                              &ref, err)) {
      return false;
    }
    plan->zero.push_back(ref);
  }
  const json::Value* launches = root.get("launches");
  if (!launches || launches->kind != json::Value::Array || launches->items.empty()) {
    *err = "'launches' must be a non-empty list";
    return false;
  }
  static const int64_t grid_hi[3] = {INT32_MAX, 65535, 65535};
  static const int64_t block_hi[3] = {1024, 1024, 64};
  for (size_t i = 0; i < launches->items.size(); ++i) {
    const json::Value& l = launches->items[i];
    std::string where = "launches[" + std::to_string(i) + "]";
    if (l.kind != json::Value::Object) {
      *err = where + " must be an object";
      return false;
    }
    Launch launch;
    const json::Value* kernel = l.get("kernel");
    if (!kernel || kernel->kind != json::Value::String || kernel->s.empty() ||
        kernel->s.size() > 1024) {
      *err = where + ".kernel must be a non-empty kernel name";
      return false;
    }
    launch.kernel = kernel->s;
    if (!plan_detail::dim3(l.get("grid"), where + ".grid", grid_hi, launch.grid, err)) return false;
    if (!plan_detail::dim3(l.get("block"), where + ".block", block_hi, launch.block, err)) {
      return false;
    }
    if (uint64_t(launch.block[0]) * launch.block[1] * launch.block[2] > 1024) {
      *err = where + ".block has more than 1024 threads";
      return false;
    }
    int64_t smem = 0;
    if (!get_int(l.get("smem"), 0, INT32_MAX, &smem)) {
      *err = where + ".smem must be an integer >= 0";
      return false;
    }
    launch.smem = static_cast<unsigned>(smem);
    const json::Value* args = l.get("args");
    if (!args || args->kind != json::Value::Array) {
      *err = where + ".args must be a list";
      return false;
    }
    for (size_t k = 0; k < args->items.size(); ++k) {
      BufRef ref;
      if (!plan_detail::buf_ref(args->items[k], where + ".args[" + std::to_string(k) + "]", true,
                                *plan, &ref, err)) {
        return false;
      }
      launch.args.push_back(ref);
    }
    plan->launches.push_back(std::move(launch));
  }
  return true;
}

// Checks one runtime tensor against the plan. Returns an empty string when it matches.
inline std::string check_tensor(const TensorSpec& spec, int dtype, const int64_t* dims,
                                size_t ndims) {
  bool same = dtype == spec.dtype && ndims == spec.shape.size();
  for (size_t k = 0; same && k < ndims; ++k) same = dims[k] == spec.shape[k];
  if (same) return std::string();
  return "has shape " + shape_str(dims, ndims) + " dtype " + dtype_name(dtype) +
         ", but the plan expects shape " + shape_str(spec.shape.data(), spec.shape.size()) +
         " dtype " + spec.dtype_str;
}

}  // namespace mlso
