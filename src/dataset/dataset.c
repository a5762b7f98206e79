/* Dataset shards (safetensors) and manifest: writer and memory-mapped reader. */
#include <dflash/dataset.h>
#include <dflash/safetensors.h>
#include <dflash/storage.h>
#include <stdio.h>
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/internal.h"
#include "storage/stage.h"

#define MANIFEST "dataset.json"

struct dflash_dataset_writer {
  char *dir;    /* where shards are written: `remote`'s staging directory when set */
  char *remote; /* s3:// destination: shards are uploaded as they close */
  dflash_storage *storage;
  dflash_dataset_writer_options opts;
  df_buf ids, mask;   /* current shard */
  df_buf offsets;     /* int64 per sample + 1 */
  json_t *sample_ids; /* current shard's ids */
  json_t *shards;     /* manifest entries */
  uint64_t samples, tokens, supervised;
  bool finished;
};

static void dataset_writer_options_defaults(dflash_dataset_writer_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->shard_tokens = (uint64_t)1 << 26;
}

DF_DEFINE_INIT(dflash_dataset_writer_options, dataset_writer_options_defaults)

static dflash_status start_shard(dflash_dataset_writer *w) {
  w->ids.len = w->mask.len = w->offsets.len = 0;
  json_decref(w->sample_ids);
  w->sample_ids = json_array();
  int64_t zero = 0;
  if (!w->sample_ids) return df_error_nomem("sample ids");
  return df_buf_append(&w->offsets, &zero, sizeof zero);
}

/* The options' strings are the caller's: keep copies until finish. */
static dflash_status copy_strings(dflash_dataset_writer *w) {
  const char **fields[] = {&w->opts.tokenizer_hash, &w->opts.template_name, &w->opts.options_json};
  for (size_t i = 0; i < DF_ARRAY_LEN(fields); i++) {
    if (!*fields[i]) continue;
    char *copy = df_strdup(*fields[i]);
    *fields[i] = copy;
    if (!copy) {
      while (++i < DF_ARRAY_LEN(fields)) *fields[i] = NULL; /* not ours to free */
      return df_error_nomem("dataset writer options");
    }
  }
  if (w->opts.options_json) {
    json_t *o = NULL;
    dflash_status st = df_json_parse(w->opts.options_json, strlen(w->opts.options_json),
                                     "dataset writer options_json", &o);
    bool obj = !st && json_is_object(o);
    json_decref(o);
    if (!st && !obj)
      st = df_error(DFLASH_E_FORMAT, "dataset writer options_json: not a JSON object");
    if (st) return st;
  }
  return DFLASH_OK;
}

static void free_strings(dflash_dataset_writer *w) {
  free((char *)w->opts.tokenizer_hash);
  free((char *)w->opts.template_name);
  free((char *)w->opts.options_json);
}

static dflash_status create_writer(const char *dir, const dflash_dataset_writer_options *opts,
                                   dflash_dataset_writer **out);

/* An s3:// destination: refuse one that holds a manifest, and stage shards
 * in a local directory (one shard at a time: each is deleted once uploaded). */
static dflash_status open_remote(dflash_dataset_writer *w, const char *remote) {
  char *manifest = df_stage_join(remote, MANIFEST);
  if (!manifest) return df_error_nomem("path");
  dflash_storage_info info = {.struct_size = sizeof info};
  dflash_status st = dflash_storage_create(NULL, &w->storage);
  if (!st) st = dflash_storage_stat(w->storage, manifest, &info);
  if (!st) st = df_error(DFLASH_E_EXISTS, "%s: already holds a dataset", remote);
  else if (st == DFLASH_E_NOT_FOUND) st = DFLASH_OK;
  free(manifest);
  if (!st && !(w->remote = df_strdup(remote))) st = df_error_nomem("path");
  if (!st) st = df_stage_tmpdir("dataset", &w->dir);
  return st;
}

/* Remote datasets: upload a finished file of the staging directory. */
static dflash_status publish(dflash_dataset_writer *w, const char *name, bool drop_local) {
  if (!w->remote) return DFLASH_OK;
  dflash_status st = df_stage_out(w->storage, w->dir, w->remote, name);
  char *path = drop_local ? df_path_join(w->dir, name) : NULL;
  if (path) remove(path);
  free(path);
  return st;
}

