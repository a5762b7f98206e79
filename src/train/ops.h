/*
 * The drafter's layer kinds, float32, one forward and one backward function
 * each (llm.c style). Row-major everywhere. Backward functions ACCUMULATE
 * into parameter gradients and OVERWRITE input gradients unless noted.
 * Every parallel loop gives each output element to exactly one task and sums
 * in a fixed order, so results do not depend on thread scheduling: a resumed
 * run reproduces the uninterrupted one bit for bit.
 */
#ifndef DFLASH_TRAIN_OPS_H
#define DFLASH_TRAIN_OPS_H

#include "core/internal.h"

/* ---- matmul (OpenBLAS, one thread per call) -------------------------------- */

/* C = alpha op(A) op(B) + beta C, row-major, as cblas_sgemm. With a pool of more
 * than one thread, a large product is cut into one block of C's rows or columns
 * per thread, each a single-threaded cblas_sgemm (the trainer keeps OpenBLAS at one
 * thread: df_blas_setup); each element of C is one call's sum over K. Not from inside
 * a df_pool_for of the same pool. */
void df_sgemm(df_pool *pool, bool ta, bool tb, int M, int N, int K, float alpha, const float *A,
              int lda, const float *B, int ldb, float beta, float *C, int ldc);
/* y[M,N] = x[M,K] w[N,K]^T (+ y when accumulate). */
void df_matmul_forward(df_pool *pool, float *y, const float *x, const float *w, int M, int N, int K,
                       bool accumulate);
/* dx[M,K] (+)= dy[M,N] w[N,K] (dx may be NULL); dw[N,K] += dy^T x (dw may be NULL). */
void df_matmul_backward(df_pool *pool, float *dx, float *dw, const float *dy, const float *x,
                        const float *w, int M, int N, int K, bool accumulate_dx);

/* ---- RMSNorm over rows of n ---------------------------------------------- */

/* y = w * x / sqrt(mean(x^2) + eps); rstd[r] saved. */
void df_rmsnorm_forward(df_pool *pool, float *y, float *rstd, const float *x, const float *w,
                        int rows, int n, float eps);
/* dx (+)= ..., dw += sum_r dy * x * rstd. */
void df_rmsnorm_backward(df_pool *pool, float *dx, float *dw, const float *dy, const float *x,
                         const float *w, const float *rstd, int rows, int n, bool accumulate_dx);

/* ---- RoPE (rotate-half convention of Hugging Face) ------------------------ */

/* Rotate x [rows, heads, d] in place; row r uses position pos[r]; cos/sin are
 * [n_pos, rot/2] tables (already scaled by the YaRN attention factor). Only
 * the first `rot` dims of each head turn (partial_rotary_factor), in pairs
 * (i, i + rot/2); dims rot..d-1 pass through. rot == d: the whole head. */
void df_rope_forward(df_pool *pool, float *x, const int32_t *pos, const float *cos_t,
                     const float *sin_t, int rows, int heads, int d, int rot);
/* The transpose rotation, in place on the gradient. */
void df_rope_backward(df_pool *pool, float *dx, const int32_t *pos, const float *cos_t,
                      const float *sin_t, int rows, int heads, int d, int rot);

/* inv_freq [rot/2] and the attention factor for a config (plain or YaRN) whose
 * heads turn `rot` dims (Hugging Face computes both over that width). */
typedef struct dflash_drafter_config dflash_drafter_config;
void df_rope_inv_freq(const dflash_drafter_config *cfg, int rot, double *inv_freq,
                      double *attn_factor);

/* ---- DFlash attention ----------------------------------------------------- */

/*
 * Queries: T = n_blocks*B block rows of q [T, nh*d]. Keys/values: context
 * rows kc/vc [Sc, nkv*d] and block rows kb/vb [T, nkv*d]. Block n (anchor
 * anchors[n]) at offset j sees context s < anchor (and, when window > 0,
 * s >= anchor + j - (window-1)), and its own block's rows (all of them; when
 * window > 0 only j' <= j and j' >= j - (window-1)). Scale 1/sqrt(d).
 */
#define DF_MAX_HEAD_DIM 512 /* attention keeps per-tile gradients on the stack */

typedef struct df_attn_shape {
  int n_blocks, B, Sc, nh, nkv, d;
  int window; /* 0: full attention */
  const int32_t *anchors;
} df_attn_shape;

