/* Text helpers: regex translation, UTF-8 repair (Python's "replace"), NFC. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "testutil.h"
#include "tokenizer/tok_internal.h"

START_TEST(regex_translation) {
  char *out;
  ck_assert_ok(df_regex_translate("[\\p{Lu}\\p{M}&&[^\\p{Han}]]*", &out));
  ck_assert_str_eq(out, "(?:(?=[^\\p{sc=Han}])[\\p{Lu}\\p{M}])*");
  free(out);
  ck_assert_ok(df_regex_translate("\\p{Han}+|\\p{L}|\\p{Greek}", &out));
  ck_assert_str_eq(out, "\\p{sc=Han}+|\\p{L}|\\p{sc=Greek}");
  free(out);
  ck_assert_ok(df_regex_translate("\\s+(?!\\S)", &out));
  ck_assert_ptr_nonnull(strstr(out, "\\x{3000}"));
  ck_assert_ptr_null(strstr(out, "\\s"));
  free(out);
  ck_assert_ok(df_regex_translate("[^\\s\\p{L}]", &out));
  ck_assert(out[0] == '[' && out[1] == '^' && strstr(out, "\\x{85}") && strstr(out, "\\p{L}]"));
  free(out);
  ck_assert_status(df_regex_translate("[a[bc]]", &out), DFLASH_E_UNSUPPORTED, "nested");
  ck_assert_status(df_regex_translate("[abc", &out), DFLASH_E_REGEX, "unterminated");
}
END_TEST

static void repaired(const char *in, size_t n, const char *want) {
  df_buf b = {0};
  bool changed;
  ck_assert_ok(df_utf8_repair(in, n, &b, &changed));
  ck_assert(changed);
  ck_assert_uint_eq(b.len, strlen(want));
  ck_assert_int_eq(memcmp(b.data, want, b.len), 0);
  df_buf_free(&b);
}

/* Expected strings are Python's bytes.decode("utf-8", "replace"). */
START_TEST(utf8_repair_matches_python) {
#define FFFD "\xEF\xBF\xBD"
  repaired("\xff", 1, FFFD);
  repaired("\xed\xa0\x80", 3, FFFD FFFD FFFD);
  repaired("abc\xe2\x82", 5, "abc" FFFD);
  repaired("\xf0\x9f\x98x", 4, FFFD "x");
  repaired("\xc0\x80", 2, FFFD FFFD);
  repaired("\xf4\x90\x80\x80", 4, FFFD FFFD FFFD FFFD);
  repaired("\xe0\x80\xaf", 3, FFFD FFFD FFFD);
  repaired("a\x80\xe6\x97\xa5", 5, "a" FFFD "\xe6\x97\xa5");
  df_buf b = {0};
  bool changed = true;
  ck_assert_ok(df_utf8_repair("ok \xe6\x97\xa5", 6, &b, &changed));
  ck_assert(!changed);
  df_buf_free(&b);
#undef FFFD
}
END_TEST

START_TEST(nfc) {
  df_buf b = {0};
  bool changed;
  ck_assert_ok(df_nfc("cafe\xcc\x81", 6, &b, &changed));
  ck_assert(changed);
  ck_assert_uint_eq(b.len, 5);
  ck_assert_int_eq(memcmp(b.data, "caf\xc3\xa9", 5), 0);
  ck_assert_ok(df_nfc("plain ascii", 11, &b, &changed));
  ck_assert(!changed);
  ck_assert_ok(df_nfc("\xe6\x97\xa5\xe6\x9c\xac", 6, &b, &changed));
  ck_assert(!changed);
  /* U+11A7 after an LV syllable stays (utf8proc 2.8 drops it): the expected bytes are
   * Python's unicodedata.normalize("NFC", ...) of U+AC8C U+11A7 and of U+1100 U+1161 U+11A7
   * U+11A8 (U+AC00 U+11A7 U+11A8: nothing composes across U+11A7). */
  ck_assert_ok(df_nfc("\xea\xb2\x8c\xe1\x86\xa7", 6, &b, &changed));
  ck_assert(!changed);
  ck_assert(!df_utf8_quick_nfc("\xe1\x84\x80", 3)); /* an L jamo may compose */
  ck_assert_ok(df_nfc("\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa7\xe1\x86\xa8", 12, &b, &changed));
  ck_assert(changed);
  ck_assert_uint_eq(b.len, 9);
  ck_assert_int_eq(memcmp(b.data, "\xea\xb0\x80\xe1\x86\xa7\xe1\x86\xa8", 9), 0);
  df_buf_free(&b);
}
END_TEST

/* Characters around which NFC spans begin and end: letters that compose with
 * a following mark, marks of several classes (reordered), Hangul L/V/T jamo and
 * LV syllables, singletons (U+212B, U+0340), starters that compose as second
 * (U+0CD5 after U+0CBF, U+0DCA..), precomposed letters that compose again
 * (U+00EA + U+0301), CJK and ASCII. */
