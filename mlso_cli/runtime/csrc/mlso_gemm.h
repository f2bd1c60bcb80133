// Library GEMM launches (plan version 2) with cuBLASLt, opened with dlopen like libcuda is.
//
// Why dlopen: the op must load where there is no GPU and must not pin a CUDA toolkit version.
// ONNX Runtime's CUDA EP has already loaded libcublasLt.so.13 into the process, so RTLD_NOLOAD
// finds that very copy; only when it is absent (the PyCUDA launcher) is it loaded anew.
//
// Why everything is made at creation: ORT captures Compute into a CUDA graph, and a capture
// must not allocate, synchronise or select algorithms. So `Runner::init` (called when ORT
// creates the kernel, or by mlso_gemm_create) makes the handle, one matmul descriptor and three
// layouts per GEMM (four with a residual), picks each GEMM's algorithm
// (cublasLtMatmulAlgoGetHeuristic, the best of the list), and allocates ONE workspace
// (kWorkspaceBytes) with the driver API. `Runner::run` only calls cublasLtMatmul on the caller's
// stream. One workspace per node: two concurrent runs of one node on two streams would share it
// (ORT runs a node's Compute one at a time per session).
//
// Row-major to cuBLASLt's column-major: C = A @ B row-major is C^T = B^T @ A^T column-major, so
// the plan's B is cuBLASLt's A and the plan's A is its B; a plan operand stored transposed is
// cuBLASLt's OP_T. Compute is CUBLAS_COMPUTE_32F (fp32 accumulation; no TF32 for fp32 GEMMs,
// as ONNX Runtime's fp32 MatMul).
//
// A bias epilogue (plan version 3) is CUBLASLT_EPILOGUE_BIAS: the bias vector is added to the
// fp32 result before it is rounded to D's type. cuBLASLt's bias has D's rows, which are the
// plan's columns (n), since its D is the plan's C transposed: one bias element per column of
// C, the same for every row and (BIAS_BATCH_STRIDE left 0) every batch entry. Its type is D's
// (cublasLt.h, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: "the same type as the elements of output
// matrix (Dtype)" outside IMMA and fp8 kernels), which the plan validators require, so
// BIAS_DATA_TYPE keeps its default. The bias pointer lives in the descriptor: creation sets one
// with the real pointer's alignment (the heuristic reads its value for that), and each run sets
// the real one before cublasLtMatmul, a host-side attribute write that a graph capture allows.
//
// A residual epilogue (plan version 4) is cuBLASLt's own C with beta = 1: D = alpha * A @ B +
// beta * C, C being the residual R (its own layout: R's ld and batch stride, D's type, since the
// plan requires C's dtype) and D the plan's C. cublasLt.h: "Accumulator and value from matrix C
// are typically converted to scale type before final scaling. Value is then converted from scale
// type to type of matrix D", so R meets the fp32 product and the sum is rounded once. TRANSC
// supports only CUBLAS_OP_N, so R is never transposed (the validators have no such field). C is
// never D here (the validators refuse R in C's buffer): every candidate algorithm must support
// out-of-place results (CUBLASLT_ALGO_CAP_OUT_OF_PLACE_RESULT_SUPPORT), which creation checks
// when the library has cublasLtMatmulAlgoCapGetAttribute. What is fixed at creation: R's layout,
// beta, and its alignment (MIN_ALIGNMENT_C_BYTES from R's offset and batch stride over a
// 256-byte aligned buffer, as for the bias stand-in); R's pointer is cublasLtMatmul's C
// argument, passed per run. No bias with it: cublasLt.h does not say whether the bias epilogue
// combines with beta != 0, nor in which order the two meet the product.
//
// The algorithm: cublasLtMatmulAlgoGetHeuristic lists up to 8, best first by its model, and the
// first is used. With MLSO_GEMM_ALGO=timed, creation instead times each listed algorithm on
// scratch operands of the GEMM's own shape, layout and alignment (a private stream, 2 warm-up
// and 10 timed calls each, best of 3 rounds) and keeps the fastest, cached per process and
// context, keyed by everything the heuristic was given, so each shape is timed once. Why it is
// not the default: measured on an H100 (benchmarks/RESULTS.md, library GEMMs), the timed choice
// ran within 1 us of the heuristic's in CUDA-graph replay on all 8 real-width shapes, although
// it was up to 17% faster in its own back-to-back timing (a warm L2, which a model's layers do
// not give); and it makes the choice, hence the summation order, depend on timing noise.
//
// Built without the cuBLASLt headers (MLSO_HAVE_CUBLASLT undefined), init fails with a message
// saying how to get them; everything else of the library works.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "mlso_cuda_driver.h"
#include "mlso_plan.h"

