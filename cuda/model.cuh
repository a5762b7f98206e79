// The CUDA drafter model shared by the backend's translation units (the twins of the CPU
// side's files): model.cu forward and backward (src/train/model.c), backend.cu the optimizer
// step and the host copies (backend_cpu.c), dist.cu NCCL and the gradient buckets (dist.c),
// arena.cu the device buffers, uploads and df_cu_create. Internal to cuda/.
#pragma once
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
#include "train/cuda/dist.h"
#include "train/tensors.h"
}

namespace dfcu {

constexpr size_t kBucketElems = DF_CU_BUCKET_ELEMS; // 64 Mi elements (256 MB fp32)
constexpr size_t kPending = DF_CU_PENDING;     // deferred sequences on the device between drains
constexpr int kDsparkRows = DF_CU_DSPARK_ROWS; // DSpark: rows per pass over the vocabulary

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

} // namespace dfcu

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
  // Muon (df_cu_config.muon, sorted by offset; empty for AdamW): per step, each matrix's
  // update all-gathered (through tmp, bucket by bucket) into ns_x, Newton-Schulz between
  // ns_x and ns_y with the Gram matrix in ns_g and its polynomial in ns_gg, the Frobenius
  // norm's sum of squares in ns_ss (backend.cu muon_step). Over several ranks only the
  // matrix's owner (arena.cu assign_muon_owners) runs Newton-Schulz and broadcasts the result.
  struct muon_mat {
    size_t off, n;
    int rows, cols;
    double lr_scale;
    int owner;
  };
  std::vector<muon_mat> muon;
  float *ns_x = nullptr, *ns_y = nullptr, *ns_g = nullptr, *ns_gg = nullptr;
  double *ns_ss = nullptr;
  // DSpark (c.dspark; model.cu dspark_loss): per row (cap_r) the Markov head's previous token,
  // the target's final state (bf16 [R, H], when the sequence has one: has_final), the Markov
  // embeddings W1[prev] (bf16 [R, r]) and the confidence logit's gradient; per chunk of
  // kDsparkRows rows the draft logits (fp32 [rows, Vd]), the target's (fp32 [rows, V]),
  // d(draft logits) (bf16 [rows, Vd]) and d(e) (fp32 [rows, r]). A pruned draft vocabulary
  // (c.draft_vocab < c.V; df_cu_set_draft_vocab): the kept target ids (int32 [Vd]) and the
  // drafter's LM head, the target head's rows at them (bf16 [Vd, H]); both nullptr otherwise
  // (the drafter's head is m->head).
  struct dspark_bufs {
    int32_t *prev = nullptr, *kept = nullptr;
    bf16 *xt = nullptr, *e = nullptr, *dz = nullptr, *head = nullptr;
    float *z = nullptr, *zt = nullptr, *de = nullptr, *ds = nullptr;
    size_t cap_r = 0;
    bool has_final = false;
  } dsp;
};

namespace dfcu {

// ---- arena.cu: buffers, uploads, the device ----------------------------------------------
dflash_status dalloc(df_cu_model *m, void **p, size_t bytes, const char *what);
template <typename T>
dflash_status dalloc(df_cu_model *m, T **p, size_t count, const char *what) {
  return dalloc(m, (void **)p, count * sizeof(T), what);
}
// The current device is per host thread: every entry point makes the model's device current,
// since a caller may use the trainer from another thread than the one that created it (whose
// device may be 0 while this rank's is LOCAL_RANK).
dflash_status use_device(const df_cu_model *m);
// Upload `n` floats from the host as bf16 through the staging buffer.
dflash_status upload_bf16(df_cu_model *m, bf16 *dst, const float *src, size_t n);
// One sequence to the device without waiting for the one before (see df_cu_model::stage):
// the small per-row arrays from the pinned stage on st (the arena is the previous sequence's
// until st reaches them), the context rows as stored on copy_st, then decoded and checked on
// st; *bad (device) gets the lowest non-finite index, or ~0.
dflash_status upload_batch(df_cu_model *m, const df_cu_batch *b, unsigned long long *bad);

// ---- dist.cu: NCCL -----------------------------------------------------------------------
// Wait for the stream. With NCCL, a peer that died leaves the collective
// kernels spinning for ever, so give up after the collective timeout (or on
// NCCL's own asynchronous error): abort the communicator and fail, naming
// `what`; the model refuses collectives from then on.
// (With an event, what the stream had reached when it was recorded.)
dflash_status wait_on(df_cu_model *m, cudaStream_t s, const char *what, cudaEvent_t ev = nullptr);
dflash_status wait_stream(df_cu_model *m, const char *what);
// Collectives need the communicator that an earlier failure may have aborted.
dflash_status comm_usable(const df_cu_model *m);
// The reduce-scatter overlaps the backward: several ranks joined over NCCL (and not turned
// off, df_cu_config.no_overlap).
bool joined(const df_cu_model *m);
bool overlapping(const df_cu_model *m);
// This rank's slice of bucket b: flat offset and length.
void slice(const df_cu_model *m, size_t b, size_t *off, size_t *len);
// Reduce-scatter bucket b in place on stream s: this rank's slice gets the sum.
dflash_status reduce_scatter(df_cu_model *m, size_t b, cudaStream_t s);
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
dflash_status issue_ready(df_cu_model *m, rs_issuer *rs, size_t done);
// Every rank's reduced slices of the gradients into every rank's buffer, in place
// (collective): what get_grad returns after a step over several ranks.
dflash_status gather_grads(df_cu_model *m);

// ---- model.cu: forward and backward ------------------------------------------------------
// The backward of the uploaded sequence; with rs, each gradient bucket reduce-scattered on
// the communication stream as soon as the backward has finished it.
dflash_status model_backward(df_cu_model *m, rs_issuer *rs);
// The deferred backward of the last sequence, when something other than the step comes
// next: in stream order, as if it had run at its accumulate.
dflash_status flush_backward(df_cu_model *m);

// ---- parameters and activations ----------------------------------------------------------
inline bf16 *w_of(df_cu_model *m, size_t i) { return m->w16 + m->offsets[i]; }
inline float *g_of(df_cu_model *m, size_t i) { return m->grads + m->offsets[i]; }
inline size_t lw(int l, int k) { return df_tensor_layer(l, k); }
// norm.weight, DFlash 1's last tensor; DFlash 2's follow it (train/tensors.h): per layer
// attention_conv's base_kernel and kernel_projection, then mlp_conv's; then the selector's
// predecessor and successor codebooks and hidden_projection.
inline size_t norm_index(const df_cu_model *m) { return df_tensor_tail(m->c.L, DF_TT_NORM); }
inline size_t conv_w(const df_cu_model *m, int l, int which, int proj) {
  return df_tensor_conv(m->c.L, l, which ? DF_CONV_MLP : DF_CONV_ATT,
                        proj ? DF_TC_PROJ : DF_TC_BASE);
}
inline size_t sel_w(const df_cu_model *m, int k) { return df_tensor_sel(m->c.L, k); }
template <typename T>
T *act(df_cu_model *m, int id) {
  return (T *)(m->arena + m->lay.off[id]);
}
template <typename T>
T *lact(df_cu_model *m, int l, int id) {
  return (T *)(m->arena + m->lay.loff[l][id]);
}

} // namespace dfcu
