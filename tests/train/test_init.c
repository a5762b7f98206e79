/* The trainer's initial parameters: counter-based (every chunk of every
 * tensor drawn by its own generator), so the thread pool may fill them in
 * any order and the values never depend on the thread count. */
#include <dflash/train.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "train/rng.h"

enum { CHUNK = 1 << 14 }; /* trainer.c's INIT_CHUNK */

static void config(dflash_drafter_config *c) {
  dflash_drafter_config_default(c);
  c->hidden_size = 128, c->intermediate_size = 320, c->num_hidden_layers = 2; /* 40960: 3 chunks */
  c->num_attention_heads = 4, c->num_key_value_heads = 2, c->head_dim = 32, c->vocab_size = 64;
  c->num_target_layers = 8, c->block_size = 4, c->mask_token_id = 63;
  c->n_target_layer_ids = 2, c->target_layer_ids[0] = 1, c->target_layer_ids[1] = 5;
}

static dflash_trainer *make(int threads, uint64_t seed) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  config(&c);
  size_t vh = (size_t)c.vocab_size * c.hidden_size;
  float *E = calloc(vh, 4), *H = calloc(vh, 4);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.n_threads = threads;
  o.seed = seed;
  o.init_std = 0.02;
  dflash_trainer *t = NULL;
  ck_assert_ok(dflash_trainer_create(&c, E, H, &o, &t));
  free(E), free(H);
  return t;
}

static float *param(dflash_trainer *t, size_t i, size_t *numel, int *ndim) {
  const char *name;
  int32_t nd;
  ck_assert_ok(dflash_trainer_param_info(t, i, &name, &nd, NULL, numel));
  float *p = malloc(4 * *numel);
  ck_assert_ok(dflash_trainer_get_param(t, name, p, *numel));
  *ndim = nd;
  return p;
}

START_TEST(init_is_the_same_for_any_thread_count) {
  dflash_trainer *t[3] = {make(1, 7), make(2, 7), make(5, 7)};
  for (size_t i = 0; i < dflash_trainer_param_count(t[0]); i++) {
    size_t n;
    int nd;
    float *p0 = param(t[0], i, &n, &nd);
    for (int k = 1; k < 3; k++) {
      float *p = param(t[k], i, &n, &nd);
      ck_assert_msg(!memcmp(p0, p, 4 * n), "tensor %zu differs between 1 and %d threads", i,
                    k == 1 ? 2 : 5);
      free(p);
    }
    free(p0);
  }
  for (int k = 0; k < 3; k++) dflash_trainer_free(t[k]);
}
END_TEST

/* The definition (CHANGELOG.md): chunk c of tensor i from the generator seeded by
 * (seed, i << 40 ^ c ^ 0x1417); each 64-bit draw gives two 24-bit uniforms u, v and the
 * values std * sqrt(-2 ln u) * (cos, sin)(2 pi v). 1-D tensors are 1. Before, one
 * generator ran through all tensors in turn, one double-precision draw pair per value. */
START_TEST(init_values_follow_the_counter_definition) {
  dflash_trainer *t = make(3, 7);
  size_t checked = 0;
  double sum = 0, sumsq = 0, count = 0;
  for (size_t i = 0; i < dflash_trainer_param_count(t); i++) {
    size_t n;
    int nd;
    float *p = param(t, i, &n, &nd);
    for (size_t k = 0; k < n; k++) {
      if (nd == 1) {
        ck_assert_msg(p[k] == 1.0f, "tensor %zu (1-D) element %zu is %g, not 1", i, k, p[k]);
        continue;
      }
      sum += p[k], sumsq += (double)p[k] * p[k], count++;
    }
    for (size_t c0 = 0; nd == 2 && c0 * CHUNK < n; c0++) {
      df_rng r;
      df_rng_seed(&r, 7, ((uint64_t)i << 40) ^ c0 ^ 0x1417);
      for (size_t k = c0 * CHUNK; k < n && k < c0 * CHUNK + 64; k += 2) {
        uint64_t x = df_rng_next(&r);
        float u = ((float)(x >> 40) + 0.5f) * 0x1p-24f;
        float v = ((float)((x >> 8) & 0xffffff) + 0.5f) * 0x1p-24f;
        float rad = 0.02f * sqrtf(-2.0f * logf(u)), a = 6.2831853f * v;
        ck_assert_msg(p[k] == rad * cosf(a) && (k + 1 >= n || p[k + 1] == rad * sinf(a)),
                      "tensor %zu element %zu: %.9g %.9g, the definition gives %.9g %.9g", i, k,
                      p[k], p[k + 1], rad * cosf(a), rad * sinf(a));
        checked += 2;
      }
    }
    free(p);
  }
  ck_assert_uint_gt(checked, 1000);
  double mean = sum / count, sd = sqrt(sumsq / count - mean * mean);
  ck_assert_msg(fabs(mean) < 1e-3 && fabs(sd - 0.02) < 0.02 * 0.02,
                "%.0f values: mean %g, std %g (wanted 0, 0.02)", count, mean, sd);
  dflash_trainer_free(t);
}
END_TEST

/* The recipe knobs (lr_schedule, position_weighting): defaults, refusals, an older
 * caller's struct, and the schedules' rates at hand-computed steps (warm-up 2 of 10 steps:
 * linear = lr * (10 - s) / 8 after it, constant = lr). */
