// Internals of the emulated CUDA device, shared by its implementation files.
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda_emu.h"

#if defined(__SANITIZE_ADDRESS__)
#define DFEMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DFEMU_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define DFEMU_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DFEMU_TSAN 1
#endif
#endif

namespace dfemu {

// The emulated architecture (DFLASH_EMU_ARCH=sm_90|sm_100|sm_120, default sm_90): the
// properties cudaGetDeviceProperties reports and the limits a launch is checked against.
// Figures: CUDA C Programming Guide (compute capabilities 9.0, 10.0, 12.0) and the cards'
// datasheets (see docs/gpu.md); `memory` is what the driver reports.
struct Arch {
  const char *name, *card; // "sm_120", "RTX PRO 6000 Blackwell"
  int major, minor, sms, clock_khz, mem_clock_khz, bus_bits;
  size_t smem_optin;  // dynamic + static shared memory per block, opted in
  size_t smem_per_sm; // shared memory per SM
  int regs_per_sm, regs_per_block, threads_per_sm;
  size_t l2, memory;
};
// The arch of this process (read once; an unknown name aborts naming the known ones).
const Arch &arch();
constexpr size_t kSmemDefault = 49152; // 48 KiB without cudaFuncAttributeMaxDynamicSharedMemorySize
constexpr size_t kSmemStatic = 49152;  // static __shared__ per block
constexpr unsigned kMaxThreads = 1024;
constexpr int kMaxDevices = 16;

// Diagnostics go to stderr, prefixed "cuda-emu: ".
void report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
// A kernel or API misuse the hardware would hang on or corrupt memory with: report it with
// the seed and abort.
[[noreturn]] void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
// Record `e` as this host thread's last error (cudaGetLastError) and return it.
cudaError_t fail(cudaError_t e);

uint64_t mix(uint64_t a, uint64_t b);
// The next launch's seed on `device`.
uint64_t launch_seed(int device);
enum class Order { RANDOM, FORWARD, REVERSE };
Order order(); // DFLASH_EMU_ORDER: random (default), forward, reverse

// ---- memory ---------------------------------------------------------------------------------
enum class Mem { DEVICE, PINNED };
struct Alloc {
  uintptr_t base;
  size_t size;
  int device;
  Mem kind;
};
// The live allocation holding byte p.
bool find_alloc(const void *p, Alloc *out);
// Whether [p, p + n) lies in one live device allocation (on `device`, or any when -1); if
// not, reports it naming `call` and `what`.
bool check_device(const void *p, size_t n, int device, const char *call, const char *what);
bool is_device(const void *p);
bool is_pinned(const void *p, size_t n);

// ---- streams --------------------------------------------------------------------------------
struct Op {
  virtual ~Op() = default;
  // Run the op, or as much as can run: true when it has finished. An op that waits for other
  // host threads (an NCCL collective) returns false until they have come.
  virtual bool step() = 0;
  // Block until step() may progress.
  virtual void wait() {}
  uint64_t id = 0;
};
struct Stream {
  int device = 0;
  bool legacy = false, nonblocking = false;
  std::mutex mu; // q, next_id, done_id
  std::recursive_mutex exec;
  std::deque<std::unique_ptr<Op>> q;
  uint64_t next_id = 1, done_id = 0;
};
int current_device();
// The stream a handle names (0, cudaStreamLegacy, cudaStreamPerThread: the current device's
// legacy stream), or nullptr when it is not a live stream.
Stream *resolve(cudaStream_t s);
// Queue `op` in stream order (work on the legacy stream waits for the blocking streams and
// the other way round); returns its id.
uint64_t enqueue(Stream *s, std::unique_ptr<Op> op);
template <typename F>
uint64_t enqueue_fn(Stream *s, F f) {
  struct FnOp : Op {
    F f;
    explicit FnOp(F g) : f(std::move(g)) {}
    bool step() override {
      f();
      return true;
    }
  };
  return enqueue(s, std::unique_ptr<Op>(new FnOp(std::move(f))));
}
// Run the queued work of s, through op `until` (0: all of it). block: wait for ops that
// wait on other threads; otherwise cudaErrorNotReady when one does.
cudaError_t drain(Stream *s, uint64_t until, bool block);
// What a call on the legacy stream waits for: the blocking streams and the legacy stream.
void drain_legacy(int device);
void drain_device(int device);

// ---- kernels (fiber.cpp) ----------------------------------------------------------------------
struct KernelRun {
  const char *name;
  const void *kernel;
  dim3 grid, block;
  size_t smem;
  KernelBody body;
  uint64_t seed;
  int device;
};
void run_kernel(const KernelRun &k);
// Static shared memory a kernel was seen to use (0 before its first run).
size_t known_static_smem(const void *kernel);
size_t dynamic_smem_limit(const void *kernel);
void note_kernel_run(int device);

} // namespace dfemu
