/*
 * Defects of the CUDA backend found by review, each shown on the emulated
 * device (cuda/emu, suite 'cuda-emu'):
 *   - a refused kernel launch (the emulator refuses a kernel by name, as the hardware refuses
 *     one that needs more registers than a block has) is a DFLASH_E_CUDA naming the kernel,
 *     from every launcher, never a silent no-op;
 *   - a trainer created for device 1 (LOCAL_RANK=1) works from another host thread, whose
 *     current device is 0 (the emulator refuses launches on another device's stream);
 *   - predict on rows whose logits are all NaN gives the CPU backend's answer (token 0);
 *   - two ranks (processes, NCCL, ZeRO-1) that scale each sequence differently: the step's
 *     norm and get_grad afterwards are those of one rank with the global batch;
 *   - creating a rank allocates only its ZeRO-1 shard of the fp32 masters and moments, and
 *     only rank 0 copies optimizer state to the host for a checkpoint.
 */
#include <dflash/experimental.h>
#include <dflash/train.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../train/seq.h"
#include "gpu_common.h"
#include "synth.h"
#include "testutil.h"
#include "train/backend.h"
#include "train/trainer.h"

/* Test controls of cuda/emu/runtime.cpp. */
void dfemu_refuse_kernel(const char *name);
void dfemu_memory_stats(int device, size_t *used, size_t *peak, uint64_t *to_host, int reset);

static dflash_status make_opt(const dflash_drafter_config *c, int backend, double clip,
                              dflash_trainer **t) {
  dflash_trainer_options o;
  g_small_options(&o, backend);
  o.grad_clip = clip;
  o.dist_timeout_s = 120; /* a rank that hangs fails the test within the meson timeout */
  return g_small_trainer(c, &o, t);
}

static dflash_trainer *make(const dflash_drafter_config *c, int backend) {
  dflash_trainer *t;
  ck_assert_ok(make_opt(c, backend, 1.0, &t));
  return t;
}

