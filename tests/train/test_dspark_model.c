/* DSpark drafters through the trainer on the CPU (the whole-model gradients against torch are
 * oracle_model_dspark.py): the tensor table under the spec's checkpoint names, a checkpoint
 * that saves and loads them, training that lowers the loss, the anchor rule of
 * spec/dspark.md section 2, the optimizer groups, and the refusals of the paths without
 * DSpark (the CUDA backend, its plan; evaluation is test_dspark_eval.c's). */
#include <dflash/dataset.h>
#include <dflash/experimental.h>
#include <dflash/safetensors.h>
#include <dflash/train.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "seq.h"
#include "synth.h"
#include "testutil.h"
#include "train/backend.h"
#include "train/cuda/dfcuda.h"
#include "train/trainer.h"

enum { H = 16, V = 37, L = 1, B = 4, RK = 5, S = 24, KH = 2 * H };

static void config(dflash_drafter_config *c, int conf) {
  dflash_drafter_config_default(c);
  c->hidden_size = H, c->intermediate_size = 24, c->num_hidden_layers = L;
  c->num_attention_heads = 2, c->num_key_value_heads = 1, c->head_dim = 8, c->vocab_size = V;
  c->num_target_layers = 8, c->block_size = B, c->mask_token_id = V - 1;
  c->n_target_layer_ids = 2, c->target_layer_ids[0] = 2, c->target_layer_ids[1] = 5;
  c->tie_word_embeddings = 0;
  c->dspark = 1, c->markov_rank = RK, c->confidence_head = conf;
}

static float wave(size_t i, int k) { return sinf(0.37f * (float)i + (float)k) * 0.8f; }

static dflash_status make(int backend, int conf, int optimizer, dflash_trainer **t) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  config(&c, conf);
  static float E[V * H], Hd[V * H];
  for (size_t i = 0; i < (size_t)V * H; i++) E[i] = wave(i, 1), Hd[i] = wave(i, 2);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.backend = backend, o.seed = 3, o.lr = 1e-2, o.warmup_ratio = 0, o.vocab_chunk = 8;
  o.optimizer = optimizer, o.n_threads = 2;
  return dflash_trainer_create(&c, E, Hd, &o, t);
}

/* One fixed training sequence: ids, mask, hidden rows, the target's final state. */
typedef struct {
  int32_t ids[S], anchors[4];
  uint8_t mask[S];
  float hidden[S * KH], final[S * H];
} seq_t;

static void make_seq(seq_t *q) {
  for (int i = 0; i < S; i++) q->ids[i] = (7 * i + 3) % (V - 1), q->mask[i] = i >= 2;
  for (int i = 0; i < S * KH; i++) q->hidden[i] = wave((size_t)i, 3);
  for (int i = 0; i < S * H; i++) q->final[i] = wave((size_t)i, 4);
  const int32_t a[4] = {2, 9, 15, 22}; /* 22: only slot 0 (predicting 23) is in the sequence */
  memcpy(q->anchors, a, sizeof a);
}

static dflash_sample sample_of(const seq_t *q) {
  return (dflash_sample){.struct_size = sizeof(dflash_sample),
                         .input_ids = q->ids,
                         .loss_mask = q->mask,
                         .len = S,
                         .hidden = q->hidden,
                         .anchors = q->anchors,
                         .n_anchors = 4,
                         .target_final = q->final};
}

