// The emulated CUDA runtime: devices, memory, copies, streams, events, launches.
//
// Stream model: work is queued, never run at once, and runs only when something forces it: a
// synchronisation of its stream, device or event, a query, a copy that must return with its
// data, or work on a stream that has to wait for it. This is the latest the hardware may run
// it, so code that reads a result without the synchronisation CUDA requires reads stale
// data here every time, not once in a thousand runs:
//   - cudaStreamNonBlocking streams do not synchronise with the legacy stream (stream 0),
//     so a cudaMemcpy or cudaMemset on the legacy stream runs before work still queued on a
//     non-blocking stream, and work queued on the legacy stream (cudaMemset, a cudaMemcpy
//     from pageable memory, which may return before its DMA has happened) is not seen by a
//     non-blocking stream until something drains the legacy stream;
//   - work on the legacy stream waits for the blocking streams and they wait for it;
//   - cudaMemcpyAsync to pageable host memory returns only once the copy has happened (so it
//     drains its stream), from pageable host memory it takes a copy of the source at the call;
//     with pinned memory both sides are read and written when the copy runs;
//   - cudaFree and cudaFreeHost synchronise the device.
// Device memory is host memory from posix_memalign, 0xff-poisoned (NaN) when allocated;
// every copy and memset is checked against the live allocations, so one that runs past an
// allocation is an error and a message, not a silent read. Without ASan a canary behind
// each allocation catches kernel writes past its end at cudaFree; under ASan the allocation
// is exact and ASan catches kernel reads and writes past it.
#include <sys/random.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <string>

#include "internal.h"

namespace dfemu {

const Arch &arch() {
  // H200 (9.0): 227 KiB per block of 228 per SM; B200 (10.0): the same shared memory, 148
  // SMs, 192 GB nominal (the reported figure a guess); RTX PRO 6000 Blackwell (12.0): 99 KiB
  // per block (101,376 B) of 100 per SM, 48 warps per SM, 97,887 MiB reported.
  static const Arch table[] = {
      {"sm_90", "H200", 9, 0, 132, 1980000, 2619000, 6144, 232448, 233472, 65536, 65536, 2048,
       50u << 20, 143771ull << 20},
      {"sm_100", "B200", 10, 0, 148, 1965000, 3996000, 8192, 232448, 233472, 65536, 65536, 2048,
       126u << 20, 183105ull << 20},
      {"sm_120", "RTX PRO 6000 Blackwell", 12, 0, 188, 2617000, 14000000, 512, 101376, 102400,
       65536, 65536, 1536, 128u << 20, 97887ull << 20},
  };
  static const Arch &a = []() -> const Arch & {
    const char *env = getenv("DFLASH_EMU_ARCH");
    if (!env || !*env) return table[0];
    for (const Arch &t : table)
      if (!strcmp(env, t.name)) return t;
    fatal("DFLASH_EMU_ARCH=%s: not an emulated architecture (sm_90, sm_100 or sm_120)", env);
  }();
  return a;
}


// ---- diagnostics, seed --------------------------------------------------------------------
namespace {
std::atomic<uint64_t> g_seed_override{0};
thread_local cudaError_t t_last = cudaSuccess;

uint64_t drawn_seed() {
  static const uint64_t s = [] {
    const char *env = getenv("DFLASH_EMU_SEED");
    uint64_t v = 0;
    if (env && *env) {
      v = strtoull(env, nullptr, 10);
    } else {
      if (getrandom(&v, sizeof v, 0) != (ssize_t)sizeof v)
        v = (uint64_t)std::chrono::steady_clock::now().time_since_epoch().count() ^
            ((uint64_t)getpid() << 32);
      v %= 1000000000000ull; // short enough to type
    }
    fprintf(stderr,
            "cuda-emu: thread-order seed %" PRIu64 " (DFLASH_EMU_SEED=%" PRIu64 " repeats it)\n", v,
            v);
    return v;
  }();
  return s;
}
} // namespace

uint64_t seed() {
  uint64_t o = g_seed_override.load();
  return o ? o : drawn_seed();
}
void set_seed(uint64_t s) { g_seed_override.store(s); }

void report(const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "cuda-emu: %s\n", msg);
}

void fatal(const char *fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr,
          "cuda-emu: FATAL: %s (thread-order seed %" PRIu64 ", DFLASH_EMU_SEED=%" PRIu64
          " repeats it)\n",
          msg, seed(), seed());
  fflush(stderr);
  abort();
}

void device_fault(const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fatal("device fault: %s", msg);
}

cudaError_t fail(cudaError_t e) {
  t_last = e;
  return e;
}

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

