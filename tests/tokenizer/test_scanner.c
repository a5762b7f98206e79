/* The hand-written scanners split exactly where their regexes do. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tokenizer/tok_internal.h"

/* Characters chosen to sit on every class boundary the patterns care about. */
static const char *const ALPHABET[] = {
    "a",
    "z",
    "A",
    "Z",
    "s",
    "S",
    "t",
    "l",
    "L",
    "e",
    "r",
    "v",
    "d",
    "m",
    "0",
    "7",
    " ",
    " ",
    "\t",
    "\r",
    "\n",
    "'",
    "'",
    ".",
    ",",
    "/",
    "!",
    "-",
    "_",
    "\xc5\xbf" /* long s */,
    "\xcc\x81" /* U+0301 Mn */,
    "\xe0\xa4\x83" /* U+0903 Mc */,
    "\xc7\x85" /* U+01C5 Lt */,
    "\xca\xb0" /* U+02B0 Lm */,
    "\xe6\x97\xa5" /* Han Lo */,
    "\xe3\x80\x85" /* U+3005 Lm Han */,
    "\xe3\x80\x87" /* U+3007 Nl Han */,
    "\xe3\x80\x81" /* U+3001 */,
    "\xe3\x80\x82",
    "\xc2\xa0" /* NBSP */,
    "\xe3\x80\x80" /* U+3000 */,
    "\xc2\x85" /* NEL */,
    "\xe1\xa0\x8e" /* U+180E, not White_Space */,
    "\xe2\x80\xa8" /* U+2028 */,
    "\xc2\xbd" /* No */,
    "\xd9\xa3" /* Arabic-Indic 3 */,
    "\xce\xa9",
    "\xc3\x9f",
    "\xf0\x9f\x98\x80" /* emoji */,
    "\xef\xb8\x8f" /* VS16 Mn */,
    "\xe2\x80\x8d" /* ZWJ Cf */,
    "\xee\x80\x80" /* PUA */,
    "\xe2\xba\x80" /* U+2E80 radical, Han So */,
    "\xf0\xa0\x80\x80" /* U+20000 Han */,
    "\xe0\xb8\x81" /* Thai */,
    "\xe0\xb8\xb4" /* Thai Mn */,
    "\xd8\xa8" /* Arabic */,
    "\xcb\x86" /* U+02C6 Lm */,
    "\xe1\xbe\x88" /* U+1F88 Lt */,
    "\xf0\x9d\x9f\x8e" /* math digit */,
};

/* One pattern twice: with its hand-written scanner and with the PCRE2 regex alone. */
typedef struct scan_pair {
  const char *pattern;
  df_pretok with, without;
  df_pretok_scratch s1, s2;
} scan_pair;

static void pair_open(scan_pair *p, const char *pattern) {
  *p = (scan_pair){.pattern = pattern};
  ck_assert_ok(
      df_pretok_add_regex(&p->with, pattern, false, DF_SPLIT_ISOLATED, false, false, NULL));
  ck_assert_ok(
      df_pretok_add_regex(&p->without, pattern, false, DF_SPLIT_ISOLATED, false, false, NULL));
  ck_assert_int_ne(p->with.steps[0].scanner, DF_SCAN_NONE);
  p->without.steps[0].scanner = DF_SCAN_NONE;
}

/* Both split `text` into the same pieces. */
static void pair_check(scan_pair *p, const char *text, size_t len) {
  const char *b1, *b2;
  df_ranges *r1, *r2;
  ck_assert_ok(df_pretok_run(&p->with, text, len, &p->s1, &b1, &r1));
  ck_assert_ok(df_pretok_run(&p->without, text, len, &p->s2, &b2, &r2));
  bool same = r1->len == r2->len && !memcmp(r1->v, r2->v, r1->len * sizeof *r1->v);
  ck_assert_msg(same, "%s: scanner and regex split \"%.*s\" differently", p->pattern, (int)len,
                text);
}

static void pair_close(scan_pair *p) {
  df_pretok_scratch_free(&p->s1);
  df_pretok_scratch_free(&p->s2);
  df_pretok_free(&p->with);
  df_pretok_free(&p->without);
}

static void compare(scan_pair *p) {
  unsigned seed = 2024;
  char text[512];
  for (int iter = 0; iter < 60000 / DF_TEST_STRIDE; iter++) { /* a quarter under sanitizers */
    size_t len = 0, n = (size_t)(rand_r(&seed) % 24);
    /* favour runs: repeat a small sub-alphabet */
    size_t span = 2 + (size_t)(rand_r(&seed) % DF_ARRAY_LEN(ALPHABET));
    size_t base = (size_t)rand_r(&seed) % (DF_ARRAY_LEN(ALPHABET) - 1);
    for (size_t k = 0; k < n; k++) {
      const char *c = ALPHABET[(base + (size_t)rand_r(&seed) % span) % DF_ARRAY_LEN(ALPHABET)];
      memcpy(text + len, c, strlen(c));
      len += strlen(c);
    }
    pair_check(p, text, len);
  }
}

