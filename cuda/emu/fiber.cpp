// The emulated device's execution of a kernel: blocks one after another in a shuffled
// order, each block's CUDA threads on fibers of the host thread that drains the stream.
//
// Why fibers: a block is up to 1024 threads that meet at barriers; with one host thread per
// CUDA thread every barrier costs a round of futex wake-ups and the order is the OS's, not
// ours. Fibers switch in a few nanoseconds (x86-64: our own register switch, no signal-mask
// system call as in swapcontext), the order in which they run is drawn from a seeded
// generator, and a block's threads never run at the same time, so the emulator itself needs
// no locks and ASan/UBSan see ordinary single-threaded code.
//
// The scheduler keeps the block's runnable threads (not started yet, or waiting no more); it
// picks one at random and runs it until it reaches __syncthreads, a warp collective or its
// end, then picks again. A thread that has not started runs as a plain call on the fiber
// that picked it (a "runner"), so threads that never wait cost no switch at all; one that
// waits keeps its runner until it is picked again. When every live thread waits at the
// same __syncthreads they are all released; a warp collective completes when every live lane
// named in its mask has arrived. Nothing runnable and nobody to release is a deadlock (a
// warp op or barrier that not every thread reaches), threads at two different barriers are
// divergent code: both reported with the seed.
#include <pthread.h>
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
#ifdef DFEMU_TSAN
// ThreadSanitizer's fiber interface (tsan_interface.h): each runner is a fiber to TSan, and
// a switch synchronises, as the runners of one block never run at the same time.
extern "C" {
void *__tsan_get_current_fiber(void);
void *__tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void *fiber);
void __tsan_switch_to_fiber(void *fiber, unsigned flags);
}
#endif

// DFEMU_UCONTEXT: the portable switch on x86-64 too (to test it).
#if defined(__x86_64__) && !defined(DFEMU_UCONTEXT)
#define DFEMU_X86_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace dfemu {

namespace {

// ---- context switch -------------------------------------------------------------------------
#ifdef DFEMU_X86_SWITCH
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
  sp[1] = 0;               // r15
  sp[2] = 0;               // r14
  sp[3] = (uint64_t)entry; // r13
  sp[4] = (uint64_t)arg;   // r12
  sp[5] = 0;               // rbx
  sp[6] = 0;               // rbp
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
  makecontext(&c->uc, reinterpret_cast<void (*)()>(uc_entry), 4, (unsigned)e, (unsigned)(e >> 32),
              (unsigned)a, (unsigned)(a >> 32));
}
inline void ctx_swap(Context *from, Context *to) { swapcontext(&from->uc, &to->uc); }
#endif

// ---- runners ----------------------------------------------------------------------------
// A runner is a fiber with its own stack whose loop picks the next CUDA thread to run. An
// unstarted thread runs as a plain call on the runner that picked it, so a thread that never
// waits costs a function call, not a context switch. A thread that waits (a barrier, a warp
// op) keeps its runner; the next pick goes on another runner (a parked one, or a new one),
// or switches straight to the runner of the suspended thread it picked.
#ifdef DFEMU_ASAN
constexpr size_t kStack = 256 << 10;
#else
constexpr size_t kStack = 64 << 10;
#endif

struct Runner {
  Context ctx;
  void *tsan = nullptr;
  char *map = nullptr, *stack = nullptr; // the mapping (a guard page first) and the stack
  int assigned = -1;                     // an unstarted thread to run when resumed
};

enum State : uint8_t { UNSTARTED, RUNNING, RUNNABLE, AT_BARRIER, IN_WARP_OP, DONE };

// A cp.async in flight: done when its commit group is waited for (group == ~0u: not yet
// committed).
struct AsyncCopy {
  void *dst;
  const void *src;
  unsigned bytes, group;
};

struct Thread {
  uint3 idx{};
  std::vector<AsyncCopy> async; // this thread's cp.async not yet waited for
  unsigned groups = 0;          // commit groups so far
  unsigned tid = 0;
  State state = UNSTARTED;
  Runner *host = nullptr;         // the runner holding its stack once started
  const char *bar_file = nullptr; // the __syncthreads it waits at
  int bar_line = 0;
};

