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
static dflash_status env_int(df_env_fn get, void *ctx, const char *name, long lo, long hi,
                             int *out, bool *found) {
  const char *v = get(ctx, name);
  *found = v && *v;
  if (!*found) return DFLASH_OK;
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || *end || end == v || x < lo || x > hi)
    return df_error(DFLASH_E_CONFIG, "environment variable %s=\"%s\" is not an integer in "
                    "[%ld, %ld]", name, v, lo, hi);
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
    return df_error(DFLASH_E_CONFIG, "environment: %s is set but %s is not (set both RANK and "
                    "WORLD_SIZE, as torchrun does)", has_rank ? "RANK" : "WORLD_SIZE",
                    has_rank ? "WORLD_SIZE" : "RANK");
  if (out->rank >= out->world)
    return df_error(DFLASH_E_CONFIG, "environment: RANK=%d is not below WORLD_SIZE=%d",
                    out->rank, out->world);
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

/* ---- rendezvous ----------------------------------------------------------- */

static dflash_status io_all(int fd, void *buf, size_t n, bool send_it, const char *what) {
  char *p = buf;
  while (n) {
    ssize_t k = send_it ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0)
      return k < 0 ? df_error_errno(DFLASH_E_IO, errno, "rendezvous: %s", what)
                   : df_error(DFLASH_E_IO, "rendezvous: peer closed the connection during %s",
                              what);
    p += k;
    n -= (size_t)k;
  }
  return DFLASH_OK;
}

static dflash_status resolve(const df_dist_env *env, bool passive, struct addrinfo **out) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
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

/* Rank 0: accept world-1 ranks, each sends its rank (4 bytes), gets the blob. */
static dflash_status serve(const df_dist_env *env, const void *blob, size_t len,
                           double deadline) {
  struct addrinfo *ai;
  dflash_status st = resolve(env, true, &ai);
  if (st) return st;
  int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol), one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (fd < 0 || bind(fd, ai->ai_addr, ai->ai_addrlen) || listen(fd, 128))
    st = df_error_errno(DFLASH_E_IO, errno, "rendezvous: cannot listen on port %d",
                        env->master_port);
  freeaddrinfo(ai);
  bool *seen = calloc((size_t)env->world, sizeof *seen);
  if (!st && !seen) st = df_error_nomem("rendezvous");
  for (int joined = 1; !st && joined < env->world;) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int ms = (int)((deadline - df_now_seconds()) * 1000);
    if (ms <= 0 || poll(&p, 1, ms) == 0) {
      st = df_error(DFLASH_E_TIMEOUT, "rendezvous: only %d of %d ranks joined on port %d before "
                    "the timeout", joined, env->world, env->master_port);
      break;
    }
    int c = accept(fd, NULL, NULL);
    if (c < 0) continue;
    int32_t r = -1;
    st = io_all(c, &r, sizeof r, false, "reading a rank");
    if (!st && (r <= 0 || r >= env->world || seen[r]))
      st = df_error(DFLASH_E_IO, "rendezvous: a peer announced rank %d (world %d%s)", r,
                    env->world, r > 0 && r < env->world ? ", already joined" : "");
    if (!st) st = io_all(c, (void *)blob, len, true, "sending the id");
    if (!st) seen[r] = true, joined++;
    close(c);
  }
  free(seen);
  if (fd >= 0) close(fd);
  return st;
}

/* Other ranks: connect (retrying while rank 0 starts), send rank, read blob. */
static dflash_status join(const df_dist_env *env, void *blob, size_t len, double deadline) {
  for (;;) {
    struct addrinfo *ai;
    dflash_status st = resolve(env, false, &ai);
    if (st) return st;
    int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
    int ok = fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) == 0;
    int err = errno;
    freeaddrinfo(ai);
    if (ok) {
      int32_t r = env->rank;
      st = io_all(fd, &r, sizeof r, true, "sending the rank");
      if (!st) st = io_all(fd, blob, len, false, "reading the id");
      close(fd);
      return st;
    }
    if (fd >= 0) close(fd);
    if (df_now_seconds() > deadline)
      return df_error_errno(DFLASH_E_NETWORK, err, "rendezvous: rank %d cannot reach %s:%d",
                            env->rank, env->master_addr, env->master_port);
    struct timespec ts = {0, 50 * 1000 * 1000};
    nanosleep(&ts, NULL);
  }
}

dflash_status df_rendezvous(const df_dist_env *env, void *blob, size_t len, double timeout_s) {
  if (env->world <= 1) return DFLASH_OK;
  double deadline = df_now_seconds() + timeout_s;
  return env->rank == 0 ? serve(env, blob, len, deadline) : join(env, blob, len, deadline);
}

/* ---- buckets -------------------------------------------------------------- */

dflash_status df_bucket_layout_init(df_bucket_layout *l, size_t n, int world,
                                    size_t bucket_elems) {
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
