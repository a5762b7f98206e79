#include <dflash/safetensors.h>
#include <dflash/train.h>
#include <stdlib.h>
#include <string.h>

#include "seq.h"
#include "core/internal.h"
#include "testutil.h"
#include "core/bf16.h"

static const char *CFG =
    "{\"hidden_size\": 16, \"intermediate_size\": 24, \"num_hidden_layers\": 2,"
    "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 4, \"vocab_size\": 31,"
    "\"num_target_layers\": 8, \"block_size\": 4, \"dflash_config\": {\"mask_token_id\": 30,"
    "\"target_layer_ids\": [1, 5]}}";

static float *embed(void) {
  float *e = malloc(31 * 16 * sizeof *e);
  for (int i = 0; i < 31 * 16; i++) e[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
  return e;
}

/* optimizer: dflash_optimizer (Muon keeps its momentum where AdamW keeps adam_m). */
static dflash_trainer *make_with(uint64_t seed, const float *E, int32_t optimizer) {
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  ck_assert_ok(dflash_drafter_config_parse(CFG, strlen(CFG), "cfg", &cfg));
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.seed = seed;
  o.total_steps = 10;
  o.lr = 1e-2;
  o.n_threads = 2;
  o.optimizer = optimizer;
  dflash_trainer *t;
  ck_assert_ok(dflash_trainer_create(&cfg, E, E, &o, &t));
  return t;
}

static dflash_trainer *make(uint64_t seed, const float *E) {
  return make_with(seed, E, DFLASH_OPTIMIZER_ADAMW);
}

static float *all_params(dflash_trainer *t, size_t *total) {
  size_t n = 0, k = dflash_trainer_param_count(t), numel;
  for (size_t i = 0; i < k; i++)
    dflash_trainer_param_info(t, i, NULL, NULL, NULL, &numel), n += numel;
  float *out = malloc(n * sizeof *out), *p = out;
  for (size_t i = 0; i < k; i++) {
    const char *name;
    dflash_trainer_param_info(t, i, &name, NULL, NULL, &numel);
    ck_assert_ok(dflash_trainer_get_param(t, name, p, numel));
    p += numel;
  }
  *total = n;
  return out;
}

START_TEST(save_load_round_trip) {
  char *dir = df_test_tmpdir();
  float *E = embed();
  dflash_trainer *a = make(1, E), *b = make(2, E);
  char *ckpt = df_path_join(dir, "ckpt");
  ck_assert_ok(dflash_trainer_save(a, ckpt, 0));
  size_t n, n2;
  float *pa = all_params(a, &n), *pb = all_params(b, &n2);
  ck_assert(memcmp(pa, pb, n * 4) != 0);
  free(pb);
  ck_assert_ok(dflash_trainer_load(b, ckpt));
  pb = all_params(b, &n2);
  ck_assert_mem_eq(pa, pb, n * 4);
  /* config.json reads back as the same config; names are the spec's. */
  char *cfgpath = df_path_join(ckpt, "config.json");
  dflash_drafter_config c1 = {.struct_size = sizeof c1}, c2 = {.struct_size = sizeof c2};
  ck_assert_ok(dflash_drafter_config_load(cfgpath, &c1));
  ck_assert_ok(dflash_drafter_config_parse(CFG, strlen(CFG), "cfg", &c2));
  ck_assert_mem_eq(&c1, &c2, sizeof c1);
  dflash_safetensors *st;
  ck_assert_ok(dflash_safetensors_open(ckpt, &st));
  dflash_tensor t = {.struct_size = sizeof t};
  ck_assert_ok(dflash_safetensors_find(st, "layers.1.self_attn.q_norm.weight", &t));
  ck_assert_ok(dflash_safetensors_find(st, "fc.weight", &t));
  ck_assert_int_eq(t.shape[0], 16);
  ck_assert_int_eq(t.shape[1], 32);
  dflash_safetensors_free(st);
  /* bf16: loads back rounded to nearest even. */
  ck_assert_ok(dflash_trainer_save(a, ckpt, 1));
  ck_assert_ok(dflash_trainer_load(b, ckpt));
  free(pb);
  pb = all_params(b, &n2);
  for (size_t i = 0; i < n; i++) ck_assert_float_eq(pb[i], df_bf16_to_f32(df_f32_to_bf16(pa[i])));
  free(pa), free(pb), free(cfgpath), free(ckpt), free(E);
  dflash_trainer_free(a);
  dflash_trainer_free(b);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(load_reports_missing_tensor) {
  char *dir = df_test_tmpdir();
  char *path = df_path_join(dir, "partial.safetensors");
  dflash_safetensors_writer *w;
  ck_assert_ok(dflash_safetensors_writer_create(path, &w));
  int64_t shape[2] = {16, 32};
  ck_assert_ok(dflash_safetensors_writer_declare(w, "fc.weight", DFLASH_DTYPE_F32, 2, shape));
  float z[512] = {0};
  ck_assert_ok(dflash_safetensors_writer_write(w, z, sizeof z));
  ck_assert_ok(dflash_safetensors_writer_commit(w));
  dflash_safetensors_writer_free(w);
  float *E = embed();
  dflash_trainer *t = make(1, E);
  ck_assert_status(dflash_trainer_load(t, path), DFLASH_E_NOT_FOUND, "hidden_norm.weight");
  dflash_trainer_free(t);
  free(E), free(path);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* Train 6 steps; separately train 3, save state, restore into a fresh
 * trainer, train 3 more: losses and parameters identical bit for bit. */
static double train_steps(dflash_trainer *t, int from, int to) {
  int32_t ids[24];
  uint8_t mask[24];
  float hid[24 * 32];
  double last = 0;
  for (int s = from; s < to; s++) {
    for (int i = 0; i < 24; i++) ids[i] = (i * 5 + s) % 30, mask[i] = i > 2;
    for (int i = 0; i < 24 * 32; i++) hid[i] = (float)(((i + s) * 17) % 29) / 14.0f - 1.0f;
    int32_t anc[8], n;
    ck_assert_ok(dflash_anchors_sample(mask, 24, 4, 8, 5, (uint64_t)s, anc, &n));
    double loss, norm, lr;
    ck_assert_ok(dflash_trainer_forward_backward(t, SEQ(ids, mask, 24, hid, anc, n), &loss));
    ck_assert_ok(dflash_trainer_step(t, &norm, &lr));
    last = loss;
  }
  return last;
}

/* _i: dflash_optimizer; Muon's momentum travels as adam_m, so its resume is exact too. */
START_TEST(resume_is_exact) {
  char *dir = df_test_tmpdir();
  char *state = df_path_join(dir, "state.safetensors");
  float *E = embed();
  dflash_trainer *full = make_with(3, E, _i), *first = make_with(3, E, _i),
                 *resumed = make_with(99, E, _i);
  double l_full = train_steps(full, 0, 6);
  train_steps(first, 0, 3);
  const char blob[] = "epoch=0 pos=3";
  ck_assert_ok(dflash_trainer_save_state(first, state, blob, sizeof blob));
  size_t len = 0;
  ck_assert_ok(dflash_trainer_load_state(resumed, state, NULL, 0, &len));
  ck_assert_uint_eq(len, sizeof blob);
  char back[64];
  len = 0;
  ck_assert_int_eq(dflash_trainer_load_state(resumed, state, back, sizeof blob - 1, &len),
                   DFLASH_E_BUFFER);
  ck_assert_uint_eq(len, sizeof blob);
  ck_assert_ok(dflash_trainer_load_state(resumed, state, back, sizeof back, &len));
  ck_assert_str_eq(back, blob);
  ck_assert_int_eq(dflash_trainer_step_count(resumed), 3);
  double l_res = train_steps(resumed, 3, 6);
  ck_assert_double_eq(l_full, l_res);
  size_t n;
  float *pf = all_params(full, &n), *pr = all_params(resumed, &n);
  ck_assert_mem_eq(pf, pr, n * 4);
  free(pf), free(pr), free(E), free(state);
  dflash_trainer_free(full), dflash_trainer_free(first), dflash_trainer_free(resumed);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

TCase *tc_checkpoint(void) {
  TCase *tc = tcase_create("checkpoint");
  tcase_add_test(tc, save_load_round_trip);
  tcase_add_test(tc, load_reports_missing_tensor);
  tcase_add_loop_test(tc, resume_is_exact, DFLASH_OPTIMIZER_ADAMW, DFLASH_OPTIMIZER_MUON + 1);
  return tc;
}
