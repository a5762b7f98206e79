/* A spool shared by several consumers on S3 (df_spool_share): each reads every shard's header
 * and only its own samples' bytes, the next shard's on a thread. spool.c says how the spool
 * works. */
#include <dflash/storage.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "hidden.h"
#include "storage/stage.h"
#include "spool_internal.h"

/* ---- a spool shared by several consumers, on S3 ---------------------------------------------- */

/* Mark this consumer's samples of ts[from..n) (usable sample k of the epoch is its when
 * k mod G is in [lo, hi)) as kept, the others not loaded; the count after them. With k
 * unknown (after a seek without it) none is kept: each is then read when it is asked for. */
static uint64_t mark_keep(const dflash_spool *sp, sp_tensor *ts, size_t n, size_t from,
                          uint64_t k) {
  for (size_t i = 0; i < n; i++) {
    ts[i].loaded = false, ts[i].keep = false;
    if (i < from || k == K_UNKNOWN || !sp->usable(sp->uctx, ts[i].id)) continue;
    ts[i].keep = k % sp->G >= sp->lo && k % sp->G < sp->hi;
    k++;
  }
  return k;
}

/* Read the kept samples' bytes of shard `loc` into base, one ranged GET per run of them. */
static dflash_status fetch_kept(dflash_storage *st, const char *loc, uint8_t *base, sp_tensor *ts,
                                size_t n) {
  for (size_t i = 0; i < n;) {
    if (!ts[i].keep) {
      i++;
      continue;
    }
    size_t j = i + 1;
    while (j < n && ts[j].keep && ts[j].begin == ts[j - 1].end) j++;
    size_t len = (size_t)(ts[j - 1].end - ts[i].begin), got = 0;
    dflash_status s = dflash_storage_read_range(st, loc, ts[i].begin, base + ts[i].begin, len,
                                                &got);
    if (!s && got != len)
      s = df_error(DFLASH_E_TRUNCATED, "%s: %zu of %zu bytes at %" PRIu64, loc, got, len,
                   ts[i].begin);
    if (s) return s;
    for (size_t m = i; m < j; m++) ts[m].loaded = true;
    i = j;
  }
  return DFLASH_OK;
}

/* Header, index and kept samples of shard `loc` (`size` bytes, 0: stat it) into b / *cur / *ts. */
static dflash_status sparse_read(const dflash_spool *sp, dflash_storage *st, const char *loc,
                                 uint64_t size, size_t from, uint64_t k, df_stage_buf *b,
                                 df_stage_st **cur, sp_tensor **ts, size_t *n, uint64_t *k_after) {
  dflash_storage_info info = {.struct_size = sizeof info};
  dflash_status s = size ? DFLASH_OK : dflash_storage_stat(st, loc, &info);
  if (!size) size = info.size;
  if (!s) s = df_stage_read_header(st, loc, size, b);
  if (!s) s = df_stage_st_parse(loc, b, cur);
  if (!s) s = df_sp_index_into(sp, *cur, b->data, loc, ts, n);
  if (!s) *k_after = mark_keep(sp, *ts, *n, from, k);
  return s ? s : fetch_kept(st, loc, b->data, *ts, *n);
}

static void *sparse_main(void *arg) {
  sp_sparse *a = arg;
  a->status = sparse_read(a->sp, a->st, a->loc, 0, 0, a->k, &a->buf, &a->cur, &a->ts, &a->n_ts,
                          &a->k_after);
  __atomic_store_n(&a->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

/* Wait for the thread, and forget what it read (the buffer stays, for reuse). */
void df_sp_sparse_drop(sp_sparse *a) {
  if (a->running) pthread_join(a->th, NULL);
  a->running = false;
  df_stage_st_free(a->cur);
  free(a->ts);
  a->cur = NULL, a->ts = NULL, a->n_ts = 0;
  free(a->loc);
  a->loc = NULL;
}

/* Start reading shard (e, s), whose first usable sample is the epoch's k-th, ahead. */
void df_sp_sparse_start(dflash_spool *sp, int32_t e, uint64_t s, uint64_t k) {
  sp_sparse *a = &sp->next;
  df_sp_sparse_drop(a);
  if (k == K_UNKNOWN || (!a->st && dflash_storage_create(NULL, &a->st))) {
    dflash_clear_error();
    return;
  }
  if (!(a->loc = df_sp_shard_loc(sp->base, e, s, "safetensors"))) return;
  a->sp = sp, a->e = e, a->s = s, a->k = k, a->status = DFLASH_E_NOT_FOUND, a->done = 0;
  a->running = pthread_create(&a->th, NULL, sparse_main, a) == 0;
}

/* Whether shard (e, s) is read ahead already (header, index and kept samples). */
bool df_sp_sparse_has(const dflash_spool *sp, int32_t e, uint64_t s) {
  const sp_sparse *a = &sp->next;
  if (!a->loc || a->e != e || a->s != s || !a->running) return false;
  return __atomic_load_n(&a->done, __ATOMIC_ACQUIRE) && a->status == DFLASH_OK;
}

bool df_sp_shared_s3(const dflash_spool *sp) {
  return sp->usable && dflash_storage_is_remote(sp->base);
}

/* Shard (e, s) of a shared spool on S3: the one read ahead when it is this one, else its
 * header and this consumer's samples from the position on, read now. */
dflash_status df_sp_sparse_open(dflash_spool *sp, const char *loc, uint64_t size, int32_t e,
                                uint64_t s) {
  sp_sparse *a = &sp->next;
  if (a->running) pthread_join(a->th, NULL), a->running = false;
  dflash_status r;
  if (!sp->seeked && a->loc && a->e == e && a->s == s && a->status == DFLASH_OK &&
      a->buf.len == size) {
    df_stage_buf t = sp->mem;
    sp->mem = a->buf, a->buf = t;
    sp->cur = a->cur, sp->ts = a->ts, sp->n_ts = a->n_ts, sp->k_after = a->k_after;
    a->cur = NULL, a->ts = NULL, a->n_ts = 0;
    r = DFLASH_OK;
  } else {
    uint64_t k = sp->seeked ? sp->k_seek : sp->k_after;
    r = sparse_read(sp, sp->st, loc, size, sp->seeked ? (size_t)sp->offset : 0, k, &sp->mem,
                    &sp->cur, &sp->ts, &sp->n_ts, &sp->k_after);
  }
  df_sp_sparse_drop(a);
  return r;
}

/* A sample of a shared spool that was not read with its shard (not this consumer's as far as
 * the shard's reading knew, e.g. a short last batch's share): its bytes now. */
dflash_status df_sp_load_sample(dflash_spool *sp, sp_tensor *t) {
  if (t->loaded) return DFLASH_OK;
  char *loc = df_sp_shard_loc(sp->base, sp->cur_e, sp->cur_s, "safetensors");
  if (!loc) return df_error_nomem("spool");
  t->keep = true;
  dflash_status s = fetch_kept(sp->st, loc, sp->mem.data, t, 1);
  free(loc);
  return s;
}

void df_spool_share(dflash_spool *sp, df_spool_usable_fn usable, void *ctx, uint64_t global_batch,
                    uint64_t lo, uint64_t hi) {
  sp->usable = usable, sp->uctx = ctx, sp->G = global_batch, sp->lo = lo, sp->hi = hi;
}
