/* Finite-difference checks of every op's backward, and of the whole model's
 * loss gradient through the public trainer. Objective: L = sum(c * y) for
 * fixed random c, so dL/dy = c feeds the backward. Central differences in
 * float32 with step 1e-2: truncation ~h^2 and rounding ~eps/h keep the error
 * near 1e-4 of the gradient's scale; the bound is 1e-2 of it (a wrong term
 * is off by O(1)). */
#include <dflash/experimental.h>
#include <dflash/train.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "seq.h"
#include "testutil.h"
#include "train/model.h"

static uint64_t lcg = 12345;
static float frand(void) { /* uniform in [-1, 1) */
  lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
  return (float)((lcg >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}
static float *rnd(size_t n, float scale) {
  float *p = malloc(n * sizeof *p);
  for (size_t i = 0; i < n; i++) p[i] = frand() * scale;
  return p;
}
static double dotd(const float *a, const float *b, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
  return s;
}

typedef double (*objective)(void *ctx);

static void fd_check(const char *what, objective f, void *ctx, float *x, const float *g, size_t n) {
  double scale = 0;
  for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(g[i]));
  ck_assert_msg(scale > 0, "%s: gradient is all zero", what);
  const float h = 1e-2f;
  for (int k = 0; k < 12; k++) {
    size_t i = (size_t)(k * 7919u) % n;
    float keep = x[i];
    x[i] = keep + h;
    double fp = f(ctx);
    x[i] = keep - h;
    double fm = f(ctx);
    x[i] = keep;
    double fd = (fp - fm) / (2.0 * h);
    ck_assert_msg(fabs(fd - g[i]) <= 1e-2 * scale,
                  "%s[%zu]: analytic %g, finite difference %g "
                  "(scale %g)",
                  what, i, g[i], fd, scale);
  }
}

/* ---- RMSNorm -------------------------------------------------------------- */
typedef struct {
  float *x, *w, *c, *y, *rstd;
  int rows, n;
} rms_t;
static double rms_obj(void *v) {
  rms_t *p = v;
  df_rmsnorm_forward(NULL, p->y, p->rstd, p->x, p->w, p->rows, p->n, 1e-6f);
  return dotd(p->c, p->y, (size_t)p->rows * p->n);
}
START_TEST(rmsnorm_fd) {
  rms_t p = {rnd(5 * 12, 1), rnd(12, 1), rnd(5 * 12, 1), rnd(60, 1), rnd(5, 1), 5, 12};
  float *dx = calloc(60, 4), *dw = calloc(12, 4);
  rms_obj(&p);
  df_rmsnorm_backward(NULL, dx, dw, p.c, p.x, p.w, p.rstd, 5, 12, false);
  fd_check("rmsnorm dx", rms_obj, &p, p.x, dx, 60);
  fd_check("rmsnorm dw", rms_obj, &p, p.w, dw, 12);
  free(p.x), free(p.w), free(p.c), free(p.y), free(p.rstd), free(dx), free(dw);
}
END_TEST

/* ---- RoPE ----------------------------------------------------------------- */
typedef struct {
  float *x, *y, *c, *cos_t, *sin_t;
  int32_t *pos;
  int rot;
} rope_t;
static double rope_obj(void *v) {
  rope_t *p = v;
  memcpy(p->y, p->x, 3 * 2 * 8 * sizeof(float));
  df_rope_forward(NULL, p->y, p->pos, p->cos_t, p->sin_t, 3, 2, 8, p->rot);
  return dotd(p->c, p->y, 3 * 2 * 8);
}
/* rot = 8: whole heads; rot = 4 (partial_rotary_factor 0.5): pairs (i, i+2)
 * of the first four dims turn, the last four pass through. */
static void rope_case(int rot) {
  dflash_drafter_config cfg;
  dflash_drafter_config_default(&cfg);
  cfg.head_dim = 8;
  cfg.rope_type = DFLASH_ROPE_YARN;
  cfg.rope_factor = 8;
  cfg.rope_original_max_position = 16;
  cfg.rope_attention_factor = 1.2;
  int half = rot / 2;
  double inv[4], af;
  df_rope_inv_freq(&cfg, rot, inv, &af);
  ck_assert_double_eq(af, 1.2);
  ck_assert_double_eq(inv[0], 1.0); /* theta^0, beyond the YaRN ramp */
  rope_t p = {rnd(48, 1),
              rnd(48, 1),
              rnd(48, 1),
              malloc(40 * 4 * 4),
              malloc(40 * 4 * 4),
              (int32_t[]){3, 17, 39},
              rot};
  for (int q = 0; q < 40; q++)
    for (int i = 0; i < half; i++)
      p.cos_t[q * half + i] = (float)(cos(q * inv[i]) * af),
                         p.sin_t[q * half + i] = (float)(sin(q * inv[i]) * af);
  rope_obj(&p);
  for (int r = 0; r < 6; r++) {
    /* dim 0 pairs with dim `half` */
    float a = p.x[r * 8], b = p.x[r * 8 + half];
    int pos = p.pos[r / 2];
    float c = p.cos_t[pos * half], sn = p.sin_t[pos * half];
    ck_assert_float_eq_tol(p.y[r * 8], a * c - b * sn, 1e-5);
    ck_assert_float_eq_tol(p.y[r * 8 + half], b * c + a * sn, 1e-5);
    for (int i = rot; i < 8; i++) ck_assert_float_eq(p.y[r * 8 + i], p.x[r * 8 + i]);
  }
  float *dx = malloc(48 * 4);
  memcpy(dx, p.c, 48 * 4);
  df_rope_backward(NULL, dx, p.pos, p.cos_t, p.sin_t, 3, 2, 8, rot);
  fd_check(rot == 8 ? "rope dx" : "partial rope dx", rope_obj, &p, p.x, dx, 48);
  free(p.x), free(p.y), free(p.c), free(p.cos_t), free(p.sin_t), free(dx);
}
START_TEST(rope_fd) { rope_case(8); }
END_TEST
START_TEST(rope_partial_fd) {
  rope_case(4);
  /* Frequencies over the rotated width: theta^(-2i/rot), not theta^(-2i/d). */
  dflash_drafter_config cfg;
  dflash_drafter_config_default(&cfg);
  cfg.head_dim = 8;
  double inv[2], af;
  df_rope_inv_freq(&cfg, 4, inv, &af);
  ck_assert_double_eq_tol(inv[1], pow(10000.0, -0.5), 1e-15);
}
END_TEST

/* ---- attention ------------------------------------------------------------ */
typedef struct {
  df_attn_shape s;
  float *q, *kc, *vc, *kb, *vb, *out, *lse, *c, *work;
} attn_t;
static double attn_obj(void *v) {
  attn_t *p = v;
  df_attention_forward(NULL, &p->s, p->out, p->lse, p->q, p->kc, p->vc, p->kb, p->vb, p->work);
  return dotd(p->c, p->out, (size_t)p->s.n_blocks * p->s.B * p->s.nh * p->s.d);
}
static void attention_fd(int window) {
  static const int32_t anchors[] = {2, 5, 9};
  attn_t p = {.s = {.n_blocks = 3,
                    .B = 4,
                    .Sc = 9,
                    .nh = 4,
                    .nkv = 2,
                    .d = 6,
                    .window = window,
                    .anchors = anchors}};
  size_t T = 12, qn = T * 4 * 6, kbn = T * 2 * 6, kcn = 9 * 2 * 6;
  p.q = rnd(qn, 1), p.kc = rnd(kcn, 1), p.vc = rnd(kcn, 1), p.kb = rnd(kbn, 1), p.vb = rnd(kbn, 1);
  p.out = rnd(qn, 1), p.lse = rnd(T * 4, 1), p.c = rnd(qn, 1);
  p.work = malloc(df_attention_work(NULL, &p.s) * sizeof(float));
  float *dq = rnd(qn, 1), *dkc = rnd(kcn, 1), *dvc = rnd(kcn, 1), *dkb = rnd(kbn, 1),
        *dvb = rnd(kbn, 1);
  attn_obj(&p);
  df_attention_backward(NULL, &p.s, dq, dkc, dvc, dkb, dvb, p.work, p.c, p.out, p.lse, p.q, p.kc,
                        p.vc, p.kb, p.vb);
  fd_check("attention dq", attn_obj, &p, p.q, dq, qn);
  fd_check("attention dk context", attn_obj, &p, p.kc, dkc, kcn);
  fd_check("attention dv context", attn_obj, &p, p.vc, dvc, kcn);
  fd_check("attention dk block", attn_obj, &p, p.kb, dkb, kbn);
  fd_check("attention dv block", attn_obj, &p, p.vb, dvb, kbn);
  float *ptrs[] = {p.q, p.kc, p.vc, p.kb, p.vb, p.out, p.lse, p.c, p.work, dq, dkc, dvc, dkb, dvb};
  for (size_t i = 0; i < DF_ARRAY_LEN(ptrs); i++) free(ptrs[i]);
}
START_TEST(attention_full_fd) { attention_fd(0); }
END_TEST
START_TEST(attention_sliding_fd) { attention_fd(3); }
END_TEST

/* The mask itself: block 0 (anchor 2) must not depend on context rows >= 2,
 * nor on other blocks' rows. */
START_TEST(attention_mask_blocks) {
  static const int32_t anchors[] = {2, 6};
  df_attn_shape s = {.n_blocks = 2, .B = 3, .Sc = 6, .nh = 1, .nkv = 1, .d = 4, .anchors = anchors};
  float *q = rnd(24, 1), *kc = rnd(24, 1), *vc = rnd(24, 1), *kb = rnd(24, 1), *vb = rnd(24, 1);
  float out1[24], out2[24], lse[6];
  float *work = malloc(df_attention_work(NULL, &s) * sizeof(float));
  df_attention_forward(NULL, &s, out1, lse, q, kc, vc, kb, vb, work);
  for (int i = 2 * 4; i < 24; i++) vc[i] += 5.0f; /* context rows 2.. */
  for (int i = 12; i < 24; i++) vb[i] += 5.0f;    /* block 1's rows */
  df_attention_forward(NULL, &s, out2, lse, q, kc, vc, kb, vb, work);
  ck_assert_mem_eq(out1, out2, 12 * sizeof(float)); /* block 0 unchanged */
  ck_assert(memcmp(out1 + 12, out2 + 12, 12 * sizeof(float)) != 0);
  free(q), free(kc), free(vc), free(kb), free(vb), free(work);
}
END_TEST

/* ---- SwiGLU --------------------------------------------------------------- */
typedef struct {
  float *g, *u, *m, *c;
} swiglu_t;
static double swiglu_obj(void *v) {
  swiglu_t *p = v;
  df_swiglu_forward(NULL, p->m, p->g, p->u, 40);
  return dotd(p->c, p->m, 40);
}
START_TEST(swiglu_fd) {
  swiglu_t p = {rnd(40, 3), rnd(40, 1), rnd(40, 1), rnd(40, 1)};
  float dg[40], du[40];
  df_swiglu_backward(NULL, dg, du, p.c, p.g, p.u, 40);
  fd_check("swiglu dg", swiglu_obj, &p, p.g, dg, 40);
  fd_check("swiglu du", swiglu_obj, &p, p.u, du, 40);
  free(p.g), free(p.u), free(p.m), free(p.c);
}
END_TEST

/* ---- LM head + CE (chunk 7 does not divide V = 30) ------------------------ */
typedef struct {
  float *x, *E, *coef, *work;
  int32_t *tgt;
  double loss[4];
} ce_t;
static double ce_obj(void *v) {
  ce_t *p = v;
  df_lmhead_ce(NULL, p->loss, NULL, p->x, p->E, p->tgt, p->coef, 4, 10, 30, 7, p->work);
  double s = 0;
  for (int r = 0; r < 4; r++) s += p->coef[r] * p->loss[r];
  return s;
}
START_TEST(lmhead_ce_fd) {
  ce_t p = {rnd(40, 1),
            rnd(300, 1),
            (float[]){1.0f, 0.5f, 0.25f, 2.0f},
            malloc(df_lmhead_work(4, 10, 7) * sizeof(float)),
            (int32_t[]){0, 29, 13, 6},
            {0}};
  float dx[40];
  df_lmhead_ce(NULL, p.loss, dx, p.x, p.E, p.tgt, p.coef, 4, 10, 30, 7, p.work);
  /* The loss itself against a direct log-softmax over all logits. */
  for (int r = 0; r < 4; r++) {
    double mx = -1e30, l[30];
    for (int v = 0; v < 30; v++) l[v] = dotd(p.x + r * 10, p.E + v * 10, 10), mx = fmax(mx, l[v]);
    double s = 0;
    for (int v = 0; v < 30; v++) s += exp(l[v] - mx);
    ck_assert_double_eq_tol(p.loss[r], mx + log(s) - l[p.tgt[r]], 1e-5);
  }
  fd_check("lm head dx", ce_obj, &p, p.x, dx, 40);
  free(p.x), free(p.E), free(p.work);
}
END_TEST

/* ---- whole model, through the public API ---------------------------------- */
static const char *TINY =
    "{\"hidden_size\": 16, \"intermediate_size\": 24, \"num_hidden_layers\": 2,"
    "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 4, \"vocab_size\": 23,"
    "\"num_target_layers\": 8, \"block_size\": 4, \"rope_scaling\": {\"rope_type\": \"yarn\","
    "\"factor\": 4.0, \"original_max_position_embeddings\": 8}, \"max_position_embeddings\": 32,"
    "\"layer_types\": [\"sliding_attention\", \"full_attention\"], \"use_sliding_window\": true,"
    "\"sliding_window\": 3,"
    "\"dflash_config\": {\"mask_token_id\": 22, \"target_layer_ids\": [1, 5]}}";

typedef struct {
  dflash_trainer *t;
  int32_t ids[20];
  uint8_t mask[20];
  float *hid;
  int32_t anc[4];
  const char *name;
  float *p;
  size_t n;
} model_t;
static double model_obj(void *v) {
  model_t *m = v;
  ck_assert_ok(dflash_trainer_set_param(m->t, m->name, m->p, m->n));
  double loss;
  ck_assert_ok(
      dflash_trainer_forward_backward(m->t, SEQ(m->ids, m->mask, 20, m->hid, m->anc, 4), &loss));
  return loss;
}
/* The tiny model with partial_rotary_factor 0.5: RoPE on 2 of the 4 dims. */
static void model_fd_case(double partial_rotary_factor) {
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  ck_assert_ok(dflash_drafter_config_parse(TINY, strlen(TINY), "tiny", &cfg));
  cfg.partial_rotary_factor = partial_rotary_factor;
  float *E = rnd(23 * 16, 1), *W = rnd(23 * 16, 1);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.init_std = 0.3;
  o.n_threads = 2;
  model_t m = {.hid = rnd(20 * 32, 1), .anc = {0, 3, 9, 18}};
  ck_assert_ok(dflash_trainer_create(&cfg, E, W, &o, &m.t));
  for (int i = 0; i < 20; i++) m.ids[i] = (i * 7) % 22, m.mask[i] = i != 5 && i != 11;
  for (size_t k = 0; k < dflash_trainer_param_count(m.t); k++) {
    int32_t nd;
    int64_t shape[2];
    ck_assert_ok(dflash_trainer_param_info(m.t, k, &m.name, &nd, shape, &m.n));
    m.p = malloc(m.n * 4);
    float *g = malloc(m.n * 4);
    ck_assert_ok(dflash_trainer_get_param(m.t, m.name, m.p, m.n));
    model_obj(&m);
    ck_assert_ok(dflash_trainer_get_grad(m.t, m.name, g, m.n));
    fd_check(m.name, model_obj, &m, m.p, g, m.n);
    free(m.p), free(g);
  }
  dflash_trainer_free(m.t);
  free(E), free(W), free(m.hid);
}
START_TEST(model_fd) { model_fd_case(1.0); }
END_TEST
START_TEST(model_partial_rotary_fd) { model_fd_case(0.5); }
END_TEST

/* dflash_trainer_logits: the argmax of positions 1..B-1 is predict's answer,
 * a block's logits do not depend on the other blocks packed with it, and
 * position 0 is included. */
START_TEST(logits_of_blocks) {
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  ck_assert_ok(dflash_drafter_config_parse(TINY, strlen(TINY), "tiny", &cfg));
  float *E = rnd(23 * 16, 1), *W = rnd(23 * 16, 1), *hid = rnd(20 * 32, 1);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.init_std = 0.3;
  dflash_trainer *t;
  ck_assert_ok(dflash_trainer_create(&cfg, E, W, &o, &t));
  int32_t ids[20], anc[4] = {0, 3, 16, 19}, pred[4 * 3];
  for (int i = 0; i < 20; i++) ids[i] = (i * 5) % 22;
  enum { B = 4, V = 23 };
  float *all = malloc(sizeof(float) * 4 * B * V), *one = malloc(sizeof(float) * B * V);
  ck_assert_ok(dflash_trainer_logits(t, SEQ(ids, NULL, 20, hid, anc, 4), all));
  ck_assert_ok(dflash_trainer_propose(t, SEQ(ids, NULL, 20, hid, anc, 4), NULL, pred, NULL));
  for (int n = 0; n < 4; n++) {
    for (int j = 1; j < B; j++) {
      const float *row = all + ((size_t)n * B + j) * V;
      int best = 0;
      for (int v = 1; v < V; v++) best = row[v] > row[best] ? v : best;
      ck_assert_int_eq(best, pred[n * (B - 1) + j - 1]);
    }
    ck_assert_ok(dflash_trainer_logits(t, SEQ(ids, NULL, 20, hid, &anc[n], 1), one));
    for (int k = 0; k < B * V; k++)
      ck_assert_float_eq_tol(one[k], all[(size_t)n * B * V + k], 1e-5);
  }
  ck_assert_status(dflash_trainer_logits(t, SEQ(ids, NULL, 20, hid, anc, -1), all),
                   DFLASH_E_INVALID_ARG, "sample ?: -1 anchors");
  anc[1] = 20;
  ck_assert_status(dflash_trainer_logits(t, SEQ(ids, NULL, 20, hid, anc, 4), all), DFLASH_E_RANGE,
                   "anchor 1 = 20");
  dflash_trainer_free(t);
  free(E), free(W), free(hid), free(all), free(one);
}
END_TEST

/* Bad inputs: clear errors, no crash. */
START_TEST(model_rejects_bad_inputs) {
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  ck_assert_ok(dflash_drafter_config_parse(TINY, strlen(TINY), "tiny", &cfg));
  float *E = rnd(23 * 16, 1), *hid = rnd(20 * 32, 1);
  dflash_trainer *t;
  ck_assert_ok(dflash_trainer_create(&cfg, E, E, NULL, &t));
  int32_t ids[20] = {0}, anc[2] = {1, 25};
  uint8_t mask[20];
  memset(mask, 1, sizeof mask);
  double loss;
  ck_assert_status(dflash_trainer_forward_backward(t, SEQ(ids, mask, 20, hid, anc, 2), &loss),
                   DFLASH_E_RANGE, "anchor 1 = 25");
  anc[1] = 4;
  ids[3] = 23;
  ck_assert_status(dflash_trainer_forward_backward(t, SEQ(ids, mask, 20, hid, anc, 2), &loss),
                   DFLASH_E_RANGE, "input_ids[3] = 23");
  ids[3] = 0;
  hid[5 * 32 + 7] = NAN;
  ck_assert_status(dflash_trainer_forward_backward(t, SEQ(ids, mask, 20, hid, anc, 2), &loss),
                   DFLASH_E_FORMAT, "position 5, column 7 is NaN");
  dflash_trainer_free(t);
  free(E), free(hid);
}
END_TEST

TCase *tc_ops(void) {
  TCase *tc = tcase_create("ops");
  tcase_add_test(tc, rmsnorm_fd);
  tcase_add_test(tc, rope_fd);
  tcase_add_test(tc, rope_partial_fd);
  tcase_add_test(tc, attention_full_fd);
  tcase_add_test(tc, attention_sliding_fd);
  tcase_add_test(tc, attention_mask_blocks);
  tcase_add_test(tc, swiglu_fd);
  tcase_add_test(tc, lmhead_ce_fd);
  tcase_add_test(tc, model_fd);
  tcase_add_test(tc, model_partial_rotary_fd);
  tcase_add_test(tc, logits_of_blocks);
  tcase_add_test(tc, model_rejects_bad_inputs);
  return tc;
}
