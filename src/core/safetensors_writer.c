/*
 * Streaming safetensors writer and index writer. The header is fixed once the
 * tensors are declared, so data streams straight to disk in declaration order
 * without buffering; the file appears under its final name only when complete.
 */
#include <dflash/safetensors.h>

#include "internal.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

enum writer_state { W_DECLARING, W_WRITING, W_FINISHED, W_FAILED };

struct dflash_safetensors_writer {
  df_atomic_file file;
  json_t *tensors; /* name -> info, in declaration order */
  json_t *meta;
  uint64_t total;   /* bytes declared */
  uint64_t written; /* bytes streamed so far */
  enum writer_state state;
};

DFLASH_API dflash_status dflash_safetensors_writer_create(const char *path,
                                                          dflash_safetensors_writer **out) {
  DF_CHECK_ARG(path && out);
  *out = NULL;
  dflash_safetensors_writer *w = calloc(1, sizeof *w);
  if (!w) return df_error_nomem("safetensors writer");
  w->file.fd = -1;
  w->tensors = json_object();
  w->meta = json_object();
  dflash_status st = (w->tensors && w->meta) ? df_atomic_open(path, &w->file)
                                             : df_error_nomem("safetensors writer");
  if (st) {
    dflash_safetensors_writer_free(w);
    return st;
  }
  *out = w;
  return DFLASH_OK;
}

static dflash_status require_declaring(const dflash_safetensors_writer *w, const char *what) {
  if (w->state != W_DECLARING)
    return df_error(DFLASH_E_STATE, "%s: %s after data was written", w->file.path, what);
  return DFLASH_OK;
}

DFLASH_API dflash_status dflash_safetensors_writer_metadata(dflash_safetensors_writer *w,
                                                            const char *key, const char *value) {
  DF_CHECK_ARG(w && key && value);
  dflash_status st = require_declaring(w, "metadata added");
  if (st) return st;
  if (!df_utf8_valid(key, strlen(key)) || !df_utf8_valid(value, strlen(value)))
    return df_error(DFLASH_E_UTF8, "%s: metadata \"%s\" is not valid UTF-8", w->file.path, key);
  if (!strcmp(key, "__metadata__"))
    return df_error(DFLASH_E_INVALID_ARG, "%s: \"__metadata__\" is not a metadata key",
                    w->file.path);
  if (json_object_set_new(w->meta, key, json_string(value))) return df_error_nomem("metadata");
  return DFLASH_OK;
}

static json_t *tensor_info(dflash_dtype dtype, uint32_t ndim, const int64_t *shape, uint64_t begin,
                           uint64_t end) {
  json_t *dims = json_array();
  for (uint32_t d = 0; dims && d < ndim; d++)
    if (json_array_append_new(dims, json_integer(shape[d]))) { /* out of memory: no dims */
      json_decref(dims);
      return NULL;
    }
  return json_pack("{s:s, s:o, s:[I,I]}", "dtype", dflash_dtype_name(dtype), "shape", dims,
                   "data_offsets", (json_int_t)begin, (json_int_t)end);
}

DFLASH_API dflash_status dflash_safetensors_writer_declare(dflash_safetensors_writer *w,
                                                           const char *name, dflash_dtype dtype,
                                                           uint32_t ndim, const int64_t *shape) {
  DF_CHECK_ARG(w && name && (shape || ndim == 0));
  dflash_status st = require_declaring(w, "tensor declared");
  if (st) return st;
  const char *path = w->file.path;
  if (!dflash_dtype_name(dtype))
    return df_error(DFLASH_E_DTYPE, "%s: tensor \"%s\": unknown dtype %d", path, name, (int)dtype);
  if (!name[0] || !strcmp(name, "__metadata__") || !df_utf8_valid(name, strlen(name)))
    return df_error(DFLASH_E_INVALID_ARG, "%s: \"%s\" is not a valid tensor name", path, name);
  if (json_object_get(w->tensors, name))
    return df_error(DFLASH_E_DUPLICATE, "%s: tensor \"%s\" declared twice", path, name);
  uint64_t bytes = dflash_dtype_size(dtype);
  for (uint32_t d = 0; d < ndim; d++) {
    if (shape[d] < 0)
      return df_error(DFLASH_E_INVALID_ARG, "%s: tensor \"%s\": negative dimension", path, name);
    if (!df_mul_u64(bytes, (uint64_t)shape[d], &bytes))
      return df_error(DFLASH_E_OVERFLOW, "%s: tensor \"%s\": byte size overflows", path, name);
  }
  uint64_t end;
  if (!df_add_u64(w->total, bytes, &end) || end > INT64_MAX)
    return df_error(DFLASH_E_OVERFLOW, "%s: file size overflows at tensor \"%s\"", path, name);
  json_t *info = tensor_info(dtype, ndim, shape, w->total, end);
  if (!info || json_object_set_new(w->tensors, name, info)) return df_error_nomem("tensor info");
  w->total = end;
  return DFLASH_OK;
}

/* Header: metadata first, then tensors in declaration order, padded with
 * spaces so the data section starts 8-byte aligned (as Python's writer does). */
