/* DFlash 2's grouped dynamic causal convolution (dflash2.h). */
#include "dflash2.h"
#include "ops.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct conv_ctx {
  float *out;
  const float *x, *dyn, *base, *residual;
  size_t dyn_stride;
  int B, H, k, g;
} conv_ctx;

static void conv_rows(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  const conv_ctx *c = vc;
  size_t H = (size_t)c->H;
  for (size_t t = b; t < e; t++) {
    int j = (int)(t % (size_t)c->B), taps = j + 1 < c->k ? j + 1 : c->k;
    const float *dyn = c->dyn + t * c->dyn_stride;
    float *out = c->out + t * H;
    for (size_t ch = 0; ch < H; ch++) {
      float acc = 0.0f;
      for (int o = 0; o < taps; o++) {
        float v = c->x[(t - (size_t)o) * H + ch];
        acc += c->base[(size_t)o * H + ch] * v;
        acc += dyn[(size_t)o * (H / (size_t)c->g) + ch / (size_t)c->g] * v;
      }
      out[ch] = c->residual ? c->residual[t * H + ch] + acc : acc;
    }
  }
}

void df2_conv_apply(df_pool *pool, float *out, const float *x, const float *dyn, size_t dyn_stride,
                    const float *base, const float *residual, int T, int B, int H, int k, int g) {
  conv_ctx c = {.out = out,
                .x = x,
                .dyn = dyn,
                .base = base,
                .residual = residual,
                .dyn_stride = dyn_stride,
                .B = B,
                .H = H,
                .k = k,
                .g = g};
  df_pool_for(pool, (size_t)T, 16, conv_rows, &c);
}

typedef struct conv_bwd_ctx {
  float *dx, *ddyn, *dbase;
  const float *dout, *x, *dyn, *base;
  size_t dyn_stride;
  int T, B, H, k, g;
} conv_bwd_ctx;

/* Rows s: dx[s, c] = sum over the taps o that read x[s] from row s + o of the
 * same block of dout[s + o, c] (base[o, c] + dyn[s + o, o, c / g]); and
 * ddyn[s, o, q] = sum over channels c of group q of dout[s, c] x[s - o, c]. */
static void conv_bwd_rows(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  const conv_bwd_ctx *c = vc;
  size_t H = (size_t)c->H, g = (size_t)c->g, G = H / g;
  for (size_t s = b; s < e; s++) {
    int j = (int)(s % (size_t)c->B);
    int ahead = c->B - j < c->k ? c->B - j : c->k; /* rows s .. s+ahead-1 read x[s] */
    int behind = j + 1 < c->k ? j + 1 : c->k;      /* taps row s has */
    float *dx = c->dx + s * H;
    for (size_t ch = 0; ch < H; ch++) {
      float acc = 0.0f;
      for (int o = 0; o < ahead; o++) {
        size_t t = s + (size_t)o;
        float w = c->base[(size_t)o * H + ch] + c->dyn[t * c->dyn_stride + (size_t)o * G + ch / g];
        acc += c->dout[t * H + ch] * w;
      }
      dx[ch] = acc;
    }
    float *dd = c->ddyn + s * c->dyn_stride;
    for (int o = 0; o < c->k; o++)
      for (size_t q = 0; q < G; q++) {
        float acc = 0.0f;
        for (size_t ch = q * g; o < behind && ch < (q + 1) * g; ch++)
          acc += c->dout[s * H + ch] * c->x[(s - (size_t)o) * H + ch];
        dd[(size_t)o * G + q] = acc;
      }
  }
}

/* Channels ch: dbase[o, ch] += sum_t dout[t, ch] x[t - o, ch] (same block). */
static void conv_bwd_base(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  const conv_bwd_ctx *c = vc;
  size_t H = (size_t)c->H;
  for (size_t ch = b; ch < e; ch++)
    for (int o = 0; o < c->k; o++) {
      double acc = 0;
      for (size_t t = 0; t < (size_t)c->T; t++)
        if ((int)(t % (size_t)c->B) >= o)
          acc += (double)c->dout[t * H + ch] * c->x[(t - (size_t)o) * H + ch];
      c->dbase[(size_t)o * H + ch] += (float)acc;
    }
}

void df2_conv_backward(df_pool *pool, float *dx, float *ddyn, float *dbase, const float *dout,
                       const float *x, const float *dyn, size_t dyn_stride, const float *base,
                       int T, int B, int H, int k, int g) {
  conv_bwd_ctx c = {.dx = dx,
                    .ddyn = ddyn,
                    .dbase = dbase,
                    .dout = dout,
                    .x = x,
                    .dyn = dyn,
                    .base = base,
                    .dyn_stride = dyn_stride,
                    .T = T,
                    .B = B,
                    .H = H,
                    .k = k,
                    .g = g};
  df_pool_for(pool, (size_t)T, 16, conv_bwd_rows, &c);
  df_pool_for(pool, (size_t)H, 8, conv_bwd_base, &c);
}

