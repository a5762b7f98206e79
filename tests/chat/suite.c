#include <check.h>

TCase *tc_chat_render(void);
TCase *tc_chat_mask(void);
TCase *tc_chat_json_fast(void);
TCase *tc_chat_tools_ts(void);

Suite *df_test_suite(void) {
  Suite *s = suite_create("chat");
  suite_add_tcase(s, tc_chat_render());
  suite_add_tcase(s, tc_chat_mask());
  suite_add_tcase(s, tc_chat_json_fast());
  suite_add_tcase(s, tc_chat_tools_ts());
  return s;
}
