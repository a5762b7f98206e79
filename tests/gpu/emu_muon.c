/*
 * Muon on the CUDA backend (cuda/backend.cu muon_step) on the emulated device, against the
 * CPU backend's Muon (src/train/optim_muon.c, itself checked against PyTorch by
 * tests/reference/oracle_optim.py):
 *
 * 1. world 1: the same model and the same gradients (pushed into both backends), several
 *    steps (the momentum carries over; the odd steps clip, so the momentum reads the device
 *    clip factor), the fp32 masters and Muon's momentum (m1) against the CPU's;
 * 2. a train_state saved by CPU Muon resumes on CUDA, and one saved by CUDA Muon on the CPU;
 * 3. two ranks (ZeRO-1 over the emulated NCCL, small buckets so that Muon matrices straddle
 *    both bucket and rank-slice boundaries) against one rank with the ranks' summed
 *    gradients: equal to the bit.
 *
 * Tolerance of 1 and 2: both sides start from the same fp32 masters and gradients; the
 * momentum is the same float arithmetic (equal to the bit), Newton-Schulz the same products,
 * but on the device on the tensor cores in TF32 (cuBLAS rounds each product's inputs to 10
 * mantissa bits, unit roundoff u = 2^-11 = 4.9e-4; the emulated cuBLAS does the same) where
 * the CPU multiplies in fp32, in another summation order and with the tall matrices in the
 * X (bA + cA^2) form instead of transposed. So the orthogonalised updates differ by TF32
 * rounding, amplified by the five quintic steps (slope a = 3.4 near 0). Measured: 2.2e-3
 * relative L2 in the updates (masters after minus before) after 4 steps, 3.5e-3 after the
 * resumes (4.4 u to 7 u; with fp32 products it was 5.3e-6). The bound is 1e-2 (20 u), and the
 * world-1 difference must exceed 1e-4 (the TF32 rounding is modelled, not fp32's); the
 * control, AdamW's update on the same gradients, differs from Muon's by 3.6.
 */
#include <dflash/train.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "train/backend.h"
#include "train/cuda/dfcuda.h"
#include "gpu_common.h"
#include "testutil.h"
#include "train/cuda/dist.h"
#include "train/trainer.h"

enum { STEPS = 4, MORE = 2, WORLD = 2 };
#define UPDATE_TOL 1e-2 /* 20 TF32 unit roundoffs (see above) */
#define TF32_SEEN 1e-4
static const size_t kBucket = 8192; /* elements: matrices straddle buckets and slices */

/* g_small_config with the MLP width (96) at which the tolerances above were measured. */
static void small_config(dflash_drafter_config *c) {
  g_small_config(c);
  c->intermediate_size = 96;
}

static void muon_options(dflash_trainer_options *o, int32_t backend) {
  dflash_trainer_options_default(o);
  o->backend = backend, o->seed = 3, o->vocab_chunk = 128, o->init_std = 0.05;
  o->optimizer = DFLASH_OPTIMIZER_MUON, o->lr = 1e-3, o->weight_decay = 0.01;
}

/* Step k's gradients: odd steps have a norm above the clip (1), even ones below. */
static float *grads_of(size_t n, int k, int part) {
  float scale = (float)((k % 2 ? 2.0 : 0.2) / sqrt((double)n));
  return g_random(n, scale, 100 + 10 * (uint64_t)k + (uint64_t)part);
}

static df_adam adam_of(const dflash_trainer *t, int k) {
  const dflash_trainer_options *o = &t->opt;
  return (df_adam){.lr = o->lr,
                   .weight_decay = o->weight_decay,
                   .beta1 = o->beta1,
                   .beta2 = o->beta2,
                   .eps = o->adam_eps,
                   .grad_clip = o->grad_clip,
                   .step = k + 1,
                   .muon = o->optimizer == DFLASH_OPTIMIZER_MUON,
                   .muon_momentum = o->muon_momentum,
                   .muon_weight_decay = o->muon_weight_decay,
                   .muon_adjust_lr = o->muon_adjust_lr};
}

/* One optimizer step of trainer t on gradients g, through its backend (as
 * dflash_trainer_step, with the gradients set instead of accumulated). */
static void step_with(dflash_trainer *t, const float *g, int k, double *norm) {
  df_backend *be = t->be;
  memcpy(t->m.grads, g, sizeof(float) * t->m.n_params); /* the CPU's storage */
  ck_assert_ok(be->vt->push(be, DF_BUF_GRADS, t->m.grads));
  df_adam a = adam_of(t, k);
  ck_assert_ok(be->vt->step(be, &a, norm));
  be->stale |= DF_BUF_PARAMS | DF_BUF_GRADS | DF_BUF_M1 | DF_BUF_M2;
}

