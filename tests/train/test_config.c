#include <dflash/train.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testutil.h"

#define CFG_HEAD                                                                \
  "{\"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 2, " \
  "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16, "  \
  "\"vocab_size\": 1000, \"num_target_layers\": 36, "

static dflash_status parse(const char *text, dflash_drafter_config *c) {
  return dflash_drafter_config_parse(text, strlen(text), "t.json", c);
}

START_TEST(block_size_placements) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(
      parse(CFG_HEAD "\"block_size\": 16, \"dflash_config\": {\"mask_token_id\": 7}}", &c));
  ck_assert_int_eq(c.block_size, 16);
  ck_assert_ok(parse(CFG_HEAD "\"dflash_config\": {\"mask_token_id\": 7, \"block_size\": 8}}", &c));
  ck_assert_int_eq(c.block_size, 8);
  ck_assert_ok(parse(CFG_HEAD "\"block_size\": 8, \"dflash_config\": {\"mask_token_id\": 7, "
                              "\"block_size\": 8}}",
                     &c));
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"dflash_config\": {\"mask_token_id\": 7, "
                                  "\"block_size\": 8}}",
                         &c),
                   DFLASH_E_CONFIG, "disagrees");
  ck_assert_status(parse(CFG_HEAD "\"dflash_config\": {\"mask_token_id\": 7}}", &c),
                   DFLASH_E_CONFIG, "block_size");
}
END_TEST

START_TEST(default_target_layers_follow_spec) {
  int32_t ids[8];
  ck_assert_ok(dflash_drafter_default_target_layers(36, 5, ids));
  int32_t qwen[] = {1, 9, 17, 25, 33};
  ck_assert_mem_eq(ids, qwen, sizeof qwen);
  ck_assert_ok(dflash_drafter_default_target_layers(61, 6, ids));
  int32_t kimi[] = {1, 12, 24, 35, 47, 58};
  ck_assert_mem_eq(ids, kimi, sizeof kimi);
  ck_assert_ok(dflash_drafter_default_target_layers(36, 1, ids));
  ck_assert_int_eq(ids[0], 18);
  /* Without target_layer_ids the config gets one per drafter layer. */
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(
      parse(CFG_HEAD "\"block_size\": 16, \"dflash_config\": {\"mask_token_id\": 7}}", &c));
  ck_assert_int_eq(c.n_target_layer_ids, 2);
  ck_assert_int_eq(c.target_layer_ids[0], 1);
  ck_assert_int_eq(c.target_layer_ids[1], 33);
  /* Explicit ids need no num_target_layers; neither may be missing together. */
  const char *no_l = "{\"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
                     "\"num_attention_heads\": 4, \"vocab_size\": 100, \"block_size\": 4,"
                     "\"dflash_config\": {\"mask_token_id\": 7, \"target_layer_ids\": [2, 40]}}";
  ck_assert_ok(parse(no_l, &c));
  ck_assert_int_eq(c.num_target_layers, 0);
  ck_assert_int_eq(c.head_dim, 128); /* Qwen3Config's default, not 64 / 4 */
  ck_assert_status(
      parse("{\"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
            "\"num_attention_heads\": 4, \"vocab_size\": 100, \"block_size\": 4,"
            "\"dflash_config\": {\"mask_token_id\": 7}}",
            &c),
      DFLASH_E_CONFIG, "neither dflash_config.target_layer_ids nor num_target_layers");
}
END_TEST

START_TEST(validation_names_the_problem) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_status(
      parse("{\"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
            "\"num_attention_heads\": 6, \"num_key_value_heads\": 4, \"head_dim\": 16,"
            "\"vocab_size\": 100, \"num_target_layers\": 8, \"block_size\": 4,"
            "\"dflash_config\": {\"mask_token_id\": 7}}",
            &c),
      DFLASH_E_CONFIG, "multiple of num_key_value_heads");
  ck_assert_status(parse(CFG_HEAD
                         "\"block_size\": 16, \"dflash_config\": {\"mask_token_id\": 1000}}",
                         &c),
                   DFLASH_E_CONFIG, "mask_token_id 1000 is outside the vocabulary");
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"dflash_config\": {\"mask_token_id\": 1, "
                                  "\"target_layer_ids\": [1, 40]}}",
                         &c),
                   DFLASH_E_CONFIG, "target_layer_ids[1] = 40");
  ck_assert_status(parse(CFG_HEAD
                         "\"block_size\": 16, \"layer_types\": [\"full_attention\", "
                         "\"sliding_attention\"], \"dflash_config\": {\"mask_token_id\": 1}}",
                         &c),
                   DFLASH_E_CONFIG, "sliding_window");
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"layer_types\": [\"full_attention\"], "
                                  "\"dflash_config\": {\"mask_token_id\": 1}}",
                         &c),
                   DFLASH_E_CONFIG, "layer_types");
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"rope_scaling\": {\"rope_type\": \"yarn\"},"
                                  "\"dflash_config\": {\"mask_token_id\": 1}}",
                         &c),
                   DFLASH_E_CONFIG, "factor");
  ck_assert_status(parse(CFG_HEAD
                         "\"block_size\": 16, \"rope_scaling\": {\"rope_type\": \"llama3\", "
                         "\"factor\": 8}, \"dflash_config\": {\"mask_token_id\": 1}}",
                         &c),
                   DFLASH_E_UNSUPPORTED, "llama3");
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 16, \"attention_bias\": true, "
                                  "\"dflash_config\": {\"mask_token_id\": 1}}",
                         &c),
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
  dflash_drafter_config c = {.struct_size = sizeof c}, back = {.struct_size = sizeof back};
  ck_assert_ok(parse(kimi, &c));
  ck_assert_int_eq(c.rope_type, DFLASH_ROPE_YARN);
  ck_assert_double_eq_tol(c.rope_attention_factor, 0.1 * log(64.0) + 1.0, 1e-12);
  ck_assert_int_eq(c.rope_original_max_position, 4096);
  ck_assert_int_eq(c.n_target_layer_ids, 6);
  ck_assert_int_eq(c.target_layer_ids[5], 58);
  size_t len = 0;
  ck_assert_int_eq(dflash_drafter_config_to_json(&c, NULL, 0, &len), DFLASH_E_BUFFER);
  char *buf = malloc(len);
  ck_assert_ok(dflash_drafter_config_to_json(&c, buf, len, &len));
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
  ck_assert_ok(parse(CFG_HEAD
                     "\"block_size\": 4, \"rope_parameters\": {\"rope_type\": \"default\","
                     "\"rope_theta\": 1000000.0}, \"dflash_config\": {\"mask_token_id\": 1}}",
                     &c));
  ck_assert_double_eq(c.rope_theta, 1e6);
  ck_assert_int_eq(c.rope_type, DFLASH_ROPE_DEFAULT);
}
END_TEST

