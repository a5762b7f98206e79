/* The spool's consumer (spool.c says how the spool works): open, read in order with the next
 * shard read ahead, seek, pass, release what is consumed. */
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

/* spool.json (spool_produce.c writes it): K, H, dtype, and whether the shards carry the
 * target's final state ("final_state": "post_norm" after the dtype; absent in a spool without
 * it, as in every spool of older libdflash). */
static dflash_status parse_meta(dflash_spool *sp, const char *loc, const char *text) {
  char fmt[32], dt[32], fin[32];
  int n = 0, m = 0;
  if (sscanf(text,
             "{\"format\": \"%31[^\"]\", \"num_layers\": %d, \"hidden_size\": %d, "
             "\"dtype\": \"%31[^\"]\"%n",
             fmt, &sp->K, &sp->H, dt, &n) != 4 ||
      !n || strcmp(fmt, DF_SPOOL_FORMAT) || sp->K <= 0 || sp->H <= 0)
    return df_error(DFLASH_E_FORMAT, "%s: not a %s manifest", loc, DF_SPOOL_FORMAT);
  if (!strcmp(dt, "bf16")) sp->dtype = DFLASH_DTYPE_BF16;
  else if (!strcmp(dt, "fp8_e4m3")) sp->dtype = DFLASH_DTYPE_F8_E4M3;
  else return df_error(DFLASH_E_DTYPE, "%s: unknown dtype \"%s\"", loc, dt);
  const char *rest = text + n;
  sp->final = false;
  if (!strncmp(rest, ", \"" DF_HIDDEN_FINAL_KEY "\"", strlen(DF_HIDDEN_FINAL_KEY) + 4)) {
    if (sscanf(rest, ", \"" DF_HIDDEN_FINAL_KEY "\": \"%31[^\"]\"}%n", fin, &m) != 1 || !m)
      return df_error(DFLASH_E_FORMAT, "%s: unreadable %s in \"%s\"", loc, DF_HIDDEN_FINAL_KEY,
                      text);
    if (strcmp(fin, DF_HIDDEN_FINAL_POST_NORM))
      return df_error(DFLASH_E_FORMAT,
                      "%s: %s = \"%s\": this libdflash reads \"%s\" (the target's final state "
                      "after its final norm) only",
                      loc, DF_HIDDEN_FINAL_KEY, fin, DF_HIDDEN_FINAL_POST_NORM);
    sp->final = true;
  }
  return DFLASH_OK;
}

