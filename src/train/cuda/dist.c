/* Rank discovery, TCP rendezvous and gradient buckets (dist.h). */
#include "dist.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

/* ---- environment ---------------------------------------------------------- */

/* *out = integer value of `name` in [lo, hi]; *found = whether it is set. */
static dflash_status env_int(df_env_fn get, void *ctx, const char *name, long lo, long hi, int *out,
                             bool *found) {
  const char *v = get(ctx, name);
  *found = v && *v;
  if (!*found) return DFLASH_OK;
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || *end || end == v || x < lo || x > hi)
    return df_error(DFLASH_E_CONFIG,
                    "environment variable %s=\"%s\" is not an integer in "
                    "[%ld, %ld]",
                    name, v, lo, hi);
  *out = (int)x;
  return DFLASH_OK;
}

/* The first of two spellings that is set (torchrun's, then Slurm's). */
static dflash_status env_int2(df_env_fn get, void *ctx, const char *a, const char *b, long lo,
                              long hi, int *out, bool *found) {
  dflash_status st = env_int(get, ctx, a, lo, hi, out, found);
  if (st || *found) return st;
  return env_int(get, ctx, b, lo, hi, out, found);
}

dflash_status df_dist_env_parse(df_env_fn get, void *ctx, df_dist_env *out) {
  memset(out, 0, sizeof *out);
  out->world = 1;
  bool has_rank, has_world, has_local, has_port;
  dflash_status st;
  if ((st = env_int2(get, ctx, "WORLD_SIZE", "SLURM_NTASKS", 1, 1 << 20, &out->world,
                     &has_world)) ||
      (st = env_int2(get, ctx, "RANK", "SLURM_PROCID", 0, 1 << 20, &out->rank, &has_rank)) ||
      (st = env_int2(get, ctx, "LOCAL_RANK", "SLURM_LOCALID", 0, 1 << 16, &out->local_rank,
                     &has_local)) ||
      (st = env_int(get, ctx, "MASTER_PORT", 1, 65535, &out->master_port, &has_port)))
    return st;
  if (has_rank != has_world)
    return df_error(DFLASH_E_CONFIG,
                    "environment: %s is set but %s is not (set both RANK and "
                    "WORLD_SIZE, as torchrun does)",
                    has_rank ? "RANK" : "WORLD_SIZE", has_rank ? "WORLD_SIZE" : "RANK");
  if (out->rank >= out->world)
    return df_error(DFLASH_E_CONFIG, "environment: RANK=%d is not below WORLD_SIZE=%d", out->rank,
                    out->world);
  if (!has_local) out->local_rank = out->world == 1 ? 0 : out->rank;
  const char *addr = get(ctx, "MASTER_ADDR");
  if (addr && *addr) {
    if (strlen(addr) >= sizeof out->master_addr)
      return df_error(DFLASH_E_CONFIG, "environment: MASTER_ADDR is longer than %zu bytes",
                      sizeof out->master_addr - 1);
    snprintf(out->master_addr, sizeof out->master_addr, "%s", addr);
  }
  if (out->world > 1 && (!out->master_addr[0] || !has_port))
    return df_error(DFLASH_E_CONFIG, "environment: WORLD_SIZE=%d needs %s for the rendezvous",
                    out->world, out->master_addr[0] ? "MASTER_PORT" : "MASTER_ADDR");
  return DFLASH_OK;
}

static const char *real_getenv(void *ctx, const char *name) {
  (void)ctx;
  return getenv(name);
}

dflash_status df_dist_env_from_environ(df_dist_env *out) {
  return df_dist_env_parse(real_getenv, NULL, out);
}

/* ---- communicator ---------------------------------------------------------- */

#define COMM_MAGIC 0x4d434644u /* "DFCM" */

enum { OP_HELLO = 1, OP_SUM_F32, OP_SUM_F64, OP_BCAST, OP_ABORT };

