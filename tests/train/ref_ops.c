/* Plain references of the trainer's CPU ops (ref_ops.h). */
#include "ref_ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "train/dflash2.h"

/* ---- matmul: y = x w^T ---------------------------------------------------- */

/* y[m,n] = sum_k x[m,k] w[n,k] (+ y[m,n]). */
void ref_matmul_forward(float *y, const float *x, const float *w, int M, int N, int K,
                        bool accumulate) {
  for (int m = 0; m < M; m++)
    for (int n = 0; n < N; n++) {
      double s = accumulate ? y[(size_t)m * N + n] : 0.0;
      for (int k = 0; k < K; k++) s += (double)x[(size_t)m * K + k] * w[(size_t)n * K + k];
      y[(size_t)m * N + n] = (float)s;
    }
}

/* dx[m,k] (+)= sum_n dy[m,n] w[n,k];  dw[n,k] += sum_m dy[m,n] x[m,k]. */
void ref_matmul_backward(float *dx, float *dw, const float *dy, const float *x, const float *w,
                         int M, int N, int K, bool accumulate_dx) {
  for (int m = 0; dx && m < M; m++)
    for (int k = 0; k < K; k++) {
      double s = accumulate_dx ? dx[(size_t)m * K + k] : 0.0;
      for (int n = 0; n < N; n++) s += (double)dy[(size_t)m * N + n] * w[(size_t)n * K + k];
      dx[(size_t)m * K + k] = (float)s;
    }
  for (int n = 0; dw && n < N; n++)
    for (int k = 0; k < K; k++) {
      double s = dw[(size_t)n * K + k];
      for (int m = 0; m < M; m++) s += (double)dy[(size_t)m * N + n] * x[(size_t)m * K + k];
      dw[(size_t)n * K + k] = (float)s;
    }
}

/* ---- RMSNorm -------------------------------------------------------------- */

/* rstd = 1/sqrt(mean(x^2) + eps); y = w * x * rstd. */
void ref_rmsnorm_forward(float *y, float *rstd, const float *x, const float *w, int rows, int n,
                         float eps) {
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * n;
    double ss = 0;
    for (int i = 0; i < n; i++) ss += (double)xr[i] * xr[i];
    rstd[r] = (float)(1.0 / sqrt(ss / n + eps));
    for (int i = 0; i < n; i++) y[(size_t)r * n + i] = (float)((double)w[i] * xr[i] * rstd[r]);
  }
}

/* With u = w*dy: dx_i = rstd u_i - rstd^3 x_i (sum_j u_j x_j) / n (the
 * derivative of rstd); dw_i += sum_r dy_i x_i rstd. */
void ref_rmsnorm_backward(float *dx, float *dw, const float *dy, const float *x, const float *w,
                          const float *rstd, int rows, int n, bool accumulate_dx) {
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * n, *dyr = dy + (size_t)r * n;
    double rs = rstd[r], ux = 0;
    for (int i = 0; i < n; i++) ux += (double)w[i] * dyr[i] * xr[i];
    for (int i = 0; dx && i < n; i++) {
      double v = rs * w[i] * dyr[i] - rs * rs * rs * xr[i] * ux / n;
      float *d = dx + (size_t)r * n + i;
      *d = (float)(accumulate_dx ? *d + v : v);
    }
  }
  for (int i = 0; dw && i < n; i++) {
    double s = dw[i];
    for (int r = 0; r < rows; r++)
      s += (double)dy[(size_t)r * n + i] * x[(size_t)r * n + i] * rstd[r];
    dw[i] = (float)s;
  }
}

/* ---- RoPE: rotate pairs (i, i + rot/2) by angle pos * freq_i --------------- */

static void rope_rotate(float *x, const int32_t *pos, const float *cos_t, const float *sin_t,
                        int rows, int heads, int d, int rot, double sign) {
  int half = rot / 2;
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < heads; h++)
      for (int i = 0; i < half; i++) {
        float *v = x + ((size_t)r * heads + h) * d;
        double c = cos_t[(size_t)pos[r] * half + i], s = sign * sin_t[(size_t)pos[r] * half + i];
        double a = v[i], b = v[i + half];
        v[i] = (float)(a * c - b * s);
        v[i + half] = (float)(b * c + a * s);
      }
}

