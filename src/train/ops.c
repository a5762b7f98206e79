/* Forward and backward of every layer kind of the drafter (see ops.h). */
#include "ops.h"

#include <cblas.h>
#include <dflash/train.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Hot loops get an AVX2 clone picked at load time (GCC/clang ifunc); the
 * build's baseline stays generic x86-64. ISO C mode keeps floating-point
 * contraction off, so both clones compute bit-identical results. Not under
 * sanitizers: an instrumented ifunc resolver runs during relocation, before the
 * sanitizer runtime is up (TSan crashes there). gcc says __SANITIZE_*__, clang
 * __has_feature. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DF_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define DF_SANITIZED 1
#endif
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(DF_SANITIZED) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define DF_HOT __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef DF_HOT
#define DF_HOT
#endif
#define DF_INLINE static inline __attribute__((always_inline))

/* ---- matmul --------------------------------------------------------------- */

typedef struct gemm_ctx {
  bool ta, tb, split_m;
  int M, N, K, parts, align;
  float alpha, beta;
  const float *A, *B;
  float *C;
  int lda, ldb, ldc;
} gemm_ctx;

/* Part i of the split dimension, in multiples of align (the kernels' tile). */
static void gemm_range(const gemm_ctx *g, size_t i, int *lo, int *hi) {
  int n = g->split_m ? g->M : g->N, tiles = (n + g->align - 1) / g->align;
  *lo = (int)((size_t)tiles * i / (size_t)g->parts) * g->align;
  *hi = (int)((size_t)tiles * (i + 1) / (size_t)g->parts) * g->align;
  if (*hi > n) *hi = n;
}

static void gemm_parts(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  const gemm_ctx *g = vc;
  for (size_t i = b; i < e; i++) {
    int lo, hi;
    gemm_range(g, i, &lo, &hi);
    if (hi <= lo) continue;
    const float *A = g->A, *B = g->B;
    float *C = g->C;
    int M = g->M, N = g->N;
    if (g->split_m) {
      A += g->ta ? (size_t)lo : (size_t)lo * g->lda, C += (size_t)lo * g->ldc, M = hi - lo;
    } else {
      B += g->tb ? (size_t)lo * g->ldb : (size_t)lo, C += lo, N = hi - lo;
    }
    cblas_sgemm(CblasRowMajor, g->ta ? CblasTrans : CblasNoTrans, g->tb ? CblasTrans : CblasNoTrans,
                M, N, g->K, g->alpha, A, g->lda, B, g->ldb, g->beta, C, g->ldc);
  }
}

/* Below this many multiply-adds a product runs whole on the calling thread: the
 * pool's wake-up (a futex round trip, ~10-50 us) would cost more than it saves. */
#define GEMM_SPLIT_MIN (1 << 21)

void df_sgemm(df_pool *pool, bool ta, bool tb, int M, int N, int K, float alpha, const float *A,
              int lda, const float *B, int ldb, float beta, float *C, int ldc) {
  int parts = df_pool_size(pool);
  if (parts <= 1 || (double)M * N * K < GEMM_SPLIT_MIN) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N,
                K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  /* Each part is a whole block of C's rows or columns, so every element of C is
   * one call's, summed over K in that call's order: the same bits for any split. */
  gemm_ctx g = {.ta = ta,
                .tb = tb,
                .split_m = M > N,
                .M = M,
                .N = N,
                .K = K,
                .parts = parts,
                .alpha = alpha,
                .beta = beta,
                .A = A,
                .B = B,
                .C = C,
                .lda = lda,
                .ldb = ldb,
                .ldc = ldc};
  g.align = g.split_m ? 8 : 16;
  df_pool_for(pool, (size_t)parts, 1, gemm_parts, &g);
}

void df_matmul_forward(df_pool *pool, float *y, const float *x, const float *w, int M, int N, int K,
                       bool accumulate) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!accumulate) memset(y, 0, sizeof(float) * (size_t)M * (size_t)N);
    return;
  }
  df_sgemm(pool, false, true, M, N, K, 1.0f, x, K, w, K, accumulate ? 1.0f : 0.0f, y, N);
}

void df_matmul_backward(df_pool *pool, float *dx, float *dw, const float *dy, const float *x,
                        const float *w, int M, int N, int K, bool accumulate_dx) {
  if (M <= 0 || N <= 0 || K <= 0) return;
  if (dx)
    df_sgemm(pool, false, false, M, K, N, 1.0f, dy, N, w, K, accumulate_dx ? 1.0f : 0.0f, dx, K);
  if (dw) df_sgemm(pool, true, false, N, K, M, 1.0f, dy, N, x, K, 1.0f, dw, K);
}

