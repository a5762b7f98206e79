// Element-wise and row kernels of the drafter (the GPU twins of
// src/train/ops.c): bf16 storage, float arithmetic.
//
// Naming: a kernel that twins a CPU reference op is named after it without the df_ prefix
// (df_rmsnorm_forward -> rmsnorm_forward, df_lmhead_ce -> lmhead_ce_*), a kernel that is one
// pass of an op adds the pass (rmsnorm_backward_dw_partial, lmhead_ce_chunk); DFlash 2's
// kernels (dflash2.cu) keep dflash2.h's df2_ names (df2_conv_apply, df2_selector_row).
// Kernels with no CPU op (gather_rows, adamw, positions, ...) keep descriptive names.
#include <cuda_fp8.h>
#include <float.h>

#include "common.cuh"

namespace {

constexpr int kWarp = 32;

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Block-wide sum/max (blockDim a multiple of 32, <= 1024); every thread gets it.
__device__ float block_sum(float v) {
  DF_SHARED(float, sh, [32]);
  v = warp_sum(v);
  int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  int nw = blockDim.x / kWarp;
  v = lane < nw ? sh[lane] : 0.0f;
  return warp_sum(v);
}
__device__ float block_max(float v) {
  DF_SHARED(float, sh, [32]);
  v = warp_max(v);
  int lane = threadIdx.x % kWarp, w = threadIdx.x / kWarp;
  __syncthreads();
  if (lane == 0) sh[w] = v;
  __syncthreads();
  int nw = blockDim.x / kWarp;
  v = lane < nw ? sh[lane] : -FLT_MAX;
  return warp_max(v);
}

__device__ __forceinline__ float ld(const bf16 *p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float ld(const float *p, size_t i) { return p[i]; }

unsigned blocks_for(size_t n, int threads) {
  size_t b = (n + threads - 1) / threads;
  return (unsigned)(b > 65535u * 16 ? 65535u * 16 : b);
}

// ---- RMSNorm: one warp per row ------------------------------------------------
__global__ void rmsnorm_forward(bf16 *y, float *rstd, const bf16 *x, const bf16 *w, long rows,
                                int n, float eps) {
  long r = (long)blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  const bf16 *xr = x + r * n;
  float ss = 0;
  for (int i = lane; i < n; i += kWarp) {
    float v = ld(xr, i);
    ss += v * v;
  }
  float rs = rsqrtf(warp_sum(ss) / n + eps);
  if (lane == 0) rstd[r] = rs;
  for (int i = lane; i < n; i += kWarp)
    y[r * n + i] = __float2bfloat16(ld(w, i) * (ld(xr, i) * rs));
}

template <typename DY, typename DX>
__global__ void rmsnorm_backward(DX *dx, const DY *dy, const bf16 *x, const bf16 *w,
                                 const float *rstd, long rows, int n, bool acc) {
  long r = (long)blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp;
  int lane = threadIdx.x % kWarp;
  if (r >= rows) return;
  size_t base = (size_t)r * n;
  float rs = rstd[r], dot = 0;
  for (int i = lane; i < n; i += kWarp) dot += ld(dy, base + i) * ld(w, i) * ld(x, base + i);
  float k = warp_sum(dot) / n * rs * rs * rs;
  for (int i = lane; i < n; i += kWarp) {
    float v = ld(dy, base + i) * ld(w, i) * rs - k * ld(x, base + i);
    if (acc) v += ld(dx, base + i);
    if constexpr (sizeof(DX) == 4) dx[base + i] = v;
    else dx[base + i] = __float2bfloat16(v);
  }
}

// dw partial sums: block (32 columns x 8 row lanes), grid.y row slices.
constexpr int kDwSplit = DF_CU_DW_SPLIT;
template <typename DY>
__global__ void rmsnorm_backward_dw_partial(float *partial, const DY *dy, const bf16 *x,
                                            const float *rstd, long rows, int n) {
  DF_SHARED(float, sh, [8][33]);
  int c = blockIdx.x * 32 + threadIdx.x;
  float s = 0;
  if (c < n)
    for (long r = (long)blockIdx.y * 8 + threadIdx.y; r < rows; r += (long)gridDim.y * 8)
      s += ld(dy, (size_t)r * n + c) * ld(x, (size_t)r * n + c) * rstd[r];
  sh[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < n) {
    float t = 0;
    for (int k = 0; k < 8; k++) t += sh[k][threadIdx.x];
    partial[(size_t)blockIdx.y * n + c] = t;
  }
}

__global__ void rmsnorm_backward_dw_reduce(float *dw, const float *partial, int n, int splits) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= n) return;
  float t = 0;
  for (int k = 0; k < splits; k++) t += partial[(size_t)k * n + c];
  dw[c] += t;
}