Order order() {
  static const Order o = [] {
    const char *env = getenv("DFLASH_EMU_ORDER");
    if (!env || !*env || !strcmp(env, "random")) return Order::RANDOM;
    if (!strcmp(env, "forward")) return Order::FORWARD;
    if (!strcmp(env, "reverse")) return Order::REVERSE;
    fprintf(stderr, "cuda-emu: DFLASH_EMU_ORDER=%s is not random, forward or reverse\n", env);
    return Order::RANDOM;
  }();
  return o;
}

// ---- devices ------------------------------------------------------------------------------
namespace {
struct Device {
  std::mutex mu; // streams, used
  Stream legacy;
  std::vector<Stream *> streams;
  size_t used = 0, peak = 0; // bytes of device memory allocated, now and at most
  std::atomic<uint64_t> launches{0}, kernels{0}, to_host{0}; // to_host: bytes copied D2H
  std::atomic<uint64_t> from_host{0}; // bytes copied H2D (pageable or pinned)
};

Device *devices() {
  static Device *d = [] {
    Device *v = new Device[kMaxDevices];
    for (int i = 0; i < kMaxDevices; i++) v[i].legacy.device = i, v[i].legacy.legacy = true;
    return v;
  }();
  return d;
}
Device &dev(int i) { return devices()[i]; }

int device_count() {
  static const int n = [] {
    const char *env = getenv("DFLASH_EMU_DEVICES");
    if (!env || !*env) return 1;
    long v = strtol(env, nullptr, 10);
    return v < 0 ? 0 : v > kMaxDevices ? kMaxDevices : (int)v;
  }();
  return n;
}

size_t device_memory() {
  static const size_t n = [] {
    const char *env = getenv("DFLASH_EMU_DEVICE_MEMORY");
    return env && *env ? (size_t)strtoull(env, nullptr, 10) : arch().memory;
  }();
  return n;
}

thread_local int t_device = 0;

std::mutex g_stream_mu;
std::set<Stream *> g_streams;
// Destroyed streams are kept, empty, until exit: another host thread (an emulated rank on the
// same device) may have copied the device's stream list and be about to drain one (TSan saw
// cudaStreamDestroy's delete race with drain_device's lock of that stream). Draining an empty
// stream returns at once. Reachable from here, so not a leak.
std::vector<std::unique_ptr<Stream>> g_dead_streams;


double now_ms() {
  return std::chrono::duration<double, std::milli>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
} // namespace

struct Event {
  Stream *s = nullptr; // the stream of the last record (nullptr: none, or it was destroyed)
  uint64_t op = 0;
  std::atomic<uint64_t> gen{0}, done_gen{0};
  double t_ms = 0;
  bool timing = true;
};
namespace {
std::mutex g_event_mu;
std::set<Event *> g_events;
} // namespace

int current_device() { return t_device; }

uint64_t launch_seed(int device) {
  return mix(seed(), mix((uint64_t)device, dev(device).launches++));
}

void note_kernel_run(int device) { dev(device).kernels++; }

uint64_t kernels_run() { return dev(t_device).kernels.load(); }

// ---- memory -------------------------------------------------------------------------------
namespace {
std::mutex g_mem_mu;
std::map<uintptr_t, Alloc> g_allocs;
#ifndef DFEMU_ASAN
constexpr size_t kCanary = 64;
constexpr unsigned char kCanaryByte = 0xa5;
#else
constexpr size_t kCanary = 0;
#endif

bool find_locked(uintptr_t p, Alloc *out) {
  auto it = g_allocs.upper_bound(p);
  if (it == g_allocs.begin()) return false;
  --it;
  if (p >= it->second.base + it->second.size) return false;
  *out = it->second;
  return true;
}
} // namespace

bool find_alloc(const void *p, Alloc *out) {
  std::lock_guard<std::mutex> g(g_mem_mu);
  return find_locked((uintptr_t)p, out);
}

bool is_device(const void *p) {
  Alloc a;
  return find_alloc(p, &a) && a.kind == Mem::DEVICE;
}

bool is_pinned(const void *p, size_t n) {
  Alloc a;
  return find_alloc(p, &a) && a.kind == Mem::PINNED && (uintptr_t)p + n <= a.base + a.size;
}

bool check_device(const void *p, size_t n, int device, const char *call, const char *what) {
  Alloc a;
  if (!find_alloc(p, &a) || a.kind != Mem::DEVICE) {
    report("%s: %s %p (%zu bytes) is not in any live device allocation", call, what, p, n);
    return false;
  }
  uintptr_t end = (uintptr_t)p + n;
  if (end > a.base + a.size || end < (uintptr_t)p) {
    report("%s: %s [%p, +%zu bytes) runs %zu bytes past the end of its %zu-byte device "
           "allocation at %p",
           call, what, p, n, (size_t)(end - (a.base + a.size)), a.size, (void *)a.base);
    return false;
  }
  if (device >= 0 && a.device != device) {
    report("%s: %s %p is memory of device %d, not of device %d", call, what, p, a.device, device);
    return false;
  }
  return true;
}

bool device_range(const void *p, const void **base, size_t *size) {
  Alloc a;
  if (!find_alloc(p, &a) || a.kind != Mem::DEVICE) return false;
  if (base) *base = (const void *)a.base;
  if (size) *size = a.size;
  return true;
}

// ---- streams ------------------------------------------------------------------------------
Stream *resolve(cudaStream_t s) {
  if (!s || s == cudaStreamLegacy || s == cudaStreamPerThread) return &dev(t_device).legacy;
  std::lock_guard<std::mutex> g(g_stream_mu);
  return g_streams.count(s) ? s : nullptr;
}

namespace {
std::vector<Stream *> streams_of(int device, bool blocking_only) {
  Device &d = dev(device);
  std::lock_guard<std::mutex> g(d.mu);
  std::vector<Stream *> v;
  for (Stream *s : d.streams)
    if (!blocking_only || !s->nonblocking) v.push_back(s);
  return v;
}
} // namespace

uint64_t enqueue(Stream *s, std::unique_ptr<Op> op) {
  if (s->legacy) {
    for (Stream *b : streams_of(s->device, true)) drain(b, 0, true);
  } else if (!s->nonblocking) {
    drain(&dev(s->device).legacy, 0, true);
  }
  std::lock_guard<std::mutex> g(s->mu);
  op->id = s->next_id++;
  uint64_t id = op->id;
  s->q.push_back(std::move(op));
  return id;
}

cudaError_t drain(Stream *s, uint64_t until, bool block) {
  std::lock_guard<std::recursive_mutex> ex(s->exec);
  for (;;) {
    Op *op;
    {
      std::lock_guard<std::mutex> g(s->mu);
      if (s->q.empty() || (until && s->q.front()->id > until)) return cudaSuccess;
      op = s->q.front().get();
    }
    while (!op->step()) {
      if (!block) return cudaErrorNotReady;
      op->wait();
    }
    std::unique_ptr<Op> done;
    {
      std::lock_guard<std::mutex> g(s->mu);
      s->done_id = op->id;
      done = std::move(s->q.front());
      s->q.pop_front();
    }
  }
}

void drain_legacy(int device) {
  drain(&dev(device).legacy, 0, true);
  for (Stream *b : streams_of(device, true)) drain(b, 0, true);
}

void drain_device(int device) {
  drain(&dev(device).legacy, 0, true);
  for (Stream *b : streams_of(device, false)) drain(b, 0, true);
}

// ---- launches -----------------------------------------------------------------------------
namespace {
struct KernelOp : Op {
  KernelRun k;
  explicit KernelOp(const KernelRun &r) : k(r) {}
  ~KernelOp() override { k.body.destroy(const_cast<void *>(k.body.args)); }
  bool step() override {
    run_kernel(k);
    return true;
  }
};
// dfemu_refuse_kernel: launches of the kernel a test named are refused.
std::mutex g_refuse_mu;
std::string g_refuse;
bool refused_by_test(const char *name) {
  std::lock_guard<std::mutex> g(g_refuse_mu);
  if (g_refuse.empty() || std::strncmp(name, g_refuse.c_str(), g_refuse.size())) return false;
  char next = name
      [g_refuse
           .size()]; // the whole identifier: "rmsnorm_backward" is not "rmsnorm_backward_dw_partial"
  return !(next == '_' || (next >= '0' && next <= '9') || (next >= 'a' && next <= 'z') ||
           (next >= 'A' && next <= 'Z'));
}
// A launch the hardware refuses: the error for cudaGetLastError, a line on stderr.
void refuse_launch(const char *name, KernelBody body, cudaError_t e, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void refuse_launch(const char *name, KernelBody body, cudaError_t e, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  report("launch of %s refused (%s): %s", name, cudaGetErrorName(e), msg);
  body.destroy(const_cast<void *>(body.args));
  fail(e);
}
} // namespace

void launch(const char *name, const void *kernel, dim3 grid, dim3 block, size_t smem,
            Stream *stream, KernelBody body) {
  KernelRun k{name, kernel, grid, block, smem, body, 0, 0};
#define refuse(...) refuse_launch(name, body, __VA_ARGS__)
  if (!device_count()) return refuse(cudaErrorNoDevice, "no device");
  unsigned long long nt = (unsigned long long)block.x * block.y * block.z;
  if (!block.x || !block.y || !block.z || block.x > 1024 || block.y > 1024 || block.z > 64 ||
      nt > kMaxThreads)
    return refuse(cudaErrorInvalidConfiguration,
                  "block (%u,%u,%u): at most 1024 threads, "
                  "(1024,1024,64) per dimension",
                  block.x, block.y, block.z);
  if (!grid.x || !grid.y || !grid.z || grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535)
    return refuse(cudaErrorInvalidConfiguration,
                  "grid (%u,%u,%u): each of x < 2^31, y, z <= "
                  "65535 and none 0",
                  grid.x, grid.y, grid.z);
  size_t lim = dynamic_smem_limit(kernel), st = known_static_smem(kernel);
  size_t optin = arch().smem_optin;
  if (smem > lim || smem + st > optin)
    return refuse(cudaErrorInvalidValue,
                  "%zu bytes of dynamic shared memory (limit %zu for "
                  "this kernel, %zu with %zu static at most on %s)",
                  smem, lim, optin - (st < optin ? st : optin), st, arch().name);
  if (refused_by_test(name))
    return refuse(cudaErrorLaunchOutOfResources,
                  "refused on request (dfemu_refuse_kernel), as "
                  "the hardware refuses a kernel that needs more registers than a block has");
  Stream *s = resolve(stream);
  if (!s)
    return refuse(cudaErrorInvalidResourceHandle, "stream %p is not a live stream", (void *)stream);
  if (s->device != t_device)
    return refuse(cudaErrorInvalidResourceHandle,
                  "its stream belongs to device %d but the "
                  "current device of this host thread is %d",
                  s->device, t_device);
  k.seed = launch_seed(s->device);
  k.device = s->device;
  enqueue(s, std::unique_ptr<Op>(new KernelOp(k)));
#undef refuse
}

} // namespace dfemu

using namespace dfemu;

// ---- errors -------------------------------------------------------------------------------
const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
  case cudaSuccess: return "cudaSuccess";
  case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
  case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
  case cudaErrorInitializationError: return "cudaErrorInitializationError";
  case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
  case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
  case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
  case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
  case cudaErrorNoDevice: return "cudaErrorNoDevice";
  case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
  case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
  case cudaErrorNotReady: return "cudaErrorNotReady";
  case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
  case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
  case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
  case cudaSuccess: return "no error";
  case cudaErrorInvalidValue: return "invalid argument";
  case cudaErrorMemoryAllocation: return "out of memory";
  case cudaErrorInitializationError: return "initialization error";
  case cudaErrorInvalidConfiguration: return "invalid configuration argument";
  case cudaErrorInvalidDeviceFunction: return "invalid device function";
  case cudaErrorInvalidDevicePointer: return "invalid device pointer";
  case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
  case cudaErrorNoDevice: return "no CUDA-capable device is detected";
  case cudaErrorInvalidDevice: return "invalid device ordinal";
  case cudaErrorInvalidResourceHandle: return "invalid resource handle";
  case cudaErrorNotReady: return "device not ready";
  case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
  case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
  case cudaErrorLaunchFailure: return "unspecified launch failure";
  }
  return "unknown error";
}