struct Warp {
  unsigned live = 0; // lanes that exist and have not exited
  bool pending = false;
  Coll kind = COLL_SYNCWARP;
  unsigned mask = 0, arrived = 0;
  const char *what = "";
  LanesFn lanes_fn = nullptr; // COLL_LANES: runs once with every lane's argument
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
  // Drawn per block under RANDOM: prefer the lanes of the warp that ran last, so one warp
  // can run far ahead of the others (through many warp ops) while another thread has not
  // yet finished the segment before a barrier - the race a missing barrier between a plain
  // loop and warp-level work (WMMA) opens, which picking every thread uniformly rarely shows.
  bool sticky = false;
  unsigned last_warp = 0;
  unsigned nthreads = 0, alive = 0, at_barrier = 0;
  const Thread *bar_first = nullptr; // the first thread at the __syncthreads, while at_barrier
  uint3 block{};
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  std::vector<unsigned> runnable;
  std::vector<unsigned> pos;   // pos[tid]: its index in runnable while it is there
  std::vector<unsigned> ready; // ready[w]: the lanes of warp w in runnable (a bit each)
  Thread *cur = nullptr;
  Rng rng{0};
  char *dyn = nullptr;
  std::vector<SharedSlot> shared;
  size_t static_bytes = 0;
};
thread_local Exec *t_exec;

// The host thread's side: its own context while a block runs, and its runners.
struct Host {
  Context ctx;
  Runner *cur = nullptr; // the runner executing now (nullptr: the host itself)
  std::vector<Runner *> all, parked;
  const void *stack_bottom = nullptr;
  size_t stack_size = 0;
  void *tsan = nullptr;
  unsigned tsan_gen = 0; // g_fork_gen when `tsan` was taken
  ~Host() {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (Runner *r : all) {
#ifdef DFEMU_TSAN
      __tsan_destroy_fiber(r->tsan);
#endif
#ifdef DFEMU_ASAN
      // ASan leaves the redzones of the frames that ran on this stack poisoned; a later
      // mmap that gets these pages back (the NCCL segment, a cudaMallocHost) would then
      // read as a stack-buffer-underflow.
      ASAN_UNPOISON_MEMORY_REGION(r->map, kStack + page);
#endif
      munmap(r->map, kStack + page);
      delete r;
    }
  }
};
thread_local Host t_host;

#ifdef DFEMU_TSAN
// fork() makes the child's thread a new thread to TSan: the host fiber taken in the parent
// and the parent's parked runners are not this thread's any more (using them made TSan see
// the death tests' children race with themselves). A child takes its own.
unsigned g_fork_gen = 1;
void on_fork_child() { g_fork_gen++; }
const int g_atfork = pthread_atfork(nullptr, nullptr, on_fork_child);
#endif

std::mutex g_kernel_mu;
std::map<const void *, size_t> g_static_smem; // per kernel, once seen
std::map<const void *, size_t> g_dyn_limit;   // cudaFuncAttributeMaxDynamicSharedMemorySize

// Switch from the running context to `to` (a runner, or the host when nullptr).
void switch_to(Runner *to) {
  Runner *from = t_host.cur;
  Context *fc = from ? &from->ctx : &t_host.ctx, *tc = to ? &to->ctx : &t_host.ctx;
  t_host.cur = to;
#ifdef DFEMU_TSAN
  __tsan_switch_to_fiber(to ? to->tsan : t_host.tsan, 0);
#endif
#ifdef DFEMU_ASAN
  void *fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, to ? to->stack : t_host.stack_bottom,
                                 to ? kStack : t_host.stack_size);
  ctx_swap(fc, tc);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  ctx_swap(fc, tc);
#endif
  t_host.cur = from;
}

void runner_loop(Runner *r);

void runner_entry(void *arg) {
#ifdef DFEMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
  runner_loop((Runner *)arg);
  fatal("a runner left its loop");
}

