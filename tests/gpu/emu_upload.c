/*
 * The CUDA trainer's host path off the critical path, on the emulated
 * device (suite 'cuda-emu'), whose streams run work only when something forces them, so a
 * staging buffer refilled before its copy ran, or a missing wait, reads the wrong rows:
 *   - hidden rows uploaded as stored (bf16, or fp8 e4m3 with a scale per token and layer)
 *     and converted on the device give the gradients, parameters and losses of the float32
 *     path fed the same values, to the bit (both decodings are exact or the same fp32
 *     product);
 *   - several sequences accumulated back to back, with no wait, through the two pinned
 *     stages equal the same sequences accumulated one at a time with a wait each;
 *   - dflash_trainer_accumulate never calls cudaStreamSynchronize (the emulator
 *     counts it): one wait per batch, at collect;
 *   - a NaN/Inf hidden row is found on the device and refused at collect or at the step,
 *     naming the sample, with no parameter changed;
 *   - dflash_train_run from an offline store and from a spool uploads the rows as stored
 *     (half the host-to-device bytes of the float32 path for bf16) with the same result.
 */
#include <dflash/hidden.h>
#include <dflash/experimental.h>
#include <dflash/train.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../train/seq.h"
#include "../train/synth.h"
#include "gpu_common.h"
#include "testutil.h"
#include "core/bf16.h"
#include "train/trainer.h"

void dfemu_sync_counts(uint64_t *stream_syncs, uint64_t *event_syncs, uint64_t *device_syncs,
                       int reset);
uint64_t dfemu_from_host_bytes(int device, int reset);

typedef struct world {
  dflash_drafter_config c;
  float *E, *Hd;
} world;

static void world_make(world *w) {
  g_small_config(&w->c);
  g_small_embeddings(&w->c, &w->E, &w->Hd);
}

static void world_free(world *w) { free(w->E), free(w->Hd); }

static dflash_trainer *make(const world *w, int backend) {
  dflash_trainer_options o;
  g_small_options(&o, backend);
  dflash_trainer *t = NULL;
  ck_assert_ok(dflash_trainer_create(&w->c, w->E, w->Hd, &o, &t));
  return t;
}

/* A sequence with its hidden rows as stored, and the float32 rows they decode to. */
typedef struct stored_seq {
  g_seq q;
  int32_t dtype;
  void *codes;
  float *scales;  /* fp8: [len, K] */
  float *decoded; /* [len, K*H] */
  char id[32];
} stored_seq;

static void stored_make(const world *w, int64_t len, uint64_t seed, int32_t dtype, stored_seq *s) {
  ck_assert_int_eq(g_seq_make(&w->c, len, 6, seed, &s->q), 0);
  int K = w->c.n_target_layer_ids, H = w->c.hidden_size;
  size_t n = (size_t)len * K * H, rows = (size_t)len * K;
  s->dtype = dtype;
  snprintf(s->id, sizeof s->id, "seq-%llu", (unsigned long long)seed);
  s->decoded = malloc(n * sizeof(float));
  s->scales = NULL;
  if (dtype == DFLASH_DTYPE_BF16) {
    uint16_t *c = malloc(2 * n);
    for (size_t i = 0; i < n; i++) c[i] = df_f32_to_bf16(s->q.hidden[i]);
    for (size_t i = 0; i < n; i++) s->decoded[i] = df_bf16_to_f32(c[i]);
    s->codes = c;
    return;
  }
  uint8_t *c = malloc(n);
  s->scales = malloc(rows * sizeof(float));
  for (size_t r = 0; r < rows; r++) { /* the writer's scale: amax / 448 */
    float amax = 0;
    for (int i = 0; i < H; i++) amax = fmaxf(amax, fabsf(s->q.hidden[r * H + i]));
    float sc = amax > 0 ? amax / 448.0f : 1.0f;
    s->scales[r] = sc;
    for (int i = 0; i < H; i++) {
      c[r * H + i] = df_f32_to_e4m3(s->q.hidden[r * H + i] / sc);
      s->decoded[r * H + i] = df_e4m3_to_f32(c[r * H + i]) * sc;
    }
  }
  s->codes = c;
}

static void stored_free(stored_seq *s) {
  g_seq_free(&s->q);
  free(s->codes), free(s->scales), free(s->decoded);
}

static dflash_sample as_sample(const stored_seq *s) {
  return (dflash_sample){.struct_size = sizeof(dflash_sample),
                         .id = s->id,
                         .len = s->q.len,
                         .input_ids = s->q.ids,
                         .loss_mask = s->q.mask,
                         .hidden_dtype = s->dtype,
                         .hidden_codes = s->codes,
                         .hidden_scales = s->scales};
}

