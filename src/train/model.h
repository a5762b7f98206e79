/*
 * The drafter on the CPU: parameters and gradients in two contiguous float
 * buffers (llm.c style), activations in one arena sized per call, and the
 * forward/backward of the whole model and its loss over one sequence.
 */
#ifndef DFLASH_TRAIN_MODEL_H
#define DFLASH_TRAIN_MODEL_H

#include <dflash/experimental.h>
#include <dflash/train.h>

#include "ops.h"
#include "tensors.h"

/* The fields of dflash_drafter_config beyond DFlash 1 with full RoPE (partial RoPE, DFlash 2),
 * apart: what the model's shapes and ops branch on (df_config_ext_of). */
typedef struct df_config_ext {
  double partial_rotary_factor;
  int32_t dflash2;
  int32_t conv_kernel_size;
  int32_t conv_group_size;
  int32_t selector_top_k;
  int32_t selector_rank;
  int32_t dspark; /* DSpark's fields (dflash_drafter_config's) */
  int32_t markov_rank;
  int32_t confidence_head;
  int32_t num_anchors;
  int32_t draft_vocab; /* V_d: vocab_size when not pruned */
} df_config_ext;

/* Parameter views (into params or grads), one float* per row of tensors.h's lists. */
#define DF_TENSOR_FIELD_(id, field, ...) float *field;
#define DF_CONV_FIELD_(id, field, name) df_conv_w field;

/* DFlash 2: one grouped dynamic causal convolution, base_kernel [2, k, H]
 * and kernel_projection.weight [2 k H / g, H]. */
typedef struct df_conv_w {
  DF_TENSORS_CONV(DF_TENSOR_FIELD_)
} df_conv_w;

/* Per layer: in_ln, wq, wk, wv, wo, q_norm, k_norm, post_ln, wg, wu, wd; att_conv and
 * mlp_conv for DFlash 2 only. */
typedef struct df_layer_w {
  DF_TENSORS_LAYER(DF_TENSOR_FIELD_)
  DF_CONVS(DF_CONV_FIELD_)
} df_layer_w;

/* fc, hidden_norm, norm; DFlash 2's candidate selector sel_pred, sel_succ (codebooks
 * [V, r]) and sel_hproj (hidden_projection [r, H]); DSpark's markov_w1, markov_w2 ([V, r])
 * and confidence head conf_w [H + r], conf_b [1] (NULL without the head). */
typedef struct df_weights {
  DF_TENSORS_HEAD(DF_TENSOR_FIELD_)
  DF_TENSORS_TAIL(DF_TENSOR_FIELD_)
  df_layer_w layer[DFLASH_DRAFTER_MAX_LAYERS];
  DF_TENSORS_SELECTOR(DF_TENSOR_FIELD_)
  DF_TENSORS_MARKOV(DF_TENSOR_FIELD_)
  DF_TENSORS_CONF(DF_TENSOR_FIELD_)
} df_weights;

/* How a fresh trainer fills a tensor (trainer.c). */
typedef enum df_init_kind {
  DF_INIT_NORMAL,        /* N(0, init_std) */
  DF_INIT_ONES,          /* norms */
  DF_INIT_ZERO,          /* DFlash 2's kernel and hidden projections */
  DF_INIT_CONV_IDENTITY, /* base kernels: tap 0 is 1, the others 0 */
} df_init_kind;

typedef struct df_tensor_info {
  char name[96];
  size_t offset, numel;
  int64_t shape[3];
  int ndim;
  df_init_kind init;
} df_tensor_info;

/* The sizes tensors.h's shapes are made of, for a config (ext NULL: DFlash 1). */
df_tensor_dims df_tensor_dims_of(const dflash_drafter_config *cfg, const df_config_ext *ext);

/* Activations of one layer (pointers into the arena). */
typedef struct df_layer_acts {
  float *h_in, *rstd1, *xn1;
  float *q_pre, *q_rstd, *q;
  float *kb_pre, *kb_rstd, *kb, *vb;
  float *kc_pre, *kc_rstd, *kc, *vc;
  float *att, *lse;
  float *h_mid, *rstd2, *xn2;
  float *g, *u, *m;
  /* DFlash 2: dynamic kernels [T, 2 k H/g] of each convolution, the
   * convolved sublayer inputs and the sublayer outputs before finish */
  float *att_dyn, *att_x, *att_y, *mlp_dyn, *mlp_x, *mlp_y;
} df_layer_acts;

