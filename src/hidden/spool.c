/*
 * The spool (include/dflash/hidden.h): a bounded hidden-state store that a
 * trainer consumes while a producer writes it, as two processes that share
 * nothing but the spool's files (a local folder or an s3:// prefix), so
 * everything goes through dflash_storage and every step is crash-safe:
 *
 *   producer: wait until the shards present total < budget; PUT the shard's
 *             .ids; write the shard (local: temp, fsync, rename; s3: one PUT
 *             of a locally staged file). End of epoch: PUT eNNNNN.end.
 *   consumer: read shards in order (s3: one GET each into a reused memory buffer, the next
 *             shard read ahead on a thread while this one is used; local: mapped); after its
 *             own state is durable, PUT "consumed" (epoch, shard), then delete the shards
 *             before it. Reading ahead changes nothing in the spool.
 *
 * A restarted producer rebuilds its epoch from the .ids files: a shard whose
 * .ids exists but which is neither present nor consumed died in the crash,
 * so it is dropped and its samples are taken again. "consumed" is read after
 * the listing, and the consumer writes it before deleting, so a shard the
 * listing misses because it was just deleted is always counted as consumed.
 */
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

/* ---- names and small files ---------------------------------------------------------------- */

static char *sp_path(const char *base, const char *name) { return df_stage_join(base, name); }

static char *shard_loc(const char *base, int32_t e, uint64_t s, const char *ext) {
  char name[64];
  snprintf(name, sizeof name, "e%05d-s%06" PRIu64 ".%s", e, s, ext);
  return sp_path(base, name);
}

static char *end_loc(const char *base, int32_t e) {
  char name[32];
  snprintf(name, sizeof name, "e%05d.end", e);
  return sp_path(base, name);
}

static bool parse_name(const char *name, sp_entry *out) {
  int e, n = 0;
  unsigned long long s;
  char ext[16];
  if (sscanf(name, "e%5d.end%n", &e, &n) == 1 && n > 0 && !name[n]) {
    *out = (sp_entry){SP_END, e, 0, 0};
    return true;
  }
  n = 0;
  if (sscanf(name, "e%5d-s%6llu.%15[a-z]%n", &e, &s, ext, &n) != 3 || name[n]) return false;
  if (!strcmp(ext, "safetensors")) *out = (sp_entry){SP_SHARD, e, s, 0};
  else if (!strcmp(ext, "ids")) *out = (sp_entry){SP_IDS, e, s, 0};
  else return false;
  return true;
}

static dflash_status scan(dflash_storage *st, const char *base, sp_scan *out) {
  memset(out, 0, sizeof *out);
  char *prefix = sp_path(base, "");
  dflash_storage_listing *l = NULL;
  dflash_status s = prefix ? dflash_storage_list(st, prefix, &l) : df_error_nomem("spool");
  size_t n = s ? 0 : dflash_storage_listing_count(l), plen = prefix ? strlen(prefix) : 0;
  if (!s && !(out->e = calloc(n + 1, sizeof *out->e))) s = df_error_nomem("spool listing");
  for (size_t i = 0; !s && i < n; i++) {
    const char *loc;
    uint64_t size;
    if ((s = dflash_storage_listing_get(l, i, &loc, &size))) break;
    sp_entry e;
    if (strchr(loc + plen, '/') || !parse_name(loc + plen, &e)) continue;
    e.size = size;
    out->e[out->n++] = e;
  }
  dflash_storage_listing_free(l);
  free(prefix);
  if (s) free(out->e), out->e = NULL;
  return s;
}

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

/* A small text object; DFLASH_E_NOT_FOUND (no message) when absent. */
static dflash_status read_small(dflash_storage *st, const char *loc, char **text) {
  size_t len;
  void *data;
  dflash_storage_info info = {.struct_size = sizeof info};
  /* Only a clear "absent" is absence: a failed request (after the client's retries) is an
   * error, never taken for a shard or marker that is not there. */
  dflash_status s = dflash_storage_stat(st, loc, &info);
  if (s == DFLASH_E_NOT_FOUND) dflash_clear_error();
  if (s) return s;
  s = dflash_storage_read(st, loc, &data, &len);
  if (s) return s;
  *text = df_strndup(data, len);
  dflash_storage_buffer_free(data);
  return *text ? DFLASH_OK : df_error_nomem("spool file");
}

