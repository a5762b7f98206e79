/*
 * Hidden-state store writer: samples are encoded (bf16, or fp8 e4m3 with a
 * scale per token and layer) into a buffer; when it passes shard_bytes it is
 * written as one safetensors shard (temporary name, fsync, rename) and the
 * index is rewritten, so a killed dump loses at most the unflushed buffer.
 */
#include "hidden.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "storage/stage.h"
#include "core/bf16.h"

static void hidden_writer_options_defaults(dflash_hidden_writer_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->dtype = DFLASH_DTYPE_BF16;
  o->shard_bytes = 1ULL << 30;
}

DF_DEFINE_INIT(dflash_hidden_writer_options, hidden_writer_options_defaults)

const char *df_hidden_dtype_name(int32_t dtype) {
  return dtype == DFLASH_DTYPE_F8_E4M3 ? "fp8_e4m3" : "bf16";
}

static dflash_status make_dir(const char *dir) { return df_mkdir_p(dir); }

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* A reopened store's record against the writer's: every shard says the same (the reader
 * reads one), so a disagreement, or a record for shards written without one, is refused; a
 * writer given none keeps the store's. */
static dflash_status keep_record(dflash_hidden_writer *w, const df_hidden_record *s) {
  df_hidden_record *r = &w->rec;
  char a[512], b[512];
  df_hidden_record_ids_text(s, a, sizeof a);
  df_hidden_record_ids_text(r, b, sizeof b);
  if (r->n_layer_ids && strcmp(a, b))
    return df_error(DFLASH_E_MISMATCH,
                    "%s holds the target layers %s; cannot append target_layer_ids %s", w->dir, a,
                    b);
  const char *sh = s->tokenizer_hash ? s->tokenizer_hash : "(not recorded)";
  if (r->tokenizer_hash && strcmp(sh, r->tokenizer_hash))
    return df_error(DFLASH_E_MISMATCH,
                    "%s was written for tokenizer_hash %s; cannot append tokenizer_hash %s", w->dir,
                    sh, r->tokenizer_hash);
  if (!r->n_layer_ids && s->n_layer_ids) {
    if (!(r->layer_ids = malloc((size_t)s->n_layer_ids * sizeof *r->layer_ids)))
      return df_error_nomem("target layer ids");
    memcpy(r->layer_ids, s->layer_ids, (size_t)s->n_layer_ids * sizeof *r->layer_ids);
    r->n_layer_ids = s->n_layer_ids;
  }
  if (!r->tokenizer_hash && s->tokenizer_hash && !(r->tokenizer_hash = df_strdup(sh)))
    return df_error_nomem("tokenizer hash");
  return DFLASH_OK;
}

/* Existing shards and ids of a store being reopened for appending. */
static dflash_status load_existing(dflash_hidden_writer *w) {
  DIR *d = opendir(w->dir);
  if (!d) return df_error_errno(DFLASH_E_IO, errno, "cannot list %s", w->dir);
  struct dirent *de;
  dflash_status st = DFLASH_OK;
  while (!st && (de = readdir(d))) {
    if (strncmp(de->d_name, "hidden-", 7) || !df_str_ends_with(de->d_name, ".safetensors"))
      continue;
    char **ns = realloc(w->shards, (w->n_shards + 1) * sizeof *ns);
    if (!ns || !(ns[w->n_shards] = df_strdup(de->d_name))) {
      if (ns) w->shards = ns;
      st = df_error_nomem("shard list");
      break;
    }
    w->shards = ns;
    w->n_shards++;
  }
  closedir(d);
  if (st || w->n_shards == 0) return st;
  qsort(w->shards, w->n_shards, sizeof *w->shards, cmp_str);
  dflash_hidden *h;
  if ((st = dflash_hidden_open(w->dir, &h))) return df_error_wrap(st, "reopening %s", w->dir);
  dflash_hidden_info info = {.struct_size = sizeof info};
  st = dflash_hidden_get_info(h, &info);
  int32_t K = info.num_layers, H = info.hidden_size, dt = info.dtype;
  if (!st && (K != w->K || H != w->H || dt != w->dtype))
    st = df_error(DFLASH_E_MISMATCH,
                  "%s holds K=%d, H=%d, %s states; cannot append K=%d, H=%d, "
                  "%s",
                  w->dir, K, H, df_hidden_dtype_name(dt), w->K, w->H,
                  df_hidden_dtype_name(w->dtype));
  if (!st && (info.final_state != 0) != w->final)
    st = df_error(DFLASH_E_MISMATCH,
                  "%s %s the target's final state; cannot append samples %s it (final_state %d)",
                  w->dir, info.final_state ? "holds" : "does not hold",
                  w->final ? "with" : "without", w->final);
  if (!st) st = keep_record(w, df_hidden_record_of(h));
  for (size_t i = 0; !st && i < info.count; i++) {
    const char *id;
    if ((st = dflash_hidden_id(h, i, &id))) break;
    if (df_strset_add(&w->ids, id) < 0) st = df_error_nomem("sample ids");
  }
  dflash_hidden_free(h);
  return st;
}

