/*
 * The C interface of the CUDA trainer backend (the .cu files in cuda/), called by
 * src/train/cuda/backend_cuda.c. Plain C types, usable from C and nvcc. Every
 * function returns a dflash_status and records the message with df_error.
 */
#ifndef DFLASH_CUDA_DFCUDA_H
#define DFLASH_CUDA_DFCUDA_H

#include <dflash/dflash.h>

#include "train/act_layout.h"

/* As core/internal.h's (not included here: the CUDA sources declare its error helpers
 * themselves, with C++ linkage). */
#ifndef DF_MUST_CHECK
#if defined(__GNUC__)
#define DF_MUST_CHECK __attribute__((warn_unused_result))
#else
#define DF_MUST_CHECK
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* The CUDA attention's shape limits (cuda/attention.cu packs a block's B rows times the query
 * heads of one kv head into one CTA's M tile). Checked when a CUDA trainer is created and by
 * the training plan, so that a shape the kernels cannot run is refused before any work; the
 * shared-memory limit, which depends on the device, is checked at the first launch. */
#define DF_CU_ATTN_MAX_D 256    /* head_dim, a multiple of 8 */
#define DF_CU_ATTN_MAX_ROWS 128 /* block size x query heads per kv head, rounded up to 16 */

/* Packed query rows of one attention CTA: block size B times the query heads per kv head,
 * rounded up to 16 (nkv > 0 and nh % nkv == 0). */
static inline int df_cu_attn_rows(int B, int nh, int nkv) {
  return (B * (nh / nkv) + 15) / 16 * 16;
}

/* NULL when the CUDA attention runs this shape, else what it breaks. */
static inline const char *df_cu_attn_shape_why(int B, int nh, int nkv, int d) {
  if (d <= 0 || d % 8 || d > DF_CU_ATTN_MAX_D)
    return "head_dim must be a multiple of 8, at most 256";
  if (nkv <= 0 || nh % nkv) return "the query heads must be a multiple of the kv heads";
  if (B <= 0 || df_cu_attn_rows(B, nh, nkv) > DF_CU_ATTN_MAX_ROWS)
    return "block size times query heads per kv head must be at most 128 rows";
  return NULL;
}

/* Host and device alike under nvcc; plain C elsewhere (the emulator, the training plan). */
#ifdef __CUDACC__
#define DF_CU_HD __host__ __device__
#else
#define DF_CU_HD
#endif

/* One attention CTA's shared memory, as cuda/attention.cu lays it out and the training plan
 * reports it: the byte offset of each region, each on 128 bytes, and the total. kind:
 * DF_CU_ATTN_FWD, _BWD_Q (dQ) or _BWD_KV (dK / dV); Mp packed query rows (a multiple of 16),
 * N keys per tile, dp head_dim rounded up to 16. Rows are dp bf16 long, dp + 8 when dp is not
 * a multiple of 64 (the swizzle needs 64; the pad keeps ldmatrix free of bank conflicts). */
enum { DF_CU_ATTN_FWD, DF_CU_ATTN_BWD_Q, DF_CU_ATTN_BWD_KV };
#define DF_CU_ATTN_MAX_N 64 /* keys per tile; 32 and 16 where 64 does not fit */
typedef struct df_cu_attn_smem {
  size_t q, dout, k, v, ls, ds, total;
} df_cu_attn_smem;

static inline DF_CU_HD int df_cu_attn_row_len(int dp) { return dp % 64 ? dp + 8 : dp; }

static inline DF_CU_HD size_t df_cu_attn_take(size_t *at, size_t bytes) {
  size_t o = *at;
  *at = (*at + bytes + 127) & ~(size_t)127;
  return o;
}

static inline DF_CU_HD df_cu_attn_smem df_cu_attn_smem_layout(int kind, int Mp, int N, int dp) {
  size_t ld = (size_t)df_cu_attn_row_len(dp), at = 0;
  df_cu_attn_smem m = {0, 0, 0, 0, 0, 0, 0};
  m.q = df_cu_attn_take(&at, 2 * (size_t)Mp * ld);
  m.dout = kind == DF_CU_ATTN_FWD ? 0 : df_cu_attn_take(&at, 2 * (size_t)Mp * ld);
  m.k = df_cu_attn_take(&at, 2 * (size_t)N * ld);
  m.v = df_cu_attn_take(&at, 2 * (size_t)N * ld);
  m.ls = kind == DF_CU_ATTN_BWD_KV ? df_cu_attn_take(&at, 4 * (size_t)Mp) : 0;
  m.ds = kind == DF_CU_ATTN_BWD_KV ? df_cu_attn_take(&at, 4 * (size_t)Mp) : 0;
  m.total = at;
  return m;
}

