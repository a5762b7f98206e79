/*
 * The spool batch source of a training run (--hidden spool:PATH): the dataset opened
 * alone (or joined with an offline store), the spool's samples gathered into global batches
 * in the producer's order, each rank keeping its share, and the used-up shards released
 * after a state save. Split out of run.c (the run struct: run_internal.h).
 */
#include <dflash/hidden.h>
#include <dflash/storage.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/backend.h"
#include "train/cuda/dist.h"
#include "hidden/hidden.h"
#include "train/position.h"
#include "stream.h"
#include "train/rng.h"
#include "train/remote_files.h"
#include "train/trainer.h"
#include "run_internal.h"

/* ---- --hidden spool:PATH ---------------------------------------------------------------- */

static const char *spool_path(const char *hidden) {
  return strncmp(hidden, "spool:", 6) ? NULL : hidden + 6;
}

static const dflash_dataset *g_sort_tok; /* qsort has no context argument */

static const char *id_of(const dflash_dataset *t, uint64_t i) {
  const char *id;
  const int32_t *ids;
  const uint8_t *mask;
  size_t n_ids;
  /* i < count (the callers' bisection): the one failure, an index out of range, never comes. */
  if (dflash_dataset_sample(t, (size_t)i, &ids, &mask, &n_ids, &id)) return "";
  return id;
}

static int cmp_by_id(const void *a, const void *b) {
  return strcmp(id_of(g_sort_tok, *(const uint64_t *)a), id_of(g_sort_tok, *(const uint64_t *)b));
}

/* The dataset index of a sample id, or -1. */
static int64_t find_id(const run *r, const char *id) {
  size_t lo = 0, hi = dflash_dataset_count(r->tok);
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(id_of(r->tok, r->by_id[mid]), id);
    if (!c) return (int64_t)r->by_id[mid];
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return -1;
}

/* df_spool_share's test (read only: safe on the spool's thread). */
bool df_run_spool_usable(void *ctx, const char *id) {
  const run *r = ctx;
  int64_t idx = find_id(r, id);
  return idx >= 0 && r->is_usable[idx];
}

/* The dataset alone (the spool comes sample by sample), or the dataset joined with a store.
 * On CUDA the samples (from a store or the spool alike) carry their hidden rows as stored,
 * for the device to convert and check (DFLASH_TRAIN_STORED_ROWS=0 / 1 overrides, e.g. to
 * train the CPU backend through the same path). */
dflash_status df_run_open_data(run *r) {
  const dflash_train_run_options *o = r->o;
  const char *path = spool_path(o->hidden_dir);
  const char *sr = getenv("DFLASH_TRAIN_STORED_ROWS");
  r->stored_rows = sr && *sr ? !strcmp(sr, "1") : r->topt.backend == DFLASH_BACKEND_CUDA;
  if (!path) {
    dflash_sample_stream_options so;
    dflash_sample_stream_options_default(&so);
    so.stored_rows = r->stored_rows;
    dflash_status st = dflash_sample_stream_open(o->data_dir, o->hidden_dir, &so, &r->s);
    if (!st) r->tok = df_sample_stream_tokens(r->s);
    return st;
  }
  dflash_spool_options so;
  dflash_spool_options_default(&so);
  so.wait_s = o->spool_wait_s;
  so.reuse = o->spool_reuse != 0;
  so.stored_rows = r->stored_rows;
  r->sp_info.struct_size = sizeof r->sp_info;
  dflash_status st = dflash_dataset_open(o->data_dir, &r->own_tok);
  if (!st) st = dflash_spool_open(path, &so, &r->spool);
  if (!st) st = dflash_spool_get_info(r->spool, &r->sp_info);
  if (st) return st;
  r->tok = r->own_tok;
  size_t n = dflash_dataset_count(r->tok);
  r->by_id = malloc((n ? n : 1) * sizeof *r->by_id);
  r->is_usable = calloc(n ? n : 1, 1);
  if (!r->by_id || !r->is_usable) return df_error_nomem("dataset ids");
  for (size_t i = 0; i < n; i++) r->by_id[i] = i;
  g_sort_tok = r->tok;
  qsort(r->by_id, n, sizeof *r->by_id, cmp_by_id);
  return DFLASH_OK;
}

