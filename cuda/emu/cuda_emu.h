// An emulated CUDA device for tests: the CUDA sources of cuda/ compile as host C++ against
// this header (through the shims in cuda/emu/include/, which take the place of
// cuda_runtime.h, cuda_bf16.h, cublas_v2.h and nccl.h) and run on the CPU.
//
// Device side: a kernel launch (DF_LAUNCH in cuda/common.cuh) runs every block in turn, in a
// shuffled order; each block runs as its CUDA threads, one fiber each (cuda/emu/fiber.cpp),
// meeting at __syncthreads and at warp collectives (shuffles, votes, __syncwarp). Which thread
// runs next, between two barriers, is drawn at random (seeded: DFLASH_EMU_SEED), so a kernel
// that needs a barrier it does not have computes a wrong or unstable result. Shared memory
// (DF_SHARED, DF_DYN_SHARED) is poisoned with 0xff bytes (NaN) before every block.
//
// Host side (cuda/emu/runtime.cpp): device memory, copies, memsets, streams and events with
// stream-order semantics that delay work as long as CUDA allows, pinned memory, launch
// checks against the limits of the emulated architecture (DFLASH_EMU_ARCH: sm_90 H200,
// sm_100 B200, sm_120 RTX PRO 6000 Blackwell); cuBLAS's GemmEx (cuda/emu/blas.cpp) and NCCL's
// collectives for ranks in threads of one process (cuda/emu/nccl.cpp).
//
// Nothing here is CUDA's code or CUDA's headers: the names and semantics are those of the
// public CUDA, cuBLAS and NCCL documentation. What it cannot show: see cuda/emu/README.md.
#pragma once
#ifndef __cplusplus
#error "cuda_emu.h is C++: the emulated CUDA sources compile as C++20"
#endif

#define DFLASH_CUDA_EMU 1

#include <cmath>
#include <math.h>  // cuda_runtime.h declares the C maths functions globally
#include <stdio.h> // and printf, for device code too
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- qualifiers -------------------------------------------------------------------------
// __shared__ is deliberately not defined: shared memory is declared with DF_SHARED /
// DF_DYN_SHARED (cuda/common.cuh), which the emulator can poison per block.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

namespace dfemu {

// The CUDA thread running on this host thread (set by the block scheduler).
struct Coords {
  uint3 thread, block;
  dim3 bdim, gdim;
};
inline constinit thread_local Coords t_coords{};

// ---- block and warp synchronisation (fiber.cpp) ----
void syncthreads(const char *file, int line);
// A warp collective of the calling lane: every lane named in `mask` must make the same
// call; returns this lane's result. kind: one of the Coll values.
enum Coll : int { COLL_SYNCWARP, COLL_SHFL, COLL_BALLOT, COLL_ANY, COLL_ALL, COLL_LANES };
uint64_t warp_collective(Coll kind, unsigned mask, uint64_t value, int src_lane, const char *what);
// A warp-wide op on every lane's data (WMMA's fragment ops, mma.h): all 32 lanes of the warp
// must call it with the same fn and what; when the last arrives, fn runs once with every
// lane's arg (lane order), on that lane's fiber (the others' stacks are intact meanwhile).
typedef void (*LanesFn)(void *const *lane_args, const char *what);
void warp_all_lanes(LanesFn fn, void *arg, const char *what);
unsigned active_mask();
unsigned lane_id();
[[noreturn]] void device_fault(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

// ---- raw tensor-core and async-copy instructions (mma_sync.cpp, fiber.cpp; cuda/tc.cuh) ----
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 of the calling lane: a warp-wide op
// (all 32 lanes, converged) on the PTX ISA's fragment layouts (cuda/tc.cuh states them).
void mma_m16n8k16_bf16(float *d, const uint32_t *a, const uint32_t *b, const float *c);
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16: lanes 8j..8j+7 give matrix j's
// row addresses (16-byte aligned, in the block's shared memory); r[j] of lane l is matrix j's
// row l / 4, columns 2 (l % 4) and + 1 (the lower column in the low half), of the
// transposed matrix with .trans.
void ldmatrix(uint32_t *r, int nmat, bool trans, const void *row_addr);
// cp.async.{ca,cg}.shared.global of `bytes` (4, 8, 16): dst is poisoned (0xff) until a
// cp.async.wait_group (or the thread's end) completes the copy's commit group.
void cp_async(void *dst, const void *src, unsigned bytes);
void cp_async_commit();
// Completes every committed group but the newest n.
void cp_async_wait(unsigned n);
// Whether [p, p + n) lies in the running block's shared memory.
bool in_shared(const void *p, size_t n);

// Shared memory of the running block: `tag` names the DF_SHARED declaration.
void *static_shared(const void *tag, size_t bytes, size_t align);
void *dynamic_shared();

template <typename T>
T shfl(unsigned mask, T v, int src, const char *what) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffle of this type");
  uint64_t raw = 0;
  std::memcpy(&raw, &v, sizeof v);
  raw = warp_collective(COLL_SHFL, mask, raw, src, what);
  T out;
  std::memcpy(&out, &raw, sizeof out);
  return out;
}
// Source lane of each shuffle flavour (CUDA's rules for width < 32: a lane outside its
// segment reads its own value).
inline int seg_base(int lane, int width) { return lane / width * width; }
inline int src_xor(int lane, int mask, int width) {
  int s = lane ^ mask;
  return s >= seg_base(lane, width) + width ? lane : s;
}
inline int src_idx(int lane, int src, int width) {
  return seg_base(lane, width) + (src % width + width) % width;
}
inline int src_up(int lane, unsigned d, int width) {
  int s = lane - (int)d;
  return s < seg_base(lane, width) ? lane : s;
}
inline int src_down(int lane, unsigned d, int width) {
  int s = lane + (int)d;
  return s >= seg_base(lane, width) + width ? lane : s;
}

// ---- launches (fiber.cpp, runtime.cpp) ----
struct KernelBody {
  void (*run)(const void *args); // one CUDA thread: the kernel on its own copy of the args
  const void *args;
  void (*destroy)(void *args);
};
struct Stream;
// Checks the configuration like the hardware (the error goes to cudaGetLastError) and
// queues the kernel on `stream`; owns `args` from here on.
void launch(const char *name, const void *kernel, dim3 grid, dim3 block, size_t smem,
            Stream *stream, KernelBody body);

template <typename... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  Stream *stream;
  const char *name;

