/*
 * dflash_train_run on the CUDA backend with two ranks (AdamW, and Muon), each a separate process on its own
 * emulated device (LOCAL_RANK, DFLASH_EMU_DEVICES=2), gradients reduce-scattered and
 * weights all-gathered over the emulated NCCL (ZeRO-1: each rank keeps half of the fp32
 * masters and moments), against one process with the same global batch, and checkpoint +
 * resume at world 2 (suite 'cuda-emu').
 *
 * Tolerance: one process accumulates the second sequence's gradient onto the first one's
 * inside each GEMM and reduction, two ranks compute each from zero and add the two buffers
 * once, so fp32 gradients differ by an ulp or so (and, were an fp32 master moved across a
 * bf16 rounding boundary, the next forward would see a weight one bf16 step away). Measured
 * 1.1e-8 (every thread order gives the same numbers); the bounds are tests/train's for the
 * CPU, and still ~3000x below what dropping the pairing costs (the control, one process with
 * batch 1, differs by 6e-2).
 */
#include <dflash/dflash.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu_common.h"
#include "synth.h"
#include "testutil.h"

#define PARAM_TOL 2e-5
#define LOSS_RTOL 1e-4

static double rel(double a, double b) {
  return a == b ? 0 : (a > b ? a - b : b - a) / (b > 0 ? b : -b);
}

/* synth_spawn, with LOCAL_RANK: each rank on its own device, as torchrun sets it. */
static pid_t spawn(const dflash_train_run_options *o, int rank, int world, int port,
                   const char *report) {
  fflush(NULL);
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid > 0) return pid;
  unsetenv("DFLASH_NCCL");
  if (world > 1) {
    g_rank_env(rank, world, port);
  } else {
    unsetenv("RANK"), unsetenv("LOCAL_RANK"), unsetenv("WORLD_SIZE");
  }
  /* A rank that hangs fails the test within the meson timeout (a trainer option). */
  dflash_train_run_options oo = *o;
  dflash_trainer_options to;
  if (o->trainer) to = *o->trainer;
  else dflash_trainer_options_default(&to);
  to.dist_timeout_s = 120;
  oo.trainer = &to;
  dflash_status st = dflash_train_run(&oo, NULL);
  FILE *f = fopen(report, "w");
  if (f) {
    fprintf(f, "%d\n%s\n", (int)st, st ? dflash_last_error() : "");
    fclose(f);
  }
  _exit((int)st);
}

static void run_world(dflash_train_run_options *o, int world, const char *root) {
  int port = synth_free_port();
  pid_t pid[2];
  char *rep[2];
  for (int r = 0; r < world; r++) {
    char name[32];
    snprintf(name, sizeof name, "report-%d", r);
    rep[r] = synth_path(root, name);
    pid[r] = spawn(&o[r], r, world, port, rep[r]);
  }
  for (int r = 0; r < world; r++) {
    int rc = synth_wait(pid[r], 300);
    char msg[1024];
    ck_assert_msg(rc == 0, "rank %d of %d exited with %d: %s", r, world, rc,
                  synth_report(rep[r], msg, sizeof msg) ? msg : "");
    free(rep[r]);
  }
}

static void options(dflash_train_run_options *o, const char *root, const char *out) {
  synth_run_options(o, root, out);
  synth_trainer(o)->backend = DFLASH_BACKEND_CUDA;
  o->epochs = 3;
  /* Pinned: with several ranks batch_size 0 lets the trainer pick, and on an sm_12x device
   * (PCIe) it picks 4 sequences per step, which would change the step counts below. */
  o->batch_size = 1;
}

/* One process with the global batch (2) against two ranks of batch 1, each its own process
 * (NCCL, ZeRO-1), with `optimizer`; then the control, one process with batch 1, which must
 * differ from the first by more than control_min. */
static void two_ranks_vs_one(int32_t optimizer, const char *what, double param_tol,
                             double loss_rtol, double control_min) {
  char *root = df_test_tmpdir();
  synth_world(root, 7, 40, 1); /* global batches of 2, 2, 2, 1 per epoch: 12 steps */
  char *one = synth_at(root, "one"), *dp = synth_at(root, "dp"), *dp1 = synth_at(root, "dp1");
  char *b1 = synth_at(root, "batch1");
  dflash_train_run_options o[2];
  options(&o[0], root, one);
  synth_trainer(&o[0])->optimizer = optimizer;
  o[0].batch_size = 2;
  run_world(o, 1, root);
  options(&o[0], root, dp);
  options(&o[1], root, dp1);
  for (int r = 0; r < 2; r++) synth_trainer(&o[r])->optimizer = optimizer;
  run_world(o, 2, root);
  ck_assert_msg(!synth_exists(dp1), "rank 1 wrote into its out_dir");
  double d = synth_max_abs_diff(one, dp);
  synth_metric a[16], b[16];
  size_t na = synth_metrics(one, a, 16), nb = synth_metrics(dp, b, 16);
  ck_assert_uint_eq(na, 12);
  ck_assert_uint_eq(nb, 12);
  double worst = 0;
  for (size_t i = 0; i < na; i++) {
    ck_assert_int_eq(a[i].tokens, b[i].tokens);
    ck_assert(a[i].lr == b[i].lr);
    double r = rel(b[i].loss, a[i].loss) > rel(b[i].norm, a[i].norm) ? rel(b[i].loss, a[i].loss)
                                                                     : rel(b[i].norm, a[i].norm);
    worst = r > worst ? r : worst;
  }
  options(&o[0], root, b1);
  synth_trainer(&o[0])->optimizer = optimizer;
  run_world(o, 1, root);
  double control = synth_max_abs_diff(one, b1);
  printf("CUDA %s train run, 1 process x batch 2 vs 2 ranks x batch 1 (NCCL, ZeRO-1): max |param "
         "diff| %.3g (bound %g), worst loss/norm rel. diff %.3g (bound %g); control, 1 process "
         "x batch 1: %.3g\n",
         what, d, param_tol, worst, loss_rtol, control);
  fflush(stdout);
  ck_assert_msg(d <= param_tol, "parameters differ by %g", d);
  ck_assert_msg(worst <= loss_rtol, "losses or norms differ by %g", worst);
  ck_assert_msg(control > control_min, "control differs by only %g", control);
  df_test_rmtree(root);
  free(root);
}