cudaError_t cudaGetLastError() {
  cudaError_t e = t_last;
  t_last = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return t_last; }

// ---- devices ------------------------------------------------------------------------------
cudaError_t cudaGetDeviceCount(int *count) {
  if (!count) return fail(cudaErrorInvalidValue);
  *count = device_count();
  return *count ? cudaSuccess : fail(cudaErrorNoDevice);
}

cudaError_t cudaDeviceCanAccessPeer(int *can, int device, int peer) {
  if (!can) return fail(cudaErrorInvalidValue);
  int n = device_count();
  if (device < 0 || device >= n || peer < 0 || peer >= n) return fail(cudaErrorInvalidDevice);
  const char *env = getenv("DFLASH_EMU_P2P");
  *can = device != peer && !(env && !strcmp(env, "0"));
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (!device_count()) return fail(cudaErrorNoDevice);
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
  if (!device) return fail(cudaErrorInvalidValue);
  if (!device_count()) return fail(cudaErrorNoDevice);
  *device = t_device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int device) {
  if (!p) return fail(cudaErrorInvalidValue);
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice);
  std::memset(p, 0, sizeof *p);
  const Arch &a = arch();
  snprintf(p->name, sizeof p->name, "cuda-emu %s (%s limits)", a.name, a.card);
  p->totalGlobalMem = device_memory();
  p->sharedMemPerBlock = kSmemDefault;
  p->sharedMemPerBlockOptin = a.smem_optin;
  p->sharedMemPerMultiprocessor = a.smem_per_sm;
  p->regsPerBlock = a.regs_per_block;
  p->warpSize = 32;
  p->maxThreadsPerBlock = 1024;
  p->maxThreadsDim[0] = 1024, p->maxThreadsDim[1] = 1024, p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647, p->maxGridSize[1] = 65535, p->maxGridSize[2] = 65535;
  p->multiProcessorCount = a.sms;
  p->major = a.major, p->minor = a.minor;
  p->clockRate = a.clock_khz;
  p->memoryClockRate = a.mem_clock_khz;
  p->memoryBusWidth = a.bus_bits;
  p->l2CacheSize = (int)a.l2;
  p->maxThreadsPerMultiProcessor = a.threads_per_sm;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
  cudaDeviceProp p;
  cudaError_t e = cudaGetDeviceProperties(&p, device);
  if (e || !value) return e ? e : fail(cudaErrorInvalidValue);
  switch (attr) {
  case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
  case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)p.sharedMemPerBlock; break;
  case cudaDevAttrWarpSize: *value = 32; break;
  case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
  case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
  case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
  case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)p.sharedMemPerBlockOptin; break;
  default: return fail(cudaErrorInvalidValue);
  }
  return cudaSuccess;
}

