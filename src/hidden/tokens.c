/* A small reader of the tokenized dataset format (see hidden.h): shards of
 * input_ids / loss_mask / offsets with the sample ids in metadata. */
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "hidden.h"

typedef struct shard {
  dflash_safetensors *st;
  const int32_t *ids;
  int32_t *ids_copy; /* when the mapped tensor is not 4-byte aligned */
  const uint8_t *mask;
  int64_t *offsets;  /* n + 1 */
  char **sample_ids;
  size_t n;
} shard;

struct df_tokens {
  shard *shards;
  size_t n_shards;
  size_t *first; /* global index of each shard's first sample, n_shards + 1 */
};

static dflash_status tensor(const dflash_safetensors *st, const char *path, const char *name,
                            dflash_dtype dtype, dflash_tensor *t) {
  t->struct_size = sizeof *t;
  if (dflash_safetensors_find(st, name, t))
    return df_error(DFLASH_E_FORMAT, "%s: dataset shard lacks tensor %s", path, name);
  if (t->dtype != dtype || t->ndim != 1)
    return df_error(DFLASH_E_FORMAT, "%s: %s must be a 1-D %s tensor", path, name,
                    dflash_dtype_name(dtype));
  return DFLASH_OK;
}

static dflash_status parse_ids(shard *s, const char *path) {
  const char *text;
  if (dflash_safetensors_metadata_find(s->st, "sample_ids", &text))
    return df_error(DFLASH_E_FORMAT, "%s: dataset shard lacks metadata \"sample_ids\"", path);
  json_t *arr;
  dflash_status st = df_json_parse(text, strlen(text), path, &arr);
  if (st) return st;
  if (!json_is_array(arr) || json_array_size(arr) != s->n) {
    json_decref(arr);
    return df_error(DFLASH_E_FORMAT, "%s: metadata sample_ids must be an array of %zu ids", path,
                    s->n);
  }
  s->sample_ids = calloc(s->n + 1, sizeof *s->sample_ids);
  for (size_t i = 0; !st && i < s->n; i++) {
    json_t *v = json_array_get(arr, i);
    if (!json_is_string(v)) st = df_error(DFLASH_E_FORMAT, "%s: sample_ids[%zu] is not a string",
                                          path, i);
    else if (!s->sample_ids || !(s->sample_ids[i] = df_strdup(json_string_value(v))))
      st = df_error_nomem("sample ids");
  }
  json_decref(arr);
  return st;
}

static dflash_status open_shard(shard *s, const char *path) {
  dflash_status st = dflash_safetensors_open(path, &s->st);
  if (st) return st;
  dflash_tensor ids, mask, off;
  if ((st = tensor(s->st, path, "input_ids", DFLASH_DTYPE_I32, &ids)) ||
      (st = tensor(s->st, path, "loss_mask", DFLASH_DTYPE_U8, &mask)) ||
      (st = tensor(s->st, path, "offsets", DFLASH_DTYPE_I64, &off)))
    return st;
  int64_t N = ids.shape[0];
  if (mask.shape[0] != N)
    return df_error(DFLASH_E_FORMAT, "%s: loss_mask has %lld entries, input_ids %lld", path,
                    (long long)mask.shape[0], (long long)N);
  if (off.shape[0] < 1) return df_error(DFLASH_E_FORMAT, "%s: offsets is empty", path);
  s->n = (size_t)off.shape[0] - 1;
  s->offsets = malloc((s->n + 1) * sizeof *s->offsets);
  if (!s->offsets) return df_error_nomem("offsets");
  memcpy(s->offsets, off.data, (s->n + 1) * sizeof *s->offsets);
  for (size_t i = 0; i <= s->n; i++)
    if ((i == 0 && s->offsets[0] != 0) || (i > 0 && s->offsets[i] < s->offsets[i - 1]) ||
        s->offsets[i] > N)
      return df_error(DFLASH_E_FORMAT, "%s: offsets[%zu] = %lld breaks 0 = offsets[0] <= ... <= "
                      "%lld", path, i, (long long)s->offsets[i], (long long)N);
  if (s->offsets[s->n] != N)
    return df_error(DFLASH_E_FORMAT, "%s: offsets end at %lld, input_ids has %lld", path,
                    (long long)s->offsets[s->n], (long long)N);
  s->mask = mask.data;
  s->ids = ids.data;
  if ((uintptr_t)ids.data % sizeof(int32_t)) {
    s->ids_copy = malloc((size_t)N * sizeof(int32_t) + 1);
    if (!s->ids_copy) return df_error_nomem("input_ids");
    memcpy(s->ids_copy, ids.data, (size_t)N * sizeof(int32_t));
    s->ids = s->ids_copy;
  }
  return parse_ids(s, path);
}