/* The widest key tile (64, 32, 16) of `kind` whose shared memory fits `limit` bytes per
 * block; 0 when none does. */
static inline int df_cu_attn_pick_n(int kind, int Mp, int dp, size_t limit) {
  for (int N = DF_CU_ATTN_MAX_N; N >= 16; N /= 2)
    if (df_cu_attn_smem_layout(kind, Mp, N, dp).total <= limit) return N;
  return 0;
}

/* Sequences per GPU per optimizer step the trainer picks when none is asked for
 * (dflash_train_run_options.batch_size 0, the default; the training plan's batch_size 0), in
 * the gradient-accumulation form: the sequences run one after another into one fp32
 * gradient buffer, then one reduce-scatter and one all-gather per step, so device memory
 * does not depend on the count. One sequence per step unless several ranks talk over PCIe:
 * there the fp32 gradient reduce-scatter and the bf16 weight all-gather (~6 bytes per
 * parameter through a 15-42 GB/s NCCL bus) outlast one sequence's compute, and
 * DF_CU_PCIE_SEQUENCES spread them. 4 is the smallest count at which
 * bench/gpu_model.py predicts >= 50 % MFU for both the Kimi and the Qwen3-8B drafter on
 * 8 RTX PRO 6000 at 25 GB/s (3: Qwen3-8B 49.3 %); gpu_model.py's auto_batch is this rule
 * and tests/gpu/test_gpu_model.py checks the two agree. */
#define DF_CU_PCIE_SEQUENCES 4
static inline int df_cu_auto_sequences(int world, int pcie) {
  return world > 1 && pcie ? DF_CU_PCIE_SEQUENCES : 1;
}

/* Whether 8-GPU machines of this compute capability talk over PCIe: no part of sm_86
 * (RTX A6000, A40), sm_89 (L40S, RTX 6000 Ada) or sm_12x (RTX PRO 6000 Blackwell, RTX 5090)
 * has an NVLink switch (at most a two-GPU bridge); sm_80, sm_90 and sm_10x machines of 8
 * are NVLink (SXM) boards. A PCIe card of those (H100 PCIe) passes --batch itself. */
static inline int df_cu_arch_pcie(int major, int minor) {
  return major == 12 || (major == 8 && (minor == 6 || minor == 9));
}

/* What the trainer reads of a device before it creates a model (df_cu_device_props). */
typedef struct df_cu_props {
  char name[256];
  int major, minor, sms;
  size_t smem_per_block; /* opt-in */
  size_t total_mem;
  /* How it reaches the others: the visible devices, how many of the others it can access
   * directly (cudaDeviceCanAccessPeer), the first it cannot (-1: none), and NCCL's version
   * (major * 10000 + minor * 100 + patch; 0 unknown, -1 built without NCCL). */
  int n_devices, p2p_peers, p2p_missing, nccl_version;
} df_cu_props;

