/*
 * safetensors reader: validation of one file's header and layout (shared with
 * the fuzz target), memory-mapping, shard sets and the public accessors.
 */
#include "safetensors_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Python's safetensors refuses headers above 100 MB; so do we (a corrupt
 * length must not make us parse gigabytes as JSON). */
#define DF_ST_MAX_HEADER (100u * 1000u * 1000u)

static const struct {
  const char *name;
  size_t size;
} dtype_info[] = {
    [DFLASH_DTYPE_F64] = {"F64", 8},         [DFLASH_DTYPE_F32] = {"F32", 4},
    [DFLASH_DTYPE_F16] = {"F16", 2},         [DFLASH_DTYPE_BF16] = {"BF16", 2},
    [DFLASH_DTYPE_F8_E4M3] = {"F8_E4M3", 1}, [DFLASH_DTYPE_F8_E5M2] = {"F8_E5M2", 1},
    [DFLASH_DTYPE_I64] = {"I64", 8},         [DFLASH_DTYPE_I32] = {"I32", 4},
    [DFLASH_DTYPE_I16] = {"I16", 2},         [DFLASH_DTYPE_I8] = {"I8", 1},
    [DFLASH_DTYPE_U8] = {"U8", 1},           [DFLASH_DTYPE_BOOL] = {"BOOL", 1},
    [DFLASH_DTYPE_U16] = {"U16", 2},         [DFLASH_DTYPE_U32] = {"U32", 4},
    [DFLASH_DTYPE_U64] = {"U64", 8},
};

DFLASH_API const char *dflash_dtype_name(dflash_dtype dtype) {
  return (unsigned)dtype < DF_ARRAY_LEN(dtype_info) ? dtype_info[dtype].name : NULL;
}

DFLASH_API size_t dflash_dtype_size(dflash_dtype dtype) {
  return (unsigned)dtype < DF_ARRAY_LEN(dtype_info) ? dtype_info[dtype].size : 0;
}

DFLASH_API dflash_status dflash_dtype_from_name(const char *name, dflash_dtype *out) {
  DF_CHECK_ARG(name && out);
  for (size_t i = 0; i < DF_ARRAY_LEN(dtype_info); i++) {
    if (!strcmp(name, dtype_info[i].name)) {
      *out = (dflash_dtype)i;
      return DFLASH_OK;
    }
  }
  return df_error(DFLASH_E_DTYPE, "unknown dtype \"%s\"", name);
}

/* ---- one file ------------------------------------------------------------ */

/* Metadata is reported ordered by key, whatever order the JSON had. */
static void sort_meta(char **keys, char **values, size_t n) {
  for (size_t i = 1; i < n; i++) {
    char *k = keys[i], *v = values[i];
    size_t j = i;
    for (; j > 0 && strcmp(keys[j - 1], k) > 0; j--) {
      keys[j] = keys[j - 1];
      values[j] = values[j - 1];
    }
    keys[j] = k;
    values[j] = v;
  }
}

static dflash_status parse_metadata(df_st_file *f, json_t *meta) {
  if (!json_is_object(meta))
    return df_error(DFLASH_E_FORMAT, "%s: \"__metadata__\" is not an object", f->path);
  size_t n = json_object_size(meta);
  f->meta_keys = calloc(n + 1, sizeof *f->meta_keys);
  f->meta_values = calloc(n + 1, sizeof *f->meta_values);
  if (!f->meta_keys || !f->meta_values) return df_error_nomem("safetensors metadata");
  const char *key;
  json_t *value;
  json_object_foreach(meta, key, value) {
    if (!json_is_string(value))
      return df_error(DFLASH_E_FORMAT, "%s: __metadata__ value of \"%s\" is not a string", f->path,
                      key);
    f->meta_keys[f->n_meta] = df_strdup(key);
    f->meta_values[f->n_meta] = df_strndup(json_string_value(value), json_string_length(value));
    if (!f->meta_keys[f->n_meta++] || !f->meta_values[f->n_meta - 1])
      return df_error_nomem("safetensors metadata");
  }
  sort_meta(f->meta_keys, f->meta_values, f->n_meta);
  return DFLASH_OK;
}

static dflash_status json_u64(json_t *v, uint64_t *out) {
  if (!json_is_integer(v) || json_integer_value(v) < 0) return DFLASH_E_FORMAT;
  *out = (uint64_t)json_integer_value(v);
  return DFLASH_OK;
}

