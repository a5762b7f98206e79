#include "tok_testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "testutil.h"

char *tt_base64(const void *data, size_t n, char *out) {
  static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const unsigned char *s = data;
  char *o = out;
  for (size_t i = 0; i < n; i += 3) {
    unsigned v = (unsigned)s[i] << 16 | (i + 1 < n ? (unsigned)s[i + 1] << 8 : 0) |
                 (i + 2 < n ? s[i + 2] : 0);
    *o++ = A[v >> 18 & 63];
    *o++ = A[v >> 12 & 63];
    *o++ = i + 1 < n ? A[v >> 6 & 63] : '=';
    *o++ = i + 2 < n ? A[v & 63] : '=';
  }
  *o = '\0';
  return out;
}

char *tt_write_ranks(const char *dir, const char *name, const char *const *extra) {
  df_buf b = {0};
  char enc[256];
  for (int i = 0; i < 256; i++) {
    unsigned char c = (unsigned char)i;
    ck_assert_int_eq(df_buf_printf(&b, "%s %d\n", tt_base64(&c, 1, enc), i), DFLASH_OK);
  }
  for (int k = 0; extra && extra[k]; k++)
    ck_assert_int_eq(df_buf_printf(&b, "%s %d\n", tt_base64(extra[k], strlen(extra[k]), enc),
                                   256 + k),
                     DFLASH_OK);
  char *path = df_path_join(dir, name);
  ck_assert(df_test_write(path, b.data, b.len));
  df_buf_free(&b);
  return path;
}

dflash_tokenizer *tt_load(const char *path, const char *pattern) {
  dflash_tokenizer_options o;
  dflash_tokenizer_options_default(&o);
  o.pattern = pattern;
  dflash_tokenizer *t = NULL;
  ck_assert_ok(dflash_tokenizer_load(path, &o, &t));
  return t;
}

char *tt_write(const char *dir, const char *name, const char *text) {
  char *path = df_path_join(dir, name);
  ck_assert(df_test_write(path, text, strlen(text)));
  return path;
}
