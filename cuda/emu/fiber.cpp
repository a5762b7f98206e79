// The emulated device's execution of a kernel: blocks one after another in a shuffled
// order, each block's CUDA threads as fibers on the host thread that drains the stream.
//
// Why fibers: a block is up to 1024 threads that meet at barriers; with one host thread per
// CUDA thread every barrier costs a round of futex wake-ups and the order is the OS's, not
// ours. Fibers switch in a few nanoseconds (x86-64: our own register switch, no signal-mask
// system call as in swapcontext), the order in which they run is drawn from a seeded
// generator, and a block's threads never run at the same time, so the emulator itself needs
// no locks and ASan/UBSan see ordinary single-threaded code.
//
// The scheduler keeps the block's runnable fibers; it picks one at random, runs it until it
// reaches __syncthreads, a warp collective or its end, and picks again. When every live
// thread waits at __syncthreads they are all released; a warp collective completes when
// every live lane named in its mask has arrived. Nothing runnable and nobody releasable is a
// deadlock (a barrier in divergent code): reported with the seed.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>

#include "internal.h"

#ifdef DFEMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace dfemu {

thread_local Coords t_coords;

namespace {

// ---- context switch -------------------------------------------------------------------------
#if defined(__x86_64__)
extern "C" void dfemu_ctx_switch(void **save_sp, void *new_sp);
extern "C" void dfemu_ctx_start();
// Callee-saved registers, MXCSR and the x87 control word: what the System V ABI asks a
// function to preserve. A new fiber "returns" into dfemu_ctx_start with its entry in r13 and
// argument in r12.
asm(R"(
  .text
  .p2align 4
  .globl dfemu_ctx_switch
  .hidden dfemu_ctx_switch
  .type dfemu_ctx_switch, @function
dfemu_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size dfemu_ctx_switch, .-dfemu_ctx_switch
  .p2align 4
  .globl dfemu_ctx_start
  .hidden dfemu_ctx_start
  .type dfemu_ctx_start, @function
dfemu_ctx_start:
  movq %r12, %rdi
  andq $-16, %rsp
  callq *%r13
  ud2
  .size dfemu_ctx_start, .-dfemu_ctx_start
)");

struct Context {
  void *sp = nullptr;
};
void ctx_make(Context *c, char *stack, size_t size, void (*entry)(void *), void *arg) {
  uintptr_t top = ((uintptr_t)stack + size) & ~(uintptr_t)15;
  uint64_t *sp = (uint64_t *)top - 8;
  uint32_t csr[2];
  asm volatile("stmxcsr %0; fnstcw %1" : "=m"(csr[0]), "=m"(csr[1]));
  std::memcpy(&sp[0], csr, 8);
  sp[1] = 0;                    // r15
  sp[2] = 0;                    // r14
  sp[3] = (uint64_t)entry;      // r13
  sp[4] = (uint64_t)arg;        // r12
  sp[5] = 0;                    // rbx
  sp[6] = 0;                    // rbp
  sp[7] = (uint64_t)&dfemu_ctx_start;
  c->sp = sp;
}
inline void ctx_swap(Context *from, Context *to) { dfemu_ctx_switch(&from->sp, to->sp); }
#else
struct Context {
  ucontext_t uc;
};
void uc_entry(unsigned e0, unsigned e1, unsigned a0, unsigned a1) {
  auto fn = reinterpret_cast<void (*)(void *)>(((uint64_t)e1 << 32) | e0);
  fn(reinterpret_cast<void *>(((uint64_t)a1 << 32) | a0));
}
void ctx_make(Context *c, char *stack, size_t size, void (*entry)(void *), void *arg) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack;
  c->uc.uc_stack.ss_size = size;
  c->uc.uc_link = nullptr;
  // makecontext passes ints: the pointers travel in halves.
  uint64_t a = (uintptr_t)arg, e = (uintptr_t)entry;
  makecontext(&c->uc, reinterpret_cast<void (*)()>(uc_entry), 4, (unsigned)e,
              (unsigned)(e >> 32), (unsigned)a, (unsigned)(a >> 32));
}
inline void ctx_swap(Context *from, Context *to) { swapcontext(&from->uc, &to->uc); }
#endif

