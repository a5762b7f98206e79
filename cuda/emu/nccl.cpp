// The emulated NCCL: communicators whose ranks are host threads or processes of one machine,
// and all-reduce, reduce-scatter, all-gather and broadcast in stream order.
//
// The ranks of an id meet in a POSIX shared-memory segment named by the id (created by the
// first to come, unlinked once all have joined), each on its own device ordinal, as NCCL
// requires of the GPUs of one node: two ranks on one device are ncclInvalidUsage ("Duplicate
// GPU"). A collective is queued on its stream like a kernel; when the stream reaches it, the
// rank works through its send buffer in windows: it copies a window into its slot of the
// segment, waits for every rank (a counting barrier), computes its own part of the result
// from all slots, and waits again before the slots are reused. Until the other ranks come,
// the stream is not ready (cudaStreamQuery says cudaErrorNotReady, a synchronisation waits),
// so a rank that never comes shows as the hang (or the backend's timeout) it is on real
// hardware. Every rank reduces in rank order 0..n-1 in the element type's own arithmetic
// (bf16: fp32 rounded back after each rank), so results are deterministic and equal on all
// ranks; NCCL's ring order is not modelled. The first window checks that every rank called
// the same collective with the same count, type, op and root (NCCL would hang or corrupt
// memory otherwise): an abort naming both calls.
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>

#include "include/nccl.h"
#include "internal.h"