/* The spec's section 5 names and shapes after DFlash 1's tensors; the bias starts at 0. */
START_TEST(dspark_tensors_named_as_the_spec) {
  dflash_trainer *t;
  ck_assert_ok(make(DFLASH_BACKEND_CPU, 1, DFLASH_OPTIMIZER_ADAMW, &t));
  size_t n1 = 3 + 11 * L;
  ck_assert_uint_eq(dflash_trainer_param_count(t), n1 + 4);
  static const struct {
    const char *name;
    int64_t d0, d1;
  } want[] = {{"markov_head.markov_w1.weight", V, RK},
              {"markov_head.markov_w2.weight", V, RK},
              {"confidence_head.proj.weight", 1, H + RK},
              {"confidence_head.proj.bias", 1, 1}};
  for (size_t i = 0; i < 4; i++) {
    const char *name;
    int32_t nd;
    int64_t shape[2];
    size_t numel;
    ck_assert_ok(dflash_trainer_param_info(t, n1 + i, &name, &nd, shape, &numel));
    ck_assert_str_eq(name, want[i].name);
    ck_assert_int_eq(shape[0], want[i].d0);
    ck_assert_int_eq(shape[1], want[i].d1);
  }
  float bias = 1;
  ck_assert_ok(dflash_trainer_get_param(t, "confidence_head.proj.bias", &bias, 1));
  ck_assert_float_eq(bias, 0);
  dflash_trainer_free(t);
  /* Without the confidence head: the Markov factors only. */
  ck_assert_ok(make(DFLASH_BACKEND_CPU, 0, DFLASH_OPTIMIZER_ADAMW, &t));
  ck_assert_uint_eq(dflash_trainer_param_count(t), n1 + 2);
  dflash_trainer_free(t);
}
END_TEST

