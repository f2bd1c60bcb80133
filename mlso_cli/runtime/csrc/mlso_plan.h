// The launch plan (versions 1 to 4): what the op checks, allocates, zeroes and launches.
// Version 2 adds library GEMM launches ({"kind": "gemm", ...}), run with cuBLASLt (mlso_gemm.h);
// version 3 a GEMM's bias epilogue ("bias": a vector of C's dtype added to every row of C);
// version 4 its residual epilogue ("residual": a matrix of C's dtype added to C, with beta).
//
// Why a separate header: the rules must be identical at kernel creation and in the self-test
// entry points that CPU tests call through ctypes, and they mirror mlso_cli/runtime/plan.py.
// Nothing here touches ONNX Runtime or CUDA.
#pragma once

#include <cstdint>
#include <initializer_list>
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

// One matrix of a library GEMM, in elements of its dtype: element (e, r, c) of the logical
// matrix is at offset + e * stride + (trans ? c * ld + r : r * ld + c).
struct GemmOperand {
  BufRef buf;
  int64_t offset = 0;
  int64_t ld = 1;
  int64_t stride = 0;
  bool trans = false;
};

// C[e] = alpha * A[e] @ B[e] + beta * C[e], row-major, for e < batch; fp32 accumulation. With a
// residual epilogue, beta multiplies R[e] instead: C[e] = alpha * A[e] @ B[e] + beta * R[e].
struct Gemm {
  int64_t m = 1, n = 1, k = 1, batch = 1;
  GemmOperand a, b, c;
  int dtype_ab = 0;
  int dtype_c = 0;
  double alpha = 1.0, beta = 0.0;
  // Bias epilogue (version 3): n elements of dtype_c at bias_offset of bias_buf, added to every
  // row of every batch entry of C inside the call (cuBLASLt's CUBLASLT_EPILOGUE_BIAS).
  bool has_bias = false;
  BufRef bias_buf;
  int64_t bias_offset = 0;
  // Residual epilogue (version 4): an m x n matrix of dtype_c per batch entry, row-major (never
  // transposed), read as cuBLASLt's C while the plan's C is its D. Never with a bias.
  bool has_residual = false;
  GemmOperand residual;
};

struct Launch {
  bool is_gemm = false;  // a library GEMM (`gemm` holds it) rather than a kernel
  Gemm gemm;
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

  bool has_gemm() const {
    for (const auto& l : launches) {
      if (l.is_gemm) return true;
    }
    return false;
  }
};

// A node's declared tensor type: dtype 0 is unknown; has_shape false is an unknown rank; a
// dim of -1 is unknown. Compared with the plan by check_declared.
struct Declared {
  int dtype = 0;
  bool has_shape = false;
  std::vector<int64_t> dims;
};

// The limits of docs/runtime.md, "Plan validation" (the same constants as runtime/plan.py).
constexpr int64_t kGridMax[3] = {INT32_MAX, 65535, 65535};
constexpr int64_t kBlockMax[3] = {1024, 1024, 64};
constexpr uint64_t kBlockThreadsMax = 1024;
constexpr int64_t kSmemMax = 232448;
constexpr int64_t kDimMax = int64_t(1) << 40;
constexpr uint64_t kTensorBytesMax = uint64_t(1) << 40;
constexpr uint64_t kScratchTotalMax = uint64_t(16) << 30;
constexpr size_t kRankMax = 16;