namespace dfemu {

namespace {
constexpr int kMaxRanks = 64;
constexpr size_t kWindow = 1 << 20; // bytes of each rank's send buffer per round
constexpr size_t kHeader = 64 << 10;

struct Desc {
  int kind; // 0 all-reduce, 1 reduce-scatter, 2 all-gather, 3 broadcast
  int type, op, root;
  size_t count;
  uint64_t seq;
};
const char *kind_name(int k) {
  static const char *n[] = {"ncclAllReduce", "ncclReduceScatter", "ncclAllGather", "ncclBroadcast"};
  return k >= 0 && k < 4 ? n[k] : "?";
}

// The segment: this header, then one kWindow slot per rank.
struct Shared {
  std::atomic<uint32_t> state; // 0 fresh (zero-filled), 1 being initialised, 2 ready
  int32_t nranks;
  pthread_mutex_t mu; // joining, and waiting at barriers
  pthread_cond_t cv;
  int32_t joined, unlinked, failed;
  uint64_t members; // bit per rank that joined
  int32_t device[kMaxRanks];
  std::atomic<uint64_t> arrivals; // barrier k completes at (k + 1) * nranks arrivals
  Desc desc[kMaxRanks];
};
static_assert(sizeof(Shared) <= kHeader, "NCCL segment header");

struct IdBody {
  char magic[8];
  uint64_t key;
};
constexpr char kMagic[8] = {'d', 'f', 'e', 'm', 'u', 'n', 'c', 'l'};

double timeout_s() {
  const char *env = getenv("DFLASH_EMU_NCCL_TIMEOUT");
  return env && *env ? atof(env) : 300.0;
}

void seg_name(uint64_t key, char *out, size_t n) {
  snprintf(out, n, "/dfemu-nccl-%016" PRIx64, key);
}

// A robust process-shared mutex: a rank that died holding it does not block the others.
void lock(Shared *s) {
  if (pthread_mutex_lock(&s->mu) == EOWNERDEAD) pthread_mutex_consistent(&s->mu);
}
void unlock(Shared *s) { pthread_mutex_unlock(&s->mu); }
// Wait on the condition for at most ms milliseconds.
void timed_wait(Shared *s, int ms) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += (long)ms * 1000000L;
  ts.tv_sec += ts.tv_nsec / 1000000000L;
  ts.tv_nsec %= 1000000000L;
  if (pthread_cond_timedwait(&s->cv, &s->mu, &ts) == EOWNERDEAD) pthread_mutex_consistent(&s->mu);
}

size_t type_size(ncclDataType_t t) {
  switch (t) {
  case ncclInt8:
  case ncclUint8: return 1;
  case ncclFloat16:
  case ncclBfloat16: return 2;
  case ncclInt32:
  case ncclUint32:
  case ncclFloat32: return 4;
  case ncclInt64:
  case ncclUint64:
  case ncclFloat64: return 8;
  }
  return 0;
}

template <typename T>
T apply(ncclRedOp_t op, T a, T b) {
  switch (op) {
  case ncclSum:
  case ncclAvg: return a + b;
  case ncclProd: return a * b;
  case ncclMax: return a < b ? b : a;
  case ncclMin: return b < a ? b : a;
  }
  return a;
}

// out[i] = op over ranks q of in[q][i], i < n, in rank order.
template <typename T>
void reduce_typed(const unsigned char *const *in, int R, void *out, size_t n, ncclRedOp_t op) {
  for (size_t i = 0; i < n; i++) {
    T acc, v;
    std::memcpy(&acc, in[0] + i * sizeof(T), sizeof(T));
    for (int q = 1; q < R; q++) {
      std::memcpy(&v, in[q] + i * sizeof(T), sizeof(T));
      acc = apply(op, acc, v);
    }
    if (op == ncclAvg) acc = (T)(acc / (T)R);
    std::memcpy((unsigned char *)out + i * sizeof(T), &acc, sizeof(T));
  }
}
void reduce_bf16(const unsigned char *const *in, int R, void *out, size_t n, ncclRedOp_t op) {
  for (size_t i = 0; i < n; i++) {
    __nv_bfloat16 b;
    std::memcpy(&b, in[0] + 2 * i, 2);
    float acc = __bfloat162float(b);
    for (int q = 1; q < R; q++) {
      std::memcpy(&b, in[q] + 2 * i, 2);
      acc = __bfloat162float(__float2bfloat16_rn(apply(op, acc, __bfloat162float(b))));
    }
    if (op == ncclAvg) acc /= (float)R;
    b = __float2bfloat16_rn(acc);
    std::memcpy((unsigned char *)out + 2 * i, &b, 2);
  }
}
void reduce(const unsigned char *const *in, int R, void *out, size_t bytes, int type, int op) {
  auto t = (ncclDataType_t)type;
  auto o = (ncclRedOp_t)op;
  size_t n = bytes / type_size(t);
  switch (t) {
  case ncclInt8: reduce_typed<int8_t>(in, R, out, n, o); break;
  case ncclUint8: reduce_typed<uint8_t>(in, R, out, n, o); break;
  case ncclInt32: reduce_typed<int32_t>(in, R, out, n, o); break;
  case ncclUint32: reduce_typed<uint32_t>(in, R, out, n, o); break;
  case ncclInt64: reduce_typed<int64_t>(in, R, out, n, o); break;
  case ncclUint64: reduce_typed<uint64_t>(in, R, out, n, o); break;
  case ncclFloat32: reduce_typed<float>(in, R, out, n, o); break;
  case ncclFloat64: reduce_typed<double>(in, R, out, n, o); break;
  case ncclBfloat16: reduce_bf16(in, R, out, n, o); break;
  case ncclFloat16: fatal("ncclFloat16 reductions are not emulated");
  }
}
} // namespace

struct Comm {
  Shared *sh = nullptr; // nullptr: one rank, nothing to share
  size_t map_bytes = 0;
  int rank = 0, nranks = 1, device = 0;
  uint64_t seq = 0;      // collectives queued
  uint64_t barriers = 0; // barriers this rank has arrived at
  std::atomic<int> refs{1};
  std::atomic<bool> aborted{false};
  std::atomic<int> async_error{ncclSuccess};
  unsigned char *slot(int r) { return (unsigned char *)sh + kHeader + (size_t)r * kWindow; }
  ~Comm() {
    if (sh) munmap(sh, map_bytes);
  }
  void unref() {
    if (--refs == 0) delete this;
  }
};

namespace {
struct CollOp : Op {
  Comm *comm;
  Desc d;
  const unsigned char *send;
  unsigned char *recv;
  size_t total = 0, w = 0; // bytes of the send buffer, start of this window
  int phase = 0;           // 0 stage, 1 wait to compute, 2 wait to go on
  uint64_t barrier = 0;    // the barrier this rank waits at
  ~CollOp() override { comm->unref(); }