/*
 * An s3:// store is written through a local mirror in the cache directory:
 * each shard is written there, uploaded, then hollowed out (its data blocks
 * given back, its header kept), so the disk holds one shard at a time plus
 * headers. Shards already in the bucket (an earlier run, another machine)
 * get header-only stand-ins first, so appending works as for a local store.
 * One writer per store at a time (as for a local directory).
 */
static dflash_status setup_remote(dflash_hidden_writer *w, const char *url) {
  char *prefix = df_stage_join(url, "");
  dflash_storage_listing *l = NULL;
  dflash_status st = prefix ? dflash_storage_create(NULL, &w->storage) : df_error_nomem("path");
  if (!st && !(w->remote = df_strdup(url))) st = df_error_nomem("path");
  if (!st) st = df_stage_cache_path(url, &w->dir);
  /* The bucket is the truth: a shard written here but never uploaded (a
   * crash) must not count, so the mirror is rebuilt from the listing. */
  if (!st) df_stage_rmtree(w->dir);
  if (!st) st = dflash_storage_list(w->storage, prefix, &l);
  for (size_t i = 0; !st && i < dflash_storage_listing_count(l); i++) {
    const char *loc, *name;
    uint64_t size;
    if ((st = dflash_storage_listing_get(l, i, &loc, &size))) break;
    name = loc + strlen(prefix);
    if (strncmp(name, "hidden-", 7) || strchr(name, '/') || !df_str_ends_with(name, ".safetensors"))
      continue;
    char *local = df_path_join(w->dir, name);
    st = local ? df_stage_st_stub(w->storage, loc, size, local) : df_error_nomem("path");
    free(local);
  }
  if (!st) st = df_stage_mkdirs(w->dir);
  dflash_storage_listing_free(l);
  free(prefix);
  return st;
}

/* Remote stores: upload the shard just written and the index, then hollow
 * out the local copy. */
static dflash_status publish(dflash_hidden_writer *w, const char *name) {
  if (!w->remote) return DFLASH_OK;
  dflash_status st = df_stage_out(w->storage, w->dir, w->remote, name);
  if (!st) st = df_stage_out(w->storage, w->dir, w->remote, DF_HIDDEN_INDEX);
  char *path = st ? NULL : df_path_join(w->dir, name);
  if (path) df_stage_st_hollow(path);
  free(path);
  return st;
}