  template <typename... A>
  void operator()(A &&...a) const {
    static_assert(sizeof...(A) == sizeof...(P), "kernel launched with the wrong argument count");
    using Args = std::tuple<void (*)(P...), std::decay_t<P>...>;
    Args *args = new Args(kernel, static_cast<std::decay_t<P>>(std::forward<A>(a))...);
    KernelBody body;
    body.args = args;
    body.run = [](const void *p) {
      const Args &t = *static_cast<const Args *>(p);
      std::apply([](auto k, const auto &...v) { k(v...); }, t); // by value: each thread a copy
    };
    body.destroy = [](void *p) { delete static_cast<Args *>(p); };
    launch(name, reinterpret_cast<const void *>(kernel), grid, block, smem, stream, body);
  }
};
template <typename... P>
Launch<P...> make_launch(dim3 grid, dim3 block, size_t smem, Stream *stream, void (*k)(P...),
                         const char *name) {
  return Launch<P...>{k, grid, block, smem, stream, name};
}

} // namespace dfemu

#define DFEMU_LAUNCH(grid, block, smem, stream, ...) \
  ::dfemu::make_launch((grid), (block), (smem), (stream), (__VA_ARGS__), #__VA_ARGS__)
#define DFEMU_SHARED(type, name, dims)           \
  static const char dfemu_shared_tag_##name = 0; \
  type(&name) dims = *static_cast<type(*) dims>( \
      ::dfemu::static_shared(&dfemu_shared_tag_##name, sizeof(type dims), alignof(type dims)))
#define DFEMU_DYN_SHARED(type, name) \
  type *const name = static_cast<type *>(::dfemu::dynamic_shared())

// ---- built-in variables and device functions ---------------------------------------------
#define threadIdx (::dfemu::t_coords.thread)
#define blockIdx (::dfemu::t_coords.block)
#define blockDim (::dfemu::t_coords.bdim)
#define gridDim (::dfemu::t_coords.gdim)
constexpr int warpSize = 32;

// A macro, so that the barrier knows its call site: threads of one block waiting at two
// different __syncthreads is divergent code, undefined in CUDA, and reported.
#define __syncthreads() ::dfemu::syncthreads(__FILE__, __LINE__)
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::dfemu::warp_collective(::dfemu::COLL_SYNCWARP, mask, 0, 0, "__syncwarp");
}
inline unsigned __activemask() { return ::dfemu::active_mask(); }
inline unsigned __ballot_sync(unsigned mask, int pred) {
  return (unsigned)::dfemu::warp_collective(::dfemu::COLL_BALLOT, mask, pred != 0, 0,
                                            "__ballot_sync");
}
inline int __any_sync(unsigned mask, int pred) {
  return (int)::dfemu::warp_collective(::dfemu::COLL_ANY, mask, pred != 0, 0, "__any_sync");
}
inline int __all_sync(unsigned mask, int pred) {
  return (int)::dfemu::warp_collective(::dfemu::COLL_ALL, mask, pred != 0, 0, "__all_sync");
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return ::dfemu::shfl(mask, v, ::dfemu::src_idx((int)::dfemu::lane_id(), src, width),
                       "__shfl_sync");
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return ::dfemu::shfl(mask, v, ::dfemu::src_xor((int)::dfemu::lane_id(), lane_mask, width),
                       "__shfl_xor_sync");
}
template <typename T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::dfemu::shfl(mask, v, ::dfemu::src_up((int)::dfemu::lane_id(), delta, width),
                       "__shfl_up_sync");
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return ::dfemu::shfl(mask, v, ::dfemu::src_down((int)::dfemu::lane_id(), delta, width),
                       "__shfl_down_sync");
}
// Fences order memory between threads that run concurrently; fibers of one block never do,
// and blocks run one after another.
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_signal_fence(__ATOMIC_SEQ_CST); }

