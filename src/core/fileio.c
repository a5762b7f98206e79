/* Whole-file reads and crash-safe writes (temporary name, fsync, rename). */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

dflash_status df_read_file(const char *path, char **out, size_t *out_len) {
  *out = NULL;
  if (out_len) *out_len = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return df_error_errno(errno == ENOENT ? DFLASH_E_NOT_FOUND : DFLASH_E_IO, errno,
                          "%s: cannot open", path);
  df_buf b = {0};
  dflash_status st = DFLASH_OK;
  for (;;) {
    if ((st = df_buf_reserve(&b, 1 << 16))) break;
    ssize_t n = read(fd, b.data + b.len, b.cap - b.len - 1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      st = df_error_errno(DFLASH_E_IO, errno, "%s: read failed", path);
      break;
    }
    if (n == 0) break;
    b.len += (size_t)n;
  }
  close(fd);
  if (st) {
    df_buf_free(&b);
    return st;
  }
  if (!b.data && (st = df_buf_reserve(&b, 1))) return st;
  b.data[b.len] = '\0';
  *out = b.data;
  if (out_len) *out_len = b.len;
  return DFLASH_OK;
}

dflash_status df_write_all(int fd, const void *data, size_t n, const char *path) {
  const char *p = data;
  while (n) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return df_error_errno(DFLASH_E_IO, errno, "%s: write failed", path);
    p += w;
    n -= (size_t)w;
  }
  return DFLASH_OK;
}

dflash_status df_fsync_parent(const char *path) {
  char *dir = df_path_dirname(path);
  if (!dir) return df_error_nomem("path");
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  dflash_status st = DFLASH_OK;
  if (fd < 0) st = df_error_errno(DFLASH_E_IO, errno, "%s: cannot open directory", dir);
  else if (fsync(fd) != 0 && errno != EINVAL)
    st = df_error_errno(DFLASH_E_IO, errno, "%s: fsync of directory failed", dir);
  if (fd >= 0) close(fd);
  free(dir);
  return st;
}

dflash_status df_atomic_open(const char *path, df_atomic_file *f) {
  memset(f, 0, sizeof *f);
  f->fd = -1;
  f->path = df_strdup(path);
  /* pid in the name keeps two writers of the same file from sharing a temp. */
  f->tmp_path = df_asprintf("%s.tmp.%ld", path, (long)getpid());
  if (!f->path || !f->tmp_path) {
    df_atomic_abort(f);
    return df_error_nomem("path");
  }
  f->fd = open(f->tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (f->fd < 0) {
    dflash_status st = df_error_errno(DFLASH_E_IO, errno, "%s: cannot create", f->tmp_path);
    free(f->tmp_path);
    f->tmp_path = NULL;
    df_atomic_abort(f);
    return st;
  }
  return DFLASH_OK;
}

dflash_status df_atomic_write(df_atomic_file *f, const void *data, size_t n) {
  return df_write_all(f->fd, data, n, f->tmp_path);
}

dflash_status df_atomic_commit(df_atomic_file *f) {
  if (fsync(f->fd) != 0) return df_error_errno(DFLASH_E_IO, errno, "%s: fsync failed", f->tmp_path);
  if (close(f->fd) != 0) {
    f->fd = -1;
    return df_error_errno(DFLASH_E_IO, errno, "%s: close failed", f->tmp_path);
  }
  f->fd = -1;
  if (rename(f->tmp_path, f->path) != 0)
    return df_error_errno(DFLASH_E_IO, errno, "%s: cannot rename to %s", f->tmp_path, f->path);
  free(f->tmp_path);
  f->tmp_path = NULL;
  dflash_status st = df_fsync_parent(f->path);
  df_atomic_abort(f);
  return st;
}

void df_atomic_abort(df_atomic_file *f) {
  if (f->fd >= 0) close(f->fd);
  f->fd = -1;
  if (f->tmp_path) unlink(f->tmp_path);
  free(f->tmp_path);
  free(f->path);
  f->tmp_path = f->path = NULL;
}

dflash_status df_write_file_atomic(const char *path, const void *data, size_t n) {
  df_atomic_file f;
  dflash_status st = df_atomic_open(path, &f);
  if (st) return st;
  if ((st = df_atomic_write(&f, data, n)) || (st = df_atomic_commit(&f))) df_atomic_abort(&f);
  return st;
}

/* Create one directory level; an existing directory is fine, an existing
 * non-directory is not. A new directory is made durable in its parent. */
static dflash_status mkdir_one(const char *dir) {
  if (mkdir(dir, 0777) == 0) return df_fsync_parent(dir);
  struct stat sb;
  if (errno == EEXIST && stat(dir, &sb) == 0) {
    if (S_ISDIR(sb.st_mode)) return DFLASH_OK;
    return df_error(DFLASH_E_EXISTS, "%s exists and is not a directory", dir);
  }
  return df_error_errno(DFLASH_E_IO, errno, "%s: cannot create directory", dir);
}

dflash_status df_mkdir_p(const char *path) {
  char *dir = df_strdup(path);
  if (!dir) return df_error_nomem("directory name");
  dflash_status st = DFLASH_OK;
  for (char *p = dir + 1; !st; p++) { /* each level in turn, like mkdir -p */
    bool end = *p == '\0';
    if (*p != '/' && !end) continue;
    *p = '\0';
    if (p[-1] != '/') st = mkdir_one(dir); /* skip empty levels of "a//b" */
    if (end) break;
    *p = '/';
  }
  free(dir);
  return st;
}

dflash_status df_map_file(const char *path, const uint8_t **base, uint64_t *size) {
  *base = NULL;
  *size = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return df_error_errno(errno == ENOENT ? DFLASH_E_NOT_FOUND : DFLASH_E_IO, errno,
                          "%s: cannot open", path);
  struct stat sb;
  dflash_status st = DFLASH_OK;
  if (fstat(fd, &sb) != 0) st = df_error_errno(DFLASH_E_IO, errno, "%s: cannot stat", path);
  else if (!S_ISREG(sb.st_mode)) st = df_error(DFLASH_E_IO, "%s: not a regular file", path);
  else if (sb.st_size > 0) {
    void *p = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) st = df_error_errno(DFLASH_E_IO, errno, "%s: mmap failed", path);
    else {
      *base = p;
      *size = (uint64_t)sb.st_size;
    }
  }
  close(fd);
  return st;
}

void df_unmap_file(const uint8_t *base, uint64_t size) {
  if (base) munmap((void *)base, (size_t)size);
}
