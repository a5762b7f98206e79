/* DFlash 2 drafters on the CPU: the tensor table with z-lab's names and
 * shapes, the identity initialisation, the checkpoint, the convolution
 * against a direct evaluation, and the refusals. The forward against z-lab's DFlash2DraftModel is
 * oracle_dflash2.py. */
#include <dflash/safetensors.h>
#include <dflash/experimental.h>
#include <dflash/train.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "seq.h"
#include "core/internal.h"
#include "testutil.h"
#include "train/dflash2.h"
#include "train/ops.h"
#include "train/trainer.h"

enum { H = 32, V = 40, L = 2, K = 3, G = 8, R = 6, B = 4 };

static void config(dflash_drafter_config *c) {
  dflash_drafter_config_default(c);
  c->hidden_size = H, c->intermediate_size = 48, c->num_hidden_layers = L;
  c->num_attention_heads = 4, c->num_key_value_heads = 2, c->head_dim = 8, c->vocab_size = V;
  c->num_target_layers = 8, c->block_size = B, c->mask_token_id = V - 1;
  c->n_target_layer_ids = 1, c->target_layer_ids[0] = 3;
  c->dflash2 = 1, c->conv_kernel_size = K, c->conv_group_size = G;
  c->selector_top_k = 5, c->selector_rank = R;
}

static float *zeros(size_t n) { return calloc(n, sizeof(float)); }

/* lr != 0: constant learning rate |lr| (no warm-up), LM-head chunks of 16;
 * lr < 0 also the selector loss's inject mode. */
static dflash_status make_lr(int backend, double lr, dflash_trainer **t) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  config(&c);
  float *E = zeros((size_t)V * H), *Hd = zeros((size_t)V * H);
  for (size_t i = 0; i < (size_t)V * H; i++) {
    E[i] = (float)((i * 7) % 13) / 13.0f - 0.5f;
    Hd[i] = (float)((i * 5) % 11) / 11.0f - 0.5f;
  }
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.backend = backend;
  o.seed = 5;
  if (lr != 0) o.lr = fabs(lr), o.warmup_ratio = 0, o.vocab_chunk = 16;
  if (lr < 0) o.selector_loss_mode = DFLASH_SELECTOR_LOSS_INJECT;
  dflash_status st = dflash_trainer_create(&c, E, Hd, &o, t);
  free(E), free(Hd);
  return st;
}

static dflash_status make(int backend, dflash_trainer **t) { return make_lr(backend, 0, t); }

static float *get(dflash_trainer *t, const char *name, size_t n) {
  float *p = zeros(n);
  ck_assert_ok(dflash_trainer_get_param(t, name, p, n));
  return p;
}

/* z-lab's names and shapes, after DFlash 1's tensors; identity init. */
START_TEST(tensors_named_and_initialised_as_identity) {
  dflash_trainer *t;
  ck_assert_ok(make(DFLASH_BACKEND_CPU, &t));
  size_t n1 = 3 + 11 * L; /* DFlash 1: fc, hidden_norm, norm + 11 per layer */
  ck_assert_uint_eq(dflash_trainer_param_count(t), n1 + 4 * L + 3);
  const char *name;
  int32_t nd;
  int64_t shape[2];
  size_t numel;
  ck_assert_ok(dflash_trainer_param_info(t, n1, &name, &nd, shape, &numel));
  ck_assert_str_eq(name, "layers.0.attention_conv.base_kernel");
  ck_assert_int_eq(nd, 2); /* [2, k, H] reported as [2, k * H] */
  ck_assert_int_eq(shape[0], 2);
  ck_assert_int_eq(shape[1], K * H);
  ck_assert_ok(dflash_trainer_param_info(t, n1 + 1, &name, &nd, shape, &numel));
  ck_assert_str_eq(name, "layers.0.attention_conv.kernel_projection.weight");
  ck_assert_int_eq(shape[0], 2 * K * H / G);
  ck_assert_int_eq(shape[1], H);
  ck_assert_ok(dflash_trainer_param_info(t, n1 + 2, &name, NULL, NULL, NULL));
  ck_assert_str_eq(name, "layers.0.mlp_conv.base_kernel");
  ck_assert_ok(dflash_trainer_param_info(t, n1 + 4 * L, &name, NULL, shape, NULL));
  ck_assert_str_eq(name, "candidate_selector.predecessor_codebook");
  ck_assert_int_eq(shape[0], V);
  ck_assert_int_eq(shape[1], R);
  ck_assert_ok(dflash_trainer_param_info(t, n1 + 4 * L + 2, &name, NULL, shape, NULL));
  ck_assert_str_eq(name, "candidate_selector.hidden_projection.weight");
  ck_assert_int_eq(shape[0], R);
  ck_assert_int_eq(shape[1], H);

  float *bk = get(t, "layers.1.mlp_conv.base_kernel", 2 * K * H);
  for (int s = 0; s < 2; s++)
    for (int o = 0; o < K; o++)
      for (int c = 0; c < H; c++) ck_assert_float_eq(bk[(s * K + o) * H + c], o == 0 ? 1.0f : 0.0f);
  free(bk);
  float *kp = get(t, "layers.1.attention_conv.kernel_projection.weight", 2 * K * H / G * H);
  for (int i = 0; i < 2 * K * H / G * H; i++) ck_assert_float_eq(kp[i], 0.0f);
  free(kp);
  float *hp = get(t, "candidate_selector.hidden_projection.weight", R * H);
  for (int i = 0; i < R * H; i++) ck_assert_float_eq(hp[i], 0.0f);
  free(hp);
  float *cb = get(t, "candidate_selector.successor_codebook", V * R);
  double ss = 0;
  for (int i = 0; i < V * R; i++) ss += (double)cb[i] * cb[i];
  ck_assert(ss > 0); /* random: the projection's gradient must not vanish */
  free(cb);
  dflash_trainer_free(t);
}
END_TEST