typedef struct df_acts {
  float *ctx_pre, *ctx_rstd, *ctx; /* [Sc, H] */
  df_layer_acts layer[DFLASH_DRAFTER_MAX_LAYERS];
  float *h_out, *rstd_f, *hf; /* [T, H] */
  /* gradients, shared by all layers */
  float *dh, *dx, *dq, *dkb, *dvb, *dkc, *dvc, *datt, *dg, *du, *dm, *dctx, *dtmp, *dctx_tmp;
  /* DFlash 2: d(sublayer output before finish), d(convolved input), d(dynamic kernels) */
  float *d2_y, *d2_x, *d2_dyn;
  /* loss rows */
  float *rows_x, *rows_dx, *coef;
  int32_t *rows_t, *rows_target;
  double *row_loss;
  /* DSpark: each row's previous token, weight, and the target's final state [R, H] */
  int32_t *rows_prev;
  double *rows_w;
  float *rows_xt;
  int32_t *pos_block, *pos_ctx;
  float *work;
} df_acts;

typedef struct df_model {
  dflash_drafter_config cfg;
  df_config_ext ext;
  int H, KH, nh, nkv, d, I, V, B, L;
  bool dflash2;
  bool dspark; /* ext.dspark: anchor-first rows, the Markov and confidence heads */
  int conv_k, conv_g, conv_groups, sel_rank; /* DFlash 2's sizes (ext) */
  int rot; /* rotated dims of each head (partial_rotary_factor): pairs (i, i + rot/2) */
  int vocab_chunk;
  double gamma;
  df_tensor_info *tensors;
  size_t n_tensors, n_params;
  float *params, *grads;
  df_weights w, g;
  float *embed, *lm_head; /* frozen, [V, H]; a pruned DSpark drafter's lm_head [Vd, H] */
  /* DSpark's pruned draft vocabulary (draft_vocab.c): Vd < V, kept [Vd] ascending target ids,
   * t2d [V] the draft index of a target id or -1, lm_head_full the target's [V, H] head the
   * kept rows come from. Vd = V and all three NULL when not pruned. */
  int Vd;
  int32_t *kept, *t2d;
  float *lm_head_full;
  bool dv_set;     /* kept given (set or loaded), not the fresh default: training needs it */
  unsigned dv_gen; /* counts df_model_set_draft_vocab calls: a backend's copy is stale after one */
  df_pool *pool;
  /* RoPE tables [n_pos, rot/2] */
  double *inv_freq;
  double attn_factor;
  float *cos_t, *sin_t;
  int n_pos;
  /* arena */
  float *arena;
  size_t arena_floats;
  df_acts a;
  int T, Sc, R; /* sizes of the current call */
  /* DFlash 2's selector loss (ext): its weight, "inject" (else "drop"), and
   * the last df_model_step's sums: weighted selector CE, supervised rows,
   * rows whose true token was among the top-K (candidate recall). */
  double sel_weight;
  bool sel_inject;
  double sel_loss_sum, sel_rows, sel_hits;
  /* DFLASH_POSITION_WEIGHTING_ADAPTIVE: df_position_weight is 1, and each call weighs its rows by
   * row_w [R] (adaptive_weights in model.c), which the selector loss reads too. */
  bool adaptive;
  const double *row_w;
} df_model;

/* `cfg` is the caller's (any struct_size, by the one rule). */
DF_MUST_CHECK dflash_status df_model_init(df_model *m, const dflash_drafter_config *cfg,
                                          int n_threads, int vocab_chunk, double gamma);
void df_model_free(df_model *m);
const df_tensor_info *df_model_find(const df_model *m, const char *name);

/* The weight of block position k (1..B-1), before the loss mask. */
double df_position_weight(const df_model *m, int k);

/*
 * Forward + backward of sum(w*CE) over one sequence; gradients (scaled by
 * grad_scale) are ADDED to m->grads when `backward`. Checks the inputs
 * (ids in the vocabulary, anchors in range, finite hidden states).
 * DSpark: sum(w * (0.1 CE + 0.9 L1 + 1.0 BCE)) over its anchor-first rows instead
 * (df_model_step_final gives the target's final state; without it, 0.1 CE alone).
 */
DF_MUST_CHECK dflash_status df_model_step(df_model *m, const int32_t *ids, const uint8_t *loss_mask,
                                          int64_t len, const float *hidden, const int32_t *anchors,
                                          int32_t n_anchors, double grad_scale, bool backward,
                                          double *loss_sum, double *weight_sum);
/* The same with CE targets labels[p] instead of ids[p] (NULL: ids): `--labels target`, the
 * target's greedy tokens; the block input (anchor token) stays ids. */
