/*
 * The optimizer step without a host wait, on the emulated
 * device (suite 'cuda-emu'), whose streams run work only when something forces them:
 *   - dflash_trainer_step_async enqueues the last backward, the norm, the clip factor (all
 *     on the device), AdamW and returns without a single cudaStreamSynchronize /
 *     cudaEventSynchronize / cudaDeviceSynchronize; the next step's zero_grad and first
 *     accumulate are enqueued behind it, and step_result then waits once, on the
 *     step's event;
 *   - several steps of that schedule (the next step's first sequence uploaded before the
 *     norm is asked for) equal dflash_trainer_step's, to the bit: norms, losses, parameters
 *     and gradients; a step_result read without the step's event (checked by hand: the
 *     pinned copy has not run yet) returns the previous step's norm and fails this;
 *   - a non-finite norm found on the device leaves the parameters unchanged and fails
 *     step_result with DFLASH_E_RANGE, the step uncounted;
 *   - dflash_train_run (which steps this way) equals DFLASH_TRAIN_SYNC_STEP=1 (a wait per
 *     step) to the bit: metrics and checkpoint.
 * Two ranks with ZeRO-1 and the overlapped reduce-scatter: tests/gpu/emu_overlap.c.
 */
#include <dflash/hidden.h>
#include <dflash/train.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../train/seq.h"
#include "../train/synth.h"
#include "gpu_common.h"
#include "testutil.h"
#include "train/backend.h"
#include "train/trainer.h"

void dfemu_sync_counts(uint64_t *stream_syncs, uint64_t *event_syncs, uint64_t *device_syncs,
                       int reset);

enum { STEPS = 3, PER = 2 }; /* steps, sequences per step */

typedef struct world {
  dflash_drafter_config c;
  float *E, *Hd;
  g_seq q[STEPS][PER];
  char id[STEPS][PER][16];
} world;

static void world_make(world *w) {
  g_small_config(&w->c);
  g_small_embeddings(&w->c, &w->E, &w->Hd);
  for (int k = 0; k < STEPS; k++)
    for (int i = 0; i < PER; i++) {
      ck_assert_int_eq(g_seq_make(&w->c, 48 + 8 * i + 4 * k, 6, 101 + 10 * k + i, &w->q[k][i]), 0);
      snprintf(w->id[k][i], sizeof w->id[k][i], "s%d.%d", k, i);
    }
}

static void world_free(world *w) {
  free(w->E), free(w->Hd);
  for (int k = 0; k < STEPS; k++)
    for (int i = 0; i < PER; i++) g_seq_free(&w->q[k][i]);
}

static dflash_trainer *make(const world *w, double lr) {
  dflash_trainer_options o;
  g_small_options(&o, DFLASH_BACKEND_CUDA);
  o.lr = lr;
  o.grad_clip = 0.02; /* clips: the factor computed on the device is used */
  dflash_trainer *t = NULL;
  ck_assert_ok(dflash_trainer_create(&w->c, w->E, w->Hd, &o, &t));
  return t;
}

static void accumulate(dflash_trainer *t, const world *w, int k, int i) {
  const g_seq *q = &w->q[k][i];
  dflash_sample smp = {.struct_size = sizeof smp,
                       .id = w->id[k][i],
                       .len = q->len,
                       .input_ids = q->ids,
                       .loss_mask = q->mask,
                       .hidden = q->hidden};
  ck_assert_ok(dflash_trainer_accumulate(t, seq_at(&smp, q->anchors, q->na), 0.02));
}

typedef struct outcome {
  double norm[STEPS], loss[STEPS], lr[STEPS];
  float *params, *grads;
  uint64_t step_syncs[3], result_syncs[3]; /* of the last async step: stream, event, device */
} outcome;

/* STEPS steps of PER sequences. async: each step's norm asked for only after the next
 * step's first sequence was accumulated (as dflash_train_run does). */
