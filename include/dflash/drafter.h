/*
 * A DFlash drafter's architecture: dflash_drafter_config (the fields of
 * config.json that the maths needs, as SGLang and vLLM load it, DFlash 2 and
 * partial RoPE included), parsing, validation and serialisation, and the spec's
 * default target layers.
 *
 * The model is described in docs/drafter.md (the project's spec): a stack of
 * Qwen3-style layers whose queries are blocks of B positions (anchor token +
 * B-1 mask tokens) and whose keys/values are the target's projected hidden
 * states strictly before the anchor plus the block itself.
 *
 * A config is a plain struct. Part of train.h, which includes this header.
 */
#ifndef DFLASH_DRAFTER_H
#define DFLASH_DRAFTER_H

#include <dflash/dflash.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DFLASH_DRAFTER_MAX_LAYERS 64  /* drafter layers */
#define DFLASH_DRAFTER_MAX_TARGET 128 /* target layer ids */

typedef enum dflash_rope_type {
  DFLASH_ROPE_DEFAULT = 0, /* plain RoPE, theta = rope_theta */
  DFLASH_ROPE_YARN = 1     /* YaRN (rope_scaling.rope_type == "yarn") */
} dflash_rope_type;

typedef enum dflash_layer_type {
  DFLASH_LAYER_FULL = 0,   /* "full_attention" */
  DFLASH_LAYER_SLIDING = 1 /* "sliding_attention": window `sliding_window` */
} dflash_layer_type;

/*
 * A drafter's architecture: the fields of config.json that the maths needs.
 * Fill with dflash_drafter_config_default() (Qwen3-style defaults, nothing
 * sized), then dflash_drafter_config_parse/load if wanted. A versioned struct
 * (dflash.h): every function reads it by the one rule (a smaller struct's
 * missing tail is the defaults), and parse/load write it up to its
 * struct_size; a config.json that sets a key whose field lies past the
 * caller's struct_size to a non-default value is refused
 * (DFLASH_E_UNSUPPORTED naming the key and the file), so nothing is dropped
 * silently.
 */