enum { SELECT_MAX_K = 1024 };

/* Row c's selector score: logit + <A(prev) * P(h), B(cand)>. */
static float select_score(const float *a, const float *h, const float *succ_cb, int r, int32_t cand,
                          float unary) {
  const float *b = succ_cb + (size_t)cand * r;
  float e = 0;
  for (int j = 0; j < r; j++) e += a[j] * h[j] * b[j];
  return unary + e;
}

/* q = softmax(s / temperature) over m candidates (z-lab's _sampling_probs:
 * the scores divided in float32, the softmax in double here), and the index
 * the uniform draw u lands on. */
static int select_sample(const float *s, int m, double temperature, double u, float *q) {
  float t = (float)temperature;
  double mx = -INFINITY, z = 0, acc = 0;
  for (int c = 0; c < m; c++) mx = s[c] / t > mx ? s[c] / t : mx;
  for (int c = 0; c < m; c++) z += exp((double)(s[c] / t) - mx);
  int pick = -1, last = 0; /* last: the last candidate with q > 0 */
  for (int c = 0; c < m; c++) {
    double p = exp((double)(s[c] / t) - mx) / z;
    q[c] = (float)p;
    acc += p;
    if (pick < 0 && u < acc) pick = c;
    if (p > 0) last = c;
  }
  return pick >= 0 && q[pick] > 0 ? pick : last; /* u above the rounded total */
}

void df2_select(const df2_select_args *s, df_rng *rng, int32_t *path) {
  int32_t cand_buf[SELECT_MAX_K];
  float unary[SELECT_MAX_K], score[SELECT_MAX_K], q_buf[SELECT_MAX_K];
  int k = s->top_k < SELECT_MAX_K ? s->top_k : SELECT_MAX_K;
  bool sample = s->temperature > 0 && rng;
  int32_t prev = s->anchor_id;
  for (int i = 0; i < s->n; i++) {
    const float *row = s->logits + (size_t)i * s->V;
    int32_t *cand = s->cand ? s->cand + (size_t)i * k : cand_buf;
    int m = 0;
    for (int32_t v = 0; v < s->V; v++) m = df_topk_insert(cand, unary, m, k, v, row[v]);
    const float *a = s->pred_cb + (size_t)prev * s->r, *h = s->hproj + (size_t)i * s->r;
    int best = 0;
    for (int c = 0; c < m; c++) {
      score[c] = select_score(a, h, s->succ_cb, s->r, cand[c], unary[c]);
      if (score[c] > score[best]) best = c;
    }
    if (sample) {
      float *q = s->probs ? s->probs + (size_t)i * k : q_buf;
      best = select_sample(score, m, s->temperature, df_rng_unit(rng), q);
    }
    prev = path[i] = cand[best];
  }
}

int32_t df2_argmax(const float *row, int V) {
  int32_t best = 0;
  for (int32_t v = 1; v < V; v++)
    if (row[v] > row[best]) best = v;
  return best;
}

void df2_select_greedy(const float *logits, const float *hproj, const float *pred_cb,
                       const float *succ_cb, int n, int V, int r, int top_k, int32_t anchor_id,
                       int32_t *path) {
  df2_select_args s = {.logits = logits,
                       .hproj = hproj,
                       .pred_cb = pred_cb,
                       .succ_cb = succ_cb,
                       .n = n,
                       .V = V,
                       .r = r,
                       .top_k = top_k,
                       .anchor_id = anchor_id};
  df2_select(&s, NULL, path);
}

void df2_lmhead_topk(const float *x, const float *E, int R, int H, int V, int chunk, int top_k,
                     int32_t *ids, float *vals, float *scratch) {
  int k = top_k < SELECT_MAX_K ? top_k : SELECT_MAX_K;
  int *n = calloc((size_t)R, sizeof *n);
  if (!n) return; /* callers size top_k <= V and check the allocation of scratch */
  for (int v0 = 0; v0 < V; v0 += chunk) {
    int nv = V - v0 < chunk ? V - v0 : chunk;
    df_matmul_forward(NULL, scratch, x, E + (size_t)v0 * H, R, nv, H, false);
    for (int r = 0; r < R; r++)
      for (int v = 0; v < nv; v++)
        n[r] = df_topk_insert(ids + (size_t)r * k, vals + (size_t)r * k, n[r], k, v0 + v,
                              scratch[(size_t)r * nv + v]);
  }
  free(n);
}

int df2_selector_candidates(int32_t *cand, float *unary, int k, int32_t target, float target_logit,
                            bool inject) {
  for (int c = 0; c < k; c++)
    if (cand[c] == target) return c;
  if (!inject) return -1;
  cand[k - 1] = target, unary[k - 1] = target_logit;
  return k - 1;
}