/* A code point anywhere in Unicode (no surrogates), or ASCII half the time, so every
 * block of the scanner's two-level class table is read with ASCII around it. */
static uint32_t random_code_point(unsigned *seed) {
  uint32_t r = (uint32_t)rand_r(seed);
  if (r % 2) return (uint32_t)rand_r(seed) % 128;
  uint32_t c = (uint32_t)rand_r(seed) % (r % 3 ? 0x10000u : 0x110000u); /* favour the BMP */
  return c >= 0xD800 && c <= 0xDFFF ? c - 0x800 : c;
}

/* The scanner against the regex on strings of code points drawn from all of Unicode. */
static void compare_random_unicode(scan_pair *p) {
  unsigned seed = 7;
  char text[16 * 4];
  for (int iter = 0; iter < 40000 / DF_TEST_STRIDE; iter++) {
    size_t len = 0, n = 1 + (size_t)(rand_r(&seed) % 16);
    for (size_t k = 0; k < n; k++) len += df_utf8_put(text + len, random_code_point(&seed));
    pair_check(p, text, len);
  }
}

static const char *const PATTERNS[] = {"cl100k", "o200k", "kimi-k2", "qwen2", "qwen3.5"};
static const df_scan_impl IMPLS[] = {DF_SCAN_PIECE, DF_SCAN_BLOCK, DF_SCAN_BLOCK_AVX2, DF_SCAN_MASK,
                                     DF_SCAN_MASK_AVX2};

/* Loop index -> (pattern, implementation); false when this CPU lacks the implementation
 * (AVX2), after which the test checks nothing. Call after pair_open (which loads the
 * scanner tables); undo with df_scan_set_impl(saved). */
static bool pick_impl(int i, df_scan_impl *saved) {
  *saved = df_scan_get_impl();
  return df_scan_set_impl(IMPLS[i % DF_ARRAY_LEN(IMPLS)]);
}

START_TEST(scanners_agree_on_random_unicode) {
  scan_pair p;
  pair_open(&p, PATTERNS[_i / (int)DF_ARRAY_LEN(IMPLS)]);
  df_scan_impl saved;
  if (pick_impl(_i, &saved)) compare_random_unicode(&p);
  df_scan_set_impl(saved);
  pair_close(&p);
}
END_TEST

START_TEST(scanners_agree_with_regex) {
  scan_pair p;
  pair_open(&p, PATTERNS[_i / (int)DF_ARRAY_LEN(IMPLS)]);
  df_scan_impl saved;
  if (pick_impl(_i, &saved)) compare(&p);
  df_scan_set_impl(saved);
  pair_close(&p);
}
END_TEST

/* Text that puts `piece` at byte `at` of ASCII filler `fill` (repeated) and ends after
 * `tail` more bytes of it: every piece at every position of a 64-byte block. */
static size_t place(char *text, const char *fill, size_t at, const char *piece, size_t tail) {
  size_t len = 0, f = strlen(fill);
  for (size_t k = 0; k < at; k++) text[len++] = fill[k % f];
  memcpy(text + len, piece, strlen(piece));
  len += strlen(piece);
  for (size_t k = 0; k < tail; k++) text[len++] = fill[k % f];
  return len;
}

/* Pieces the block scanner decides from its masks, and the characters that make it fall
 * back, put across the 64-byte block boundaries in every position (in a sanitizer build,
 * every DF_TEST_STRIDE-th, starting where the fill and the piece say: all positions across
 * them). */
static void compare_block_boundaries(scan_pair *p) {
  static const char *const fills[] = {"a", " ", ".", "Ab c1'", "xY\n 9/", "  \t"};
  static const char *const pieces[] = {
      "Hello",
      " world",
      "'s",
      "'RE x",
      "don't",
      "123456",
      "12",
      " \n\n  x",
      "a  \r\n",
      "...",
      " ...\n/\n/",
      "ABCdef",
      "ABC",
      "\xc3\xa9t\xc3\xa9",
      "\xe6\x97\xa5\xe6\x9c\xac",
      " \xc2\xa0x",
      "x\xcc\x81y",
      "'\xc5\xbf",
      "7\xd9\xa3",
      ".\xc3\xa9",
      " \xe3\x80\x82",
      "\xf0\x9f\x98\x80!",
      "A\xc7\x85\x62" /* Lt between ASCII letters */,
      "  ",
      "\t.",
  };
  char text[256];
  for (size_t f = 0; f < DF_ARRAY_LEN(fills); f++)
    for (size_t k = 0; k < DF_ARRAY_LEN(pieces); k++)
      for (size_t at = (f + k) % DF_TEST_STRIDE; at < 140; at += DF_TEST_STRIDE) {
        pair_check(p, text, place(text, fills[f], at, pieces[k], 0));
        pair_check(p, text, place(text, fills[f], at, pieces[k], 3));
        pair_check(p, text, place(text, fills[f], at, pieces[k], 70));
      }
}

