/*
 * DSpark (spec/dspark.md) on the CPU: the Markov and confidence heads over a drafter's
 * supervised rows, and the objective 0.1 CE + 0.9 L1 + 1.0 BCE in one pass over the
 * vocabulary, forward and backward. What the model's rows (anchor-first layout, label shift)
 * feed it is model.c's; this is the head and the loss alone.
 */
#ifndef DFLASH_TRAIN_DSPARK_H
#define DFLASH_TRAIN_DSPARK_H

#include <stdbool.h>
#include <stdint.h>

#include "core/internal.h"

/*
 * Row i (of R): e = w1[prev_i] (the Markov embedding of the previous token, [r]),
 * z = E x_i + w2 e (the draft logits over V), p = softmax(z);
 *   CE_i  = -log p[target_i]
 *   L1_i  = sum_v |p_v - q_v|, q = softmax(E xt_i)  (the target's distribution; xt NULL: 0)
 *   c*_i  = clamp(1 - L1_i / 2, 0, 1), a constant (stop-gradient, the paper's eq. 8;
 *           pruned: see qlse)
 *   s_i   = cw . [x_i; e] + cb (the confidence logit; cw NULL: no head)
 *   BCE_i = softplus(s_i) - c*_i s_i
 * The gradients are those of sum_i coef_i (alpha_ce CE_i + alpha_l1 L1_i + alpha_conf BCE_i)
 * with sign(0) = 0 in L1's; BCE needs q (c* is defined by L1), so xt NULL leaves it out too.
 */
typedef struct df_dspark_args {
  const float *x;        /* [R, H] the drafter's final-norm state of each row */
  const float *xt;       /* [R, H] the target's post-norm final state there, or NULL */
  const float *E;        /* [V, H] the target's LM head (frozen) */
  const float *w1, *w2;  /* markov_w1 [V1, r], markov_w2 [V, r] */
  const float *cw;       /* confidence_head.proj.weight [H + r], or NULL */
  float cb;              /* its bias */
  const int32_t *prev;   /* [R] the previous token (teacher forcing), in [0, V1) */
  const int32_t *target; /* [R] the CE label, in [0, V), or -1: no CE on the row (a label
                           * outside a pruned draft vocabulary; L1 and BCE stay) */
  /* A pruned draft vocabulary: V is V_d (E, w2 and the logits have V_d rows), V1 the full
   * vocabulary (w1's rows; <= 0: V), and qlse [R] the target's logsumexp over the full
   * vocabulary at each row (NULL: not pruned). q above is then renormalized over the V_d
   * rows (speculators' teacher) for L1, and c* = clamp((1 + sum q' - sum |p - q'|) / 2, 0,
   * 1) with q' = exp(E xt - qlse) normalized over the full vocabulary, i.e. sum_kept min(p,
   * q'): the acceptance, which the renormalized teacher would overstate by the dropped mass
   * (spec/dspark.md section 4). */
  int V1;
  const double *qlse;
  const float *coef;      /* [R] the gradient coefficient (weight * grad scale) */
  const double *w;        /* [R] the weight of the sums below */
  const float *cstar_fix; /* [R] c* to use instead of L1's (a test hook), or NULL */
  int R, H, V, r;
  int chunk_rows; /* rows per pass (scratch 2 V floats a row); <= 0: 32 */
  double alpha_ce, alpha_l1, alpha_conf;
  /* Outputs, each NULL or: dx [R, H] overwritten; dw1, dw2, dcw [H + r], dcb [1] accumulated;
   * conf [R] the confidence sigmoid(s_i), cstar [R] c*_i, ce/l1/bce [R] the row terms. */
  float *dx, *dw1, *dw2, *dcw, *dcb;
  float *conf, *cstar;
  double *ce, *l1, *bce;
} df_dspark_args;

/* Sums sum_i w_i CE_i, w_i L1_i, w_i BCE_i (the caller divides by sum w). */
typedef struct df_dspark_sums {
  double ce, l1, bce;
} df_dspark_sums;

/* The pass above; rows are independent, the parameter gradients summed in row order (the
 * scatter into w1's rows included), so the result does not depend on the pool's threads.
 * DFLASH_E_NOMEM when its scratch cannot be had, DFLASH_E_RANGE for an id outside [0, V). */
DF_MUST_CHECK dflash_status df_dspark_loss(df_pool *pool, const df_dspark_args *a,
                                           df_dspark_sums *sums);

/*
 * The supervised rows of one sequence in DSpark's anchor-first layout (spec/dspark.md
 * section 2): block n is anchors[n] followed by B - 1 mask tokens, and its slot k (0..B-1)
 * predicts position p = anchor + k + 1, one later than DFlash's slot k, so slot 0 is
 * supervised and B slots give B drafts. Its label is labels[p] (NULL: ids[p], the data), its
 * previous token (the Markov head's, teacher-forced) the anchor's id for k = 0 and the slot
 * k - 1 label after. Slot k counts while the prefix mask
 *   m_k = prod_{j <= k} [anchor + j + 1 < len] loss_mask[anchor + j + 1]
 * is 1 (the first unsupervised or out-of-sequence slot ends the block), with weight
 * w_k = exp(-k / gamma) (gamma <= 0: 1), k 0-based (the paper's exp(-(k-1)/gamma), 1-based).
 * Returns R and fills each array that is not NULL (room for n_anchors * B): rows_t (block
 * row n * B + k), rows_target, rows_prev, w and coef (w * grad_scale). Padding blocks are
 * blocks not passed. Anchors must lie in [0, len); ids and labels in the vocabulary (the
 * caller checks, as for DFlash).
 */
int df_dspark_rows(int B, double gamma, const int32_t *ids, const int32_t *labels,
                   const uint8_t *loss_mask, int64_t len, const int32_t *anchors, int32_t n_anchors,
                   double grad_scale, int32_t *rows_t, int32_t *rows_target, int32_t *rows_prev,
                   double *w, float *coef);

/* sum w_k over the rows df_dspark_rows gives for these anchors (what the loss divides by). */
double df_dspark_weight_sum(int B, double gamma, const uint8_t *loss_mask, int64_t len,
                            const int32_t *anchors, int32_t n_anchors);

/* The objective's weights (spec/dspark.md section 2: DeepSpec's configs, SpecForge's schema). */
#define DF_DSPARK_ALPHA_CE 0.1
#define DF_DSPARK_ALPHA_L1 0.9
#define DF_DSPARK_ALPHA_CONF 1.0

#endif