namespace plan_detail {

// Records the first problem: its rule key (the "reason" of tests/data/plan_cases.json) and a
// message naming the field. Always returns false, so callers write `return fail(...)`.
struct Problem {
  std::string* msg;
  std::string* code;
  bool fail(const char* key, const std::string& what) const {
    *msg = what;
    if (code) *code = key;
    return false;
  }
};

inline bool get_int(const json::Value* v, int64_t lo, int64_t hi, int64_t* out) {
  if (!v || v->kind != json::Value::Number || !v->is_int) return false;
  if (v->i < lo || v->i > hi) return false;
  *out = v->i;
  return true;
}

inline bool known_keys(const json::Value& obj, std::initializer_list<const char*> allowed,
                       const std::string& where, const Problem& p) {
  for (const auto& f : obj.fields) {
    bool ok = false;
    for (const char* a : allowed) ok = ok || f.first == a;
    if (!ok) return p.fail("unknown_field", where + " has an unknown field '" + f.first + "'");
  }
  return true;
}

inline bool valid_target(const std::string& t) {  // ^(sm|compute)_[0-9]+[a-z]?$
  size_t i = 0;
  if (t.rfind("sm_", 0) == 0) {
    i = 3;
  } else if (t.rfind("compute_", 0) == 0) {
    i = 8;
  } else {
    return false;
  }
  size_t digits = 0;
  while (i < t.size() && t[i] >= '0' && t[i] <= '9') ++i, ++digits;
  if (digits == 0) return false;
  if (i < t.size() && t[i] >= 'a' && t[i] <= 'z') ++i;
  return i == t.size();
}

inline bool valid_kernel_name(const std::string& k) {  // ^[A-Za-z_][A-Za-z0-9_]{0,1023}$
  if (k.empty() || k.size() > 1024) return false;
  for (size_t i = 0; i < k.size(); ++i) {
    char c = k[i];
    bool alpha = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '_';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

// Validates dtype and shape of a tensor object; fills spec, including its byte size.
inline bool shape_bytes(const json::Value& t, const std::string& where, TensorSpec* spec,
                        const Problem& p) {
  const json::Value* dt = t.get("dtype");
  size_t itemsize = 0;
  if (!dt || dt->kind != json::Value::String || !dtype_from_name(dt->s, &spec->dtype, &itemsize)) {
    return p.fail("dtype", where + ".dtype must be one of float16, bfloat16, float32, float64, "
                                   "int8, uint8, int32, int64, bool");
  }
  spec->dtype_str = dt->s;
  const json::Value* shape = t.get("shape");
  if (!shape || shape->kind != json::Value::Array || shape->items.size() > kRankMax) {
    return p.fail("shape", where + ".shape must be a list of at most 16 integers");
  }
  bool has_zero = false;
  for (size_t k = 0; k < shape->items.size(); ++k) {
    int64_t d = 0;
    if (!get_int(&shape->items[k], 0, kDimMax, &d)) {
      return p.fail("shape", where + ".shape[" + std::to_string(k) +
                                 "] must be an integer in [0, 2^40]");
    }
    spec->shape.push_back(d);
    has_zero = has_zero || d == 0;
  }
  // Checked multiplication; an empty tensor is 0 bytes whatever its other dims (as in Python).
  uint64_t bytes = has_zero ? 0 : itemsize;
  bool overflow = false;
  for (size_t k = 0; !has_zero && k < spec->shape.size() && !overflow; ++k) {
    overflow = __builtin_mul_overflow(bytes, static_cast<uint64_t>(spec->shape[k]), &bytes);
  }
  if (overflow || bytes > kTensorBytesMax) {
    return p.fail("too_large", where + " is larger than 2^40 bytes");
  }
  spec->bytes = static_cast<size_t>(bytes);
  return true;
}

inline bool tensor_list(const json::Value& root, const char* key, std::vector<TensorSpec>* out,
                        const Problem& p) {
  const json::Value* list = root.get(key);
  if (!list || list->kind != json::Value::Array) {
    return p.fail("tensors", std::string("'") + key + "' must be a list");
  }
  for (size_t i = 0; i < list->items.size(); ++i) {
    const json::Value& t = list->items[i];
    std::string where = std::string(key) + "[" + std::to_string(i) + "]";
    if (t.kind != json::Value::Object) return p.fail("tensors", where + " must be an object");
    if (!known_keys(t, {"dtype", "shape"}, where, p)) return false;
    TensorSpec spec;
    if (!shape_bytes(t, where, &spec, p)) return false;
    out->push_back(std::move(spec));
  }
  return true;
}

inline bool buf_ref(const json::Value& v, const std::string& where, bool allow_input,
                    const Plan& plan, BufRef* out, const Problem& p) {
  if (v.kind != json::Value::Object) return p.fail("ref", where + " must be an object");
  if (!known_keys(v, {"kind", "index"}, where, p)) return false;
  const json::Value* kind = v.get("kind");
  std::string kinds = allow_input ? "input or output or scratch" : "output or scratch";
  if (!kind || kind->kind != json::Value::String) {
    return p.fail("ref", where + ".kind must be " + kinds);
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
    return p.fail("ref", where + ".kind must be " + kinds);
  }
  int64_t index = 0;
  if (!get_int(v.get("index"), 0, INT64_MAX, &index) || static_cast<uint64_t>(index) >= limit) {
    return p.fail("ref", where + ".index must be an integer in [0, " + std::to_string(limit) +
                             ") for kind " + kind->s);
  }
  out->index = static_cast<size_t>(index);
  return true;
}

inline bool dim3(const json::Value* v, const std::string& where, const int64_t* hi, unsigned* out,
                 const char* code, const Problem& p) {
  if (!v || v->kind != json::Value::Array || v->items.size() != 3) {
    return p.fail(code, where + " must be a list of 3 integers");
  }
  for (int k = 0; k < 3; ++k) {
    int64_t d = 0;
    if (!get_int(&v->items[k], 1, hi[k], &d)) {
      return p.fail(code, where + "[" + std::to_string(k) + "] must be an integer in [1, " +
                              std::to_string(static_cast<long long>(hi[k])) + "]");
    }
    out[k] = static_cast<unsigned>(d);
  }
  return true;
}

inline bool get_number(const json::Value* v, double* out) {
  if (!v || v->kind != json::Value::Number) return false;
  double x = v->is_int ? static_cast<double>(v->i) : v->d;
  if (!(x == x) || x > 1.7976931348623157e308 || x < -1.7976931348623157e308) return false;
  *out = x;
  return true;
}

// The dtype and byte size of the buffer a (checked) reference names.
inline void buffer_dtype_bytes(const BufRef& ref, const Plan& plan,
                               const std::vector<size_t>& scratch_dtype, int* dtype,
                               uint64_t* nbytes) {
  switch (ref.kind) {
    case BufKind::Input:
      *dtype = plan.inputs[ref.index].dtype;
      *nbytes = plan.inputs[ref.index].bytes;
      break;
    case BufKind::Output:
      *dtype = plan.outputs[ref.index].dtype;
      *nbytes = plan.outputs[ref.index].bytes;
      break;
    case BufKind::Scratch:
    default:
      *dtype = static_cast<int>(scratch_dtype[ref.index]);
      *nbytes = plan.scratch[ref.index];
      break;
  }
}

inline bool same_buf(const BufRef& x, const BufRef& y) {
  return x.kind == y.kind && x.index == y.index;
}

// Refuses (gemm_bounds) an operand whose elements reach `last` (one past its final element,
// counted from its buffer's start) when that lies past the buffer's `nbytes`. 128 bits: every
// factor of `last` is below 2^41.
inline bool within_buffer(unsigned __int128 last, size_t itemsize, uint64_t nbytes,
                          const std::string& w, const Problem& p) {
  if (last * (unsigned __int128)itemsize <= (unsigned __int128)nbytes) return true;
  unsigned __int128 idx = last - 1;
  std::string digits;
  do {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(idx % 10)));
    idx /= 10;
  } while (idx);
  return p.fail("gemm_bounds", w + " reaches element " + digits + " of a buffer of " +
                                   std::to_string(nbytes) + " bytes");
}

// The bias epilogue; the checks and their order are runtime/plan.py's _gemm_bias().
inline bool gemm_bias(const json::Value& bias, const std::string& w, const Plan& plan,
                      const std::vector<size_t>& scratch_dtype, size_t size_c, Gemm* g,
                      const Problem& p) {
  if (plan.version < 3) return p.fail("version", w + " is a bias epilogue, which needs 'version' 3");
  if (bias.kind != json::Value::Object) return p.fail("gemm", w + " must be an object");
  if (!known_keys(bias, {"buf", "offset"}, w, p)) return false;
  const json::Value* bbuf = bias.get("buf");
  if (!bbuf) return p.fail("ref", w + ".buf must be an object");
  if (!buf_ref(*bbuf, w + ".buf", true, plan, &g->bias_buf, p)) return false;
  if (!get_int(bias.get("offset"), 0, kDimMax, &g->bias_offset)) {
    return p.fail("gemm", w + ".offset must be an integer in [0, 2^40]");
  }
  int have = 0;
  uint64_t nbytes = 0;
  buffer_dtype_bytes(g->bias_buf, plan, scratch_dtype, &have, &nbytes);
  if (have != g->dtype_c) {
    return p.fail("gemm", w + ".buf is " + dtype_name(have) + ", the bias is read as C's " +
                              dtype_name(g->dtype_c));
  }
  // offset <= 2^40 and n < 2^31: the sum and the product fit in 64 bits.
  uint64_t last = uint64_t(g->bias_offset) + uint64_t(g->n);
  if (last * uint64_t(size_c) > nbytes) {
    return p.fail("gemm_bounds", w + " reaches element " + std::to_string(last - 1) +
                                     " of a buffer of " + std::to_string(nbytes) + " bytes");
  }
  if (same_buf(g->bias_buf, g->c.buf)) return p.fail("gemm", w + " is the buffer of C");
  g->has_bias = true;
  return true;
}

// The residual epilogue; the checks and their order are runtime/plan.py's _gemm_residual().
inline bool gemm_residual(const json::Value& r, bool with_bias, const std::string& w,
                          const Plan& plan, const std::vector<size_t>& scratch_dtype,
                          size_t size_c, Gemm* g, const Problem& p) {
  if (plan.version < 4) {
    return p.fail("version", w + " is a residual epilogue, which needs 'version' 4");
  }
  if (with_bias) return p.fail("gemm", w + " comes with a bias: a GEMM has at most one epilogue");
  if (r.kind != json::Value::Object) return p.fail("gemm", w + " must be an object");
  if (!known_keys(r, {"buf", "offset", "ld", "stride"}, w, p)) return false;
  GemmOperand& op = g->residual;
  const json::Value* buf = r.get("buf");
  if (!buf) return p.fail("ref", w + ".buf must be an object");
  if (!buf_ref(*buf, w + ".buf", true, plan, &op.buf, p)) return false;
  const char* keys[3] = {"offset", "ld", "stride"};
  int64_t* vals[3] = {&op.offset, &op.ld, &op.stride};
  for (int i = 0; i < 3; ++i) {
    int64_t lo = i == 1 ? 1 : 0;
    if (!get_int(r.get(keys[i]), lo, kDimMax, vals[i])) {
      return p.fail("gemm", w + "." + keys[i] + " must be an integer in [" + std::to_string(lo) +
                                ", 2^40]");
    }
  }
  op.trans = false;
  int have = 0;
  uint64_t nbytes = 0;
  buffer_dtype_bytes(op.buf, plan, scratch_dtype, &have, &nbytes);
  if (have != g->dtype_c) {
    return p.fail("gemm", w + ".buf is " + dtype_name(have) + ", the residual is read as C's " +
                              dtype_name(g->dtype_c));
  }
  if (op.ld < g->n) {
    return p.fail("gemm", w + ".ld is " + std::to_string(op.ld) + ", less than its columns (" +
                              std::to_string(g->n) + ")");
  }
  // Every factor is below 2^41, so the products fit in 128 bits.
  using u128 = unsigned __int128;
  u128 last = u128(op.offset) + u128(g->batch - 1) * u128(op.stride) +
              u128(g->m - 1) * u128(op.ld) + u128(g->n);
  if (!within_buffer(last, size_c, nbytes, w, p)) return false;
  if (same_buf(op.buf, g->c.buf)) {
    return p.fail("gemm", w + " is the buffer of C, which the GEMM writes while it reads the "
                              "residual");
  }
  g->has_residual = true;
  return true;
}

// A library GEMM launch; the checks and their order are runtime/plan.py's _gemm().
inline bool gemm(const json::Value& l, const std::string& where, const Plan& plan,
                 const std::vector<size_t>& scratch_dtype, Gemm* g, const Problem& p) {
  if (plan.version < 2) {
    return p.fail("version", where + " is a library GEMM, which needs 'version' 2");
  }
  if (!known_keys(l, {"kind", "m", "n", "k", "batch", "a", "b", "c", "dtype_ab", "dtype_c",
                      "alpha", "beta", "bias", "residual"},
                  where, p)) {
    return false;
  }
  const char* names[4] = {"m", "n", "k", "batch"};
  int64_t* dims[4] = {&g->m, &g->n, &g->k, &g->batch};
  for (int i = 0; i < 4; ++i) {
    if (!get_int(l.get(names[i]), 1, INT32_MAX, dims[i])) {
      return p.fail("gemm", where + "." + names[i] + " must be an integer in [1, 2^31-1]");
    }
  }
  const json::Value* dab = l.get("dtype_ab");
  size_t size_ab = 0, size_c = 0;
  bool ab_ok = dab && dab->kind == json::Value::String &&
               (dab->s == "float16" || dab->s == "bfloat16" || dab->s == "float32");
  if (!ab_ok || !dtype_from_name(dab->s, &g->dtype_ab, &size_ab)) {
    return p.fail("gemm", where + ".dtype_ab must be one of float16, bfloat16, float32");
  }
  const json::Value* dc = l.get("dtype_c");
  bool c_ok = dc && dc->kind == json::Value::String && (dc->s == dab->s || dc->s == "float32");
  if (!c_ok || !dtype_from_name(dc->s, &g->dtype_c, &size_c)) {
    return p.fail("gemm", where + ".dtype_c must be " + dab->s + " or float32");
  }
  if (!get_number(l.get("alpha"), &g->alpha)) {
    return p.fail("gemm", where + ".alpha must be a finite number");
  }
  if (!get_number(l.get("beta"), &g->beta)) {
    return p.fail("gemm", where + ".beta must be a finite number");
  }
  struct Role {
    const char* name;
    int64_t rows, cols;
    int dtype;
    size_t itemsize;
    GemmOperand* op;
  };
  Role roles[3] = {{"a", g->m, g->k, g->dtype_ab, size_ab, &g->a},
                   {"b", g->k, g->n, g->dtype_ab, size_ab, &g->b},
                   {"c", g->m, g->n, g->dtype_c, size_c, &g->c}};
  for (const Role& r : roles) {
    std::string w = where + "." + r.name;
    const json::Value* op = l.get(r.name);
    if (!op || op->kind != json::Value::Object) return p.fail("gemm", w + " must be an object");
    if (!known_keys(*op, {"buf", "offset", "ld", "stride", "trans"}, w, p)) return false;
    const json::Value* buf = op->get("buf");
    bool is_c = std::string(r.name) == "c";
    if (!buf) return p.fail("ref", w + ".buf must be an object");
    if (!buf_ref(*buf, w + ".buf", !is_c, plan, &r.op->buf, p)) return false;
    const char* keys[3] = {"offset", "ld", "stride"};
    int64_t* vals[3] = {&r.op->offset, &r.op->ld, &r.op->stride};
    for (int i = 0; i < 3; ++i) {
      int64_t lo = i == 1 ? 1 : 0;
      if (!get_int(op->get(keys[i]), lo, kDimMax, vals[i])) {
        return p.fail("gemm", w + "." + keys[i] + " must be an integer in [" +
                                  std::to_string(lo) + ", 2^40]");
      }
    }
    const json::Value* trans = op->get("trans");
    if (!trans || trans->kind != json::Value::Bool || (is_c && trans->b)) {
      return p.fail("gemm", w + ".trans must be " + (is_c ? "false" : "true or false"));
    }
    r.op->trans = trans->b;
    int have = 0;
    uint64_t nbytes = 0;
    std::string have_name;
    switch (r.op->buf.kind) {
      case BufKind::Input:
        have = plan.inputs[r.op->buf.index].dtype;
        nbytes = plan.inputs[r.op->buf.index].bytes;
        break;
      case BufKind::Output:
        have = plan.outputs[r.op->buf.index].dtype;
        nbytes = plan.outputs[r.op->buf.index].bytes;
        break;
      case BufKind::Scratch:
      default:
        have = static_cast<int>(scratch_dtype[r.op->buf.index]);
        nbytes = plan.scratch[r.op->buf.index];
        break;
    }
    if (have != r.dtype) {
      return p.fail("gemm", w + ".buf is " + dtype_name(have) + ", the GEMM reads it as " +
                                dtype_name(r.dtype));
    }
    int64_t need = r.op->trans ? r.rows : r.cols;
    if (r.op->ld < need) {
      return p.fail("gemm", w + ".ld is " + std::to_string(r.op->ld) + ", less than its " +
                                (r.op->trans ? "rows" : "columns") + " (" +
                                std::to_string(need) + ")");
    }
    // Every factor is below 2^41, so the products fit in 128 bits.
    using u128 = unsigned __int128;
    u128 span = r.op->trans ? u128(r.cols - 1) * u128(r.op->ld) + u128(r.rows)
                            : u128(r.rows - 1) * u128(r.op->ld) + u128(r.cols);
    // C's batch entries are disjoint when packed one after another, or side by side within
    // each row (heads handed on as [s, heads * d]: ld spans them all).
    bool side = !r.op->trans && r.op->stride >= r.cols &&
                u128(g->batch - 1) * u128(r.op->stride) + u128(r.cols) <= u128(r.op->ld);
    if (is_c && g->batch > 1 && u128(r.op->stride) < span && !side) {
      return p.fail("gemm", w + ".stride is " + std::to_string(r.op->stride) +
                                ": batch entries of C overlap");
    }
    u128 last = u128(r.op->offset) + u128(g->batch - 1) * u128(r.op->stride) + span;
    if (!within_buffer(last, r.itemsize, nbytes, w, p)) return false;
  }
  if (same_buf(g->c.buf, g->a.buf) || same_buf(g->c.buf, g->b.buf)) {
    return p.fail("gemm", where + ".c is the buffer of an operand");
  }
  const json::Value* bias = l.get("bias");
  if (bias && !gemm_bias(*bias, where + ".bias", plan, scratch_dtype, size_c, g, p)) return false;
  const json::Value* residual = l.get("residual");
  if (!residual) return true;
  return gemm_residual(*residual, bias != nullptr, where + ".residual", plan, scratch_dtype,
                       size_c, g, p);
}


inline std::string declared_str(const Declared& d) {
  std::string s = d.dtype ? dtype_name(d.dtype) : std::string("?");
  if (!d.has_shape) return s + " [?]";
  s += " [";
  for (size_t i = 0; i < d.dims.size(); ++i) {
    if (i) s += ",";
    s += d.dims[i] < 0 ? std::string("?") : std::to_string(static_cast<long long>(d.dims[i]));
  }
  return s + "]";
}

inline bool declared_list(const std::vector<TensorSpec>& specs, const std::vector<Declared>& decl,
                          const char* key, const Problem& p) {
  if (decl.size() != specs.size()) {
    return p.fail("count", "lists " + std::to_string(specs.size()) + " " + key +
                               " but the node declares " + std::to_string(decl.size()));
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& s = specs[i];
    const Declared& d = decl[i];
    bool same = d.dtype == 0 || d.dtype == s.dtype;
    if (d.has_shape) {
      same = same && d.dims.size() == s.shape.size();
      for (size_t k = 0; same && k < d.dims.size(); ++k) {
        same = d.dims[k] < 0 || d.dims[k] == s.shape[k];
      }
    }
    if (!same) {
      return p.fail("declared", std::string(key) + "[" + std::to_string(i) + "] is " +
                                    s.dtype_str + " " + shape_str(s.shape.data(), s.shape.size()) +
                                    " in the plan, but the node declares " + declared_str(d));
    }
  }
  return true;
}

}  // namespace plan_detail