/* The CUDA backend takes DFlash 2 (cuda/dflash2.cu, against this backend on the emulated
 * device in gpu_parity_emu): a library without CUDA or a device refuses it for that reason
 * alone. The CPU backend trains it (the selector loss exists), the forward as before. */
START_TEST(cuda_not_refused_cpu_trains) {
  dflash_trainer *t = NULL;
  if (make(DFLASH_BACKEND_CUDA, &t) == DFLASH_OK) dflash_trainer_free(t);
  else ck_assert_msg(!strstr(dflash_last_error(), "DFlash 2"), "%s", dflash_last_error());
  t = NULL;
  ck_assert_ok(make(DFLASH_BACKEND_CPU, &t));
  int32_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8}, anchors[2] = {0, 3};
  uint8_t mask[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  float hidden[8 * H] = {0};
  double loss = -1;
  ck_assert_ok(dflash_trainer_forward_backward(t, SEQ(ids, mask, 8, hidden, anchors, 2), &loss));
  ck_assert(isfinite(loss) && loss > 0);
  ck_assert_double_eq(t->m.sel_rows, 6);
  float *logits = zeros(2 * B * V);
  ck_assert_ok(dflash_trainer_logits(t, SEQ(ids, NULL, 8, hidden, anchors, 2), logits));
  free(logits);
  dflash_trainer_free(t);
}
END_TEST

/* The selector loss's options: defaults, checked, and absent from an older struct. */
START_TEST(selector_loss_options) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  config(&c);
  float *E = zeros((size_t)V * H);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  ck_assert_double_eq(o.selector_loss_weight, 1.0);
  ck_assert_int_eq(o.selector_loss_mode, DFLASH_SELECTOR_LOSS_DROP);
  dflash_trainer *t = NULL;
  o.selector_loss_mode = 2;
  ck_assert_status(dflash_trainer_create(&c, E, E, &o, &t), DFLASH_E_INVALID_ARG,
                   "selector_loss_mode");
  o.selector_loss_mode = DFLASH_SELECTOR_LOSS_DROP, o.selector_loss_weight = -1;
  ck_assert_status(dflash_trainer_create(&c, E, E, &o, &t), DFLASH_E_INVALID_ARG,
                   "selector_loss_weight");
  /* An older caller's struct (up to init_std) gets the defaults. */
  o.selector_loss_weight = 0;
  o.struct_size = offsetof(dflash_trainer_options, selector_loss_weight);
  ck_assert_ok(dflash_trainer_create(&c, E, E, &o, &t));
  ck_assert_double_eq(t->m.sel_weight, 1.0);
  dflash_trainer_free(t);
  free(E);
}
END_TEST

/* Selector CE per scored row (drop: rows with the true token a candidate). */
static double selector_ce(const df_model *m, bool inject) {
  double rows = inject ? m->sel_rows : m->sel_hits;
  ck_assert(rows > 0);
  return m->sel_loss_sum / rows;
}

/* A few AdamW steps of a tiny DFlash 2 drafter on one sequence lower the
 * selector's loss, in both modes. */
