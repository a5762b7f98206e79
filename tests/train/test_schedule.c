/* The learning-rate schedule of a whole run (run.h: max_steps, schedule_steps,
 * allow_settings_change): max_steps ends it, an extended or re-rated resume trains, a run at
 * learning rate 0 or resumed past max_steps is refused, and resume errors name enums by name.
 * The rates are read back from metrics.jsonl and compared with each other, not with a BLAS
 * result. */
#include <dflash/train.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "synth.h"
#include "testutil.h"
#include "train/run/run_internal.h"

enum { MAX_LINES = 64 };

typedef struct world {
  char *root, *out;
  dflash_train_run_options o;
} world;

static world make_world(void) {
  world w;
  w.root = synth_small_run(&w.o, &w.out);
  synth_trainer(&w.o)->warmup_ratio = 0; /* every step's rate is the decay's */
  return w;
}

static void free_world(world *w) {
  df_test_rmtree(w->root);
  free(w->root);
}

static size_t lines(const world *w, synth_metric *m) { return synth_metrics(w->out, m, MAX_LINES); }

/* Before: max_steps stopped the run but the cosine ran over the epochs, so a 4-step run of 8
 * ended near its peak rate. Now it decays to the floor (0) over the 4 steps, unless
 * schedule_steps keeps the epochs'. */
START_TEST(max_steps_ends_the_schedule) {
  world w = make_world();
  synth_metric m[MAX_LINES];
  w.o.max_steps = 4;
  ck_assert_ok(dflash_train_run(&w.o, NULL));
  ck_assert_uint_eq(lines(&w, m), 4);
  double peak = synth_trainer(&w.o)->lr;
  ck_assert_double_eq(m[0].lr, peak);
  ck_assert_msg(m[3].lr < 0.2 * peak, "last lr %g of peak %g", m[3].lr, peak);
  df_test_rmtree(w.out);
  w.o.schedule_steps = DFLASH_SCHEDULE_EPOCHS; /* told otherwise: the epochs' length */
  ck_assert_ok(dflash_train_run(&w.o, NULL));
  ck_assert_uint_eq(lines(&w, m), 4);
  ck_assert_msg(m[3].lr > 0.5 * peak, "last lr %g of peak %g", m[3].lr, peak);
  w.o.schedule_steps = -2;
  ck_assert_status(dflash_train_run(&w.o, NULL), DFLASH_E_INVALID_ARG, "schedule_steps -2");
  free_world(&w);
}
END_TEST

/* Before: a finished run resumed with more epochs continued from its last rate, 0, and wrote
 * the same model. Now the added steps restart from lr (the saved schedule had ended). */
START_TEST(extending_a_finished_run_trains) {
  world w = make_world();
  synth_metric m[MAX_LINES];
  ck_assert_ok(dflash_train_run(&w.o, NULL));
  size_t n = lines(&w, m);
  ck_assert_uint_gt(n, 2);
  float *before = synth_checkpoint_floats(w.out, &(size_t){0});
  w.o.resume = 1, w.o.epochs = 2;
  ck_assert_status(dflash_train_run(&w.o, NULL), DFLASH_E_MISMATCH, "epochs 1 -> 2");
  w.o.allow_settings_change = 1;
  ck_assert_ok(dflash_train_run(&w.o, NULL));
  ck_assert_uint_eq(lines(&w, m), 2 * n);
  double peak = synth_trainer(&w.o)->lr;
  ck_assert_double_eq(m[n].lr, peak);
  for (size_t i = n + 1; i < 2 * n; i++) ck_assert(m[i].lr < m[i - 1].lr && m[i].lr >= 0);
  size_t k = 0;
  float *after = synth_checkpoint_floats(w.out, &k);
  ck_assert(memcmp(before, after, k * sizeof *after) != 0);
  free(before), free(after);
  free_world(&w);
}
END_TEST

/* Before: a new lr under allow_settings_change only moved the floor; the rate went on from the
 * saved schedule's. Now the next step takes the new lr and decays from it. */
START_TEST(a_new_lr_is_taken_on_resume) {
  world w = make_world();
  synth_metric m[MAX_LINES];
  w.o.max_steps = 2, w.o.schedule_steps = DFLASH_SCHEDULE_EPOCHS;
  ck_assert_ok(dflash_train_run(&w.o, NULL));
  double lr = synth_trainer(&w.o)->lr / 4;
  synth_trainer(&w.o)->lr = lr;
  w.o.max_steps = 0, w.o.resume = 1, w.o.allow_settings_change = 1;
  ck_assert_ok(dflash_train_run(&w.o, NULL));
  size_t n = lines(&w, m);
  ck_assert_uint_gt(n, 3);
  ck_assert_double_eq(m[2].lr, lr);
  ck_assert(m[n - 1].lr < m[2].lr);
  free_world(&w);
}
END_TEST