// Host waits, for tests that a path does not wait per sequence (dfemu_sync_counts).
static std::atomic<uint64_t> g_stream_syncs{0}, g_event_syncs{0}, g_device_syncs{0};

cudaError_t cudaDeviceSynchronize() {
  g_device_syncs++;
  if (!device_count()) return fail(cudaErrorNoDevice);
  drain_device(t_device);
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
  if (!free_bytes || !total_bytes) return fail(cudaErrorInvalidValue);
  if (!device_count()) return fail(cudaErrorNoDevice);
  Device &d = dev(t_device);
  std::lock_guard<std::mutex> g(d.mu);
  *total_bytes = device_memory();
  *free_bytes = device_memory() - d.used;
  return cudaSuccess;
}

// ---- memory -------------------------------------------------------------------------------
cudaError_t cudaMalloc(void **p, size_t bytes) {
  if (!p) return fail(cudaErrorInvalidValue);
  if (!device_count()) return fail(cudaErrorNoDevice);
  *p = nullptr;
  if (!bytes) return cudaSuccess;
  Device &d = dev(t_device);
  {
    std::lock_guard<std::mutex> g(d.mu);
    if (bytes > device_memory() - d.used) return fail(cudaErrorMemoryAllocation);
    d.used += bytes;
    if (d.used > d.peak) d.peak = d.used;
  }
  void *q = nullptr;
  if (bytes > SIZE_MAX - kCanary - 256 || posix_memalign(&q, 256, bytes + kCanary)) {
    std::lock_guard<std::mutex> g(d.mu);
    d.used -= bytes;
    return fail(cudaErrorMemoryAllocation);
  }
  std::memset(q, 0xff, bytes); // fresh device memory reads as NaN
#ifndef DFEMU_ASAN
  std::memset((char *)q + bytes, kCanaryByte, kCanary);
#endif
  {
    std::lock_guard<std::mutex> g(g_mem_mu);
    g_allocs[(uintptr_t)q] = Alloc{(uintptr_t)q, bytes, t_device, Mem::DEVICE};
  }
  *p = q;
  return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
  if (!p) return cudaSuccess;
  Alloc a;
  {
    std::lock_guard<std::mutex> g(g_mem_mu);
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end() || it->second.kind != Mem::DEVICE) {
      report("cudaFree(%p): not the start of a live device allocation", p);
      return fail(cudaErrorInvalidValue);
    }
    a = it->second;
  }
  drain_device(a.device); // cudaFree waits for the device
