/*
 * The drafter's trainable tensors, declared once. model.c builds the
 * parameter buffer and its checkpoint names from these lists and binds its weight views with
 * them, plan.c counts the parameters with them, and the CUDA backend (cuda/model.cu) finds a
 * tensor by the indices below: the buffer holds, in this order,
 *
 *   DF_TENSORS_HEAD                  fc, hidden_norm
 *   L x DF_TENSORS_LAYER             "layers.N." + suffix
 *   DF_TENSORS_TAIL                  norm                      (DFlash 1 ends here)
 *   L x DF_CONVS x DF_TENSORS_CONV   "layers.N.<conv>." + suffix  (DFlash 2 only)
 *   DF_TENSORS_SELECTOR              candidate_selector.*      (DFlash 2 only)
 *   DF_TENSORS_MARKOV                markov_head.*             (DSpark only)
 *   DF_TENSORS_CONF                  confidence_head.proj.*    (DSpark with its confidence head)
 *
 * so DFlash 1's offsets depend on neither (DFlash 2 and DSpark never come together). A row is
 * X(id, field, name, d0, d1, d2, init): the enum suffix, the float* field of df_weights /
 * df_layer_w / df_conv_w (model.h) that views it, the checkpoint name (or its suffix), its
 * shape (d1 0: a vector [d0]; d2 0: a matrix [d0, d1]; else [d0, d1, d2], stored as
 * [d0, d1 * d2]) as expressions over `z`, a df_tensor_dims in the expanding scope, and how a
 * fresh trainer fills it (df_init_kind of model.h, as a suffix). Adding a tensor: a row
 * here (and its use in both backends, HACKING.md "What a trainer op touches"); appending to
 * DF_TENSORS_LAYER moves every later tensor, which is fine (offsets are computed), but
 * changes the checkpoint's tensor order, never its names.
 *
 * C and C++ (the CUDA sources include it).
 */
#ifndef DFLASH_TRAIN_TENSORS_H
#define DFLASH_TRAIN_TENSORS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The sizes a shape is made of. */
typedef struct df_tensor_dims {
  int64_t H;  /* hidden_size */
  int64_t KH; /* n_target_layer_ids * hidden_size: the fc input */
  int64_t QD; /* num_attention_heads * head_dim */
  int64_t KD; /* num_key_value_heads * head_dim */
  int64_t HD; /* head_dim */
  int64_t I;  /* intermediate_size */
  int64_t V;  /* vocab_size */
  int64_t L;  /* num_hidden_layers */
  /* DFlash 2 (0 for DFlash 1) */
  int64_t CK;  /* conv_kernel_size */
  int64_t CP;  /* rows of a kernel projection: 2 * CK * (H / conv_group_size) */
  int64_t SR;  /* selector_rank */
  int dflash2; /* the DFlash 2 tensors exist */
  /* DSpark (0 for DFlash) */
  int64_t MR; /* markov_rank */
  int64_t VD; /* draft_vocab_size (V when not pruned) */
  int dspark; /* the Markov head exists */
  int conf;   /* and the confidence head */
} df_tensor_dims;

#define DF_TENSORS_HEAD(X)                     \
  X(FC, fc, "fc.weight", z.H, z.KH, 0, NORMAL) \
  X(HIDDEN_NORM, hidden_norm, "hidden_norm.weight", z.H, 0, 0, ONES)

#define DF_TENSORS_LAYER(X)                                               \
  X(IN_LN, in_ln, "input_layernorm.weight", z.H, 0, 0, ONES)              \
  X(Q, wq, "self_attn.q_proj.weight", z.QD, z.H, 0, NORMAL)               \
  X(K, wk, "self_attn.k_proj.weight", z.KD, z.H, 0, NORMAL)               \
  X(V, wv, "self_attn.v_proj.weight", z.KD, z.H, 0, NORMAL)               \
  X(O, wo, "self_attn.o_proj.weight", z.H, z.QD, 0, NORMAL)               \
  X(QN, q_norm, "self_attn.q_norm.weight", z.HD, 0, 0, ONES)              \
  X(KN, k_norm, "self_attn.k_norm.weight", z.HD, 0, 0, ONES)              \
  X(POST_LN, post_ln, "post_attention_layernorm.weight", z.H, 0, 0, ONES) \
  X(G, wg, "mlp.gate_proj.weight", z.I, z.H, 0, NORMAL)                   \
  X(U, wu, "mlp.up_proj.weight", z.I, z.H, 0, NORMAL)                     \
  X(D, wd, "mlp.down_proj.weight", z.H, z.I, 0, NORMAL)