/* Every message: this header, then `bytes` of payload. Native byte order:
 * every rank runs the same build on the same kind of machine. */
typedef struct msg_hdr {
  uint32_t magic, op;
  int32_t origin, status; /* OP_ABORT: the rank that failed and why */
  uint32_t seq, pad;
  uint64_t bytes;
} msg_hdr;

struct df_comm {
  int rank, world;
  int *fd;        /* rank 0: fd[r] for each r >= 1; others: fd[0] (to rank 0) */
  double timeout; /* one collective */
  double wait;    /* this rank's bound for the collective under way */
  uint32_t seq;   /* collectives so far */
  bool broken;
  char what[96]; /* the collective under way, for messages */
  /* A failure a peer reported (OP_ABORT), as rank 0 passes it on. */
  int abort_origin; /* -1: none */
  dflash_status abort_status;
  char abort_why[513];
};

static int fd_of(const df_comm *c, int peer) { return c->fd[c->rank == 0 ? peer : 0]; }

static const char *op_name(uint32_t op) {
  switch (op) {
  case OP_SUM_F32: return "float sum";
  case OP_SUM_F64: return "double sum";
  case OP_BCAST: return "broadcast";
  case OP_ABORT: return "abort";
  }
  return "hello";
}

/* poll()'s milliseconds for `left` seconds: dist_timeout_s may be far
 * more than an int of milliseconds (~24 days); past that, wake up and look
 * at the deadline again. */
static int poll_ms(double left) {
  if (left <= 0) return 0;
  return left > 1e6 ? 1000 * 1000 * 1000 : (int)(left * 1000) + 1;
}

/* Move n bytes over `fd` to/from `peer` (-1: a rank still joining) before
 * `deadline`, naming the peer on failure. */
static dflash_status xfer_fd(df_comm *c, int fd, int peer, void *buf, size_t n, bool out,
                             double deadline) {
  char *p = buf, who[32];
  if (peer < 0) snprintf(who, sizeof who, "a joining rank");
  else snprintf(who, sizeof who, "rank %d", peer);
  while (n) {
    struct pollfd pf = {.fd = fd, .events = out ? POLLOUT : POLLIN};
    double left = deadline - df_now_seconds();
    int rc = left > 0 ? poll(&pf, 1, poll_ms(left)) : 0;
    if (rc < 0 && errno == EINTR) continue;
    if (rc == 0 && left > 1e6) continue;
    if (rc == 0)
      return df_error(DFLASH_E_TIMEOUT,
                      "rank %d: %s %s for %.0f s during %s (the trainer option "
                      "dist_timeout_s, dflash train --dist-timeout, waits longer)",
                      c->rank, who, out ? "took no data" : "sent nothing", c->wait, c->what);
    /* MSG_DONTWAIT: a blocking send of n bytes would wait, past the
     * deadline, until a stalled peer reads them all. */
    ssize_t k = out ? send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT) : recv(fd, p, n, MSG_DONTWAIT);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0)
      return df_error(DFLASH_E_NETWORK,
                      "rank %d: %s closed its connection during %s (%s): it "
                      "exited, was killed or lost the network",
                      c->rank, who, c->what, k < 0 ? strerror(errno) : "end of stream");
    p += k;
    n -= (size_t)k;
  }
  return DFLASH_OK;
}

static dflash_status xfer(df_comm *c, int peer, void *buf, size_t n, bool out, double deadline) {
  return xfer_fd(c, fd_of(c, peer), peer, buf, n, out, deadline);
}

static dflash_status send_hdr(df_comm *c, int peer, uint32_t op, uint64_t bytes, double deadline) {
  msg_hdr h = {.magic = COMM_MAGIC, .op = op, .origin = c->rank, .seq = c->seq, .bytes = bytes};
  return xfer(c, peer, &h, sizeof h, true, deadline);
}

