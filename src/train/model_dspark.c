/* DSpark's parts of the CPU drafter (model.h): the loss over the anchor-first rows model.c
 * lays out, through dspark.c's heads, and the greedy drafts chained through the Markov head.
 * The backbone, rows and backward are model.c's. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "dflash2.h"
#include "dspark.h"
#include "model.h"

/* The target's final state, finite (it sets the L1 term and the confidence target). */
dflash_status df_model_check_final(const df_model *m, const float *final, int64_t len) {
  size_t n = final ? (size_t)len * (size_t)m->H : 0;
  for (size_t i = 0; i < n; i++)
    if (!isfinite(final[i]))
      return df_error(DFLASH_E_FORMAT, "the target's final hidden state at position %zu is %s",
                      i / (size_t)m->H, isnan(final[i]) ? "NaN" : "Inf");
  return DFLASH_OK;
}

/* The target's logsumexp over the full vocabulary of each of the n rows x [n, H] (through
 * lm_head_full, 32 rows a pass), into a new *out [n]. */
static dflash_status full_lse(const df_model *m, const float *x, int n, double **out) {
  int cr = n < 32 ? n : 32, V = m->V;
  float *z = malloc(sizeof(float) * (size_t)cr * V);
  double *lse = malloc(sizeof(double) * (size_t)n);
  if (!z || !lse) {
    free(z), free(lse);
    return df_error_nomem("DSpark full-vocabulary logsumexp");
  }
  for (int r0 = 0; r0 < n; r0 += cr) {
    int k = n - r0 < cr ? n - r0 : cr;
    df_matmul_forward(m->pool, z, x + (size_t)r0 * m->H, m->lm_head_full, k, V, m->H, false);
    for (int i = 0; i < k; i++) {
      const float *zi = z + (size_t)i * V;
      double mx = -INFINITY, s = 0;
      for (int v = 0; v < V; v++) mx = fmax(mx, zi[v]);
      for (int v = 0; v < V; v++) s += exp((double)zi[v] - mx);
      lse[r0 + i] = mx + log(s);
    }
  }
  free(z);
  *out = lse;
  return DFLASH_OK;
}

/* DSpark's loss over the rows prepare laid out (df_dspark_rows): the drafter's final-norm
 * rows and, with `final`, the target's state at the position before each label (q_k is the
 * target's distribution of x_{a+k+1}, read at a + k), into df_dspark_loss; its d(rows) go
 * back through model_backward like the block CE's. */
dflash_status df_model_dspark_loss(df_model *m, const float *final, const int32_t *anchors,
                                   double grad_scale, bool backward, double *lsum, double *wsum) {
  df_acts *a = &m->a;
  size_t H = (size_t)m->H;
  for (int r = 0; r < m->R; r++) {
    int t = a->rows_t[r];
    memcpy(a->rows_x + r * H, a->hf + (size_t)t * H, sizeof(float) * H);
    if (final)
      memcpy(a->rows_xt + r * H, final + (size_t)(anchors[t / m->B] + t % m->B) * H,
             sizeof(float) * H);
    a->coef[r] = (float)(a->rows_w[r] * grad_scale);
    *wsum += a->rows_w[r];
  }
  /* A pruned draft vocabulary: labels map through t2d (-1: outside it, no CE on the row), and
   * c* takes the target's distribution over the full vocabulary (its logsumexp per row). */
  int32_t *tgt = a->rows_target;
  double *qlse = NULL;
  if (m->t2d && m->R > 0) {
    tgt = malloc(sizeof(int32_t) * (size_t)m->R);
    if (!tgt) return df_error_nomem("DSpark draft labels");
    for (int r = 0; r < m->R; r++) tgt[r] = m->t2d[a->rows_target[r]];
    if (final && m->ext.confidence_head) { /* only c* reads it */
      dflash_status st = full_lse(m, a->rows_xt, m->R, &qlse);
      if (st) {
        free(tgt);
        return st;
      }
    }
  }
  bool conf = m->ext.confidence_head != 0;
  df_dspark_args d = {.x = a->rows_x,
                      .xt = final ? a->rows_xt : NULL,
                      .E = m->lm_head,
                      .w1 = m->w.markov_w1,
                      .w2 = m->w.markov_w2,
                      .cw = conf ? m->w.conf_w : NULL,
                      .cb = conf ? m->w.conf_b[0] : 0.0f,
                      .prev = a->rows_prev,
                      .target = tgt,
                      .V1 = m->V,
                      .qlse = qlse,
                      .coef = a->coef,
                      .w = a->rows_w,
                      .R = m->R,
                      .H = m->H,
                      .V = m->Vd,
                      .r = m->ext.markov_rank,
                      .alpha_ce = DF_DSPARK_ALPHA_CE,
                      .alpha_l1 = DF_DSPARK_ALPHA_L1,
                      .alpha_conf = DF_DSPARK_ALPHA_CONF};
  if (backward) {
    d.dx = a->rows_dx, d.dw1 = m->g.markov_w1, d.dw2 = m->g.markov_w2;
    if (conf) d.dcw = m->g.conf_w, d.dcb = m->g.conf_b;
  }
  df_dspark_sums sums;
  dflash_status st = df_dspark_loss(m->pool, &d, &sums);
  *lsum += d.alpha_ce * sums.ce + d.alpha_l1 * sums.l1 + d.alpha_conf * sums.bce;
  if (tgt != a->rows_target) free(tgt);
  free(qlse);
  return st;
}

