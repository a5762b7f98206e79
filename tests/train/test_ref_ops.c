/* The tuned CPU ops (src/train/ops.c, dflash2.c: BLAS, chunking, tiling,
 * threads) against their plain references (ref_ops.c) on random inputs, at
 * shapes that cross the tuned code's edges: odd sizes, the pools' grains
 * (16, 64, 4096 rows/elements), attention's 8-row context tiles, vocabulary
 * chunks that do not divide V, GQA, sliding windows, anchor 0, masked CE rows.
 * Each op runs inline (NULL pool) and on a 3-thread pool.
 * Agreement is max |tuned - ref| / max(1, max |ref|) <= tol: 1e-5 for every
 * float output (float32 rounding of sums of up to a few hundred terms; the
 * errors seen are <= 1e-6), 1e-6 for RoPE (no sums), 1e-10 for the double
 * sum of squares; top-K ids, argmax and hit counts exact. A wrong term, scale
 * or edge is off by O(1e-2) or more. DF_REF_VERBOSE=1 prints each error. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref_ops.h"
#include "testutil.h"
#include "train/dflash2.h"
#include "train/ops.h"

static uint64_t lcg = 2024;
static float frand(void) { /* uniform in [-1, 1) */
  lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
  return (float)((lcg >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}
static float *rnd(size_t n, float scale) {
  float *p = malloc((n ? n : 1) * sizeof *p);
  for (size_t i = 0; i < n; i++) p[i] = frand() * scale;
  return p;
}
static float *dup(const float *x, size_t n) {
  float *p = malloc((n ? n : 1) * sizeof *p);
  if (n) memcpy(p, x, n * sizeof *p);
  return p;
}

static df_pool *pool_of(int i) {
  static df_pool *p3;
  if (i == 0) return NULL;
  if (!p3) ck_assert_ok(df_pool_create(3, &p3));
  return p3;
}

static double rel_err(const float *got, const float *ref, size_t n) {
  double scale = 1, e = 0;
  for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(ref[i]));
  for (size_t i = 0; i < n; i++) {
    double d = fabs((double)got[i] - ref[i]);
    e = fmax(e, isnan(d) ? INFINITY : d);
  }
  return e / scale;
}

static void report(const char *what, const char *shape, double err, double tol) {
  if (getenv("DF_REF_VERBOSE"))
    fprintf(stderr, "ref %-22s %-40s err %.3g (tol %g)\n", what, shape, err, tol);
  ck_assert_msg(err <= tol, "%s at %s: tuned vs reference error %g > %g", what, shape, err, tol);
}

static void expect_close(const char *what, const char *shape, const float *got, const float *ref,
                         size_t n, double tol) {
  report(what, shape, rel_err(got, ref, n), tol);
}

/* ---- matmul --------------------------------------------------------------- */

static void matmul_case(df_pool *pool, int M, int N, int K, bool acc) {
  char sh[64];
  snprintf(sh, sizeof sh, "M%d N%d K%d acc%d pool%d", M, N, K, acc, pool != NULL);
  float *x = rnd((size_t)M * K, 1), *w = rnd((size_t)N * K, 1), *dy = rnd((size_t)M * N, 1);
  float *y = rnd((size_t)M * N, 1), *yr = dup(y, (size_t)M * N);
  df_matmul_forward(pool, y, x, w, M, N, K, acc);
  ref_matmul_forward(yr, x, w, M, N, K, acc);
  expect_close("matmul y", sh, y, yr, (size_t)M * N, 1e-5);
  float *dx = rnd((size_t)M * K, 1), *dxr = dup(dx, (size_t)M * K);
  float *dw = rnd((size_t)N * K, 1), *dwr = dup(dw, (size_t)N * K);
  df_matmul_backward(pool, dx, dw, dy, x, w, M, N, K, acc);
  ref_matmul_backward(dxr, dwr, dy, x, w, M, N, K, acc);
  expect_close("matmul dx", sh, dx, dxr, (size_t)M * K, 1e-5);
  expect_close("matmul dw", sh, dw, dwr, (size_t)N * K, 1e-5);
  df_matmul_backward(pool, NULL, dw, dy, x, w, M, N, K, acc); /* dx NULL: dw only */
  ref_matmul_backward(NULL, dwr, dy, x, w, M, N, K, acc);
  expect_close("matmul dw (dx NULL)", sh, dw, dwr, (size_t)N * K, 1e-5);
  free(x), free(w), free(dy), free(y), free(yr), free(dx), free(dxr), free(dw), free(dwr);
}

