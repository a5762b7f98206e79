/* NFC shared by the tokenizer and the chat layer: a quick check, and a normaliser that hands
 * utf8proc only the spans that may change. */
#include "internal.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* Decode one UTF-8 code point at s[*i]; -1 for an invalid sequence. */
static int32_t next_cp(const uint8_t *s, size_t n, size_t *i) {
  utf8proc_int32_t cp;
  utf8proc_ssize_t k = utf8proc_iterate(s + *i, (utf8proc_ssize_t)(n - *i), &cp);
  *i += k > 0 ? (size_t)k : 1;
  return k > 0 ? cp : -1;
}

/* Whether NFC leaves code point c (>= U+0300) alone in every context: a starter without a
 * decomposition that takes no part in canonical composition (first or second) and is no
 * Hangul jamo that composes algorithmically (L U+1100..1112, V U+1161..1175, T U+11A8..11C2,
 * here the whole block but U+11A7). Such a character is also a boundary: nothing composes or
 * reorders across it, so NFC(a c b) = NFC(a) c NFC(b) for any a, b (UAX #15, "boundary
 * before").
 * U+11A7 (HANGUL JUNGSEONG O-YAE) is inert, but utf8proc 2.8 (Debian 12's and 13's) composes
 * an LV syllable with it as if it were a trailing consonant of index 0 and drops it, where
 * Python's unicodedata and Hugging Face tokenizers keep it; as a boundary it never reaches
 * utf8proc. */
static bool nfc_inert(int32_t c) {
  if (c < 0) return false;
  if (c == 0x11A7) return true;
  if (c >= 0x1100 && c <= 0x11FF) return false;
  const utf8proc_property_t *p = utf8proc_get_property(c);
  return !p->combining_class && p->decomp_seqindex == UINT16_MAX && p->comb_index == UINT16_MAX;
}

/*
 * True when `s` is certainly NFC: every code point is inert (above). Such text is unchanged
 * by NFC; anything else goes through df_nfc. This keeps the common case (ASCII, CJK, most
 * scripts) free of the allocation and full normalisation.
 */
bool df_utf8_quick_nfc(const char *str, size_t n) {
  const uint8_t *s = (const uint8_t *)str;
  for (size_t i = 0; i < n;) {
    if (s[i] < 0xCC) { /* below U+0300 (or a continuation byte of one): always NFC */
      i++;
      continue;
    }
    if (!nfc_inert(next_cp(s, n, &i))) return false;
  }
  return true;
}

/* Whether the code point at s[i] is a boundary in the sense above. Every code point below
 * U+0300 is one: a starter that composes with nothing before it. */
static bool nfc_boundary_at(const uint8_t *s, size_t n, size_t i) {
  if (s[i] < 0xCC) return true;
  return nfc_inert(next_cp(s, n, &i));
}

/* NFC of the span s[b..e) (cut at boundaries), appended to out after the untouched text
 * s[*copied..b) when it changes anything. */
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
 * NFC through utf8proc, but only over the spans that may change: each character that is not
 * inert takes the span from the last boundary before it to the next boundary after it. Text
 * outside the spans is already NFC and is copied (or, when no span changes, not touched at
 * all), so one accent in a long document costs a few bytes of utf8proc, not the whole text.
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
    if (nfc_inert(next_cp(s, len, &i))) {
      boundary = at;
      continue;
    }
    while (i < len && !nfc_boundary_at(s, len, i)) next_cp(s, len, &i);
    dflash_status st = nfc_span(s, boundary, i, &copied, out, changed);
    if (st) return st;
    boundary = i;
  }
  if (*changed && df_buf_append(out, s + copied, len - copied)) return df_error_nomem("NFC");
  return DFLASH_OK;
}