START_TEST(gamma_table) {
  ck_assert_double_eq(dflash_trainer_default_loss_gamma(16), 7.0);
  ck_assert_double_eq(dflash_trainer_default_loss_gamma(10), 5.0);
  ck_assert_double_eq(dflash_trainer_default_loss_gamma(8), 4.0);
}
END_TEST

/* ---- refusals found by comparing with the reference loaders ---- */

#define CFG_TAIL "\"block_size\": 4, \"dflash_config\": {\"mask_token_id\": 1}"

/* The reference model (and mlx's loader) read num_target_layers even when
 * target_layer_ids are given: it is always written, and a config without it
 * cannot be saved (nothing is written). */
START_TEST(num_target_layers_written_or_refused) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(parse(CFG_HEAD CFG_TAIL "}", &c));
  size_t len = 0;
  ck_assert_int_eq(dflash_drafter_config_to_json(&c, NULL, 0, &len), DFLASH_E_BUFFER);
  char *buf = malloc(len);
  ck_assert_ok(dflash_drafter_config_to_json(&c, buf, len, &len));
  ck_assert_ptr_nonnull(strstr(buf, "\"num_target_layers\": 36"));
  free(buf);
  ck_assert_ok(parse("{\"hidden_size\": 64, \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
                     "\"num_attention_heads\": 4, \"vocab_size\": 100, \"block_size\": 4,"
                     "\"dflash_config\": {\"mask_token_id\": 7, \"target_layer_ids\": [2]}}",
                     &c));
  ck_assert_status(dflash_drafter_config_to_json(&c, NULL, 0, &len), DFLASH_E_CONFIG,
                   "num_target_layers");
  char dir[] = "/tmp/dflash-cfg-XXXXXX";
  ck_assert_ptr_nonnull(mkdtemp(dir));
  char path[64];
  snprintf(path, sizeof path, "%s/config.json", dir);
  ck_assert_status(dflash_drafter_config_save(&c, path), DFLASH_E_CONFIG, "num_target_layers");
  ck_assert_int_ne(access(path, F_OK), 0);
  rmdir(dir);
}
END_TEST

/* rope_scaling.factor must equal max_position_embeddings /
 * original_max_position_embeddings (transformers 4.51-4.55 use the ratio,
 * everything else the factor), and the original length must be given. */
START_TEST(yarn_factor_must_match_ratio) {
#define YARN(mpe, orig)                                                               \
  CFG_HEAD "\"max_position_embeddings\": " mpe ", \"rope_scaling\": {\"rope_type\": " \
           "\"yarn\", \"factor\": 64.0" orig "}, " CFG_TAIL "}"
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(parse(YARN("262144", ", \"original_max_position_embeddings\": 4096"), &c));
  ck_assert_status(parse(YARN("131072", ", \"original_max_position_embeddings\": 4096"), &c),
                   DFLASH_E_CONFIG,
                   "t.json: rope_scaling.factor 64 differs from "
                   "max_position_embeddings / rope_scaling.original_max_position_embeddings = "
                   "131072 / 4096 = 32");
  ck_assert_status(parse(YARN("262144", ""), &c), DFLASH_E_CONFIG,
                   "t.json: rope_scaling (yarn) needs a positive "
                   "\"original_max_position_embeddings\"");
  /* A struct filled in code that disagrees is not written either. */
  ck_assert_ok(parse(YARN("262144", ", \"original_max_position_embeddings\": 4096"), &c));
  c.max_position_embeddings = 32768;
  size_t len = 0;
  ck_assert_status(dflash_drafter_config_to_json(&c, NULL, 0, &len), DFLASH_E_CONFIG,
                   "differs from max_position_embeddings");
#undef YARN
}
END_TEST

/* A DFlash 2 checkpoint parsed as DFlash 1 lost its extra weights silently:
 * dflash_drafter_config has no field for them, so only the _ext parsers
 * take one. */
START_TEST(architectures_must_be_dflash) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(parse(CFG_HEAD "\"architectures\": [\"DFlashDraftModel\"], " CFG_TAIL "}", &c));
  ck_assert_ok(parse(CFG_HEAD "\"architectures\": null, " CFG_TAIL "}", &c));
  ck_assert_status(parse(CFG_HEAD "\"architectures\": [\"DFlash2DraftModel\"], " CFG_TAIL "}", &c),
                   DFLASH_E_CONFIG, /* DFlash 2 is read, and needs its sizes */
                   "t.json: a DFlash2DraftModel needs \"conv_kernel_size\"");
  ck_assert_status(parse(CFG_HEAD "\"architectures\": [\"Qwen3ForCausalLM\"], " CFG_TAIL "}", &c),
                   DFLASH_E_UNSUPPORTED, "\"architectures\" = [\"Qwen3ForCausalLM\"]");
  ck_assert_status(parse(CFG_HEAD "\"architectures\": [\"DFlashDraftModel\", \"X\"], " CFG_TAIL "}",
                         &c),
                   DFLASH_E_UNSUPPORTED, "architectures");
  ck_assert_status(parse(CFG_HEAD "\"architectures\": \"DFlashDraftModel\", " CFG_TAIL "}", &c),
                   DFLASH_E_UNSUPPORTED, "architectures");
}
END_TEST