/* ---- RMSNorm -------------------------------------------------------------- */

typedef struct rms_ctx {
  float *y, *dx, *dw, *rstd;
  const float *x, *w, *dy, *rstd_in;
  int n;
  float eps;
  bool acc;
} rms_ctx;

DF_HOT static void rms_fwd_rows(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  rms_ctx *c = vc;
  for (size_t r = b; r < e; r++) {
    const float *x = c->x + r * (size_t)c->n;
    float *y = c->y + r * (size_t)c->n;
    double ss = 0;
    for (int i = 0; i < c->n; i++) ss += (double)x[i] * x[i];
    float rs = (float)(1.0 / sqrt(ss / c->n + c->eps));
    c->rstd[r] = rs;
    for (int i = 0; i < c->n; i++) y[i] = c->w[i] * (x[i] * rs);
  }
}

void df_rmsnorm_forward(df_pool *pool, float *y, float *rstd, const float *x, const float *w,
                        int rows, int n, float eps) {
  rms_ctx c = {.y = y, .rstd = rstd, .x = x, .w = w, .n = n, .eps = eps};
  df_pool_for(pool, (size_t)rows, 64, rms_fwd_rows, &c);
}

DF_HOT static void rms_bwd_rows(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  rms_ctx *c = vc;
  for (size_t r = b; r < e; r++) {
    const float *x = c->x + r * (size_t)c->n, *dy = c->dy + r * (size_t)c->n;
    float *dx = c->dx + r * (size_t)c->n;
    float rs = c->rstd_in[r];
    double dot = 0; /* sum of (dy*w) * x */
    for (int i = 0; i < c->n; i++) dot += (double)dy[i] * c->w[i] * x[i];
    float k = (float)(dot / c->n) * rs * rs * rs;
    for (int i = 0; i < c->n; i++) {
      float v = dy[i] * c->w[i] * rs - k * x[i];
      dx[i] = c->acc ? dx[i] + v : v;
    }
  }
}

/* dw[i] = sum over rows of dy*x*rstd: one task per column range, rows in order. */
typedef struct rms_dw_ctx {
  const rms_ctx *c;
  size_t rows;
} rms_dw_ctx;

DF_HOT static void rms_dw_cols(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  rms_dw_ctx *d = vc;
  const rms_ctx *c = d->c;
  for (size_t i = b; i < e; i++) {
    double s = 0;
    for (size_t r = 0; r < d->rows; r++)
      s += (double)c->dy[r * (size_t)c->n + i] * c->x[r * (size_t)c->n + i] * c->rstd_in[r];
    c->dw[i] += (float)s;
  }
}

void df_rmsnorm_backward(df_pool *pool, float *dx, float *dw, const float *dy, const float *x,
                         const float *w, const float *rstd, int rows, int n, bool accumulate_dx) {
  rms_ctx c = {
      .dx = dx, .dw = dw, .x = x, .w = w, .dy = dy, .rstd_in = rstd, .n = n, .acc = accumulate_dx};
  if (dx) df_pool_for(pool, (size_t)rows, 64, rms_bwd_rows, &c);
  if (dw) {
    rms_dw_ctx d = {&c, (size_t)rows};
    df_pool_for(pool, (size_t)n, 16, rms_dw_cols, &d);
  }
}

/* ---- RoPE ----------------------------------------------------------------- */

static double yarn_correction_dim(double rotations, int dim, double base, double max_pos) {
  return (dim * log(max_pos / (rotations * 2.0 * M_PI))) / (2.0 * log(base));
}

void df_rope_inv_freq(const dflash_drafter_config *cfg, int rot, double *inv_freq,
                      double *attn_factor) {
  int d = rot, half = d / 2;
  double base = cfg->rope_theta;
  for (int i = 0; i < half; i++) inv_freq[i] = 1.0 / pow(base, (2.0 * i) / d);
  *attn_factor = 1.0;
  if (cfg->rope_type != DFLASH_ROPE_YARN) return;
  /* YaRN (Peng et al.), as Hugging Face's _compute_yarn_parameters: blend
   * interpolated and extrapolated frequencies with a linear ramp between the
   * correction dims of beta_fast and beta_slow rotations. */
  double max_pos = cfg->rope_original_max_position;
  double low = yarn_correction_dim(cfg->rope_beta_fast, d, base, max_pos);
  double high = yarn_correction_dim(cfg->rope_beta_slow, d, base, max_pos);
  if (cfg->rope_truncate) {
    low = floor(low);
    high = ceil(high);
  }
  if (low < 0) low = 0;
  if (high > d - 1) high = d - 1;
  if (low == high) high += 0.001;
  for (int i = 0; i < half; i++) {
    double ramp = (i - low) / (high - low);
    ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
    double extrapolation = 1.0 - ramp;
    double interp = inv_freq[i] / cfg->rope_factor;
    inv_freq[i] = interp * (1.0 - extrapolation) + inv_freq[i] * extrapolation;
  }
  *attn_factor = cfg->rope_attention_factor;
}