#ifndef DFEMU_ASAN
  for (size_t i = 0; i < kCanary; i++)
    if (((unsigned char *)p)[a.size + i] != kCanaryByte)
      fatal("device memory written past the end of the %zu-byte allocation at %p (byte %zu "
            "behind it): a kernel wrote out of bounds",
            a.size, p, i);
#endif
  {
    std::lock_guard<std::mutex> g(g_mem_mu);
    g_allocs.erase((uintptr_t)p);
  }
  {
    Device &d = dev(a.device);
    std::lock_guard<std::mutex> g(d.mu);
    d.used -= a.size;
  }
  free(p);
  return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **p, size_t bytes, unsigned flags) {
  (void)flags;
  if (!p) return fail(cudaErrorInvalidValue);
  *p = nullptr;
  void *q = nullptr;
  if (posix_memalign(&q, 4096, bytes ? bytes : 1)) return fail(cudaErrorMemoryAllocation);
  std::memset(q, 0xff, bytes);
  {
    std::lock_guard<std::mutex> g(g_mem_mu);
    g_allocs[(uintptr_t)q] = Alloc{(uintptr_t)q, bytes ? bytes : 1, -1, Mem::PINNED};
  }
  *p = q;
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t bytes) { return cudaHostAlloc(p, bytes, 0); }