/* Keys of z-lab's reference model (and DFlash 2) that libdflash does not
 * implement: refused when set to anything but their neutral value, at the top
 * level or in dflash_config (the reference reads both). */
START_TEST(unimplemented_keys_refused) {
  static const struct {
    const char *set;
    const char *key;
  } bad[] = {
      {"\"input_embedding_scale\": 2.0", "\"input_embedding_scale\" = 2.0"},
      {"\"output_multiplier\": 0.5", "\"output_multiplier\" = 0.5"},
      {"\"final_logit_softcapping\": 30.0", "\"final_logit_softcapping\" = 30.0"},
      {"\"attention_value_scale\": 0.25", "\"attention_value_scale\" = 0.25"},
      {"\"is_causal\": true", "\"is_causal\" = true"},
      {"\"conv_kernel_size\": 4", "\"conv_kernel_size\" = 4"},
      {"\"conv_group_size\": 64", "\"conv_group_size\" = 64"},
      {"\"selector_rank\": 32", "\"selector_rank\" = 32"},
      {"\"selector_top_k\": 8", "\"selector_top_k\" = 8"},
  };
  static const char *neutral[] = {
      "\"input_embedding_scale\": 1.0", "\"output_multiplier\": 1",
      "\"output_multiplier\": null",    "\"final_logit_softcapping\": null",
      "\"final_logit_softcapping\": 0", "\"attention_value_scale\": 1.0",
      "\"is_causal\": false",           "\"is_causal\": null",
      "\"conv_kernel_size\": null",     "\"selector_rank\": 0",
  };
  char text[1024];
  dflash_drafter_config c = {.struct_size = sizeof c};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    snprintf(text, sizeof text, CFG_HEAD "%s, " CFG_TAIL "}", bad[i].set);
    char want[160];
    snprintf(want, sizeof want, "t.json: %s is not implemented by libdflash", bad[i].key);
    ck_assert_status(parse(text, &c), DFLASH_E_UNSUPPORTED, want);
    snprintf(text, sizeof text,
             CFG_HEAD "\"block_size\": 4, \"dflash_config\": "
                      "{\"mask_token_id\": 1, %s}}",
             bad[i].set);
    snprintf(want, sizeof want, "t.json: dflash_config.%s is not implemented", bad[i].key);
    ck_assert_status(parse(text, &c), DFLASH_E_UNSUPPORTED, want);
  }
  for (size_t i = 0; i < sizeof neutral / sizeof *neutral; i++) {
    snprintf(text, sizeof text, CFG_HEAD "%s, " CFG_TAIL "}", neutral[i]);
    ck_assert_msg(parse(text, &c) == DFLASH_OK, "%s: %s", neutral[i], dflash_last_error());
  }
  /* is_causal that agrees with every layer: true when all layers slide. */
  const char *all_sliding =
      "{\"hidden_size\": 64, \"intermediate_size\": 96, "
      "\"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"head_dim\": 16, "
      "\"vocab_size\": 100, \"num_target_layers\": 8, \"layer_types\": [\"sliding_attention\"], "
      "\"use_sliding_window\": true, \"sliding_window\": 8, \"is_causal\": %s, " CFG_TAIL "}";
  snprintf(text, sizeof text, all_sliding, "true");
  ck_assert_ok(parse(text, &c));
  snprintf(text, sizeof text, all_sliding, "false");
  ck_assert_status(parse(text, &c), DFLASH_E_UNSUPPORTED, "\"is_causal\" = false");
}
END_TEST

/* Qwen3Config (hence the reference model) defaults head_dim to 128. */
START_TEST(head_dim_defaults_as_qwen3config) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(
      parse("{\"hidden_size\": 256, \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
            "\"num_attention_heads\": 8, \"vocab_size\": 100, \"num_target_layers\": 8," CFG_TAIL
            "}",
            &c));
  ck_assert_int_eq(c.head_dim, 128);
  ck_assert_ok(parse("{\"hidden_size\": 256, \"intermediate_size\": 96, \"num_hidden_layers\": 1,"
                     "\"num_attention_heads\": 8, \"head_dim\": 32, \"vocab_size\": 100,"
                     "\"num_target_layers\": 8, " CFG_TAIL "}",
                     &c));
  ck_assert_int_eq(c.head_dim, 32);
}
END_TEST

/* Qwen3Config drops sliding_window unless use_sliding_window is true. */
START_TEST(sliding_layers_need_use_sliding_window) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  const char *fmt = CFG_HEAD "\"layer_types\": [\"full_attention\", \"sliding_attention\"], "
                             "%s\"sliding_window\": 8, " CFG_TAIL "}";
  char text[512];
  snprintf(text, sizeof text, fmt, "");
  ck_assert_status(parse(text, &c), DFLASH_E_CONFIG,
                   "t.json: layer_types[1] is \"sliding_attention\" but \"use_sliding_window\"");
  snprintf(text, sizeof text, fmt, "\"use_sliding_window\": false, ");
  ck_assert_status(parse(text, &c), DFLASH_E_CONFIG, "use_sliding_window");
  snprintf(text, sizeof text, fmt, "\"use_sliding_window\": true, ");
  ck_assert_ok(parse(text, &c));
  ck_assert_int_eq(c.layer_types[1], DFLASH_LAYER_SLIDING);
  ck_assert_int_eq(c.sliding_window, 8);
}
END_TEST

/* A caller's config of an older header: struct_size ends before `field`. */
#define OLDER_THAN(field) offsetof(dflash_drafter_config, field)

/* partial_rotary_factor: a field of the config, refused when the caller's struct ends before
 * it (an older header's), so nothing is dropped silently. */