typedef struct rope_ctx {
  float *x;
  const int32_t *pos;
  const float *cos_t, *sin_t;
  int heads, d, rot;
  float sign; /* +1 forward, -1 backward (transpose rotation) */
} rope_ctx;

DF_HOT static void rope_rows(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  rope_ctx *c = vc;
  int half = c->rot / 2;
  for (size_t r = b; r < e; r++) {
    const float *cs = c->cos_t + (size_t)c->pos[r] * half;
    const float *sn = c->sin_t + (size_t)c->pos[r] * half;
    for (int h = 0; h < c->heads; h++) {
      float *x = c->x + (r * (size_t)c->heads + h) * (size_t)c->d;
      for (int i = 0; i < half; i++) {
        float a = x[i], bb = x[i + half], s = c->sign * sn[i];
        x[i] = a * cs[i] - bb * s;
        x[i + half] = bb * cs[i] + a * s;
      }
    }
  }
}

void df_rope_forward(df_pool *pool, float *x, const int32_t *pos, const float *cos_t,
                     const float *sin_t, int rows, int heads, int d, int rot) {
  rope_ctx c = {x, pos, cos_t, sin_t, heads, d, rot, 1.0f};
  df_pool_for(pool, (size_t)rows, 64, rope_rows, &c);
}

void df_rope_backward(df_pool *pool, float *dx, const int32_t *pos, const float *cos_t,
                      const float *sin_t, int rows, int heads, int d, int rot) {
  rope_ctx c = {dx, pos, cos_t, sin_t, heads, d, rot, -1.0f};
  df_pool_for(pool, (size_t)rows, 64, rope_rows, &c);
}

/* ---- attention ------------------------------------------------------------ */

/* Eight independent partial sums: the compiler vectorises this without
 * -ffast-math, and the order (hence the result) is fixed. */
DF_INLINE float dotf(const float *a, const float *b, int n) {
  float p[8] = {0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int k = 0; k < 8; k++) p[k] += a[i + k] * b[i + k];
  float s = ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7]));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

/* exp of a non-positive argument; below -87 the result is under float's
 * normal range and libm's underflow path is slow, so flush it to 0. */
DF_INLINE float expneg(float x) { return x < -87.0f ? 0.0f : expf(x); }

DF_INLINE void axpyf(float *y, float a, const float *x, int n) {
  for (int i = 0; i < n; i++) y[i] += a * x[i];
}

/* Visible context [*lo, *hi) and block offsets [*blo, *bhi) of query j. */
DF_INLINE void visible(const df_attn_shape *s, int n, int j, int *lo, int *hi, int *blo, int *bhi) {
  int a = s->anchors[n];
  *hi = a < s->Sc ? a : s->Sc;
  *lo = 0;
  *blo = 0;
  *bhi = s->B;
  if (s->window > 0) {
    int l = a + j - (s->window - 1);
    *lo = l > 0 ? l : 0;
    /* Sliding layers are causal inside the block, as SGLang serves them. */
    int bl = j - (s->window - 1);
    *blo = bl > 0 ? bl : 0;
    *bhi = j + 1;
  }
  if (*lo > *hi) *lo = *hi;
}

typedef struct attn_ctx {
  const df_attn_shape *s;
  float *out, *lse, *dq, *dkc, *dvc, *dkb, *dvb, *D;
  const float *q, *kc, *vc, *kb, *vb, *dout, *o;
  float *scratch; /* per worker: Sc + B floats */
  size_t scratch_stride;
  /* Context keys and values transposed per kv head, [nkv][d][sc8] with
   * sc8 = Sc rounded up to 8: scores against 8 keys at a time vectorise
   * over the keys instead of needing horizontal sums. */
  float *kt, *vt;
  size_t sc8;
  float scale;
} attn_ctx;

