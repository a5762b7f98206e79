/*
 * DFlash 2 (z-lab's dflash 0.1.0, DFlash2DraftModel) on the CPU: the grouped
 * dynamic causal convolution around every attention and MLP sublayer, and
 * the candidate selector's parameters.
 */
#ifndef DFLASH_TRAIN_DFLASH2_H
#define DFLASH_TRAIN_DFLASH2_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/internal.h"
#include "rng.h"

/*
 * One grouped dynamic causal convolution over T = n_blocks * B rows of width
 * H, each block on its own (the taps stop at the block's first position, as
 * z-lab's zero padding does for the one block it drafts):
 *   out[t, c] = residual[t, c] + sum_{o < k, j - o >= 0}
 *               (base[o, c] + dyn[t, o, c / g]) * x[t - o, c],   j = t mod B,
 * summed in z-lab's order (per tap the base term, then the dynamic term).
 * dyn row t starts at dyn + t * dyn_stride and holds [k, H / g]; base is
 * [k, H]; residual may be NULL (0). out must not alias x.
 */
void df2_conv_apply(df_pool *pool, float *out, const float *x, const float *dyn, size_t dyn_stride,
                    const float *base, const float *residual, int T, int B, int H, int k, int g);

/*
 * The backward of df2_conv_apply for dout = d(out) (the residual's gradient
 * is dout itself): dx [T, H] and ddyn (rows at ddyn + t * dyn_stride, [k,
 * H/g] each) are overwritten, dbase [k, H] is accumulated (a gradient
 * buffer). dx must not alias dout.
 */
void df2_conv_backward(df_pool *pool, float *dx, float *ddyn, float *dbase, const float *dout,
                       const float *x, const float *dyn, size_t dyn_stride, const float *base,
                       int T, int B, int H, int k, int g);

/*
 * The candidate selector's greedy path over n consecutive drafted positions
 * (z-lab's CandidateSelector.select at temperature 0): at position i the
 * top_k tokens of logits[i] (the candidates, their logits the unary scores)
 * are rescored unary(b) + <A(prev) * P(h_i), B(b)>, where A / B are rows of
 * the predecessor / successor codebooks [V, r], P(h_i) = hproj[i] [r], and
 * prev is the token chosen at the position before (the anchor's token at
 * the first); path[i] gets the best. logits [n, V], hproj [n, r]. Ties go to
 * the candidate with the larger logit, then the smaller id.
 */
void df2_select_greedy(const float *logits, const float *hproj, const float *pred_cb,
                       const float *succ_cb, int n, int V, int r, int top_k, int32_t anchor_id,
                       int32_t *path);

/* The first largest of V logits (df_lmhead_argmax's choice). */
int32_t df2_argmax(const float *row, int V);

/* One block's drafted positions through the candidate selector
 * (df2_select). */
typedef struct df2_select_args {
  const float *logits;            /* [n, V] */
  const float *hproj;             /* [n, r] P(h_i) */
  const float *pred_cb, *succ_cb; /* [V, r] */
  int n, V, r, top_k;
  int32_t anchor_id;  /* the predecessor of position 0 */
  double temperature; /* > 0 (with an rng): sample */
  int32_t *cand;      /* NULL or [n, top_k]: the candidates, descending logit */
  float *probs;       /* NULL or [n, top_k]: q when sampling */
} df2_select_args;

/*
 * z-lab's CandidateSelector.select over one block: at temperature 0 (or
 * without rng) df2_select_greedy's path; at temperature T > 0 position i's
 * token is drawn (one df_rng_unit per position, inverse CDF in candidate
 * order) from q = softmax(scores / T) over its candidates, the path's own
 * draw as the next predecessor.
 */
void df2_select(const df2_select_args *s, df_rng *rng, int32_t *path);

/*
 * The selector loss's candidates: the top_k (by logit, ties to the smaller
 * id) of each of R rows' logits x_r . E[v] (x [R, H], E [V, H]), computed
 * vocabulary chunk by chunk so the [R, V] logits never exist; ids / vals
 * [R, top_k] get them in descending order. scratch holds R * chunk floats.
 */
void df2_lmhead_topk(const float *x, const float *E, int R, int H, int V, int chunk, int top_k,
                     int32_t *ids, float *vals, float *scratch);

/*
 * The index of the true token `target` among the k candidates, or, when it
 * is not one of them: -1 (mode "drop": the position leaves the selector
 * loss) or, with `inject`, k - 1 after the true token (unary target_logit)
 * replaced the lowest candidate (mode "inject").
 */
int df2_selector_candidates(int32_t *cand, float *unary, int k, int32_t target, float target_logit,
                            bool inject);

/*
 * One position's selector loss, the K-way cross-entropy of candidate y under
 * the scores s_c = unary[c] + <a * h, B[cand[c]]> (a = A(true previous
 * token), h = P(h_t), B the successor codebook [V, r]); unary[c] is the
 * drafter's logit x . E[cand[c]] (E the LM head [V, H]) and is differentiated
 * (only the top-K selection is not). With da non-NULL, coef * d(loss) is
 * accumulated into da [r], dh [r], dsucc_cb [V, r] and dx [H] (the unary
 * path; P's is the caller's, from dh). p holds k floats.
 */
double df2_selector_row(const int32_t *cand, const float *unary, int k, int y, const float *a,
                        const float *h, const float *succ_cb, int r, float coef, float *da,
                        float *dh, float *dsucc_cb, const float *E, int H, float *dx, float *p);

/* The selector loss over R rows (df2_selector_loss). */
typedef struct df2_sel_args {
  const float *x;                   /* [R, H] the drafter's final (normed) hidden rows */
  const float *E;                   /* [V, H] the LM head */
  const float *pred, *succ, *hproj; /* codebooks [V, r], hidden_projection [r, H] */
  const int32_t *target, *prev;     /* [R] the true token and the true previous one */
  const float *coef;                /* [R] gradient scale of each row's CE */
  const double *w;                  /* [R] loss weight of each row's CE */
  int R, H, V, r, K, chunk;
  bool inject; /* "inject", else "drop" */
  /* [R, K] each row's top-K ids and logits, descending, as df_lmhead_ce_topk
   * keeps them in the block CE's pass; NULL: a pass of df2_lmhead_topk's own
   * (the LM head's logits computed a second time). */
  const int32_t *cand;
  const float *unary;
  /* Backward when dx is non-NULL: all four are accumulated. */
  float *dx, *dpred, *dsucc, *dhproj;
} df2_sel_args;

/*
 * DFlash 2's selector loss: for each row the top-K candidates of
 * its logits (s->cand, else df2_lmhead_topk), the true token placed among them or the row
 * dropped (df2_selector_candidates), and df2_selector_row's CE; *loss gets
 * sum_i w[i] CE_i, *hits the rows whose true token was a candidate (before
 * any injection). The gradient reaches x through the unary logits and P(x).
 */
dflash_status df2_selector_loss(const df2_sel_args *s, double *loss, double *hits);

#endif
