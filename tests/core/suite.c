#include <check.h>

TCase *tc_blas(void);
TCase *tc_error(void);
TCase *tc_fileio(void);
TCase *tc_json(void);
TCase *tc_progress(void);
TCase *tc_safetensors(void);
TCase *tc_threadpool(void);
TCase *tc_util(void);

Suite *df_test_suite(void) {
  Suite *s = suite_create("core");
  suite_add_tcase(s, tc_blas());
  suite_add_tcase(s, tc_error());
  suite_add_tcase(s, tc_fileio());
  suite_add_tcase(s, tc_json());
  suite_add_tcase(s, tc_progress());
  suite_add_tcase(s, tc_safetensors());
  suite_add_tcase(s, tc_threadpool());
  suite_add_tcase(s, tc_util());
  return s;
}
