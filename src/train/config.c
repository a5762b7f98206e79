/*
 * Drafter config.json: parse the way SGLang and vLLM read it (a Qwen3Config
 * with DFlash fields), validate, and write it back with both block_size
 * placements and an explicit YaRN attention factor.
 */
#include "core/internal.h"
#include "config_dspark.h"
#include "config_keys.h"
#include "model.h"

#include <dflash/storage.h>
#include <dflash/train.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void drafter_config_defaults(dflash_drafter_config *cfg) {
  if (!cfg) return;
  memset(cfg, 0, sizeof *cfg);
  cfg->struct_size = sizeof *cfg;
  cfg->rms_norm_eps = 1e-6;
  cfg->rope_theta = 10000.0; /* Qwen3Config's default when the file has none */
  cfg->max_position_embeddings = 32768;
  cfg->rope_type = DFLASH_ROPE_DEFAULT;
  cfg->rope_beta_fast = 32.0;
  cfg->rope_beta_slow = 1.0;
  cfg->rope_truncate = 1;
  cfg->mask_token_id = -1;
  cfg->partial_rotary_factor = 1.0;
}

DF_DEFINE_INIT(dflash_drafter_config, drafter_config_defaults)

dflash_status df_config_in(const dflash_drafter_config *in, dflash_drafter_config *cfg) {
  drafter_config_defaults(cfg);
  if (!in) return df_error(DFLASH_E_INVALID_ARG, "dflash_drafter_config: NULL");
  return df_opts_in(cfg, in, sizeof *cfg, "dflash_drafter_config");
}

void df_config_ext_of(const dflash_drafter_config *cfg, df_config_ext *ext) {
  *ext = (df_config_ext){.partial_rotary_factor = cfg->partial_rotary_factor,
                         .dflash2 = cfg->dflash2,
                         .conv_kernel_size = cfg->conv_kernel_size,
                         .conv_group_size = cfg->conv_group_size,
                         .selector_top_k = cfg->selector_top_k,
                         .selector_rank = cfg->selector_rank,
                         .dspark = cfg->dspark,
                         .markov_rank = cfg->markov_rank,
                         .confidence_head = cfg->confidence_head,
                         .num_anchors = cfg->num_anchors,
                         .draft_vocab = cfg->draft_vocab_size > 0 &&
                                                cfg->draft_vocab_size < cfg->vocab_size
                                            ? cfg->draft_vocab_size
                                            : cfg->vocab_size};
}

/* Whether a caller's struct of `size` bytes holds `field` (fields are appended, never moved). */
#define CFG_HOLDS(size, field) \
  ((size) >= offsetof(dflash_drafter_config, field) + sizeof(((dflash_drafter_config *)0)->field))

int df_rotary_dims(const dflash_drafter_config *cfg, const df_config_ext *ext) {
  /* Python's int(head_dim * partial_rotary_factor), as transformers and
   * llama.cpp's converter compute it. */
  double f = ext ? ext->partial_rotary_factor : 1.0;
  return f >= 1.0 ? cfg->head_dim : (int)((double)cfg->head_dim * f);
}

dflash_status df_config_ext_validate(const dflash_drafter_config *cfg, const df_config_ext *ext,
                                     const char *what) {
  if (!ext) return DFLASH_OK;
  double f = ext->partial_rotary_factor;
  if (!(f > 0.0 && f <= 1.0))
    return df_error(DFLASH_E_CONFIG, "%s: partial_rotary_factor must be in (0, 1] (got %g)", what,
                    f);
  int rot = df_rotary_dims(cfg, ext);
  if (rot < 2 || rot % 2)
    return df_error(DFLASH_E_CONFIG,
                    "%s: partial_rotary_factor %g rotates int(%d * %g) = %d "
                    "dims of each head; that must be even and at least 2",
                    what, f, cfg->head_dim, f, rot);
  dflash_status st = df_dflash2_validate(cfg, ext, what);
  return st ? st : df_dspark_validate(cfg, ext, what);
}

dflash_status df_dflash2_validate(const dflash_drafter_config *cfg, const df_config_ext *e,
                                  const char *what) {
  if (e->dflash2 != 0 && e->dflash2 != 1)
    return df_error(DFLASH_E_CONFIG, "%s: dflash2 must be 0 or 1 (got %d)", what, e->dflash2);
  if (!e->dflash2) {
    /* Sizes without the architecture would be dropped silently. */
    if (e->conv_kernel_size || e->conv_group_size || e->selector_top_k || e->selector_rank)
      return df_error(DFLASH_E_CONFIG,
                      "%s: DFlash 2 sizes (conv_kernel_size %d, "
                      "conv_group_size %d, selector_top_k %d, selector_rank %d) are set but "
                      "dflash2 is 0",
                      what, e->conv_kernel_size, e->conv_group_size, e->selector_top_k,
                      e->selector_rank);
    return DFLASH_OK;
  }
  /* The bounds keep 2 k H / g and V r inside int32 for the tensor table. */
  if (e->conv_kernel_size < 1 || e->conv_kernel_size > 64)
    return df_error(DFLASH_E_CONFIG, "%s: conv_kernel_size must be in 1..64 (got %d)", what,
                    e->conv_kernel_size);
  if (e->conv_group_size < 1 || cfg->hidden_size % e->conv_group_size)
    return df_error(DFLASH_E_CONFIG,
                    "%s: conv_group_size %d must be >= 1 and divide "
                    "hidden_size %d",
                    what, e->conv_group_size, cfg->hidden_size);
  if (e->selector_top_k < 1 || e->selector_top_k > cfg->vocab_size)
    return df_error(DFLASH_E_CONFIG, "%s: selector_top_k must be in 1..vocab_size=%d (got %d)",
                    what, cfg->vocab_size, e->selector_top_k);
  if (e->selector_top_k > 1024) /* dflash2.c's candidate buffer */
    return df_error(DFLASH_E_CONFIG, "%s: selector_top_k %d is above libdflash's limit of 1024",
                    what, e->selector_top_k);
  if (e->selector_rank < 1 || e->selector_rank > 65536)
    return df_error(DFLASH_E_CONFIG, "%s: selector_rank must be in 1..65536 (got %d)", what,
                    e->selector_rank);
  return DFLASH_OK;
}