/* ||(a - base) - (b - base)|| / ||b - base|| over the elements where mask is `want`. */
static double rel_update(const float *a, const float *b, const float *base, const uint8_t *mask,
                         int want, size_t n) {
  double d = 0, r = 0;
  for (size_t i = 0; i < n; i++) {
    if (mask[i] != want) continue;
    double da = (double)a[i] - (base ? base[i] : 0), db = (double)b[i] - (base ? base[i] : 0);
    d += (da - db) * (da - db), r += db * db;
  }
  return sqrt(d / (r > 0 ? r : 1));
}

/* 1 where df_muon_takes the parameter's tensor. */
static uint8_t *muon_mask(const df_model *m) {
  uint8_t *mask = calloc(m->n_params, 1);
  for (size_t i = 0; i < m->n_tensors; i++)
    if (df_muon_takes(&m->tensors[i])) memset(mask + m->tensors[i].offset, 1, m->tensors[i].numel);
  return mask;
}

static dflash_trainer *make(const dflash_drafter_config *c, const float *E, const float *Hd,
                            int32_t backend, int32_t optimizer) {
  dflash_trainer_options o;
  muon_options(&o, backend);
  o.optimizer = optimizer;
  dflash_trainer *t = NULL;
  ck_assert_ok(dflash_trainer_create(c, E, Hd, &o, &t));
  return t;
}

static void pull_all(dflash_trainer *t) {
  ck_assert_ok(df_trainer_pull(t, DF_BUF_PARAMS | DF_BUF_M1 | DF_BUF_M2));
}

/* Masters (as updates from base) and momentum of a against b, Muon and AdamW elements apart. */
static void compare(const char *what, const dflash_trainer *a, const dflash_trainer *b,
                    const float *base, const uint8_t *mask, double *worst) {
  size_t n = a->m.n_params;
  double pm = rel_update(a->m.params, b->m.params, base, mask, 1, n);
  double pa = rel_update(a->m.params, b->m.params, base, mask, 0, n);
  double mm = rel_update(a->m1, b->m1, NULL, mask, 1, n);
  double ma = rel_update(a->m1, b->m1, NULL, mask, 0, n);
  printf("%s: Muon updates %.3g, momentum %.3g; AdamW updates %.3g, m1 %.3g (relative L2)\n", what,
         pm, mm, pa, ma);
  double w = fmax(fmax(pm, pa), fmax(mm, ma));
  *worst = fmax(*worst, w);
  ck_assert_msg(w <= UPDATE_TOL, "%s: differs by %g (bound %g)", what, w, UPDATE_TOL);
  for (size_t i = 0; i < n; i++) /* Muon keeps m2 at 0 on its matrices, as the CPU */
    if (mask[i]) ck_assert(a->m2[i] == 0 && b->m2[i] == 0);
}