/* Parse {"dtype", "shape", "data_offsets"} of tensor `name` into `e`. */
static dflash_status parse_entry(const df_st_file *f, const char *name, json_t *info,
                                 df_st_entry *e) {
  const char *path = f->path;
  if (!json_is_object(info))
    return df_error(DFLASH_E_FORMAT, "%s: tensor \"%s\": entry is not an object", path, name);
  json_t *dtype = json_object_get(info, "dtype");
  json_t *shape = json_object_get(info, "shape");
  json_t *offsets = json_object_get(info, "data_offsets");
  if (!json_is_string(dtype) || !json_is_array(shape) || !json_is_array(offsets))
    return df_error(DFLASH_E_FORMAT,
                    "%s: tensor \"%s\": needs string \"dtype\", array \"shape\" and array "
                    "\"data_offsets\"",
                    path, name);
  if (dflash_dtype_from_name(json_string_value(dtype), &e->dtype))
    return df_error(DFLASH_E_DTYPE, "%s: tensor \"%s\": unknown dtype \"%s\"", path, name,
                    json_string_value(dtype));
  e->ndim = (uint32_t)json_array_size(shape);
  e->shape = calloc(e->ndim + 1u, sizeof *e->shape);
  if (!e->shape) return df_error_nomem("tensor shape");
  uint64_t count = 1;
  for (uint32_t d = 0; d < e->ndim; d++) {
    uint64_t dim;
    if (json_u64(json_array_get(shape, d), &dim) || dim > INT64_MAX)
      return df_error(DFLASH_E_FORMAT, "%s: tensor \"%s\": shape[%u] is not a non-negative integer",
                      path, name, d);
    e->shape[d] = (int64_t)dim;
    if (!df_mul_u64(count, dim, &count))
      return df_error(DFLASH_E_OVERFLOW, "%s: tensor \"%s\": element count overflows", path, name);
  }
  uint64_t nbytes;
  if (!df_mul_u64(count, dflash_dtype_size(e->dtype), &nbytes))
    return df_error(DFLASH_E_OVERFLOW, "%s: tensor \"%s\": byte size overflows", path, name);
  if (json_array_size(offsets) != 2 || json_u64(json_array_get(offsets, 0), &e->begin) ||
      json_u64(json_array_get(offsets, 1), &e->end) || e->end < e->begin)
    return df_error(DFLASH_E_FORMAT,
                    "%s: tensor \"%s\": data_offsets must be [begin, end] with 0 <= begin <= end",
                    path, name);
  if (e->end - e->begin != nbytes)
    return df_error(DFLASH_E_FORMAT,
                    "%s: tensor \"%s\": data_offsets span %llu bytes but %s%s needs %llu", path,
                    name, (unsigned long long)(e->end - e->begin), dflash_dtype_name(e->dtype),
                    e->ndim ? " x shape" : "", (unsigned long long)nbytes);
  e->name = df_strdup(name);
  return e->name ? DFLASH_OK : df_error_nomem("tensor name");
}

