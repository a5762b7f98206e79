// The emulated NCCL: communicators whose ranks are host threads of one process (one rank:
// any thread), and all-reduce, reduce-scatter, all-gather and broadcast in stream order.
//
// ncclCommInitRank meets the other ranks of the id in this process (each on its own device,
// as NCCL requires: two ranks on one device are ncclInvalidUsage). A collective is queued on
// its stream like a kernel; when the stream reaches it, the rank arrives at the collective
// (matched by call order on the communicator, as NCCL matches them); the last rank to arrive
// checks that everybody called the same collective with the same count, type and root, and
// moves the data for all ranks; until then the stream is not ready (cudaStreamQuery says
// cudaErrorNotReady, a synchronisation waits). Reductions run in rank order 0..n-1 in the
// element type's own arithmetic (bf16: fp32 rounded back after each rank), so results are
// deterministic; NCCL's ring order is not modelled.
#include <sys/random.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "include/nccl.h"
#include "internal.h"

namespace dfemu {

namespace {
struct Desc {
  int kind; // 0 all-reduce, 1 reduce-scatter, 2 all-gather, 3 broadcast
  const void *send;
  void *recv;
  size_t count;
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;
};
const char *kind_name(int k) {
  static const char *n[] = {"ncclAllReduce", "ncclReduceScatter", "ncclAllGather", "ncclBroadcast"};
  return n[k];
}

struct Instance {
  std::vector<Desc> d;
  int arrived = 0, left = 0;
  bool done = false;
};
}  // namespace

struct Clique {
  int nranks;
  std::vector<Comm *> ranks;
  int joined = 0;
  bool failed = false; // a rank was refused: the others give up too
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Instance> inst;
};

struct Comm {
  std::shared_ptr<Clique> c;
  int rank = 0, device = 0;
  uint64_t seq = 0;
  std::atomic<int> refs{1};
  std::atomic<bool> aborted{false};
  std::atomic<int> async_error{ncclSuccess};
  void unref() {
    if (--refs == 0) delete this;
  }
};

namespace {
constexpr char kMagic[8] = {'d', 'f', 'e', 'm', 'u', 'n', 'c', 'l'};
struct IdBody {
  char magic[8];
  uint64_t key;
  int64_t pid;
};

std::mutex g_reg_mu;
std::condition_variable g_reg_cv;
std::map<uint64_t, std::shared_ptr<Clique>> g_pending; // ids whose ranks are still joining

double timeout_s() {
  const char *env = getenv("DFLASH_EMU_NCCL_TIMEOUT");
  return env && *env ? atof(env) : 300.0;
}

size_t type_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
  }
  return 0;
}

template <typename T>
T apply(ncclRedOp_t op, T a, T b) {
  switch (op) {
    case ncclSum: case ncclAvg: return a + b;
    case ncclProd: return a * b;
    case ncclMax: return a < b ? b : a;
    case ncclMin: return b < a ? b : a;
  }
  return a;
}

// out[i] = op over ranks q of in_q[i], i < n (in rank order).
template <typename T>
void reduce_typed(const std::vector<const void *> &in, void *out, size_t n, ncclRedOp_t op,
                  bool bf16) {
  size_t R = in.size();
  std::vector<T> tmp(n);
  for (size_t i = 0; i < n; i++) {
    T acc = ((const T *)in[0])[i];
    for (size_t q = 1; q < R; q++) acc = apply(op, acc, ((const T *)in[q])[i]);
    if (op == ncclAvg) acc = (T)(acc / (T)R);
    tmp[i] = acc;
  }
  (void)bf16;
  std::memcpy(out, tmp.data(), n * sizeof(T));
}
void reduce_bf16(const std::vector<const void *> &in, void *out, size_t n, ncclRedOp_t op) {
  size_t R = in.size();
  std::vector<__nv_bfloat16> tmp(n);
  for (size_t i = 0; i < n; i++) {
    float acc = __bfloat162float(((const __nv_bfloat16 *)in[0])[i]);
    for (size_t q = 1; q < R; q++)
      acc = __bfloat162float(__float2bfloat16_rn(
          apply(op, acc, __bfloat162float(((const __nv_bfloat16 *)in[q])[i]))));
    if (op == ncclAvg) acc /= (float)R;
    tmp[i] = __float2bfloat16_rn(acc);
  }
  std::memcpy(out, tmp.data(), n * 2);
}
void reduce(const std::vector<const void *> &in, void *out, size_t n, ncclDataType_t t,
            ncclRedOp_t op) {
  switch (t) {
    case ncclInt8: reduce_typed<int8_t>(in, out, n, op, false); break;
    case ncclUint8: reduce_typed<uint8_t>(in, out, n, op, false); break;
    case ncclInt32: reduce_typed<int32_t>(in, out, n, op, false); break;
    case ncclUint32: reduce_typed<uint32_t>(in, out, n, op, false); break;
    case ncclInt64: reduce_typed<int64_t>(in, out, n, op, false); break;
    case ncclUint64: reduce_typed<uint64_t>(in, out, n, op, false); break;
    case ncclFloat32: reduce_typed<float>(in, out, n, op, false); break;
    case ncclFloat64: reduce_typed<double>(in, out, n, op, false); break;
    case ncclBfloat16: reduce_bf16(in, out, n, op); break;
    case ncclFloat16: fatal("ncclFloat16 reductions are not emulated");
  }
}