START_TEST(cuda_two_ranks_zero1_equal_one_process_with_the_global_batch) {
  two_ranks_vs_one(DFLASH_OPTIMIZER_ADAMW, "AdamW", PARAM_TOL, LOSS_RTOL, 100 * PARAM_TOL);
}
END_TEST

/* Muon (cuda/backend.cu muon_step) through the whole run: two ranks, each its own process, the
 * Muon update all-gathered over NCCL and each matrix's Newton-Schulz run by its owner rank and
 * broadcast, against one process with the global batch. tests/gpu/emu_muon.c checks the step
 * itself to the bit against one rank on the same gradients; here the gradients differ by the ulps
 * of their summation order (as above), which Muon turns into more than AdamW does:
 * Newton-Schulz's quintic amplifies a relative perturbation up to ~3.4^5 in the small singular
 * directions, and every weight moves by about lr x 0.2 each step, so a few fp32 masters land on
 * the other side of a bf16 rounding boundary and the next forward sees them one bf16 step away
 * (measured: parameters 1.7e-4 apart after 12 steps, losses and norms 3.2e-4 with TF32
 * Newton-Schulz, 1.5e-4 and 6.9e-4 with fp32; the same comparison on the CPU backend's fp32
 * weights, run by hand: 4.1e-7 and 6.6e-8). The bounds, 1e-3 and 5e-3: the control (one process
 * with batch 1) differs by 3.0e-2, 30x the first. */
#define MUON_PARAM_TOL 1e-3
#define MUON_LOSS_RTOL 5e-3
START_TEST(cuda_muon_two_ranks_equal_one_process_with_the_global_batch) {
  two_ranks_vs_one(DFLASH_OPTIMIZER_MUON, "Muon", MUON_PARAM_TOL, MUON_LOSS_RTOL,
                   10 * MUON_PARAM_TOL);
}
END_TEST

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

/* Checkpoints gather the ZeRO-1 shards of masters and moments over NCCL; a resume scatters
 * them again: stopped at step 5 and resumed, two CUDA ranks redo the uninterrupted run to
 * the bit, and one process resumes their checkpoint with the same global batch. */
START_TEST(cuda_resume_at_world_two_reproduces_the_uninterrupted_run) {
  char *root = df_test_tmpdir();
  synth_world(root, 7, 40, 1);
  char *full = synth_at(root, "full"), *part = synth_at(root, "part");
  char *other = synth_at(root, "other");
  dflash_train_run_options o[2];
  for (int r = 0; r < 2; r++) options(&o[r], root, full), o[r].save_every = 2;
  run_world(o, 2, root);
  for (int k = 0; k < 2; k++) {
    for (int r = 0; r < 2; r++) /* stopped early: the full run's schedule */
      o[r].out_dir = k ? other : part, o[r].max_steps = 5,
      o[r].schedule_steps = DFLASH_SCHEDULE_EPOCHS;
    run_world(o, 2, root);
  }
  for (int r = 0; r < 2; r++) o[r].out_dir = part, o[r].max_steps = 0, o[r].resume = 1;
  run_world(o, 2, root);
  size_t na, nb;
  char **a = stable_lines(full, &na), **b = stable_lines(part, &nb);
  ck_assert_uint_eq(na, 12);
  ck_assert_uint_eq(nb, na);
  for (size_t i = 0; i < na; i++) ck_assert_str_eq(a[i], b[i]);
  ck_assert(synth_max_abs_diff(full, part) == 0);
  o[0].out_dir = other;
  o[0].batch_size = 2;
  run_world(o, 1, root);
  synth_metric x[16], y[16];
  ck_assert_uint_eq(synth_metrics(full, x, 16), 12);
  ck_assert_uint_eq(synth_metrics(other, y, 16), 12);
  for (size_t i = 0; i < 12; i++)
    ck_assert_msg(rel(y[i].loss, x[i].loss) <= LOSS_RTOL, "step %ld: %.9g vs %.9g", x[i].step,
                  x[i].loss, y[i].loss);
  double d = synth_max_abs_diff(full, other);
  printf("CUDA resume at world 2: bit-identical to the uninterrupted run; world 2 -> world 1 "
         "resume: max |param diff| %.3g (bound %g)\n",
         d, PARAM_TOL);
  ck_assert(d <= PARAM_TOL);
  synth_free_lines(a, na);
  synth_free_lines(b, nb);
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* Run by tests/check_main.c. Two emulated devices, one a rank. */
Suite *df_test_suite(void) {
  setenv("DFLASH_EMU_DEVICES", "2", 1);
  Suite *s = suite_create("cuda_emu_run_dist");
  TCase *tc = tcase_create("dist");
  tcase_set_timeout(tc, 900);
  tcase_add_test(tc, cuda_two_ranks_zero1_equal_one_process_with_the_global_batch);
  tcase_add_test(tc, cuda_resume_at_world_two_reproduces_the_uninterrupted_run);
  tcase_add_test(tc, cuda_muon_two_ranks_equal_one_process_with_the_global_batch);
  suite_add_tcase(s, tc);
  return s;
}