/* Saved under the names the engines load, and loaded back bit for bit. */
START_TEST(dspark_checkpoint_round_trip) {
  char *dir = df_test_tmpdir();
  char *ckpt = df_path_join(dir, "ds");
  dflash_trainer *a, *b;
  ck_assert_ok(make(DFLASH_BACKEND_CPU, 1, DFLASH_OPTIMIZER_ADAMW, &a));
  ck_assert_ok(make(DFLASH_BACKEND_CPU, 1, DFLASH_OPTIMIZER_ADAMW, &b));
  static float w1[V * RK], cw[H + RK];
  for (int i = 0; i < V * RK; i++) w1[i] = (float)i / 64.0f;
  for (int i = 0; i < H + RK; i++) cw[i] = -(float)i / 8.0f;
  float cb = 0.625f;
  ck_assert_ok(dflash_trainer_set_param(a, "markov_head.markov_w1.weight", w1, V * RK));
  ck_assert_ok(dflash_trainer_set_param(a, "confidence_head.proj.weight", cw, H + RK));
  ck_assert_ok(dflash_trainer_set_param(a, "confidence_head.proj.bias", &cb, 1));
  ck_assert_ok(dflash_trainer_save(a, ckpt, 0));
  dflash_safetensors *st;
  ck_assert_ok(dflash_safetensors_open(ckpt, &st));
  dflash_tensor ten = {.struct_size = sizeof ten};
  ck_assert_ok(dflash_safetensors_find(st, "confidence_head.proj.weight", &ten));
  ck_assert_uint_eq(ten.ndim, 2);
  ck_assert_int_eq(ten.shape[0], 1);
  ck_assert_int_eq(ten.shape[1], H + RK);
  ck_assert_ok(dflash_safetensors_find(st, "markov_head.markov_w2.weight", &ten));
  ck_assert_ok(dflash_safetensors_find(st, "confidence_head.proj.bias", &ten));
  dflash_safetensors_free(st);
  ck_assert_ok(dflash_trainer_load(b, ckpt));
  size_t n = dflash_trainer_param_count(a);
  for (size_t i = 0; i < n; i++) {
    const char *name;
    int32_t nd;
    int64_t shape[2];
    size_t numel;
    ck_assert_ok(dflash_trainer_param_info(a, i, &name, &nd, shape, &numel));
    float *pa = malloc(numel * sizeof *pa), *pb = malloc(numel * sizeof *pb);
    ck_assert_ok(dflash_trainer_get_param(a, name, pa, numel));
    ck_assert_ok(dflash_trainer_get_param(b, name, pb, numel));
    ck_assert_msg(!memcmp(pa, pb, numel * sizeof *pa), "%s differs after the round trip", name);
    free(pa), free(pb);
  }
  char *cfg = df_path_join(ckpt, "config.json");
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(dflash_drafter_config_load(cfg, &c));
  ck_assert_int_eq(c.dspark, 1);
  ck_assert_int_eq(c.markov_rank, RK);
  ck_assert_int_eq(c.confidence_head, 1);
  free(cfg);
  dflash_trainer_free(a);
  dflash_trainer_free(b);
  free(ckpt);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* The normal trainer loop (accumulate, step) lowers the DSpark loss, with AdamW and Muon;
 * forward_backward's loss equals accumulate's sums. */
static void trains_with(int optimizer) {
  dflash_trainer *t;
  ck_assert_ok(make(DFLASH_BACKEND_CPU, 1, optimizer, &t));
  static seq_t q;
  make_seq(&q);
  dflash_sample s = sample_of(&q);
  double first = 0, loss = 0, w = 0;
  ck_assert_ok(dflash_trainer_weight_sum(t, &s, &w));
  /* anchors 2, 9, 15 give 4 slots each, 22 one: 3 (1 + e^-1/4 + e^-1/2 + e^-3/4) + 1 */
  ck_assert_double_eq_tol(w, 3 * (1 + exp(-0.25) + exp(-0.5) + exp(-0.75)) + 1, 1e-12);
  ck_assert_ok(dflash_trainer_forward_backward(t, &s, &first));
  for (int step = 0; step < 30; step++) {
    double ls, ws;
    ck_assert_ok(dflash_trainer_zero_grad(t));
    ck_assert_ok(dflash_trainer_accumulate(t, &s, 1.0 / w));
    ck_assert_ok(dflash_trainer_collect(t, &ls, &ws));
    ck_assert_double_eq_tol(ws, w, 1e-12);
    if (step == 0) ck_assert_double_eq_tol(ls / ws, first, 1e-9 * first);
    ck_assert_ok(dflash_trainer_step(t, NULL, NULL));
    loss = ls / ws;
  }
  ck_assert_msg(loss < 0.8 * first, "loss %g after 30 steps, %g before", loss, first);
  dflash_trainer_free(t);
}

START_TEST(dspark_trains_adamw) { trains_with(DFLASH_OPTIMIZER_ADAMW); }
END_TEST

START_TEST(dspark_trains_muon) { trains_with(DFLASH_OPTIMIZER_MUON); }
END_TEST

/* Muon takes none of DSpark's tensors (optim_muon.c says why); AdamW keeps them. */
START_TEST(dspark_tensors_stay_with_adamw) {
  dflash_trainer *t;
  ck_assert_ok(make(DFLASH_BACKEND_CPU, 1, DFLASH_OPTIMIZER_MUON, &t));
  for (size_t i = 0; i < t->m.n_tensors; i++) {
    const df_tensor_info *ti = &t->m.tensors[i];
    bool ds = !strncmp(ti->name, "markov_head.", 12) || !strncmp(ti->name, "confidence_head.", 16);
    if (ds) ck_assert_msg(!df_muon_takes(ti), "Muon takes %s", ti->name);
  }
  ck_assert(df_muon_takes(df_model_find(&t->m, "fc.weight")));
  dflash_trainer_free(t);
}
END_TEST

/* spec/dspark.md section 2: anchors a <= S - 2 with loss_mask[a] and loss_mask[a + 1], the
 * block free to leave the sequence; DFlash's rule is unchanged. */
START_TEST(dspark_anchor_rule) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  config(&c, 1);
  enum { N = 12 };
  const uint8_t mask[N] = {0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1};
  int32_t out[N], n = 0;
  ck_assert_ok(df_anchors_sample_cfg(&c, mask, N, N, 7, 0, out, &n));
  const int32_t want[] = {1, 2, 5, 8, 9, 10}; /* 10 = S - 2; its block leaves the sequence */
  ck_assert_int_eq(n, 6);
  for (int i = 0; i < n; i++) ck_assert_int_eq(out[i], want[i]);
  /* Few supervised tokens still give anchors (DFlash asks 2 B of them). */
  const uint8_t few[5] = {0, 0, 1, 1, 0};
  ck_assert_ok(df_anchors_sample_cfg(&c, few, 5, 4, 7, 0, out, &n));
  ck_assert_int_eq(n, 1);
  ck_assert_int_eq(out[0], 2);
  /* DFlash: the block must fit (a + B <= S). */
  c.dspark = 0, c.markov_rank = 0, c.confidence_head = 0;
  ck_assert_ok(df_anchors_sample_cfg(&c, mask, N, N, 7, 0, out, &n));
  const int32_t want_d[] = {1, 2, 5, 8};
  ck_assert_int_eq(n, 4);
  for (int i = 0; i < n; i++) ck_assert_int_eq(out[i], want_d[i]);
  int32_t pub[N], np = 0;
  ck_assert_ok(dflash_anchors_sample(mask, N, B, N, 7, 0, pub, &np));
  ck_assert_int_eq(np, n);
  ck_assert_mem_eq(pub, out, sizeof(int32_t) * (size_t)n);
}
END_TEST