/* The last three are over df_sgemm's split threshold (2^21 multiply-adds): on the
 * pool they are cut into blocks of rows (M > N) or of columns, in tiles of 8 and 16
 * that do not divide them, in every transpose the forward and backward use. */
START_TEST(vs_ref_matmul) {
  static const int shapes[][3] = {{1, 1, 1},   {7, 13, 5},     {33, 65, 129},  {64, 1, 300},
                                  {2, 97, 16}, {131, 71, 301}, {51, 333, 203}, {9, 1013, 257}};
  for (int p = 0; p < 2; p++)
    for (size_t i = 0; i < DF_ARRAY_LEN(shapes); i++)
      for (int acc = 0; acc < 2; acc++)
        matmul_case(pool_of(p), shapes[i][0], shapes[i][1], shapes[i][2], acc);
}
END_TEST

/* ---- RMSNorm (rows in grains of 64, dw columns in grains of 16) ----------- */

static void rmsnorm_case(df_pool *pool, int rows, int n, bool acc) {
  char sh[64];
  snprintf(sh, sizeof sh, "rows%d n%d acc%d pool%d", rows, n, acc, pool != NULL);
  size_t N = (size_t)rows * n;
  float *x = rnd(N, 2), *w = rnd((size_t)n, 1), *dy = rnd(N, 1), *y = rnd(N, 1), *yr = dup(y, N);
  float *rs = rnd((size_t)rows, 1), *rsr = dup(rs, (size_t)rows);
  df_rmsnorm_forward(pool, y, rs, x, w, rows, n, 1e-6f);
  ref_rmsnorm_forward(yr, rsr, x, w, rows, n, 1e-6f);
  expect_close("rmsnorm y", sh, y, yr, N, 1e-5);
  expect_close("rmsnorm rstd", sh, rs, rsr, (size_t)rows, 1e-5);
  float *dx = rnd(N, 1), *dxr = dup(dx, N), *dw = rnd((size_t)n, 1), *dwr = dup(dw, (size_t)n);
  df_rmsnorm_backward(pool, dx, dw, dy, x, w, rsr, rows, n, acc);
  ref_rmsnorm_backward(dxr, dwr, dy, x, w, rsr, rows, n, acc);
  expect_close("rmsnorm dx", sh, dx, dxr, N, 1e-5);
  expect_close("rmsnorm dw", sh, dw, dwr, (size_t)n, 1e-5);
  free(x), free(w), free(dy), free(y), free(yr), free(rs), free(rsr);
  free(dx), free(dxr), free(dw), free(dwr);
}

START_TEST(vs_ref_rmsnorm) {
  static const int shapes[][2] = {{1, 1}, {65, 17}, {130, 100}, {3, 33}};
  for (int p = 0; p < 2; p++)
    for (size_t i = 0; i < DF_ARRAY_LEN(shapes); i++)
      for (int acc = 0; acc < 2; acc++) rmsnorm_case(pool_of(p), shapes[i][0], shapes[i][1], acc);
}
END_TEST

/* ---- RoPE ----------------------------------------------------------------- */

