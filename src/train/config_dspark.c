/*
 * DSpark's part of the drafter config.json (spec/dspark.md section 5): its keys read from the
 * top level or dflash_config, the keys that make an engine refuse or misread a DSpark
 * checkpoint refused, its fields validated, and its keys written in both places. Split from
 * config.c, which calls these where it reads and writes every other key.
 */
#include "config_dspark.h"

#include <string.h>

#include "config_keys.h"
#include "model.h"

dflash_status df_dspark_unsupported(const df_config_ext *e, const char *what, const char *why) {
  if (!e->dspark) return DFLASH_OK;
  return df_error(DFLASH_E_UNSUPPORTED,
                  "%s: not for a DSpark drafter (Qwen3DSparkModel) yet: %s (issue 40)", what, why);
}

dflash_status df_dspark_validate(const dflash_drafter_config *cfg, const df_config_ext *e,
                                 const char *what) {
  if (e->dspark != 0 && e->dspark != 1)
    return df_error(DFLASH_E_CONFIG, "%s: dspark must be 0 or 1 (got %d)", what, e->dspark);
  if (cfg->draft_vocab_size < 0 || cfg->draft_vocab_size > cfg->vocab_size)
    return df_error(DFLASH_E_CONFIG, "%s: draft_vocab_size must be in 0..vocab_size %d (got %d)",
                    what, cfg->vocab_size, cfg->draft_vocab_size);
  if (!e->dspark && e->draft_vocab > 0 && e->draft_vocab < cfg->vocab_size)
    return df_error(DFLASH_E_CONFIG,
                    "%s: draft_vocab_size %d below vocab_size %d is for a DSpark drafter only "
                    "(no engine's DFlash loader reads d2t)",
                    what, cfg->draft_vocab_size, cfg->vocab_size);
  if (!e->dspark) {
    /* DSpark's fields without the architecture would be dropped silently on writing. */
    if (e->markov_rank || e->confidence_head || e->num_anchors)
      return df_error(DFLASH_E_CONFIG,
                      "%s: DSpark fields (markov_rank %d, confidence_head %d, num_anchors %d) "
                      "are set but dspark is 0",
                      what, e->markov_rank, e->confidence_head, e->num_anchors);
    return DFLASH_OK;
  }
  if (e->dflash2)
    return df_error(DFLASH_E_CONFIG, "%s: dspark and dflash2 are exclusive architectures", what);
  /* DFlash 2's selector_rank bound: r beyond it is no drafter anyone serves. */
  if (e->markov_rank < 1 || e->markov_rank > 65536)
    return df_error(DFLASH_E_CONFIG, "%s: markov_rank must be in 1..65536 (got %d)", what,
                    e->markov_rank);
  if (e->confidence_head != 0 && e->confidence_head != 1)
    return df_error(DFLASH_E_CONFIG, "%s: confidence_head must be 0 or 1 (got %d)", what,
                    e->confidence_head);
  if (e->num_anchors < 0)
    return df_error(DFLASH_E_CONFIG, "%s: num_anchors must not be negative (got %d)", what,
                    e->num_anchors);
  /* The spec's checkpoint: the drafter has its own (target's) LM head rows, never tied. */
  if (cfg->tie_word_embeddings)
    return df_error(DFLASH_E_CONFIG,
                    "%s: a DSpark drafter is written with tie_word_embeddings false "
                    "(spec/dspark.md section 5)",
                    what);
  return DFLASH_OK;
}

dflash_status df_config_dspark_refused_keys(const char *what, json_t *obj, const char *where) {
  static const struct {
    const char *key, *why;
  } dspark_off[] = {
      {"speculators_model_type", "with it SGLang refuses a DSpark checkpoint; allowed: null"},
      {"transformer_layer_config",
       "with it llama.cpp's converter takes the bonus-anchor layout, not the anchor-first one "
       "libdflash trains; allowed: null"},
      {"aux_hidden_state_layer_ids",
       "with it llama.cpp's converter takes the bonus-anchor layout; use "
       "dflash_config.target_layer_ids; allowed: null"},
  };
  for (size_t i = 0; i < DF_ARRAY_LEN(dspark_off); i++) {
    json_t *x = json_object_get(obj, dspark_off[i].key);
    if (x && !json_is_null(x))
      return df_config_refuse_key(what, where, dspark_off[i].key, x, dspark_off[i].why);
  }
  json_t *ls = json_object_get(obj, "logit_scale");
  if (ls && !json_is_null(ls) && !(json_is_number(ls) && json_number_value(ls) == 1.0))
    return df_config_refuse_key(
        what, where, "logit_scale", ls,
        "logits and the Markov bias are used unscaled (vLLM would scale the bias "
        "too); allowed: 1 or null");
  return DFLASH_OK;
}

/* A DSpark key, from dflash_config or the top level (the spec writes both: SpecForge reads
 * dflash_config, vLLM the top level); the two must agree. NULL when neither holds it. */
static dflash_status dspark_value(const char *what, json_t *root, const char *key, json_t **out) {
  json_t *dc = json_object_get(root, "dflash_config");
  json_t *in = json_is_object(dc) ? json_object_get(dc, key) : NULL;
  json_t *top = json_object_get(root, key);
  if (in && json_is_null(in)) in = NULL;
  if (top && json_is_null(top)) top = NULL;
  if (in && top && !json_equal(in, top))
    return df_error(DFLASH_E_CONFIG, "%s: \"%s\" at the top level disagrees with dflash_config's",
                    what, key);
  *out = in ? in : top;
  return DFLASH_OK;
}

