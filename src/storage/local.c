/* The local-file side of the storage API: the same operations as S3, on a
 * file system, with durable atomic writes (core/fileio.c). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "storage_internal.h"

dflash_status df_local_read_range(const df_loc *l, uint64_t offset, void *buf, size_t len,
                                  size_t *got) {
  *got = 0;
  int fd = open(l->path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return df_error_errno(errno == ENOENT ? DFLASH_E_NOT_FOUND : DFLASH_E_IO, errno,
                          "%s: cannot open", l->text);
  dflash_status s = DFLASH_OK;
  while (*got < len) {
    ssize_t k = pread(fd, (char *)buf + *got, len - *got, (off_t)(offset + *got));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) s = df_error_errno(DFLASH_E_IO, errno, "%s: read failed", l->text);
    if (k <= 0) break;
    *got += (size_t)k;
  }
  close(fd);
  return s;
}

dflash_status df_local_stat(const df_loc *l, dflash_storage_info *out) {
  struct stat sb;
  if (stat(l->path, &sb) != 0)
    return df_error_errno(errno == ENOENT ? DFLASH_E_NOT_FOUND : DFLASH_E_IO, errno,
                          "%s: cannot stat", l->text);
  if (!S_ISREG(sb.st_mode)) return df_error(DFLASH_E_IO, "%s: not a regular file", l->text);
  out->size = (uint64_t)sb.st_size;
  out->mtime = (int64_t)sb.st_mtime;
  return DFLASH_OK;
}

dflash_status df_local_mkdirs_for(const char *path) {
  char *dir = df_path_dirname(path);
  if (!dir) return df_error_nomem("directory name");
  dflash_status s = df_mkdir_p(dir);
  free(dir);
  return s;
}

dflash_status df_local_delete(const df_loc *l) {
  if (unlink(l->path) != 0 && errno != ENOENT)
    return df_error_errno(DFLASH_E_IO, errno, "%s: cannot delete", l->text);
  return DFLASH_OK;
}

/* "name.tmp.<pid>": an unfinished atomic write (core/fileio.c). */
static bool is_temp_name(const char *name) {
  const char *t = strstr(name, ".tmp.");
  if (!t) return false;
  t += 5;
  if (!*t) return false;
  for (; *t; t++)
    if (*t < '0' || *t > '9') return false;
  return true;
}

/* Walk `dir` (spelled `shown` in results), adding files that start with
 * `prefix`; only descend where the prefix can still match. */
static dflash_status walk(const char *dir, const char *shown, const char *prefix,
                          dflash_storage_listing *out, int depth) {
  if (depth > 64) return DFLASH_OK;
  DIR *d = opendir(dir);
  if (!d)
    return errno == ENOENT || errno == ENOTDIR
               ? DFLASH_OK
               : df_error_errno(DFLASH_E_IO, errno, "%s: cannot list", dir);
  dflash_status s = DFLASH_OK;
  struct dirent *e;
  size_t plen = strlen(prefix);
  while (!s && (e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || is_temp_name(e->d_name)) continue;
    char *full = df_path_join(dir, e->d_name);
    char *name = df_asprintf("%s%s", shown, e->d_name);
    struct stat sb;
    if (!full || !name) s = df_error_nomem("listing");
    else if (stat(full, &sb) != 0) { /* vanished meanwhile */ } else if (S_ISDIR(sb.st_mode)) {
      char *sub = df_asprintf("%s/", name);
      size_t n = sub ? strlen(sub) : 0;
      if (!sub) s = df_error_nomem("listing");
      else if (!strncmp(sub, prefix, n < plen ? n : plen))
        s = walk(full, sub, prefix, out, depth + 1);
      free(sub);
    } else if (S_ISREG(sb.st_mode) && !strncmp(name, prefix, plen)) {
      s = df_listing_add(out, name, (uint64_t)sb.st_size);
      name = NULL;
    }
    free(full);
    free(name);
  }
  closedir(d);
  return s;
}

dflash_status df_local_list(const df_loc *p, dflash_storage_listing *out) {
  /* Results are spelled like the prefix: its text up to the last '/'. */
  const char *text = p->text;
  const char *slash = strrchr(text, '/');
  char *shown = df_strndup(text, slash ? (size_t)(slash - text + 1) : 0);
  const char *pslash = strrchr(p->path, '/');
  char *dir = pslash ? df_strndup(p->path, (size_t)(pslash - p->path + 1)) : df_strdup(".");
  dflash_status s = shown && dir ? walk(dir, shown, text, out, 0) : df_error_nomem("listing");
  free(shown);
  free(dir);
  return s;
}