/* [x1; x2] -> [x1 c - x2 s; x2 c + x1 s]. */
void ref_rope_forward(float *x, const int32_t *pos, const float *cos_t, const float *sin_t,
                      int rows, int heads, int d, int rot) {
  rope_rotate(x, pos, cos_t, sin_t, rows, heads, d, rot, 1.0);
}

/* The rotation is orthogonal: its backward is the rotation by -angle. */
void ref_rope_backward(float *dx, const int32_t *pos, const float *cos_t, const float *sin_t,
                       int rows, int heads, int d, int rot) {
  rope_rotate(dx, pos, cos_t, sin_t, rows, heads, d, rot, -1.0);
}

/* ---- DFlash attention ----------------------------------------------------- */

/* Whether query (block n, offset j) sees context row p / block row jp
 * (ops.h's mask, written as a predicate). */
static bool sees_context(const df_attn_shape *s, int n, int j, int p) {
  int a = s->anchors[n];
  return p < a && p < s->Sc && (s->window <= 0 || p >= a + j - (s->window - 1));
}
static bool sees_block(const df_attn_shape *s, int j, int jp) {
  return s->window <= 0 || (jp <= j && jp >= j - (s->window - 1));
}

/* Key/value row p (< Sc: context, else block row p - Sc) of kv head g. */
static const float *kv_row(const df_attn_shape *s, const float *ctx, const float *blk, int n, int p,
                           int g) {
  if (p < s->Sc) return ctx + ((size_t)p * s->nkv + g) * s->d;
  return blk + (((size_t)n * s->B + (p - s->Sc)) * s->nkv + g) * s->d;
}
static bool sees(const df_attn_shape *s, int n, int j, int p) {
  return p < s->Sc ? sees_context(s, n, j, p) : sees_block(s, j, p - s->Sc);
}

/* The probabilities P[p] = softmax(q.k_p / sqrt(d)) over the visible keys
 * p of the Sc + B candidates (0 elsewhere); returns the log-sum-exp. */
static double attn_probs(const df_attn_shape *s, int n, int j, int h, const float *q,
                         const float *kc, const float *kb, double *P) {
  int g = h / (s->nh / s->nkv), L = s->Sc + s->B;
  const float *qr = q + (((size_t)n * s->B + j) * s->nh + h) * s->d;
  double mx = -INFINITY, z = 0;
  for (int p = 0; p < L; p++) {
    P[p] = -INFINITY;
    if (!sees(s, n, j, p)) continue;
    const float *k = kv_row(s, kc, kb, n, p, g);
    double dot = 0;
    for (int i = 0; i < s->d; i++) dot += (double)qr[i] * k[i];
    P[p] = dot / sqrt((double)s->d);
    mx = P[p] > mx ? P[p] : mx;
  }
  for (int p = 0; p < L; p++) z += P[p] == -INFINITY ? 0 : exp(P[p] - mx);
  for (int p = 0; p < L; p++) P[p] = P[p] == -INFINITY ? 0 : exp(P[p] - mx) / z;
  return mx + log(z);
}

/* out = sum_p P[p] v_p, lse per (row, head). */
void ref_attention_forward(const df_attn_shape *s, float *out, float *lse, const float *q,
                           const float *kc, const float *vc, const float *kb, const float *vb) {
  double *P = malloc(sizeof(double) * (size_t)(s->Sc + s->B));
  for (int n = 0; n < s->n_blocks; n++)
    for (int j = 0; j < s->B; j++)
      for (int h = 0; h < s->nh; h++) {
        size_t th = ((size_t)n * s->B + j) * s->nh + h;
        lse[th] = (float)attn_probs(s, n, j, h, q, kc, kb, P);
        for (int i = 0; i < s->d; i++) {
          double o = 0;
          for (int p = 0; p < s->Sc + s->B; p++)
            if (P[p] > 0) o += P[p] * kv_row(s, vc, vb, n, p, h / (s->nh / s->nkv))[i];
          out[th * s->d + i] = (float)o;
        }
      }
  free(P);
}