Runner *get_runner() {
#ifdef DFEMU_TSAN
  // First on this thread, or first in a forked child: run_block calls this from the host
  // before its first switch, so the current fiber is the host's.
  if (t_host.tsan_gen != g_fork_gen) {
    t_host.tsan = __tsan_get_current_fiber();
    t_host.tsan_gen = g_fork_gen;
    t_host.parked.clear(); // the parent's runners: left alone, never resumed here
  }
#endif
  if (!t_host.parked.empty()) {
    Runner *r = t_host.parked.back();
    t_host.parked.pop_back();
    return r;
  }
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  void *p = mmap(nullptr, kStack + page, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) fatal("cannot map a fiber stack (%zu bytes)", kStack + page);
  mprotect(p, page, PROT_NONE); // a stack overflow faults instead of corrupting a neighbour
  Runner *r = new Runner();
  r->map = (char *)p;
  r->stack = (char *)p + page;
  ctx_make(&r->ctx, r->stack, kStack, runner_entry, r);
#ifdef DFEMU_TSAN
  r->tsan = __tsan_create_fiber(0);
#endif
  t_host.all.push_back(r);
  return r;
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
  unsigned n[6] = {0, 0, 0, 0, 0, 0};
  for (auto &t : e->threads) n[t.state]++;
  fatal("kernel %s, block (%u,%u,%u) of (%u,%u,%u), %u threads: %s [threads not started %u, "
        "runnable %u, at __syncthreads %u, in a warp op %u, done %u]",
        e->k->name, e->block.x, e->block.y, e->block.z, e->k->grid.x, e->k->grid.y, e->k->grid.z,
        e->nthreads, msg, n[UNSTARTED], n[RUNNABLE], n[AT_BARRIER], n[IN_WARP_OP], n[DONE]);
}

void make_runnable(Exec *e, Thread *t) {
  t->state = RUNNABLE;
  e->ready[t->tid / 32] |= 1u << t->tid % 32;
  e->pos[t->tid] = (unsigned)e->runnable.size();
  e->runnable.push_back(t->tid);
}

// The next thread to run (taken off the runnable list), or -1 when the block is done. All
// live threads at __syncthreads (and at the same one) release it.
int pick(Exec *e) {
  for (;;) {
    if (!e->runnable.empty()) break;
    if (!e->alive) return -1;
    if (e->at_barrier != e->alive)
      block_fatal(e, "deadlock: no thread can run (a __syncthreads or warp op that not every "
                     "thread reaches)");
    // Every waiting thread is at the same __syncthreads: syncthreads checks each on arrival.
    for (auto &t : e->threads)
      if (t.state == AT_BARRIER) make_runnable(e, &t);
    e->at_barrier = 0;
    // Which warp runs ahead after a barrier is drawn, not the last one to arrive (that
    // would always let the warp that finished first before the barrier go last after it).
    e->last_warp = e->rng.below(e->warps.size());
  }
  size_t i = 0, n = e->runnable.size();
  if (e->ord == Order::RANDOM && e->sticky) {
    // One of the runnable lanes of last_warp (waiting, or unstarted), the k-th from lane 0.
    unsigned lanes = e->ready[e->last_warp], same = (unsigned)__builtin_popcount(lanes);
    if (same) {
      for (unsigned k = e->rng.below(same); k; k--) lanes &= lanes - 1;
      i = e->pos[e->last_warp * 32 + (unsigned)__builtin_ctz(lanes)];
    } else {
      i = e->rng.below(n);
    }
  } else if (e->ord == Order::RANDOM) {
    i = e->rng.below(n);
  } else { // lowest (forward) or highest (reverse) thread first
    for (size_t j = 1; j < n; j++)
      if ((e->runnable[j] < e->runnable[i]) == (e->ord == Order::FORWARD)) i = j;
  }
  unsigned t = e->runnable[i];
  e->last_warp = t / 32;
  e->ready[t / 32] &= ~(1u << t % 32);
  e->runnable[i] = e->runnable[n - 1];
  e->pos[e->runnable[i]] = (unsigned)i;
  e->runnable.pop_back();
  return (int)t;
}

void became_current(Exec *e, Thread *t) {
  t->state = RUNNING;
  e->cur = t;
  t_coords.thread = t->idx;
}