// ---- RoPE -----------------------------------------------------------------------
// The first rot of each head's d dims rotate (pairs i, i + rot/2); the rest pass through.
// sign 1 is df_rope_forward, sign -1 (the transposed rotation) df_rope_backward.
__global__ void rope_forward(bf16 *x, const int32_t *pos, const float *cos_t, const float *sin_t,
                             long rows, int heads, int d, int rot, float sign) {
  int half = rot / 2;
  size_t n = (size_t)rows * heads * half;
  for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < n;
       t += (size_t)gridDim.x * blockDim.x) {
    int i = (int)(t % half);
    size_t rh = t / half, r = rh / heads;
    bf16 *v = x + rh * d;
    float c = cos_t[(size_t)pos[r] * half + i], s = sign * sin_t[(size_t)pos[r] * half + i];
    float a = __bfloat162float(v[i]), b = __bfloat162float(v[i + half]);
    v[i] = __float2bfloat16(a * c - b * s);
    v[i + half] = __float2bfloat16(b * c + a * s);
  }
}

// The cos/sin tables of src/train/model.c's rope_tables (from df_rope_inv_freq's inv_freq).
__global__ void rope_table(float *cos_t, float *sin_t, const double *inv_freq, double af, int n_pos,
                           int half) {
  size_t n = (size_t)n_pos * half;
  for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < n;
       t += (size_t)gridDim.x * blockDim.x) {
    double ang = (double)(t / half) * inv_freq[t % half];
    cos_t[t] = (float)(cos(ang) * af);
    sin_t[t] = (float)(sin(ang) * af);
  }
}

// ---- SwiGLU ---------------------------------------------------------------------
__global__ void swiglu_forward(bf16 *m, const bf16 *g, const bf16 *u, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float gv = __bfloat162float(g[i]);
    m[i] = __float2bfloat16(gv / (1.0f + __expf(-gv)) * __bfloat162float(u[i]));
  }
}

__global__ void swiglu_backward(bf16 *dg, bf16 *du, const bf16 *dm, const bf16 *g, const bf16 *u,
                                size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float gv = __bfloat162float(g[i]), d = __bfloat162float(dm[i]);
    float sig = 1.0f / (1.0f + __expf(-gv));
    du[i] = __float2bfloat16(d * gv * sig);
    dg[i] = __float2bfloat16(d * __bfloat162float(u[i]) * sig * (1.0f + gv * (1.0f - sig)));
  }
}

// ---- gathers and conversions ------------------------------------------------------
__global__ void gather_rows(bf16 *out, const bf16 *table, const int32_t *idx, long rows, int n) {
  size_t total = (size_t)rows * n;
  for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total;
       t += (size_t)gridDim.x * blockDim.x)
    out[t] = table[(size_t)idx[t / n] * n + t % n];
}

__global__ void scatter_rows(bf16 *out, const bf16 *rows, const int32_t *idx, long n_rows, int n) {
  size_t total = (size_t)n_rows * n;
  for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total;
       t += (size_t)gridDim.x * blockDim.x)
    out[(size_t)idx[t / n] * n + t % n] = rows[t];
}

__global__ void f32_to_bf16(bf16 *out, const float *in, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = __float2bfloat16(in[i]);
}
__global__ void bf16_to_f32(float *out, const bf16 *in, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}
// The context rows as stored (bf16, e4m3 x a float scale per row of H, or fp32) to bf16,
// with the NaN/Inf check the host used to make: the lowest bad flat index into *bad.
// e4m3 * scale in fp32, then round to bf16: the host's df_hidden_decode + df_f32_to_bf16.
__global__ void hidden_decode(bf16 *out, const void *codes, const float *scales, int dtype,
                              size_t n, int H, unsigned long long *bad) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float v;
    if (dtype == DF_CU_HIDDEN_BF16) {
      v = __bfloat162float(((const bf16 *)codes)[i]);
    } else if (dtype == DF_CU_HIDDEN_FP8) {
      __nv_fp8_e4m3 q;
      q.__x = ((const uint8_t *)codes)[i];
      v = (float)q * scales[i / (size_t)H];
    } else {
      v = ((const float *)codes)[i];
    }
    if (!isfinite(v)) atomicMin(bad, (unsigned long long)i);
    out[i] = __float2bfloat16(v);
  }
}
// One sequence's sum(w * CE) over its R rows, w by block position: one block, fixed order.
__global__ void seq_loss(const float *loss, const int32_t *rows_t, const float *wtab, int B, int R,
                         double *out) {
  DF_SHARED(double, sh, [256]);
  double s = 0;
  for (int r = threadIdx.x; r < R; r += blockDim.x)
    s += (double)(wtab ? wtab[rows_t[r] % B] : 1.0f) * loss[r];
  sh[threadIdx.x] = s;
  __syncthreads();
  for (unsigned o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = sh[0];
}
__global__ void positions(int32_t *pos, const int32_t *anchors, int A, int B) {
  int t = blockIdx.x * blockDim.x + threadIdx.x;
  if (t < A * B) pos[t] = anchors[t / B] + t % B;
}

// ---- LM head + cross-entropy --------------------------------------------------------
__global__ void lmhead_ce_init(float *mx, float *sum, float *tl, int R) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < R) mx[r] = -FLT_MAX, sum[r] = 0, tl[r] = 0;
}

