// The drafter on one GPU (the twin of src/train/model.c): bf16 weights and
// activations, fp32 gradients, fp32 master weights and AdamW moments (ZeRO-1
// shards over NCCL ranks), cuBLAS for every GEMM with fp32 accumulation.
#include <stdlib.h>
#include <string.h>

#include <chrono>
#include <thread>
#include <vector>

#ifdef DFLASH_HAVE_NCCL
#include <nccl.h>
#endif

#include "common.cuh"
#include "dflash2.cuh"

extern "C" {
#include "train/dist.h"
#include "train/tensors.h"
}

namespace {

constexpr size_t kBucketElems = DF_CU_BUCKET_ELEMS; // 64 Mi elements (256 MB fp32)
constexpr size_t kPending = DF_CU_PENDING; // deferred sequences on the device between drains

// Parameter tensors: the table of train/tensors.h, from which model.c builds the buffer.
enum { P_FC = DF_TH_FC, P_HIDDEN_NORM = DF_TH_HIDDEN_NORM };
enum {
  W_IN_LN = DF_TL_IN_LN,
  W_Q = DF_TL_Q,
  W_K = DF_TL_K,
  W_V = DF_TL_V,
  W_O = DF_TL_O,
  W_QN = DF_TL_QN,
  W_KN = DF_TL_KN,
  W_POST_LN = DF_TL_POST_LN,
  W_G = DF_TL_G,
  W_U = DF_TL_U,
  W_D = DF_TL_D
};

} // namespace

struct df_cu_model {
  df_cu_config c;
  std::vector<size_t> offsets;
  cudaStream_t st = nullptr;
  // The gradient reduce-scatters overlapped with the backward (several ranks): issued on
  // comm_st bucket by bucket, each behind ev_ready recorded on st after the bucket's last dW;
  // st waits for ev_comm (after the last one) before the optimizer.
  cudaStream_t comm_st = nullptr;
  cudaEvent_t ev_ready = nullptr, ev_comm = nullptr;
  cublasHandle_t blas = nullptr;
  bf16 *w16 = nullptr, *embed = nullptr, *head = nullptr;
  float *grads = nullptr, *master = nullptr, *m1 = nullptr, *m2 = nullptr, *tmp = nullptr;
  double *inv_freq = nullptr, *sumsq_part = nullptr, *sumsq_out = nullptr;
  float *cos_t = nullptr, *sin_t = nullptr, *dw_scratch = nullptr, *best = nullptr;
  int32_t *iota = nullptr, *best_i = nullptr;
  int n_pos = 0, rank = 0, world = 1;
  df_bucket_layout buckets{};
  // from[i]: the lowest flat offset of tensors i.. (table order): once the backward has
  // finished tensor i and every later one, the gradients at and above from[i] are final.
  std::vector<size_t> from;
  // The backward of the last sequence before a step is deferred (pending_bwd) to df_cu_step,
  // which knows it is the last (with several ranks it overlaps the reduce-scatter with it);
  // any other call runs it first (the arena still holds that sequence).
  bool overlap = false, pending_bwd = false;
  char *arena = nullptr;
  size_t arena_bytes = 0, live = 0, peak = 0;
  df_act_layout lay{};
  int T = 0, Sc = 0, R = 0, A = 0;
#ifdef DFLASH_HAVE_NCCL
  ncclComm_t comm = nullptr;
#endif
  // After a step over several ranks each rank's gradient buffer holds the reduced sum only
  // in its own slices (reduce-scatter); the rest is its local part until gathered.
  bool grads_sharded = false;
  double comm_timeout = 1800; // seconds one NCCL collective may take
  bool comm_failed = false;   // aborted: every later call fails
  df2_dev *df2 = nullptr;     // DFlash 2's convolutions and selector (dflash2.cu)
  // The per-sequence host-to-device path (upload_batch): two pinned staging buffers, used in
  // turn. Sequence k's context rows go up on copy_st into stages[k % 2].dev while sequence
  // k - 1 computes on st; st waits for `copied` before decoding them into the arena, and
  // records `used` once it has read the stage (host and device side). Before refilling a
  // stage the host waits for its `used` (sequence k - 2's, long done), never for st.
  struct stage {
    char *pin = nullptr, *dev = nullptr;
    size_t pin_cap = 0, dev_cap = 0;
    cudaEvent_t copied = nullptr, used = nullptr;
    bool armed = false; // `used` recorded at least once
  } stages[2];
  int next_stage = 0;
  cudaStream_t copy_st = nullptr;
  float *wtab = nullptr; // [B] position weights (NULL: 1)
  // Deferred accumulates (row_loss NULL): each sequence's sum(w*CE) and first non-finite
  // context index on the device (kPending slots; drained to the host vectors when full).
  double *pend_loss = nullptr;
  unsigned long long *pend_bad = nullptr; // [kPending + 1]: the last one for synchronous calls
  size_t n_dev_pend = 0;
  std::vector<double> host_loss;
  std::vector<int64_t> host_bad;
  // The step's clip state (kernels.cu df_cu_clip) on the device, copied after the norm into
  // pinned clip_pin; ev_step is recorded after the step's last work (the all-gather). A step
  // made without waiting (step_pending) returns at once; df_cu_step_result waits for ev_step,
  // not for the sequences enqueued after the step. (Not for the norm alone: a rank with no
  // sequence in the next step must still take part in the all-gather, which the emulated
  // device runs only when its host waits; a GPU runs it anyway.)
  df_cu_clip *clip = nullptr, *clip_pin = nullptr;
  cudaEvent_t ev_step = nullptr;
  bool step_pending = false;
};