// The warp op finishes when every live lane of its mask has arrived.
void try_complete(Exec *e, Warp &w, unsigned warp_no) {
  if (!w.pending || (w.arrived & w.live) != (w.mask & w.live)) return;
  unsigned who = w.mask & w.live;
  if (w.kind == COLL_LANES) {
    // WMMA's fragment ops are warp-wide: a lane that exited or does not exist (a partial
    // warp) never reaches them, and the hardware hangs or computes garbage.
    if (who != 0xffffffffu)
      block_fatal(e,
                  "%s in warp %u is reached by lanes 0x%08x only (lanes that exited or do "
                  "not exist: 0x%08x): every lane of the warp must call it",
                  w.what, warp_no, w.arrived, ~w.live);
    void *args[32];
    for (unsigned l = 0; l < 32; l++) args[l] = (void *)(uintptr_t)w.val[l];
    w.lanes_fn(args, w.what);
  }
  uint64_t ballot = 0;
  for (unsigned l = 0; l < 32; l++)
    if (who >> l & 1) ballot |= (uint64_t)(w.val[l] != 0) << l;
  for (unsigned l = 0; l < 32; l++) {
    if (!(who >> l & 1)) continue;
    switch (w.kind) {
    case COLL_SHFL: {
      // From a lane that does not take part (outside the mask, exited, or beyond a partial
      // warp) the hardware returns an undefined value: poison (NaN, -1), so code that uses
      // it unguarded computes garbage visibly, and code that guards its use is fine.
      int s = w.src[l];
      w.res[l] = s >= 0 && s < 32 && (who >> s & 1) ? w.val[s] : ~0ull;
      break;
    }
    case COLL_BALLOT: w.res[l] = ballot; break;
    case COLL_ANY: w.res[l] = ballot != 0; break;
    case COLL_ALL: w.res[l] = ballot == who; break;
    case COLL_SYNCWARP:
    case COLL_LANES: w.res[l] = 0; break;
    }
  }
  w.pending = false;
  w.arrived = 0;
  for (unsigned l = 0; l < 32; l++)
    if (who >> l & 1) {
      Thread &t = e->threads[warp_no * 32 + l];
      if (t.state == IN_WARP_OP) make_runnable(e, &t);
    }
}

// A thread from its start to its end, on runner r.
void run_thread(Exec *e, Runner *r, unsigned tid) {
  Thread *t = &e->threads[tid];
  t->host = r;
  t->async.clear();
  t->groups = 0;
  became_current(e, t);
  e->k->body.run(e->k->body.args);
  e = t_exec;
  // The PTX ISA leaves a copy into shared memory undefined once its CTA may have exited, and
  // a thread that exits without cp.async.wait_group lets its CTA do so with copies in flight:
  // a fault here, where the hardware would write into memory another CTA may already own.
  if (!t->async.empty())
    device_fault("thread (%u,%u,%u) of block (%u,%u,%u) of %s exited with %zu cp.async copies in "
                 "flight (no cp.async.wait_group after them)",
                 t->idx.x, t->idx.y, t->idx.z, e->block.x, e->block.y, e->block.z, e->k->name,
                 t->async.size());
  t->state = DONE;
  e->cur = nullptr;
  e->alive--;
  unsigned w = t->tid / 32, lane = t->tid % 32;
  Warp &wp = e->warps[w];
  wp.live &= ~(1u << lane);
  if (wp.pending && (wp.mask >> lane & 1)) try_complete(e, wp, w);
}

void runner_loop(Runner *r) {
  for (;;) {
    Exec *e = t_exec;
    if (r->assigned >= 0) {
      unsigned t = (unsigned)r->assigned;
      r->assigned = -1;
      run_thread(e, r, t);
      continue;
    }
    int t = pick(e);
    if (t < 0) { // the block is done: back to the host, parked
      t_host.parked.push_back(r);
      switch_to(nullptr);
      continue;
    }
    Thread &th = e->threads[(size_t)t];
    if (!th.host) {
      r->assigned = t;
      continue;
    }
    t_host.parked.push_back(r); // free: its stack holds no thread
    switch_to(th.host);
  }
}

