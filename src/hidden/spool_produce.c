/* The spool's producer (spool.c says how the spool works): publish under a budget, end an
 * epoch, rebuild an epoch after a crash. */
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

static const sp_entry *scan_find(const sp_scan *sc, int kind, int32_t e, uint64_t s) {
  for (size_t i = 0; i < sc->n; i++)
    if (sc->e[i].kind == kind && sc->e[i].epoch == e && sc->e[i].seq == s) return &sc->e[i];
  return NULL;
}

static uint64_t scan_shard_bytes(const sp_scan *sc) {
  uint64_t b = 0;
  for (size_t i = 0; i < sc->n; i++)
    if (sc->e[i].kind == SP_SHARD) b += sc->e[i].size;
  return b;
}

/* The consumer's mark: every shard before (*e, *s) is consumed ((0, 0) when none is). */
static dflash_status read_consumed(dflash_storage *st, const char *base, int32_t *e, uint64_t *s) {
  *e = 0, *s = 0;
  char *loc = df_sp_path(base, "consumed"), *text = NULL;
  if (!loc) return df_error_nomem("spool");
  dflash_status r = df_sp_read_small(st, loc, &text);
  if (r == DFLASH_E_NOT_FOUND) r = DFLASH_OK;
  else if (!r && sscanf(text, "epoch=%d shard=%" SCNu64, e, s) != 2)
    r = df_error(DFLASH_E_FORMAT, "%s: unreadable \"%s\"", loc, text);
  free(text);
  free(loc);
  return r;
}

/* spool.json; a spool with the target's final state says so after the dtype (a spool without
 * it reads as every spool before it did, and older consumers stop reading at the dtype). */
static dflash_status spool_meta(int32_t K, int32_t H, int32_t dtype, bool final, char **out) {
  *out = df_asprintf("{\"format\": \"%s\", \"num_layers\": %d, \"hidden_size\": %d, "
                     "\"dtype\": \"%s\"%s}\n",
                     DF_SPOOL_FORMAT, K, H, df_hidden_dtype_name(dtype),
                     final ? ", \"" DF_HIDDEN_FINAL_KEY "\": \"" DF_HIDDEN_FINAL_POST_NORM "\""
                           : "");
  return *out ? DFLASH_OK : df_error_nomem("spool.json");
}

/* ---- producer ------------------------------------------------------------------------------ */

static const char *wbase(const dflash_hidden_writer *w) { return w->remote ? w->remote : w->dir; }

/* Temporary files of a killed producer would hold disk the budget does not see. */
static void remove_stale_temps(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *de;
  while ((de = readdir(d)))
    if (strstr(de->d_name, ".tmp.") && de->d_name[0] == 'e') {
      char *p = df_path_join(dir, de->d_name);
      if (p) unlink(p);
      free(p);
    }
  closedir(d);
}

static dflash_status add_ids(dflash_hidden_writer *w, const char *text) {
  for (const char *p = text; *p;) {
    const char *nl = strchr(p, '\n');
    size_t n = nl ? (size_t)(nl - p) : strlen(p);
    char *id = df_strndup(p, n);
    int r = id && n ? df_strset_add(&w->ids, id) : 0;
    free(id);
    if (!id || r < 0) return df_error_nomem("spool ids");
    w->epoch_samples += (uint64_t)r;
    p += n + (nl ? 1 : 0);
  }
  return DFLASH_OK;
}

/* Where a restarted producer stands: the epoch after the last ended one or the last one
 * begun, its next shard, and the ids it has published there. */
static dflash_status recover(dflash_hidden_writer *w) {
  sp_scan sc;
  dflash_status s = df_sp_scan(w->storage, wbase(w), &sc);
  int32_t ce;
  uint64_t cs;
  if (!s) s = read_consumed(w->storage, wbase(w), &ce, &cs);
  if (s) return free(sc.e), s;
  int32_t e = 0;
  for (size_t i = 0; i < sc.n; i++)
    if (sc.e[i].epoch > e) e = sc.e[i].epoch;
  if (scan_find(&sc, SP_END, e, 0)) e++;
  w->epoch = e;
  w->present = scan_shard_bytes(&sc);
  for (uint64_t q = 0; !s; q++) {
    if (!scan_find(&sc, SP_IDS, e, q)) break;
    char *ids = df_sp_shard_loc(wbase(w), e, q, "ids"), *text = NULL;
    if (!scan_find(&sc, SP_SHARD, e, q) && !df_sp_before(e, q, ce, cs)) {
      /* Lost in the crash before it became visible: publish it again. */
      s = ids ? dflash_storage_delete(w->storage, ids) : df_error_nomem("spool");
      free(ids);
      break;
    }
    s = ids ? df_sp_read_small(w->storage, ids, &text) : df_error_nomem("spool");
    if (!s) s = add_ids(w, text);
    w->seq = q + 1;
    free(text);
    free(ids);
  }
  free(sc.e);
  return s;
}