static const uint32_t NFC_ALPHABET[] = {'a',     'e',    'o',    ' ',    'A',    0x00EA, 0x00E9,
                                        0x01B0,  0x0300, 0x0301, 0x0302, 0x0308, 0x0323, 0x0327,
                                        0x031B,  0x0345, 0x05B0, 0x0591, 0x1100, 0x1161, 0x11A8,
                                        0xAC00,  0xAC01, 0x212B, 0x0340, 0x0344, 0x0CBF, 0x0CD5,
                                        0x0DD9,  0x0DCA, 0x0DCF, 0x0B47, 0x0B3E, 0x0B57, 0x3099,
                                        0x304B,  0x65E5, 0x1E0D, 0x0391, 0x1F00, 0x0915, 0x093C,
                                        0x1D15E, 0x0627, 0x0654, 0x0655, 0x3131, 0xFB2C, 0x05BC,
                                        0x05C1};

static size_t put_utf8(uint32_t c, char *o) {
  if (c < 0x80) return o[0] = (char)c, 1;
  if (c < 0x800) return o[0] = (char)(0xC0 | c >> 6), o[1] = (char)(0x80 | (c & 0x3F)), 2;
  if (c < 0x10000)
    return o[0] = (char)(0xE0 | c >> 12), o[1] = (char)(0x80 | (c >> 6 & 0x3F)),
           o[2] = (char)(0x80 | (c & 0x3F)), 3;
  return o[0] = (char)(0xF0 | c >> 18), o[1] = (char)(0x80 | (c >> 12 & 0x3F)),
         o[2] = (char)(0x80 | (c >> 6 & 0x3F)), o[3] = (char)(0x80 | (c & 0x3F)), 4;
}