static dflash_status dspark_bool(const char *what, json_t *v, const char *key, int32_t *out) {
  if (!json_is_boolean(v))
    return df_error(DFLASH_E_CONFIG, "%s: \"%s\" must be true or false", what, key);
  *out = json_is_true(v);
  return DFLASH_OK;
}

static dflash_status dspark_int(const char *what, json_t *v, const char *key, int32_t *out) {
  if (!json_is_integer(v) || json_integer_value(v) < INT32_MIN || json_integer_value(v) > INT32_MAX)
    return df_error(DFLASH_E_CONFIG, "%s: \"%s\" must be a 32-bit integer", what, key);
  *out = (int32_t)json_integer_value(v);
  return DFLASH_OK;
}

/* DSpark's fields into `c`. Required: markov_rank (the engines size W1/W2 by it),
 * enable_confidence_head (no two sources agree on its absence) and sample_from_anchor true
 * (the anchor-first layout; llama.cpp has a bonus-anchor one). Defaults: markov_head_type
 * "vanilla", confidence_head_with_markov true (the paper's eq. 7). Refused: other head
 * types (llama.cpp's converter takes vanilla only) and a head without the Markov embedding.
 * draft_vocab_size in 1..vocab_size (below it: pruned; equal: stored as 0). */
dflash_status df_config_dspark_parse(const char *what, json_t *root, dflash_drafter_config *c) {
  json_t *v = NULL; /* dspark_value sets it on success; gcc -O3 cannot see that */
  int32_t flag = 0;
  dflash_status st;
  if ((st = dspark_value(what, root, "markov_rank", &v))) return st;
  if (!v) return df_error(DFLASH_E_CONFIG, "%s: a DSpark config needs \"markov_rank\"", what);
  if ((st = dspark_int(what, v, "markov_rank", &c->markov_rank))) return st;
  if ((st = dspark_value(what, root, "markov_head_type", &v))) return st;
  if (v && !(json_is_string(v) && !strcmp(json_string_value(v), "vanilla")))
    return df_config_refuse_key(
        what, "", "markov_head_type", v,
        "only the vanilla Markov head is (llama.cpp's converter takes no other)");
  if ((st = dspark_value(what, root, "enable_confidence_head", &v))) return st;
  if (!v)
    return df_error(DFLASH_E_CONFIG, "%s: a DSpark config needs \"enable_confidence_head\"", what);
  if ((st = dspark_bool(what, v, "enable_confidence_head", &c->confidence_head))) return st;
  if ((st = dspark_value(what, root, "confidence_head_with_markov", &v))) return st;
  if (v && (st = dspark_bool(what, v, "confidence_head_with_markov", &flag))) return st;
  if (v && !flag && c->confidence_head)
    return df_config_refuse_key(
        what, "", "confidence_head_with_markov", v,
        "the confidence head reads [norm(h); W1[prev]] (the paper's eq. 7)");
  if ((st = dspark_value(what, root, "sample_from_anchor", &v))) return st;
  if (v && (st = dspark_bool(what, v, "sample_from_anchor", &flag))) return st;
  if (!v || !flag)
    return df_error(v ? DFLASH_E_UNSUPPORTED : DFLASH_E_CONFIG,
                    "%s: a DSpark config needs \"sample_from_anchor\": true (the anchor-first "
                    "block libdflash trains; %s)",
                    what, v ? "the bonus-anchor layout is not implemented" : "it is absent");
  if ((st = dspark_value(what, root, "draft_vocab_size", &v))) return st;
  int32_t dv = c->vocab_size;
  if (v && (st = dspark_int(what, v, "draft_vocab_size", &dv))) return st;
  if (dv < 1 || dv > c->vocab_size)
    return df_error(DFLASH_E_CONFIG,
                    "%s: \"draft_vocab_size\" must be in 1..vocab_size %d (got %d)", what,
                    c->vocab_size, dv);
  c->draft_vocab_size = dv < c->vocab_size ? dv : 0;
  if ((st = dspark_value(what, root, "num_anchors", &v))) return st;
  if (v && (st = dspark_int(what, v, "num_anchors", &c->num_anchors))) return st;
  c->dspark = 1;
  return DFLASH_OK;
}

/* DSpark's keys (spec/dspark.md section 5), at the top level (vLLM, llama.cpp's converter and
 * DeepSpec read them there) and in dflash_config (SpecForge reads them there). Never written:
 * speculators_model_type, transformer_layer_config, aux_hidden_state_layer_ids, logit_scale
 * (each makes an engine refuse the checkpoint or read another layout). */
int df_config_dspark_json(json_t *o, json_t *dc, const dflash_drafter_config *c) {
  int bad = 0;
  json_t *where[2] = {o, dc};
  for (int i = 0; i < 2; i++) {
    bad |= json_object_set_new(where[i], "markov_rank", json_integer(c->markov_rank));
    bad |= json_object_set_new(where[i], "markov_head_type", json_string("vanilla"));
    bad |= json_object_set_new(where[i], "enable_confidence_head",
                               json_boolean(c->confidence_head));
    bad |= json_object_set_new(where[i], "confidence_head_with_markov", json_true());
    bad |= json_object_set_new(where[i], "sample_from_anchor", json_true());
    if (c->num_anchors > 0)
      bad |= json_object_set_new(where[i], "num_anchors", json_integer(c->num_anchors));
    /* only when pruned (spec section 5) */
    if (c->draft_vocab_size > 0 && c->draft_vocab_size < c->vocab_size)
      bad |= json_object_set_new(where[i], "draft_vocab_size", json_integer(c->draft_vocab_size));
  }
  return bad;
}
