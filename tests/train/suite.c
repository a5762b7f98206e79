#include <check.h>

TCase *tc_config(void);
TCase *tc_ops(void);
TCase *tc_anchors(void);
TCase *tc_checkpoint(void);
TCase *tc_backend(void);
TCase *tc_dist(void);
TCase *tc_run_dist(void);
TCase *tc_eval(void);
TCase *tc_init(void);
TCase *tc_dflash2(void);
TCase *tc_ref_ops(void);
TCase *tc_position(void);
TCase *tc_schedule(void);
TCase *tc_store_layers(void);
TCase *tc_run_stats(void);
TCase *tc_dspark(void);
TCase *tc_dspark_model(void);
TCase *tc_dspark_eval(void);
TCase *tc_dspark_run(void);

Suite *df_test_suite(void) {
  Suite *s = suite_create("train");
  suite_add_tcase(s, tc_config());
  suite_add_tcase(s, tc_ops());
  suite_add_tcase(s, tc_anchors());
  suite_add_tcase(s, tc_checkpoint());
  suite_add_tcase(s, tc_backend());
  suite_add_tcase(s, tc_dist());
  suite_add_tcase(s, tc_run_dist());
  suite_add_tcase(s, tc_eval());
  suite_add_tcase(s, tc_init());
  suite_add_tcase(s, tc_dflash2());
  suite_add_tcase(s, tc_ref_ops());
  suite_add_tcase(s, tc_position());
  suite_add_tcase(s, tc_schedule());
  suite_add_tcase(s, tc_store_layers());
  suite_add_tcase(s, tc_run_stats());
  suite_add_tcase(s, tc_dspark());
  suite_add_tcase(s, tc_dspark_model());
  suite_add_tcase(s, tc_dspark_eval());
  suite_add_tcase(s, tc_dspark_run());
  return s;
}