/* A pruned draft vocabulary is no longer refused on CUDA (tests/gpu/emu_dspark.c trains it
 * there): the trainer asks for a device (here, without one or without CUDA in the build, that
 * is the only failure, not a refusal of DSpark), and the plan counts W2's V_d rows and the
 * pruned buffers (df_cu_dspark_bytes: the logits V_d wide but the target's V wide, the kept
 * rows of the head and their ids). The full vocabulary's plan counts W1, W2 and the
 * confidence head, and DSpark's buffers on top of the DFlash arena. What stays refused
 * (dflash_trainer_propose on CUDA) is tested where a device exists (emu_dspark.c). */
START_TEST(dspark_refused_where_not_implemented) {
  dflash_trainer *t = NULL;
  dflash_drafter_config c = {.struct_size = sizeof c};
  config(&c, 1);
  enum { VD = V - 10 };
  c.draft_vocab_size = VD;
  static float E[V * H], Hd[V * H];
  for (size_t i = 0; i < (size_t)V * H; i++) E[i] = wave(i, 1), Hd[i] = wave(i, 2);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.backend = DFLASH_BACKEND_CUDA;
  dflash_status st = dflash_trainer_create(&c, E, Hd, &o, &t);
  ck_assert_msg(st == DFLASH_OK || !strstr(dflash_last_error(), "DSpark"),
                "a pruned DSpark drafter on CUDA: %s", dflash_last_error());
  dflash_trainer_free(t);
  t = NULL;
  dflash_train_plan_options po;
  dflash_train_plan_options_default(&po);
  po.num_anchors = 8, po.seq_len = 64, po.vocab_chunk = 16;
  dflash_train_plan pp = {.struct_size = sizeof pp}, p = {.struct_size = sizeof p};
  ck_assert_ok(dflash_train_plan_compute(&c, &po, &pp));
  c.draft_vocab_size = 0;
  ck_assert_ok(dflash_train_plan_compute(&c, &po, &p));
  dflash_drafter_config d = c;
  d.dspark = 0, d.markov_rank = 0, d.confidence_head = 0;
  dflash_train_plan pd = {.struct_size = sizeof pd};
  ck_assert_ok(dflash_train_plan_compute(&d, &po, &pd));
  ck_assert_uint_eq(p.n_params - pd.n_params, (uint64_t)2 * V * RK + H + RK + 1);
  ck_assert_uint_ge(p.activations - pd.activations, df_cu_dspark_bytes((size_t)8 * B, H, V, V, RK));
  /* Pruned: W2 is [V_d, r]; the arena is the same, DSpark's buffers are the pruned ones. */
  ck_assert_uint_eq(pp.n_params - pd.n_params, (uint64_t)(V + VD) * RK + H + RK + 1);
  ck_assert_uint_eq(pp.activations + df_cu_dspark_bytes((size_t)8 * B, H, V, V, RK),
                    p.activations + df_cu_dspark_bytes((size_t)8 * B, H, V, VD, RK));
  /* fp32 draft logits and bf16 d(logits) V_d wide a pass; the head's kept rows and ids */
  ck_assert_uint_eq(pp.activations + (uint64_t)DF_CU_DSPARK_ROWS * (V - VD) * (4 + 2),
                    p.activations + (uint64_t)VD * (2 * H + 4));
  ck_assert_uint_eq(pp.frozen, p.frozen);
  ck_assert_ok(make(DFLASH_BACKEND_CPU, 1, DFLASH_OPTIMIZER_ADAMW, &t));
  static seq_t q;
  make_seq(&q);
  dflash_sample s = sample_of(&q);
  /* propose drafts B tokens a block, slot 0 included */
  int32_t pred[4 * B];
  for (int i = 0; i < 4 * B; i++) pred[i] = -1;
  ck_assert_ok(dflash_trainer_propose(t, &s, NULL, pred, NULL));
  for (int i = 0; i < 4 * B; i++) ck_assert(pred[i] >= 0 && pred[i] < V);
  dflash_trainer_free(t);
}
END_TEST

