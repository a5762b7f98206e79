/*
 * Data-parallel plumbing that needs no GPU: which rank this process is
 * (torchrun / Slurm environment), a TCP rendezvous that hands rank 0's NCCL
 * unique id to every rank, and the gradient bucket layout that the
 * all-reduce / reduce-scatter and the ZeRO-1 optimizer shards follow.
 */
#ifndef DFLASH_TRAIN_DIST_H
#define DFLASH_TRAIN_DIST_H

#include "core/internal.h"

typedef struct df_dist_env {
  int rank, world, local_rank;
  char master_addr[256];
  int master_port;
} df_dist_env;

/* Look up a variable (getenv, or a table in tests). */
typedef const char *(*df_env_fn)(void *ctx, const char *name);

/*
 * RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (torchrun), else
 * SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID with MASTER_ADDR/PORT. No
 * variables at all: a single process (rank 0 of 1, no rendezvous needed).
 * World > 1 requires MASTER_ADDR and MASTER_PORT. DFLASH_E_CONFIG names the
 * variable that is missing or malformed.
 */
DF_MUST_CHECK dflash_status df_dist_env_parse(df_env_fn get, void *ctx, df_dist_env *out);
/* The same over the process environment. */
DF_MUST_CHECK dflash_status df_dist_env_from_environ(df_dist_env *out);

/*
 * Give every rank rank 0's `len` bytes in `blob`: rank 0 listens on
 * master_addr:master_port and sends the blob to each of the world-1 ranks
 * that connect (each names its rank; duplicates and out-of-range ranks are
 * refused); the others connect, retrying until `timeout_s`. The same as
 * df_comm_open + df_comm_broadcast + df_comm_free.
 */
DF_MUST_CHECK dflash_status df_rendezvous(const df_dist_env *env, void *blob, size_t len,
                                          double timeout_s);

/*
 * A host communicator between the ranks of a data-parallel run: persistent
 * TCP connections in a star around rank 0, made with the same rendezvous.
 * It carries the CPU backend's gradient all-reduce and every rank's small
 * scalars (weights, loss, tokens), the NCCL id, and failures.
 *
 * Reductions are deterministic: rank 0 adds the contributions in rank order
 * (((x0 + x1) + x2) + ...) in the buffer's own type and sends the result
 * to every rank, so all ranks hold the same bits.
 *
 * Every collective is bounded by `timeout_s` (a rank that sends nothing for
 * that long is named in a DFLASH_E_TIMEOUT). A peer whose connection closes
 * (it exited or was killed) fails the collective with DFLASH_E_NETWORK
 * naming that rank; a peer that reported a failure with df_comm_abort, with
 * DFLASH_E_CANCELLED naming it and quoting its message. Rank 0 passes every
 * such failure on to the other ranks, so no rank waits for a dead run.
 * After a failure the communicator is broken: later calls fail at once.
 * Ranks must call the same collectives in the same order (checked: a
 * mismatch is DFLASH_E_INTERNAL, "the ranks diverged").
 */
typedef struct df_comm df_comm;
DF_MUST_CHECK dflash_status df_comm_open(const df_dist_env *env, double timeout_s, df_comm **out);
/* NULL-safe. Closes the connections (peers see the rank leave). */
void df_comm_free(df_comm *c);
int df_comm_rank(const df_comm *c);
int df_comm_world(const df_comm *c);
/* Sum over ranks, in place. */
DF_MUST_CHECK dflash_status df_comm_sum_f32(df_comm *c, float *x, size_t n);
DF_MUST_CHECK dflash_status df_comm_sum_f64(df_comm *c, double *x, size_t n);
/* Rank 0's `len` bytes to every rank (len must agree). len 0: a barrier. */
DF_MUST_CHECK dflash_status df_comm_broadcast(df_comm *c, void *buf, size_t len);
/* Tell the peers that this rank stops with `status` (the thread's last
 * error is sent as the reason). Best effort, never blocks; breaks c. */
void df_comm_abort(df_comm *c, dflash_status status);

/*
 * Buckets over a flat gradient buffer of n elements: the buffer is padded to
 * n_padded (a multiple of world), and cut into buckets of at most
 * `bucket_elems` (rounded down to a multiple of world, at least world),
 * numbered from the END of the buffer (the last layers' gradients are ready
 * first in the backward pass). Each bucket's length is a multiple of world;
 * rank r owns the r-th 1/world slice of every bucket (ZeRO-1), and its slices
 * laid end to end, in bucket order, form its optimizer shard.
 */
typedef struct df_bucket {
  size_t offset, count; /* range of the padded flat buffer */
  size_t shard_offset;  /* where this bucket's slice starts in each rank's shard */
} df_bucket;

typedef struct df_bucket_layout {
  size_t n, n_padded, shard_len; /* shard_len = n_padded / world */
  int world;
  size_t n_buckets;
  df_bucket *buckets;
} df_bucket_layout;

DF_MUST_CHECK dflash_status df_bucket_layout_init(df_bucket_layout *l, size_t n, int world,
                                                  size_t bucket_elems);
void df_bucket_layout_free(df_bucket_layout *l);

#endif
