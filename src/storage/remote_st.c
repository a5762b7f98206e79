/* safetensors read on demand through the storage API: the header with one
 * ranged read (validated by the same df_st_parse as local files), tensors
 * with ranged reads through a read-ahead window. Chosen over download-to-cache
 * because GPU nodes have little disk next to their weights, and the trainer
 * only needs a few tensors (embedding, LM head) of a target checkpoint. */
#include <stdlib.h>
#include <string.h>

#include "core/safetensors_internal.h"
#include "storage_internal.h"

#define DF_ST_DEFAULT_READAHEAD (16u << 20)
#define DF_ST_HEADER_LIMIT (100u * 1000u * 1000u) /* as the local reader */

struct dflash_storage_safetensors {
  dflash_storage *st;
  char *location;
  uint64_t size;
  df_st_file file;
  df_st_entry **by_name;
  uint64_t readahead;
  uint8_t *win; /* bytes [win_off, win_off + win_len) of the object */
  uint64_t win_off;
  size_t win_len;
};

DFLASH_API void dflash_storage_safetensors_free(dflash_storage_safetensors *f) {
  if (!f) return;
  df_st_file_clear(&f->file);
  free(f->by_name);
  free(f->win);
  free(f->location);
  free(f);
}

/* Fill the window with up to `readahead` bytes at `offset`. */
static dflash_status fill_window(dflash_storage_safetensors *f, uint64_t offset) {
  uint64_t want = f->size - offset < f->readahead ? f->size - offset : f->readahead;
  size_t got = 0;
  dflash_status s = dflash_storage_read_range(f->st, f->location, offset, f->win, (size_t)want,
                                              &got);
  f->win_off = offset;
  f->win_len = s ? 0 : got;
  if (!s && got != want)
    s = df_error(DFLASH_E_TRUNCATED, "%s: object shorter than its %llu bytes (changed while read?)",
                 f->location, (unsigned long long)f->size);
  return s;
}

static int cmp_name(const void *a, const void *b) {
  return strcmp((*(df_st_entry *const *)a)->name, (*(df_st_entry *const *)b)->name);
}

/* Parse the header: from the window when it holds it all, else from a
 * second read of exactly the header. */
static dflash_status parse_header(dflash_storage_safetensors *f) {
  df_st_file *h = &f->file;
  h->path = f->location;
  h->size = f->size;
  h->base = f->win;
  uint64_t n = 0;
  for (int i = 7; i >= 0 && f->win_len >= 8; i--) n = (n << 8) | f->win[i];
  uint8_t *header = NULL;
  /* Lengths df_st_parse rejects before looking past byte 8 need no read. */
  bool plausible = f->size >= 8 && n <= f->size - 8 && n <= DF_ST_HEADER_LIMIT;
  if (plausible && 8 + n > f->win_len) {
    header = malloc((size_t)(8 + n));
    if (!header) return df_error_nomem("safetensors header");
    size_t got = 0;
    dflash_status s = dflash_storage_read_range(f->st, f->location, 0, header, (size_t)(8 + n),
                                                &got);
    if (!s && got != 8 + n) s = df_error(DFLASH_E_TRUNCATED, "%s: header cut short", f->location);
    if (s) {
      free(header);
      return s;
    }
    h->base = header;
  }
  dflash_status s = df_st_parse(h, 0);
  h->base = NULL;
  h->path = NULL; /* borrowed from f->location */
  free(header);
  return s;
}

DFLASH_API dflash_status dflash_storage_safetensors_open(dflash_storage *st, const char *location,
                                                         uint64_t readahead,
                                                         dflash_storage_safetensors **out) {
  DF_CHECK_ARG(st && location && out);
  *out = NULL;
  dflash_storage_safetensors *f = calloc(1, sizeof *f);
  if (!f) return df_error_nomem("remote safetensors");
  f->st = st;
  f->readahead = readahead ? readahead : DF_ST_DEFAULT_READAHEAD;
  if (f->readahead < 4096) f->readahead = 4096; /* the 8-byte length must fit */
  f->location = df_strdup(location);
  dflash_storage_info info = {.struct_size = sizeof info};
  dflash_status s = f->location ? dflash_storage_stat(st, location, &info)
                                : df_error_nomem("location");
  f->size = info.size;
  if (!s && !(f->win = malloc((size_t)f->readahead))) s = df_error_nomem("read-ahead window");
  if (!s) s = fill_window(f, 0);
  if (!s) s = parse_header(f);
  if (!s && !(f->by_name = calloc(f->file.n_entries + 1, sizeof *f->by_name)))
    s = df_error_nomem("tensor index");
  if (s) {
    dflash_storage_safetensors_free(f);
    return s;
  }
  for (size_t i = 0; i < f->file.n_entries; i++) f->by_name[i] = &f->file.entries[i];
  qsort(f->by_name, f->file.n_entries, sizeof *f->by_name, cmp_name);
  *out = f;
  return DFLASH_OK;
}