dflash_status dflash_dataset_writer_create(const char *dir,
                                           const dflash_dataset_writer_options *opts,
                                           dflash_dataset_writer **out) {
  DF_CHECK_ARG(dir && out);
  *out = NULL;
  if (dflash_storage_is_remote(dir)) return create_writer(dir, opts, out);
  dflash_status mk = df_mkdir_p(dir);
  if (mk) return mk;
  char *manifest = df_path_join(dir, MANIFEST);
  struct stat sb;
  bool exists = manifest && stat(manifest, &sb) == 0;
  free(manifest);
  if (exists) return df_error(DFLASH_E_EXISTS, "%s: already holds a dataset", dir);
  return create_writer(dir, opts, out);
}

static dflash_status create_writer(const char *dir, const dflash_dataset_writer_options *opts,
                                   dflash_dataset_writer **out) {
  dflash_dataset_writer *w = calloc(1, sizeof *w);
  if (!w) return df_error_nomem("dataset writer");
  dflash_dataset_writer_options_default(&w->opts);
  dflash_status st = df_opts_in(&w->opts, opts, sizeof w->opts, "dflash_dataset_writer_options");
  if (st) {
    free(w);
    return st;
  }
  st = copy_strings(w);
  if (dflash_storage_is_remote(dir)) {
    if (!st) st = open_remote(w, dir);
  } else {
    w->dir = df_strdup(dir);
  }
  w->shards = json_array();
  if (!st && !(w->dir && w->shards)) st = df_error_nomem("dataset writer");
  if (!st) st = start_shard(w);
  if (st) {
    dflash_dataset_writer_free(w);
    return st;
  }
  *out = w;
  return DFLASH_OK;
}

static dflash_status write_tensor(dflash_safetensors_writer *sw, const df_buf *b) {
  return dflash_safetensors_writer_write(sw, b->data ? b->data : "", b->len);
}

static dflash_status flush_shard(dflash_dataset_writer *w) {
  size_t n_samples = json_array_size(w->sample_ids);
  if (!n_samples) return DFLASH_OK;
  char name[32];
  snprintf(name, sizeof name, "shard-%05zu.safetensors", json_array_size(w->shards));
  char *path = df_path_join(w->dir, name);
  char *ids_json = json_dumps(w->sample_ids, JSON_COMPACT | JSON_ENSURE_ASCII);
  dflash_safetensors_writer *sw = NULL;
  dflash_status st = (path && ids_json) ? dflash_safetensors_writer_create(path, &sw)
                                        : df_error_nomem("shard");
  int64_t n_tok = (int64_t)(w->ids.len / sizeof(int32_t)), n_off = (int64_t)n_samples + 1;
  if (!st) st = dflash_safetensors_writer_metadata(sw, "sample_ids", ids_json);
  /* Stored in declaration order, widest first, so every tensor is aligned to
   * its element size in the (8-aligned) data section: offsets, input_ids,
   * loss_mask. Readers find them by name. */
  if (!st) st = dflash_safetensors_writer_declare(sw, "offsets", DFLASH_DTYPE_I64, 1, &n_off);
  if (!st) st = dflash_safetensors_writer_declare(sw, "input_ids", DFLASH_DTYPE_I32, 1, &n_tok);
  if (!st) st = dflash_safetensors_writer_declare(sw, "loss_mask", DFLASH_DTYPE_U8, 1, &n_tok);
  if (!st) st = write_tensor(sw, &w->offsets);
  if (!st) st = write_tensor(sw, &w->ids);
  if (!st) st = write_tensor(sw, &w->mask);
  if (!st) st = dflash_safetensors_writer_commit(sw);
  if (!st) st = publish(w, name, true);
  if (!st && json_array_append_new(w->shards,
                                   json_pack("{s:s,s:I,s:I}", "file", name, "samples",
                                             (json_int_t)n_samples, "tokens", (json_int_t)n_tok)))
    st = df_error_nomem("manifest");
  dflash_safetensors_writer_free(sw);
  free(path);
  free(ids_json);
  return st ? st : start_shard(w);
}

