/*
 * The CUDA backend's device memory, as plain arithmetic shared by the GPU
 * code (which carves its arena with it) and `dflash train --plan` (which
 * reports it), so the plan is what the GPU allocates. C and C++ (nvcc).
 */
#ifndef DFLASH_TRAIN_ACT_LAYOUT_H
#define DFLASH_TRAIN_ACT_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define DF_ACT_ALIGN 256 /* bytes; every tensor starts aligned */
#define DF_ACT_MAX_LAYERS 64

/* Tensors used once per call. */
enum df_act_id {
  DF_ACT_HIDDEN,   /* bf16 [Sc, KH] target features */
  DF_ACT_CTX_PRE,  /* bf16 [Sc, H] */
  DF_ACT_CTX_RSTD, /* f32 [Sc] */
  DF_ACT_CTX,      /* bf16 [Sc, H] */
  DF_ACT_H_OUT,    /* bf16 [T, H] */
  DF_ACT_RSTD_F,   /* f32 [T] */
  DF_ACT_HF,       /* bf16 [T, H] */
  DF_ACT_DH,       /* bf16 [T, H] */
  DF_ACT_DX,       /* f32 [T, H] */
  DF_ACT_DQ,       /* bf16 [T, qd] */
  DF_ACT_DKB,      /* bf16 [T, kd] */
  DF_ACT_DVB,      /* bf16 [T, kd] */
  DF_ACT_DATT,     /* bf16 [T, qd] */
  DF_ACT_DG,       /* bf16 [T, I] */
  DF_ACT_DU,       /* bf16 [T, I] */
  DF_ACT_DM,       /* bf16 [T, I] */
  DF_ACT_DTMP,     /* bf16 [T, max(qd, kd)] */
  DF_ACT_D,        /* f32 [T, nh] attention row term */
  DF_ACT_DKC,      /* bf16 [Sc, kd] */
  DF_ACT_DVC,      /* bf16 [Sc, kd] */
  DF_ACT_DCTX,     /* f32 [Sc, H] */
  DF_ACT_DCTX_TMP, /* bf16 [Sc, max(kd, H)] */
  DF_ACT_ROWS_X,   /* bf16 [R, H] */
  DF_ACT_ROWS_DX,  /* bf16 [R, H] */
  DF_ACT_CE_ACC,   /* f32 [R, H] */
  DF_ACT_LOGITS,   /* f32 [R, chunk] */
  DF_ACT_PROBS,    /* bf16 [R, chunk] */
  DF_ACT_ROW_F32,  /* f32 [5, R]: max, sum, target logit, coef, loss */
  DF_ACT_ROW_I32,  /* i32 [2, R]: row -> block row, target id */
  DF_ACT_TOK,      /* i32 [2, T]: block tokens, block positions */
  DF_ACT_ANCHORS,  /* i32 [A] */
  DF_ACT_COUNT
};

/* Tensors kept per layer for the backward pass. */
enum df_lact_id {
  DF_LACT_H_IN,
  DF_LACT_RSTD1,
  DF_LACT_XN1, /* bf16 [T,H], f32 [T], bf16 [T,H] */
  DF_LACT_Q_PRE,
  DF_LACT_Q_RSTD,
  DF_LACT_Q, /* bf16 [T,qd], f32 [T,nh], bf16 */
  DF_LACT_KB_PRE,
  DF_LACT_KB_RSTD,
  DF_LACT_KB,
  DF_LACT_VB, /* [T,kd], f32 [T,nkv] */
  DF_LACT_KC_PRE,
  DF_LACT_KC_RSTD,
  DF_LACT_KC,
  DF_LACT_VC, /* [Sc,kd], f32 [Sc,nkv] */
  DF_LACT_ATT,
  DF_LACT_LSE, /* bf16 [T,qd], f32 [T,nh] */
  DF_LACT_H_MID,
  DF_LACT_RSTD2,
  DF_LACT_XN2, /* bf16 [T,H], f32 [T], bf16 [T,H] */
  DF_LACT_G,
  DF_LACT_U,
  DF_LACT_M, /* bf16 [T,I] */
  DF_LACT_COUNT
};

typedef struct df_act_dims {
  int64_t H, KH, nh, nkv, d, I, L;
  int64_t T, Sc, R, A, chunk;
} df_act_dims;

typedef struct df_act_layout {
  size_t off[DF_ACT_COUNT], bytes[DF_ACT_COUNT];
  size_t loff[DF_ACT_MAX_LAYERS][DF_LACT_COUNT], lbytes[DF_LACT_COUNT];
  size_t total;
} df_act_layout;

/* Offsets (from an aligned base) and sizes of every tensor, and the total. */
void df_act_layout_compute(const df_act_dims *d, df_act_layout *out);

#ifdef __cplusplus
}
#endif

#endif