typedef struct dflash_drafter_config {
  size_t struct_size;
  int32_t hidden_size;
  int32_t intermediate_size;
  int32_t num_hidden_layers;
  int32_t num_attention_heads;
  int32_t num_key_value_heads;
  int32_t head_dim;
  int32_t vocab_size;
  int32_t max_position_embeddings;
  double rms_norm_eps;
  double rope_theta;
  /* rope_scaling */
  int32_t rope_type;                  /* dflash_rope_type */
  double rope_factor;                 /* yarn: "factor" */
  double rope_attention_factor;       /* yarn: "attention_factor"; <= 0: derived */
  double rope_beta_fast;              /* yarn: default 32 */
  double rope_beta_slow;              /* yarn: default 1 */
  int32_t rope_original_max_position; /* yarn: "original_max_position_embeddings" */
  int32_t rope_truncate;              /* yarn: "truncate" (default 1) */
  /* DFlash */
  int32_t num_target_layers; /* layers of the target model (L) */
  int32_t block_size;
  int32_t mask_token_id;
  int32_t n_target_layer_ids; /* K */
  int32_t target_layer_ids[DFLASH_DRAFTER_MAX_TARGET];
  int32_t layer_types[DFLASH_DRAFTER_MAX_LAYERS]; /* dflash_layer_type per layer */
  int32_t sliding_window;                         /* 0 when no layer slides */
  int32_t attention_bias;                         /* must be 0 (biases unsupported) */
  int32_t tie_word_embeddings;                    /* written as-is */
  /* RoPE on the first int(head_dim * factor) dims of each head (Hugging Face's
   * partial_rotary_factor, top level or in rope_parameters / rope_scaling;
   * the rest pass through unrotated); in (0, 1], 1 by default. The CPU
   * backend implements it, the CUDA backend refuses a value below 1. */
  double partial_rotary_factor;
  /* DFlash 2 (architectures ["DFlash2DraftModel"], z-lab's dflash 0.1.0):
   * nonzero `dflash2` adds a grouped dynamic causal convolution around every
   * attention and MLP sublayer and a candidate selector; the four sizes are
   * dflash_config's (or the top level's) conv_kernel_size k >= 1,
   * conv_group_size g (channels per group, hidden_size % g == 0),
   * selector_top_k (1..vocab_size) and selector_rank r >= 1. 0 everywhere
   * (the default) is DFlash 1. Parameters per layer:
   * layers.N.{attention,mlp}_conv.base_kernel [2, k, H] and
   * .kernel_projection.weight [2 k H / g, H]; candidate_selector.
   * {predecessor,successor}_codebook [V, r] and .hidden_projection.weight
   * [r, H]. A fresh drafter is initialised to compute exactly DFlash 1. The
   * CPU backend trains it (the selector's loss: dflash_trainer_options'
   * selector_loss_weight / _mode) and predicts with the selector; the CUDA
   * backend refuses DFlash 2 configs. */
  int32_t dflash2;
  int32_t conv_kernel_size;
  int32_t conv_group_size;
  int32_t selector_top_k;
  int32_t selector_rank;
  /* DSpark (architectures ["Qwen3DSparkModel"]; spec/dspark.md): nonzero `dspark` is the
   * DFlash backbone with an anchor-first block (slot k predicts x_{a+k+1}: B inputs give B
   * drafts), a low-rank Markov head on the previous token (markov_head.markov_w1 [V, r],
   * .markov_w2 [V_d, r], r = `markov_rank`, "vanilla" only) and, when `confidence_head`,
   * a confidence head (confidence_head.proj.{weight [1, H + r], bias [1]}) on the
   * final-norm state and the Markov embedding. config.json carries them at the top level
   * and in dflash_config (markov_rank, markov_head_type, enable_confidence_head,
   * confidence_head_with_markov, sample_from_anchor, num_anchors). `num_anchors` is the
   * anchors per sequence the checkpoint records (DeepSpec's loader asserts the key; 0: not
   * written). 0 everywhere (the default) is DFlash. The CPU trainer trains
   * it (dflash_sample.target_final gives the target distribution); the CUDA backend, the
   * training plan and evaluation refuse it (DFLASH_E_UNSUPPORTED). */
  int32_t dspark;
  int32_t markov_rank;
  int32_t confidence_head;
  int32_t num_anchors;
  /* DSpark's pruned draft vocabulary (spec/dspark.md section 4): V_d in 1..vocab_size, or 0
   * (the default) for the full vocabulary (V_d = vocab_size is the same). Below vocab_size,
   * the drafter drafts over V_d target ids (its `d2t` / `t2d` tables, see
   * dflash_draft_vocab_select and dflash_trainer_set_draft_vocab): lm_head.weight is the
   * target head's kept rows [V_d, H] and markov_w2 is [V_d, r] (markov_w1 stays [V, r]).
   * config.json's `draft_vocab_size` (top level and dflash_config), written only when
   * pruned. DSpark only: a DFlash config with it below vocab_size is DFLASH_E_CONFIG. */
  int32_t draft_vocab_size;
} dflash_drafter_config;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_drafter_config_default(&cfg). */
DFLASH_API void dflash_drafter_config_init(dflash_drafter_config *cfg, size_t size);
#define dflash_drafter_config_default(cfg) dflash_drafter_config_init((cfg), sizeof *(cfg))

/*
 * Parse config.json text into `out`, whose struct_size the caller set
 * (with dflash_drafter_config_default). Accepts `block_size` at the top level or inside
 * `dflash_config` (equal when both), `dflash_config.{mask_token_id,
 * target_layer_ids}`, `layer_types`, `rope_scaling` (null, default or yarn;
 * `type` or `rope_type`), `head_dim` (default 128, as Qwen3Config). Missing
 * target_layer_ids take the spec's default for num_target_layers. The result
 * is validated (dflash_drafter_config_validate). `what` names the source in
 * errors (may be NULL). Refused, naming the key and `what`: `architectures`
 * other than ["DFlashDraftModel"], ["DFlash2DraftModel"] or a DSpark name
 * (["Qwen3DSparkModel"], SpecForge's ["DSparkDraftModel"]) and keys of models libdflash does not
 * implement set to non-default values (DFLASH_E_UNSUPPORTED); a YaRN
 * rope_scaling without original_max_position_embeddings, or whose factor
 * differs from max_position_embeddings / original_max_position_embeddings,
 * and sliding_attention layers without use_sliding_window (DFLASH_E_CONFIG).
 */