#define DF_TENSORS_TAIL(X) X(NORM, norm, "norm.weight", z.H, 0, 0, ONES)

/* DFlash 2's two convolutions per layer (X(id, field, name)), each with these tensors. A
 * fresh drafter computes exactly DFlash 1: tap 0 of the base kernel 1, dynamic kernels 0. */
#define DF_CONVS(X)                  \
  X(ATT, att_conv, "attention_conv") \
  X(MLP, mlp_conv, "mlp_conv")

#define DF_TENSORS_CONV(X)                                  \
  X(BASE, base, "base_kernel", 2, z.CK, z.H, CONV_IDENTITY) \
  X(PROJ, proj, "kernel_projection.weight", z.CP, z.H, 0, ZERO)

/* The selector adds nothing to a fresh drafter's logits (hidden projection 0; the codebooks
 * random, so the projection's gradient is not zero). z-lab stores the codebooks without
 * ".weight" (its from_pretrained maps them). */
#define DF_TENSORS_SELECTOR(X)                                                       \
  X(PRED, sel_pred, "candidate_selector.predecessor_codebook", z.V, z.SR, 0, NORMAL) \
  X(SUCC, sel_succ, "candidate_selector.successor_codebook", z.V, z.SR, 0, NORMAL)   \
  X(HPROJ, sel_hproj, "candidate_selector.hidden_projection.weight", z.SR, z.H, 0, ZERO)

/* DSpark (spec/dspark.md section 5): the vanilla Markov head, W1 [V, r] indexed by the
 * previous token's target id and W2 [V_d, r] (V_d: the draft vocabulary, V unless pruned), and the
 * confidence head on [norm(h); W1[prev]] (a bias: vLLM builds the projection with one).
 * Normal init, as DeepSpec's Hugging Face post_init (the spec's assumption); the bias 0. */
#define DF_TENSORS_MARKOV(X)                                             \
  X(W1, markov_w1, "markov_head.markov_w1.weight", z.V, z.MR, 0, NORMAL) \
  X(W2, markov_w2, "markov_head.markov_w2.weight", z.VD, z.MR, 0, NORMAL)

#define DF_TENSORS_CONF(X)                                               \
  X(CW, conf_w, "confidence_head.proj.weight", 1, z.H + z.MR, 0, NORMAL) \
  X(CB, conf_b, "confidence_head.proj.bias", 1, 0, 0, ZERO)

#define DF_TENSOR_ENUM_(prefix, id) prefix##id,
#define DF_TENSOR_HEAD_ENUM_(id, ...) DF_TENSOR_ENUM_(DF_TH_, id)
#define DF_TENSOR_LAYER_ENUM_(id, ...) DF_TENSOR_ENUM_(DF_TL_, id)
#define DF_TENSOR_TAIL_ENUM_(id, ...) DF_TENSOR_ENUM_(DF_TT_, id)
#define DF_TENSOR_CONV_ENUM_(id, ...) DF_TENSOR_ENUM_(DF_TC_, id)
#define DF_CONV_ENUM_(id, ...) DF_TENSOR_ENUM_(DF_CONV_, id)
#define DF_TENSOR_SEL_ENUM_(id, ...) DF_TENSOR_ENUM_(DF_TS_, id)
#define DF_TENSOR_MARKOV_ENUM_(id, ...) DF_TENSOR_ENUM_(DF_TM_, id)
#define DF_TENSOR_CONF_ENUM_(id, ...) DF_TENSOR_ENUM_(DF_TQ_, id)
enum df_tensor_head { DF_TENSORS_HEAD(DF_TENSOR_HEAD_ENUM_) DF_TH_COUNT };
enum df_tensor_layer { DF_TENSORS_LAYER(DF_TENSOR_LAYER_ENUM_) DF_TL_COUNT };
enum df_tensor_tail { DF_TENSORS_TAIL(DF_TENSOR_TAIL_ENUM_) DF_TT_COUNT };
enum df_conv { DF_CONVS(DF_CONV_ENUM_) DF_CONV_COUNT };
enum df_tensor_conv { DF_TENSORS_CONV(DF_TENSOR_CONV_ENUM_) DF_TC_COUNT };
enum df_tensor_sel { DF_TENSORS_SELECTOR(DF_TENSOR_SEL_ENUM_) DF_TS_COUNT };
enum df_tensor_markov { DF_TENSORS_MARKOV(DF_TENSOR_MARKOV_ENUM_) DF_TM_COUNT };
enum df_tensor_conf { DF_TENSORS_CONF(DF_TENSOR_CONF_ENUM_) DF_TQ_COUNT };