dflash_status dflash_dataset_writer_add(dflash_dataset_writer *w, const char *sample_id,
                                        const int32_t *ids, const uint8_t *mask, size_t n) {
  DF_CHECK_ARG(w && sample_id && ids && mask && n > 0);
  if (w->finished) return df_error(DFLASH_E_STATE, "dataset writer: already finished");
  /* Check the id before touching the shard, and undo a partial append, so a
   * refused sample leaves the shard consistent. */
  if (!df_utf8_valid(sample_id, strlen(sample_id)))
    return df_error(DFLASH_E_UTF8, "sample id \"%s\" is not valid UTF-8", sample_id);
  json_t *sid = json_string(sample_id);
  if (!sid) return df_error_nomem("sample id");
  size_t ids_len = w->ids.len, mask_len = w->mask.len, off_len = w->offsets.len;
  dflash_status st = df_buf_append(&w->ids, ids, n * sizeof *ids);
  if (!st) st = df_buf_append(&w->mask, mask, n);
  int64_t end = (int64_t)(w->ids.len / sizeof(int32_t));
  if (!st) st = df_buf_append(&w->offsets, &end, sizeof end);
  if (!st && json_array_append_new(w->sample_ids, sid)) st = df_error_nomem("sample ids");
  else if (st) json_decref(sid);
  if (st) {
    w->ids.len = ids_len;
    w->mask.len = mask_len;
    w->offsets.len = off_len;
    return st;
  }
  w->samples++;
  w->tokens += n;
  for (size_t i = 0; i < n; i++) w->supervised += mask[i] != 0;
  if ((uint64_t)end >= w->opts.shard_tokens) return flush_shard(w);
  return DFLASH_OK;
}

static json_t *manifest_json(const dflash_dataset_writer *w) {
  json_t *m = json_pack("{s:s,s:i,s:I,s:I,s:I,s:O}", "format", "dflash-dataset", "version", 1,
                        "samples", (json_int_t)w->samples, "tokens", (json_int_t)w->tokens,
                        "supervised_tokens", (json_int_t)w->supervised, "shards", w->shards);
  if (!m) return NULL;
  /* Out of memory in any of these would write a manifest without the field: none at all. */
  int lost = json_object_set_new(m, "tokenizer_hash",
                                 w->opts.tokenizer_hash ? json_string(w->opts.tokenizer_hash)
                                                        : json_null());
  lost |= json_object_set_new(m, "template",
                              w->opts.template_name ? json_string(w->opts.template_name)
                                                    : json_null());
  json_t *o = w->opts.options_json ? json_loads(w->opts.options_json, 0, NULL) : json_object();
  lost |= json_object_set_new(m, "options", o);
  if (lost) json_decref(m);
  return lost ? NULL : m;
}

dflash_status dflash_dataset_writer_commit(dflash_dataset_writer *w) {
  DF_CHECK_ARG(w);
  if (w->finished) return df_error(DFLASH_E_STATE, "dataset writer: already finished");
  dflash_status st = flush_shard(w);
  if (st) return st;
  json_t *m = manifest_json(w);
  char *text = m ? json_dumps(m, JSON_INDENT(2)) : NULL;
  char *path = df_path_join(w->dir, MANIFEST);
  st = (text && path) ? df_write_file_atomic(path, text, strlen(text)) : df_error_nomem("manifest");
  if (!st) st = publish(w, MANIFEST, false); /* last: it makes the dataset visible */
  json_decref(m);
  free(text);
  free(path);
  if (!st) w->finished = true;
  return st;
}

void dflash_dataset_writer_free(dflash_dataset_writer *w) {
  if (!w) return;
  df_buf_free(&w->ids);
  df_buf_free(&w->mask);
  df_buf_free(&w->offsets);
  json_decref(w->sample_ids);
  json_decref(w->shards);
  free_strings(w);
  if (w->remote) df_stage_rmtree(w->dir);
  free(w->remote);
  dflash_storage_free(w->storage);
  free(w->dir);
  free(w);
}

/* ---- reader ---------------------------------------------------------------- */

typedef struct df_shard {
  dflash_safetensors *st;
  const int32_t *ids;
  const uint8_t *mask;
  const int64_t *offsets;
  size_t n_samples, n_tokens, first; /* first: global index of its sample 0 */
  json_t *sample_ids;
  void *owned[2]; /* aligned copies of misaligned tensors (shards from other writers) */
} df_shard;

struct dflash_dataset {
  df_shard *shards;
  size_t n_shards, n_samples;
  uint64_t n_tokens;
};

void dflash_dataset_free(dflash_dataset *ds) {
  if (!ds) return;
  for (size_t i = 0; i < ds->n_shards; i++) {
    dflash_safetensors_free(ds->shards[i].st);
    json_decref(ds->shards[i].sample_ids);
    free(ds->shards[i].owned[0]);
    free(ds->shards[i].owned[1]);
  }
  free(ds->shards);
  free(ds);
}

static dflash_status tensor(const dflash_safetensors *st, const char *path, const char *name,
                            dflash_dtype dtype, const void **data, size_t *n) {
  dflash_tensor t = {.struct_size = sizeof t};
  dflash_status s = dflash_safetensors_find(st, name, &t);
  if (s) return df_error_wrap(s, "%s", path);
  if (t.dtype != (int32_t)dtype || t.ndim != 1)
    return df_error(DFLASH_E_FORMAT, "%s: tensor %s is not a 1-D %s", path, name,
                    dflash_dtype_name(dtype));
  *data = t.data;
  *n = (size_t)t.shape[0];
  return DFLASH_OK;
}

