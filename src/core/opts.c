/* Versioned structs: the one rule for every options and output struct (core/internal.h). */
#include <string.h>

#include "internal.h"

/* A struct_size beyond this is not a struct but an uninitialised field. */
#define DF_OPTS_MAX_SIZE ((size_t)1 << 20)

static size_t caller_size(const void *s) {
  size_t n;
  memcpy(&n, s, sizeof n);
  return n;
}

static bool tail_is_zero(const unsigned char *p, size_t from, size_t to) {
  for (size_t i = from; i < to; i++)
    if (p[i]) return false;
  return true;
}

dflash_status df_opts_in(void *dst, const void *src, size_t size, const char *what) {
  if (!src) return DFLASH_OK;
  size_t n = caller_size(src);
  if (n < sizeof(size_t) || n > DF_OPTS_MAX_SIZE)
    return df_error(DFLASH_E_INVALID_ARG,
                    "%s: struct_size %zu is not a struct size (set it to "
                    "sizeof, or initialise with the _default function)",
                    what, n);
  /* A newer caller's fields this library does not know: fine while they are unset. */
  if (n > size && !tail_is_zero(src, size, n))
    return df_error(DFLASH_E_UNSUPPORTED,
                    "%s: struct_size %zu, and bytes past this library's "
                    "%zu are set: options of a newer libdflash",
                    what, n, size);
  memcpy(dst, src, n < size ? n : size);
  memcpy(dst, &size, sizeof size);
  return DFLASH_OK;
}

dflash_status df_opts_out(void *dst, const void *src, size_t size, const char *what) {
  size_t n = caller_size(dst);
  if (n < sizeof(size_t) || n > DF_OPTS_MAX_SIZE)
    return df_error(DFLASH_E_INVALID_ARG,
                    "%s: struct_size %zu is not a struct size (set it to "
                    "sizeof before the call)",
                    what, n);
  memcpy(dst, src, n < size ? n : size);
  if (n > size) memset((unsigned char *)dst + size, 0, n - size);
  memcpy(dst, &n, sizeof n);
  return DFLASH_OK;
}

void df_opts_fill(void *dst, size_t n, const void *defaults, size_t size) {
  if (!dst || n < sizeof(size_t)) return;
  memcpy(dst, defaults, n < size ? n : size);
  if (n > size) memset((unsigned char *)dst + size, 0, n - size);
  memcpy(dst, &n, sizeof n);
}
