#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "testutil.h"

START_TEST(utf8_validation_rejects_what_python_rejects) {
  static const struct {
    const char *s;
    bool ok;
  } cases[] = {
      {"plain", true},         {"caf\xc3\xa9", true},
      {"\xe4\xb8\xad", true},  {"\xf0\x9f\x98\x80", true},
      {"\xc3", false},         {"\xc0\xaf", false},
      {"\xed\xa0\x80", false}, {"\xf4\x90\x80\x80", false},
      {"\x80", false},         {"\xe0\x80\xaf", false},
  };
  for (size_t i = 0; i < DF_ARRAY_LEN(cases); i++)
    ck_assert_msg(df_utf8_valid(cases[i].s, strlen(cases[i].s)) == cases[i].ok, "case %zu", i);
}
END_TEST

START_TEST(paths_and_buffers) {
  char *p = df_path_join("a/b/", "c.json");
  ck_assert_str_eq(p, "a/b/c.json");
  free(p);
  p = df_path_dirname("a/b/c.json");
  ck_assert_str_eq(p, "a/b");
  free(p);
  p = df_path_dirname("c.json");
  ck_assert_str_eq(p, ".");
  free(p);
  df_buf b = {0};
  for (int i = 0; i < 1000; i++) ck_assert_ok(df_buf_printf(&b, "%d,", i));
  ck_assert_uint_eq(b.len, strlen(b.data));
  ck_assert(df_str_ends_with(b.data, "998,999,"));
  df_buf_free(&b);
  uint64_t out;
  ck_assert(!df_mul_u64(UINT64_MAX / 2, 3, &out));
  ck_assert(df_mul_u64(1u << 20, 1u << 20, &out) && out == (1ull << 40));
}
END_TEST

START_TEST(backoff_is_full_jitter_and_honours_retry_after) {
  uint64_t rng = 42;
  double max_seen = 0, min_seen = 1e9;
  for (int i = 0; i < 10000; i++) {
    double w = df_backoff_s(&rng, 3, 0.5, 30, -1, 60); /* cap 0.5 * 2^2 = 2 s */
    ck_assert(w >= 0 && w < 2.0);
    if (w > max_seen) max_seen = w;
    if (w < min_seen) min_seen = w;
  }
  ck_assert(max_seen > 1.9 && min_seen < 0.1); /* spread over the whole window */
  ck_assert(df_backoff_s(&rng, 40, 0.5, 30, -1, 60) < 30.0);
  ck_assert(df_backoff_s(&rng, 1, 0.5, 30, 7.0, 60) >= 7.0);
  ck_assert(df_backoff_s(&rng, 1, 0.5, 30, 500.0, 60) == 60.0);
  ck_assert(df_parse_retry_after(" 12", false) == 12.0);
  ck_assert(df_parse_retry_after("1500", true) == 1.5);
  ck_assert(df_parse_retry_after("soon", false) == -1.0);
  double d = df_parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", false);
  ck_assert(d < 0); /* a date in the past: nothing to wait for */
}
END_TEST

TCase *tc_util(void) {
  TCase *tc = tcase_create("util");
  tcase_add_test(tc, utf8_validation_rejects_what_python_rejects);
  tcase_add_test(tc, paths_and_buffers);
  tcase_add_test(tc, backoff_is_full_jitter_and_honours_retry_after);
  return tc;
}