/* Element access must be aligned (C); a tensor that is not gets an aligned copy. */
static dflash_status align_tensor(const void **data, size_t bytes, size_t align, void **owned) {
  if ((uintptr_t)*data % align == 0) return DFLASH_OK;
  *owned = malloc(bytes ? bytes : 1);
  if (!*owned) return df_error_nomem("aligned tensor copy");
  memcpy(*owned, *data, bytes);
  *data = *owned;
  return DFLASH_OK;
}

/* Map one shard and check its offsets describe its tokens exactly. */
static dflash_status open_shard(const char *path, df_shard *sh) {
  dflash_status st = dflash_safetensors_open(path, &sh->st);
  size_t n_mask = 0, n_off = 0;
  const char *ids_json = NULL;
  if (!st)
    st = tensor(sh->st, path, "input_ids", DFLASH_DTYPE_I32, (const void **)&sh->ids,
                &sh->n_tokens);
  if (!st)
    st = tensor(sh->st, path, "loss_mask", DFLASH_DTYPE_U8, (const void **)&sh->mask, &n_mask);
  if (!st)
    st = tensor(sh->st, path, "offsets", DFLASH_DTYPE_I64, (const void **)&sh->offsets, &n_off);
  if (!st) st = dflash_safetensors_metadata_find(sh->st, "sample_ids", &ids_json);
  if (!st)
    st = align_tensor((const void **)&sh->ids, sh->n_tokens * sizeof *sh->ids, sizeof *sh->ids,
                      &sh->owned[0]);
  if (!st)
    st = align_tensor((const void **)&sh->offsets, n_off * sizeof *sh->offsets, sizeof *sh->offsets,
                      &sh->owned[1]);
  if (st) return st;
  sh->n_samples = n_off ? n_off - 1 : 0;
  if (n_mask != sh->n_tokens || !n_off || sh->offsets[0] != 0 ||
      sh->offsets[sh->n_samples] != (int64_t)sh->n_tokens)
    return df_error(DFLASH_E_FORMAT, "%s: offsets do not cover input_ids/loss_mask", path);
  for (size_t i = 0; i < sh->n_samples; i++)
    if (sh->offsets[i + 1] <= sh->offsets[i])
      return df_error(DFLASH_E_FORMAT, "%s: offsets not increasing at sample %zu", path, i);
  sh->sample_ids = json_loads(ids_json, 0, NULL);
  if (!json_is_array(sh->sample_ids) || json_array_size(sh->sample_ids) != sh->n_samples)
    return df_error(DFLASH_E_FORMAT, "%s: sample_ids metadata does not list %zu ids", path,
                    sh->n_samples);
  return DFLASH_OK;
}

static dflash_status open_all(dflash_dataset *ds, const char *dir, const json_t *manifest) {
  const json_t *shards = json_object_get(manifest, "shards");
  if (!json_is_array(shards)) return df_error(DFLASH_E_FORMAT, "%s/" MANIFEST ": no shards", dir);
  ds->shards = calloc(json_array_size(shards) + 1, sizeof *ds->shards);
  if (!ds->shards) return df_error_nomem("dataset shards");
  for (size_t i = 0; i < json_array_size(shards); i++) {
    const char *file = json_string_value(json_object_get(json_array_get(shards, i), "file"));
    if (!file || strchr(file, '/'))
      return df_error(DFLASH_E_FORMAT, "%s/" MANIFEST ": shard %zu has no plain file name", dir, i);
    char *path = df_path_join(dir, file);
    if (!path) return df_error_nomem("path");
    df_shard *sh = &ds->shards[ds->n_shards++];
    dflash_status st = open_shard(path, sh);
    free(path);
    if (st) return st;
    sh->first = ds->n_samples;
    ds->n_samples += sh->n_samples;
    ds->n_tokens += sh->n_tokens;
  }
  json_int_t want = json_integer_value(json_object_get(manifest, "samples"));
  if ((size_t)want != ds->n_samples)
    return df_error(DFLASH_E_MISMATCH, "%s/" MANIFEST ": %lld samples listed, shards hold %zu", dir,
                    (long long)want, ds->n_samples);
  return DFLASH_OK;
}

/* An s3:// dataset is mirrored into the cache directory (storage/stage.h)
 * and opened there: datasets are small next to hidden states, and samples
 * are served as pointers into mapped shards. */
