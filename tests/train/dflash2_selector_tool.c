/* For tests/reference/torch_dflash2_selector.py: runs DFlash 2's selector
 * loss forward and backward (df2_selector_loss, src/train/dflash2.c, with
 * the candidates of the block CE's pass, df_lmhead_ce_topk) on the inputs in
 * argv[1] and writes the results to argv[2]. Input: int32 R, H, V, r, K,
 * chunk, inject, then float32 x [R, H], E [V, H], A [V, r], B [V, r],
 * P [r, H], int32 target [R], prev [R], float32 coef [R] (also the loss
 * weights). Output: float32 loss, hits, dx [R, H], dA [V, r], dB [V, r],
 * dP [r, H] (the gradients of sum_i coef_i CE_i). */
#include <stdio.h>
#include <stdlib.h>

#include "core/internal.h"
#include "train/dflash2.h"
#include "train/ops.h"

static void *read_n(FILE *f, size_t n) {
  void *p = malloc(n * 4);
  if (p && fread(p, 4, n, f) != n) {
    free(p);
    return NULL;
  }
  return p;
}

static int write_all(FILE *o, const float *const *t, const size_t *n, int k) {
  for (int i = 0; i < k; i++)
    if (fwrite(t[i], 4, n[i], o) != n[i]) return 1;
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
    return 2;
  }
  FILE *in = fopen(argv[1], "rb");
  int32_t d[7];
  if (!in || fread(d, sizeof d, 1, in) != 1) return 2;
  int R = d[0], H = d[1], V = d[2], r = d[3];
  if (R < 1 || H < 1 || V < 1 || r < 1) return 2;
  size_t rh = (size_t)R * H, vh = (size_t)V * H, vr = (size_t)V * r, hr = (size_t)r * H;
  float *x = read_n(in, rh), *E = read_n(in, vh), *A = read_n(in, vr), *B = read_n(in, vr);
  float *P = read_n(in, hr);
  int32_t *target = read_n(in, R), *prev = read_n(in, R);
  float *coef = read_n(in, R);
  fclose(in);
  double *w = malloc(sizeof(double) * R);
  float *dx = calloc(rh, 4), *dA = calloc(vr, 4), *dB = calloc(vr, 4), *dP = calloc(hr, 4);
  if (!x || !E || !A || !B || !P || !target || !prev || !coef || !w || !dx || !dA || !dB || !dP)
    return 2;
  for (int i = 0; i < R; i++) w[i] = coef[i];
  /* The candidates as training takes them: from the block CE's LM-head pass. */
  int K = d[4] >= 1 && d[4] <= V ? d[4] : 1;
  int32_t *cand = malloc(sizeof(int32_t) * R * K);
  float *unary = malloc(sizeof(float) * R * K),
        *work = malloc(sizeof(float) * df_lmhead_work(R, H, d[5] > 0 ? d[5] : 1));
  double *ce = malloc(sizeof(double) * R);
  if (!cand || !unary || !work || !ce || d[5] < 1) return 2;
  df_lmhead_ce_topk(NULL, ce, NULL, x, E, target, coef, R, H, V, d[5], work, K, cand, unary);
  df2_sel_args s = {.x = x,
                    .E = E,
                    .pred = A,
                    .succ = B,
                    .hproj = P,
                    .target = target,
                    .prev = prev,
                    .coef = coef,
                    .w = w,
                    .R = R,
                    .H = H,
                    .V = V,
                    .r = r,
                    .K = d[4],
                    .chunk = d[5],
                    .inject = d[6] != 0,
                    .dx = dx,
                    .dpred = dA,
                    .dsucc = dB,
                    .dhproj = dP,
                    .cand = cand,
                    .unary = unary};
  double loss, hits;
  if (df2_selector_loss(&s, &loss, &hits)) return 2;
  free(cand), free(unary), free(work), free(ce);
  float head[2] = {(float)loss, (float)hits};
  const float *outs[] = {head, dx, dA, dB, dP};
  size_t ns[] = {2, rh, vr, vr, hr};
  FILE *o = fopen(argv[2], "wb");
  if (!o || write_all(o, outs, ns, 5) || fclose(o)) return 2;
  free(x), free(E), free(A), free(B), free(P), free(target), free(prev), free(coef), free(w);
  free(dx), free(dA), free(dB), free(dP);
  return 0;
}
