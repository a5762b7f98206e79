/* Evaluation of a DSpark drafter (eval.c; the float64 torch comparison on random weights is
 * oracle_eval_dspark.py): a drafter built by hand so that its greedy Markov chain counts,
 * d = succ(prev) = prev + 1 (mod 11), whatever the backbone says (the frozen LM head is 0,
 * so every logit is the Markov bias alpha(prev) * [v = succ(prev)]). Its walk, acceptance,
 * per-draft accuracy, probabilistic tau and confidence calibration are then checked against
 * numbers worked out here from that rule alone, with and without a pruned draft vocabulary
 * and a store without the target's final state. */
#include <dflash/dataset.h>
#include <dflash/hidden.h>
#include <dflash/train.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "seq.h"
#include "synth.h"
#include "testutil.h"

/* Vocabulary 12: tokens 0..10 and the mask 11; rank V so that W1 is the identity. */
enum { H = 8, V = 12, NT = 11, B = 4, RK = V, S = 17, P0 = 2 };
/* The Markov bias of succ(prev) after prev: its own per prev, so that the probabilistic tau
 * tells which previous token each slot read. */
static double alpha(int32_t prev) { return 2.0 + 0.5 * (double)(prev % 4); }

/* Prompt 5 9, then the answer [2, 17) (positions in the comments of the tests). */
static const int32_t IDS[S] = {5, 9, 0, 1, 2, 7, 8, 9, 10, 0, 4, 5, 6, 7, 3, 4, 5};

static int32_t succ(int32_t v) { return (v + 1) % NT; }

/* The confidence head reads only the Markov embedding W1[prev] = e_prev: logit w_prev. */
static double conf_logit(int32_t prev) { return 0.5 * (double)(prev % 3) - 0.4; }

static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* `pruned`: the draft vocabulary leaves out token 8 (V_d 11), so after 7 the chain cannot
 * draft the data's 8 and takes the first kept id (all its logits are 0): 0. */
static const int32_t KEPT[NT] = {0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11};

static int32_t chain_next(int32_t prev, int pruned) {
  int32_t s = succ(prev);
  return pruned && s == 8 ? 0 : s;
}

static dflash_trainer *make(int pruned) {
  char cfg_text[1024];
  snprintf(cfg_text, sizeof cfg_text,
           "{\"architectures\": [\"Qwen3DSparkModel\"], \"hidden_size\": %d, "
           "\"intermediate_size\": 16, \"num_hidden_layers\": 1, \"num_attention_heads\": 2, "
           "\"num_key_value_heads\": 1, \"head_dim\": 4, \"vocab_size\": %d, "
           "\"num_target_layers\": 4, \"block_size\": %d, \"tie_word_embeddings\": false, "
           "\"markov_rank\": %d, \"enable_confidence_head\": true, \"sample_from_anchor\": true, "
           "%s\"dflash_config\": {\"mask_token_id\": %d, \"target_layer_ids\": [1]}}",
           H, V, B, RK, pruned ? "\"draft_vocab_size\": 11, " : "", V - 1);
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  ck_assert_ok(dflash_drafter_config_parse(cfg_text, strlen(cfg_text), "cfg", &cfg));
  static float E[V * H], Z[V * H];
  for (int i = 0; i < V * H; i++) E[i] = sinf(0.7f * (float)i), Z[i] = 0;
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.n_threads = 1, o.seed = 2;
  dflash_trainer *t;
  ck_assert_ok(dflash_trainer_create(&cfg, E, Z, &o, &t));
  int Vd = pruned ? NT : V;
  if (pruned) ck_assert_ok(dflash_trainer_set_draft_vocab(t, KEPT, NT));
  static float w1[V * RK], w2[V * RK], cw[H + RK], cb[1];
  memset(w1, 0, sizeof w1), memset(w2, 0, sizeof w2), memset(cw, 0, sizeof cw);
  for (int v = 0; v < V; v++) w1[v * RK + v] = 1;
  /* W2 row i (draft id kept[i]) reads rank column c (= prev) when kept[i] = succ(c) */
  for (int i = 0; i < Vd; i++)
    for (int c = 0; c < V; c++)
      if ((pruned ? KEPT[i] : i) == succ(c)) w2[i * RK + c] = (float)alpha(c);
  for (int c = 0; c < V; c++) cw[H + c] = (float)conf_logit(c);
  cb[0] = 0;
  ck_assert_ok(dflash_trainer_set_param(t, "markov_head.markov_w1.weight", w1, V * RK));
  ck_assert_ok(dflash_trainer_set_param(t, "markov_head.markov_w2.weight", w2, (size_t)Vd * RK));
  ck_assert_ok(dflash_trainer_set_param(t, "confidence_head.proj.weight", cw, H + RK));
  ck_assert_ok(dflash_trainer_set_param(t, "confidence_head.proj.bias", cb, 1));
  return t;
}

