/* The spool's internals, shared by spool.c (names and small files), spool_produce.c,
 * spool_consume.c and spool_share.c. Internal to src/hidden. */
#ifndef DFLASH_HIDDEN_SPOOL_INTERNAL_H
#define DFLASH_HIDDEN_SPOOL_INTERNAL_H

#include <dflash/storage.h>
#include <pthread.h>
#include <stdbool.h>

#include "hidden.h"
#include "storage/stage.h"

#define DF_SPOOL_FORMAT "dflash-spool-1"

enum { SP_SHARD, SP_IDS, SP_END };

typedef struct sp_entry {
  int kind;
  int32_t epoch;
  uint64_t seq, size;
} sp_entry;

typedef struct sp_scan {
  sp_entry *e;
  size_t n;
} sp_scan;

typedef struct sp_tensor {
  const char *id;
  const void *codes, *scales;
  int64_t len;
  const void *tids; /* "t/<id>" I32 [len] in the shard, or NULL */
  /* A spool with final_state: "f/<id>" [len, H] codes and, for fp8, "fs/<id>" F32 [len, 1] */
  const void *fcodes, *fscales;
  uint64_t begin, end; /* its tensors' bytes in the shard (they follow each other) */
  bool keep;           /* shared (df_spool_share): this consumer's, so read with the header */
  bool loaded;         /* its bytes are in memory (always, but for a shared spool on S3) */
} sp_tensor;

/* s3://: the next shard, read on a thread of its own (its own client) while the trainer uses the
 * current one, so that a GET is not on the trainer's path. Only a hint: whatever it could not
 * read (not published yet, gone, an error) is read again the plain way, which reports it. */
typedef struct sp_ahead {
  pthread_t th;
  bool running;
  dflash_storage *st;
  char *loc;
  int32_t e;
  uint64_t s;
  df_stage_buf buf;
  dflash_status status;
  int done; /* set (release) by the thread when status and buf are final */
} sp_ahead;

#define K_UNKNOWN UINT64_MAX /* a count of usable samples not known (sp_sparse, df_spool_seek) */

/* A shared spool on S3: the next shard's header, index and kept samples, read on a thread of its
 * own (its own client). Its fields are the thread's until `done`; a hint like sp_ahead. */
typedef struct sp_sparse {
  pthread_t th;
  bool running;
  dflash_storage *st;
  const struct dflash_spool *sp; /* read only: K, H, dtype and the share */
  char *loc;
  int32_t e;
  uint64_t s, k, k_after; /* usable samples of the epoch before and after the shard */
  df_stage_buf buf;
  df_stage_st *cur;
  sp_tensor *ts;
  size_t n_ts;
  dflash_status status;
  int done;
} sp_sparse;

typedef struct sp_opened {
  int32_t e;
  uint64_t s, size;
} sp_opened;

struct dflash_spool {
  char *base;
  dflash_storage *st;
  dflash_spool_options o;
  int32_t K, H, dtype;
  bool final;      /* spool.json declares final_state: every sample has "f/<id>" */
  bool want_final; /* decode it into dflash_sample.target_final (df_spool_set_final) */
  int32_t epoch;   /* position */
  uint64_t shard, offset;
  df_stage_st *cur; /* the open shard (of spool epoch cur_e), or NULL */
  int32_t cur_e;
  uint64_t cur_s;
  df_stage_buf mem; /* s3://: the shard's bytes, one GET into a buffer reused shard after shard */
  sp_ahead ahead;   /* s3://: the next shard's, read meanwhile (two shards in memory at most) */
  bool read_ahead;  /* off with DFLASH_SPOOL_READ_AHEAD=0 (bench/s3_read.py compares) */
  sp_tensor *ts;    /* its samples in append order */
  size_t n_ts;
  float *buf;
  size_t cap;
  int32_t *tbuf; /* the current sample's target ids (the shard's may be unaligned) */
  size_t tcap;
  float *fbuf; /* the current sample's final state, float32 [len, H] */
  size_t fcap;
  bool waited_note;
  /* The shards opened and not released yet, with their sizes, and the producer's budget once
   * read: the trainer's room accounting without a listing of the spool per shard. */
  sp_opened *opened;
  size_t n_opened, cap_opened;
  uint64_t budget;
  /* Shared by several consumers (df_spool_share): on S3 this one reads every shard's header
   * and only its own samples' bytes, the next shard's on a thread (`next`). */
  df_spool_usable_fn usable;
  void *uctx;
  uint64_t G, lo, hi;
  uint64_t k_seek, k_after; /* usable samples of the epoch before the seek / after cur */
  bool seeked;
  sp_sparse next;
};

/* spool.c: names and small files */
char *df_sp_path(const char *base, const char *name);
char *df_sp_shard_loc(const char *base, int32_t e, uint64_t s, const char *ext);
char *df_sp_end_loc(const char *base, int32_t e);
DF_MUST_CHECK dflash_status df_sp_scan(dflash_storage *st, const char *base, sp_scan *out);
DF_MUST_CHECK dflash_status df_sp_read_small(dflash_storage *st, const char *loc, char **text);
bool df_sp_before(int32_t e, uint64_t s, int32_t me, uint64_t ms);
void df_sp_sleep_s(double s);
double df_sp_poll_step(double waited);

/* spool_consume.c */
DF_MUST_CHECK dflash_status df_sp_index_into(const dflash_spool *sp, const df_stage_st *f,
                                             const uint8_t *base, const char *loc, sp_tensor **out,
                                             size_t *n_out);

/* spool_share.c */
void df_sp_sparse_drop(sp_sparse *a);
void df_sp_sparse_start(dflash_spool *sp, int32_t e, uint64_t s, uint64_t k);
bool df_sp_sparse_has(const dflash_spool *sp, int32_t e, uint64_t s);
bool df_sp_shared_s3(const dflash_spool *sp);
DF_MUST_CHECK dflash_status df_sp_sparse_open(dflash_spool *sp, const char *loc, uint64_t size,
                                              int32_t e, uint64_t s);
DF_MUST_CHECK dflash_status df_sp_load_sample(dflash_spool *sp, sp_tensor *t);

#endif
