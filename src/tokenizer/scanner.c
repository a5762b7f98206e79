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

static void choose_impl(void);

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
  if (!g_init_status) choose_impl();
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

/* The class of the character at i (< len), and where the next one starts: one decode for
 * the loops that walk runs. */
static inline uint8_t cls_step(const scan *x, size_t *i) {
  uint8_t b = x->s[*i];
  if (b < 0x80) {
    *i += 1;
    return g_ascii[b];
  }
  return class_of(df_utf8_next(x->s, i));
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
    size_t next = i;
    uint8_t c = cls_step(x, &next);
    if ((c & all) != all || (c & none)) break;
    i = next;
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

/* `[UP]*[LO]+` at p: its end, or 0. [UP]* takes the whole upper run, then backtracking
 * gives characters back until [LO]+ fits: at the run's end if a [LO] character follows
 * (then [LO]+ runs on), else at the run's last [LO] character, where [LO]+ takes just
 * that one (the characters after it are not [LO]). So one pass finds it. */
static size_t up_then_lo(const scan *x, size_t p, uint8_t none) {
  size_t last_lo_end = 0;
  while (p < x->len) {
    size_t next = p;
    uint8_t c = cls_step(x, &next);
    if (!(c & C_UP) || (c & none)) break;
    p = next;
    if (c & C_LO) last_lo_end = p;
  }
  return is(x, p, C_LO, none) ? run(x, p, C_LO, none) : last_lo_end;
}

/* [^\r\n\p{L}\p{N}]?[UP]*[LO]+C? then [^\r\n\p{L}\p{N}]?[UP]+[LO]*C? (o200k; Kimi with Han
 * excluded from both classes via `none`). */
static size_t cased_word(const scan *x, size_t i, uint8_t none) {
  size_t starts[2] = {i, i};
  int n_starts = 0;
  if (is_p1(x, i)) starts[n_starts++] = next_char(x, i); /* the optional char, taken first */
  starts[n_starts++] = i;
  for (int k = 0; k < n_starts; k++) { /* alternative 1 */
    size_t end = up_then_lo(x, starts[k], none);
    if (end) return end + contraction(x, end);
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

/* End of the run of characters with any class bit of `letters`. */
static size_t letter_run(const scan *x, size_t p, uint8_t letters) {
  while (p < x->len) {
    size_t next = p;
    if (!(cls_step(x, &next) & letters)) break;
    p = next;
  }
  return p;
}

/* Qwen2 (`letters` = L) and Qwen3.5 (`letters` = L or M). */
static size_t scan_qwen(const scan *x, size_t i, bool marks) {
  size_t c = contraction(x, i);
  if (c) return i + c;
  uint8_t letters = marks ? C_L | C_M : C_L;
  if (is_p1(x, i) && next_char(x, i) < x->len && (cls_at(x, next_char(x, i)) & letters)) {
    return letter_run(x, next_char(x, i), letters);
  }
  if (cls_at(x, i) & letters) return letter_run(x, i, letters);
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

/* ---- the block scanner ------------------------------------------------------ */
/*
 * Most text is ASCII pieces: " word", "Word", "123", " ...", "  ". df_scan_pieces reads
 * 64 bytes at a time as bitmasks of byte classes and finds where such a piece ends with
 * shifts and a count of trailing zeros instead of a table lookup per character. A piece
 * the masks do not decide (one that reaches a non-ASCII byte, which may continue a word
 * or a run of spaces, or the end of the 64 bytes) goes to df_scan_next. ASCII letters are
 * Lu or Ll and never marks or Han, so for ASCII the cased-word alternatives of o200k and
 * Kimi reduce to "upper-case run, then lower-case run" (see ascii_cased_word).
 */

static df_scan_impl g_impl = DF_SCAN_PIECE;
static bool g_block_ok, g_avx2_ok; /* set once by build_classes */
static void (*g_masks)(const uint8_t *p, df_scan_masks *m);

/* The masks from the class table: the reference the AVX2 masks are checked against. */
static void masks_portable(const uint8_t *p, df_scan_masks *m) {
  *m = (df_scan_masks){0};
  for (unsigned i = 0; i < 64; i++) {
    uint64_t b = 1ull << i;
    if (p[i] >= 0x80) {
      m->high |= b;
      continue;
    }
    uint8_t c = g_ascii[p[i]];
    if (c & C_L) *(c & C_UP ? &m->up : &m->lo) |= b;
    else if (c & C_N) m->digit |= b;
    else if (c & C_WS) m->space |= b;
    else m->other |= b;
    if (c & C_CRLF) m->nl |= b;
    if (p[i] == '/') m->slash |= b;
    if (p[i] == '\'') m->quote |= b;
    if (p[i] == ' ') m->blank |= b;
  }
}

/* What the block scanner assumes of ASCII, checked against the table from PCRE2: a letter
 * is upper or lower case (never a mark or Han), letters, digits and spaces are apart, and
 * line breaks are spaces. */
static bool ascii_fits_blocks(void) {
  for (unsigned c = 0; c < 128; c++) {
    uint8_t k = g_ascii[c];
    bool letter = k & C_L, up = k & C_UP, lo = k & C_LO;
    if ((k & (C_M | C_HAN)) || (letter ? up == lo : up || lo)) return false;
    if (letter + !!(k & C_N) + !!(k & C_WS) > 1 || ((k & C_CRLF) && !(k & C_WS))) return false;
  }
  return true;
}

/* The AVX2 masks equal the portable ones on every byte value. */
static bool avx2_agrees(void) {
  if (!df_scan_cpu_has_avx2()) return false;
  for (unsigned base = 0; base < 256; base += 64) {
    uint8_t p[64];
    for (unsigned i = 0; i < 64; i++) p[i] = (uint8_t)(base + i);
    df_scan_masks a, b;
    masks_portable(p, &a);
    df_scan_masks_avx2(p, &b);
    if (memcmp(&a, &b, sizeof a)) return false;
  }
  return true;
}

static void choose_impl(void) {
  g_block_ok = ascii_fits_blocks();
  g_avx2_ok = g_block_ok && avx2_agrees();
  bool no_simd = df_env_on(getenv("DFLASH_TOKENIZER_NO_SIMD"));
  df_scan_set_impl(g_avx2_ok && !no_simd ? DF_SCAN_MASK_AVX2 : DF_SCAN_PIECE);
  df_utf8_set_avx2(!no_simd);
}

bool df_scan_set_impl(df_scan_impl impl) {
  bool avx2 = impl == DF_SCAN_BLOCK_AVX2 || impl == DF_SCAN_MASK_AVX2;
  if ((impl != DF_SCAN_PIECE && !g_block_ok) || (avx2 && !g_avx2_ok)) return false;
  g_impl = impl;
  g_masks = avx2 ? df_scan_masks_avx2 : masks_portable;
  return true;
}

df_scan_impl df_scan_get_impl(void) { return g_impl; }

typedef struct window {
  df_scan_masks m;
  uint64_t letter; /* up | lo */
  uint64_t opt;    /* [^\r\n\p{L}\p{N}] (ASCII) */
  uint64_t word;   /* where a word piece starts: a letter, or `opt` then a letter */
  uint64_t known;  /* where a run may end: an ASCII byte, or the text's end */
  /* Where a word from an earlier letter stops: not a letter (bytes past the text included),
   * and for o200k and Kimi an upper-case letter after a lower-case one. */
  uint64_t stop_cased, stop_any;
  size_t at;   /* text offset of bit 0 */
  unsigned n;  /* bytes of text in the window (bits at and past n are clear) */
  bool at_end; /* the text ends at n */
} window;

static inline __attribute__((always_inline)) void load_window(const scan *x, size_t at, window *w) {
  size_t left = x->len - at;
  w->at = at;
  w->n = left < 64 ? (unsigned)left : 64;
  w->at_end = left <= 64;
  uint64_t valid = ~0ull;
  if (left >= 64) {
    g_masks(x->s + at, &w->m);
  } else {
    uint8_t pad[64] = {0};
    memcpy(pad, x->s + at, left);
    g_masks(pad, &w->m);
    valid = (1ull << left) - 1;
    uint64_t *m = &w->m.up;
    for (size_t k = 0; k < sizeof w->m / sizeof *m; k++) m[k] &= valid;
  }
  const df_scan_masks *m = &w->m;
  w->letter = m->up | m->lo;
  w->opt = (m->other | m->space) & ~m->nl;
  w->word = w->letter | (w->opt & w->letter >> 1);
  w->known = (~m->high & valid) | (left < 64 ? 1ull << left : 0);
  w->stop_any = ~w->letter;
  w->stop_cased = w->stop_any | (m->up & m->lo << 1);
}

/* End of the run of set bits of m from bit k (64 when it reaches the top). */
static inline unsigned run_end(uint64_t m, unsigned k) {
  if (k >= 64) return 64;
  uint64_t r = ~(m >> k);
  return r ? k + (unsigned)__builtin_ctzll(r) : 64;
}

static inline bool bit(uint64_t m, unsigned k) { return k < 64 && (m >> k & 1); }

/* Whether a run that stops at e really ends there: at an ASCII byte, or at the text end. */
static inline bool decided(const window *w, unsigned e) {
  return e < 64 ? w->known >> e & 1 : w->at_end;
}

/* The white-space alternatives on ASCII spaces from k (cl100k: `\s++$` first). */
static unsigned block_space(const window *w, unsigned k, bool cl100k) {
  unsigned e = run_end(w->m.space, k);
  if (!decided(w, e)) return 0;
  bool text_end = e == w->n && w->at_end;
  if (cl100k && text_end) return e;
  uint64_t below_e = e >= 64 ? ~0ull : (1ull << e) - 1;
  uint64_t breaks = w->m.nl & below_e & (~0ull << k);
  if (breaks) return 64 - (unsigned)__builtin_clzll(breaks); /* just past the last break */
  if (text_end) return e;
  return e - 1 > k ? e - 1 : e; /* \s+(?!\S) leaves the last space to the next piece */
}

/* The end (relative to w->at, > k) of the piece at bit k, or 0 when the masks do not
 * decide it. Mirrors the scan_* functions above on ASCII. */
__attribute__((always_inline)) static inline unsigned block_piece(df_scanner sc, const scan *x,
                                                                  const window *w, unsigned k) {
  const df_scan_masks *m = &w->m;
  bool cased = sc == DF_SCAN_O200K || sc == DF_SCAN_KIMI;
  size_t at = w->at;
  uint64_t kb = 1ull << k;
  if (!cased && x->s[at + k] == '\'') { /* cl100k and Qwen try contractions first */
    size_t c = contraction(x, at + k);
    if (c) return k + (unsigned)c;
  }
  if (w->word & kb) { /* letters, after an optional [^\r\n\p{L}\p{N}] */
    /* Cased: [UP]* then [LO]* from p ends at the first stop after p (a non-letter, or an
     * upper-case letter after a lower-case one), one shift and a count instead of two runs.
     * p <= 63, so the shift by p + 1 is two shifts; none before the top: undecided. */
    unsigned p = k + !(w->letter & kb);
    uint64_t after = (cased ? w->stop_cased : w->stop_any) >> p >> 1;
    if (!after) return 0;
    unsigned e = p + 1 + (unsigned)__builtin_ctzll(after);
    if (!(w->known >> e & 1)) return 0;
    if (cased && (m->quote >> e & 1)) e += (unsigned)contraction(x, at + e);
    return e;
  }
  if ((m->high & kb) || ((w->opt & kb) && !decided(w, k + 1))) return 0;
  if (m->digit & kb) {
    if (sc == DF_SCAN_QWEN2 || sc == DF_SCAN_QWEN35) return k + 1;
    unsigned e = run_end(m->digit, k);
    return e - k >= 3 ? k + 3 : decided(w, e) ? e : 0;
  }
  unsigned q = m->other & kb ? k : x->s[at + k] == ' ' && bit(m->other, k + 1) ? k + 1 : 64;
  if (q < 64) { /* ` ?[^\s\p{L}\p{N}]+` then line breaks (and '/' in o200k) */
    unsigned e = run_end(m->other, q);
    if (!decided(w, e)) return 0;
    if (e >= w->n) return e;
    unsigned t = run_end(m->nl | (sc == DF_SCAN_O200K ? m->slash : 0), e);
    return t < w->n || w->at_end ? t : 0;
  }
  return block_space(w, k, sc == DF_SCAN_CL100K);
}

/* ---- the mask scanner (o200k, Kimi K2, Qwen2, Qwen3.5) ------------------------- */
/*
 * Where a window's bytes are ASCII, o200k's and Kimi's pieces (Qwen's too: the differences are
 * marked in mask_starts) start at places a few bit operations on the masks find for all 64
 * bytes at once, so the pieces come without a branch on each one's kind (which the per-piece
 * scanner mispredicted about once a piece). The window starts at a piece start, so nothing
 * before it matters (the class of the byte before bit 0 reads as none). A piece starts at:
 * - a letter after a non-letter, or an upper-case letter after a lower-case one (the cased
 *   words [UP]*[LO]+ | [UP]+[LO]*), unless the byte before it is taken as the word's
 *   optional [^\r\n\p{L}\p{N}]: a space or tab (always at a piece start: see the last rule),
 *   or punctuation that starts its run and has no space before it (a space before it takes
 *   it as ` ?[^\s\p{L}\p{N}]+`, a longer run takes it whole); the piece then starts there;
 * - a digit after a non-digit, and every third digit of a run (\p{N}{1,3});
 * - punctuation after a non-punctuation byte other than a space;
 * - white space after a byte that is not white space, unless it is a line break right after
 *   punctuation (the run's [\r\n]* tail, o200k's [\r\n/]*: a '/' after it falls back);
 * - white space right after a run's last line break (\s*[\r\n]+ ends there);
 * - a run's last byte when it is a space or tab and the text goes on with something else
 *   (\s+(?!\S) leaves it to the next piece);
 * - and a contraction ('s 't 're 've 'm 'll 'd, any case) after a letter belongs to the word:
 *   no piece starts inside it, one starts after it.
 * Which of these hold near the end of the window's ASCII bytes depends on bytes past it, so
 * only pieces that end by `cut` (3 bytes before the first non-ASCII byte or the window's end,
 * and before any white-space run that reaches it) are taken; the text's end decides them all.
 * The Check tests compare every implementation with PCRE2 (test_scanner.c).
 */

/* seed's bits (each one of within's) spread up (to higher bits) through the runs of `within`
 * they are in. One add: a seed bit's carry runs up through its run's bits and clears them,
 * so the bits the add changed, within the runs, are the run from the seed up (a second seed
 * in a run that a lower one's carry passed is changed back: the or puts it in again). Six
 * doubling steps did it before, as smear_down still must (a carry runs only upward). */
static inline uint64_t smear_up(uint64_t seed, uint64_t within) {
  return seed | (((within + seed) ^ within) & within);
}

/* seed's bits spread down (to lower bits) through the runs of `within` they touch: six doubling
 * steps (unrolled: gcc left the loop rolled). */
static inline uint64_t smear_down(uint64_t seed, uint64_t within) {
#pragma GCC unroll 6
  for (unsigned sh = 1; sh < 64; sh <<= 1) {
    seed |= (seed >> sh) & within;
    within &= within >> sh;
  }
  return seed;
}

static inline uint64_t below(unsigned k) { return k >= 64 ? ~0ull : (1ull << k) - 1; }

/* Every third digit of each run, from its first. */
static inline uint64_t digit_starts(uint64_t d) {
  uint64_t first = d & ~(d << 1), all = first, third = d & d << 1 & d << 2;
  for (uint64_t c = first; (c = c << 3 & third);) all |= c;
  return all;
}

/* Piece starts of the window's bytes below its first non-ASCII byte, and in *cut how far they
 * are decided (a piece that ends by it is exact). False: the per-piece scanner takes it. */
static bool mask_starts(df_scanner sc, const scan *x, const window *w, uint64_t *starts,
                        unsigned *cut) {
  const df_scan_masks *m = &w->m;
  unsigned h = m->high ? (unsigned)__builtin_ctzll(m->high) : w->n;
  bool end = w->at_end && h == w->n; /* the text ends at h: nothing past it to wait for */
  if (!end && h < 8) return false;
  uint64_t v = below(h);
  uint64_t letter = (m->up | m->lo) & v, lo = m->lo & v, up = m->up & v, ws = m->space & v;
  uint64_t nl = m->nl & v, punct = m->other & v, blank = m->blank & v, tab = ws & ~nl & ~blank;
  uint64_t word = letter & ~(letter << 1);
  uint64_t punct_first = punct & ~(punct << 1) & ~(blank << 1);
  uint64_t opt = (word >> 1) & (blank | tab | punct_first);
  bool cased = sc == DF_SCAN_O200K || sc == DF_SCAN_KIMI; /* else Qwen: \p{L}+, \p{N} */
  uint64_t s = ((word | (cased ? up & lo << 1 : 0)) & ~(opt << 1)) | opt | punct_first;
  s |= cased ? digit_starts(m->digit & v) : m->digit & v;
  uint64_t tail = smear_up(nl & punct << 1, nl);
  uint64_t rest = ws & ~tail;
  uint64_t has_nl = smear_down(nl & rest, rest);
  s |= (rest & ~(rest << 1)) | (rest & ~has_nl & has_nl << 1);
  s |= (blank | tab) & rest & ~(ws >> 1) & below(h - 1); /* a run's last space or tab */
  unsigned c = end ? h : h - 3;
  uint64_t late = ws & ~below(c - 1); /* a white-space run that reaches the cut: not decided */
  if (!end && late) {
    unsigned p = (unsigned)__builtin_ctzll(late);
    uint64_t gaps = ~ws & below(p);
    c = gaps ? 64 - (unsigned)__builtin_clzll(gaps) : 0;
  }
  if (sc == DF_SCAN_O200K) { /* [\r\n/]*: a '/' after the line breaks joins them */
    uint64_t slash = (tail << 1) & m->slash & v;
    if (slash && (unsigned)__builtin_ctzll(slash) <= c) return false;
  }
  /* o200k, Kimi: a word takes the contraction after it. Qwen tries contractions first at a
   * piece start: one there is a piece of its own (a quote after a space or punctuation is in
   * their piece, not at a start). */
  for (uint64_t q = m->quote & v & (cased ? letter << 1 : s); q; q &= q - 1) {
    unsigned k = (unsigned)__builtin_ctzll(q);
    size_t at = w->at + k, n = contraction(x, at);
    if (!n) continue;
    if (cased && at + n < x->len && x->s[at + n] == '\'' && k < c) return false; /* it's's */
    s &= ~(below((unsigned)n) << k);
    s |= cased ? 0 : 1ull << k;
    if (k + n < 64) s |= 1ull << (k + n);
  }
  *starts = s;
  *cut = c;
  return true;
}

/* The pieces of the window from mask_starts, appended to out (at most cap in all): how far
 * they reach (relative to w->at), 0 when none is decided. */
static unsigned mask_window(df_scanner sc, const scan *x, const window *w, size_t shift,
                            df_range *out, size_t cap, size_t *n_out) {
  uint64_t s;
  unsigned cut;
  if (!mask_starts(sc, x, w, &s, &cut) || !(s & 1)) return 0;
  bool end = cut == w->n && w->at_end;
  unsigned limit = end ? cut : 63 - (unsigned)__builtin_clzll(s & below(cut + 1));
  size_t n = *n_out, at = shift + w->at;
  unsigned b = 0;
  uint64_t e = s & below(limit) & ~1ull;
  /* Room for all (at most 64 a window): no test of it per piece. One loop with the test was
   * ~3 % slower on drv2 (three paired runs). */
  if (cap - n >= 64)
    for (; e; e &= e - 1) {
      unsigned k = (unsigned)__builtin_ctzll(e);
      out[n++] = (df_range){at + b, at + k};
      b = k;
    }
  for (; e && n < cap; e &= e - 1) {
    unsigned k = (unsigned)__builtin_ctzll(e);
    out[n++] = (df_range){at + b, at + k};
    b = k;
  }
  if (n < cap && b < limit) {
    out[n++] = (df_range){at + b, at + limit};
    b = limit;
  }
  *n_out = n;
  return b;
}

/* Pieces by df_scan_next from `pos` while the text there is not ASCII (where the block
 * scanner would only fall back again), at least one. */
static size_t piece_run(df_scanner sc, const scan *x, size_t pos, size_t shift, df_range *out,
                        size_t cap, size_t *n_out, bool one) {
  size_t n = *n_out;
  while (pos < x->len && n < cap) {
    size_t k = df_scan_next(sc, x->s, x->len, pos);
    if (!k) break;
    out[n++] = (df_range){shift + pos, shift + pos + k};
    pos += k;
    if (one && (pos + 1 >= x->len || (x->s[pos] < 0x80 && x->s[pos + 1] < 0x80))) break;
  }
  *n_out = n;
  return pos;
}

/* The block loop for one pattern (inlined per pattern, so `sc` is a constant and the
 * tests on it fold away). */
__attribute__((always_inline)) static inline size_t block_pieces(df_scanner sc, const scan *x,
                                                                 size_t pos, size_t shift,
                                                                 df_range *out, size_t cap,
                                                                 size_t *stop) {
  size_t n = 0;
  window w;
  const bool masks = (g_impl == DF_SCAN_MASK || g_impl == DF_SCAN_MASK_AVX2) &&
                     sc != DF_SCAN_CL100K; /* (cl100k's white space differs: \s++$, \s*[\r\n]) */
  while (pos < x->len && n < cap) {
    load_window(x, pos, &w);
    if (masks) {
      unsigned got = mask_window(sc, x, &w, shift, out, cap, &n);
      if (got) {
        pos += got;
        continue;
      }
    }
    unsigned k = 0, end;
    const size_t at = shift + pos;
    while (k < w.n && n < cap && (end = block_piece(sc, x, &w, k))) {
      out[n++] = (df_range){at + k, at + end};
      k = end;
    }
    pos += k;
    /* Undecided at k: if a non-ASCII byte lies ahead in the window, the piece reached it
     * (an ASCII run that reaches the window's end passes none), and a new window would
     * stop there again; so would one that starts at k = 0. Else it straddles the end. */
    if (n < cap && k < w.n && (k == 0 || w.m.high >> k)) {
      size_t before = n;
      pos = piece_run(sc, x, pos, shift, out, cap, &n, true);
      if (n == before) break; /* nothing matches here */
    }
  }
  *stop = pos;
  return n;
}

size_t df_scan_pieces(df_scanner sc, const uint8_t *text, size_t len, size_t pos, size_t shift,
                      df_range *out, size_t cap, size_t *stop) {
  scan x = {text, len};
  size_t n = 0;
  if (g_impl == DF_SCAN_PIECE) {
    *stop = piece_run(sc, &x, pos, shift, out, cap, &n, false);
    return n;
  }
  switch (sc) {
  case DF_SCAN_CL100K: return block_pieces(DF_SCAN_CL100K, &x, pos, shift, out, cap, stop);
  case DF_SCAN_O200K: return block_pieces(DF_SCAN_O200K, &x, pos, shift, out, cap, stop);
  case DF_SCAN_KIMI: return block_pieces(DF_SCAN_KIMI, &x, pos, shift, out, cap, stop);
  case DF_SCAN_QWEN2: return block_pieces(DF_SCAN_QWEN2, &x, pos, shift, out, cap, stop);
  case DF_SCAN_QWEN35: return block_pieces(DF_SCAN_QWEN35, &x, pos, shift, out, cap, stop);
  case DF_SCAN_NONE: break;
  }
  *stop = pos;
  return 0;
}