  size_t es() const { return type_size((ncclDataType_t)d.type); }
  void arrive() {
    barrier = comm->barriers++;
    lock(comm->sh);
    comm->sh->arrivals.fetch_add(1);
    pthread_cond_broadcast(&comm->sh->cv);
    unlock(comm->sh);
  }
  bool passed() const {
    return comm->sh->arrivals.load() >= (barrier + 1) * (uint64_t)comm->nranks;
  }
  // This rank's part of the result for the window [w, w + len) of every rank's send buffer.
  void compute(size_t len) {
    const unsigned char *in[kMaxRanks];
    int R = comm->nranks;
    for (int q = 0; q < R; q++) in[q] = comm->slot(q);
    size_t part = d.count * es();
    switch (d.kind) {
    case 0: reduce(in, R, recv + w, len, d.type, d.op); break;
    case 1: { // this rank's slice [rank * part, (rank + 1) * part) of the window
      size_t lo = (size_t)comm->rank * part, hi = lo + part;
      size_t a = w > lo ? w : lo, b = w + len < hi ? w + len : hi;
      if (a >= b) break;
      for (int q = 0; q < R; q++) in[q] = comm->slot(q) + (a - w);
      reduce(in, R, recv + (a - lo), b - a, d.type, d.op);
      break;
    }
    case 2:
      for (int q = 0; q < R; q++) std::memmove(recv + (size_t)q * part + w, in[q], len);
      break;
    case 3: std::memmove(recv + w, in[d.root], len); break;
    }
  }
  void check_match() {
    const Desc &a = comm->sh->desc[0];
    for (int r = 1; r < comm->nranks; r++) {
      const Desc &b = comm->sh->desc[r];
      if (b.kind != a.kind || b.count != a.count || b.type != a.type || b.op != a.op ||
          b.root != a.root || b.seq != a.seq)
        fatal("NCCL collective: rank 0 called %s #%" PRIu64 " (count %zu, type %d, op %d, root "
              "%d), rank %d %s #%" PRIu64 " (count %zu, type %d, op %d, root %d): NCCL hangs or "
              "corrupts memory",
              kind_name(a.kind), a.seq, a.count, a.type, a.op, a.root, r, kind_name(b.kind), b.seq,
              b.count, b.type, b.op, b.root);
    }
  }
  bool step() override {
    if (comm->aborted) return true; // abandoned with its communicator
    if (!comm->sh) {                // one rank: the result is the input
      if (recv != send) std::memmove(recv, send, total);
      return true;
    }
    for (;;) {
      size_t len = total - w < kWindow ? total - w : kWindow;
      switch (phase) {
      case 0:
        if (w == 0) comm->sh->desc[comm->rank] = d;
        if (d.kind != 3 || comm->rank == d.root) std::memcpy(comm->slot(comm->rank), send + w, len);
        arrive();
        phase = 1;
        break;
      case 1:
        if (!passed()) return false;
        if (w == 0) check_match();
        compute(len);
        arrive();
        phase = 2;
        break;
      case 2:
        if (!passed()) return false;
        w += len;
        phase = 0;
        if (w >= total) return true;
        break;
      }
    }
  }
  void wait() override {
    lock(comm->sh);
    if (!passed() && !comm->aborted) timed_wait(comm->sh, 50);
    unlock(comm->sh);
  }
};

bool live_comm(ncclComm_t c) { return c != nullptr; }

ncclResult_t enqueue_coll(ncclComm_t comm, cudaStream_t stream, Desc d, const void *send,
                          void *recv, size_t send_bytes, size_t recv_bytes) {
  const char *name = kind_name(d.kind);
  if (!live_comm(comm)) return ncclInvalidArgument;
  if (comm->aborted) return ncclInvalidUsage;
  auto t = (ncclDataType_t)d.type;
  if (!type_size(t) || t == ncclFloat16) {
    report("%s: data type %d is not emulated", name, d.type);
    return ncclInvalidArgument;
  }
  if (d.op < 0 || d.op > ncclAvg) return ncclInvalidArgument;
  Stream *s = resolve(stream);
  if (!s) {
    report("%s: %p is not a live stream", name, (void *)stream);
    return ncclInvalidArgument;
  }
  if (s->device != comm->device) {
    report("%s: rank %d's communicator is on device %d but the stream on device %d", name,
           comm->rank, comm->device, s->device);
    return ncclInvalidUsage;
  }
  if ((send_bytes && !check_device(send, send_bytes, comm->device, name, "send buffer")) ||
      (recv_bytes && !check_device(recv, recv_bytes, comm->device, name, "receive buffer")))
    return ncclInvalidArgument;
  auto *op = new CollOp();
  comm->refs++;
  op->comm = comm;
  d.seq = comm->seq++;
  op->d = d;
  op->send = (const unsigned char *)send;
  op->recv = (unsigned char *)recv;
  // Every rank walks the same number of windows: over the largest send buffer of any rank.
  op->total = d.kind == 1 ? d.count * type_size(t) * (size_t)comm->nranks : d.count * type_size(t);
  enqueue(s, std::unique_ptr<Op>(op));
  return ncclSuccess;
}
} // namespace
} // namespace dfemu

