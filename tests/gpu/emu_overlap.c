/*
 * With several ranks, cuda/model.cu reduce-scatters the gradients bucket by
 * bucket on a communication stream while the backward of the step's last sequence runs,
 * each bucket behind an event recorded after its last dW GEMM. Two ranks over NCCL
 * (threads of this process, one emulated device each) with small buckets (many per layer)
 * must give the same row losses, norms, parameters, moments and gathered gradients, to the
 * bit, with the overlap (default) and without it (df_cu_config.no_overlap: the
 * reduce-scatter after the backward on the compute stream, as before).
 *
 * Why this tests the ordering: the emulator runs queued work only when something forces it,
 * and the step drains the communication stream first; without the cudaStreamWaitEvent in
 * issue_ready, every bucket would be reduced before the backward that completes it ran
 * (checked by hand: the parameters then differ, see the commit that added this test).
 * The calls between accumulate and step (predict, scale_grads) run the deferred backward
 * first: covered here as well.
 *
 * A third mode steps without waiting (df_cu_step with norm NULL, as dflash_trainer_step_async):
 * the next step's zero_grad and first sequence are enqueued before df_cu_step_result asks
 * for the norm, so nothing drains the communication stream before the compute stream; the
 * norm, clip and AdamW there wait for the reduce-scatter through the ev_comm event alone.
 * It must equal the other two to the bit (without that event wait the compute stream reads
 * the gradients before the reduce-scatter: see the commit that added this mode).
 *
 * A fourth reduce-scatters in bf16 (df_cu_config.rs_bf16, the option grad_reduce_bf16): within
 * bf16's rounding of the fp32 mode, not equal to it.
 */
#include <dflash/train.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "train/backend.h"
#include "train/cuda/dfcuda.h"
#include "emu_batch.h"
#include "gpu_common.h"
#include "testutil.h"
#include "core/bf16.h"
#include "train/cuda/dist.h"
#include "train/trainer.h"

enum { WORLD = 2, SEQS = 2, STEPS = 2 };
static const size_t kBucket = 8192; /* elements: 11 buckets over the small model */


typedef struct rank_job {
  const df_model *m;
  int rank, no_overlap, async, rs_bf16;
  const unsigned char *id;
  batch *seqs[SEQS];
  float *loss[STEPS][SEQS], *grads, *params, *m1, *m2;
  int32_t *pred;
  double norm[STEPS];
  dflash_status st;
  char err[512];
} rank_job;

/* grad_factor != 1 (as backend_cuda.c passes with several ranks): the scaling runs per
 * bucket on the communication stream when overlapped, on the whole buffer when not. */
static const df_cu_adam kAdam = {.decay = 0.99f,
                                 .b1 = 0.9f,
                                 .b2 = 0.95f,
                                 .eps = 1e-8f,
                                 .step_size = 1e-2f,
                                 .bc2_sqrt = 0.2236068f,
                                 .clip = 0.5,
                                 .grad_factor = 0.75};

/* Step 1: one sequence, step. Step 2: zero, one sequence, a predict and a
 * rescale in between (each runs the deferred backward first), the other, step; then the
 * gathered gradients and everything else to the host. */
static dflash_status run_rank(rank_job *j, df_cu_model *dev) {
  dflash_status st = DFLASH_OK;
  st = df_cu_accumulate(dev, &j->seqs[0]->b, j->loss[0][0]);
  if (!st) st = df_cu_step(dev, &kAdam, j->async ? NULL : &j->norm[0]);
  if (!st) st = df_cu_zero_grad(dev);
  /* async: the next step's first sequence deferred (no wait) before the norm is read */
  if (!st) st = df_cu_accumulate(dev, &j->seqs[1]->b, j->async ? NULL : j->loss[1][1]);
  if (!st && j->async) st = df_cu_step_result(dev, &j->norm[0]);
  if (!st) st = df_cu_predict(dev, &j->seqs[0]->b, j->pred);
  if (!st) st = df_cu_scale_grads(dev, 0.5);
  if (!st) st = df_cu_accumulate(dev, &j->seqs[0]->b, j->loss[1][0]);
  if (!st) st = df_cu_step(dev, &kAdam, j->async ? NULL : &j->norm[1]);
  if (!st && j->async) st = df_cu_step_result(dev, &j->norm[1]);
  double sum = 0;
  int64_t bad = 0;
  if (!st && j->async) st = df_cu_results(dev, &sum, &bad, 1);
  if (!st && j->async && (bad != -1 || !(sum > 0)))
    st = df_error(DFLASH_E_INTERNAL, "deferred sequence: loss %g, bad %lld", sum, (long long)bad);
  if (!st) st = df_cu_copy(dev, DF_CU_GRADS, j->grads, 1);
  if (!st) st = df_cu_copy(dev, DF_CU_PARAMS, j->params, 1);
  if (!st) st = df_cu_copy(dev, DF_CU_M1, j->m1, 1);
  if (!st) st = df_cu_copy(dev, DF_CU_M2, j->m2, 1);
  return st;
}

