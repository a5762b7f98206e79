// The drafter on one GPU (the twin of src/train/model.c): bf16 weights and
// activations, fp32 gradients, fp32 master weights and AdamW moments (ZeRO-1
// shards over NCCL ranks), cuBLAS for every GEMM with fp32 accumulation.
// The buffers, uploads and create are in arena.cu, the optimizer step in backend.cu, NCCL
// and the gradient buckets in dist.cu (model.cuh: what they share).
#include "model.cuh"

using namespace dfcu;

namespace {

// Row-major C[M,N] = op(A) op(B) (+ beta C); A, B bf16; C bf16 or fp32.
dflash_status gemm(df_cu_model *m, bool ta, bool tb, int M, int N, int K, const bf16 *A, int lda,
                   const bf16 *B, int ldb, void *C, int ldc, bool c32, float beta) {
  if (M <= 0 || N <= 0) return DFLASH_OK;
  float alpha = 1.0f;
  if (K <= 0) {
    if (beta == 0.0f) DF_CU(cudaMemsetAsync(C, 0, (size_t)M * ldc * (c32 ? 4 : 2), m->st));
    return DFLASH_OK;
  }
  DF_BLAS(cublasGemmEx(m->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N,
                       M, K, &alpha, B, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &beta, C,
                       c32 ? CUDA_R_32F : CUDA_R_16BF, ldc, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT));
  return DFLASH_OK;
}
// y[M,N] (+)= x[M,K] w[N,K]^T
dflash_status linear(df_cu_model *m, bf16 *y, const bf16 *x, const bf16 *w, int M, int N, int K,
                     bool acc = false) {
  return gemm(m, false, true, M, N, K, x, K, w, K, y, N, false, acc ? 1.0f : 0.0f);
}
// dx[M,K] (+)= dy[M,N] w[N,K] (dx fp32 or bf16); dw[N,K] += dy^T x.
dflash_status linear_dx(df_cu_model *m, void *dx, bool dx32, const bf16 *dy, const bf16 *w, int M,
                        int N, int K, bool acc) {
  return gemm(m, false, false, M, K, N, dy, N, w, K, dx, K, dx32, acc ? 1.0f : 0.0f);
}
dflash_status linear_dw(df_cu_model *m, float *dw, const bf16 *dy, const bf16 *x, int M, int N,
                        int K) {
  return gemm(m, true, false, N, K, M, dy, N, x, K, dw, K, true, 1.0f);
}

// DFLASH_E_FORMAT naming token and column for a non-finite context value at flat index i.
dflash_status bad_hidden(const df_cu_model *m, int64_t i) {
  return df_error(DFLASH_E_FORMAT,
                  "hidden state at position %lld, column %lld is not finite "
                  "(checked on the device)",
                  (long long)(i / m->c.KH), (long long)(i % m->c.KH));
}

// The deferred sequences' results from the device into host_loss / host_bad (one wait).
dflash_status drain_pending(df_cu_model *m) {
  size_t n = m->n_dev_pend, k = m->host_loss.size();
  if (!n) return DFLASH_OK;
  std::vector<unsigned long long> bad(n);
  m->host_loss.resize(k + n);
  DF_CU(
      cudaMemcpyAsync(m->host_loss.data() + k, m->pend_loss, 8 * n, cudaMemcpyDeviceToHost, m->st));
  DF_CU(cudaMemcpyAsync(bad.data(), m->pend_bad, 8 * n, cudaMemcpyDeviceToHost, m->st));
  DF_TRY(wait_stream(m, "the deferred sequences' losses"));
  for (unsigned long long v : bad) m->host_bad.push_back(v == ~0ull ? -1 : (int64_t)v);
  m->n_dev_pend = 0;
  return DFLASH_OK;
}

df_attn_dev attn_shape(df_cu_model *m, int l) {
  df_attn_dev a;
  a.n_blocks = m->A, a.B = m->c.B, a.Sc = m->Sc, a.nh = m->c.nh, a.nkv = m->c.nkv, a.d = m->c.d;
  a.window = m->c.window[l];
  a.anchors = act<int32_t>(m, DF_ACT_ANCHORS);
  a.scale = 1.0f / sqrtf((float)m->c.d);
  return a;
}

// out = rope(norm(x W^T)) per head.
dflash_status qk_forward(df_cu_model *m, bf16 *pre, float *rstd, bf16 *out, const bf16 *x,
                         size_t wi, size_t ni, const int32_t *pos, int rows, int heads) {
  DF_TRY(linear(m, pre, x, w_of(m, wi), rows, heads * m->c.d, m->c.H));
  DF_TRY(
      k_rmsnorm_forward(m->st, out, rstd, pre, w_of(m, ni), (long)rows * heads, m->c.d, m->c.eps));
  DF_TRY(k_rope_forward(m->st, out, pos, m->cos_t, m->sin_t, rows, heads, m->c.d, m->c.rot, 1.0f));
  return DFLASH_OK;
}

// out = residual + x W^T, through DFlash 2's finishing convolution (`which` 0: attention,
// 1: MLP) when the model has it.
dflash_status sublayer_out(df_cu_model *m, int l, int which, bf16 *out, const bf16 *residual,
                           const bf16 *x, size_t wi, int K) {
  int T = m->T, H = m->c.H;
  if (m->df2) {
    DF_TRY(linear(m, df2_y(m->df2, l, which), x, w_of(m, wi), T, H, K));
    return df2_finish(m->df2, m->st, l, which, out, residual, w_of(m, conv_w(m, l, which, 0)));
  }
  DF_CU(cudaMemcpyAsync(out, residual, 2 * (size_t)T * H, cudaMemcpyDeviceToDevice, m->st));
  return linear(m, out, x, w_of(m, wi), T, H, K, true);
}

// q/k/v and gate/up stay separate GEMMs. Their weights are contiguous (W_Q, W_K, W_V and
// W_G, W_U are consecutive in the flat table), but one GEMM over [W_Q; W_K; W_V] writes rows
// [q | k | v] interleaved, while the norms, RoPE and attention (attention.cu) read Q_PRE, KB_PRE
// and VB as separate dense arrays of the shared activation layout (act_layout.h, which
// `dflash train --plan` also sizes); so would dW and dx from [dq | dk | dv]. Strided-batched
// GEMMs (k with v, gate with up) the emulator does not model. bench/gpu_model.py predicts
// fusing all five saves 0.7 ms of a 273 ms step at Qwen3-8B (1.3 of 603 at Kimi) on H200:
// these GEMMs already fill the GPU (N >= 1024, M = 8192), so not worth a layout change.
dflash_status layer_forward(df_cu_model *m, int l, bf16 *out) {
  const df_cu_config &c = m->c;
  int T = m->T, Sc = m->Sc, H = c.H, kd = c.nkv * c.d, qd = c.nh * c.d;
  const int32_t *pos_b = act<int32_t>(m, DF_ACT_TOK) + T;
  bf16 *ctx = act<bf16>(m, DF_ACT_CTX);
#define LA(id, ty) lact<ty>(m, l, DF_LACT_##id)
  bf16 *h_in = LA(H_IN, bf16), *xn1 = LA(XN1, bf16), *h_mid = LA(H_MID, bf16);
  DF_TRY(
      k_rmsnorm_forward(m->st, xn1, LA(RSTD1, float), h_in, w_of(m, lw(l, W_IN_LN)), T, H, c.eps));
  const bf16 *xa = xn1; // the attention's input: DFlash 2 convolves it first
  if (m->df2)
    DF_TRY(df2_prepare(m->df2, m->st, m->blas, l, 0, xn1, w_of(m, conv_w(m, l, 0, 1)),
                       w_of(m, conv_w(m, l, 0, 0)), &xa));
  DF_TRY(qk_forward(m, LA(Q_PRE, bf16), LA(Q_RSTD, float), LA(Q, bf16), xa, lw(l, W_Q), lw(l, W_QN),
                    pos_b, T, c.nh));
  DF_TRY(qk_forward(m, LA(KB_PRE, bf16), LA(KB_RSTD, float), LA(KB, bf16), xa, lw(l, W_K),
                    lw(l, W_KN), pos_b, T, c.nkv));
  DF_TRY(linear(m, LA(VB, bf16), xa, w_of(m, lw(l, W_V)), T, kd, H));
  // The context enters only as extra keys/values.
  DF_TRY(qk_forward(m, LA(KC_PRE, bf16), LA(KC_RSTD, float), LA(KC, bf16), ctx, lw(l, W_K),
                    lw(l, W_KN), m->iota, Sc, c.nkv));
  DF_TRY(linear(m, LA(VC, bf16), ctx, w_of(m, lw(l, W_V)), Sc, kd, H));
  df_attn_dev a = attn_shape(m, l);
  DF_TRY(k_attention_forward(m->st, &a, LA(ATT, bf16), LA(LSE, float), LA(Q, bf16), LA(KC, bf16),
                             LA(VC, bf16), LA(KB, bf16), LA(VB, bf16)));
  DF_TRY(sublayer_out(m, l, 0, h_mid, h_in, LA(ATT, bf16), lw(l, W_O), qd));
  DF_TRY(k_rmsnorm_forward(m->st, LA(XN2, bf16), LA(RSTD2, float), h_mid, w_of(m, lw(l, W_POST_LN)),
                           T, H, c.eps));
  const bf16 *xm = LA(XN2, bf16); // the MLP's input
  if (m->df2)
    DF_TRY(df2_prepare(m->df2, m->st, m->blas, l, 1, xm, w_of(m, conv_w(m, l, 1, 1)),
                       w_of(m, conv_w(m, l, 1, 0)), &xm));
  DF_TRY(linear(m, LA(G, bf16), xm, w_of(m, lw(l, W_G)), T, c.I, H));
  DF_TRY(linear(m, LA(U, bf16), xm, w_of(m, lw(l, W_U)), T, c.I, H));
  DF_TRY(k_swiglu_forward(m->st, LA(M, bf16), LA(G, bf16), LA(U, bf16), (size_t)T * c.I));
  return sublayer_out(m, l, 1, out, h_mid, LA(M, bf16), lw(l, W_D), c.I);
}

dflash_status model_forward(df_cu_model *m) {
  const df_cu_config &c = m->c;
  bf16 *ctx_pre = act<bf16>(m, DF_ACT_CTX_PRE);
  DF_TRY(linear(m, ctx_pre, act<bf16>(m, DF_ACT_HIDDEN), w_of(m, P_FC), m->Sc, c.H, c.KH));
  DF_TRY(k_rmsnorm_forward(m->st, act<bf16>(m, DF_ACT_CTX), act<float>(m, DF_ACT_CTX_RSTD), ctx_pre,
                           w_of(m, P_HIDDEN_NORM), m->Sc, c.H, c.eps));
  DF_TRY(k_gather_rows(m->st, lact<bf16>(m, 0, DF_LACT_H_IN), m->embed, act<int32_t>(m, DF_ACT_TOK),
                       m->T, c.H));
  for (int l = 0; l < c.L; l++)
    DF_TRY(layer_forward(m, l,
                         l + 1 < c.L ? lact<bf16>(m, l + 1, DF_LACT_H_IN)
                                     : act<bf16>(m, DF_ACT_H_OUT)));
  DF_TRY(k_rmsnorm_forward(m->st, act<bf16>(m, DF_ACT_HF), act<float>(m, DF_ACT_RSTD_F),
                           act<bf16>(m, DF_ACT_H_OUT), w_of(m, norm_index(m)), m->T, c.H, c.eps));
  int32_t *ri = act<int32_t>(m, DF_ACT_ROW_I32);
  DF_TRY(k_gather_rows(m->st, act<bf16>(m, DF_ACT_ROWS_X), act<bf16>(m, DF_ACT_HF), ri, m->R, c.H));
  return DFLASH_OK;
}

// LM head + CE over vocabulary chunks: row losses, and (grad) rows_dx.
dflash_status lmhead_ce(df_cu_model *m, bool grad) {
  const df_cu_config &c = m->c;
  int R = m->R, H = c.H, chunk = c.vocab_chunk < c.V ? c.vocab_chunk : c.V;
  float *rf = act<float>(m, DF_ACT_ROW_F32), *acc = act<float>(m, DF_ACT_CE_ACC);
  float *mx = rf, *sum = rf + R, *tl = rf + 2 * (size_t)R, *coef = rf + 3 * (size_t)R,
        *loss = rf + 4 * (size_t)R;
  const int32_t *target = act<int32_t>(m, DF_ACT_ROW_I32) + R;
  float *logits = act<float>(m, DF_ACT_LOGITS);
  bf16 *probs = act<bf16>(m, DF_ACT_PROBS), *x = act<bf16>(m, DF_ACT_ROWS_X);
  DF_TRY(k_lmhead_ce_init(m->st, mx, sum, tl, R));
  if (grad) DF_CU(cudaMemsetAsync(acc, 0, 4 * (size_t)R * H, m->st));
  if (m->df2) DF_TRY(df2_topk_init(m->df2, m->st, R)); // the selector's candidates
  for (int v0 = 0; v0 < c.V; v0 += chunk) {
    int cn = c.V - v0 < chunk ? c.V - v0 : chunk;
    const bf16 *Ec = m->head + (size_t)v0 * H;
    DF_TRY(gemm(m, false, true, R, cn, H, x, H, Ec, H, logits, cn, true, 0.0f));
    if (m->df2) DF_TRY(df2_topk_chunk(m->df2, m->st, logits, R, cn, v0));
    DF_TRY(k_lmhead_ce_chunk(m->st, logits, probs, mx, sum, tl, acc, target, R, cn, v0, H, grad));
    if (grad) DF_TRY(gemm(m, false, false, R, H, cn, probs, cn, Ec, H, acc, H, true, 1.0f));
  }
  DF_TRY(k_lmhead_ce_finish(m->st, loss, grad ? act<bf16>(m, DF_ACT_ROWS_DX) : nullptr, mx, sum, tl,
                            acc, coef, m->head, target, R, H));
  return DFLASH_OK;
}

// DSpark's buffers for R rows (model.cuh dspark_bufs), then this sequence's previous tokens
// and the target's final state at each row from the host (pageable: copied at the call).
dflash_status dspark_upload(df_cu_model *m, const df_cu_batch *b) {
  auto &d = m->dsp;
  int H = m->c.H, V = m->c.V, Vd = m->c.draft_vocab, r = m->c.markov_rank;
  size_t R = (size_t)(b->R > 0 ? b->R : 1);
  if (!d.z) {
    size_t rows = kDsparkRows;
    DF_TRY(dalloc(m, &d.z, rows * Vd, "DSpark logits"));
    DF_TRY(dalloc(m, &d.zt, rows * V, "DSpark target logits"));
    DF_TRY(dalloc(m, &d.dz, rows * Vd, "DSpark logit gradients"));
    DF_TRY(dalloc(m, &d.de, rows * r, "DSpark Markov embedding gradients"));
  }
  if (R > d.cap_r) {
    bool sync = d.prev != nullptr; // cudaFree waits for the device
    if (sync) cudaFree(d.prev), cudaFree(d.xt), cudaFree(d.e), cudaFree(d.ds);
    d.prev = nullptr, d.xt = nullptr, d.e = nullptr, d.ds = nullptr, d.cap_r = 0;
    DF_TRY(dalloc(m, &d.prev, R, "DSpark previous tokens"));
    DF_TRY(dalloc(m, &d.xt, R * H, "DSpark target final states"));
    DF_TRY(dalloc(m, &d.e, R * r, "DSpark Markov embeddings"));
    DF_TRY(dalloc(m, &d.ds, R, "DSpark confidence gradients"));
    d.cap_r = R;
  }
  d.has_final = b->rows_final != nullptr;
  if (b->R <= 0) return DFLASH_OK;
  DF_CU(cudaMemcpyAsync(d.prev, b->rows_prev, 4 * (size_t)b->R, cudaMemcpyHostToDevice, m->st));
  if (d.has_final)
    DF_CU(
        cudaMemcpyAsync(d.xt, b->rows_final, 2 * (size_t)b->R * H, cudaMemcpyHostToDevice, m->st));
  return DFLASH_OK;
}

// DSpark's heads and objective over the rows (src/train/dspark.c's df_dspark_loss, its CPU
// twin): per chunk of rows z = x E^T + W1[prev] W2^T over the draft vocabulary and zt = xt
// E^T over the full one by GEMM, the row pass (k_dspark_loss_rows), then with grad d(x) = dz
// E, d(e) = dz W2 and dW2 += dz^T e by GEMM, the confidence head's parts and W1's sparse rows
// in row order. E is the target's head; pruned (Vd < V), the drafter's E is its rows at the
// kept ids (d.head) and the row pass reads the target's logits there. The row losses
// (alpha-weighted) go where lmhead_ce puts the CE, so the deferred sum(w * loss) and the
// host's read them alike.
dflash_status dspark_loss(df_cu_model *m, bool grad) {
  const df_cu_config &c = m->c;
  auto &d = m->dsp;
  int R = m->R, H = c.H, V = c.V, Vd = c.draft_vocab, r = c.markov_rank, L = c.L;
  const bf16 *E = d.head ? d.head : m->head; // the drafter's LM head [Vd, H]
  float *rf = act<float>(m, DF_ACT_ROW_F32), *acc = act<float>(m, DF_ACT_CE_ACC);
  float *coef = grad ? rf + 3 * (size_t)R : nullptr, *loss = rf + 4 * (size_t)R;
  const int32_t *target = act<int32_t>(m, DF_ACT_ROW_I32) + R;
  bf16 *x = act<bf16>(m, DF_ACT_ROWS_X), *rdx = act<bf16>(m, DF_ACT_ROWS_DX);
  size_t i1 = df_tensor_markov(L, DF_TM_W1), i2 = df_tensor_markov(L, DF_TM_W2);
  const bf16 *w2 = w_of(m, i2), *cw = nullptr, *cb = nullptr;
  float *dcw = nullptr, *dcb = nullptr;
  if (c.dspark_conf && d.has_final) {
    cw = w_of(m, df_tensor_conf(L, DF_TQ_CW)), cb = w_of(m, df_tensor_conf(L, DF_TQ_CB));
    dcw = g_of(m, df_tensor_conf(L, DF_TQ_CW)), dcb = g_of(m, df_tensor_conf(L, DF_TQ_CB));
  }
  DF_TRY(k_gather_rows(m->st, d.e, w_of(m, i1), d.prev, R, r));
  for (int r0 = 0; r0 < R; r0 += kDsparkRows) {
    int n = R - r0 < kDsparkRows ? R - r0 : kDsparkRows;
    const bf16 *xc = x + (size_t)r0 * H, *ec = d.e + (size_t)r0 * r;
    DF_TRY(gemm(m, false, true, n, Vd, H, xc, H, E, H, d.z, Vd, true, 0.0f));
    DF_TRY(gemm(m, false, true, n, Vd, r, ec, r, w2, r, d.z, Vd, true, 1.0f));
    if (d.has_final)
      DF_TRY(
          gemm(m, false, true, n, V, H, d.xt + (size_t)r0 * H, H, m->head, H, d.zt, V, true, 0.0f));
    DF_TRY(k_dspark_loss_rows(m->st, d.z, d.has_final ? d.zt : nullptr, grad ? d.dz : nullptr, xc,
                              ec, cw, cb, target + r0, coef ? coef + r0 : nullptr, loss + r0,
                              d.ds + r0, d.kept, n, Vd, V, H, r, c.ds_alpha_ce, c.ds_alpha_l1,
                              c.ds_alpha_conf));
    if (!grad) continue;
    float *accc = acc + (size_t)r0 * H;
    DF_TRY(gemm(m, false, false, n, H, Vd, d.dz, Vd, E, H, accc, H, true, 0.0f));
    DF_TRY(gemm(m, false, false, n, r, Vd, d.dz, Vd, w2, r, d.de, r, true, 0.0f));
    DF_TRY(linear_dw(m, g_of(m, i2), d.dz, ec, n, Vd, r));
    DF_TRY(k_dspark_conf_rows(m->st, rdx + (size_t)r0 * H, accc, d.de, d.ds + r0, cw, n, H, r));
    DF_TRY(k_dspark_param_grads(m->st, g_of(m, i1), d.de, d.prev + r0, dcw, dcb, d.ds + r0, xc, ec,
                                n, H, r));
  }
  return DFLASH_OK;
}

// DFlash 2's selector loss on the rows (after lmhead_ce found their candidates): added to
// the row losses; with grad, into rows_dx and the selector's gradients.
dflash_status selector_loss(df_cu_model *m, const df_cu_batch *b, bool grad) {
  float *rf = act<float>(m, DF_ACT_ROW_F32);
  int R = m->R;
  df2_sel_io io = {R,
                   act<bf16>(m, DF_ACT_ROWS_X),
                   m->head,
                   act<int32_t>(m, DF_ACT_ROW_I32) + R,
                   b->rows_prev,
                   grad ? rf + 3 * (size_t)R : nullptr,
                   rf + 4 * (size_t)R,
                   act<bf16>(m, DF_ACT_ROWS_DX),
                   w_of(m, sel_w(m, 0)),
                   w_of(m, sel_w(m, 1)),
                   w_of(m, sel_w(m, 2)),
                   g_of(m, sel_w(m, 0)),
                   g_of(m, sel_w(m, 1)),
                   g_of(m, sel_w(m, 2)),
                   act<bf16>(m, DF_ACT_PROBS)};
  return df2_selector(m->df2, m->st, m->blas, &io);
}

// Through rope, per-head norm and projection; dx (+)= dpre W, dW += dpre^T x.
dflash_status qk_backward(df_cu_model *m, bf16 *dout, bf16 *dpre, void *dx, bool dx32, bool acc,
                          size_t wi, size_t ni, const bf16 *pre, const float *rstd, const bf16 *x,
                          const int32_t *pos, int rows, int heads) {
  int d = m->c.d;
  DF_TRY(k_rope_forward(m->st, dout, pos, m->cos_t, m->sin_t, rows, heads, d, m->c.rot, -1.0f));
  DF_TRY(k_rmsnorm_backward_dw(m->st, g_of(m, ni), dout, nullptr, pre, rstd, (long)rows * heads, d,
                               m->dw_scratch));
  DF_TRY(k_rmsnorm_backward(m->st, nullptr, dpre, dout, nullptr, pre, w_of(m, ni), rstd,
                            (long)rows * heads, d, false));
  DF_TRY(linear_dx(m, dx, dx32, dpre, w_of(m, wi), rows, heads * d, m->c.H, acc));
  return linear_dw(m, g_of(m, wi), dpre, x, rows, heads * d, m->c.H);
}

// RMSNorm backward with fp32 dy: dw, then dx (+)= into bf16.
dflash_status norm_backward(df_cu_model *m, bf16 *dx16, const float *dy32, const bf16 *x, size_t wi,
                            const float *rstd, long rows, int n, bool acc) {
  DF_TRY(k_rmsnorm_backward_dw(m->st, g_of(m, wi), nullptr, dy32, x, rstd, rows, n, m->dw_scratch));
  return k_rmsnorm_backward(m->st, nullptr, dx16, nullptr, dy32, x, w_of(m, wi), rstd, rows, n,
                            acc);
}

// DFlash 2: dx = d(normed input xn) from d(convolved input) through prepare (its base
// kernel and projection get their gradients).
dflash_status conv_prepare_backward(df_cu_model *m, int l, int which, float *dx, const bf16 *xn) {
  size_t b = conv_w(m, l, which, 0), p = conv_w(m, l, which, 1);
  return df2_prepare_bwd(m->df2, m->st, m->blas, l, which, dx, xn, w_of(m, p), w_of(m, b),
                         g_of(m, p), g_of(m, b));
}

dflash_status layer_backward(df_cu_model *m, int l) {
  const df_cu_config &c = m->c;
  int T = m->T, Sc = m->Sc, H = c.H, kd = c.nkv * c.d, qd = c.nh * c.d, I = c.I;
  bf16 *dh = act<bf16>(m, DF_ACT_DH), *dm = act<bf16>(m, DF_ACT_DM), *dg = act<bf16>(m, DF_ACT_DG),
       *du = act<bf16>(m, DF_ACT_DU), *datt = act<bf16>(m, DF_ACT_DATT),
       *dq = act<bf16>(m, DF_ACT_DQ), *dkb = act<bf16>(m, DF_ACT_DKB),
       *dvb = act<bf16>(m, DF_ACT_DVB), *dkc = act<bf16>(m, DF_ACT_DKC),
       *dvc = act<bf16>(m, DF_ACT_DVC), *dtmp = act<bf16>(m, DF_ACT_DTMP),
       *dctx_tmp = act<bf16>(m, DF_ACT_DCTX_TMP), *ctx = act<bf16>(m, DF_ACT_CTX);
  float *dx = act<float>(m, DF_ACT_DX), *dctx = act<float>(m, DF_ACT_DCTX);
  const int32_t *pos_b = act<int32_t>(m, DF_ACT_TOK) + T;
  // MLP (DFlash 2: its output went through finish, its input is the convolved xm)
  const bf16 *dy = dh, *xm = LA(XN2, bf16), *xa = LA(XN1, bf16);
  float *dxs = dx; // d(sublayer input)
  if (m->df2) {
    DF_TRY(df2_finish_bwd(m->df2, m->st, l, 1, dh, w_of(m, conv_w(m, l, 1, 0)),
                          g_of(m, conv_w(m, l, 1, 0)), &dy));
    xm = df2_xc(m->df2, l, 1), xa = df2_xc(m->df2, l, 0), dxs = df2_dxc(m->df2);
  }
  DF_TRY(linear_dx(m, dm, false, dy, w_of(m, lw(l, W_D)), T, H, I, false));
  DF_TRY(linear_dw(m, g_of(m, lw(l, W_D)), dy, LA(M, bf16), T, H, I));
  DF_TRY(k_swiglu_backward(m->st, dg, du, dm, LA(G, bf16), LA(U, bf16), (size_t)T * I));
  DF_TRY(linear_dx(m, dxs, true, dg, w_of(m, lw(l, W_G)), T, I, H, false));
  DF_TRY(linear_dx(m, dxs, true, du, w_of(m, lw(l, W_U)), T, I, H, true));
  DF_TRY(linear_dw(m, g_of(m, lw(l, W_G)), dg, xm, T, I, H));
  DF_TRY(linear_dw(m, g_of(m, lw(l, W_U)), du, xm, T, I, H));
  if (m->df2) DF_TRY(conv_prepare_backward(m, l, 1, dx, LA(XN2, bf16)));
  DF_TRY(norm_backward(m, dh, dx, LA(H_MID, bf16), lw(l, W_POST_LN), LA(RSTD2, float), T, H, true));
  // attention
  if (m->df2)
    DF_TRY(df2_finish_bwd(m->df2, m->st, l, 0, dh, w_of(m, conv_w(m, l, 0, 0)),
                          g_of(m, conv_w(m, l, 0, 0)), &dy));
  DF_TRY(linear_dx(m, datt, false, dy, w_of(m, lw(l, W_O)), T, H, qd, false));
  DF_TRY(linear_dw(m, g_of(m, lw(l, W_O)), dy, LA(ATT, bf16), T, H, qd));
  df_attn_dev a = attn_shape(m, l);
  DF_TRY(k_attention_backward(m->st, &a, dq, dkc, dvc, dkb, dvb, act<float>(m, DF_ACT_D), datt,
                              LA(ATT, bf16), LA(LSE, float), LA(Q, bf16), LA(KC, bf16),
                              LA(VC, bf16), LA(KB, bf16), LA(VB, bf16)));
  DF_TRY(qk_backward(m, dq, dtmp, dxs, true, false, lw(l, W_Q), lw(l, W_QN), LA(Q_PRE, bf16),
                     LA(Q_RSTD, float), xa, pos_b, T, c.nh));
  DF_TRY(qk_backward(m, dkb, dtmp, dxs, true, true, lw(l, W_K), lw(l, W_KN), LA(KB_PRE, bf16),
                     LA(KB_RSTD, float), xa, pos_b, T, c.nkv));
  DF_TRY(linear_dx(m, dxs, true, dvb, w_of(m, lw(l, W_V)), T, kd, H, true));
  DF_TRY(linear_dw(m, g_of(m, lw(l, W_V)), dvb, xa, T, kd, H));
  if (m->df2) DF_TRY(conv_prepare_backward(m, l, 0, dx, LA(XN1, bf16)));
  DF_TRY(qk_backward(m, dkc, dctx_tmp, dctx, true, true, lw(l, W_K), lw(l, W_KN), LA(KC_PRE, bf16),
                     LA(KC_RSTD, float), ctx, m->iota, Sc, c.nkv));
  DF_TRY(linear_dx(m, dctx, true, dvc, w_of(m, lw(l, W_V)), Sc, kd, H, true));
  DF_TRY(linear_dw(m, g_of(m, lw(l, W_V)), dvc, ctx, Sc, kd, H));
  DF_TRY(norm_backward(m, dh, dx, LA(H_IN, bf16), lw(l, W_IN_LN), LA(RSTD1, float), T, H, true));
  return DFLASH_OK;
}
#undef LA

} // namespace