// Atomics: a block's fibers switch only at barriers, so a read-modify-write is never torn;
// blocks of one device run on one host thread.
template <typename T>
T atomicAdd(T *p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}
template <typename T>
T atomicSub(T *p, T v) {
  T old = *p;
  *p = old - v;
  return old;
}
template <typename T>
T atomicMax(T *p, T v) {
  T old = *p;
  *p = old < v ? v : old;
  return old;
}
template <typename T>
T atomicMin(T *p, T v) {
  T old = *p;
  *p = v < old ? v : old;
  return old;
}
template <typename T>
T atomicExch(T *p, T v) {
  T old = *p;
  *p = v;
  return old;
}
template <typename T>
T atomicCAS(T *p, T cmp, T v) {
  T old = *p;
  if (old == cmp) *p = v;
  return old;
}

// Fast-math intrinsics. __expf is ex2.approx(x * log2 e) on the hardware: the product is
// rounded to float first (its error grows with |x|); ex2.approx's own 2 ulp are not modelled.
inline float __expf(float x) { return exp2f(x * 1.4426950408889634f); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }

template <typename T>
inline T __ldg(const T *p) {
  return *p;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline unsigned __brev(unsigned x) {
  x = (x >> 1 & 0x55555555u) | (x & 0x55555555u) << 1;
  x = (x >> 2 & 0x33333333u) | (x & 0x33333333u) << 2;
  x = (x >> 4 & 0x0f0f0f0fu) | (x & 0x0f0f0f0fu) << 4;
  return __builtin_bswap32(x);
}

// ---- bfloat16 -----------------------------------------------------------------------------
struct __nv_bfloat16 {
  uint16_t __x;
};
typedef __nv_bfloat16 nv_bfloat16;
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = (uint32_t)b.__x << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// cvt.rn.bf16.f32: round to nearest even; every NaN becomes the canonical 0x7fff.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fff};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{(uint16_t)(u >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short v) { return __nv_bfloat16{v}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }

// ---- float8 e4m3 (fn: no infinities, NaN 0x7f / 0xff, max 448) ------------------------------
struct __nv_fp8_e4m3 {
  uint8_t __x;
  __nv_fp8_e4m3() = default;
  explicit __nv_fp8_e4m3(float f);
  explicit operator float() const;
};
namespace dfemu {
inline float e4m3_to_float(uint8_t v) {
  int sign = v >> 7, e = (v >> 3) & 0xf, man = v & 7;
  if (e == 15 && man == 7) return NAN;
  float f = e == 0 ? std::ldexp((float)man, -9) : std::ldexp(1.0f + man / 8.0f, e - 7);
  return sign ? -f : f;
}
// cvt.rn.satfinite.e4m3x2.f32: round to nearest even, finite values saturate at +-448.
inline uint8_t float_to_e4m3(float x) {
  if (std::isnan(x)) return 0x7f;
  uint8_t sign = std::signbit(x) ? 0x80 : 0;
  float a = std::fabs(x);
  if (a >= 448.0f) return sign | 0x7e;
  if (a == 0.0f) return sign;
  int e;
  std::frexp(a, &e);                                  // a = m 2^e, m in [0.5, 1): binade 2^(e-1)
  int ex = e - 1 < -6 ? -6 : e - 1;                   // below 2^-6: subnormals, steps of 2^-9
  int q = (int)std::nearbyint(std::ldexp(a, 3 - ex)); // half to even (default rounding)
  // Subnormal codes are q itself; a normal one is (ex + 7) << 3 | (q - 8), and q == 16
  // (rounded up into the next binade) lands on its code too.
  return (uint8_t)(sign | (((ex + 7) << 3) + q - 8));
}
} // namespace dfemu
inline __nv_fp8_e4m3::__nv_fp8_e4m3(float f) : __x(::dfemu::float_to_e4m3(f)) {}
inline __nv_fp8_e4m3::operator float() const { return ::dfemu::e4m3_to_float(__x); }

// ---- the runtime API -----------------------------------------------------------------------
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDeviceFunction = 98,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
};
typedef cudaError_t cudaError;
typedef dfemu::Stream *cudaStream_t;
#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)
enum { cudaStreamDefault = 0, cudaStreamNonBlocking = 1 };
namespace dfemu {
struct Event;
}
typedef dfemu::Event *cudaEvent_t;
enum { cudaEventDefault = 0, cudaEventBlockingSync = 1, cudaEventDisableTiming = 2 };
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};
enum { cudaHostAllocDefault = 0, cudaHostAllocPortable = 1, cudaHostAllocMapped = 2 };