static float *kv_grad(const df_attn_shape *s, float *ctx, float *blk, int n, int p, int g) {
  return (float *)kv_row(s, ctx, blk, n, p, g);
}

/* dP_p = dout . v_p; dS_p = P_p (dP_p - sum_p' P_p' dP_p'); dq = sum dS_p k_p
 * / sqrt(d); dk_p += dS_p q / sqrt(d); dv_p += P_p dout. */
void ref_attention_backward(const df_attn_shape *s, float *dq, float *dkc, float *dvc, float *dkb,
                            float *dvb, const float *dout, const float *q, const float *kc,
                            const float *vc, const float *kb, const float *vb) {
  int L = s->Sc + s->B, d = s->d;
  size_t T = (size_t)s->n_blocks * s->B, nc = (size_t)s->Sc * s->nkv * d;
  memset(dq, 0, sizeof(float) * T * s->nh * d);
  memset(dkc, 0, sizeof(float) * nc), memset(dvc, 0, sizeof(float) * nc);
  memset(dkb, 0, sizeof(float) * T * s->nkv * d), memset(dvb, 0, sizeof(float) * T * s->nkv * d);
  double *P = malloc(sizeof(double) * (size_t)L), *dP = malloc(sizeof(double) * (size_t)L);
  double scale = 1.0 / sqrt((double)d);
  for (int n = 0; n < s->n_blocks; n++)
    for (int j = 0; j < s->B; j++)
      for (int h = 0; h < s->nh; h++) {
        int g = h / (s->nh / s->nkv);
        size_t th = ((size_t)n * s->B + j) * s->nh + h;
        const float *dO = dout + th * d, *qr = q + th * d;
        attn_probs(s, n, j, h, q, kc, kb, P);
        double D = 0;
        for (int p = 0; p < L; p++) {
          dP[p] = 0;
          for (int i = 0; P[p] > 0 && i < d; i++)
            dP[p] += (double)dO[i] * kv_row(s, vc, vb, n, p, g)[i];
          D += P[p] * dP[p];
        }
        for (int p = 0; p < L; p++) {
          if (P[p] == 0) continue;
          double dS = P[p] * (dP[p] - D) * scale;
          const float *k = kv_row(s, kc, kb, n, p, g);
          float *dk = kv_grad(s, dkc, dkb, n, p, g), *dv = kv_grad(s, dvc, dvb, n, p, g);
          for (int i = 0; i < d; i++) {
            dq[th * d + i] += (float)(dS * k[i]);
            dk[i] += (float)(dS * qr[i]);
            dv[i] += (float)(P[p] * dO[i]);
          }
        }
      }
  free(P), free(dP);
}

/* ---- SwiGLU: m = silu(g) u, silu(g) = g sigmoid(g) ------------------------- */

void ref_swiglu_forward(float *m, const float *g, const float *u, size_t n) {
  for (size_t i = 0; i < n; i++) m[i] = (float)(g[i] / (1.0 + exp(-(double)g[i])) * u[i]);
}

/* du = dm silu(g); dg = dm u sigmoid(g) (1 + g (1 - sigmoid(g))). */
void ref_swiglu_backward(float *dg, float *du, const float *dm, const float *g, const float *u,
                         size_t n) {
  for (size_t i = 0; i < n; i++) {
    double sig = 1.0 / (1.0 + exp(-(double)g[i]));
    du[i] = (float)(dm[i] * g[i] * sig);
    dg[i] = (float)(dm[i] * u[i] * sig * (1.0 + g[i] * (1.0 - sig)));
  }
}

/* ---- LM head + cross-entropy over all V logits at once -------------------- */

/* Top k by repeated selection of the largest not yet taken (the first on ties). */
void ref_topk(const float *vals, int n, int k, int32_t *ids, float *top) {
  bool *taken = calloc((size_t)n, 1);
  for (int c = 0; c < k; c++) {
    int best = -1;
    for (int v = 0; v < n; v++)
      if (!taken[v] && (best < 0 || vals[v] > vals[best])) best = v;
    taken[best] = true, ids[c] = best, top[c] = vals[best];
  }
  free(taken);
}

