// DFlash 2 on the GPU (dflash2.cuh): the kernels and their launchers. bf16 storage, float
// arithmetic in the CPU reference's order (src/train/dflash2.c), fixed summation orders
// (no atomics), so a run repeats to the bit.
// Kernels are named after the dflash2.h op they twin (df2_conv_apply, df2_selector_row), a
// pass of one adds the pass (df2_conv_backward_dx, df2_lmhead_topk_chunk); the greedy kernel
// is df2_select_greedy_block because its launcher is df2_select_greedy (kernels.cu's rule).
#include <math.h>

#include <vector>

#include "dflash2.cuh"

struct df2_dev {
  int H, B, L, V, k, g, G, K, r, chunk;
  float sel_weight;
  bool inject;
  int T = 0, R = 0;
  char *buf = nullptr;
  size_t bytes = 0;
  // Kept from the forward for the backward, per layer and convolution.
  float *dyn[DF_ACT_MAX_LAYERS][2]; // [T, 2kG]: prepare's taps, then finish's
  bf16 *xc[DF_ACT_MAX_LAYERS][2];   // [T, H] the convolved input
  bf16 *y[DF_ACT_MAX_LAYERS][2];    // [T, H] the sublayer output before finish
  // Backward scratch.
  bf16 *d_y, *d_dyn16;
  float *d_xc, *d_dyn, *dbase_part;
  // Selector, per row.
  int32_t *cand, *prev, *pred;
  float *unary, *ds, *tl, *hp, *sdx;
  bf16 *dh16, *u16, *wv16;
};