// The data movement of one collective, for every rank (they all wait in it).
void execute(std::vector<Desc> &d) {
  size_t R = d.size(), n = d[0].count, es = type_size(d[0].type), bytes = n * es;
  std::vector<const void *> in(R);
  switch (d[0].kind) {
    case 0: { // all-reduce: into a temporary, then to everyone (in place is fine)
      std::vector<unsigned char> out(bytes);
      for (size_t q = 0; q < R; q++) in[q] = d[q].send;
      reduce(in, out.data(), n, d[0].type, d[0].op);
      for (size_t q = 0; q < R; q++) std::memcpy(d[q].recv, out.data(), bytes);
      break;
    }
    case 1: { // reduce-scatter: rank r gets the reduction of everyone's r-th slice
      std::vector<std::vector<unsigned char>> out(R, std::vector<unsigned char>(bytes));
      for (size_t r = 0; r < R; r++) {
        for (size_t q = 0; q < R; q++) in[q] = (const char *)d[q].send + r * bytes;
        reduce(in, out[r].data(), n, d[0].type, d[0].op);
      }
      for (size_t r = 0; r < R; r++) std::memcpy(d[r].recv, out[r].data(), bytes);
      break;
    }
    case 2: { // all-gather: everyone's buffer, in rank order, to everyone
      std::vector<unsigned char> all(R * bytes);
      for (size_t q = 0; q < R; q++) std::memcpy(all.data() + q * bytes, d[q].send, bytes);
      for (size_t r = 0; r < R; r++) std::memcpy(d[r].recv, all.data(), R * bytes);
      break;
    }
    case 3: { // broadcast from root
      std::vector<unsigned char> buf(bytes);
      std::memcpy(buf.data(), d[(size_t)d[0].root].send, bytes);
      for (size_t r = 0; r < R; r++) std::memcpy(d[r].recv, buf.data(), bytes);
      break;
    }
  }
}

struct CollOp : Op {
  Comm *comm;
  uint64_t seq;
  Desc d;
  bool arrived = false;
  ~CollOp() override { comm->unref(); }
  bool step() override {
    Clique &c = *comm->c;
    std::unique_lock<std::mutex> g(c.mu);
    if (comm->aborted) return true;
    Instance &in = c.inst[seq];
    if (!arrived) {
      arrived = true;
      if (in.d.empty()) in.d.resize((size_t)c.nranks);
      in.d[(size_t)comm->rank] = d;
      if (++in.arrived == c.nranks) {
        const Desc &a = in.d[0];
        for (int r = 1; r < c.nranks; r++) {
          const Desc &b = in.d[(size_t)r];
          if (b.kind != a.kind || b.count != a.count || b.type != a.type || b.op != a.op ||
              b.root != a.root)
            fatal("NCCL collective #%llu: rank 0 called %s(count %zu, type %d, op %d, root %d) "
                  "but rank %d called %s(count %zu, type %d, op %d, root %d): NCCL hangs or "
                  "corrupts memory", (unsigned long long)seq, kind_name(a.kind), a.count,
                  (int)a.type, (int)a.op, a.root, r, kind_name(b.kind), b.count, (int)b.type,
                  (int)b.op, b.root);
        }
        execute(in.d);
        in.done = true;
        c.cv.notify_all();
      }
    }
    if (!in.done) return false;
    if (++in.left == c.nranks) c.inst.erase(seq);
    return true;
  }
  void wait() override {
    Clique &c = *comm->c;
    std::unique_lock<std::mutex> g(c.mu);
    c.cv.wait_for(g, std::chrono::milliseconds(50), [&] {
      auto it = c.inst.find(seq);
      return comm->aborted || it == c.inst.end() || it->second.done;
    });
  }
};

bool live_comm(ncclComm_t c) { return c && c->c; }