// The running thread waits (its state says for what); returns when it runs again.
void wait_here(Exec *e, Thread *self) {
  int t = pick(e);
  if (t < 0) fatal("a block finished while one of its threads waits");
  Thread &nx = e->threads[(size_t)t];
  if (&nx == self) {
    became_current(e, self);
    return;
  }
  if (!nx.host) {
    Runner *w = get_runner();
    w->assigned = t;
    switch_to(w);
  } else {
    switch_to(nx.host);
  }
  became_current(t_exec, self);
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
  e->runnable.resize(n);
  e->pos.resize(n);
  e->ready.resize(e->warps.size());
  for (unsigned t = 0; t < n; t++) {
    Thread &th = e->threads[t];
    th.tid = t;
    th.idx = uint3{t % k.block.x, t / k.block.x % k.block.y, t / (k.block.x * k.block.y)};
    th.state = UNSTARTED;
    th.host = nullptr;
    e->runnable[t] = t;
    e->pos[t] = t;
  }
  for (unsigned w = 0; w * 32 < n; w++) {
    Warp &wp = e->warps[w];
    unsigned lanes = n - w * 32 >= 32 ? 32 : n - w * 32;
    wp.live = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
    e->ready[w] = wp.live;
    wp.pending = false;
    wp.arrived = 0;
  }
  e->alive = n;
  e->at_barrier = 0;
  e->cur = nullptr;
  e->sticky = e->ord == Order::RANDOM && e->rng.below(4) == 0; // a quarter: it costs switches
  e->last_warp = e->rng.below(e->warps.size());
  switch_to(get_runner()); // returns when the block is done
}

} // namespace

void syncthreads(const char *file, int line) {
  Exec *e = exec_or_die("__syncthreads");
  Thread *t = e->cur;
  // Checked on arrival against the first thread waiting, so pick releases them without a
  // second pass over the block (a strcmp per thread per barrier).
  const Thread *first = e->at_barrier ? e->bar_first : nullptr;
  if (first &&
      (line != first->bar_line || (file != first->bar_file && strcmp(file, first->bar_file))))
    block_fatal(e,
                "threads wait at different barriers: thread %u at __syncthreads %s:%d, "
                "thread %u at %s:%d (a barrier in divergent code)",
                first->tid, first->bar_file, first->bar_line, t->tid, file, line);
  if (!first) e->bar_first = t;
  t->state = AT_BARRIER;
  t->bar_file = file;
  t->bar_line = line;
  e->at_barrier++;
  wait_here(e, t);
}

unsigned lane_id() { return exec_or_die("a warp intrinsic")->cur->tid % 32; }

unsigned active_mask() {
  Exec *e = exec_or_die("__activemask");
  return e->warps[e->cur->tid / 32].live;
}

namespace {
uint64_t arrive(Coll kind, unsigned mask, uint64_t value, int src, const char *what, LanesFn fn) {
  Exec *e = exec_or_die(what);
  Thread *t = e->cur;
  unsigned w = t->tid / 32, lane = t->tid % 32;
  Warp &wp = e->warps[w];
  if (!(mask >> lane & 1))
    block_fatal(e, "thread %u (warp %u lane %u) calls %s with mask 0x%08x, which leaves it out",
                t->tid, w, lane, what, mask);
  if (!wp.pending) {
    wp.pending = true;
    wp.kind = kind;
    wp.mask = mask;
    wp.what = what;
    wp.lanes_fn = fn;
    wp.arrived = 0;
  } else if (wp.kind != kind || wp.mask != mask ||
             (kind == COLL_LANES && (wp.lanes_fn != fn || strcmp(wp.what, what)))) {
    block_fatal(e,
                "warp %u lane %u calls %s with mask 0x%08x while lanes 0x%08x wait in %s "
                "with mask 0x%08x",
                w, lane, what, mask, wp.arrived, wp.what, wp.mask);
  }
  wp.val[lane] = value;
  wp.src[lane] = src;
  wp.arrived |= 1u << lane;
  t->state = IN_WARP_OP;
  // The last lane to arrive completes the op, which makes every lane (itself too) runnable;
  // then it waits like the others, so which lane goes on first is drawn as well.
  try_complete(e, wp, w);
  wait_here(e, t);
  return wp.res[lane];
}
} // namespace