typedef struct outcome {
  double loss, weight, norm;
  float *grads, *params;
} outcome;

static void outcome_free(outcome *o) { free(o->grads), free(o->params); }

/* zero_grad, the sequences (stored rows, or the same decoded to float32), the
 * gradients, one step, the parameters. */
static void train(const world *w, stored_seq *seqs, int n, bool stored, outcome *out) {
  dflash_trainer *t = make(w, DFLASH_BACKEND_CUDA);
  ck_assert_ok(dflash_trainer_zero_grad(t));
  out->loss = out->weight = 0;
  for (int i = 0; i < n; i++) {
    const g_seq *q = &seqs[i].q;
    if (stored) {
      dflash_sample smp = as_sample(&seqs[i]);
      ck_assert_ok(dflash_trainer_accumulate(t, seq_at(&smp, q->anchors, q->na), 0.01));
    } else {
      ck_assert_ok(dflash_trainer_accumulate(
          t, SEQ(q->ids, q->mask, q->len, seqs[i].decoded, q->anchors, q->na), 0.01));
    }
  }
  ck_assert_ok(dflash_trainer_collect(t, &out->loss, &out->weight));
  out->grads = g_dump(t, 1);
  ck_assert_ok(dflash_trainer_step(t, &out->norm, NULL));
  out->params = g_dump(t, 0);
  dflash_trainer_free(t);
}

static void check_stored_equals_f32(int32_t dtype, const char *what) {
  world w;
  world_make(&w);
  enum { N = 4 };
  stored_seq seqs[N];
  for (int i = 0; i < N; i++) stored_make(&w, 48 + 8 * i, 31 + i, dtype, &seqs[i]);
  outcome a, b;
  train(&w, seqs, N, false, &a);
  train(&w, seqs, N, true, &b);
  dflash_trainer *t = make(&w, DFLASH_BACKEND_CUDA);
  size_t n = t->m.n_params;
  dflash_trainer_free(t);
  size_t dg = g_n_differ(a.grads, b.grads, n), dp = g_n_differ(a.params, b.params, n);
  printf("%s stored rows vs float32: %zu of %zu gradients and %zu parameters differ; loss %.9g "
         "vs %.9g, weight %.9g vs %.9g, norm %.9g vs %.9g\n",
         what, dg, n, dp, b.loss, a.loss, b.weight, a.weight, b.norm, a.norm);
  ck_assert_msg(dg == 0 && dp == 0, "%s: %zu gradients, %zu parameters differ", what, dg, dp);
  ck_assert(a.norm == b.norm && a.weight == b.weight);
  /* The device sums w*CE with float position weights, the host with double ones. */
  ck_assert_msg(fabs(a.loss - b.loss) <= 1e-6 * fabs(a.loss), "%s: loss %.9g vs %.9g", what, b.loss,
                a.loss);
  outcome_free(&a), outcome_free(&b);
  for (int i = 0; i < N; i++) stored_free(&seqs[i]);
  world_free(&w);
}

START_TEST(bf16_stored_rows_equal_the_float32_path_to_the_bit) {
  check_stored_equals_f32(DFLASH_DTYPE_BF16, "bf16");
}
END_TEST

START_TEST(fp8_stored_rows_equal_the_float32_path_to_the_bit) {
  check_stored_equals_f32(DFLASH_DTYPE_F8_E4M3, "fp8");
}
END_TEST

/* Back to back through the two stages (distinct rows each) equals a wait after each: a
 * stage refilled before its copy ran (one buffer, or no wait for its `used` event) uploads
 * the next-but-one sequence's rows instead. */