START_TEST(recipe_options_checked) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  config(&c);
  size_t vh = (size_t)c.vocab_size * c.hidden_size;
  float *E = calloc(vh, 4);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  ck_assert_int_eq(o.lr_schedule, DFLASH_LR_COSINE);
  ck_assert_int_eq(o.position_weighting, DFLASH_POSITION_WEIGHTING_DECAY);
  dflash_trainer *t = NULL;
  o.lr_schedule = 3;
  ck_assert_status(dflash_trainer_create(&c, E, E, &o, &t), DFLASH_E_INVALID_ARG, "lr_schedule");
  o.lr_schedule = DFLASH_LR_COSINE, o.position_weighting = 2;
  ck_assert_status(dflash_trainer_create(&c, E, E, &o, &t), DFLASH_E_INVALID_ARG,
                   "position_weighting");
  /* Refused by the options check, before any device is looked for. */
  o.position_weighting = DFLASH_POSITION_WEIGHTING_ADAPTIVE, o.backend = DFLASH_BACKEND_CUDA;
  ck_assert_status(dflash_trainer_create(&c, E, E, &o, &t), DFLASH_E_UNSUPPORTED,
                   "CPU backend only");
  o.backend = DFLASH_BACKEND_CPU, o.lr = 1.0, o.warmup_ratio = 0.2, o.total_steps = 10;
  o.lr_schedule = DFLASH_LR_LINEAR;
  ck_assert_ok(dflash_trainer_create(&c, E, E, &o, &t));
  const double linear[] = {0, 0.5, 1, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0, 0};
  for (int s = 0; s < 12; s++)
    ck_assert_double_eq_tol(dflash_trainer_lr_at(t, s), linear[s], 1e-15);
  dflash_trainer_free(t);
  o.lr_schedule = DFLASH_LR_CONSTANT;
  ck_assert_ok(dflash_trainer_create(&c, E, E, &o, &t));
  ck_assert_double_eq(dflash_trainer_lr_at(t, 1), 0.5);
  for (int s = 2; s < 12; s++) ck_assert_double_eq(dflash_trainer_lr_at(t, s), 1.0);
  dflash_trainer_free(t);
  /* An older caller's struct (up to selector_loss_mode) gets the defaults: cosine. */
  o.struct_size = offsetof(dflash_trainer_options, lr_schedule);
  ck_assert_ok(dflash_trainer_create(&c, E, E, &o, &t));
  ck_assert_double_eq_tol(dflash_trainer_lr_at(t, 6), 0.5, 1e-15); /* cosine half-way */
  dflash_trainer_free(t);
  free(E);
}
END_TEST

/* A Muon run's first step moves each matrix by lr x 0.2 sqrt(max side) x an orthogonalised
 * update (the oracle checks its values): here the options' checks and refusals. */
START_TEST(muon_options_checked) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  config(&c);
  float *E = calloc((size_t)c.vocab_size * c.hidden_size, 4);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  ck_assert_int_eq(o.optimizer, DFLASH_OPTIMIZER_ADAMW);
  ck_assert_double_eq(o.muon_momentum, 0.95);
  ck_assert_double_eq(o.muon_weight_decay, 0.1);
  ck_assert_int_eq(o.muon_adjust_lr, DFLASH_MUON_ADJUST_LR_MATCH_RMS_ADAMW);
  dflash_trainer *t = NULL;
  o.optimizer = 2;
  ck_assert_status(dflash_trainer_create(&c, E, E, &o, &t), DFLASH_E_INVALID_ARG, "optimizer");
  o.optimizer = DFLASH_OPTIMIZER_MUON, o.muon_momentum = 1.0;
  ck_assert_status(dflash_trainer_create(&c, E, E, &o, &t), DFLASH_E_INVALID_ARG, "muon_momentum");
  o.muon_momentum = 0.95, o.muon_weight_decay = -0.1;
  ck_assert_status(dflash_trainer_create(&c, E, E, &o, &t), DFLASH_E_INVALID_ARG,
                   "muon_weight_decay");
  o.muon_weight_decay = 0.1, o.muon_adjust_lr = 2;
  ck_assert_status(dflash_trainer_create(&c, E, E, &o, &t), DFLASH_E_INVALID_ARG, "muon_adjust_lr");
  /* Muon runs on CUDA too: the options pass, and only this build's device (none, or no
   * CUDA in the build) may refuse, never the optimizer (tests/gpu/emu_muon.c runs it). */
  o.muon_adjust_lr = DFLASH_MUON_ADJUST_LR_ORIGINAL, o.backend = DFLASH_BACKEND_CUDA;
  dflash_status st = dflash_trainer_create(&c, E, E, &o, &t);
  ck_assert_msg(!st || !strstr(dflash_last_error(), "optimizer"), "%s", dflash_last_error());
  if (!st) dflash_trainer_free(t);
  t = NULL;
  o.backend = DFLASH_BACKEND_CPU;
  ck_assert_ok(dflash_trainer_create(&c, E, E, &o, &t));
  dflash_trainer_free(t);
  /* An older caller's struct (up to position_weighting) gets the defaults: what lies past
   * its size is not read (an invalid optimizer there is no error). */
  o.struct_size = offsetof(dflash_trainer_options, muon_momentum), o.optimizer = 7;
  ck_assert_ok(dflash_trainer_create(&c, E, E, &o, &t));
  dflash_trainer_free(t);
  free(E);
}
END_TEST

TCase *tc_init(void) {
  TCase *tc = tcase_create("init");
  tcase_add_test(tc, init_is_the_same_for_any_thread_count);
  tcase_add_test(tc, init_values_follow_the_counter_definition);
  tcase_add_test(tc, recipe_options_checked);
  tcase_add_test(tc, muon_options_checked);
  return tc;
}
