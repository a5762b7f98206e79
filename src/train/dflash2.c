/* DFlash 2's grouped dynamic causal convolution (dflash2.h). */
#include "dflash2.h"

#include <stdlib.h>

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

void df2_conv_apply(df_pool *pool, float *out, const float *x, const float *dyn,
                    size_t dyn_stride, const float *base, const float *residual, int T, int B,
                    int H, int k, int g) {
  conv_ctx c = {.out = out, .x = x, .dyn = dyn, .base = base, .residual = residual,
                .dyn_stride = dyn_stride, .B = B, .H = H, .k = k, .g = g};
  df_pool_for(pool, (size_t)T, 16, conv_rows, &c);
}

/* Insert candidate v (logit x) into the top list (k kept, by logit then id). */
static int top_insert(int32_t *ids, float *vals, int n, int k, int32_t v, float x) {
  if (n == k && !(x > vals[n - 1])) return n; /* ties keep the smaller id, seen first */
  int i = n < k ? n++ : n - 1;
  while (i > 0 && x > vals[i - 1]) {
    ids[i] = ids[i - 1], vals[i] = vals[i - 1];
    i--;
  }
  ids[i] = v, vals[i] = x;
  return n;
}

enum { SELECT_MAX_K = 1024 };

void df2_select_greedy(const float *logits, const float *hproj, const float *pred_cb,
                       const float *succ_cb, int n, int V, int r, int top_k, int32_t anchor_id,
                       int32_t *path) {
  int32_t cand[SELECT_MAX_K];
  float unary[SELECT_MAX_K];
  int k = top_k < SELECT_MAX_K ? top_k : SELECT_MAX_K;
  int32_t prev = anchor_id;
  for (int i = 0; i < n; i++) {
    const float *row = logits + (size_t)i * V;
    int m = 0;
    for (int32_t v = 0; v < V; v++) m = top_insert(cand, unary, m, k, v, row[v]);
    const float *a = pred_cb + (size_t)prev * r, *h = hproj + (size_t)i * r;
    int best = 0;
    float best_s = 0;
    for (int c = 0; c < m; c++) {
      const float *b = succ_cb + (size_t)cand[c] * r;
      float e = 0;
      for (int j = 0; j < r; j++) e += a[j] * h[j] * b[j];
      float s = unary[c] + e;
      if (c == 0 || s > best_s) best = c, best_s = s;
    }
    prev = path[i] = cand[best];
  }
}