struct cudaDeviceProp {
  char name[256];
  size_t totalGlobalMem, sharedMemPerBlock, sharedMemPerBlockOptin, sharedMemPerMultiprocessor;
  int regsPerBlock, warpSize, maxThreadsPerBlock, maxThreadsDim[3], maxGridSize[3];
  int multiProcessorCount, major, minor, clockRate, memoryClockRate, memoryBusWidth;
  int l2CacheSize, maxThreadsPerMultiProcessor;
};
enum cudaDeviceAttr {
  cudaDevAttrMaxThreadsPerBlock = 1,
  cudaDevAttrMaxSharedMemoryPerBlock = 8,
  cudaDevAttrWarpSize = 10,
  cudaDevAttrMultiProcessorCount = 16,
  cudaDevAttrComputeCapabilityMajor = 75,
  cudaDevAttrComputeCapabilityMinor = 76,
  cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();

cudaError_t cudaGetDeviceCount(int *count);
// Every pair of distinct emulated devices can access each other, unless DFLASH_EMU_P2P=0
// (a box whose GPUs have no P2P, as 8 RTX 5090s: what the trainer's start-up line flags).
cudaError_t cudaDeviceCanAccessPeer(int *can, int device, int peer);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);

cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags);
cudaError_t cudaFreeHost(void *p);
template <typename T>
cudaError_t cudaMalloc(T **p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void **>(p), bytes);
}
template <typename T>
cudaError_t cudaMallocHost(T **p, size_t bytes) {
  return cudaMallocHost(reinterpret_cast<void **>(p), bytes);
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void *p, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream = nullptr);

cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags = 0);

cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

cudaError_t cudaFuncSetAttribute(const void *func, cudaFuncAttribute attr, int value);
template <typename R, typename... P>
cudaError_t cudaFuncSetAttribute(R (*func)(P...), cudaFuncAttribute attr, int value) {
  return cudaFuncSetAttribute(reinterpret_cast<const void *>(func), attr, value);
}

// ---- emulator controls (tests) ---------------------------------------------------------------
namespace dfemu {
// The thread-order seed of this process (DFLASH_EMU_SEED, else drawn and printed once).
uint64_t seed();
// Set it (a test that runs one kernel under several orders); 0 restores the drawn seed.
void set_seed(uint64_t s);
// Number of kernels executed so far on this host thread's current device.
uint64_t kernels_run();
// Whether p points into a live device allocation, and its [base, size).
bool device_range(const void *p, const void **base, size_t *size);
} // namespace dfemu