/* Runs longer than a block (spaces, letters, digits, punctuation, line breaks), each
 * broken at every position by a non-ASCII or another ASCII character. */
static void compare_long_runs(scan_pair *p) {
  static const char *const runs[] = {" ", "a", "Z", "7", "-", "\n", " \n", "aB", "/"};
  static const char *const breaks[] = {"x",        " ",        "'s", "\xc2\xa0",
                                       "\xc3\xa9", "\xd9\xa3", "\n", "."};
  char text[512];
  for (size_t r = 0; r < DF_ARRAY_LEN(runs); r++)
    for (size_t b = 0; b < DF_ARRAY_LEN(breaks); b++)
      for (size_t at = 0; at < 200; at += 1 + at / 40)
        for (size_t tail = 0; tail < 200; tail += 67)
          pair_check(p, text, place(text, runs[r], at, breaks[b], tail));
}

START_TEST(block_scanner_agrees_across_blocks) {
  scan_pair p;
  pair_open(&p, PATTERNS[_i / (int)DF_ARRAY_LEN(IMPLS)]);
  df_scan_impl saved;
  if (pick_impl(_i, &saved)) {
    compare_block_boundaries(&p);
    compare_long_runs(&p);
  }
  df_scan_set_impl(saved);
  pair_close(&p);
}
END_TEST

/* Long random texts, mostly ASCII with non-ASCII characters among them, so blocks mix. */
static void compare_long_mixed(scan_pair *p) {
  unsigned seed = 99;
  char text[400 * 4];
  for (int iter = 0; iter < 3000 / DF_TEST_STRIDE; iter++) {
    size_t len = 0, n = 1 + (size_t)(rand_r(&seed) % 400);
    unsigned ascii_share = (unsigned)rand_r(&seed) % 100;
    for (size_t k = 0; k < n; k++) {
      const char *c = ALPHABET[(size_t)rand_r(&seed) % DF_ARRAY_LEN(ALPHABET)];
      if ((unsigned)rand_r(&seed) % 100 < ascii_share)
        while ((uint8_t)c[0] >= 0x80) c = ALPHABET[(size_t)rand_r(&seed) % DF_ARRAY_LEN(ALPHABET)];
      memcpy(text + len, c, strlen(c));
      len += strlen(c);
    }
    pair_check(p, text, len);
  }
}

START_TEST(block_scanner_agrees_on_long_mixed_text) {
  scan_pair p;
  pair_open(&p, PATTERNS[_i / (int)DF_ARRAY_LEN(IMPLS)]);
  df_scan_impl saved;
  if (pick_impl(_i, &saved)) compare_long_mixed(&p);
  df_scan_set_impl(saved);
  pair_close(&p);
}
END_TEST

/* The default is the block scanner with AVX2 where the CPU has it: the fast path is the
 * one that runs (unless DFLASH_TOKENIZER_NO_SIMD is set for the test). */
START_TEST(block_scanner_is_the_default_with_avx2) {
  scan_pair p;
  pair_open(&p, "o200k");
  bool avx2 = df_scan_cpu_has_avx2() && !df_env_on(getenv("DFLASH_TOKENIZER_NO_SIMD"));
  ck_assert_int_eq(df_scan_get_impl(), avx2 ? DF_SCAN_MASK_AVX2 : DF_SCAN_PIECE);
  pair_close(&p);
}
END_TEST

TCase *tc_tok_scanner(void);
TCase *tc_tok_scanner(void) {
  TCase *tc = tcase_create("scanner");
  int n = (int)(DF_ARRAY_LEN(PATTERNS) * DF_ARRAY_LEN(IMPLS));
  tcase_add_loop_test(tc, scanners_agree_with_regex, 0, n);
  tcase_add_loop_test(tc, scanners_agree_on_random_unicode, 0, n);
  tcase_add_loop_test(tc, block_scanner_agrees_across_blocks, 0, n);
  tcase_add_loop_test(tc, block_scanner_agrees_on_long_mixed_text, 0, n);
  tcase_add_test(tc, block_scanner_is_the_default_with_avx2);
  return tc;
}
