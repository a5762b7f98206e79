/* Small string, path, UTF-8 and buffer helpers. */
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

char *df_strdup(const char *s) { return s ? df_strndup(s, strlen(s)) : NULL; }

char *df_strndup(const char *s, size_t n) {
  char *p = malloc(n + 1);
  if (!p) return NULL;
  memcpy(p, s, n);
  p[n] = '\0';
  return p;
}

char *df_asprintf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0) return NULL;
  char *p = malloc((size_t)n + 1);
  if (!p) return NULL;
  va_start(ap, fmt);
  vsnprintf(p, (size_t)n + 1, fmt, ap);
  va_end(ap);
  return p;
}

char *df_path_join(const char *dir, const char *name) {
  if (name[0] == '/' || !dir || !dir[0]) return df_strdup(name);
  size_t n = strlen(dir);
  return df_asprintf("%s%s%s", dir, dir[n - 1] == '/' ? "" : "/", name);
}

char *df_path_dirname(const char *path) {
  const char *slash = strrchr(path, '/');
  if (!slash) return df_strdup(".");
  if (slash == path) return df_strdup("/");
  return df_strndup(path, (size_t)(slash - path));
}

bool df_str_ends_with(const char *s, const char *suffix) {
  size_t a = strlen(s), b = strlen(suffix);
  return a >= b && memcmp(s + a - b, suffix, b) == 0;
}

bool df_utf8_valid(const char *str, size_t len) {
  const unsigned char *s = (const unsigned char *)str;
  size_t i = 0;
  while (i < len) {
    unsigned c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t n;
    unsigned cp, min;
    if ((c & 0xE0) == 0xC0) {
      n = 1;
      cp = c & 0x1F;
      min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      n = 2;
      cp = c & 0x0F;
      min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      n = 3;
      cp = c & 0x07;
      min = 0x10000;
    } else return false;
    if (len - i <= n) return false;
    for (size_t k = 1; k <= n; k++) {
      if ((s[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n + 1;
  }
  return true;
}

dflash_status df_buf_reserve(df_buf *b, size_t extra) {
  if (b->cap - b->len > extra) return DFLASH_OK;
  size_t need;
  if (__builtin_add_overflow(b->len, extra + 1, &need)) return df_error_nomem("buffer");
  size_t cap = b->cap ? b->cap : 64;
  while (cap < need) {
    if (cap > SIZE_MAX / 2) {
      cap = need;
      break;
    }
    cap *= 2;
  }
  char *p = realloc(b->data, cap);
  if (!p) return df_error_nomem("buffer");
  b->data = p;
  b->cap = cap;
  return DFLASH_OK;
}

dflash_status df_buf_append(df_buf *b, const void *data, size_t n) {
  dflash_status st = df_buf_reserve(b, n);
  if (st) return st;
  if (n) memcpy(b->data + b->len, data, n);
  b->len += n;
  b->data[b->len] = '\0';
  return DFLASH_OK;
}

dflash_status df_buf_printf(df_buf *b, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (n < 0) return df_error(DFLASH_E_INTERNAL, "df_buf_printf: bad format");
  dflash_status st = df_buf_reserve(b, (size_t)n);
  if (st) return st;
  va_start(ap, fmt);
  vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
  va_end(ap);
  b->len += (size_t)n;
  return DFLASH_OK;
}

void df_buf_free(df_buf *b) {
  free(b->data);
  b->data = NULL;
  b->len = b->cap = 0;
}

double df_now_seconds(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
