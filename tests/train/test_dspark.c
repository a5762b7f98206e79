/* DSpark's loss pass (src/train/dspark.c) by central differences, as test_ops.c checks every
 * op: the gradient of sum_i coef_i (a_ce CE + a_l1 L1 + a_conf BCE) with respect to x, the
 * Markov tables w1 (the rows of the previous tokens, repeated ones included) and w2, and the
 * confidence head, in float32 with step 1e-2 (bound 1e-2 of the gradient's scale). c* is held
 * at the unperturbed pass's values (cstar_fix): the spec detaches it, so the finite difference
 * of a loss that let it move would not be the gradient. Also: the pass does not depend on the
 * pool's thread count or the rows per chunk, and refuses ids outside the vocabulary. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "train/dspark.h"

enum { R = 5, H = 8, V = 24, RK = 4 };

static uint64_t lcg = 777;
static float frand(void) {
  lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
  return (float)((lcg >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}
static void rnd(float *p, size_t n, float scale) {
  for (size_t i = 0; i < n; i++) p[i] = frand() * scale;
}

typedef struct {
  float x[R * H], xt[R * H], E[V * H], w1[V * RK], w2[V * RK], cw[H + RK], cstar[R], coef[R];
  double w[R];
  int32_t prev[R], target[R];
  df_dspark_args a;
} fix_t;

static void setup_fix(fix_t *f) {
  rnd(f->x, R * H, 1), rnd(f->xt, R * H, 1), rnd(f->E, V * H, 1);
  rnd(f->w1, V * RK, 0.7f), rnd(f->w2, V * RK, 0.7f), rnd(f->cw, H + RK, 0.5f);
  for (int i = 0; i < R; i++) {
    f->coef[i] = 0.3f + 0.2f * (float)i;
    f->w[i] = f->coef[i];
    f->prev[i] = i % 3; /* rows 0 and 3 share a previous token */
    f->target[i] = (7 * i + 2) % V;
  }
  f->a = (df_dspark_args){.x = f->x,
                          .xt = f->xt,
                          .E = f->E,
                          .w1 = f->w1,
                          .w2 = f->w2,
                          .cw = f->cw,
                          .cb = 0.2f,
                          .prev = f->prev,
                          .target = f->target,
                          .coef = f->coef,
                          .w = f->w,
                          .R = R,
                          .H = H,
                          .V = V,
                          .r = RK,
                          .chunk_rows = 2,
                          .alpha_ce = 0.1,
                          .alpha_l1 = 0.9,
                          .alpha_conf = 1.0};
}

static double objective(fix_t *f) {
  df_dspark_args a = f->a;
  a.cstar_fix = f->cstar;
  a.dx = a.dw1 = a.dw2 = a.dcw = a.dcb = NULL;
  a.conf = a.cstar = NULL;
  df_dspark_sums s;
  ck_assert_ok(df_dspark_loss(NULL, &a, &s));
  return a.alpha_ce * s.ce + a.alpha_l1 * s.l1 + a.alpha_conf * s.bce;
}

static void fd_check(const char *what, fix_t *f, float *p, const float *g, size_t n,
                     const size_t *idx, int k) {
  double scale = 0;
  for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(g[i]));
  ck_assert_msg(scale > 0, "%s: gradient is all zero", what);
  const float h = 1e-2f;
  for (int j = 0; j < k; j++) {
    size_t i = idx ? idx[j] : (size_t)(j * 7919u) % n;
    float keep = p[i];
    p[i] = keep + h;
    double fp = objective(f);
    p[i] = keep - h;
    double fm = objective(f);
    p[i] = keep;
    double fd = (fp - fm) / (2.0 * h);
    ck_assert_msg(fabs(fd - g[i]) <= 1e-2 * scale,
                  "%s[%zu]: analytic %g, finite difference %g (scale %g)", what, i, g[i], fd,
                  scale);
  }
}

START_TEST(dspark_loss_fd) {
  static fix_t f;
  setup_fix(&f);
  static float dx[R * H], dw1[V * RK], dw2[V * RK], dcw[H + RK];
  float dcb = 0;
  memset(dw1, 0, sizeof dw1), memset(dw2, 0, sizeof dw2), memset(dcw, 0, sizeof dcw);
  df_dspark_args a = f.a;
  a.dx = dx, a.dw1 = dw1, a.dw2 = dw2, a.dcw = dcw, a.dcb = &dcb, a.cstar = f.cstar;
  df_dspark_sums s;
  ck_assert_ok(df_dspark_loss(NULL, &a, &s));
  ck_assert(s.ce > 0 && s.l1 > 0 && s.bce > 0);
  fd_check("dx", &f, f.x, dx, R * H, NULL, 12);
  /* w1: the used rows (0, 1, 2), every column; other rows get nothing */
  size_t rows_used[3 * RK];
  for (int i = 0; i < 3 * RK; i++) rows_used[i] = (size_t)i;
  fd_check("dw1", &f, f.w1, dw1, V * RK, rows_used, 3 * RK);
  for (int i = 3 * RK; i < V * RK; i++) ck_assert_float_eq(dw1[i], 0);
  fd_check("dw2", &f, f.w2, dw2, V * RK, NULL, 12);
  fd_check("dcw", &f, f.cw, dcw, H + RK, NULL, H + RK);
  /* the bias: through the objective's cb */
  float cb = f.a.cb;
  f.a.cb = cb + 1e-2f;
  double fp = objective(&f);
  f.a.cb = cb - 1e-2f;
  double fm = objective(&f);
  f.a.cb = cb;
  ck_assert_double_eq_tol((fp - fm) / 2e-2, dcb, 1e-2 * fabs(dcb) + 1e-4);
}
END_TEST