static dflash_status write_header(dflash_safetensors_writer *w) {
  json_t *root = json_object();
  if (!root) return df_error_nomem("header");
  /* A failed set or update (out of memory) would write a header without those tensors. */
  bool lost = json_object_size(w->meta) && json_object_set(root, "__metadata__", w->meta);
  lost = json_object_update(root, w->tensors) || lost;
  char *text = lost ? NULL : json_dumps(root, JSON_COMPACT);
  json_decref(root);
  if (!text) return df_error_nomem("header");
  size_t len = strlen(text), padded = (len + 7) & ~(size_t)7;
  df_buf b = {0};
  uint8_t le[8];
  for (int i = 0; i < 8; i++) le[i] = (uint8_t)((uint64_t)padded >> (8 * i));
  dflash_status st = df_buf_append(&b, le, 8);
  if (!st) st = df_buf_append(&b, text, len);
  while (!st && b.len < 8 + padded) st = df_buf_append(&b, " ", 1);
  free(text);
  if (!st) st = df_atomic_write(&w->file, b.data, b.len);
  df_buf_free(&b);
  return st;
}

DFLASH_API dflash_status dflash_safetensors_writer_write(dflash_safetensors_writer *w,
                                                         const void *data, size_t n) {
  DF_CHECK_ARG(w && (data || n == 0));
  if (w->state == W_FINISHED || w->state == W_FAILED)
    return df_error(DFLASH_E_STATE, "%s: write after the writer %s",
                    w->file.path ? w->file.path : "", w->state == W_FAILED ? "failed" : "finished");
  dflash_status st = DFLASH_OK;
  if (w->state == W_DECLARING) {
    w->state = W_WRITING;
    if ((st = write_header(w))) {
      w->state = W_FAILED;
      return st;
    }
  }
  if (n > w->total - w->written)
    return df_error(DFLASH_E_RANGE, "%s: %zu more bytes written than the %llu declared",
                    w->file.path, n - (size_t)(w->total - w->written),
                    (unsigned long long)w->total);
  if ((st = df_atomic_write(&w->file, data, n))) {
    w->state = W_FAILED;
    return st;
  }
  w->written += n;
  return DFLASH_OK;
}

DFLASH_API dflash_status dflash_safetensors_writer_commit(dflash_safetensors_writer *w) {
  DF_CHECK_ARG(w);
  dflash_status st = dflash_safetensors_writer_write(w, "",
                                                     0); /* writes the header if no data came */
  if (st) return st;
  if (w->written != w->total)
    return df_error(DFLASH_E_TRUNCATED, "%s: only %llu of %llu declared bytes were written",
                    w->file.path, (unsigned long long)w->written, (unsigned long long)w->total);
  if ((st = df_atomic_commit(&w->file))) {
    w->state = W_FAILED;
    return st;
  }
  w->state = W_FINISHED;
  return DFLASH_OK;
}

DFLASH_API void dflash_safetensors_writer_free(dflash_safetensors_writer *w) {
  if (!w) return;
  df_atomic_abort(&w->file); /* removes the temporary file of an unfinished writer */
  json_decref(w->tensors);
  json_decref(w->meta);
  free(w);
}

/* ---- index ---------------------------------------------------------------- */

static dflash_status add_shard_to_index(const char *dir, const char *shard, json_t *map,
                                        uint64_t *total) {
  char *path = df_path_join(dir, shard);
  if (!path) return df_error_nomem("path");
  dflash_safetensors *st;
  dflash_status s = dflash_safetensors_open(path, &st);
  free(path);
  if (s) return s;
  for (size_t i = 0; i < dflash_safetensors_count(st) && !s; i++) {
    dflash_tensor t = {.struct_size = sizeof t};
    if ((s = dflash_safetensors_get(st, i, &t))) break;
    if (json_object_get(map, t.name))
      s = df_error(DFLASH_E_DUPLICATE, "tensor \"%s\" is in %s and in an earlier shard", t.name,
                   shard);
    else if (json_object_set_new(map, t.name, json_string(shard))) s = df_error_nomem("weight map");
    *total += t.nbytes;
  }
  dflash_safetensors_free(st);
  return s;
}

DFLASH_API dflash_status dflash_safetensors_write_index(const char *path, size_t n_shards,
                                                        const char *const *shard_files,
                                                        size_t n_meta, const char *const *meta_keys,
                                                        const char *const *meta_values) {
  DF_CHECK_ARG(path && (shard_files || n_shards == 0) &&
               (n_meta == 0 || (meta_keys && meta_values)));
  char *dir = df_path_dirname(path);
  json_t *map = json_object(), *meta = json_object();
  dflash_status s = (dir && map && meta) ? DFLASH_OK : df_error_nomem("index");
  uint64_t total = 0;
  for (size_t i = 0; i < n_shards && !s; i++)
    s = add_shard_to_index(dir, shard_files[i], map, &total);
  for (size_t i = 0; i < n_meta && !s; i++)
    if (!df_utf8_valid(meta_values[i], strlen(meta_values[i])))
      s = df_error(DFLASH_E_INVALID_ARG, "index metadata \"%s\" is not valid UTF-8", meta_keys[i]);
    else if (json_object_set_new(meta, meta_keys[i], json_string(meta_values[i])))
      s = df_error_nomem("index metadata");
  char *text = NULL;
  if (!s) {
    json_t *root = json_object_set_new(meta, "total_size", json_integer((json_int_t)total))
                       ? NULL
                       : json_pack("{s:O, s:O}", "metadata", meta, "weight_map", map);
    text = root ? json_dumps(root, JSON_INDENT(2) | JSON_SORT_KEYS) : NULL;
    json_decref(root);
    s = text ? df_write_file_atomic(path, text, strlen(text)) : df_error_nomem("index text");
  }
  free(text);
  free(dir);
  json_decref(map);
  json_decref(meta);
  return s;
}
