// mlso_host_emu.h -- runs generated kernels on the CPU, for tests on machines without a GPU.
//
// Why: code generation is mostly index arithmetic, phases and barriers; executing the generated
// source on the host against the reference interpreter catches those bugs where CI has no GPU.
// Blocks run one after another on the calling OS thread; each CUDA thread of a block is a
// cooperative fiber (own stack, own threadIdx) that runs until it waits at a barrier, then
// switches to the next fiber that can run. __syncthreads is a barrier over the block; warp
// operations (shuffles, ldmatrix, mma.sync) exchange values through a per-warp area between two
// warp barriers. Fibers replace one OS thread per CUDA thread: switching is a few instructions
// in user space instead of futex wake-ups, and a barrier some threads never reach is reported
// (every fiber left waits, none can run) instead of hanging. ldmatrix and mma follow the PTX ISA
// fragment definitions (m8n8 b16 matrices; m16n8k16 .row.col with fp32 accumulation), so the
// layouts the templates assume are checked too. cp.async is a synchronous copy here, so races
// between stages are not modelled. Use small shapes. Not compiled by nvcc (only with
// MLSO_HOST_EMU defined).
#pragma once

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#if !defined(__x86_64__) || defined(MLSO_EMU_UCONTEXT)
#define MLSO_EMU_UCONTEXT 1
#include <ucontext.h>
#endif

#define MLSO_HOST_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) alignas(n)
#define MLSO_DYNAMIC_SMEM(name) unsigned char* name = mlso_emu::ctx->smem

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

// ---- Fibers: the CUDA threads of one block, run cooperatively on one OS thread ----

struct Fiber;

// First-in first-out list of fibers, linked through Fiber::next.
struct Queue {
  Fiber* head = nullptr;
  Fiber* tail = nullptr;
  inline void push(Fiber* f);
  inline Fiber* pop();
  inline void take_all(Queue& q);  // append q's fibers in order, leaving q empty
};

// A barrier over `expected` fibers. Arriving fibers wait in `waiting`; the one that arrives last
// moves them all to the ready queue and keeps running.
struct Barrier {
  unsigned expected, arrived = 0;
  Queue waiting;
  const char* what;  // named in the deadlock report
};

struct Warp {
  Barrier bar{32, 0, {}, "a warp barrier (__syncwarp, shuffle, ldmatrix or mma)"};
  float f[32];
  const void* p[32];
  unsigned a[32][4];
  unsigned b[32][2];
};

// What the kernel sees as threadIdx, blockIdx, ... and its block's shared state.
struct Ctx {
  dim3 tid, bid, bdim, gdim;
  unsigned char* smem = nullptr;
  Barrier* block = nullptr;
  Warp* warp = nullptr;
};

// Stack per fiber: kernels keep register arrays (fragments, accumulators, mma operands) on it.
// Each stack has PROT_NONE guard pages below it, so an overflow faults (and is reported) instead
// of corrupting the neighbouring fiber. Override with -DMLSO_EMU_STACK_KIB=...
#ifndef MLSO_EMU_STACK_KIB
#define MLSO_EMU_STACK_KIB 256
#endif
constexpr std::size_t kStack = std::size_t(MLSO_EMU_STACK_KIB) * 1024;
// Guard below each stack. hostemu.py builds with -fstack-clash-protection (a large frame is
// probed page by page), so one page would do; 64 KiB also covers frames built without it.
constexpr std::size_t kGuard = 64 * 1024;
static_assert(kStack % 65536 == 0 && kStack >= 131072,
              "fiber stacks are whole 64 KiB units, at least 128 KiB (64 KiB of it for colour())");

// Stack tops a multiple of 64 KiB apart would put every fiber's hot frames in the same cache
// sets; fiber i starts its stack colour(i) bytes lower (distinct 64-byte steps below 64 KiB).
inline std::size_t colour(unsigned i) { return (std::size_t(i) * 2112) % 65536; }
static_assert(2112 % 16 == 0, "stack tops stay 16-byte aligned");

