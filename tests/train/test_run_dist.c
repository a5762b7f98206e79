/*
 * dflash_train_run with several ranks, each a separate process (as torchrun
 * starts them), the CPU backend summing gradients over the run's TCP
 * connections: the data split and the gradient averaging against one
 * process with the same global batch, who writes files, failing ranks, and
 * resuming.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "synth.h"
#include "testutil.h"

/*
 * One process with batch 2 and two ranks with batch 1 each compute the same
 * global-batch gradient; the only difference is float32 rounding. One
 * process accumulates the second sequence's gradient into the buffer that
 * already holds the first one's (inside each GEMM and reduction), two ranks
 * compute each from zero and add the two buffers once. That moves gradient
 * elements by an ulp or so; AdamW's m / sqrt(v) carries it into the update
 * and 12 steps of lr 5e-3 compound it. Measured: 1.2e-7, one float32 ulp
 * of the norm weights near 1. The bound is ~170x that and still ~3000x
 * below what dropping the pairing costs (the 1-process, batch-1 control
 * differs by 6e-2).
 */
#define PARAM_TOL 2e-5
#define LOSS_RTOL 1e-4

/* Metrics lines without the timing fields. */
static char **stable_lines(const char *dir, size_t *n) {
  char *p = synth_path(dir, "metrics.jsonl");
  char **lines = synth_lines(p, n);
  ck_assert_msg(lines != NULL, "%s is missing", p);
  for (size_t i = 0; i < *n; i++) {
    char *cut = strstr(lines[i], ", \"tokens_per_s\"");
    ck_assert_ptr_nonnull(cut);
    *cut = 0;
  }
  free(p);
  return lines;
}

static double rel(double a, double b) {
  return a == b ? 0 : (a > b ? a - b : b - a) / (b > 0 ? b : -b);
}

/* Run ranks 0..world-1 of `o[r]` to the end; each must succeed. */
static void run_world(dflash_train_run_options *o, int world, const char *root) {
  int port = synth_free_port();
  pid_t pid[2];
  char *rep[2];
  for (int r = 0; r < world; r++) {
    char name[32];
    snprintf(name, sizeof name, "report-%d", r);
    rep[r] = synth_path(root, name);
    pid[r] = synth_spawn(&o[r], r, world, port, 60, rep[r]);
  }
  for (int r = 0; r < world; r++) {
    int rc = synth_wait(pid[r], 240);
    char msg[1024];
    ck_assert_msg(rc == 0, "rank %d of %d exited with %d: %s", r, world, rc,
                  synth_report(rep[r], msg, sizeof msg) ? msg : "");
    free(rep[r]);
  }
}

/* 7 trainable samples: global batches of 2, 2, 2, 1 per epoch (rank 1
 * gets nothing in the last one), 3 epochs, 12 steps. */
static char *world7(void) {
  char *root = df_test_tmpdir();
  synth_world(root, 7, 40, 1);
  return root;
}

START_TEST(two_ranks_equal_one_process_with_the_global_batch) {
  char *root = world7();
  char *one = synth_at(root, "one"), *dp = synth_at(root, "dp");
  char *dp1 = synth_at(root, "dp-rank1"), *b1 = synth_at(root, "batch1");
  dflash_train_run_options o[2];
  synth_run_options(&o[0], root, one);
  o[0].epochs = 3;
  o[0].batch_size = 2;
  run_world(o, 1, root);
  synth_run_options(&o[0], root, dp);
  synth_run_options(&o[1], root, dp1); /* rank 1 gets its own out_dir: it must stay unused */
  o[0].epochs = o[1].epochs = 3;
  run_world(o, 2, root);
  ck_assert_msg(!synth_exists(dp1), "rank 1 wrote into its out_dir");
  double d = synth_max_abs_diff(one, dp);
  printf("train run 1 process x batch 2 vs 2 ranks x batch 1: max |param diff| %.3g (bound %g)\n",
         d, PARAM_TOL);
  ck_assert_msg(d <= PARAM_TOL, "parameters differ by %g", d);
  synth_metric a[16], b[16];
  size_t na = synth_metrics(one, a, 16), nb = synth_metrics(dp, b, 16);
  ck_assert_uint_eq(na, 12);
  ck_assert_uint_eq(nb, 12);
  for (size_t i = 0; i < na; i++) {
    ck_assert_int_eq(a[i].step, b[i].step);
    ck_assert_int_eq(a[i].epoch, b[i].epoch);
    ck_assert_int_eq(a[i].tokens, b[i].tokens); /* global tokens: 80 per full batch */
    ck_assert(a[i].lr == b[i].lr);
    ck_assert_msg(rel(b[i].loss, a[i].loss) <= LOSS_RTOL && rel(b[i].norm, a[i].norm) <= LOSS_RTOL,
                  "step %ld: loss %.9g vs %.9g, grad norm %.9g vs %.9g", a[i].step, a[i].loss,
                  b[i].loss, a[i].norm, b[i].norm);
  }
  ck_assert_int_eq(a[11].tokens, 3 * 7 * 40);
  /* Control: the same data in batches of 1 (no averaging over the pair)
   * is far outside the bound, so the comparison above can fail. */
  synth_run_options(&o[0], root, b1);
  o[0].epochs = 3;
  run_world(o, 1, root);
  double control = synth_max_abs_diff(one, b1);
  printf("control, 1 process x batch 1: max |param diff| %.3g\n", control);
  ck_assert_msg(control > 100 * PARAM_TOL, "control differs by only %g", control);
  df_test_rmtree(root);
  free(root);
}
END_TEST

