// mlso_host_emu.h -- runs generated kernels on the CPU, for tests on machines without a GPU.
//
// Why: code generation is mostly index arithmetic, phases and barriers; executing the generated
// source on the host against the reference interpreter catches those bugs where CI has no GPU.
// One std::thread per CUDA thread; __syncthreads is a std::barrier over the block; warp
// operations (shuffles, ldmatrix, mma.sync) exchange values through a per-warp area between two
// warp barriers. ldmatrix and mma follow the PTX ISA fragment definitions (m8n8 b16 matrices;
// m16n8k16 .row.col with fp32 accumulation), so the layouts the templates assume are checked
// too. cp.async is a synchronous copy here, so races between stages are not modelled. Slow:
// use small shapes. Not compiled by nvcc (only with MLSO_HOST_EMU defined).
#pragma once

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#define MLSO_HOST_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) alignas(n)
#define MLSO_DYNAMIC_SMEM(name) unsigned char* name = mlso_emu::ctx.smem

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

typedef _Float16 __half;
struct __nv_bfloat16 {
  uint16_t bits;
};

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __int_as_float(unsigned i) { return __int_as_float(static_cast<int>(i)); }
inline float __half2float(__half h) { return static_cast<float>(h); }
inline __half __float2half_rn(float f) { return static_cast<__half>(f); }
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return __nv_bfloat16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline std::size_t __cvta_generic_to_shared(const void* p) { return reinterpret_cast<std::size_t>(p); }

namespace mlso_emu {

struct Warp {
  std::barrier<> bar{32};
  float f[32];
  const void* p[32];
  unsigned a[32][4];
  unsigned b[32][2];
  float c[32][4];
};

struct Ctx {
  dim3 tid, bid, bdim, gdim;
  unsigned char* smem = nullptr;
  std::barrier<>* block = nullptr;
  Warp* warp = nullptr;
};
inline thread_local Ctx ctx;

inline int lane() { return static_cast<int>(ctx.tid.x & 31u); }

inline void copy16(void* smem, const void* gmem, bool pred) {
  if (pred) {
    std::memcpy(smem, gmem, 16);
  } else {
    std::memset(smem, 0, 16);
  }
}

inline uint16_t bits16(const void* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ldmatrix .m8n8 .b16, N matrices; matrix i's 8 row addresses come from lanes 8i..8i+7.
// Thread t receives, per matrix, elements (row t/4, cols 2(t%4), 2(t%4)+1), or with .trans
// (rows 2(t%4), 2(t%4)+1, col t/4); the first element sits in the low 16 bits.
template <int N>
inline void ldmatrix(unsigned (&r)[N], const void* p, bool trans) {
  Warp& w = *ctx.warp;
  const int t = lane();
  w.p[t] = p;
  w.bar.arrive_and_wait();
  for (int i = 0; i < N; ++i) {
    uint16_t e[2];
    for (int h = 0; h < 2; ++h) {
      const int row = trans ? 2 * (t % 4) + h : t / 4;
      const int col = trans ? t / 4 : 2 * (t % 4) + h;
      const auto* base = static_cast<const unsigned char*>(w.p[8 * i + row]);
      e[h] = bits16(base + 2 * col);
    }
    r[i] = static_cast<unsigned>(e[0]) | (static_cast<unsigned>(e[1]) << 16);
  }
  w.bar.arrive_and_wait();
}

template <typename T>
inline float half_of(unsigned reg, int h) {
  const uint16_t v = static_cast<uint16_t>(h ? (reg >> 16) : (reg & 0xffffu));
  T x;
  std::memcpy(&x, &v, 2);
  if constexpr (sizeof(T) == 2 && std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return static_cast<float>(x);
  }
}

// mma.sync.m16n8k16.row.col, fp32 accumulate. groupID g = lane/4, t = lane%4:
// A: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
// B: b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g); C/D: c0,c1 (g, 2t..), c2,c3 (g+8, 2t..).
template <typename T>
inline void mma_16816(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  Warp& w = *ctx.warp;
  const int l = lane();
  for (int i = 0; i < 4; ++i) w.a[l][i] = a[i];
  w.b[l][0] = b[0];
  w.b[l][1] = b[1];
  w.bar.arrive_and_wait();
  float A[16][16], B[16][8];
  for (int ln = 0; ln < 32; ++ln) {
    const int g = ln / 4, t = ln % 4;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = half_of<T>(w.a[ln][0], h);
      A[g + 8][2 * t + h] = half_of<T>(w.a[ln][1], h);
      A[g][2 * t + 8 + h] = half_of<T>(w.a[ln][2], h);
      A[g + 8][2 * t + 8 + h] = half_of<T>(w.a[ln][3], h);
      B[2 * t + h][g] = half_of<T>(w.b[ln][0], h);
      B[2 * t + 8 + h][g] = half_of<T>(w.b[ln][1], h);
    }
  }
  w.bar.arrive_and_wait();
  const int g = l / 4, t = l % 4;
  const int rows[4] = {g, g, g + 8, g + 8};
  const int cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    float s = d[i];
    for (int k = 0; k < 16; ++k) s += A[rows[i]][k] * B[k][cols[i]];
    d[i] = s;
  }
}