/* df_nfc normalises only spans; utf8proc over the whole text is the reference. */
START_TEST(nfc_spans_match_whole_text) {
  enum { N_ALPHA = sizeof NFC_ALPHABET / sizeof *NFC_ALPHABET };
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  char text[4 * 24];
  df_buf b = {0};
  for (int round = 0; round < 50000; round++) {
    size_t n = 0, k = 1 + (size_t)(round % 24);
    for (size_t j = 0; j < k; j++) {
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      n += put_utf8(NFC_ALPHABET[(rng >> 33) % N_ALPHA], text + n);
    }
    utf8proc_uint8_t *want = NULL;
    utf8proc_ssize_t m = utf8proc_map((const utf8proc_uint8_t *)text, (utf8proc_ssize_t)n, &want,
                                      UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    ck_assert_int_ge(m, 0);
    bool changed;
    ck_assert_ok(df_nfc(text, n, &b, &changed));
    const char *got = changed ? b.data : text;
    size_t got_n = changed ? b.len : n;
    if (got_n != (size_t)m || memcmp(got, want, got_n))
      ck_abort_msg("NFC differs from utf8proc on round %d (%zu bytes)", round, n);
    ck_assert(changed == ((size_t)m != n || memcmp(want, text, n) != 0));
    free(want);
  }
  df_buf_free(&b);
}
END_TEST

/* df_nfc_regions runs df_nfc only around the bytes from 0xCC, regions cut at ASCII bytes with
 * none in the 64 after them: texts of the alphabet above with ASCII runs of 0 to 150 bytes in
 * between (so regions merge, split, start at the text's start and end at its end), against
 * utf8proc over the whole text. */
START_TEST(nfc_regions_match_whole_text) {
  enum { N_ALPHA = sizeof NFC_ALPHABET / sizeof *NFC_ALPHABET };
  uint64_t rng = 0xD1B54A32D192ED03ull;
  char text[8 * (4 + 150)];
  df_buf b = {0}, part = {0};
  for (int round = 0; round < 20000; round++) {
    size_t n = 0, k = 1 + (size_t)(round % 8);
    for (size_t j = 0; j < k; j++) {
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      size_t gap = (rng >> 20) % 4 ? 0 : (size_t)((rng >> 40) % 151);
      for (size_t g = 0; g < gap; g++) text[n++] = (char)('a' + (g * 7 + j) % 26);
      n += put_utf8(NFC_ALPHABET[(rng >> 33) % N_ALPHA], text + n);
    }
    utf8proc_uint8_t *want = NULL;
    utf8proc_ssize_t m = utf8proc_map((const utf8proc_uint8_t *)text, (utf8proc_ssize_t)n, &want,
                                      UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    ck_assert_int_ge(m, 0);
    bool changed;
    ck_assert_ok(df_nfc_regions(text, n, &b, &part, &changed));
    const char *got = changed ? b.data : text;
    size_t got_n = changed ? b.len : n;
    if (got_n != (size_t)m || memcmp(got, want, got_n))
      ck_abort_msg("NFC regions differ from utf8proc on round %d (%zu bytes)", round, n);
    ck_assert(changed == ((size_t)m != n || memcmp(want, text, n) != 0));
    free(want);
  }
  df_buf_free(&b);
  df_buf_free(&part);
}
END_TEST

/* Whether the scalar repair finds s[0..n) valid (the reference for the AVX2 check). */
static bool scalar_valid(const uint8_t *s, size_t n) {
  df_buf b = {0};
  bool changed = false;
  /* no ck_assert in these loops: Check records every passing one */
  df_utf8_set_avx2(false);
  if (df_utf8_repair((const char *)s, n, &b, &changed)) ck_abort_msg("repair failed");
  df_buf_free(&b);
  df_utf8_set_avx2(true);
  return !changed;
}

/* seq (n bytes) placed inside ASCII at `at` of a `len`-byte buffer: across the vector's
 * 32-byte boundary, at the start and at the end of the text. */
static void check_placed(const uint8_t *seq, size_t n, size_t at, size_t len) {
  uint8_t buf[96];
  memset(buf, 'a', sizeof buf);
  memcpy(buf + at, seq, n);
  bool want = scalar_valid(buf, len);
  if (df_utf8_valid_avx2(buf, len) != want)
    ck_abort_msg("AVX2 says %svalid for %02x %02x %02x %02x (%zu bytes) at %zu of %zu",
                 want ? "in" : "", seq[0], n > 1 ? seq[1] : 0, n > 2 ? seq[2] : 0,
                 n > 3 ? seq[3] : 0, n, at, len);
}

/* The AVX2 check agrees with the scalar repair: every 1- and 2-byte string, every 3-byte one
 * that starts with a lead byte and ends on a boundary value, 4-byte ones over the boundary values of each position, each
 * across a block boundary and at both ends of the text; then random byte strings drawn from
 * those values. */
START_TEST(utf8_simd) {
  if (!df_utf8_set_avx2(true)) {
    printf("utf8_simd: skipped, this CPU has no AVX2\n");
    return;
  }
  static const uint8_t edge[] = {0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0,
                                 0xC1, 0xC2, 0xDF, 0xE0, 0xE1, 0xEC, 0xED, 0xEE, 0xEF, 0xF0,
                                 0xF1, 0xF3, 0xF4, 0xF5, 0xF7, 0xF8, 0xFE, 0xFF};
  const size_t spots[][2] = {{30, 64}, {0, 40}, {61, 64}, {33, 36}};
  uint8_t q[4];
  for (unsigned a = 0; a < 256; a++)
    for (unsigned b = 0; b < 256; b++) {
      q[0] = (uint8_t)a, q[1] = (uint8_t)b;
      for (size_t k = 0; k < DF_ARRAY_LEN(spots); k++) {
        check_placed(q, 1, spots[k][0] + 1, spots[k][1]);
        check_placed(q, 2, spots[k][0], spots[k][1]);
      }
      for (size_t c = 0; a >= 0xC0 && c < sizeof edge; c++) {
        q[2] = edge[c];
        check_placed(q, 3, 30, 64);
        check_placed(q, 3, 61, 64);
      }
    }
  for (size_t a = 0; a < sizeof edge; a++)
    for (size_t b = 0; b < sizeof edge; b++)
      for (size_t c = 0; c < sizeof edge; c++)
        for (size_t d = 0; d < sizeof edge; d++) {
          q[0] = edge[a], q[1] = edge[b], q[2] = edge[c], q[3] = edge[d];
          check_placed(q, 4, 29, 64);
          check_placed(q, 4, 60, 64);
        }
  unsigned seed = 7;
  uint8_t text[300];
  for (int round = 0; round < 50000; round++) {
    size_t n = (size_t)rand_r(&seed) % sizeof text;
    for (size_t i = 0; i < n; i++) text[i] = edge[(size_t)rand_r(&seed) % sizeof edge];
    bool want = scalar_valid(text, n);
    if (df_utf8_valid_avx2(text, n) != want)
      ck_abort_msg("AVX2 and scalar differ on random round %d (%zu bytes)", round, n);
  }
  /* Valid text through df_utf8_repair with the check on. */
  df_buf out = {0};
  bool changed = true;
  const char *ok = "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80 and some ASCII";
  ck_assert_ok(df_utf8_repair(ok, strlen(ok), &out, &changed));
  ck_assert(!changed);
  df_buf_free(&out);
}
END_TEST

TCase *tc_tok_text(void) {
  TCase *tc = tcase_create("text");
  tcase_add_test(tc, regex_translation);
  tcase_add_test(tc, utf8_repair_matches_python);
  tcase_add_test(tc, utf8_simd);
  tcase_add_test(tc, nfc);
  tcase_add_test(tc, nfc_spans_match_whole_text);
  tcase_add_test(tc, nfc_regions_match_whole_text);
  return tc;
}
