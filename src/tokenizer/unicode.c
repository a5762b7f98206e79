/* UTF-8 repair (Python's "replace" policy) and NFC through utf8proc. */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

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

dflash_status df_utf8_repair(const char *str, size_t len, df_buf *out, bool *changed) {
  const uint8_t *s = (const uint8_t *)str;
  *changed = false;
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

/* Whether NFC leaves code point c (>= U+0300) alone in every context: a starter
 * without a decomposition that takes no part in canonical composition (first
 * or second) and is no Hangul jamo (those compose algorithmically). Such a
 * character is also a boundary: nothing composes or reorders across it, so
 * NFC(a c b) = NFC(a) c NFC(b) for any a, b (UAX #15, "boundary before"). */
static bool nfc_inert(uint32_t c) {
  if (c >= 0x1100 && c <= 0x11FF) return false;
  const utf8proc_property_t *p = utf8proc_get_property((utf8proc_int32_t)c);
  return !p->combining_class && p->decomp_seqindex == UINT16_MAX && p->comb_index == UINT16_MAX;
}

/* Whether the code point at s[i] is a boundary in the sense above. Every code
 * point below U+0300 is one: a starter that composes with nothing before it. */
static bool nfc_boundary_at(const uint8_t *s, size_t i) {
  if (s[i] < 0xCC) return true;
  return nfc_inert(df_utf8_next(s, &i));
}

/* NFC of the span s[b..e) (cut at boundaries), appended to out after the
 * untouched text s[*copied..b) when it changes anything. */
static dflash_status nfc_span(const uint8_t *s, size_t b, size_t e, size_t *copied, df_buf *out,
                              bool *changed) {
  utf8proc_uint8_t *dst = NULL;
  utf8proc_ssize_t n = utf8proc_map(s + b, (utf8proc_ssize_t)(e - b), &dst,
                                    UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  if (n < 0) return df_error(DFLASH_E_UTF8, "NFC normalisation failed: %s", utf8proc_errmsg(n));
  dflash_status st = DFLASH_OK;
  if ((size_t)n != e - b || memcmp(dst, s + b, e - b) != 0) {
    if (!*changed) out->len = 0;
    *changed = true;
    if (df_buf_append(out, s + *copied, b - *copied) || df_buf_append(out, dst, (size_t)n))
      st = df_error_nomem("NFC");
    *copied = e;
  }
  free(dst);
  return st;
}

/*
 * NFC through utf8proc, but only over the spans that may change: each
 * character that is not inert takes the span from the last boundary before it
 * to the next boundary after it. Text outside the spans is already NFC and is
 * copied (or, when no span changes, not touched at all), so one accent in a
 * long document costs a few bytes of utf8proc, not the whole text.
 */
dflash_status df_nfc(const char *str, size_t len, df_buf *out, bool *changed) {
  const uint8_t *s = (const uint8_t *)str;
  *changed = false;
  size_t i = 0, boundary = 0, copied = 0;
  while (i < len) {
    if (s[i] < 0xCC) { /* below U+0300, or a continuation byte of such a character */
      if (s[i] < 0x80 || s[i] >= 0xC0) boundary = i;
      i++;
      continue;
    }
    size_t at = i;
    if (nfc_inert(df_utf8_next(s, &i))) {
      boundary = at;
      continue;
    }
    while (i < len && !nfc_boundary_at(s, i)) df_utf8_next(s, &i);
    dflash_status st = nfc_span(s, boundary, i, &copied, out, changed);
    if (st) return st;
    boundary = i;
  }
  if (*changed && df_buf_append(out, s + copied, len - copied)) return df_error_nomem("NFC");
  return DFLASH_OK;
}

bool df_is_white_space(uint32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D);
  if (c < 0x85) return false;
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}