namespace {

constexpr int kWarp = 32;
constexpr int kSegRows = 256; // rows per partial sum of the base kernels' gradient
constexpr int kMaxSeg = 64;

__device__ __forceinline__ float ld(const bf16 *p, size_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ float ld(const float *p, size_t i) { return p[i]; }
__device__ __forceinline__ void st(bf16 *p, size_t i, float v) { p[i] = __float2bfloat16(v); }
__device__ __forceinline__ void st(float *p, size_t i, float v) { p[i] = v; }

unsigned blocks_for(size_t n, int threads) {
  size_t b = (n + threads - 1) / threads;
  return (unsigned)(b > 65535u * 16 ? 65535u * 16 : b);
}

int segments(int T) {
  int s = (T + kSegRows - 1) / kSegRows;
  return s < 1 ? 1 : s > kMaxSeg ? kMaxSeg : s;
}

// Row-major C[M,N] = op(A) op(B) (+ beta C), A and B bf16, C fp32 (as model.cu's gemm).
dflash_status gemm32(cublasHandle_t h, bool ta, bool tb, int M, int N, int K, const bf16 *A,
                     int lda, const bf16 *B, int ldb, float *C, int ldc, float beta) {
  if (M <= 0 || N <= 0 || K <= 0) return DFLASH_OK;
  float alpha = 1.0f;
  DF_BLAS(cublasGemmEx(h, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K,
                       &alpha, B, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &beta, C, CUDA_R_32F, ldc,
                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return DFLASH_OK;
}

// ---- the convolution -----------------------------------------------------------------
// out[t, c] = residual[t, c] + sum_{o < taps} (base[o, c] + dyn[t, o, c / g]) x[t - o, c],
// taps = min(k, j + 1) for block position j = t mod B: never across a block's start.
__global__ void df2_conv_apply(bf16 *out, const bf16 *x, const float *dyn, int dyn_stride,
                               const bf16 *base, const bf16 *residual, int T, int B, int H, int k,
                               int g) {
  size_t n = (size_t)T * H, G = (size_t)H / g;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    size_t t = i / H, ch = i % H;
    int j = (int)(t % B), taps = j + 1 < k ? j + 1 : k;
    const float *dr = dyn + t * dyn_stride;
    float acc = 0.0f;
    for (int o = 0; o < taps; o++) {
      float v = ld(x, (t - o) * H + ch);
      acc += ld(base, (size_t)o * H + ch) * v;
      acc += dr[(size_t)o * G + ch / g] * v;
    }
    out[i] = __float2bfloat16(residual ? ld(residual, i) + acc : acc);
  }
}

// dx[s, c] = sum over the rows t = s + o of the same block that read x[s] of
// dout[t, c] (base[o, c] + dyn[t, o, c / g]).
template <typename DY, typename DX>
__global__ void df2_conv_backward_dx(DX *dx, const DY *dout, const float *dyn, int dyn_stride,
                                     const bf16 *base, int T, int B, int H, int k, int g) {
  size_t n = (size_t)T * H, G = (size_t)H / g;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    size_t s = i / H, ch = i % H;
    int j = (int)(s % B), ahead = B - j < k ? B - j : k;
    float acc = 0.0f;
    for (int o = 0; o < ahead; o++) {
      size_t t = s + o;
      float w = ld(base, (size_t)o * H + ch) + dyn[t * dyn_stride + (size_t)o * G + ch / g];
      acc += ld(dout, t * H + ch) * w;
    }
    st(dx, i, acc);
  }
}

// ddyn[s, o, q] = sum over the channels c of group q of dout[s, c] x[s - o, c] (0 for the
// taps before the block's start).
template <typename DY>
__global__ void df2_conv_backward_ddyn(float *ddyn, int dyn_stride, const DY *dout, const bf16 *x,
                                       int T, int B, int H, int k, int g) {
  size_t G = (size_t)H / g, n = (size_t)T * k * G;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    size_t s = i / (k * G), oq = i % (k * G), q = oq % G;
    int o = (int)(oq / G), j = (int)(s % B);
    float acc = 0.0f;
    for (size_t ch = q * g; o <= j && ch < (q + 1) * g; ch++)
      acc += ld(dout, s * H + ch) * ld(x, (s - o) * H + ch);
    ddyn[s * dyn_stride + oq] = acc;
  }
}

// Partial sums of dbase[o, c] = sum_t dout[t, c] x[t - o, c] (same block) over segments of
// kSegRows rows: part[seg, o, c]. Grid (channel blocks, k, segments).
template <typename DY>
__global__ void df2_conv_backward_dbase_partial(float *part, const DY *dout, const bf16 *x, int T,
                                                int B, int H, int k) {
  int ch = blockIdx.x * blockDim.x + threadIdx.x, o = blockIdx.y, seg = blockIdx.z;
  if (ch >= H) return;
  int t0 = seg * kSegRows, t1 = t0 + kSegRows < T ? t0 + kSegRows : T;
  if (seg == (int)gridDim.z - 1) t1 = T; // the last segment takes the rest
  float acc = 0.0f;
  for (int t = t0; t < t1; t++)
    if (t % B >= o) acc += ld(dout, (size_t)t * H + ch) * ld(x, (size_t)(t - o) * H + ch);
  part[((size_t)seg * k + o) * H + ch] = acc;
}

__global__ void df2_conv_backward_dbase_reduce(float *dbase, const float *part, int n_seg, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < n_seg; s++) acc += part[(size_t)s * n + i];
    dbase[i] += acc;
  }
}

// ---- top-K inside the LM head's chunk pass ---------------------------------------------
__global__ void df2_lmhead_topk_init(int32_t *ids, float *vals, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    ids[i] = 0, vals[i] = -INFINITY;
}

// One warp per row: the lanes read 32 logits at a time, the ones above the row's K-th best
// are inserted by lane 0 in token order (so ties keep the smaller id, as on the CPU).
__global__ void df2_lmhead_topk_chunk(const float *logits, int32_t *ids, float *vals, int R, int cn,
                                      int v0, int K) {
  int row = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (row >= R) return;
  const float *l = logits + (size_t)row * cn;
  int32_t *id = ids + (size_t)row * K;
  float *val = vals + (size_t)row * K;
  for (int b = 0; b < cn; b += kWarp) {
    float v = b + lane < cn ? l[b + lane] : -INFINITY;
    unsigned mask = __ballot_sync(0xffffffffu, v > val[K - 1]);
    while (mask) {
      int src = __ffs((int)mask) - 1;
      mask &= mask - 1;
      float x = __shfl_sync(0xffffffffu, v, src);
      if (lane == 0 && x > val[K - 1]) {
        int i = K - 1;
        for (; i > 0 && x > val[i - 1]; i--) id[i] = id[i - 1], val[i] = val[i - 1];
        id[i] = v0 + b + src, val[i] = x;
      }
      __syncwarp();
    }
  }
}

