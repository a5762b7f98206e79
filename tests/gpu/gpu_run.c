/*
 * The CUDA backend through the whole training loop (dflash_train_run), on
 * the synthetic world of the CPU run tests (suite 'gpu'; exits 77 without a
 * device): CPU vs CUDA vs CUDA over NCCL with one rank (DFLASH_NCCL=1), same
 * data, same seeded order, 8 steps.
 *
 * Tolerances: the CUDA run keeps bf16 weights and activations (relative
 * step 2^-8 = 0.4%) with fp32 masters, so its per-step loss may drift from
 * the float32 CPU run; 3% relative per step bounds that over 8 steps of a
 * drafter this small (gpu_parity.c holds single steps to 1%). NCCL with one
 * rank only copies the gradients through a reduce-scatter and all-gather,
 * so it must equal the plain CUDA run to the bit.
 */
#include <dflash/dflash.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "synth.h"
#include "train/backend.h"
#include "testutil.h"

static void run_one(const char *root, const char *out, int backend, bool nccl) {
  dflash_train_run_options o;
  synth_run_options(&o, root, out);
  o.epochs = 2;
  o.batch_size = 2;
  synth_trainer(&o)->backend = backend;
  if (nccl) setenv("DFLASH_NCCL", "1", 1);
  char *rep = synth_path(root, nccl ? "report-nccl" : backend ? "report-cuda" : "report-cpu");
  pid_t pid = synth_spawn(&o, 0, 1, 0, 120, rep);
  unsetenv("DFLASH_NCCL");
  int rc = synth_wait(pid, 240);
  char msg[1024];
  ck_assert_msg(rc == 0, "%s run: %s", out, synth_report(rep, msg, sizeof msg) ? msg : "");
  free(rep);
}

