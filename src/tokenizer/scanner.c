/*
 * Hand-written scanners for the named pre-tokenizer patterns. Each function
 * mirrors its regex alternative by alternative, including the order in which
 * a backtracking engine gives characters back, so the match is the one PCRE2
 * (and tiktoken's fancy-regex) returns. The character classes come from
 * PCRE2's own Unicode tables (matched once over every code point), so the
 * scanner and the regex cannot disagree about a character either.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

enum {
  C_L = 1,     /* \p{L} */
  C_N = 2,     /* \p{N} */
  C_M = 4,     /* \p{M} */
  C_UP = 8,    /* [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] */
  C_LO = 16,   /* [\p{Ll}\p{Lm}\p{Lo}\p{M}] */
  C_WS = 32,   /* \s as translated: Unicode White_Space */
  C_HAN = 64,  /* \p{sc=Han} */
  C_CRLF = 128 /* \r or \n */
};

#define N_CODEPOINTS 0x110000
/* The classes of every code point, as a two-level table: g_stage1[c >> 7] picks one of the
 * distinct 128-code-point blocks in g_blocks. A flat table (1.1 MB) misses the cache on
 * nearly every character of text that mixes scripts; this one is about 50 KB. Read-only
 * once built. */
#define BLOCK_BITS 7
static uint16_t *g_stage1; /* [N_CODEPOINTS >> BLOCK_BITS] */
static uint8_t *g_blocks;
static uint8_t g_ascii[128];
static uint8_t *g_class; /* [N_CODEPOINTS] while building */
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static dflash_status g_init_status;

/* Mark every code point the (Rust-syntax) class `rx` matches with `bit`. */
static dflash_status mark_class(const char *rx, uint8_t bit, const char *all, size_t len) {
  char *pcre = NULL;
  dflash_status st = df_regex_translate(rx, &pcre);
  if (st) return st;
  int err;
  PCRE2_SIZE off;
  pcre2_code *re = pcre2_compile((PCRE2_SPTR)pcre, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                 &err, &off, NULL);
  free(pcre);
  pcre2_match_data *md = pcre2_match_data_create(1, NULL);
  if (!re || !md) {
    pcre2_code_free(re);
    pcre2_match_data_free(md);
    return df_error(DFLASH_E_INTERNAL, "scanner class %s does not compile", rx);
  }
  pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
  size_t pos = 0;
  while (pos < len &&
         pcre2_match(re, (PCRE2_SPTR)all, len, pos, PCRE2_NO_UTF_CHECK, md, NULL) > 0) {
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    for (size_t i = ov[0]; i < ov[1];) g_class[df_utf8_next((const uint8_t *)all, &i)] |= bit;
    pos = ov[1] > ov[0] ? ov[1] : ov[1] + 1;
  }
  pcre2_code_free(re);
  pcre2_match_data_free(md);
  return DFLASH_OK;
}


/* g_stage1 and g_blocks from the flat g_class (identical blocks stored once). */
static dflash_status build_stages(void) {
  enum { B = 1 << BLOCK_BITS, N_BLOCKS = N_CODEPOINTS >> BLOCK_BITS };
  g_stage1 = malloc(N_BLOCKS * sizeof *g_stage1);
  uint8_t *blocks = malloc((size_t)N_BLOCKS * B);
  if (!g_stage1 || !blocks) {
    free(g_stage1);
    free(blocks);
    g_stage1 = NULL;
    return df_error_nomem("scanner tables");
  }
  size_t n = 0;
  for (size_t b = 0; b < N_BLOCKS; b++) {
    const uint8_t *cls = g_class + b * B;
    size_t k = n && !memcmp(blocks + (n - 1) * B, cls, B) ? n - 1 : 0; /* runs of equal blocks */
    while (k < n && memcmp(blocks + k * B, cls, B)) k++;
    if (k == n) memcpy(blocks + n++ * B, cls, B);
    g_stage1[b] = (uint16_t)k;
  }
  g_blocks = realloc(blocks, n * B);
  if (!g_blocks) g_blocks = blocks; /* shrinking failed: keep the larger block */
  memcpy(g_ascii, g_class, sizeof g_ascii);
  return DFLASH_OK;
}