static void rope_case(df_pool *pool, int rows, int heads, int d, int rot) {
  char sh[64];
  snprintf(sh, sizeof sh, "rows%d heads%d d%d rot%d pool%d", rows, heads, d, rot, pool != NULL);
  enum { NPOS = 50 };
  int half = rot / 2;
  float *cs = malloc(sizeof(float) * NPOS * (size_t)half),
        *sn = malloc(sizeof(float) * NPOS * (size_t)half);
  for (int p = 0; p < NPOS; p++)
    for (int i = 0; i < half; i++) /* a YaRN-like attention factor 1.2 scales both */
      cs[p * half + i] = (float)(1.2 * cos(p * pow(100.0, -(double)i / half))),
                    sn[p * half + i] = (float)(1.2 * sin(p * pow(100.0, -(double)i / half)));
  int32_t *pos = malloc(sizeof(int32_t) * (size_t)rows);
  for (int r = 0; r < rows; r++) pos[r] = (int32_t)((frand() + 1) * 0.5f * (NPOS - 1));
  size_t N = (size_t)rows * heads * d;
  float *x = rnd(N, 1), *xr = dup(x, N), *g = rnd(N, 1), *gr = dup(g, N);
  df_rope_forward(pool, x, pos, cs, sn, rows, heads, d, rot);
  ref_rope_forward(xr, pos, cs, sn, rows, heads, d, rot);
  expect_close("rope forward", sh, x, xr, N, 1e-6);
  df_rope_backward(pool, g, pos, cs, sn, rows, heads, d, rot);
  ref_rope_backward(gr, pos, cs, sn, rows, heads, d, rot);
  expect_close("rope backward", sh, g, gr, N, 1e-6);
  free(cs), free(sn), free(pos), free(x), free(xr), free(g), free(gr);
}

START_TEST(vs_ref_rope) {
  static const int shapes[][4] = {{1, 1, 2, 2}, {67, 3, 10, 10}, {67, 3, 10, 6}, {130, 2, 8, 4}};
  for (int p = 0; p < 2; p++)
    for (size_t i = 0; i < DF_ARRAY_LEN(shapes); i++)
      rope_case(pool_of(p), shapes[i][0], shapes[i][1], shapes[i][2], shapes[i][3]);
}
END_TEST

/* ---- attention ------------------------------------------------------------ */

typedef struct attn_case {
  int n_blocks, B, Sc, nh, nkv, d, window;
  int32_t anchors[4];
} attn_case;

typedef struct attn_bufs {
  float *q, *kc, *vc, *kb, *vb, *dout;
  size_t nq, nc, nb, nl;
} attn_bufs;

static void attn_bufs_make(const df_attn_shape *s, attn_bufs *b) {
  size_t T = (size_t)s->n_blocks * s->B;
  b->nq = T * s->nh * s->d, b->nc = (size_t)s->Sc * s->nkv * s->d, b->nb = T * s->nkv * s->d;
  b->nl = T * s->nh;
  b->q = rnd(b->nq, 2), b->kc = rnd(b->nc, 2), b->vc = rnd(b->nc, 1), b->kb = rnd(b->nb, 2);
  b->vb = rnd(b->nb, 1), b->dout = rnd(b->nq, 1);
}

static void attn_forward_check(df_pool *pool, const df_attn_shape *s, const attn_bufs *b,
                               const char *sh, float *out, float *lse) {
  float *work = malloc(sizeof(float) * (df_attention_work(pool, s) + 1));
  float *outr = malloc(sizeof(float) * b->nq), *lser = malloc(sizeof(float) * b->nl);
  df_attention_forward(pool, s, out, lse, b->q, b->kc, b->vc, b->kb, b->vb, work);
  ref_attention_forward(s, outr, lser, b->q, b->kc, b->vc, b->kb, b->vb);
  expect_close("attention out", sh, out, outr, b->nq, 1e-5);
  expect_close("attention lse", sh, lse, lser, b->nl, 1e-5);
  free(work), free(outr), free(lser);
}

static void attn_backward_check(df_pool *pool, const df_attn_shape *s, const attn_bufs *b,
                                const char *sh, const float *out, const float *lse) {
  float *work = malloc(sizeof(float) * (df_attention_work(pool, s) + 1));
  float *g[5], *gr[5];
  size_t n[5] = {b->nq, b->nc, b->nc, b->nb, b->nb};
  for (int i = 0; i < 5; i++) g[i] = rnd(n[i], 1), gr[i] = rnd(n[i], 1); /* overwritten */
  df_attention_backward(pool, s, g[0], g[1], g[2], g[3], g[4], work, b->dout, out, lse, b->q, b->kc,
                        b->vc, b->kb, b->vb);
  ref_attention_backward(s, gr[0], gr[1], gr[2], gr[3], gr[4], b->dout, b->q, b->kc, b->vc, b->kb,
                         b->vb);
  static const char *names[5] = {"attention dq", "attention dk context", "attention dv context",
                                 "attention dk block", "attention dv block"};
  for (int i = 0; i < 5; i++) expect_close(names[i], sh, g[i], gr[i], n[i], 1e-5);
  for (int i = 0; i < 5; i++) free(g[i]), free(gr[i]);
  free(work);
}

