/* DFlash 2's grouped dynamic causal convolution (dflash2.h). */
#include "dflash2.h"

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
