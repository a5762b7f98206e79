/* For tests/train/oracle_dspark.py: runs DSpark's loss forward and backward (df_dspark_loss,
 * src/train/dspark.c) on the inputs in argv[1] and writes the results to argv[2].
 * Input: int32 R, H, V, r, has_xt, has_conf, chunk_rows, then float32 alpha_ce, alpha_l1,
 * alpha_conf, x [R, H], xt [R, H] (has_xt), E [V, H], w1 [V, r], w2 [V, r], cw [H + r] and
 * cb (has_conf), int32 prev [R], target [R], float32 coef [R] (also the sums' weights).
 * Output: float64 sums ce, l1, bce, then float32 dx [R, H], dw1 [V, r], dw2 [V, r],
 * dcw [H + r], dcb, conf [R], cstar [R].
 * `--bench R H V r REPS` instead times one pass (forward + backward) with every term, with CE
 * alone (no target state, no head) and the DFlash LM-head CE (df_lmhead_ce), on one thread. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/internal.h"
#include "train/dspark.h"
#include "train/ops.h"

static void *read_n(FILE *f, size_t n) {
  void *p = malloc(n * 4 + 4);
  if (p && n && fread(p, 4, n, f) != n) {
    free(p);
    return NULL;
  }
  return p;
}

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static float *fill(size_t n, float scale, unsigned *seed) {
  float *p = malloc(n * sizeof *p);
  for (size_t i = 0; p && i < n; i++) {
    *seed = *seed * 1664525u + 1013904223u;
    p[i] = scale * ((float)(*seed >> 8) / (float)(1u << 24) * 2.0f - 1.0f);
  }
  return p;
}

static int bench(char **argv) {
  int R = atoi(argv[2]), H = atoi(argv[3]), V = atoi(argv[4]), r = atoi(argv[5]);
  int reps = atoi(argv[6]);
  if (R < 1 || H < 1 || V < 1 || r < 1 || reps < 1) return 2;
  unsigned seed = 7;
  float *x = fill((size_t)R * H, 1, &seed), *xt = fill((size_t)R * H, 1, &seed);
  float *E = fill((size_t)V * H, 0.1f, &seed), *w1 = fill((size_t)V * r, 0.02f, &seed);
  float *w2 = fill((size_t)V * r, 0.02f, &seed), *cw = fill((size_t)H + r, 0.02f, &seed);
  float *dx = calloc((size_t)R * H, 4), *dw1 = calloc((size_t)V * r, 4);
  float *dw2 = calloc((size_t)V * r, 4), *dcw = calloc((size_t)H + r, 4), dcb = 0;
  float *coef = malloc(sizeof(float) * R),
        *work = malloc(sizeof(float) * df_lmhead_work(R, H, 4096));
  double *w = malloc(sizeof(double) * R), *loss = malloc(sizeof(double) * R);
  int32_t *prev = malloc(sizeof(int32_t) * R), *tgt = malloc(sizeof(int32_t) * R);
  if (!x || !xt || !E || !w1 || !w2 || !cw || !dx || !dw1 || !dw2 || !dcw || !coef || !work || !w ||
      !loss || !prev || !tgt)
    return 2;
  for (int i = 0; i < R; i++)
    coef[i] = 1, w[i] = 1, prev[i] = (i * 7919) % V, tgt[i] = (i * 104729) % V;
  df_dspark_args a = {.x = x,
                      .xt = xt,
                      .E = E,
                      .w1 = w1,
                      .w2 = w2,
                      .cw = cw,
                      .prev = prev,
                      .target = tgt,
                      .coef = coef,
                      .w = w,
                      .R = R,
                      .H = H,
                      .V = V,
                      .r = r,
                      .alpha_ce = 0.1,
                      .alpha_l1 = 0.9,
                      .alpha_conf = 1.0,
                      .dx = dx,
                      .dw1 = dw1,
                      .dw2 = dw2,
                      .dcw = dcw,
                      .dcb = &dcb};
  df_dspark_sums s;
  double t[3] = {0};
  for (int k = 0; k < reps; k++) {
    double t0 = now();
    if (df_dspark_loss(NULL, &a, &s)) return 1;
    double t1 = now();
    df_dspark_args ce = a;
    ce.xt = NULL, ce.cw = NULL;
    if (df_dspark_loss(NULL, &ce, &s)) return 1;
    double t2 = now();
    df_lmhead_ce(NULL, loss, dx, x, E, tgt, coef, R, H, V, 4096, work);
    double t3 = now();
    t[0] += t1 - t0, t[1] += t2 - t1, t[2] += t3 - t2;
  }
  printf("R %d H %d V %d r %d: DSpark CE+L1+BCE %.4f s, DSpark CE only %.4f s, "
         "DFlash lmhead CE %.4f s (mean of %d, forward + backward, one thread)\n",
         R, H, V, r, t[0] / reps, t[1] / reps, t[2] / reps, reps);
  return 0;
}

int main(int argc, char **argv) {
  if (argc == 7 && !strcmp(argv[1], "--bench")) return bench(argv);
  if (argc != 3) {
    fprintf(stderr, "usage: %s IN OUT | --bench R H V r REPS\n", argv[0]);
    return 2;
  }
  FILE *in = fopen(argv[1], "rb");
  int32_t d[7];
  float al[3];
  if (!in || fread(d, sizeof d, 1, in) != 1 || fread(al, sizeof al, 1, in) != 1) return 2;
  int R = d[0], H = d[1], V = d[2], r = d[3];
  if (R < 1 || H < 1 || V < 1 || r < 1) return 2;
  size_t rh = (size_t)R * H, vh = (size_t)V * H, vr = (size_t)V * r, c = (size_t)H + r;
  float *x = read_n(in, rh), *xt = d[4] ? read_n(in, rh) : NULL, *E = read_n(in, vh);
  float *w1 = read_n(in, vr), *w2 = read_n(in, vr);
  float *cw = d[5] ? read_n(in, c + 1) : NULL;
  int32_t *prev = read_n(in, R), *target = read_n(in, R);
  float *coef = read_n(in, R);
  fclose(in);
  double *w = malloc(sizeof(double) * R);
  float *dx = calloc(rh, 4), *dw1 = calloc(vr, 4), *dw2 = calloc(vr, 4), *dcw = calloc(c, 4);
  float *conf = calloc(R, 4), *cstar = calloc(R, 4), dcb = 0;
  if (!x || (d[4] && !xt) || !E || !w1 || !w2 || (d[5] && !cw) || !prev || !target || !coef || !w ||
      !dx || !dw1 || !dw2 || !dcw || !conf || !cstar)
    return 2;
  for (int i = 0; i < R; i++) w[i] = coef[i];
  df_dspark_args a = {.x = x,
                      .xt = xt,
                      .E = E,
                      .w1 = w1,
                      .w2 = w2,
                      .cw = cw,
                      .cb = cw ? cw[c] : 0,
                      .prev = prev,
                      .target = target,
                      .coef = coef,
                      .w = w,
                      .R = R,
                      .H = H,
                      .V = V,
                      .r = r,
                      .chunk_rows = d[6],
                      .alpha_ce = al[0],
                      .alpha_l1 = al[1],
                      .alpha_conf = al[2],
                      .dx = dx,
                      .dw1 = dw1,
                      .dw2 = dw2,
                      .dcw = dcw,
                      .dcb = &dcb,
                      .conf = conf,
                      .cstar = cstar};
  df_pool *pool = NULL;
  if (df_pool_create(2, &pool)) return 2;
  df_dspark_sums s;
  dflash_status st = df_dspark_loss(pool, &a, &s);
  df_pool_free(pool);
  if (st) {
    fprintf(stderr, "%s\n", dflash_last_error());
    return 1;
  }
  FILE *o = fopen(argv[2], "wb");
  double sums[3] = {s.ce, s.l1, s.bce};
  if (!o || fwrite(sums, sizeof sums, 1, o) != 1 || fwrite(dx, 4, rh, o) != rh ||
      fwrite(dw1, 4, vr, o) != vr || fwrite(dw2, 4, vr, o) != vr || fwrite(dcw, 4, c, o) != c ||
      fwrite(&dcb, 4, 1, o) != 1 || fwrite(conf, 4, R, o) != (size_t)R ||
      fwrite(cstar, 4, R, o) != (size_t)R || fclose(o))
    return 1;
  free(x), free(xt), free(E), free(w1), free(w2), free(cw), free(prev), free(target), free(coef);
  free(w), free(dx), free(dw1), free(dw2), free(dcw), free(conf), free(cstar);
  return 0;
}