/* A DSpark config.json for synth_small_run's world (vocabulary 17, 8 target layers); `extra`
 * goes in before dflash_config. */
#define SMALL_RUN_DSPARK(extra)                                                              \
  "{\"architectures\": [\"Qwen3DSparkModel\"], \"hidden_size\": 32, \"intermediate_size\": " \
  "64, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, "   \
  "\"head_dim\": 8, \"vocab_size\": 17, \"num_target_layers\": 8, \"block_size\": 4, "       \
  "\"tie_word_embeddings\": false, \"markov_rank\": 4, \"enable_confidence_head\": true, "   \
  "\"sample_from_anchor\": true, " extra                                                     \
  "\"dflash_config\": {\"mask_token_id\": 16, \"target_layer_ids\": [3]}}"

static void count_dspark_warning(dflash_log_level level, const char *msg, void *user) {
  if (level == DFLASH_LOG_WARN && strstr(msg, "DSpark drafter") && strstr(msg, "0.1 CE alone"))
    ++*(int *)user;
}

/* dflash_train_run over a store (which holds no target final state) trains a DSpark drafter
 * on 0.1 CE, says so once, and writes its heads into the checkpoint. */
START_TEST(dspark_run_trains_from_a_store) {
  dflash_train_run_options o;
  char *out;
  char *root = synth_small_run(&o, &out);
  static const char cfg[] = SMALL_RUN_DSPARK("");
  ck_assert(df_test_write(o.config_path, cfg, sizeof cfg - 1));
  int warned = 0;
  dflash_set_log_callback(count_dspark_warning, &warned, DFLASH_LOG_WARN);
  dflash_status st = dflash_train_run(&o, NULL);
  dflash_set_log_callback(NULL, NULL, DFLASH_LOG_ERROR);
  ck_assert_ok(st);
  ck_assert_int_eq(warned, 1);
  synth_metric m[64];
  size_t n = synth_metrics(out, m, 64);
  ck_assert_uint_gt(n, 0);
  for (size_t i = 0; i < n; i++) ck_assert(isfinite(m[i].loss) && m[i].loss > 0);
  char *model = synth_path(out, "model.safetensors");
  dflash_safetensors *sf;
  ck_assert_ok(dflash_safetensors_open(model, &sf));
  dflash_tensor ten = {.struct_size = sizeof ten};
  ck_assert_ok(dflash_safetensors_find(sf, "markov_head.markov_w1.weight", &ten));
  ck_assert_int_eq(ten.shape[0], 17);
  ck_assert_int_eq(ten.shape[1], 4);
  ck_assert_ok(dflash_safetensors_find(sf, "confidence_head.proj.weight", &ten));
  dflash_safetensors_free(sf);
  free(model);
  df_test_rmtree(root);
  free(root);
}
END_TEST

static void count_coverage(dflash_log_level level, const char *msg, void *user) {
  if (level == DFLASH_LOG_INFO && strstr(msg, "draft vocabulary 8 of 17 tokens covers"))
    ++*(int *)user;
}

