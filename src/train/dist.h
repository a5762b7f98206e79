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
dflash_status df_dist_env_parse(df_env_fn get, void *ctx, df_dist_env *out);
/* The same over the process environment. */
dflash_status df_dist_env_from_environ(df_dist_env *out);

/*
 * Give every rank rank 0's `len` bytes in `blob`: rank 0 listens on
 * master_addr:master_port and sends the blob to each of the world-1 ranks
 * that connect (each names its rank; duplicates and out-of-range ranks are
 * refused); the others connect, retrying until `timeout_s`.
 */
dflash_status df_rendezvous(const df_dist_env *env, void *blob, size_t len, double timeout_s);

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

dflash_status df_bucket_layout_init(df_bucket_layout *l, size_t n, int world,
                                    size_t bucket_elems);
void df_bucket_layout_free(df_bucket_layout *l);

#endif
