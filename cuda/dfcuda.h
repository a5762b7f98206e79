/*
 * The C interface of the CUDA trainer backend (the .cu files in cuda/), called by
 * src/train/backend_cuda.c. Plain C types, usable from C and nvcc. Every
 * function returns a dflash_status and records the message with df_error.
 */
#ifndef DFLASH_CUDA_DFCUDA_H
#define DFLASH_CUDA_DFCUDA_H

#include <dflash/dflash.h>

#include "train/act_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct df_cu_config {
  int H, KH, nh, nkv, d, I, V, B, L, vocab_chunk;
  float eps;
  int window[DF_ACT_MAX_LAYERS]; /* 0: full attention */
  double attn_factor;
  const double *inv_freq;        /* [rot/2] */
  /* RoPE rotates the first rot dims of each head (partial_rotary_factor); 0 means d. */
  int rot;
  size_t n_params;
  const size_t *offsets;         /* [n_tensors], model.c's table order */
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
} df_cu_config;

/* Gradient buckets (NCCL calls) and the staging buffer: 64 Mi elements. */
#define DF_CU_BUCKET_ELEMS ((size_t)1 << 26)

/* One sequence, prepared on the host (backend_cuda.c). */
typedef struct df_cu_batch {
  int T, Sc, R, A, max_pos;
  const int32_t *anchors;            /* [A] */
  const int32_t *block_tok;          /* [T] anchor token / mask token */
  const int32_t *rows_t, *rows_target; /* [R] supervised (or predicted) rows */
  const float *coef;                 /* [R] w * grad_scale (NULL: predict) */
  const uint16_t *hidden;            /* bf16 [Sc, KH] */
} df_cu_batch;

enum { DF_CU_PARAMS = 1, DF_CU_GRADS = 2, DF_CU_M1 = 4, DF_CU_M2 = 8 };

typedef struct df_cu_model df_cu_model;

dflash_status df_cu_create(const df_cu_config *c, const float *params, const float *embed,
                           const float *lm_head, df_cu_model **out);
void df_cu_free(df_cu_model *m);
dflash_status df_cu_zero_grad(df_cu_model *m);
/* Forward (+ backward when coef): row_loss [R] on the host gets each row's CE. */
dflash_status df_cu_accumulate(df_cu_model *m, const df_cu_batch *b, float *row_loss);
/* Multiply the accumulated gradients by k. */
dflash_status df_cu_scale_grads(df_cu_model *m, double k);
/* Greedy token of each of b->R rows into pred. */
dflash_status df_cu_predict(df_cu_model *m, const df_cu_batch *b, int32_t *pred);

typedef struct df_cu_adam {
  float decay, b1, b2, eps, step_size, bc2_sqrt;
  double clip;        /* <= 0: off */
  double grad_factor; /* gradients are multiplied by this before the reduction */
} df_cu_adam;
/* (All-)reduce gradients, global norm, clip, AdamW on this rank's shard,
 * gather the bf16 weights. *norm is the pre-clip norm; not finite: nothing
 * changes and DFLASH_E_RANGE. */
dflash_status df_cu_step(df_cu_model *m, const df_cu_adam *a, double *norm);
/* Copy a whole flat buffer (fp32, n_params) to or from the host. With
 * ZeRO-1 sharding, to_host of masters/moments is collective (all ranks), and
 * so is to_host of the gradients after a step (each rank holds the reduced
 * sum of its own slices; they are gathered). A NULL host with to_host
 * takes part in the gather of masters or moments and copies nothing. */
dflash_status df_cu_copy(df_cu_model *m, int kind, float *host, int to_host);

/* Device bytes the model allocates besides the weights, gradients, optimizer
 * state, frozen tables and the activation arena, as df_cu_create and the
 * first sequence allocate them: the fp32 staging buffer, RoPE frequencies,
 * the norm-weight scratch (256 row slices), the norm-reduction partials and
 * the cos/sin tables and positions for [0, n_pos). For `dflash train --plan`
 * (plain C: the core library has no CUDA). */
#define DF_CU_DW_SPLIT 256
static inline size_t df_cu_fixed_scratch_bytes(int H, int d, int n_pos) {
  size_t half = (size_t)d / 2, wide = (size_t)(H > d ? H : d);
  return 4 * DF_CU_BUCKET_ELEMS + 8 * half + 4 * DF_CU_DW_SPLIT * wide + 8 * (1024 + 4096) +
         (size_t)n_pos * (2 * half * 4 + 4);
}

/* NCCL: rank 0 makes the id (128 bytes), every rank joins with it. */
#define DF_CU_NCCL_ID_BYTES 128
dflash_status df_cu_nccl_unique_id(void *id);
/* Every later wait on a collective gives up after timeout_s: the
 * communicator is aborted and the call fails with DFLASH_E_TIMEOUT. */
dflash_status df_cu_nccl_init(df_cu_model *m, int rank, int world, const void *id,
                              double timeout_s);
/* Sum `n` doubles over ranks (in place); a no-op without NCCL. */
dflash_status df_cu_allreduce_host(df_cu_model *m, double *x, int n);

/* Device memory: peak and current bytes this model allocated (arena
 * included), and the arena size of the last call. */
void df_cu_memory(const df_cu_model *m, size_t *peak, size_t *now, size_t *arena);

/* Pinned host memory for uploads. */
dflash_status df_cu_host_alloc(size_t bytes, void **out);
void df_cu_host_free(void *p);

#ifdef __cplusplus
}
#endif

#endif