DFLASH_API dflash_status dflash_drafter_config_parse(const char *json, size_t len, const char *what,
                                                     dflash_drafter_config *out);
DFLASH_API dflash_status dflash_drafter_config_load(const char *path, dflash_drafter_config *out);

/* Check sizes and relations: positive dims, heads divisible by kv heads,
 * mask id inside the vocabulary, target ids inside [0, num_target_layers),
 * layer types, sliding window, YaRN fields. DFLASH_E_CONFIG with the field. */
DFLASH_API dflash_status dflash_drafter_config_validate(const dflash_drafter_config *cfg);

/*
 * Serialise as config.json (indented, both block_size placements,
 * architectures ["DFlashDraftModel"], model_type "qwen3", num_target_layers:
 * DFLASH_E_CONFIG when it is 0, since the reference model cannot load a
 * config without it, nor one whose YaRN factor differs from
 * max_position_embeddings / original_max_position_embeddings, nor a YaRN
 * factor of 1 with an attention factor other than 1, which SGLang cannot
 * express). YaRN writes attention_factor and an mscale / mscale_all_dim pair
 * giving SGLang the same scale. No "dtype": these files describe no weights
 * (dflash_trainer_save writes it). Writes at most
 * `cap` bytes including the terminating NUL into `buf`; *len gets the size
 * needed, NUL included (DFLASH_E_BUFFER when `buf` is too small or NULL).
 */
DFLASH_API dflash_status dflash_drafter_config_to_json(const dflash_drafter_config *cfg, char *buf,
                                                       size_t cap, size_t *len);
/* Write config.json atomically. */
DFLASH_API dflash_status dflash_drafter_config_save(const dflash_drafter_config *cfg,
                                                    const char *path);

/* The spec's default target layers: K=1 -> [L/2], else
 * round(1 + i*(L-4)/(K-1)) for i in 0..K-1. `out` holds K entries. */
DFLASH_API dflash_status dflash_drafter_default_target_layers(int32_t num_target_layers, int32_t k,
                                                              int32_t *out);

/*
 * A pruned draft vocabulary (spec/dspark.md section 4, speculators' and SpecForge's rule):
 * from counts [vocab_size] of supervised token ids (dflash_dataset_token_counts, dataset.h),
 * the draft_vocab_size most frequent ids (ties: the lower id first), filled with the lowest
 * unused ids when fewer than draft_vocab_size occur, sorted ascending, into kept
 * [draft_vocab_size]. The checkpoint's tables follow: d2t[i] = kept[i] - i (offsets: target
 * id = i + d2t[i]) and t2d[id] = whether id is kept. *coverage (may be NULL) gets the kept
 * ids' share of the counted tokens (0 when none were counted): the drafter can draft no
 * other token, so acceptance cannot exceed it. Counts must not be negative.
 */
DFLASH_API dflash_status dflash_draft_vocab_select(const int64_t *counts, int32_t vocab_size,
                                                   int32_t draft_vocab_size, int32_t *kept,
                                                   double *coverage);

struct dflash_dataset; /* dataset.h's dflash_dataset */
/* dflash_draft_vocab_select on the dataset's supervised token counts
 * (dflash_dataset_token_counts): what `dflash init-config --draft-vocab N --data DIR` and a
 * training run of a pruned drafter pick. */
DFLASH_API dflash_status dflash_draft_vocab_from_dataset(const struct dflash_dataset *ds,
                                                         int32_t vocab_size,
                                                         int32_t draft_vocab_size, int32_t *kept,
                                                         double *coverage);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_DRAFTER_H */
