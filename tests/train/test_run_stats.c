/* What dflash_train_run writes to its `stats` (run.h): the last step as metrics.jsonl's last line
 * has it, how the run ended and where its checkpoint stands, so that `dflash train` and Python
 * print their summaries from fields; and a caller's older, smaller struct is written only up to
 * its struct_size. */
#include <dflash/train.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "synth.h"
#include "testutil.h"

enum { MAX_LINES = 64 };

typedef struct world {
  char *root, *out;
  dflash_train_run_options o;
} world;

static world make_world(void) {
  world w;
  w.root = synth_small_run(&w.o, &w.out);
  return w;
}

static void free_world(world *w) {
  df_test_rmtree(w->root);
  free(w->root);
}

/* The stats are the last metrics line's (its loss printed with 9 digits). */
static void assert_last_line(const dflash_train_stats *s, const char *out) {
  synth_metric m[MAX_LINES];
  size_t n = synth_metrics(out, m, MAX_LINES);
  ck_assert_uint_gt(n, 0);
  ck_assert_int_eq(s->step, m[n - 1].step);
  ck_assert_int_eq(s->epoch, m[n - 1].epoch);
  ck_assert_int_eq(s->tokens, m[n - 1].tokens);
  ck_assert_double_eq_tol(s->loss, m[n - 1].loss, 1e-8 * m[n - 1].loss);
  ck_assert_double_eq_tol(s->lr, m[n - 1].lr, 1e-8 * m[n - 1].lr);
  ck_assert(s->elapsed_s > 0 && s->loss > 0);
}

START_TEST(stats_say_how_a_run_ended) {
  world w = make_world();
  dflash_train_stats s = {.struct_size = sizeof s};
  w.o.max_steps = 3, w.o.schedule_steps = DFLASH_SCHEDULE_EPOCHS; /* to be resumed */
  ck_assert_ok(dflash_train_run(&w.o, &s));
  assert_last_line(&s, w.out);
  ck_assert_int_eq(s.step, 3);
  ck_assert_int_eq(s.last_step, 3);
  ck_assert_int_eq(s.stop_reason, DFLASH_TRAIN_STOP_MAX_STEPS);
  ck_assert_int_eq(s.checkpoint_step, 3);
  ck_assert_int_eq(s.spool, 0);
  ck_assert(s.spool_wait_s == 0 && s.selector_loss == 0);
  /* A failed call says so, over whatever the struct held. */
  memset(&s, 0x5a, sizeof s);
  s.struct_size = sizeof s;
  w.o.resume = 1, w.o.max_steps = 2;
  ck_assert_status(dflash_train_run(&w.o, &s), DFLASH_E_INVALID_ARG, "past --max-steps 2");
  ck_assert_int_eq(s.stop_reason, DFLASH_TRAIN_STOP_ERROR);
  ck_assert_int_eq(s.checkpoint_step, 0);
  /* Resumed to the epoch's end: trains the rest. */
  w.o.max_steps = 0;
  ck_assert_ok(dflash_train_run(&w.o, &s));
  assert_last_line(&s, w.out);
  ck_assert_int_eq(s.step, 8);
  ck_assert_int_eq(s.stop_reason, DFLASH_TRAIN_STOP_FINISHED);
  ck_assert_int_eq(s.checkpoint_step, 8);
  /* Resumed once more: no step to train, the saved run's last step all the same. */
  dflash_train_stats again = {.struct_size = sizeof again};
  ck_assert_ok(dflash_train_run(&w.o, &again));
  assert_last_line(&again, w.out);
  ck_assert_double_eq_tol(again.elapsed_s, s.elapsed_s, 1e-3);
  ck_assert_int_eq(again.stop_reason, DFLASH_TRAIN_STOP_FINISHED);
  ck_assert_int_eq(again.checkpoint_step, 8);
  free_world(&w);
}
END_TEST

static int stop_at_2(const dflash_train_stats *s, void *user) {
  (void)user;
  ck_assert_int_eq(s->stop_reason, DFLASH_TRAIN_STOP_NONE); /* still running */
  return s->step >= 2;
}

START_TEST(a_stop_by_the_progress_callback_is_told_apart) {
  world w = make_world();
  dflash_train_stats s = {.struct_size = sizeof s};
  w.o.progress = stop_at_2;
  ck_assert_status(dflash_train_run(&w.o, &s), DFLASH_E_CANCELLED, "stopped on request");
  /* At the next step boundary: the step whose metrics line the callback saw, or (a step is
   * asynchronous) the one after it. */
  ck_assert(s.step == 2 || s.step == 3);
  ck_assert_int_eq(s.stop_reason, DFLASH_TRAIN_STOP_REQUESTED);
  ck_assert_int_eq(s.checkpoint_step, s.step);
  assert_last_line(&s, w.out);
  free_world(&w);
}
END_TEST

/* A caller built against the header before stop_reason: its struct ends at elapsed_s, and the
 * bytes after it (here a canary) are never written. */
START_TEST(an_older_callers_stats_are_written_up_to_its_size) {
  world w = make_world();
  w.o.max_steps = 2;
  size_t old = offsetof(dflash_train_stats, stop_reason);
  unsigned char buf[sizeof(dflash_train_stats) + 16];
  memset(buf, 0xab, sizeof buf);
  dflash_train_stats *s = (dflash_train_stats *)(void *)buf;
  s->struct_size = old;
  ck_assert_ok(dflash_train_run(&w.o, s));
  ck_assert_int_eq(s->step, 2);
  ck_assert(s->elapsed_s > 0 && s->loss > 0);
  for (size_t i = old; i < sizeof buf; i++) ck_assert_msg(buf[i] == 0xab, "byte %zu written", i);
  free_world(&w);
}
END_TEST

TCase *tc_run_stats(void);
TCase *tc_run_stats(void) {
  TCase *tc = tcase_create("run_stats");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, stats_say_how_a_run_ended);
  tcase_add_test(tc, a_stop_by_the_progress_callback_is_told_apart);
  tcase_add_test(tc, an_older_callers_stats_are_written_up_to_its_size);
  return tc;
}
