/* Quick NFC check shared by the tokenizer and the chat layer. */
#include "internal.h"

#include <utf8proc.h>

/* Decode one UTF-8 code point at s[*i]; -1 for an invalid sequence. */
static int32_t next_cp(const uint8_t *s, size_t n, size_t *i) {
  utf8proc_int32_t cp;
  utf8proc_ssize_t k = utf8proc_iterate(s + *i, (utf8proc_ssize_t)(n - *i), &cp);
  *i += k > 0 ? (size_t)k : 1;
  return k > 0 ? cp : -1;
}

/*
 * True when `s` is certainly NFC: every code point is a starter without a
 * decomposition that takes no part in canonical composition (and is no
 * Hangul jamo, which composes algorithmically). Such text is unchanged by
 * NFC; anything else goes through utf8proc. This keeps the common case
 * (ASCII, CJK, most scripts) free of the allocation and full normalisation.
 */
bool df_utf8_quick_nfc(const char *str, size_t n) {
  const uint8_t *s = (const uint8_t *)str;
  for (size_t i = 0; i < n;) {
    if (s[i] < 0xCC) { /* below U+0300 (or a continuation byte of one): always NFC */
      i++;
      continue;
    }
    int32_t cp = next_cp(s, n, &i);
    if (cp < 0 || (cp >= 0x1100 && cp <= 0x11FF)) return false;
    const utf8proc_property_t *p = utf8proc_get_property(cp);
    if (p->combining_class || p->decomp_seqindex != UINT16_MAX || p->comb_index != UINT16_MAX)
      return false;
  }
  return true;
}
