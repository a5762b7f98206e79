/*
 * The target's greedy tokens from its final hidden states (vLLM's files keep that layer):
 * argmax over the vocabulary of head . rmsnorm(x) * w, what the target's own forward ends
 * with. In float32, a chunk of tokens at a time (the logits of a whole sample would be
 * len * V floats).
 */
#include <math.h>
#include <stdlib.h>

#include "ops.h"
#include "train/run/stream.h"

enum { CHUNK = 32 };

dflash_status df_greedy_tokens(const float *x, int64_t len, int32_t H, const float *norm_w,
                               float eps, const float *head, int32_t V, int32_t *out) {
  float *xn = malloc(sizeof(float) * CHUNK * (size_t)H);
  float *logits = malloc(sizeof(float) * CHUNK * (size_t)V);
  if (!xn || !logits) {
    free(xn), free(logits);
    return df_error_nomem("target logits");
  }
  for (int64_t t0 = 0; t0 < len; t0 += CHUNK) {
    int rows = len - t0 < CHUNK ? (int)(len - t0) : CHUNK;
    for (int r = 0; r < rows; r++) {
      const float *row = x + (size_t)(t0 + r) * H;
      double ss = 0;
      for (int32_t i = 0; i < H; i++) ss += (double)row[i] * row[i];
      float rstd = (float)(1.0 / sqrt(ss / H + eps));
      for (int32_t i = 0; i < H; i++) xn[(size_t)r * H + i] = row[i] * rstd * norm_w[i];
    }
    df_matmul_forward(NULL, logits, xn, head, rows, V, H, false);
    for (int r = 0; r < rows; r++) {
      const float *l = logits + (size_t)r * V;
      int32_t best = 0;
      for (int32_t v = 1; v < V; v++) best = l[v] > l[best] ? v : best; /* first max, as torch */
      out[t0 + r] = best;
    }
  }
  free(xn);
  free(logits);
  return DFLASH_OK;
}
