// Shared by the CUDA backend's translation units: types, error plumbing,
// kernel launchers (kernels.cu, attention.cu).
#pragma once
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "train/cuda/dfcuda.h"

typedef __nv_bfloat16 bf16;

// Every kernel launch and shared-memory declaration goes through these, so that the same
// source runs on the emulated device of the tests (cuda/emu, where DFLASH_CUDA_EMU is set):
//   DF_LAUNCH(grid, block, smem, stream, kernel)(args...)   kernel<<<grid, block, smem, stream>>>
//   DF_SHARED(float, sh, [8][33]);                          __shared__ float sh[8][33];
//   DF_DYN_SHARED(float, smem);                             extern __shared__ float smem[];
// (the kernel comes last so that a template's commas need no parentheses).
#ifdef DFLASH_CUDA_EMU
#define DF_LAUNCH(grid, block, smem, stream, ...) \
  DFEMU_LAUNCH(grid, block, smem, stream, __VA_ARGS__)
#define DF_SHARED(type, name, dims) DFEMU_SHARED(type, name, dims)
#define DF_DYN_SHARED(type, name) DFEMU_DYN_SHARED(type, name)
#else
#define DF_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<(grid), (block), (smem), (stream)>>>
#define DF_SHARED(type, name, dims) __shared__ type name dims
#define DF_DYN_SHARED(type, name) extern __shared__ type name[]
#endif

extern "C" dflash_status df_error(dflash_status status, const char *fmt, ...);

// Turn a failed CUDA / cuBLAS call into DFLASH_E_CUDA naming the call.
#define DF_CU(call)                                                                   \
  do {                                                                                \
    cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess)                                                            \
      return df_error(DFLASH_E_CUDA, "%s:%d: %s: %s (%s)", __FILE__, __LINE__, #call, \
                      cudaGetErrorString(e_), cudaGetErrorName(e_));                  \
  } while (0)
#define DF_BLAS(call)                                                                          \
  do {                                                                                         \
    cublasStatus_t s_ = (call);                                                                \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
      return df_error(DFLASH_E_CUDA, "%s:%d: %s: cuBLAS status %d", __FILE__, __LINE__, #call, \
                      (int)s_);                                                                \
  } while (0)
#define DF_TRY(expr)                  \
  do {                                \
    dflash_status st_ = (expr);       \
    if (st_ != DFLASH_OK) return st_; \
  } while (0)

// ---- kernels.cu ----
// Every launcher returns DFLASH_E_CUDA naming its kernel when the launch is refused.
dflash_status df_launched(const char *kernel); // cudaGetLastError after a launch
dflash_status k_rmsnorm_forward(cudaStream_t s, bf16 *y, float *rstd, const bf16 *x, const bf16 *w,
                                long rows, int n, float eps);
// dx (+)= ...; dx is float or bf16 (exactly one of dx32/dx16); dy bf16 or float.
dflash_status k_rmsnorm_backward(cudaStream_t s, float *dx32, bf16 *dx16, const bf16 *dy16,
                                 const float *dy32, const bf16 *x, const bf16 *w, const float *rstd,
                                 long rows, int n, bool acc);
// dw[i] += sum_r dy*x*rstd (fixed order); partial: scratch of rstd-sized floats * 256.
dflash_status k_rmsnorm_backward_dw(cudaStream_t s, float *dw, const bf16 *dy16, const float *dy32,
                                    const bf16 *x, const float *rstd, long rows, int n,
                                    float *partial);
size_t k_rmsnorm_backward_dw_scratch(int n);
dflash_status k_rope_forward(cudaStream_t s, bf16 *x, const int32_t *pos, const float *cos_t,
                             const float *sin_t, long rows, int heads, int d, int rot, float sign);
dflash_status k_rope_table(cudaStream_t s, float *cos_t, float *sin_t, const double *inv_freq,
                           double attn_factor, int n_pos, int half);
dflash_status k_swiglu_forward(cudaStream_t s, bf16 *m, const bf16 *g, const bf16 *u, size_t n);
dflash_status k_swiglu_backward(cudaStream_t s, bf16 *dg, bf16 *du, const bf16 *dm, const bf16 *g,
                                const bf16 *u, size_t n);
dflash_status k_gather_rows(cudaStream_t s, bf16 *out, const bf16 *table, const int32_t *idx,
                            long rows, int n);
dflash_status k_scatter_rows(cudaStream_t s, bf16 *out, const bf16 *rows, const int32_t *idx,
                             long n_rows, int n);
dflash_status k_f32_to_bf16(cudaStream_t s, bf16 *out, const float *in, size_t n);
dflash_status k_bf16_to_f32(cudaStream_t s, float *out, const bf16 *in, size_t n);
// Stored context rows (DF_CU_HIDDEN_*) to bf16; the lowest non-finite index into *bad.
dflash_status k_hidden_decode(cudaStream_t s, bf16 *out, const void *codes, const float *scales,
                              int dtype, size_t n, int H, unsigned long long *bad);
// *out = sum over r < R of wtab[rows_t[r] % B] * loss[r] (wtab NULL: weight 1), in double.
dflash_status k_seq_loss(cudaStream_t s, const float *loss, const int32_t *rows_t,
                         const float *wtab, int B, int R, double *out);
dflash_status k_positions(cudaStream_t s, int32_t *pos, const int32_t *anchors, int A, int B);
// LM head + CE over one vocabulary chunk of logits [R, c] (online softmax).
dflash_status k_lmhead_ce_chunk(cudaStream_t s, const float *logits, bf16 *probs, float *mx,
                                float *sum, float *tl, float *acc, const int32_t *target, int R,
                                int c, int v0, int H, bool grad);