dflash_status dflash_hidden_writer_create(const char *dir, int32_t num_layers, int32_t hidden_size,
                                          const dflash_hidden_writer_options *opts,
                                          dflash_hidden_writer **out) {
  DF_CHECK_ARG(dir && out);
  *out = NULL;
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  dflash_status ost = df_opts_in(&o, opts, sizeof o, "dflash_hidden_writer_options");
  if (ost) return ost;
  if (num_layers <= 0 || hidden_size <= 0)
    return df_error(DFLASH_E_INVALID_ARG,
                    "hidden writer: num_layers (%d) and hidden_size (%d) "
                    "must be positive",
                    num_layers, hidden_size);
  if (o.dtype != DFLASH_DTYPE_BF16 && o.dtype != DFLASH_DTYPE_F8_E4M3)
    return df_error(DFLASH_E_DTYPE, "hidden writer: unknown dtype %d", o.dtype);
  /* Refused rather than dropped: the caller would believe the spool checked. */
  if (o.spool_budget && (o.target_layer_ids || o.tokenizer_hash))
    return df_error(DFLASH_E_INVALID_ARG,
                    "hidden writer: target_layer_ids and tokenizer_hash are recorded by a "
                    "plain store, not a spool (spool_budget)");
  if (o.final_state != 0 && o.final_state != 1)
    return df_error(DFLASH_E_INVALID_ARG, "hidden writer: final_state is %d (0 or 1)",
                    o.final_state);
  if (o.spool_budget) return df_spool_writer_create(dir, num_layers, hidden_size, &o, out);
  bool remote = dflash_storage_is_remote(dir);
  dflash_status st = remote ? DFLASH_OK : make_dir(dir);
  if (st) return st;
  dflash_hidden_writer *w = calloc(1, sizeof *w);
  if (!w || (!remote && !(w->dir = df_strdup(dir)))) {
    free(w);
    return df_error_nomem("hidden writer");
  }
  if (remote && (st = setup_remote(w, dir))) {
    dflash_hidden_writer_free(w);
    return df_error_wrap(st, "opening hidden-state store %s", dir);
  }
  w->K = num_layers;
  w->H = hidden_size;
  w->dtype = o.dtype;
  w->final = o.final_state == 1;
  w->shard_bytes = o.shard_bytes ? o.shard_bytes : 1ULL << 30;
  if ((st = df_hidden_record_from_options(&o, num_layers, &w->rec)) || (st = load_existing(w))) {
    dflash_hidden_writer_free(w);
    return st;
  }
  *out = w;
  return DFLASH_OK;
}

static void free_pending(pending *p) {
  free(p->id);
  free(p->data);
  free(p->scales);
  free(p->tids);
  free(p->fdata);
  free(p->fscales);
}

void dflash_hidden_writer_free(dflash_hidden_writer *w) {
  if (!w) return;
  for (size_t i = 0; i < w->n_buf; i++) free_pending(&w->buf[i]);
  free(w->buf);
  for (size_t i = 0; i < w->n_shards; i++) free(w->shards[i]);
  free(w->shards);
  df_strset_free(&w->ids);
  df_hidden_record_free(&w->rec);
  if (w->spool && w->remote && w->dir) df_stage_rmtree(w->dir); /* the spool's staging */
  free(w->dir);
  free(w->remote);
  dflash_storage_free(w->storage);
  free(w);
}

/* Encode `len` tokens of K layers of H values (float32 or bf16 input) into *data (bf16, or
 * e4m3 codes with a scale per token and layer in *scales [len, K]); `what` names the rows in
 * the NaN/Inf message. */