static void train(const world *w, bool async, outcome *o) {
  dflash_trainer *t = make(w, 0.05);
  for (int k = 0; k < STEPS; k++) {
    ck_assert_ok(dflash_trainer_zero_grad(t));
    for (int i = 0; i < PER; i++) {
      accumulate(t, w, k, i);
      if (async && i == 0 && k > 0) {
        uint64_t ss, es, ds;
        dfemu_sync_counts(NULL, NULL, NULL, 1);
        ck_assert_ok(dflash_trainer_step_result(t, &o->norm[k - 1]));
        dfemu_sync_counts(&ss, &es, &ds, 1);
        o->result_syncs[0] = ss, o->result_syncs[1] = es, o->result_syncs[2] = ds;
      }
    }
    ck_assert_ok(dflash_trainer_collect(t, &o->loss[k], NULL));
    if (!async) {
      ck_assert_ok(dflash_trainer_step(t, &o->norm[k], &o->lr[k]));
      continue;
    }
    uint64_t ss, es, ds;
    dfemu_sync_counts(NULL, NULL, NULL, 1);
    ck_assert_ok(dflash_trainer_step_async(t, &o->lr[k]));
    dfemu_sync_counts(&ss, &es, &ds, 1);
    o->step_syncs[0] = ss, o->step_syncs[1] = es, o->step_syncs[2] = ds;
    ck_assert_int_eq(dflash_trainer_step_count(t), k + 1); /* counted at once */
  }
  if (async) ck_assert_ok(dflash_trainer_step_result(t, &o->norm[STEPS - 1]));
  ck_assert_status(dflash_trainer_step_result(t, NULL), DFLASH_E_STATE, "no dflash_trainer_step");
  o->params = g_dump(t, 0);
  o->grads = g_dump(t, 1); /* the last step's clipped gradients */
  dflash_trainer_free(t);
}

START_TEST(step_async_equals_step_to_the_bit) {
  world w;
  world_make(&w);
  outcome a = {0}, b = {0};
  train(&w, false, &a);
  train(&w, true, &b);
  dflash_trainer *t = make(&w, 0.05);
  size_t n = t->m.n_params;
  float *p0 = g_dump(t, 0);
  dflash_trainer_free(t);
  size_t dp = g_n_differ(a.params, b.params, n), dg = g_n_differ(a.grads, b.grads, n);
  for (int k = 0; k < STEPS; k++)
    printf("step %d: norm %.17g (wait) vs %.17g (async), loss %.17g vs %.17g\n", k + 1, a.norm[k],
           b.norm[k], a.loss[k], b.loss[k]);
  printf("%zu of %zu parameters, %zu gradients differ; step_async: %llu stream / %llu event / "
         "%llu device waits; step_result: %llu / %llu / %llu\n",
         dp, n, dg, (unsigned long long)b.step_syncs[0], (unsigned long long)b.step_syncs[1],
         (unsigned long long)b.step_syncs[2], (unsigned long long)b.result_syncs[0],
         (unsigned long long)b.result_syncs[1], (unsigned long long)b.result_syncs[2]);
  for (int k = 0; k < STEPS; k++) {
    ck_assert_msg(a.norm[k] == b.norm[k], "step %d: norm %.17g vs %.17g", k + 1, a.norm[k],
                  b.norm[k]);
    ck_assert(a.loss[k] == b.loss[k] && a.lr[k] == b.lr[k]);
    ck_assert(a.norm[k] > 0.02); /* clipped: the device's factor was applied */
  }
  ck_assert(a.norm[0] != a.norm[1] && a.norm[1] != a.norm[2]); /* a stale read would show */
  ck_assert_msg(dp == 0 && dg == 0, "%zu parameters, %zu gradients differ", dp, dg);
  ck_assert_uint_gt(g_n_differ(p0, a.params, n), n / 2); /* the steps moved the weights */
  /* Nothing waited in step_async; step_result waited once, on the step's event. */
  ck_assert(b.step_syncs[0] == 0 && b.step_syncs[1] == 0 && b.step_syncs[2] == 0);
  ck_assert(b.result_syncs[0] == 0 && b.result_syncs[1] == 1 && b.result_syncs[2] == 0);
  free(a.params), free(a.grads), free(b.params), free(b.grads), free(p0);
  world_free(&w);
}
END_TEST