/* Best effort, without blocking: tell `peer` that `origin` failed. */
static void send_abort(df_comm *c, int peer, int origin, dflash_status st, const char *why) {
  size_t len = strlen(why) < 512 ? strlen(why) : 512;
  char msg[sizeof(msg_hdr) + 512];
  msg_hdr h = {.magic = COMM_MAGIC,
               .op = OP_ABORT,
               .origin = origin,
               .status = (int32_t)st,
               .seq = c->seq,
               .bytes = len};
  memcpy(msg, &h, sizeof h);
  memcpy(msg + sizeof h, why, len);
  ssize_t k = send(fd_of(c, peer), msg, sizeof h + len, MSG_NOSIGNAL | MSG_DONTWAIT);
  (void)k;
}

/* Read `peer`'s header for the collective under way and check it matches. */
static dflash_status recv_hdr(df_comm *c, int peer, uint32_t op, uint64_t bytes, double deadline) {
  msg_hdr h;
  dflash_status st = xfer(c, peer, &h, sizeof h, false, deadline);
  if (st) return st;
  if (h.magic != COMM_MAGIC)
    return df_error(DFLASH_E_NETWORK,
                    "rank %d: rank %d sent a message that is not libdflash's "
                    "during %s",
                    c->rank, peer, c->what);
  if (h.op == OP_ABORT) {
    char *why = c->abort_why;
    size_t n = h.bytes < 512 ? (size_t)h.bytes : 512;
    memset(why, 0, sizeof c->abort_why);
    if (xfer(c, peer, why, n, false, df_now_seconds() + 5)) why[0] = 0;
    c->abort_origin = h.origin;
    c->abort_status = (dflash_status)h.status;
    return df_error(DFLASH_E_CANCELLED, "rank %d: rank %d failed (%s)%s%s; stopping during %s",
                    c->rank, h.origin, dflash_status_str((dflash_status)h.status),
                    why[0] ? ": " : "", why, c->what);
  }
  if (h.op != op || h.seq != c->seq || h.bytes != bytes)
    return df_error(DFLASH_E_INTERNAL,
                    "rank %d: rank %d is at collective #%u (%s of %llu bytes) "
                    "while this rank is at %s: the ranks diverged",
                    c->rank, peer, h.seq, op_name(h.op), (unsigned long long)h.bytes, c->what);
  return DFLASH_OK;
}

/* acc += in, n elements of the collective's type. */
static void add_in(uint32_t op, void *acc, const void *in, size_t n) {
  if (op == OP_SUM_F32)
    for (size_t i = 0; i < n; i++) ((float *)acc)[i] += ((const float *)in)[i];
  else
    for (size_t i = 0; i < n; i++) ((double *)acc)[i] += ((const double *)in)[i];
}

/* Rank 0: read rank `r`'s contribution in chunks and add it to buf. */
static dflash_status gather_add(df_comm *c, int r, uint32_t op, void *buf, size_t bytes,
                                double deadline) {
  size_t esz = op == OP_SUM_F32 ? sizeof(float) : sizeof(double);
  double scratch[8192];
  for (size_t off = 0; off < bytes;) {
    size_t k = bytes - off < sizeof scratch ? bytes - off : sizeof scratch;
    dflash_status st = xfer(c, r, scratch, k, false, deadline);
    if (st) return st;
    add_in(op, (char *)buf + off, scratch, k / esz);
    off += k;
  }
  return DFLASH_OK;
}

/* Rank 0's side of a collective: everyone's header (and contribution),
 * then the result to everyone. *culprit gets the rank that failed. */
static dflash_status root_collective(df_comm *c, uint32_t op, void *buf, size_t bytes,
                                     double deadline, int *culprit) {
  bool reduce = op != OP_BCAST;
  for (int r = 1; r < c->world; r++) {
    *culprit = r;
    dflash_status st = recv_hdr(c, r, op, bytes, deadline);
    if (!st && reduce) st = gather_add(c, r, op, buf, bytes, deadline);
    if (st) return st;
  }
  for (int r = 1; r < c->world; r++) {
    *culprit = r;
    dflash_status st = send_hdr(c, r, op, bytes, deadline);
    if (!st) st = xfer(c, r, buf, bytes, true, deadline);
    if (st) return st;
  }
  return DFLASH_OK;
}