static void attention_case(df_pool *pool, const attn_case *c) {
  df_attn_shape s = {.n_blocks = c->n_blocks,
                     .B = c->B,
                     .Sc = c->Sc,
                     .nh = c->nh,
                     .nkv = c->nkv,
                     .d = c->d,
                     .window = c->window,
                     .anchors = c->anchors};
  char sh[96];
  snprintf(sh, sizeof sh, "blocks%d B%d Sc%d nh%d nkv%d d%d win%d a0=%d pool%d", c->n_blocks, c->B,
           c->Sc, c->nh, c->nkv, c->d, c->window, c->anchors[0], pool != NULL);
  attn_bufs b;
  attn_bufs_make(&s, &b);
  float *out = malloc(sizeof(float) * b.nq), *lse = malloc(sizeof(float) * b.nl);
  attn_forward_check(pool, &s, &b, sh, out, lse);
  attn_backward_check(pool, &s, &b, sh, out, lse);
  free(out), free(lse), free(b.q), free(b.kc), free(b.vc), free(b.kb), free(b.vb), free(b.dout);
}

/* Sc 9 / 17 / 33 cross the 8-row context tiles; anchors 0 (no context), at a
 * tile edge (8, 16) and at Sc; GQA 2:1, 3:1, 4:1 and plain MHA; windows 1
 * (only itself), 2, 3 and wider than everything; B 1; d odd and a multiple of 8. */
static const attn_case ATTN_CASES[] = {
    {3, 4, 9, 4, 2, 6, 0, {2, 5, 9}},   {3, 4, 9, 4, 2, 6, 3, {2, 5, 9}},
    {2, 5, 17, 3, 1, 9, 0, {0, 17}},    {4, 3, 16, 2, 2, 8, 2, {0, 8, 16, 7}},
    {2, 1, 1, 1, 1, 1, 0, {0, 1}},      {2, 4, 0, 2, 1, 5, 0, {0, 0}},
    {2, 4, 20, 4, 4, 16, 10, {20, 13}}, {2, 3, 10, 2, 1, 7, 1, {4, 10}},
    {2, 16, 33, 8, 2, 12, 0, {33, 20}}, {3, 16, 33, 4, 1, 11, 5, {0, 31, 33}},
};

START_TEST(vs_ref_attention) {
  for (int p = 0; p < 2; p++)
    for (size_t i = 0; i < DF_ARRAY_LEN(ATTN_CASES); i++)
      attention_case(pool_of(p), &ATTN_CASES[i]);
}
END_TEST

/* ---- SwiGLU (grains of 4096) ---------------------------------------------- */

START_TEST(vs_ref_swiglu) {
  static const size_t sizes[] = {1, 4097, 9001};
  for (int p = 0; p < 2; p++)
    for (size_t i = 0; i < DF_ARRAY_LEN(sizes); i++) {
      size_t n = sizes[i];
      char sh[64];
      snprintf(sh, sizeof sh, "n%zu pool%d", n, p);
      float *g = rnd(n, 8), *u = rnd(n, 1), *dm = rnd(n, 1), *m = rnd(n, 1), *mr = rnd(n, 1);
      float *dg = rnd(n, 1), *du = rnd(n, 1), *dgr = rnd(n, 1), *dur = rnd(n, 1);
      df_swiglu_forward(pool_of(p), m, g, u, n);
      ref_swiglu_forward(mr, g, u, n);
      expect_close("swiglu m", sh, m, mr, n, 1e-5);
      df_swiglu_backward(pool_of(p), dg, du, dm, g, u, n);
      ref_swiglu_backward(dgr, dur, dm, g, u, n);
      expect_close("swiglu dg", sh, dg, dgr, n, 1e-5);
      expect_close("swiglu du", sh, du, dur, n, 1e-5);
      free(g), free(u), free(dm), free(m), free(mr), free(dg), free(du), free(dgr), free(dur);
    }
}
END_TEST