// ---- the selector loss ---------------------------------------------------------------
// One warp per row: the true token's logit (for "inject").
__global__ void df2_selector_target_logit(float *tl, const bf16 *x, const bf16 *E,
                                          const int32_t *target, int R, int H) {
  int row = blockIdx.x * (blockDim.x / kWarp) + threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (row >= R) return;
  float acc = 0;
  for (int i = lane; i < H; i += kWarp)
    acc += ld(x, (size_t)row * H + i) * ld(E, (size_t)target[row] * H + i);
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) tl[row] = acc;
}

struct sel_rows_args {
  int32_t *cand;
  float *unary, *ds;
  const float *tl, *hp, *coef;
  const int32_t *target, *prev;
  const bf16 *pred, *succ, *E;
  float *loss, *sdx;
  bf16 *dh16, *u16, *wv16;
  int K, r, H;
  float weight;
  bool inject;
};

// One block per row i (df2_selector_row's twin): the candidates (true token found, injected
// or the row dropped), the scores unary + <A(prev) * P(h), B(cand)>, the CE added to the row
// loss and, with coef, d(score) = coef * weight * (softmax - onehot) and from it the row's
// d(P(h)), A(prev) * P(h) and P(h) * sum_c ds_c B(cand_c) (for the codebooks' GEMMs), and
// the unary path's d(x) = sum_c ds_c E[cand_c].
__global__ void df2_selector_row(sel_rows_args a) {
  int i = blockIdx.x, K = a.K, r = a.r;
  DF_SHARED(int, y_sh, [1]);
  DF_SHARED(double, mz, [2]);
  int32_t *cand = a.cand + (size_t)i * K;
  float *un = a.unary + (size_t)i * K, *ds = a.ds + (size_t)i * K;
  const float *h = a.hp + (size_t)i * r;
  const bf16 *pa = a.pred + (size_t)a.prev[i] * r;
  if (threadIdx.x == 0) {
    int y = -1;
    for (int c = 0; c < K && y < 0; c++) y = cand[c] == a.target[i] ? c : -1;
    if (y < 0 && a.inject) cand[K - 1] = a.target[i], un[K - 1] = a.tl[i], y = K - 1;
    y_sh[0] = y;
  }
  __syncthreads();
  int y = y_sh[0];
  bool grad = a.coef != nullptr;
  if (y < 0) { // "drop": nothing from this row
    for (int c = threadIdx.x; grad && c < K; c += blockDim.x) ds[c] = 0;
    for (int j = threadIdx.x; grad && j < r; j += blockDim.x) {
      size_t o = (size_t)i * r + j;
      a.dh16[o] = a.u16[o] = a.wv16[o] = __float2bfloat16(0.0f);
    }
    for (int j = threadIdx.x; grad && j < a.H; j += blockDim.x) a.sdx[(size_t)i * a.H + j] = 0;
    return;
  }
  for (int c = threadIdx.x; c < K; c += blockDim.x) {
    const bf16 *b = a.succ + (size_t)cand[c] * r;
    float e = 0;
    for (int j = 0; j < r; j++) e += ld(pa, j) * h[j] * ld(b, j);
    ds[c] = un[c] + e; // the score, until the softmax below
  }
  __syncthreads();
  if (threadIdx.x == 0) { // K <= 1024 scores, in the CPU's order and precision
    double mx = -INFINITY, z = 0;
    for (int c = 0; c < K; c++) mx = ds[c] > mx ? ds[c] : mx;
    for (int c = 0; c < K; c++) z += exp((double)ds[c] - mx);
    a.loss[i] += a.weight * (float)(mx + log(z) - ds[y]);
    mz[0] = mx, mz[1] = z;
  }
  __syncthreads();
  if (!grad) return;
  float cf = a.coef[i] * a.weight;
  for (int c = threadIdx.x; c < K; c += blockDim.x)
    ds[c] = cf * (float)(exp((double)ds[c] - mz[0]) / mz[1] - (c == y));
  __syncthreads();
  for (int j = threadIdx.x; j < r; j += blockDim.x) {
    float sb = 0, aj = ld(pa, j);
    for (int c = 0; c < K; c++) sb += ds[c] * ld(a.succ, (size_t)cand[c] * r + j);
    size_t o = (size_t)i * r + j;
    a.dh16[o] = __float2bfloat16(aj * sb);
    a.u16[o] = __float2bfloat16(aj * h[j]);
    a.wv16[o] = __float2bfloat16(h[j] * sb);
  }
  for (int j = threadIdx.x; j < a.H; j += blockDim.x) {
    float acc = 0;
    for (int c = 0; c < K; c++) acc += ds[c] * ld(a.E, (size_t)cand[c] * a.H + j);
    a.sdx[(size_t)i * a.H + j] = acc;
  }
}