dflash_status dflash_drafter_default_target_layers(int32_t num_target_layers, int32_t k,
                                                   int32_t *out) {
  DF_CHECK_ARG(out);
  if (k < 1 || k > DFLASH_DRAFTER_MAX_TARGET || num_target_layers < 1)
    return df_error(DFLASH_E_CONFIG,
                    "default target layers: need 1 <= K <= %d and L >= 1 "
                    "(got K=%d, L=%d)",
                    DFLASH_DRAFTER_MAX_TARGET, k, num_target_layers);
  if (k == 1) {
    out[0] = num_target_layers / 2;
    return DFLASH_OK;
  }
  if (num_target_layers < 5)
    return df_error(DFLASH_E_CONFIG,
                    "default target layers: %d target layers are too few for "
                    "K=%d (the rule spreads them over layers 1..L-3)",
                    num_target_layers, k);
  double span = (double)(num_target_layers - 4);
  /* Python's round() (half to even), as the reference trainer computes it. */
  for (int32_t i = 0; i < k; i++) out[i] = (int32_t)rint(1.0 + (double)i * span / (double)(k - 1));
  return DFLASH_OK;
}

double dflash_trainer_default_loss_gamma(int32_t block_size) {
  switch (block_size) {
  case 16: return 7.0;
  case 10: return 5.0;
  case 8: return 4.0;
  default: return block_size > 1 ? block_size / 2.0 : 1.0;
  }
}

/* ---- validation ----------------------------------------------------------- */

static double yarn_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * log(scale) + 1.0;
}

/* SGLang, vLLM and transformers 4.46 / 4.57 / 5.x use rope_scaling.factor;
 * transformers 4.51-4.55 replaced it by max_position_embeddings /
 * original_max_position_embeddings whenever the latter is given. A config where the two disagree means
 * different RoPE frequencies in different engines: refused. */
dflash_status df_yarn_check(const dflash_drafter_config *c, const char *what) {
  if (c->rope_type != DFLASH_ROPE_YARN || c->rope_original_max_position <= 0) return DFLASH_OK;
  double ratio = (double)c->max_position_embeddings / c->rope_original_max_position;
  if (fabs(ratio - c->rope_factor) > 1e-9 * c->rope_factor)
    return df_error(DFLASH_E_CONFIG,
                    "%s: rope_scaling.factor %g differs from "
                    "max_position_embeddings / rope_scaling.original_max_position_embeddings = "
                    "%d / %d = %g (engines use the factor, transformers 4.51-4.55 the ratio); set "
                    "max_position_embeddings to %.0f",
                    what, c->rope_factor, c->max_position_embeddings, c->rope_original_max_position,
                    ratio, c->rope_factor * c->rope_original_max_position);
  return DFLASH_OK;
}

dflash_status dflash_drafter_config_validate(const dflash_drafter_config *caller) {
  DF_CHECK_ARG(caller);
  dflash_drafter_config full, *c = &full;
  dflash_status in = df_config_in(caller, &full);
  if (in) return in;
#define NEED(cond, ...)                                                            \
  do {                                                                             \
    if (!(cond)) return df_error(DFLASH_E_CONFIG, "drafter config: " __VA_ARGS__); \
  } while (0)
  NEED(c->hidden_size > 0, "hidden_size must be positive (got %d)", c->hidden_size);
  NEED(c->intermediate_size > 0, "intermediate_size must be positive (got %d)",
       c->intermediate_size);
  NEED(c->num_hidden_layers > 0 && c->num_hidden_layers <= DFLASH_DRAFTER_MAX_LAYERS,
       "num_hidden_layers must be in 1..%d (got %d)", DFLASH_DRAFTER_MAX_LAYERS,
       c->num_hidden_layers);
  NEED(c->num_attention_heads > 0, "num_attention_heads must be positive (got %d)",
       c->num_attention_heads);
  NEED(c->num_key_value_heads > 0 && c->num_attention_heads % c->num_key_value_heads == 0,
       "num_attention_heads (%d) must be a multiple of num_key_value_heads (%d)",
       c->num_attention_heads, c->num_key_value_heads);
  NEED(c->head_dim > 0 && c->head_dim % 2 == 0 && c->head_dim <= 512,
       "head_dim must be even, in 2..512 (got %d)", c->head_dim);
  NEED(c->vocab_size > 0, "vocab_size must be positive (got %d)", c->vocab_size);
  NEED(c->mask_token_id >= 0 && c->mask_token_id < c->vocab_size,
       "mask_token_id %d is outside the vocabulary [0, %d)", c->mask_token_id, c->vocab_size);
  NEED(c->block_size >= 2, "block_size must be at least 2 (got %d)", c->block_size);
  NEED(c->rms_norm_eps > 0, "rms_norm_eps must be positive (got %g)", c->rms_norm_eps);
  NEED(c->rope_theta > 1.0, "rope_theta must exceed 1 (got %g)", c->rope_theta);
  NEED(c->attention_bias == 0, "attention_bias=true is not supported by this trainer");
  /* num_target_layers may be absent (0) when the layer ids are explicit. */
  NEED(c->num_target_layers >= 0, "num_target_layers must not be negative (got %d)",
       c->num_target_layers);
  NEED(c->n_target_layer_ids > 0 && c->n_target_layer_ids <= DFLASH_DRAFTER_MAX_TARGET,
       "dflash_config.target_layer_ids must have 1..%d entries (got %d)", DFLASH_DRAFTER_MAX_TARGET,
       c->n_target_layer_ids);
  for (int32_t i = 0; i < c->n_target_layer_ids; i++)
    NEED(c->target_layer_ids[i] >= 0 &&
             (c->num_target_layers == 0 || c->target_layer_ids[i] < c->num_target_layers),
         "target_layer_ids[%d] = %d is outside the target's layers [0, %d)", i,
         c->target_layer_ids[i], c->num_target_layers);
  bool sliding = false;
  for (int32_t i = 0; i < c->num_hidden_layers; i++) {
    NEED(c->layer_types[i] == DFLASH_LAYER_FULL || c->layer_types[i] == DFLASH_LAYER_SLIDING,
         "layer_types[%d] has unknown value %d", i, c->layer_types[i]);
    sliding |= c->layer_types[i] == DFLASH_LAYER_SLIDING;
  }
  NEED(!sliding || c->sliding_window > 0,
       "sliding_attention layers need a positive sliding_window (got %d)", c->sliding_window);
  NEED(c->rope_type == DFLASH_ROPE_DEFAULT || c->rope_type == DFLASH_ROPE_YARN,
       "unknown rope type %d", c->rope_type);
  if (c->rope_type == DFLASH_ROPE_YARN) {
    NEED(c->rope_factor >= 1.0, "rope_scaling.factor must be >= 1 for yarn (got %g)",
         c->rope_factor);
    NEED(c->rope_original_max_position > 0,
         "rope_scaling.original_max_position_embeddings must be positive (got %d)",
         c->rope_original_max_position);
    NEED(c->rope_attention_factor > 0, "rope_scaling.attention_factor must be positive (got %g)",
         c->rope_attention_factor);
    NEED(c->rope_beta_fast > 0 && c->rope_beta_slow > 0,
         "rope_scaling.beta_fast/beta_slow must be positive");
  }
#undef NEED
  df_config_ext ext; /* partial RoPE and DFlash 2 */
  df_config_ext_of(c, &ext);
  return df_config_ext_validate(c, &ext, "drafter config");
}