/* ---- LM head + CE, top-K, argmax ------------------------------------------ */

typedef struct ce_case {
  int R, H, V, chunk, top_k;
} ce_case;

static void ce_inputs(const ce_case *c, int32_t *tgt, float *coef) {
  for (int r = 0; r < c->R; r++) {
    tgt[r] = r == 0 ? 0 : r == 1 ? c->V - 1 : (int32_t)((frand() + 1) * 0.5f * (c->V - 1));
    coef[r] = r % 3 == 2 ? 0.0f : 0.5f + (float)r / c->R; /* every third row masked */
  }
}

static void expect_loss(const char *sh, const double *l, const double *lr, int R) {
  float a[64], b[64];
  for (int r = 0; r < R; r++) a[r] = (float)l[r], b[r] = (float)lr[r];
  expect_close("lmhead ce loss", sh, a, b, (size_t)R, 1e-5);
}

static void expect_topk(const char *sh, const int32_t *ids, const int32_t *idr, const float *v,
                        const float *vr, size_t n) {
  expect_close("lmhead top-k logits", sh, v, vr, n, 1e-5);
  for (size_t i = 0; i < n; i++)
    ck_assert_msg(ids[i] == idr[i], "top-k at %s [%zu]: tuned %d, reference %d", sh, i, ids[i],
                  idr[i]);
}

static void ce_case_run(df_pool *pool, const ce_case *c, bool grad) {
  char sh[80];
  snprintf(sh, sizeof sh, "R%d H%d V%d chunk%d k%d grad%d pool%d", c->R, c->H, c->V, c->chunk,
           c->top_k, grad, pool != NULL);
  size_t RH = (size_t)c->R * c->H, RK = (size_t)c->R * (c->top_k ? c->top_k : 1);
  float *x = rnd(RH, 1), *E = rnd((size_t)c->V * c->H, 1), coef[64];
  int32_t tgt[64], *ids = malloc(sizeof(int32_t) * RK), *idr = malloc(sizeof(int32_t) * RK);
  ce_inputs(c, tgt, coef);
  float *work = malloc(sizeof(float) * df_lmhead_work(c->R, c->H, c->chunk));
  float *dx = grad ? rnd(RH, 1) : NULL, *dxr = rnd(RH, 1);
  float *v = malloc(sizeof(float) * RK), *vr = malloc(sizeof(float) * RK);
  double loss[64], lr[64];
  df_lmhead_ce_topk(pool, loss, dx, x, E, tgt, coef, c->R, c->H, c->V, c->chunk, work, c->top_k,
                    ids, v);
  ref_lmhead_ce(lr, dxr, x, E, tgt, coef, c->R, c->H, c->V, c->top_k, idr, vr);
  expect_loss(sh, loss, lr, c->R);
  if (grad) expect_close("lmhead ce dx", sh, dx, dxr, RH, 1e-5);
  if (c->top_k) expect_topk(sh, ids, idr, v, vr, (size_t)c->R * c->top_k);
  df_lmhead_ce(pool, loss, dx, x, E, tgt, coef, c->R, c->H, c->V, c->chunk, work);
  expect_loss(sh, loss, lr, c->R);
  if (grad) expect_close("lmhead ce dx (no top-k)", sh, dx, dxr, RH, 1e-5);
  free(x), free(E), free(ids), free(idr), free(work), free(dx), free(dxr), free(v), free(vr);
}

/* Chunks that do not divide V (7 of 30), equal V, exceed V, or are 1; R 17
 * crosses the row grain 16; top_k 0, 1, a few, and V. The last case's products
 * are over df_sgemm's split threshold: on the pool, the logits and the gradient
 * GEMMs are cut into blocks of columns (the short last chunk is not). */
static const ce_case CE_CASES[] = {{4, 10, 30, 7, 5},      {17, 33, 64, 64, 1},
                                   {1, 8, 5, 100, 5},      {20, 16, 50, 1, 3},
                                   {3, 12, 41, 16, 0},     {33, 24, 130, 32, 8},
                                   {40, 130, 1100, 512, 4}};

