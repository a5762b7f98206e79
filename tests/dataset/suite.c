#include <check.h>

TCase *tc_dataset(void);
TCase *tc_dataset_build(void);

Suite *df_test_suite(void) {
  Suite *s = suite_create("dataset");
  suite_add_tcase(s, tc_dataset());
  suite_add_tcase(s, tc_dataset_build());
  return s;
}