/* ---- parsing -------------------------------------------------------------- */

typedef struct parser {
  const char *what;
} parser;

/* Fetch an optional integer; absent or null leaves *out. */
static dflash_status get_int(const parser *p, json_t *obj, const char *key, int32_t *out,
                             bool required) {
  json_t *v = json_object_get(obj, key);
  if (!v || json_is_null(v)) {
    if (required) return df_error(DFLASH_E_CONFIG, "%s: missing \"%s\"", p->what, key);
    return DFLASH_OK;
  }
  if (!json_is_integer(v) || json_integer_value(v) < INT32_MIN || json_integer_value(v) > INT32_MAX)
    return df_error(DFLASH_E_CONFIG, "%s: \"%s\" must be a 32-bit integer", p->what, key);
  *out = (int32_t)json_integer_value(v);
  return DFLASH_OK;
}

static dflash_status get_real(const parser *p, json_t *obj, const char *key, double *out) {
  json_t *v = json_object_get(obj, key);
  if (!v || json_is_null(v)) return DFLASH_OK;
  if (!json_is_number(v))
    return df_error(DFLASH_E_CONFIG, "%s: \"%s\" must be a number", p->what, key);
  *out = json_number_value(v);
  return DFLASH_OK;
}

static dflash_status get_bool(const parser *p, json_t *obj, const char *key, int32_t *out) {
  json_t *v = json_object_get(obj, key);
  if (!v || json_is_null(v)) return DFLASH_OK;
  if (!json_is_boolean(v))
    return df_error(DFLASH_E_CONFIG, "%s: \"%s\" must be true or false", p->what, key);
  *out = json_is_true(v);
  return DFLASH_OK;
}

static dflash_status parse_rope(const parser *p, json_t *root, dflash_drafter_config *c) {
  json_t *rs = json_object_get(root, "rope_scaling");
  json_t *rp = json_object_get(root, "rope_parameters"); /* transformers v5 spelling */
  dflash_status st;
  const char *key = "rope_scaling";
  if ((!rs || json_is_null(rs)) && rp && json_is_object(rp)) {
    if ((st = get_real(p, rp, "rope_theta", &c->rope_theta))) return st;
    rs = rp;
    key = "rope_parameters";
  }
  if (!rs || json_is_null(rs)) return DFLASH_OK;
  if (!json_is_object(rs))
    return df_error(DFLASH_E_CONFIG, "%s: \"rope_scaling\" must be an object or null", p->what);
  json_t *type = json_object_get(rs, "rope_type");
  if (!type) type = json_object_get(rs, "type");
  const char *name = type && json_is_string(type) ? json_string_value(type) : "default";
  if (!strcmp(name, "default")) return DFLASH_OK;
  if (strcmp(name, "yarn"))
    return df_error(DFLASH_E_UNSUPPORTED,
                    "%s: rope_scaling type \"%s\" is not supported "
                    "(default and yarn are)",
                    p->what, name);
  c->rope_type = DFLASH_ROPE_YARN;
  c->rope_original_max_position = 0;
  double mscale = 0, mscale_all = 0, attn = 0;
  if ((st = get_real(p, rs, "factor", &c->rope_factor)) ||
      (st = get_real(p, rs, "beta_fast", &c->rope_beta_fast)) ||
      (st = get_real(p, rs, "beta_slow", &c->rope_beta_slow)) ||
      (st = get_real(p, rs, "attention_factor", &attn)) ||
      (st = get_real(p, rs, "mscale", &mscale)) ||
      (st = get_real(p, rs, "mscale_all_dim", &mscale_all)) ||
      (st = get_int(p, rs, "original_max_position_embeddings", &c->rope_original_max_position,
                    false)) ||
      (st = get_bool(p, rs, "truncate", &c->rope_truncate)))
    return st;
  if (c->rope_factor <= 0)
    return df_error(DFLASH_E_CONFIG, "%s: rope_scaling (yarn) needs a positive \"factor\"",
                    p->what);
  /* Engines disagree without it: transformers 5 takes max_position_embeddings,
   * vLLM and SGLang need the key. */
  if (c->rope_original_max_position <= 0)
    return df_error(DFLASH_E_CONFIG,
                    "%s: %s (yarn) needs a positive "
                    "\"original_max_position_embeddings\"",
                    p->what, key);
  /* The default that Hugging Face derives when attention_factor is absent;
   * engines disagree on it, so it is written explicitly. */
  if (attn <= 0) {
    attn = (mscale != 0 && mscale_all != 0)
               ? yarn_mscale(c->rope_factor, mscale) / yarn_mscale(c->rope_factor, mscale_all)
               : yarn_mscale(c->rope_factor, 1.0);
    if (attn != 1.0)
      df_log(DFLASH_LOG_WARN,
             "%s: %s (yarn) has no attention_factor; using Hugging Face's "
             "default %.6g, which engines do not all share (checkpoints write it explicitly)",
             p->what, key, attn);
  }
  c->rope_attention_factor = attn;
  return df_yarn_check(c, p->what);
}

