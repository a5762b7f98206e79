/* Staging between s3:// prefixes and local directories (see stage.h). */
#include "stage.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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
