// Fuzz driver for the C++ plan reader: mlso_json.h, mlso_plan.h and mlso_sha256.h.
//
// Why a batch driver and not a libFuzzer target: CI has g++ but no clang, so there is no
// libFuzzer instrumentation for C++. tests/fuzz/plan_fuzz.py generates inputs in Python (Atheris,
// guided by coverage of the Python validator only) and hands them here in batches, one process
// per batch, built with AddressSanitizer and UBSan (-fno-sanitize-recover=all), so any
// out-of-bounds read, leak or undefined behaviour ends the process with a report instead of
// passing silently. For every input this prints one verdict line, flushed at once, so the
// Python side knows which input a crash or hang happened on:
//
//     <reason key or "ok">\t<SHA-256 of the plan text>\t<message, bytes escaped as \xNN>
//
// Input (a file named by argv[1], or stdin): records, little-endian, back to back:
//     u32 text length, text bytes
//     i64 n_inputs, i64 n_outputs                  (negative: not checked, as in the self-test)
//     i32 declared input count (-1: not checked), then per entry:
//         i32 onnx dtype (0: unknown), i32 rank (-1: unknown), rank x i64 dims (-1: unknown)
//     i32 declared output count, the same
//     i32 kernel count (-1: not checked), then per kernel: u32 length, bytes
// The harness writes these records itself, so a malformed file is a harness bug (exit 3).

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "mlso_plan.h"
#include "mlso_sha256.h"

namespace {

class Reader {
 public:
  explicit Reader(std::string data) : data_(std::move(data)) {}
  bool done() const { return pos_ == data_.size(); }
  bool bytes(size_t n, std::string* out) {
    if (data_.size() - pos_ < n) return false;
    out->assign(data_, pos_, n);
    pos_ += n;
    return true;
  }
  template <class T>
  bool num(T* out) {
    if (data_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(out, data_.data() + pos_, sizeof(T));  // x86-64 and aarch64 are little-endian
    pos_ += sizeof(T);
    return true;
  }

 private:
  std::string data_;
  size_t pos_ = 0;
};

bool read_declared(Reader* r, bool* check, std::vector<mlso::Declared>* out) {
  int32_t n = 0;
  if (!r->num(&n) || n < -1) return false;
  *check = n >= 0;
  for (int32_t i = 0; i < n; ++i) {
    mlso::Declared d;
    int32_t dtype = 0, rank = 0;
    if (!r->num(&dtype) || !r->num(&rank) || rank < -1) return false;
    d.dtype = dtype;
    d.has_shape = rank >= 0;
    for (int32_t k = 0; k < rank; ++k) {
      int64_t dim = 0;
      if (!r->num(&dim)) return false;
      d.dims.push_back(dim);
    }
    out->push_back(d);
  }
  return true;
}

std::string escaped(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      char buf[5];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  return out;
}

// What the op does with an accepted plan, short of ORT and CUDA: so a plan that passes the
// validator but breaks an invariant the op relies on shows up as a verdict, not as a quiet pass.
std::string self_check(const mlso::Plan& plan) {
  for (const auto& spec : plan.inputs) {
    if (!mlso::check_tensor(spec, spec.dtype, spec.shape.data(), spec.shape.size()).empty()) {
      return "an input does not match its own spec";
    }
  }
  for (const auto& l : plan.launches) {
    for (const auto& a : l.args) {
      size_t limit = a.kind == mlso::BufKind::Input    ? plan.inputs.size()
                     : a.kind == mlso::BufKind::Output ? plan.outputs.size()
                                                       : plan.scratch.size();
      if (a.index >= limit) return "an argument index is out of range";
    }
    if (static_cast<int64_t>(l.smem) > plan.smem_needed()) return "smem_needed is too small";
  }
  for (const auto& z : plan.zero) {
    if (z.kind == mlso::BufKind::Input) return "an input is zeroed";
  }
  return std::string();
}

}  // namespace

int main(int argc, char** argv) {
  std::FILE* f = argc > 1 && std::strcmp(argv[1], "-") != 0 ? std::fopen(argv[1], "rb") : stdin;
  if (!f) {
    std::perror("open");
    return 3;
  }
  std::string data;
  char buf[65536];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) data.append(buf, n);
  if (f != stdin) std::fclose(f);
  Reader r(std::move(data));
  while (!r.done()) {
    uint32_t len = 0;
    std::string text;
    int64_t n_in = 0, n_out = 0;
    bool check_in = false, check_out = false;
    std::vector<mlso::Declared> ins, outs;
    int32_t n_kernels = 0;
    if (!r.num(&len) || !r.bytes(len, &text) || !r.num(&n_in) || !r.num(&n_out) ||
        !read_declared(&r, &check_in, &ins) || !read_declared(&r, &check_out, &outs) ||
        !r.num(&n_kernels) || n_kernels < -1) {
      std::fprintf(stderr, "malformed record file\n");
      return 3;
    }
    std::vector<std::string> kernels;
    for (int32_t i = 0; i < n_kernels; ++i) {
      uint32_t klen = 0;
      std::string k;
      if (!r.num(&klen) || !r.bytes(klen, &k)) {
        std::fprintf(stderr, "malformed record file\n");
        return 3;
      }
      kernels.push_back(std::move(k));
    }
    if (check_in != check_out) {
      std::fprintf(stderr, "declared inputs and outputs are checked together\n");
      return 3;
    }
    mlso::Plan plan;
    std::string msg, code = "ok";
    bool ok = mlso::parse_plan(text, static_cast<long>(n_in), static_cast<long>(n_out), &plan,
                               &msg, &code);
    if (ok && check_in) ok = mlso::check_declared(plan, ins, outs, &msg, &code);
    if (ok && n_kernels >= 0) {
      ok = mlso::check_kernels(
          plan,
          [&](const std::string& name) {
            for (const auto& k : kernels) {
              if (k == name) return true;
            }
            return false;
          },
          &msg, &code);
    }
    if (ok) {
      msg = self_check(plan);
      if (!msg.empty()) code = "self_check";
    }
    std::string hash =
        mlso::Sha256::of(reinterpret_cast<const unsigned char*>(text.data()), text.size());
    std::printf("%s\t%s\t%s\n", code.c_str(), hash.c_str(), escaped(msg).c_str());
    std::fflush(stdout);
  }
  return 0;
}