typedef struct df_cu_config {
  int H, KH, nh, nkv, d, I, V, B, L, vocab_chunk;
  float eps;
  int window[DF_ACT_MAX_LAYERS]; /* 0: full attention */
  double attn_factor;
  const double *inv_freq; /* [rot/2] */
  /* RoPE rotates the first rot dims of each head (partial_rotary_factor); 0 means d. */
  int rot;
  size_t n_params;
  const size_t *offsets; /* [n_tensors], train/tensors.h's order */
  size_t n_tensors;
  int device;
  /* Data-parallel rank and world (0 means 1) this model is created for: the
   * fp32 masters and moments are allocated as this rank's ZeRO-1 shard from
   * the start, and df_cu_nccl_init must be called with the same pair. */
  int rank, world;
  /* Gradient bucket size in elements (0: DF_CU_BUCKET_ELEMS, the most allowed); tests use
   * small ones so that a small model has several. */
  size_t bucket_elems;
  /* Nonzero: with several ranks, reduce-scatter after the backward instead of overlapping
   * it (DFLASH_CUDA_OVERLAP=0; the same results to the bit). */
  int no_overlap;
  /* Nonzero: with several ranks, the gradient reduce-scatter in bf16 (the option
   * grad_reduce_bf16):
   * each bucket rounded to bf16 (round to nearest even), summed by NCCL in bf16, this rank's
   * slice widened back to fp32. Half the bytes over the bus; an element of the sum is off by
   * at most about (world + 1) * 2^-9 times the sum of the ranks' magnitudes (one rounding of
   * each rank's value, one per addition in NCCL's ring), against fp32's 2^-24 per addition.
   * Not bit-reproducible across world sizes or NCCL algorithms. docs/gpu.md. */
  int rs_bf16;
  /* DFlash 2 (dflash2 nonzero; cuda/dflash2.cu): the convolutions' kernel size and group
   * size, the selector's top-K and rank, its loss weight and mode (inject, else drop).
   * Its tensors follow DFlash 1's in the table, as model.c lays them out. */
  int dflash2, conv_k, conv_g, sel_top_k, sel_rank, sel_inject;
  double sel_weight;
  /* [B] the loss weight of block position j (df_position_weight), for the per-sequence
   * sum(w*CE) a deferred accumulate keeps on the device; NULL: every weight 1. */
  const float *pos_weight;
  /* The matrices Muon updates (df_muon_takes on the tensor table, in table order), for a
   * trainer whose optimizer is Muon; n_muon 0 otherwise (the AdamW step needs none, and the
   * model allocates no Muon workspace). */
  const struct df_cu_muon_mat *muon;
  size_t n_muon;
  /* DSpark (dspark nonzero; spec/dspark.md, the CPU's src/train/dspark.c): the Markov head's
   * rank, whether the confidence head exists, and the objective's weights. Its tensors
   * (markov_head.*, confidence_head.proj.*) follow DFlash 1's in the table. */
  int dspark, markov_rank, dspark_conf;
  float ds_alpha_ce, ds_alpha_l1, ds_alpha_conf;
  /* DSpark's draft vocabulary V_d (markov_w2's rows and the draft logits' width): V, or
   * below it for a pruned one, whose LM head is the target's rows at the kept ids
   * (df_cu_set_draft_vocab); df_cu_create's lm_head is the target's whole [V, H] head. */
  int draft_vocab;
} df_cu_config;

/* One Muon matrix: its flat offset and shape [rows, cols] (row-major, as the CPU's), and the
 * factor its step gets over the learning rate (df_muon_lr_scale: dflash_muon_adjust_lr). */
typedef struct df_cu_muon_mat {
  size_t offset;
  int64_t rows, cols;
  double lr_scale;
} df_cu_muon_mat;

/* Newton-Schulz of Muon, shared by the CPU (optim_muon.c) and CUDA (cuda/backend.cu) steps:
 * Keller Jordan's quintic coefficients, steps and eps (torch.optim.Muon's defaults). */
#define DF_MUON_NS_A 3.4445f
#define DF_MUON_NS_B (-4.7750f)
#define DF_MUON_NS_C 2.0315f
#define DF_MUON_NS_EPS 1e-7f
#define DF_MUON_NS_STEPS 5

/* Device bytes the Muon step allocates besides the model (cuda/arena.cu), for a largest Muon
 * matrix of `max_numel` elements and a largest Gram matrix (the smaller side squared) of
 * `max_gram`: the matrix and its Newton-Schulz partner (fp32), the Gram matrix and its
 * polynomial (fp32), one double for the Frobenius norm. The momentum's all-gather goes
 * through the staging buffer (df_cu_fixed_scratch_bytes). 0 without Muon. */
static inline size_t df_cu_muon_scratch_bytes(size_t max_numel, size_t max_gram) {
  return max_numel ? 4 * (2 * max_numel + 2 * max_gram) + 8 : 0;
}

/* Gradient buckets (NCCL calls) and the staging buffer: 64 Mi elements. */
#define DF_CU_BUCKET_ELEMS ((size_t)1 << 26)

/* One sequence, prepared on the host (backend_cuda.c). */
typedef struct df_cu_batch {
  int T, Sc, R, A, max_pos;
  const int32_t *anchors;              /* [A] */
  const int32_t *block_tok;            /* [T] anchor token / mask token */
  const int32_t *rows_t, *rows_target; /* [R] supervised (or predicted) rows */
  const float *coef;                   /* [R] w * grad_scale (NULL: predict) */
  const int32_t *rows_prev;            /* [R] DFlash 2: the true token before each row; DSpark:
                                        * the Markov head's previous token (teacher forcing) */
  /* DSpark: bf16 [R, H] the target's post-norm final state at each row's position (anchor +
   * slot, the state before its label), or NULL (the loss is then 0.1 CE alone, as on the CPU). */
  const uint16_t *rows_final;
  const uint16_t *hidden; /* bf16 [Sc, KH] (when hidden_codes is NULL) */
  /* The context rows [Sc, KH] as stored: DF_CU_HIDDEN_BF16 / _FP8 (e4m3 codes with a float
   * scale per token and layer, hidden_scales [Sc, K]) / _F32. Host memory the call reads
   * before it returns (copied into a pinned staging buffer); the device converts them to
   * bf16 and checks them for NaN/Inf. NULL: `hidden`, as bf16. */
  int hidden_dtype;
  const void *hidden_codes;
  const float *hidden_scales;
} df_cu_batch;