/* acc[l] = sum_k x[k] * rows[k * stride + l] for 8 lanes (always summed in k
 * order, so forward and backward recompute identical scores). */
DF_INLINE void tile_dot(float acc[8], const float *x, const float *rows, size_t stride, int d) {
  for (int l = 0; l < 8; l++) acc[l] = 0;
  for (int k = 0; k < d; k++) {
    const float *r = rows + (size_t)k * stride;
    for (int l = 0; l < 8; l++) acc[l] += x[k] * r[l];
  }
}

static void transpose_context(attn_ctx *c) {
  const df_attn_shape *s = c->s;
  size_t d = (size_t)s->d;
  for (int g = 0; g < s->nkv; g++)
    for (size_t k = 0; k < d; k++) {
      float *kt = c->kt + ((size_t)g * d + k) * c->sc8, *vt = c->vt + ((size_t)g * d + k) * c->sc8;
      for (size_t p = 0; p < c->sc8; p++) {
        bool in = p < (size_t)s->Sc;
        kt[p] = in ? c->kc[(p * s->nkv + g) * d + k] : 0.0f;
        vt[p] = in ? c->vc[(p * s->nkv + g) * d + k] : 0.0f;
      }
    }
}

/* Scaled scores of query row (t, h) against its visible keys into sc:
 * context first (hi - lo), then block (bhi - blo). Returns their count. */
DF_INLINE int scores(const attn_ctx *c, int n, int j, int h, float *sc, int *lo, int *hi, int *blo,
                     int *bhi) {
  const df_attn_shape *s = c->s;
  int g = h / (s->nh / s->nkv), d = s->d;
  size_t t = (size_t)n * s->B + j;
  const float *q = c->q + (t * s->nh + h) * d;
  visible(s, n, j, lo, hi, blo, bhi);
  int k = 0;
  const float *kt = c->kt + (size_t)g * d * c->sc8;
  for (int t0 = *lo & ~7; t0 < *hi; t0 += 8) {
    float acc[8];
    tile_dot(acc, q, kt + t0, c->sc8, d);
    for (int l = 0; l < 8; l++)
      if (t0 + l >= *lo && t0 + l < *hi) sc[k++] = acc[l] * c->scale;
  }
  for (int p = *blo; p < *bhi; p++)
    sc[k++] = dotf(q, c->kb + (((size_t)n * s->B + p) * s->nkv + g) * d, d) * c->scale;
  return k;
}

/* Carve the work buffer: per-worker scores, D, then the transposed context. */
static void attn_work(df_pool *pool, const df_attn_shape *s, float *work, attn_ctx *c) {
  c->scratch_stride = (size_t)s->Sc + s->B;
  c->scratch = work;
  c->D = work + c->scratch_stride * (size_t)df_pool_size(pool);
  c->sc8 = ((size_t)s->Sc + 7) & ~(size_t)7;
  c->kt = c->D + (size_t)s->n_blocks * s->B * s->nh;
  c->vt = c->kt + (size_t)s->nkv * s->d * c->sc8;
  transpose_context(c);
}

DF_HOT static void attn_fwd_task(void *vc, size_t b, size_t e, int worker) {
  attn_ctx *c = vc;
  const df_attn_shape *s = c->s;
  float *sc = c->scratch + (size_t)worker * c->scratch_stride;
  int d = s->d, grp = s->nh / s->nkv;
  for (size_t task = b; task < e; task++) {
    int n = (int)(task / s->nh), h = (int)(task % s->nh), g = h / grp;
    for (int j = 0; j < s->B; j++) {
      int lo, hi, blo, bhi;
      int k = scores(c, n, j, h, sc, &lo, &hi, &blo, &bhi);
      float mx = -FLT_MAX;
      for (int i = 0; i < k; i++) mx = sc[i] > mx ? sc[i] : mx;
      double sum = 0;
      for (int i = 0; i < k; i++) sum += (sc[i] = expneg(sc[i] - mx));
      size_t t = (size_t)n * s->B + j;
      float *o = c->out + (t * s->nh + h) * d;
      memset(o, 0, sizeof(float) * d);
      float inv = (float)(1.0 / sum);
      int i = 0;
      for (int p = lo; p < hi; p++)
        axpyf(o, sc[i++] * inv, c->vc + ((size_t)p * s->nkv + g) * d, d);
      for (int p = blo; p < bhi; p++)
        axpyf(o, sc[i++] * inv, c->vb + (((size_t)n * s->B + p) * s->nkv + g) * d, d);
      c->lse[t * s->nh + h] = mx + (float)log(sum);
    }
  }
}