// One block per row: fold this chunk into the running max / sum, keep the
// target logit, write exp(l - max) for the backward GEMM, rescale acc.
__global__ void lmhead_ce_chunk(const float *logits, bf16 *probs, float *mx, float *sum, float *tl,
                                float *acc, const int32_t *target, int c, int v0, int H,
                                bool grad) {
  int r = blockIdx.x;
  const float *l = logits + (size_t)r * c;
  float cm = -FLT_MAX;
  for (int i = threadIdx.x; i < c; i += blockDim.x) cm = fmaxf(cm, l[i]);
  cm = block_max(cm);
  float old = mx[r], m = fmaxf(old, cm);
  float s = 0;
  for (int i = threadIdx.x; i < c; i += blockDim.x) {
    float e = __expf(l[i] - m);
    s += e;
    if (grad) probs[(size_t)r * c + i] = __float2bfloat16(e);
  }
  s = block_sum(s);
  float rescale = __expf(old - m);
  if (grad && rescale != 1.0f)
    for (int i = threadIdx.x; i < H; i += blockDim.x) acc[(size_t)r * H + i] *= rescale;
  __syncthreads();
  if (threadIdx.x == 0) {
    int tg = target[r] - v0;
    if (tg >= 0 && tg < c) tl[r] = l[tg];
    sum[r] = sum[r] * rescale + s;
    mx[r] = m;
  }
}

__global__ void lmhead_ce_finish(float *loss, bf16 *dx, const float *mx, const float *sum,
                                 const float *tl, const float *acc, const float *coef,
                                 const bf16 *E, const int32_t *target, int H) {
  int r = blockIdx.x;
  if (threadIdx.x == 0) loss[r] = mx[r] + logf(sum[r]) - tl[r];
  if (!dx) return;
  float k = coef[r] / sum[r], cf = coef[r];
  const bf16 *et = E + (size_t)target[r] * H;
  for (int i = threadIdx.x; i < H; i += blockDim.x)
    dx[(size_t)r * H + i] = __float2bfloat16(k * acc[(size_t)r * H + i] - cf * ld(et, i));
}

// Greedy: the first index of the largest logit (as the CPU loop picks it). A row with no
// logit above -FLT_MAX (all NaN, say) keeps index 0, as the CPU loop's does.
__global__ void lmhead_argmax_init(float *best, int32_t *best_i, int R) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < R) best[r] = -FLT_MAX, best_i[r] = 0;
}
__global__ void lmhead_argmax_chunk(const float *logits, float *best, int32_t *best_i, int c,
                                    int v0) {
  DF_SHARED(float, sv, [1024]);
  DF_SHARED(int, si, [1024]);
  int r = blockIdx.x;
  const float *l = logits + (size_t)r * c;
  float bv = -FLT_MAX;
  int bi = 0x7fffffff;
  for (int i = threadIdx.x; i < c; i += blockDim.x)
    if (l[i] > bv) bv = l[i], bi = i;
  sv[threadIdx.x] = bv, si[threadIdx.x] = bi;
  __syncthreads();
  for (unsigned o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) {
      float ov = sv[threadIdx.x + o];
      int oi = si[threadIdx.x + o];
      if (ov > sv[threadIdx.x] || (ov == sv[threadIdx.x] && oi < si[threadIdx.x]))
        sv[threadIdx.x] = ov, si[threadIdx.x] = oi;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && sv[0] > best[r]) best[r] = sv[0], best_i[r] = v0 + si[0];
}

// ---- optimizer -------------------------------------------------------------------
constexpr int kSumsqBlocks = 1024;
__global__ void sumsq_partial(const float *x, size_t n, double *partial) {
  DF_SHARED(double, sh, [256]);
  double s = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    s += (double)x[i] * x[i];
  sh[threadIdx.x] = s;
  __syncthreads();
  for (unsigned o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sh[0];
}
__global__ void sumsq_final(const double *partial, int n, double *out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double s = 0;
    for (int i = 0; i < n; i++) s += partial[i];
    *out = s;
  }
}