static dflash_status parse_int_array(const parser *p, json_t *arr, const char *key, int32_t *out,
                                     int32_t cap, int32_t *n) {
  if (!json_is_array(arr))
    return df_error(DFLASH_E_CONFIG, "%s: \"%s\" must be an array", p->what, key);
  if (json_array_size(arr) > (size_t)cap)
    return df_error(DFLASH_E_CONFIG, "%s: \"%s\" has %zu entries (at most %d)", p->what, key,
                    json_array_size(arr), cap);
  for (size_t i = 0; i < json_array_size(arr); i++) {
    json_t *v = json_array_get(arr, i);
    if (!json_is_integer(v))
      return df_error(DFLASH_E_CONFIG, "%s: \"%s\"[%zu] must be an integer", p->what, key, i);
    out[i] = (int32_t)json_integer_value(v);
  }
  *n = (int32_t)json_array_size(arr);
  return DFLASH_OK;
}

static dflash_status parse_layer_types(const parser *p, json_t *root, dflash_drafter_config *c) {
  json_t *lt = json_object_get(root, "layer_types");
  int32_t use_sliding = 0, max_window_layers = 28;
  dflash_status st;
  if ((st = get_bool(p, root, "use_sliding_window", &use_sliding)) ||
      (st = get_int(p, root, "max_window_layers", &max_window_layers, false)) ||
      (st = get_int(p, root, "sliding_window", &c->sliding_window, false)))
    return st;
  if (lt && !json_is_null(lt) && !use_sliding && json_is_array(lt)) {
    /* Qwen3Config sets sliding_window to None unless use_sliding_window: the
     * reference model would then slide without a window (causal only). */
    for (size_t i = 0; i < json_array_size(lt); i++) {
      const char *s = json_string_value(json_array_get(lt, i));
      if (s && !strcmp(s, "sliding_attention"))
        return df_error(DFLASH_E_CONFIG,
                        "%s: layer_types[%zu] is \"sliding_attention\" but "
                        "\"use_sliding_window\" is not true, so transformers' Qwen3Config drops "
                        "sliding_window; set \"use_sliding_window\": true",
                        p->what, i);
    }
  }
  if (!lt || json_is_null(lt)) {
    /* Qwen3Config's derivation when the list is absent. */
    for (int32_t i = 0; i < c->num_hidden_layers; i++)
      c->layer_types[i] = use_sliding && c->sliding_window > 0 && i >= max_window_layers
                              ? DFLASH_LAYER_SLIDING
                              : DFLASH_LAYER_FULL;
    return DFLASH_OK;
  }
  if (!json_is_array(lt) || json_array_size(lt) != (size_t)c->num_hidden_layers)
    return df_error(DFLASH_E_CONFIG,
                    "%s: \"layer_types\" must list exactly num_hidden_layers=%d "
                    "entries",
                    p->what, c->num_hidden_layers);
  for (size_t i = 0; i < json_array_size(lt); i++) {
    const char *s = json_string_value(json_array_get(lt, i));
    if (s && !strcmp(s, "full_attention")) c->layer_types[i] = DFLASH_LAYER_FULL;
    else if (s && !strcmp(s, "sliding_attention")) c->layer_types[i] = DFLASH_LAYER_SLIDING;
    else
      return df_error(DFLASH_E_CONFIG,
                      "%s: layer_types[%zu] must be \"full_attention\" or "
                      "\"sliding_attention\"",
                      p->what, i);
  }
  return DFLASH_OK;
}

/* DSpark's checkpoints (spec/dspark.md section 5) carry target_layer_ids at the top level,
 * read there when dflash_config has none (config_keys.c refuses the two differing). */
static dflash_status parse_dflash(const parser *p, json_t *root, dflash_drafter_config *c,
                                  bool top_ids) {
  json_t *dc = json_object_get(root, "dflash_config");
  if (dc && !json_is_null(dc) && !json_is_object(dc))
    return df_error(DFLASH_E_CONFIG, "%s: \"dflash_config\" must be an object", p->what);
  if (dc && json_is_null(dc)) dc = NULL;
  int32_t top_bs = 0, inner_bs = 0;
  dflash_status st;
  if ((st = get_int(p, root, "block_size", &top_bs, false))) return st;
  if (dc && (st = get_int(p, dc, "block_size", &inner_bs, false))) return st;
  if (top_bs && inner_bs && top_bs != inner_bs)
    return df_error(DFLASH_E_CONFIG,
                    "%s: block_size %d at top level disagrees with "
                    "dflash_config.block_size %d",
                    p->what, top_bs, inner_bs);
  c->block_size = inner_bs ? inner_bs : top_bs;
  if (!c->block_size)
    return df_error(DFLASH_E_CONFIG,
                    "%s: missing \"block_size\" (top level or in "
                    "dflash_config)",
                    p->what);
  if ((st = get_int(p, root, "mask_token_id", &c->mask_token_id, false))) return st;
  if (dc && (st = get_int(p, dc, "mask_token_id", &c->mask_token_id, false))) return st;
  if (c->mask_token_id < 0)
    return df_error(DFLASH_E_CONFIG, "%s: missing \"dflash_config.mask_token_id\"", p->what);
  if ((st = get_int(p, root, "num_target_layers", &c->num_target_layers, false))) return st;
  json_t *ids = dc ? json_object_get(dc, "target_layer_ids") : NULL;
  if ((!ids || json_is_null(ids)) && top_ids) ids = json_object_get(root, "target_layer_ids");
  if (ids && !json_is_null(ids)) {
    if ((st = parse_int_array(p, ids, "dflash_config.target_layer_ids", c->target_layer_ids,
                              DFLASH_DRAFTER_MAX_TARGET, &c->n_target_layer_ids)))
      return st;
    return DFLASH_OK;
  }
  if (c->num_target_layers <= 0)
    return df_error(DFLASH_E_CONFIG,
                    "%s: neither dflash_config.target_layer_ids nor "
                    "num_target_layers is given",
                    p->what);
  /* The reference trainer's default: one target layer per drafter layer. */
  c->n_target_layer_ids = c->num_hidden_layers;
  return dflash_drafter_default_target_layers(c->num_target_layers, c->num_hidden_layers,
                                              c->target_layer_ids);
}