void df_attention_forward(df_pool *pool, const df_attn_shape *s, float *out, float *lse,
                          const float *q, const float *kc, const float *vc, const float *kb,
                          const float *vb, float *work) {
  attn_ctx c = {.s = s,
                .out = out,
                .lse = lse,
                .q = q,
                .kc = kc,
                .vc = vc,
                .kb = kb,
                .vb = vb,
                .scale = 1.0f / sqrtf((float)s->d)};
  attn_work(pool, s, work, &c);
  df_pool_for(pool, (size_t)s->n_blocks * s->nh, 1, attn_fwd_task, &c);
}

size_t df_attention_work(df_pool *pool, const df_attn_shape *s) {
  size_t sc8 = ((size_t)s->Sc + 7) & ~(size_t)7;
  return ((size_t)s->Sc + s->B) * (size_t)df_pool_size(pool) + (size_t)s->n_blocks * s->B * s->nh +
         2 * (size_t)s->nkv * s->d * sc8;
}

/* D[t,h] = dout . out (the softmax backward's row term). */
DF_HOT static void attn_D_rows(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  attn_ctx *c = vc;
  for (size_t i = b; i < e; i++) c->D[i] = dotf(c->dout + i * c->s->d, c->o + i * c->s->d, c->s->d);
}

/* Pass 1, one task per (block, kv head): dq of its heads and the block's own
 * dk/dv rows for that kv head. */
DF_HOT static void attn_bwd_block(void *vc, size_t b, size_t e, int worker) {
  attn_ctx *c = vc;
  const df_attn_shape *s = c->s;
  float *sc = c->scratch + (size_t)worker * c->scratch_stride;
  int d = s->d, grp = s->nh / s->nkv;
  for (size_t task = b; task < e; task++) {
    int n = (int)(task / s->nkv), g = (int)(task % s->nkv);
    for (int p = 0; p < s->B; p++) {
      size_t row = (((size_t)n * s->B + p) * s->nkv + g) * d;
      memset(c->dkb + row, 0, sizeof(float) * d);
      memset(c->dvb + row, 0, sizeof(float) * d);
    }
    for (int h = g * grp; h < (g + 1) * grp; h++) {
      for (int j = 0; j < s->B; j++) {
        size_t t = (size_t)n * s->B + j, th = t * s->nh + h;
        const float *q = c->q + th * d, *dO = c->dout + th * d;
        float *dq = c->dq + th * d;
        memset(dq, 0, sizeof(float) * d);
        int lo, hi, blo, bhi;
        scores(c, n, j, h, sc, &lo, &hi, &blo, &bhi);
        float lse = c->lse[th], D = c->D[th];
        int i = 0;
        const float *vt = c->vt + (size_t)g * d * c->sc8;
        for (int t0 = lo & ~7; t0 < hi; t0 += 8) {
          float dP[8];
          tile_dot(dP, dO, vt + t0, c->sc8, d);
          for (int l = 0; l < 8; l++) {
            int p = t0 + l;
            if (p < lo || p >= hi) continue;
            float P = expneg(sc[i++] - lse);
            axpyf(dq, P * (dP[l] - D) * c->scale, c->kc + ((size_t)p * s->nkv + g) * d, d);
          }
        }
        for (int p = blo; p < bhi; p++, i++) {
          size_t kr = (((size_t)n * s->B + p) * s->nkv + g) * d;
          float P = expneg(sc[i] - lse);
          float dS = P * (dotf(dO, c->vb + kr, d) - D) * c->scale;
          axpyf(dq, dS, c->kb + kr, d);
          axpyf(c->dkb + kr, dS, q, d);
          axpyf(c->dvb + kr, P, dO, d);
        }
      }
    }
  }
}

/* Pass 2, one task per (kv head, tile of 8 context rows): those rows' dk/dv,
 * summing over every block that sees them, in block order. */
