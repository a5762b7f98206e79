#include <dflash/train.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define CFG_HEAD                                                                        \
  "{\"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 2, "         \
  "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16, "          \
  "\"vocab_size\": 1000, \"num_target_layers\": 36, "

static dflash_status parse(const char *text, dflash_drafter_config *c) {
  return dflash_drafter_config_parse(text, strlen(text), "t.json", c);
}

START_TEST(block_size_placements) {
  dflash_drafter_config c;
  ck_assert_ok(parse(CFG_HEAD "\"block_size\": 16, \"dflash_config\": {\"mask_token_id\": 7}}", &c));
  ck_assert_int_eq(c.block_size, 16);
  ck_assert_ok(parse(CFG_HEAD "\"dflash_config\": {\"mask_token_id\": 7, \"block_size\": 8}}", &c));
  ck_assert_int_eq(c.block_size, 8);
  ck_assert_ok(parse(CFG_HEAD "\"block_size\": 8, \"dflash_config\": {\"mask_token_id\": 7, "
                     "\"block_size\": 8}}", &c));
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"dflash_config\": {\"mask_token_id\": 7, "
                         "\"block_size\": 8}}", &c), DFLASH_E_CONFIG, "disagrees");
  ck_assert_status(parse(CFG_HEAD "\"dflash_config\": {\"mask_token_id\": 7}}", &c),
                   DFLASH_E_CONFIG, "block_size");
}
END_TEST

START_TEST(default_target_layers_follow_spec) {
  int32_t ids[8];
  ck_assert_ok(dflash_default_target_layers(36, 5, ids));
  int32_t qwen[] = {1, 9, 17, 25, 33};
  ck_assert_mem_eq(ids, qwen, sizeof qwen);
  ck_assert_ok(dflash_default_target_layers(61, 6, ids));
  int32_t kimi[] = {1, 12, 24, 35, 47, 58};
  ck_assert_mem_eq(ids, kimi, sizeof kimi);
  ck_assert_ok(dflash_default_target_layers(36, 1, ids));
  ck_assert_int_eq(ids[0], 18);
  /* Without target_layer_ids the config gets one per drafter layer. */
  dflash_drafter_config c;
  ck_assert_ok(parse(CFG_HEAD "\"block_size\": 16, \"dflash_config\": {\"mask_token_id\": 7}}", &c));
  ck_assert_int_eq(c.n_target_layer_ids, 2);
  ck_assert_int_eq(c.target_layer_ids[0], 1);
  ck_assert_int_eq(c.target_layer_ids[1], 33);
  /* Explicit ids need no num_target_layers; neither may be missing together. */
  const char *no_l = "{\"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
                     "\"num_attention_heads\": 4, \"vocab_size\": 100, \"block_size\": 4,"
                     "\"dflash_config\": {\"mask_token_id\": 7, \"target_layer_ids\": [2, 40]}}";
  ck_assert_ok(parse(no_l, &c));
  ck_assert_int_eq(c.num_target_layers, 0);
  ck_assert_int_eq(c.head_dim, 16);
  ck_assert_status(parse("{\"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
                         "\"num_attention_heads\": 4, \"vocab_size\": 100, \"block_size\": 4,"
                         "\"dflash_config\": {\"mask_token_id\": 7}}", &c),
                   DFLASH_E_CONFIG, "neither dflash_config.target_layer_ids nor num_target_layers");
}
END_TEST

START_TEST(validation_names_the_problem) {
  dflash_drafter_config c;
  ck_assert_status(parse("{\"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
                         "\"num_attention_heads\": 6, \"num_key_value_heads\": 4, \"head_dim\": 16,"
                         "\"vocab_size\": 100, \"num_target_layers\": 8, \"block_size\": 4,"
                         "\"dflash_config\": {\"mask_token_id\": 7}}", &c),
                   DFLASH_E_CONFIG, "multiple of num_key_value_heads");
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"dflash_config\": {\"mask_token_id\": 1000}}", &c),
                   DFLASH_E_CONFIG, "mask_token_id 1000 is outside the vocabulary");
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"dflash_config\": {\"mask_token_id\": 1, "
                         "\"target_layer_ids\": [1, 40]}}", &c),
                   DFLASH_E_CONFIG, "target_layer_ids[1] = 40");
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"layer_types\": [\"full_attention\", "
                         "\"sliding_attention\"], \"dflash_config\": {\"mask_token_id\": 1}}", &c),
                   DFLASH_E_CONFIG, "sliding_window");
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"layer_types\": [\"full_attention\"], "
                         "\"dflash_config\": {\"mask_token_id\": 1}}", &c),
                   DFLASH_E_CONFIG, "layer_types");
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"rope_scaling\": {\"rope_type\": \"yarn\"},"
                         "\"dflash_config\": {\"mask_token_id\": 1}}", &c),
                   DFLASH_E_CONFIG, "factor");
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"rope_scaling\": {\"rope_type\": \"llama3\", "
                         "\"factor\": 8}, \"dflash_config\": {\"mask_token_id\": 1}}", &c),
                   DFLASH_E_UNSUPPORTED, "llama3");
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"attention_bias\": true, "
                         "\"dflash_config\": {\"mask_token_id\": 1}}", &c),
                   DFLASH_E_CONFIG, "attention_bias");
  ck_assert_status(parse("[1]", &c), DFLASH_E_CONFIG, "object");
  ck_assert_status(parse("{\"hidden_size\": 64}", &c), DFLASH_E_CONFIG, "intermediate_size");
}
END_TEST