enum { DF_CU_HIDDEN_BF16 = 0, DF_CU_HIDDEN_FP8 = 1, DF_CU_HIDDEN_F32 = 2 };

enum { DF_CU_PARAMS = 1, DF_CU_GRADS = 2, DF_CU_M1 = 4, DF_CU_M2 = 8 };

typedef struct df_cu_model df_cu_model;

DF_MUST_CHECK dflash_status df_cu_create(const df_cu_config *c, const float *params,
                                         const float *embed, const float *lm_head,
                                         df_cu_model **out);
void df_cu_free(df_cu_model *m);
DF_MUST_CHECK dflash_status df_cu_zero_grad(df_cu_model *m);
/* Forward (+ backward when coef). With row_loss [R] the call waits for the device and
 * row_loss gets each row's CE (a non-finite context row fails, DFLASH_E_FORMAT naming token
 * and column). With row_loss NULL nothing waits: the context rows go up on the copy stream
 * through one of two pinned staging buffers while the previous sequence computes, and the
 * sequence's sum(w*CE) and its NaN/Inf check stay on the device until df_cu_results. */
DF_MUST_CHECK dflash_status df_cu_accumulate(df_cu_model *m, const df_cu_batch *b, float *row_loss);
/* The deferred sequences since the last call, in order (exactly n of them): sum(w*CE) and
 * the flat index into [Sc, KH] of its first non-finite context value, or -1. Waits once. */
DF_MUST_CHECK dflash_status df_cu_results(df_cu_model *m, double *loss_sum, int64_t *bad, size_t n);
/* Multiply the accumulated gradients by k. */
DF_MUST_CHECK dflash_status df_cu_scale_grads(df_cu_model *m, double k);
/* DSpark with a pruned draft vocabulary (c.draft_vocab < c.V): kept [c.draft_vocab], the
 * ascending target ids the drafter keeps (draft index i is target id kept[i]), uploaded and
 * the drafter's LM head gathered on the device from the target's rows; in stream order, so
 * the sequences accumulated before it used the set before. The labels (df_cu_batch
 * rows_target) are then draft indices, -1 for a label outside the set (no CE). */
DF_MUST_CHECK dflash_status df_cu_set_draft_vocab(df_cu_model *m, const int32_t *kept);
/* Greedy token of each of b->R rows into pred. */
DF_MUST_CHECK dflash_status df_cu_predict(df_cu_model *m, const df_cu_batch *b, int32_t *pred);

typedef struct df_cu_adam {
  float decay, b1, b2, eps, step_size, bc2_sqrt;
  double clip;        /* <= 0: off */
  double grad_factor; /* gradients are multiplied by this before the reduction */
  /* Nonzero: Muon on the model's Muon matrices (df_cu_config.muon), AdamW on the rest.
   * lr is the scheduled learning rate (a matrix's step is lr x its lr_scale), muon_mu the
   * Nesterov momentum, muon_decay 1 - lr x muon_weight_decay. */
  int muon;
  double lr;
  float muon_mu, muon_decay;
} df_cu_adam;
/* (All-)reduce gradients, global norm, clip, AdamW on this rank's shard,
 * gather the bf16 weights. With a->muon, the Muon matrices instead take Muon on this rank's
 * shard: the Nesterov momentum of its slices, the update all-gathered per bucket into every
 * rank, Newton-Schulz on each whole matrix (replicated on every rank), the step on the slices
 * (Moonshot's distributed Muon); DFLASH_E_STATE for a model created without its matrices. The norm, the clip factor and the skip of a non-finite norm are
 * computed on the device, so nothing in between waits for the host. With norm, the call
 * waits: *norm is the pre-clip norm; not finite: nothing changes and DFLASH_E_RANGE. With
 * norm NULL nothing waits (a sequence accumulated next uploads while the step runs; stream
 * order keeps the next forward behind the updated weights) and df_cu_step_result returns
 * the norm later. A step whose result was not asked for is resolved first. */
DF_MUST_CHECK dflash_status df_cu_step(df_cu_model *m, const df_cu_adam *a, double *norm);
/* The pre-clip norm of the last step made with norm NULL: waits for that step (not for the
 * sequences enqueued after it); not finite: DFLASH_E_RANGE (the step changed nothing).
 * DFLASH_E_STATE when no such step is outstanding. */