START_TEST(only_rank0_writes_files) {
  char *root = world7();
  char *out0 = synth_at(root, "r0"), *out1 = synth_at(root, "r1");
  dflash_train_run_options o[2];
  synth_run_options(&o[0], root, out0);
  synth_run_options(&o[1], root, out1);
  for (int r = 0; r < 2; r++) o[r].save_every = 1, o[r].max_steps = 3;
  run_world(o, 2, root);
  const char *files[] = {"config.json", "model.safetensors", "metrics.jsonl",
                         "train_state/state.safetensors"};
  for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
    char *p = synth_path(out0, files[i]);
    ck_assert_msg(synth_exists(p), "rank 0 did not write %s", p);
    free(p);
  }
  ck_assert_msg(!synth_exists(out1), "rank 1 created %s", out1);
  synth_metric m[4];
  ck_assert_uint_eq(synth_metrics(out0, m, 4), 3);
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* Wait until rank 0's metrics have `lines` lines. */
static void wait_lines(const char *dir, size_t lines) {
  char *p = synth_path(dir, "metrics.jsonl");
  for (int i = 0; i < 12000; i++) {
    size_t n;
    char **l = synth_lines(p, &n);
    synth_free_lines(l, n);
    if (n >= lines) {
      free(p);
      return;
    }
    usleep(10 * 1000);
  }
  ck_abort_msg("%s never reached %zu lines", p, lines);
}

/* Start two ranks of an endless run; `victim` gets `sig` after two steps;
 * the survivor must exit with `want`, naming the victim. */
static void failing_rank(int victim, int sig, double timeout, dflash_status want,
                         const char *needle) {
  char *root = world7();
  char *out = synth_at(root, "out");
  char *rep[2] = {synth_at(root, "rep0"), synth_at(root, "rep1")};
  dflash_train_run_options o;
  synth_run_options(&o, root, out);
  o.epochs = 1000000;
  int port = synth_free_port();
  pid_t pid[2];
  for (int r = 0; r < 2; r++) pid[r] = synth_spawn(&o, r, 2, port, timeout, rep[r]);
  wait_lines(out, 2);
  kill(pid[victim], sig);
  int survivor = 1 - victim;
  int rc = synth_wait(pid[survivor], 10 * timeout + 60);
  char msg[1024];
  int st = synth_report(rep[survivor], msg, sizeof msg);
  printf("rank %d after rank %d got signal %d: %s: %s", survivor, victim, sig,
         dflash_status_str(st), msg);
  ck_assert_int_eq(rc, (int)want);
  ck_assert_int_eq(st, (int)want);
  ck_assert_msg(strstr(msg, needle), "message lacks \"%s\": %s", needle, msg);
  kill(pid[victim], SIGKILL);
  waitpid(pid[victim], NULL, 0);
  df_test_rmtree(root);
  free(root);
}

START_TEST(killed_rank1_fails_rank0_naming_it) {
  failing_rank(1, SIGKILL, 60, DFLASH_E_NETWORK, "rank 1 closed its connection");
}
END_TEST

START_TEST(killed_rank0_fails_rank1_naming_it) {
  failing_rank(0, SIGKILL, 60, DFLASH_E_NETWORK, "rank 0 closed its connection");
}
END_TEST

START_TEST(stopped_rank_times_out_naming_it) {
  failing_rank(1, SIGSTOP, 3, DFLASH_E_TIMEOUT, "rank 1 ");
}
END_TEST

/* A rank that fails on its own (here: another seed than rank 0) stops the
 * other with its reason instead of leaving it waiting. */
START_TEST(a_rank_that_disagrees_stops_the_run) {
  char *root = world7();
  char *out = synth_at(root, "out");
  char *rep[2] = {synth_at(root, "rep0"), synth_at(root, "rep1")};
  dflash_train_run_options o[2];
  synth_run_options(&o[0], root, out);
  synth_run_options(&o[1], root, out);
  synth_trainer(&o[1])->seed = 6;
  int port = synth_free_port();
  pid_t pid[2];
  for (int r = 0; r < 2; r++) pid[r] = synth_spawn(&o[r], r, 2, port, 60, rep[r]);
  char msg[1024];
  ck_assert_int_eq(synth_wait(pid[1], 120), DFLASH_E_MISMATCH);
  synth_report(rep[1], msg, sizeof msg);
  ck_assert_msg(strstr(msg, "rank 1 disagrees with rank 0") && strstr(msg, "seed 6 vs 5"), "%s",
                msg);
  ck_assert_int_eq(synth_wait(pid[0], 120), DFLASH_E_CANCELLED);
  synth_report(rep[0], msg, sizeof msg);
  ck_assert_msg(strstr(msg, "rank 1 failed (DFLASH_E_MISMATCH)"), "%s", msg);
  df_test_rmtree(root);
  free(root);
}
END_TEST