namespace dfcu {

dflash_status model_backward(df_cu_model *m, rs_issuer *rs) {
  const df_cu_config &c = m->c;
  int T = m->T, H = c.H;
  bf16 *dh = act<bf16>(m, DF_ACT_DH);
  size_t norm_i = norm_index(m);
  DF_CU(cudaMemsetAsync(dh, 0, 2 * (size_t)T * H, m->st));
  DF_TRY(k_scatter_rows(m->st, dh, act<bf16>(m, DF_ACT_ROWS_DX), act<int32_t>(m, DF_ACT_ROW_I32),
                        m->R, H));
  // dh holds d(hf); turn it into d(h_out) in place (dw first: it needs dy).
  const bf16 *h_out = act<bf16>(m, DF_ACT_H_OUT);
  const float *rstd_f = act<float>(m, DF_ACT_RSTD_F);
  DF_TRY(k_rmsnorm_backward_dw(m->st, g_of(m, norm_i), dh, nullptr, h_out, rstd_f, T, H,
                               m->dw_scratch));
  DF_TRY(k_rmsnorm_backward(m->st, nullptr, dh, dh, nullptr, h_out, w_of(m, norm_i), rstd_f, T, H,
                            false));
  DF_TRY(issue_ready(m, rs, m->from[norm_i]));
  DF_CU(cudaMemsetAsync(act<float>(m, DF_ACT_DCTX), 0, 4 * (size_t)m->Sc * H, m->st));
  for (int l = c.L - 1; l >= 0; l--) {
    DF_TRY(layer_backward(m, l));
    DF_TRY(issue_ready(m, rs, m->from[lw(l, 0)]));
  }
  bf16 *dctx_tmp = act<bf16>(m, DF_ACT_DCTX_TMP);
  DF_TRY(norm_backward(m, dctx_tmp, act<float>(m, DF_ACT_DCTX), act<bf16>(m, DF_ACT_CTX_PRE),
                       P_HIDDEN_NORM, act<float>(m, DF_ACT_CTX_RSTD), m->Sc, H, false));
  DF_TRY(linear_dw(m, g_of(m, P_FC), dctx_tmp, act<bf16>(m, DF_ACT_HIDDEN), m->Sc, H, c.KH));
  return issue_ready(m, rs, 0);
}

// The deferred backward of the last sequence, when something other than the step comes
// next: in stream order, as if it had run at its accumulate.
dflash_status flush_backward(df_cu_model *m) {
  if (!m->pending_bwd) return DFLASH_OK;
  m->pending_bwd = false;
  return model_backward(m, nullptr);
}

} // namespace dfcu