START_TEST(cuda_muon_equals_cpu_muon_and_resumes_across_backends) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  small_config(&c);
  float *E, *Hd;
  g_small_embeddings(&c, &E, &Hd);
  dflash_trainer *cpu = make(&c, E, Hd, DFLASH_BACKEND_CPU, DFLASH_OPTIMIZER_MUON);
  dflash_trainer *cu = make(&c, E, Hd, DFLASH_BACKEND_CUDA, DFLASH_OPTIMIZER_MUON);
  dflash_trainer *adam = make(&c, E, Hd, DFLASH_BACKEND_CPU, DFLASH_OPTIMIZER_ADAMW);
  size_t n = cpu->m.n_params;
  uint8_t *mask = muon_mask(&cpu->m);
  float *base = malloc(4 * n);
  memcpy(base, cpu->m.params, 4 * n);
  ck_assert(!memcmp(cu->m.params, base, 4 * n));
  double worst = 0, nc[STEPS + MORE], ng[STEPS + MORE], na;
  for (int k = 0; k < STEPS; k++) {
    float *g = grads_of(n, k, 0);
    step_with(cpu, g, k, &nc[k]);
    step_with(cu, g, k, &ng[k]);
    step_with(adam, g, k, &na);
    ck_assert(fabs(nc[k] - ng[k]) <= 1e-6 * nc[k]);
    free(g);
  }
  printf("norms %.6g %.6g %.6g %.6g (clip 1)\n", nc[0], nc[1], nc[2], nc[3]);
  ck_assert(nc[1] > 1 && nc[0] < 1);
  pull_all(cu);
  compare("world 1, CUDA vs CPU Muon after 4 steps", cu, cpu, base, mask, &worst);
  ck_assert_msg(worst > TF32_SEEN, "world 1 differs by %g: TF32's rounding not seen", worst);
  /* The control: AdamW's update on the same gradients is far from Muon's. */
  double control = rel_update(adam->m.params, cpu->m.params, base, mask, 1, n);
  printf("control: AdamW vs Muon updates on the Muon matrices %.3g\n", control);
  ck_assert(control > 100 * UPDATE_TOL);

  /* A non-finite gradient norm changes nothing: not the masters, not the momentum. */
  float *p0 = malloc(4 * n), *m0 = malloc(4 * n), *bad = grads_of(n, 0, 0);
  memcpy(p0, cu->m.params, 4 * n), memcpy(m0, cu->m1, 4 * n);
  bad[n / 2] = NAN;
  memcpy(cu->m.grads, bad, 4 * n);
  ck_assert_ok(cu->be->vt->push(cu->be, DF_BUF_GRADS, cu->m.grads));
  df_adam a = adam_of(cu, STEPS);
  ck_assert_status(cu->be->vt->step(cu->be, &a, &na), DFLASH_E_RANGE, "not finite");
  cu->be->stale |= DF_BUF_PARAMS | DF_BUF_M1 | DF_BUF_M2;
  pull_all(cu);
  ck_assert(!memcmp(p0, cu->m.params, 4 * n) && !memcmp(m0, cu->m1, 4 * n));
  free(p0), free(m0), free(bad);

  /* A train_state saved by CPU Muon resumes on CUDA; one saved by CUDA Muon on the CPU. */
  char *dir = df_test_tmpdir();
  char path_c[512], path_g[512];
  snprintf(path_c, sizeof path_c, "%s/cpu.safetensors", dir);
  snprintf(path_g, sizeof path_g, "%s/cuda.safetensors", dir);
  ck_assert_ok(dflash_trainer_save_state(cpu, path_c, NULL, 0));
  ck_assert_ok(dflash_trainer_save_state(cu, path_g, NULL, 0));
  dflash_trainer *cu2 = make(&c, E, Hd, DFLASH_BACKEND_CUDA, DFLASH_OPTIMIZER_MUON);
  dflash_trainer *cpu2 = make(&c, E, Hd, DFLASH_BACKEND_CPU, DFLASH_OPTIMIZER_MUON);
  size_t len = 0;
  char blob[1];
  ck_assert_ok(dflash_trainer_load_state(cu2, path_c, blob, sizeof blob, &len));
  ck_assert_ok(dflash_trainer_load_state(cpu2, path_g, blob, sizeof blob, &len));
  /* What CUDA saved is what it held: the CPU trainer loads it exactly. */
  ck_assert(!memcmp(cpu2->m.params, cu->m.params, 4 * n) && !memcmp(cpu2->m1, cu->m1, 4 * n));
  float *before = malloc(4 * n);
  memcpy(before, cpu->m.params, 4 * n);
  for (int k = STEPS; k < STEPS + MORE; k++) {
    float *g = grads_of(n, k, 0);
    step_with(cpu, g, k, &nc[k]);
    step_with(cu2, g, k, &ng[k]);
    step_with(cpu2, g, k, &na);
    free(g);
  }
  pull_all(cu2);
  compare("CPU state resumed on CUDA, 2 more steps", cu2, cpu, before, mask, &worst);
  compare("CUDA state resumed on the CPU, 2 more steps", cpu2, cpu, before, mask, &worst);
  printf("worst relative difference %.3g (bound %g)\n", worst, UPDATE_TOL);
  df_test_rmtree(dir);
  free(dir);
  free(before), free(base), free(mask);
  dflash_trainer_free(cpu), dflash_trainer_free(cu), dflash_trainer_free(adam);
  dflash_trainer_free(cu2), dflash_trainer_free(cpu2);
  free(E), free(Hd);
}
END_TEST

/* ---- two ranks against one --------------------------------------------------------------- */

typedef struct rank_job {
  const df_model *m;
  int rank, world;
  const unsigned char *id;
  const float *g[STEPS]; /* this rank's gradients per step */
  float *params, *m1, *m2;
  double norm[STEPS];
  dflash_status st;
  char err[512];
} rank_job;