static dflash_status encode_rows(const dflash_hidden_writer *w, const char *id, const char *what,
                                 int32_t K, int64_t len, const float *f32, const uint16_t *bf16,
                                 void **data, float **scales) {
  int32_t H = w->H;
  size_t width = (size_t)K * H, n = (size_t)len * width;
  for (size_t i = 0; i < n; i++) {
    float v = f32 ? f32[i] : df_bf16_to_f32(bf16[i]);
    if (!isfinite(v))
      return df_error(DFLASH_E_FORMAT, "sample %s: %s at token %zu, column %zu is %s", id, what,
                      i / width, i % width, isnan(v) ? "NaN" : "Inf");
  }
  if (w->dtype == DFLASH_DTYPE_BF16) {
    uint16_t *out = malloc(n * sizeof *out);
    if (!out) return df_error_nomem("hidden states");
    for (size_t i = 0; i < n; i++) out[i] = f32 ? df_f32_to_bf16(f32[i]) : bf16[i];
    *data = out;
    return DFLASH_OK;
  }
  uint8_t *out = malloc(n);
  *scales = malloc((size_t)len * K * sizeof(float));
  *data = out;
  if (!out || !*scales) return df_error_nomem("hidden states");
  for (size_t r = 0; r < (size_t)len * K; r++) {
    size_t base = r * (size_t)H;
    float amax = 0;
    for (int32_t i = 0; i < H; i++) {
      float v = f32 ? f32[base + i] : df_bf16_to_f32(bf16[base + i]);
      amax = fmaxf(amax, fabsf(v));
    }
    float scale = amax > 0 ? amax / 448.0f : 1.0f;
    (*scales)[r] = scale;
    for (int32_t i = 0; i < H; i++) {
      float v = f32 ? f32[base + i] : df_bf16_to_f32(bf16[base + i]);
      out[base + i] = df_f32_to_e4m3(v / scale);
    }
  }
  return DFLASH_OK;
}

/* Encode one sample's K layers from float32 or bf16 input. */
static dflash_status encode(const dflash_hidden_writer *w, pending *p, const float *f32,
                            const uint16_t *bf16) {
  return encode_rows(w, p->id, "hidden state", w->K, p->len, f32, bf16, &p->data, &p->scales);
}

static uint64_t pending_bytes(const dflash_hidden_writer *w, const pending *p) {
  int32_t K = w->K + (p->fdata ? 1 : 0); /* the final state is one more layer's worth */
  uint64_t n = (uint64_t)p->len * K * w->H, t = p->tids ? 4 * (uint64_t)p->len : 0;
  return t + (w->dtype == DFLASH_DTYPE_BF16 ? 2 * n : n + (uint64_t)p->len * K * 4);
}

/* A copy of the target's greedy tokens (token ids are never negative). */
static dflash_status copy_tids(pending *p, const int32_t *tids) {
  if (!tids) return DFLASH_OK;
  for (int64_t i = 0; i < p->len; i++)
    if (tids[i] < 0)
      return df_error(DFLASH_E_RANGE, "sample %s: target id at token %lld is %d", p->id,
                      (long long)i, tids[i]);
  if (!(p->tids = malloc((size_t)p->len * sizeof *p->tids))) return df_error_nomem("target ids");
  memcpy(p->tids, tids, (size_t)p->len * sizeof *p->tids);
  return DFLASH_OK;
}

/* One sample's inputs to append: its K layers and its final state (NULL when none), each as
 * float32 or bf16 (one of the two set). */
typedef struct rows_in {
  const float *f32;
  const uint16_t *bf16;
  const float *fin_f32;
  const uint16_t *fin_bf16;
} rows_in;