namespace {

// Forward, LM head + CE, backward (or deferred, see pending_bwd) of an uploaded sequence.
dflash_status compute_sequence(df_cu_model *m, const df_cu_batch *b) {
  DF_TRY(model_forward(m));
  if (m->c.dspark) DF_TRY(dspark_loss(m, b->coef != nullptr));
  else DF_TRY(lmhead_ce(m, b->coef != nullptr));
  if (m->df2) DF_TRY(selector_loss(m, b, b->coef != nullptr));
  // This may be the last sequence before the step: defer its backward (the row losses need
  // only the forward), so that collect waits for the forward alone and the backward runs
  // inside the step, behind which the next step's first sequence uploads (df_cu_step with
  // norm NULL); with several ranks the step overlaps its reduce-scatter with it. The next
  // accumulate, or any other call, runs it first, in the same stream order as at once.
  if (b->coef) m->pending_bwd = true;
  return DFLASH_OK;
}

// The synchronous call's wait: its row losses and its NaN/Inf check to the host.
dflash_status finish_sync(df_cu_model *m, int R, float *row_loss) {
  unsigned long long bad = 0;
  if (R)
    DF_CU(cudaMemcpyAsync(row_loss, act<float>(m, DF_ACT_ROW_F32) + 4 * (size_t)R, 4 * (size_t)R,
                          cudaMemcpyDeviceToHost, m->st));
  DF_CU(cudaMemcpyAsync(&bad, m->pend_bad + kPending, sizeof bad, cudaMemcpyDeviceToHost, m->st));
  DF_CU(cudaStreamSynchronize(m->st));
  return bad == ~0ull ? DFLASH_OK : bad_hidden(m, (int64_t)bad);
}

} // namespace