static void train_lowers_selector_loss(bool inject) {
  dflash_trainer *t;
  ck_assert_ok(make_lr(DFLASH_BACKEND_CPU, inject ? -1e-2 : 1e-2, &t));
  ck_assert(t->m.sel_inject == inject);
  enum { LEN = 24 };
  int32_t ids[LEN], anchors[5] = {0, 4, 9, 14, 19};
  uint8_t mask[LEN];
  float hidden[LEN * H];
  for (int i = 0; i < LEN; i++) ids[i] = (i * 7 + 2) % (V - 1), mask[i] = 1;
  for (int i = 0; i < LEN * H; i++) hidden[i] = sinf(0.21f * (float)i);
  double loss, first = 0, last = 0;
  for (int step = 0; step < 30; step++) {
    ck_assert_ok(
        dflash_trainer_forward_backward(t, SEQ(ids, mask, LEN, hidden, anchors, 5), &loss));
    if (step == 0) first = selector_ce(&t->m, inject);
    last = selector_ce(&t->m, inject);
    ck_assert_ok(dflash_trainer_step(t, NULL, NULL));
  }
  ck_assert_msg(last < 0.7 * first, "%s: selector CE %g after 30 steps, %g before",
                inject ? "inject" : "drop", last, first);
  dflash_trainer_free(t);
}

START_TEST(training_lowers_selector_loss) {
  train_lowers_selector_loss(false);
  train_lowers_selector_loss(true);
}
END_TEST

/* One Muon step (no warm-up, no decay) splits the tensors as speculators does: AdamW's first
 * step moves every element with a gradient (>> adam_eps) by lr (m / sqrt(v) = g / |g|) on the
 * rank-3 base kernel and the [V, r] codebook; Muon moves the kernel projection by lr x 0.2
 * sqrt(max side) x an orthogonalised matrix, not element by element: Newton-Schulz takes each
 * of the gradient's significant singular values to ~0.7-1.2 (the small ones stay small), so
 * the squared norm lies between ~0.5 (one direction) and the small side. The values are
 * oracle_optim.py's. */
static double moved(dflash_trainer *t, const char *name, const float *before, double lr,
                    size_t *not_lr) {
  const df_tensor_info *ti = df_model_find(&t->m, name);
  ck_assert_ptr_nonnull(ti);
  double ss = 0;
  *not_lr = 0;
  for (size_t i = 0; i < ti->numel; i++) {
    double d = (double)t->m.params[ti->offset + i] - before[i];
    float g = t->m.grads[ti->offset + i];
    ss += d * d;
    if (fabsf(g) > 1e-5f && fabs(fabs(d) - lr) > 1e-3 * lr) (*not_lr)++; /* g >> adam_eps */
  }
  return ss;
}

START_TEST(muon_splits_the_tensors_like_speculators) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  config(&c);
  float *E = zeros((size_t)V * H);
  for (size_t i = 0; i < (size_t)V * H; i++) E[i] = (float)((i * 7) % 13) / 13.0f - 0.5f;
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.lr = 1e-3, o.warmup_ratio = 0, o.grad_clip = 0, o.muon_weight_decay = 0, o.seed = 5;
  o.optimizer = DFLASH_OPTIMIZER_MUON;
  dflash_trainer *t;
  ck_assert_ok(dflash_trainer_create(&c, E, E, &o, &t));
  const char *names[] = {"layers.0.attention_conv.base_kernel",
                         "candidate_selector.predecessor_codebook",
                         "layers.0.attention_conv.kernel_projection.weight"};
  float *before[3];
  int32_t ids[24], anchors[4] = {0, 5, 11, 17};
  uint8_t mask[24];
  float hidden[24 * H];
  for (int i = 0; i < 24; i++) ids[i] = (i * 7 + 2) % (V - 1), mask[i] = 1;
  for (int i = 0; i < 24 * H; i++) hidden[i] = sinf(0.21f * (float)i);
  double loss;
  /* A first step, so that the kernel projection (zero at init) has a gradient. */
  ck_assert_ok(dflash_trainer_forward_backward(t, SEQ(ids, mask, 24, hidden, anchors, 4), &loss));
  ck_assert_ok(dflash_trainer_step(t, NULL, NULL));
  for (int k = 0; k < 3; k++) {
    const df_tensor_info *ti = df_model_find(&t->m, names[k]);
    ck_assert_ptr_nonnull(ti);
    before[k] = get(t, names[k], ti->numel);
  }
  ck_assert_ok(dflash_trainer_forward_backward(t, SEQ(ids, mask, 24, hidden, anchors, 4), &loss));
  /* Step 2 of AdamW is not lr per element; compare with a fresh AdamW-only first step
   * instead: reset the moments of the AdamW tensors (t->m2 is 0 on Muon's). */
  for (int k = 0; k < 2; k++) {
    const df_tensor_info *ti = df_model_find(&t->m, names[k]);
    memset(t->m1 + ti->offset, 0, ti->numel * sizeof(float));
    memset(t->m2 + ti->offset, 0, ti->numel * sizeof(float));
  }
  t->step = 0;
  ck_assert_ok(dflash_trainer_step(t, NULL, NULL));
  size_t off_lr;
  for (int k = 0; k < 2; k++) {
    moved(t, names[k], before[k], o.lr, &off_lr);
    ck_assert_msg(off_lr == 0, "%s: %zu elements not moved by lr (AdamW's first step)", names[k],
                  off_lr);
  }
  const df_tensor_info *pj = df_model_find(&t->m, names[2]);
  double scale = o.lr * 0.2 *
                 sqrt((double)(pj->shape[0] > pj->shape[1] ? pj->shape[0] : pj->shape[1]));
  double small = (double)(pj->shape[0] < pj->shape[1] ? pj->shape[0] : pj->shape[1]);
  double ss = moved(t, names[2], before[2], o.lr, &off_lr) / (scale * scale);
  ck_assert_msg(ss > 0.5 && ss < 1.5 * small, "projection moved %g x small side", ss / small);
  ck_assert_uint_gt(off_lr, pj->numel / 2);
  for (int k = 0; k < 3; k++) free(before[k]);
  free(E);
  dflash_trainer_free(t);
}
END_TEST