uint64_t warp_collective(Coll kind, unsigned mask, uint64_t value, int src, const char *what) {
  return arrive(kind, mask, value, src, what, nullptr);
}

void warp_all_lanes(LanesFn fn, void *arg, const char *what) {
  arrive(COLL_LANES, 0xffffffffu, (uint64_t)(uintptr_t)arg, 0, what, fn);
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
    block_fatal(e, "%zu bytes of static shared memory (the hardware allows %zu)", e->static_bytes,
                kSmemStatic);
  if (e->static_bytes + e->k->smem > arch().smem_optin)
    block_fatal(e,
                "%zu bytes of static and %zu of dynamic shared memory: more than the %zu "
                "a block can have on %s (the launch fails on the hardware)",
                e->static_bytes, e->k->smem, arch().smem_optin, arch().name);
  return p;
}

bool in_shared(const void *p, size_t n) {
  Exec *e = exec_or_die("shared memory check");
  auto inside = [p, n](const char *base, size_t size) {
    return (const char *)p >= base && (const char *)p + n <= base + size;
  };
  if (inside(e->dyn, e->k->smem)) return true;
  for (auto &sl : e->shared)
    if (inside(sl.mem, sl.size)) return true;
  return false;
}

void cp_async(void *dst, const void *src, unsigned bytes) {
  Exec *e = exec_or_die("cp.async");
  if (bytes != 4 && bytes != 8 && bytes != 16)
    device_fault("cp.async of %u bytes (4, 8 or 16)", bytes);
  if ((uintptr_t)dst % bytes || (uintptr_t)src % bytes)
    device_fault("cp.async: %u-byte copy %p <- %p not aligned to its size", bytes, dst, src);
  if (!in_shared(dst, bytes))
    device_fault("cp.async: destination %p is not in the block's shared memory", dst);
  if (!is_device(src)) device_fault("cp.async: source %p is not device memory", src);
  std::memset(dst, 0xff, bytes); // unreadable until waited for
  e->cur->async.push_back(AsyncCopy{dst, src, bytes, ~0u});
}

void cp_async_commit() {
  Thread *t = exec_or_die("cp.async.commit_group")->cur;
  for (AsyncCopy &c : t->async)
    if (c.group == ~0u) c.group = t->groups;
  t->groups++;
}

void cp_async_wait(unsigned n) {
  Thread *t = exec_or_die("cp.async.wait_group")->cur;
  unsigned upto = t->groups > n ? t->groups - n : 0; // groups [0, upto) complete
  size_t kept = 0;
  for (AsyncCopy &c : t->async) {
    if (c.group != ~0u && c.group < upto) std::memcpy(c.dst, c.src, c.bytes);
    else t->async[kept++] = c;
  }
  t->async.resize(kept);
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
  e.threads.resize(e.nthreads);
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
#ifdef DFEMU_ASAN
  if (!t_host.stack_bottom) { // where the host's own stack lies, for ASan's fiber switches
    pthread_attr_t at;
    void *lo = nullptr;
    size_t sz = 0;
    if (!pthread_getattr_np(pthread_self(), &at)) {
      pthread_attr_getstack(&at, &lo, &sz);
      pthread_attr_destroy(&at);
    }
    t_host.stack_bottom = lo, t_host.stack_size = sz;
  }
#endif
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

} // namespace dfemu

// cudaFuncSetAttribute lives here, beside the limits the launch checks.
cudaError_t cudaFuncSetAttribute(const void *func, cudaFuncAttribute attr, int value) {
  using namespace dfemu;
  if (!func) return fail(cudaErrorInvalidDeviceFunction);
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    // The hardware refuses more than the opt-in maximum less the kernel's static shared memory.
    if (value < 0 || (size_t)value + known_static_smem(func) > arch().smem_optin)
      return fail(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> g(g_kernel_mu);
    g_dyn_limit[func] = (size_t)value;
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout)
    return value < -1 || value > 100 ? fail(cudaErrorInvalidValue) : cudaSuccess;
  return fail(cudaErrorInvalidValue);
}