cudaError_t cudaFreeHost(void *p) {
  if (!p) return cudaSuccess;
  {
    std::lock_guard<std::mutex> g(g_mem_mu);
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end() || it->second.kind != Mem::PINNED) {
      report("cudaFreeHost(%p): not the start of a live pinned allocation", p);
      return fail(cudaErrorInvalidValue);
    }
  }
  for (int d = 0; d < device_count(); d++) drain_device(d); // work may still read it
  {
    std::lock_guard<std::mutex> g(g_mem_mu);
    g_allocs.erase((uintptr_t)p);
  }
  free(p);
  return cudaSuccess;
}

// ---- copies and memsets -------------------------------------------------------------------
namespace {
enum class Side { PAGEABLE, PINNED, DEVICE };

// Where each end of a copy lives; false (after a message) when the kind contradicts the
// pointers or a device range runs past its allocation.
bool sides(void *dst, const void *src, size_t n, cudaMemcpyKind kind, const char *call, Side *ds,
           Side *ss) {
  auto side_of = [&](const void *p, bool want_dev, bool any, const char *what, Side *out) {
    Alloc a;
    bool found = find_alloc(p, &a);
    if (found && a.kind == Mem::DEVICE) {
      if (!any && !want_dev) {
        report("%s: the %s %p is device memory, but the copy kind says host", call, what, p);
        return false;
      }
      *out = Side::DEVICE;
      return check_device(p, n, -1, call, what);
    }
    if (!any && want_dev) {
      report("%s: the %s %p is not device memory (a freed or host pointer), but the copy kind "
             "says device",
             call, what, p);
      return false;
    }
    if (found && a.kind == Mem::PINNED && (uintptr_t)p + n > a.base + a.size) {
      report("%s: the %s [%p, +%zu bytes) runs past the end of its %zu-byte pinned allocation",
             call, what, p, n, a.size);
      return false;
    }
    *out = found ? Side::PINNED : Side::PAGEABLE;
    return true;
  };
  bool any = kind == cudaMemcpyDefault;
  if (kind < cudaMemcpyHostToHost || kind > cudaMemcpyDefault) {
    report("%s: copy kind %d", call, (int)kind);
    return false;
  }
  bool dev_dst = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  bool dev_src = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  return side_of(dst, dev_dst, any, "destination", ds) && side_of(src, dev_src, any, "source", ss);
}

// Copy `n` bytes now, or take the source now and copy it later (pageable host source).
struct CopyOp : Op {
  void *dst;
  const void *src;
  size_t n;
  std::vector<unsigned char> staged;
  bool step() override {
    std::memmove(dst, staged.empty() ? src : staged.data(), n);
    return true;
  }
};
std::unique_ptr<Op> copy_op(void *dst, const void *src, size_t n, bool stage) {
  auto *op = new CopyOp();
  op->dst = dst, op->src = src, op->n = n;
  if (stage) op->staged.assign((const unsigned char *)src, (const unsigned char *)src + n);
  return std::unique_ptr<Op>(op);
}
} // namespace

cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
  if (!n) return cudaSuccess;
  if (!device_count()) return fail(cudaErrorNoDevice);
  Side ds, ss;
  if (!dst || !src || !sides(dst, src, n, kind, "cudaMemcpy", &ds, &ss))
    return fail(cudaErrorInvalidValue);
  Stream *legacy = resolve(nullptr);
  if (ss == Side::DEVICE && ds != Side::DEVICE) dev(legacy->device).to_host += n;
  if (ds == Side::DEVICE && ss != Side::DEVICE) dev(legacy->device).from_host += n;
  if (ds == Side::DEVICE && ss == Side::DEVICE) {
    enqueue(legacy, copy_op(dst, src, n, false)); // no host-side synchronisation
  } else if (ds == Side::DEVICE && ss == Side::PAGEABLE) {
    // The legacy stream first; the call returns once the source is staged, the DMA to the
    // device may still be pending.
    drain_legacy(legacy->device);
    enqueue(legacy, copy_op(dst, src, n, true));
  } else {
    drain_legacy(legacy->device); // to host, or from pinned memory: synchronous
    std::memmove(dst, src, n);
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (!n) return cudaSuccess;
  if (!device_count()) return fail(cudaErrorNoDevice);
  Stream *s = resolve(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  Side ds, ss;
  if (!dst || !src || !sides(dst, src, n, kind, "cudaMemcpyAsync", &ds, &ss))
    return fail(cudaErrorInvalidValue);
  if (ss == Side::DEVICE && ds != Side::DEVICE) dev(s->device).to_host += n;
  if (ds == Side::DEVICE && ss != Side::DEVICE) dev(s->device).from_host += n;
  if (ds == Side::PAGEABLE && ss == Side::DEVICE) {
    // To pageable memory: returns only once the copy has happened.
    uint64_t id = enqueue(s, copy_op(dst, src, n, false));
    drain(s, id, true);
  } else if (ds != Side::DEVICE && ss != Side::DEVICE) {
    uint64_t id = enqueue(s, copy_op(dst, src, n, false)); // host to host: synchronous
    drain(s, id, true);
  } else {
    enqueue(s, copy_op(dst, src, n, ss == Side::PAGEABLE));
  }
  return cudaSuccess;
}

namespace {
bool memset_target(void *p, size_t n, const char *call, bool *pinned) {
  *pinned = false;
  if (!p) {
    report("%s: null pointer", call);
    return false;
  }
  Alloc a;
  if (find_alloc(p, &a) && a.kind == Mem::PINNED && (uintptr_t)p + n <= a.base + a.size)
    return *pinned = true;
  return check_device(p, n, -1, call, "target");
}
} // namespace

cudaError_t cudaMemset(void *p, int value, size_t n) {
  if (!n) return cudaSuccess;
  if (!device_count()) return fail(cudaErrorNoDevice);
  bool pinned;
  if (!memset_target(p, n, "cudaMemset", &pinned)) return fail(cudaErrorInvalidValue);
  Stream *legacy = resolve(nullptr);
  if (pinned) { // synchronous for pinned host memory
    drain_legacy(legacy->device);
    std::memset(p, value, n);
  } else { // queued on the legacy stream: asynchronous to the host
    enqueue_fn(legacy, [p, value, n] { std::memset(p, value, n); });
  }
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t n, cudaStream_t stream) {
  if (!n) return cudaSuccess;
  if (!device_count()) return fail(cudaErrorNoDevice);
  Stream *s = resolve(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  bool pinned;
  if (!memset_target(p, n, "cudaMemsetAsync", &pinned)) return fail(cudaErrorInvalidValue);
  enqueue_fn(s, [p, value, n] { std::memset(p, value, n); });
  return cudaSuccess;
}

// ---- streams ------------------------------------------------------------------------------
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *out, unsigned flags) {
  if (!out) return fail(cudaErrorInvalidValue);
  if (!device_count()) return fail(cudaErrorNoDevice);
  if (flags & ~1u) return fail(cudaErrorInvalidValue);
  Stream *s = new Stream();
  s->device = t_device;
  s->nonblocking = flags & cudaStreamNonBlocking;
  {
    Device &d = dev(t_device);
    std::lock_guard<std::mutex> g(d.mu);
    d.streams.push_back(s);
  }
  {
    std::lock_guard<std::mutex> g(g_stream_mu);
    g_streams.insert(s);
  }
  *out = s;
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t *out) {
  return cudaStreamCreateWithFlags(out, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  Stream *s = resolve(stream);
  if (!s || s->legacy) return fail(cudaErrorInvalidResourceHandle);
  drain(s, 0, true); // its work completes before its resources go
  {
    std::lock_guard<std::mutex> g(g_stream_mu);
    g_streams.erase(s);
  }
  {
    Device &d = dev(s->device);
    std::lock_guard<std::mutex> g(d.mu);
    for (size_t i = 0; i < d.streams.size(); i++)
      if (d.streams[i] == s) d.streams.erase(d.streams.begin() + (long)i), i--;
  }
  {
    std::lock_guard<std::mutex> g(g_event_mu);
    for (auto *e : g_events)
      if (e->s == s) e->s = nullptr;
  }
  std::lock_guard<std::mutex> g(g_stream_mu);
  g_dead_streams.emplace_back(s);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  g_stream_syncs++;
  Stream *s = resolve(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  if (s->legacy) drain_legacy(s->device);
  else drain(s, 0, true);
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  Stream *s = resolve(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  cudaError_t e = drain(s, 0, false);
  if (!e && s->legacy)
    for (Stream *b : streams_of(s->device, true))
      if ((e = drain(b, 0, false))) break;
  return e; // cudaErrorNotReady is not an error: the last error stays
}

// ---- events -------------------------------------------------------------------------------
namespace {
Event *event_of(cudaEvent_t e) {
  std::lock_guard<std::mutex> g(g_event_mu);
  return g_events.count((Event *)e) ? (Event *)e : nullptr;
}
} // namespace

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *out, unsigned flags) {
  if (!out) return fail(cudaErrorInvalidValue);
  if (!device_count()) return fail(cudaErrorNoDevice);
  auto *e = new dfemu::Event();
  e->timing = !(flags & cudaEventDisableTiming);
  {
    std::lock_guard<std::mutex> g(g_event_mu);
    g_events.insert(e);
  }
  *out = (cudaEvent_t)e;
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *out) { return cudaEventCreateWithFlags(out, 0); }

cudaError_t cudaEventDestroy(cudaEvent_t ev) {
  Event *e = event_of(ev);
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  if (e->s) drain(e->s, e->op, true); // its marker still points at it
  {
    std::lock_guard<std::mutex> g(g_event_mu);
    g_events.erase(e);
  }
  delete e;
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t ev, cudaStream_t stream) {
  Event *e = event_of(ev);
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  Stream *s = resolve(stream);
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  uint64_t gen = ++e->gen;
  e->op = enqueue_fn(s, [e, gen] {
    e->t_ms = now_ms();
    e->done_gen.store(gen);
  });
  e->s = s;
  return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t ev) {
  g_event_syncs++;
  Event *e = event_of(ev);
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  if (e->s) drain(e->s, e->op, true);
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t ev) {
  Event *e = event_of(ev);
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  if (e->s && drain(e->s, e->op, false)) return cudaErrorNotReady;
  return e->done_gen.load() == e->gen.load() ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
  Event *x = event_of(a), *y = event_of(b);
  if (!ms) return fail(cudaErrorInvalidValue);
  if (!x || !y || !x->timing || !y->timing || !x->gen || !y->gen)
    return fail(cudaErrorInvalidResourceHandle);
  if (x->done_gen.load() != x->gen.load() || y->done_gen.load() != y->gen.load())
    return cudaErrorNotReady;
  *ms = (float)(y->t_ms - x->t_ms);
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t ev, unsigned flags) {
  (void)flags;
  Stream *s = resolve(stream);
  Event *e = event_of(ev);
  if (!s || !e) return fail(cudaErrorInvalidResourceHandle);
  if (!e->s) return cudaSuccess; // never recorded: nothing to wait for
  struct WaitOp : Op {
    Stream *other;
    uint64_t until;
    bool step() override { return drain(other, until, false) == cudaSuccess; }
    void wait() override { drain(other, until, true); }
  };
  auto *op = new WaitOp();
  op->other = e->s;
  op->until = e->op;
  enqueue(s, std::unique_ptr<Op>(op));
  return cudaSuccess;
}

// ---- test controls with C linkage (tests/gpu/*.c) -----------------------------------------
extern "C" void dfemu_refuse_kernel(const char *name) {
  std::lock_guard<std::mutex> g(g_refuse_mu);
  g_refuse = name ? name : "";
}

extern "C" void dfemu_sync_counts(uint64_t *stream_syncs, uint64_t *event_syncs,
                                  uint64_t *device_syncs, int reset) {
  if (stream_syncs) *stream_syncs = g_stream_syncs.load();
  if (event_syncs) *event_syncs = g_event_syncs.load();
  if (device_syncs) *device_syncs = g_device_syncs.load();
  if (reset) g_stream_syncs = 0, g_event_syncs = 0, g_device_syncs = 0;
}

extern "C" uint64_t dfemu_from_host_bytes(int device, int reset) {
  Device &d = dev(device);
  uint64_t n = d.from_host.load();
  if (reset) d.from_host = 0;
  return n;
}

extern "C" void dfemu_memory_stats(int device, size_t *used, size_t *peak, uint64_t *to_host,
                                   int reset) {
  Device &d = dev(device);
  std::lock_guard<std::mutex> g(d.mu);
  if (used) *used = d.used;
  if (peak) *peak = d.peak;
  if (to_host) *to_host = d.to_host.load();
  if (reset) d.peak = d.used, d.to_host = 0;
}