using namespace dfemu;

const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
  case ncclSuccess: return "no error";
  case ncclUnhandledCudaError: return "unhandled cuda error";
  case ncclSystemError: return "unhandled system error";
  case ncclInternalError: return "internal error";
  case ncclInvalidArgument: return "invalid argument";
  case ncclInvalidUsage: return "invalid usage";
  case ncclRemoteError: return "remote process exited or there was a network error";
  case ncclInProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}

ncclResult_t ncclGetVersion(int *version) {
  if (!version) return ncclInvalidArgument;
  *version = 0;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  if (!id) return ncclInvalidArgument;
  IdBody b;
  std::memcpy(b.magic, kMagic, 8);
  if (getrandom(&b.key, sizeof b.key, 0) != (ssize_t)sizeof b.key)
    b.key = (uint64_t)std::chrono::steady_clock::now().time_since_epoch().count() ^
            ((uint64_t)getpid() << 40);
  std::memset(id, 0, sizeof *id);
  std::memcpy(id->internal, &b, sizeof b);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId id, int rank) {
  if (!out || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  if (nranks > kMaxRanks) {
    report("ncclCommInitRank: %d ranks (the emulator has at most %d)", nranks, kMaxRanks);
    return ncclInvalidArgument;
  }
  IdBody b;
  std::memcpy(&b, id.internal, sizeof b);
  if (std::memcmp(b.magic, kMagic, 8)) {
    report("ncclCommInitRank: not an id from the emulated ncclGetUniqueId");
    return ncclInvalidArgument;
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) || !ndev) {
    cudaGetLastError();
    return ncclUnhandledCudaError;
  }
  auto *c = new Comm();
  c->rank = rank, c->nranks = nranks, c->device = current_device();
  if (nranks == 1) {
    *out = c;
    return ncclSuccess;
  }
  auto refuse = [&](ncclResult_t r, const char *why) {
    report("ncclCommInitRank (rank %d of %d, device %d): %s", rank, nranks, c->device, why);
    delete c;
    return r;
  };
  char name[64];
  seg_name(b.key, name, sizeof name);
  size_t bytes = kHeader + (size_t)nranks * kWindow;
  int fd = shm_open(name, O_RDWR | O_CREAT, 0600);
  if (fd < 0 || ftruncate(fd, (off_t)bytes)) {
    if (fd >= 0) close(fd);
    return refuse(ncclSystemError, "cannot create the shared-memory segment");
  }
  void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return refuse(ncclSystemError, "cannot map the shared-memory segment");
  c->sh = (Shared *)p;
  c->map_bytes = bytes;
  Shared *s = c->sh;
  uint32_t fresh = 0;
  auto t0 = std::chrono::steady_clock::now();
  auto waited = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  if (s->state.compare_exchange_strong(fresh, 1)) {
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&s->mu, &ma);
    pthread_mutexattr_destroy(&ma);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
    pthread_cond_init(&s->cv, &ca);
    pthread_condattr_destroy(&ca);
    s->nranks = nranks;
    s->state.store(2);
  } else {
    while (s->state.load() != 2) {
      if (waited() > timeout_s()) return refuse(ncclSystemError, "the segment was never set up");
      usleep(1000);
    }
  }
  lock(s);
  const char *why = nullptr;
  ncclResult_t r = ncclSuccess;
  if (s->failed) why = "another rank of this id failed to join", r = ncclInvalidUsage;
  else if (s->nranks != nranks) why = "another rank gave another nranks", r = ncclInvalidArgument;
  else if (s->members >> rank & 1) why = "this rank joined already", r = ncclInvalidUsage;
  for (int q = 0; !why && q < nranks; q++)
    if ((s->members >> q & 1) && s->device[q] == c->device)
      why = "Duplicate GPU detected: another rank of this communicator uses the same device",
      r = ncclInvalidUsage;
  if (!why) {
    s->members |= 1ull << rank;
    s->device[rank] = c->device;
    s->joined++;
    pthread_cond_broadcast(&s->cv);
    while (s->joined < nranks && !s->failed && waited() <= timeout_s()) timed_wait(s, 50);
    if (s->failed) why = "another rank of this id failed to join", r = ncclInvalidUsage;
    else if (s->joined < nranks)
      why = "timed out waiting for the other ranks "
            "(DFLASH_EMU_NCCL_TIMEOUT)",
      r = ncclSystemError;
  }
  if (why) {
    s->failed = 1;
    pthread_cond_broadcast(&s->cv);
  } else if (++s->unlinked == nranks) {
    shm_unlink(name); // every rank has it mapped: the name can go
  }
  unlock(s);
  if (why) {
    shm_unlink(name);
    return refuse(r, why);
  }
  *out = c;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!live_comm(comm)) return ncclInvalidArgument;
  comm->unref(); // queued collectives keep it until they have run
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!live_comm(comm)) return ncclInvalidArgument;
  comm->aborted = true;
  if (comm->sh) {
    lock(comm->sh);
    pthread_cond_broadcast(&comm->sh->cv);
    unlock(comm->sh);
  }
  comm->unref();
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *e) {
  if (!live_comm(comm) || !e) return ncclInvalidArgument;
  *e = (ncclResult_t)comm->async_error.load();
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
  if (!live_comm(comm) || !count) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
  if (!live_comm(comm) || !rank) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
  if (!live_comm(comm) || !device) return ncclInvalidArgument;
  *device = comm->device;
  return ncclSuccess;
}