static void *rank_main(void *arg) {
  rank_job *j = arg;
  const df_model *m = j->m;
  size_t *offs = malloc(sizeof(size_t) * m->n_tensors);
  df_cu_config cfg;
  df_cu_config_of(m, offs, &cfg);
  cfg.device = cfg.rank = j->rank, cfg.world = WORLD;
  cfg.bucket_elems = kBucket, cfg.no_overlap = j->no_overlap, cfg.rs_bf16 = j->rs_bf16;
  df_cu_model *dev = NULL;
  dflash_status st = df_cu_create(&cfg, m->params, m->embed, m->lm_head, &dev);
  if (!st) st = df_cu_nccl_init(dev, j->rank, WORLD, j->id, 60);
  if (!st) st = run_rank(j, dev);
  j->st = st;
  if (st) snprintf(j->err, sizeof j->err, "%s", dflash_last_error());
  df_cu_free(dev);
  free(offs);
  return NULL;
}

/* Both ranks of one mode, in threads. */
static void run_mode(rank_job *jobs) {
  unsigned char id[DF_CU_NCCL_ID_BYTES];
  ck_assert_ok(df_cu_nccl_unique_id(id));
  pthread_t th[WORLD];
  for (int r = 0; r < WORLD; r++) jobs[r].id = id;
  for (int r = 0; r < WORLD; r++) pthread_create(&th[r], NULL, rank_main, &jobs[r]);
  for (int r = 0; r < WORLD; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < WORLD; r++)
    ck_assert_msg(!jobs[r].st, "rank %d (%s): %s", r,
                  jobs[r].no_overlap ? "not overlapped"
                  : jobs[r].async    ? "overlapped, no wait"
                  : jobs[r].rs_bf16  ? "bf16 reduce-scatter"
                                     : "overlapped",
                  jobs[r].err);
}

static size_t first_diff(const float *a, const float *b, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (memcmp(a + i, b + i, 4)) return i;
  return n;
}

static void alloc_job(rank_job *j, size_t n, batch *b) {
  for (int k = 0; k < STEPS; k++)
    for (int s = 0; s < SEQS; s++) j->loss[k][s] = calloc((size_t)b[s].b.R + 1, sizeof(float));
  j->grads = malloc(n * 4), j->params = malloc(n * 4), j->m1 = malloc(n * 4);
  j->m2 = malloc(n * 4), j->pred = calloc((size_t)b[0].b.R + 1, sizeof(int32_t));
}

static void free_job(rank_job *j) {
  for (int k = 0; k < STEPS; k++)
    for (int s = 0; s < SEQS; s++) free(j->loss[k][s]);
  free(j->grads), free(j->params), free(j->m1), free(j->m2), free(j->pred);
}

/* The two modes' rank r agree to the bit on everything the run produced. */
static void same(const rank_job *o, const rank_job *p, size_t n, const batch *b) {
  bool async = o->async || p->async; /* the deferred sequence has no row losses */
  for (int k = 0; k < STEPS; k++) {
    ck_assert_msg(o->norm[k] == p->norm[k], "rank %d step %d: norm %.17g overlapped, %.17g not",
                  o->rank, k + 1, o->norm[k], p->norm[k]);
    for (int s = 0; s < SEQS; s++)
      ck_assert((k == 0 && s == 1) || (async && k == 1 && s == 1) ||
                !memcmp(o->loss[k][s], p->loss[k][s], sizeof(float) * (size_t)b[s].b.R));
  }
  ck_assert(!memcmp(o->pred, p->pred, sizeof(int32_t) * (size_t)b[0].b.R));
  const float *bufs[4][2] = {{o->grads, p->grads},
                             {o->params, p->params},
                             {o->m1, p->m1},
                             {o->m2, p->m2}};
  const char *what[4] = {"gradients", "parameters", "first moments", "second moments"};
  for (int k = 0; k < 4; k++) {
    size_t i = first_diff(bufs[k][0], bufs[k][1], n);
    ck_assert_msg(i == n, "rank %d: %s differ at %zu of %zu: %.9g overlapped, %.9g not", o->rank,
                  what[k], i, n, bufs[k][0][i], bufs[k][1][i]);
  }
}

/* ||a - b|| / ||b|| over n floats. */
static double rel_l2(const float *a, const float *b, size_t n) {
  double d = 0, r = 0;
  for (size_t i = 0; i < n; i++)
    d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), r += (double)b[i] * b[i];
  return sqrt(d / (r > 0 ? r : 1));
}

