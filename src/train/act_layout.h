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

/*
 * Each activation once: X(id, bytes), the bytes an expression over T (block rows), Sc
 * (context rows), R (supervised rows), A (anchors), H, KH, QD, KD, NH, NKV, I and CHUNK
 * (df_act_layout_compute defines them from df_act_dims). The enums below and the sizes in
 * plan.c come from these lists, so the arena the GPU carves and `dflash train --plan` agree.
 */
/* Tensors used once per call. */
#define DF_ACTS(X)                                                                          \
  X(HIDDEN, 2 * Sc * KH)               /* bf16 [Sc, KH] target features */                  \
  X(CTX_PRE, 2 * Sc * H)               /* bf16 [Sc, H] */                                   \
  X(CTX_RSTD, 4 * Sc)                  /* f32 [Sc] */                                       \
  X(CTX, 2 * Sc * H)                   /* bf16 [Sc, H] */                                   \
  X(H_OUT, 2 * T * H)                  /* bf16 [T, H] */                                    \
  X(RSTD_F, 4 * T)                     /* f32 [T] */                                        \
  X(HF, 2 * T * H)                     /* bf16 [T, H] */                                    \
  X(DH, 2 * T * H)                     /* bf16 [T, H] */                                    \
  X(DX, 4 * T * H)                     /* f32 [T, H] */                                     \
  X(DQ, 2 * T * QD)                    /* bf16 [T, qd] */                                   \
  X(DKB, 2 * T * KD)                   /* bf16 [T, kd] */                                   \
  X(DVB, 2 * T * KD)                   /* bf16 [T, kd] */                                   \
  X(DATT, 2 * T * QD)                  /* bf16 [T, qd] */                                   \
  X(DG, 2 * T * I)                     /* bf16 [T, I] */                                    \
  X(DU, 2 * T * I)                     /* bf16 [T, I] */                                    \
  X(DM, 2 * T * I)                     /* bf16 [T, I] */                                    \
  X(DTMP, 2 * T * DF_MAX_(QD, KD))     /* bf16 [T, max(qd, kd)] */                          \
  X(D, 4 * T * NH)                     /* f32 [T, nh] attention row term */                 \
  X(DKC, 2 * Sc * KD)                  /* bf16 [Sc, kd] */                                  \
  X(DVC, 2 * Sc * KD)                  /* bf16 [Sc, kd] */                                  \
  X(DCTX, 4 * Sc * H)                  /* f32 [Sc, H] */                                    \
  X(DCTX_TMP, 2 * Sc * DF_MAX_(KD, H)) /* bf16 [Sc, max(kd, H)] */                          \
  X(ROWS_X, 2 * R * H)                 /* bf16 [R, H] */                                    \
  X(ROWS_DX, 2 * R * H)                /* bf16 [R, H] */                                    \
  X(CE_ACC, 4 * R * H)                 /* f32 [R, H] */                                     \
  X(LOGITS, 4 * R * CHUNK)             /* f32 [R, chunk] */                                 \
  X(PROBS, 2 * R * CHUNK)              /* bf16 [R, chunk] */                                \
  X(ROW_F32, 4 * 5 * R)                /* f32 [5, R]: max, sum, target logit, coef, loss */ \
  X(ROW_I32, 4 * 2 * R)                /* i32 [2, R]: row -> block row, target id */        \
  X(TOK, 4 * 2 * T)                    /* i32 [2, T]: block tokens, block positions */      \
  X(ANCHORS, 4 * A)                    /* i32 [A] */

/* Tensors kept per layer for the backward pass. */
#define DF_LACTS(X)                            \
  X(H_IN, 2 * T * H)       /* bf16 [T, H] */   \
  X(RSTD1, 4 * T)          /* f32 [T] */       \
  X(XN1, 2 * T * H)        /* bf16 [T, H] */   \
  X(Q_PRE, 2 * T * QD)     /* bf16 [T, qd] */  \
  X(Q_RSTD, 4 * T * NH)    /* f32 [T, nh] */   \
  X(Q, 2 * T * QD)         /* bf16 [T, qd] */  \
  X(KB_PRE, 2 * T * KD)    /* bf16 [T, kd] */  \
  X(KB_RSTD, 4 * T * NKV)  /* f32 [T, nkv] */  \
  X(KB, 2 * T * KD)        /* bf16 [T, kd] */  \
  X(VB, 2 * T * KD)        /* bf16 [T, kd] */  \
  X(KC_PRE, 2 * Sc * KD)   /* bf16 [Sc, kd] */ \
  X(KC_RSTD, 4 * Sc * NKV) /* f32 [Sc, nkv] */ \
  X(KC, 2 * Sc * KD)       /* bf16 [Sc, kd] */ \
  X(VC, 2 * Sc * KD)       /* bf16 [Sc, kd] */ \
  X(ATT, 2 * T * QD)       /* bf16 [T, qd] */  \
  X(LSE, 4 * T * NH)       /* f32 [T, nh] */   \
  X(H_MID, 2 * T * H)      /* bf16 [T, H] */   \
  X(RSTD2, 4 * T)          /* f32 [T] */       \
  X(XN2, 2 * T * H)        /* bf16 [T, H] */   \
  X(G, 2 * T * I)          /* bf16 [T, I] */   \
  X(U, 2 * T * I)          /* bf16 [T, I] */   \
  X(M, 2 * T * I)          /* bf16 [T, I] */

#define DF_MAX_(a, b) ((a) > (b) ? (a) : (b))
#define DF_ACT_ENUM_(id, bytes) DF_ACT_##id,
#define DF_LACT_ENUM_(id, bytes) DF_LACT_##id,
enum df_act_id { DF_ACTS(DF_ACT_ENUM_) DF_ACT_COUNT };
enum df_lact_id { DF_LACTS(DF_LACT_ENUM_) DF_LACT_COUNT };
#undef DF_ACT_ENUM_
#undef DF_LACT_ENUM_

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