// The step's clip state (df_cu_clip) from the buckets' sums of squares, on the device so
// that the optimizer needs no host round trip: the same double sum in bucket order, sqrt and
// torch's clip_grad_norm_ factor as the host computed them before (bit for bit).
__global__ void norm_sum(const double *part, int n, df_cu_clip *c) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double s = 0;
    for (int i = 0; i < n; i++) s += part[i];
    c->ss = s;
  }
}
__global__ void norm_clip(df_cu_clip *c, double clip) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double norm = sqrt(c->ss);
    double coef = clip > 0 && clip / (norm + 1e-6) < 1.0 ? clip / (norm + 1e-6) : 1.0;
    c->norm = norm;
    c->coef = (float)coef;
    c->finite = isfinite(norm) ? 1 : 0;
    c->clipped = coef < 1.0 ? 1 : 0;
  }
}
// x *= the clip factor, when the step clips (and its norm is finite).
__global__ void scale_clipped(float *x, const df_cu_clip *c, size_t n) {
  if (!c->finite || !c->clipped) return;
  float k = c->coef;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] *= k;
}

__global__ void scale(float *x, float k, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] *= k;
}

// torch.optim.AdamW's single-tensor update in float32, then the bf16 copy.
// A non-finite norm (clip->finite 0) changes nothing.
__global__ void adamw(float *p, bf16 *p16, const float *g, float *m1, float *m2, size_t n,
                      const df_cu_clip *clip, float decay, float b1, float b2, float eps,
                      float step_size, float bc2_sqrt) {
  if (!clip->finite) return;
  float gscale = clip->coef;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float gi = g[i] * gscale, pi = p[i] * decay;
    float a = m1[i] + (gi - m1[i]) * (1.0f - b1);
    float v = m2[i] * b2 + (1.0f - b2) * gi * gi;
    pi -= step_size * (a / (sqrtf(v) / bc2_sqrt + eps));
    m1[i] = a, m2[i] = v, p[i] = pi;
    p16[i] = __float2bfloat16(pi);
  }
}

// Muon's momentum as optim_muon.c: buf.lerp_(g, 1 - mu); u = g.lerp(buf, mu) (Nesterov), g
// times the clip factor as AdamW reads it. A non-finite norm changes nothing.
__global__ void muon_momentum(float *buf, float *u, const float *g, size_t n,
                              const df_cu_clip *clip, float mu) {
  if (!clip->finite) return;
  float gscale = clip->coef;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float gi = g[i] * gscale, b = buf[i] + (gi - buf[i]) * (1.0f - mu);
    buf[i] = b;
    u[i] = gi + (b - gi) * mu;
  }
}
// Newton-Schulz's start: x / max(|x|_F, eps), the norm rounded to float as optim_muon.c does.
__global__ void muon_normalize(float *x, size_t n, const double *ss, float eps) {
  float norm = (float)sqrt(*ss), k = 1.0f / (norm > eps ? norm : eps);
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] *= k;
}
// The decoupled decay and the orthogonalised step on the fp32 master, then the bf16 copy.
__global__ void muon_apply(float *p, bf16 *p16, const float *o, size_t n, const df_cu_clip *clip,
                           float decay, float step) {
  if (!clip->finite) return;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float pi = p[i] * decay - step * o[i];
    p[i] = pi;
    p16[i] = __float2bfloat16(pi);
  }
}


// ---- DSpark's heads and objective (src/train/dspark.c's df_dspark_loss) ------------------
// One block per row of a chunk: z [n, V] the draft logits (LM head plus Markov bias), zt
// [n, Vt] the target's logits or NULL (then CE alone, as the CPU without a final state).
// Each row's alpha-weighted CE + L1 + BCE into loss, the confidence logit's gradient
// coef * alpha_conf * (sigmoid(s) - c*) into ds (c* = clamp(1 - L1 / 2, 0, 1), a constant:
// the stop-gradient of the paper's eq. 8); with dz, coef times d(row)/d(z) in bf16:
// alpha_ce (p - onehot) + alpha_l1 p (sign(p - q) - sum p sign(p - q)), sign(0) = 0.
// kept NULL: V = Vt, the full vocabulary. A pruned draft vocabulary (kept [V] ascending
// target ids, V = V_d < Vt): the target's logits stay full width, q in L1 is them at the kept
// ids renormalized over those (speculators' teacher, the CPU's), c* = clamp((1 + sum q' -
// sum |p - q'|) / 2) with q' normalized over the full Vt (= 1 - L1'/2 of the full-vocabulary
// L1', p zero outside the kept ids: the dropped mass counts), and a label outside the set
// (target -1) adds no CE.
// log sum_k exp(row[idx ? idx[k] : k]) over k < n, by the whole block (max first, then
// the shifted sum): DSpark's draft row, its teacher over the kept ids, and the full target.
__device__ float block_lse(const float *row, const int32_t *idx, int n) {
  float m = -FLT_MAX;
  for (int k = threadIdx.x; k < n; k += blockDim.x) m = fmaxf(m, row[idx ? idx[k] : k]);
  m = block_max(m);
  float s = 0;
  for (int k = threadIdx.x; k < n; k += blockDim.x) s += expf(row[idx ? idx[k] : k] - m);
  return m + logf(block_sum(s));
}