int64_t df_run_spool_width(const run *r) {
  return (int64_t)r->sp_info.num_layers * r->sp_info.hidden_size;
}

dflash_status df_run_spool_buffers(run *r) {
  size_t b = (size_t)r->o->batch_size;
  r->batch_idx = malloc(b * sizeof *r->batch_idx);
  r->batch_h = calloc(b, sizeof *r->batch_h);
  r->batch_cap = calloc(b, sizeof *r->batch_cap);
  r->batch_t = calloc(b, sizeof *r->batch_t);
  r->batch_tcap = calloc(b, sizeof *r->batch_tcap);
  r->batch_pos = calloc(r->global_batch, sizeof *r->batch_pos);
  r->batch_f = calloc(b, sizeof *r->batch_f);
  r->batch_fcap = calloc(b, sizeof *r->batch_fcap);
  return r->batch_idx && r->batch_h && r->batch_cap && r->batch_t && r->batch_tcap &&
                 r->batch_pos && r->batch_f && r->batch_fcap
             ? DFLASH_OK
             : df_error_nomem("batch");
}

/* The next trainable sample of the spool into slot i of the batch: *got = 0 at the end of the
 * epoch. Samples that cannot carry an anchor are passed over, as offline. */
static dflash_status spool_checkpoint(run *r, bool model);

/* The spool sample's target ids into slot i of the batch (a flag of none). */
static dflash_status keep_tids(run *r, size_t i, const dflash_sample *smp) {
  if (!smp->target_ids)
    return r->batch_tcap[i] = 0, free(r->batch_t[i]), r->batch_t[i] = NULL, DFLASH_OK;
  if ((size_t)smp->len > r->batch_tcap[i]) {
    free(r->batch_t[i]);
    r->batch_tcap[i] = 0;
    if (!(r->batch_t[i] = malloc((size_t)smp->len * sizeof(int32_t))))
      return df_error_nomem("batch");
    r->batch_tcap[i] = (size_t)smp->len;
  }
  memcpy(r->batch_t[i], smp->target_ids, (size_t)smp->len * sizeof(int32_t));
  return DFLASH_OK;
}

/* The spool sample's target final state into slot i of the batch (a DSpark run from a spool
 * with final_state: the spool gives it for every sample). */
static dflash_status keep_final(run *r, size_t i, const dflash_sample *smp) {
  if (!r->sp_final) return DFLASH_OK;
  if (!smp->target_final)
    return df_error(DFLASH_E_INTERNAL, "spool %s: sample %s came without its final state",
                    r->o->hidden_dir, smp->id);
  size_t n = (size_t)smp->len * (size_t)r->sp_info.hidden_size;
  if (n > r->batch_fcap[i]) {
    free(r->batch_f[i]);
    r->batch_fcap[i] = 0;
    if (!(r->batch_f[i] = malloc(n * sizeof(float)))) return df_error_nomem("batch");
    r->batch_fcap[i] = n;
  }
  memcpy(r->batch_f[i], smp->target_final, n * sizeof(float));
  return DFLASH_OK;
}

/* Bytes of a spool sample's codes (padded to 4) and scales, when the rows come as stored. */
static void spool_bytes(const run *r, int64_t len, size_t *codes, size_t *scales) {
  size_t n = (size_t)len * (size_t)df_run_spool_width(r);
  bool fp8 = r->sp_info.dtype == DFLASH_DTYPE_F8_E4M3;
  *codes = ((fp8 ? n : 2 * n) + 3) & ~(size_t)3;
  *scales = fp8 ? 4 * (size_t)len * (size_t)r->sp_info.num_layers : 0;
}