/* ---- keys of models that libdflash does not implement ----------------------- */

typedef enum arch_kind { ARCH_DFLASH, ARCH_DFLASH2, ARCH_DSPARK } arch_kind;

static bool json_is_off(json_t *v) {
  return !v || json_is_null(v) || json_is_false(v) ||
         (json_is_number(v) && json_number_value(v) == 0.0);
}

static dflash_status refuse_key(const parser *p, const char *where, const char *key, json_t *v,
                                const char *why) {
  return df_config_refuse_key(p->what, where, key, v, why);
}

/* The reference model reads these from dflash_config, then the top level. */
static dflash_status check_unimplemented(const parser *p, json_t *obj, const char *where,
                                         const dflash_drafter_config *c, arch_kind kind) {
  bool dflash2 = kind == ARCH_DFLASH2;
  if (!obj || !json_is_object(obj)) return DFLASH_OK;
  static const struct {
    const char *key;
    double neutral;
    const char *why;
  } scales[] = {
      {"input_embedding_scale", 1.0, "the block embedding is used unscaled; allowed: 1 or null"},
      {"output_multiplier", 1.0, "the logits are used unscaled; allowed: 1 or null"},
      {"attention_value_scale", 1.0, "values are used unscaled; allowed: 1 or null"},
  };
  for (size_t i = 0; i < DF_ARRAY_LEN(scales); i++) {
    json_t *v = json_object_get(obj, scales[i].key);
    if (v && !json_is_null(v) && !(json_is_number(v) && json_number_value(v) == scales[i].neutral))
      return refuse_key(p, where, scales[i].key, v, scales[i].why);
  }
  json_t *v = json_object_get(obj, "final_logit_softcapping");
  if (v && !json_is_null(v) && !(json_is_number(v) && json_number_value(v) == 0.0))
    return refuse_key(p, where, "final_logit_softcapping", v,
                      "logits are not soft-capped; allowed: null or 0");
  v = json_object_get(obj, "is_causal");
  if (v && !json_is_null(v)) {
    if (!json_is_boolean(v))
      return df_error(DFLASH_E_CONFIG, "%s: %s\"is_causal\" must be true, false or null", p->what,
                      where);
    /* libdflash: causal inside the block exactly in sliding layers (the
     * reference's default); a forced value must agree on every layer. */
    for (int32_t l = 0; l < c->num_hidden_layers; l++)
      if ((c->layer_types[l] == DFLASH_LAYER_SLIDING) != json_is_true(v))
        return refuse_key(p, where, "is_causal", v,
                          "blocks are causal exactly in sliding_attention layers; allowed: null, "
                          "or a value that agrees with every layer type");
  }
  const char *key;
  json_t *val;
  json_object_foreach(obj, key, val) {
    if (!dflash2 && (!strncmp(key, "conv_", 5) || !strncmp(key, "selector_", 9)) &&
        !json_is_off(val))
      return refuse_key(p, where, key, val,
                        "DFlash 2's convolutions and candidate selector need \"architectures\": "
                        "[\"DFlash2DraftModel\"]; with DFlashDraftModel allowed: null, false "
                        "or 0");
    /* SpecForge's export writes draft_vocab_size = vocab_size on every drafter: not pruned. */
    bool unpruned = !strcmp(key, "draft_vocab_size") && json_is_integer(val) &&
                    json_integer_value(val) == c->vocab_size;
    if (kind != ARCH_DSPARK && df_config_dspark_key(key) && !json_is_off(val) && !unpruned)
      return refuse_key(p, where, key, val,
                        "DSpark's Markov and confidence heads need \"architectures\": "
                        "[\"Qwen3DSparkModel\"]; otherwise allowed: null, false or 0");
  }
  return kind == ARCH_DSPARK ? df_config_dspark_refused_keys(p->what, obj, where) : DFLASH_OK;
}

static dflash_status check_architectures(const parser *p, json_t *root, arch_kind *kind) {
  *kind = ARCH_DFLASH;
  switch (df_config_arch(root)) {
  case DF_ARCH_DFLASH: return DFLASH_OK;
  case DF_ARCH_DFLASH2: *kind = ARCH_DFLASH2; return DFLASH_OK;
  case DF_ARCH_DSPARK: *kind = ARCH_DSPARK; return DFLASH_OK;
  default: break;
  }
  return refuse_key(p, "", "architectures", json_object_get(root, "architectures"),
                    "only [\"DFlashDraftModel\"], [\"DFlash2DraftModel\"] and DSpark's "
                    "[\"Qwen3DSparkModel\"] (or SpecForge's [\"DSparkDraftModel\"]) are");
}

/* DFlash 2's sizes, as z-lab's _draft_value reads them: dflash_config first,
 * then the top level; the reference has no defaults, so each is required. */
static dflash_status parse_dflash2(const parser *p, json_t *root, df_config_ext *e) {
  json_t *dc = json_object_get(root, "dflash_config");
  struct {
    const char *key;
    int32_t *out;
  } keys[] = {
      {"conv_kernel_size", &e->conv_kernel_size},
      {"conv_group_size", &e->conv_group_size},
      {"selector_top_k", &e->selector_top_k},
      {"selector_rank", &e->selector_rank},
  };
  for (size_t i = 0; i < DF_ARRAY_LEN(keys); i++) {
    json_t *v = dc && json_is_object(dc) ? json_object_get(dc, keys[i].key) : NULL;
    json_t *owner = v && !json_is_null(v) ? dc : root;
    dflash_status st = get_int(p, owner, keys[i].key, keys[i].out, false);
    if (st) return st;
    if (!json_object_get(owner, keys[i].key) || json_is_null(json_object_get(owner, keys[i].key)))
      return df_error(DFLASH_E_CONFIG,
                      "%s: a DFlash2DraftModel needs \"%s\" (in dflash_config "
                      "or at the top level)",
                      p->what, keys[i].key);
  }
  e->dflash2 = 1;
  return DFLASH_OK;
}