DF_MUST_CHECK dflash_status df_model_step_labels(df_model *m, const int32_t *ids,
                                                 const int32_t *labels, const uint8_t *loss_mask,
                                                 int64_t len, const float *hidden,
                                                 const int32_t *anchors, int32_t n_anchors,
                                                 double grad_scale, bool backward, double *loss_sum,
                                                 double *weight_sum);
/* The same with the target's post-norm final state `final` [len, H] (NULL: none), which
 * DSpark's L1 and confidence terms need (DFlash ignores it). */
DF_MUST_CHECK dflash_status df_model_step_final(df_model *m, const int32_t *ids,
                                                const int32_t *labels, const uint8_t *loss_mask,
                                                int64_t len, const float *hidden,
                                                const float *final, const int32_t *anchors,
                                                int32_t n_anchors, double grad_scale, bool backward,
                                                double *loss_sum, double *weight_sum);
/* DSpark (model_dspark.c): the target's final state finite; the loss over the rows prepare
 * laid out (sums added to *lsum, *wsum; d(rows) into rows_dx with `backward`); the greedy
 * drafts [n_anchors, B] after a forward. */
DF_MUST_CHECK dflash_status df_model_check_final(const df_model *m, const float *final,
                                                 int64_t len);
DF_MUST_CHECK dflash_status df_model_dspark_loss(df_model *m, const float *final,
                                                 const int32_t *anchors, double grad_scale,
                                                 bool backward, double *lsum, double *wsum);
DF_MUST_CHECK dflash_status df_model_dspark_chain(df_model *m, const int32_t *ids, int64_t len,
                                                  const float *final, const int32_t *anchors,
                                                  int32_t n_anchors, int32_t *pred, float *conf,
                                                  double *ptau);
/* DSpark's evaluation (model_dspark.c's chain after a forward of these anchors): the greedy
 * drafts pred [n_anchors, B]; conf [n_anchors, B] (may be NULL) the confidence head's
 * sigmoid at each slot along the chain; with `final` (the target's post-norm state [len, H])
 * ptau [n_anchors] (may be NULL) each block's teacher-forced probabilistic tau. */
DF_MUST_CHECK dflash_status df_model_dspark_eval(df_model *m, const int32_t *ids, int64_t len,
                                                 const float *hidden, const float *final,
                                                 const int32_t *anchors, int32_t n_anchors,
                                                 int32_t *pred, float *conf, double *ptau);
/* The draft vocabulary (draft_vocab.c): `kept` [m->Vd] ascending ids (NULL: 0..Vd-1) into
 * kept / t2d and the LM head's rows gathered from lm_head_full; DFLASH_E_FORMAT naming
 * `what` for an id out of range or not ascending. */
DF_MUST_CHECK dflash_status df_model_set_draft_vocab(df_model *m, const int32_t *kept,
                                                     const char *what);
/* DFLASH_E_STATE for a pruned draft vocabulary whose kept ids were never set or loaded (the
 * fresh 0..Vd-1): nothing trains on an arbitrary set. DFLASH_OK otherwise. */
DF_MUST_CHECK dflash_status df_model_draft_vocab_ready(const df_model *m);
/* kept [n] strictly ascending in [0, V) (DFLASH_E_FORMAT naming `what` and the index). */
DF_MUST_CHECK dflash_status df_draft_vocab_check(const int32_t *kept, int64_t n, int32_t V,
                                                 const char *what);
/* Labels (may be NULL) inside the vocabulary (DFLASH_E_RANGE naming the position). */
DF_MUST_CHECK dflash_status df_model_check_labels(const df_model *m, const int32_t *labels,
                                                  int64_t len);
/* Ids inside the vocabulary, anchors inside the sequence, finite hidden
 * states (DFLASH_E_RANGE / DFLASH_E_FORMAT naming the position). */
DF_MUST_CHECK dflash_status df_model_check_inputs(const df_model *m, const int32_t *ids,
                                                  int64_t len, const float *hidden,
                                                  const int32_t *anchors, int32_t n);