// Parses and validates a plan. n_inputs / n_outputs are the node's variadic tensor counts
// (negative: not checked). On failure returns false with a message naming the field in `err`
// and the rule's key in `code` (when given). The checks run in the order of
// runtime/plan.py::validate_plan, so both sides report the same rule first.
inline bool parse_plan(const std::string& text, long n_inputs, long n_outputs, Plan* plan,
                       std::string* err, std::string* code = nullptr) {
  using plan_detail::get_int;
  const plan_detail::Problem p{err, code};
  json::Value root;
  std::string jerr;
  if (!json::parse(text, &root, &jerr)) return p.fail("json", "is not valid JSON (" + jerr + ")");
  if (root.kind != json::Value::Object) return p.fail("not_object", "must be a JSON object");
  if (!plan_detail::known_keys(root, {"version", "targets", "smem_max", "inputs", "outputs",
                                      "scratch", "zero", "launches"},
                               "the plan", p)) {
    return false;
  }
  int64_t version = 0;
  if (!get_int(root.get("version"), 1, 4, &version)) {
    return p.fail("version", "'version' must be 1, 2, 3 or 4");
  }
  plan->version = static_cast<int>(version);
  const json::Value* targets = root.get("targets");
  const char* targets_msg = "'targets' must be a non-empty list of strings such as \"sm_90a\"";
  if (!targets || targets->kind != json::Value::Array || targets->items.empty()) {
    return p.fail("targets", targets_msg);
  }
  for (const auto& t : targets->items) {
    if (t.kind != json::Value::String || !plan_detail::valid_target(t.s)) {
      return p.fail("targets", targets_msg);
    }
    plan->targets.push_back(t.s);
  }
  if (!get_int(root.get("smem_max"), 0, kSmemMax, &plan->smem_max)) {
    return p.fail("smem", "'smem_max' must be an integer in [0, " + std::to_string(kSmemMax) + "]");
  }
  if (!plan_detail::tensor_list(root, "inputs", &plan->inputs, p)) return false;
  if (!plan_detail::tensor_list(root, "outputs", &plan->outputs, p)) return false;
  if (plan->inputs.empty() || plan->outputs.empty()) {
    return p.fail("empty", "'inputs' and 'outputs' must each list at least one tensor");
  }
  if (n_inputs >= 0 && plan->inputs.size() != static_cast<size_t>(n_inputs)) {
    return p.fail("count", "lists " + std::to_string(plan->inputs.size()) +
                               " inputs but the node has " + std::to_string(n_inputs) +
                               " tensor inputs");
  }
  if (n_outputs >= 0 && plan->outputs.size() != static_cast<size_t>(n_outputs)) {
    return p.fail("count", "lists " + std::to_string(plan->outputs.size()) +
                               " outputs but the node has " + std::to_string(n_outputs) +
                               " outputs");
  }
  const json::Value* scratch = root.get("scratch");
  if (!scratch || scratch->kind != json::Value::Array) {
    return p.fail("scratch", "'scratch' must be a list");
  }
  uint64_t total = 0;
  std::vector<size_t> scratch_dtype;  // kFloat32 unless the entry names its dtype
  for (size_t i = 0; i < scratch->items.size(); ++i) {
    const json::Value& s = scratch->items[i];
    std::string where = "scratch[" + std::to_string(i) + "]";
    if (s.kind != json::Value::Object) return p.fail("scratch", where + " must be an object");
    if (!plan_detail::known_keys(s, {"bytes", "dtype", "shape"}, where, p)) return false;
    int64_t bytes = 0;
    if (!get_int(s.get("bytes"), 0, static_cast<int64_t>(kTensorBytesMax), &bytes)) {
      return p.fail("scratch", where + ".bytes must be an integer in [0, 2^40]");
    }
    scratch_dtype.push_back(kFloat32);
    if (s.get("dtype") || s.get("shape")) {
      TensorSpec spec;
      if (!plan_detail::shape_bytes(s, where, &spec, p)) return false;
      scratch_dtype.back() = static_cast<size_t>(spec.dtype);
      uint64_t need = spec.bytes < 4 ? 4 : spec.bytes;
      if (static_cast<uint64_t>(bytes) != need) {
        return p.fail("scratch", where + ".bytes is " + std::to_string(bytes) +
                                     ", but its dtype and shape need " + std::to_string(need));
      }
    }
    total += static_cast<uint64_t>(bytes);  // each <= 2^40, at most 2^24 of them before the check
    if (total > kScratchTotalMax) {
      return p.fail("scratch_total", "scratch buffers total more than 16 GiB");
    }
    plan->scratch.push_back(static_cast<size_t>(bytes));
  }
  const json::Value* zero = root.get("zero");
  if (!zero || zero->kind != json::Value::Array) return p.fail("ref", "'zero' must be a list");
  for (size_t i = 0; i < zero->items.size(); ++i) {
    BufRef ref;
    if (!plan_detail::buf_ref(zero->items[i], "zero[" + std::to_string(i) + "]", false, *plan,
                              &ref, p)) {
      return false;
    }
    plan->zero.push_back(ref);
  }
  const json::Value* launches = root.get("launches");
  if (!launches || launches->kind != json::Value::Array || launches->items.empty()) {
    return p.fail("launches", "'launches' must be a non-empty list");
  }
  for (size_t i = 0; i < launches->items.size(); ++i) {
    const json::Value& l = launches->items[i];
    std::string where = "launches[" + std::to_string(i) + "]";
    if (l.kind != json::Value::Object) return p.fail("launches", where + " must be an object");
    const json::Value* kind = l.get("kind");
    bool is_gemm = kind && kind->kind == json::Value::String && kind->s == "gemm";
    if (kind && !is_gemm && !(kind->kind == json::Value::String && kind->s == "kernel")) {
      return p.fail("launch_kind", where + ".kind must be \"kernel\" or \"gemm\"");
    }
    Launch launch;
    if (is_gemm) {
      launch.is_gemm = true;
      if (!plan_detail::gemm(l, where, *plan, scratch_dtype, &launch.gemm, p)) return false;
      plan->launches.push_back(std::move(launch));
      continue;
    }
    if (!plan_detail::known_keys(l, {"kind", "kernel", "grid", "block", "smem", "args"}, where,
                                 p)) {
      return false;
    }
    const json::Value* kernel = l.get("kernel");
    if (!kernel || kernel->kind != json::Value::String ||
        !plan_detail::valid_kernel_name(kernel->s)) {
      return p.fail("kernel", where + ".kernel must be a kernel name (a C identifier of 1 to "
                                      "1024 characters)");
    }
    launch.kernel = kernel->s;
    if (!plan_detail::dim3(l.get("grid"), where + ".grid", kGridMax, launch.grid, "grid", p)) {
      return false;
    }
    if (!plan_detail::dim3(l.get("block"), where + ".block", kBlockMax, launch.block, "block",
                           p)) {
      return false;
    }
    if (uint64_t(launch.block[0]) * launch.block[1] * launch.block[2] > kBlockThreadsMax) {
      return p.fail("block", where + ".block has more than 1024 threads");
    }
    int64_t smem = 0;
    if (!get_int(l.get("smem"), 0, kSmemMax, &smem)) {
      return p.fail("smem", where + ".smem must be an integer in [0, " + std::to_string(kSmemMax) +
                                "]");
    }
    launch.smem = static_cast<unsigned>(smem);
    const json::Value* args = l.get("args");
    if (!args || args->kind != json::Value::Array) return p.fail("ref", where + ".args must be a list");
    for (size_t k = 0; k < args->items.size(); ++k) {
      BufRef ref;
      if (!plan_detail::buf_ref(args->items[k], where + ".args[" + std::to_string(k) + "]", true,
                                *plan, &ref, p)) {
        return false;
      }
      launch.args.push_back(ref);
    }
    plan->launches.push_back(std::move(launch));
  }
  return true;
}

