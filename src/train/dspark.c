/*
 * DSpark's heads and objective over supervised rows (dspark.h): the logits of a chunk of rows
 * by GEMM ([E | w2] against [x; e], the spec's fused form), the per-row softmax, CE, L1 and
 * BCE on the pool, then the gradients by GEMM again and the scatter into w1's rows in row
 * order.
 */
#include "dspark.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"

typedef struct chunk_ctx {
  const df_dspark_args *a;
  int r0;      /* first row of the chunk */
  float *z;    /* [n, V] logits in, d(logits) out (p between) */
  float *zt;   /* [n, V] the target's logits, or NULL; then sign(p - q) */
  float *e;    /* [n, r] Markov embeddings */
  double *row; /* [n, 5] CE, L1, BCE, d(conf logit), c* */
  bool backward;
} chunk_ctx;

static void rows_fn(void *v, size_t begin, size_t end, int worker) {
  (void)worker;
  const chunk_ctx *c = v;
  const df_dspark_args *a = c->a;
  int V = a->V, H = a->H;
  for (size_t i = begin; i < end; i++) {
    int gi = c->r0 + (int)i;
    float *z = c->z + i * (size_t)V;
    /* log-softmax in double: p_v = exp(z_v - lse) */
    double mx = -INFINITY, s = 0;
    for (int v = 0; v < V; v++) mx = fmax(mx, z[v]);
    for (int v = 0; v < V; v++) s += exp((double)z[v] - mx);
    double lse = mx + log(s);
    int tgt = a->target[gi];
    double ce = tgt >= 0 ? lse - z[tgt] : 0.0;
    double l1 = 0, ps = 0;  /* sum |p - q|, sum p sign(p - q) */
    double l1f = 0, qk = 0; /* pruned: sum |p - q'|, sum q' (q' over the full vocabulary) */
    double qlf = a->qlse ? a->qlse[gi] : 0;
    double qmx = -INFINITY, qs = 0;
    float *zt = c->zt ? c->zt + i * (size_t)V : NULL;
    if (zt) {
      for (int v = 0; v < V; v++) qmx = fmax(qmx, zt[v]);
      for (int v = 0; v < V; v++) qs += exp((double)zt[v] - qmx);
      double qlse = qmx + log(qs);
      /* p and sign(p - q) replace the two rows of logits for the backward (which then needs
       * no exp); the loss sums in double, so a small c* keeps its digits. */
      for (int v = 0; v < V; v++) {
        double p = exp((double)z[v] - lse), d = p - exp((double)zt[v] - qlse);
        if (a->qlse) {
          double qf = exp((double)zt[v] - qlf);
          l1f += fabs(p - qf), qk += qf;
        }
        float sg = d > 0 ? 1.0f : d < 0 ? -1.0f : 0.0f;
        z[v] = (float)p, zt[v] = sg;
        l1 += fabs(d);
        ps += p * sg;
      }
    }
    /* The confidence head: logit on [x; e], target c* detached. */
    double bce = 0, ds = 0, cstar = 0;
    if (a->cw && zt) {
      const float *x = a->x + (size_t)gi * H, *e = c->e + i * (size_t)a->r;
      double sl = a->cb;
      for (int k = 0; k < H; k++) sl += (double)a->cw[k] * x[k];
      for (int k = 0; k < a->r; k++) sl += (double)a->cw[H + k] * e[k];
      double acc = a->qlse ? 0.5 * (1.0 + qk - l1f) : 1.0 - 0.5 * l1;
      cstar = a->cstar_fix ? a->cstar_fix[gi] : fmin(1.0, fmax(0.0, acc));
      bce = fmax(sl, 0.0) + log1p(exp(-fabs(sl))) - cstar * sl;
      double sig = 1.0 / (1.0 + exp(-sl));
      ds = (double)a->coef[gi] * a->alpha_conf * (sig - cstar);
      if (a->conf) a->conf[gi] = (float)sig;
    }
    double *row = c->row + i * 5;
    row[0] = ce, row[1] = l1, row[2] = bce, row[3] = ds, row[4] = cstar;
    if (!c->backward) continue;
    /* d/dz: alpha_ce (p - onehot) + alpha_l1 p (sign(p - q) - sum p sign(p - q)) */
    double g = a->coef[gi];
    for (int v = 0; v < V; v++) {
      double p = zt ? (double)z[v] : exp((double)z[v] - lse), d = tgt >= 0 ? p - (v == tgt) : 0;
      double dz = a->alpha_ce * d;
      if (zt) dz += a->alpha_l1 * p * ((double)zt[v] - ps);
      z[v] = (float)(g * dz);
    }
  }
}