/* partial_rotary_factor: top level (transformers 4) or inside rope_parameters /
 * rope_scaling (transformers 5 moves it there); all that are given agree. */
static dflash_status parse_partial_rotary(const parser *p, json_t *root, double *out) {
  const char *owners[] = {NULL, "rope_parameters", "rope_scaling"};
  double found = 0;
  const char *found_in = NULL;
  for (size_t i = 0; i < DF_ARRAY_LEN(owners); i++) {
    json_t *obj = owners[i] ? json_object_get(root, owners[i]) : root;
    if (!obj || !json_is_object(obj)) continue;
    json_t *v = json_object_get(obj, "partial_rotary_factor");
    if (!v || json_is_null(v)) continue;
    if (!json_is_number(v))
      return df_error(DFLASH_E_CONFIG, "%s: \"partial_rotary_factor\" must be a number", p->what);
    double f = json_number_value(v);
    if (found_in && f != found)
      return df_error(DFLASH_E_CONFIG,
                      "%s: partial_rotary_factor %g in %s disagrees with %g "
                      "in %s",
                      p->what, f, owners[i] ? owners[i] : "the top level", found, found_in);
    found = f;
    found_in = owners[i] ? owners[i] : "the top level";
  }
  if (found_in) *out = found;
  return DFLASH_OK;
}

/* The caller's config (its struct_size) must hold DSpark's fields. */
static dflash_status need_size_for_dspark(const parser *p, size_t size) {
  if (CFG_HOLDS(size, num_anchors)) return DFLASH_OK;
  return df_error(DFLASH_E_UNSUPPORTED,
                  "%s: a DSpark \"architectures\" does not fit in a dflash_drafter_config of "
                  "struct_size %zu (an older header's): rebuild against a current libdflash",
                  p->what, size);
}

/* The caller's config (its struct_size) must hold DFlash 2's fields. */
static dflash_status need_size_for_dflash2(const parser *p, size_t size) {
  if (CFG_HOLDS(size, selector_rank)) return DFLASH_OK;
  return df_error(DFLASH_E_UNSUPPORTED,
                  "%s: \"architectures\" = [\"DFlash2DraftModel\"] does "
                  "not fit in a dflash_drafter_config of struct_size %zu (an older header's): "
                  "rebuild against a current libdflash",
                  p->what, size);
}

/* Into the library's full `c`; `size` is the caller's struct_size, which must hold every
 * field the file sets to a non-default value. */
static dflash_status parse_root(const parser *p, json_t *root, dflash_drafter_config *c,
                                size_t size) {
  arch_kind kind;
  if (!json_is_object(root))
    return df_error(DFLASH_E_CONFIG, "%s: config must be a JSON object", p->what);
  dflash_status st;
  if ((st = check_architectures(p, root, &kind))) return st;
  bool dflash2 = kind == ARCH_DFLASH2, dspark = kind == ARCH_DSPARK;
  if ((st = df_config_check_keys(p->what, root))) return st;
  if (dflash2 && (st = need_size_for_dflash2(p, size))) return st;
  if (dspark && (st = need_size_for_dspark(p, size))) return st;
  if ((st = get_int(p, root, "hidden_size", &c->hidden_size, true)) ||
      (st = get_int(p, root, "intermediate_size", &c->intermediate_size, true)) ||
      (st = get_int(p, root, "num_hidden_layers", &c->num_hidden_layers, true)) ||
      (st = get_int(p, root, "num_attention_heads", &c->num_attention_heads, true)) ||
      (st = get_int(p, root, "vocab_size", &c->vocab_size, true)) ||
      (st = get_int(p, root, "max_position_embeddings", &c->max_position_embeddings, false)) ||
      (st = get_real(p, root, "rms_norm_eps", &c->rms_norm_eps)) ||
      (st = get_real(p, root, "rope_theta", &c->rope_theta)) ||
      (st = get_bool(p, root, "attention_bias", &c->attention_bias)) ||
      (st = get_bool(p, root, "tie_word_embeddings", &c->tie_word_embeddings)))
    return st;
  if (c->num_hidden_layers <= 0 || c->num_hidden_layers > DFLASH_DRAFTER_MAX_LAYERS)
    return df_error(DFLASH_E_CONFIG, "%s: num_hidden_layers must be in 1..%d (got %d)", p->what,
                    DFLASH_DRAFTER_MAX_LAYERS, c->num_hidden_layers);
  c->num_key_value_heads = c->num_attention_heads;
  if ((st = get_int(p, root, "num_key_value_heads", &c->num_key_value_heads, false))) return st;
  /* Qwen3Config's default (not hidden_size / num_attention_heads, which
   * Llama and Qwen2 configs derive); the reference model reads it as such. */
  c->head_dim = 128;
  if ((st = get_int(p, root, "head_dim", &c->head_dim, false))) return st;
  if ((st = parse_rope(p, root, c)) || (st = parse_layer_types(p, root, c)) ||
      (st = parse_dflash(p, root, c, dspark)))
    return st;
  json_t *dc = json_object_get(root, "dflash_config");
  if ((st = check_unimplemented(p, root, "", c, kind)) ||
      (st = check_unimplemented(p, dc, "dflash_config.", c, kind)))
    return st;
  if (dspark && (st = df_config_dspark_parse(p->what, root, c))) return st;
  if (c->draft_vocab_size && !CFG_HOLDS(size, draft_vocab_size))
    return df_error(DFLASH_E_UNSUPPORTED,
                    "%s: \"draft_vocab_size\" = %d does not fit in a dflash_drafter_config of "
                    "struct_size %zu (an older header's): rebuild against a current libdflash",
                    p->what, c->draft_vocab_size, size);
  df_config_ext ext = {.partial_rotary_factor = 1.0};
  if (dflash2 && (st = parse_dflash2(p, root, &ext))) return st;
  if ((st = dflash_drafter_config_validate(c))) return st;
  double prf = 1.0;
  if ((st = parse_partial_rotary(p, root, &prf))) return st;
  if (prf != 1.0 && !CFG_HOLDS(size, partial_rotary_factor))
    return df_error(DFLASH_E_UNSUPPORTED,
                    "%s: \"partial_rotary_factor\" = %g does not fit in a "
                    "dflash_drafter_config of struct_size %zu (an older header's): rebuild "
                    "against a current libdflash",
                    p->what, prf, size);
  ext.partial_rotary_factor = prf;
  if ((st = df_config_ext_validate(c, &ext, p->what))) return st;
  c->partial_rotary_factor = ext.partial_rotary_factor;
  c->dflash2 = ext.dflash2;
  c->conv_kernel_size = ext.conv_kernel_size;
  c->conv_group_size = ext.conv_group_size;
  c->selector_top_k = ext.selector_top_k;
  c->selector_rank = ext.selector_rank;
  return DFLASH_OK;
}