/* The checkpoint keeps z-lab's rank-3 base kernels and loads back. */
START_TEST(checkpoint_round_trip) {
  char *dir = df_test_tmpdir();
  char *ckpt = df_path_join(dir, "d2");
  dflash_trainer *a, *b;
  ck_assert_ok(make(DFLASH_BACKEND_CPU, &a));
  ck_assert_ok(make(DFLASH_BACKEND_CPU, &b));
  float bk[2 * K * H];
  for (int i = 0; i < 2 * K * H; i++) bk[i] = (float)i / 7.0f;
  ck_assert_ok(dflash_trainer_set_param(a, "layers.1.attention_conv.base_kernel", bk, 2 * K * H));
  ck_assert_ok(dflash_trainer_save(a, ckpt, 0));
  dflash_safetensors *st;
  ck_assert_ok(dflash_safetensors_open(ckpt, &st));
  dflash_tensor ten = {.struct_size = sizeof ten};
  ck_assert_ok(dflash_safetensors_find(st, "layers.1.attention_conv.base_kernel", &ten));
  ck_assert_uint_eq(ten.ndim, 3);
  ck_assert_int_eq(ten.shape[0], 2);
  ck_assert_int_eq(ten.shape[1], K);
  ck_assert_int_eq(ten.shape[2], H);
  ck_assert_ok(dflash_safetensors_find(st, "candidate_selector.predecessor_codebook", &ten));
  ck_assert_status(dflash_safetensors_find(st, "candidate_selector.predecessor_codebook.weight",
                                           &ten),
                   DFLASH_E_NOT_FOUND, "");
  dflash_safetensors_free(st);
  ck_assert_ok(dflash_trainer_load(b, ckpt));
  float *back = get(b, "layers.1.attention_conv.base_kernel", 2 * K * H);
  ck_assert_mem_eq(back, bk, sizeof bk);
  free(back);
  char *cfg = df_path_join(ckpt, "config.json");
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(dflash_drafter_config_load(cfg, &c));
  ck_assert_int_eq(c.dflash2, 1);
  ck_assert_int_eq(c.conv_kernel_size, K);
  ck_assert_int_eq(c.conv_group_size, G);
  free(cfg);
  dflash_trainer_free(a);
  dflash_trainer_free(b);
  free(ckpt);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* df2_conv_apply against the formula, taps cut at block starts. */
START_TEST(conv_matches_direct_evaluation) {
  enum { T = 2 * B, HH = 16, GG = 4, KK = 3, NG = HH / GG, STRIDE = 2 * KK * NG };
  float x[T * HH], dyn[T * STRIDE], base[KK * HH], res[T * HH], out[T * HH];
  for (int i = 0; i < T * HH; i++) x[i] = sinf(0.7f * (float)i), res[i] = cosf((float)i);
  for (int i = 0; i < T * STRIDE; i++) dyn[i] = 0.1f * (float)((i * 5) % 11) - 0.5f;
  for (int i = 0; i < KK * HH; i++) base[i] = 0.05f * (float)((i * 3) % 17) - 0.3f;
  df_pool *pool;
  ck_assert_ok(df_pool_create(2, &pool));
  df2_conv_apply(pool, out, x, dyn + KK * NG, STRIDE, base, res, T, B, HH, KK, GG);
  for (int t = 0; t < T; t++)
    for (int c = 0; c < HH; c++) {
      double want = res[t * HH + c];
      for (int o = 0; o < KK && o <= t % B; o++)
        want += ((double)base[o * HH + c] + dyn[t * STRIDE + KK * NG + o * NG + c / GG]) *
                x[(t - o) * HH + c];
      ck_assert_msg(fabs(out[t * HH + c] - want) < 1e-5, "t %d c %d: %g vs %g", t, c,
                    out[t * HH + c], want);
    }
  df_pool_free(pool);
}
END_TEST

/* The greedy walk: each position's choice depends on the one before. */
START_TEST(selector_walks_from_the_anchor) {
  enum { VV = 5, RR = 1, N = 2 };
  /* Logits: position 0 prefers 1 over 2, position 1 prefers 3 over 4. */
  float logits[N * VV] = {0, 2.0f, 1.9f, 0, 0, 0, 0, 0, 1.0f, 0.9f};
  float hproj[N * RR] = {1.0f, 1.0f}, pred[VV * RR] = {1, 0, 1, 0, 0}, succ[VV * RR];
  for (int v = 0; v < VV; v++) succ[v] = v == 2 ? 0.5f : v == 4 ? 1.0f : 0.0f;
  int32_t path[N];
  /* From anchor 0 (A = 1): token 2 scores 1.9 + 0.5 > 2.0; then from 2 (A = 1) token 4
   * scores 0.9 + 1 > 1.0. */
  df2_select_greedy(logits, hproj, pred, succ, N, VV, RR, 2, 0, path);
  ck_assert_int_eq(path[0], 2);
  ck_assert_int_eq(path[1], 4);
  /* From anchor 1 (A = 0): the logits alone. */
  df2_select_greedy(logits, hproj, pred, succ, N, VV, RR, 2, 1, path);
  ck_assert_int_eq(path[0], 1);
  ck_assert_int_eq(path[1], 3);
  /* top_k 1: no rescoring can leave the argmax. */
  df2_select_greedy(logits, hproj, pred, succ, N, VV, RR, 1, 0, path);
  ck_assert_int_eq(path[0], 1);
  ck_assert_int_eq(path[1], 3);
}
END_TEST

/* The top-K kept inside the block CE's LM-head pass (df_lmhead_ce_topk) is
 * the separate pass's (df2_lmhead_topk) bit for bit, ties across chunk
 * boundaries included (duplicated LM-head rows give equal logits: the
 * smaller id first), and the CE and its gradient are df_lmhead_ce's. */
START_TEST(topk_fused_into_the_ce_pass) {
  enum { RR = 5, HH = 12, VV = 61, CH = 7, KK = 9 };
  float x[RR * HH], E[VV * HH], coef[RR];
  int32_t tgt[RR];
  /* Eighths and sixteenths: every product is a multiple of 1/128 and every logit a sum of
   * 12 of them, exact in float32, so the tied rows below give equal logits whatever order
   * and blocking the BLAS's GEMM kernel sums in (OpenBLAS's Prescott kernels and AVX-512's
   * do not sum alike, and rounded sin/cos values gave 59 before 11 under Prescott). */
  for (int i = 0; i < RR * HH; i++) x[i] = roundf(8 * sinf(0.61f * (float)i + 0.3f)) / 8;
  for (int v = 0; v < VV; v++)
    for (int j = 0; j < HH; j++)
      E[v * HH + j] = roundf(16 * cosf(0.37f * (float)(v * HH + j))) / 16;
  /* Rows 0 and 2 get tokens 3 and 10 first, then ties: 3 = 40 (chunks 0 and
   * 5), 10 = 11 = 59 (chunks 1 and 8). */
  for (int j = 0; j < HH; j++)
    E[3 * HH + j] = 3 * x[0 * HH + j], E[10 * HH + j] = 3 * x[2 * HH + j];
  memcpy(E + 40 * HH, E + 3 * HH, sizeof(float) * HH);
  memcpy(E + 11 * HH, E + 10 * HH, sizeof(float) * HH);
  memcpy(E + 59 * HH, E + 10 * HH, sizeof(float) * HH);
  for (int r = 0; r < RR; r++) tgt[r] = (r * 13) % VV, coef[r] = 0.5f + (float)r;
  int32_t id1[RR * KK], id2[RR * KK];
  float v1[RR * KK], v2[RR * KK], dx1[RR * HH], dx2[RR * HH], scratch[RR * CH];
  float *work = malloc(sizeof(float) * df_lmhead_work(RR, HH, CH));
  double l1[RR], l2[RR];
  df2_lmhead_topk(x, E, RR, HH, VV, CH, KK, id1, v1, scratch);
  df_lmhead_ce(NULL, l1, dx1, x, E, tgt, coef, RR, HH, VV, CH, work);
  df_lmhead_ce_topk(NULL, l2, dx2, x, E, tgt, coef, RR, HH, VV, CH, work, KK, id2, v2);
  ck_assert_mem_eq(id1, id2, sizeof id1);
  ck_assert_mem_eq(v1, v2, sizeof v1);
  ck_assert_mem_eq(l1, l2, sizeof l1);
  ck_assert_mem_eq(dx1, dx2, sizeof dx1);
  ck_assert_int_eq(id2[0], 3);
  ck_assert_int_eq(id2[1], 40);
  ck_assert_int_eq(id2[2 * KK], 10);
  ck_assert_int_eq(id2[2 * KK + 1], 11);
  ck_assert_int_eq(id2[2 * KK + 2], 59);
  for (int r = 0; r < RR; r++)
    for (int c = 1; c < KK; c++) ck_assert(v2[r * KK + c - 1] >= v2[r * KK + c]);
  /* Forward only, and K = V (every token kept). */
  int32_t all[RR * VV];
  float allv[RR * VV];
  df_lmhead_ce_topk(NULL, l2, NULL, x, E, tgt, coef, RR, HH, VV, CH, work, VV, all, allv);
  ck_assert_mem_eq(l1, l2, sizeof l1);
  ck_assert_mem_eq(all, id1, sizeof(int32_t) * KK); /* row 0's first KK */
  free(work);
}
END_TEST

/* dflash_trainer_propose: NULL options is greedy, a near-zero temperature the
 * greedy path, q a distribution over the candidates (descending logit, the
 * argmax first), the draw reproducible; bad options and outputs refused by name. */
START_TEST(propose_samples_and_refuses) {
  dflash_trainer *t;
  ck_assert_ok(make(DFLASH_BACKEND_CPU, &t));
  for (size_t i = 0; i < t->m.n_params; i++) /* a selector that rescores */
    t->m.params[i] += 0.5f * sinf(0.37f * (float)i);
  enum { LEN = 12, NA = 3, KK = 5, N = NA * (B - 1) };
  int32_t ids[LEN], anchors[NA] = {0, 4, 7}, greedy[N], got[N], again[N], cand[N * KK];
  int32_t argmax[N];
  float hidden[LEN * H], probs[N * KK];
  for (int i = 0; i < LEN; i++) ids[i] = (i * 7 + 2) % (V - 1);
  for (int i = 0; i < LEN * H; i++) hidden[i] = cosf(0.23f * (float)i);
  const dflash_sample *smp = SEQ(ids, NULL, LEN, hidden, anchors, NA);
  ck_assert_ok(dflash_trainer_propose(t, smp, NULL, greedy, NULL));
  dflash_propose_options o;
  dflash_propose_options_default(&o);
  ck_assert_uint_eq(o.struct_size, sizeof o);
  ck_assert_ok(dflash_trainer_propose(t, smp, &o, got, NULL));
  ck_assert_mem_eq(got, greedy, sizeof got);
  dflash_propose_outputs out = {.struct_size = sizeof out,
                                .candidates = cand,
                                .probs = probs,
                                .argmax = argmax};
  o.temperature = 1e-6;
  ck_assert_ok(dflash_trainer_propose(t, smp, &o, got, &out));
  ck_assert_mem_eq(got, greedy, sizeof got);
  o.temperature = 3.0, o.seed = 9;
  ck_assert_ok(dflash_trainer_propose(t, smp, &o, got, &out));
  ck_assert_ok(dflash_trainer_propose(t, smp, &o, again, &out));
  ck_assert_mem_eq(got, again, sizeof got);
  for (int i = 0; i < N; i++) {
    double sum = 0;
    bool drawn = false;
    for (int c = 0; c < KK; c++) {
      sum += probs[i * KK + c];
      drawn |= cand[i * KK + c] == got[i] && probs[i * KK + c] > 0;
    }
    ck_assert_msg(fabs(sum - 1) < 1e-5, "position %d: q sums to %g", i, sum);
    ck_assert_msg(drawn, "position %d: token %d is not a candidate with q > 0", i, got[i]);
    ck_assert_int_eq(argmax[i], cand[i * KK]);
  }
  o.temperature = -1;
  ck_assert_status(dflash_trainer_propose(t, smp, &o, got, NULL), DFLASH_E_RANGE, "temperature -1");
  o.temperature = NAN;
  ck_assert_status(dflash_trainer_propose(t, smp, &o, got, NULL), DFLASH_E_RANGE, "temperature");
  /* Versioned, options and outputs alike: an older caller's struct is its prefix; a newer
   * one only with its unknown tail zero; a struct_size that is no size is refused. */
  struct {
    dflash_propose_options o;
    uint64_t extra;
  } big;
  memset(&big, 0, sizeof big);
  big.o = o, big.o.temperature = 3.0, big.o.struct_size = sizeof big;
  ck_assert_ok(dflash_trainer_propose(t, smp, &big.o, again, NULL));
  ck_assert_mem_eq(got, again, sizeof got);
  big.extra = 1;
  ck_assert_status(dflash_trainer_propose(t, smp, &big.o, again, NULL), DFLASH_E_UNSUPPORTED,
                   "newer libdflash");
  o.temperature = 3.0;
  int32_t untouched[N];
  memset(untouched, 0x5a, sizeof untouched);
  memcpy(argmax, untouched, sizeof argmax);
  out.struct_size = offsetof(dflash_propose_outputs, argmax); /* no argmax: not written */
  ck_assert_ok(dflash_trainer_propose(t, smp, &o, again, &out));
  ck_assert_mem_eq(got, again, sizeof got);
  ck_assert_mem_eq(argmax, untouched, sizeof argmax);
  o.struct_size = 2;
  ck_assert_status(dflash_trainer_propose(t, smp, &o, got, NULL), DFLASH_E_INVALID_ARG,
                   "struct_size 2");
  dflash_propose_options_default(&o);
  out.struct_size = 2;
  ck_assert_status(dflash_trainer_propose(t, smp, &o, got, &out), DFLASH_E_INVALID_ARG,
                   "dflash_propose_outputs");
  /* DFlash 1 has no selector to sample from; its argmax is the prediction. */
  t->m.dflash2 = false;
  o.temperature = 0.5;
  ck_assert_status(dflash_trainer_propose(t, smp, &o, got, NULL), DFLASH_E_UNSUPPORTED,
                   "needs a DFlash 2 drafter");
  o.temperature = 0;
  out = (dflash_propose_outputs){.struct_size = sizeof out, .candidates = cand};
  ck_assert_status(dflash_trainer_propose(t, smp, &o, got, &out), DFLASH_E_UNSUPPORTED,
                   "candidates / probs");
  t->m.dflash2 = true;
  dflash_trainer_free(t);
}
END_TEST

/* --plan's parameter count is the trainer's, DFlash 2 tensors included. */
START_TEST(plan_counts_dflash2_tensors) {
  dflash_trainer *t;
  ck_assert_ok(make(DFLASH_BACKEND_CPU, &t));
  size_t total = 0, d1 = 0, n1 = 3 + 11 * L;
  for (size_t i = 0; i < dflash_trainer_param_count(t); i++) {
    size_t numel;
    ck_assert_ok(dflash_trainer_param_info(t, i, NULL, NULL, NULL, &numel));
    total += numel;
    d1 += i < n1 ? numel : 0;
  }
  dflash_trainer_free(t);
  dflash_drafter_config c = {.struct_size = sizeof c};
  config(&c);
  dflash_train_plan_options o;
  dflash_train_plan_options_default(&o);
  o.gpu_bytes = UINT64_MAX / 2;
  dflash_train_plan p = {.struct_size = sizeof p};
  ck_assert_ok(dflash_train_plan_compute(&c, &o, &p));
  ck_assert_uint_eq(p.n_params, total);
  ck_assert_uint_eq(total - d1, 2 * L * (2 * K * H + 2 * K * H / G * H) + 2 * V * R + R * H);
  dflash_drafter_config d1_cfg = c; /* the same drafter as DFlash 1 */
  d1_cfg.dflash2 = d1_cfg.conv_kernel_size = d1_cfg.conv_group_size = 0;
  d1_cfg.selector_top_k = d1_cfg.selector_rank = 0;
  ck_assert_ok(dflash_train_plan_compute(&d1_cfg, &o, &p));
  ck_assert_uint_eq(p.n_params, d1);
  c.conv_group_size = 5; /* does not divide H */
  ck_assert_status(dflash_train_plan_compute(&c, &o, &p), DFLASH_E_CONFIG, "conv_group_size 5");
}
END_TEST

/* Loss sum(w * CE) of the DFlash 2 model (internal step, no refusal). */
static double model_loss(df_model *m, const int32_t *ids, const uint8_t *mask, int64_t len,
                         const float *hidden, const int32_t *anchors, int n, bool backward) {
  double lsum = 0;
  ck_assert_ok(df_model_step(m, ids, mask, len, hidden, anchors, n, 1.0, backward, &lsum, NULL));
  return lsum;
}

/* The model's backward through both convolutions of every layer against
 * central differences (float32 forward, step 1e-2: the error is ~1e-4 of the
 * gradient's scale; a missing or wrong term is O(1) of it). */
START_TEST(model_backward_through_convolutions) {
  dflash_trainer *t;
  ck_assert_ok(make(DFLASH_BACKEND_CPU, &t));
  df_model *m = &t->m;
  m->sel_inject = true; /* every row in the selector loss (top-5 of 40 rarely hits here) */
  uint64_t z = 12345;
  for (size_t i = 0; i < m->n_params; i++) {
    z = z * 6364136223846793005ULL + 1442695040888963407ULL;
    m->params[i] += 0.3f * ((float)(z >> 40) / 16777216.0f - 0.5f);
  }
  enum { LEN = 14 };
  int32_t ids[LEN], anchors[3] = {0, 5, 10};
  uint8_t mask[LEN];
  float hidden[LEN * H];
  for (int i = 0; i < LEN; i++) ids[i] = (i * 11 + 3) % (V - 1), mask[i] = i % 5 != 2;
  for (int i = 0; i < LEN * H; i++) hidden[i] = sinf(0.37f * (float)i);
  memset(m->grads, 0, m->n_params * sizeof(float));
  model_loss(m, ids, mask, LEN, hidden, anchors, 3, true);
  const char *names[] = {"layers.0.attention_conv.base_kernel",
                         "layers.0.attention_conv.kernel_projection.weight",
                         "layers.1.mlp_conv.base_kernel",
                         "layers.1.mlp_conv.kernel_projection.weight",
                         "layers.0.mlp_conv.kernel_projection.weight",
                         "layers.1.attention_conv.base_kernel",
                         "layers.0.self_attn.q_proj.weight",
                         "layers.0.input_layernorm.weight",
                         "layers.1.mlp.gate_proj.weight",
                         "fc.weight",
                         "candidate_selector.predecessor_codebook",
                         "candidate_selector.successor_codebook",
                         "candidate_selector.hidden_projection.weight"};
  for (size_t n = 0; n < sizeof names / sizeof *names; n++) {
    const df_tensor_info *ti = df_model_find(m, names[n]);
    ck_assert_ptr_nonnull(ti);
    const float *g = m->grads + ti->offset;
    double scale = 0;
    for (size_t i = 0; i < ti->numel; i++) scale = fmax(scale, fabs(g[i]));
    ck_assert_msg(scale > 0, "%s: zero gradient", names[n]);
    for (int k = 0; k < 6; k++) {
      size_t i = ((size_t)k * 7919 + 13) % ti->numel;
      float *p = m->params + ti->offset + i, keep = *p, h = 1e-2f;
      *p = keep + h;
      double lp = model_loss(m, ids, mask, LEN, hidden, anchors, 3, false);
      *p = keep - h;
      double lm = model_loss(m, ids, mask, LEN, hidden, anchors, 3, false);
      *p = keep;
      double fd = (lp - lm) / (2.0 * h);
      ck_assert_msg(fabs(fd - g[i]) <= 1e-2 * scale + 1e-5,
                    "%s[%zu]: backward %g, central "
                    "difference %g (scale %g)",
                    names[n], i, g[i], fd, scale);
    }
  }
  dflash_trainer_free(t);
}
END_TEST

TCase *tc_dflash2(void) {
  TCase *tc = tcase_create("dflash2");
  tcase_add_test(tc, tensors_named_and_initialised_as_identity);
  tcase_add_test(tc, cuda_not_refused_cpu_trains);
  tcase_add_test(tc, training_lowers_selector_loss);
  tcase_add_test(tc, selector_loss_options);
  tcase_add_test(tc, checkpoint_round_trip);
  tcase_add_test(tc, conv_matches_direct_evaluation);
  tcase_add_test(tc, selector_walks_from_the_anchor);
  tcase_add_test(tc, topk_fused_into_the_ce_pass);
  tcase_add_test(tc, propose_samples_and_refuses);
  tcase_add_test(tc, plan_counts_dflash2_tensors);
  tcase_add_test(tc, model_backward_through_convolutions);
  tcase_add_test(tc, muon_splits_the_tensors_like_speculators);
  return tc;
}