START_TEST(vs_ref_lmhead_ce) {
  for (int p = 0; p < 2; p++)
    for (size_t i = 0; i < DF_ARRAY_LEN(CE_CASES); i++)
      for (int grad = 0; grad < 2; grad++) ce_case_run(pool_of(p), &CE_CASES[i], grad);
}
END_TEST

START_TEST(vs_ref_lmhead_argmax) {
  static const int chunks[] = {1, 8, 37, 64};
  enum { R = 5, H = 9, V = 37 };
  float *x = rnd(R * H, 1), *E = rnd(V * H, 1), *work = malloc(sizeof(float) * R * (64 + 1));
  int32_t out[R], ref[R];
  ref_lmhead_argmax(x, E, ref, R, H, V);
  for (size_t c = 0; c < 2 * DF_ARRAY_LEN(chunks); c++) {
    df_lmhead_argmax(pool_of(c & 1), x, E, out, R, H, V, chunks[c / 2], work);
    for (int r = 0; r < R; r++)
      ck_assert_msg(out[r] == ref[r], "argmax chunk %d row %d: tuned %d, reference %d",
                    chunks[c / 2], r, out[r], ref[r]);
  }
  free(x), free(E), free(work);
}
END_TEST

/* df_topk_insert with many exact ties (values 0..4), offered in id order. */
START_TEST(vs_ref_topk_insert) {
  static const int ks[] = {1, 5, 50};
  enum { N = 50 };
  float vals[N];
  for (int v = 0; v < N; v++) vals[v] = (float)(int)((frand() + 1) * 2.5f);
  for (size_t i = 0; i < DF_ARRAY_LEN(ks); i++) {
    int k = ks[i], n = 0;
    int32_t ids[N], idr[N];
    float top[N], topr[N];
    for (int v = 0; v < N; v++) n = df_topk_insert(ids, top, n, k, v, vals[v]);
    ref_topk(vals, N, k, idr, topr);
    ck_assert_int_eq(n, k);
    for (int c = 0; c < k; c++)
      ck_assert_msg(ids[c] == idr[c] && top[c] == topr[c],
                    "top-%d [%d]: tuned %d (%g), "
                    "reference %d (%g)",
                    k, c, ids[c], top[c], idr[c], topr[c]);
  }
}
END_TEST

/* ---- sum of squares (chunks of max(4096, n/1024 + 1)) --------------------- */

START_TEST(vs_ref_sumsq) {
  static const size_t sizes[] = {0, 1, 4097, 3 * 4096 + 5, 4200001};
  for (int p = 0; p < 2; p++)
    for (size_t i = 0; i < DF_ARRAY_LEN(sizes); i++) {
      float *x = rnd(sizes[i], 1);
      double got = df_sumsq(pool_of(p), x, sizes[i]), ref = ref_sumsq(x, sizes[i]);
      char sh[48];
      snprintf(sh, sizeof sh, "n%zu pool%d", sizes[i], p);
      report("sumsq", sh, fabs(got - ref) / fmax(1, ref), 1e-10);
      free(x);
    }
}
END_TEST

/* ---- DFlash 2 convolution (rows in grains of 16) -------------------------- */

typedef struct conv_case {
  int n_blocks, B, H, k, g, pad;
  bool residual;
} conv_case;