/* Sum of position weights for these anchors. */
/*
 * The rows of one sequence, for both backends (model.c's prepare, backend_cuda.c's): block n
 * is anchors[n] followed by B-1 mask tokens, T = n_anchors * B block rows; the context is
 * positions 0 .. max(anchors) - 1 (*Sc) and RoPE needs positions up to *max_pos. A drafted
 * row (j >= 1 in its block) is supervised when loss_mask is set there, inside the sequence,
 * and weighted above 0; with loss_mask NULL (prediction) every drafted row is. Returns their
 * count R and fills, each array NULL or of room for n_anchors * (B - 1): rows_t (block row),
 * rows_target (the label: labels[p], else ids[p]; 0 when predicting), rows_prev (DFlash 2's
 * predecessor: the anchor token for j = 1, else the previous label; 0 past the end) and
 * coef (weight * grad_scale); block_tok [T] (the anchor token or the mask token) NULL or set.
 */
int df_model_rows(const df_model *m, const int32_t *ids, const int32_t *labels,
                  const uint8_t *loss_mask, int64_t len, const int32_t *anchors, int32_t n_anchors,
                  double grad_scale, int *Sc, int *max_pos, int32_t *block_tok, int32_t *rows_t,
                  int32_t *rows_target, int32_t *rows_prev, float *coef);
double df_model_weight_sum(const df_model *m, const uint8_t *loss_mask, int64_t len,
                           const int32_t *anchors, int32_t n_anchors);
/* Greedy predictions for positions 1..B-1 of each block (DSpark: B drafts, slots 0..B-1,
 * chained through the Markov head). */
DF_MUST_CHECK dflash_status df_model_predict(df_model *m, const int32_t *ids, int64_t len,
                                             const float *hidden, const int32_t *anchors,
                                             int32_t n_anchors, int32_t *pred);

/* dflash_trainer_propose on the model (o NULL: greedy; out NULL: the tokens only; the caller
 * checked o, and that a DFlash 1 model is asked for nothing but argmax). */
DF_MUST_CHECK dflash_status df_model_propose(df_model *m, const int32_t *ids, int64_t len,
                                             const float *hidden, const int32_t *anchors,
                                             int32_t n_anchors, const dflash_propose_options *o,
                                             const dflash_propose_outputs *out, int32_t *pred);

/* Logits [n_anchors, B, V] of every block position (see dflash_trainer_logits). */
DF_MUST_CHECK dflash_status df_model_logits(df_model *m, const int32_t *ids, int64_t len,
                                            const float *hidden, const int32_t *anchors,
                                            int32_t n_anchors, float *logits);

/* ---- config helpers (config.c) --------------------------------------------- */

/* A caller's config (any struct_size, by the one rule) as the library's full struct. */
DF_MUST_CHECK dflash_status df_config_in(const dflash_drafter_config *in,
                                         dflash_drafter_config *cfg);
/* The partial RoPE and DFlash 2 fields of a full-size config. */
void df_config_ext_of(const dflash_drafter_config *cfg, df_config_ext *ext);
/* partial_rotary_factor in (0, 1] giving an even rotated width >= 2. */
DF_MUST_CHECK dflash_status df_config_ext_validate(const dflash_drafter_config *cfg,
                                                   const df_config_ext *ext, const char *what);
/* DSpark's fields of `ext`: all zero for DFlash, else a rank in 1..65536, the confidence
 * head 0 or 1, not with DFlash 2, and tie_word_embeddings 0 (the spec's checkpoint). */
DF_MUST_CHECK dflash_status df_dspark_validate(const dflash_drafter_config *cfg,
                                               const df_config_ext *ext, const char *what);
/* DFLASH_E_UNSUPPORTED for a DSpark config, naming `what` refuses it and `why`: the paths that
 * do not implement DSpark yet (CUDA, its plan, evaluation) would silently drop its heads and
 * label shift. */
DF_MUST_CHECK dflash_status df_dspark_unsupported(const df_config_ext *ext, const char *what,
                                                  const char *why);
/* DFlash 2's fields of `ext` (the sizes, or all zero for DFlash 1). */
DF_MUST_CHECK dflash_status df_dflash2_validate(const dflash_drafter_config *cfg,
                                                const df_config_ext *ext, const char *what);
/* int(head_dim * partial_rotary_factor). */
int df_rotary_dims(const dflash_drafter_config *cfg, const df_config_ext *ext);
/* YaRN: factor == max_position_embeddings / original_max_position_embeddings. */
DF_MUST_CHECK dflash_status df_yarn_check(const dflash_drafter_config *cfg, const char *what);
/* config.json with "dtype" / "torch_dtype" = `dtype` ("bfloat16", "float32";
 * NULL: neither key), the stored weights' dtype, which SGLang builds the draft in. */
DF_MUST_CHECK dflash_status df_drafter_config_save_dtype(const dflash_drafter_config *cfg,
                                                         const char *dtype, const char *path);

#endif
