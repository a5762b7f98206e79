/* Shared main for every Check suite: each test executable links one
 * df_test_suite() and this file runs it. Exit 77 (meson's "skipped") is
 * reserved for suites that find nothing to test. */
#include <check.h>
#include <stdlib.h>

Suite *df_test_suite(void);

int main(void) {
  SRunner *sr = srunner_create(df_test_suite());
  srunner_run_all(sr, CK_NORMAL);
  int failed = srunner_ntests_failed(sr);
  srunner_free(sr);
  return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
