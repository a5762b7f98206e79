/*
 * Plain reference versions of the CPU trainer's ops (src/train/ops.h,
 * dflash2.h), for tests only, in the style of llm.c's train_gpt2.c: one
 * short loop nest per op, no BLAS, no threads, no blocking or chunking, the
 * maths written out. Sums are accumulated in double so the reference is the
 * more accurate side. Same argument order and conventions as the tuned op
 * (row-major; parameter gradients accumulate, input gradients overwrite
 * unless the tuned op's flag says accumulate).
 */
#ifndef DFLASH_TESTS_REF_OPS_H
#define DFLASH_TESTS_REF_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "train/ops.h"

void ref_matmul_forward(float *y, const float *x, const float *w, int M, int N, int K,
                        bool accumulate);
void ref_matmul_backward(float *dx, float *dw, const float *dy, const float *x, const float *w,
                         int M, int N, int K, bool accumulate_dx);

void ref_rmsnorm_forward(float *y, float *rstd, const float *x, const float *w, int rows, int n,
                         float eps);
void ref_rmsnorm_backward(float *dx, float *dw, const float *dy, const float *x, const float *w,
                          const float *rstd, int rows, int n, bool accumulate_dx);

void ref_rope_forward(float *x, const int32_t *pos, const float *cos_t, const float *sin_t,
                      int rows, int heads, int d, int rot);
void ref_rope_backward(float *dx, const int32_t *pos, const float *cos_t, const float *sin_t,
                       int rows, int heads, int d, int rot);

void ref_attention_forward(const df_attn_shape *s, float *out, float *lse, const float *q,
                           const float *kc, const float *vc, const float *kb, const float *vb);
void ref_attention_backward(const df_attn_shape *s, float *dq, float *dkc, float *dvc, float *dkb,
                            float *dvb, const float *dout, const float *q, const float *kc,
                            const float *vc, const float *kb, const float *vb);

void ref_swiglu_forward(float *m, const float *g, const float *u, size_t n);
void ref_swiglu_backward(float *dg, float *du, const float *dm, const float *g, const float *u,
                         size_t n);

/* loss[r], dx (may be NULL) and, with top_k > 0, the top_k ids / logits. */
void ref_lmhead_ce(double *loss, float *dx, const float *x, const float *E, const int32_t *target,
                   const float *coef, int R, int H, int V, int top_k, int32_t *top_ids,
                   float *top_vals);
void ref_lmhead_argmax(const float *x, const float *E, int32_t *out, int R, int H, int V);
/* The top k of n values (descending, ties to the smaller index), by selection. */
void ref_topk(const float *vals, int n, int k, int32_t *ids, float *top);

double ref_sumsq(const float *x, size_t n);

void ref_conv_apply(float *out, const float *x, const float *dyn, size_t dyn_stride,
                    const float *base, const float *residual, int T, int B, int H, int k, int g);
void ref_conv_backward(float *dx, float *ddyn, float *dbase, const float *dout, const float *x,
                       const float *dyn, size_t dyn_stride, const float *base, int T, int B, int H,
                       int k, int g);

/* df2_selector_loss's maths: candidates are the top K of the full logits. */
typedef struct df2_sel_args df2_sel_args;
void ref_selector_loss(const df2_sel_args *s, double *loss, double *hits);

#endif