// The rows' sparse [R, cn] matrix of chunk [v0, v0 + cn): ds at each candidate (codebook B),
// or 1 at the previous token (codebook A, prev non-NULL). The buffer is zeroed first.
__global__ void df2_selector_scatter_chunk(bf16 *mat, const int32_t *cand, const float *ds,
                                           const int32_t *prev, int R, int K, int cn, int v0) {
  size_t n = prev ? (size_t)R : (size_t)R * K;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    int tok = prev ? prev[i] : cand[i];
    size_t row = prev ? i : i / K;
    if (tok >= v0 && tok < v0 + cn)
      mat[row * cn + (tok - v0)] = __float2bfloat16(prev ? 1.0f : ds[i]);
  }
}

// rows_dx (bf16) += sdx (fp32).
__global__ void df2_add_rows(bf16 *dx, const float *sdx, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    dx[i] = __float2bfloat16(ld(dx, i) + sdx[i]);
}

// One thread per block (df2_select_greedy's twin): position by position, the candidate of
// the best score given the token chosen before (the block's own token first).
__global__ void df2_select_greedy_block(int32_t *pred, const int32_t *cand, const float *unary,
                                        const float *hp, const int32_t *block_tok,
                                        const bf16 *pred_cb, const bf16 *succ_cb, int A, int B,
                                        int K, int r) {
  int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= A) return;
  int32_t prev = block_tok[(size_t)n * B];
  for (int j = 0; j < B - 1; j++) {
    size_t i = (size_t)n * (B - 1) + j;
    const bf16 *pa = pred_cb + (size_t)prev * r;
    const float *h = hp + i * r;
    int best = 0;
    float best_s = 0;
    for (int c = 0; c < K; c++) {
      const bf16 *b = succ_cb + (size_t)cand[i * K + c] * r;
      float e = 0;
      for (int q = 0; q < r; q++) e += ld(pa, q) * h[q] * ld(b, q);
      float s = unary[i * K + c] + e;
      if (c == 0 || s > best_s) best = c, best_s = s;
    }
    prev = pred[i] = cand[i * K + best];
  }
}

template <typename T>
T *carve(char *base, size_t *cur, size_t count) {
  T *p = base ? (T *)(base + *cur) : nullptr;
  *cur += (count * sizeof(T) + 255) & ~(size_t)255;
  return p;
}

size_t layout(df2_dev *d, char *base, int T, int R) {
  size_t cur = 0, t = (size_t)T, rr = (size_t)R, H = (size_t)d->H, kg2 = 2 * (size_t)d->k * d->G;
  for (int l = 0; l < d->L; l++)
    for (int w = 0; w < 2; w++) {
      d->dyn[l][w] = carve<float>(base, &cur, t * kg2);
      d->xc[l][w] = carve<bf16>(base, &cur, t * H);
      d->y[l][w] = carve<bf16>(base, &cur, t * H);
    }
  d->d_y = carve<bf16>(base, &cur, t * H);
  d->d_xc = carve<float>(base, &cur, t * H);
  d->d_dyn = carve<float>(base, &cur, t * kg2);
  d->d_dyn16 = carve<bf16>(base, &cur, t * kg2);
  d->dbase_part = carve<float>(base, &cur, (size_t)kMaxSeg * d->k * H);
  size_t rk = rr * d->K, rq = rr * d->r;
  d->cand = carve<int32_t>(base, &cur, rk);
  d->unary = carve<float>(base, &cur, rk);
  d->ds = carve<float>(base, &cur, rk);
  d->prev = carve<int32_t>(base, &cur, rr);
  d->pred = carve<int32_t>(base, &cur, rr);
  d->tl = carve<float>(base, &cur, rr);
  d->hp = carve<float>(base, &cur, rq);
  d->dh16 = carve<bf16>(base, &cur, rq);
  d->u16 = carve<bf16>(base, &cur, rq);
  d->wv16 = carve<bf16>(base, &cur, rq);
  d->sdx = carve<float>(base, &cur, rr * H);
  return cur;
}