static double rel_diff(const float *a, const float *b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    double x = a[i], y = b[i];
    num += (x - y) * (x - y), den += y * y;
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* ---- a: every launch is checked ------------------------------------------------------------ */

/* Create, one forward + backward, a clipped step (scale runs), predict. */
static dflash_status exercise(const dflash_drafter_config *c, const g_seq *q, char *msg,
                              size_t cap) {
  dflash_trainer *t = NULL;
  dflash_status st = make_opt(c, DFLASH_BACKEND_CUDA, 1e-6, &t);
  double loss, norm;
  if (!st)
    st = dflash_trainer_forward_backward(t,
                                         SEQ(q->ids, q->mask, q->len, q->hidden, q->anchors, q->na),
                                         &loss);
  if (!st) st = dflash_trainer_step(t, &norm, NULL);
  int32_t *pred = malloc(sizeof(int32_t) * (size_t)q->na * c->block_size);
  if (!st)
    st = dflash_trainer_propose(t, SEQ(q->ids, NULL, q->len, q->hidden, q->anchors, q->na), NULL,
                                pred, NULL);
  free(pred);
  snprintf(msg, cap, "%s", st ? dflash_last_error() : "");
  dflash_trainer_free(t);
  return st;
}

START_TEST(a_refused_launch_fails_naming_its_kernel) {
  static const char *kernels[] = {"f32_to_bf16",
                                  "rope_table",
                                  "positions",
                                  "gather_rows",
                                  "rmsnorm_forward",
                                  "rope_forward",
                                  "swiglu_forward",
                                  "attention_forward",
                                  "lmhead_ce_init",
                                  "lmhead_ce_chunk",
                                  "lmhead_ce_finish",
                                  "scatter_rows",
                                  "rmsnorm_backward_dw_partial",
                                  "rmsnorm_backward_dw_reduce",
                                  "rmsnorm_backward",
                                  "swiglu_backward",
                                  "attention_backward_q",
                                  "attention_backward_kv",
                                  "sumsq_partial",
                                  "sumsq_final",
                                  "norm_sum",
                                  "norm_clip",
                                  "scale_clipped",
                                  "adamw",
                                  "lmhead_argmax_init",
                                  "lmhead_argmax_chunk"};
  dflash_drafter_config c = {.struct_size = sizeof c};
  g_small_config(&c);
  g_seq q;
  ck_assert_int_eq(g_seq_make(&c, 60, 6, 21, &q), 0);
  char msg[1024];
  ck_assert_msg(exercise(&c, &q, msg, sizeof msg) == DFLASH_OK, "no refusal: %s", msg);
  for (size_t k = 0; k < sizeof kernels / sizeof *kernels; k++) {
    dfemu_refuse_kernel(kernels[k]);
    dflash_status st = exercise(&c, &q, msg, sizeof msg);
    dfemu_refuse_kernel(NULL);
    ck_assert_msg(st == DFLASH_E_CUDA && strstr(msg, kernels[k]),
                  "kernel %s refused: status %d, \"%s\"", kernels[k], (int)st, msg);
  }
  g_seq_free(&q);
}
END_TEST

/* The attention's shape limits are refused when the trainer is created and by the plan, naming
 * the limit, not at the first launch; the CPU backend trains those shapes. */
START_TEST(a_shape_limits_refused_at_create_and_by_the_plan) {
  static const struct {
    int d, nh, nkv, B;
    const char *why;
  } bad[] = {{12, 4, 2, 4, "multiple of 8"},
             {264, 4, 2, 4, "at most 256"},
             {16, 16, 1, 16, "at most 128 rows"}};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    dflash_drafter_config c = {.struct_size = sizeof c};
    g_small_config(&c);
    c.head_dim = bad[i].d, c.num_attention_heads = bad[i].nh;
    c.num_key_value_heads = bad[i].nkv, c.block_size = bad[i].B;
    ck_assert_ok(dflash_drafter_config_validate(&c));
    dflash_trainer *t = NULL;
    /* Refused by the backend before the device model is made (named as the backend's). */
    ck_assert_status(make_opt(&c, DFLASH_BACKEND_CUDA, 1e-6, &t), DFLASH_E_UNSUPPORTED, bad[i].why);
    ck_assert_msg(strstr(dflash_last_error(), "trainer backend cuda: block size"), "%s",
                  dflash_last_error());
    ck_assert_ptr_null(t);
    ck_assert_ok(make_opt(&c, DFLASH_BACKEND_CPU, 1e-6, &t));
    dflash_trainer_free(t);
    dflash_train_plan_options po;
    dflash_train_plan_options_default(&po);
    dflash_train_plan p = {.struct_size = sizeof p};
    ck_assert_status(dflash_train_plan_compute(&c, &po, &p), DFLASH_E_UNSUPPORTED,
                     "training plan: the CUDA trainer cannot run");
  }
}
END_TEST

/* ---- b: the trainer's device from any host thread ------------------------------------------ */

typedef struct use_job {
  dflash_trainer *t;
  const g_seq *q;
  double loss, norm;
  float *grads, *params;
  int32_t *pred;
  dflash_status st;
  char err[512];
} use_job;

static void *use_trainer(void *arg) {
  use_job *j = arg;
  const g_seq *q = j->q;
  dflash_status st = dflash_trainer_forward_backward(
      j->t, SEQ(q->ids, q->mask, q->len, q->hidden, q->anchors, q->na), &j->loss);
  if (!st) st = g_dump_into(j->t, 1, j->grads);
  if (!st) st = dflash_trainer_step(j->t, &j->norm, NULL);
  if (!st) st = g_dump_into(j->t, 0, j->params);
  if (!st)
    st = dflash_trainer_propose(j->t, SEQ(q->ids, NULL, q->len, q->hidden, q->anchors, q->na), NULL,
                                j->pred, NULL);
  j->st = st;
  if (st) snprintf(j->err, sizeof j->err, "%s", dflash_last_error());
  return NULL;
}