extern "C" dflash_status df_cu_accumulate(df_cu_model *m, const df_cu_batch *b, float *row_loss) {
  DF_TRY(use_device(m));
  if (m->grads_sharded && b->coef)
    return df_error(DFLASH_E_STATE,
                    "rank %d: the gradients of a step over %d ranks are "
                    "sharded: zero them before accumulating again",
                    m->rank, m->world);
  bool deferred = row_loss == nullptr;
  if (deferred && m->n_dev_pend == kPending) DF_TRY(drain_pending(m));
  size_t slot = deferred ? m->n_dev_pend : kPending;
  if (b->A <= 0) {
    if (!deferred) return DFLASH_OK;
    DF_CU(cudaMemsetAsync(m->pend_loss + slot, 0, sizeof(double), m->st));
    DF_CU(cudaMemsetAsync(m->pend_bad + slot, 0xff, sizeof(unsigned long long), m->st));
    m->n_dev_pend++;
    return DFLASH_OK;
  }
  DF_TRY(flush_backward(m)); // the arena is about to take this sequence
  DF_TRY(upload_batch(m, b, m->pend_bad + slot));
  if (m->c.dspark) DF_TRY(dspark_upload(m, b));
  DF_TRY(compute_sequence(m, b));
  if (!deferred) return finish_sync(m, b->R, row_loss);
  DF_TRY(k_seq_loss(m->st, act<float>(m, DF_ACT_ROW_F32) + 4 * (size_t)b->R,
                    act<int32_t>(m, DF_ACT_ROW_I32), m->wtab, m->c.B, b->R, m->pend_loss + slot));
  m->n_dev_pend++;
  return DFLASH_OK;
}