/* The consumer's mark: every shard before (*e, *s) is consumed ((0, 0) when none is). */
static dflash_status read_consumed(dflash_storage *st, const char *base, int32_t *e, uint64_t *s) {
  *e = 0, *s = 0;
  char *loc = sp_path(base, "consumed"), *text = NULL;
  if (!loc) return df_error_nomem("spool");
  dflash_status r = read_small(st, loc, &text);
  if (r == DFLASH_E_NOT_FOUND) r = DFLASH_OK;
  else if (!r && sscanf(text, "epoch=%d shard=%" SCNu64, e, s) != 2)
    r = df_error(DFLASH_E_FORMAT, "%s: unreadable \"%s\"", loc, text);
  free(text);
  free(loc);
  return r;
}

static bool before(int32_t e, uint64_t s, int32_t me, uint64_t ms) {
  return e < me || (e == me && s < ms);
}

static void sleep_s(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

/* Poll interval: quick at first, then at most a second. */
static double poll_step(double waited) { return waited < 1 ? 0.02 : waited < 10 ? 0.2 : 1.0; }

static dflash_status spool_meta(const char *base, int32_t K, int32_t H, int32_t dtype, char **out) {
  *out = df_asprintf("{\"format\": \"%s\", \"num_layers\": %d, \"hidden_size\": %d, "
                     "\"dtype\": \"%s\"}\n",
                     DF_SPOOL_FORMAT, K, H, df_hidden_dtype_name(dtype));
  (void)base;
  return *out ? DFLASH_OK : df_error_nomem("spool.json");
}

static dflash_status parse_meta(const char *loc, const char *text, int32_t *K, int32_t *H,
                                int32_t *dtype) {
  char fmt[32], dt[32];
  if (sscanf(text,
             "{\"format\": \"%31[^\"]\", \"num_layers\": %d, \"hidden_size\": %d, "
             "\"dtype\": \"%31[^\"]\"}",
             fmt, K, H, dt) != 4 ||
      strcmp(fmt, DF_SPOOL_FORMAT) || *K <= 0 || *H <= 0)
    return df_error(DFLASH_E_FORMAT, "%s: not a %s manifest", loc, DF_SPOOL_FORMAT);
  if (!strcmp(dt, "bf16")) *dtype = DFLASH_HIDDEN_BF16;
  else if (!strcmp(dt, "fp8_e4m3")) *dtype = DFLASH_HIDDEN_FP8_E4M3;
  else return df_error(DFLASH_E_DTYPE, "%s: unknown dtype \"%s\"", loc, dt);
  return DFLASH_OK;
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
  dflash_status s = scan(w->storage, wbase(w), &sc);
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
    char *ids = shard_loc(wbase(w), e, q, "ids"), *text = NULL;
    if (!scan_find(&sc, SP_SHARD, e, q) && !before(e, q, ce, cs)) {
      /* Lost in the crash before it became visible: publish it again. */
      s = ids ? dflash_storage_delete(w->storage, ids) : df_error_nomem("spool");
      free(ids);
      break;
    }
    s = ids ? read_small(w->storage, ids, &text) : df_error_nomem("spool");
    if (!s) s = add_ids(w, text);
    w->seq = q + 1;
    free(text);
    free(ids);
  }
  free(sc.e);
  return s;
}

static dflash_status writer_manifest(dflash_hidden_writer *w) {
  char *loc = sp_path(wbase(w), "spool.json"), *text = NULL, *mine = NULL;
  if (!loc) return df_error_nomem("spool");
  dflash_status s = spool_meta(wbase(w), w->K, w->H, w->dtype, &mine);
  dflash_status r = s ? s : read_small(w->storage, loc, &text);
  if (r == DFLASH_E_NOT_FOUND) s = dflash_storage_write(w->storage, loc, mine, strlen(mine));
  else if (!r && strcmp(text, mine))
    s = df_error(DFLASH_E_MISMATCH, "%s holds %s; this writer has K=%d, H=%d, %s", loc, text, w->K,
                 w->H, df_hidden_dtype_name(w->dtype));
  else s = r;
  free(loc), free(text), free(mine);
  return s;
}

/* The producer's budget, for the trainer: it frees room in steps of half of it (each step
 * costs it a state save). Rewritten by every producer start. */