START_TEST(partial_rotary_factor_parsed_or_refused) {
  dflash_drafter_config c;
  dflash_drafter_config_default(&c);
  ck_assert_double_eq(c.partial_rotary_factor, 1.0);
  const char *half = CFG_HEAD "\"partial_rotary_factor\": 0.5, " CFG_TAIL "}";
  ck_assert_ok(parse(half, &c));
  ck_assert_double_eq(c.partial_rotary_factor, 0.5);
  /* A factor of 1 is the default, accepted in any struct. */
  ck_assert_ok(parse(CFG_HEAD "\"partial_rotary_factor\": 1.0, " CFG_TAIL "}", &c));
  ck_assert_double_eq(c.partial_rotary_factor, 1.0);
  /* transformers 5 keeps it in rope_parameters. */
  const char *v5 = CFG_HEAD "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": "
                            "10000.0, \"partial_rotary_factor\": 0.25}, " CFG_TAIL "}";
  ck_assert_ok(parse(v5, &c));
  ck_assert_double_eq(c.partial_rotary_factor, 0.25);
  const char *both = CFG_HEAD
      "\"partial_rotary_factor\": 0.5, \"rope_parameters\": {"
      "\"rope_type\": \"default\", \"partial_rotary_factor\": 0.25}, " CFG_TAIL "}";
  ck_assert_status(parse(both, &c), DFLASH_E_CONFIG, "disagrees");
  /* head_dim 16: 0.1875 rotates 3 dims (odd), 0 and 1.5 are outside (0, 1]. */
  static const char *bad[] = {"0.1875", "0", "1.5", "\"half\""};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    char text[512];
    snprintf(text, sizeof text, CFG_HEAD "\"partial_rotary_factor\": %s, " CFG_TAIL "}", bad[i]);
    ck_assert_status(parse(text, &c), DFLASH_E_CONFIG, "partial_rotary_factor");
  }
  /* Written back when it is not the default, and read again. */
  ck_assert_ok(parse(half, &c));
  char buf[4096];
  size_t len = sizeof buf;
  ck_assert_ok(dflash_drafter_config_to_json(&c, buf, len, &len));
  ck_assert_ptr_nonnull(strstr(buf, "\"partial_rotary_factor\": 0.5"));
  dflash_drafter_config c2 = {.struct_size = sizeof c2};
  ck_assert_ok(dflash_drafter_config_parse(buf, strlen(buf), "back", &c2));
  ck_assert_mem_eq(&c2, &c, sizeof c);
  c.partial_rotary_factor = 1.0;
  len = sizeof buf;
  ck_assert_ok(dflash_drafter_config_to_json(&c, buf, len, &len));
  ck_assert_ptr_null(strstr(buf, "partial_rotary_factor"));
  /* An older caller's struct, ending before the field: refused, and left as it was. */
  dflash_drafter_config old;
  dflash_drafter_config_init(&old, OLDER_THAN(partial_rotary_factor));
  old.hidden_size = 7;
  ck_assert_status(parse(half, &old), DFLASH_E_UNSUPPORTED,
                   "t.json: \"partial_rotary_factor\" = 0.5 does not fit in a "
                   "dflash_drafter_config of struct_size");
  ck_assert_int_eq(old.hidden_size, 7);
  /* ... which reads a config without it, and writes no byte past its struct_size. */
  memset((char *)&old + OLDER_THAN(partial_rotary_factor), 0xab,
         sizeof old - OLDER_THAN(partial_rotary_factor));
  ck_assert_ok(parse(CFG_HEAD CFG_TAIL "}", &old));
  ck_assert_uint_eq(old.struct_size, OLDER_THAN(partial_rotary_factor));
  ck_assert_int_eq(old.hidden_size, 64);
  for (size_t i = OLDER_THAN(partial_rotary_factor); i < sizeof old; i++)
    ck_assert_uint_eq(((unsigned char *)&old)[i], 0xab);
  /* ... and its missing tail means the defaults to every reader. */
  len = sizeof buf;
  ck_assert_ok(dflash_drafter_config_to_json(&old, buf, len, &len));
  ck_assert_ptr_null(strstr(buf, "partial_rotary_factor"));
  ck_assert_ok(dflash_drafter_config_validate(&old));
}
END_TEST

#define DF2_HEAD CFG_HEAD "\"architectures\": [\"DFlash2DraftModel\"], \"block_size\": 4, "
#define DF2_KEYS                                                              \
  "\"conv_kernel_size\": 2, \"conv_group_size\": 16, \"selector_top_k\": 8, " \
  "\"selector_rank\": 32"

/* DFlash2DraftModel: the four sizes, from dflash_config or the top level
 * (z-lab's _draft_value: dflash_config first), written back and re-read. */
START_TEST(dflash2_config_parsed_and_written) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(parse(DF2_HEAD "\"dflash_config\": {\"mask_token_id\": 1, " DF2_KEYS "}}", &c));
  ck_assert_int_eq(c.dflash2, 1);
  ck_assert_int_eq(c.conv_kernel_size, 2);
  ck_assert_int_eq(c.conv_group_size, 16);
  ck_assert_int_eq(c.selector_top_k, 8);
  ck_assert_int_eq(c.selector_rank, 32);
  /* Top level, with dflash_config taking precedence where both are given. */
  ck_assert_ok(parse(DF2_HEAD DF2_KEYS ", \"dflash_config\": {\"mask_token_id\": 1, "
                                       "\"conv_kernel_size\": 3}}",
                     &c));
  ck_assert_int_eq(c.conv_kernel_size, 3);
  ck_assert_int_eq(c.selector_rank, 32);
  char buf[4096];
  size_t len = sizeof buf;
  ck_assert_ok(dflash_drafter_config_to_json(&c, buf, len, &len));
  ck_assert_ptr_nonnull(strstr(buf, "\"DFlash2DraftModel\""));
  ck_assert_ptr_nonnull(strstr(buf, "\"conv_kernel_size\": 3"));
  ck_assert_ptr_nonnull(strstr(buf, "\"selector_top_k\": 8"));
  dflash_drafter_config c2 = {.struct_size = sizeof c2};
  ck_assert_ok(parse(buf, &c2));
  ck_assert_mem_eq(&c2, &c, sizeof c);
  /* DFlash 1 fields write DFlashDraftModel and no DFlash 2 key. */
  c2.dflash2 = c2.conv_kernel_size = c2.conv_group_size = 0;
  c2.selector_top_k = c2.selector_rank = 0;
  len = sizeof buf;
  ck_assert_ok(dflash_drafter_config_to_json(&c2, buf, len, &len));
  ck_assert_ptr_nonnull(strstr(buf, "\"DFlashDraftModel\""));
  ck_assert_ptr_null(strstr(buf, "conv_"));
  /* A caller's struct of an older header (no DFlash 2 fields) cannot hold it. */
  dflash_drafter_config old;
  dflash_drafter_config_init(&old, OLDER_THAN(dflash2));
  const char *t = DF2_HEAD "\"dflash_config\": {\"mask_token_id\": 1, " DF2_KEYS "}}";
  ck_assert_status(parse(t, &old), DFLASH_E_UNSUPPORTED,
                   "t.json: \"architectures\" = [\"DFlash2DraftModel\"] does not fit in a "
                   "dflash_drafter_config of struct_size");
}
END_TEST