DF_HOT static void attn_bwd_context(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  attn_ctx *c = vc;
  const df_attn_shape *s = c->s;
  int d = s->d, grp = s->nh / s->nkv;
  size_t tiles = c->sc8 / 8;
  for (size_t task = b; task < e; task++) {
    int g = (int)(task / tiles), t0 = (int)(task % tiles) * 8;
    const float *kt = c->kt + (size_t)g * d * c->sc8 + t0,
                *vt = c->vt + (size_t)g * d * c->sc8 + t0;
    float dkt[DF_MAX_HEAD_DIM][8], dvt[DF_MAX_HEAD_DIM][8]; /* [d][lane] */
    memset(dkt, 0, sizeof(float) * 8 * (size_t)d);
    memset(dvt, 0, sizeof(float) * 8 * (size_t)d);
    for (int n = 0; n < s->n_blocks; n++) {
      if (t0 >= s->anchors[n]) continue;
      for (int j = 0; j < s->B; j++) {
        int lo, hi, blo, bhi;
        visible(s, n, j, &lo, &hi, &blo, &bhi);
        if (hi <= t0 || lo >= t0 + 8) continue;
        for (int h = g * grp; h < (g + 1) * grp; h++) {
          size_t th = ((size_t)n * s->B + j) * s->nh + h;
          const float *q = c->q + th * d, *dO = c->dout + th * d;
          float sc[8], dP[8], P[8], dS[8];
          tile_dot(sc, q, kt, c->sc8, d);
          tile_dot(dP, dO, vt, c->sc8, d);
          for (int l = 0; l < 8; l++) {
            bool in = t0 + l >= lo && t0 + l < hi;
            P[l] = in ? expneg(sc[l] * c->scale - c->lse[th]) : 0.0f;
            dS[l] = P[l] * (dP[l] - c->D[th]) * c->scale;
          }
          for (int k = 0; k < d; k++)
            for (int l = 0; l < 8; l++) {
              dkt[k][l] += q[k] * dS[l];
              dvt[k][l] += dO[k] * P[l];
            }
        }
      }
    }
    for (int l = 0; l < 8 && t0 + l < s->Sc; l++) {
      size_t kr = ((size_t)(t0 + l) * s->nkv + g) * d;
      for (int k = 0; k < d; k++) c->dkc[kr + k] = dkt[k][l], c->dvc[kr + k] = dvt[k][l];
    }
  }
}

void df_attention_backward(df_pool *pool, const df_attn_shape *s, float *dq, float *dkc, float *dvc,
                           float *dkb, float *dvb, float *work, const float *dout, const float *out,
                           const float *lse, const float *q, const float *kc, const float *vc,
                           const float *kb, const float *vb) {
  size_t T = (size_t)s->n_blocks * s->B;
  attn_ctx c = {.s = s,
                .lse = (float *)lse,
                .dq = dq,
                .dkc = dkc,
                .dvc = dvc,
                .dkb = dkb,
                .dvb = dvb,
                .q = q,
                .kc = kc,
                .vc = vc,
                .kb = kb,
                .vb = vb,
                .dout = dout,
                .o = out,
                .scale = 1.0f / sqrtf((float)s->d)};
  attn_work(pool, s, work, &c);
  df_pool_for(pool, T * s->nh, 256, attn_D_rows, &c);
  df_pool_for(pool, (size_t)s->n_blocks * s->nkv, 1, attn_bwd_block, &c);
  if (s->Sc > 0) df_pool_for(pool, (size_t)s->nkv * (c.sc8 / 8), 1, attn_bwd_context, &c);
}

/* ---- SwiGLU --------------------------------------------------------------- */

typedef struct swiglu_ctx {
  float *m, *dg, *du;
  const float *g, *u, *dm;
} swiglu_ctx;

DF_HOT static void swiglu_fwd(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  swiglu_ctx *c = vc;
  for (size_t i = b; i < e; i++) {
    float g = c->g[i];
    c->m[i] = g / (1.0f + expf(-g)) * c->u[i];
  }
}

DF_HOT static void swiglu_bwd(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  swiglu_ctx *c = vc;
  for (size_t i = b; i < e; i++) {
    float g = c->g[i], sig = 1.0f / (1.0f + expf(-g));
    float silu = g * sig;
    c->du[i] = c->dm[i] * silu;
    c->dg[i] = c->dm[i] * c->u[i] * sig * (1.0f + g * (1.0f - sig));
  }
}

void df_swiglu_forward(df_pool *pool, float *m, const float *g, const float *u, size_t n) {
  swiglu_ctx c = {.m = m, .g = g, .u = u};
  df_pool_for(pool, n, 4096, swiglu_fwd, &c);
}

void df_swiglu_backward(df_pool *pool, float *dg, float *du, const float *dm, const float *g,
                        const float *u, size_t n) {
  swiglu_ctx c = {.dg = dg, .du = du, .dm = dm, .g = g, .u = u};
  df_pool_for(pool, n, 4096, swiglu_bwd, &c);
}