static void *ahead_main(void *arg) {
  sp_ahead *a = arg;
  dflash_storage_info info = {.struct_size = sizeof info};
  a->status = dflash_storage_stat(a->st, a->loc, &info);
  if (!a->status) a->status = df_stage_read_object(a->st, a->loc, info.size, &a->buf);
  __atomic_store_n(&a->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

static void ahead_join(sp_ahead *a) {
  if (!a->running) return;
  pthread_join(a->th, NULL);
  a->running = false;
}

static void spool_options_defaults(dflash_spool_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->wait_s = 600;
}

DF_DEFINE_INIT(dflash_spool_options, spool_options_defaults)

static dflash_status open_meta(dflash_spool *sp) {
  char *loc = df_sp_path(sp->base, "spool.json"), *text = NULL;
  if (!loc) return df_error_nomem("spool");
  double t0 = df_now_seconds();
  dflash_status s;
  while ((s = df_sp_read_small(sp->st, loc, &text)) == DFLASH_E_NOT_FOUND) {
    double waited = df_now_seconds() - t0;
    if (sp->o.wait_s >= 0 && waited >= sp->o.wait_s) {
      s = df_error(DFLASH_E_TIMEOUT,
                   "spool %s: no spool.json after %.0f s (has a producer "
                   "opened it?)",
                   sp->base, waited);
      break;
    }
    df_sp_sleep_s(df_sp_poll_step(waited));
  }
  if (!s) s = parse_meta(sp, loc, text);
  free(text);
  free(loc);
  return s;
}

dflash_status dflash_spool_open(const char *spool, const dflash_spool_options *opts,
                                dflash_spool **out) {
  DF_CHECK_ARG(spool && out);
  *out = NULL;
  dflash_spool *sp = calloc(1, sizeof *sp);
  if (!sp) return df_error_nomem("spool");
  dflash_spool_options_default(&sp->o);
  dflash_status s = df_opts_in(&sp->o, opts, sizeof sp->o, "dflash_spool_options");
  size_t n = strlen(spool);
  while (n > 1 && spool[n - 1] == '/') n--;
  if (!s && !(sp->base = df_strndup(spool, n))) s = df_error_nomem("spool");
  if (!s) s = dflash_storage_create(NULL, &sp->st);
  const char *ra = getenv("DFLASH_SPOOL_READ_AHEAD");
  sp->read_ahead = !ra || strcmp(ra, "0");
  sp->want_final = true;
  if (!s) s = open_meta(sp);
  if (s) {
    dflash_spool_free(sp);
    return s;
  }
  *out = sp;
  return DFLASH_OK;
}

static void close_shard(dflash_spool *sp) {
  df_stage_st_free(sp->cur);
  sp->cur = NULL;
  free(sp->ts);
  sp->ts = NULL;
  sp->n_ts = 0;
}

void dflash_spool_free(dflash_spool *sp) {
  if (!sp) return;
  close_shard(sp);
  ahead_join(&sp->ahead);
  dflash_storage_free(sp->ahead.st);
  free(sp->ahead.loc);
  df_stage_buf_free(&sp->ahead.buf);
  df_sp_sparse_drop(&sp->next);
  dflash_storage_free(sp->next.st);
  df_stage_buf_free(&sp->next.buf);
  df_stage_buf_free(&sp->mem);
  dflash_storage_free(sp->st);
  free(sp->base);
  free(sp->buf);
  free(sp->tbuf);
  free(sp->fbuf);
  free(sp->opened);
  free(sp);
}

dflash_status dflash_spool_get_info(const dflash_spool *sp, dflash_spool_info *out) {
  DF_CHECK_ARG(sp && out);
  dflash_spool_info info = {.struct_size = sizeof info,
                            .num_layers = sp->K,
                            .hidden_size = sp->H,
                            .dtype = sp->dtype,
                            .final_state = sp->final};
  return df_opts_out(out, &info, sizeof info, "dflash_spool_info");
}

void df_spool_set_final(dflash_spool *sp, bool on) { sp->want_final = on; }

dflash_status dflash_spool_seek(dflash_spool *sp, int32_t epoch, uint64_t shard, uint64_t offset) {
  return df_spool_seek_k(sp, epoch, shard, offset, K_UNKNOWN);
}

dflash_status df_spool_seek_k(dflash_spool *sp, int32_t epoch, uint64_t shard, uint64_t offset,
                              uint64_t k) {
  DF_CHECK_ARG(sp && epoch >= 0);
  sp->epoch = epoch, sp->shard = shard, sp->offset = offset;
  sp->k_seek = k, sp->seeked = true;
  return DFLASH_OK;
}

dflash_status dflash_spool_tell(const dflash_spool *sp, int32_t *epoch, uint64_t *shard,
                                uint64_t *offset) {
  DF_CHECK_ARG(sp);
  if (epoch) *epoch = sp->epoch;
  if (shard) *shard = sp->shard;
  if (offset) *offset = sp->offset;
  return DFLASH_OK;
}

/* The epoch whose shards epoch `e` reads. */
static int32_t source_epoch(const dflash_spool *sp, int32_t e) { return sp->o.reuse ? 0 : e; }

/* Bytes [begin, end) of a tensor view, relative to base. */
static void span(const dflash_tensor *t, const uint8_t *base, uint64_t *begin, uint64_t *end) {
  uint64_t b = (uint64_t)((const uint8_t *)t->data - base), e = b + t->nbytes;
  if (b < *begin) *begin = b;
  if (e > *end) *end = e;
}

/* Sample e's final state in shard f (a spool with final_state): "f/<id>" [len, H] in the rows'
 * dtype and, for fp8, "fs/<id>" F32 [len, 1]; its bytes join the sample's span. */
static dflash_status index_final(const dflash_spool *sp, const df_stage_st *f, const uint8_t *base,
                                 const char *loc, sp_tensor *e) {
  bool fp8 = sp->dtype == DFLASH_DTYPE_F8_E4M3;
  dflash_dtype want = fp8 ? DFLASH_DTYPE_F8_E4M3 : DFLASH_DTYPE_BF16;
  char name[DF_HIDDEN_MAX_ID + 8];
  dflash_tensor t = {.struct_size = sizeof t}, sc = {.struct_size = sizeof sc};
  snprintf(name, sizeof name, "f/%s", e->id);
  if (df_stage_st_find(f, name, &t))
    return df_error(DFLASH_E_FORMAT,
                    "%s: sample %s has no final state (f/%s), though the spool declares %s", loc,
                    e->id, e->id, DF_HIDDEN_FINAL_KEY);
  if (t.dtype != (int32_t)want || t.ndim != 2 || t.shape[0] != e->len || t.shape[1] != sp->H)
    return df_error(DFLASH_E_FORMAT, "%s: final state of sample %s is not %s [%lld, %d]", loc,
                    e->id, dflash_dtype_name(want), (long long)e->len, sp->H);
  e->fcodes = t.data;
  span(&t, base, &e->begin, &e->end);
  if (!fp8) return DFLASH_OK;
  snprintf(name, sizeof name, "fs/%s", e->id);
  if (df_stage_st_find(f, name, &sc))
    return df_error(DFLASH_E_FORMAT, "%s: final state of sample %s lacks its scales (fs/%s)", loc,
                    e->id, e->id);
  if (sc.dtype != DFLASH_DTYPE_F32 || sc.ndim != 2 || sc.shape[0] != e->len || sc.shape[1] != 1)
    return df_error(DFLASH_E_FORMAT, "%s: final-state scales of sample %s are not F32 [%lld, 1]",
                    loc, e->id, (long long)e->len);
  e->fscales = sc.data;
  span(&sc, base, &e->begin, &e->end);
  return DFLASH_OK;
}

/* The shard's final_state metadata against spool.json's. */
static dflash_status check_shard_final(const dflash_spool *sp, const df_stage_st *f,
                                       const char *loc) {
  const char *fin = NULL;
  if (df_stage_st_metadata_find(f, DF_HIDDEN_FINAL_KEY, &fin)) fin = NULL;
  if (sp->final && (!fin || strcmp(fin, DF_HIDDEN_FINAL_POST_NORM)))
    return df_error(DFLASH_E_MISMATCH,
                    "%s: the spool's spool.json declares %s, but the shard %s%s%s", loc,
                    DF_HIDDEN_FINAL_KEY, fin ? "says \"" : "does not", fin ? fin : "",
                    fin ? "\"" : "");
  if (!sp->final && fin)
    return df_error(DFLASH_E_MISMATCH,
                    "%s: the shard declares %s = \"%s\", but the spool's spool.json does not", loc,
                    DF_HIDDEN_FINAL_KEY, fin);
  return DFLASH_OK;
}

/* The samples of shard f (at `loc`, its bytes from `base`) in the order they were appended
 * (their data follow each other), into *out / *n_out; every one marked loaded. */
dflash_status df_sp_index_into(const dflash_spool *sp, const df_stage_st *f, const uint8_t *base,
                               const char *loc, sp_tensor **out, size_t *n_out) {
  size_t n = df_stage_st_count(f);
  const char *k, *h, *dt;
  char want[32];
  snprintf(want, sizeof want, "%d", sp->K);
  if (df_stage_st_metadata_find(f, "num_layers", &k) || strcmp(k, want) ||
      (snprintf(want, sizeof want, "%d", sp->H), df_stage_st_metadata_find(f, "hidden_size", &h)) ||
      strcmp(h, want) || df_stage_st_metadata_find(f, "dtype", &dt) ||
      strcmp(dt, df_hidden_dtype_name(sp->dtype)))
    return df_error(DFLASH_E_MISMATCH,
                    "%s: layers, hidden size or dtype differ from the "
                    "spool's spool.json",
                    loc);
  dflash_status fst = check_shard_final(sp, f, loc);
  if (fst) return fst;
  sp_tensor *ts = calloc(n + 1, sizeof *ts);
  if (!(*out = ts)) return df_error_nomem("spool shard");
  *n_out = 0;
  bool fp8 = sp->dtype == DFLASH_DTYPE_F8_E4M3;
  dflash_dtype want_dt = fp8 ? DFLASH_DTYPE_F8_E4M3 : DFLASH_DTYPE_BF16;
  for (size_t i = 0; i < n; i++) {
    dflash_tensor t = {.struct_size = sizeof t}, sc = {.struct_size = sizeof sc};
    dflash_status st = df_stage_st_get(f, i, &t); /* file order: the order of appends */
    if (st) return st;
    if (!sp->final && !strncmp(t.name, "f/", 2))
      return df_error(DFLASH_E_FORMAT,
                      "%s: final-state tensor %s, but neither the shard nor spool.json declares %s",
                      loc, t.name, DF_HIDDEN_FINAL_KEY);
    if (strncmp(t.name, "h/", 2)) continue;
    if (t.dtype != (int32_t)want_dt || t.ndim != 2 || t.shape[1] != (int64_t)sp->K * sp->H)
      return df_error(DFLASH_E_FORMAT, "%s: %s is not %s [S, %lld]", loc, t.name,
                      dflash_dtype_name(want_dt), (long long)sp->K * sp->H);
    sp_tensor *e = &ts[(*n_out)++];
    *e = (sp_tensor){.id = t.name + 2, .codes = t.data, .len = t.shape[0], .loaded = true};
    e->begin = UINT64_MAX, e->end = 0;
    span(&t, base, &e->begin, &e->end);
    char name[DF_HIDDEN_MAX_ID + 8];
    dflash_tensor ti = {.struct_size = sizeof ti};
    snprintf(name, sizeof name, "t/%s", e->id);
    if (!df_stage_st_find(f, name, &ti)) {
      if (ti.dtype != DFLASH_DTYPE_I32 || ti.ndim != 1 || ti.shape[0] != e->len)
        return df_error(DFLASH_E_FORMAT, "%s: target ids of sample %s are not I32 [%lld]", loc,
                        e->id, (long long)e->len);
      e->tids = ti.data;
      span(&ti, base, &e->begin, &e->end);
    }
    if (sp->final && (st = index_final(sp, f, base, loc, e))) return st;
    if (!fp8) continue;
    snprintf(name, sizeof name, "s/%s", e->id);
    if (df_stage_st_find(f, name, &sc) || sc.dtype != DFLASH_DTYPE_F32 || sc.ndim != 2 ||
        sc.shape[0] != e->len || sc.shape[1] != sp->K)
      return df_error(DFLASH_E_FORMAT, "%s: scales of sample %s missing or not F32 [%lld, %d]", loc,
                      e->id, (long long)e->len, sp->K);
    e->scales = sc.data;
    span(&sc, base, &e->begin, &e->end);
  }
  return DFLASH_OK;
}

static dflash_status index_shard(dflash_spool *sp, const char *loc) {
  return df_sp_index_into(sp, sp->cur, sp->mem.data, loc, &sp->ts, &sp->n_ts);
}


/* Start reading shard (e, s) ahead; nothing when it cannot start (the plain read follows). */
static void ahead_start(dflash_spool *sp, int32_t e, uint64_t s) {
  sp_ahead *a = &sp->ahead;
  ahead_join(a);
  if (!a->st && dflash_storage_create(NULL, &a->st)) {
    dflash_clear_error();
    return;
  }
  free(a->loc);
  if (!(a->loc = df_sp_shard_loc(sp->base, e, s, "safetensors"))) return;
  a->e = e, a->s = s, a->status = DFLASH_E_NOT_FOUND, a->done = 0;
  a->running = pthread_create(&a->th, NULL, ahead_main, a) == 0;
}

/* Whether shard (e, s) is read ahead, whole, already (no request needed to know it is there). */
static bool ahead_has(const dflash_spool *sp, int32_t e, uint64_t s) {
  const sp_ahead *a = &sp->ahead;
  if (!a->loc || a->e != e || a->s != s) return false;
  if (a->running && !__atomic_load_n(&a->done, __ATOMIC_ACQUIRE)) return false;
  return a->status == DFLASH_OK;
}

/* Shard (e, s) of `size` bytes now takes room until released (not with reuse: never). */
static dflash_status note_opened(dflash_spool *sp, int32_t e, uint64_t s, uint64_t size) {
  if (sp->o.reuse) return DFLASH_OK;
  if (sp->n_opened && sp->opened[sp->n_opened - 1].e == e && sp->opened[sp->n_opened - 1].s == s)
    return DFLASH_OK; /* opened again (a seek back within it) */
  if (sp->n_opened == sp->cap_opened) {
    size_t cap = sp->cap_opened ? 2 * sp->cap_opened : 16;
    sp_opened *p = realloc(sp->opened, cap * sizeof *p);
    if (!p) return df_error_nomem("spool shards");
    sp->opened = p, sp->cap_opened = cap;
  }
  sp->opened[sp->n_opened++] = (sp_opened){e, s, size};
  return DFLASH_OK;
}

void df_spool_forget(dflash_spool *sp, int32_t epoch, uint64_t shard) {
  size_t k = 0;
  for (size_t i = 0; i < sp->n_opened; i++)
    if (!df_sp_before(sp->opened[i].e, sp->opened[i].s, epoch, shard))
      sp->opened[k++] = sp->opened[i];
  sp->n_opened = k;
}

/* s3://: the shard read ahead when it is this one and of this size (swapped into sp->mem), else
 * one GET of the whole shard into sp->mem (no local copy); local: mapped. */
static dflash_status open_shard(dflash_spool *sp, const char *loc, uint64_t size, int32_t e,
                                uint64_t s) {
  close_shard(sp);
  sp_ahead *a = &sp->ahead;
  bool remote = dflash_storage_is_remote(sp->base);
  ahead_join(a);
  dflash_status r;
  if (df_sp_shared_s3(sp)) {
    r = df_sp_sparse_open(sp, loc, size, e, s);
  } else if (remote && a->loc && a->e == e && a->s == s && a->status == DFLASH_OK &&
             a->buf.len == size) {
    df_stage_buf t = sp->mem;
    sp->mem = a->buf, a->buf = t;
    a->status = DFLASH_E_NOT_FOUND; /* used */
    r = df_stage_st_parse(loc, &sp->mem, &sp->cur);
  } else {
    r = df_stage_st_load(sp->st, loc, size, &sp->mem, &sp->cur);
  }
  if (!r && !df_sp_shared_s3(sp)) r = index_shard(sp, loc); /* sparse_open indexes its own */
  if (r) {
    close_shard(sp);
    return df_error_wrap(r, "spool shard %s", loc);
  }
  sp->cur_e = e, sp->cur_s = s, sp->seeked = false;
  if (df_sp_shared_s3(sp)) df_sp_sparse_start(sp, e, s + 1, sp->k_after);
  else if (remote && sp->read_ahead) ahead_start(sp, e, s + 1);
  return note_opened(sp, e, s, size);
}

/* The end marker of epoch e: its shard count, or DFLASH_E_NOT_FOUND (no message). */
static dflash_status end_shards(dflash_spool *sp, int32_t e, uint64_t *shards) {
  char *loc = df_sp_end_loc(sp->base, e), *text = NULL;
  if (!loc) return df_error_nomem("spool");
  dflash_status s = df_sp_read_small(sp->st, loc, &text);
  if (!s && sscanf(text, "shards=%" SCNu64, shards) != 1)
    s = df_error(DFLASH_E_FORMAT, "%s: unreadable \"%s\"", loc, text);
  free(loc);
  free(text);
  return s;
}

/* Make the shard at the position current: 1 when it is open, 0 at the end of the epoch. */
static dflash_status reach_shard(dflash_spool *sp, int *have) {
  int32_t e = source_epoch(sp, sp->epoch);
  double t0 = df_now_seconds();
  bool retried = false;
  for (;;) {
    if (sp->cur && sp->cur_e == e && sp->cur_s == sp->shard) {
      sp->seeked = false; /* a seek within the open shard: its reading stands */
      if (sp->offset < sp->n_ts) return *have = 1, DFLASH_OK;
      sp->shard++, sp->offset = 0; /* a resume past its end, or an empty shard */
      continue;
    }
    char *loc = df_sp_shard_loc(sp->base, e, sp->shard, "safetensors");
    if (!loc) return df_error_nomem("spool");
    dflash_storage_info info = {.struct_size = sizeof info};
    /* A shard read ahead needs no HEAD: it is there, and its size is the one it was read at. */
    bool have_ahead = ahead_has(sp, e, sp->shard) || df_sp_sparse_has(sp, e, sp->shard);
    if (have_ahead) info.size = df_sp_shared_s3(sp) ? sp->next.buf.len : sp->ahead.buf.len;
    dflash_status s = have_ahead ? DFLASH_OK : dflash_storage_stat(sp->st, loc, &info);
    if (!s) s = open_shard(sp, loc, info.size, e, sp->shard);
    else if (s == DFLASH_E_NOT_FOUND) dflash_clear_error();
    free(loc);
    if (s != DFLASH_E_NOT_FOUND) {
      if (s) return s;
      sp->waited_note = retried = false;
      continue;
    }
    uint64_t n;
    s = end_shards(sp, e, &n);
    if (!s && sp->shard >= n) return *have = 0, DFLASH_OK;
    /* The marker follows every shard of its epoch: a shard missing above was maybe published
     * just before the marker we now see, so look again before calling it gone. */
    if (!s && !retried) {
      retried = true;
      continue;
    }
    if (!s)
      return df_error(DFLASH_E_NOT_FOUND,
                      "spool %s: shard e%05d-s%06" PRIu64 " (of %" PRIu64
                      ") is gone (deleted by another consumer?)",
                      sp->base, e, sp->shard, n);
    if (s != DFLASH_E_NOT_FOUND) return s;
    double waited = df_now_seconds() - t0;
    if (sp->o.wait_s >= 0 && waited >= sp->o.wait_s)
      return df_error(DFLASH_E_TIMEOUT,
                      "spool %s: no shard e%05d-s%06" PRIu64 " and no end of "
                      "epoch %d after %.0f s (is the producer running?)",
                      sp->base, e, sp->shard, e, waited);
    if (waited >= 5 && !sp->waited_note) {
      df_log(DFLASH_LOG_INFO, "waiting for spool %s: shard e%05d-s%06" PRIu64, sp->base, e,
             sp->shard);
      sp->waited_note = true;
    }
    df_sp_sleep_s(df_sp_poll_step(waited));
  }
}

/* The sample's target ids copied into sp->tbuf (the shard's may be unaligned); *out NULL
 * when the shard stores none. */
static dflash_status spool_tids(dflash_spool *sp, const sp_tensor *t, const int32_t **out) {
  *out = NULL;
  if (!t->tids) return DFLASH_OK;
  if ((size_t)t->len > sp->tcap) {
    free(sp->tbuf);
    sp->tcap = 0;
    if (!(sp->tbuf = malloc((size_t)t->len * sizeof *sp->tbuf))) return df_error_nomem("spool");
    sp->tcap = (size_t)t->len;
  }
  memcpy(sp->tbuf, t->tids, (size_t)t->len * sizeof *sp->tbuf);
  *out = sp->tbuf;
  return DFLASH_OK;
}

/* The sample's final state decoded to float32 into sp->fbuf and checked finite (DSpark's
 * target_final); *out NULL when the spool has none or its consumer does not want it. */
static dflash_status spool_final(dflash_spool *sp, const sp_tensor *t, const float **out) {
  *out = NULL;
  if (!sp->final || !sp->want_final) return DFLASH_OK;
  size_t n = (size_t)t->len * sp->H;
  if (n > sp->fcap) {
    free(sp->fbuf);
    sp->fcap = 0;
    if (!(sp->fbuf = malloc(n * sizeof *sp->fbuf))) return df_error_nomem("spool final state");
    sp->fcap = n;
  }
  df_hidden_decode(1, sp->H, sp->dtype, t->fcodes, t->fscales, sp->fbuf, t->len);
  for (size_t i = 0; i < n; i++)
    if (!isfinite(sp->fbuf[i]))
      return df_error(DFLASH_E_FORMAT,
                      "spool %s: sample %s: target final state at token %zu, column %zu is not "
                      "finite",
                      sp->base, t->id, i / (size_t)sp->H, i % (size_t)sp->H);
  *out = sp->fbuf;
  return DFLASH_OK;
}

/* A sample decoded to float32 into sp->buf, checked for NaN/Inf and all-zero layers. */
static dflash_status decode_sample(dflash_spool *sp, const sp_tensor *t, dflash_sample *out) {
  size_t width = (size_t)sp->K * sp->H, need = (size_t)t->len * width;
  if (need > sp->cap) {
    free(sp->buf);
    sp->cap = 0;
    if (!(sp->buf = malloc(need * sizeof *sp->buf))) return df_error_nomem("spool sample");
    sp->cap = need;
  }
  df_hidden_decode(sp->K, sp->H, sp->dtype, t->codes, t->scales, sp->buf, t->len);
  for (size_t i = 0; i < need; i++)
    if (!isfinite(sp->buf[i]))
      return df_error(DFLASH_E_FORMAT,
                      "spool %s: sample %s: hidden state at token %zu, column "
                      "%zu is not finite",
                      sp->base, t->id, i / width, i % width);
  dflash_status s = df_hidden_check_sample(t->id, sp->buf, t->len, sp->K, sp->H);
  const int32_t *tids = NULL;
  const float *fin = NULL;
  if (!s) s = spool_tids(sp, t, &tids);
  if (!s) s = spool_final(sp, t, &fin);
  if (s) return s;
  out->id = t->id, out->len = t->len, out->hidden = sp->buf;
  out->epoch = sp->epoch, out->shard = sp->shard, out->offset = sp->offset;
  out->target_ids = tids, out->target_final = fin;
  return DFLASH_OK;
}

/* Past a shard's last sample the position is the next shard's first, so that a caller that
 * releases at its position frees the shard it has used up. */
static void advance(dflash_spool *sp) {
  if (++sp->offset >= sp->n_ts) sp->shard++, sp->offset = 0;
}

/* Reach the next sample's shard: *t the sample, or NULL at the end of the epoch (the position
 * then moves to the next epoch). */
static dflash_status next_tensor(dflash_spool *sp, const sp_tensor **t) {
  int have = 0;
  dflash_status s = reach_shard(sp, &have);
  *t = !s && have ? &sp->ts[sp->offset] : NULL;
  if (!s && !have) sp->epoch++, sp->shard = 0, sp->offset = 0, sp->k_after = 0;
  return s;
}

dflash_status df_spool_pass(dflash_spool *sp, dflash_sample *out, int32_t *end_of_epoch) {
  const sp_tensor *t;
  dflash_status s = next_tensor(sp, &t);
  if (s) return s;
  *end_of_epoch = !t;
  if (!t) return DFLASH_OK;
  out->id = t->id, out->len = t->len, out->hidden = NULL, out->target_ids = NULL;
  out->epoch = sp->epoch, out->shard = sp->shard, out->offset = sp->offset;
  advance(sp);
  return DFLASH_OK;
}

/* The next sample into the library's struct `out` (zeroed, at this library's size). */
static dflash_status spool_next(dflash_spool *sp, dflash_sample *out, int32_t *end_of_epoch) {
  const sp_tensor *t;
  dflash_status s = next_tensor(sp, &t);
  if (s) return s;
  *end_of_epoch = !t;
  if (!t) return DFLASH_OK;
  if ((s = df_sp_load_sample(sp, &sp->ts[sp->offset]))) return s;
  if (sp->o.stored_rows) { /* the shard's codes as they are: the consumer checks NaN/Inf */
    const int32_t *tids = NULL;
    const float *fin = NULL;
    if ((s = df_hidden_check_codes(t->id, sp->dtype, t->codes, t->scales, t->len, sp->K, sp->H)) ||
        (s = spool_tids(sp, t, &tids)) || (s = spool_final(sp, t, &fin)))
      return s;
    *out = (dflash_sample){.struct_size = sizeof *out,
                           .id = t->id,
                           .len = t->len,
                           .epoch = sp->epoch,
                           .shard = sp->shard,
                           .offset = sp->offset,
                           .target_ids = tids,
                           .target_final = fin,
                           .hidden_dtype = sp->dtype,
                           .hidden_codes = t->codes,
                           .hidden_scales = sp->dtype == DFLASH_DTYPE_F8_E4M3 ? t->scales : NULL};
  } else if ((s = decode_sample(sp, t, out))) {
    return s;
  }
  advance(sp);
  return DFLASH_OK;
}

dflash_status dflash_spool_next(dflash_spool *sp, dflash_sample *out, int32_t *end_of_epoch) {
  DF_CHECK_ARG(sp && out && end_of_epoch);
  dflash_sample v = {.struct_size = sizeof v};
  /* The caller's struct_size is checked (and its struct cleared) before a sample is taken. */
  dflash_status s = df_opts_out(out, &v, sizeof v, "dflash_sample");
  if (!s) s = spool_next(sp, &v, end_of_epoch);
  if (!s && !*end_of_epoch) s = df_opts_out(out, &v, sizeof v, "dflash_sample");
  return s;
}

dflash_status dflash_spool_release(dflash_spool *sp, int32_t epoch, uint64_t shard) {
  DF_CHECK_ARG(sp && epoch >= 0);
  if (sp->o.reuse) { /* epoch 0's shards are the data of every epoch: keep them */
    return DFLASH_OK;
  }
  char *loc = df_sp_path(sp->base, "consumed");
  char *text = df_asprintf("epoch=%d shard=%" PRIu64 "\n", epoch, shard);
  sp_scan sc = {0};
  dflash_status s = loc && text ? dflash_storage_write(sp->st, loc, text, strlen(text))
                                : df_error_nomem("spool");
  if (!s) s = df_sp_scan(sp->st, sp->base, &sc);
  for (size_t i = 0; !s && i < sc.n; i++) {
    const sp_entry *e = &sc.e[i];
    if (e->kind != SP_SHARD || !df_sp_before(e->epoch, e->seq, epoch, shard)) continue;
    char *victim = df_sp_shard_loc(sp->base, e->epoch, e->seq, "safetensors");
    s = victim ? dflash_storage_delete(sp->st, victim) : df_error_nomem("spool");
    free(victim);
  }
  free(sc.e);
  free(loc);
  free(text);
  if (!s) df_spool_forget(sp, epoch, shard);
  sp->budget = 0; /* read again: a restarted producer may have another */
  return s ? df_error_wrap(s, "releasing consumed shards of spool %s", sp->base) : DFLASH_OK;
}

bool df_spool_ready(dflash_spool *sp) {
  int32_t e = source_epoch(sp, sp->epoch);
  if (sp->cur && sp->cur_e == e && sp->cur_s == sp->shard && sp->offset < sp->n_ts) return true;
  if (ahead_has(sp, e, sp->shard) || df_sp_sparse_has(sp, e, sp->shard)) return true;
  char *loc = df_sp_shard_loc(sp->base, e, sp->shard, "safetensors"),
       *end = df_sp_end_loc(sp->base, e);
  dflash_storage_info info = {.struct_size = sizeof info};
  bool ready = !loc || !end || dflash_storage_stat(sp->st, loc, &info) != DFLASH_E_NOT_FOUND ||
               dflash_storage_stat(sp->st, end, &info) != DFLASH_E_NOT_FOUND;
  dflash_clear_error();
  free(loc);
  free(end);
  return ready;
}

dflash_status df_spool_pressure(dflash_spool *sp, int32_t epoch, uint64_t shard, uint64_t *used,
                                uint64_t *budget) {
  *used = 0;
  for (size_t i = 0; i < sp->n_opened; i++)
    if (df_sp_before(sp->opened[i].e, sp->opened[i].s, epoch, shard)) *used += sp->opened[i].size;
  /* The producer writes its budget before its first shard; read once (again while none). */
  dflash_status r = DFLASH_OK;
  if (!sp->budget) {
    char *loc = df_sp_path(sp->base, "budget"), *text = NULL;
    r = loc ? df_sp_read_small(sp->st, loc, &text) : df_error_nomem("spool");
    if (!r && sscanf(text, "bytes=%" SCNu64, &sp->budget) != 1) sp->budget = 0;
    if (r == DFLASH_E_NOT_FOUND) dflash_clear_error(), r = DFLASH_OK;
    free(loc);
    free(text);
  }
  *budget = sp->budget;
  return r;
}