// ---- fiber stacks ---------------------------------------------------------------------------
#ifdef DFEMU_ASAN
constexpr size_t kStack = 256 << 10;
#else
constexpr size_t kStack = 64 << 10;
#endif

// kMaxThreads stacks with a guard page below each, mapped once per host thread.
struct StackPool {
  char *base = nullptr;
  size_t page = 0, stride = 0;
  ~StackPool() {
    if (base) munmap(base, stride * kMaxThreads);
  }
  char *get(unsigned i) {
    if (!base) {
      page = (size_t)sysconf(_SC_PAGESIZE);
      stride = kStack + page;
      void *p = mmap(nullptr, stride * kMaxThreads, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p == MAP_FAILED) fatal("cannot map %u fiber stacks", kMaxThreads);
      base = (char *)p;
      for (unsigned t = 0; t < kMaxThreads; t++) mprotect(base + t * stride, page, PROT_NONE);
    }
    return base + i * stride + page;
  }
};
thread_local StackPool t_stacks;

// ---- a block in flight ----------------------------------------------------------------------
enum State : uint8_t { RUNNABLE, AT_BARRIER, IN_WARP_OP, DONE };

struct Fiber {
  Context ctx;
  char *stack = nullptr;
  void *asan_fake = nullptr;
  uint3 idx{};
  unsigned tid = 0;
  State state = RUNNABLE;
};

struct Warp {
  unsigned live = 0; // lanes that exist and have not exited
  bool pending = false;
  Coll kind = COLL_SYNCWARP;
  unsigned mask = 0, arrived = 0;
  const char *what = "";
  uint64_t val[32], res[32];
  int src[32];
};