static dflash_status put_budget(dflash_hidden_writer *w) {
  char *loc = sp_path(wbase(w), "budget");
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
    dflash_status s = scan(w->storage, wbase(w), &sc);
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
    sleep_s(poll_step(waited));
  }
}

static dflash_status put_ids(dflash_hidden_writer *w) {
  df_buf b = {0};
  dflash_status s = DFLASH_OK;
  for (size_t i = 0; !s && i < w->n_buf; i++) s = df_buf_printf(&b, "%s\n", w->buf[i].id);
  char *loc = s ? NULL : shard_loc(wbase(w), w->epoch, w->seq, "ids");
  if (!s && !loc) s = df_error_nomem("spool");
  if (!s) s = dflash_storage_write(w->storage, loc, b.data ? b.data : "", b.len);
  free(loc);
  df_buf_free(&b);
  return s;
}

static dflash_status put_shard(dflash_hidden_writer *w, uint64_t *size) {
  char *local = shard_loc(w->dir, w->epoch, w->seq, "safetensors");
  char *dst = w->remote ? shard_loc(w->remote, w->epoch, w->seq, "safetensors") : NULL;
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
  char *loc = s ? NULL : end_loc(wbase(w), w->epoch);
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

dflash_status dflash_hidden_writer_spool_status(const dflash_hidden_writer *w, int32_t *epoch,
                                                uint64_t *samples, uint64_t *spool_bytes,
                                                uint64_t *high_water) {
  DF_CHECK_ARG(w);
  if (epoch) *epoch = w->epoch;
  if (samples) *samples = w->epoch_samples;
  if (spool_bytes) *spool_bytes = w->present;
  if (high_water) *high_water = w->high_water;
  return DFLASH_OK;
}

/* ---- consumer ------------------------------------------------------------------------------ */

typedef struct sp_tensor {
  const char *id;
  const void *codes, *scales;
  int64_t len;
  const void *tids;    /* "t/<id>" I32 [len] in the shard, or NULL */
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

static void sparse_drop(sp_sparse *a);

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

typedef struct sp_opened {
  int32_t e;
  uint64_t s, size;
} sp_opened;

struct dflash_spool {
  char *base;
  dflash_storage *st;
  dflash_spool_options o;
  int32_t K, H, dtype;
  int32_t epoch; /* position */
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

static void spool_options_defaults(dflash_spool_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->wait_s = 600;
}

DF_DEFINE_INIT(dflash_spool_options, spool_options_defaults)

static dflash_status open_meta(dflash_spool *sp) {
  char *loc = sp_path(sp->base, "spool.json"), *text = NULL;
  if (!loc) return df_error_nomem("spool");
  double t0 = df_now_seconds();
  dflash_status s;
  while ((s = read_small(sp->st, loc, &text)) == DFLASH_E_NOT_FOUND) {
    double waited = df_now_seconds() - t0;
    if (sp->o.wait_s >= 0 && waited >= sp->o.wait_s) {
      s = df_error(DFLASH_E_TIMEOUT,
                   "spool %s: no spool.json after %.0f s (has a producer "
                   "opened it?)",
                   sp->base, waited);
      break;
    }
    sleep_s(poll_step(waited));
  }
  if (!s) s = parse_meta(loc, text, &sp->K, &sp->H, &sp->dtype);
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
  sparse_drop(&sp->next);
  dflash_storage_free(sp->next.st);
  df_stage_buf_free(&sp->next.buf);
  df_stage_buf_free(&sp->mem);
  dflash_storage_free(sp->st);
  free(sp->base);
  free(sp->buf);
  free(sp->tbuf);
  free(sp->opened);
  free(sp);
}

dflash_status dflash_spool_info(const dflash_spool *sp, int32_t *num_layers, int32_t *hidden_size,
                                int32_t *dtype) {
  DF_CHECK_ARG(sp);
  if (num_layers) *num_layers = sp->K;
  if (hidden_size) *hidden_size = sp->H;
  if (dtype) *dtype = sp->dtype;
  return DFLASH_OK;
}

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

/* The samples of shard f (at `loc`, its bytes from `base`) in the order they were appended
 * (their data follow each other), into *out / *n_out; every one marked loaded. */
static dflash_status index_into(const dflash_spool *sp, const df_stage_st *f, const uint8_t *base,
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
  sp_tensor *ts = calloc(n + 1, sizeof *ts);
  if (!(*out = ts)) return df_error_nomem("spool shard");
  *n_out = 0;
  bool fp8 = sp->dtype == DFLASH_HIDDEN_FP8_E4M3;
  dflash_dtype want_dt = fp8 ? DFLASH_DTYPE_F8_E4M3 : DFLASH_DTYPE_BF16;
  for (size_t i = 0; i < n; i++) {
    dflash_tensor t = {.struct_size = sizeof t}, sc = {.struct_size = sizeof sc};
    dflash_status st = df_stage_st_get(f, i, &t); /* file order: the order of appends */
    if (st) return st;
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
  return index_into(sp, sp->cur, sp->mem.data, loc, &sp->ts, &sp->n_ts);
}

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
  if (!s) s = index_into(sp, *cur, b->data, loc, ts, n);
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
static void sparse_drop(sp_sparse *a) {
  if (a->running) pthread_join(a->th, NULL);
  a->running = false;
  df_stage_st_free(a->cur);
  free(a->ts);
  a->cur = NULL, a->ts = NULL, a->n_ts = 0;
  free(a->loc);
  a->loc = NULL;
}

/* Start reading shard (e, s), whose first usable sample is the epoch's k-th, ahead. */
static void sparse_start(dflash_spool *sp, int32_t e, uint64_t s, uint64_t k) {
  sp_sparse *a = &sp->next;
  sparse_drop(a);
  if (k == K_UNKNOWN || (!a->st && dflash_storage_create(NULL, &a->st))) {
    dflash_clear_error();
    return;
  }
  if (!(a->loc = shard_loc(sp->base, e, s, "safetensors"))) return;
  a->sp = sp, a->e = e, a->s = s, a->k = k, a->status = DFLASH_E_NOT_FOUND, a->done = 0;
  a->running = pthread_create(&a->th, NULL, sparse_main, a) == 0;
}

/* Whether shard (e, s) is read ahead already (header, index and kept samples). */
static bool sparse_has(const dflash_spool *sp, int32_t e, uint64_t s) {
  const sp_sparse *a = &sp->next;
  if (!a->loc || a->e != e || a->s != s || !a->running) return false;
  return __atomic_load_n(&a->done, __ATOMIC_ACQUIRE) && a->status == DFLASH_OK;
}

static bool shared_s3(const dflash_spool *sp) {
  return sp->usable && dflash_storage_is_remote(sp->base);
}

/* Shard (e, s) of a shared spool on S3: the one read ahead when it is this one, else its
 * header and this consumer's samples from the position on, read now. */
static dflash_status sparse_open(dflash_spool *sp, const char *loc, uint64_t size, int32_t e,
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
  sparse_drop(a);
  return r;
}

/* A sample of a shared spool that was not read with its shard (not this consumer's as far as
 * the shard's reading knew, e.g. a short last batch's share): its bytes now. */
static dflash_status load_sample(dflash_spool *sp, sp_tensor *t) {
  if (t->loaded) return DFLASH_OK;
  char *loc = shard_loc(sp->base, sp->cur_e, sp->cur_s, "safetensors");
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

/* Start reading shard (e, s) ahead; nothing when it cannot start (the plain read follows). */
static void ahead_start(dflash_spool *sp, int32_t e, uint64_t s) {
  sp_ahead *a = &sp->ahead;
  ahead_join(a);
  if (!a->st && dflash_storage_create(NULL, &a->st)) {
    dflash_clear_error();
    return;
  }
  free(a->loc);
  if (!(a->loc = shard_loc(sp->base, e, s, "safetensors"))) return;
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
    if (!before(sp->opened[i].e, sp->opened[i].s, epoch, shard)) sp->opened[k++] = sp->opened[i];
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
  if (shared_s3(sp)) {
    r = sparse_open(sp, loc, size, e, s);
  } else if (remote && a->loc && a->e == e && a->s == s && a->status == DFLASH_OK &&
             a->buf.len == size) {
    df_stage_buf t = sp->mem;
    sp->mem = a->buf, a->buf = t;
    a->status = DFLASH_E_NOT_FOUND; /* used */
    r = df_stage_st_parse(loc, &sp->mem, &sp->cur);
  } else {
    r = df_stage_st_load(sp->st, loc, size, &sp->mem, &sp->cur);
  }
  if (!r && !shared_s3(sp)) r = index_shard(sp, loc); /* sparse_open indexes its own */
  if (r) {
    close_shard(sp);
    return df_error_wrap(r, "spool shard %s", loc);
  }
  sp->cur_e = e, sp->cur_s = s, sp->seeked = false;
  if (shared_s3(sp)) sparse_start(sp, e, s + 1, sp->k_after);
  else if (remote && sp->read_ahead) ahead_start(sp, e, s + 1);
  return note_opened(sp, e, s, size);
}

/* The end marker of epoch e: its shard count, or DFLASH_E_NOT_FOUND (no message). */
static dflash_status end_shards(dflash_spool *sp, int32_t e, uint64_t *shards) {
  char *loc = end_loc(sp->base, e), *text = NULL;
  if (!loc) return df_error_nomem("spool");
  dflash_status s = read_small(sp->st, loc, &text);
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
    char *loc = shard_loc(sp->base, e, sp->shard, "safetensors");
    if (!loc) return df_error_nomem("spool");
    dflash_storage_info info = {.struct_size = sizeof info};
    /* A shard read ahead needs no HEAD: it is there, and its size is the one it was read at. */
    bool have_ahead = ahead_has(sp, e, sp->shard) || sparse_has(sp, e, sp->shard);
    if (have_ahead) info.size = shared_s3(sp) ? sp->next.buf.len : sp->ahead.buf.len;
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
    sleep_s(poll_step(waited));
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
  if (!s) s = spool_tids(sp, t, &tids);
  if (s) return s;
  out->id = t->id, out->len = t->len, out->hidden = sp->buf;
  out->epoch = sp->epoch, out->shard = sp->shard, out->offset = sp->offset;
  out->target_ids = tids;
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
  if ((s = load_sample(sp, &sp->ts[sp->offset]))) return s;
  if (sp->o.stored_rows) { /* the shard's codes as they are: the consumer checks NaN/Inf */
    const int32_t *tids = NULL;
    if ((s = df_hidden_check_codes(t->id, sp->dtype, t->codes, t->scales, t->len, sp->K, sp->H)) ||
        (s = spool_tids(sp, t, &tids)))
      return s;
    *out = (dflash_sample){.struct_size = sizeof *out,
                           .id = t->id,
                           .len = t->len,
                           .epoch = sp->epoch,
                           .shard = sp->shard,
                           .offset = sp->offset,
                           .target_ids = tids,
                           .hidden_dtype = sp->dtype,
                           .hidden_codes = t->codes,
                           .hidden_scales = sp->dtype == DFLASH_HIDDEN_FP8_E4M3 ? t->scales : NULL};
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
  char *loc = sp_path(sp->base, "consumed");
  char *text = df_asprintf("epoch=%d shard=%" PRIu64 "\n", epoch, shard);
  sp_scan sc = {0};
  dflash_status s = loc && text ? dflash_storage_write(sp->st, loc, text, strlen(text))
                                : df_error_nomem("spool");
  if (!s) s = scan(sp->st, sp->base, &sc);
  for (size_t i = 0; !s && i < sc.n; i++) {
    const sp_entry *e = &sc.e[i];
    if (e->kind != SP_SHARD || !before(e->epoch, e->seq, epoch, shard)) continue;
    char *victim = shard_loc(sp->base, e->epoch, e->seq, "safetensors");
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
  if (ahead_has(sp, e, sp->shard) || sparse_has(sp, e, sp->shard)) return true;
  char *loc = shard_loc(sp->base, e, sp->shard, "safetensors"), *end = end_loc(sp->base, e);
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
    if (before(sp->opened[i].e, sp->opened[i].s, epoch, shard)) *used += sp->opened[i].size;
  /* The producer writes its budget before its first shard; read once (again while none). */
  dflash_status r = DFLASH_OK;
  if (!sp->budget) {
    char *loc = sp_path(sp->base, "budget"), *text = NULL;
    r = loc ? read_small(sp->st, loc, &text) : df_error_nomem("spool");
    if (!r && sscanf(text, "bytes=%" SCNu64, &sp->budget) != 1) sp->budget = 0;
    if (r == DFLASH_E_NOT_FOUND) dflash_clear_error(), r = DFLASH_OK;
    free(loc);
    free(text);
  }
  *budget = sp->budget;
  return r;
}