dflash_status k_lmhead_ce_finish(cudaStream_t s, float *loss, bf16 *dx, const float *mx,
                                 const float *sum, const float *tl, const float *acc,
                                 const float *coef, const bf16 *E, const int32_t *target, int R,
                                 int H);
dflash_status k_lmhead_ce_init(cudaStream_t s, float *mx, float *sum, float *tl, int R);
// Greedy over vocabulary chunks: init (best -FLT_MAX, index 0), then one call per chunk.
dflash_status k_lmhead_argmax_init(cudaStream_t s, float *best, int32_t *best_i, int R);
dflash_status k_lmhead_argmax_chunk(cudaStream_t s, const float *logits, float *best,
                                    int32_t *best_i, int R, int c, int v0);
// DSpark (src/train/dspark.c): the per-row loss pass over a chunk of n rows' logits, the rows'
// d(x) with the confidence head's part, and the parameter gradients (w1's sparse rows, the
// confidence projection) in row order. Launch notes at the kernels. The loss pass: z [n, V]
// (V the draft vocabulary), zt [n, Vt] the target's logits over the full vocabulary, kept
// [V] the draft vocabulary's target ids when pruned (NULL: V = Vt).
dflash_status k_dspark_loss_rows(cudaStream_t s, float *z, float *zt, bf16 *dz, const bf16 *x,
                                 const bf16 *e, const bf16 *cw, const bf16 *cb,
                                 const int32_t *target, const float *coef, float *loss, float *ds,
                                 const int32_t *kept, int n, int V, int Vt, int H, int r,
                                 float a_ce, float a_l1, float a_conf);
dflash_status k_dspark_conf_rows(cudaStream_t s, bf16 *rows_dx, const float *acc, float *de,
                                 const float *ds, const bf16 *cw, int n, int H, int r);
dflash_status k_dspark_param_grads(cudaStream_t s, float *dw1, const float *de, const int32_t *prev,
                                   float *dcw, float *dcb, const float *ds, const bf16 *x,
                                   const bf16 *e, int n, int H, int r);
// sum of squares (double, fixed order); partial holds 1024 doubles.
dflash_status k_sumsq(cudaStream_t s, const float *x, size_t n, double *partial, double *out);
dflash_status k_scale(cudaStream_t s, float *x, float k, size_t n);
// The optimizer's clip state, computed on the device (df_cu_step): the global sum of squares,
// the pre-clip norm, the clip factor, whether the norm is finite (else AdamW changes nothing)
// and whether the factor is below 1 (the gradients are then scaled by it).
struct df_cu_clip {
  double ss, norm;
  float coef;
  int32_t finite, clipped, pad;
};
// Sum the buckets' sums of squares in order into clip->ss; then (after the all-reduce over
// ranks, if any) the norm and factor of torch's clip_grad_norm_ for max_norm (<= 0: off).
dflash_status k_norm_sum(cudaStream_t s, const double *part, int n, df_cu_clip *clip);
dflash_status k_norm_clip(cudaStream_t s, df_cu_clip *clip, double max_norm);
dflash_status k_scale_clipped(cudaStream_t s, float *x, const df_cu_clip *clip, size_t n);
// AdamW with the gradients times clip->coef; nothing when clip->finite is 0.
dflash_status k_adamw(cudaStream_t s, float *p, bf16 *p16, const float *g, float *m1, float *m2,
                      size_t n, const df_cu_clip *clip, float decay, float b1, float b2, float eps,
                      float step_size, float bc2_sqrt);
// Muon's Nesterov momentum (src/train/optim_muon.c) on n elements of this rank's shard, the
// gradients times clip->coef: buf (m1) updated, the update into u; nothing when clip->finite
// is 0.
dflash_status k_muon_momentum(cudaStream_t s, float *buf, float *u, const float *g, size_t n,
                              const df_cu_clip *clip, float mu);
// x *= 1 / max(sqrt(*ss), eps): the Frobenius normalisation before Newton-Schulz.
dflash_status k_muon_normalize(cudaStream_t s, float *x, size_t n, const double *ss, float eps);
// p = p * decay - step * o, then the bf16 copy; nothing when clip->finite is 0.
dflash_status k_muon_apply(cudaStream_t s, float *p, bf16 *p16, const float *o, size_t n,
                           const df_cu_clip *clip, float decay, float step);

// ---- attention.cu ----
struct df_attn_dev {
  int n_blocks, B, Sc, nh, nkv, d, window;
  const int32_t *anchors; // device
  float scale;
};
// DFLASH_E_UNSUPPORTED naming the limit when forward or backward cannot run this shape (only
// B, nh, nkv and d are read), e.g. more shared memory than the device has per block.
dflash_status k_attention_check(const df_attn_dev *a);
dflash_status k_attention_forward(cudaStream_t s, const df_attn_dev *a, bf16 *out, float *lse,
                                  const bf16 *q, const bf16 *kc, const bf16 *vc, const bf16 *kb,
                                  const bf16 *vb);
dflash_status k_attention_backward(cudaStream_t s, const df_attn_dev *a, bf16 *dq, bf16 *dkc,
                                   bf16 *dvc, bf16 *dkb, bf16 *dvb, float *D, const bf16 *dout,
                                   const bf16 *out, const float *lse, const bf16 *q, const bf16 *kc,
                                   const bf16 *vc, const bf16 *kb, const bf16 *vb);