__global__ void dspark_loss_rows(float *z, float *zt, bf16 *dz, const bf16 *x, const bf16 *e,
                                 const bf16 *cw, const bf16 *cb, const int32_t *target,
                                 const float *coef, float *loss, float *ds, const int32_t *kept,
                                 int V, int Vt, int H, int r, float a_ce, float a_l1,
                                 float a_conf) {
  int i = blockIdx.x;
  float *zi = z + (size_t)i * V, *ti = zt ? zt + (size_t)i * Vt : nullptr;
  int tgt = target[i];
  float zl = tgt >= 0 ? zi[tgt] : 0.0f; // read before the row is overwritten below
  float lse = block_lse(zi, nullptr, V);
  float l1 = 0, ps = 0, acc = 1.0f; // acc: 1 - L1 / 2, the acceptance c* clamps
  float qlse = 0;                   // the teacher's logsumexp (over the kept ids when pruned)
  if (ti && !kept) {
    qlse = block_lse(ti, nullptr, V);
    // p and sign(p - q) replace the two rows (each thread its own columns throughout)
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
      float p = expf(zi[v] - lse), d = p - expf(ti[v] - qlse);
      float sg = d > 0 ? 1.0f : d < 0 ? -1.0f : 0.0f;
      zi[v] = p, ti[v] = sg;
      l1 += fabsf(d), ps += p * sg;
    }
    l1 = block_sum(l1);
    ps = block_sum(ps);
    acc = 1.0f - 0.5f * l1;
  } else if (ti) {
    // Pruned: zt is read at the kept ids (a column another thread's row entry may alias), so
    // it is not overwritten; the backward below takes q again from it.
    qlse = block_lse(ti, kept, V);
    // the target's logsumexp over the full vocabulary (c* only)
    float flse = cw ? block_lse(ti, nullptr, Vt) : 0.0f;
    float l1f = 0, qk = 0; // sum_kept |p - q'|, sum_kept q'
    for (int k = threadIdx.x; k < V; k += blockDim.x) {
      float t = ti[kept[k]], p = expf(zi[k] - lse), d = p - expf(t - qlse);
      float sg = d > 0 ? 1.0f : d < 0 ? -1.0f : 0.0f;
      zi[k] = p;
      l1 += fabsf(d), ps += p * sg;
      if (cw) {
        float qf = expf(t - flse);
        l1f += fabsf(p - qf), qk += qf;
      }
    }
    l1 = block_sum(l1);
    ps = block_sum(ps);
    if (cw) {
      l1f = block_sum(l1f);
      qk = block_sum(qk);
      acc = 0.5f * (1.0f + qk - l1f);
    }
  }
  float bce = 0, dsv = 0;
  if (ti && cw) { // the confidence head on [x; e]
    float sl = 0;
    for (int k = threadIdx.x; k < H; k += blockDim.x) sl += ld(cw, k) * ld(x, (size_t)i * H + k);
    for (int k = threadIdx.x; k < r; k += blockDim.x)
      sl += ld(cw, H + k) * ld(e, (size_t)i * r + k);
    sl = block_sum(sl) + ld(cb, 0);
    float cst = fminf(1.0f, fmaxf(0.0f, acc));
    bce = fmaxf(sl, 0.0f) + log1pf(expf(-fabsf(sl))) - cst * sl;
    if (coef) dsv = coef[i] * a_conf * (1.0f / (1.0f + expf(-sl)) - cst);
  }
  if (threadIdx.x == 0) {
    float ce = tgt >= 0 ? lse - zl : 0.0f;
    loss[i] = a_ce * ce + a_l1 * l1 + a_conf * bce;
    ds[i] = dsv;
  }
  if (!dz) return;
  float g = coef[i];
  for (int v = threadIdx.x; v < V; v += blockDim.x) {
    float p = ti ? zi[v] : expf(zi[v] - lse);
    float d = a_ce * (tgt >= 0 ? p - (v == tgt ? 1.0f : 0.0f) : 0.0f);
    if (ti) {
      float sg = ti[v];
      if (kept) { // sign(p - q) again, as above
        float dq = p - expf(ti[kept[v]] - qlse);
        sg = dq > 0 ? 1.0f : dq < 0 ? -1.0f : 0.0f;
      }
      d += a_l1 * p * (sg - ps);
    }
    dz[(size_t)i * V + v] = __float2bfloat16(g * d);
  }
}

// One block per row: d(x) = dz E (acc, fp32) plus ds cw[:H] into rows_dx (bf16), and
// d(e) += ds cw[H:] (the confidence head's paths; without the head acc alone).
__global__ void dspark_conf_rows(bf16 *rows_dx, const float *acc, float *de, const float *ds,
                                 const bf16 *cw, int H, int r) {
  int i = blockIdx.x;
  float d = cw ? ds[i] : 0.0f;
  for (int k = threadIdx.x; k < H; k += blockDim.x)
    rows_dx[(size_t)i * H + k] = __float2bfloat16(acc[(size_t)i * H + k] +
                                                  (cw ? d * ld(cw, k) : 0.0f));
  if (cw)
    for (int k = threadIdx.x; k < r; k += blockDim.x) de[(size_t)i * r + k] += d * ld(cw, H + k);
}