START_TEST(double_buffer_never_overwrites_a_stage_still_read) {
  world w;
  world_make(&w);
  enum { N = 5 };
  stored_seq seqs[N];
  for (int i = 0; i < N; i++) stored_make(&w, 56, 51 + i, DFLASH_DTYPE_BF16, &seqs[i]);
  /* One at a time: accumulate then collect (a wait) per sequence. */
  dflash_trainer *t = make(&w, DFLASH_BACKEND_CUDA);
  ck_assert_ok(dflash_trainer_zero_grad(t));
  double one_loss = 0;
  for (int i = 0; i < N; i++) {
    dflash_sample smp = as_sample(&seqs[i]);
    double ls;
    ck_assert_ok(dflash_trainer_accumulate(t, seq_at(&smp, seqs[i].q.anchors, seqs[i].q.na), 0.01));
    ck_assert_ok(dflash_trainer_collect(t, &ls, NULL));
    one_loss += ls;
  }
  float *g1 = g_dump(t, 1);
  size_t n = t->m.n_params;
  dflash_trainer_free(t);
  /* Back to back, the caller's copies of the rows overwritten as soon as each call returns
   * (the call reads them before it returns). */
  t = make(&w, DFLASH_BACKEND_CUDA);
  ck_assert_ok(dflash_trainer_zero_grad(t));
  stored_seq scratch;
  stored_make(&w, 56, 99, DFLASH_DTYPE_BF16, &scratch);
  size_t bytes = (size_t)56 * w.c.n_target_layer_ids * w.c.hidden_size * 2;
  for (int i = 0; i < N; i++) {
    memcpy(scratch.codes, seqs[i].codes, bytes);
    dflash_sample smp = as_sample(&scratch);
    smp.input_ids = seqs[i].q.ids, smp.loss_mask = seqs[i].q.mask;
    ck_assert_ok(dflash_trainer_accumulate(t, seq_at(&smp, seqs[i].q.anchors, seqs[i].q.na), 0.01));
    memset(scratch.codes, 0xff, bytes); /* NaN everywhere: read late, it would fail */
  }
  double loss;
  ck_assert_ok(dflash_trainer_collect(t, &loss, NULL));
  float *g2 = g_dump(t, 1);
  size_t d = g_n_differ(g1, g2, n);
  printf("double buffer: %zu of %zu gradients differ; loss %.9g vs %.9g\n", d, n, loss, one_loss);
  ck_assert_msg(d == 0, "%zu gradients differ from one sequence at a time", d);
  ck_assert(fabs(loss - one_loss) <= 1e-12 * fabs(one_loss));
  free(g1), free(g2);
  dflash_trainer_free(t);
  stored_free(&scratch);
  for (int i = 0; i < N; i++) stored_free(&seqs[i]);
  world_free(&w);
}
END_TEST

START_TEST(accumulate_never_waits_per_sequence) {
  world w;
  world_make(&w);
  enum { N = 6 };
  stored_seq seqs[N];
  for (int i = 0; i < N; i++) stored_make(&w, 56, 71 + i, DFLASH_DTYPE_F8_E4M3, &seqs[i]);
  dflash_trainer *t = make(&w, DFLASH_BACKEND_CUDA);
  ck_assert_ok(dflash_trainer_zero_grad(t));
  /* The first sequence sizes the arena, RoPE tables and stages (each grows once). */
  dflash_sample smp = as_sample(&seqs[0]);
  ck_assert_ok(dflash_trainer_accumulate(t, seq_at(&smp, seqs[0].q.anchors, seqs[0].q.na), 0.01));
  ck_assert_ok(dflash_trainer_collect(t, NULL, NULL));
  uint64_t ss, es, ds;
  dfemu_sync_counts(NULL, NULL, NULL, 1);
  for (int i = 1; i < N; i++) {
    smp = as_sample(&seqs[i]);
    ck_assert_ok(dflash_trainer_accumulate(t, seq_at(&smp, seqs[i].q.anchors, seqs[i].q.na), 0.01));
  }
  dfemu_sync_counts(&ss, &es, &ds, 1);
  printf("%d sequences: %llu cudaStreamSynchronize, %llu cudaEventSynchronize (a stage's "
         "'used', two sequences back), %llu cudaDeviceSynchronize\n",
         N - 1, (unsigned long long)ss, (unsigned long long)es, (unsigned long long)ds);
  ck_assert_msg(ss == 0 && ds == 0, "accumulate waited for the stream %llu times",
                (unsigned long long)ss);
  ck_assert(es <= (uint64_t)(N - 1));
  double loss, weight;
  ck_assert_ok(dflash_trainer_collect(t, &loss, &weight));
  dfemu_sync_counts(&ss, NULL, NULL, 1);
  ck_assert_uint_eq(ss, 1); /* the one wait per batch */
  ck_assert(isfinite(loss) && loss > 0 && weight > 0);
  /* forward_backward still waits (and returns its loss). */
  double ls = NAN;
  const g_seq *q1 = &seqs[1].q;
  ck_assert_ok(dflash_trainer_forward_backward(
      t, SEQ(q1->ids, q1->mask, q1->len, seqs[1].decoded, q1->anchors, q1->na), &ls));
  dfemu_sync_counts(&ss, NULL, NULL, 1);
  ck_assert(ss >= 1 && isfinite(ls));
  dflash_trainer_free(t);
  for (int i = 0; i < N; i++) stored_free(&seqs[i]);
  world_free(&w);
}
END_TEST