#if MLSO_EMU_UCONTEXT
// Portable switch (glibc swapcontext also saves the signal mask: one syscall per switch).
struct Regs {
  ucontext_t uc;
};
inline void swap_regs(Regs& from, Regs& to) { swapcontext(&from.uc, &to.uc); }
#else
// x86-64 System V switch: push the callee-saved registers on the current stack, store its stack
// pointer in *from, load `to`, pop its registers and return into it. Caller-saved registers are
// the compiler's to spill around the call. MXCSR / x87 control are not switched: kernels never
// change rounding modes, so all fibers share the launcher's.
struct Regs {
  void* sp;
};
__attribute__((naked, noinline)) inline void swap_sp(void** /*from*/, void* /*to*/) {
  asm("pushq %rbp\n\tpushq %rbx\n\tpushq %r12\n\tpushq %r13\n\tpushq %r14\n\tpushq %r15\n\t"
      "movq %rsp, (%rdi)\n\tmovq %rsi, %rsp\n\t"
      "popq %r15\n\tpopq %r14\n\tpopq %r13\n\tpopq %r12\n\tpopq %rbx\n\tpopq %rbp\n\tret\n\t");
}
inline void swap_regs(Regs& from, Regs& to) { swap_sp(&from.sp, to.sp); }
#endif

struct Fiber {
  Ctx cuda;
  const Barrier* wait = nullptr;  // the barrier this fiber waits at, if any
  Fiber* next = nullptr;          // in the ready queue or its barrier's `waiting`
  bool done = false;              // the kernel returned
  unsigned char* stack = nullptr;  // lowest byte of its kStack bytes
  unsigned char* top = nullptr;    // where its stack starts (grows down), see colour()
  Regs regs;
};

inline void Queue::push(Fiber* f) {
  f->next = nullptr;
  (tail ? tail->next : head) = f;
  tail = f;
}
inline Fiber* Queue::pop() {
  Fiber* f = head;
  if (f && !(head = f->next)) tail = nullptr;
  return f;
}
inline void Queue::take_all(Queue& q) {
  if (!q.head) return;
  (tail ? tail->next : head) = q.head;
  tail = q.tail;
  q.head = q.tail = nullptr;
}

// The block being run: its fibers, the one running, those that can run (in the order they
// became able to), and the launcher's own context.
struct Sched {
  std::vector<Fiber> fibers;
  unsigned n = 0;
  Fiber* running = nullptr;
  Queue ready;
  Regs main;
  void (*body)(void*) = nullptr;  // runs the kernel with its arguments
  void* arg = nullptr;
  unsigned char* map = nullptr;  // all stacks with their guards, (kGuard + kStack) each
  std::size_t map_bytes = 0;
};
// Plain globals: launches are made by one OS thread (the driver's main), and all fibers run on it.
inline Sched sched;
inline Ctx* ctx = nullptr;  // the running fiber's; switched with it

// Leave the running fiber (waiting or finished) for the first ready one, or for the launcher
// when none is ready (the block finished, or deadlock).
inline void switch_away() {
  Sched& s = sched;
  Fiber* me = s.running;
  Fiber* f = s.ready.pop();
  if (!f) {
    swap_regs(me->regs, s.main);
    return;
  }
  f->wait = nullptr;
  s.running = f;
  ctx = &f->cuda;
  swap_regs(me->regs, f->regs);  // returns when someone switches back here (and set ctx)
}

inline void arrive_and_wait(Barrier& b) {
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    sched.ready.take_all(b.waiting);
    return;
  }
  Fiber* me = sched.running;
  me->wait = &b;
  b.waiting.push(me);
  switch_away();
}

[[noreturn]] inline void fiber_entry() {
  sched.body(sched.arg);
  sched.running->done = true;
  switch_away();
  std::abort();  // a finished fiber is never resumed
}