// The parameter gradients of n rows, one thread per column, rows in order (deterministic,
// as the CPU's row-order scatter): w1's sparse rows dw1[prev_i] += de_i (columns 0..r-1);
// with the confidence head dcw += sum_i ds_i [x_i; e_i] (columns r..r+H+r-1) and dcb +=
// sum_i ds_i (the last).
__global__ void dspark_param_grads(float *dw1, const float *de, const int32_t *prev, float *dcw,
                                   float *dcb, const float *ds, const bf16 *x, const bf16 *e, int n,
                                   int H, int r) {
  int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < r) {
    for (int i = 0; i < n; i++) dw1[(size_t)prev[i] * r + j] += de[(size_t)i * r + j];
    return;
  }
  if (!dcw) return;
  j -= r;
  if (j > H + r) return;
  float s = 0;
  for (int i = 0; i < n; i++)
    s += ds[i] * (j < H       ? ld(x, (size_t)i * H + j)
                  : j < H + r ? ld(e, (size_t)i * r + j - H)
                              : 1.0f);
  if (j < H + r) dcw[j] += s;
  else *dcb += s;
}
} // namespace

// ---- launchers ----------------------------------------------------------------------
// Each returns the launch's status: a launch the device refuses (its configuration, shared
// memory, registers, a stream of another device) never runs, and would otherwise leave its
// outputs unwritten without a word.
dflash_status df_launched(const char *kernel) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return DFLASH_OK;
  // A refused launch, or an earlier asynchronous fault that surfaced here.
  return df_error(DFLASH_E_CUDA, "CUDA: launch of kernel %s: %s (%s)", kernel,
                  cudaGetErrorString(e), cudaGetErrorName(e));
}

dflash_status k_rmsnorm_forward(cudaStream_t s, bf16 *y, float *rstd, const bf16 *x, const bf16 *w,
                                long rows, int n, float eps) {
  if (rows <= 0) return DFLASH_OK;
  DF_LAUNCH((unsigned)((rows + 7) / 8), 256, 0, s, rmsnorm_forward)(y, rstd, x, w, rows, n, eps);
  return df_launched("rmsnorm_forward");
}

dflash_status k_rmsnorm_backward(cudaStream_t s, float *dx32, bf16 *dx16, const bf16 *dy16,
                                 const float *dy32, const bf16 *x, const bf16 *w, const float *rstd,
                                 long rows, int n, bool acc) {
  if (rows <= 0) return DFLASH_OK;
  unsigned g = (unsigned)((rows + 7) / 8);
  if (dy16 && dx32)
    DF_LAUNCH(g, 256, 0, s, rmsnorm_backward<bf16, float>)(dx32, dy16, x, w, rstd, rows, n, acc);
  else if (dy16)
    DF_LAUNCH(g, 256, 0, s, rmsnorm_backward<bf16, bf16>)(dx16, dy16, x, w, rstd, rows, n, acc);
  else if (dx32)
    DF_LAUNCH(g, 256, 0, s, rmsnorm_backward<float, float>)(dx32, dy32, x, w, rstd, rows, n, acc);
  else DF_LAUNCH(g, 256, 0, s, rmsnorm_backward<float, bf16>)(dx16, dy32, x, w, rstd, rows, n, acc);
  return df_launched("rmsnorm_backward");
}

size_t k_rmsnorm_backward_dw_scratch(int n) { return (size_t)kDwSplit * n; }

dflash_status k_rmsnorm_backward_dw(cudaStream_t s, float *dw, const bf16 *dy16, const float *dy32,
                                    const bf16 *x, const float *rstd, long rows, int n,
                                    float *partial) {
  if (rows <= 0) return DFLASH_OK;
  long sp = (rows + 63) / 64;
  int splits = (int)(sp > kDwSplit ? kDwSplit : sp);
  dim3 grid((n + 31) / 32, splits), block(32, 8);
  if (dy16) {
    DF_LAUNCH(grid, block, 0, s, rmsnorm_backward_dw_partial<bf16>)
    (partial, dy16, x, rstd, rows, n);
  } else {
    DF_LAUNCH(grid, block, 0, s, rmsnorm_backward_dw_partial<float>)
    (partial, dy32, x, rstd, rows, n);
  }
  DF_TRY(df_launched("rmsnorm_backward_dw_partial"));
  DF_LAUNCH((n + 255) / 256, 256, 0, s, rmsnorm_backward_dw_reduce)(dw, partial, n, splits);
  return df_launched("rmsnorm_backward_dw_reduce");
}