/* The spool sample's hidden rows (float32, or as stored) into slot i of the batch. */
static dflash_status keep_rows(run *r, size_t i, const dflash_sample *smp) {
  size_t n = (size_t)smp->len * (size_t)df_run_spool_width(r), code_b, scale_b;
  spool_bytes(r, smp->len, &code_b, &scale_b);
  size_t bytes = r->stored_rows ? code_b + scale_b : n * sizeof(float);
  if (bytes > r->batch_cap[i]) {
    free(r->batch_h[i]);
    r->batch_cap[i] = 0;
    if (!(r->batch_h[i] = malloc(bytes))) return df_error_nomem("batch");
    r->batch_cap[i] = bytes;
  }
  if (!r->stored_rows) {
    memcpy(r->batch_h[i], smp->hidden, n * sizeof(float));
  } else {
    memcpy(r->batch_h[i], smp->hidden_codes, r->sp_info.dtype == DFLASH_DTYPE_F8_E4M3 ? n : 2 * n);
    if (scale_b) memcpy(r->batch_h[i] + code_b, smp->hidden_scales, scale_b);
  }
  return DFLASH_OK;
}

/* The next trainable sample of the spool: its data into slot i when `keep` (else passed over,
 * unread: another rank's), its place in *at; *got = 0 at the end of the epoch. Samples that
 * cannot carry an anchor are passed over, as offline. */
static dflash_status spool_take(run *r, size_t i, bool keep, int *got, df_spool_pos *at) {
  for (;;) {
    /* About to wait: the producer may be waiting for room, so give back what the last step used
     * up (the state then is the last step's: nothing has changed since). One process only: the
     * save is collective, and ranks do not wait at the same moments (spool_maybe_free). */
    bool unreleased = r->bnd_epoch != r->rel_epoch || r->bnd_shard != r->rel_shard;
    dflash_status cst = r->world == 1 && unreleased && !df_spool_ready(r->spool)
                            ? spool_checkpoint(r, false)
                            : DFLASH_OK;
    if (cst) return cst;
    dflash_sample smp = {.struct_size = sizeof smp};
    int32_t end;
    /* The trainer's own wait counter: time in a next that had no shard ready to read. */
    bool ready = df_spool_ready(r->spool);
    double t_wait = df_now_seconds();
    dflash_status st = keep ? dflash_spool_next(r->spool, &smp, &end)
                            : df_spool_pass(r->spool, &smp, &end);
    if (!ready) r->spool_wait += df_now_seconds() - t_wait;
    if (st || end) return *got = 0, st;
    int64_t idx = find_id(r, smp.id);
    if (idx < 0)
      return df_error(DFLASH_E_NOT_FOUND, "spool sample %s is not in the dataset %s", smp.id,
                      r->o->data_dir);
    const char *id;
    const int32_t *ids;
    const uint8_t *mask;
    size_t n_ids;
    if ((st = dflash_dataset_sample(r->tok, (size_t)idx, &ids, &mask, &n_ids, &id))) return st;
    int64_t len = (int64_t)n_ids;
    if (len != smp.len)
      return df_error(DFLASH_E_MISMATCH,
                      "sample %s: %" PRId64 " tokens but %" PRId64 " rows of "
                      "hidden states in the spool",
                      id, len, smp.len);
    if (!r->is_usable[idx]) continue;
    *at = (df_spool_pos){smp.epoch, smp.shard, smp.offset};
    if (!keep) return *got = 1, DFLASH_OK;
    if ((st = keep_rows(r, i, &smp))) return st;
    r->batch_idx[i] = (uint64_t)idx;
    if ((st = keep_tids(r, i, &smp)) || (st = keep_final(r, i, &smp))) return st;
    return *got = 1, DFLASH_OK;
  }
}

/* Gather the next global batch (*n samples; *ended at the epoch's end marker) and keep this
 * rank's share: the full batch's share as the samples come, and for a short last batch, whose
 * share is known only at the end, the samples of that share read again. */