dflash_status dflash_drafter_config_parse(const char *json, size_t len, const char *what,
                                          dflash_drafter_config *out) {
  DF_CHECK_ARG(json && out);
  parser p = {what ? what : "config.json"};
  json_t *root;
  dflash_status st = df_json_parse(json, len, p.what, &root);
  if (st) return st;
  dflash_drafter_config c;
  dflash_drafter_config_default(&c);
  st = parse_root(&p, root, &c, out->struct_size);
  json_decref(root);
  /* An output struct: written up to the caller's struct_size (the one rule). */
  if (!st) st = df_opts_out(out, &c, sizeof c, "dflash_drafter_config");
  return st;
}

dflash_status dflash_drafter_config_load(const char *path, dflash_drafter_config *out) {
  DF_CHECK_ARG(path && out);
  char *text;
  size_t len;
  dflash_status st;
  if (dflash_storage_is_remote(path)) { /* an s3:// checkpoint's config.json */
    dflash_storage *s3 = NULL;
    if (!(st = dflash_storage_create(NULL, &s3)))
      st = dflash_storage_read(s3, path, (void **)&text, &len);
    dflash_storage_free(s3);
  } else {
    st = df_read_file(path, &text, &len);
  }
  if (st) return st;
  st = dflash_drafter_config_parse(text, len, path, out);
  free(text);
  return st;
}

/* ---- writing -------------------------------------------------------------- */

static json_t *int_array(const int32_t *v, int32_t n) {
  json_t *a = json_array();
  for (int32_t i = 0; a && i < n; i++)
    if (json_array_append_new(a, json_integer(v[i]))) json_decref(a), a = NULL;
  return a;
}

/* The mscale with mscale_all_dim = 1 whose YaRN ratio
 * (0.1 m ln f + 1) / (0.1 ln f + 1) is the attention factor A:
 * m = (A (0.1 ln f + 1) - 1) / (0.1 ln f). For f = 1 every mscale gives 1,
 * which yarn_scale_check makes sure A is. */
static double yarn_mscale_for(const dflash_drafter_config *c) {
  double lf = 0.1 * log(c->rope_factor);
  if (c->rope_factor <= 1.0) return 1.0;
  return (c->rope_attention_factor * (lf + 1.0) - 1.0) / lf;
}

/* SGLang cannot express an attention factor other than 1 when the YaRN
 * factor is 1 (its scale is then 1 whatever mscale says): refused on writing. */
static dflash_status yarn_scale_check(const dflash_drafter_config *c, const char *what) {
  if (c->rope_type != DFLASH_ROPE_YARN || c->rope_factor > 1.0 || c->rope_attention_factor == 1.0)
    return DFLASH_OK;
  return df_error(DFLASH_E_CONFIG,
                  "%s: rope_scaling.factor 1 with attention_factor %g: SGLang scales YaRN "
                  "attention by 1 at factor 1, so engines would disagree; use attention_factor 1",
                  what, c->rope_attention_factor);
}

static json_t *rope_json(const dflash_drafter_config *c) {
  if (c->rope_type != DFLASH_ROPE_YARN) return json_null();
  json_t *r = json_object();
  int bad = json_object_set_new(r, "rope_type", json_string("yarn"));
  bad |= json_object_set_new(r, "factor", json_real(c->rope_factor));
  bad |= json_object_set_new(r, "original_max_position_embeddings",
                             json_integer(c->rope_original_max_position));
  /* Explicit: engines disagree on the default. vLLM 0.33 and transformers
   * take attention_factor; SGLang 0.5.23 ignores it and scales by
   * mscale(f, mscale) / mscale(f, mscale_all_dim) (rotary_embedding/yarn.py):
   * the pair written gives that ratio = attention_factor. */
  bad |= json_object_set_new(r, "attention_factor", json_real(c->rope_attention_factor));
  bad |= json_object_set_new(r, "mscale", json_real(yarn_mscale_for(c)));
  bad |= json_object_set_new(r, "mscale_all_dim", json_real(1.0));
  bad |= json_object_set_new(r, "beta_fast", json_real(c->rope_beta_fast));
  bad |= json_object_set_new(r, "beta_slow", json_real(c->rope_beta_slow));
  if (!c->rope_truncate) bad |= json_object_set_new(r, "truncate", json_false());
  if (bad) json_decref(r), r = NULL; /* out of memory: the caller's set fails too */
  return r;
}