static int cmp_by_offset(const void *a, const void *b) {
  const df_st_entry *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

/* Tensors must tile the data section exactly: in range, no overlap, no gap,
 * nothing after the last one (what Python's safetensors enforces too). */
static dflash_status check_layout(df_st_file *f) {
  uint64_t data_len = f->size - f->data_start, need = 0;
  size_t last = 0;
  for (size_t i = 0; i < f->n_entries; i++)
    if (f->entries[i].end > need) need = f->entries[i].end, last = i;
  /* The header is whole (it parsed), so data ending early is a cut copy or download. */
  if (need > data_len)
    return df_error(DFLASH_E_TRUNCATED,
                    "%s: truncated: %llu bytes, the header describes %llu (tensor \"%s\": "
                    "data_offsets [%llu, %llu] run past the %llu-byte data section)",
                    f->path, (unsigned long long)f->size,
                    (unsigned long long)(f->data_start + need), f->entries[last].name,
                    (unsigned long long)f->entries[last].begin,
                    (unsigned long long)f->entries[last].end, (unsigned long long)data_len);
  qsort(f->entries, f->n_entries, sizeof *f->entries, cmp_by_offset);
  uint64_t pos = 0;
  const char *prev = NULL;
  for (size_t i = 0; i < f->n_entries; i++) {
    const df_st_entry *e = &f->entries[i];
    if (e->begin < pos)
      return df_error(DFLASH_E_RANGE, "%s: tensor \"%s\" overlaps tensor \"%s\" (bytes %llu..%llu)",
                      f->path, e->name, prev, (unsigned long long)e->begin,
                      (unsigned long long)pos);
    if (e->begin > pos)
      return df_error(DFLASH_E_FORMAT, "%s: %llu unused bytes before tensor \"%s\"", f->path,
                      (unsigned long long)(e->begin - pos), e->name);
    pos = e->end;
    prev = e->name;
  }
  if (pos != data_len)
    return df_error(DFLASH_E_FORMAT, "%s: %llu bytes after the last tensor are not described",
                    f->path, (unsigned long long)(data_len - pos));
  return DFLASH_OK;
}

static dflash_status parse_header_json(df_st_file *f, json_t *root, size_t file_index) {
  if (!json_is_object(root))
    return df_error(DFLASH_E_FORMAT, "%s: header is not a JSON object", f->path);
  size_t n = json_object_size(root);
  f->entries = calloc(n + 1, sizeof *f->entries);
  if (!f->entries) return df_error_nomem("tensor table");
  const char *key;
  json_t *value;
  dflash_status st;
  json_object_foreach(root, key, value) {
    if (!strcmp(key, "__metadata__")) {
      if ((st = parse_metadata(f, value))) return st;
      continue;
    }
    df_st_entry *e = &f->entries[f->n_entries++];
    e->file = file_index;
    if ((st = parse_entry(f, key, value, e))) return st;
  }
  return check_layout(f);
}

/* What a file that is not safetensors looks like, for the message. */
static const char *sniff(const unsigned char *b, uint64_t size) {
  if (size >= 4 && !memcmp(b, "GGUF", 4)) return "a GGUF file";
  if (size >= 4 && !memcmp(b, "PK\3\4", 4)) return "a zip archive (a PyTorch .bin/.pt?)";
  if (size >= 2 && b[0] == 0x1f && b[1] == 0x8b) return "gzip data";
  if (b[0] == 0x80) return "a Python pickle (a PyTorch .bin?)";
  if (b[0] == '{' || b[0] == '[') return "JSON or JSONL text";
  return "something else";
}

dflash_status df_st_parse(df_st_file *f, size_t file_index) {
  if (f->size < 8)
    return df_error(DFLASH_E_TRUNCATED, "%s: %llu bytes, too short for the 8-byte header length",
                    f->path, (unsigned long long)f->size);
  /* A safetensors file is an 8-byte little-endian length, then a JSON object. */
  if (f->size > 8 && f->base[8] != '{')
    return df_error(DFLASH_E_FORMAT,
                    "%s: not a safetensors file (byte 8 is not the '{' that "
                    "opens its JSON header): it looks like %s",
                    f->path, sniff(f->base, f->size));
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = (n << 8) | f->base[i];
  if (n > f->size - 8)
    return df_error(DFLASH_E_TRUNCATED,
                    "%s: truncated: header length %llu exceeds the %llu bytes "
                    "that follow",
                    f->path, (unsigned long long)n, (unsigned long long)(f->size - 8));
  if (n > DF_ST_MAX_HEADER)
    return df_error(DFLASH_E_FORMAT, "%s: header length %llu is above the 100 MB limit", f->path,
                    (unsigned long long)n);
  const char *text = (const char *)f->base + 8;
  if (!df_utf8_valid(text, (size_t)n))
    return df_error(DFLASH_E_UTF8, "%s: header is not valid UTF-8", f->path);
  if (n == 0 || text[0] != '{')
    return df_error(DFLASH_E_FORMAT, "%s: header does not start with '{'", f->path);
  f->data_start = 8 + n;
  json_t *root;
  dflash_status st = df_json_parse(text, (size_t)n, f->path, &root);
  if (st) return df_error_wrap(st, "safetensors header");
  st = parse_header_json(f, root, file_index);
  json_decref(root);
  return st;
}

void df_st_file_clear(df_st_file *f) {
  for (size_t i = 0; i < f->n_entries; i++) {
    free(f->entries[i].name);
    free(f->entries[i].shape);
  }
  free(f->entries);
  for (size_t i = 0; i < f->n_meta; i++) {
    free(f->meta_keys[i]);
    free(f->meta_values[i]);
  }
  free(f->meta_keys);
  free(f->meta_values);
  f->entries = NULL;
  f->meta_keys = f->meta_values = NULL;
  f->n_entries = f->n_meta = 0;
}

static dflash_status map_file(df_st_file *f) {
  dflash_status st = df_map_file(f->path, &f->base, &f->size);
  if (!st && f->base) f->mapped = true;
  if (!st && !f->base) f->base = (const uint8_t *)""; /* empty file: parsed as too short */
  return st;
}

/* ---- sets of files ------------------------------------------------------- */

struct dflash_safetensors {
  df_st_file *files;
  size_t n_files;
  df_st_entry **sorted; /* every tensor of every file, by name */
  size_t n;
  /* metadata of the whole set: a file's __metadata__ or the index's "metadata" */
  char **meta_keys, **meta_values;
  size_t n_meta;
  bool own_meta; /* meta arrays allocated here (index) rather than borrowed */
};

DFLASH_API void dflash_safetensors_free(dflash_safetensors *st) {
  if (!st) return;
  for (size_t i = 0; i < st->n_files; i++) {
    df_st_file *f = &st->files[i];
    if (f->mapped) df_unmap_file(f->base, f->size);
    df_st_file_clear(f);
    free(f->path);
  }
  if (st->own_meta) {
    for (size_t i = 0; i < st->n_meta; i++) {
      free(st->meta_keys[i]);
      free(st->meta_values[i]);
    }
    free(st->meta_keys);
    free(st->meta_values);
  }
  free(st->files);
  free(st->sorted);
  free(st);
}

static dflash_status add_file(dflash_safetensors *st, const char *path) {
  df_st_file *f = &st->files[st->n_files];
  memset(f, 0, sizeof *f);
  f->path = df_strdup(path);
  if (!f->path) return df_error_nomem("path");
  st->n_files++;
  dflash_status s = map_file(f);
  return s ? s : df_st_parse(f, st->n_files - 1);
}

static int cmp_entry_name(const void *a, const void *b) {
  return strcmp((*(df_st_entry *const *)a)->name, (*(df_st_entry *const *)b)->name);
}

/* Build the name-sorted table of all tensors; a name in two files is an error. */
static dflash_status index_tensors(dflash_safetensors *st) {
  size_t total = 0;
  for (size_t i = 0; i < st->n_files; i++) total += st->files[i].n_entries;
  st->sorted = calloc(total + 1, sizeof *st->sorted);
  if (!st->sorted) return df_error_nomem("tensor index");
  for (size_t i = 0; i < st->n_files; i++)
    for (size_t j = 0; j < st->files[i].n_entries; j++)
      st->sorted[st->n++] = &st->files[i].entries[j];
  qsort(st->sorted, st->n, sizeof *st->sorted, cmp_entry_name);
  for (size_t i = 1; i < st->n; i++)
    if (!strcmp(st->sorted[i]->name, st->sorted[i - 1]->name))
      return df_error(DFLASH_E_DUPLICATE, "tensor \"%s\" appears in both %s and %s",
                      st->sorted[i]->name, st->files[st->sorted[i - 1]->file].path,
                      st->files[st->sorted[i]->file].path);
  if (!st->own_meta && st->n_files > 0) {
    st->meta_keys = st->files[0].meta_keys;
    st->meta_values = st->files[0].meta_values;
    st->n_meta = st->files[0].n_meta;
  }
  return DFLASH_OK;
}

static const df_st_entry *find_entry(const dflash_safetensors *st, const char *name) {
  size_t lo = 0, hi = st->n;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(st->sorted[mid]->name, name);
    if (c == 0) return st->sorted[mid];
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return NULL;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static dflash_status alloc_files(dflash_safetensors *st, size_t n) {
  st->files = calloc(n + 1, sizeof *st->files);
  return st->files ? DFLASH_OK : df_error_nomem("file table");
}

/* The index's "metadata" values as strings (total_size is a number there). */
static dflash_status index_metadata(dflash_safetensors *st, json_t *meta, const char *path) {
  st->own_meta = true;
  if (!meta) return DFLASH_OK;
  if (!json_is_object(meta))
    return df_error(DFLASH_E_FORMAT, "%s: \"metadata\" is not an object", path);
  size_t n = json_object_size(meta);
  st->meta_keys = calloc(n + 1, sizeof(char *));
  st->meta_values = calloc(n + 1, sizeof(char *));
  if (!st->meta_keys || !st->meta_values) return df_error_nomem("index metadata");
  const char *key;
  json_t *value;
  json_object_foreach(meta, key, value) {
    char *text = json_is_string(value) ? df_strdup(json_string_value(value))
                                       : json_dumps(value, JSON_COMPACT | JSON_ENCODE_ANY);
    st->meta_keys[st->n_meta] = df_strdup(key);
    st->meta_values[st->n_meta++] = text;
    if (!text || !st->meta_keys[st->n_meta - 1]) return df_error_nomem("index metadata");
  }
  sort_meta(st->meta_keys, st->meta_values, st->n_meta);
  return DFLASH_OK;
}

/* Every weight_map entry must name a tensor that its shard really holds. */
static dflash_status check_weight_map(dflash_safetensors *st, json_t *map, const char *path) {
  const char *name;
  json_t *file;
  json_object_foreach(map, name, file) {
    const df_st_entry *e = find_entry(st, name);
    if (!e)
      return df_error(DFLASH_E_NOT_FOUND, "%s: tensor \"%s\" is not in shard %s", path, name,
                      json_string_value(file));
    const char *holder = st->files[e->file].path;
    const char *want = json_string_value(file);
    if (!df_str_ends_with(holder, want) ||
        (strlen(holder) > strlen(want) && holder[strlen(holder) - strlen(want) - 1] != '/'))
      return df_error(DFLASH_E_MISMATCH, "%s: tensor \"%s\" is mapped to %s but found in %s", path,
                      name, want, holder);
  }
  return DFLASH_OK;
}

/* Unique shard file names of a weight_map, sorted. */
static dflash_status shard_names(json_t *map, const char *path, char ***out, size_t *n_out) {
  size_t n = json_object_size(map), k = 0;
  char **names = calloc(n + 1, sizeof *names);
  if (!names) return df_error_nomem("shard list");
  const char *tensor;
  json_t *file;
  json_object_foreach(map, tensor, file) {
    if (!json_is_string(file) || !json_string_length(file)) {
      free(names);
      return df_error(DFLASH_E_FORMAT, "%s: weight_map entry \"%s\" is not a file name", path,
                      tensor);
    }
    names[k++] = (char *)json_string_value(file);
  }
  qsort(names, k, sizeof *names, cmp_str);
  size_t u = 0;
  for (size_t i = 0; i < k; i++)
    if (u == 0 || strcmp(names[u - 1], names[i])) names[u++] = names[i];
  *out = names;
  *n_out = u;
  return DFLASH_OK;
}

static dflash_status open_index(dflash_safetensors *st, const char *path) {
  json_t *root;
  dflash_status s = df_json_load_file(path, &root);
  if (s) return s;
  json_t *map = json_object_get(root, "weight_map");
  char **names = NULL;
  size_t n = 0;
  char *dir = df_path_dirname(path);
  if (!dir) s = df_error_nomem("path");
  else if (!json_is_object(root) || !json_is_object(map))
    s = df_error(DFLASH_E_FORMAT, "%s: not a safetensors index (no \"weight_map\" object)", path);
  else if (!(s = shard_names(map, path, &names, &n)) && !(s = alloc_files(st, n)) &&
           !(s = index_metadata(st, json_object_get(root, "metadata"), path))) {
    for (size_t i = 0; i < n && !s; i++) {
      char *shard = df_path_join(dir, names[i]);
      s = shard ? add_file(st, shard) : df_error_nomem("path");
      if (s == DFLASH_E_NOT_FOUND)
        s = df_error_wrap(s, "shard %s named by index %s", names[i], path);
      free(shard);
    }
    if (!s) s = index_tensors(st);
    if (!s) s = check_weight_map(st, map, path);
  }
  free(names);
  free(dir);
  json_decref(root);
  return s;
}

/* A directory: its index if it has exactly one, else all its .safetensors files. */
static dflash_status open_dir(dflash_safetensors *st, const char *path) {
  DIR *d = opendir(path);
  if (!d) return df_error_errno(DFLASH_E_IO, errno, "%s: cannot open directory", path);
  char **files = NULL, *index = NULL;
  size_t n = 0, cap = 0;
  dflash_status s = DFLASH_OK;
  struct dirent *de;
  while (!s && (de = readdir(d))) {
    if (df_str_ends_with(de->d_name, ".safetensors.index.json")) {
      if (index)
        s = df_error(DFLASH_E_DUPLICATE, "%s: more than one *.safetensors.index.json", path);
      else if (!(index = df_path_join(path, de->d_name))) s = df_error_nomem("path");
    } else if (df_str_ends_with(de->d_name, ".safetensors")) {
      if (n == cap) {
        cap = cap ? 2 * cap : 16;
        char **grown = realloc(files, cap * sizeof *files);
        if (!grown) {
          s = df_error_nomem("file list");
          break;
        }
        files = grown;
      }
      if (!(files[n++] = df_path_join(path, de->d_name))) s = df_error_nomem("path");
    }
  }
  closedir(d);
  if (!s && index) s = open_index(st, index);
  else if (!s && n == 0)
    s = df_error(DFLASH_E_NOT_FOUND, "%s: no .safetensors files in directory", path);
  else if (!s) {
    qsort(files, n, sizeof *files, cmp_str);
    if (!(s = alloc_files(st, n)))
      for (size_t i = 0; i < n && !s; i++) s = add_file(st, files[i]);
    if (!s) s = index_tensors(st);
  }
  for (size_t i = 0; i < n; i++) free(files[i]);
  free(files);
  free(index);
  return s;
}

DFLASH_API dflash_status dflash_safetensors_open(const char *path, dflash_safetensors **out) {
  DF_CHECK_ARG(path && out);
  *out = NULL;
  dflash_safetensors *st = calloc(1, sizeof *st);
  if (!st) return df_error_nomem("safetensors handle");
  struct stat sb;
  dflash_status s;
  if (stat(path, &sb) != 0)
    s = df_error_errno(errno == ENOENT ? DFLASH_E_NOT_FOUND : DFLASH_E_IO, errno, "%s", path);
  else if (S_ISDIR(sb.st_mode)) s = open_dir(st, path);
  else if (df_str_ends_with(path, ".json")) s = open_index(st, path);
  else if (!(s = alloc_files(st, 1)) && !(s = add_file(st, path))) s = index_tensors(st);
  if (s) {
    dflash_safetensors_free(st);
    return s;
  }
  *out = st;
  return DFLASH_OK;
}

/* ---- accessors ----------------------------------------------------------- */

static dflash_status fill_view(const dflash_safetensors *st, const df_st_entry *e,
                               dflash_tensor *out) {
  const df_st_file *f = &st->files[e->file];
  dflash_tensor t = {.struct_size = sizeof t,
                     .name = e->name,
                     .dtype = e->dtype,
                     .ndim = e->ndim,
                     .shape = e->shape,
                     .data = f->base + f->data_start + e->begin,
                     .nbytes = e->end - e->begin,
                     .file = f->path};
  return df_opts_out(out, &t, sizeof t, "dflash_tensor");
}

DFLASH_API size_t dflash_safetensors_count(const dflash_safetensors *st) { return st ? st->n : 0; }

DFLASH_API size_t dflash_safetensors_file_count(const dflash_safetensors *st) {
  return st ? st->n_files : 0;
}

DFLASH_API dflash_status dflash_safetensors_get(const dflash_safetensors *st, size_t index,
                                                dflash_tensor *out) {
  DF_CHECK_ARG(st && out);
  if (index >= st->n)
    return df_error(DFLASH_E_RANGE, "tensor index %zu out of range (%zu tensors)", index, st->n);
  return fill_view(st, st->sorted[index], out);
}

DFLASH_API dflash_status dflash_safetensors_find(const dflash_safetensors *st, const char *name,
                                                 dflash_tensor *out) {
  DF_CHECK_ARG(st && name && out);
  const df_st_entry *e = find_entry(st, name);
  if (!e)
    return df_error(DFLASH_E_NOT_FOUND, "no tensor \"%s\" in %s%s", name, st->files[0].path,
                    st->n_files > 1 ? " and its other shards" : "");
  return fill_view(st, e, out);
}

DFLASH_API size_t dflash_safetensors_metadata_count(const dflash_safetensors *st) {
  return st ? st->n_meta : 0;
}

DFLASH_API dflash_status dflash_safetensors_metadata_get(const dflash_safetensors *st, size_t index,
                                                         const char **key, const char **value) {
  DF_CHECK_ARG(st && key && value);
  if (index >= st->n_meta)
    return df_error(DFLASH_E_RANGE, "metadata index %zu out of range (%zu entries)", index,
                    st->n_meta);
  *key = st->meta_keys[index];
  *value = st->meta_values[index];
  return DFLASH_OK;
}

DFLASH_API dflash_status dflash_safetensors_metadata_find(const dflash_safetensors *st,
                                                          const char *key, const char **value) {
  DF_CHECK_ARG(st && key && value);
  for (size_t i = 0; i < st->n_meta; i++) {
    if (!strcmp(st->meta_keys[i], key)) {
      *value = st->meta_values[i];
      return DFLASH_OK;
    }
  }
  return df_error(DFLASH_E_NOT_FOUND, "no metadata key \"%s\" in %s", key,
                  st->n_files ? st->files[0].path : "safetensors set");
}