static float g_hidden[S * H], g_final[S * H];

static void fill_rows(void) {
  for (int i = 0; i < S * H; i++) g_hidden[i] = cosf(0.3f * (float)i), g_final[i] = sinf(0.9f * i);
}

/* The dataset (one sample, prompt masked) and its store, with or without the final state. */
static void write_store(const char *root, int final) {
  char *data = synth_path(root, "data"), *hid = synth_path(root, "hidden");
  dflash_dataset_writer *dw;
  ck_assert_ok(dflash_dataset_writer_create(data, NULL, &dw));
  uint8_t mask[S];
  for (int i = 0; i < S; i++) mask[i] = i >= P0;
  ck_assert_ok(dflash_dataset_writer_add(dw, "s0", IDS, mask, S));
  ck_assert_ok(dflash_dataset_writer_commit(dw));
  dflash_dataset_writer_free(dw);
  dflash_hidden_writer_options ho;
  dflash_hidden_writer_options_default(&ho);
  ho.final_state = final;
  dflash_hidden_writer *hw;
  ck_assert_ok(dflash_hidden_writer_create(hid, 1, H, &ho, &hw));
  dflash_hidden_rows r;
  dflash_hidden_rows_default(&r);
  r.len = S, r.states = g_hidden, r.final_state = final ? g_final : NULL;
  ck_assert_ok(dflash_hidden_writer_add(hw, "s0", &r));
  ck_assert_ok(dflash_hidden_writer_commit(hw));
  dflash_hidden_writer_free(hw);
  free(data), free(hid);
}

/* What the rule gives, worked out independently of eval.c: the greedy drafts at anchor a
 * (the chain from IDS[a]), the acceptance against the data (stops at the end S), each
 * block's probabilistic tau (teacher-forced: prev = IDS[a + k]; q is uniform over V, the
 * frozen head being 0), the walk and the confidence at the walk's reached slots. */
typedef struct expect {
  int32_t accept[S];
  double ptau[S];
  int64_t hits[B], scored[B], steps, tokens, hist[B + 1];
  double cpred[B], cobs[B];
  int64_t cn[B];
  double bin_p[10], bin_o[10];
  int64_t bin_n[10];
} expect;

/* sum_v min(p_v, 1/V) for p = softmax of the Markov bias after prev over the draft ids. */
static double accept_prob(int32_t prev, int pruned) {
  int Vd = pruned ? NT : V;
  bool hit = !(pruned && succ(prev) == 8); /* succ(prev) among the draft ids */
  double ea = exp((double)(float)alpha(prev)), zs = hit ? ea + (Vd - 1) : Vd;
  double sum = 0;
  for (int i = 0; i < Vd; i++) {
    int32_t id = pruned ? KEPT[i] : i;
    double p = (hit && id == succ(prev) ? ea : 1.0) / zs;
    sum += fmin(p, 1.0 / V);
  }
  return sum;
}

static void work_out(int pruned, expect *x) {
  memset(x, 0, sizeof *x);
  for (int a = 0; a < S; a++) x->accept[a] = -1;
  for (int a = P0; a < S - 1; a++) {
    int32_t prev = IDS[a];
    int acc = 0;
    bool run = true;
    double tau = 1, prod = 1;
    for (int j = 0; j < B && a + j + 1 < S; j++) {
      int32_t d = chain_next(prev, pruned);
      bool ok = d == IDS[a + j + 1];
      x->hits[j] += ok, x->scored[j]++;
      if (run && ok) acc++;
      else run = false;
      prev = d;
      prod *= accept_prob(IDS[a + j], pruned);
      tau += prod;
    }
    x->accept[a] = acc, x->ptau[a] = tau;
  }
  for (int p = P0; p < S - 1;) {
    int gain = x->accept[p] + 1 < S - 1 - p ? x->accept[p] + 1 : S - 1 - p;
    int32_t prev = IDS[p];
    for (int j = 0; j < B && j <= x->accept[p] && p + j + 1 < S; j++) {
      double c = sigmoid(conf_logit(prev));
      double ok = j < x->accept[p];
      int bin = (int)(c * 10);
      x->cpred[j] += c, x->cobs[j] += ok, x->cn[j]++;
      x->bin_p[bin] += c, x->bin_o[bin] += ok, x->bin_n[bin]++;
      prev = chain_next(prev, pruned);
    }
    x->hist[gain - 1]++, x->steps++, x->tokens += gain;
    p += gain;
  }
}