static int cmp_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static dflash_status list_shards(const char *dir, char ***out, size_t *n) {
  DIR *d = opendir(dir);
  if (!d) return df_error_errno(errno == ENOENT ? DFLASH_E_NOT_FOUND : DFLASH_E_IO, errno,
                                "cannot open dataset directory %s", dir);
  char **names = NULL;
  size_t k = 0;
  struct dirent *de;
  dflash_status st = DFLASH_OK;
  while (!st && (de = readdir(d))) {
    if (!df_str_ends_with(de->d_name, ".safetensors")) continue;
    char **nn = realloc(names, (k + 1) * sizeof *nn);
    if (!nn || !(nn[k] = df_path_join(dir, de->d_name))) st = df_error_nomem("shard list");
    if (nn) names = nn;
    if (!st) k++;
  }
  closedir(d);
  if (!st && k == 0) st = df_error(DFLASH_E_NOT_FOUND, "%s: no *.safetensors dataset shards", dir);
  if (st) {
    for (size_t i = 0; i < k; i++) free(names[i]);
    free(names);
    return st;
  }
  qsort(names, k, sizeof *names, cmp_name);
  *out = names;
  *n = k;
  return DFLASH_OK;
}

dflash_status df_tokens_open(const char *dir, df_tokens **out) {
  char **paths = NULL;
  size_t n = 0;
  dflash_status st = list_shards(dir, &paths, &n);
  if (st) return st;
  df_tokens *t = calloc(1, sizeof *t);
  if (t) t->shards = calloc(n, sizeof *t->shards), t->first = calloc(n + 1, sizeof *t->first);
  if (!t || !t->shards || !t->first) st = df_error_nomem("dataset");
  for (size_t i = 0; !st && i < n; i++) {
    t->n_shards++;
    st = open_shard(&t->shards[i], paths[i]);
    t->first[i + 1] = t->first[i] + t->shards[i].n;
  }
  for (size_t i = 0; i < n; i++) free(paths[i]);
  free(paths);
  if (st) {
    df_tokens_free(t);
    return st;
  }
  *out = t;
  return DFLASH_OK;
}

void df_tokens_free(df_tokens *t) {
  if (!t) return;
  for (size_t i = 0; t->shards && i < t->n_shards; i++) {
    shard *s = &t->shards[i];
    for (size_t j = 0; s->sample_ids && j < s->n; j++) free(s->sample_ids[j]);
    free(s->sample_ids);
    free(s->offsets);
    free(s->ids_copy);
    dflash_safetensors_free(s->st);
  }
  free(t->shards);
  free(t->first);
  free(t);
}

size_t df_tokens_count(const df_tokens *t) { return t->first[t->n_shards]; }

void df_tokens_get(const df_tokens *t, size_t i, const char **id, const int32_t **ids,
                   const uint8_t **mask, int64_t *len) {
  size_t lo = 0, hi = t->n_shards; /* last shard whose first <= i */
  while (hi - lo > 1) {
    size_t mid = (lo + hi) / 2;
    if (t->first[mid] <= i) lo = mid;
    else hi = mid;
  }
  const shard *s = &t->shards[lo];
  size_t j = i - t->first[lo];
  *id = s->sample_ids[j];
  *ids = s->ids + s->offsets[j];
  *mask = s->mask + s->offsets[j];
  *len = s->offsets[j + 1] - s->offsets[j];
}