// Launch: blocks one after another, each with one host thread per CUDA thread.
template <class K, class... Args>
void launch(dim3 grid, dim3 block, std::size_t smem_bytes, K kernel, Args... args) {
  const unsigned nt = block.x * block.y * block.z;
  if (nt % 32 != 0) {
    std::fprintf(stderr, "emulation needs whole warps\n");
    std::exit(3);
  }
  std::vector<unsigned char> smem(smem_bytes + 256);
  unsigned char* base = smem.data() + (256 - reinterpret_cast<std::uintptr_t>(smem.data()) % 128);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::memset(base, 0xff, smem_bytes);  // NaN patterns: reads of unwritten smem show up
        std::barrier<> bar(nt);
        std::vector<Warp> warps(nt / 32);
        std::vector<std::thread> threads;
        threads.reserve(nt);
        for (unsigned t = 0; t < nt; ++t) {
          threads.emplace_back([&, t]() {
            ctx.tid = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            ctx.bid = dim3{bx, by, bz};
            ctx.bdim = block;
            ctx.gdim = grid;
            ctx.smem = base;
            ctx.block = &bar;
            ctx.warp = &warps[t / 32];
            kernel(args...);
          });
        }
        for (auto& th : threads) th.join();
      }
}

}  // namespace mlso_emu

#define threadIdx (mlso_emu::ctx.tid)
#define blockIdx (mlso_emu::ctx.bid)
#define blockDim (mlso_emu::ctx.bdim)
#define gridDim (mlso_emu::ctx.gdim)

inline void __syncthreads() { mlso_emu::ctx.block->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
  mlso_emu::Warp& w = *mlso_emu::ctx.warp;
  const int l = mlso_emu::lane();
  w.f[l] = v;
  w.bar.arrive_and_wait();
  const float r = w.f[l ^ off];
  w.bar.arrive_and_wait();
  return r;
}

namespace mlso_emu {

// Test driver helpers: raw little-endian buffers in files.
inline std::vector<unsigned char> read_file(const char* path, std::size_t nbytes) {
  std::vector<unsigned char> buf(nbytes + 16);
  FILE* f = std::fopen(path, "rb");
  if (!f || std::fread(buf.data(), 1, nbytes, f) != nbytes) {
    std::fprintf(stderr, "cannot read %s\n", path);
    std::exit(2);
  }
  std::fclose(f);
  return buf;
}

inline std::vector<unsigned char> poisoned(std::size_t nbytes) { return std::vector<unsigned char>(nbytes + 16, 0xff); }

// A library GEMM launch of the plan (cuBLASLt on the GPU): C[e] = A[e] @ B[e] for e < batch,
// row-major, operands addressed as the plan describes them (offset, ld, batch stride, trans),
// the products summed in double and rounded once to fp32, then to C's type. cuBLASLt sums in
// fp32 in blocked order, whose error is well under one rounding of a 16-bit C; a naive fp32 sum
// in k order would model a worse GEMM than the library is (and than the interpreter's float32
// mode assumes), so the emulator stands for the correctly rounded product instead. A bias
// epilogue (bias non-null: n elements of C's type from bias_off, the same for every row and
// batch entry) is added to that fp32 value before the one rounding to C's type, as cuBLASLt's
// CUBLASLT_EPILOGUE_BIAS adds it to its fp32 result.
inline float gemm_load(const float* p) { return *p; }
inline float gemm_load(const __half* p) { return __half2float(*p); }
inline float gemm_load(const __nv_bfloat16* p) { return __bfloat162float(*p); }
inline void gemm_store(float* p, float v) { *p = v; }
inline void gemm_store(__half* p, float v) { *p = __float2half_rn(v); }
inline void gemm_store(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

template <class TA, class TC>
void gemm(long m, long n, long k, long batch, const TA* a, long a_off, long lda, long a_stride,
          bool a_trans, const TA* b, long b_off, long ldb, long b_stride, bool b_trans, TC* c,
          long c_off, long ldc, long c_stride, float alpha, float beta,
          const TC* bias = nullptr, long bias_off = 0) {
  for (long e = 0; e < batch; ++e) {
    for (long i = 0; i < m; ++i) {
      for (long j = 0; j < n; ++j) {
        double acc = 0.0;
        for (long q = 0; q < k; ++q) {
          long ai = a_off + e * a_stride + (a_trans ? q * lda + i : i * lda + q);
          long bi = b_off + e * b_stride + (b_trans ? j * ldb + q : q * ldb + j);
          acc += double(gemm_load(a + ai)) * double(gemm_load(b + bi));
        }
        TC* out = c + c_off + e * c_stride + i * ldc + j;
        float v = alpha * float(acc);
        if (beta != 0.0f) v += beta * gemm_load(out);
        if (bias) v += gemm_load(bias + bias_off + j);
        gemm_store(out, v);
      }
    }
  }
}

inline void write_file(const char* path, const std::vector<unsigned char>& buf, std::size_t nbytes) {
  FILE* f = std::fopen(path, "wb");
  if (!f || std::fwrite(buf.data(), 1, nbytes, f) != nbytes) {
    std::fprintf(stderr, "cannot write %s\n", path);
    std::exit(2);
  }
  std::fclose(f);
}

}  // namespace mlso_emu

inline void __syncwarp(unsigned = 0xffffffffu) { mlso_emu::ctx.warp->bar.arrive_and_wait(); }