namespace {

dflash_status dalloc(df_cu_model *m, void **p, size_t bytes, const char *what) {
  cudaError_t e = cudaMalloc(p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    return df_error(DFLASH_E_NOMEM,
                    "CUDA: cannot allocate %.2f GiB for %s (%.2f GiB free of "
                    "%.2f GiB): %s",
                    bytes / 1073741824.0, what, fr / 1073741824.0, tot / 1073741824.0,
                    cudaGetErrorString(e));
  }
  m->live += bytes;
  if (m->live > m->peak) m->peak = m->live;
  return DFLASH_OK;
}
template <typename T>
dflash_status dalloc(df_cu_model *m, T **p, size_t count, const char *what) {
  return dalloc(m, (void **)p, count * sizeof(T), what);
}

// Wait for the stream. With NCCL, a peer that died leaves the collective
// kernels spinning for ever, so give up after the collective timeout (or on
// NCCL's own asynchronous error): abort the communicator and fail, naming
// `what`; the model refuses collectives from then on.
// (With an event, what the stream had reached when it was recorded.)
dflash_status wait_on(df_cu_model *m, cudaStream_t s, const char *what, cudaEvent_t ev = nullptr) {
#ifdef DFLASH_HAVE_NCCL
  if (m->comm) {
    auto start = std::chrono::steady_clock::now();
    for (;;) {
      cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(s);
      if (e == cudaSuccess) return DFLASH_OK;
      if (e != cudaErrorNotReady)
        return df_error(DFLASH_E_CUDA, "rank %d: %s: %s", m->rank, what, cudaGetErrorString(e));
      ncclResult_t ae = ncclSuccess;
      ncclCommGetAsyncError(m->comm, &ae);
      double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if ((ae != ncclSuccess && ae != ncclInProgress) || waited > m->comm_timeout) {
        ncclCommAbort(m->comm);
        m->comm = nullptr;
        m->comm_failed = true;
        if (ae != ncclSuccess && ae != ncclInProgress)
          return df_error(DFLASH_E_CUDA, "rank %d: %s: NCCL: %s", m->rank, what,
                          ncclGetErrorString(ae));
        return df_error(DFLASH_E_TIMEOUT,
                        "rank %d: %s did not finish within %.0f s: a peer rank "
                        "died or hangs (set DFLASH_DIST_TIMEOUT to wait longer)",
                        m->rank, what, m->comm_timeout);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
#endif
  if (m->comm_failed)
    return df_error(DFLASH_E_STATE, "rank %d: %s: NCCL was aborted after an earlier failure",
                    m->rank, what);
  DF_CU(ev ? cudaEventSynchronize(ev) : cudaStreamSynchronize(s));
  return DFLASH_OK;
}
dflash_status wait_stream(df_cu_model *m, const char *what) { return wait_on(m, m->st, what); }

// Collectives need the communicator that an earlier failure may have aborted.
dflash_status comm_usable(const df_cu_model *m) {
  if (!m->comm_failed) return DFLASH_OK;
  return df_error(DFLASH_E_STATE,
                  "rank %d: NCCL was aborted after an earlier failure; the run "
                  "cannot continue",
                  m->rank);
}

// The reduce-scatter overlaps the backward: several ranks joined over NCCL (and not turned
// off, df_cu_config.no_overlap).
bool joined(const df_cu_model *m) {
#ifdef DFLASH_HAVE_NCCL
  return m->comm != nullptr;
#else
  (void)m;
  return false;
#endif
}
bool overlapping(const df_cu_model *m) { return m->overlap && joined(m); }

// The current device is per host thread: every entry point makes the model's device current,
// since a caller may use the trainer from another thread than the one that created it (whose
// device may be 0 while this rank's is LOCAL_RANK).
dflash_status use_device(const df_cu_model *m) {
  cudaError_t e = cudaSetDevice(m->c.device);
  if (e != cudaSuccess)
    return df_error(DFLASH_E_CUDA, "CUDA: cannot make device %d current: %s", m->c.device,
                    cudaGetErrorString(e));
  return DFLASH_OK;
}

bf16 *w_of(df_cu_model *m, size_t i) { return m->w16 + m->offsets[i]; }
float *g_of(df_cu_model *m, size_t i) { return m->grads + m->offsets[i]; }
size_t lw(int l, int k) { return df_tensor_layer(l, k); }
// norm.weight, DFlash 1's last tensor; DFlash 2's follow it (train/tensors.h): per layer
// attention_conv's base_kernel and kernel_projection, then mlp_conv's; then the selector's
// predecessor and successor codebooks and hidden_projection.
size_t norm_index(const df_cu_model *m) { return df_tensor_tail(m->c.L, DF_TT_NORM); }
size_t conv_w(const df_cu_model *m, int l, int which, int proj) {
  return df_tensor_conv(m->c.L, l, which ? DF_CONV_MLP : DF_CONV_ATT,
                        proj ? DF_TC_PROJ : DF_TC_BASE);
}
size_t sel_w(const df_cu_model *m, int k) { return df_tensor_sel(m->c.L, k); }

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

template <typename T>
T *act(df_cu_model *m, int id) {
  return (T *)(m->arena + m->lay.off[id]);
}
template <typename T>
T *lact(df_cu_model *m, int l, int id) {
  return (T *)(m->arena + m->lay.loff[l][id]);
}

dflash_status ensure_rope(df_cu_model *m, int n_pos) {
  if (n_pos <= m->n_pos) return DFLASH_OK;
  int half = m->c.rot / 2;
  if (m->cos_t) cudaFree(m->cos_t), cudaFree(m->sin_t), cudaFree(m->iota);
  m->live -= (size_t)m->n_pos * (2 * half * 4 + 4);
  m->cos_t = m->sin_t = nullptr;
  m->iota = nullptr;
  m->n_pos = 0;
  DF_TRY(dalloc(m, &m->cos_t, (size_t)n_pos * half, "RoPE tables"));
  DF_TRY(dalloc(m, &m->sin_t, (size_t)n_pos * half, "RoPE tables"));
  DF_TRY(dalloc(m, &m->iota, (size_t)n_pos, "positions"));
  DF_TRY(k_rope_table(m->st, m->cos_t, m->sin_t, m->inv_freq, m->c.attn_factor, n_pos, half));
  std::vector<int32_t> io((size_t)n_pos);
  for (int i = 0; i < n_pos; i++) io[(size_t)i] = i;
  DF_CU(cudaMemcpyAsync(m->iota, io.data(), io.size() * 4, cudaMemcpyHostToDevice, m->st));
  DF_CU(cudaStreamSynchronize(m->st));
  m->n_pos = n_pos;
  return DFLASH_OK;
}

dflash_status ensure_arena(df_cu_model *m, const df_cu_batch *b) {
  df_act_dims d = {m->c.H, m->c.KH, m->c.nh, m->c.nkv,
                   m->c.d, m->c.I,  m->c.L,  b->T,
                   b->Sc,  b->R,    b->A,    m->c.vocab_chunk < m->c.V ? m->c.vocab_chunk : m->c.V};
  df_act_layout lay;
  df_act_layout_compute(&d, &lay);
  if (lay.total > m->arena_bytes) {
    if (m->arena) cudaFree(m->arena), m->live -= m->arena_bytes;
    m->arena = nullptr;
    m->arena_bytes = 0;
    DF_TRY(dalloc(m, &m->arena, lay.total, "activations (one sequence)"));
    m->arena_bytes = lay.total;
  }
  m->lay = lay;
  m->T = b->T, m->Sc = b->Sc, m->R = b->R, m->A = b->A;
  return DFLASH_OK;
}

dflash_status upload(df_cu_model *m, void *dst, const void *src, size_t bytes) {
  if (bytes) DF_CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, m->st));
  return DFLASH_OK;
}

size_t align_up(size_t n) { return (n + 255) & ~(size_t)255; }

// Each stage big enough for this sequence (growing waits: cudaFree and cudaFreeHost wait for
// the device; it happens while sequences grow, not per sequence).
dflash_status grow_stage(df_cu_model *m, df_cu_model::stage &s, size_t pin, size_t dev) {
  if (pin > s.pin_cap) {
    if (s.pin) cudaFreeHost(s.pin);
    s.pin = nullptr;
    s.pin_cap = 0;
    if (cudaMallocHost((void **)&s.pin, pin) != cudaSuccess)
      return df_error(DFLASH_E_NOMEM,
                      "CUDA: cannot allocate %.2f MiB of pinned host memory "
                      "for the context rows' staging",
                      pin / 1048576.0);
    s.pin_cap = pin;
  }
  if (dev > s.dev_cap) {
    if (s.dev) cudaFree(s.dev), m->live -= s.dev_cap;
    s.dev = nullptr;
    s.dev_cap = 0;
    DF_TRY(dalloc(m, &s.dev, dev, "context rows as stored (staging)"));
    s.dev_cap = dev;
  }
  return DFLASH_OK;
}

// Append `bytes` from `src` at *off of the stage's pinned buffer; its address in *at.
const void *stage_put(char *pin, size_t *off, const void *src, size_t bytes) {
  char *at = pin + *off;
  if (bytes) memcpy(at, src, bytes);
  *off += bytes;
  return at;
}

// The context rows as stored: dtype, codes, scales and their byte sizes.
struct stored_rows {
  int dtype;
  const void *codes;
  const float *scales;
  size_t n, code_bytes, scale_bytes;
};

dflash_status stored_of(const df_cu_model *m, const df_cu_batch *b, stored_rows *r) {
  r->dtype = b->hidden_codes ? b->hidden_dtype : DF_CU_HIDDEN_BF16;
  r->codes = b->hidden_codes ? b->hidden_codes : b->hidden;
  r->scales = b->hidden_scales;
  r->n = (size_t)b->Sc * m->c.KH;
  if (r->dtype != DF_CU_HIDDEN_BF16 && r->dtype != DF_CU_HIDDEN_FP8 && r->dtype != DF_CU_HIDDEN_F32)
    return df_error(DFLASH_E_INVALID_ARG, "CUDA: hidden states of unknown dtype %d", r->dtype);
  if (r->n && (!r->codes || (r->dtype == DF_CU_HIDDEN_FP8 && !r->scales)))
    return df_error(DFLASH_E_INVALID_ARG, "CUDA: %s",
                    r->codes ? "fp8 hidden states without "
                               "their scales"
                             : "no hidden states");
  r->code_bytes = r->n * (r->dtype == DF_CU_HIDDEN_FP8 ? 1 : r->dtype == DF_CU_HIDDEN_F32 ? 4 : 2);
  r->scale_bytes = r->dtype == DF_CU_HIDDEN_FP8 ? 4 * (size_t)b->Sc * (m->c.KH / m->c.H) : 0;
  return DFLASH_OK;
}

// One sequence to the device without waiting for the one before (see df_cu_model::stage):
// the small per-row arrays from the pinned stage on st (the arena is the previous sequence's
// until st reaches them), the context rows as stored on copy_st, then decoded and checked on
// st; *bad (device) gets the lowest non-finite index, or ~0.
dflash_status upload_batch(df_cu_model *m, const df_cu_batch *b, unsigned long long *bad) {
  DF_TRY(ensure_rope(m, b->max_pos));
  DF_TRY(ensure_arena(m, b));
  stored_rows r{};
  DF_TRY(stored_of(m, b, &r));
  size_t small = 4 * ((size_t)b->A + (size_t)b->T + 2 * (size_t)b->R) +
                 (b->coef ? 4 * (size_t)b->R : 0);
  size_t dev_off = align_up(small), codes_off = align_up(r.scale_bytes);
  size_t dev_bytes = codes_off + r.code_bytes;
  df_cu_model::stage &s = m->stages[m->next_stage];
  m->next_stage ^= 1;
  // Its last readers are two sequences back (the previous sequence uses the other stage).
  if (s.armed) DF_CU(cudaEventSynchronize(s.used));
  DF_TRY(grow_stage(m, s, dev_off + dev_bytes, dev_bytes));
  size_t off = 0;
  const void *anchors = stage_put(s.pin, &off, b->anchors, 4 * (size_t)b->A);
  const void *tok = stage_put(s.pin, &off, b->block_tok, 4 * (size_t)b->T);
  const void *rows = stage_put(s.pin, &off, b->rows_t, 4 * (size_t)b->R);
  const void *target = stage_put(s.pin, &off, b->rows_target, 4 * (size_t)b->R);
  const void *coef = b->coef ? stage_put(s.pin, &off, b->coef, 4 * (size_t)b->R) : nullptr;
  off = dev_off;
  stage_put(s.pin, &off, r.scales, r.scale_bytes);
  off = dev_off + codes_off;
  stage_put(s.pin, &off, r.codes, r.code_bytes);
  if (s.armed) DF_CU(cudaStreamWaitEvent(m->copy_st, s.used, 0));
  if (dev_bytes)
    DF_CU(cudaMemcpyAsync(s.dev, s.pin + dev_off, dev_bytes, cudaMemcpyHostToDevice, m->copy_st));
  DF_CU(cudaEventRecord(s.copied, m->copy_st));
  // Tests poison the arena (0xff bytes: bf16/f32 NaN) so a read of anything
  // this call did not write shows up in the outputs.
  static const char *poison = getenv("DFLASH_CUDA_POISON");
  if (poison && *poison == '1') DF_CU(cudaMemsetAsync(m->arena, 0xff, m->lay.total, m->st));
  if (m->df2) DF_TRY(df2_reserve(m->df2, m->st, b->T, b->R, poison && *poison == '1'));
  int32_t *dtok = act<int32_t>(m, DF_ACT_TOK), *ri = act<int32_t>(m, DF_ACT_ROW_I32);
  DF_TRY(upload(m, act<int32_t>(m, DF_ACT_ANCHORS), anchors, 4 * (size_t)b->A));
  DF_TRY(upload(m, dtok, tok, 4 * (size_t)b->T));
  DF_TRY(upload(m, ri, rows, 4 * (size_t)b->R));
  DF_TRY(upload(m, ri + b->R, target, 4 * (size_t)b->R));
  if (coef)
    DF_TRY(upload(m, act<float>(m, DF_ACT_ROW_F32) + 3 * (size_t)b->R, coef, 4 * (size_t)b->R));
  DF_CU(cudaMemsetAsync(bad, 0xff, sizeof *bad, m->st));
  DF_CU(cudaStreamWaitEvent(m->st, s.copied, 0));
  DF_TRY(k_hidden_decode(m->st, act<bf16>(m, DF_ACT_HIDDEN), s.dev + codes_off,
                         (const float *)s.dev, r.dtype, r.n, m->c.H, bad));
  DF_CU(cudaEventRecord(s.used, m->st));
  s.armed = true;
  DF_TRY(k_positions(m->st, dtok + b->T, act<int32_t>(m, DF_ACT_ANCHORS), b->A, m->c.B));
  return DFLASH_OK;
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
      k_rmsnorm_fwd_bf16(m->st, out, rstd, pre, w_of(m, ni), (long)rows * heads, m->c.d, m->c.eps));
  DF_TRY(k_rope(m->st, out, pos, m->cos_t, m->sin_t, rows, heads, m->c.d, m->c.rot, 1.0f));
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
      k_rmsnorm_fwd_bf16(m->st, xn1, LA(RSTD1, float), h_in, w_of(m, lw(l, W_IN_LN)), T, H, c.eps));
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
  DF_TRY(k_attention_fwd(m->st, &a, LA(ATT, bf16), LA(LSE, float), LA(Q, bf16), LA(KC, bf16),
                         LA(VC, bf16), LA(KB, bf16), LA(VB, bf16)));
  DF_TRY(sublayer_out(m, l, 0, h_mid, h_in, LA(ATT, bf16), lw(l, W_O), qd));
  DF_TRY(k_rmsnorm_fwd_bf16(m->st, LA(XN2, bf16), LA(RSTD2, float), h_mid,
                            w_of(m, lw(l, W_POST_LN)), T, H, c.eps));
  const bf16 *xm = LA(XN2, bf16); // the MLP's input
  if (m->df2)
    DF_TRY(df2_prepare(m->df2, m->st, m->blas, l, 1, xm, w_of(m, conv_w(m, l, 1, 1)),
                       w_of(m, conv_w(m, l, 1, 0)), &xm));
  DF_TRY(linear(m, LA(G, bf16), xm, w_of(m, lw(l, W_G)), T, c.I, H));
  DF_TRY(linear(m, LA(U, bf16), xm, w_of(m, lw(l, W_U)), T, c.I, H));
  DF_TRY(k_swiglu_fwd(m->st, LA(M, bf16), LA(G, bf16), LA(U, bf16), (size_t)T * c.I));
  return sublayer_out(m, l, 1, out, h_mid, LA(M, bf16), lw(l, W_D), c.I);
}

