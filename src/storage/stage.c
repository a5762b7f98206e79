/* Staging between s3:// prefixes and local directories (see stage.h). */
#include "stage.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/safetensors_internal.h"
#include "storage_internal.h"

char *df_cache_dir(void) {
  const char *c = getenv("DFLASH_CACHE_DIR");
  if (c && *c) return df_strdup(c);
  const char *t = getenv("TMPDIR");
  return df_asprintf("%s/dflash-cache-%u", t && *t ? t : "/tmp", (unsigned)getuid());
}

char *df_stage_join(const char *dir, const char *name) {
  size_t n = strlen(dir);
  while (n && dir[n - 1] == '/') n--;
  return df_asprintf("%.*s/%s", (int)n, dir, name);
}

dflash_status df_stage_cache_path(const char *remote, char **out) {
  *out = NULL;
  df_loc l;
  dflash_status s = df_loc_parse(remote, &l);
  if (s) return s;
  if (!l.s3) {
    df_loc_clear(&l);
    return df_error(DFLASH_E_INVALID_ARG, "%s: not an s3:// location", remote);
  }
  char *cache = df_cache_dir();
  size_t k = strlen(l.key);
  while (k && l.key[k - 1] == '/') k--;
  *out = cache ? df_asprintf("%s/s3/%s/%.*s", cache, l.bucket, (int)k, l.key) : NULL;
  free(cache);
  df_loc_clear(&l);
  return *out ? DFLASH_OK : df_error_nomem("cache path");
}

/* A relative object name that stays inside the directory it is mirrored to. */
static bool safe_relative(const char *rel) {
  if (!*rel || rel[0] == '/') return false;
  for (const char *p = rel; p && *p; p = strchr(p, '/') ? strchr(p, '/') + 1 : NULL) {
    size_t n = strcspn(p, "/");
    if (n == 0 || (n == 1 && p[0] == '.') || (n == 2 && p[0] == '.' && p[1] == '.')) return false;
  }
  return true;
}

static bool same_size(const char *path, uint64_t size) {
  struct stat sb;
  return stat(path, &sb) == 0 && S_ISREG(sb.st_mode) && (uint64_t)sb.st_size == size;
}

dflash_status df_stage_in(dflash_storage *st, const char *remote, const char *local_dir,
                          size_t *n_files) {
  size_t n = strlen(remote);
  char *prefix = n && remote[n - 1] == '/' ? df_strdup(remote) : df_asprintf("%s/", remote);
  if (!prefix) return df_error_nomem("prefix");
  dflash_storage_listing *l = NULL;
  dflash_status s = dflash_storage_list(st, prefix, &l);
  size_t plen = strlen(prefix);
  if (!s && l->n == 0) s = df_error(DFLASH_E_NOT_FOUND, "%s: no objects under this prefix", prefix);
  for (size_t i = 0; !s && i < l->n; i++) {
    const char *rel = l->items[i].name + plen;
    if (!safe_relative(rel)) {
      s = df_error(DFLASH_E_FORMAT, "%s: object name leaves its directory", l->items[i].name);
      break;
    }
    char *dst = df_stage_join(local_dir, rel);
    if (!dst) s = df_error_nomem("path");
    else if (!same_size(dst, l->items[i].size)) s = dflash_storage_copy(st, l->items[i].name, dst);
    free(dst);
  }
  if (!s && n_files) *n_files = l->n;
  dflash_storage_listing_free(l);
  free(prefix);
  return s;
}

dflash_status df_stage_in_cached(dflash_storage *st, const char *remote, char **local) {
  dflash_status s = df_stage_cache_path(remote, local);
  if (!s) s = df_stage_in(st, remote, *local, NULL);
  if (s) {
    free(*local);
    *local = NULL;
  }
  return s;
}

dflash_status df_stage_out(dflash_storage *st, const char *local_dir, const char *remote,
                           const char *name) {
  char *src = df_stage_join(local_dir, name), *dst = df_stage_join(remote, name);
  dflash_status s = src && dst ? dflash_storage_copy(st, src, dst) : df_error_nomem("path");
  free(src);
  free(dst);
  return s;
}

dflash_status df_stage_tmpdir(const char *tag, char **out) {
  *out = NULL;
  char *cache = df_cache_dir();
  char *tmpl = cache ? df_asprintf("%s/staging/%s-XXXXXX", cache, tag) : NULL;
  free(cache);
  if (!tmpl) return df_error_nomem("staging directory");
  dflash_status s = df_local_mkdirs_for(tmpl);
  if (!s && !mkdtemp(tmpl))
    s = df_error_errno(DFLASH_E_IO, errno, "%s: cannot create staging directory", tmpl);
  if (s) {
    free(tmpl);
    return s;
  }
  *out = tmpl;
  return DFLASH_OK;
}

static int rm_one(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  remove(path);
  return 0;
}