/* 1 - L1/2 of draft row z [Vd] (its softmax p, zero outside a pruned drafter's kept ids)
 * against the target's distribution q = exp(zt - qlse), zt [V] over the full vocabulary:
 * sum_v min(p_v, q_v), the probability that rejection sampling accepts a draw from p. */
static double accept_prob(const df_model *m, const float *z, const float *zt, double qlse) {
  int Vd = m->Vd;
  double mx = -INFINITY, s = 0;
  for (int i = 0; i < Vd; i++) mx = fmax(mx, z[i]);
  for (int i = 0; i < Vd; i++) s += exp((double)z[i] - mx);
  double lse = mx + log(s), l1 = 0, qkept = 0;
  for (int i = 0; i < Vd; i++) {
    double q = exp((double)zt[m->kept ? m->kept[i] : i] - qlse);
    l1 += fabs(exp((double)z[i] - lse) - q);
    qkept += q;
  }
  l1 += fmax(0.0, 1.0 - qkept); /* the target's mass outside the kept ids, where p is 0 */
  return 1.0 - 0.5 * l1;
}

/* The probabilistic tau of each block into ptau [n_anchors] (df_model_dspark_chain's, after
 * the forward): zb [n_anchors, B, Vd] the backbone's logits. The target's logits of every
 * position the blocks read (anchors[0]..: the walk's consecutive anchors, so a few more rows
 * than anchors) in one product through the full head, then per slot the Markov bias on the
 * data's token x_{a+k} (teacher forcing) for all B slots of a block in one product. */
static dflash_status dspark_prob_tau(df_model *m, const int32_t *ids, int64_t len,
                                     const float *final, const int32_t *anchors, int32_t n_anchors,
                                     const float *zb, double *ptau) {
  int B = m->B, Vd = m->Vd, V = m->V, r = m->ext.markov_rank, H = m->H;
  int64_t lo = INT64_MAX, hi = -1; /* rows a + k with a + k + 1 < len */
  for (int32_t n = 0; n < n_anchors; n++) {
    int64_t a = anchors[n], top = a + B - 1 < len - 2 ? a + B - 1 : len - 2;
    if (top >= a) lo = a < lo ? a : lo, hi = top > hi ? top : hi;
  }
  size_t span = hi >= lo ? (size_t)(hi - lo + 1) : 0;
  const float *head = m->lm_head_full ? m->lm_head_full : m->lm_head;
  float *zt = malloc(sizeof(float) * (span ? span : 1) * (size_t)V);
  double *qlse = malloc(sizeof(double) * (span ? span : 1));
  float *e = malloc(sizeof(float) * (size_t)B * r), *z = malloc(sizeof(float) * (size_t)B * Vd);
  if (!zt || !qlse || !e || !z) {
    free(zt), free(qlse), free(e), free(z);
    return df_error_nomem("DSpark probabilistic tau");
  }
  if (span) df_matmul_forward(m->pool, zt, final + (size_t)lo * H, head, (int)span, V, H, false);
  for (size_t i = 0; i < span; i++) {
    const float *row = zt + i * (size_t)V;
    double mx = -INFINITY, sum = 0;
    for (int v = 0; v < V; v++) mx = fmax(mx, row[v]);
    for (int v = 0; v < V; v++) sum += exp((double)row[v] - mx);
    qlse[i] = mx + log(sum);
  }
  for (int32_t n = 0; n < n_anchors; n++) {
    int64_t a = anchors[n];
    int K = 0; /* the slots inside the sequence */
    while (K < B && a + K + 1 < len) K++;
    for (int k = 0; k < K; k++)
      memcpy(e + (size_t)k * r, m->w.markov_w1 + (size_t)ids[a + k] * r, sizeof(float) * r);
    memcpy(z, zb + (size_t)n * B * Vd, sizeof(float) * (size_t)K * Vd);
    if (K) df_matmul_forward(m->pool, z, e, m->w.markov_w2, K, Vd, r, true);
    double tau = 1, run = 1;
    for (int k = 0; k < K; k++) {
      size_t row = (size_t)(a + k - lo);
      run *= accept_prob(m, z + (size_t)k * Vd, zt + row * (size_t)V, qlse[row]);
      tau += run;
    }
    ptau[n] = tau;
  }
  free(zt), free(qlse), free(e), free(z);
  return DFLASH_OK;
}