START_TEST(resume_at_world_two_reproduces_the_uninterrupted_run) {
  char *root = world7();
  char *full = synth_at(root, "full"), *part = synth_at(root, "part");
  char *other = synth_at(root, "other");
  dflash_train_run_options o[2];
  for (int r = 0; r < 2; r++) {
    synth_run_options(&o[r], root, full);
    o[r].epochs = 3;
    o[r].save_every = 2;
  }
  run_world(o, 2, root);
  /* Stop at step 5 (epoch 1, mid-order), with a line the state never saw. */
  for (int k = 0; k < 2; k++) {
    const char *dir = k ? other : part;
    for (int r = 0; r < 2; r++) /* stopped early: the full run's schedule */
      o[r].out_dir = dir, o[r].max_steps = 5, o[r].schedule_steps = DFLASH_SCHEDULE_EPOCHS;
    run_world(o, 2, root);
    char *m = synth_path(dir, "metrics.jsonl");
    FILE *f = fopen(m, "a");
    fputs("{\"step\": 6, \"epoch\": 1, \"loss\": 0}\n", f);
    fclose(f);
    free(m);
  }
  for (int r = 0; r < 2; r++) o[r].out_dir = part, o[r].max_steps = 0, o[r].resume = 1;
  run_world(o, 2, root);
  size_t na, nb;
  char **a = stable_lines(full, &na), **b = stable_lines(part, &nb);
  ck_assert_uint_eq(na, 12);
  ck_assert_uint_eq(nb, na);
  for (size_t i = 0; i < na; i++) ck_assert_str_eq(a[i], b[i]);
  ck_assert(synth_max_abs_diff(full, part) == 0);
  /* The same state resumed by one process with the same global batch. */
  o[0].out_dir = other;
  o[0].batch_size = 2;
  run_world(o, 1, root);
  synth_metric x[16], y[16];
  ck_assert_uint_eq(synth_metrics(full, x, 16), 12);
  ck_assert_uint_eq(synth_metrics(other, y, 16), 12);
  for (size_t i = 0; i < 12; i++) {
    ck_assert_int_eq(x[i].step, y[i].step);
    ck_assert_int_eq(x[i].tokens, y[i].tokens);
    ck_assert(x[i].lr == y[i].lr);
    ck_assert_msg(rel(y[i].loss, x[i].loss) <= LOSS_RTOL, "step %ld: %.9g vs %.9g", x[i].step,
                  x[i].loss, y[i].loss);
  }
  double d = synth_max_abs_diff(full, other);
  printf("world 2 -> world 1 resume: max |param diff| %.3g\n", d);
  ck_assert(d <= PARAM_TOL);
  synth_free_lines(a, na);
  synth_free_lines(b, nb);
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* dist_timeout_s is a trainer option (it was the environment's DFLASH_DIST_TIMEOUT): outside
 * (0, 1e9] the run refuses it before any rendezvous, naming it; the stopped-rank test above
 * shows a 3 s value taking effect. */
START_TEST(dist_timeout_s_is_a_checked_trainer_option) {
  char *root = world7();
  char *out = synth_at(root, "out");
  dflash_train_run_options o;
  synth_run_options(&o, root, out);
  const double bad[] = {0, -1, 2e9};
  for (int i = 0; i < 3; i++) {
    synth_trainer(&o)->dist_timeout_s = bad[i];
    ck_assert_status(dflash_train_run(&o, NULL), DFLASH_E_INVALID_ARG, "dist_timeout_s");
  }
  df_test_rmtree(root);
  free(root);
}
END_TEST

TCase *tc_run_dist(void) {
  TCase *tc = tcase_create("run_dist");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, two_ranks_equal_one_process_with_the_global_batch);
  tcase_add_test(tc, only_rank0_writes_files);
  tcase_add_test(tc, killed_rank1_fails_rank0_naming_it);
  tcase_add_test(tc, killed_rank0_fails_rank1_naming_it);
  tcase_add_test(tc, stopped_rank_times_out_naming_it);
  tcase_add_test(tc, a_rank_that_disagrees_stops_the_run);
  tcase_add_test(tc, resume_at_world_two_reproduces_the_uninterrupted_run);
  tcase_add_test(tc, dist_timeout_s_is_a_checked_trainer_option);
  return tc;
}