/* Missing and invalid sizes name the key and the file. */
START_TEST(dflash2_bad_sizes_refused) {
  static const struct {
    const char *keys, *want;
  } bad[] = {
      {"\"conv_group_size\": 16, \"selector_top_k\": 8, \"selector_rank\": 32",
       "t.json: a DFlash2DraftModel needs \"conv_kernel_size\""},
      {"\"conv_kernel_size\": 2, \"selector_top_k\": 8, \"selector_rank\": 32",
       "t.json: a DFlash2DraftModel needs \"conv_group_size\""},
      {"\"conv_kernel_size\": 2, \"conv_group_size\": 16, \"selector_rank\": 32",
       "needs \"selector_top_k\""},
      {"\"conv_kernel_size\": 2, \"conv_group_size\": 16, \"selector_top_k\": 8",
       "needs \"selector_rank\""},
      {"\"conv_kernel_size\": 0, \"conv_group_size\": 16, \"selector_top_k\": 8, "
       "\"selector_rank\": 32",
       "t.json: conv_kernel_size must be in 1..64 (got 0)"},
      {"\"conv_kernel_size\": 2, \"conv_group_size\": 12, \"selector_top_k\": 8, "
       "\"selector_rank\": 32",
       "t.json: conv_group_size 12 must be >= 1 and divide hidden_size 64"},
      {"\"conv_kernel_size\": 2, \"conv_group_size\": 0, \"selector_top_k\": 8, "
       "\"selector_rank\": 32",
       "conv_group_size 0 must be >= 1"},
      {"\"conv_kernel_size\": 2, \"conv_group_size\": 16, \"selector_top_k\": 1001, "
       "\"selector_rank\": 32",
       "t.json: selector_top_k must be in 1..vocab_size=1000 (got 1001)"},
      {"\"conv_kernel_size\": 2, \"conv_group_size\": 16, \"selector_top_k\": 8, "
       "\"selector_rank\": -1",
       "t.json: selector_rank must be in 1..65536 (got -1)"},
      {"\"conv_kernel_size\": 2.5, \"conv_group_size\": 16, \"selector_top_k\": 8, "
       "\"selector_rank\": 32",
       "t.json: \"conv_kernel_size\" must be a 32-bit integer"},
  };
  char text[1024];
  dflash_drafter_config c = {.struct_size = sizeof c};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    snprintf(text, sizeof text, DF2_HEAD "\"dflash_config\": {\"mask_token_id\": 1, %s}}",
             bad[i].keys);
    ck_assert_status(parse(text, &c), DFLASH_E_CONFIG, bad[i].want);
  }
  /* Sizes without dflash2 would be dropped: the writer and validate refuse. */
  ck_assert_ok(parse(CFG_HEAD CFG_TAIL "}", &c));
  c.selector_rank = 8;
  size_t len = 0;
  ck_assert_status(dflash_drafter_config_to_json(&c, NULL, 0, &len), DFLASH_E_CONFIG,
                   "dflash2 is 0");
  ck_assert_status(dflash_drafter_config_validate(&c), DFLASH_E_CONFIG, "dflash2 is 0");
}
END_TEST

/* Before: each of these parsed, trained the default target layers (or a default field) and
 * wrote them into the checkpoint. */
START_TEST(unknown_keys_are_named_with_a_close_match) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_status(
      parse(CFG_HEAD "\"block_size\": 4, \"dflash_config\": {\"mask_token_id\": 1, "
                     "\"target_layer_id\": [3, 9]}}",
            &c),
      DFLASH_E_CONFIG,
      "unknown key \"dflash_config.target_layer_id\" (did you mean target_layer_ids?)");
  ck_assert_status(parse(CFG_HEAD "\"block_size\": 4, \"dflash_config\": {\"mask_token_id\": 1, "
                                  "\"colour\": 3}}",
                         &c),
                   DFLASH_E_CONFIG, "unknown key \"dflash_config.colour\"");
  /* Top level: a near miss of a field read there, or of dflash_config's. */
  ck_assert_status(parse(CFG_HEAD "\"rms_norm_epps\": 1e-5, " CFG_TAIL "}", &c), DFLASH_E_CONFIG,
                   "\"rms_norm_epps\" (did you mean rms_norm_eps?)");
  ck_assert_status(parse(CFG_HEAD "\"target_layer_id\": [3], " CFG_TAIL "}", &c), DFLASH_E_CONFIG,
                   "did you mean dflash_config.target_layer_ids?");
  ck_assert_status(parse(CFG_HEAD "\"target_layer_ids\": [3], " CFG_TAIL "}", &c), DFLASH_E_CONFIG,
                   "\"target_layer_ids\" at the top level is not read");
  /* What transformers' PretrainedConfig and the engines write stays accepted. */
  ck_assert_ok(parse(CFG_HEAD "\"bos_token_id\": 1, \"eos_token_id\": 2, \"pad_token_id\": 0, "
                              "\"use_cache\": true, \"hidden_act\": \"silu\", \"torch_dtype\": "
                              "\"bfloat16\", \"transformers_version\": \"4.57.1\", "
                              "\"initializer_range\": 0.02, \"model_type\": \"qwen3\", "
                              "\"attention_dropout\": 0.0, \"sep_token_id\": null, "
                              "\"block_size\": 4, \"dflash_config\": {\"mask_token_id\": 1, "
                              "\"mask_token\": \"<|MASK|>\", \"target_layer_ids\": [3, 9]}}",
                     &c));
  ck_assert_int_eq(c.n_target_layer_ids, 2);
}
END_TEST