/* ---- LM head + CE --------------------------------------------------------- */

typedef struct ce_ctx {
  float *logits, *acc, *mx;
  double *sum, *tl;
  const int32_t *target;
  int c, v0, H;
  bool grad;
  int top_k;        /* > 0: also keep each row's top_k logits */
  int32_t *top_ids; /* [R, top_k] */
  float *top_vals;
} ce_ctx;

int df_topk_insert(int32_t *ids, float *vals, int n, int k, int32_t v, float x) {
  if (n == k && !(x > vals[n - 1])) return n; /* ties keep the smaller id, seen first */
  int i = n < k ? n++ : n - 1;
  while (i > 0 && x > vals[i - 1]) {
    ids[i] = ids[i - 1], vals[i] = vals[i - 1];
    i--;
  }
  ids[i] = v, vals[i] = x;
  return n;
}

/* The chunk's raw logits into row r's top list (before they become exps).
 * Every column seen so far was offered, so the list holds min(v0, k). */
static void ce_topk_row(const ce_ctx *x, size_t r, const float *l) {
  int k = x->top_k, n = x->v0 < k ? x->v0 : k;
  int32_t *ids = x->top_ids + r * (size_t)k;
  float *vals = x->top_vals + r * (size_t)k;
  for (int i = 0; i < x->c; i++) n = df_topk_insert(ids, vals, n, k, x->v0 + i, l[i]);
}

/* Online softmax update for one chunk of logits per row: new running max,
 * rescaled sum and accumulator, logits turned into exp(l - max). */
DF_HOT static void ce_chunk_rows(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  ce_ctx *x = vc;
  for (size_t r = b; r < e; r++) {
    float *l = x->logits + r * (size_t)x->c;
    int tgt = x->target[r] - x->v0;
    if (tgt >= 0 && tgt < x->c) x->tl[r] = l[tgt];
    if (x->top_k > 0) ce_topk_row(x, r, l);
    float m = x->mx[r];
    for (int i = 0; i < x->c; i++) m = l[i] > m ? l[i] : m;
    float rescale = expneg(x->mx[r] - m); /* 0 on the first chunk */
    double s = 0;
    for (int i = 0; i < x->c; i++) s += (l[i] = expneg(l[i] - m));
    x->sum[r] = x->sum[r] * rescale + s;
    x->mx[r] = m;
    if (x->grad && rescale != 1.0f) {
      float *a = x->acc + r * (size_t)x->H;
      for (int i = 0; i < x->H; i++) a[i] *= rescale;
    }
  }
}

typedef struct ce_fin_ctx {
  const ce_ctx *x;
  double *loss;
  float *dx;
  const float *E, *coef;
} ce_fin_ctx;

DF_HOT static void ce_finish_rows(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  ce_fin_ctx *f = vc;
  const ce_ctx *x = f->x;
  for (size_t r = b; r < e; r++) {
    if (f->loss) f->loss[r] = (double)x->mx[r] + log(x->sum[r]) - x->tl[r];
    if (!f->dx) continue;
    float k = (float)(f->coef[r] / x->sum[r]);
    const float *a = x->acc + r * (size_t)x->H, *et = f->E + (size_t)x->target[r] * x->H;
    float *dx = f->dx + r * (size_t)x->H;
    for (int i = 0; i < x->H; i++) dx[i] = k * a[i] - f->coef[r] * et[i];
  }
}

void df_lmhead_ce(df_pool *pool, double *loss, float *dx, const float *x, const float *E,
                  const int32_t *target, const float *coef, int R, int H, int V, int chunk,
                  float *scratch) {
  df_lmhead_ce_topk(pool, loss, dx, x, E, target, coef, R, H, V, chunk, scratch, 0, NULL, NULL);
}

void df_lmhead_ce_topk(df_pool *pool, double *loss, float *dx, const float *x, const float *E,
                       const int32_t *target, const float *coef, int R, int H, int V, int chunk,
                       float *scratch, int top_k, int32_t *top_ids, float *top_vals) {
  df_lmhead_ce_pass(pool, dx != NULL, x, E, target, R, H, V, chunk, scratch, top_k, top_ids,
                    top_vals);
  df_lmhead_ce_finish(pool, loss, dx, E, target, coef, R, H, chunk, scratch);
}