// The convolution's backward for dout (d(out), or d(convolved input)) of input x.
template <typename DY, typename DX>
dflash_status conv_backward(df2_dev *d, cudaStream_t s, DX *dx, float *ddyn, float *dbase,
                            const DY *dout, const bf16 *x, const float *dyn, const bf16 *base) {
  int T = d->T, H = d->H, kg2 = 2 * d->k * d->G, seg = segments(T);
  size_t n = (size_t)T * H;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, df2_conv_backward_dx<DY, DX>)
  (dx, dout, dyn, kg2, base, T, d->B, H, d->k, d->g);
  DF_TRY(df_launched("df2_conv_backward_dx"));
  DF_LAUNCH(blocks_for((size_t)T * d->k * d->G, 256), 256, 0, s, df2_conv_backward_ddyn<DY>)
  (ddyn, kg2, dout, x, T, d->B, H, d->k, d->g);
  DF_TRY(df_launched("df2_conv_backward_ddyn"));
  DF_LAUNCH(dim3((H + 127) / 128, d->k, seg), 128, 0, s, df2_conv_backward_dbase_partial<DY>)
  (d->dbase_part, dout, x, T, d->B, H, d->k);
  DF_TRY(df_launched("df2_conv_backward_dbase_partial"));
  DF_LAUNCH(blocks_for((size_t)d->k * H, 256), 256, 0, s, df2_conv_backward_dbase_reduce)
  (dbase, d->dbase_part, seg, d->k * H);
  return df_launched("df2_conv_backward_dbase_reduce");
}

// d(codebook)[v0 : v0 + cn] += mat^T rows for every vocabulary chunk, mat the sparse
// [R, cn] matrix of df2_selector_scatter_chunk: the sums over rows in a fixed order (a GEMM) where
// scattered atomics would not repeat to the bit.
dflash_status codebook_grad(df2_dev *d, cudaStream_t s, cublasHandle_t h, float *dcb,
                            const bf16 *rows, const int32_t *prev, int R, bf16 *mat) {
  for (int v0 = 0; v0 < d->V; v0 += d->chunk) {
    int cn = d->V - v0 < d->chunk ? d->V - v0 : d->chunk;
    DF_CU(cudaMemsetAsync(mat, 0, 2 * (size_t)R * cn, s));
    size_t n = prev ? (size_t)R : (size_t)R * d->K;
    DF_LAUNCH(blocks_for(n, 256), 256, 0, s, df2_selector_scatter_chunk)
    (mat, d->cand, d->ds, prev, R, d->K, cn, v0);
    DF_TRY(df_launched("df2_selector_scatter_chunk"));
    DF_TRY(gemm32(h, true, false, cn, d->r, R, mat, cn, rows, d->r, dcb + (size_t)v0 * d->r, d->r,
                  1.0f));
  }
  return DFLASH_OK;
}

} // namespace

dflash_status df2_create(const df_cu_config *c, df2_dev **out) {
  *out = nullptr;
  if (c->conv_k < 1 || c->conv_g < 1 || c->H % c->conv_g || c->sel_top_k < 1 ||
      c->sel_top_k > 1024 || c->sel_top_k > c->V || c->sel_rank < 1 || c->L > DF_ACT_MAX_LAYERS)
    return df_error(DFLASH_E_INVALID_ARG,
                    "CUDA DFlash 2: kernel size %d, group %d (H %d), "
                    "top-%d of %d tokens, rank %d",
                    c->conv_k, c->conv_g, c->H, c->sel_top_k, c->V, c->sel_rank);
  df2_dev *d = new (std::nothrow) df2_dev();
  if (!d) return df_error(DFLASH_E_NOMEM, "CUDA DFlash 2 state");
  d->H = c->H, d->B = c->B, d->L = c->L, d->V = c->V, d->k = c->conv_k, d->g = c->conv_g;
  d->G = c->H / c->conv_g, d->K = c->sel_top_k, d->r = c->sel_rank;
  d->chunk = c->vocab_chunk > 0 && c->vocab_chunk < c->V ? c->vocab_chunk : c->V;
  d->sel_weight = (float)c->sel_weight, d->inject = c->sel_inject != 0;
  *out = d;
  return DFLASH_OK;
}

