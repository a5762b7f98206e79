/*
 * Keys of a drafter config.json that nothing reads: a typo of a field the library reads would
 * otherwise train with that field's default (`target_layer_id` trains the default layers and
 * writes them into the checkpoint). Split from config.c, which reads the keys.
 */
#include "config_keys.h"

#include <stdlib.h>
#include <string.h>

/* DSpark's keys that a DFlash config must leave off (config.c refuses them set there). */
#define DSPARK_ONLY_KEYS                                                                      \
  "markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", \
      "sample_from_anchor", "draft_vocab_size"

/* Keys read in dflash_config and at the top level alike: DFlash 2's sizes, the scales, and
 * DSpark's, which the spec writes in both places (config.c's dspark_json). One list, so that
 * a key added for one place is not missing from the other. */
#define SHARED_KEYS                                                          \
  "conv_kernel_size", "conv_group_size", "selector_top_k", "selector_rank",  \
      "input_embedding_scale", "output_multiplier", "attention_value_scale", \
      "final_logit_softcapping", "is_causal", "num_anchors", DSPARK_ONLY_KEYS

/* dflash_config belongs to DFlash: every key in it is one the library reads, or one an engine
 * reads that the library has no use for (SGLang's "mask_token", the token's text, which the
 * library's mask_token_id makes redundant). Anything else in it is a mistake. The first two
 * are the ones a top-level key is checked against (df_config_check_keys). */
static const char *const inner_keys[] = {
    "mask_token_id", "target_layer_ids", "block_size", "mask_token", SHARED_KEYS,
};

static const char *const dspark_keys[] = {DSPARK_ONLY_KEYS};

bool df_config_dspark_key(const char *key) {
  for (size_t i = 0; i < DF_ARRAY_LEN(dspark_keys); i++)
    if (!strcmp(key, dspark_keys[i])) return true;
  return false;
}

df_config_arch_kind df_config_arch(json_t *root) {
  json_t *a = json_object_get(root, "architectures");
  if (!a || json_is_null(a)) return DF_ARCH_DFLASH;
  const char *name = json_is_array(a) && json_array_size(a) == 1
                         ? json_string_value(json_array_get(a, 0))
                         : NULL;
  if (!name) return DF_ARCH_OTHER;
  if (!strcmp(name, "DFlashDraftModel")) return DF_ARCH_DFLASH;
  if (!strcmp(name, "DFlash2DraftModel")) return DF_ARCH_DFLASH2;
  /* The spec's name, and SpecForge's, which llama.cpp's converter also takes (its third,
   * speculators' DSparkSpeculator, nests the layer config elsewhere: not read). */
  if (!strcmp(name, "Qwen3DSparkModel") || !strcmp(name, "DSparkDraftModel")) return DF_ARCH_DSPARK;
  return DF_ARCH_OTHER;
}

/* The top level is transformers' PretrainedConfig: real configs (z-lab's, speculators',
 * SGLang's) carry dozens of its keys the library does not read (bos_token_id, use_cache,
 * transformers_version, ...), and new transformers releases add more, so an unknown key there
 * is no error. Only a near miss of a key the library reads is: that is the typo that trains
 * with a default. The distances of the real keys to these are 3 or more (bos_token_id and
 * pad_token_id to mask_token_id), above the threshold (near()). */
static const char *const top_keys[] = {
    "architectures",      "attention_bias",
    "block_size",         "dflash_config",
    "head_dim",           "hidden_size",
    "intermediate_size",  "layer_types",
    "mask_token_id",      "max_position_embeddings",
    "max_window_layers",  "num_attention_heads",
    "num_hidden_layers",  "num_key_value_heads",
    "num_target_layers",  "partial_rotary_factor",
    "rms_norm_eps",       "rope_parameters",
    "rope_scaling",       "rope_theta",
    "sliding_window",     "tie_word_embeddings",
    "use_sliding_window", "vocab_size",
    "logit_scale",        SHARED_KEYS,
};

enum { MAX_KEY = 64 };

static int min3(int a, int b, int c) {
  int m = a < b ? a : b;
  return m < c ? m : c;
}

/* Optimal-string-alignment distance (Levenshtein plus adjacent swaps); keys longer than
 * MAX_KEY are far from every name here. */
static int distance(const char *a, const char *b) {
  size_t n = strlen(a), m = strlen(b);
  if (n >= MAX_KEY || m >= MAX_KEY) return MAX_KEY;
  int d[MAX_KEY + 1][MAX_KEY + 1];
  for (size_t i = 0; i <= n; i++) d[i][0] = (int)i;
  for (size_t j = 0; j <= m; j++) d[0][j] = (int)j;
  for (size_t i = 1; i <= n; i++)
    for (size_t j = 1; j <= m; j++) {
      int cost = a[i - 1] != b[j - 1];
      d[i][j] = min3(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost);
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] &&
          d[i - 2][j - 2] + 1 < d[i][j])
        d[i][j] = d[i - 2][j - 2] + 1;
    }
  return d[n][m];
}

