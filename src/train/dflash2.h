/*
 * DFlash 2 (z-lab's dflash 0.1.0, DFlash2DraftModel) on the CPU: the grouped
 * dynamic causal convolution around every attention and MLP sublayer, and
 * the candidate selector's parameters.
 */
#ifndef DFLASH_TRAIN_DFLASH2_H
#define DFLASH_TRAIN_DFLASH2_H

#include <stddef.h>

#include "core/internal.h"

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
void df2_conv_apply(df_pool *pool, float *out, const float *x, const float *dyn,
                    size_t dyn_stride, const float *base, const float *residual, int T, int B,
                    int H, int k, int g);

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

#endif