/* A send to rank 0 failed: rank 0 may have stopped the run and closed
 * with an abort message waiting in this rank's receive queue. Prefer that
 * reason to the bare broken connection. */
static dflash_status pending_abort(df_comm *c, dflash_status st) {
  char saved[1024];
  snprintf(saved, sizeof saved, "%s", dflash_last_error());
  msg_hdr probe;
  if (recv(c->fd[0], &probe, sizeof probe, MSG_PEEK | MSG_DONTWAIT) == (ssize_t)sizeof probe &&
      probe.magic == COMM_MAGIC && probe.op == OP_ABORT)
    return recv_hdr(c, 0, OP_ABORT, 0, df_now_seconds() + 1);
  return df_error(st, "%s", saved);
}

static dflash_status leaf_collective(df_comm *c, uint32_t op, void *buf, size_t bytes,
                                     double deadline) {
  bool reduce = op != OP_BCAST;
  dflash_status st = send_hdr(c, 0, op, bytes, deadline);
  if (!st && reduce) st = xfer(c, 0, buf, bytes, true, deadline);
  if (st) return pending_abort(c, st);
  st = recv_hdr(c, 0, op, bytes, deadline);
  if (!st) st = xfer(c, 0, buf, bytes, false, deadline);
  return st;
}

static dflash_status collective(df_comm *c, uint32_t op, void *buf, size_t bytes) {
  if (c->broken)
    return df_error(DFLASH_E_STATE, "rank %d: the ranks' connections failed earlier", c->rank);
  c->seq++;
  snprintf(c->what, sizeof c->what, "collective #%u (%s of %zu bytes)", c->seq, op_name(op), bytes);
  if (c->world == 1) return DFLASH_OK;
  /* Rank 0 diagnoses a silent rank first and tells the others, so their
   * own (longer) deadline only fires when rank 0 itself is silent. */
  c->wait = c->rank == 0 ? c->timeout : c->timeout * 1.25 + 5;
  double deadline = df_now_seconds() + c->wait;
  int culprit = 0;
  dflash_status st = c->rank == 0 ? root_collective(c, op, buf, bytes, deadline, &culprit)
                                  : leaf_collective(c, op, buf, bytes, deadline);
  if (!st) return DFLASH_OK;
  c->broken = true;
  /* Pass the failure on: a peer's own report as it came, else what this
   * rank saw of the culprit. */
  bool relay = c->abort_origin >= 0;
  for (int r = 1; c->rank == 0 && r < c->world; r++) {
    if (relay && r != c->abort_origin)
      send_abort(c, r, c->abort_origin, c->abort_status, c->abort_why);
    else if (!relay) /* the culprit too, in case it lives (e.g. it diverged) */
      send_abort(c, r, r == culprit ? 0 : culprit, st, dflash_last_error());
  }
  return st;
}

dflash_status df_comm_sum_f32(df_comm *c, float *x, size_t n) {
  return collective(c, OP_SUM_F32, x, n * sizeof *x);
}

dflash_status df_comm_sum_f64(df_comm *c, double *x, size_t n) {
  return collective(c, OP_SUM_F64, x, n * sizeof *x);
}

dflash_status df_comm_broadcast(df_comm *c, void *buf, size_t len) {
  return collective(c, OP_BCAST, buf, len);
}

void df_comm_abort(df_comm *c, dflash_status status) {
  if (!c || c->broken) return;
  c->broken = true;
  if (c->rank != 0) send_abort(c, 0, c->rank, status, dflash_last_error());
  for (int r = 1; c->rank == 0 && r < c->world; r++)
    send_abort(c, r, 0, status, dflash_last_error());
}