#define DSP_HEAD CFG_HEAD "\"architectures\": [\"Qwen3DSparkModel\"], \"block_size\": 8, "
#define DSP_KEYS                                                                         \
  "\"markov_rank\": 32, \"markov_head_type\": \"vanilla\", \"enable_confidence_head\": " \
  "true, \"confidence_head_with_markov\": true, \"sample_from_anchor\": true"

/* spec/dspark.md section 5: the DSpark keys at the top level (mask_token_id and
 * target_layer_ids included) are read, written at the top level and in dflash_config, and
 * the written file reads back to the same struct. */
START_TEST(dspark_config_parsed_and_written) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(parse(DSP_HEAD DSP_KEYS ", \"num_anchors\": 256, \"mask_token_id\": 5, "
                                       "\"target_layer_ids\": [3, 9]}",
                     &c));
  ck_assert_int_eq(c.dspark, 1);
  ck_assert_int_eq(c.markov_rank, 32);
  ck_assert_int_eq(c.confidence_head, 1);
  ck_assert_int_eq(c.num_anchors, 256);
  ck_assert_int_eq(c.mask_token_id, 5);
  ck_assert_int_eq(c.block_size, 8);
  ck_assert_int_eq(c.n_target_layer_ids, 2);
  ck_assert_int_eq(c.target_layer_ids[1], 9);
  ck_assert_int_eq(c.dflash2, 0);
  char buf[8192];
  size_t len = sizeof buf;
  ck_assert_ok(dflash_drafter_config_to_json(&c, buf, len, &len));
  static const char *const want[] = {
      "\"architectures\": [\n    \"Qwen3DSparkModel\"\n  ]",
      "\"model_type\": \"qwen3\"",
      "\"tie_word_embeddings\": false",
      "\"sample_from_anchor\": true",
      "\"markov_head_type\": \"vanilla\"",
      "\"confidence_head_with_markov\": true",
  };
  for (size_t i = 0; i < sizeof want / sizeof *want; i++)
    ck_assert_msg(strstr(buf, want[i]), "missing %s in\n%s", want[i], buf);
  /* Both placements: once at the top level, once in dflash_config. */
  static const char *const twice[] = {"\"markov_rank\": 32", "\"enable_confidence_head\": true",
                                      "\"num_anchors\": 256", "\"mask_token_id\": 5",
                                      "\"block_size\": 8"};
  for (size_t i = 0; i < sizeof twice / sizeof *twice; i++) {
    const char *a = strstr(buf, twice[i]);
    ck_assert_msg(a && strstr(a + 1, twice[i]), "%s not written twice in\n%s", twice[i], buf);
  }
  /* The keys that make an engine refuse or misread the checkpoint are never written. */
  static const char *const never[] = {"speculators_model_type",     "transformer_layer_config",
                                      "aux_hidden_state_layer_ids", "logit_scale",
                                      "draft_vocab_size",           "DFlashDraftModel"};
  for (size_t i = 0; i < sizeof never / sizeof *never; i++)
    ck_assert_msg(!strstr(buf, never[i]), "%s written in\n%s", never[i], buf);
  dflash_drafter_config c2 = {.struct_size = sizeof c2};
  ck_assert_ok(parse(buf, &c2));
  ck_assert_mem_eq(&c2, &c, sizeof c);
  /* From dflash_config alone (SpecForge's placement, its architectures name), head off. */
  ck_assert_ok(parse(CFG_HEAD "\"architectures\": [\"DSparkDraftModel\"], \"dflash_config\": "
                              "{\"block_size\": 16, \"mask_token_id\": 1, \"markov_rank\": 256, "
                              "\"enable_confidence_head\": false, \"sample_from_anchor\": true, "
                              "\"draft_vocab_size\": 1000}}",
                     &c2));
  ck_assert_int_eq(c2.dspark, 1);
  ck_assert_int_eq(c2.block_size, 16);
  ck_assert_int_eq(c2.markov_rank, 256);
  ck_assert_int_eq(c2.confidence_head, 0);
  ck_assert_int_eq(c2.num_anchors, 0);
  len = sizeof buf;
  ck_assert_ok(dflash_drafter_config_to_json(&c2, buf, len, &len));
  ck_assert_ptr_nonnull(strstr(buf, "\"enable_confidence_head\": false"));
  ck_assert_ptr_null(strstr(buf, "num_anchors"));
  ck_assert_ptr_nonnull(strstr(buf, "\"Qwen3DSparkModel\""));
  /* A caller's struct of an older header (no DSpark fields) cannot hold it. */
  dflash_drafter_config old;
  dflash_drafter_config_init(&old, OLDER_THAN(dspark));
  ck_assert_status(parse(DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5}", &old), DFLASH_E_UNSUPPORTED,
                   "t.json: a DSpark \"architectures\" does not fit in a dflash_drafter_config "
                   "of struct_size");
  /* ... and its missing tail (DFlash) reads as DFlash. */
  ck_assert_ok(parse(CFG_HEAD CFG_TAIL "}", &old));
  len = sizeof buf;
  ck_assert_ok(dflash_drafter_config_to_json(&old, buf, len, &len));
  ck_assert_ptr_null(strstr(buf, "markov"));
}
END_TEST

/* What the spec makes an engine refuse, and what libdflash does not implement, is refused by
 * name; DSpark's keys in a DFlash config would be dropped, and are refused too. */