/* Threads and chunking change nothing: rows are independent and the sums run in row order. */
START_TEST(dspark_loss_deterministic) {
  static fix_t f;
  setup_fix(&f);
  static float dx[2][R * H], dw1[2][V * RK], dw2[2][V * RK], dcw[2][H + RK];
  float dcb[2] = {0, 0};
  df_dspark_sums s[2];
  memset(dw1, 0, sizeof dw1), memset(dw2, 0, sizeof dw2), memset(dcw, 0, sizeof dcw);
  df_pool *pool = NULL;
  ck_assert_ok(df_pool_create(3, &pool));
  for (int k = 0; k < 2; k++) {
    df_dspark_args a = f.a;
    a.chunk_rows = k ? R : 2; /* whole and split; GEMM shapes differ, so compare to 1e-6 */
    a.dx = dx[k], a.dw1 = dw1[k], a.dw2 = dw2[k], a.dcw = dcw[k], a.dcb = &dcb[k];
    ck_assert_ok(df_dspark_loss(k ? pool : NULL, &a, &s[k]));
  }
  df_pool_free(pool);
  ck_assert_double_eq_tol(s[0].ce, s[1].ce, 1e-5 * s[0].ce);
  ck_assert_double_eq_tol(s[0].l1, s[1].l1, 1e-5 * s[0].l1);
  ck_assert_double_eq_tol(s[0].bce, s[1].bce, 1e-5 * s[0].bce);
  for (int i = 0; i < R * H; i++) ck_assert_float_eq_tol(dx[0][i], dx[1][i], 1e-5f);
  for (int i = 0; i < V * RK; i++) ck_assert_float_eq_tol(dw1[0][i], dw1[1][i], 1e-5f);
  ck_assert_float_eq_tol(dcb[0], dcb[1], 1e-5f);
  /* Ids outside the vocabulary are refused, not read. */
  f.prev[1] = V;
  df_dspark_sums t;
  ck_assert_status(df_dspark_loss(NULL, &f.a, &t), DFLASH_E_RANGE, "row 1: previous token 24");
}
END_TEST

/* The anchor-first rows, worked out by hand from spec/dspark.md section 2 on a 10-token
 * sequence whose position 5 is unsupervised: ids are 10 + position, target labels 100 +
 * position. A label shifted as DFlash's (slot k -> anchor + k) gives 12 where 13 is. */
START_TEST(dspark_rows_follow_spec) {
  int32_t ids[10], labels[10];
  for (int i = 0; i < 10; i++) ids[i] = 10 + i, labels[i] = 100 + i;
  const uint8_t mask[10] = {0, 0, 1, 1, 1, 0, 1, 1, 1, 1};
  const int32_t anchors[3] = {2, 4, 7};
  int32_t t[12], tgt[12], prev[12];
  double w[12];
  float coef[12];
  int R = df_dspark_rows(4, 4.0, ids, NULL, mask, 10, anchors, 3, 0.5, t, tgt, prev, w, coef);
  /* anchor 2: slots 0, 1 predict 3, 4; slot 2 would predict 5 (unsupervised): the block ends.
   * anchor 4: slot 0 would predict 5: nothing. anchor 7: slots 0, 1 predict 8, 9; slot 2
   * would predict 10, past the end. */
  ck_assert_int_eq(R, 4);
  const int32_t want_t[] = {0, 1, 8, 9}, want_tgt[] = {13, 14, 18, 19},
                want_prev[] = {12, 13, 17, 18};
  const double want_w[] = {1.0, 0.77880078307140488, 1.0, 0.77880078307140488}; /* e^-1/4 */
  for (int i = 0; i < R; i++) {
    ck_assert_int_eq(t[i], want_t[i]);
    ck_assert_int_eq(tgt[i], want_tgt[i]);
    ck_assert_int_eq(prev[i], want_prev[i]);
    ck_assert_double_eq_tol(w[i], want_w[i], 1e-15);
    ck_assert_float_eq_tol(coef[i], (float)(0.5 * want_w[i]), 1e-7f);
  }
  /* Target labels: the label and, after slot 0, the previous token come from them. */
  R = df_dspark_rows(4, 4.0, ids, labels, mask, 10, anchors, 3, 1.0, NULL, tgt, prev, NULL, NULL);
  ck_assert_int_eq(R, 4);
  const int32_t lab_tgt[] = {103, 104, 108, 109}, lab_prev[] = {12, 103, 17, 108};
  for (int i = 0; i < R; i++) {
    ck_assert_int_eq(tgt[i], lab_tgt[i]);
    ck_assert_int_eq(prev[i], lab_prev[i]);
  }
  /* A whole block: 4 drafts from 4 inputs, weights 1, e^-1/4, e^-1/2, e^-3/4; gamma 0: 1. */
  const uint8_t all[10] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  const int32_t a0 = 0;
  R = df_dspark_rows(4, 4.0, ids, NULL, all, 10, &a0, 1, 1.0, t, tgt, NULL, w, NULL);
  ck_assert_int_eq(R, 4);
  ck_assert_int_eq(tgt[3], 14);
  ck_assert_double_eq_tol(w[3], 0.47236655274101469, 1e-15);
  R = df_dspark_rows(4, 0.0, ids, NULL, all, 10, &a0, 1, 1.0, NULL, NULL, NULL, w, NULL);
  ck_assert_double_eq(w[3], 1.0);
}
END_TEST

TCase *tc_dspark(void) {
  TCase *tc = tcase_create("dspark");
  tcase_add_test(tc, dspark_loss_fd);
  tcase_add_test(tc, dspark_loss_deterministic);
  tcase_add_test(tc, dspark_rows_follow_spec);
  return tc;
}