DFLASH_API size_t dflash_storage_safetensors_count(const dflash_storage_safetensors *f) {
  return f ? f->file.n_entries : 0;
}

static dflash_status view(const dflash_storage_safetensors *f, const df_st_entry *e,
                          dflash_tensor *out) {
  dflash_tensor t = {.struct_size = sizeof t,
                     .name = e->name,
                     .dtype = e->dtype,
                     .ndim = e->ndim,
                     .shape = e->shape,
                     .data = NULL,
                     .nbytes = e->end - e->begin,
                     .file = f->location};
  return df_opts_out(out, &t, sizeof t, "dflash_tensor");
}

DFLASH_API dflash_status dflash_storage_safetensors_get(const dflash_storage_safetensors *f,
                                                        size_t index, dflash_tensor *out) {
  DF_CHECK_ARG(f && out);
  if (index >= f->file.n_entries)
    return df_error(DFLASH_E_RANGE, "%s: tensor index %zu of %zu", f->location, index,
                    f->file.n_entries);
  return view(f, f->by_name[index], out);
}

static const df_st_entry *find(const dflash_storage_safetensors *f, const char *name) {
  size_t lo = 0, hi = f->file.n_entries;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(f->by_name[mid]->name, name);
    if (!c) return f->by_name[mid];
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return NULL;
}

DFLASH_API dflash_status dflash_storage_safetensors_find(const dflash_storage_safetensors *f,
                                                         const char *name, dflash_tensor *out) {
  DF_CHECK_ARG(f && name && out);
  const df_st_entry *e = find(f, name);
  if (!e) return df_error(DFLASH_E_NOT_FOUND, "%s: no tensor \"%s\"", f->location, name);
  return view(f, e, out);
}

DFLASH_API dflash_status dflash_storage_safetensors_metadata_find(
    const dflash_storage_safetensors *f, const char *key, const char **value) {
  DF_CHECK_ARG(f && key && value);
  for (size_t i = 0; i < f->file.n_meta; i++)
    if (!strcmp(f->file.meta_keys[i], key)) {
      *value = f->file.meta_values[i];
      return DFLASH_OK;
    }
  return df_error(DFLASH_E_NOT_FOUND, "%s: no metadata key \"%s\"", f->location, key);
}

DFLASH_API dflash_status dflash_storage_safetensors_read(dflash_storage_safetensors *f,
                                                         const char *name, void *buf,
                                                         size_t buf_len, uint64_t *needed) {
  DF_CHECK_ARG(f && name && (buf || !buf_len));
  const df_st_entry *e = find(f, name);
  if (!e) return df_error(DFLASH_E_NOT_FOUND, "%s: no tensor \"%s\"", f->location, name);
  uint64_t nbytes = e->end - e->begin, at = f->file.data_start + e->begin;
  if (needed) *needed = nbytes;
  if (buf_len < nbytes)
    return df_error(DFLASH_E_BUFFER, "%s: tensor \"%s\" has %llu bytes, buffer %zu", f->location,
                    name, (unsigned long long)nbytes, buf_len);
  bool in_window = at >= f->win_off && at + nbytes <= f->win_off + f->win_len;
  if (!in_window && nbytes >= f->readahead) { /* big tensors straight into the caller's buffer */
    size_t got = 0;
    dflash_status s = dflash_storage_read_range(f->st, f->location, at, buf, (size_t)nbytes, &got);
    if (!s && got != nbytes)
      s = df_error(DFLASH_E_TRUNCATED, "%s: tensor \"%s\" cut short", f->location, name);
    return s;
  }
  if (!in_window) {
    dflash_status s = fill_window(f, at);
    if (s) return s;
  }
  if (nbytes) memcpy(buf, f->win + (at - f->win_off), (size_t)nbytes);
  return DFLASH_OK;
}