static dflash_status spool_batch(run *r, size_t *n, bool *ended) {
  size_t B = (size_t)r->o->batch_size, lo = B * (size_t)r->rank, hi = lo + B, lo2, hi2;
  int one = 1;
  dflash_status st = DFLASH_OK;
  for (*n = 0; *n < r->global_batch && one && !st; *n += (size_t)one) {
    bool keep = *n >= lo && *n < hi;
    st = spool_take(r, keep ? *n - lo : 0, keep, &one, &r->batch_pos[*n]);
  }
  if (st) return st;
  *ended = !one;
  df_run_share(r, *n, &lo2, &hi2);
  hi = hi < *n ? hi : *n;
  r->n_mine = hi > lo ? hi - lo : 0;
  if (lo2 == lo && hi2 == hi) return DFLASH_OK; /* always with one rank */
  df_spool_pos back;
  st = dflash_spool_tell(r->spool, &back.epoch, &back.shard, &back.offset);
  for (size_t k = lo2; k < hi2 && !st; k++) {
    const df_spool_pos *p = &r->batch_pos[k];
    df_spool_pos at;
    st = dflash_spool_seek(r->spool, p->epoch, p->shard, p->offset);
    if (!st) st = spool_take(r, k - lo2, true, &one, &at);
    if (!st && (!one || at.epoch != p->epoch || at.shard != p->shard || at.offset != p->offset))
      st = df_error(DFLASH_E_INTERNAL,
                    "spool %s: sample at e%d s%" PRIu64 " +%" PRIu64 " not found again",
                    r->o->hidden_dir, p->epoch, p->shard, p->offset);
  }
  /* Back to where the end marker left it: the next epoch's start (no usable sample before). */
  if (!st) st = df_spool_seek_k(r->spool, back.epoch, back.shard, back.offset, 0);
  r->n_mine = hi2 - lo2;
  return st;
}

/* Sample i of the gathered batch, as the stream would give it. */
dflash_status df_run_spool_sample(run *r, size_t i, dflash_sample *out, int32_t *done) {
  const char *id;
  *done = 0;
  out->struct_size = sizeof *out;
  out->index = r->batch_idx[i];
  size_t n_ids;
  dflash_status st = dflash_dataset_sample(r->tok, (size_t)out->index, &out->input_ids,
                                           &out->loss_mask, &n_ids, &id);
  if (st) return st;
  out->len = (int64_t)n_ids;
  out->id = id;
  out->target_ids = r->batch_t[i];
  out->target_final = r->sp_final ? r->batch_f[i] : NULL;
  out->hidden = r->stored_rows ? NULL : (const float *)r->batch_h[i];
  out->hidden_dtype = r->sp_info.dtype;
  out->hidden_codes = r->stored_rows ? r->batch_h[i] : NULL;
  size_t code_b, scale_b;
  spool_bytes(r, out->len, &code_b, &scale_b);
  out->hidden_scales = r->stored_rows && scale_b ? (const float *)(r->batch_h[i] + code_b) : NULL;
  return DFLASH_OK;
}

/* The state is durable up to the last step's spool position: let the producer reuse the room. */
static dflash_status spool_release(run *r) {
  if (r->bnd_epoch == r->rel_epoch && r->bnd_shard == r->rel_shard) return DFLASH_OK;
  dflash_status st = DFLASH_OK;
  if (r->rank == 0) st = dflash_spool_release(r->spool, r->bnd_epoch, r->bnd_shard);
  else df_spool_forget(r->spool, r->bnd_epoch, r->bnd_shard); /* rank 0 deletes */
  if (!st) r->rel_epoch = r->bnd_epoch, r->rel_shard = r->bnd_shard;
  return st;
}

/* Save the state as of the last step (and the checkpoint with `model`), then release. */
static dflash_status spool_checkpoint(run *r, bool model) {
  dflash_status st = df_run_save_as(r, r->bnd_epoch, r->bnd_pos, model);
  return st ? st : spool_release(r);
}

