#include <check.h>

TCase *tc_dataset(void);
TCase *tc_dataset_build(void);
TCase *tc_dataset_build_fetch(void);

Suite *df_test_suite(void) {
  Suite *s = suite_create("dataset");
  suite_add_tcase(s, tc_dataset());
  suite_add_tcase(s, tc_dataset_build());
  suite_add_tcase(s, tc_dataset_build_fetch());
  return s;
}