dflash_status k_rope_forward(cudaStream_t s, bf16 *x, const int32_t *pos, const float *cos_t,
                             const float *sin_t, long rows, int heads, int d, int rot, float sign) {
  size_t n = (size_t)rows * heads * (rot / 2);
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, rope_forward)
  (x, pos, cos_t, sin_t, rows, heads, d, rot, sign);
  return df_launched("rope_forward");
}

dflash_status k_rope_table(cudaStream_t s, float *cos_t, float *sin_t, const double *inv_freq,
                           double attn_factor, int n_pos, int half) {
  size_t n = (size_t)n_pos * half;
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, rope_table)
  (cos_t, sin_t, inv_freq, attn_factor, n_pos, half);
  return df_launched("rope_table");
}

dflash_status k_swiglu_forward(cudaStream_t s, bf16 *m, const bf16 *g, const bf16 *u, size_t n) {
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, swiglu_forward)(m, g, u, n);
  return df_launched("swiglu_forward");
}
dflash_status k_swiglu_backward(cudaStream_t s, bf16 *dg, bf16 *du, const bf16 *dm, const bf16 *g,
                                const bf16 *u, size_t n) {
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, swiglu_backward)(dg, du, dm, g, u, n);
  return df_launched("swiglu_backward");
}
dflash_status k_gather_rows(cudaStream_t s, bf16 *out, const bf16 *table, const int32_t *idx,
                            long rows, int n) {
  size_t t = (size_t)rows * n;
  if (!t) return DFLASH_OK;
  DF_LAUNCH(blocks_for(t, 256), 256, 0, s, gather_rows)(out, table, idx, rows, n);
  return df_launched("gather_rows");
}
dflash_status k_scatter_rows(cudaStream_t s, bf16 *out, const bf16 *rows, const int32_t *idx,
                             long n_rows, int n) {
  size_t t = (size_t)n_rows * n;
  if (!t) return DFLASH_OK;
  DF_LAUNCH(blocks_for(t, 256), 256, 0, s, scatter_rows)(out, rows, idx, n_rows, n);
  return df_launched("scatter_rows");
}
dflash_status k_f32_to_bf16(cudaStream_t s, bf16 *out, const float *in, size_t n) {
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, f32_to_bf16)(out, in, n);
  return df_launched("f32_to_bf16");
}
dflash_status k_bf16_to_f32(cudaStream_t s, float *out, const bf16 *in, size_t n) {
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, bf16_to_f32)(out, in, n);
  return df_launched("bf16_to_f32");
}
dflash_status k_hidden_decode(cudaStream_t s, bf16 *out, const void *codes, const float *scales,
                              int dtype, size_t n, int H, unsigned long long *bad) {
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, hidden_decode)(out, codes, scales, dtype, n, H, bad);
  return df_launched("hidden_decode");
}
dflash_status k_seq_loss(cudaStream_t s, const float *loss, const int32_t *rows_t,
                         const float *wtab, int B, int R, double *out) {
  DF_LAUNCH(1, 256, 0, s, seq_loss)(loss, rows_t, wtab, B, R, out);
  return df_launched("seq_loss");
}
dflash_status k_positions(cudaStream_t s, int32_t *pos, const int32_t *anchors, int A, int B) {
  if (A <= 0 || B <= 0) return DFLASH_OK;
  DF_LAUNCH((A * B + 255) / 256, 256, 0, s, positions)(pos, anchors, A, B);
  return df_launched("positions");
}
dflash_status k_lmhead_ce_init(cudaStream_t s, float *mx, float *sum, float *tl, int R) {
  if (!R) return DFLASH_OK;
  DF_LAUNCH((R + 255) / 256, 256, 0, s, lmhead_ce_init)(mx, sum, tl, R);
  return df_launched("lmhead_ce_init");
}
dflash_status k_lmhead_ce_chunk(cudaStream_t s, const float *logits, bf16 *probs, float *mx,
                                float *sum, float *tl, float *acc, const int32_t *target, int R,
                                int c, int v0, int H, bool grad) {
  if (!R) return DFLASH_OK;
  DF_LAUNCH(R, 256, 0, s, lmhead_ce_chunk)(logits, probs, mx, sum, tl, acc, target, c, v0, H, grad);
  return df_launched("lmhead_ce_chunk");
}
dflash_status k_lmhead_ce_finish(cudaStream_t s, float *loss, bf16 *dx, const float *mx,
                                 const float *sum, const float *tl, const float *acc,
                                 const float *coef, const bf16 *E, const int32_t *target, int R,
                                 int H) {
  if (!R) return DFLASH_OK;
  DF_LAUNCH(R, 256, 0, s, lmhead_ce_finish)(loss, dx, mx, sum, tl, acc, coef, E, target, H);
  return df_launched("lmhead_ce_finish");
}
dflash_status k_lmhead_argmax_init(cudaStream_t s, float *best, int32_t *best_i, int R) {
  if (!R) return DFLASH_OK;
  DF_LAUNCH((R + 255) / 256, 256, 0, s, lmhead_argmax_init)(best, best_i, R);
  return df_launched("lmhead_argmax_init");
}
dflash_status k_lmhead_argmax_chunk(cudaStream_t s, const float *logits, float *best,
                                    int32_t *best_i, int R, int c, int v0) {
  if (!R) return DFLASH_OK;
  DF_LAUNCH(R, 256, 0, s, lmhead_argmax_chunk)(logits, best, best_i, c, v0);
  return df_launched("lmhead_argmax_chunk");
}
dflash_status k_sumsq(cudaStream_t s, const float *x, size_t n, double *partial, double *out) {
  DF_LAUNCH(kSumsqBlocks, 256, 0, s, sumsq_partial)(x, n, partial);
  DF_TRY(df_launched("sumsq_partial"));
  DF_LAUNCH(1, 32, 0, s, sumsq_final)(partial, kSumsqBlocks, out);
  return df_launched("sumsq_final");
}
dflash_status k_scale(cudaStream_t s, float *x, float k, size_t n) {
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, scale)(x, k, n);
  return df_launched("scale");
}
dflash_status k_adamw(cudaStream_t s, float *p, bf16 *p16, const float *g, float *m1, float *m2,
                      size_t n, const df_cu_clip *clip, float decay, float b1, float b2, float eps,
                      float step_size, float bc2_sqrt) {
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, adamw)
  (p, p16, g, m1, m2, n, clip, decay, b1, b2, eps, step_size, bc2_sqrt);
  return df_launched("adamw");
}
dflash_status k_norm_sum(cudaStream_t s, const double *part, int n, df_cu_clip *clip) {
  DF_LAUNCH(1, 32, 0, s, norm_sum)(part, n, clip);
  return df_launched("norm_sum");
}
dflash_status k_norm_clip(cudaStream_t s, df_cu_clip *clip, double max_norm) {
  DF_LAUNCH(1, 32, 0, s, norm_clip)(clip, max_norm);
  return df_launched("norm_clip");
}
dflash_status k_scale_clipped(cudaStream_t s, float *x, const df_cu_clip *clip, size_t n) {
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, scale_clipped)(x, clip, n);
  return df_launched("scale_clipped");
}
dflash_status k_muon_momentum(cudaStream_t s, float *buf, float *u, const float *g, size_t n,
                              const df_cu_clip *clip, float mu) {
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, muon_momentum)(buf, u, g, n, clip, mu);
  return df_launched("muon_momentum");
}
dflash_status k_muon_normalize(cudaStream_t s, float *x, size_t n, const double *ss, float eps) {
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, muon_normalize)(x, n, ss, eps);
  return df_launched("muon_normalize");
}
dflash_status k_muon_apply(cudaStream_t s, float *p, bf16 *p16, const float *o, size_t n,
                           const df_cu_clip *clip, float decay, float step) {
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, muon_apply)(p, p16, o, n, clip, decay, step);
  return df_launched("muon_apply");
}