static dflash_status append(dflash_hidden_writer *w, const char *id, const rows_in *in,
                            const int32_t *tids, int64_t len) {
  const float *f32 = in->f32;
  const uint16_t *bf16 = in->bf16;
  DF_CHECK_ARG(w && id && (f32 || bf16));
  if (w->finished) return df_error(DFLASH_E_STATE, "hidden writer %s: already finished", w->dir);
  if (!*id || strlen(id) > DF_HIDDEN_MAX_ID)
    return df_error(DFLASH_E_INVALID_ARG,
                    "hidden writer: sample id is empty or longer than %d "
                    "bytes",
                    DF_HIDDEN_MAX_ID);
  if (len <= 0) return df_error(DFLASH_E_RANGE, "sample %s: length %lld", id, (long long)len);
  if (df_strset_has(&w->ids, id))
    return df_error(DFLASH_E_DUPLICATE, "sample %s: already in %s%s", id,
                    w->remote ? w->remote : w->dir, w->spool ? " (this epoch)" : "");
  /* A spool's full shard that found no room: publish it first, or refuse this sample. */
  dflash_status pst = w->spool && w->buf_bytes >= w->shard_bytes ? df_spool_publish(w, w->wait_s)
                                                                 : DFLASH_OK;
  if (pst) return pst;
  if (w->n_buf == w->cap_buf) {
    size_t nc = w->cap_buf ? 2 * w->cap_buf : 64;
    pending *nb = realloc(w->buf, nc * sizeof *nb);
    if (!nb) return df_error_nomem("hidden writer buffer");
    w->buf = nb;
    w->cap_buf = nc;
  }
  pending p = {.id = df_strdup(id), .len = len};
  if (!p.id) return df_error_nomem("sample id");
  dflash_status st = copy_tids(&p, tids);
  if (!st) st = encode(w, &p, f32, bf16);
  if (!st && (in->fin_f32 || in->fin_bf16))
    st = encode_rows(w, id, "final state", 1, len, in->fin_f32, in->fin_bf16, &p.fdata, &p.fscales);
  if (!st && df_strset_add(&w->ids, id) < 0) st = df_error_nomem("sample ids");
  int32_t zk = st ? -1 : df_hidden_zero_layer(f32, bf16, len, w->K, w->H);
  if (zk >= 0 && !w->zero_layer_samples++)
    df_log(DFLASH_LOG_WARN,
           "hidden writer %s: sample %s: layer %d of %d is all zeros (nothing "
           "captured?); dflash train and eval will refuse such samples",
           w->dir, id, zk, w->K);
  if (st) {
    free_pending(&p);
    return st;
  }
  w->buf[w->n_buf++] = p;
  w->buf_bytes += pending_bytes(w, &p);
  w->epoch_samples++;
  if (w->buf_bytes < w->shard_bytes) return DFLASH_OK;
  if (!w->spool) return dflash_hidden_writer_flush(w);
  /* The sample is taken; a shard without room waits for the next call. */
  st = df_spool_publish(w, 0);
  if (st == DFLASH_E_TIMEOUT) dflash_clear_error(), st = DFLASH_OK;
  return st;
}

static void hidden_rows_defaults(dflash_hidden_rows *r) {
  memset(r, 0, sizeof *r);
  r->struct_size = sizeof *r;
  r->dtype = DFLASH_DTYPE_F32;
}

DF_DEFINE_INIT(dflash_hidden_rows, hidden_rows_defaults)

dflash_status dflash_hidden_writer_add(dflash_hidden_writer *w, const char *sample_id,
                                       const dflash_hidden_rows *rows) {
  DF_CHECK_ARG(rows);
  dflash_hidden_rows r;
  hidden_rows_defaults(&r);
  dflash_status st = df_opts_in(&r, rows, sizeof r, "dflash_hidden_rows");
  if (st) return st;
  DF_CHECK_ARG(r.states);
  if (r.dtype != DFLASH_DTYPE_F32 && r.dtype != DFLASH_DTYPE_BF16)
    return df_error(DFLASH_E_DTYPE, "sample %s: rows of dtype %d: F32 or BF16 are taken",
                    sample_id ? sample_id : "(null)", r.dtype);
  DF_CHECK_ARG(w);
  const char *sid = sample_id ? sample_id : "(null)";
  if (w->final && !r.final_state)
    return df_error(DFLASH_E_INVALID_ARG,
                    "sample %s: %s keeps the target's final state (final_state), and "
                    "rows.final_state is NULL",
                    sid, w->remote ? w->remote : w->dir);
  if (!w->final && r.final_state)
    return df_error(DFLASH_E_INVALID_ARG,
                    "sample %s: rows.final_state given, but %s was created without final_state "
                    "(it would be dropped)",
                    sid, w->remote ? w->remote : w->dir);
  int bf16 = r.dtype == DFLASH_DTYPE_BF16;
  rows_in in = {.f32 = bf16 ? NULL : r.states,
                .bf16 = bf16 ? r.states : NULL,
                .fin_f32 = bf16 ? NULL : r.final_state,
                .fin_bf16 = bf16 ? r.final_state : NULL};
  return append(w, sample_id, &in, r.target_ids, r.len);
}