/* l = E x_r; loss_r = logsumexp(l) - l[target]; dx = coef (softmax(l) E - E[target]). */
void ref_lmhead_ce(double *loss, float *dx, const float *x, const float *E, const int32_t *target,
                   const float *coef, int R, int H, int V, int top_k, int32_t *top_ids,
                   float *top_vals) {
  double *l = malloc(sizeof(double) * (size_t)V);
  float *lf = malloc(sizeof(float) * (size_t)V);
  for (int r = 0; r < R; r++) {
    const float *xr = x + (size_t)r * H;
    double mx = -INFINITY, z = 0;
    for (int v = 0; v < V; v++) {
      l[v] = 0;
      for (int i = 0; i < H; i++) l[v] += (double)xr[i] * E[(size_t)v * H + i];
      lf[v] = (float)l[v], mx = l[v] > mx ? l[v] : mx;
    }
    for (int v = 0; v < V; v++) z += exp(l[v] - mx);
    loss[r] = mx + log(z) - l[target[r]];
    if (top_k > 0)
      ref_topk(lf, V, top_k, top_ids + (size_t)r * top_k, top_vals + (size_t)r * top_k);
    for (int i = 0; dx && i < H; i++) {
      double g = -(double)E[(size_t)target[r] * H + i];
      for (int v = 0; v < V; v++) g += exp(l[v] - mx) / z * E[(size_t)v * H + i];
      dx[(size_t)r * H + i] = (float)(coef[r] * g);
    }
  }
  free(l), free(lf);
}

/* out[r] = the first v with the largest x_r . E[v]. */
void ref_lmhead_argmax(const float *x, const float *E, int32_t *out, int R, int H, int V) {
  float *l = malloc(sizeof(float) * (size_t)V), top;
  for (int r = 0; r < R; r++) {
    for (int v = 0; v < V; v++) {
      double s = 0;
      for (int i = 0; i < H; i++) s += (double)x[(size_t)r * H + i] * E[(size_t)v * H + i];
      l[v] = (float)s;
    }
    ref_topk(l, V, 1, &out[r], &top);
  }
  free(l);
}

double ref_sumsq(const float *x, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
  return s;
}

/* ---- DFlash 2 grouped dynamic causal convolution -------------------------- */

/* The weight of tap o on channel c at row t: base[o, c] + dyn[t, o, c / g]. */
static double tap(const float *dyn, size_t dyn_stride, const float *base, int t, int o, int c,
                  int H, int g) {
  return (double)base[(size_t)o * H + c] +
         dyn[(size_t)t * dyn_stride + (size_t)o * (H / g) + c / g];
}

/* out[t, c] = residual[t, c] + sum_{o < k, o <= t mod B} tap(t, o, c) x[t - o, c]. */
void ref_conv_apply(float *out, const float *x, const float *dyn, size_t dyn_stride,
                    const float *base, const float *residual, int T, int B, int H, int k, int g) {
  for (int t = 0; t < T; t++)
    for (int c = 0; c < H; c++) {
      double s = residual ? residual[(size_t)t * H + c] : 0.0;
      for (int o = 0; o < k && o <= t % B; o++)
        s += tap(dyn, dyn_stride, base, t, o, c, H, g) * x[(size_t)(t - o) * H + c];
      out[(size_t)t * H + c] = (float)s;
    }
}

/* Each term tap(t,o,c) x[t-o,c] of out[t,c] sends dout[t,c] tap to dx[t-o,c],
 * dout[t,c] x[t-o,c] to ddyn[t,o,c/g] and to dbase[o,c]. */
void ref_conv_backward(float *dx, float *ddyn, float *dbase, const float *dout, const float *x,
                       const float *dyn, size_t dyn_stride, const float *base, int T, int B, int H,
                       int k, int g) {
  memset(dx, 0, sizeof(float) * (size_t)T * H);
  for (int t = 0; t < T; t++)
    memset(ddyn + (size_t)t * dyn_stride, 0, sizeof(float) * (size_t)k * (H / g));
  for (int t = 0; t < T; t++)
    for (int o = 0; o < k && o <= t % B; o++)
      for (int c = 0; c < H; c++) {
        double d = dout[(size_t)t * H + c], xv = x[(size_t)(t - o) * H + c];
        dx[(size_t)(t - o) * H + c] += (float)(d * tap(dyn, dyn_stride, base, t, o, c, H, g));
        ddyn[(size_t)t * dyn_stride + (size_t)o * (H / g) + c / g] += (float)(d * xv);
        dbase[(size_t)o * H + c] += (float)(d * xv);
      }
}