/* The Kimi K2.x drafter's shape, YaRN with the attention factor derived as
 * Hugging Face does when absent (0.1 ln(factor) + 1). */
START_TEST(yarn_and_round_trip) {
  const char *kimi =
      "{\"architectures\": [\"DFlashDraftModel\"], \"model_type\": \"qwen3\", \"hidden_size\": 7168,"
      "\"intermediate_size\": 18432, \"num_hidden_layers\": 6, \"num_attention_heads\": 64,"
      "\"num_key_value_heads\": 8, \"head_dim\": 128, \"rms_norm_eps\": 1e-06,"
      "\"rope_theta\": 50000.0, \"rope_scaling\": {\"type\": \"yarn\", \"factor\": 64.0,"
      "\"original_max_position_embeddings\": 4096, \"beta_fast\": 32, \"beta_slow\": 1},"
      "\"max_position_embeddings\": 262144, \"vocab_size\": 163840, \"num_target_layers\": 61,"
      "\"block_size\": 16, \"dflash_config\": {\"mask_token_id\": 163838,"
      "\"target_layer_ids\": [1, 12, 24, 35, 47, 58]}}";
  dflash_drafter_config c, back;
  ck_assert_ok(parse(kimi, &c));
  ck_assert_int_eq(c.rope_type, DFLASH_ROPE_YARN);
  ck_assert_double_eq_tol(c.rope_attention_factor, 0.1 * log(64.0) + 1.0, 1e-12);
  ck_assert_int_eq(c.rope_original_max_position, 4096);
  ck_assert_int_eq(c.n_target_layer_ids, 6);
  ck_assert_int_eq(c.target_layer_ids[5], 58);
  size_t len = 0;
  ck_assert_int_eq(dflash_drafter_config_to_json(&c, NULL, &len), DFLASH_E_BUFFER);
  char *buf = malloc(len);
  ck_assert_ok(dflash_drafter_config_to_json(&c, buf, &len));
  /* Both placements and an explicit attention factor are written. */
  ck_assert_ptr_nonnull(strstr(buf, "\"attention_factor\""));
  ck_assert_ptr_nonnull(strstr(buf, "\"DFlashDraftModel\""));
  const char *first = strstr(buf, "\"block_size\"");
  ck_assert_ptr_nonnull(first);
  ck_assert_ptr_nonnull(strstr(first + 1, "\"block_size\""));
  ck_assert_ok(parse(buf, &back));
  ck_assert_mem_eq(&back, &c, sizeof c);
  free(buf);
  /* rope_parameters (transformers v5 spelling) carries the theta. */
  ck_assert_ok(parse(CFG_HEAD "\"block_size\": 4, \"rope_parameters\": {\"rope_type\": \"default\","
                     "\"rope_theta\": 1000000.0}, \"dflash_config\": {\"mask_token_id\": 1}}", &c));
  ck_assert_double_eq(c.rope_theta, 1e6);
  ck_assert_int_eq(c.rope_type, DFLASH_ROPE_DEFAULT);
}
END_TEST

START_TEST(gamma_table) {
  ck_assert_double_eq(dflash_default_loss_gamma(16), 7.0);
  ck_assert_double_eq(dflash_default_loss_gamma(10), 5.0);
  ck_assert_double_eq(dflash_default_loss_gamma(8), 4.0);
}
END_TEST

TCase *tc_config(void) {
  TCase *tc = tcase_create("config");
  tcase_add_test(tc, block_size_placements);
  tcase_add_test(tc, default_target_layers_follow_spec);
  tcase_add_test(tc, validation_names_the_problem);
  tcase_add_test(tc, yarn_and_round_trip);
  tcase_add_test(tc, gamma_table);
  return tc;
}