void df2_free(df2_dev *d) {
  if (!d) return;
  if (d->buf) cudaFree(d->buf);
  delete d;
}

size_t df2_bytes(const df2_dev *d) { return d ? d->bytes : 0; }

dflash_status df2_reserve(df2_dev *d, cudaStream_t s, int T, int R, bool poison) {
  size_t need = layout(d, nullptr, T, R);
  if (need > d->bytes) {
    if (d->buf) cudaFree(d->buf);
    d->buf = nullptr, d->bytes = 0;
    cudaError_t e = cudaMalloc((void **)&d->buf, need);
    if (e != cudaSuccess)
      return df_error(DFLASH_E_NOMEM,
                      "CUDA: cannot allocate %.2f GiB for DFlash 2's "
                      "convolutions and selector: %s",
                      need / 1073741824.0, cudaGetErrorString(e));
    d->bytes = need;
  }
  layout(d, d->buf, T, R);
  d->T = T, d->R = R;
  if (poison) DF_CU(cudaMemsetAsync(d->buf, 0xff, d->bytes, s));
  return DFLASH_OK;
}

dflash_status df2_prepare(df2_dev *d, cudaStream_t s, cublasHandle_t h, int l, int which,
                          const bf16 *xn, const bf16 *proj, const bf16 *base, const bf16 **xc) {
  int T = d->T, H = d->H, kg2 = 2 * d->k * d->G;
  float *dyn = d->dyn[l][which];
  DF_TRY(gemm32(h, false, true, T, kg2, H, xn, H, proj, H, dyn, kg2, 0.0f));
  size_t n = (size_t)T * H;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, df2_conv_apply)
  (d->xc[l][which], xn, dyn, kg2, base, nullptr, T, d->B, H, d->k, d->g);
  *xc = d->xc[l][which];
  return df_launched("df2_conv_apply");
}

bf16 *df2_y(df2_dev *d, int l, int which) { return d->y[l][which]; }
const bf16 *df2_xc(df2_dev *d, int l, int which) { return d->xc[l][which]; }
float *df2_dxc(df2_dev *d) { return d->d_xc; }

dflash_status df2_finish(df2_dev *d, cudaStream_t s, int l, int which, bf16 *out,
                         const bf16 *residual, const bf16 *base) {
  int T = d->T, H = d->H, kg = d->k * d->G;
  size_t n = (size_t)T * H;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, df2_conv_apply)
  (out, d->y[l][which], d->dyn[l][which] + kg, 2 * kg, base + (size_t)d->k * H, residual, T, d->B,
   H, d->k, d->g);
  return df_launched("df2_conv_apply");
}

dflash_status df2_finish_bwd(df2_dev *d, cudaStream_t s, int l, int which, const bf16 *dout,
                             const bf16 *base, float *dbase, const bf16 **dy) {
  size_t kg = (size_t)d->k * d->G, kh = (size_t)d->k * d->H;
  DF_TRY(conv_backward(d, s, d->d_y, d->d_dyn + kg, dbase + kh, dout, d->y[l][which],
                       d->dyn[l][which] + kg, base + kh));
  *dy = d->d_y;
  return DFLASH_OK;
}

dflash_status df2_prepare_bwd(df2_dev *d, cudaStream_t s, cublasHandle_t h, int l, int which,
                              float *dxn, const bf16 *xn, const bf16 *proj, const bf16 *base,
                              float *dproj, float *dbase) {
  int T = d->T, H = d->H, kg2 = 2 * d->k * d->G;
  DF_TRY(conv_backward(d, s, dxn, d->d_dyn, dbase, (const float *)d->d_xc, xn, d->dyn[l][which],
                       base));
  DF_TRY(k_f32_to_bf16(s, d->d_dyn16, d->d_dyn, (size_t)T * kg2));
  // Through the kernel projection: d(xn) += ddyn proj, d(proj) += ddyn^T xn.
  DF_TRY(gemm32(h, false, false, T, H, kg2, d->d_dyn16, kg2, proj, H, dxn, H, 1.0f));
  return gemm32(h, true, false, kg2, H, T, d->d_dyn16, kg2, xn, H, dproj, H, 1.0f);
}