dflash_status df_dspark_loss(df_pool *pool, const df_dspark_args *a, df_dspark_sums *sums) {
  DF_CHECK_ARG(a && sums && a->x && a->E && a->w1 && a->w2 && a->prev && a->target && a->coef &&
               a->w);
  *sums = (df_dspark_sums){0};
  if (a->R <= 0) return DFLASH_OK;
  int V = a->V, H = a->H, r = a->r;
  if (V < 1 || H < 1 || r < 1) return df_error(DFLASH_E_INVALID_ARG, "DSpark loss: empty shape");
  int V1 = a->V1 > 0 ? a->V1 : V;
  for (int i = 0; i < a->R; i++)
    if (a->prev[i] < 0 || a->prev[i] >= V1 || a->target[i] < -1 || a->target[i] >= V)
      return df_error(DFLASH_E_RANGE,
                      "DSpark loss: row %d: previous token %d (of %d) or label %d (of %d, or "
                      "-1) is outside the vocabulary",
                      i, a->prev[i], V1, a->target[i], V);
  bool backward = a->dx || a->dw1 || a->dw2 || a->dcw || a->dcb;
  int cr = a->chunk_rows > 0 ? a->chunk_rows : 32;
  if (cr > a->R) cr = a->R;
  size_t zn = (size_t)cr * V;
  float *z = malloc(sizeof(float) * zn), *zt = a->xt ? malloc(sizeof(float) * zn) : NULL;
  float *e = malloc(sizeof(float) * (size_t)cr * r), *de = malloc(sizeof(float) * (size_t)cr * r);
  float *dxc = malloc(sizeof(float) * (size_t)cr * H);
  double *row = malloc(sizeof(double) * (size_t)cr * 5);
  if (!z || (a->xt && !zt) || !e || !de || !dxc || !row) {
    free(z), free(zt), free(e), free(de), free(dxc), free(row);
    return df_error_nomem("DSpark loss scratch");
  }
  for (int r0 = 0; r0 < a->R; r0 += cr) {
    int n = a->R - r0 < cr ? a->R - r0 : cr;
    for (int i = 0; i < n; i++)
      memcpy(e + (size_t)i * r, a->w1 + (size_t)a->prev[r0 + i] * r, sizeof(float) * r);
    /* z = x E^T + e w2^T: the LM head's logits plus the Markov bias */
    df_matmul_forward(pool, z, a->x + (size_t)r0 * H, a->E, n, V, H, false);
    df_matmul_forward(pool, z, e, a->w2, n, V, r, true);
    if (zt) df_matmul_forward(pool, zt, a->xt + (size_t)r0 * H, a->E, n, V, H, false);
    chunk_ctx c = {a, r0, z, zt, e, row, backward};
    df_pool_for(pool, (size_t)n, 1, rows_fn, &c);
    for (int i = 0; i < n; i++) {
      int gi = r0 + i;
      const double *rw = row + (size_t)i * 5;
      sums->ce += a->w[gi] * rw[0], sums->l1 += a->w[gi] * rw[1], sums->bce += a->w[gi] * rw[2];
      if (a->ce) a->ce[gi] = rw[0];
      if (a->l1) a->l1[gi] = rw[1];
      if (a->bce) a->bce[gi] = rw[2];
      if (a->cstar) a->cstar[gi] = (float)rw[4];
    }
    if (!backward) continue;
    /* z now holds d(logits): into x through E, into e and w2 through the Markov bias. */
    df_matmul_backward(pool, dxc, NULL, z, NULL, a->E, n, V, H, false);
    df_matmul_backward(pool, de, a->dw2, z, e, a->w2, n, V, r, false);
    for (int i = 0; i < n; i++) {
      int gi = r0 + i;
      float ds = (float)row[(size_t)i * 5 + 3];
      float *dx = dxc + (size_t)i * H, *dei = de + (size_t)i * r;
      const float *ei = e + (size_t)i * r, *x = a->x + (size_t)gi * H;
      if (a->cw && ds != 0) {
        for (int k = 0; k < H; k++) dx[k] += ds * a->cw[k];
        for (int k = 0; k < r; k++) dei[k] += ds * a->cw[H + k];
        if (a->dcw) {
          for (int k = 0; k < H; k++) a->dcw[k] += ds * x[k];
          for (int k = 0; k < r; k++) a->dcw[H + k] += ds * ei[k];
        }
        if (a->dcb) a->dcb[0] += ds;
      }
      if (a->dx) memcpy(a->dx + (size_t)gi * H, dx, sizeof(float) * H);
      /* The sparse gradient of w1: row prev_i, in row order. */
      if (a->dw1) {
        float *d1 = a->dw1 + (size_t)a->prev[gi] * r;
        for (int k = 0; k < r; k++) d1[k] += dei[k];
      }
    }
  }
  free(z), free(zt), free(e), free(de), free(dxc), free(row);
  return DFLASH_OK;
}

/* Slot k's weight, or 0 where the prefix mask has ended the block (df_dspark_rows' rule). */
static double slot_weight(double gamma, const uint8_t *loss_mask, int64_t len, int64_t p, int k) {
  if (p >= len || !loss_mask[p]) return 0;
  return gamma > 0 ? exp(-(double)k / gamma) : 1.0;
}

double df_dspark_weight_sum(int B, double gamma, const uint8_t *loss_mask, int64_t len,
                            const int32_t *anchors, int32_t n_anchors) {
  double s = 0;
  for (int32_t n = 0; n < n_anchors; n++)
    for (int k = 0; k < B; k++) {
      double wk = slot_weight(gamma, loss_mask, len, (int64_t)anchors[n] + k + 1, k);
      if (wk == 0) break;
      s += wk;
    }
  return s;
}

int df_dspark_rows(int B, double gamma, const int32_t *ids, const int32_t *labels,
                   const uint8_t *loss_mask, int64_t len, const int32_t *anchors, int32_t n_anchors,
                   double grad_scale, int32_t *rows_t, int32_t *rows_target, int32_t *rows_prev,
                   double *w, float *coef) {
  int R = 0;
  for (int32_t n = 0; n < n_anchors; n++)
    for (int k = 0; k < B; k++) {
      int64_t p = (int64_t)anchors[n] + k + 1;
      /* the prefix mask: past the first slot it drops, the block drafts nothing more */
      double wk = slot_weight(gamma, loss_mask, len, p, k);
      if (wk == 0) break;
      if (rows_t) rows_t[R] = n * B + k;
      if (rows_target) rows_target[R] = labels ? labels[p] : ids[p];
      if (rows_prev) rows_prev[R] = k == 0 || !labels ? ids[p - 1] : labels[p - 1];
      if (w) w[R] = wk;
      if (coef) coef[R] = (float)(wk * grad_scale);
      R++;
    }
  return R;
}