DF_MUST_CHECK dflash_status df_cu_step_result(df_cu_model *m, double *norm);
/* Copy a whole flat buffer (fp32, n_params) to or from the host. With
 * ZeRO-1 sharding, to_host of masters/moments is collective (all ranks), and
 * so is to_host of the gradients after a step (each rank holds the reduced
 * sum of its own slices; they are gathered). A NULL host with to_host
 * takes part in the gather of masters or moments and copies nothing. */
DF_MUST_CHECK dflash_status df_cu_copy(df_cu_model *m, int kind, float *host, int to_host);

/* Deferred sequences whose results the device holds between drains (df_cu_results). */
#define DF_CU_PENDING 1024

/* Device bytes the model allocates besides the weights, gradients, optimizer
 * state, frozen tables and the activation arena, as df_cu_create and the
 * first sequence allocate them: the fp32 staging buffer, RoPE frequencies,
 * the norm-weight scratch (256 row slices), the norm-reduction partials, the
 * cos/sin tables and positions for [0, n_pos), the per-sequence results and
 * position weights, and the two stages of context rows as stored (at most
 * n_pos rows of KH values, bounded by the float32 path's 4 bytes a value;
 * bf16 stores need half, fp8 a quarter plus the scales). For `dflash train
 * --plan` (plain C: the core library has no CUDA). A Muon trainer allocates
 * df_cu_muon_scratch_bytes more, which the plan adds with options.optimizer Muon. */
#define DF_CU_DW_SPLIT 256
static inline size_t df_cu_fixed_scratch_bytes(int H, int KH, int d, int B, int n_pos) {
  size_t half = (size_t)d / 2, wide = (size_t)(H > d ? H : d);
  return 4 * DF_CU_BUCKET_ELEMS + 8 * half + 4 * DF_CU_DW_SPLIT * wide + 8 * (1024 + 4096) + 32 +
         (size_t)n_pos * (2 * half * 4 + 4) + 8 * (2 * (size_t)DF_CU_PENDING + 1) + 4 * (size_t)B +
         2 * (4 * (size_t)n_pos * (size_t)KH + 256);
}

/* DSpark's device buffers besides the arena (cuda/model.cu dspark_upload, arena.cu), for R
 * supervised rows (A * B: DSpark's slot 0 is supervised too), hidden size H, vocabulary V,
 * draft vocabulary Vd (V unless pruned) and Markov rank r: per row the previous token (int32),
 * the target's final state and the Markov embedding (bf16) and the confidence gradient
 * (fp32); per pass of DF_CU_DSPARK_ROWS rows the draft logits (fp32, Vd wide), the target's
 * (fp32, V wide), d(draft logits) (bf16, Vd wide) and d(e) (fp32); pruned, the drafter's LM
 * head (the kept rows, bf16 [Vd, H]) and the kept ids (int32 [Vd]). For `dflash train
 * --plan`. */
#define DF_CU_DSPARK_ROWS 64
static inline size_t df_cu_dspark_bytes(size_t R, size_t H, size_t V, size_t Vd, size_t r) {
  R = R ? R : 1;
  Vd = Vd && Vd < V ? Vd : V;
  return R * (4 + 2 * H + 2 * r + 4) + (size_t)DF_CU_DSPARK_ROWS * (Vd * (4 + 2) + V * 4 + 4 * r) +
         (Vd < V ? Vd * (2 * H + 4) : 0);
}

/* The properties of CUDA device `device` (DFLASH_E_NO_DEVICE when there is none). */
DF_MUST_CHECK dflash_status df_cu_device_props(int device, df_cu_props *out);

/* NCCL: rank 0 makes the id (128 bytes), every rank joins with it. */
#define DF_CU_NCCL_ID_BYTES 128
DF_MUST_CHECK dflash_status df_cu_nccl_unique_id(void *id);
/* Every later wait on a collective gives up after timeout_s: the
 * communicator is aborted and the call fails with DFLASH_E_TIMEOUT. */
DF_MUST_CHECK dflash_status df_cu_nccl_init(df_cu_model *m, int rank, int world, const void *id,
                                            double timeout_s);
/* Sum `n` doubles over ranks (in place); a no-op without NCCL. */
DF_MUST_CHECK dflash_status df_cu_allreduce_host(df_cu_model *m, double *x, int n);

/* Device memory: peak and current bytes this model allocated (arena
 * included), and the arena size of the last call. */
void df_cu_memory(const df_cu_model *m, size_t *peak, size_t *now, size_t *arena);

/* Pinned host memory for uploads. */
DF_MUST_CHECK dflash_status df_cu_host_alloc(size_t bytes, void **out);
void df_cu_host_free(void *p);

#ifdef __cplusplus
}
#endif

#endif