/* The closest of `names` to `key` and its distance. */
static const char *closest(const char *key, const char *const *names, size_t n, int *dist) {
  const char *best = NULL;
  *dist = MAX_KEY;
  for (size_t i = 0; i < n; i++) {
    int k = distance(key, names[i]);
    if (k < *dist) *dist = k, best = names[i];
  }
  return best;
}

static bool listed(const char *key, const char *const *names, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!strcmp(key, names[i])) return true;
  return false;
}

/* A near miss: 1 edit for short names (head_dim), 2 for the rest. */
static bool near(const char *name, int dist) {
  return dist > 0 && dist <= (strlen(name) <= 8 ? 1 : 2);
}

static dflash_status check_inner(const char *what, json_t *dc) {
  const char *key;
  json_t *v;
  json_object_foreach(dc, key, v) {
    if (listed(key, inner_keys, DF_ARRAY_LEN(inner_keys))) continue;
    int d;
    const char *best = closest(key, inner_keys, DF_ARRAY_LEN(inner_keys), &d);
    if (d <= 3)
      return df_error(DFLASH_E_CONFIG,
                      "%s: unknown key \"dflash_config.%s\" (did you mean %s?): nothing reads "
                      "it, so the drafter would train with that field's default",
                      what, key, best);
    return df_error(DFLASH_E_CONFIG,
                    "%s: unknown key \"dflash_config.%s\": dflash_config holds only DFlash's "
                    "fields (mask_token_id, target_layer_ids, block_size, DFlash 2's sizes, ...)",
                    what, key);
  }
  return DFLASH_OK;
}

/* A top-level target_layer_ids is read by nothing (z-lab's model, SGLang and vLLM read
 * dflash_config's): refused unless dflash_config holds the same list. DSpark's checkpoints
 * carry it there (spec/dspark.md section 5), and config.c reads it when dflash_config has
 * none; both given must still agree. */
static dflash_status check_misplaced(const char *what, json_t *root, json_t *dc) {
  json_t *top = json_object_get(root, "target_layer_ids");
  if (!top || json_is_null(top)) return DFLASH_OK;
  json_t *inner = dc ? json_object_get(dc, "target_layer_ids") : NULL;
  if (inner && json_is_null(inner)) inner = NULL;
  if (inner && json_equal(inner, top)) return DFLASH_OK;
  if (!inner && df_config_arch(root) == DF_ARCH_DSPARK) return DFLASH_OK;
  if (inner && df_config_arch(root) == DF_ARCH_DSPARK)
    return df_error(DFLASH_E_CONFIG,
                    "%s: \"target_layer_ids\" at the top level differs from "
                    "dflash_config.target_layer_ids",
                    what);
  return df_error(DFLASH_E_CONFIG,
                  "%s: \"target_layer_ids\" at the top level is not read (did you mean "
                  "dflash_config.target_layer_ids?)%s",
                  what, inner ? "; it also differs from dflash_config's" : "");
}

dflash_status df_config_check_keys(const char *what, json_t *root) {
  json_t *dc = json_object_get(root, "dflash_config");
  dflash_status st = dc && json_is_object(dc) ? check_inner(what, dc) : DFLASH_OK;
  if (!st) st = check_misplaced(what, root, json_is_object(dc) ? dc : NULL);
  if (st) return st;
  const char *key;
  json_t *v;
  json_object_foreach(root, key, v) {
    if (listed(key, top_keys, DF_ARRAY_LEN(top_keys))) continue;
    int d, di;
    const char *best = closest(key, top_keys, DF_ARRAY_LEN(top_keys), &d);
    const char *inner = closest(key, inner_keys, 2, &di); /* mask_token_id, target_layer_ids */
    if (near(inner, di) && di < d)
      return df_error(DFLASH_E_CONFIG,
                      "%s: unknown key \"%s\" (did you mean dflash_config.%s?): nothing reads "
                      "it, so the drafter would train with that field's default",
                      what, key, inner);
    if (best && near(best, d))
      return df_error(DFLASH_E_CONFIG,
                      "%s: unknown key \"%s\" (did you mean %s?): nothing reads it, so the "
                      "drafter would train with that field's default",
                      what, key, best);
  }
  return DFLASH_OK;
}

dflash_status df_config_refuse_key(const char *what, const char *where, const char *key, json_t *v,
                                   const char *why) {
  char *text = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
  dflash_status st = df_error(DFLASH_E_UNSUPPORTED,
                              "%s: %s\"%s\" = %s is not implemented by "
                              "libdflash (%s)",
                              what, where, key, text ? text : "?", why);
  free(text);
  return st;
}