/* A non-finite code at flat index `at` of sequence s (a context row: position < anchors). */
static void poison(stored_seq *s, size_t at) {
  if (s->dtype == DFLASH_DTYPE_BF16) ((uint16_t *)s->codes)[at] = 0x7f80; /* +Inf */
  else ((uint8_t *)s->codes)[at] = 0x7f;                                  /* e4m3 NaN */
}

static void check_refused(int32_t dtype, bool at_step) {
  world w;
  world_make(&w);
  stored_seq seqs[3];
  for (int i = 0; i < 3; i++) stored_make(&w, 56, 81 + i, dtype, &seqs[i]);
  int KH = w.c.n_target_layer_ids * w.c.hidden_size;
  size_t at = (size_t)1 * KH + 5; /* position 1, column 5 */
  int32_t last = 0;
  for (int i = 0; i < seqs[1].q.na; i++)
    last = seqs[1].q.anchors[i] > last ? seqs[1].q.anchors[i] : last;
  ck_assert_int_gt(last, 1); /* position 1 is a context row */
  poison(&seqs[1], at);
  dflash_trainer *t = make(&w, DFLASH_BACKEND_CUDA);
  float *p0 = g_dump(t, 0);
  size_t n = t->m.n_params;
  ck_assert_ok(dflash_trainer_zero_grad(t));
  for (int i = 0; i < 3; i++) { /* accepted: the check is on the device */
    dflash_sample smp = as_sample(&seqs[i]);
    ck_assert_ok(dflash_trainer_accumulate(t, seq_at(&smp, seqs[i].q.anchors, seqs[i].q.na), 0.01));
  }
  double norm = 0;
  dflash_status st = at_step ? dflash_trainer_step(t, &norm, NULL)
                             : dflash_trainer_collect(t, NULL, NULL);
  const char *msg = dflash_last_error();
  printf("%s, refused at %s: %s (%s)\n", dtype ? "fp8" : "bf16", at_step ? "step" : "collect",
         dflash_status_str(st), msg);
  ck_assert_int_eq(st, DFLASH_E_FORMAT);
  ck_assert_msg(strstr(msg, seqs[1].id) && strstr(msg, "position 1, column 5") &&
                    strstr(msg, "device"),
                "message: %s", msg);
  if (!at_step) st = dflash_trainer_step(t, &norm, NULL); /* NaN gradients: refused too */
  ck_assert_int_ne(st, DFLASH_OK);
  ck_assert_int_eq(dflash_trainer_step_count(t), 0);
  float *p1 = g_dump(t, 0);
  ck_assert_uint_eq(g_n_differ(p0, p1, n), 0);
  free(p0), free(p1);
  dflash_trainer_free(t);
  for (int i = 0; i < 3; i++) stored_free(&seqs[i]);
  world_free(&w);
}

START_TEST(nan_or_inf_row_is_refused_on_the_device_naming_the_sample) {
  check_refused(DFLASH_DTYPE_BF16, true);
  check_refused(DFLASH_DTYPE_F8_E4M3, false);
}
END_TEST

/* ---- dflash_train_run: an offline store and a spool through the same upload ---------- */

/* A spool at `dir` holding the synthetic store's samples (dataset order), one epoch. */
static void write_spool(const char *root, const char *dir) {
  char *hid = synth_path(root, "hidden");
  dflash_hidden *h;
  ck_assert_ok(dflash_hidden_open(hid, &h));
  dflash_hidden_info info = {.struct_size = sizeof info};
  ck_assert_ok(dflash_hidden_get_info(h, &info));
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.shard_bytes = 8192;
  o.spool_budget = 1 << 24;
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(dir, info.num_layers, info.hidden_size, &o, &w));
  for (size_t i = 0; i < info.count; i++) {
    const char *id;
    int64_t len;
    ck_assert_ok(dflash_hidden_id(h, i, &id));
    ck_assert_ok(dflash_hidden_length(h, id, &len));
    float *x = malloc(sizeof(float) * (size_t)len * info.num_layers * info.hidden_size);
    ck_assert_ok(dflash_hidden_read(h, id, x, len));
    ck_assert_ok(df_test_hidden_add(w, id, x, NULL, len));
    free(x);
  }
  ck_assert_ok(dflash_hidden_writer_end_epoch(w));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  dflash_hidden_free(h);
  free(hid);
}