static inline uint8_t class_of(uint32_t c) {
  return g_blocks[(size_t)g_stage1[c >> BLOCK_BITS] << BLOCK_BITS | (c & ((1u << BLOCK_BITS) - 1))];
}

static void build_classes(void) {
  g_class = calloc(N_CODEPOINTS, 1);
  char *all = malloc((size_t)N_CODEPOINTS * 4);
  if (!g_class || !all) {
    free(all);
    free(g_class);
    g_class = NULL;
    g_init_status = df_error_nomem("scanner tables");
    return;
  }
  size_t len = 0;
  for (uint32_t c = 0; c < N_CODEPOINTS; c++)
    if (c < 0xD800 || c > 0xDFFF) len += df_utf8_put(all + len, c);
  static const struct {
    const char *rx;
    uint8_t bit;
  } classes[] = {{"\\p{L}+", C_L},
                 {"\\p{N}+", C_N},
                 {"\\p{M}+", C_M},
                 {"[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+", C_UP},
                 {"[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+", C_LO},
                 {"\\s+", C_WS},
                 {"\\p{Han}+", C_HAN},
                 {"[\\r\\n]+", C_CRLF}};
  for (size_t k = 0; k < DF_ARRAY_LEN(classes) && !g_init_status; k++)
    g_init_status = mark_class(classes[k].rx, classes[k].bit, all, len);
  free(all);
  if (!g_init_status) g_init_status = build_stages();
  free(g_class);
  g_class = NULL;
}

dflash_status df_scan_init(void) {
  pthread_once(&g_once, build_classes);
  return g_blocks ? DFLASH_OK : g_init_status ? g_init_status : DFLASH_E_NOMEM;
}

/* ---- scanning helpers ----------------------------------------------------- */

typedef struct scan {
  const uint8_t *s;
  size_t len;
} scan;

static inline uint8_t cls_at(const scan *x, size_t i) {
  if (i >= x->len) return 0;
  if (x->s[i] < 0x80) return g_ascii[x->s[i]];
  size_t j = i;
  return class_of(df_utf8_next(x->s, &j));
}

static inline size_t next_char(const scan *x, size_t i) {
  if (x->s[i] < 0x80) return i + 1;
  if (x->s[i] < 0xE0) return i + 2;
  return i + (x->s[i] < 0xF0 ? 3 : 4);
}

static inline size_t prev_char(const scan *x, size_t i) {
  do i--;
  while (i > 0 && (x->s[i] & 0xC0) == 0x80);
  return i;
}

/* End of the run of characters whose class has all bits of `all` and none of `none`. */
static inline size_t run(const scan *x, size_t i, uint8_t all, uint8_t none) {
  while (i < x->len) {
    uint8_t c = cls_at(x, i);
    if ((c & all) != all || (c & none)) break;
    i = next_char(x, i);
  }
  return i;
}

static inline bool is(const scan *x, size_t i, uint8_t all, uint8_t none) {
  uint8_t c = cls_at(x, i);
  return i < x->len && (c & all) == all && !(c & none);
}

/* "Other" as in [^\r\n\p{L}\p{N}]. */
static inline bool is_p1(const scan *x, size_t i) {
  return i < x->len && !(cls_at(x, i) & (C_CRLF | C_L | C_N));
}

/* (?i:'s|'t|'re|'ve|'m|'ll|'d) at i: its length, or 0. PCRE2 folds case with
 * Unicode simple folding, where s also matches U+017F (long s). */