static json_t *config_json(const dflash_drafter_config *c, const df_config_ext *e,
                           const char *dtype) {
  json_t *o = json_object();
  json_t *arch = json_array();
  int bad = json_array_append_new(arch, json_string(e->dspark    ? "Qwen3DSparkModel"
                                                    : e->dflash2 ? "DFlash2DraftModel"
                                                                 : "DFlashDraftModel"));
  bad |= json_object_set_new(o, "architectures", arch);
  bad |= json_object_set_new(o, "model_type", json_string("qwen3"));
  bad |= json_object_set_new(o, "hidden_size", json_integer(c->hidden_size));
  bad |= json_object_set_new(o, "intermediate_size", json_integer(c->intermediate_size));
  bad |= json_object_set_new(o, "num_hidden_layers", json_integer(c->num_hidden_layers));
  bad |= json_object_set_new(o, "num_attention_heads", json_integer(c->num_attention_heads));
  bad |= json_object_set_new(o, "num_key_value_heads", json_integer(c->num_key_value_heads));
  bad |= json_object_set_new(o, "head_dim", json_integer(c->head_dim));
  bad |= json_object_set_new(o, "hidden_act", json_string("silu"));
  bad |= json_object_set_new(o, "rms_norm_eps", json_real(c->rms_norm_eps));
  bad |= json_object_set_new(o, "rope_theta", json_real(c->rope_theta));
  bad |= json_object_set_new(o, "rope_scaling", rope_json(c));
  bad |= json_object_set_new(o, "max_position_embeddings",
                             json_integer(c->max_position_embeddings));
  bad |= json_object_set_new(o, "vocab_size", json_integer(c->vocab_size));
  bad |= json_object_set_new(o, "attention_bias", json_boolean(c->attention_bias));
  bad |= json_object_set_new(o, "attention_dropout", json_real(0.0));
  bad |= json_object_set_new(o, "tie_word_embeddings", json_boolean(c->tie_word_embeddings));
  if (dtype) {
    /* The stored weights' dtype, under transformers 5's key and 4's: SGLang
     * (--dtype auto) builds the draft in it, and in float16 when it is absent. */
    bad |= json_object_set_new(o, "dtype", json_string(dtype));
    bad |= json_object_set_new(o, "torch_dtype", json_string(dtype));
  }
  bad |= json_object_set_new(o, "num_target_layers", json_integer(c->num_target_layers));
  if (e->partial_rotary_factor != 1.0)
    bad |= json_object_set_new(o, "partial_rotary_factor", json_real(e->partial_rotary_factor));
  bad |= json_object_set_new(o, "block_size", json_integer(c->block_size));
  json_t *dc = json_object();
  bad |= json_object_set_new(dc, "mask_token_id", json_integer(c->mask_token_id));
  bad |= json_object_set_new(dc, "target_layer_ids",
                             int_array(c->target_layer_ids, c->n_target_layer_ids));
  bad |= json_object_set_new(dc, "block_size", json_integer(c->block_size));
  if (e->dflash2) {
    bad |= json_object_set_new(dc, "conv_kernel_size", json_integer(e->conv_kernel_size));
    bad |= json_object_set_new(dc, "conv_group_size", json_integer(e->conv_group_size));
    bad |= json_object_set_new(dc, "selector_top_k", json_integer(e->selector_top_k));
    bad |= json_object_set_new(dc, "selector_rank", json_integer(e->selector_rank));
  }
  if (e->dspark) {
    bad |= df_config_dspark_json(o, dc, c);
    bad |= json_object_set_new(o, "mask_token_id", json_integer(c->mask_token_id));
    bad |= json_object_set_new(o, "target_layer_ids",
                               int_array(c->target_layer_ids, c->n_target_layer_ids));
  }
  bad |= json_object_set_new(o, "dflash_config", dc);
  json_t *lt = json_array();
  bool sliding = false;
  for (int32_t i = 0; i < c->num_hidden_layers; i++) {
    sliding |= c->layer_types[i] == DFLASH_LAYER_SLIDING;
    bad |= json_array_append_new(lt, json_string(c->layer_types[i] == DFLASH_LAYER_SLIDING
                                                     ? "sliding_attention"
                                                     : "full_attention"));
  }
  bad |= json_object_set_new(o, "layer_types", lt);
  bad |= json_object_set_new(o, "use_sliding_window", json_boolean(sliding));
  bad |= json_object_set_new(o, "sliding_window",
                             sliding ? json_integer(c->sliding_window) : json_null());
  if (bad) json_decref(o), o = NULL; /* out of memory: a config without a field is never written */
  return o;
}

static dflash_status to_json(const dflash_drafter_config *caller, const char *dtype, char *buf,
                             size_t cap, size_t *len) {
  DF_CHECK_ARG(caller && len);
  dflash_drafter_config full, *cfg = &full;
  df_config_ext ext;
  dflash_status st = df_config_in(caller, &full);
  if (!st) df_config_ext_of(&full, &ext);
  if (!st) st = dflash_drafter_config_validate(cfg);
  if (!st) st = df_config_ext_validate(cfg, &ext, "drafter config");
  if (!st) st = df_yarn_check(cfg, "drafter config");
  if (!st) st = yarn_scale_check(cfg, "drafter config");
  if (st) return st;
  /* The reference model reads num_target_layers even when target_layer_ids
   * are given (and so does mlx's loader): a config without it does not load. */
  if (cfg->num_target_layers <= 0)
    return df_error(DFLASH_E_CONFIG,
                    "drafter config: num_target_layers (the target model's "
                    "layer count) is unknown, and a config.json without it does not load in the "
                    "reference model; set it before saving");
  json_t *o = config_json(cfg, &ext, dtype);
  if (!o) return df_error_nomem("config JSON");
  char *s = json_dumps(o, JSON_INDENT(2) | JSON_REAL_PRECISION(17));
  json_decref(o);
  if (!s) return df_error_nomem("config JSON");
  size_t need = strlen(s) + 2; /* trailing newline + NUL */
  if (!buf || cap < need) {
    *len = need;
    free(s);
    return df_error(DFLASH_E_BUFFER, "config JSON needs %zu bytes", need);
  }
  snprintf(buf, need, "%s\n", s);
  *len = need;
  free(s);
  return DFLASH_OK;
}

dflash_status dflash_drafter_config_to_json(const dflash_drafter_config *cfg, char *buf, size_t cap,
                                            size_t *len) {
  return to_json(cfg, NULL, buf, cap, len);
}

dflash_status df_drafter_config_save_dtype(const dflash_drafter_config *cfg, const char *dtype,
                                           const char *path) {
  DF_CHECK_ARG(cfg && path);
  size_t len = 0;
  dflash_status st = to_json(cfg, dtype, NULL, 0, &len);
  if (st != DFLASH_E_BUFFER) return st ? st : df_error(DFLASH_E_INTERNAL, "config size");
  dflash_clear_error();
  char *buf = malloc(len);
  if (!buf) return df_error_nomem("config JSON");
  st = to_json(cfg, dtype, buf, len, &len);
  if (!st) st = df_write_file_atomic(path, buf, strlen(buf));
  free(buf);
  return st;
}

dflash_status dflash_drafter_config_save(const dflash_drafter_config *cfg, const char *path) {
  return df_drafter_config_save_dtype(cfg, NULL, path);
}