int df_comm_rank(const df_comm *c) { return c ? c->rank : 0; }
int df_comm_world(const df_comm *c) { return c ? c->world : 1; }

void df_comm_free(df_comm *c) {
  if (!c) return;
  int n = c->rank == 0 ? c->world : 1;
  for (int i = 0; i < n; i++)
    if (c->fd[i] >= 0) close(c->fd[i]);
  free(c->fd);
  free(c);
}

/* ---- rendezvous ------------------------------------------------------------ */

static dflash_status resolve(const df_dist_env *env, bool passive, struct addrinfo **out) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC,
                           .ai_socktype = SOCK_STREAM,
                           .ai_flags = passive ? AI_PASSIVE : 0};
  char port[16];
  snprintf(port, sizeof port, "%d", env->master_port);
  /* Rank 0 listens on every interface: MASTER_ADDR names it for the others. */
  int rc = getaddrinfo(passive ? NULL : env->master_addr, port, &hints, out);
  if (rc)
    return df_error(DFLASH_E_IO, "rendezvous: cannot resolve %s:%d: %s",
                    passive ? "*" : env->master_addr, env->master_port, gai_strerror(rc));
  return DFLASH_OK;
}

static void no_delay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* A listening socket on `ai`, -1 (errno set) when it cannot be made. An
 * IPv6 one also takes IPv4: MASTER_ADDR=localhost is ::1 on many hosts. */
static int listen_on(const struct addrinfo *ai) {
  int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol), one = 1, zero = 0;
  if (fd < 0) return -1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (ai->ai_family == AF_INET6) setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
  if (bind(fd, ai->ai_addr, ai->ai_addrlen) || listen(fd, 128)) {
    int err = errno;
    close(fd);
    errno = err;
    return -1;
  }
  return fd;
}

/* Rank 0: accept world-1 ranks; each says hello with its rank and world. */
static dflash_status serve(df_comm *c, const df_dist_env *env, double deadline) {
  struct addrinfo *ai;
  dflash_status st = resolve(env, true, &ai);
  if (st) return st;
  int fd = -1;
  for (int v6 = 1; fd < 0 && v6 >= 0; v6--) /* dual-stack IPv6 first, else IPv4 */
    for (const struct addrinfo *a = ai; fd < 0 && a; a = a->ai_next)
      if ((a->ai_family == AF_INET6) == v6) fd = listen_on(a);
  if (fd < 0)
    st = df_error_errno(DFLASH_E_IO, errno, "rendezvous: cannot listen on port %d",
                        env->master_port);
  freeaddrinfo(ai);
  for (int joined = 1; !st && joined < env->world;) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int ms = poll_ms(deadline - df_now_seconds()), rc = ms > 0 ? poll(&p, 1, ms) : 0;
    if (rc < 0 || (rc == 0 && ms == 1000 * 1000 * 1000)) continue; /* EINTR; a long wait */
    if (rc == 0) {
      st = df_error(DFLASH_E_TIMEOUT,
                    "rendezvous: only %d of %d ranks joined on port %d before "
                    "the timeout",
                    joined, env->world, env->master_port);
      break;
    }
    int a = accept(fd, NULL, NULL);
    if (a < 0) continue;
    msg_hdr h = {0};
    st = xfer_fd(c, a, -1, &h, sizeof h, false, df_now_seconds() + 10);
    int r = h.origin;
    if (!st && (h.magic != COMM_MAGIC || h.op != OP_HELLO))
      st = df_error(DFLASH_E_IO,
                    "rendezvous: something that is not a libdflash rank connected "
                    "to port %d",
                    env->master_port);
    else if (!st && (int)h.bytes != env->world)
      st = df_error(DFLASH_E_CONFIG, "rendezvous: rank %d has WORLD_SIZE=%d, rank 0 has %d", r,
                    (int)h.bytes, env->world);
    else if (!st && (r <= 0 || r >= env->world || c->fd[r] >= 0))
      st = df_error(DFLASH_E_IO, "rendezvous: a peer announced rank %d (world %d%s)", r, env->world,
                    r > 0 && r < env->world ? ", already joined" : "");
    if (st) {
      close(a);
      break;
    }
    no_delay(a);
    c->fd[r] = a;
    joined++;
  }
  if (fd >= 0) close(fd);
  return st;
}

