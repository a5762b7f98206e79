/* NFC shared by the tokenizer and the chat layer: a quick check, and a normaliser that hands
 * utf8proc only the spans that may change. */
#include "internal.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* Decode one UTF-8 code point at s[*i]; -1 for an invalid sequence. Well-formed 2- and 3-byte
 * sequences (nearly every character the quick check meets) are decoded here, the rest by
 * utf8proc. */
static inline int32_t next_cp(const uint8_t *s, size_t n, size_t *i) {
  size_t j = *i;
  uint8_t c = s[j];
  if (c >= 0xC2 && c <= 0xDF && j + 1 < n && (s[j + 1] & 0xC0) == 0x80) {
    *i = j + 2;
    return (int32_t)(c & 0x1F) << 6 | (s[j + 1] & 0x3F);
  }
  if (c >= 0xE0 && c <= 0xEF && j + 2 < n && (s[j + 2] & 0xC0) == 0x80) {
    uint8_t lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF;
    if (s[j + 1] >= lo && s[j + 1] <= hi) {
      *i = j + 3;
      return (int32_t)(c & 0x0F) << 12 | (int32_t)(s[j + 1] & 0x3F) << 6 | (s[j + 2] & 0x3F);
    }
  }
  utf8proc_int32_t cp;
  utf8proc_ssize_t k = utf8proc_iterate(s + *i, (utf8proc_ssize_t)(n - *i), &cp);
  *i += k > 0 ? (size_t)k : 1;
  return k > 0 ? cp : -1;
}

/* Whether code point c (>= U+0300) is a boundary NFC cannot cross backwards: a starter
 * without a canonical decomposition (a compatibility one does not count: NFC ignores it), not
 * the second of any canonical composition, and no Hangul jamo that composes algorithmically
 * (L U+1100..1112, V U+1161..1175, T U+11A8..11C2, here the whole block but U+11A7). Then
 * NFC(a c b) = NFC(a) NFC(c b) for any a, b (UAX #15, "boundary before"): text of such
 * characters alone is NFC, and a character that is not one needs only the span from the
 * last boundary before it to the next one after it. c may still be the first of a
 * composition (Arabic alef, kana, Latin letters): the span of a mark after it starts at c.
 * Counting those (and compatibility decompositions) as boundaries too kept Arabic words,
 * kana and Hangul compatibility letters out of utf8proc.
 * U+11A7 (HANGUL JUNGSEONG O-YAE) is inert, but utf8proc 2.8 (Debian 12's and 13's) composes
 * an LV syllable with it as if it were a trailing consonant of index 0 and drops it, where
 * Python's unicodedata and Hugging Face tokenizers keep it; as a boundary it never reaches
 * utf8proc. */
static bool nfc_inert_slow(int32_t c) {
  if (c == 0x11A7) return true;
  if (c >= 0x1100 && c <= 0x11FF) return false;
  const utf8proc_property_t *p = utf8proc_get_property(c);
  bool canonical_decomp = p->decomp_seqindex != UINT16_MAX && p->decomp_type == 0;
  bool second = p->comb_index >= 0x8000 && p->comb_index != UINT16_MAX; /* utf8proc's layout */
  return !p->combining_class && !canonical_decomp && !second;
}

/* nfc_inert_slow of every code point, as bits in blocks of 256 code points, one copy of each
 * distinct block (~100 of 4352): two loads instead of two calls into utf8proc per character,
 * which were a third of NFC's cost. Built once, on first use (~20 ms). */
enum { BLOCK = 256, N_BLOCKS = 0x110000 / BLOCK };
static uint16_t g_stage1[N_BLOCKS];
static uint8_t (*g_blocks)[BLOCK / 8];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void build_inert(void) {
  uint8_t(*blocks)[BLOCK / 8] = calloc(N_BLOCKS, sizeof *blocks);
  if (!blocks) return; /* nfc_inert falls back to utf8proc */
  size_t n = 0;
  for (size_t b = 0; b < N_BLOCKS; b++) {
    uint8_t bits[BLOCK / 8] = {0};
    for (int k = 0; k < BLOCK; k++)
      if (nfc_inert_slow((int32_t)(b * BLOCK + (size_t)k)))
        bits[k >> 3] |= (uint8_t)(1u << (k & 7));
    size_t u = 0;
    while (u < n && memcmp(blocks[u], bits, sizeof bits)) u++;
    if (u == n) memcpy(blocks[n++], bits, sizeof bits);
    g_stage1[b] = (uint16_t)u;
  }
  uint8_t(*shrunk)[BLOCK / 8] = realloc(blocks, n * sizeof *blocks);
  g_blocks = shrunk ? shrunk : blocks;
}

static inline bool nfc_inert(int32_t c) {
  if (c < 0) return false;
  if (!g_blocks) return nfc_inert_slow(c);
  return g_blocks[g_stage1[c / BLOCK]][(c % BLOCK) >> 3] >> (c & 7) & 1;
}

/*
 * True when `s` is certainly NFC: every code point is inert (above). Such text is unchanged
 * by NFC; anything else goes through df_nfc. This keeps the common case (ASCII, CJK, most
 * scripts) free of the allocation and full normalisation.
 */
bool df_utf8_quick_nfc(const char *str, size_t n) {
  const uint8_t *s = (const uint8_t *)str;
  pthread_once(&g_once, build_inert);
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
  pthread_once(&g_once, build_inert);
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