/* Floats of `work` the two functions below need. */
size_t df_attention_work(df_pool *pool, const df_attn_shape *s);
/* out [T, nh*d]; lse [T, nh] (log-sum-exp of the scaled scores). */
void df_attention_forward(df_pool *pool, const df_attn_shape *s, float *out, float *lse,
                          const float *q, const float *kc, const float *vc, const float *kb,
                          const float *vb, float *work);
/* dq, dkb, dvb, dkc, dvc are overwritten. */
void df_attention_backward(df_pool *pool, const df_attn_shape *s, float *dq, float *dkc, float *dvc,
                           float *dkb, float *dvb, float *work, const float *dout, const float *out,
                           const float *lse, const float *q, const float *kc, const float *vc,
                           const float *kb, const float *vb);

/* ---- SwiGLU --------------------------------------------------------------- */

/* m = silu(g) * u over n elements. */
void df_swiglu_forward(df_pool *pool, float *m, const float *g, const float *u, size_t n);
/* dg, du from dm. */
void df_swiglu_backward(df_pool *pool, float *dg, float *du, const float *dm, const float *g,
                        const float *u, size_t n);

/* ---- LM head + cross-entropy, chunked over the vocabulary ----------------- */

/*
 * For R rows x [R, H] with targets and coefficients coef[r]: loss_r =
 * logsumexp(x_r E^T) - x_r . E[target_r], never materialising more than
 * R x chunk logits; dx[r] = coef[r] * (softmax(x_r E^T) E - E[target_r]).
 * `scratch` holds df_lmhead_work() floats (8-byte aligned). loss[r] gets
 * the per-row CE.
 * dx may be NULL (forward only).
 */
void df_lmhead_ce(df_pool *pool, double *loss, float *dx, const float *x, const float *E,
                  const int32_t *target, const float *coef, int R, int H, int V, int chunk,
                  float *scratch);
/*
 * df_lmhead_ce that also keeps, in the same pass over each logits chunk
 * (so the LM head's logits GEMM runs once for both), the top_k (<= V)
 * logits of every row: top_ids / top_vals [R, top_k] in descending order,
 * ties to the smaller id (df_topk_insert). top_k 0 (or NULL outputs): none,
 * exactly df_lmhead_ce.
 */
void df_lmhead_ce_topk(df_pool *pool, double *loss, float *dx, const float *x, const float *E,
                       const int32_t *target, const float *coef, int R, int H, int V, int chunk,
                       float *scratch, int top_k, int32_t *top_ids, float *top_vals);
size_t df_lmhead_work(int R, int H, int chunk);
/*
 * df_lmhead_ce_topk in two halves, so that a caller can choose coef from the
 * row losses of the same pass (the adaptive weighting) without a second
 * LM-head pass: the pass leaves each row's running max, sum, target logit
 * and (with grad) the unweighted sum of softmax-weighted E rows in scratch;
 * the finish turns them into loss[r] (when loss is not NULL) and, with dx,
 * dx[r] = coef[r] * (softmax_r . E - E[target_r]). The finish may run more
 * than once on one pass (loss first, then dx with coef).
 */
void df_lmhead_ce_pass(df_pool *pool, bool grad, const float *x, const float *E,
                       const int32_t *target, int R, int H, int V, int chunk, float *scratch,
                       int top_k, int32_t *top_ids, float *top_vals);
void df_lmhead_ce_finish(df_pool *pool, double *loss, float *dx, const float *E,
                         const int32_t *target, const float *coef, int R, int H, int chunk,
                         float *scratch);
/* Offer token v with logit x to a top list of n (<= k) entries sorted by
 * logit, descending; an equal logit goes after those already there (so,
 * offered in id order, ties keep the smaller id). Returns the new count. */
int df_topk_insert(int32_t *ids, float *vals, int n, int k, int32_t v, float x);
/* Greedy prediction: argmax_v x_r . E[v] for each row (chunked). */
void df_lmhead_argmax(df_pool *pool, const float *x, const float *E, int32_t *out, int R, int H,
                      int V, int chunk, float *scratch);

/* ---- misc ----------------------------------------------------------------- */

/* Sum of squares of n floats in double, in a fixed order (parallel chunks
 * whose partial sums are added in chunk order). */
double df_sumsq(df_pool *pool, const float *x, size_t n);

#endif