/* Before: resuming at step 4 with max_steps 2 trained one step (step 5 of "2"); at max_steps 4
 * one more too. Now past it is refused and at it nothing trains. */
START_TEST(resume_past_max_steps_is_refused) {
  world w = make_world();
  synth_metric m[MAX_LINES];
  w.o.max_steps = 4;
  ck_assert_ok(dflash_train_run(&w.o, NULL));
  w.o.resume = 1, w.o.max_steps = 2;
  ck_assert_status(dflash_train_run(&w.o, NULL), DFLASH_E_INVALID_ARG,
                   "is at step 4, past --max-steps 2");
  ck_assert_uint_eq(lines(&w, m), 4);
  w.o.max_steps = 4;
  dflash_train_stats s = {.struct_size = sizeof s};
  ck_assert_ok(dflash_train_run(&w.o, &s));
  ck_assert_uint_eq(lines(&w, m), 4);
  ck_assert_int_eq(s.step, 4);
  free_world(&w);
}
END_TEST

/* A resume whose every step would take learning rate 0 (its schedule ended where the state
 * stands, the epochs go on) is refused, saying why; an explicit lr 0 stays the caller's
 * choice. Before, it trained the rest of the epoch at 0. */
START_TEST(a_run_at_lr_0_is_refused) {
  world w = make_world();
  synth_metric m[MAX_LINES];
  w.o.max_steps = 2, w.o.schedule_steps = 2;
  ck_assert_ok(dflash_train_run(&w.o, NULL));
  w.o.resume = 1, w.o.max_steps = 0;
  ck_assert_status(dflash_train_run(&w.o, NULL), DFLASH_E_INVALID_ARG, "learning rate 0");
  ck_assert_uint_eq(lines(&w, m), 2);
  df_test_rmtree(w.out);
  w.o.resume = 0, w.o.epochs = 1, w.o.schedule_steps = 0;
  synth_trainer(&w.o)->lr = 0;
  ck_assert_ok(dflash_train_run(&w.o, NULL));
  free_world(&w);
}
END_TEST

/* Before: "loss_gamma 0 -> -1", "lr_schedule 0 -> 1" (and "labels 0 -> 1", which this store,
 * without target ids, refuses before the settings: checked on the formatter itself). */
START_TEST(resume_errors_name_enums) {
  world w = make_world();
  w.o.max_steps = 2;
  ck_assert_ok(dflash_train_run(&w.o, NULL));
  w.o.resume = 1;
  synth_trainer(&w.o)->loss_gamma = -1;
  synth_trainer(&w.o)->lr_schedule = DFLASH_LR_LINEAR;
  dflash_status st = dflash_train_run(&w.o, NULL);
  const char *e = dflash_last_error();
  ck_assert_int_eq(st, DFLASH_E_MISMATCH);
  char text[48];
  df_run_setting_text("labels", DFLASH_TRAIN_LABELS_TARGET, text, sizeof text);
  ck_assert_str_eq(text, "target");
  df_run_setting_text("muon_adjust_lr", DFLASH_MUON_ADJUST_LR_ORIGINAL, text, sizeof text);
  ck_assert_str_eq(text, "original");
  df_run_setting_text("labels", 7, text, sizeof text); /* unknown: the number */
  ck_assert_str_eq(text, "7");
  ck_assert_msg(strstr(e, "loss_gamma default (--weighting decay) -> none (--weighting none)"),
                "%s", e);
  ck_assert_msg(strstr(e, "lr_schedule cosine -> linear"), "%s", e);
  free_world(&w);
}
END_TEST

TCase *tc_schedule(void);
TCase *tc_schedule(void) {
  TCase *tc = tcase_create("schedule");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, max_steps_ends_the_schedule);
  tcase_add_test(tc, extending_a_finished_run_trains);
  tcase_add_test(tc, a_new_lr_is_taken_on_resume);
  tcase_add_test(tc, resume_past_max_steps_is_refused);
  tcase_add_test(tc, a_run_at_lr_0_is_refused);
  tcase_add_test(tc, resume_errors_name_enums);
  return tc;
}