/* The running state df_lmhead_ce_pass leaves in scratch for df_lmhead_ce_finish. */
static ce_ctx ce_state(float *scratch, const int32_t *target, int R, int H, int chunk, bool grad) {
  double *sum = (double *)scratch, *tl = sum + R; /* scratch is malloc-aligned */
  float *mx = (float *)(tl + R), *logits = mx + R, *acc = logits + (size_t)R * chunk;
  return (ce_ctx){.logits = logits,
                  .acc = acc,
                  .mx = mx,
                  .sum = sum,
                  .tl = tl,
                  .target = target,
                  .H = H,
                  .grad = grad};
}

void df_lmhead_ce_pass(df_pool *pool, bool grad, const float *x, const float *E,
                       const int32_t *target, int R, int H, int V, int chunk, float *scratch,
                       int top_k, int32_t *top_ids, float *top_vals) {
  if (R <= 0) return;
  ce_ctx c = ce_state(scratch, target, R, H, chunk, grad);
  for (int r = 0; r < R; r++) c.mx[r] = -FLT_MAX, c.sum[r] = 0, c.tl[r] = 0;
  if (grad) memset(c.acc, 0, sizeof(float) * (size_t)R * H);
  c.top_k = top_ids && top_vals ? top_k : 0;
  c.top_ids = top_ids, c.top_vals = top_vals;
  for (int v0 = 0; v0 < V; v0 += chunk) {
    c.v0 = v0;
    c.c = V - v0 < chunk ? V - v0 : chunk;
    const float *Ec = E + (size_t)v0 * H;
    df_sgemm(pool, false, true, R, c.c, H, 1.0f, x, H, Ec, H, 0.0f, c.logits, c.c);
    df_pool_for(pool, (size_t)R, 16, ce_chunk_rows, &c);
    if (grad) df_sgemm(pool, false, false, R, H, c.c, 1.0f, c.logits, c.c, Ec, H, 1.0f, c.acc, H);
  }
}

void df_lmhead_ce_finish(df_pool *pool, double *loss, float *dx, const float *E,
                         const int32_t *target, const float *coef, int R, int H, int chunk,
                         float *scratch) {
  if (R <= 0) return;
  ce_ctx c = ce_state(scratch, target, R, H, chunk, dx != NULL);
  ce_fin_ctx f = {&c, loss, dx, E, coef};
  df_pool_for(pool, (size_t)R, 16, ce_finish_rows, &f);
}

size_t df_lmhead_work(int R, int H, int chunk) {
  return (size_t)R * (5 + (size_t)chunk + (size_t)H);
}

void df_lmhead_argmax(df_pool *pool, const float *x, const float *E, int32_t *out, int R, int H,
                      int V, int chunk, float *scratch) {
  if (R <= 0) return;
  float *best = scratch + (size_t)R * chunk;
  for (int r = 0; r < R; r++) best[r] = -FLT_MAX, out[r] = 0;
  for (int v0 = 0; v0 < V; v0 += chunk) {
    int cn = V - v0 < chunk ? V - v0 : chunk;
    df_sgemm(pool, false, true, R, cn, H, 1.0f, x, H, E + (size_t)v0 * H, H, 0.0f, scratch, cn);
    for (int r = 0; r < R; r++)
      for (int i = 0; i < cn; i++)
        if (scratch[(size_t)r * cn + i] > best[r])
          best[r] = scratch[(size_t)r * cn + i], out[r] = v0 + i;
  }
}

/* ---- sum of squares ------------------------------------------------------- */

typedef struct sumsq_ctx {
  const float *x;
  size_t n, chunk;
  double *part;
} sumsq_ctx;

static void sumsq_chunks(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  sumsq_ctx *c = vc;
  for (size_t k = b; k < e; k++) {
    size_t lo = k * c->chunk, hi = lo + c->chunk < c->n ? lo + c->chunk : c->n;
    double s = 0;
    for (size_t i = lo; i < hi; i++) s += (double)c->x[i] * c->x[i];
    c->part[k] = s;
  }
}

double df_sumsq(df_pool *pool, const float *x, size_t n) {
  enum { MAX_PARTS = 1024 };
  double part[MAX_PARTS];
  /* The chunking depends on n only, so the sum does too. */
  size_t chunk = n / MAX_PARTS + 1 > 4096 ? n / MAX_PARTS + 1 : 4096;
  sumsq_ctx c = {x, n, chunk, part};
  size_t chunks = (n + chunk - 1) / chunk;
  df_pool_for(pool, chunks, 1, sumsq_chunks, &c);
  double s = 0;
  for (size_t k = 0; k < chunks; k++) s += part[k];
  return s;
}