#if MLSO_EMU_UCONTEXT
inline void start_regs(Fiber& f) {
  getcontext(&f.regs.uc);
  f.regs.uc.uc_stack.ss_sp = f.stack;
  f.regs.uc.uc_stack.ss_size = std::size_t(f.top - f.stack);
  f.regs.uc.uc_link = nullptr;
  makecontext(&f.regs.uc, fiber_entry, 0);
}
#else
// A fresh fiber's stack as swap_sp leaves one: six zero registers, then fiber_entry as the
// return address, entered with rsp = 8 mod 16 as after a call.
inline void start_regs(Fiber& f) {
  auto* top = reinterpret_cast<void**>(f.top);
  top[-1] = nullptr;  // fiber_entry's own (never used) return address
  top[-2] = reinterpret_cast<void*>(&fiber_entry);
  for (int r = 3; r <= 8; ++r) top[-r] = nullptr;
  f.regs.sp = top - 8;
}
#endif

// An overflow into a guard page: say so instead of a bare segfault (runs on its own stack).
inline void on_segv(int sig, siginfo_t* si, void*) {
  const Sched& s = sched;
  const auto* a = static_cast<unsigned char*>(si->si_addr);
  if (s.map && a >= s.map && a < s.map + s.map_bytes &&
      std::size_t(a - s.map) % (kGuard + kStack) < kGuard) {
    static const char msg[] =
        "mlso_emu: an emulated CUDA thread overflowed its fiber stack (MLSO_EMU_STACK_KIB)\n";
    (void)!write(2, msg, sizeof msg - 1);
    _exit(5);
  }
  signal(sig, SIG_DFL);  // any other fault: the default action when it repeats
}

// At least n fibers with stacks; the mapping is kept and reused by later blocks and launches.
inline void reserve_fibers(unsigned n) {
  Sched& s = sched;
  if (s.fibers.size() < n) {
    if (s.map) munmap(s.map, s.map_bytes);
    s.map_bytes = std::size_t(n) * (kGuard + kStack);
    void* m = mmap(nullptr, s.map_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "mlso_emu: cannot map %zu bytes of fiber stacks\n", s.map_bytes);
      std::exit(3);
    }
    s.map = static_cast<unsigned char*>(m);
    s.fibers.assign(n, Fiber{});
    for (unsigned i = 0; i < n; ++i) {
      s.fibers[i].stack = s.map + std::size_t(i) * (kGuard + kStack) + kGuard;
      s.fibers[i].top = s.fibers[i].stack + kStack - colour(i);
      if (mprotect(s.fibers[i].stack, kStack, PROT_READ | PROT_WRITE) != 0) {
        std::fprintf(stderr, "mlso_emu: cannot set up fiber stacks\n");
        std::exit(3);
      }
    }
  }
  static bool handler = false;
  if (!handler) {
    handler = true;
    static std::vector<unsigned char> alt(64 * 1024);
    stack_t ss{};
    ss.ss_sp = alt.data();
    ss.ss_size = alt.size();
    sigaltstack(&ss, nullptr);
    struct sigaction sa{};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
  }
}

// Every fiber still waits (or has returned) but some wait: a barrier that not all threads of its
// block (or warp) reach. Name who waits where, in runs of consecutive threads, and exit.
[[noreturn]] inline void report_deadlock(dim3 bid) {
  const Sched& s = sched;
  std::fprintf(stderr,
               "mlso_emu: deadlock in block (%u, %u, %u): not every thread reaches a barrier\n",
               bid.x, bid.y, bid.z);
  for (unsigned i = 0; i < s.n;) {
    unsigned j = i + 1;
    while (j < s.n && s.fibers[j].done == s.fibers[i].done &&
           s.fibers[j].wait == s.fibers[i].wait)
      ++j;
    const Fiber& f = s.fibers[i];
    std::fprintf(stderr, j - i > 1 ? "  threads %u-%u: " : "  thread %u: ", i, j - 1);
    if (f.done) {
      std::fprintf(stderr, "returned\n");
    } else if (f.wait == f.cuda.block) {
      std::fprintf(stderr, "waiting at %s\n", f.wait->what);
    } else {
      std::fprintf(stderr, "waiting at %s of warp %u\n", f.wait->what, i / 32);
    }
    i = j;
  }
  std::exit(4);
}