static df_cu_muon_mat *muon_list(const df_model *m, size_t *n) {
  df_cu_muon_mat *l = malloc(sizeof *l * m->n_tensors);
  *n = 0;
  for (size_t i = 0; i < m->n_tensors; i++) {
    const df_tensor_info *ti = &m->tensors[i];
    if (df_muon_takes(ti))
      l[(*n)++] = (df_cu_muon_mat){ti->offset, ti->shape[0], ti->shape[1],
                                   df_muon_lr_scale(DFLASH_MUON_ADJUST_LR_MATCH_RMS_ADAMW,
                                                    ti->shape[0], ti->shape[1])};
  }
  return l;
}

/* The device step's constants for step k, as backend_cuda.c's cuda_step makes them (clip
 * off: the norm's sum over ranks is another double order, whose rounding would move the
 * clip factor; world 1 covers the clip). */
static df_cu_adam cu_adam(int k) {
  df_adam a = {.lr = 1e-3,
               .weight_decay = 0.01,
               .beta1 = 0.9,
               .beta2 = 0.95,
               .eps = 1e-8,
               .step = k + 1,
               .muon = true,
               .muon_momentum = 0.95,
               .muon_weight_decay = 0.1};
  df_adam_consts c;
  df_adam_constants(&a, &c);
  return (df_cu_adam){.decay = c.decay,
                      .b1 = c.b1,
                      .b2 = c.b2,
                      .eps = c.eps,
                      .step_size = c.step_size,
                      .bc2_sqrt = c.bc2_sqrt,
                      .clip = 0,
                      .grad_factor = 1.0,
                      .muon = 1,
                      .lr = a.lr,
                      .muon_mu = (float)a.muon_momentum,
                      .muon_decay = (float)(1.0 - a.lr * a.muon_weight_decay)};
}

static void *rank_main(void *arg) {
  rank_job *j = arg;
  const df_model *m = j->m;
  size_t *offs = malloc(sizeof(size_t) * m->n_tensors), n_muon = 0;
  df_cu_muon_mat *muon = muon_list(m, &n_muon);
  df_cu_config cfg;
  df_cu_config_of(m, offs, &cfg);
  cfg.device = cfg.rank = j->rank, cfg.world = j->world, cfg.bucket_elems = kBucket;
  cfg.muon = muon, cfg.n_muon = n_muon;
  df_cu_model *dev = NULL;
  dflash_status st = df_cu_create(&cfg, m->params, m->embed, m->lm_head, &dev);
  if (!st && j->world > 1) st = df_cu_nccl_init(dev, j->rank, j->world, j->id, 60);
  for (int k = 0; !st && k < STEPS; k++) {
    df_cu_adam a = cu_adam(k);
    st = df_cu_copy(dev, DF_CU_GRADS, (float *)j->g[k], 0);
    if (!st) st = df_cu_step(dev, &a, &j->norm[k]);
  }
  if (!st) st = df_cu_copy(dev, DF_CU_PARAMS, j->params, 1);
  if (!st) st = df_cu_copy(dev, DF_CU_M1, j->m1, 1);
  if (!st) st = df_cu_copy(dev, DF_CU_M2, j->m2, 1);
  j->st = st;
  if (st) snprintf(j->err, sizeof j->err, "%s", dflash_last_error());
  df_cu_free(dev);
  free(offs), free(muon);
  return NULL;
}

static void run(rank_job *jobs, int world) {
  unsigned char id[DF_CU_NCCL_ID_BYTES];
  ck_assert_ok(df_cu_nccl_unique_id(id));
  pthread_t th[WORLD];
  for (int r = 0; r < world; r++) jobs[r].id = id;
  for (int r = 0; r < world; r++) pthread_create(&th[r], NULL, rank_main, &jobs[r]);
  for (int r = 0; r < world; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < world; r++)
    ck_assert_msg(!jobs[r].st, "rank %d of %d: %s", r, world, jobs[r].err);
}

/* Whether some Muon matrix crosses a rank's slice boundary inside a bucket, and some a
 * bucket boundary, in the world-2 layout. */