/* A non-finite gradient norm is found on the device: step_async returns, AdamW changes
 * nothing, step_result fails and the step does not count. */
START_TEST(non_finite_norm_fails_step_result_and_changes_nothing) {
  world w;
  world_make(&w);
  dflash_trainer *t = make(&w, 0.05);
  size_t n = t->m.n_params;
  float *p0 = g_dump(t, 0);
  ck_assert_ok(dflash_trainer_zero_grad(t));
  accumulate(t, &w, 0, 0);
  ck_assert_ok(dflash_trainer_collect(t, NULL, NULL));
  /* An Inf gradient, written into the device buffer. */
  ck_assert_ok(df_trainer_pull(t, DF_BUF_GRADS));
  t->m.grads[0] = INFINITY;
  ck_assert_ok(df_trainer_push(t, DF_BUF_GRADS));
  double lr, norm = 0;
  ck_assert_ok(dflash_trainer_step_async(t, &lr));
  ck_assert_int_eq(dflash_trainer_step_count(t), 1);
  dflash_status st = dflash_trainer_step_result(t, &norm);
  printf("non-finite norm: %s (%s), norm %g\n", dflash_status_str(st), dflash_last_error(), norm);
  ck_assert_int_eq(st, DFLASH_E_RANGE);
  ck_assert(strstr(dflash_last_error(), "not finite"));
  ck_assert(!isfinite(norm));
  ck_assert_int_eq(dflash_trainer_step_count(t), 0);
  float *p1 = g_dump(t, 0);
  ck_assert_uint_eq(g_n_differ(p0, p1, n), 0);
  free(p0), free(p1);
  dflash_trainer_free(t);
  world_free(&w);
}
END_TEST

/* ---- dflash_train_run: the overlapped step vs a wait per step ----------------------------- */

static void cuda_run(const char *root, const char *out, bool sync) {
  dflash_train_run_options o;
  synth_run_options(&o, root, out);
  o.epochs = 2;
  o.batch_size = 2;
  o.save_every = 2;
  synth_trainer(&o)->backend = DFLASH_BACKEND_CUDA;
  if (sync) setenv("DFLASH_TRAIN_SYNC_STEP", "1", 1);
  dflash_status st = dflash_train_run(&o, NULL);
  unsetenv("DFLASH_TRAIN_SYNC_STEP");
  ck_assert_msg(st == DFLASH_OK, "%s: %s", out, dflash_last_error());
}

START_TEST(train_run_equals_a_wait_per_step) {
  char *root = df_test_tmpdir();
  synth_world(root, 7, 40, 1);
  char *a = synth_at(root, "sync"), *b = synth_at(root, "async");
  cuda_run(root, a, true);
  cuda_run(root, b, false);
  synth_metric x[32], y[32];
  size_t nx = synth_metrics(a, x, 32), ny = synth_metrics(b, y, 32);
  printf("dflash_train_run: %zu steps (wait per step) vs %zu (async)\n", nx, ny);
  ck_assert_uint_eq(nx, ny);
  ck_assert_uint_ge(nx, 4);
  for (size_t i = 0; i < nx; i++) {
    printf("  step %ld: loss %.9g / %.9g, norm %.9g / %.9g\n", x[i].step, x[i].loss, y[i].loss,
           x[i].norm, y[i].norm);
    ck_assert_msg(x[i].step == y[i].step && x[i].loss == y[i].loss && x[i].norm == y[i].norm,
                  "step %ld: loss %.9g vs %.9g, norm %.9g vs %.9g", x[i].step, x[i].loss, y[i].loss,
                  x[i].norm, y[i].norm);
  }
  ck_assert_msg(synth_max_abs_diff(a, b) == 0, "the checkpoints differ");
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* Run by tests/check_main.c. */
Suite *df_test_suite(void) {
  Suite *s = suite_create("cuda_emu_async");
  TCase *tc = tcase_create("async");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, step_async_equals_step_to_the_bit);
  tcase_add_test(tc, non_finite_norm_fails_step_result_and_changes_nothing);
  tcase_add_test(tc, train_run_equals_a_wait_per_step);
  suite_add_tcase(s, tc);
  return s;
}