static void spool_boundary(run *r, bool ended) {
  /* Cannot fail on an open spool with these pointers. */
  DF_IGNORE(dflash_spool_tell(r->spool, &r->bnd_epoch, &r->bnd_shard, &r->bnd_off));
  r->bnd_pos = ended ? 0 : r->pos;
}

/* After a step that used up shards: a state save to free them only once they are half the
 * producer's budget (every save writes the whole optimizer state), or always when the
 * producer's budget is unknown. Waiting for a shard saves anyway (spool_take); with several
 * ranks, which cannot agree on when to wait, rank 0 decides here instead, saving also when
 * the next shard is not there yet, and tells the others. */
static dflash_status spool_maybe_free(run *r) {
  if (r->bnd_epoch == r->rel_epoch && r->bnd_shard == r->rel_shard) return DFLASH_OK;
  uint64_t used = 0, budget = 0;
  int32_t save = 0;
  dflash_status st = DFLASH_OK;
  if (r->rank == 0) {
    st = df_spool_pressure(r->spool, r->bnd_epoch, r->bnd_shard, &used, &budget);
    save = !budget || 2 * used >= budget || (r->world > 1 && !df_spool_ready(r->spool));
  }
  if (!st && r->comm) st = df_comm_broadcast(r->comm, &save, sizeof save);
  return st || !save ? st : spool_checkpoint(r, false);
}

/*
 * Training from a spool: each epoch is what the producer published for it, in its order, up to
 * its end marker; a step takes the next batch_size trainable samples (fewer at the end). Used-up
 * shards are released after a state save (train_state only) when they reach half the budget or
 * the trainer would wait; checkpoints as offline (save_every, max_steps, the end).
 */
dflash_status df_run_spool_loop(run *r) {
  const dflash_train_run_options *o = r->o;
  dflash_status st = DFLASH_OK;
  bool reuse = o->spool_reuse != 0;
  if ((st = df_spool_seek_k(r->spool, r->epoch, r->sp_shard, r->sp_off, r->pos))) return st;
  spool_boundary(r, false);
  r->bnd_pos = r->pos;
  r->rel_epoch = r->epoch, r->rel_shard = r->sp_shard;
  if (r->resumed) { /* a kill between the state and the deletes: finish them */
    r->rel_epoch = -1;
    if ((st = spool_release(r))) return st;
  }
  /* Resumed exactly at max_steps: the run is done (the loop below would take one more). */
  if (o->max_steps > 0 && dflash_trainer_step_count(r->t) >= o->max_steps) return DFLASH_OK;
  for (; r->epoch < o->epochs; r->epoch++, r->pos = 0, r->sp_shard = r->sp_off = 0) {
    if ((st = df_spool_seek_k(r->spool, r->epoch, r->sp_shard, r->sp_off, r->pos))) return st;
    for (bool ended = false; !ended;) {
      size_t got = 0;
      if ((st = spool_batch(r, &got, &ended))) return st;
      if (got && (st = df_run_train_step(r, got))) return st;
      r->pos += got;
      spool_boundary(r, ended);
      int64_t step = dflash_trainer_step_count(r->t);
      bool stop = o->max_steps > 0 && step >= o->max_steps;
      bool full = stop || (got && o->save_every > 0 && step % o->save_every == 0);
      int32_t act;
      if ((st = df_run_next_action(r, stop || r->bnd_epoch >= o->epochs, &act))) return st;
      if (r->bnd_epoch >= o->epochs) break; /* the final save follows */
      if (full || act != ACT_NONE) st = spool_checkpoint(r, true);
      else if (!reuse) st = spool_maybe_free(r);
      if (st) return st;
      if (stop) return DFLASH_OK;
      if (act == ACT_STOP) return df_run_stopped(r);
    }
  }
  return spool_checkpoint(r, true);
}
