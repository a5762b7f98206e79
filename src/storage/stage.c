/* Staging between s3:// prefixes and local directories (see stage.h). */
#include "stage.h"

#include <errno.h>
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