dflash_status model_forward(df_cu_model *m) {
  const df_cu_config &c = m->c;
  bf16 *ctx_pre = act<bf16>(m, DF_ACT_CTX_PRE);
  DF_TRY(linear(m, ctx_pre, act<bf16>(m, DF_ACT_HIDDEN), w_of(m, P_FC), m->Sc, c.H, c.KH));
  DF_TRY(k_rmsnorm_fwd_bf16(m->st, act<bf16>(m, DF_ACT_CTX), act<float>(m, DF_ACT_CTX_RSTD),
                            ctx_pre, w_of(m, P_HIDDEN_NORM), m->Sc, c.H, c.eps));
  DF_TRY(k_gather_rows(m->st, lact<bf16>(m, 0, DF_LACT_H_IN), m->embed, act<int32_t>(m, DF_ACT_TOK),
                       m->T, c.H));
  for (int l = 0; l < c.L; l++)
    DF_TRY(layer_forward(m, l,
                         l + 1 < c.L ? lact<bf16>(m, l + 1, DF_LACT_H_IN)
                                     : act<bf16>(m, DF_ACT_H_OUT)));
  DF_TRY(k_rmsnorm_fwd_bf16(m->st, act<bf16>(m, DF_ACT_HF), act<float>(m, DF_ACT_RSTD_F),
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
  DF_TRY(k_ce_init(m->st, mx, sum, tl, R));
  if (grad) DF_CU(cudaMemsetAsync(acc, 0, 4 * (size_t)R * H, m->st));
  if (m->df2) DF_TRY(df2_topk_init(m->df2, m->st, R)); // the selector's candidates
  for (int v0 = 0; v0 < c.V; v0 += chunk) {
    int cn = c.V - v0 < chunk ? c.V - v0 : chunk;
    const bf16 *Ec = m->head + (size_t)v0 * H;
    DF_TRY(gemm(m, false, true, R, cn, H, x, H, Ec, H, logits, cn, true, 0.0f));
    if (m->df2) DF_TRY(df2_topk_chunk(m->df2, m->st, logits, R, cn, v0));
    DF_TRY(k_ce_chunk(m->st, logits, probs, mx, sum, tl, acc, target, R, cn, v0, H, grad));
    if (grad) DF_TRY(gemm(m, false, false, R, H, cn, probs, cn, Ec, H, acc, H, true, 1.0f));
  }
  DF_TRY(k_ce_finish(m->st, loss, grad ? act<bf16>(m, DF_ACT_ROWS_DX) : nullptr, mx, sum, tl, acc,
                     coef, m->head, target, R, H));
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
  DF_TRY(k_rope(m->st, dout, pos, m->cos_t, m->sin_t, rows, heads, d, m->c.rot, -1.0f));
  DF_TRY(k_rmsnorm_dw(m->st, g_of(m, ni), dout, nullptr, pre, rstd, (long)rows * heads, d,
                      m->dw_scratch));
  DF_TRY(k_rmsnorm_bwd(m->st, nullptr, dpre, dout, nullptr, pre, w_of(m, ni), rstd,
                       (long)rows * heads, d, false));
  DF_TRY(linear_dx(m, dx, dx32, dpre, w_of(m, wi), rows, heads * d, m->c.H, acc));
  return linear_dw(m, g_of(m, wi), dpre, x, rows, heads * d, m->c.H);
}

// RMSNorm backward with fp32 dy: dw, then dx (+)= into bf16.
dflash_status norm_backward(df_cu_model *m, bf16 *dx16, const float *dy32, const bf16 *x, size_t wi,
                            const float *rstd, long rows, int n, bool acc) {
  DF_TRY(k_rmsnorm_dw(m->st, g_of(m, wi), nullptr, dy32, x, rstd, rows, n, m->dw_scratch));
  return k_rmsnorm_bwd(m->st, nullptr, dx16, nullptr, dy32, x, w_of(m, wi), rstd, rows, n, acc);
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
  DF_TRY(k_swiglu_bwd(m->st, dg, du, dm, LA(G, bf16), LA(U, bf16), (size_t)T * I));
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
  DF_TRY(k_attention_bwd(m->st, &a, dq, dkc, dvc, dkb, dvb, act<float>(m, DF_ACT_D), datt,
                         LA(ATT, bf16), LA(LSE, float), LA(Q, bf16), LA(KC, bf16), LA(VC, bf16),
                         LA(KB, bf16), LA(VB, bf16)));
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

void slice(const df_cu_model *m, size_t b, size_t *off, size_t *len);

// Reduce-scatter bucket b in place on stream s: this rank's slice gets the sum.
dflash_status reduce_scatter(df_cu_model *m, size_t b, cudaStream_t s) {
#ifdef DFLASH_HAVE_NCCL
  size_t off, len;
  slice(m, b, &off, &len);
  const df_bucket *k = &m->buckets.buckets[b];
  ncclResult_t r = ncclReduceScatter(m->grads + k->offset, m->grads + off, len, ncclFloat, ncclSum,
                                     m->comm, s);
  if (r != ncclSuccess)
    return df_error(DFLASH_E_CUDA, "NCCL reduce-scatter of bucket %zu: %s", b,
                    ncclGetErrorString(r));
#else
  (void)m, (void)b, (void)s;
#endif
  return DFLASH_OK;
}

// The reduce-scatters a backward issues as it goes (NULL: none): the next bucket (buckets
// are numbered from the end of the buffer, the order the backward finishes them) and the
// factor a bucket's gradients get before the reduction (df_cu_adam.grad_factor).
struct rs_issuer {
  size_t next;
  bool scale;
  float factor;
};

// Every bucket whose gradients are all final (at or above flat offset `done`) to the
// communication stream, behind one event recorded on the compute stream now, i.e. after
// the dW GEMMs that wrote them; the compute stream meanwhile runs on.
dflash_status issue_ready(df_cu_model *m, rs_issuer *rs, size_t done) {
  if (!rs || rs->next >= m->buckets.n_buckets || m->buckets.buckets[rs->next].offset < done)
    return DFLASH_OK;
  DF_CU(cudaEventRecord(m->ev_ready, m->st));
  DF_CU(cudaStreamWaitEvent(m->comm_st, m->ev_ready, 0));
  for (; rs->next < m->buckets.n_buckets && m->buckets.buckets[rs->next].offset >= done;
       rs->next++) {
    const df_bucket *k = &m->buckets.buckets[rs->next];
    if (rs->scale) DF_TRY(k_scale(m->comm_st, m->grads + k->offset, rs->factor, k->count));
    DF_TRY(reduce_scatter(m, rs->next, m->comm_st));
  }
  return DFLASH_OK;
}

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
  DF_TRY(k_rmsnorm_dw(m->st, g_of(m, norm_i), dh, nullptr, h_out, rstd_f, T, H, m->dw_scratch));
  DF_TRY(
      k_rmsnorm_bwd(m->st, nullptr, dh, dh, nullptr, h_out, w_of(m, norm_i), rstd_f, T, H, false));
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

// Upload `n` floats from the host as bf16 through the staging buffer.
dflash_status upload_bf16(df_cu_model *m, bf16 *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n; i += kBucketElems) {
    size_t k = n - i < kBucketElems ? n - i : kBucketElems;
    DF_CU(cudaMemcpyAsync(m->tmp, src + i, 4 * k, cudaMemcpyHostToDevice, m->st));
    DF_TRY(k_f32_to_bf16(m->st, dst + i, m->tmp, k));
  }
  DF_CU(cudaStreamSynchronize(m->st));
  return DFLASH_OK;
}

// This rank's slice of bucket b: flat offset and length.
void slice(const df_cu_model *m, size_t b, size_t *off, size_t *len) {
  const df_bucket *k = &m->buckets.buckets[b];
  *len = k->count / (size_t)m->world;
  *off = k->offset + (size_t)m->rank * *len;
}

// Every rank's reduced slices of the gradients into every rank's buffer, in place
// (collective): what get_grad returns after a step over several ranks.
dflash_status gather_grads(df_cu_model *m) {
#ifdef DFLASH_HAVE_NCCL
  DF_TRY(comm_usable(m));
  for (size_t b = 0; m->comm && b < m->buckets.n_buckets; b++) {
    size_t off, len;
    slice(m, b, &off, &len);
    ncclResult_t r = ncclAllGather(m->grads + off, m->grads + m->buckets.buckets[b].offset, len,
                                   ncclFloat, m->comm, m->st);
    if (r != ncclSuccess)
      return df_error(DFLASH_E_CUDA, "NCCL all-gather of gradient bucket %zu: %s", b,
                      ncclGetErrorString(r));
  }
  DF_TRY(wait_stream(m, "NCCL all-gather of the reduced gradients"));
#endif
  m->grads_sharded = false;
  return DFLASH_OK;
}

float *shard_buf(df_cu_model *m, int kind) {
  return kind == DF_CU_PARAMS ? m->master : kind == DF_CU_M1 ? m->m1 : m->m2;
}

} // namespace

extern "C" dflash_status df_cu_create(const df_cu_config *c, const float *params,
                                      const float *embed, const float *lm_head, df_cu_model **out) {
  *out = nullptr;
  df_cu_model *m = new (std::nothrow) df_cu_model();
  if (!m) return df_error(DFLASH_E_NOMEM, "CUDA model");
  m->c = *c;
  if (m->c.rot <= 0) m->c.rot = m->c.d; // no partial_rotary_factor: whole heads
  m->offsets.assign(c->offsets, c->offsets + c->n_tensors);
  m->c.offsets = nullptr;
  m->c.inv_freq = nullptr;
  m->c.pos_weight = nullptr;
  dflash_status st = DFLASH_OK;
#define TRY(x)                              \
  do {                                      \
    if ((st = (x)) != DFLASH_OK) goto fail; \
  } while (0)
  {
    cudaError_t e = cudaSetDevice(c->device);
    if (e != cudaSuccess) {
      st = df_error(DFLASH_E_NO_DEVICE, "CUDA: cannot use device %d: %s", c->device,
                    cudaGetErrorString(e));
      goto fail;
    }
    {
      // Refused here rather than at the first backward: a shape whose attention (forward or
      // backward) needs more shared memory than the device has per block.
      df_attn_dev shape{0, c->B, 0, c->nh, c->nkv, c->d, 0, nullptr, 0.0f};
      TRY(k_attention_check(&shape));
    }
    if (cudaStreamCreateWithFlags(&m->st, cudaStreamNonBlocking) != cudaSuccess ||
        cudaStreamCreateWithFlags(&m->comm_st, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&m->ev_ready, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&m->ev_comm, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&m->ev_step, cudaEventDisableTiming) != cudaSuccess ||
        cudaStreamCreateWithFlags(&m->copy_st, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&m->stages[0].copied, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&m->stages[0].used, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&m->stages[1].copied, cudaEventDisableTiming) != cudaSuccess ||
        cudaEventCreateWithFlags(&m->stages[1].used, cudaEventDisableTiming) != cudaSuccess ||
        cublasCreate(&m->blas) != CUBLAS_STATUS_SUCCESS ||
        cublasSetStream(m->blas, m->st) != CUBLAS_STATUS_SUCCESS) {
      st = df_error(DFLASH_E_CUDA, "CUDA: cannot create the streams, events and cuBLAS handle");
      goto fail;
    }
    // Created as this rank's ZeRO-1 shard: no full fp32 masters and moments, on the device
    // or the host, ever exist (df_cu_nccl_init only joins the communicator).
    m->world = c->world > 1 ? c->world : 1;
    m->rank = c->rank;
    if (m->rank < 0 || m->rank >= m->world) {
      st = df_error(DFLASH_E_INVALID_ARG, "CUDA: rank %d of %d", c->rank, m->world);
      goto fail;
    }
    if (c->bucket_elems > kBucketElems) {
      st = df_error(DFLASH_E_INVALID_ARG, "CUDA: gradient buckets of %zu elements (at most %zu)",
                    c->bucket_elems, kBucketElems);
      goto fail;
    }
    TRY(df_bucket_layout_init(&m->buckets, c->n_params, m->world,
                              c->bucket_elems ? c->bucket_elems : kBucketElems));
    // DFlash 2's gradients (after norm.weight in the table) are not final when the backward
    // passes their offsets, which the overlapped reduce-scatter assumes: after the backward.
    m->overlap = m->world > 1 && !c->no_overlap && !c->dflash2;
    if (c->dflash2) TRY(df2_create(c, &m->df2));
    m->from.assign(m->offsets.size() + 1, c->n_params);
    for (size_t i = m->offsets.size(); i-- > 0;)
      m->from[i] = m->offsets[i] < m->from[i + 1] ? m->offsets[i] : m->from[i + 1];
    size_t np = m->buckets.n_padded, vh = (size_t)c->V * c->H;
    TRY(dalloc(m, &m->w16, np, "bf16 weights"));
    TRY(dalloc(m, &m->grads, np, "fp32 gradients"));
    TRY(dalloc(m, &m->master, m->buckets.shard_len, "fp32 master weights"));
    TRY(dalloc(m, &m->m1, m->buckets.shard_len, "AdamW moments"));
    TRY(dalloc(m, &m->m2, m->buckets.shard_len, "AdamW moments"));
    TRY(dalloc(m, &m->embed, vh, "frozen embedding"));
    TRY(dalloc(m, &m->head, vh, "frozen LM head"));
    TRY(dalloc(m, &m->tmp, kBucketElems, "staging"));
    TRY(dalloc(m, &m->inv_freq, (size_t)m->c.rot / 2, "RoPE frequencies"));
    TRY(dalloc(m, &m->dw_scratch, k_rmsnorm_dw_scratch(c->H > c->d ? c->H : c->d), "norm scratch"));
    TRY(dalloc(m, &m->sumsq_part, 1024 + 4096, "norm scratch"));
    m->sumsq_out = m->sumsq_part + 1024;
    TRY(dalloc(m, &m->pend_loss, kPending, "per-sequence losses"));
    TRY(dalloc(m, &m->pend_bad, kPending + 1, "per-sequence NaN/Inf checks"));
    TRY(dalloc(m, &m->clip, 1, "gradient norm and clip factor"));
    if (cudaMallocHost((void **)&m->clip_pin, sizeof *m->clip_pin) != cudaSuccess) {
      st = df_error(DFLASH_E_NOMEM, "CUDA: cannot allocate pinned memory for the gradient norm");
      goto fail;
    }
    if (c->pos_weight) {
      TRY(dalloc(m, &m->wtab, (size_t)c->B, "position weights"));
      if (cudaMemcpyAsync(m->wtab, c->pos_weight, 4 * (size_t)c->B, cudaMemcpyHostToDevice,
                          m->st) != cudaSuccess) {
        st = df_error(DFLASH_E_CUDA, "CUDA: cannot upload the position weights");
        goto fail;
      }
    }
    // Every copy and memset goes on m->st: the stream is non-blocking, so work on the legacy
    // stream (cudaMemcpy, cudaMemset) would be neither waited for nor ordered before it.
    if (cudaMemcpyAsync(m->inv_freq, c->inv_freq, sizeof(double) * (m->c.rot / 2),
                        cudaMemcpyHostToDevice, m->st) != cudaSuccess) {
      st = df_error(DFLASH_E_CUDA, "CUDA: cannot upload RoPE frequencies");
      goto fail;
    }
    TRY(upload_bf16(m, m->embed, embed, vh));
    TRY(upload_bf16(m, m->head, lm_head, vh));
    TRY(df_cu_copy(m, DF_CU_PARAMS, (float *)params, 0));
    TRY(df_cu_zero_grad(m));
    if (cudaMemsetAsync(m->m1, 0, 4 * m->buckets.shard_len, m->st) != cudaSuccess ||
        cudaMemsetAsync(m->m2, 0, 4 * m->buckets.shard_len, m->st) != cudaSuccess ||
        cudaStreamSynchronize(m->st) != cudaSuccess) {
      st = df_error(DFLASH_E_CUDA, "CUDA: cannot clear the AdamW moments");
      goto fail;
    }
  }
#undef TRY
  *out = m;
  return DFLASH_OK;
fail:
  df_cu_free(m);
  return st;
}

extern "C" void df_cu_free(df_cu_model *m) {
  if (!m) return;
  cudaSetDevice(m->c.device); // the frees and destroys below act on it
  if (m->st) cudaStreamSynchronize(m->st);
  if (m->comm_st) cudaStreamSynchronize(m->comm_st);
  if (m->copy_st) cudaStreamSynchronize(m->copy_st);
  void *bufs[] = {m->w16,       m->embed,    m->head,          m->grads,         m->master,
                  m->m1,        m->m2,       m->tmp,           m->inv_freq,      m->sumsq_part,
                  m->cos_t,     m->sin_t,    m->dw_scratch,    m->best,          m->iota,
                  m->best_i,    m->arena,    m->stages[0].dev, m->stages[1].dev, m->wtab,
                  m->pend_loss, m->pend_bad, m->clip};
  for (void *p : bufs)
    if (p) cudaFree(p);
  df2_free(m->df2);
  if (m->clip_pin) cudaFreeHost(m->clip_pin);
  if (m->ev_step) cudaEventDestroy(m->ev_step);
  for (auto &g : m->stages) {
    if (g.pin) cudaFreeHost(g.pin);
    if (g.copied) cudaEventDestroy(g.copied);
    if (g.used) cudaEventDestroy(g.used);
  }
  if (m->copy_st) cudaStreamDestroy(m->copy_st);
#ifdef DFLASH_HAVE_NCCL
  if (m->comm) ncclCommDestroy(m->comm);
#endif
  if (m->blas) cublasDestroy(m->blas);
  if (m->ev_ready) cudaEventDestroy(m->ev_ready);
  if (m->ev_comm) cudaEventDestroy(m->ev_comm);
  if (m->comm_st) cudaStreamDestroy(m->comm_st);
  if (m->st) cudaStreamDestroy(m->st);
  df_bucket_layout_free(&m->buckets);
  delete m;
}

extern "C" dflash_status df_cu_zero_grad(df_cu_model *m) {
  DF_TRY(use_device(m));
  m->grads_sharded = false;
  m->pending_bwd = false; // what it would add is cleared anyway
  DF_CU(cudaMemsetAsync(m->grads, 0, 4 * m->buckets.n_padded, m->st));
  return DFLASH_OK;
}

namespace {

// Forward, LM head + CE, backward (or deferred, see pending_bwd) of an uploaded sequence.
dflash_status compute_sequence(df_cu_model *m, const df_cu_batch *b) {
  DF_TRY(model_forward(m));
  DF_TRY(lmhead_ce(m, b->coef != nullptr));
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
  if (b->A <= 0 || b->R <= 0) return DFLASH_OK;
  DF_TRY(flush_backward(m));
  DF_TRY(upload_batch(m, b, m->pend_bad + kPending));
  DF_TRY(model_forward(m));
  const df_cu_config &c = m->c;
  int R = b->R, chunk = c.vocab_chunk < c.V ? c.vocab_chunk : c.V;
  // best value / index: the row-f32 block's first two slots are free here.
  float *best = act<float>(m, DF_ACT_ROW_F32);
  int32_t *best_i = (int32_t *)(best + R);
  DF_TRY(k_argmax_init(m->st, best, best_i, R));       // all-NaN rows: token 0, as on the CPU
  if (m->df2) DF_TRY(df2_topk_init(m->df2, m->st, R)); // DFlash 2: the selector's candidates
  for (int v0 = 0; v0 < c.V; v0 += chunk) {
    int cn = c.V - v0 < chunk ? c.V - v0 : chunk;
    DF_TRY(gemm(m, false, true, R, cn, c.H, act<bf16>(m, DF_ACT_ROWS_X), c.H,
                m->head + (size_t)v0 * c.H, c.H, act<float>(m, DF_ACT_LOGITS), cn, true, 0.0f));
    if (m->df2) DF_TRY(df2_topk_chunk(m->df2, m->st, act<float>(m, DF_ACT_LOGITS), R, cn, v0));
    else DF_TRY(k_argmax_chunk(m->st, act<float>(m, DF_ACT_LOGITS), best, best_i, R, cn, v0));
  }
  if (m->df2) // the greedy path of each block, as the CPU's select_blocks
    DF_TRY(df2_select_greedy(m->df2, m->st, m->blas, act<bf16>(m, DF_ACT_ROWS_X),
                             act<int32_t>(m, DF_ACT_TOK), b->A, w_of(m, sel_w(m, 0)),
                             w_of(m, sel_w(m, 1)), w_of(m, sel_w(m, 2)), pred));
  else DF_CU(cudaMemcpyAsync(pred, best_i, 4 * (size_t)R, cudaMemcpyDeviceToHost, m->st));
  return finish_sync(m, 0, nullptr);
}

extern "C" dflash_status df_cu_allreduce_host(df_cu_model *m, double *x, int n) {
  DF_TRY(use_device(m));
#ifdef DFLASH_HAVE_NCCL
  DF_TRY(comm_usable(m));
  if (!m->comm || n <= 0) return DFLASH_OK;
  double *d = m->sumsq_out;
  if (n > 4096) return df_error(DFLASH_E_INTERNAL, "all-reduce of %d doubles", n);
  DF_CU(cudaMemcpyAsync(d, x, 8 * (size_t)n, cudaMemcpyHostToDevice, m->st));
  ncclResult_t r = ncclAllReduce(d, d, (size_t)n, ncclDouble, ncclSum, m->comm, m->st);
  if (r != ncclSuccess)
    return df_error(DFLASH_E_CUDA, "NCCL all-reduce: %s", ncclGetErrorString(r));
  DF_CU(cudaMemcpyAsync(x, d, 8 * (size_t)n, cudaMemcpyDeviceToHost, m->st));
  DF_TRY(wait_stream(m, "NCCL all-reduce of host scalars"));
#else
  (void)m, (void)x, (void)n;
#endif
  return DFLASH_OK;
}

extern "C" dflash_status df_cu_scale_grads(df_cu_model *m, double k) {
  DF_TRY(use_device(m));
  DF_TRY(flush_backward(m));
  return k_scale(m->st, m->grads, (float)k, m->buckets.n_padded);
}

extern "C" dflash_status df_cu_step_result(df_cu_model *m, double *norm) {
  DF_TRY(use_device(m));
  if (!m->step_pending)
    return df_error(DFLASH_E_STATE, "CUDA: no optimizer step is waiting for its result");
  m->step_pending = false;
  // The step only, not the sequences enqueued after it.
  DF_TRY(wait_on(m, m->st, "the optimizer step (NCCL reduce-scatter, all-reduce, all-gather)",
                 m->ev_step));
  if (norm) *norm = m->clip_pin->norm;
  if (!m->clip_pin->finite)
    return df_error(DFLASH_E_RANGE, "gradient norm is not finite; parameters left unchanged");
  return DFLASH_OK;
}

extern "C" dflash_status df_cu_step(df_cu_model *m, const df_cu_adam *a, double *norm) {
  DF_TRY(use_device(m));
  size_t nb = m->buckets.n_buckets;
  if (nb > 4096) return df_error(DFLASH_E_INTERNAL, "%zu gradient buckets", nb);
  DF_TRY(comm_usable(m));
  if (m->step_pending) DF_TRY(df_cu_step_result(m, nullptr)); // one outstanding at a time
  bool deferred = m->pending_bwd;
  m->pending_bwd = false;
  if (deferred && overlapping(m)) {
    // The last sequence's backward, each bucket reduce-scattered on comm_st as soon as the
    // backward has finished it (the same scaling and sums as below, bit for bit); the
    // optimizer waits for the last one.
    rs_issuer rs{0, a->grad_factor != 1.0, (float)a->grad_factor};
    DF_TRY(model_backward(m, &rs));
    DF_CU(cudaEventRecord(m->ev_comm, m->comm_st));
    DF_CU(cudaStreamWaitEvent(m->st, m->ev_comm, 0));
    // A waiting step drains the stream that runs the collectives here, for a dead peer's
    // timeout (so on the emulator a bucket issued without its event reads unfinished
    // gradients); one that does not wait relies on the event alone (df_cu_step_result then
    // waits on st, which has waited for comm_st).
    if (norm) DF_TRY(wait_on(m, m->comm_st, "NCCL gradient reduce-scatter (overlapped)"));
  } else {
    if (deferred) DF_TRY(model_backward(m, nullptr));
    if (a->grad_factor != 1.0)
      DF_TRY(k_scale(m->st, m->grads, (float)a->grad_factor, m->buckets.n_padded));
    for (size_t b = 0; joined(m) && b < nb; b++) DF_TRY(reduce_scatter(m, b, m->st));
  }
  m->grads_sharded = m->world > 1;
  // The norm and the clip factor on the device: sum of squares per bucket slice, their sum
  // in bucket order, summed over ranks, then sqrt and the factor (kernels.cu norm_clip).
  for (size_t b = 0; b < nb; b++) {
    size_t off, len;
    slice(m, b, &off, &len);
    DF_TRY(k_sumsq(m->st, m->grads + off, len, m->sumsq_part, m->sumsq_out + b));
  }
  DF_TRY(k_norm_sum(m->st, m->sumsq_out, (int)nb, m->clip));
#ifdef DFLASH_HAVE_NCCL
  if (m->comm) {
    ncclResult_t r = ncclAllReduce(&m->clip->ss, &m->clip->ss, 1, ncclDouble, ncclSum, m->comm,
                                   m->st);
    if (r != ncclSuccess)
      return df_error(DFLASH_E_CUDA, "NCCL all-reduce of the gradient norm: %s",
                      ncclGetErrorString(r));
  }
#endif
  DF_TRY(k_norm_clip(m->st, m->clip, a->clip));
  DF_CU(cudaMemcpyAsync(m->clip_pin, m->clip, sizeof *m->clip, cudaMemcpyDeviceToHost, m->st));
  // AdamW reads the factor on the device, and changes nothing for a non-finite norm.
  for (size_t b = 0; b < nb; b++) {
    size_t off, len, sh = m->buckets.buckets[b].shard_offset;
    slice(m, b, &off, &len);
    DF_TRY(k_adamw(m->st, m->master + sh, m->w16 + off, m->grads + off, m->m1 + sh, m->m2 + sh, len,
                   m->clip, a->decay, a->b1, a->b2, a->eps, a->step_size, a->bc2_sqrt));
    DF_TRY(k_scale_clipped(m->st, m->grads + off, m->clip, len));
  }
#ifdef DFLASH_HAVE_NCCL
  for (size_t b = 0; m->comm && b < nb; b++) {
    size_t off, len;
    slice(m, b, &off, &len);
    ncclResult_t r = ncclAllGather(m->w16 + off, m->w16 + m->buckets.buckets[b].offset, len,
                                   ncclBfloat16, m->comm, m->st);
    if (r != ncclSuccess)
      return df_error(DFLASH_E_CUDA, "NCCL all-gather of bucket %zu: %s", b, ncclGetErrorString(r));
  }
#endif
  DF_CU(cudaEventRecord(m->ev_step, m->st));
  m->step_pending = true;
  if (!norm) return DFLASH_OK; // the caller asks df_cu_step_result later
  DF_TRY(wait_stream(m, "NCCL all-gather of the updated weights"));
  return df_cu_step_result(m, norm);
}

extern "C" dflash_status df_cu_copy(df_cu_model *m, int kind, float *host, int to_host) {
  DF_TRY(use_device(m));
  DF_TRY(flush_backward(m)); // it reads the weights and writes the gradients
  size_t n = m->c.n_params;
  if (kind == DF_CU_GRADS) {
    // On m->st, after the work that wrote or reads them (zero_grad, the backward, a step).
    if (to_host && m->grads_sharded) DF_TRY(gather_grads(m));
    if (!to_host) m->grads_sharded = false;
    DF_CU(to_host ? cudaMemcpyAsync(host, m->grads, 4 * n, cudaMemcpyDeviceToHost, m->st)
                  : cudaMemcpyAsync(m->grads, host, 4 * n, cudaMemcpyHostToDevice, m->st));
    DF_CU(cudaStreamSynchronize(m->st));
    return DFLASH_OK;
  }
  float *sb = shard_buf(m, kind);
  if (to_host && m->world > 1) DF_TRY(comm_usable(m));
  for (size_t b = 0; b < m->buckets.n_buckets; b++) {
    const df_bucket *k = &m->buckets.buckets[b];
    size_t off, len;
    slice(m, b, &off, &len);
    if (to_host) {
      // Gather every rank's slice of this bucket, then keep the unpadded part.
      float *dst = m->tmp;
      if (m->world == 1)
        DF_CU(cudaMemcpyAsync(dst, sb + k->shard_offset, 4 * len, cudaMemcpyDeviceToDevice, m->st));
#ifdef DFLASH_HAVE_NCCL
      else {
        ncclResult_t r = ncclAllGather(sb + k->shard_offset, dst, len, ncclFloat, m->comm, m->st);
        if (r != ncclSuccess)
          return df_error(DFLASH_E_CUDA, "NCCL all-gather: %s", ncclGetErrorString(r));
      }
#endif
      size_t keep = k->offset >= n ? 0 : (n - k->offset < k->count ? n - k->offset : k->count);
      if (host) // NULL: this rank only takes part in the gather
        DF_CU(cudaMemcpyAsync(host + k->offset, dst, 4 * keep, cudaMemcpyDeviceToHost, m->st));
      DF_TRY(wait_stream(m, "NCCL all-gather of optimizer shards"));
    } else {
      size_t keep = off >= n ? 0 : (n - off < len ? n - off : len);
      DF_CU(cudaMemsetAsync(sb + k->shard_offset, 0, 4 * len, m->st));
      DF_CU(cudaMemcpyAsync(sb + k->shard_offset, host + off, 4 * keep, cudaMemcpyHostToDevice,
                            m->st));
    }
  }
  if (!to_host && kind == DF_CU_PARAMS) {
    DF_CU(cudaMemsetAsync(m->w16, 0, 2 * m->buckets.n_padded, m->st));
    DF_TRY(upload_bf16(m, m->w16, host, n));
  }
  DF_CU(cudaStreamSynchronize(m->st));
  return DFLASH_OK;
}

extern "C" dflash_status df_cu_nccl_unique_id(void *id) {
#ifdef DFLASH_HAVE_NCCL
  static_assert(sizeof(ncclUniqueId) == DF_CU_NCCL_ID_BYTES, "NCCL id size");
  ncclResult_t r = ncclGetUniqueId((ncclUniqueId *)id);
  if (r != ncclSuccess)
    return df_error(DFLASH_E_CUDA, "ncclGetUniqueId: %s", ncclGetErrorString(r));
  return DFLASH_OK;
#else
  (void)id;
  return df_error(DFLASH_E_UNSUPPORTED, "libdflash was built without NCCL");
#endif
}

extern "C" dflash_status df_cu_nccl_init(df_cu_model *m, int rank, int world, const void *id,
                                         double timeout_s) {
#ifdef DFLASH_HAVE_NCCL
  DF_TRY(use_device(m));
  // The buffers were laid out for this rank at create: the communicator must agree.
  if (rank != m->rank || world != m->world)
    return df_error(DFLASH_E_STATE,
                    "NCCL: joining as rank %d of %d, but the CUDA model was "
                    "created for rank %d of %d",
                    rank, world, m->rank, m->world);
  m->comm_timeout = timeout_s;
  ncclUniqueId uid;
  memcpy(&uid, id, sizeof uid);
  ncclResult_t r = ncclCommInitRank(&m->comm, world, uid, rank);
  if (r != ncclSuccess)
    return df_error(DFLASH_E_CUDA, "ncclCommInitRank (rank %d of %d): %s", rank, world,
                    ncclGetErrorString(r));
  return DFLASH_OK;
#else
  (void)m, (void)rank, (void)world, (void)id, (void)timeout_s;
  return df_error(DFLASH_E_UNSUPPORTED, "libdflash was built without NCCL");
#endif
}

extern "C" void df_cu_memory(const df_cu_model *m, size_t *peak, size_t *now, size_t *arena) {
  // DFlash 2's buffers (dflash2.cu) are allocated apart from the arena.
  if (peak) *peak = m->peak + df2_bytes(m->df2);
  if (now) *now = m->live + df2_bytes(m->df2);
  if (arena) *arena = m->arena_bytes;
}

extern "C" dflash_status df_cu_host_alloc(size_t bytes, void **out) {
  DF_CU(cudaMallocHost(out, bytes ? bytes : 1));
  return DFLASH_OK;
}

extern "C" void df_cu_host_free(void *p) {
  if (p) cudaFreeHost(p);
}