inline int lane() { return static_cast<int>(ctx->tid.x & 31u); }

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
  Warp& w = *ctx->warp;
  const int t = lane();
  w.p[t] = p;
  arrive_and_wait(w.bar);
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
  arrive_and_wait(w.bar);
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
  Warp& w = *ctx->warp;
  const int l = lane();
  for (int i = 0; i < 4; ++i) w.a[l][i] = a[i];
  w.b[l][0] = b[0];
  w.b[l][1] = b[1];
  arrive_and_wait(w.bar);
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
  arrive_and_wait(w.bar);
  const int g = l / 4, t = l % 4;
  const int rows[4] = {g, g, g + 8, g + 8};
  const int cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    float s = d[i];
    for (int k = 0; k < 16; ++k) s += A[rows[i]][k] * B[k][cols[i]];
    d[i] = s;
  }
}

// Launch: blocks one after another; in each, one fiber per CUDA thread, started in thread order.
template <class K, class... Args>
void launch(dim3 grid, dim3 block, std::size_t smem_bytes, K kernel, Args... args) {
  const unsigned nt = block.x * block.y * block.z;
  if (nt == 0 || nt % 32 != 0) {
    std::fprintf(stderr, "emulation needs whole warps\n");
    std::exit(3);
  }
  std::vector<unsigned char> smem(smem_bytes + 256);
  unsigned char* base = smem.data() + (256 - reinterpret_cast<std::uintptr_t>(smem.data()) % 128);
  auto body = [&]() { kernel(args...); };
  Sched& s = sched;
  reserve_fibers(nt);
  s.n = nt;
  s.body = [](void* p) { (*static_cast<decltype(body)*>(p))(); };
  s.arg = &body;
  std::vector<Warp> warps(nt / 32);
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::memset(base, 0xff, smem_bytes);  // NaN patterns: reads of unwritten smem show up
        Barrier bar{nt, 0, {}, "__syncthreads"};
        for (Warp& w : warps) w.bar.arrived = 0, w.bar.waiting = Queue{};
        s.ready = Queue{};
        for (unsigned t = 0; t < nt; ++t) {
          Fiber& f = s.fibers[t];
          f.cuda.tid = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
          f.cuda.bid = dim3{bx, by, bz};
          f.cuda.bdim = block;
          f.cuda.gdim = grid;
          f.cuda.smem = base;
          f.cuda.block = &bar;
          f.cuda.warp = &warps[t / 32];
          f.wait = nullptr;
          f.done = false;
          start_regs(f);
          s.ready.push(&f);
        }
        s.running = s.ready.pop();
        ctx = &s.running->cuda;
        swap_regs(s.main, s.running->regs);  // back when no fiber is ready
        for (unsigned t = 0; t < nt; ++t)
          if (!s.fibers[t].done) report_deadlock(dim3{bx, by, bz});
      }
  ctx = nullptr;
}

}  // namespace mlso_emu

#define threadIdx (mlso_emu::ctx->tid)
#define blockIdx (mlso_emu::ctx->bid)
#define blockDim (mlso_emu::ctx->bdim)
#define gridDim (mlso_emu::ctx->gdim)

inline void __syncthreads() { mlso_emu::arrive_and_wait(*mlso_emu::ctx->block); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
  mlso_emu::Warp& w = *mlso_emu::ctx->warp;
  const int l = mlso_emu::lane();
  w.f[l] = v;
  mlso_emu::arrive_and_wait(w.bar);
  const float r = w.f[l ^ off];
  mlso_emu::arrive_and_wait(w.bar);
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
// CUBLASLT_EPILOGUE_BIAS adds it to its fp32 result. A residual epilogue (resid non-null: an
// m x n matrix of C's type per batch entry at r_off, rows r_ld apart, entries r_stride apart)
// is cuBLASLt's own C: beta times it, not C's old value, joins the fp32 value before that one
// rounding, as cublasLtMatmul converts C to its fp32 scale type before the final scaling.
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
          const TC* bias = nullptr, long bias_off = 0, const TC* resid = nullptr, long r_off = 0,
          long r_ld = 0, long r_stride = 0) {
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
        const TC* addend = resid ? resid + r_off + e * r_stride + i * r_ld + j : out;
        if (beta != 0.0f) v += beta * gemm_load(addend);
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

inline void __syncwarp(unsigned = 0xffffffffu) {
  mlso_emu::arrive_and_wait(mlso_emu::ctx->warp->bar);
}