dflash_status k_dspark_loss_rows(cudaStream_t s, float *z, float *zt, bf16 *dz, const bf16 *x,
                                 const bf16 *e, const bf16 *cw, const bf16 *cb,
                                 const int32_t *target, const float *coef, float *loss, float *ds,
                                 const int32_t *kept, int n, int V, int Vt, int H, int r,
                                 float a_ce, float a_l1, float a_conf) {
  if (n <= 0) return DFLASH_OK;
  DF_LAUNCH(n, 256, 0, s, dspark_loss_rows)
  (z, zt, dz, x, e, cw, cb, target, coef, loss, ds, kept, V, Vt, H, r, a_ce, a_l1, a_conf);
  return df_launched("dspark_loss_rows");
}
dflash_status k_dspark_conf_rows(cudaStream_t s, bf16 *rows_dx, const float *acc, float *de,
                                 const float *ds, const bf16 *cw, int n, int H, int r) {
  if (n <= 0) return DFLASH_OK;
  DF_LAUNCH(n, 256, 0, s, dspark_conf_rows)(rows_dx, acc, de, ds, cw, H, r);
  return df_launched("dspark_conf_rows");
}
dflash_status k_dspark_param_grads(cudaStream_t s, float *dw1, const float *de, const int32_t *prev,
                                   float *dcw, float *dcb, const float *ds, const bf16 *x,
                                   const bf16 *e, int n, int H, int r) {
  if (n <= 0) return DFLASH_OK;
  int cols = r + (dcw ? H + r + 1 : 0);
  DF_LAUNCH((cols + 127) / 128, 128, 0, s, dspark_param_grads)
  (dw1, de, prev, dcw, dcb, ds, x, e, n, H, r);
  return df_launched("dspark_param_grads");
}