static dflash_status shard_metadata(const dflash_hidden_writer *w, dflash_safetensors_writer *sw) {
  char k[32], h[32];
  snprintf(k, sizeof k, "%d", w->K);
  snprintf(h, sizeof h, "%d", w->H);
  dflash_status st = dflash_safetensors_writer_metadata(sw, "format", DF_HIDDEN_FORMAT);
  if (!st) st = dflash_safetensors_writer_metadata(sw, "num_layers", k);
  if (!st) st = dflash_safetensors_writer_metadata(sw, "hidden_size", h);
  if (!st) st = dflash_safetensors_writer_metadata(sw, "dtype", df_hidden_dtype_name(w->dtype));
  if (!st) st = df_hidden_record_write(&w->rec, sw);
  if (!st && w->final)
    st = dflash_safetensors_writer_metadata(sw, DF_HIDDEN_FINAL_KEY, DF_HIDDEN_FINAL_POST_NORM);
  return st;
}

dflash_status df_hidden_write_shard(const dflash_hidden_writer *w, const char *path) {
  dflash_safetensors_writer *sw;
  dflash_status st = dflash_safetensors_writer_create(path, &sw);
  if (st) return st;
  st = shard_metadata(w, sw);
  bool fp8 = w->dtype == DFLASH_DTYPE_F8_E4M3;
  char name[DF_HIDDEN_MAX_ID + 8];
  for (size_t i = 0; !st && i < w->n_buf; i++) {
    const pending *p = &w->buf[i];
    int64_t shape[2] = {p->len, (int64_t)w->K * w->H}, sshape[2] = {p->len, w->K};
    snprintf(name, sizeof name, "h/%s", p->id);
    st = dflash_safetensors_writer_declare(sw, name, fp8 ? DFLASH_DTYPE_F8_E4M3 : DFLASH_DTYPE_BF16,
                                           2, shape);
    snprintf(name, sizeof name, "s/%s", p->id);
    if (!st && fp8) st = dflash_safetensors_writer_declare(sw, name, DFLASH_DTYPE_F32, 2, sshape);
    snprintf(name, sizeof name, "t/%s", p->id);
    if (!st && p->tids)
      st = dflash_safetensors_writer_declare(sw, name, DFLASH_DTYPE_I32, 1, shape);
    int64_t fshape[2] = {p->len, w->H}, fsshape[2] = {p->len, 1};
    snprintf(name, sizeof name, "f/%s", p->id);
    if (!st && p->fdata)
      st = dflash_safetensors_writer_declare(sw, name,
                                             fp8 ? DFLASH_DTYPE_F8_E4M3 : DFLASH_DTYPE_BF16, 2,
                                             fshape);
    snprintf(name, sizeof name, "fs/%s", p->id);
    if (!st && p->fdata && fp8)
      st = dflash_safetensors_writer_declare(sw, name, DFLASH_DTYPE_F32, 2, fsshape);
  }
  for (size_t i = 0; !st && i < w->n_buf; i++) {
    const pending *p = &w->buf[i];
    size_t n = (size_t)p->len * w->K * w->H;
    st = dflash_safetensors_writer_write(sw, p->data, fp8 ? n : 2 * n);
    if (!st && fp8) st = dflash_safetensors_writer_write(sw, p->scales, (size_t)p->len * w->K * 4);
    if (!st && p->tids) st = dflash_safetensors_writer_write(sw, p->tids, (size_t)p->len * 4);
    size_t nf = (size_t)p->len * w->H;
    if (!st && p->fdata) st = dflash_safetensors_writer_write(sw, p->fdata, fp8 ? nf : 2 * nf);
    if (!st && p->fdata && fp8)
      st = dflash_safetensors_writer_write(sw, p->fscales, (size_t)p->len * 4);
  }
  if (!st) st = dflash_safetensors_writer_commit(sw);
  dflash_safetensors_writer_free(sw);
  return st;
}

