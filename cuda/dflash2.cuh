// DFlash 2 on the GPU (cuda/dflash2.cu; the twin of src/train/dflash2.c): the grouped
// dynamic causal convolution around every attention and MLP sublayer, the candidate
// selector's loss and its backward, and the selector's greedy path at predict. model.cu
// calls these at the few places where DFlash 2 differs from DFlash 1; the state below owns
// its own device buffers (the shared activation layout, act_layout.h, is DFlash 1's).
#pragma once
#include "common.cuh"

struct df2_dev;

// Sizes from the config (c->dflash2 must be set).
dflash_status df2_create(const df_cu_config *c, df2_dev **out);
void df2_free(df2_dev *d);
// Device bytes the state holds now.
size_t df2_bytes(const df2_dev *d);
// Buffers for T block rows and R supervised (or predicted) rows; with poison (the tests'
// DFLASH_CUDA_POISON) filled with 0xff bytes (NaN) on stream s, as model.cu's arena.
dflash_status df2_reserve(df2_dev *d, cudaStream_t s, int T, int R, bool poison);

// ---- convolutions (`which` 0: attention_conv, 1: mlp_conv of layer l) ----
// GroupedDynamicCausalConv.prepare: the dynamic kernels of both convolutions from the
// normed input xn [T, H] (proj [2kG, H]), and the first convolution (base [2, k, H]);
// *xc gets the convolved input, the sublayer's.
dflash_status df2_prepare(df2_dev *d, cudaStream_t s, cublasHandle_t h, int l, int which,
                          const bf16 *xn, const bf16 *proj, const bf16 *base, const bf16 **xc);
// Where the sublayer writes its output y [T, H] (before finish).
bf16 *df2_y(df2_dev *d, int l, int which);
// .finish: out = residual + the second convolution of y.
dflash_status df2_finish(df2_dev *d, cudaStream_t s, int l, int which, bf16 *out,
                         const bf16 *residual, const bf16 *base);
// Backward of finish for dout = d(out): *dy gets d(y); dbase (fp32 [2, k, H]) accumulates.
dflash_status df2_finish_bwd(df2_dev *d, cudaStream_t s, int l, int which, const bf16 *dout,
                             const bf16 *base, float *dbase, const bf16 **dy);
// Where the sublayer's backward writes d(convolved input), fp32 [T, H].
float *df2_dxc(df2_dev *d);
// Backward of prepare: dxn (fp32 [T, H]) is overwritten with d(normed input); dbase and
// dproj accumulate. Reads df2_dxc and both halves of the dynamic kernels' gradient.
dflash_status df2_prepare_bwd(df2_dev *d, cudaStream_t s, cublasHandle_t h, int l, int which,
                              float *dxn, const bf16 *xn, const bf16 *proj, const bf16 *base,
                              float *dproj, float *dbase);
// The convolved inputs kept for the backward (the sublayer's dW reads them).
const bf16 *df2_xc(df2_dev *d, int l, int which);

// ---- candidate selector ----
// The top-K of each row's logits, inside the LM head's vocabulary-chunk pass: init before
// the first chunk, then one call per chunk of logits [R, cn] starting at token v0.
dflash_status df2_topk_init(df2_dev *d, cudaStream_t s, int R);
dflash_status df2_topk_chunk(df2_dev *d, cudaStream_t s, const float *logits, int R, int cn,
                             int v0);

struct df2_sel_io {
  int R;
  const bf16 *x, *E;               // rows [R, H], LM head [V, H]
  const int32_t *target;           // device [R]
  const int32_t *prev_host;        // host [R]: the true previous token of each row
  const float *coef;               // device [R] (w * grad_scale), NULL: no backward
  float *loss;                     // device [R]: += selector_loss_weight * CE
  bf16 *rows_dx;                   // device [R, H]: += d(rows) (with coef)
  const bf16 *pred, *succ, *hproj; // codebooks [V, r], hidden_projection [r, H]
  float *dpred, *dsucc, *dhproj;   // their gradients (accumulated)
  bf16 *scratch;                   // [R, chunk], free after the block CE (its probabilities)
};
// After df2_topk_*: the K-way CE of the true token over each row's candidates (drop or
// inject), added to the row losses, and its backward.
dflash_status df2_selector(df2_dev *d, cudaStream_t s, cublasHandle_t h, const df2_sel_io *io);

// Predict: after df2_topk_* over the A * (B - 1) drafted rows x (block order), the greedy
// path of each block from its own token (block_tok [A * B], device) into pred (host).
dflash_status df2_select_greedy(df2_dev *d, cudaStream_t s, cublasHandle_t h, const bf16 *x,
                                const int32_t *block_tok, int A, const bf16 *pred_cb,
                                const bf16 *succ_cb, const bf16 *hproj, int32_t *pred);