static dflash_status open_remote_dataset(const char *url, dflash_dataset **out) {
  dflash_storage *st = NULL;
  char *local = NULL;
  dflash_status s = dflash_storage_create(NULL, &st);
  if (!s) s = df_stage_in_cached(st, url, &local);
  dflash_storage_free(st);
  if (!s) s = dflash_dataset_open(local, out);
  free(local);
  return s ? df_error_wrap(s, "opening dataset %s", url) : DFLASH_OK;
}

dflash_status dflash_dataset_open(const char *dir, dflash_dataset **out) {
  DF_CHECK_ARG(dir && out);
  *out = NULL;
  if (dflash_storage_is_remote(dir)) return open_remote_dataset(dir, out);
  char *path = df_path_join(dir, MANIFEST);
  json_t *m = NULL;
  struct stat sb;
  dflash_status st = DFLASH_OK;
  if (!path) st = df_error_nomem("path");
  else if (stat(path, &sb) != 0 && errno == ENOENT)
    st = df_error(DFLASH_E_NOT_FOUND, "%s: missing: not a dataset, or an unfinished run", path);
  if (!st) st = df_json_load_file(path, &m);
  free(path);
  if (st) return st;
  dflash_dataset *ds = calloc(1, sizeof *ds);
  st = ds ? open_all(ds, dir, m) : df_error_nomem("dataset");
  json_decref(m);
  if (st) {
    dflash_dataset_free(ds);
    return st;
  }
  *out = ds;
  return DFLASH_OK;
}

size_t dflash_dataset_count(const dflash_dataset *ds) { return ds ? ds->n_samples : 0; }
uint64_t dflash_dataset_tokens(const dflash_dataset *ds) { return ds ? ds->n_tokens : 0; }

dflash_status dflash_dataset_sample(const dflash_dataset *ds, size_t index, const int32_t **ids,
                                    const uint8_t **mask, size_t *n, const char **sample_id) {
  DF_CHECK_ARG(ds);
  if (index >= ds->n_samples)
    return df_error(DFLASH_E_RANGE, "sample %zu of %zu", index, ds->n_samples);
  /* Binary search over shard starts. */
  size_t lo = 0, hi = ds->n_shards;
  while (hi - lo > 1) {
    size_t mid = (lo + hi) / 2;
    if (ds->shards[mid].first <= index) lo = mid;
    else hi = mid;
  }
  const df_shard *sh = &ds->shards[lo];
  size_t k = index - sh->first;
  int64_t b = sh->offsets[k], e = sh->offsets[k + 1];
  if (ids) *ids = sh->ids + b;
  if (mask) *mask = sh->mask + b;
  if (n) *n = (size_t)(e - b);
  if (sample_id) *sample_id = json_string_value(json_array_get(sh->sample_ids, k));
  return DFLASH_OK;
}

dflash_status dflash_dataset_length_histogram(const dflash_dataset *ds, size_t bin_width,
                                              size_t n_bins, uint64_t *counts) {
  DF_CHECK_ARG(ds && bin_width > 0 && n_bins > 0 && counts);
  memset(counts, 0, n_bins * sizeof *counts);
  for (size_t s = 0; s < ds->n_shards; s++)
    for (size_t k = 0; k < ds->shards[s].n_samples; k++) {
      size_t len = (size_t)(ds->shards[s].offsets[k + 1] - ds->shards[s].offsets[k]);
      size_t b = len / bin_width;
      counts[b < n_bins ? b : n_bins - 1]++;
    }
  return DFLASH_OK;
}

dflash_status dflash_dataset_token_counts(const dflash_dataset *ds, int32_t vocab_size,
                                          int64_t *counts, int64_t *supervised) {
  DF_CHECK_ARG(ds && vocab_size > 0 && counts);
  memset(counts, 0, (size_t)vocab_size * sizeof *counts);
  int64_t total = 0;
  size_t n = dflash_dataset_count(ds);
  for (size_t i = 0; i < n; i++) {
    const int32_t *ids;
    const uint8_t *mask;
    size_t len;
    const char *id;
    dflash_status st = dflash_dataset_sample(ds, i, &ids, &mask, &len, &id);
    if (st) return st;
    for (size_t p = 0; p < len; p++) {
      if (!mask[p]) continue;
      if (ids[p] < 0 || ids[p] >= vocab_size)
        return df_error(DFLASH_E_RANGE,
                        "dataset sample %zu (%s), position %zu: supervised token id %d is "
                        "outside the vocabulary [0, %d)",
                        i, id ? id : "?", p, ids[p], vocab_size);
      counts[ids[p]]++;
      total++;
    }
  }
  if (supervised) *supervised = total;
  return DFLASH_OK;
}