// Collectives are queued one by one, in call order, on their streams: a group adds nothing.
ncclResult_t ncclGroupStart() { return ncclSuccess; }
ncclResult_t ncclGroupEnd() { return ncclSuccess; }

ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t type,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  size_t b = count * type_size(type);
  return enqueue_coll(comm, stream, Desc{0, type, op, 0, count, 0}, send, recv, b, b);
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t recvcount, ncclDataType_t type,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  size_t b = recvcount * type_size(type);
  size_t n = live_comm(comm) ? (size_t)comm->nranks : 1;
  return enqueue_coll(comm, stream, Desc{1, type, op, 0, recvcount, 0}, send, recv, b * n, b);
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t sendcount, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  size_t b = sendcount * type_size(type);
  size_t n = live_comm(comm) ? (size_t)comm->nranks : 1;
  return enqueue_coll(comm, stream, Desc{2, type, ncclSum, 0, sendcount, 0}, send, recv, b, b * n);
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  if (!live_comm(comm) || root < 0 || root >= comm->nranks) return ncclInvalidArgument;
  size_t b = count * type_size(type);
  // Only the root's send buffer is read.
  return enqueue_coll(comm, stream, Desc{3, type, ncclSum, root, count, 0}, send, recv,
                      comm->rank == root ? b : 0, b);
}