void df_stage_rmtree(const char *dir) {
  if (dir && *dir) nftw(dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

/* The 8-byte little-endian header length of a safetensors file. */
static uint64_t header_len(const uint8_t b[8]) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = (n << 8) | b[i];
  return n;
}

dflash_status df_stage_st_stub(dflash_storage *st, const char *remote, uint64_t size,
                               const char *local) {
  uint8_t len8[8];
  size_t got = 0;
  dflash_status s = dflash_storage_read_range(st, remote, 0, len8, 8, &got);
  uint64_t n = got == 8 ? header_len(len8) : 0;
  if (!s && (got != 8 || n > size - 8 || n > (100u << 20)))
    return df_error(DFLASH_E_FORMAT, "%s: not a safetensors object", remote);
  uint8_t *head = s ? NULL : malloc((size_t)(8 + n));
  if (!s && !head) s = df_error_nomem("safetensors header");
  if (!s) s = dflash_storage_read_range(st, remote, 0, head, (size_t)(8 + n), &got);
  if (!s && got != 8 + n) s = df_error(DFLASH_E_TRUNCATED, "%s: header cut short", remote);
  df_atomic_file f = {.fd = -1};
  if (!s) s = df_local_mkdirs_for(local);
  if (!s) s = df_atomic_open(local, &f);
  if (!s) s = df_atomic_write(&f, head, (size_t)(8 + n));
  if (!s && ftruncate(f.fd, (off_t)size) != 0)
    s = df_error_errno(DFLASH_E_IO, errno, "%s: cannot extend", local);
  if (!s) s = df_atomic_commit(&f);
  df_atomic_abort(&f);
  free(head);
  return s;
}

void df_stage_st_hollow(const char *path) {
  int fd = open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return;
  uint8_t len8[8];
  struct stat sb;
  if (pread(fd, len8, 8, 0) == 8 && fstat(fd, &sb) == 0) {
    off_t data = (off_t)(8 + header_len(len8));
    if (data < sb.st_size &&
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, data, sb.st_size - data) != 0)
      df_log(DFLASH_LOG_DEBUG, "%s: cannot punch a hole; the local copy stays whole", path);
  }
  close(fd);
}

dflash_status df_stage_mkdirs(const char *dir) {
  char *marker = df_path_join(dir, "x");
  dflash_status s = marker ? df_local_mkdirs_for(marker) : df_error_nomem("path");
  free(marker);
  return s;
}

void df_stage_buf_free(df_stage_buf *b) {
  free(b->data);
  *b = (df_stage_buf){0};
}

/* Room for size + extra bytes in b (a size past memory is DFLASH_E_OVERFLOW naming it); for
 * objects up to 1/8 larger, in whole 2 MiB pages, so that shards of about the same size never
 * grow it again. */
static dflash_status reserve(df_stage_buf *b, uint64_t size, size_t extra, const char *location) {
  if (size >= SIZE_MAX / 2)
    return df_error(DFLASH_E_OVERFLOW, "%s: %" PRIu64 " bytes do not fit in memory", location,
                    size);
  size_t want = (size_t)size + extra;
  if (want <= b->cap) return DFLASH_OK;
  size_t cap = want + want / 8, page = (size_t)2 << 20;
  cap = (cap + page - 1) / page * page;
  uint8_t *p = df_alloc_large(cap);
  if (!p)
    return df_error(DFLASH_E_NOMEM, "%s: no memory for a %zu-byte read buffer", location, cap);
  free(b->data);
  b->data = p, b->cap = cap;
  return DFLASH_OK;
}

dflash_status df_stage_read_header(dflash_storage *st, const char *location, uint64_t size,
                                   df_stage_buf *b) {
  b->len = 0;
  if (size < 8)
    return df_error(DFLASH_E_TRUNCATED, "%s: %" PRIu64 " bytes, too short for a safetensors header",
                    location, size);
  dflash_status s = reserve(b, size, 0, location);
  /* Its length, then exactly the header: two small GETs (a guess at the length would read
   * tensor bytes that the caller may not want). */
  size_t got = 0;
  if (!s) s = dflash_storage_read_range(st, location, 0, b->data, 8, &got);
  if (!s && got < 8)
    s = df_error(DFLASH_E_TRUNCATED, "%s: %zu bytes came of its header", location, got);
  if (s) return s;
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = n << 8 | b->data[i];
  if (n > size - 8)
    return df_error(DFLASH_E_FORMAT, "%s: header of %" PRIu64 " bytes in a %" PRIu64 "-byte object",
                    location, n, size);
  size_t have = got, need = (size_t)(8 + n);
  while (!s && have < need) {
    s = dflash_storage_read_range(st, location, have, b->data + have, need - have, &got);
    if (!s && !got) s = df_error(DFLASH_E_TRUNCATED, "%s: its header ended early", location);
    have += got;
  }
  if (!s) b->len = (size_t)size;
  return s;
}