static void check_eval(int pruned, int final) {
  fill_rows();
  char *root = df_test_tmpdir();
  write_store(root, final);
  char *data = synth_path(root, "data"), *hid = synth_path(root, "hidden");
  dflash_trainer *t = make(pruned);
  expect x;
  work_out(pruned, &x);
  /* the hand-made drafts themselves, token for token */
  int32_t anchors[S], n = 0, pred[S * B];
  for (int a = P0; a < S - 1; a++) anchors[n++] = a;
  ck_assert_ok(
      dflash_trainer_propose(t, SEQ(IDS, NULL, S, g_hidden, anchors, n), NULL, pred, NULL));
  for (int i = 0; i < n; i++) {
    int32_t prev = IDS[anchors[i]];
    for (int j = 0; j < B; j++) ck_assert_int_eq(pred[i * B + j], prev = chain_next(prev, pruned));
  }
  /* acceptance at each anchor: B drafts a block, counting stops at the end */
  int32_t acc[S];
  ck_assert_ok(dflash_trainer_acceptance(t, SEQ(IDS, NULL, S, g_hidden, anchors, n), acc));
  for (int i = 0; i < n; i++) ck_assert_int_eq(acc[i], x.accept[anchors[i]]);
  double acc_j[B], cp[B], co[B];
  int64_t hist[B + 1], cn[B];
  dflash_eval_walk w;
  dflash_eval_walk_default(&w);
  ck_assert_double_eq(w.prob_tau, -1);
  ck_assert_double_eq(w.conf_ece, -1);
  w.accuracy = acc_j, w.step_hist = hist;
  w.conf_predicted = cp, w.conf_observed = co, w.conf_count = cn;
  ck_assert_ok(dflash_trainer_eval_walk(t, data, hid, &w));
  ck_assert_int_eq(w.steps, x.steps);
  ck_assert_int_eq(w.tokens, x.tokens);
  ck_assert_int_eq(w.tokens, S - 1 - P0);
  ck_assert_double_eq_tol(w.walk_tau, (double)x.tokens / (double)x.steps, 1e-12);
  for (int g = 0; g < B + 1; g++) ck_assert_int_eq(hist[g], x.hist[g]);
  int64_t pos = 0, scored = 0, hits = 0;
  double tau_sum = 0, ptau_sum = 0;
  for (int a = 0; a < S; a++)
    if (x.accept[a] >= 0) pos++, tau_sum += 1 + x.accept[a], ptau_sum += x.ptau[a];
  ck_assert_int_eq(w.positions, pos);
  ck_assert_double_eq_tol(w.position_tau, tau_sum / (double)pos, 1e-12);
  for (int j = 0; j < B; j++) {
    ck_assert_double_eq_tol(acc_j[j], (double)x.hits[j] / (double)x.scored[j], 1e-12);
    scored += x.scored[j], hits += x.hits[j];
  }
  ck_assert_int_eq(w.scored, scored);
  ck_assert_double_eq_tol(w.selector_accuracy, (double)hits / (double)scored, 1e-12);
  ck_assert_double_eq(w.candidate_recall, -1);
  if (final) ck_assert_double_eq_tol(w.prob_tau, ptau_sum / (double)pos, 1e-6);
  else ck_assert(w.prob_tau == -1 && w.prob_tau_se == -1); /* unavailable, the rest stands */
  int64_t all = 0;
  double gap = 0;
  for (int j = 0; j < B; j++) {
    ck_assert_int_eq(cn[j], x.cn[j]);
    ck_assert_double_eq_tol(cp[j], x.cpred[j] / (double)x.cn[j], 1e-6);
    ck_assert_double_eq_tol(co[j], x.cobs[j] / (double)x.cn[j], 1e-12);
  }
  for (int b = 0; b < 10; b++) all += x.bin_n[b], gap += fabs(x.bin_p[b] - x.bin_o[b]);
  ck_assert_double_eq_tol(w.conf_ece, gap / (double)all, 1e-6);
  ck_assert(w.conf_ece > 0);
  /* the sampled-anchor tau: every anchor of the rule a <= S - 2 (64 > their count) */
  dflash_eval ev;
  dflash_eval_default(&ev);
  double acc_s[B];
  ev.accuracy = acc_s;
  ck_assert_ok(dflash_trainer_eval(t, data, hid, &ev));
  ck_assert_int_eq(ev.n_blocks, pos);
  ck_assert_double_eq_tol(ev.tau, tau_sum / (double)pos, 1e-12);
  for (int j = 0; j < B; j++) ck_assert_double_eq_tol(acc_s[j], acc_j[j], 1e-12);
  dflash_trainer_free(t);
  free(data), free(hid);
  df_test_rmtree(root);
  free(root);
}