static void conv_case_run(df_pool *pool, const conv_case *c) {
  char sh[80];
  snprintf(sh, sizeof sh, "blocks%d B%d H%d k%d g%d stride+%d res%d pool%d", c->n_blocks, c->B,
           c->H, c->k, c->g, c->pad, c->residual, pool != NULL);
  int T = c->n_blocks * c->B;
  size_t stride = (size_t)c->k * (c->H / c->g) + (size_t)c->pad, TH = (size_t)T * c->H;
  size_t nd = (size_t)T * stride, nb = (size_t)c->k * c->H;
  float *x = rnd(TH, 1), *dyn = rnd(nd, 1), *base = rnd(nb, 1), *dout = rnd(TH, 1);
  float *res = c->residual ? rnd(TH, 1) : NULL, *out = rnd(TH, 1), *outr = rnd(TH, 1);
  df2_conv_apply(pool, out, x, dyn, stride, base, res, T, c->B, c->H, c->k, c->g);
  ref_conv_apply(outr, x, dyn, stride, base, res, T, c->B, c->H, c->k, c->g);
  expect_close("conv out", sh, out, outr, TH, 1e-5);
  /* ddyn's stride padding starts equal on both sides and must stay so. */
  float *dx = rnd(TH, 1), *dxr = rnd(TH, 1), *dd = rnd(nd, 1), *ddr = dup(dd, nd);
  float *db = rnd(nb, 1), *dbr = dup(db, nb);
  df2_conv_backward(pool, dx, dd, db, dout, x, dyn, stride, base, T, c->B, c->H, c->k, c->g);
  ref_conv_backward(dxr, ddr, dbr, dout, x, dyn, stride, base, T, c->B, c->H, c->k, c->g);
  expect_close("conv dx", sh, dx, dxr, TH, 1e-5);
  expect_close("conv ddyn", sh, dd, ddr, nd, 1e-5);
  expect_close("conv dbase", sh, db, dbr, nb, 1e-5);
  free(x), free(dyn), free(base), free(dout), free(res), free(out), free(outr);
  free(dx), free(dxr), free(dd), free(ddr), free(db), free(dbr);
}

/* k < B, k == B, k > B, B 1; groups of 1, 3, 4 and all H channels; the
 * model's dyn strides (2 k G: the second half's kernels sit after the first). */
static const conv_case CONV_CASES[] = {{3, 4, 12, 3, 4, 0, true},  {2, 5, 12, 5, 3, 20, false},
                                       {1, 17, 6, 4, 1, 24, true}, {4, 2, 8, 3, 8, 3, true},
                                       {5, 1, 4, 2, 2, 0, false},  {2, 16, 10, 4, 2, 20, true}};

START_TEST(vs_ref_conv) {
  for (int p = 0; p < 2; p++)
    for (size_t i = 0; i < DF_ARRAY_LEN(CONV_CASES); i++) conv_case_run(pool_of(p), &CONV_CASES[i]);
}
END_TEST

/* ---- DFlash 2 selector: top-K of the LM head, the selector loss ----------- */

START_TEST(vs_ref_lmhead_topk) {
  enum { R = 6, H = 10, V = 40, K = 5 };
  static const int chunks[] = {1, 7, 40, 64};
  float *x = rnd(R * H, 1), *E = rnd(V * H, 1), *scratch = malloc(sizeof(float) * R * 64);
  float v[R * K], vr[R * K], l[V];
  int32_t ids[R * K], idr[R * K];
  for (int r = 0; r < R; r++) {
    for (int u = 0; u < V; u++) {
      double s = 0;
      for (int i = 0; i < H; i++) s += (double)x[r * H + i] * E[u * H + i];
      l[u] = (float)s;
    }
    ref_topk(l, V, K, idr + r * K, vr + r * K);
  }
  for (size_t c = 0; c < DF_ARRAY_LEN(chunks); c++) {
    char sh[32];
    snprintf(sh, sizeof sh, "R6 H10 V40 K5 chunk%d", chunks[c]);
    df2_lmhead_topk(x, E, R, H, V, chunks[c], K, ids, v, scratch);
    expect_topk(sh, ids, idr, v, vr, R * K);
  }
  free(x), free(E), free(scratch);
}
END_TEST

typedef struct sel_bufs {
  float *dx, *dpred, *dsucc, *dhproj;
} sel_bufs;

static void sel_bufs_make(sel_bufs *b, const sel_bufs *from, int R, int H, int V, int r) {
  size_t n[4] = {(size_t)R * H, (size_t)V * r, (size_t)V * r, (size_t)r * H};
  float **p[4] = {&b->dx, &b->dpred, &b->dsucc, &b->dhproj};
  const float *f[4] = {from ? from->dx : NULL, from ? from->dpred : NULL, from ? from->dsucc : NULL,
                       from ? from->dhproj : NULL};
  for (int i = 0; i < 4; i++) *p[i] = from ? dup(f[i], n[i]) : rnd(n[i], 0.1f);
}