START_TEST(b_other_host_thread_uses_the_trainers_device) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  g_small_config(&c);
  setenv("LOCAL_RANK", "1", 1);
  dflash_trainer *t1 = make(&c, DFLASH_BACKEND_CUDA);
  unsetenv("LOCAL_RANK");
  dflash_trainer *t0 = make(&c, DFLASH_BACKEND_CUDA); /* this thread is on device 0 now */
  g_seq q;
  ck_assert_int_eq(g_seq_make(&c, 60, 6, 23, &q), 0);
  size_t n = t0->m.n_params, np = (size_t)q.na * (c.block_size - 1);
  use_job j[2];
  for (int k = 0; k < 2; k++)
    j[k] = (use_job){.t = k ? t1 : t0,
                     .q = &q,
                     .grads = calloc(n, 4),
                     .params = calloc(n, 4),
                     .pred = calloc(np, 4)};
  use_trainer(&j[0]);
  ck_assert_msg(!j[0].st, "device 0 on its own thread: %s", j[0].err);
  pthread_t th;
  pthread_create(&th, NULL, use_trainer, &j[1]);
  pthread_join(th, NULL);
  ck_assert_msg(!j[1].st, "device 1 from another thread: %s", j[1].err);
  ck_assert_msg(j[1].loss == j[0].loss && j[1].norm == j[0].norm,
                "device 1 from another thread: loss %.9g norm %.9g, device 0 %.9g %.9g", j[1].loss,
                j[1].norm, j[0].loss, j[0].norm);
  ck_assert_msg(!memcmp(j[0].grads, j[1].grads, 4 * n) &&
                    !memcmp(j[0].params, j[1].params, 4 * n) &&
                    !memcmp(j[0].pred, j[1].pred, 4 * np),
                "devices 0 and 1 disagree");
  for (int k = 0; k < 2; k++) free(j[k].grads), free(j[k].params), free(j[k].pred);
  g_seq_free(&q);
  dflash_trainer_free(t0), dflash_trainer_free(t1);
}
END_TEST

/* ---- c: predict on all-NaN logits --------------------------------------------------------- */

START_TEST(c_predict_on_nan_rows_matches_the_cpu) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  g_small_config(&c);
  dflash_trainer *t[2] = {make(&c, DFLASH_BACKEND_CPU), make(&c, DFLASH_BACKEND_CUDA)};
  /* The final norm's weight NaN: every hidden row, so every logit, is NaN. */
  size_t last = dflash_trainer_param_count(t[0]) - 1, numel;
  const char *name;
  dflash_trainer_param_info(t[0], last, &name, NULL, NULL, &numel);
  float *w = malloc(4 * numel);
  for (size_t i = 0; i < numel; i++) w[i] = NAN;
  g_seq q;
  ck_assert_int_eq(g_seq_make(&c, 60, 6, 24, &q), 0);
  size_t np = (size_t)q.na * (c.block_size - 1);
  int32_t *pred[2];
  for (int k = 0; k < 2; k++) {
    ck_assert_ok(dflash_trainer_set_param(t[k], name, w, numel));
    pred[k] = malloc(4 * np);
    memset(pred[k], 0x5a, 4 * np);
    ck_assert_ok(dflash_trainer_propose(t[k], SEQ(q.ids, NULL, q.len, q.hidden, q.anchors, q.na),
                                        NULL, pred[k], NULL));
  }
  for (size_t i = 0; i < np; i++)
    ck_assert_msg(pred[1][i] == pred[0][i], "row %zu of NaN logits: CUDA predicts %d, CPU %d", i,
                  pred[1][i], pred[0][i]);
  free(pred[0]), free(pred[1]), free(w);
  g_seq_free(&q);
  dflash_trainer_free(t[0]), dflash_trainer_free(t[1]);
}
END_TEST

/* ---- d, e: two ranks in processes ------------------------------------------------------------ */

enum { N_SEQ = 4 };

typedef struct shared_out {
  int st;
  char err[512];
  double norm;
  size_t peak_create, used_create, peak_run;
  uint64_t to_host_create, to_host_ckpt;
  int save_other; /* rank 1's own save_state */
  char save_msg[256];
} shared_out;