ncclResult_t enqueue_coll(ncclComm_t comm, cudaStream_t stream, Desc d, size_t send_bytes,
                          size_t recv_bytes) {
  const char *name = kind_name(d.kind);
  if (!live_comm(comm)) return ncclInvalidArgument;
  if (comm->aborted) return ncclInvalidUsage;
  if (!type_size(d.type) || d.type == ncclFloat16) {
    report("%s: data type %d is not emulated", name, (int)d.type);
    return ncclInvalidArgument;
  }
  if ((unsigned)d.op > ncclAvg) return ncclInvalidArgument;
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
  if (current_device() != comm->device)
    report("%s: rank %d calls from a host thread whose current device is %d, not its device %d",
           name, comm->rank, current_device(), comm->device);
  if ((send_bytes && !check_device(d.send, send_bytes, comm->device, name, "send buffer")) ||
      (recv_bytes && !check_device(d.recv, recv_bytes, comm->device, name, "receive buffer")))
    return ncclInvalidArgument;
  auto *op = new CollOp();
  comm->refs++;
  op->comm = comm;
  op->seq = comm->seq++;
  op->d = d;
  enqueue(s, std::unique_ptr<Op>(op));
  return ncclSuccess;
}
}  // namespace
}  // namespace dfemu

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

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  if (!id) return ncclInvalidArgument;
  IdBody b;
  std::memcpy(b.magic, kMagic, 8);
  if (getrandom(&b.key, sizeof b.key, 0) != (ssize_t)sizeof b.key)
    b.key = (uint64_t)std::chrono::steady_clock::now().time_since_epoch().count();
  b.pid = getpid();
  std::memset(id, 0, sizeof *id);
  std::memcpy(id->internal, &b, sizeof b);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId id, int rank) {
  if (!out || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
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
  if (b.pid != getpid() && nranks > 1) {
    report("ncclCommInitRank: the id comes from process %lld; the emulated NCCL joins ranks "
           "of one process only", (long long)b.pid);
    return ncclSystemError;
  }
  auto *c = new Comm();
  c->rank = rank;
  c->device = current_device();
  std::unique_lock<std::mutex> g(g_reg_mu);
  auto &slot = g_pending[b.key];
  if (!slot) {
    slot = std::make_shared<Clique>();
    slot->nranks = nranks;
    slot->ranks.assign((size_t)nranks, nullptr);
  }
  std::shared_ptr<Clique> cl = slot;
  auto refuse = [&](ncclResult_t r, const char *why) {
    report("ncclCommInitRank (rank %d of %d, device %d): %s", rank, nranks, c->device, why);
    cl->failed = true;
    g_reg_cv.notify_all();
    delete c;
    return r;
  };
  if (cl->failed) return refuse(ncclInvalidUsage, "another rank of this id failed to join");
  if (cl->nranks != nranks) return refuse(ncclInvalidArgument, "another rank gave another nranks");
  if (cl->ranks[(size_t)rank]) return refuse(ncclInvalidUsage, "this rank joined already");
  for (Comm *o : cl->ranks)
    if (o && o->device == c->device)
      return refuse(ncclInvalidUsage, "Duplicate GPU detected: another rank of this "
                                      "communicator uses the same device");
  c->c = cl;
  cl->ranks[(size_t)rank] = c;
  if (++cl->joined == nranks) {
    g_pending.erase(b.key);
    g_reg_cv.notify_all();
  } else {
    bool ok = g_reg_cv.wait_for(g, std::chrono::duration<double>(timeout_s()),
                                [&] { return cl->joined == nranks || cl->failed; });
    if (!ok || cl->joined != nranks) {
      cl->ranks[(size_t)rank] = nullptr;
      cl->joined--;
      c->c.reset();
      return ok ? refuse(ncclInvalidUsage, "another rank of this id failed to join")
                : refuse(ncclSystemError, "timed out waiting for the other ranks "
                                          "(DFLASH_EMU_NCCL_TIMEOUT)");
    }
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
  {
    std::lock_guard<std::mutex> g(comm->c->mu);
    comm->aborted = true;
    comm->c->cv.notify_all();
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
  *count = comm->c->nranks;
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
  return enqueue_coll(comm, stream, Desc{0, send, recv, count, type, op, 0}, b, b);
}

ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t recvcount,
                               ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  size_t b = recvcount * type_size(type);
  int n = live_comm(comm) ? comm->c->nranks : 1;
  return enqueue_coll(comm, stream, Desc{1, send, recv, recvcount, type, op, 0}, b * (size_t)n, b);
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t sendcount, ncclDataType_t type,
                           ncclComm_t comm, cudaStream_t stream) {
  size_t b = sendcount * type_size(type);
  int n = live_comm(comm) ? comm->c->nranks : 1;
  return enqueue_coll(comm, stream, Desc{2, send, recv, sendcount, type, ncclSum, 0}, b,
                      b * (size_t)n);
}

ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t type,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  if (!live_comm(comm) || root < 0 || root >= comm->c->nranks) return ncclInvalidArgument;
  size_t b = count * type_size(type);
  // Only the root's send buffer is read.
  return enqueue_coll(comm, stream, Desc{3, send, recv, count, type, ncclSum, root},
                      comm->rank == root ? b : 0, b);
}