/* A pruned draft vocabulary picked from a run's dataset (df_trainer_draft_vocab_from_data):
 * the kept ids are dflash_draft_vocab_from_dataset's, the coverage is logged, and the
 * trainer then trains; dflash_train_run picks the same ids (its d2t in the checkpoint). */
START_TEST(dspark_pruned_vocabulary_from_data) {
  dflash_train_run_options o;
  char *out;
  char *root = synth_small_run(&o, &out);
  static const char cfg[] = SMALL_RUN_DSPARK("\"draft_vocab_size\": 8, ");
  ck_assert(df_test_write(o.config_path, cfg, sizeof cfg - 1));
  dflash_drafter_config c = {.struct_size = sizeof c};
  ck_assert_ok(dflash_drafter_config_parse(cfg, sizeof cfg - 1, "t.json", &c));
  ck_assert_int_eq(c.draft_vocab_size, 8);
  int32_t want[8], got[8], n = 0;
  double cov_want = 0, cov = 0;
  dflash_dataset *ds;
  ck_assert_ok(dflash_dataset_open(o.data_dir, &ds));
  ck_assert_ok(dflash_draft_vocab_from_dataset(ds, 17, 8, want, &cov_want));
  dflash_dataset_free(ds);
  ck_assert(cov_want > 0 && cov_want <= 1);
  static float E[17 * 32], Hd[17 * 32];
  for (size_t i = 0; i < 17 * 32; i++) E[i] = wave(i, 1), Hd[i] = wave(i, 2);
  dflash_trainer *t;
  ck_assert_ok(dflash_trainer_create(&c, E, Hd, NULL, &t));
  int logged = 0;
  dflash_set_log_callback(count_coverage, &logged, DFLASH_LOG_INFO);
  dflash_status st = df_trainer_draft_vocab_from_data(t, o.data_dir, &cov);
  dflash_set_log_callback(NULL, NULL, DFLASH_LOG_ERROR);
  ck_assert_ok(st);
  ck_assert_int_eq(logged, 1);
  ck_assert_double_eq(cov, cov_want);
  ck_assert_ok(dflash_trainer_draft_vocab(t, got, 8, &n));
  ck_assert_int_eq(n, 8);
  ck_assert_mem_eq(got, want, sizeof want);
  ck_assert_status(df_trainer_draft_vocab_from_data(t, NULL, NULL), DFLASH_E_CONFIG,
                   "this run has no dataset");
  dflash_trainer_free(t);
  /* The run picks the same ids from its dataset and writes them as d2t offsets. */
  ck_assert_ok(dflash_train_run(&o, NULL));
  char *model = synth_path(out, "model.safetensors");
  dflash_safetensors *sf;
  ck_assert_ok(dflash_safetensors_open(model, &sf));
  dflash_tensor ten = {.struct_size = sizeof ten};
  ck_assert_ok(dflash_safetensors_find(sf, "d2t", &ten));
  int64_t d2t[8]; /* a safetensors tensor's data need not be 8-byte aligned */
  memcpy(d2t, ten.data, sizeof d2t);
  for (int i = 0; i < 8; i++) ck_assert_int_eq(d2t[i] + i, want[i]);
  dflash_safetensors_free(sf);
  free(model);
  df_test_rmtree(root);
  free(root);
}
END_TEST

TCase *tc_dspark_model(void) {
  TCase *tc = tcase_create("dspark_model");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, dspark_tensors_named_as_the_spec);
  tcase_add_test(tc, dspark_checkpoint_round_trip);
  tcase_add_test(tc, dspark_trains_adamw);
  tcase_add_test(tc, dspark_trains_muon);
  tcase_add_test(tc, dspark_tensors_stay_with_adamw);
  tcase_add_test(tc, dspark_anchor_rule);
  tcase_add_test(tc, dspark_refused_where_not_implemented);
  tcase_add_test(tc, dspark_run_trains_from_a_store);
  tcase_add_test(tc, dspark_pruned_vocabulary_from_data);
  return tc;
}