static dflash_status writer_manifest(dflash_hidden_writer *w) {
  char *loc = df_sp_path(wbase(w), "spool.json"), *text = NULL, *mine = NULL;
  if (!loc) return df_error_nomem("spool");
  dflash_status s = spool_meta(w->K, w->H, w->dtype, w->final, &mine);
  dflash_status r = s ? s : df_sp_read_small(w->storage, loc, &text);
  if (r == DFLASH_E_NOT_FOUND) s = dflash_storage_write(w->storage, loc, mine, strlen(mine));
  else if (!r && strcmp(text, mine))
    s = df_error(DFLASH_E_MISMATCH, "%s holds %s; this writer has K=%d, H=%d, %s, final_state %d",
                 loc, text, w->K, w->H, df_hidden_dtype_name(w->dtype), w->final);
  else s = r;
  free(loc), free(text), free(mine);
  return s;
}

/* The producer's budget, for the trainer: it frees room in steps of half of it (each step
 * costs it a state save). Rewritten by every producer start. */
static dflash_status put_budget(dflash_hidden_writer *w) {
  char *loc = df_sp_path(wbase(w), "budget");
  char *text = df_asprintf("bytes=%" PRIu64 "\n", w->budget);
  dflash_status s = loc && text ? dflash_storage_write(w->storage, loc, text, strlen(text))
                                : df_error_nomem("spool");
  free(loc);
  free(text);
  return s;
}

dflash_status df_spool_writer_create(const char *dir, int32_t K, int32_t H,
                                     const dflash_hidden_writer_options *o,
                                     dflash_hidden_writer **out) {
  uint64_t shard = o->shard_bytes ? o->shard_bytes : 1ULL << 30;
  if (o->spool_budget < 2 * shard)
    return df_error(DFLASH_E_INVALID_ARG,
                    "spool %s: budget %" PRIu64 " bytes is under two "
                    "shards (2 x %" PRIu64 "): the trainer holds one while the next is written",
                    dir, o->spool_budget, shard);
  dflash_hidden_writer *w = calloc(1, sizeof *w);
  if (!w) return df_error_nomem("spool writer");
  bool remote = dflash_storage_is_remote(dir);
  w->spool = true;
  w->K = K, w->H = H, w->dtype = o->dtype, w->shard_bytes = shard;
  w->final = o->final_state == 1; /* every shard carries f/<id> and says so (writer.c) */
  w->budget = o->spool_budget, w->wait_s = o->spool_wait_s;
  dflash_status s = dflash_storage_create(NULL, &w->storage);
  if (!s && remote && !(w->remote = df_strdup(dir))) s = df_error_nomem("spool");
  /* s3://: shards are staged in a directory of this process's own (the trainer may share the
   * cache directory). */
  if (!s && remote) s = df_stage_tmpdir("spool-writer", &w->dir);
  if (!s && !remote && !(w->dir = df_strdup(dir))) s = df_error_nomem("spool");
  if (!s && !remote) s = df_mkdir_p(w->dir);
  if (!s && !remote) remove_stale_temps(w->dir);
  if (!s) s = writer_manifest(w);
  if (!s) s = put_budget(w);
  if (!s) s = recover(w);
  if (s) {
    dflash_hidden_writer_free(w);
    return df_error_wrap(s, "opening spool %s", dir);
  }
  *out = w;
  return DFLASH_OK;
}

/* Wait until the shards present total less than the budget. */
static dflash_status wait_for_room(dflash_hidden_writer *w, double wait_s) {
  double t0 = df_now_seconds();
  for (;;) {
    sp_scan sc;
    dflash_status s = df_sp_scan(w->storage, wbase(w), &sc);
    if (s) return s;
    w->present = scan_shard_bytes(&sc);
    free(sc.e);
    if (w->present < w->budget) return DFLASH_OK;
    double waited = df_now_seconds() - t0;
    if (wait_s >= 0 && waited >= wait_s)
      return df_error(DFLASH_E_TIMEOUT,
                      "spool %s is full: %" PRIu64 " bytes of unconsumed "
                      "shards, budget %" PRIu64 " (waited %.0f s for the trainer)",
                      wbase(w), w->present, w->budget, waited);
    df_sp_sleep_s(df_sp_poll_step(waited));
  }
}