/* One CUDA run in this process; the bytes it copied host to device. */
static uint64_t cuda_run(const char *root, const char *hidden, const char *out, bool stored) {
  dflash_train_run_options o;
  synth_run_options(&o, root, out);
  if (hidden) o.hidden_dir = hidden;
  o.epochs = 1;
  o.batch_size = 2;
  synth_trainer(&o)->backend = DFLASH_BACKEND_CUDA;
  setenv("DFLASH_TRAIN_STORED_ROWS", stored ? "1" : "0", 1);
  dfemu_from_host_bytes(0, 1);
  dflash_status st = dflash_train_run(&o, NULL);
  uint64_t bytes = dfemu_from_host_bytes(0, 1);
  unsetenv("DFLASH_TRAIN_STORED_ROWS");
  ck_assert_msg(st == DFLASH_OK, "%s: %s", out, dflash_last_error());
  return bytes;
}

static void check_same_run(const char *a, const char *b, const char *what) {
  synth_metric x[16], y[16];
  size_t nx = synth_metrics(a, x, 16), ny = synth_metrics(b, y, 16);
  ck_assert_uint_eq(nx, ny);
  ck_assert_uint_gt(nx, 0);
  for (size_t i = 0; i < nx; i++)
    ck_assert_msg(x[i].loss == y[i].loss && x[i].norm == y[i].norm,
                  "%s: step %ld: loss %.9g vs %.9g", what, x[i].step, x[i].loss, y[i].loss);
  ck_assert_msg(synth_max_abs_diff(a, b) == 0, "%s: the checkpoints differ", what);
}

START_TEST(offline_store_and_spool_upload_rows_as_stored) {
  char *root = df_test_tmpdir();
  synth_world(root, 7, 40, 1);
  char *off_s = synth_at(root, "off-stored"), *off_f = synth_at(root, "off-f32");
  uint64_t b_off_s = cuda_run(root, NULL, off_s, true);
  uint64_t b_off_f = cuda_run(root, NULL, off_f, false);
  char *sp1 = synth_at(root, "spool1"), *sp2 = synth_at(root, "spool2");
  write_spool(root, sp1);
  write_spool(root, sp2);
  char spool1[512], spool2[512];
  snprintf(spool1, sizeof spool1, "spool:%s", sp1);
  snprintf(spool2, sizeof spool2, "spool:%s", sp2);
  char *sp_s = synth_at(root, "spool-stored"), *sp_f = synth_at(root, "spool-f32");
  uint64_t b_sp_s = cuda_run(root, spool1, sp_s, true);
  uint64_t b_sp_f = cuda_run(root, spool2, sp_f, false);
  printf("host-to-device bytes: offline stored %llu, float32 %llu; spool stored %llu, float32 "
         "%llu\n",
         (unsigned long long)b_off_s, (unsigned long long)b_off_f, (unsigned long long)b_sp_s,
         (unsigned long long)b_sp_f);
  check_same_run(off_s, off_f, "offline");
  check_same_run(sp_s, sp_f, "spool");
  /* bf16 codes are half of float32's bytes: the hidden rows dominate what goes up. */
  ck_assert_msg(b_off_s < b_off_f && b_sp_s < b_sp_f,
                "the rows did not go up as stored (bytes %llu/%llu, %llu/%llu)",
                (unsigned long long)b_off_s, (unsigned long long)b_off_f,
                (unsigned long long)b_sp_s, (unsigned long long)b_sp_f);
  /* The saving is the same for both sources: the same samples through the same path. */
  ck_assert_uint_eq(b_off_f - b_off_s, b_sp_f - b_sp_s);
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* Run by tests/check_main.c. */
Suite *df_test_suite(void) {
  Suite *s = suite_create("cuda_emu_upload");
  TCase *tc = tcase_create("upload");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, bf16_stored_rows_equal_the_float32_path_to_the_bit);
  tcase_add_test(tc, fp8_stored_rows_equal_the_float32_path_to_the_bit);
  tcase_add_test(tc, double_buffer_never_overwrites_a_stage_still_read);
  tcase_add_test(tc, accumulate_never_waits_per_sequence);
  tcase_add_test(tc, nan_or_inf_row_is_refused_on_the_device_naming_the_sample);
  tcase_add_test(tc, offline_store_and_spool_upload_rows_as_stored);
  suite_add_tcase(s, tc);
  return s;
}