struct Rng {
  uint64_t s;
  uint64_t next() {
    s += 0x9e3779b97f4a7c15ull;
    uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  unsigned below(size_t n) { return (unsigned)(((unsigned __int128)next() * n) >> 64); }
};

struct SharedSlot {
  const void *tag;
  char *mem;
  size_t size;
};

struct Exec {
  const KernelRun *k = nullptr;
  Order ord = Order::RANDOM;
  unsigned nthreads = 0, alive = 0, at_barrier = 0;
  uint3 block{};
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  std::vector<unsigned> runnable;
  Fiber *cur = nullptr;
  Context sched;
  void *sched_fake = nullptr;
  const void *sched_bottom = nullptr;
  size_t sched_size = 0;
  Rng rng{0};
  char *dyn = nullptr;
  std::vector<SharedSlot> shared;
  size_t static_bytes = 0;
};
thread_local Exec *t_exec;

std::mutex g_kernel_mu;
std::map<const void *, size_t> g_static_smem; // per kernel, once seen
std::map<const void *, size_t> g_dyn_limit;   // cudaFuncAttributeMaxDynamicSharedMemorySize

void asan_start(void **fake, const void *bottom, size_t size) {
#ifdef DFEMU_ASAN
  __sanitizer_start_switch_fiber(fake, bottom, size);
#else
  (void)fake, (void)bottom, (void)size;
#endif
}
void asan_finish(void *fake, const void **bottom, size_t *size) {
#ifdef DFEMU_ASAN
  __sanitizer_finish_switch_fiber(fake, bottom, size);
#else
  (void)fake, (void)bottom, (void)size;
#endif
}

Exec *exec_or_die(const char *what) {
  Exec *e = t_exec;
  if (!e || !e->cur) fatal("%s called outside a kernel", what);
  return e;
}

[[noreturn]] void block_fatal(Exec *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void block_fatal(Exec *e, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  unsigned n[4] = {0, 0, 0, 0};
  for (auto &f : e->fibers) n[f.state]++;
  fatal("kernel %s, block (%u,%u,%u) of (%u,%u,%u), %u threads: %s [threads runnable %u, at "
        "__syncthreads %u, in a warp op %u, done %u]",
        e->k->name, e->block.x, e->block.y, e->block.z, e->k->grid.x, e->k->grid.y,
        e->k->grid.z, e->nthreads, msg, n[RUNNABLE], n[AT_BARRIER], n[IN_WARP_OP], n[DONE]);
}

void make_runnable(Exec *e, Fiber *f) {
  f->state = RUNNABLE;
  e->runnable.push_back(f->tid);
}

// From a fiber back to the scheduler; returns when the scheduler runs it again.
void yield(Exec *e, Fiber *f, bool final) {
  asan_start(final ? nullptr : &f->asan_fake, e->sched_bottom, e->sched_size);
  ctx_swap(&f->ctx, &e->sched);
  asan_finish(f->asan_fake, nullptr, nullptr);
}

// The warp op finishes when every live lane of its mask has arrived.
void try_complete(Exec *e, Warp &w, unsigned warp_no) {
  if (!w.pending || (w.arrived & w.live) != (w.mask & w.live)) return;
  unsigned who = w.mask & w.live;
  uint64_t ballot = 0;
  for (unsigned l = 0; l < 32; l++)
    if (who >> l & 1) ballot |= (uint64_t)(w.val[l] != 0) << l;
  for (unsigned l = 0; l < 32; l++) {
    if (!(who >> l & 1)) continue;
    switch (w.kind) {
      case COLL_SHFL: {
        int s = w.src[l];
        if (s < 0 || s > 31 || !(who >> s & 1))
          block_fatal(e, "warp %u lane %u: %s reads lane %d, which is not taking part (mask "
                      "0x%08x, live lanes 0x%08x): the value is undefined",
                      warp_no, l, w.what, s, w.mask, w.live);
        w.res[l] = w.val[s];
        break;
      }
      case COLL_BALLOT: w.res[l] = ballot; break;
      case COLL_ANY: w.res[l] = ballot != 0; break;
      case COLL_ALL: w.res[l] = ballot == who; break;
      case COLL_SYNCWARP: w.res[l] = 0; break;
    }
  }
  w.pending = false;
  w.arrived = 0;
  for (unsigned l = 0; l < 32; l++)
    if (who >> l & 1) {
      Fiber &f = e->fibers[warp_no * 32 + l];
      if (f.state == IN_WARP_OP) make_runnable(e, &f);
    }
}

void fiber_main(void *arg) {
  Exec *e = (Exec *)arg;
  asan_finish(nullptr, &e->sched_bottom, &e->sched_size);
  e->k->body.run(e->k->body.args);
  Fiber *f = e->cur;
  f->state = DONE;
  e->alive--;
  unsigned w = f->tid / 32, lane = f->tid % 32;
  Warp &wp = e->warps[w];
  wp.live &= ~(1u << lane);
  if (wp.pending && (wp.mask >> lane & 1)) try_complete(e, wp, w);
  yield(e, f, true);
  fatal("a finished fiber was resumed");
}

void poison_shared(Exec *e) {
  if (e->k->smem) std::memset(e->dyn, 0xff, e->k->smem);
  for (auto &s : e->shared) std::memset(s.mem, 0xff, s.size);
}

void run_block(Exec *e) {
  const KernelRun &k = *e->k;
  unsigned n = e->nthreads;
  t_coords.block = e->block;
  poison_shared(e);
  e->runnable.clear();
  for (unsigned t = 0; t < n; t++) {
    Fiber &f = e->fibers[t];
    f.tid = t;
    f.idx = uint3{t % k.block.x, t / k.block.x % k.block.y, t / (k.block.x * k.block.y)};
    f.state = RUNNABLE;
    f.asan_fake = nullptr;
    f.stack = t_stacks.get(t);
    ctx_make(&f.ctx, f.stack, kStack, fiber_main, e);
    e->runnable.push_back(t);
  }
  for (unsigned w = 0; w * 32 < n; w++) {
    Warp &wp = e->warps[w];
    unsigned lanes = n - w * 32 >= 32 ? 32 : n - w * 32;
    wp.live = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
    wp.pending = false;
    wp.arrived = 0;
  }
  e->alive = n;
  e->at_barrier = 0;
  for (;;) {
    if (e->runnable.empty()) {
      if (!e->alive) break;
      if (e->at_barrier == e->alive) {
        for (auto &f : e->fibers)
          if (f.state == AT_BARRIER) make_runnable(e, &f);
        e->at_barrier = 0;
        continue;
      }
      block_fatal(e, "deadlock: no thread can run (a __syncthreads or warp op that not every "
                     "thread reaches)");
    }
    size_t pick = e->ord == Order::RANDOM ? e->rng.below(e->runnable.size()) : 0;
    if (e->ord != Order::RANDOM) { // lowest (forward) or highest (reverse) thread first
      for (size_t i = 1; i < e->runnable.size(); i++)
        if ((e->runnable[i] < e->runnable[pick]) == (e->ord == Order::FORWARD)) pick = i;
    }
    unsigned t = e->runnable[pick];
    e->runnable[pick] = e->runnable.back();
    e->runnable.pop_back();
    Fiber *f = &e->fibers[t];
    e->cur = f;
    t_coords.thread = f->idx;
    asan_start(&e->sched_fake, f->stack, kStack);
    ctx_swap(&e->sched, &f->ctx);
    asan_finish(e->sched_fake, nullptr, nullptr);
    e->cur = nullptr;
  }
}

}  // namespace

void syncthreads() {
  Exec *e = exec_or_die("__syncthreads");
  Fiber *f = e->cur;
  f->state = AT_BARRIER;
  e->at_barrier++;
  yield(e, f, false);
}

unsigned lane_id() { return exec_or_die("a warp intrinsic")->cur->tid % 32; }

unsigned active_mask() {
  Exec *e = exec_or_die("__activemask");
  return e->warps[e->cur->tid / 32].live;
}

uint64_t warp_collective(Coll kind, unsigned mask, uint64_t value, int src, const char *what) {
  Exec *e = exec_or_die(what);
  Fiber *f = e->cur;
  unsigned w = f->tid / 32, lane = f->tid % 32;
  Warp &wp = e->warps[w];
  if (!(mask >> lane & 1))
    block_fatal(e, "thread %u (warp %u lane %u) calls %s with mask 0x%08x, which leaves it out",
                f->tid, w, lane, what, mask);
  if (!wp.pending) {
    wp.pending = true;
    wp.kind = kind;
    wp.mask = mask;
    wp.what = what;
    wp.arrived = 0;
  } else if (wp.kind != kind || wp.mask != mask) {
    block_fatal(e, "warp %u lane %u calls %s with mask 0x%08x while lanes 0x%08x wait in %s "
                "with mask 0x%08x", w, lane, what, mask, wp.arrived, wp.what, wp.mask);
  }
  wp.val[lane] = value;
  wp.src[lane] = src;
  wp.arrived |= 1u << lane;
  f->state = IN_WARP_OP;
  // The last lane to arrive completes the op, which makes every lane (itself too) runnable;
  // then it yields like the others, so which lane goes on first is drawn as well.
  try_complete(e, wp, w);
  yield(e, f, false);
  return wp.res[lane];
}

void *static_shared(const void *tag, size_t bytes, size_t align) {
  Exec *e = exec_or_die("shared memory");
  for (auto &s : e->shared)
    if (s.tag == tag) return s.mem;
  void *p = nullptr;
  if (posix_memalign(&p, align < 16 ? 16 : align, bytes ? bytes : 1))
    fatal("out of host memory for shared memory");
  std::memset(p, 0xff, bytes);
  e->shared.push_back(SharedSlot{tag, (char *)p, bytes});
  e->static_bytes += bytes;
  if (e->static_bytes > kSmemStatic)
    block_fatal(e, "%zu bytes of static shared memory (the hardware allows %zu)",
                e->static_bytes, kSmemStatic);
  if (e->static_bytes + e->k->smem > kSmemOptin)
    block_fatal(e, "%zu bytes of static and %zu of dynamic shared memory: more than the %zu "
                "a block can have (the launch fails on the hardware)", e->static_bytes,
                e->k->smem, kSmemOptin);
  return p;
}

void *dynamic_shared() { return exec_or_die("dynamic shared memory")->dyn; }

size_t known_static_smem(const void *kernel) {
  std::lock_guard<std::mutex> g(g_kernel_mu);
  auto it = g_static_smem.find(kernel);
  return it == g_static_smem.end() ? 0 : it->second;
}

size_t dynamic_smem_limit(const void *kernel) {
  std::lock_guard<std::mutex> g(g_kernel_mu);
  auto it = g_dyn_limit.find(kernel);
  return it == g_dyn_limit.end() ? kSmemDefault : it->second;
}

void run_kernel(const KernelRun &k) {
  if (t_exec) fatal("kernel %s launched from inside kernel %s", k.name, t_exec->k->name);
  Exec e;
  e.k = &k;
  e.ord = order();
  e.rng.s = k.seed;
  e.nthreads = k.block.x * k.block.y * k.block.z;
  e.fibers.resize(e.nthreads);
  e.warps.resize((e.nthreads + 31) / 32);
  void *dyn = nullptr;
  if (posix_memalign(&dyn, 128, k.smem ? k.smem : 1)) fatal("out of host memory");
  e.dyn = (char *)dyn;
  t_coords.bdim = k.block;
  t_coords.gdim = k.grid;
  size_t nb = (size_t)k.grid.x * k.grid.y * k.grid.z;
  std::vector<uint32_t> order_of(nb);
  for (size_t i = 0; i < nb; i++) order_of[i] = (uint32_t)i;
  if (e.ord == Order::RANDOM)
    for (size_t i = nb; i > 1; i--) std::swap(order_of[i - 1], order_of[e.rng.below(i)]);
  else if (e.ord == Order::REVERSE)
    for (size_t i = 0; i < nb / 2; i++) std::swap(order_of[i], order_of[nb - 1 - i]);
  t_exec = &e;
  for (size_t i = 0; i < nb; i++) {
    uint32_t b = order_of[i];
    e.block = uint3{b % k.grid.x, b / k.grid.x % k.grid.y, b / (k.grid.x * k.grid.y)};
    run_block(&e);
  }
  t_exec = nullptr;
  {
    std::lock_guard<std::mutex> g(g_kernel_mu);
    g_static_smem[k.kernel] = e.static_bytes;
  }
  for (auto &s : e.shared) free(s.mem);
  free(dyn);
  note_kernel_run(k.device);
}

}  // namespace dfemu

// cudaFuncSetAttribute lives here, beside the limits the launch checks.
cudaError_t cudaFuncSetAttribute(const void *func, cudaFuncAttribute attr, int value) {
  using namespace dfemu;
  if (!func) return fail(cudaErrorInvalidDeviceFunction);
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    // The hardware refuses more than the opt-in maximum less the kernel's static shared memory.
    if (value < 0 || (size_t)value + known_static_smem(func) > kSmemOptin)
      return fail(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> g(g_kernel_mu);
    g_dyn_limit[func] = (size_t)value;
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout)
    return value < -1 || value > 100 ? fail(cudaErrorInvalidValue) : cudaSuccess;
  return fail(cudaErrorInvalidValue);
}