double df2_selector_row(const int32_t *cand, const float *unary, int k, int y, const float *a,
                        const float *h, const float *succ_cb, int r, float coef, float *da,
                        float *dh, float *dsucc_cb, const float *E, int H, float *dx, float *p) {
  double mx = -INFINITY, z = 0;
  for (int c = 0; c < k; c++) {
    const float *b = succ_cb + (size_t)cand[c] * r;
    float e = 0;
    for (int j = 0; j < r; j++) e += a[j] * h[j] * b[j];
    p[c] = unary[c] + e;
    mx = p[c] > mx ? p[c] : mx;
  }
  for (int c = 0; c < k; c++) z += exp((double)p[c] - mx);
  double loss = mx + log(z) - p[y];
  if (!da) return loss;
  for (int c = 0; c < k; c++) {
    /* d(loss)/d(score c) = softmax_c - [c == y], scaled by the row's weight. */
    float ds = coef * (float)(exp((double)p[c] - mx) / z - (c == y));
    const float *b = succ_cb + (size_t)cand[c] * r;
    float *db = dsucc_cb + (size_t)cand[c] * r;
    for (int j = 0; j < r; j++) {
      db[j] += ds * a[j] * h[j];
      da[j] += ds * h[j] * b[j];
      dh[j] += ds * a[j] * b[j];
    }
    /* The unary score is x . E[cand]: d(x) += ds E[cand]. */
    const float *e = E + (size_t)cand[c] * H;
    for (int j = 0; j < H; j++) dx[j] += ds * e[j];
  }
  return loss;
}

typedef struct sel_buf {
  int32_t *cand;
  float *unary, *hp, *dh, *p, *scratch;
} sel_buf;

static void sel_buf_free(sel_buf *b) {
  free(b->cand), free(b->unary), free(b->hp), free(b->dh), free(b->p), free(b->scratch);
}

static dflash_status sel_buf_alloc(const df2_sel_args *s, sel_buf *b) {
  size_t R = (size_t)s->R, r = (size_t)s->r, K = (size_t)s->K;
  b->cand = malloc(sizeof(int32_t) * R * K);
  b->unary = malloc(sizeof(float) * R * K);
  b->hp = malloc(sizeof(float) * R * r);
  b->dh = calloc(R * r, sizeof(float));
  b->p = malloc(sizeof(float) * K);
  /* Own candidates only without the CE pass's (a second LM-head pass). */
  b->scratch = s->cand ? NULL : malloc(sizeof(float) * R * (size_t)s->chunk);
  if (b->cand && b->unary && b->hp && b->dh && b->p && (s->cand || b->scratch)) return DFLASH_OK;
  sel_buf_free(b);
  return df_error_nomem("candidate selector loss");
}

static float dot(const float *x, const float *y, int n) {
  float s = 0;
  for (int j = 0; j < n; j++) s += x[j] * y[j];
  return s;
}

dflash_status df2_selector_loss(const df2_sel_args *s, double *loss, double *hits) {
  int R = s->R, r = s->r, K = s->K;
  *loss = *hits = 0;
  if (R <= 0) return DFLASH_OK;
  if (K < 1 || K > SELECT_MAX_K || K > s->V || s->chunk < 1)
    return df_error(DFLASH_E_RANGE, "selector loss: top-%d of %d tokens (chunk %d)", K, s->V,
                    s->chunk);
  sel_buf b;
  dflash_status st = sel_buf_alloc(s, &b);
  if (st) return st;
  if (s->cand) { /* copied: injection rewrites them */
    memcpy(b.cand, s->cand, sizeof(int32_t) * (size_t)R * K);
    memcpy(b.unary, s->unary, sizeof(float) * (size_t)R * K);
  } else {
    df2_lmhead_topk(s->x, s->E, R, s->H, s->V, s->chunk, K, b.cand, b.unary, b.scratch);
  }
  df_matmul_forward(NULL, b.hp, s->x, s->hproj, R, r, s->H, false);
  for (int i = 0; i < R; i++) {
    int32_t *cand = b.cand + (size_t)i * K, y_tok = s->target[i];
    float *un = b.unary + (size_t)i * K;
    float tl = dot(s->x + (size_t)i * s->H, s->E + (size_t)y_tok * s->H, s->H);
    int y = df2_selector_candidates(cand, un, K, y_tok, tl, false);
    *hits += y >= 0;
    if (y < 0) y = df2_selector_candidates(cand, un, K, y_tok, tl, s->inject);
    if (y < 0) continue; /* "drop": the true token is not a candidate */
    size_t pa = (size_t)s->prev[i] * r;
    double l = df2_selector_row(cand, un, K, y, s->pred + pa, b.hp + (size_t)i * r, s->succ, r,
                                s->coef[i], s->dx ? s->dpred + pa : NULL, b.dh + (size_t)i * r,
                                s->dsucc, s->E, s->H, s->dx ? s->dx + (size_t)i * s->H : NULL, b.p);
    *loss += s->w[i] * l;
  }
  if (s->dx) df_matmul_backward(NULL, s->dx, s->dhproj, b.dh, s->x, s->hproj, R, r, s->H, true);
  sel_buf_free(&b);
  return DFLASH_OK;
}
