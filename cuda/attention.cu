// DFlash-masked attention on the GPU, flash-attention style: queries are the
// B positions of one block, keys are the context prefix before the block's
// anchor plus the block itself; scores live one key tile at a time in shared
// memory with an online softmax, never as an S x S matrix. The mask is
// ops.c's `visible`: context s < anchor (and, in sliding layers,
// s >= anchor + j - (window - 1)); block keys all (sliding: j - (window-1)
// .. j). Three kernels: forward; backward for dq and the block's own dk/dv
// (one CTA per block and kv head, its query heads in order); backward for
// the context dk/dv (one CTA per tile of context rows and kv head, summing
// over blocks in order), so results do not depend on scheduling.
#include <float.h>

#include "common.cuh"

namespace {

constexpr int kTpr = 8;     // threads per query row
constexpr int kKt = 64;     // keys per tile (forward, dq pass)
constexpr int kKtCtx = 32;  // context keys per CTA (dk/dv pass)
constexpr int kMaxDpt = 32; // head_dim / kTpr (head_dim <= 256)

struct Shape {
  int B, Sc, nh, nkv, d, window;
  const int32_t *anchors;
  float scale;
};

__device__ __forceinline__ int n_ctx(const Shape &s, int a) { return a < s.Sc ? a : s.Sc; }

// Whether query j (block with anchor a) sees key `key` (< nctx: context
// row, else block row key - nctx).
__device__ __forceinline__ bool visible(const Shape &s, int a, int nctx, int j, int key) {
  if (key < nctx) return s.window <= 0 || key >= a + j - (s.window - 1);
  int p = key - nctx;
  return s.window <= 0 || (p <= j && p >= j - (s.window - 1));
}

// First context row any query of the block can see.
__device__ __forceinline__ int ctx_lo(const Shape &s, int a) {
  if (s.window <= 0) return 0;
  int lo = a - (s.window - 1);
  return lo > 0 ? lo : 0;
}

__device__ __forceinline__ const bf16 *key_row(const Shape &s, const bf16 *ctx, const bf16 *blk,
                                               int n, int nctx, int key, int g) {
  return key < nctx ? ctx + ((size_t)key * s.nkv + g) * s.d
                    : blk + (((size_t)n * s.B + (key - nctx)) * s.nkv + g) * s.d;
}

// Load `cnt` key/value rows starting at `k0` into shared tiles.
__device__ void load_tile(const Shape &s, bf16 *Ks, bf16 *Vs, const bf16 *kc, const bf16 *vc,
                          const bf16 *kb, const bf16 *vb, int n, int nctx, int k0, int cnt,
                          int g) {
  for (int e = threadIdx.x; e < cnt * s.d; e += blockDim.x) {
    int k = e / s.d, dd = e % s.d;
    Ks[k * s.d + dd] = key_row(s, kc, kb, n, nctx, k0 + k, g)[dd];
    Vs[k * s.d + dd] = key_row(s, vc, vb, n, nctx, k0 + k, g)[dd];
  }
}

__device__ __forceinline__ float dot_fb(const float *a, const bf16 *b, int d) {
  float s = 0;
  for (int i = 0; i < d; i++) s += a[i] * __bfloat162float(b[i]);
  return s;
}

__device__ __forceinline__ float row_sum8(float v) {
  unsigned mask = __activemask(); // the last warp is partial when B * 8 % 32 != 0
  for (int o = kTpr / 2; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
  return v;
}

// ---- forward: one CTA per (block, head), B * 8 threads ----------------------------
__global__ void attn_fwd(Shape s, bf16 *out, float *lse, const bf16 *q, const bf16 *kc,
                         const bf16 *vc, const bf16 *kb, const bf16 *vb) {
  DF_DYN_SHARED(float, smem);
  int n = blockIdx.x, h = blockIdx.y, g = h / (s.nh / s.nkv), d = s.d;
  float *qs = smem;                          // [B][d]
  float *S = qs + s.B * d;                   // [B][kKt]
  bf16 *Ks = (bf16 *)(S + s.B * kKt);        // [kKt][d]
  bf16 *Vs = Ks + kKt * d;
  int j = threadIdx.x / kTpr, l = threadIdx.x % kTpr, dpt = d / kTpr;
  for (int e = threadIdx.x; e < s.B * d; e += blockDim.x) {
    size_t t = (size_t)n * s.B + e / d;
    qs[e] = __bfloat162float(q[(t * s.nh + h) * d + e % d]);
  }
  int a = s.anchors[n], nctx = n_ctx(s, a), k_begin = ctx_lo(s, a) < nctx ? ctx_lo(s, a) : nctx;
  int nk = nctx + s.B;
  float acc[kMaxDpt], m = -FLT_MAX, lsum = 0;
  for (int i = 0; i < dpt; i++) acc[i] = 0;
  for (int k0 = k_begin; k0 < nk; k0 += kKt) {
    int cnt = nk - k0 < kKt ? nk - k0 : kKt;
    __syncthreads();
    load_tile(s, Ks, Vs, kc, vc, kb, vb, n, nctx, k0, cnt, g);
    __syncthreads();
    for (int k = l; k < cnt; k += kTpr)
      S[j * kKt + k] = visible(s, a, nctx, j, k0 + k)
                           ? dot_fb(qs + j * d, Ks + k * d, d) * s.scale : -FLT_MAX;
    __syncthreads();
    float tm = m;
    for (int k = 0; k < cnt; k++) tm = fmaxf(tm, S[j * kKt + k]);
    float rescale = __expf(m - tm);
    lsum *= rescale;
    for (int i = 0; i < dpt; i++) acc[i] *= rescale;
    for (int k = 0; k < cnt; k++) {
      float sc = S[j * kKt + k];
      if (sc == -FLT_MAX) continue;
      float p = __expf(sc - tm);
      lsum += p;
      const bf16 *v = Vs + k * d + l * dpt;
      for (int i = 0; i < dpt; i++) acc[i] += p * __bfloat162float(v[i]);
    }
    m = tm;
  }
  size_t t = (size_t)n * s.B + j;
  float inv = lsum > 0 ? 1.0f / lsum : 0.0f;
  for (int i = 0; i < dpt; i++)
    out[(t * s.nh + h) * d + l * dpt + i] = __float2bfloat16(acc[i] * inv);
  if (l == 0) lse[t * s.nh + h] = m + logf(lsum);
}

// ---- backward 1: dq, block dk/dv; one CTA per (block, kv head) -----------------------
__global__ void attn_bwd_block(Shape s, bf16 *dq, bf16 *dkb, bf16 *dvb, float *Dg,
                               const bf16 *dout, const bf16 *o, const float *lse, const bf16 *q,
                               const bf16 *kc, const bf16 *vc, const bf16 *kb, const bf16 *vb) {
  DF_DYN_SHARED(float, smem);
  int n = blockIdx.x, g = blockIdx.y, d = s.d, grp = s.nh / s.nkv;
  float *qs = smem, *dOs = qs + s.B * d;     // [B][d]
  float *P = dOs + s.B * d, *dS = P + s.B * kKt; // [B][kKt]
  bf16 *Ks = (bf16 *)(dS + s.B * kKt), *Vs = Ks + kKt * d;
  int j = threadIdx.x / kTpr, l = threadIdx.x % kTpr, dpt = d / kTpr;
  int a = s.anchors[n], nctx = n_ctx(s, a), k_begin = ctx_lo(s, a) < nctx ? ctx_lo(s, a) : nctx;
  int nk = nctx + s.B;
  float dkb_acc[kMaxDpt], dvb_acc[kMaxDpt]; // block key j's rows, dims l*dpt..
  for (int i = 0; i < dpt; i++) dkb_acc[i] = dvb_acc[i] = 0;
  for (int h = g * grp; h < (g + 1) * grp; h++) {
    size_t th = ((size_t)n * s.B + j) * s.nh + h;
    __syncthreads();
    for (int e = threadIdx.x; e < s.B * d; e += blockDim.x) {
      size_t r = (((size_t)n * s.B + e / d) * s.nh + h) * d + e % d;
      qs[e] = __bfloat162float(q[r]);
      dOs[e] = __bfloat162float(dout[r]);
    }
    float part = 0;
    for (int i = 0; i < dpt; i++)
      part += __bfloat162float(dout[th * d + l * dpt + i]) *
              __bfloat162float(o[th * d + l * dpt + i]);
    float D = row_sum8(part), L = lse[th];
    if (l == 0) Dg[th] = D;
    float dq_acc[kMaxDpt];
    for (int i = 0; i < dpt; i++) dq_acc[i] = 0;
    for (int k0 = k_begin; k0 < nk; k0 += kKt) {
      int cnt = nk - k0 < kKt ? nk - k0 : kKt;
      __syncthreads();
      load_tile(s, Ks, Vs, kc, vc, kb, vb, n, nctx, k0, cnt, g);
      __syncthreads();
      for (int k = l; k < cnt; k += kTpr) {
        float p = 0, ds = 0;
        if (visible(s, a, nctx, j, k0 + k)) {
          p = __expf(dot_fb(qs + j * d, Ks + k * d, d) * s.scale - L);
          ds = p * (dot_fb(dOs + j * d, Vs + k * d, d) - D) * s.scale;
        }
        P[j * kKt + k] = p;
        dS[j * kKt + k] = ds;
      }
      __syncthreads();
      for (int k = 0; k < cnt; k++) {
        float ds = dS[j * kKt + k];
        const bf16 *kr = Ks + k * d + l * dpt;
        for (int i = 0; i < dpt; i++) dq_acc[i] += ds * __bfloat162float(kr[i]);
      }
      // Thread row j doubles as block key j for the block's own dk/dv.
      int k = nctx + j - k0;
      if (k >= 0 && k < cnt)
        for (int jj = 0; jj < s.B; jj++) {
          float ds = dS[jj * kKt + k], p = P[jj * kKt + k];
          for (int i = 0; i < dpt; i++) {
            dkb_acc[i] += ds * qs[jj * d + l * dpt + i];
            dvb_acc[i] += p * dOs[jj * d + l * dpt + i];
          }
        }
    }
    for (int i = 0; i < dpt; i++) dq[th * d + l * dpt + i] = __float2bfloat16(dq_acc[i]);
  }
  size_t kr = (((size_t)n * s.B + j) * s.nkv + g) * d + l * dpt;
  for (int i = 0; i < dpt; i++) {
    dkb[kr + i] = __float2bfloat16(dkb_acc[i]);
    dvb[kr + i] = __float2bfloat16(dvb_acc[i]);
  }
}

// ---- backward 2: context dk/dv; one CTA per (tile of context rows, kv head) -----------
__global__ void attn_bwd_ctx(Shape s, int n_blocks, bf16 *dkc, bf16 *dvc, const float *Dg,
                             const bf16 *dout, const float *lse, const bf16 *q, const bf16 *kc,
                             const bf16 *vc) {
  DF_DYN_SHARED(float, smem);
  int p0 = blockIdx.x * kKtCtx, g = blockIdx.y, d = s.d, grp = s.nh / s.nkv;
  int cnt = s.Sc - p0 < kKtCtx ? s.Sc - p0 : kKtCtx;
  float *qs = smem, *dOs = qs + s.B * d;              // [B][d]
  float *P = dOs + s.B * d, *dS = P + s.B * kKtCtx;   // [B][kKtCtx]
  float *dk = dS + s.B * kKtCtx, *dv = dk + kKtCtx * d; // [kKtCtx][d]
  bf16 *Ks = (bf16 *)(dv + kKtCtx * d), *Vs = Ks + kKtCtx * d;
  int j = threadIdx.x / kTpr, l = threadIdx.x % kTpr;
  for (int e = threadIdx.x; e < kKtCtx * d; e += blockDim.x) {
    dk[e] = dv[e] = 0;
    int k = e / d;
    size_t r = ((size_t)(p0 + k) * s.nkv + g) * d + e % d;
    Ks[e] = k < cnt ? kc[r] : __float2bfloat16(0.0f);
    Vs[e] = k < cnt ? vc[r] : __float2bfloat16(0.0f);
  }
  for (int n = 0; n < n_blocks; n++) {
    int a = s.anchors[n], nctx = n_ctx(s, a);
    if (p0 >= nctx || p0 + cnt <= ctx_lo(s, a)) continue;
    for (int h = g * grp; h < (g + 1) * grp; h++) {
      __syncthreads();
      for (int e = threadIdx.x; e < s.B * d; e += blockDim.x) {
        size_t r = (((size_t)n * s.B + e / d) * s.nh + h) * d + e % d;
        qs[e] = __bfloat162float(q[r]);
        dOs[e] = __bfloat162float(dout[r]);
      }
      __syncthreads();
      size_t th = ((size_t)n * s.B + j) * s.nh + h;
      float L = lse[th], D = Dg[th];
      for (int k = l; k < kKtCtx; k += kTpr) {
        float p = 0, ds = 0;
        // p0 + k >= nctx would read as a block key in visible(): not context.
        if (k < cnt && p0 + k < nctx && visible(s, a, nctx, j, p0 + k)) {
          p = __expf(dot_fb(qs + j * d, Ks + k * d, d) * s.scale - L);
          ds = p * (dot_fb(dOs + j * d, Vs + k * d, d) - D) * s.scale;
        }
        P[j * kKtCtx + k] = p;
        dS[j * kKtCtx + k] = ds;
      }
      __syncthreads();
      for (int e = threadIdx.x; e < kKtCtx * d; e += blockDim.x) {
        int k = e / d, dd = e % d;
        float sk = 0, sv = 0;
        for (int jj = 0; jj < s.B; jj++) {
          sk += dS[jj * kKtCtx + k] * qs[jj * d + dd];
          sv += P[jj * kKtCtx + k] * dOs[jj * d + dd];
        }
        dk[e] += sk;
        dv[e] += sv;
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < cnt * d; e += blockDim.x) {
    size_t r = ((size_t)(p0 + e / d) * s.nkv + g) * d + e % d;
    dkc[r] = __float2bfloat16(dk[e]);
    dvc[r] = __float2bfloat16(dv[e]);
  }
}

dflash_status check_shape(const df_attn_dev *a) {
  if (a->d % kTpr || a->d / kTpr > kMaxDpt || a->d % 2 || a->B * kTpr > 1024 ||
      a->nh % a->nkv)
    return df_error(DFLASH_E_UNSUPPORTED, "CUDA attention: head_dim %d (a multiple of 8, at "
                    "most %d), block size %d (at most 128) and %d heads over %d kv heads are "
                    "not supported together", a->d, kTpr * kMaxDpt, a->B, a->nh, a->nkv);
  return DFLASH_OK;
}

Shape shape_of(const df_attn_dev *a) {
  return Shape{a->B, a->Sc, a->nh, a->nkv, a->d, a->window, a->anchors, a->scale};
}

template <typename K>
dflash_status launch_smem(K kernel, size_t bytes) {
  DF_CU(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  return DFLASH_OK;
}

}  // namespace

dflash_status k_attention_fwd(cudaStream_t st, const df_attn_dev *a, bf16 *out, float *lse,
                              const bf16 *q, const bf16 *kc, const bf16 *vc, const bf16 *kb,
                              const bf16 *vb) {
  DF_TRY(check_shape(a));
  if (a->n_blocks <= 0) return DFLASH_OK;
  size_t smem = sizeof(float) * (size_t)a->B * (a->d + kKt) + sizeof(bf16) * 2 * kKt * a->d;
  DF_TRY(launch_smem(attn_fwd, smem));
  DF_LAUNCH(dim3(a->n_blocks, a->nh), a->B * kTpr, smem, st, attn_fwd)(shape_of(a), out, lse, q,
                                                                       kc, vc, kb, vb);
  DF_CU(cudaGetLastError());
  return DFLASH_OK;
}

dflash_status k_attention_bwd(cudaStream_t st, const df_attn_dev *a, bf16 *dq, bf16 *dkc,
                              bf16 *dvc, bf16 *dkb, bf16 *dvb, float *D, const bf16 *dout,
                              const bf16 *out, const float *lse, const bf16 *q, const bf16 *kc,
                              const bf16 *vc, const bf16 *kb, const bf16 *vb) {
  DF_TRY(check_shape(a));
  if (a->n_blocks <= 0) return DFLASH_OK;
  Shape s = shape_of(a);
  size_t smem1 = sizeof(float) * (size_t)a->B * 2 * (a->d + kKt) + sizeof(bf16) * 2 * kKt * a->d;
  DF_TRY(launch_smem(attn_bwd_block, smem1));
  DF_LAUNCH(dim3(a->n_blocks, a->nkv), a->B * kTpr, smem1, st, attn_bwd_block)(
      s, dq, dkb, dvb, D, dout, out, lse, q, kc, vc, kb, vb);
  DF_CU(cudaGetLastError());
  if (a->Sc <= 0) return DFLASH_OK;
  size_t smem2 = sizeof(float) * (2 * (size_t)a->B * (a->d + kKtCtx) + 2 * kKtCtx * a->d) +
                 sizeof(bf16) * 2 * kKtCtx * a->d;
  DF_TRY(launch_smem(attn_bwd_ctx, smem2));
  DF_LAUNCH(dim3((a->Sc + kKtCtx - 1) / kKtCtx, a->nkv), a->B * kTpr, smem2, st, attn_bwd_ctx)(
      s, a->n_blocks, dkc, dvc, D, dout, lse, q, kc, vc);
  DF_CU(cudaGetLastError());
  return DFLASH_OK;
}