/* Index in the tensor table of each kind of tensor (L: num_hidden_layers). */
static inline size_t df_tensor_layer(int l, int k) {
  return DF_TH_COUNT + (size_t)l * DF_TL_COUNT + (size_t)k;
}
static inline size_t df_tensor_tail(int L, int k) { return df_tensor_layer(L, 0) + (size_t)k; }
static inline size_t df_tensor_conv(int L, int l, int conv, int k) {
  return df_tensor_tail(L, DF_TT_COUNT) + ((size_t)l * DF_CONV_COUNT + (size_t)conv) * DF_TC_COUNT +
         (size_t)k;
}
static inline size_t df_tensor_sel(int L, int k) { return df_tensor_conv(L, L, 0, k); }
/* DSpark's, right after DFlash 1's (a DSpark drafter has no DFlash 2 tensors). */
static inline size_t df_tensor_markov(int L, int k) {
  return df_tensor_tail(L, DF_TT_COUNT) + (size_t)k;
}
static inline size_t df_tensor_conf(int L, int k) {
  return df_tensor_markov(L, DF_TM_COUNT) + (size_t)k;
}
/* How many tensors a DFlash 1 or 2 drafter has (DSpark's end at df_tensor_conf). */
static inline size_t df_tensor_count(int L, int dflash2) {
  return dflash2 ? df_tensor_sel(L, DF_TS_COUNT) : df_tensor_tail(L, DF_TT_COUNT);
}

/* Elements of a row's tensor. */
#define DF_TENSOR_NUMEL(d0, d1, d2) \
  ((uint64_t)(d0) * (uint64_t)((d1) > 0 ? (d1) : 1) * (uint64_t)((d2) > 0 ? (d2) : 1))

/* Every trainable parameter of a drafter of these dims (what `dflash train --plan` counts). */
static inline uint64_t df_tensor_params(df_tensor_dims z) {
#define DF_TENSOR_SUM_(id, field, name, d0, d1, d2, init) +DF_TENSOR_NUMEL(d0, d1, d2)
  uint64_t head = 0 DF_TENSORS_HEAD(DF_TENSOR_SUM_) DF_TENSORS_TAIL(DF_TENSOR_SUM_);
  uint64_t layer = 0 DF_TENSORS_LAYER(DF_TENSOR_SUM_);
  uint64_t conv = 0 DF_TENSORS_CONV(DF_TENSOR_SUM_);
  uint64_t sel = 0 DF_TENSORS_SELECTOR(DF_TENSOR_SUM_);
  uint64_t markov = 0 DF_TENSORS_MARKOV(DF_TENSOR_SUM_);
  uint64_t conf = 0 DF_TENSORS_CONF(DF_TENSOR_SUM_);
#undef DF_TENSOR_SUM_
  uint64_t n = head + (uint64_t)z.L * layer;
  if (z.dflash2) n += (uint64_t)z.L * DF_CONV_COUNT * conv + sel;
  if (z.dspark) n += markov + (z.conf ? conf : 0);
  return n;
}

#ifdef __cplusplus
}
#endif

#endif
