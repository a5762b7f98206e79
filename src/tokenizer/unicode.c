/* UTF-8 repair (Python's "replace" policy) and character classes (NFC is core/nfc.c). */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

/* Bytes allowed after a lead byte, per position, following Unicode's table of
 * well-formed sequences (so overlongs and surrogates fail at the second byte). */
static size_t valid_prefix(const uint8_t *s, size_t avail, size_t *need) {
  uint8_t c = s[0];
  uint8_t lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) *need = 2;
  else if (c >= 0xE0 && c <= 0xEF) {
    *need = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    *need = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *need = 1;
    return 0; /* not a lead byte */
  }
  size_t k = 1;
  if (k < avail && s[k] >= lo && s[k] <= hi) {
    k++;
    while (k < *need && k < avail && (s[k] & 0xC0) == 0x80) k++;
  }
  return k;
}

static bool g_utf8_avx2;

bool df_utf8_set_avx2(bool on) {
  g_utf8_avx2 = on && df_scan_cpu_has_avx2();
  return g_utf8_avx2 == on;
}

dflash_status df_utf8_repair(const char *str, size_t len, df_buf *out, bool *changed) {
  const uint8_t *s = (const uint8_t *)str;
  *changed = false;
  /* Text is nearly always valid: the vector check costs a few percent of the byte loop. */
  if (g_utf8_avx2 && df_utf8_valid_avx2(s, len)) return DFLASH_OK;
  size_t i = 0, copied = 0;
  while (i < len) {
    if (s[i] < 0x80) { /* ASCII: skip it eight bytes at a time */
      i++;
      uint64_t w;
      while (i + 8 <= len && (memcpy(&w, s + i, 8), !(w & 0x8080808080808080ull))) i += 8;
      continue;
    }
    size_t need, k = valid_prefix(s + i, len - i, &need);
    if (k == need) {
      i += k;
      continue;
    }
    /* s[i .. i + max(k,1)) is one maximal invalid subpart: one U+FFFD. */
    if (!*changed) out->len = 0;
    *changed = true;
    if (df_buf_append(out, s + copied, i - copied) || df_buf_append(out, "\xEF\xBF\xBD", 3))
      return DFLASH_E_NOMEM;
    i += k ? k : 1;
    copied = i;
  }
  if (*changed && df_buf_append(out, s + copied, len - copied)) return DFLASH_E_NOMEM;
  return DFLASH_OK;
}

bool df_is_white_space(uint32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D);
  if (c < 0x85) return false;
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