static dflash_status write_index(const dflash_hidden_writer *w) {
  char k[32], h[32];
  snprintf(k, sizeof k, "%d", w->K);
  snprintf(h, sizeof h, "%d", w->H);
  /* The index's metadata is what a reader sees (the shards' is the same). */
  const char *keys[7] = {"format", "num_layers", "hidden_size", "dtype"};
  const char *vals[7] = {DF_HIDDEN_FORMAT, k, h, df_hidden_dtype_name(w->dtype)};
  size_t n = 4;
  char ids[12 * 256 + 1];
  if (w->rec.n_layer_ids && df_hidden_record_ids_csv(&w->rec, ids, sizeof ids))
    keys[n] = "target_layer_ids", vals[n++] = ids;
  if (w->rec.tokenizer_hash) keys[n] = "tokenizer_hash", vals[n++] = w->rec.tokenizer_hash;
  if (w->final) keys[n] = DF_HIDDEN_FINAL_KEY, vals[n++] = DF_HIDDEN_FINAL_POST_NORM;
  char *path = df_path_join(w->dir, DF_HIDDEN_INDEX);
  if (!path) return df_error_nomem("index path");
  dflash_status st = dflash_safetensors_write_index(path, w->n_shards,
                                                    (const char *const *)w->shards, n, keys, vals);
  free(path);
  return st;
}

dflash_status dflash_hidden_writer_flush(dflash_hidden_writer *w) {
  DF_CHECK_ARG(w);
  if (w->n_buf == 0) return DFLASH_OK;
  if (w->spool) return df_spool_publish(w, w->wait_s);
  char name[64];
  snprintf(name, sizeof name, "hidden-%05zu.safetensors", w->n_shards);
  char *path = df_path_join(w->dir, name);
  char **ns = realloc(w->shards, (w->n_shards + 1) * sizeof *ns);
  if (ns) w->shards = ns;
  if (!path || !ns || !(w->shards[w->n_shards] = df_strdup(name))) {
    free(path);
    return df_error_nomem("hidden shard");
  }
  dflash_status st = df_hidden_write_shard(w, path);
  free(path);
  if (st) {
    free(w->shards[w->n_shards]);
    return df_error_wrap(st, "writing hidden-state shard %s/%s", w->dir, name);
  }
  w->n_shards++;
  if ((st = write_index(w)) || (st = publish(w, name))) return st;
  df_hidden_writer_drop_buffer(w);
  return DFLASH_OK;
}

void df_hidden_writer_drop_buffer(dflash_hidden_writer *w) {
  for (size_t i = 0; i < w->n_buf; i++) free_pending(&w->buf[i]);
  w->n_buf = 0;
  w->buf_bytes = 0;
}

dflash_status dflash_hidden_writer_commit(dflash_hidden_writer *w) {
  DF_CHECK_ARG(w);
  if (w->finished) return DFLASH_OK;
  dflash_status st = dflash_hidden_writer_flush(w);
  if (w->spool) {
    if (!st) w->finished = true;
    return st;
  }
  if (!st && w->n_shards == 0) st = write_index(w); /* an empty store is still a store */
  if (!st && w->n_shards == 0 && w->remote)
    st = df_stage_out(w->storage, w->dir, w->remote, DF_HIDDEN_INDEX);
  if (!st) w->finished = true;
  if (!st && w->zero_layer_samples)
    df_log(DFLASH_LOG_WARN, "hidden writer %s: %llu sample(s) have an all-zero layer", w->dir,
           (unsigned long long)w->zero_layer_samples);
  return st;
}