/* ---- DFlash 2 selector loss ----------------------------------------------- */

/* One row's K-way CE over scores s_c = unary_c + sum_j a_j h_j b_cand_c,j and,
 * with s->dx, its gradient: ds_c = coef (softmax_c - [c == y]) into B, A, h
 * and x (through unary = x . E[cand]). */
static double sel_row(const df2_sel_args *s, int i, const int32_t *cand, const float *unary, int y,
                      const double *h, double *dh) {
  int K = s->K, r = s->r;
  const float *a = s->pred + (size_t)s->prev[i] * r;
  double *sc = malloc(sizeof(double) * (size_t)K), mx = -INFINITY, z = 0;
  for (int c = 0; c < K; c++) {
    sc[c] = unary[c];
    for (int j = 0; j < r; j++) sc[c] += a[j] * h[j] * s->succ[(size_t)cand[c] * r + j];
    mx = sc[c] > mx ? sc[c] : mx;
  }
  for (int c = 0; c < K; c++) z += exp(sc[c] - mx);
  double loss = mx + log(z) - sc[y];
  for (int c = 0; s->dx && c < K; c++) {
    double ds = s->coef[i] * (exp(sc[c] - mx) / z - (c == y));
    const float *b = s->succ + (size_t)cand[c] * r;
    for (int j = 0; j < r; j++) {
      s->dsucc[(size_t)cand[c] * r + j] += (float)(ds * a[j] * h[j]);
      s->dpred[(size_t)s->prev[i] * r + j] += (float)(ds * h[j] * b[j]);
      dh[j] += ds * a[j] * b[j];
    }
    for (int q = 0; q < s->H; q++)
      s->dx[(size_t)i * s->H + q] += (float)(ds * s->E[(size_t)cand[c] * s->H + q]);
  }
  free(sc);
  return loss;
}

/* Per row: the top K of the full logits are the candidates; the true token
 * is found among them, else dropped or injected in the last place; h =
 * hproj x; the gradient of h goes back through hproj to x and hproj. */
void ref_selector_loss(const df2_sel_args *s, double *loss, double *hits) {
  int K = s->K, r = s->r, H = s->H;
  float *l = malloc(sizeof(float) * (size_t)s->V), *unary = malloc(sizeof(float) * (size_t)K);
  int32_t *cand = malloc(sizeof(int32_t) * (size_t)K);
  double *h = malloc(sizeof(double) * (size_t)r), *dh = malloc(sizeof(double) * (size_t)r);
  *loss = *hits = 0;
  for (int i = 0; i < s->R; i++) {
    const float *x = s->x + (size_t)i * H;
    for (int v = 0; v < s->V; v++) {
      double d = 0;
      for (int q = 0; q < H; q++) d += (double)x[q] * s->E[(size_t)v * H + q];
      l[v] = (float)d;
    }
    ref_topk(l, s->V, K, cand, unary);
    int y = -1;
    for (int c = 0; c < K; c++) y = cand[c] == s->target[i] ? c : y;
    *hits += y >= 0;
    if (y < 0 && !s->inject) continue;
    if (y < 0) y = K - 1, cand[y] = s->target[i], unary[y] = l[s->target[i]];
    for (int j = 0; j < r; j++) {
      h[j] = dh[j] = 0;
      for (int q = 0; q < H; q++) h[j] += (double)s->hproj[(size_t)j * H + q] * x[q];
    }
    *loss += s->w[i] * sel_row(s, i, cand, unary, y, h, dh);
    for (int j = 0; s->dx && j < r; j++)
      for (int q = 0; q < H; q++) {
        s->dx[(size_t)i * H + q] += (float)(dh[j] * s->hproj[(size_t)j * H + q]);
        s->dhproj[(size_t)j * H + q] += (float)(dh[j] * x[q]);
      }
  }
  free(l), free(unary), free(cand), free(h), free(dh);
}
