/* The speculative walk (dflash_trainer_walk): on a sequence built so that
 * the drafter's greedy drafts are accepted for a planned number of tokens at
 * each planned anchor, the walk must take exactly the planned steps. */
#include <dflash/experimental.h>
#include <dflash/hidden.h>
#include <dflash/train.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "seq.h"
#include "synth.h"
#include "testutil.h"

static const char *CFG =
    "{\"hidden_size\": 16, \"intermediate_size\": 24, \"num_hidden_layers\": 1,"
    "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 4, \"vocab_size\": 31,"
    "\"num_target_layers\": 8, \"block_size\": 4, \"dflash_config\": {\"mask_token_id\": 30,"
    "\"target_layer_ids\": [1, 5]}}";

enum { S = 90, B = 4, V = 30 /* real tokens; 30 is the mask */, KH = 32 };

static dflash_trainer *make(void) {
  static float E[31 * 16];
  for (int i = 0; i < 31 * 16; i++) E[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  ck_assert_ok(dflash_drafter_config_parse(CFG, strlen(CFG), "cfg", &cfg));
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.seed = 3;
  o.n_threads = 1;
  o.init_std = 0.5; /* varied predictions */
  dflash_trainer *t;
  ck_assert_ok(dflash_trainer_create(&cfg, E, E, &o, &t));
  return t;
}

typedef struct world {
  int32_t ids[S];
  uint8_t mask[S];
  float hidden[S * KH];
  int32_t planned[S]; /* acceptance built in at each walk anchor, -1 elsewhere */
  int64_t steps, tokens;
} world;

/* Prompt 0..9, answers [10, 41) and [52, 90): walk each run left to right,
 * making the drafts at anchor p right for `k` tokens and wrong at k+1. The
 * drafts at p depend only on ids[p] and hidden[< p], which are final by then. */
static void build(dflash_trainer *t, world *w) {
  static const int plan[] = {3, 0, 2, 1, 0, 3, 3, 1, 2, 0, 0, 2};
  srand(11);
  for (int i = 0; i < S; i++) {
    w->ids[i] = rand() % V;
    w->mask[i] = (i >= 10 && i < 41) || i >= 52;
    w->planned[i] = -1;
  }
  for (int i = 0; i < S * KH; i++) w->hidden[i] = (float)(rand() % 2001) / 1000.0f - 1.0f;
  w->steps = w->tokens = 0;
  int np = 0;
  const int runs[2][2] = {{10, 41}, {52, 90}};
  for (int r = 0; r < 2; r++) {
    int s = runs[r][0], e = runs[r][1];
    for (int p = s; p < e - 1;) {
      int32_t pred[B - 1];
      ck_assert_ok(
          dflash_trainer_propose(t, SEQ(w->ids, NULL, S, w->hidden, &p, 1), NULL, pred, NULL));
      int k = plan[np++ % 12];
      for (int j = 1; j <= k && p + j < e; j++) w->ids[p + j] = pred[j - 1];
      if (k < B - 1 && p + k + 1 < e) w->ids[p + k + 1] = (pred[k] + 1) % V;
      int cap = e - 1 - p;
      w->planned[p] = k < cap ? k : cap;
      int gain = k + 1 < cap ? k + 1 : cap;
      w->steps++, w->tokens += gain;
      p += gain;
    }
  }
  ck_assert_int_eq(w->tokens, (41 - 1 - 10) + (90 - 1 - 52));
}

START_TEST(walk_takes_the_planned_steps) {
  dflash_trainer *t = make();
  world *w = malloc(sizeof *w);
  build(t, w);
  int64_t tokens, steps, hist[B] = {0};
  int32_t accept[S];
  ck_assert_ok(dflash_trainer_walk(t, SEQ(w->ids, w->mask, S, w->hidden, NULL, 0), 0, &tokens,
                                   &steps, accept, hist));
  ck_assert_int_eq(steps, w->steps);
  ck_assert_int_eq(tokens, w->tokens);
  ck_assert_int_gt(steps, 20);
  ck_assert_int_lt(steps, tokens); /* some steps gained more than one token */
  int64_t hs = 0, ht = 0;
  for (int g = 0; g < B; g++) hs += hist[g], ht += (g + 1) * hist[g];
  ck_assert_int_eq(hs, steps);
  ck_assert_int_eq(ht, tokens);
  for (int p = 0; p < S; p++) {
    int anchor = (p >= 10 && p < 40) || (p >= 52 && p < 89);
    if (!anchor) {
      ck_assert_int_eq(accept[p], -1);
      continue;
    }
    if (w->planned[p] >= 0) ck_assert_int_eq(accept[p], w->planned[p]);
    /* Every other position: the acceptance of that single anchor, counting
     * stopped at the end of its run. */
    int32_t a, e = p < 41 ? 41 : 90;
    ck_assert_ok(dflash_trainer_acceptance(t, SEQ(w->ids, NULL, e, w->hidden, &p, 1), &a));
    ck_assert_int_eq(accept[p], a);
  }
  /* NULL accept and hist are fine. */
  ck_assert_ok(dflash_trainer_walk(t, SEQ(w->ids, w->mask, S, w->hidden, NULL, 0), 0, &tokens,
                                   &steps, NULL, NULL));
  ck_assert_int_eq(steps, w->steps);
  free(w);
  dflash_trainer_free(t);
}
END_TEST

/* max_tokens cuts every run to its first N positions: the walk equals a
 * plain walk over the acceptance, each count stopped at the cut. */
START_TEST(walk_max_tokens_cuts_each_run) {
  dflash_trainer *t = make();
  world *w = malloc(sizeof *w);
  build(t, w);
  enum { N = 9 };
  int64_t tokens, steps;
  int32_t accept[S];
  ck_assert_ok(dflash_trainer_walk(t, SEQ(w->ids, w->mask, S, w->hidden, NULL, 0), N, &tokens,
                                   &steps, accept, NULL));
  int64_t want_steps = 0;
  const int starts[2] = {10, 52};
  for (int r = 0; r < 2; r++) {
    int s = starts[r], e = s + N;
    for (int p = s; p < e - 1; want_steps++) {
      int32_t a;
      ck_assert_ok(dflash_trainer_acceptance(t, SEQ(w->ids, NULL, e, w->hidden, &p, 1), &a));
      ck_assert_int_eq(accept[p], a);
      p += a + 1 < e - 1 - p ? a + 1 : e - 1 - p;
    }
    ck_assert_int_eq(accept[e - 1], -1);
    ck_assert_int_eq(accept[e + 3], -1); /* the cut-off rest of the run */
  }
  ck_assert_int_eq(tokens, 2 * (N - 1));
  ck_assert_int_eq(steps, want_steps);
  free(w);
  dflash_trainer_free(t);
}
END_TEST

START_TEST(walk_rejects_bad_arguments) {
  dflash_trainer *t = make();
  int32_t ids[4] = {0};
  uint8_t mask[4] = {1, 1, 1, 1};
  float h[4 * KH] = {0};
  int64_t tokens, steps;
  ck_assert_int_eq(dflash_trainer_walk(t, SEQ(ids, NULL, 4, h, NULL, 0), 0, &tokens, &steps, NULL,
                                       NULL),
                   DFLASH_E_INVALID_ARG);
  ck_assert_int_eq(dflash_trainer_walk(t, SEQ(ids, mask, 4, h, NULL, 0), -1, &tokens, &steps, NULL,
                                       NULL),
                   DFLASH_E_INVALID_ARG);
  int32_t anchor = 0, accept;
  ck_assert_int_eq(dflash_trainer_acceptance(t, SEQ(ids, NULL, 4, h, &anchor, -1), &accept),
                   DFLASH_E_INVALID_ARG);
  /* The one sample struct: checked the same way by every call, by name. */
  anchor = 4;
  ck_assert_status(dflash_trainer_acceptance(t, SEQ(ids, NULL, 4, h, &anchor, 1), &accept),
                   DFLASH_E_RANGE, "anchor 0 = 4 is outside the sequence [0, 4)");
  ck_assert_status(dflash_trainer_walk(t, NULL, 0, &tokens, &steps, NULL, NULL),
                   DFLASH_E_INVALID_ARG, "dflash_sample is NULL");
  dflash_sample bad = {.struct_size = 3, .input_ids = ids, .len = 4, .hidden = h};
  ck_assert_status(dflash_trainer_acceptance(t, &bad, &accept), DFLASH_E_INVALID_ARG,
                   "dflash_sample: struct_size 3");
  bad.struct_size = sizeof bad, bad.len = -1;
  ck_assert_status(dflash_trainer_acceptance(t, &bad, &accept), DFLASH_E_INVALID_ARG, "length -1");
  bad.len = 4, bad.hidden = NULL; /* neither float rows nor codes */
  ck_assert_status(dflash_trainer_acceptance(t, &bad, &accept), DFLASH_E_INVALID_ARG,
                   "no hidden states");
  dflash_eval ev;
  dflash_eval_default(&ev);
  ck_assert_uint_eq(ev.struct_size, sizeof ev);
  ck_assert_int_eq(ev.anchors_per_seq, 64);
  ev.anchors_per_seq = 0;
  ck_assert_status(dflash_trainer_eval(t, "d", "h", &ev), DFLASH_E_INVALID_ARG,
                   "anchors_per_seq 0");
  ev.anchors_per_seq = 4, ev.struct_size = 3;
  ck_assert_status(dflash_trainer_eval(t, "d", "h", &ev), DFLASH_E_INVALID_ARG,
                   "dflash_eval: struct_size 3");
  dflash_eval_walk ew;
  dflash_eval_walk_default(&ew);
  ck_assert_uint_eq(ew.struct_size, sizeof ew);
  ew.struct_size = 8; /* an older caller's struct: accepted, so the missing folder is what fails */
  dflash_status st = dflash_trainer_eval_walk(t, "d", "h", &ew);
  ck_assert(st != DFLASH_OK && st != DFLASH_E_INVALID_ARG);
  ew.struct_size = 3; /* not a struct size */
  ck_assert_int_eq(dflash_trainer_eval_walk(t, "d", "h", &ew), DFLASH_E_INVALID_ARG);
  ew.struct_size = sizeof ew;
  ew.max_tokens = -1;
  ck_assert_int_eq(dflash_trainer_eval_walk(t, "d", "h", &ew), DFLASH_E_INVALID_ARG);
  dflash_trainer_free(t);
}
END_TEST

/* The held-out store must hold the drafter's K*H features per token: a
 * trainer for two target layers over a one-layer store (synth_world: H = 32,
 * K = 1) is refused, not read past each sample's hidden states. */
START_TEST(eval_rejects_hidden_of_another_width) {
  char *root = df_test_tmpdir();
  synth_world(root, 3, 24, 1);
  char *data = synth_path(root, "train"), *hidden = synth_path(root, "hidden");
  static float E[17 * 32];
  const char *fmt = "{\"hidden_size\": 32, \"intermediate_size\": 64, \"num_hidden_layers\": 1,"
                    "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 8,"
                    "\"vocab_size\": 17, \"num_target_layers\": 8, \"block_size\": 4,"
                    "\"dflash_config\": {\"mask_token_id\": 16, \"target_layer_ids\": %s}}";
  const char *layers[2] = {"[3]", "[3, 5]"};
  for (int i = 0; i < 2; i++) {
    char text[512];
    snprintf(text, sizeof text, fmt, layers[i]);
    dflash_drafter_config cfg = {.struct_size = sizeof cfg};
    ck_assert_ok(dflash_drafter_config_parse(text, strlen(text), "cfg", &cfg));
    dflash_trainer *t;
    ck_assert_ok(dflash_trainer_create(&cfg, E, E, NULL, &t));
    dflash_eval_walk ew;
    dflash_eval_walk_default(&ew);
    dflash_eval ev;
    dflash_eval_default(&ev);
    ev.anchors_per_seq = 4;
    if (i == 0) {
      ck_assert_ok(dflash_trainer_eval_walk(t, data, hidden, &ew));
      ck_assert_int_gt(ew.steps, 0);
      /* Each anchor scores block positions 1..3 (B 4) inside its run, at least the first. */
      ck_assert_int_ge(ew.scored, ew.positions);
      ck_assert_int_le(ew.scored, 3 * ew.positions);
      ck_assert_double_eq(ew.candidate_recall, -1); /* DFlash 1: no candidates */
      ck_assert_double_eq(ew.backbone_accuracy, ew.selector_accuracy);
      /* A caller built before the appended fields: they are left alone. */
      dflash_eval_walk old;
      memset(&old, 0x5a, sizeof old);
      dflash_eval_walk_default(&old);
      old.struct_size = offsetof(dflash_eval_walk, scored);
      old.scored = 77;
      ck_assert_ok(dflash_trainer_eval_walk(t, data, hidden, &old));
      ck_assert_int_eq(old.steps, ew.steps);
      ck_assert_int_eq(old.scored, 77);
      old.struct_size = 3; /* not a struct size */
      ck_assert_int_eq(dflash_trainer_eval_walk(t, data, hidden, &old), DFLASH_E_INVALID_ARG);
      double acc[3] = {-1, -1, -1};
      ev.accuracy = acc;
      ck_assert_ok(dflash_trainer_eval(t, data, hidden, &ev));
      ck_assert_uint_eq(ev.struct_size, sizeof ev);
      ck_assert_int_gt(ev.n_blocks, 0);
      ck_assert(ev.tau >= 1 && ev.tau <= 4);
      for (int k = 0; k < 3; k++) ck_assert(acc[k] >= 0 && acc[k] <= 1);
      /* An older caller's struct without n_blocks: tau written, the rest left alone. */
      dflash_eval prior = ev;
      prior.struct_size = offsetof(dflash_eval, n_blocks), prior.tau = 0, prior.n_blocks = 77;
      ck_assert_ok(dflash_trainer_eval(t, data, hidden, &prior));
      ck_assert_double_eq(prior.tau, ev.tau);
      ck_assert_int_eq(prior.n_blocks, 77);
      ck_assert_uint_eq(prior.struct_size, offsetof(dflash_eval, n_blocks));
    } else {
      ck_assert_status(dflash_trainer_eval_walk(t, data, hidden, &ew), DFLASH_E_MISMATCH,
                       "K*H = 64");
      ck_assert_status(dflash_trainer_eval(t, data, hidden, &ev), DFLASH_E_MISMATCH,
                       "32 features per token");
    }
    dflash_trainer_free(t);
  }
  free(data), free(hidden);
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* Every sequence call takes the sample's rows as stored (bf16 codes here, decoded on the host)
 * as it takes them in float32: the same drafts, acceptance and walk, and logits and loss
 * within float rounding (the decoded rows sit in another buffer). */
START_TEST(sample_calls_take_stored_rows) {
  dflash_trainer *t = make();
  enum { L = 24, NA = 3, N = NA * (B - 1), NL = NA * B * 31 };
  int32_t ids[L], anchors[NA] = {0, 7, 15};
  uint8_t mask[L];
  static float hid[L * KH], lg[2][NL];
  static uint16_t codes[L * KH];
  srand(5);
  for (int i = 0; i < L; i++) ids[i] = rand() % V, mask[i] = i >= 2;
  for (int i = 0; i < L * KH; i++) { /* values bf16 holds exactly */
    float f = (float)(rand() % 2001) / 1000.0f - 1.0f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    codes[i] = (uint16_t)(u >> 16);
    u = (uint32_t)codes[i] << 16;
    memcpy(&hid[i], &u, sizeof u);
  }
  dflash_sample smp[2] = {*SEQ(ids, mask, L, hid, anchors, NA),
                          *SEQ(ids, mask, L, NULL, anchors, NA)};
  smp[1].hidden_dtype = DFLASH_DTYPE_BF16, smp[1].hidden_codes = codes;
  int32_t pred[2][N], acc[2][NA], walk_acc[2][L];
  int64_t tokens[2], steps[2];
  double loss[2];
  for (int k = 0; k < 2; k++) {
    ck_assert_ok(dflash_trainer_propose(t, &smp[k], NULL, pred[k], NULL));
    ck_assert_ok(dflash_trainer_acceptance(t, &smp[k], acc[k]));
    ck_assert_ok(dflash_trainer_walk(t, &smp[k], 0, &tokens[k], &steps[k], walk_acc[k], NULL));
    ck_assert_ok(dflash_trainer_logits(t, &smp[k], lg[k]));
    ck_assert_ok(dflash_trainer_forward_backward(t, &smp[k], &loss[k]));
  }
  ck_assert_mem_eq(pred[0], pred[1], sizeof pred[0]);
  ck_assert_mem_eq(acc[0], acc[1], sizeof acc[0]);
  ck_assert_mem_eq(walk_acc[0], walk_acc[1], sizeof walk_acc[0]);
  ck_assert_int_eq(tokens[0], tokens[1]);
  ck_assert_int_eq(steps[0], steps[1]);
  for (int i = 0; i < NL; i++) ck_assert_float_eq_tol(lg[0][i], lg[1][i], 1e-5f);
  ck_assert_double_eq_tol(loss[0], loss[1], 1e-6 * fabs(loss[0]));
  smp[1].hidden_dtype = 99; /* no such dtype: refused by name */
  ck_assert_status(dflash_trainer_propose(t, &smp[1], NULL, pred[1], NULL), DFLASH_E_INVALID_ARG,
                   "hidden dtype 99");
  dflash_trainer_free(t);
}
END_TEST

TCase *tc_eval(void) {
  TCase *tc = tcase_create("eval");
  tcase_add_test(tc, walk_takes_the_planned_steps);
  tcase_add_test(tc, walk_max_tokens_cuts_each_run);
  tcase_add_test(tc, walk_rejects_bad_arguments);
  tcase_add_test(tc, sample_calls_take_stored_rows);
  tcase_add_test(tc, eval_rejects_hidden_of_another_width);
  return tc;
}