dflash_status df2_topk_init(df2_dev *d, cudaStream_t s, int R) {
  size_t n = (size_t)R * d->K;
  if (!n) return DFLASH_OK;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, df2_lmhead_topk_init)(d->cand, d->unary, n);
  return df_launched("df2_lmhead_topk_init");
}

dflash_status df2_topk_chunk(df2_dev *d, cudaStream_t s, const float *logits, int R, int cn,
                             int v0) {
  if (!R) return DFLASH_OK;
  DF_LAUNCH((R + 7) / 8, 256, 0, s, df2_lmhead_topk_chunk)
  (logits, d->cand, d->unary, R, cn, v0, d->K);
  return df_launched("df2_lmhead_topk_chunk");
}

dflash_status df2_selector(df2_dev *d, cudaStream_t s, cublasHandle_t h, const df2_sel_io *io) {
  int R = io->R, H = d->H, r = d->r;
  if (R <= 0) return DFLASH_OK;
  if (!io->prev_host)
    return df_error(DFLASH_E_INTERNAL, "CUDA DFlash 2: the batch has no previous tokens");
  DF_CU(cudaMemcpyAsync(d->prev, io->prev_host, 4 * (size_t)R, cudaMemcpyHostToDevice, s));
  DF_LAUNCH((R + 7) / 8, 256, 0, s, df2_selector_target_logit)
  (d->tl, io->x, io->E, io->target, R, H);
  DF_TRY(df_launched("df2_selector_target_logit"));
  DF_TRY(gemm32(h, false, true, R, r, H, io->x, H, io->hproj, H, d->hp, r, 0.0f));
  sel_rows_args a = {d->cand, d->unary, d->ds,    d->tl, d->hp,    io->coef,      io->target,
                     d->prev, io->pred, io->succ, io->E, io->loss, d->sdx,        d->dh16,
                     d->u16,  d->wv16,  d->K,     r,     H,        d->sel_weight, d->inject};
  DF_LAUNCH(R, 128, 0, s, df2_selector_row)(a);
  DF_TRY(df_launched("df2_selector_row"));
  if (!io->coef) return DFLASH_OK;
  // hidden_projection: d(P) += dh^T x; the rows' d(x) += dh P, then into rows_dx.
  DF_TRY(gemm32(h, true, false, r, H, R, d->dh16, r, io->x, H, io->dhproj, H, 1.0f));
  DF_TRY(gemm32(h, false, false, R, H, r, d->dh16, r, io->hproj, H, d->sdx, H, 1.0f));
  size_t n = (size_t)R * H;
  DF_LAUNCH(blocks_for(n, 256), 256, 0, s, df2_add_rows)(io->rows_dx, d->sdx, n);
  DF_TRY(df_launched("df2_add_rows"));
  DF_TRY(codebook_grad(d, s, h, io->dsucc, d->u16, nullptr, R, io->scratch));
  return codebook_grad(d, s, h, io->dpred, d->wv16, d->prev, R, io->scratch);
}

dflash_status df2_select_greedy(df2_dev *d, cudaStream_t s, cublasHandle_t h, const bf16 *x,
                                const int32_t *block_tok, int A, const bf16 *pred_cb,
                                const bf16 *succ_cb, const bf16 *hproj, int32_t *pred) {
  int R = A * (d->B - 1);
  if (R <= 0) return DFLASH_OK;
  DF_TRY(gemm32(h, false, true, R, d->r, d->H, x, d->H, hproj, d->H, d->hp, d->r, 0.0f));
  DF_LAUNCH((A + 63) / 64, 64, 0, s, df2_select_greedy_block)
  (d->pred, d->cand, d->unary, d->hp, block_tok, pred_cb, succ_cb, A, d->B, d->K, d->r);
  DF_TRY(df_launched("df2_select_greedy_block"));
  DF_CU(cudaMemcpyAsync(pred, d->pred, 4 * (size_t)R, cudaMemcpyDeviceToHost, s));
  return DFLASH_OK;
}