#ifdef MLSO_HAVE_CUBLASLT
#include <cublasLt.h>
#endif

namespace mlso {
namespace blas {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;
constexpr const char* kLibrary = "libcublasLt.so.13";
constexpr int kHeuristicResults = 8;

#ifdef MLSO_HAVE_CUBLASLT

struct Lt {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtDestroy) destroy = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) layout_destroy = nullptr;
  decltype(&cublasLtMatrixLayoutSetAttribute) layout_set = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) pref_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  // Optional (null when absent): only used to check out-of-place support for residual GEMMs.
  decltype(&cublasLtMatmulAlgoCapGetAttribute) cap_get = nullptr;
};

// Resolves cuBLASLt once per process. nullptr and *error when it cannot.
inline const Lt* lt(std::string* error) {
  static std::once_flag once;
  static Lt fns;
  static std::string load_error;
  static bool ok = false;
  std::call_once(once, [] {
    void* lib = dlopen(kLibrary, RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen(kLibrary, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      load_error = std::string("cannot open ") + kLibrary + " (" + (e ? e : "unknown error") +
                   "); the library GEMMs of this node need cuBLAS 13. Fix: install it (pip "
                   "install nvidia-cublas, or the CUDA 13 toolkit) and put it on the loader "
                   "path, or re-run `mlso optimize` with MLSO_LIBRARY_GEMM=0";
      return;
    }
    std::string missing;
    auto bind = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn) missing += std::string(missing.empty() ? "" : ", ") + name;
    };
    bind(fns.create, "cublasLtCreate");
    bind(fns.destroy, "cublasLtDestroy");
    bind(fns.desc_create, "cublasLtMatmulDescCreate");
    bind(fns.desc_destroy, "cublasLtMatmulDescDestroy");
    bind(fns.desc_set, "cublasLtMatmulDescSetAttribute");
    bind(fns.layout_create, "cublasLtMatrixLayoutCreate");
    bind(fns.layout_destroy, "cublasLtMatrixLayoutDestroy");
    bind(fns.layout_set, "cublasLtMatrixLayoutSetAttribute");
    bind(fns.pref_create, "cublasLtMatmulPreferenceCreate");
    bind(fns.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    bind(fns.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    bind(fns.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    bind(fns.matmul, "cublasLtMatmul");
    fns.cap_get = reinterpret_cast<decltype(fns.cap_get)>(
        dlsym(lib, "cublasLtMatmulAlgoCapGetAttribute"));
    if (!missing.empty()) {
      load_error = std::string(kLibrary) + " lacks " + missing;
      return;
    }
    ok = true;  // the handle stays open for the life of the process
  });
  if (!ok) {
    if (error) *error = load_error;
    return nullptr;
  }
  return &fns;
}

inline cudaDataType_t cuda_type(int dtype) {
  switch (dtype) {
    case kFloat16: return CUDA_R_16F;
    case kBfloat16: return CUDA_R_16BF;
    default: return CUDA_R_32F;
  }
}

inline size_t itemsize(int dtype) { return dtype == kFloat32 ? 4 : 2; }

// The largest power of two up to 256 dividing every value: the alignment cuBLASLt may assume
// for an operand's pointers (buffers themselves are 256-byte aligned by ORT and PyCUDA).
inline uint32_t alignment(std::initializer_list<uint64_t> bytes) {
  uint32_t a = 256;
  for (uint64_t b : bytes) {
    while (a > 1 && b % a != 0) a /= 2;
  }
  return a;
}

struct Op {
  const Gemm* g = nullptr;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;  // cuBLASLt's A, B, D
  cublasLtMatrixLayout_t lr = nullptr;  // cuBLASLt's C: the residual's, else lc (C = D)
  cublasLtMatmulAlgo_t algo{};
  float alpha = 1.0f, beta = 0.0f;
  std::string how;  // how the algorithm was chosen (mlso_gemm_describe)
};

// Whether creation times the heuristic's candidates (MLSO_GEMM_ALGO=timed) or keeps its first
// (unset, or any other value).
inline bool timed_choice() {
  const char* v = std::getenv("MLSO_GEMM_ALGO");
  return v && std::strcmp(v, "timed") == 0;
}

// Chosen algorithms, per process: key (shape, layouts, alignments, epilogue, context) -> algo.
struct ChoiceCache {
  std::mutex lock;
  std::map<std::string, std::pair<cublasLtMatmulAlgo_t, std::string>> chosen;
};

inline ChoiceCache& choices() {
  static ChoiceCache cache;
  return cache;
}

// Elements an operand's layout reaches: offset + (batch-1)*stride + the last row's end.
inline int64_t extent(const GemmOperand& o, int64_t rows, int64_t cols, int64_t batch) {
  int64_t span = o.trans ? (cols - 1) * o.ld + rows : (rows - 1) * o.ld + cols;
  return o.offset + (batch - 1) * o.stride + span;
}

class Runner {
 public:
  Runner() = default;
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  // Everything for the plan's GEMM launches, in the current CUDA context. On failure returns
  // false with one sentence in *err (what failed and why; the caller adds the fix).
  bool init(const Plan& plan, const cu::Driver* drv, std::string* err) {
    drv_ = drv;
    fns_ = lt(err);
    if (!fns_) return false;
    if (!drv->cuMemAlloc || !drv->cuMemFree) {
      *err = "libcuda.so.1 lacks cuMemAlloc_v2 / cuMemFree_v2";
      return false;
    }
    if (!check(fns_->create(&handle_), "cublasLtCreate", err)) return false;
    cu::CUresult r = drv->cuMemAlloc(&workspace_, kWorkspaceBytes);
    if (r != cu::CUDA_SUCCESS) {
      workspace_ = 0;
      *err = "cannot allocate the " + std::to_string(kWorkspaceBytes >> 20) +
             " MiB cuBLASLt workspace: " + drv->describe(r);
      return false;
    }
    ops_.resize(plan.launches.size());
    for (size_t i = 0; i < plan.launches.size(); ++i) {
      if (!plan.launches[i].is_gemm) continue;
      if (!make(plan.launches[i].gemm, &ops_[i], "launches[" + std::to_string(i) + "]", err)) {
        return false;
      }
    }
    return true;
  }

  // Enqueues launch `index` on `stream`; a, b, c (and bias, residual for those epilogues; else
  // ignored) are the base pointers of the plan buffers its operands name (offsets are applied
  // here). Nothing is allocated or synchronised.
  bool run(size_t index, void* a, void* b, void* c, void* bias, void* residual,
           cu::CUstream stream, std::string* err) const {
    if (index >= ops_.size() || !ops_[index].g) {
      *err = "launch " + std::to_string(index) + " is not a library GEMM";
      return false;
    }
    const Op& op = ops_[index];
    const Gemm& g = *op.g;
    size_t sab = itemsize(g.dtype_ab), sc = itemsize(g.dtype_c);
    const char* pa = static_cast<const char*>(a) + g.a.offset * sab;
    const char* pb = static_cast<const char*>(b) + g.b.offset * sab;
    char* pc = static_cast<char*>(c) + g.c.offset * sc;
    // cuBLASLt's C: the residual (read with beta), else D itself (beta 0: not read).
    const char* pr = g.has_residual ? static_cast<const char*>(residual) + g.residual.offset * sc
                                    : pc;
    if (g.has_bias) {
      const void* pbias = static_cast<const char*>(bias) + g.bias_offset * sc;
      if (!check(fns_->desc_set(op.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &pbias,
                                sizeof(pbias)),
                 "cublasLtMatmulDescSetAttribute(BIAS_POINTER)", err)) {
        return false;
      }
    }
    // cuBLASLt's A is the plan's B, its B the plan's A (see the top of this file).
    cublasStatus_t s = fns_->matmul(
        handle_, op.desc, &op.alpha, pb, op.la, pa, op.lb, &op.beta, pr, op.lr, pc, op.lc,
        &op.algo, reinterpret_cast<void*>(static_cast<uintptr_t>(workspace_)), kWorkspaceBytes,
        reinterpret_cast<cudaStream_t>(stream));
    return check(s, "cublasLtMatmul", err);
  }

  // How launch `index`'s algorithm was chosen ("" for a kernel launch).
  std::string describe(size_t index) const {
    return index < ops_.size() ? ops_[index].how : std::string();
  }

  ~Runner() {
    if (fns_) {
      for (Op& op : ops_) {
        if (op.la) fns_->layout_destroy(op.la);
        if (op.lb) fns_->layout_destroy(op.lb);
        if (op.lc) fns_->layout_destroy(op.lc);
        if (op.lr && op.lr != op.lc) fns_->layout_destroy(op.lr);
        if (op.desc) fns_->desc_destroy(op.desc);
      }
      if (handle_) fns_->destroy(handle_);
    }
    if (workspace_ && drv_) drv_->cuMemFree(workspace_);
  }

 private:
  static bool check(cublasStatus_t s, const char* what, std::string* err) {
    if (s == CUBLAS_STATUS_SUCCESS) return true;
    *err = std::string(what) + " failed (cublasStatus_t " + std::to_string(static_cast<int>(s)) +
           ")";
    return false;
  }

  bool layout(cublasLtMatrixLayout_t* out, int dtype, int64_t rows, int64_t cols, int64_t ld,
              int64_t batch, int64_t stride, std::string* err) {
    if (!check(fns_->layout_create(out, cuda_type(dtype), static_cast<uint64_t>(rows),
                                   static_cast<uint64_t>(cols), ld),
               "cublasLtMatrixLayoutCreate", err)) {
      return false;
    }
    int32_t count = static_cast<int32_t>(batch);
    return check(fns_->layout_set(*out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
                 "cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)", err) &&
           check(fns_->layout_set(*out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                  sizeof(stride)),
                 "cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)", err);
  }

  bool make(const Gemm& g, Op* op, const std::string& where, std::string* err) {
    op->g = &g;
    op->alpha = static_cast<float>(g.alpha);
    op->beta = static_cast<float>(g.beta);
    if (!check(fns_->desc_create(&op->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
               "cublasLtMatmulDescCreate", err)) {
      return false;
    }
    // cuBLASLt's A (n x k) is the plan's B: stored as k x n row-major = n x k column-major (N),
    // or transposed = k x n column-major (T).
    cublasOperation_t ta = g.b.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t tb = g.a.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (!check(fns_->desc_set(op->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
               "cublasLtMatmulDescSetAttribute(TRANSA)", err) ||
        !check(fns_->desc_set(op->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
               "cublasLtMatmulDescSetAttribute(TRANSB)", err)) {
      return false;
    }
    if (g.has_bias) {
      // Until the first run: a stand-in with the alignment the real pointer will have (a
      // 256-byte aligned buffer plus the offset), which the heuristic below depends on.
      uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      const void* stand_in = reinterpret_cast<const void*>(
          static_cast<uintptr_t>(256 + uint64_t(g.bias_offset) * itemsize(g.dtype_c)));
      if (!check(fns_->desc_set(op->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue,
                                sizeof(epilogue)),
                 "cublasLtMatmulDescSetAttribute(EPILOGUE)", err) ||
          !check(fns_->desc_set(op->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &stand_in,
                                sizeof(stand_in)),
                 "cublasLtMatmulDescSetAttribute(BIAS_POINTER)", err)) {
        return false;
      }
    }
    if (!layout(&op->la, g.dtype_ab, g.b.trans ? g.k : g.n, g.b.trans ? g.n : g.k, g.b.ld,
                g.batch, g.b.stride, err) ||
        !layout(&op->lb, g.dtype_ab, g.a.trans ? g.m : g.k, g.a.trans ? g.k : g.m, g.a.ld,
                g.batch, g.a.stride, err) ||
        !layout(&op->lc, g.dtype_c, g.n, g.m, g.c.ld, g.batch, g.c.stride, err)) {
      return false;
    }
    op->lr = op->lc;
    if (g.has_residual) {
      op->lr = nullptr;  // a layout of its own: R's ld and batch stride, in D's type
      if (!layout(&op->lr, g.dtype_c, g.n, g.m, g.residual.ld, g.batch, g.residual.stride,
                  err)) {
        return false;
      }
    }
    cublasLtMatmulPreference_t pref = nullptr;
    if (!check(fns_->pref_create(&pref), "cublasLtMatmulPreferenceCreate", err)) return false;
    uint64_t ws = kWorkspaceBytes;
    size_t sab = itemsize(g.dtype_ab), sc = itemsize(g.dtype_c);
    auto span = [&](const GemmOperand& o, size_t size) {
      return alignment({uint64_t(o.offset) * size, g.batch > 1 ? uint64_t(o.stride) * size : 0});
    };
    uint32_t align_a = span(g.b, sab), align_b = span(g.a, sab), align_d = span(g.c, sc);
    uint32_t align_c = g.has_residual ? span(g.residual, sc) : align_d;
    bool ok =
        check(fns_->pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
              "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)", err) &&
        check(fns_->pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                             sizeof(align_a)),
              "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_A_BYTES)", err) &&
        check(fns_->pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b,
                             sizeof(align_b)),
              "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_B_BYTES)", err) &&
        check(fns_->pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c,
                             sizeof(align_c)),
              "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_C_BYTES)", err) &&
        check(fns_->pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d,
                             sizeof(align_d)),
              "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT_D_BYTES)", err);
    cublasLtMatmulHeuristicResult_t results[kHeuristicResults] = {};
    int found = 0;
    if (ok) {
      ok = check(fns_->heuristic(handle_, op->desc, op->la, op->lb, op->lr, op->lc, pref,
                                 kHeuristicResults, results, &found),
                 "cublasLtMatmulAlgoGetHeuristic", err);
    }
    fns_->pref_destroy(pref);
    if (!ok) return false;
    std::vector<cublasLtMatmulAlgo_t> candidates;  // best first
    for (int i = 0; i < found; ++i) {
      if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
      if (g.has_residual && !out_of_place(results[i].algo)) continue;
      candidates.push_back(results[i].algo);
    }
    if (!candidates.empty()) {
      op->algo = candidates[0];
      op->how = "heuristic's first of " + std::to_string(candidates.size());
      if (candidates.size() > 1 && timed_choice() && drv_->can_time()) {
        char ctx_id[32];
        cu::CUcontext ctx = nullptr;
        if (drv_->cuCtxGetCurrent) drv_->cuCtxGetCurrent(&ctx);
        std::snprintf(ctx_id, sizeof(ctx_id), "%p", static_cast<void*>(ctx));
        std::string key = describe_key(g, align_a, align_b, align_c, align_d) + " ctx " + ctx_id;
        ChoiceCache& cache = choices();
        std::lock_guard<std::mutex> guard(cache.lock);
        auto hit = cache.chosen.find(key);
        if (hit != cache.chosen.end()) {
          op->algo = hit->second.first;
          op->how = hit->second.second + " (cached)";
        } else {
          time_candidates(g, op, candidates);  // keeps the heuristic's first on any failure
          cache.chosen[key] = {op->algo, op->how};
        }
      }
      return true;
    }
    *err = where + ": cuBLASLt has no algorithm for this GEMM (m " + std::to_string(g.m) +
           ", n " + std::to_string(g.n) + ", k " + std::to_string(g.k) + ", batch " +
           std::to_string(g.batch) + ")";
    return false;
  }

  // Whether an algorithm may write D elsewhere than C (a residual GEMM's case). Unknown (no
  // cublasLtMatmulAlgoCapGetAttribute, or the query fails): trusted, as the heuristic was given
  // C's and D's layouts separately.
  bool out_of_place(const cublasLtMatmulAlgo_t& algo) const {
    if (!fns_->cap_get) return true;
    int32_t support = 1;
    size_t written = 0;
    if (fns_->cap_get(&algo, CUBLASLT_ALGO_CAP_OUT_OF_PLACE_RESULT_SUPPORT, &support,
                      sizeof(support), &written) != CUBLAS_STATUS_SUCCESS) {
      return true;
    }
    return support != 0;
  }

  static std::string describe_key(const Gemm& g, uint32_t aa, uint32_t ab, uint32_t ac,
                                  uint32_t ad) {
    auto op = [](const GemmOperand& o) {
      return std::to_string(o.ld) + "/" + std::to_string(o.stride) + (o.trans ? "T" : "N");
    };
    return std::to_string(g.m) + "x" + std::to_string(g.n) + "x" + std::to_string(g.k) + "b" +
           std::to_string(g.batch) + " t" + std::to_string(g.dtype_ab) + std::to_string(g.dtype_c) +
           " a" + op(g.a) + " b" + op(g.b) + " c" + op(g.c) + " al" + std::to_string(aa) + "," +
           std::to_string(ab) + "," + std::to_string(ac) + "," + std::to_string(ad) +
           (g.has_bias ? " bias" : "") + (g.has_residual ? " r" + op(g.residual) : "") + " ab" +
           std::to_string(g.alpha) + "," + std::to_string(g.beta);
  }

  // Times each candidate on scratch operands of the GEMM's extents (offsets kept, so alignment
  // is the real one) and keeps the fastest in op->algo. Anything failing leaves op as it was.
  void time_candidates(const Gemm& g, Op* op, const std::vector<cublasLtMatmulAlgo_t>& cands) {
    const cu::Driver& d = *drv_;
    size_t sab = itemsize(g.dtype_ab), sc = itemsize(g.dtype_c);
    size_t bytes_a = size_t(extent(g.a, g.m, g.k, g.batch)) * sab;
    size_t bytes_b = size_t(extent(g.b, g.k, g.n, g.batch)) * sab;
    size_t bytes_c = size_t(extent(g.c, g.m, g.n, g.batch)) * sc;
    size_t bytes_bias = g.has_bias ? size_t(g.bias_offset + g.n) * sc : 0;
    size_t bytes_r = g.has_residual ? size_t(extent(g.residual, g.m, g.n, g.batch)) * sc : 0;
    constexpr int kBufs = 5;
    cu::CUdeviceptr buf[kBufs] = {0, 0, 0, 0, 0};
    size_t sizes[kBufs] = {bytes_a, bytes_b, bytes_c, bytes_bias, bytes_r};
    cu::CUstream stream = nullptr;
    cu::CUevent start = nullptr, stop = nullptr;
    bool ok = true;
    for (int i = 0; i < kBufs && ok; ++i) {
      if (sizes[i]) ok = d.cuMemAlloc(&buf[i], sizes[i]) == cu::CUDA_SUCCESS;
    }
    ok = ok && d.cuStreamCreate(&stream, 1 /* CU_STREAM_NON_BLOCKING */) == cu::CUDA_SUCCESS &&
         d.cuEventCreate(&start, 0) == cu::CUDA_SUCCESS &&
         d.cuEventCreate(&stop, 0) == cu::CUDA_SUCCESS;
    // 0x3C bytes: fp16/bf16 values near 1 and small fp32 values, all finite.
    for (int i = 0; i < kBufs && ok; ++i) {
      if (sizes[i]) ok = d.cuMemsetD8Async(buf[i], 0x3C, sizes[i], stream) == cu::CUDA_SUCCESS;
    }
    const void* bias_ptr = reinterpret_cast<const void*>(
        static_cast<uintptr_t>(buf[3] + uint64_t(g.bias_offset) * sc));
    if (ok && g.has_bias) {
      ok = fns_->desc_set(op->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_ptr,
                          sizeof(bias_ptr)) == CUBLAS_STATUS_SUCCESS;
    }
    auto ptr = [](cu::CUdeviceptr base, int64_t offset, size_t size) {
      return reinterpret_cast<char*>(static_cast<uintptr_t>(base)) + offset * int64_t(size);
    };
    const char* pa = ptr(buf[0], g.a.offset, sab);
    const char* pb = ptr(buf[1], g.b.offset, sab);
    char* pc = ptr(buf[2], g.c.offset, sc);
    const char* pr = g.has_residual ? ptr(buf[4], g.residual.offset, sc) : pc;
    auto call = [&](const cublasLtMatmulAlgo_t& algo) {
      return fns_->matmul(handle_, op->desc, &op->alpha, pb, op->la, pa, op->lb, &op->beta, pr,
                          op->lr, pc, op->lc, &algo,
                          reinterpret_cast<void*>(static_cast<uintptr_t>(workspace_)),
                          kWorkspaceBytes, reinterpret_cast<cudaStream_t>(stream)) ==
             CUBLAS_STATUS_SUCCESS;
    };
    constexpr int kWarmup = 2, kTimed = 10, kRounds = 3;
    std::vector<float> best(cands.size(), -1.0f);
    for (int round = 0; round < kRounds && ok; ++round) {
      for (size_t i = 0; i < cands.size(); ++i) {
        if (round > 0 && best[i] < 0) continue;  // failed before
        bool good = true;
        for (int w = 0; w < kWarmup && good; ++w) good = call(cands[i]);
        good = good && d.cuEventRecord(start, stream) == cu::CUDA_SUCCESS;
        for (int t = 0; t < kTimed && good; ++t) good = call(cands[i]);
        good = good && d.cuEventRecord(stop, stream) == cu::CUDA_SUCCESS &&
               d.cuStreamSynchronize(stream) == cu::CUDA_SUCCESS;
        float ms = 0.0f;
        good = good && d.cuEventElapsedTime(&ms, start, stop) == cu::CUDA_SUCCESS;
        if (!good) {  // this candidate is out; an unhealthy stream ends the timing
          best[i] = -1.0f;
          ok = d.cuStreamSynchronize(stream) == cu::CUDA_SUCCESS;
          if (!ok) break;
          continue;
        }
        float us = ms * 1000.0f / kTimed;
        if (round == 0 || us < best[i]) best[i] = us;
      }
    }
    if (ok) {
      size_t pick = 0;
      for (size_t i = 1; i < cands.size(); ++i) {
        if (best[i] >= 0 && (best[pick] < 0 || best[i] < best[pick])) pick = i;
      }
      if (best[pick] >= 0) {
        op->algo = cands[pick];
        char line[160];
        std::snprintf(line, sizeof(line),
                      "timed: candidate %zu of %zu, %.1f us (heuristic's first %.1f us)",
                      pick + 1, cands.size(), best[pick], best[0]);
        op->how = line;
      }
    }
    if (stream) d.cuStreamSynchronize(stream);
    if (start) d.cuEventDestroy(start);
    if (stop) d.cuEventDestroy(stop);
    if (stream) d.cuStreamDestroy(stream);
    for (cu::CUdeviceptr b : buf) {
      if (b) d.cuMemFree(b);
    }
  }

  const cu::Driver* drv_ = nullptr;
  const Lt* fns_ = nullptr;
  cublasLtHandle_t handle_ = nullptr;
  cu::CUdeviceptr workspace_ = 0;
  std::vector<Op> ops_;
};

#else  // built without the cuBLASLt headers

class Runner {
 public:
  bool init(const Plan&, const cu::Driver*, std::string* err) {
    *err = "this build of the mlso runtime library has no cuBLASLt support (the cuBLAS headers "
           "were not found when it was built; set MLSO_CUBLAS_INCLUDE to a folder holding "
           "cublasLt.h and rebuild it, or re-run `mlso optimize` with MLSO_LIBRARY_GEMM=0)";
    return false;
  }
  bool run(size_t, void*, void*, void*, void*, void*, cu::CUstream, std::string* err) const {
    *err = "no cuBLASLt support in this build";
    return false;
  }
  std::string describe(size_t) const { return std::string(); }
};

#endif

}  // namespace blas
}  // namespace mlso