static size_t contraction(const scan *x, size_t i) {
  if (i >= x->len || x->s[i] != '\'' || i + 1 >= x->len) return 0;
  uint8_t a = x->s[i + 1] | 0x20;
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (x->s[i + 1] == 0xC5 && i + 2 < x->len && x->s[i + 2] == 0xBF) return 3; /* 'ſ */
  if (i + 2 >= x->len) return 0;
  uint8_t b = x->s[i + 2] | 0x20;
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

/* ---- alternatives shared by several patterns ------------------------------ */

/* ` ?[^\s<extra>]+<tail>*` where `stop` are the classes excluded from the run
 * and `slash` admits '/' in the tail (o200k). Returns the end or 0. */
static size_t punct_run(const scan *x, size_t i, uint8_t stop, bool slash) {
  size_t p = i;
  if (x->s[p] == ' ' && p + 1 < x->len && !(cls_at(x, p + 1) & stop)) p++;
  if (p >= x->len || (cls_at(x, p) & stop)) return 0;
  p = run(x, p, 0, stop);
  while (p < x->len && (x->s[p] == '\r' || x->s[p] == '\n' || (slash && x->s[p] == '/'))) p++;
  return p;
}

/* The white-space alternatives `\s*[\r\n]+ | \s+(?!\S) | \s+` (o200k, Kimi, Qwen). */
static size_t space_tail(const scan *x, size_t i) {
  size_t e = run(x, i, C_WS, 0);
  if (e == i) return 0;
  for (size_t q = e; q > i;) { /* \s*[\r\n]+: back off to the last line break */
    q = prev_char(x, q);
    if (x->s[q] == '\r' || x->s[q] == '\n') return q + 1;
  }
  if (e == x->len) return e;
  size_t last = prev_char(x, e); /* \s+(?!\S): leave the last space to the next word */
  return last > i ? last : e;
}

/* \p{N}{1,max} */
static size_t digits(const scan *x, size_t i, int max) {
  size_t p = i;
  for (int k = 0; k < max && is(x, p, C_N, 0); k++) p = next_char(x, p);
  return p;
}

/* [^\r\n\p{L}\p{N}]?[UP]*[LO]+C? then [^\r\n\p{L}\p{N}]?[UP]+[LO]*C? (o200k; Kimi with Han
 * excluded from both classes via `none`). */
static size_t cased_word(const scan *x, size_t i, uint8_t none) {
  size_t starts[2] = {i, i};
  int n_starts = 0;
  if (is_p1(x, i)) starts[n_starts++] = next_char(x, i); /* the optional char, taken first */
  starts[n_starts++] = i;
  for (int k = 0; k < n_starts; k++) { /* alternative 1: [UP]* backs off until [LO]+ fits */
    size_t p = starts[k], e = run(x, p, C_UP, none);
    for (size_t q = e;; q = prev_char(x, q)) {
      if (is(x, q, C_LO, none)) {
        size_t end = run(x, q, C_LO, none);
        return end + contraction(x, end);
      }
      if (q == p) break;
    }
  }
  for (int k = 0; k < n_starts; k++) { /* alternative 2 */
    size_t p = starts[k];
    if (!is(x, p, C_UP, none)) continue;
    size_t end = run(x, run(x, p, C_UP, none), C_LO, none);
    return end + contraction(x, end);
  }
  return 0;
}

/* The cased-word alternatives of o200k and Kimi when the word is ASCII: an optional
 * [^\r\n\p{L}\p{N}] then upper-case letters then lower-case ones, decided without the
 * backtracking of cased_word. ASCII letters are Lu or Ll only, so [UP]* cannot give back a
 * character [LO]+ would take, and alternative 2 takes the upper-case run. Returns the end,
 * or 0 when a character that decides the match is not ASCII (the caller runs cased_word). */
static size_t ascii_cased_word(const scan *x, size_t i) {
  const uint8_t *s = x->s;
  size_t p = i, n = x->len;
  if (s[p] >= 0x80) return 0;
  if (!(g_ascii[s[p]] & C_L)) { /* the optional character, taken when a letter follows */
    if ((g_ascii[s[p]] & (C_CRLF | C_N)) || p + 1 >= n || s[p + 1] >= 0x80 ||
        !(g_ascii[s[p + 1]] & C_L))
      return 0;
    p++;
  }
  size_t u = p;
  while (u < n && s[u] < 0x80 && (g_ascii[s[u]] & C_UP)) u++;
  size_t e = u;
  while (e < n && s[e] < 0x80 && (g_ascii[s[e]] & C_LO)) e++;
  if (e < n && s[e] >= 0x80) return 0; /* the run may go on with a non-ASCII letter or mark */
  return e + contraction(x, e);
}

/* ---- the patterns ----------------------------------------------------------- */

static size_t scan_cl100k(const scan *x, size_t i) {
  size_t c = contraction(x, i);
  if (c) return i + c;
  size_t p = is_p1(x, i) ? next_char(x, i) : i; /* [^\r\n\p{L}\p{N}]?+\p{L}++ */
  if (is(x, p, C_L, 0)) return run(x, p, C_L, 0);
  if (is(x, i, C_N, 0)) return digits(x, i, 3);
  size_t e = punct_run(x, i, C_WS | C_L | C_N, false);
  if (e) return e;
  e = run(x, i, C_WS, 0);
  if (e == i) return 0;
  if (e == x->len) return e;   /* \s++$ */
  for (size_t q = e; q > i;) { /* \s*[\r\n] */
    q = prev_char(x, q);
    if (x->s[q] == '\r' || x->s[q] == '\n') return q + 1;
  }
  size_t last = prev_char(x, e); /* \s+(?!\S) else \s */
  return last > i ? last : e;
}

static size_t scan_o200k(const scan *x, size_t i) {
  size_t e = ascii_cased_word(x, i);
  if (e) return e;
  e = cased_word(x, i, 0);
  if (e) return e;
  if (is(x, i, C_N, 0)) return digits(x, i, 3);
  e = punct_run(x, i, C_WS | C_L | C_N, true);
  return e ? e : space_tail(x, i);
}

static size_t scan_kimi(const scan *x, size_t i) {
  size_t e = ascii_cased_word(x, i); /* ASCII is never Han */
  if (e) return e;
  if (is(x, i, C_HAN, 0)) return run(x, i, C_HAN, 0);
  e = cased_word(x, i, C_HAN);
  if (e) return e;
  if (is(x, i, C_N, 0)) return digits(x, i, 3);
  e = punct_run(x, i, C_WS | C_L | C_N, false);
  return e ? e : space_tail(x, i);
}

/* Qwen2 (`letters` = L) and Qwen3.5 (`letters` = L or M). */
static size_t scan_qwen(const scan *x, size_t i, bool marks) {
  size_t c = contraction(x, i);
  if (c) return i + c;
  uint8_t letters = marks ? C_L | C_M : C_L;
  if (is_p1(x, i) && next_char(x, i) < x->len && (cls_at(x, next_char(x, i)) & letters)) {
    size_t p = next_char(x, i);
    while (p < x->len && (cls_at(x, p) & letters)) p = next_char(x, p);
    return p;
  }
  if (cls_at(x, i) & letters) {
    size_t p = i;
    while (p < x->len && (cls_at(x, p) & letters)) p = next_char(x, p);
    return p;
  }
  if (is(x, i, C_N, 0)) return next_char(x, i);
  size_t e = punct_run(x, i, C_WS | C_N | letters, false);
  return e ? e : space_tail(x, i);
}

size_t df_scan_next(df_scanner sc, const uint8_t *text, size_t len, size_t pos) {
  scan x = {text, len};
  size_t end = 0;
  switch (sc) {
  case DF_SCAN_CL100K: end = scan_cl100k(&x, pos); break;
  case DF_SCAN_O200K: end = scan_o200k(&x, pos); break;
  case DF_SCAN_KIMI: end = scan_kimi(&x, pos); break;
  case DF_SCAN_QWEN2: end = scan_qwen(&x, pos, false); break;
  case DF_SCAN_QWEN35: end = scan_qwen(&x, pos, true); break;
  case DF_SCAN_NONE: break;
  }
  return end > pos ? end - pos : 0;
}