START_TEST(dspark_bad_configs_refused) {
  static const struct {
    const char *text;
    dflash_status st;
    const char *want;
  } bad[] = {
      {DSP_HEAD "\"mask_token_id\": 5, \"enable_confidence_head\": true, "
                "\"sample_from_anchor\": true}",
       DFLASH_E_CONFIG, "t.json: a DSpark config needs \"markov_rank\""},
      {DSP_HEAD "\"mask_token_id\": 5, \"markov_rank\": 8, \"sample_from_anchor\": true}",
       DFLASH_E_CONFIG, "needs \"enable_confidence_head\""},
      {DSP_HEAD "\"mask_token_id\": 5, \"markov_rank\": 8, \"enable_confidence_head\": true}",
       DFLASH_E_CONFIG, "needs \"sample_from_anchor\": true"},
      {DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"dflash_config\": {\"enable_confidence_head\": "
                         "false}}",
       DFLASH_E_CONFIG, "\"enable_confidence_head\" at the top level disagrees"},
      {DSP_HEAD "\"mask_token_id\": 5, \"markov_rank\": 8, \"enable_confidence_head\": true, "
                "\"sample_from_anchor\": false}",
       DFLASH_E_UNSUPPORTED, "bonus-anchor layout is not implemented"},
      {DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"dflash_config\": {\"markov_rank\": 16}}",
       DFLASH_E_CONFIG, "t.json: \"markov_rank\" at the top level disagrees with dflash_config's"},
      {DSP_HEAD "\"mask_token_id\": 5, \"markov_rank\": 8, \"enable_confidence_head\": true, "
                "\"sample_from_anchor\": true, \"markov_head_type\": \"gated\"}",
       DFLASH_E_UNSUPPORTED, "\"markov_head_type\" = \"gated\" is not implemented"},
      {DSP_HEAD "\"mask_token_id\": 5, \"markov_rank\": 8, \"enable_confidence_head\": true, "
                "\"sample_from_anchor\": true, \"confidence_head_with_markov\": false}",
       DFLASH_E_UNSUPPORTED, "\"confidence_head_with_markov\" = false"},
      {DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"draft_vocab_size\": 1001}", DFLASH_E_CONFIG,
       "t.json: \"draft_vocab_size\" must be in 1..vocab_size 1000 (got 1001)"},
      {DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"draft_vocab_size\": 0}", DFLASH_E_CONFIG,
       "\"draft_vocab_size\" must be in 1..vocab_size"},
      {DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"draft_vocab_size\": 500, \"dflash_config\": "
                         "{\"draft_vocab_size\": 400}}",
       DFLASH_E_CONFIG, "\"draft_vocab_size\" at the top level disagrees with dflash_config's"},
      {CFG_HEAD "\"draft_vocab_size\": 500, " CFG_TAIL "}", DFLASH_E_UNSUPPORTED,
       "\"draft_vocab_size\" = 500 is not implemented by libdflash"},
      {DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"speculators_model_type\": \"dspark\"}",
       DFLASH_E_UNSUPPORTED, "SGLang refuses"},
      {DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"transformer_layer_config\": {}}",
       DFLASH_E_UNSUPPORTED, "bonus-anchor layout"},
      {DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"aux_hidden_state_layer_ids\": [1]}",
       DFLASH_E_UNSUPPORTED, "\"aux_hidden_state_layer_ids\""},
      {DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"logit_scale\": 2.0}", DFLASH_E_UNSUPPORTED,
       "\"logit_scale\" = 2.0"},
      {DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"tie_word_embeddings\": true}", DFLASH_E_CONFIG,
       "tie_word_embeddings false"},
      {DSP_HEAD "\"mask_token_id\": 5, \"markov_rank\": 0, \"enable_confidence_head\": true, "
                "\"sample_from_anchor\": true}",
       DFLASH_E_CONFIG, "markov_rank must be in 1..65536 (got 0)"},
      {DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"target_layer_ids\": [3], "
                         "\"dflash_config\": {\"target_layer_ids\": [4]}}",
       DFLASH_E_CONFIG, "differs from dflash_config.target_layer_ids"},
      {DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"dflash_config\": {\"markov_rnk\": 3}}",
       DFLASH_E_CONFIG, "did you mean markov_rank?"},
      {CFG_HEAD "\"markov_rank\": 256, " CFG_TAIL "}", DFLASH_E_UNSUPPORTED,
       "\"markov_rank\" = 256 is not implemented by libdflash (DSpark's Markov and confidence "
       "heads need \"architectures\": [\"Qwen3DSparkModel\"]"},
      {CFG_HEAD "\"block_size\": 4, \"dflash_config\": {\"mask_token_id\": 1, "
                "\"sample_from_anchor\": true}}",
       DFLASH_E_UNSUPPORTED, "dflash_config.\"sample_from_anchor\" = true"},
      {CFG_HEAD "\"architectures\": [\"DSparkSpeculator\"], " CFG_TAIL "}", DFLASH_E_UNSUPPORTED,
       "\"architectures\" = [\"DSparkSpeculator\"]"},
  };
  dflash_drafter_config c = {.struct_size = sizeof c};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    ck_assert_status(parse(bad[i].text, &c), bad[i].st, bad[i].want);
  }
  /* Off values of the DSpark keys leave a DFlash config alone. */
  ck_assert_ok(parse(CFG_HEAD "\"markov_rank\": 0, \"enable_confidence_head\": false, "
                              "\"sample_from_anchor\": null, " CFG_TAIL "}",
                     &c));
  ck_assert_int_eq(c.dspark, 0);
  /* The struct's rules: fields without the architecture, or with DFlash 2, are refused. */
  ck_assert_ok(parse(CFG_HEAD CFG_TAIL "}", &c));
  c.markov_rank = 8;
  ck_assert_status(dflash_drafter_config_validate(&c), DFLASH_E_CONFIG, "dspark is 0");
  size_t len = 0;
  ck_assert_status(dflash_drafter_config_to_json(&c, NULL, 0, &len), DFLASH_E_CONFIG,
                   "dspark is 0");
  c.markov_rank = 0, c.num_anchors = 512;
  ck_assert_status(dflash_drafter_config_validate(&c), DFLASH_E_CONFIG, "num_anchors 512");
  c.dspark = 1, c.markov_rank = 8;
  ck_assert_ok(dflash_drafter_config_validate(&c));
  c.dflash2 = 1, c.conv_kernel_size = 2, c.conv_group_size = 16, c.selector_top_k = 8;
  c.selector_rank = 8;
  ck_assert_status(dflash_drafter_config_validate(&c), DFLASH_E_CONFIG, "exclusive");
  /* A pruned draft vocabulary: DSpark only, 0 < V_d <= V. */
  ck_assert_ok(parse(CFG_HEAD CFG_TAIL "}", &c));
  c.draft_vocab_size = 500;
  ck_assert_status(dflash_drafter_config_validate(&c), DFLASH_E_CONFIG,
                   "draft_vocab_size 500 below vocab_size 1000 is for a DSpark drafter only");
  c.draft_vocab_size = 1000; /* the full vocabulary: not pruned */
  ck_assert_ok(dflash_drafter_config_validate(&c));
  /* SpecForge's export writes draft_vocab_size = vocab_size into every DFlash config. */
  ck_assert_ok(parse(CFG_HEAD "\"draft_vocab_size\": 1000, " CFG_TAIL "}", &c));
  ck_assert_int_eq(c.draft_vocab_size, 0);
  c.dspark = 1, c.markov_rank = 8, c.draft_vocab_size = 1001;
  ck_assert_status(dflash_drafter_config_validate(&c), DFLASH_E_CONFIG,
                   "draft_vocab_size must be in 0..vocab_size 1000 (got 1001)");
  c.draft_vocab_size = -1;
  ck_assert_status(dflash_drafter_config_validate(&c), DFLASH_E_CONFIG,
                   "draft_vocab_size must be in 0..vocab_size 1000 (got -1)");
}
END_TEST