static void sel_case(bool inject, bool own_cand) {
  enum { R = 8, H = 10, V = 40, r = 4, K = 5, CH = 7 };
  char sh[48];
  snprintf(sh, sizeof sh, "R8 H10 V40 r4 K5 inject%d cand%s", inject, own_cand ? "own" : "ce");
  float *x = rnd(R * H, 1), *E = rnd(V * H, 1), *pred = rnd(V * r, 1), *succ = rnd(V * r, 1);
  float *hproj = rnd(r * H, 1), coef[R], *work = malloc(sizeof(float) * df_lmhead_work(R, H, CH));
  int32_t tgt[R], prev[R], cand[R * K];
  float unary[R * K];
  double w[R], loss, hits, lr, hr, ce[R];
  for (int i = 0; i < R; i++) /* even rows: a random (likely missed) target */
    tgt[i] = (i * 13 + 3) % V, prev[i] = (i * 7) % V, coef[i] = 0.25f * (i + 1), w[i] = 0.5 + i;
  df_lmhead_ce_topk(NULL, ce, NULL, x, E, tgt, coef, R, H, V, CH, work, K, cand, unary);
  for (int i = 1; i < R; i += 2) tgt[i] = cand[i * K + i % K]; /* odd rows: a hit */
  sel_bufs g, gr;
  sel_bufs_make(&g, NULL, R, H, V, r);
  sel_bufs_make(&gr, &g, R, H, V, r);
  df2_sel_args s = {.x = x,
                    .E = E,
                    .pred = pred,
                    .succ = succ,
                    .hproj = hproj,
                    .target = tgt,
                    .prev = prev,
                    .coef = coef,
                    .w = w,
                    .R = R,
                    .H = H,
                    .V = V,
                    .r = r,
                    .K = K,
                    .chunk = CH,
                    .inject = inject,
                    .cand = own_cand ? NULL : cand,
                    .unary = own_cand ? NULL : unary,
                    .dx = g.dx,
                    .dpred = g.dpred,
                    .dsucc = g.dsucc,
                    .dhproj = g.dhproj};
  ck_assert_ok(df2_selector_loss(&s, &loss, &hits));
  s.dx = gr.dx, s.dpred = gr.dpred, s.dsucc = gr.dsucc, s.dhproj = gr.dhproj;
  ref_selector_loss(&s, &lr, &hr);
  ck_assert_double_eq(hits, hr);
  report("selector loss", sh, fabs(loss - lr) / fmax(1, fabs(lr)), 1e-5);
  expect_close("selector dx", sh, g.dx, gr.dx, R * H, 1e-5);
  expect_close("selector dpred", sh, g.dpred, gr.dpred, V * r, 1e-5);
  expect_close("selector dsucc", sh, g.dsucc, gr.dsucc, V * r, 1e-5);
  expect_close("selector dhproj", sh, g.dhproj, gr.dhproj, r * H, 1e-5);
  float *ptrs[] = {x,       E,       pred,     succ,  hproj,    work,     g.dx,
                   g.dpred, g.dsucc, g.dhproj, gr.dx, gr.dpred, gr.dsucc, gr.dhproj};
  for (size_t i = 0; i < DF_ARRAY_LEN(ptrs); i++) free(ptrs[i]);
}

START_TEST(vs_ref_selector_loss_drop_inject) {
  for (int inject = 0; inject < 2; inject++)
    for (int own = 0; own < 2; own++) sel_case(inject, own);
}
END_TEST

TCase *tc_ref_ops(void) {
  TCase *tc = tcase_create("ref_ops");
  tcase_add_test(tc, vs_ref_matmul);
  tcase_add_test(tc, vs_ref_rmsnorm);
  tcase_add_test(tc, vs_ref_rope);
  tcase_add_test(tc, vs_ref_attention);
  tcase_add_test(tc, vs_ref_swiglu);
  tcase_add_test(tc, vs_ref_lmhead_ce);
  tcase_add_test(tc, vs_ref_lmhead_argmax);
  tcase_add_test(tc, vs_ref_topk_insert);
  tcase_add_test(tc, vs_ref_sumsq);
  tcase_add_test(tc, vs_ref_conv);
  tcase_add_test(tc, vs_ref_lmhead_topk);
  tcase_add_test(tc, vs_ref_selector_loss_drop_inject);
  return tc;
}