/* Rank `rank` of `world`: sequences rank*k .. of N_SEQ, each scaled by its own 1/weight
 * (world 1: all of them, by the global 1/weight). */
static void run_rank(int rank, int world, int port, const g_seq *q, const double *w,
                     shared_out *out, float *grads, const char *ckpt) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  g_small_config(&c);
  if (world > 1) g_rank_env(rank, world, port);
  dfemu_memory_stats(rank, NULL, NULL, NULL, 1);
  dflash_trainer *t = NULL;
  dflash_status st = make_opt(&c, DFLASH_BACKEND_CUDA, 1.0, &t);
  dfemu_memory_stats(rank, &out->used_create, &out->peak_create, &out->to_host_create, 1);
  double W = 0;
  for (int i = 0; i < N_SEQ; i++) W += w[i];
  if (!st) st = dflash_trainer_zero_grad(t);
  int per = N_SEQ / world;
  for (int i = rank * per; !st && i < (rank + 1) * per; i++)
    st = dflash_trainer_accumulate(t,
                                   SEQ(q[i].ids, q[i].mask, q[i].len, q[i].hidden, q[i].anchors,
                                       q[i].na),
                                   world > 1 ? 1.0 / w[i] : 1.0 / W);
  if (!st) st = dflash_trainer_step(t, &out->norm, NULL);
  if (!st) st = g_dump_into(t, 1, grads);
  /* e: a checkpoint as dflash_train_run saves one: every rank gathers, rank 0 writes. */
  if (!st) {
    dfemu_memory_stats(rank, NULL, NULL, NULL, 1);
    st = df_trainer_pull(t, DF_BUF_PARAMS | DF_BUF_M1 | DF_BUF_M2);
    if (!st && rank == 0) st = dflash_trainer_save_state(t, ckpt, NULL, 0);
    dfemu_memory_stats(rank, NULL, &out->peak_run, &out->to_host_ckpt, 0);
    if (!st && rank == 1) {
      out->save_other = (int)dflash_trainer_save_state(t, ckpt, NULL, 0);
      snprintf(out->save_msg, sizeof out->save_msg, "%s", dflash_last_error());
    }
  }
  out->st = (int)st;
  if (st) snprintf(out->err, sizeof out->err, "%s", dflash_last_error());
  dflash_trainer_free(t);
}