extern "C" dflash_status df_cu_results(df_cu_model *m, double *loss_sum, int64_t *bad, size_t n) {
  DF_TRY(use_device(m));
  DF_TRY(drain_pending(m));
  size_t have = m->host_loss.size();
  if (n != have)
    return df_error(DFLASH_E_STATE, "CUDA: %zu deferred sequences, results asked for %zu", have, n);
  for (size_t i = 0; i < n; i++) {
    if (loss_sum) loss_sum[i] = m->host_loss[i];
    if (bad) bad[i] = m->host_bad[i];
  }
  m->host_loss.clear();
  m->host_bad.clear();
  return DFLASH_OK;
}

extern "C" dflash_status df_cu_predict(df_cu_model *m, const df_cu_batch *b, int32_t *pred) {
  DF_TRY(use_device(m));
  if (m->c.dspark) // its drafts chain through the Markov head (model_dspark.c), not here yet
    return df_error(DFLASH_E_UNSUPPORTED, "CUDA: DSpark drafts (predict) are not implemented on "
                                          "the CUDA backend; the CPU backend drafts them");
  if (b->A <= 0 || b->R <= 0) return DFLASH_OK;
  DF_TRY(flush_backward(m));
  DF_TRY(upload_batch(m, b, m->pend_bad + kPending));
  DF_TRY(model_forward(m));
  const df_cu_config &c = m->c;
  int R = b->R, chunk = c.vocab_chunk < c.V ? c.vocab_chunk : c.V;
  // best value / index: the row-f32 block's first two slots are free here.
  float *best = act<float>(m, DF_ACT_ROW_F32);
  int32_t *best_i = (int32_t *)(best + R);
  DF_TRY(k_lmhead_argmax_init(m->st, best, best_i, R)); // all-NaN rows: token 0, as on the CPU
  if (m->df2) DF_TRY(df2_topk_init(m->df2, m->st, R));  // DFlash 2: the selector's candidates
  for (int v0 = 0; v0 < c.V; v0 += chunk) {
    int cn = c.V - v0 < chunk ? c.V - v0 : chunk;
    DF_TRY(gemm(m, false, true, R, cn, c.H, act<bf16>(m, DF_ACT_ROWS_X), c.H,
                m->head + (size_t)v0 * c.H, c.H, act<float>(m, DF_ACT_LOGITS), cn, true, 0.0f));
    if (m->df2) DF_TRY(df2_topk_chunk(m->df2, m->st, act<float>(m, DF_ACT_LOGITS), R, cn, v0));
    else
      DF_TRY(k_lmhead_argmax_chunk(m->st, act<float>(m, DF_ACT_LOGITS), best, best_i, R, cn, v0));
  }
  if (m->df2) // the greedy path of each block, as the CPU's select_blocks
    DF_TRY(df2_select_greedy(m->df2, m->st, m->blas, act<bf16>(m, DF_ACT_ROWS_X),
                             act<int32_t>(m, DF_ACT_TOK), b->A, w_of(m, sel_w(m, 0)),
                             w_of(m, sel_w(m, 1)), w_of(m, sel_w(m, 2)), pred));
  else DF_CU(cudaMemcpyAsync(pred, best_i, 4 * (size_t)R, cudaMemcpyDeviceToHost, m->st));
  return finish_sync(m, 0, nullptr);
}
