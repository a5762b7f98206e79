#include <check.h>

TCase *tc_sse(void);
TCase *tc_response(void);
TCase *tc_input(void);
TCase *tc_output(void);
TCase *tc_request(void);
TCase *tc_guards(void);
TCase *tc_ctl(void);
TCase *tc_ids(void);
TCase *tc_health(void);

Suite *df_test_suite(void) {
  Suite *s = suite_create("fetch");
  suite_add_tcase(s, tc_sse());
  suite_add_tcase(s, tc_response());
  suite_add_tcase(s, tc_input());
  suite_add_tcase(s, tc_output());
  suite_add_tcase(s, tc_request());
  suite_add_tcase(s, tc_guards());
  suite_add_tcase(s, tc_ctl());
  suite_add_tcase(s, tc_ids());
  suite_add_tcase(s, tc_health());
  return s;
}