START_TEST(d_e_two_ranks_scaling_each_sequence_equal_one_rank) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  g_small_config(&c);
  dflash_trainer *cpu = make(&c, DFLASH_BACKEND_CPU);
  size_t n = cpu->m.n_params;
  g_seq q[N_SEQ];
  double w[N_SEQ];
  static const int lens[N_SEQ] = {70, 40, 64, 90}, nas[N_SEQ] = {6, 2, 5, 8};
  for (int i = 0; i < N_SEQ; i++) {
    ck_assert_int_eq(g_seq_make(&c, lens[i], nas[i], 41 + i, &q[i]), 0);
    ck_assert_ok(
        dflash_trainer_weight_sum(cpu, SEQ(NULL, q[i].mask, q[i].len, NULL, q[i].anchors, q[i].na),
                                  &w[i]));
  }
  dflash_trainer_free(cpu);
  /* One rank with the global batch (index 0), two ranks (1, 2), in shared memory. */
  size_t bytes = 3 * (sizeof(shared_out) + 4 * n);
  char *shm = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ck_assert_ptr_ne(shm, MAP_FAILED);
  memset(shm, 0, bytes);
  shared_out *out = (shared_out *)shm;
  float *grads = (float *)(shm + 3 * sizeof(shared_out));
  char *dir = df_test_tmpdir(), *ckpt = synth_path(dir, "state-2"),
       *ckpt1 = synth_path(dir, "state-1");
  int port = synth_free_port();
  pid_t pid[3];
  for (int k = 0; k < 3; k++) {
    fflush(NULL);
    pid[k] = fork();
    ck_assert_int_ge(pid[k], 0);
    if (pid[k] == 0) {
      run_rank(k ? k - 1 : 0, k ? 2 : 1, port, q, w, &out[k], grads + k * n, k ? ckpt : ckpt1);
      _exit(0);
    }
    if (k == 0) ck_assert_int_eq(synth_wait(pid[0], 300), 0); /* the device-0 run first */
  }
  for (int k = 1; k < 3; k++) ck_assert_int_eq(synth_wait(pid[k], 300), 0);
  for (int k = 0; k < 3; k++) ck_assert_msg(!out[k].st, "run %d: %s", k, out[k].err);
  printf("2 ranks vs 1: norm %.9g %.9g vs %.9g; get_grad rel. diff %.2e, %.2e\n", out[1].norm,
         out[2].norm, out[0].norm, rel_diff(grads + n, grads, n),
         rel_diff(grads + 2 * n, grads, n));
  /* d: the norm over the reduced gradient, and get_grad returns it whole on every rank. */
  for (int k = 1; k < 3; k++) {
    ck_assert_msg(fabs(out[k].norm - out[0].norm) <= 1e-3 * out[0].norm,
                  "rank %d: norm %.9g, one rank %.9g", k - 1, out[k].norm, out[0].norm);
    double d = rel_diff(grads + k * n, grads, n);
    ck_assert_msg(d <= 1e-2, "rank %d: get_grad after the step differs from one rank's by %.2e",
                  k - 1, d);
  }
  /* e: a rank creates its ZeRO-1 shard of the fp32 masters and moments (12 bytes a
   * parameter, half of them on each of 2 ranks) and copies nothing to the host for it;
   * the plan's total is the peak; only rank 0 copies the moments to the host. */
  printf("device bytes after create: 1 rank %zu (peak %zu), 2 ranks %zu / %zu (peaks %zu / "
         "%zu); to host at create %llu / %llu; checkpoint to host %llu / %llu\n",
         out[0].used_create, out[0].peak_create, out[1].used_create, out[2].used_create,
         out[1].peak_create, out[2].peak_create, (unsigned long long)out[1].to_host_create,
         (unsigned long long)out[2].to_host_create, (unsigned long long)out[1].to_host_ckpt,
         (unsigned long long)out[2].to_host_ckpt);
  for (int k = 1; k < 3; k++) {
    ck_assert_msg(out[k].peak_create + 6 * n <= out[0].peak_create + 64 * 1024,
                  "rank %d: peak at create %zu bytes, one rank %zu (a shard saves %zu)", k - 1,
                  out[k].peak_create, out[0].peak_create, 6 * n);
    ck_assert_msg(out[k].to_host_create == 0, "rank %d copied %llu bytes to the host at create",
                  k - 1, (unsigned long long)out[k].to_host_create);
  }
  ck_assert_msg(out[1].to_host_ckpt >= 12 * n && out[2].to_host_ckpt <= 4 * n + 4096,
                "checkpoint: rank 0 copied %llu bytes to the host, rank 1 %llu (n %zu)",
                (unsigned long long)out[1].to_host_ckpt, (unsigned long long)out[2].to_host_ckpt,
                n);
  ck_assert_msg(out[2].save_other == DFLASH_E_STATE && strstr(out[2].save_msg, "rank 0"),
                "rank 1's own save_state: %d \"%s\"", out[2].save_other, out[2].save_msg);
  /* The state rank 0 wrote equals one rank's after the same step (the moments too). */
  dflash_trainer *a, *b;
  ck_assert_ok(make_opt(&c, DFLASH_BACKEND_CPU, 1.0, &a));
  ck_assert_ok(make_opt(&c, DFLASH_BACKEND_CPU, 1.0, &b));
  /* A buffer for the caller blob: with NULL, load_state only asks for its size and restores
   * nothing (the comparison below then compared two fresh trainers). */
  char ublob[256];
  size_t ulen = 0;
  /* The step's update: the state's parameters less a fresh trainer's (the runs' init). */
  float *up_a = malloc(n * sizeof *up_a), *up_b = malloc(n * sizeof *up_b);
  ck_assert(up_a && up_b);
  memcpy(up_a, a->m.params, n * sizeof *up_a);
  memcpy(up_b, b->m.params, n * sizeof *up_b);
  ck_assert_ok(dflash_trainer_load_state(a, ckpt, ublob, sizeof ublob, &ulen));
  ck_assert_ok(dflash_trainer_load_state(b, ckpt1, ublob, sizeof ublob, &ulen));
  for (size_t i = 0; i < n; i++)
    up_a[i] = a->m.params[i] - up_a[i], up_b[i] = b->m.params[i] - up_b[i];
  double d_m1 = rel_diff(a->m1, b->m1, n), d_m2 = rel_diff(a->m2, b->m2, n);
  double d_p = rel_diff(a->m.params, b->m.params, n), d_u = rel_diff(up_a, up_b, n);
  fprintf(stderr,
          "state of 2 ranks vs 1 rank (relative): m1 %.3g, m2 %.3g, params %.3g, update %.3g\n",
          d_m1, d_m2, d_p, d_u);
  ck_assert_msg(d_m1 < 1e-2 && d_m2 < 2e-2, "moments differ: m1 %g, m2 %g", d_m1, d_m2);
  /* Adam's first update is about lr * sign(g) per element: where bf16 rounding and the
   * reduction order (2 ranks, 1 rank) flip the sign of a near-zero gradient, a fraction f of
   * the elements, the updates differ by about 2 sqrt(f) (0.068 here, f ~ 0.1%). A rank 0
   * that saved its own shard of the masters alone would leave half the update out (0.7). */
  ck_assert_msg(d_u < 0.15, "the step's update differs by %g (the parameters by %g)", d_u, d_p);
  free(up_a), free(up_b);
  dflash_trainer_free(a), dflash_trainer_free(b);
  /* The plan at this shape over 2 ranks (no reserve) bounds the measured peak. */
  dflash_train_plan_options po;
  dflash_train_plan_options_default(&po);
  po.world_size = 2, po.seq_len = 100, po.num_anchors = 8, po.vocab_chunk = 128;
  po.reserve_bytes = 0, po.gpu_bytes = UINT64_MAX;
  dflash_train_plan plan = {.struct_size = sizeof plan};
  ck_assert_ok(dflash_train_plan_compute(&c, &po, &plan));
  printf("plan for 2 ranks: %llu bytes; measured peak %zu / %zu\n", (unsigned long long)plan.total,
         out[1].peak_run, out[2].peak_run);
  for (int k = 1; k < 3; k++)
    ck_assert_msg(out[k].peak_run <= plan.total &&
                      out[k].peak_create >= plan.total - plan.activations,
                  "rank %d: peak %zu (at create %zu), plan %llu (%llu without "
                  "activations)",
                  k - 1, out[k].peak_run, out[k].peak_create, (unsigned long long)plan.total,
                  (unsigned long long)(plan.total - plan.activations));
  munmap(shm, bytes);
  for (int i = 0; i < N_SEQ; i++) g_seq_free(&q[i]);
  df_test_rmtree(dir);
  free(ckpt), free(ckpt1), free(dir);
}
END_TEST

/* Run by tests/check_main.c. Two emulated devices for the two-rank case, no rank from
 * the environment. */
Suite *df_test_suite(void) {
  setenv("DFLASH_EMU_DEVICES", "2", 1);
  unsetenv("RANK"), unsetenv("LOCAL_RANK"), unsetenv("WORLD_SIZE"), unsetenv("DFLASH_NCCL");
  Suite *s = suite_create("cuda_emu_defects");
  TCase *tc = tcase_create("defects");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, a_refused_launch_fails_naming_its_kernel);
  tcase_add_test(tc, a_shape_limits_refused_at_create_and_by_the_plan);
  tcase_add_test(tc, b_other_host_thread_uses_the_trainers_device);
  tcase_add_test(tc, c_predict_on_nan_rows_matches_the_cpu);
  tcase_add_test(tc, d_e_two_ranks_scaling_each_sequence_equal_one_rank);
  suite_add_tcase(s, tc);
  return s;
}