/* DSpark's greedy drafts, as llama.cpp, vLLM and SGLang draft at T = 0 (spec/dspark.md
 * sections 1 and 6): one backbone pass gives every slot's logits; the Markov bias of slot k
 * needs the token drafted at slot k - 1 (the anchor's for slot 0), so the B slots are chosen
 * one after another, d_k = argmax(LM(norm(h_k)) + W2 W1[d_{k-1}]), B drafts a block. A
 * pruned drafter picks among its V_d rows and maps the pick to its target id. With `conf`
 * [n_anchors, B] (a drafter with the confidence head), slot k's sigmoid(w . [norm(h_k);
 * W1[d_{k-1}]] + b), what an engine's cut-off reads; with `final` and `ptau` [n_anchors],
 * the probabilistic tau of each block (spec/dspark.md section 6), teacher-forced:
 * 1 + sum_k prod_{j <= k} accept_prob(z_j with prev = ids[a + j], q_j from final[a + j])
 * over the slots k with a + k + 1 < len. */
dflash_status df_model_dspark_chain(df_model *m, const int32_t *ids, int64_t len,
                                    const float *final, const int32_t *anchors, int32_t n_anchors,
                                    int32_t *pred, float *conf, double *ptau) {
  /* Slot k of every anchor of a group in one product with W2 [V_d, r]: the chain is
   * sequential in k only, and one pass over W2 (50 MB at V 49,152, r 256) per group and slot
   * rather than per anchor and slot is what makes the walk's many blocks affordable. */
  enum { GROUP = 16 };
  int B = m->B, V = m->Vd, r = m->ext.markov_rank, H = m->H;
  bool want_conf = conf && m->ext.confidence_head && m->w.conf_w;
  bool want_tau = ptau && final;
  int G = n_anchors < GROUP ? (n_anchors > 0 ? n_anchors : 1) : GROUP;
  /* the backbone's logits of every block (they do not depend on the previous token) */
  size_t nb = want_tau ? (size_t)n_anchors : (size_t)G;
  float *zb = malloc(sizeof(float) * (nb ? nb : 1) * (size_t)B * V);
  float *z = malloc(sizeof(float) * (size_t)G * V), *e = malloc(sizeof(float) * (size_t)G * r);
  int32_t *prev = malloc(sizeof(int32_t) * (size_t)G);
  if (!zb || !z || !e || !prev) {
    free(zb), free(z), free(e), free(prev);
    return df_error_nomem("DSpark draft logits");
  }
  dflash_status st = DFLASH_OK;
  for (int32_t g0 = 0; g0 < n_anchors; g0 += G) {
    int gn = n_anchors - g0 < G ? n_anchors - g0 : G;
    const float *hf = m->a.hf + (size_t)g0 * B * H;
    float *zg = zb + (want_tau ? (size_t)g0 * B * V : 0);
    df_matmul_forward(m->pool, zg, hf, m->lm_head, gn * B, V, H, false);
    for (int i = 0; i < gn; i++) prev[i] = ids[anchors[g0 + i]];
    for (int k = 0; k < B; k++) {
      for (int i = 0; i < gn; i++) {
        const float *ei = m->w.markov_w1 + (size_t)prev[i] * r;
        memcpy(e + (size_t)i * r, ei, sizeof(float) * r);
        memcpy(z + (size_t)i * V, zg + ((size_t)i * B + k) * V, sizeof(float) * (size_t)V);
        if (want_conf) {
          const float *x = hf + ((size_t)i * B + k) * H, *cw = m->w.conf_w;
          double s = m->w.conf_b[0];
          for (int j = 0; j < H; j++) s += (double)cw[j] * x[j];
          for (int j = 0; j < r; j++) s += (double)cw[H + j] * ei[j];
          conf[(size_t)(g0 + i) * B + k] = (float)(1.0 / (1.0 + exp(-s)));
        }
      }
      df_matmul_forward(m->pool, z, e, m->w.markov_w2, gn, V, r, true);
      /* picked in the draft vocabulary, mapped to a target id (i + d2t[i]) for the next
       * Markov step and the output */
      for (int i = 0; i < gn; i++) {
        int32_t d = df2_argmax(z + (size_t)i * V, V);
        prev[i] = pred[(size_t)(g0 + i) * B + k] = m->kept ? m->kept[d] : d;
      }
    }
  }
  if (want_tau) st = dspark_prob_tau(m, ids, len, final, anchors, n_anchors, zb, ptau);
  free(zb), free(z), free(e), free(prev);
  return st;
}