/* A pruned draft vocabulary (spec/dspark.md sections 4-5): draft_vocab_size read from either
 * place, written in both only when below vocab_size, read back the same; V_d = V is no
 * pruning (0 in the struct, not written); an older caller's struct cannot hold it. */
START_TEST(dspark_draft_vocab_config) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(parse(DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"dflash_config\": "
                                       "{\"draft_vocab_size\": 300}}",
                     &c));
  ck_assert_int_eq(c.draft_vocab_size, 300);
  char buf[8192];
  size_t len = sizeof buf;
  ck_assert_ok(dflash_drafter_config_to_json(&c, buf, len, &len));
  const char *a = strstr(buf, "\"draft_vocab_size\": 300");
  ck_assert_msg(a && strstr(a + 1, "\"draft_vocab_size\": 300"), "not written twice in\n%s", buf);
  dflash_drafter_config c2 = {.struct_size = sizeof c2};
  ck_assert_ok(parse(buf, &c2));
  ck_assert_mem_eq(&c2, &c, sizeof c);
  ck_assert_ok(parse(DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"draft_vocab_size\": 1000}", &c));
  ck_assert_int_eq(c.draft_vocab_size, 0);
  len = sizeof buf;
  ck_assert_ok(dflash_drafter_config_to_json(&c, buf, len, &len));
  ck_assert_ptr_null(strstr(buf, "draft_vocab_size"));
  dflash_drafter_config old;
  dflash_drafter_config_init(&old, OLDER_THAN(draft_vocab_size));
  ck_assert_status(parse(DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5, \"draft_vocab_size\": 300}",
                         &old),
                   DFLASH_E_UNSUPPORTED, "\"draft_vocab_size\" = 300 does not fit");
}
END_TEST

/* A DSpark config.json makes a trainer; adaptive weighting (DFlash's, from the step's own
 * LM-head pass) is refused by name. Where DSpark trains and where it is refused by backend
 * and vocabulary: tests/train/test_dspark_model.c. */
START_TEST(dspark_config_makes_a_trainer) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(parse(DSP_HEAD DSP_KEYS ", \"mask_token_id\": 5}", &c));
  float *embed = calloc(1000 * 64, sizeof *embed);
  ck_assert_ptr_nonnull(embed);
  dflash_trainer *t = NULL;
  ck_assert_ok(dflash_trainer_create(&c, embed, embed, NULL, &t));
  dflash_trainer_free(t);
  t = NULL;
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.position_weighting = DFLASH_POSITION_WEIGHTING_ADAPTIVE;
  ck_assert_status(dflash_trainer_create(&c, embed, embed, &o, &t), DFLASH_E_UNSUPPORTED,
                   "position_weighting ADAPTIVE");
  ck_assert_ptr_null(t);
  free(embed);
}
END_TEST

TCase *tc_config(void) {
  TCase *tc = tcase_create("config");
  tcase_add_test(tc, unknown_keys_are_named_with_a_close_match);
  tcase_add_test(tc, block_size_placements);
  tcase_add_test(tc, default_target_layers_follow_spec);
  tcase_add_test(tc, validation_names_the_problem);
  tcase_add_test(tc, yarn_and_round_trip);
  tcase_add_test(tc, gamma_table);
  tcase_add_test(tc, num_target_layers_written_or_refused);
  tcase_add_test(tc, yarn_factor_must_match_ratio);
  tcase_add_test(tc, architectures_must_be_dflash);
  tcase_add_test(tc, unimplemented_keys_refused);
  tcase_add_test(tc, head_dim_defaults_as_qwen3config);
  tcase_add_test(tc, sliding_layers_need_use_sliding_window);
  tcase_add_test(tc, partial_rotary_factor_parsed_or_refused);
  tcase_add_test(tc, dflash2_config_parsed_and_written);
  tcase_add_test(tc, dflash2_bad_sizes_refused);
  tcase_add_test(tc, dspark_config_parsed_and_written);
  tcase_add_test(tc, dspark_bad_configs_refused);
  tcase_add_test(tc, dspark_draft_vocab_config);
  tcase_add_test(tc, dspark_config_makes_a_trainer);
  return tc;
}