/* Planned by hand (no pruning): anchor 2 (token 0) drafts 1 2 3 4 against 1 2 7 8: accept 2,
 * gain 3; anchor 5 (7): 8 9 10 0, all right, gain 5; anchor 10 (4): 5 6 7 8 against 5 6 7 3,
 * gain 4; anchor 14 (3): 4 5 and the sequence ends, gain 2: 14 tokens in 4 steps. */
START_TEST(dspark_walk_follows_the_chain) {
  expect x;
  work_out(0, &x);
  ck_assert_int_eq(x.steps, 4);
  ck_assert_int_eq(x.tokens, 14);
  ck_assert_int_eq(x.accept[2], 2);
  ck_assert_int_eq(x.accept[5], 4);
  ck_assert_int_eq(x.accept[10], 3);
  ck_assert_int_eq(x.accept[14], 2);
  /* the chain's own argmax, not the data's token, feeds slot 3 at anchor 2: 4, not 8 (the
   * data's 7 would give 8 = IDS[6], a hit) */
  ck_assert_int_eq(chain_next(chain_next(chain_next(chain_next(IDS[2], 0), 0), 0), 0), 4);
  check_eval(0, 1);
}
END_TEST

/* Pruned (8 left out): anchor 5 (7) drafts 0, not 8: accept 0. */
START_TEST(dspark_walk_pruned_vocabulary) {
  expect x;
  work_out(1, &x);
  ck_assert_int_eq(x.accept[5], 0);
  ck_assert_int_gt(x.steps, 4);
  check_eval(1, 1);
}
END_TEST

/* A store written without final_state: the probabilistic tau is unavailable (-1), the walk
 * and the calibration are the same. */
START_TEST(dspark_eval_without_final_state) { check_eval(0, 0); }
END_TEST

/* dflash_trainer_walk on one sample: B + 1 gains in step_hist. */
START_TEST(dspark_walk_one_sample) {
  fill_rows();
  dflash_trainer *t = make(0);
  expect x;
  work_out(0, &x);
  uint8_t mask[S];
  for (int i = 0; i < S; i++) mask[i] = i >= P0;
  int64_t tokens, steps, hist[B + 1] = {0};
  int32_t accept[S];
  ck_assert_ok(dflash_trainer_walk(t, SEQ(IDS, mask, S, g_hidden, NULL, 0), 0, &tokens, &steps,
                                   accept, hist));
  ck_assert_int_eq(tokens, x.tokens);
  ck_assert_int_eq(steps, x.steps);
  ck_assert_mem_eq(accept, x.accept, sizeof accept);
  ck_assert_mem_eq(hist, x.hist, sizeof hist);
  ck_assert_int_eq(hist[B], 1); /* anchor 5 gained B + 1 = 5 tokens */
  dflash_trainer_free(t);
}
END_TEST

TCase *tc_dspark_eval(void) {
  TCase *tc = tcase_create("dspark_eval");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, dspark_walk_follows_the_chain);
  tcase_add_test(tc, dspark_walk_pruned_vocabulary);
  tcase_add_test(tc, dspark_eval_without_final_state);
  tcase_add_test(tc, dspark_walk_one_sample);
  return tc;
}