static dflash_status put_ids(dflash_hidden_writer *w) {
  df_buf b = {0};
  dflash_status s = DFLASH_OK;
  for (size_t i = 0; !s && i < w->n_buf; i++) s = df_buf_printf(&b, "%s\n", w->buf[i].id);
  char *loc = s ? NULL : df_sp_shard_loc(wbase(w), w->epoch, w->seq, "ids");
  if (!s && !loc) s = df_error_nomem("spool");
  if (!s) s = dflash_storage_write(w->storage, loc, b.data ? b.data : "", b.len);
  free(loc);
  df_buf_free(&b);
  return s;
}

static dflash_status put_shard(dflash_hidden_writer *w, uint64_t *size) {
  char *local = df_sp_shard_loc(w->dir, w->epoch, w->seq, "safetensors");
  char *dst = w->remote ? df_sp_shard_loc(w->remote, w->epoch, w->seq, "safetensors") : NULL;
  dflash_status s = local && (dst || !w->remote) ? df_hidden_write_shard(w, local)
                                                 : df_error_nomem("spool");
  dflash_storage_info info = {.struct_size = sizeof info};
  if (!s && !(s = dflash_storage_stat(w->storage, local, &info))) *size = info.size;
  if (!s && dst) s = dflash_storage_copy(w->storage, local, dst);
  if (dst && local) unlink(local); /* staged only */
  free(local);
  free(dst);
  return s;
}

dflash_status df_spool_publish(dflash_hidden_writer *w, double wait_s) {
  if (w->n_buf == 0) return DFLASH_OK;
  dflash_status s = wait_for_room(w, wait_s);
  uint64_t size = 0;
  if (!s) s = put_ids(w);
  if (!s) s = put_shard(w, &size);
  if (s == DFLASH_E_TIMEOUT) return s;
  if (s) return df_error_wrap(s, "spool %s: shard e%05d-s%06" PRIu64, wbase(w), w->epoch, w->seq);
  w->present += size;
  if (w->present > w->high_water) w->high_water = w->present;
  w->seq++;
  df_hidden_writer_drop_buffer(w);
  return DFLASH_OK;
}

dflash_status dflash_hidden_writer_end_epoch(dflash_hidden_writer *w) {
  DF_CHECK_ARG(w);
  if (!w->spool) return df_error(DFLASH_E_STATE, "hidden writer %s: not a spool", w->dir);
  if (w->finished) return df_error(DFLASH_E_STATE, "spool %s: writer finished", wbase(w));
  dflash_status s = df_spool_publish(w, w->wait_s);
  char *loc = s ? NULL : df_sp_end_loc(wbase(w), w->epoch);
  char *text = loc ? df_asprintf("shards=%" PRIu64 " samples=%" PRIu64 "\n", w->seq,
                                 w->epoch_samples)
                   : NULL;
  if (!s && !text) s = df_error_nomem("spool");
  if (!s) s = dflash_storage_write(w->storage, loc, text, strlen(text));
  free(loc);
  free(text);
  if (s) return s;
  w->epoch++;
  w->seq = 0;
  w->epoch_samples = 0;
  df_strset_free(&w->ids);
  memset(&w->ids, 0, sizeof w->ids);
  return DFLASH_OK;
}

int dflash_hidden_writer_contains(const dflash_hidden_writer *w, const char *sample_id) {
  return w && sample_id && df_strset_has(&w->ids, sample_id) ? 1 : 0;
}

dflash_status dflash_hidden_writer_get_spool_status(const dflash_hidden_writer *w,
                                                    dflash_hidden_writer_spool_status *out) {
  DF_CHECK_ARG(w && out);
  dflash_hidden_writer_spool_status status = {.struct_size = sizeof status,
                                              .epoch = w->epoch,
                                              .samples = w->epoch_samples,
                                              .spool_bytes = w->present,
                                              .high_water = w->high_water};
  return df_opts_out(out, &status, sizeof status, "dflash_hidden_writer_spool_status");
}