// Compares a parsed plan's inputs and outputs with the node's declared types (what the ONNX
// graph says the node consumes and produces). A mismatch would make ORT hand the op buffers
// of another size or type than the kernels write.
inline bool check_declared(const Plan& plan, const std::vector<Declared>& inputs,
                           const std::vector<Declared>& outputs, std::string* err,
                           std::string* code = nullptr) {
  const plan_detail::Problem p{err, code};
  return plan_detail::declared_list(plan.inputs, inputs, "inputs", p) &&
         plan_detail::declared_list(plan.outputs, outputs, "outputs", p);
}

// Checks every launch's kernel against `has_kernel(name)` (the driver's lookup in the op, a
// list in the tests). Runs after check_declared, as in Python.
template <class HasKernel>
inline bool check_kernels(const Plan& plan, HasKernel has_kernel, std::string* err,
                          std::string* code = nullptr) {
  const plan_detail::Problem p{err, code};
  for (size_t i = 0; i < plan.launches.size(); ++i) {
    if (plan.launches[i].is_gemm) continue;  // a library call: nothing to find in the binary
    if (!has_kernel(plan.launches[i].kernel)) {
      return p.fail("kernel_missing", "launches[" + std::to_string(i) + "].kernel '" +
                                          plan.launches[i].kernel +
                                          "' is not in the kernel binary");
    }
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