START_TEST(overlapped_reduce_scatter_equals_the_one_after_the_backward) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  g_small_config(&c);
  float *E, *Hd;
  g_small_embeddings(&c, &E, &Hd);
  dflash_trainer_options opt;
  dflash_trainer_options_default(&opt);
  opt.backend = DFLASH_BACKEND_CPU, opt.seed = 3, opt.vocab_chunk = 128, opt.init_std = 0.05;
  dflash_trainer *cpu = NULL;
  ck_assert_ok(dflash_trainer_create(&c, E, Hd, &opt, &cpu));
  const df_model *m = &cpu->m;
  size_t n = m->n_params;
  df_bucket_layout lay;
  ck_assert_ok(df_bucket_layout_init(&lay, n, WORLD, kBucket));
  printf("%zu parameters in %zu buckets of <= %zu over %d layers\n", n, lay.n_buckets, kBucket,
         m->L);
  /* Several buckets per layer, so buckets are issued while later layers still compute. */
  ck_assert_uint_ge(lay.n_buckets, 4 * (size_t)m->L);
  df_bucket_layout_free(&lay);
  g_seq q[WORLD][SEQS];
  batch b[WORLD][SEQS];
  for (int r = 0; r < WORLD; r++)
    for (int s = 0; s < SEQS; s++) {
      ck_assert_int_eq(g_seq_make(&c, 60 + 10 * s + 5 * r, 5 + s, 40 + 2 * r + s, &q[r][s]), 0);
      make_batch(m, &q[r][s], 0.01 * (1 + r + s), &b[r][s]);
    }
  rank_job jobs[4][WORLD];
  for (int mode = 0; mode < 4; mode++)
    for (int r = 0; r < WORLD; r++) {
      jobs[mode][r] = (rank_job){.m = m,
                                 .rank = r,
                                 .no_overlap = mode == 1,
                                 .async = mode == 2,
                                 .rs_bf16 = mode == 3,
                                 .seqs = {&b[r][0], &b[r][1]}};
      alloc_job(&jobs[mode][r], n, b[r]);
    }
  for (int mode = 0; mode < 4; mode++) run_mode(jobs[mode]);
  printf("norms %.17g, %.17g (overlapped); %.17g, %.17g (not); %.17g, %.17g (no wait)\n",
         jobs[0][0].norm[0], jobs[0][0].norm[1], jobs[1][0].norm[0], jobs[1][0].norm[1],
         jobs[2][0].norm[0], jobs[2][0].norm[1]);
  for (int r = 0; r < WORLD; r++) same(&jobs[0][r], &jobs[1][r], n, b[r]);
  for (int r = 0; r < WORLD; r++) same(&jobs[0][r], &jobs[2][r], n, b[r]);
  /* The step moved the weights: a no-op on both sides would also be "equal". */
  ck_assert_uint_lt(first_diff(jobs[0][0].params, m->params, n), n);
  /* The bf16 reduce-scatter (mode 3) against fp32's: its summed gradients within bf16's
   * rounding (dfcuda.h: (world + 1) x 2^-9 of the ranks' magnitudes per element; 2^-7 of the
   * norm here, two ranks), the norms likewise, the weights after two AdamW steps close;
   * and not equal, or the option did nothing. */
  for (int r = 0; r < WORLD; r++) {
    const rank_job *f = &jobs[0][r], *h = &jobs[3][r];
    double eg = rel_l2(h->grads, f->grads, n), ep = rel_l2(h->params, f->params, n);
    printf("rank %d, bf16 vs fp32 reduce-scatter: gradients %.3g, parameters %.3g relative; "
           "norms %.9g / %.9g\n",
           r, eg, ep, h->norm[1], f->norm[1]);
    ck_assert(eg > 0 && eg <= 0x1p-7);
    ck_assert(ep <= 1e-3);
    for (int k = 0; k < STEPS; k++) ck_assert(fabs(h->norm[k] - f->norm[k]) <= 0x1p-7 * f->norm[k]);
  }
  for (int mode = 0; mode < 4; mode++)
    for (int r = 0; r < WORLD; r++) free_job(&jobs[mode][r]);
  for (int r = 0; r < WORLD; r++)
    for (int s = 0; s < SEQS; s++) free_batch(&b[r][s]), g_seq_free(&q[r][s]);
  dflash_trainer_free(cpu);
  free(E), free(Hd);
}
END_TEST

/* Run by tests/check_main.c. Two emulated devices, one a rank. */
Suite *df_test_suite(void) {
  setenv("DFLASH_EMU_DEVICES", "2", 1);
  Suite *s = suite_create("cuda_emu_overlap");
  TCase *tc = tcase_create("overlap");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, overlapped_reduce_scatter_equals_the_one_after_the_backward);
  suite_add_tcase(s, tc);
  return s;
}
