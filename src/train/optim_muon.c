/* Muon (torch.optim.Muon, as vLLM speculators trains DFlash drafters with it) for the CPU
 * backend: Nesterov momentum, then the gradient's Newton-Schulz orthogonalisation, then a
 * decoupled weight decay and a shape-scaled step. torch runs the iterations in bfloat16 on
 * the GPU; here they are float32 df_sgemm (the trainer's pool, one OpenBLAS thread each). */
#include "backend.h"
#include "train/cuda/dfcuda.h" /* DF_MUON_NS_*, shared with the CUDA step */

#include "ops.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Keller Jordan's quintic coefficients, steps and eps, torch.optim.Muon's defaults. */
static const float NS_A = DF_MUON_NS_A, NS_B = DF_MUON_NS_B, NS_C = DF_MUON_NS_C,
                   NS_EPS = DF_MUON_NS_EPS;
enum { NS_STEPS = DF_MUON_NS_STEPS };

/* speculators' split: matrices, but not vocabulary-sized ones (its name hints; here DFlash
 * 2's selector codebooks [V, r]; the embedding and LM head are frozen). DSpark's Markov
 * factors are vocabulary-sized too and stay with AdamW: W1 [V, r] is an embedding table (a
 * step touches only the rows of the tokens seen, which orthogonalising the whole matrix
 * would spread to every row), W2 [V, r] an output head over the vocabulary (Muon's
 * practice leaves both to AdamW). The confidence projection [1, H + r] has one row (the
 * rule's sides > 1), so AdamW takes it and its bias. */
bool df_muon_takes(const df_tensor_info *ti) {
  return ti->ndim == 2 && ti->shape[0] > 1 && ti->shape[1] > 1 && !strstr(ti->name, "codebook") &&
         strncmp(ti->name, "markov_head.", 12) != 0;
}

/* x [r, c], r <= c, in place: x /= max(|x|_F, eps), then NS_STEPS of
 * x = a x + (b G + c G G) x with G = x x^T. g, gg [r, r] and y [r, c] are scratch. */
static void newton_schulz(df_pool *pool, float *x, float *y, float *g, float *gg, int r, int c) {
  double ss = 0;
  for (size_t i = 0; i < (size_t)r * c; i++) ss += (double)x[i] * x[i];
  float norm = (float)sqrt(ss), k = 1.0f / (norm > NS_EPS ? norm : NS_EPS);
  for (size_t i = 0; i < (size_t)r * c; i++) x[i] *= k;
  for (int s = 0; s < NS_STEPS; s++) {
    df_sgemm(pool, false, true, r, r, c, 1.0f, x, c, x, c, 0.0f, g, r);
    memcpy(gg, g, sizeof(float) * (size_t)r * r);
    df_sgemm(pool, false, false, r, r, r, NS_C, g, r, g, r, NS_B, gg, r);
    memcpy(y, x, sizeof(float) * (size_t)r * c);
    df_sgemm(pool, false, false, r, c, r, 1.0f, gg, r, x, c, NS_A, y, c);
    memcpy(x, y, sizeof(float) * (size_t)r * c);
  }
}

double df_muon_lr_scale(int32_t adjust, int64_t rows, int64_t cols) {
  if (adjust == DFLASH_MUON_ADJUST_LR_ORIGINAL)
    return sqrt(rows > cols ? (double)rows / (double)cols : 1.0);
  return 0.2 * sqrt((double)(rows > cols ? rows : cols));
}

static double adjusted_lr(const df_adam *a, int64_t rows, int64_t cols) {
  return a->lr * df_muon_lr_scale(a->muon_adjust_lr, rows, cols);
}

dflash_status df_muon_update(df_pool *pool, float *p, const float *grad, float *buf, int64_t rows,
                             int64_t cols, const df_adam *a) {
  int r = (int)(rows < cols ? rows : cols), c = (int)(rows < cols ? cols : rows);
  size_t n = (size_t)rows * (size_t)cols;
  float *x = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n);
  float *g = malloc(sizeof(float) * (size_t)r * r), *gg = malloc(sizeof(float) * (size_t)r * r);
  if (!x || !y || !g || !gg) {
    free(x), free(y), free(g), free(gg);
    return df_error_nomem("Muon workspace");
  }
  float mu = (float)a->muon_momentum;
  /* buf.lerp_(grad, 1 - mu); update = grad.lerp(buf, mu) (Nesterov), transposed when
   * rows > cols so that the Gram matrix is the small side. */
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++) {
      size_t at = (size_t)i * (size_t)cols + (size_t)j;
      buf[at] += (grad[at] - buf[at]) * (1.0f - mu);
      float u = grad[at] + (buf[at] - grad[at]) * mu;
      if (rows > cols) y[(size_t)j * (size_t)rows + (size_t)i] = u;
      else x[at] = u;
    }
  if (rows > cols) memcpy(x, y, sizeof(float) * n);
  newton_schulz(pool, x, y, g, gg, r, c);
  float decay = (float)(1.0 - a->lr * a->muon_weight_decay),
        step = (float)adjusted_lr(a, rows, cols);
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++) {
      size_t at = (size_t)i * (size_t)cols + (size_t)j;
      float o = rows > cols ? x[(size_t)j * (size_t)rows + (size_t)i] : x[at];
      p[at] = p[at] * decay - step * o;
    }
  free(x), free(y), free(g), free(gg);
  return DFLASH_OK;
}
