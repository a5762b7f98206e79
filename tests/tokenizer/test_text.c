/* Text helpers: regex translation, UTF-8 repair (Python's "replace"), NFC. */
#include <stdlib.h>
#include <string.h>

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
  df_buf_free(&b);
}
END_TEST

TCase *tc_tok_text(void) {
  TCase *tc = tcase_create("text");
  tcase_add_test(tc, regex_translation);
  tcase_add_test(tc, utf8_repair_matches_python);
  tcase_add_test(tc, nfc);
  return tc;
}
