#include <check.h>

TCase *tc_tok_bpe(void);
TCase *tc_tok_bpe_diff(void);
TCase *tc_tok_load_errors(void);
TCase *tc_tok_api(void);
TCase *tc_tok_text(void);
TCase *tc_tok_scanner(void);

Suite *df_test_suite(void) {
  Suite *s = suite_create("tokenizer");
  suite_add_tcase(s, tc_tok_bpe());
  suite_add_tcase(s, tc_tok_bpe_diff());
  suite_add_tcase(s, tc_tok_load_errors());
  suite_add_tcase(s, tc_tok_api());
  suite_add_tcase(s, tc_tok_text());
  suite_add_tcase(s, tc_tok_scanner());
  return s;
}