dflash_status df_stage_read_object(dflash_storage *st, const char *location, uint64_t size,
                                   df_stage_buf *b) {
  b->len = 0;
  /* One byte more than announced is asked for, so that an object that grew is seen. */
  size_t want = (size_t)size + 1;
  dflash_status s = reserve(b, size, 1, location);
  if (s) return s;
  size_t got = 0;
  s = dflash_storage_read_range(st, location, 0, b->data, want, &got);
  if (s) return s;
  if (got < size)
    return df_error(DFLASH_E_TRUNCATED, "%s: %zu of its %" PRIu64 " bytes came", location, got,
                    size);
  if (got > size)
    return df_error(DFLASH_E_MISMATCH, "%s: more than the %" PRIu64 " bytes it had when listed",
                    location, size);
  b->len = got;
  return DFLASH_OK;
}

struct df_stage_st {
  char *location;
  df_st_file file;
  const uint8_t *map; /* a local object's mapping, or NULL */
  uint64_t map_size;
  df_st_entry **by_name;
};

void df_stage_st_free(df_stage_st *f) {
  if (!f) return;
  df_st_file_clear(&f->file);
  if (f->map) df_unmap_file(f->map, f->map_size);
  free(f->by_name);
  free(f->location);
  free(f);
}

static int cmp_entry_name(const void *a, const void *b) {
  return strcmp((*(df_st_entry *const *)a)->name, (*(df_st_entry *const *)b)->name);
}

static dflash_status st_open(dflash_storage *st, const char *location, uint64_t size,
                             df_stage_buf *b, bool read, df_stage_st **out) {
  *out = NULL;
  df_stage_st *f = calloc(1, sizeof *f);
  if (!f || !(f->location = df_strdup(location))) {
    free(f);
    return df_error_nomem("safetensors object");
  }
  dflash_status s = DFLASH_OK;
  if (b) {
    if (read) s = df_stage_read_object(st, location, size, b);
    f->file.base = b->data ? b->data : (const uint8_t *)"", f->file.size = b->len;
  } else {
    df_loc l;
    s = df_loc_parse_object(location, &l);
    if (!s) {
      s = df_map_file(l.path, &f->map, &f->map_size);
      df_loc_clear(&l);
    }
    f->file.base = f->map ? f->map : (const uint8_t *)"", f->file.size = f->map_size;
  }
  f->file.path = f->location;
  if (!s) s = df_st_parse(&f->file, 0);
  if (!s && !(f->by_name = calloc(f->file.n_entries + 1, sizeof *f->by_name)))
    s = df_error_nomem("tensor index");
  if (s) {
    f->file.path = NULL;
    df_stage_st_free(f);
    return s;
  }
  for (size_t i = 0; i < f->file.n_entries; i++) f->by_name[i] = &f->file.entries[i];
  qsort(f->by_name, f->file.n_entries, sizeof *f->by_name, cmp_entry_name);
  *out = f;
  return DFLASH_OK;
}

dflash_status df_stage_st_load(dflash_storage *st, const char *location, uint64_t size,
                               df_stage_buf *b, df_stage_st **out) {
  return st_open(st, location, size, dflash_storage_is_remote(location) ? b : NULL, true, out);
}

dflash_status df_stage_st_parse(const char *location, const df_stage_buf *b, df_stage_st **out) {
  return st_open(NULL, location, b->len, (df_stage_buf *)b, false, out);
}

size_t df_stage_st_count(const df_stage_st *f) { return f ? f->file.n_entries : 0; }

static dflash_status st_view(const df_stage_st *f, const df_st_entry *e, dflash_tensor *out) {
  dflash_tensor t = {.struct_size = sizeof t,
                     .name = e->name,
                     .dtype = e->dtype,
                     .ndim = e->ndim,
                     .shape = e->shape,
                     .data = f->file.base + f->file.data_start + e->begin,
                     .nbytes = e->end - e->begin,
                     .file = f->location};
  return df_opts_out(out, &t, sizeof t, "dflash_tensor");
}

dflash_status df_stage_st_get(const df_stage_st *f, size_t index, dflash_tensor *out) {
  if (index >= f->file.n_entries)
    return df_error(DFLASH_E_RANGE, "%s: tensor index %zu of %zu", f->location, index,
                    f->file.n_entries);
  return st_view(f, &f->file.entries[index], out);
}

dflash_status df_stage_st_find(const df_stage_st *f, const char *name, dflash_tensor *out) {
  size_t lo = 0, hi = f->file.n_entries;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(f->by_name[mid]->name, name);
    if (!c) return st_view(f, f->by_name[mid], out);
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return DFLASH_E_NOT_FOUND;
}

dflash_status df_stage_st_metadata_find(const df_stage_st *f, const char *key, const char **value) {
  for (size_t i = 0; i < f->file.n_meta; i++)
    if (!strcmp(f->file.meta_keys[i], key)) {
      *value = f->file.meta_values[i];
      return DFLASH_OK;
    }
  return DFLASH_E_NOT_FOUND;
}