/* Other ranks: connect (retrying while rank 0 starts) and say hello. */
static dflash_status join(df_comm *c, const df_dist_env *env, double deadline) {
  for (;;) {
    struct addrinfo *ai;
    dflash_status st = resolve(env, false, &ai);
    if (st) return st;
    int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    int ok = fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) == 0;
    int err = errno;
    freeaddrinfo(ai);
    if (ok) {
      no_delay(fd);
      c->fd[0] = fd;
      return send_hdr(c, 0, OP_HELLO, (uint64_t)env->world, deadline);
    }
    if (fd >= 0) close(fd);
    if (df_now_seconds() > deadline)
      return df_error_errno(DFLASH_E_NETWORK, err, "rendezvous: rank %d cannot reach %s:%d",
                            env->rank, env->master_addr, env->master_port);
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

dflash_status df_comm_open(const df_dist_env *env, double timeout_s, df_comm **out) {
  *out = NULL;
  df_comm *c = calloc(1, sizeof *c);
  int n = env->rank == 0 ? env->world : 1;
  if (c) c->fd = malloc(sizeof(int) * (size_t)n);
  if (!c || !c->fd) {
    free(c);
    return df_error_nomem("rank connections");
  }
  for (int i = 0; i < n; i++) c->fd[i] = -1;
  c->rank = env->rank;
  c->world = env->world;
  c->timeout = c->wait = timeout_s;
  c->abort_origin = -1;
  snprintf(c->what, sizeof c->what, "the rendezvous");
  double deadline = df_now_seconds() + timeout_s;
  dflash_status st = env->world <= 1  ? DFLASH_OK
                     : env->rank == 0 ? serve(c, env, deadline)
                                      : join(c, env, deadline);
  if (st) {
    df_comm_free(c);
    return st;
  }
  *out = c;
  return DFLASH_OK;
}

dflash_status df_rendezvous(const df_dist_env *env, void *blob, size_t len, double timeout_s) {
  if (env->world <= 1) return DFLASH_OK;
  df_comm *c;
  dflash_status st = df_comm_open(env, timeout_s, &c);
  if (!st) st = df_comm_broadcast(c, blob, len);
  df_comm_free(c);
  return st;
}

/* ---- buckets -------------------------------------------------------------- */

dflash_status df_bucket_layout_init(df_bucket_layout *l, size_t n, int world, size_t bucket_elems) {
  memset(l, 0, sizeof *l);
  if (world < 1 || n == 0)
    return df_error(DFLASH_E_INVALID_ARG, "bucket layout: %zu elements over %d ranks", n, world);
  size_t w = (size_t)world;
  size_t per = bucket_elems / w * w;
  if (per < w) per = w;
  l->n = n;
  l->world = world;
  l->n_padded = (n + w - 1) / w * w;
  l->shard_len = l->n_padded / w;
  l->n_buckets = (l->n_padded + per - 1) / per;
  l->buckets = calloc(l->n_buckets, sizeof *l->buckets);
  if (!l->buckets) return df_error_nomem("gradient buckets");
  size_t end = l->n_padded, shard = 0;
  for (size_t b = 0; b < l->n_buckets; b++) {
    size_t count = end < per ? end : per;
    l->buckets[b] = (df_bucket){.offset = end - count, .count = count, .shard_offset = shard};
    shard += count / w;
    end -= count;
  }
  return DFLASH_OK;
}

void df_bucket_layout_free(df_bucket_layout *l) {
  if (!l) return;
  free(l->buckets);
  memset(l, 0, sizeof *l);
}