static void check_straddles(const df_model *m) {
  df_bucket_layout lay;
  ck_assert_ok(df_bucket_layout_init(&lay, m->n_params, WORLD, kBucket));
  int slices = 0, buckets = 0;
  for (size_t i = 0; i < m->n_tensors; i++) {
    const df_tensor_info *ti = &m->tensors[i];
    if (!df_muon_takes(ti)) continue;
    for (size_t b = 0; b < lay.n_buckets; b++) {
      size_t lo = lay.buckets[b].offset, mid = lo + lay.buckets[b].count / WORLD;
      slices += ti->offset < mid && mid < ti->offset + ti->numel;
      buckets += ti->offset < lo && lo < ti->offset + ti->numel;
    }
  }
  printf("world 2: %zu buckets of <= %zu; Muon matrices cross %d slice and %d bucket "
         "boundaries\n",
         lay.n_buckets, kBucket, slices, buckets);
  ck_assert(slices > 0 && buckets > 0);
  df_bucket_layout_free(&lay);
}

START_TEST(cuda_muon_two_ranks_equal_one) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  small_config(&c);
  float *E, *Hd;
  g_small_embeddings(&c, &E, &Hd);
  dflash_trainer *cpu = make(&c, E, Hd, DFLASH_BACKEND_CPU, DFLASH_OPTIMIZER_MUON);
  const df_model *m = &cpu->m;
  size_t n = m->n_params;
  check_straddles(m);
  float *g[WORLD + 1][STEPS];
  for (int k = 0; k < STEPS; k++) {
    g[0][k] = grads_of(n, k, 0), g[1][k] = grads_of(n, k, 1), g[2][k] = malloc(4 * n);
    for (size_t i = 0; i < n; i++) g[2][k][i] = g[0][k][i] + g[1][k][i];
  }
  rank_job one = {.m = m, .rank = 0, .world = 1}, two[WORLD];
  for (int k = 0; k < STEPS; k++) one.g[k] = g[2][k];
  for (int r = 0; r < WORLD; r++) {
    two[r] = (rank_job){.m = m, .rank = r, .world = WORLD};
    for (int k = 0; k < STEPS; k++) two[r].g[k] = g[r][k];
  }
  rank_job *all[WORLD + 1] = {&one, &two[0], &two[1]};
  for (int i = 0; i <= WORLD; i++)
    all[i]->params = malloc(4 * n), all[i]->m1 = malloc(4 * n), all[i]->m2 = malloc(4 * n);
  run(&one, 1);
  run(two, WORLD);
  uint8_t *mask = muon_mask(m);
  for (int r = 0; r < WORLD; r++) {
    for (int k = 0; k < STEPS; k++)
      ck_assert_msg(fabs(two[r].norm[k] - one.norm[k]) <= 1e-12 * one.norm[k],
                    "step %d: norm %.17g vs %.17g", k, two[r].norm[k], one.norm[k]);
    for (size_t i = 0; i < n; i++) {
      ck_assert_msg(!memcmp(&two[r].params[i], &one.params[i], 4) &&
                        !memcmp(&two[r].m1[i], &one.m1[i], 4) &&
                        !memcmp(&two[r].m2[i], &one.m2[i], 4),
                    "rank %d, element %zu (%s): master %.9g vs %.9g, m1 %.9g vs %.9g", r, i,
                    mask[i] ? "Muon" : "AdamW", two[r].params[i], one.params[i], two[r].m1[i],
                    one.m1[i]);
    }
  }
  /* The steps moved the Muon matrices (equal no-ops would pass too). */
  ck_assert(rel_update(one.params, m->params, NULL, mask, 1, n) > 0);
  double moved = 0;
  for (size_t i = 0; i < n; i++)
    if (mask[i]) moved = fmax(moved, fabs((double)one.params[i] - m->params[i]));
  printf("two ranks (ZeRO-1) equal one rank to the bit over %d Muon steps; largest Muon "
         "update %.3g\n",
         STEPS, moved);
  ck_assert(moved > 1e-4);
  for (int i = 0; i <= WORLD; i++) free(all[i]->params), free(all[i]->m1), free(all[i]->m2);
  for (int k = 0; k < STEPS; k++) free(g[0][k]), free(g[1][k]), free(g[2][k]);
  free(mask);
  dflash_trainer_free(cpu);
  free(E), free(Hd);
}
END_TEST

/* Run by tests/check_main.c. Two emulated devices for the two-rank case; set before any
 * test forks, so every test sees them. */
Suite *df_test_suite(void) {
  setenv("DFLASH_EMU_DEVICES", "2", 1);
  Suite *s = suite_create("cuda_emu_muon");
  TCase *tc = tcase_create("muon");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, cuda_muon_equals_cpu_muon_and_resumes_across_backends);
  tcase_add_test(tc, cuda_muon_two_ranks_equal_one);
  suite_add_tcase(s, tc);
  return s;
}
