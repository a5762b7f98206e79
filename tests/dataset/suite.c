#include <check.h>

TCase *tc_dataset(void);

Suite *df_test_suite(void) {
  Suite *s = suite_create("dataset");
  suite_add_tcase(s, tc_dataset());
  return s;
}
