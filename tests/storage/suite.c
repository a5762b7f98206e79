#include <check.h>

TCase *tc_storage_local(void);
TCase *tc_storage_s3(void);
TCase *tc_storage_profile(void);

Suite *df_test_suite(void) {
  Suite *s = suite_create("storage");
  suite_add_tcase(s, tc_storage_local());
  suite_add_tcase(s, tc_storage_s3());
  suite_add_tcase(s, tc_storage_profile());
  return s;
}