START_TEST(cuda_run_loop_matches_cpu_and_nccl_one_rank_is_exact) {
  char *root = df_test_tmpdir();
  synth_world(root, 7, 40, 1);
  char *cpu = synth_at(root, "cpu"), *gpu = synth_at(root, "cuda"), *nccl = synth_at(root, "nccl");
  run_one(root, cpu, DFLASH_BACKEND_CPU, false);
  run_one(root, gpu, DFLASH_BACKEND_CUDA, false);
  run_one(root, nccl, DFLASH_BACKEND_CUDA, true);
  synth_metric c[16], g[16], n[16];
  ck_assert_uint_eq(synth_metrics(cpu, c, 16), 8);
  ck_assert_uint_eq(synth_metrics(gpu, g, 16), 8);
  ck_assert_uint_eq(synth_metrics(nccl, n, 16), 8);
  double worst = 0;
  for (int i = 0; i < 8; i++) {
    ck_assert_int_eq(c[i].tokens, g[i].tokens);
    ck_assert(c[i].lr == g[i].lr);
    double r = (g[i].loss > c[i].loss ? g[i].loss - c[i].loss : c[i].loss - g[i].loss) / c[i].loss;
    worst = r > worst ? r : worst;
    printf("step %ld: loss cpu %.6f cuda %.6f nccl-1 %.6f\n", c[i].step, c[i].loss, g[i].loss,
           n[i].loss);
    ck_assert_msg(g[i].loss == n[i].loss && g[i].norm == n[i].norm,
                  "step %ld: NCCL 1-rank run differs from plain CUDA", g[i].step);
  }
  printf("CUDA vs CPU through dflash_train_run: worst per-step loss rel. diff %.4f (bound 0.03)\n",
         worst);
  ck_assert(worst <= 0.03);
  ck_assert(synth_max_abs_diff(gpu, nccl) == 0);
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* dflash_train_run's batch_size 0: the sequences per step the CUDA backend picks from the
 * device it reads. The emulated RTX PRO 6000 (sm_120, no NVLink) takes 4 with several ranks;
 * the emulated H200 (sm_90), and any device with one rank, 1. On a real GPU only the one-rank
 * answer is known here. */
START_TEST(cuda_picks_sequences_per_step_from_the_device) {
  const char *arch = getenv("DFLASH_EMU_ARCH");
  /* On the emulator: two devices without P2P, for the start-up line below. */
  if (arch) setenv("DFLASH_EMU_DEVICES", "2", 1), setenv("DFLASH_EMU_P2P", "0", 1);
  char note[1536];
  int32_t n = -1;
  ck_assert_int_eq(df_backend_auto_sequences(DFLASH_BACKEND_CUDA, 1, &n, note, sizeof note),
                   DFLASH_OK);
  ck_assert_int_eq(n, 1);
  ck_assert_msg(strstr(note, "one GPU"), "%s", note);
  ck_assert_int_eq(df_backend_auto_sequences(DFLASH_BACKEND_CUDA, 8, &n, note, sizeof note),
                   DFLASH_OK);
  printf("8 ranks: %s\n", note);
  if (arch && !strcmp(arch, "sm_120")) {
    ck_assert_int_eq(n, 4);
    ck_assert_msg(strstr(note, "sm_120") && strstr(note, "PCIe"), "%s", note);
  } else if (arch) {
    ck_assert_int_eq(n, 1);
    ck_assert_msg(strstr(note, "NVLink"), "%s", note);
  } else {
    ck_assert(n == 1 || n == 4);
  }
  ck_assert_int_eq(df_backend_auto_sequences(DFLASH_BACKEND_CPU, 8, &n, note, sizeof note),
                   DFLASH_OK);
  ck_assert_int_eq(n, 1);
  /* The start-up line reads P2P and NCCL's version from the device and the library. */
  unsetenv("NCCL_MIN_NCHANNELS");
  ck_assert_int_eq(df_backend_cuda_link_note(8, note, sizeof note), DFLASH_OK);
  printf("start-up line: %s\n", note);
  ck_assert_msg(strstr(note, "device 0 of ") && strstr(note, "NCCL_MIN_NCHANNELS="), "%s", note);
  if (arch) {
    ck_assert_msg(strstr(note, "P2P to 0 of 1") && strstr(note, "no P2P to device 1") &&
                      strstr(note, "NCCL (version unknown)"),
                  "%s", note);
    ck_assert_msg(!strcmp(arch, "sm_120") == !!strstr(note, "NCCL_MIN_NCHANNELS=8 ("), "%s", note);
  }
  /* dflash train --plan without --gpu: the plan read from the device present. */
  dflash_drafter_config c = {.struct_size = sizeof c};
  dflash_drafter_config_default(&c);
  c.hidden_size = 256, c.intermediate_size = 512, c.num_hidden_layers = 1, c.vocab_size = 1000;
  c.num_target_layers = 4, c.mask_token_id = 999, c.n_target_layer_ids = 1;
  c.target_layer_ids[0] = 1;
  c.num_attention_heads = 64, c.num_key_value_heads = 8, c.head_dim = 128, c.block_size = 16;
  dflash_train_plan_options po;
  dflash_train_plan_options_default(&po);
  po.device = 0, po.world_size = 8, po.gpu_bytes = 1; /* both read from the device instead */
  dflash_train_plan p = {.struct_size = sizeof p};
  dflash_status st = dflash_train_plan_compute(&c, &po, &p);
  printf(
      "plan on %s: %d sequences per step, %llu bytes of shared memory per block, %llu of memory, %s\n",
      p.device_name, p.sequences_per_step, (unsigned long long)p.attention_smem,
      (unsigned long long)p.gpu_bytes, st ? dflash_last_error() : "fits");
  ck_assert_msg(strstr(p.device_name, "(sm_"), "%s", p.device_name);
  ck_assert_uint_gt(p.gpu_bytes, 1);
  if (arch && !strcmp(arch, "sm_120")) {
    ck_assert_int_eq(p.sequences_per_step, 4);
    ck_assert_uint_eq(p.attention_smem, 99328); /* Kimi's packing at 64 keys on 99 KB */
  } else if (arch) {
    ck_assert_int_eq(p.sequences_per_step, 1);
  }
}
END_TEST

/* Whether this machine has a CUDA device; asked in a child so that this
 * process (which forks the runs) never initialises CUDA. */
static bool have_device(void) {
  pid_t pid = fork();
  if (pid == 0) {
    int n = 0;
    dflash_status st = dflash_cuda_device_count(&n);
    if (st || n < 1) printf("skip: no CUDA device (%s)\n", st ? dflash_last_error() : "0");
    fflush(stdout);
    _exit(!st && n > 0 ? 0 : 1);
  }
  int status = 1;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

/* Run by tests/check_main.c; exit 77 is meson's skip. */
Suite *df_test_suite(void) {
  if (!have_device()) exit(77);
  Suite *s = suite_create("gpu_run");
  TCase *tc = tcase_create("run");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, cuda_run_loop_matches_cpu_and_nccl_one_rank_is_exact);
  suite_add_tcase(s, tc);
  TCase *auto_tc = tcase_create("auto"); /* CK_RUN_CASE=auto: this one alone */
  tcase_add_test(auto_tc, cuda_picks_sequences_per_step_from_the_device);
  suite_add_tcase(s, auto_tc);
  return s;
}
