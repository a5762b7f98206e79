#include <dflash/dataset.h>
#include <dflash/hidden.h>
#include <dflash/safetensors.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/internal.h"
#include "testutil.h"
#include "core/bf16.h"
#include "hidden/hidden.h"

static uint64_t lcg = 99;
static double unif(void) {
  lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
  return ((lcg >> 11) + 0.5) / 9007199254740992.0;
}
static double gauss(void) { return sqrt(-2 * log(unif())) * cos(6.283185307179586 * unif()); }

static float *states(int64_t len, int width, int heavy) {
  float *x = malloc((size_t)len * width * sizeof *x);
  for (int64_t i = 0; i < len * width; i++) {
    double g = gauss();
    /* heavy: a few large outlier channels, as real residual streams have */
    x[i] = (float)(heavy && (i % width) % 97 == 3 ? 40.0 * g : g);
  }
  return x;
}

START_TEST(e4m3_codes_round_trip) {
  for (int c = 0; c < 256; c++) {
    if ((c & 0x7f) == 0x7f) continue; /* NaN */
    float f = df_e4m3_to_f32((uint8_t)c);
    uint8_t back = df_f32_to_e4m3(f);
    if (c == 0x80) ck_assert_int_eq(back, 0x80); /* -0 */
    else ck_assert_msg(back == c, "code 0x%02x -> %g -> 0x%02x", c, f, back);
  }
  ck_assert_float_eq(df_e4m3_to_f32(0x7e), 448.0f);
  ck_assert_float_eq(df_e4m3_to_f32(0x01), ldexpf(1, -9));
  ck_assert_int_eq(df_f32_to_e4m3(1000.0f), 0x7e);                 /* saturates */
  ck_assert_int_eq(df_f32_to_e4m3(1.0625f), df_f32_to_e4m3(1.0f)); /* ties to even */
}
END_TEST

/* Writes, reads back, and measures the relative RMS error per row. */
static double store_error(int dtype, int heavy) {
  char *dir = df_test_tmpdir();
  enum { K = 3, H = 64, LEN = 40 };
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.dtype = dtype;
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(dir, K, H, &o, &w));
  float *x = states(LEN, K * H, heavy);
  ck_assert_ok(df_test_hidden_add(w, "s0", x, NULL, LEN));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  dflash_hidden *h;
  ck_assert_ok(dflash_hidden_open(dir, &h));
  float *y = malloc(sizeof(float) * LEN * K * H);
  ck_assert_ok(dflash_hidden_read(h, "s0", y, LEN));
  double worst = 0, total = 0;
  for (int r = 0; r < LEN * K; r++) {
    double e = 0, n = 0;
    for (int i = 0; i < H; i++) {
      double d = (double)y[r * H + i] - x[r * H + i];
      e += d * d, n += (double)x[r * H + i] * x[r * H + i];
    }
    worst = fmax(worst, sqrt(e / n));
    total += sqrt(e / n);
  }
  printf("hidden store %s (%s rows): relative RMS error per row mean %.3f%%, worst %.3f%%\n",
         dtype ? "fp8_e4m3" : "bf16", heavy ? "outlier" : "Gaussian", 100 * total / (LEN * K),
         100 * worst);
  dflash_hidden_free(h);
  free(x), free(y);
  df_test_rmtree(dir);
  free(dir);
  return worst;
}

START_TEST(accuracy_bf16_and_fp8) {
  ck_assert_double_lt(store_error(DFLASH_DTYPE_BF16, 0), 0.004);
  ck_assert_double_lt(store_error(DFLASH_DTYPE_BF16, 1), 0.004);
  ck_assert_double_lt(store_error(DFLASH_DTYPE_F8_E4M3, 0), 0.05);
  ck_assert_double_lt(store_error(DFLASH_DTYPE_F8_E4M3, 1), 0.05);
}
END_TEST

START_TEST(shards_index_and_append) {
  char *dir = df_test_tmpdir();
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.shard_bytes = 3000; /* a few samples per shard */
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(dir, 2, 8, &o, &w));
  char id[32];
  for (int i = 0; i < 10; i++) {
    float *x = states(20 + i, 16, 0);
    snprintf(id, sizeof id, "sample-%d", i);
    ck_assert_ok(df_test_hidden_add(w, id, x, NULL, 20 + i));
    free(x);
  }
  float *x = states(5, 16, 0);
  ck_assert_status(df_test_hidden_add(w, "sample-3", x, NULL, 5), DFLASH_E_DUPLICATE, "sample-3");
  dflash_hidden_rows r;
  dflash_hidden_rows_default(&r);
  r.len = 5, r.states = x, r.dtype = DFLASH_DTYPE_F16;
  ck_assert_status(dflash_hidden_writer_add(w, "f16", &r), DFLASH_E_DTYPE, "sample f16");
  r.states = NULL, r.dtype = DFLASH_DTYPE_F32;
  ck_assert_status(dflash_hidden_writer_add(w, "none", &r), DFLASH_E_INVALID_ARG, "states");
  x[17] = INFINITY;
  ck_assert_status(df_test_hidden_add(w, "bad", x, NULL, 5), DFLASH_E_FORMAT,
                   "sample bad: hidden state at token 1, column 1 is Inf");
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  /* Reopen and append: ids stay unique across sessions; K/H must match. */
  ck_assert_status(dflash_hidden_writer_create(dir, 3, 8, NULL, &w), DFLASH_E_MISMATCH, "K=2");
  ck_assert_ok(dflash_hidden_writer_create(dir, 2, 8, &o, &w));
  ck_assert_status(df_test_hidden_add(w, "sample-0", x, NULL, 5), DFLASH_E_DUPLICATE, "sample-0");
  x[17] = 0;
  ck_assert_ok(df_test_hidden_add(w, "late", x, NULL, 5));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  free(x);
  dflash_hidden *h;
  ck_assert_ok(dflash_hidden_open(dir, &h));
  dflash_hidden_info info = {.struct_size = sizeof info};
  ck_assert_ok(dflash_hidden_get_info(h, &info));
  ck_assert_uint_eq(info.count, 11);
  ck_assert_int_eq(info.num_layers, 2);
  dflash_safetensors *st;
  ck_assert_ok(dflash_safetensors_open(dir, &st));
  ck_assert_uint_gt(dflash_safetensors_file_count(st), 2);
  dflash_safetensors_free(st);
  int64_t len;
  ck_assert_ok(dflash_hidden_length(h, "sample-7", &len));
  ck_assert_int_eq(len, 27);
  ck_assert_status(dflash_hidden_length(h, "nope", &len), DFLASH_E_NOT_FOUND, "nope");
  float buf[16 * 30];
  ck_assert_status(dflash_hidden_read(h, "sample-7", buf, 26), DFLASH_E_MISMATCH, "sample-7");
  dflash_hidden_free(h);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* A dataset written by the dataset module (the format `dflash tokenize` makes). */
static void write_dataset(const char *dir, int n, const int *lens) {
  dflash_dataset_writer *w;
  ck_assert_ok(dflash_dataset_writer_create(dir, NULL, &w));
  int64_t pos = 0;
  for (int i = 0; i < n; i++) {
    int32_t ids[64];
    uint8_t mask[64];
    for (int k = 0; k < lens[i]; k++, pos++) ids[k] = (int32_t)(pos % 50), mask[k] = pos % 3 != 0;
    char id[16];
    snprintf(id, sizeof id, "sample-%d", i);
    ck_assert_ok(dflash_dataset_writer_add(w, id, ids, mask, (size_t)lens[i]));
  }
  ck_assert_ok(dflash_dataset_writer_commit(w));
  dflash_dataset_writer_free(w);
}

START_TEST(stream_joins_and_reports) {
  char *root = df_test_tmpdir();
  char *data = df_path_join(root, "data"), *hid = df_path_join(root, "hidden");
  /* 48 tokens in all: the dataset writer's offsets tensor follows the
   * 1-byte mask, and its reader loads it in place (misaligned otherwise). */
  int lens[] = {7, 12, 9, 20};
  write_dataset(data, 4, lens);
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(hid, 1, 4, NULL, &w));
  float *x[4];
  for (int i = 0; i < 4; i++) {
    char id[16];
    snprintf(id, sizeof id, "sample-%d", i);
    x[i] = states(lens[i], 4, 0);
    if (i != 2) ck_assert_ok(df_test_hidden_add(w, id, x[i], NULL, i == 3 ? 14 : lens[i]));
  }
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  dflash_sample_stream *s;
  ck_assert_ok(dflash_sample_stream_open(data, hid, NULL, &s));
  ck_assert_uint_eq(dflash_sample_stream_count(s), 4);
  size_t bad;
  ck_assert_status(dflash_sample_stream_check(s, &bad), DFLASH_E_NOT_FOUND, "sample-2");
  ck_assert_uint_eq(bad, 2);
  uint64_t order[] = {1, 0, 2, 3, 1};
  ck_assert_ok(dflash_sample_stream_start(s, order, 5));
  dflash_sample smp = {.struct_size = sizeof smp};
  int done;
  ck_assert_ok(dflash_sample_stream_next(s, &smp, &done));
  ck_assert_str_eq(smp.id, "sample-1");
  ck_assert_int_eq(smp.len, 12);
  ck_assert_int_eq(smp.input_ids[0], 7); /* token stream position 7 */
  for (int i = 0; i < 12 * 4; i++)
    ck_assert_float_eq(smp.hidden[i], df_bf16_to_f32(df_f32_to_bf16(x[1][i])));
  ck_assert_ok(dflash_sample_stream_next(s, &smp, &done));
  ck_assert_str_eq(smp.id, "sample-0");
  ck_assert_status(dflash_sample_stream_next(s, &smp, &done), DFLASH_E_NOT_FOUND, "sample-2");
  ck_assert_status(dflash_sample_stream_next(s, &smp, &done), DFLASH_E_MISMATCH,
                   "sample-3: 20 tokens but 14 rows");
  ck_assert_ok(dflash_sample_stream_next(s, &smp, &done));
  ck_assert_str_eq(smp.id, "sample-1");
  ck_assert_ok(dflash_sample_stream_next(s, &smp, &done));
  ck_assert_int_eq(done, 1);
  dflash_sample_stream_free(s);
  for (int i = 0; i < 4; i++) free(x[i]);
  free(data), free(hid);
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* Sanity: the stream refuses a sample with an all-zero layer, naming sample and layer (the
 * trainer and eval read through it); dflash_hidden_stats gives per-layer RMS and zero rows. */
START_TEST(zero_layers_refused_and_counted) {
  char *root = df_test_tmpdir();
  char *data = df_path_join(root, "data"), *hid = df_path_join(root, "hidden");
  int lens[] = {6, 10};
  write_dataset(data, 2, lens);
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(hid, 2, 4, NULL, &w)); /* K = 2 layers, H = 4 */
  float x0[6 * 8], x1[10 * 8];
  for (int i = 0; i < 6 * 8; i++) x0[i] = i % 8 < 4 ? 2.0f : -0.5f; /* exact in bf16 */
  for (int i = 0; i < 10 * 8; i++) x1[i] = i % 8 < 4 ? 2.0f : 0.0f; /* layer 1 all zero */
  x0[8 + 4] = x0[8 + 5] = x0[8 + 6] = x0[8 + 7] = 0.0f;             /* one zero row */
  ck_assert_ok(df_test_hidden_add(w, "sample-0", x0, NULL, 6));
  ck_assert_ok(df_test_hidden_add(w, "sample-1", x1, NULL, 10));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  dflash_hidden *h;
  ck_assert_ok(dflash_hidden_open(hid, &h));
  double rms[2];
  uint64_t zero[2], rows;
  ck_assert_ok(dflash_hidden_stats(h, rms, zero, &rows));
  ck_assert_uint_eq(rows, 16);
  ck_assert_double_eq_tol(rms[0], 2.0, 1e-12);
  ck_assert_double_eq_tol(rms[1], sqrt(5 * 4 * 0.25 / (16.0 * 4)), 1e-12); /* 5 rows of -0.5 */
  ck_assert_uint_eq(zero[0], 0);
  ck_assert_uint_eq(zero[1], 1 + 10);
  dflash_hidden_free(h);
  dflash_sample_stream *s;
  ck_assert_ok(dflash_sample_stream_open(data, hid, NULL, &s));
  uint64_t order[] = {0, 1};
  ck_assert_ok(dflash_sample_stream_start(s, order, 2));
  dflash_sample smp = {.struct_size = sizeof smp};
  int done;
  ck_assert_ok(dflash_sample_stream_next(s, &smp, &done)); /* one zero row is not a zero layer */
  ck_assert_str_eq(smp.id, "sample-0");
  ck_assert_status(dflash_sample_stream_next(s, &smp, &done), DFLASH_E_FORMAT,
                   "sample sample-1: layer 1 of 2 of its hidden states is all zeros");
  dflash_sample_stream_free(s);
  free(data), free(hid);
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* The spool in one process (the two-process runs are bindings/python/tests/test_spool.py):
 * order, budget, spool-full, end of epoch, release, producer recovery, bad arguments. */
START_TEST(spool_order_budget_release) {
  char *dir = df_test_tmpdir(), *sp = df_path_join(dir, "spool");
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.shard_bytes = 1000; /* 2 samples of 10 x 32 bf16 (640 B) */
  o.spool_budget = 1500;
  dflash_hidden_writer *w;
  ck_assert_status(dflash_hidden_writer_create(sp, 2, 16, &o, &w), DFLASH_E_INVALID_ARG,
                   "under two shards");
  o.spool_budget = 2000;
  ck_assert_ok(dflash_hidden_writer_create(sp, 2, 16, &o, &w));
  dflash_hidden_writer *w2;
  ck_assert_status(dflash_hidden_writer_create(sp, 2, 8, &o, &w2), DFLASH_E_MISMATCH, "spool.json");
  float *x = states(10, 32, 0);
  char id[32];
  int taken = 0;
  dflash_status st = DFLASH_OK;
  while (!st && taken < 50) {
    snprintf(id, sizeof id, "s%02d", taken);
    if (!(st = df_test_hidden_add(w, id, x, NULL, 10))) taken++;
  }
  ck_assert_status(st, DFLASH_E_TIMEOUT, "is full");
  ck_assert_int_eq(dflash_hidden_writer_contains(w, id), 0); /* refused: not taken */
  ck_assert_int_eq(dflash_hidden_writer_contains(w, "s00"), 1);
  dflash_hidden_writer_spool_status ss = {.struct_size = sizeof ss};
  ck_assert_ok(dflash_hidden_writer_get_spool_status(w, &ss));
  ck_assert_int_eq(ss.epoch, 0);
  ck_assert_uint_eq(ss.samples, (uint64_t)taken);
  ck_assert_uint_ge(ss.spool_bytes, o.spool_budget);
  ck_assert_uint_lt(ss.high_water, o.spool_budget + 2 * o.shard_bytes); /* budget + one shard */
  dflash_spool_options so;
  dflash_spool_options_default(&so);
  so.wait_s = 0;
  dflash_spool *c;
  ck_assert_ok(dflash_spool_open(sp, &so, &c));
  dflash_spool_info si = {.struct_size = sizeof si};
  ck_assert_ok(dflash_spool_get_info(c, &si));
  ck_assert_int_eq(si.num_layers, 2);
  ck_assert_int_eq(si.hidden_size, 16);
  ck_assert_int_eq(si.dtype, DFLASH_DTYPE_BF16);
  dflash_sample smp = {.struct_size = sizeof smp};
  int end, got = 0;
  while (!(st = dflash_spool_next(c, &smp, &end))) {
    snprintf(id, sizeof id, "s%02d", got++);
    ck_assert_str_eq(smp.id, id);
    ck_assert_int_eq(smp.len, 10);
    ck_assert_float_eq_tol(smp.hidden[5], x[5], 0.02f);
  }
  ck_assert_status(st, DFLASH_E_TIMEOUT, "no shard e00000-s000002");
  ck_assert_int_eq(got, 4); /* two shards published, the third waits for room */
  int32_t e;
  uint64_t shard, off;
  ck_assert_ok(dflash_spool_tell(c, &e, &shard, &off));
  ck_assert_uint_eq(shard, 2);
  ck_assert_ok(dflash_spool_release(c, e, shard));
  ck_assert_ok(dflash_hidden_writer_end_epoch(w)); /* room now: the rest, then the marker */
  while (!(st = dflash_spool_next(c, &smp, &end)) && !end) got++;
  ck_assert_ok(st);
  ck_assert_int_eq(got, taken);
  ck_assert_ok(dflash_spool_tell(c, &e, &shard, &off));
  ck_assert_int_eq(e, 1);
  ck_assert_uint_eq(shard, 0);
  ck_assert_int_eq(dflash_hidden_writer_contains(w, "s00"), 0); /* a new epoch */
  ck_assert_ok(df_test_hidden_add(w, "s00", x, NULL, 10));
  ck_assert_ok(dflash_hidden_writer_flush(w));
  dflash_hidden_writer_free(w);
  /* A restarted producer: the same epoch and its ids. */
  ck_assert_ok(dflash_hidden_writer_create(sp, 2, 16, &o, &w));
  ck_assert_ok(dflash_hidden_writer_get_spool_status(w, &ss));
  ck_assert_int_eq(ss.epoch, 1);
  ck_assert_uint_eq(ss.samples, 1);
  ck_assert_status(df_test_hidden_add(w, "s00", x, NULL, 10), DFLASH_E_DUPLICATE, "this epoch");
  dflash_hidden_writer_free(w);
  ck_assert_ok(dflash_spool_next(c, &smp, &end));
  ck_assert_str_eq(smp.id, "s00");
  ck_assert_int_eq(smp.epoch, 1);
  dflash_spool_free(c);
  /* Not a spool; a missing one. */
  dflash_hidden_writer_options_default(&o);
  ck_assert_ok(dflash_hidden_writer_create(dir, 2, 16, &o, &w));
  ck_assert_status(dflash_hidden_writer_end_epoch(w), DFLASH_E_STATE, "not a spool");
  dflash_hidden_writer_free(w);
  char *none = df_path_join(dir, "none");
  ck_assert_status(dflash_spool_open(none, &so, &c), DFLASH_E_TIMEOUT, "no spool.json");
  free(none);
  free(x);
  free(sp);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* The one test of vLLM's file names and of a folder's layout (the CLI asks the library). */
START_TEST(vllm_names_and_layouts) {
  static const char *yes[] = {"hs_0.safetensors", "hs_123456.safetensors"};
  static const char *no[] = {"hs_.safetensors",   "hs_1a.safetensors",    "hs_1.safetensor",
                             "xhs_1.safetensors", "hs_1.safetensors.tmp", ""};
  for (size_t i = 0; i < DF_ARRAY_LEN(yes); i++)
    ck_assert_msg(dflash_hidden_is_vllm_file(yes[i]) == 1, "%s", yes[i]);
  for (size_t i = 0; i < DF_ARRAY_LEN(no); i++)
    ck_assert_msg(dflash_hidden_is_vllm_file(no[i]) == 0, "%s", no[i]);
  ck_assert_int_eq(dflash_hidden_is_vllm_file(NULL), 0);
  char *dir = df_test_tmpdir(), *store = df_path_join(dir, "store");
  ck_assert_int_eq(dflash_hidden_layout_of(dir), DFLASH_HIDDEN_LAYOUT_NONE);
  ck_assert_int_eq(dflash_hidden_layout_of(store), DFLASH_HIDDEN_LAYOUT_NONE); /* no folder */
  char *hs = df_path_join(dir, "hs_7.safetensors");
  ck_assert(df_test_write(hs, "x", 1)); /* the name is what counts; nothing is opened */
  ck_assert_int_eq(dflash_hidden_layout_of(dir), DFLASH_HIDDEN_LAYOUT_VLLM);
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(store, 1, 4, NULL, &w));
  static const float rows[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  ck_assert_ok(df_test_hidden_add(w, "s0", rows, NULL, 2));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  ck_assert_int_eq(dflash_hidden_layout_of(store), DFLASH_HIDDEN_LAYOUT_STORE);
  ck_assert_int_eq(dflash_hidden_layout_of(NULL), DFLASH_HIDDEN_LAYOUT_NONE);
  free(hs), free(store);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* One sample of K=2 layers of H=8 into a store at `dir` with options `o`; the create status. */
static dflash_status write_one(const char *dir, const dflash_hidden_writer_options *o,
                               const char *id) {
  dflash_hidden_writer *w;
  dflash_status st = dflash_hidden_writer_create(dir, 2, 8, o, &w);
  if (st) return st;
  float *x = states(6, 16, 0);
  ck_assert_ok(df_test_hidden_add(w, id, x, NULL, 6));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  free(x);
  return DFLASH_OK;
}

static void assert_record(const char *dir, const char *ids, const char *hash) {
  dflash_hidden *h;
  ck_assert_ok(dflash_hidden_open(dir, &h));
  char text[64];
  df_hidden_record_ids_text(df_hidden_record_of(h), text, sizeof text);
  ck_assert_str_eq(text, ids);
  const char *got = df_hidden_record_of(h)->tokenizer_hash;
  ck_assert_str_eq(got ? got : "-", hash);
  dflash_hidden_free(h);
}

/* Before: a store did not say which target layers it holds, so nothing could catch a drafter
 * config that reads others. Now the writer records them (and the tokenizer hash) and a reopened
 * store keeps one record. */
START_TEST(the_store_records_its_layers_and_tokenizer) {
  char *dir = df_test_tmpdir(), *old = df_test_tmpdir();
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  const int32_t ids[2] = {9, 17}, other[2] = {9, 18}, neg[2] = {-1, 3};
  o.target_layer_ids = ids, o.tokenizer_hash = "sha256:00ff";
  ck_assert_ok(write_one(dir, &o, "a"));
  assert_record(dir, "9, 17", "sha256:00ff");
  /* Given nothing, a reopened store keeps its record in the shards it adds. */
  ck_assert_ok(write_one(dir, NULL, "b"));
  assert_record(dir, "9, 17", "sha256:00ff");
  o.target_layer_ids = other;
  ck_assert_status(write_one(dir, &o, "c"), DFLASH_E_MISMATCH,
                   "holds the target layers 9, 17; cannot append target_layer_ids 9, 18");
  o.target_layer_ids = ids, o.tokenizer_hash = "sha256:1234";
  ck_assert_status(write_one(dir, &o, "c"), DFLASH_E_MISMATCH, "tokenizer_hash sha256:00ff");
  /* A store written without the record (older libdflash) reads as such; a record cannot be
   * added to its unrecorded shards. */
  ck_assert_ok(write_one(old, NULL, "a"));
  assert_record(old, "(not recorded)", "-");
  o.tokenizer_hash = NULL;
  ck_assert_status(write_one(old, &o, "b"), DFLASH_E_MISMATCH, "holds the target layers (not");
  o.target_layer_ids = neg;
  ck_assert_status(write_one(old, &o, "b"), DFLASH_E_INVALID_ARG, "target_layer_ids[0] = -1");
  o.target_layer_ids = NULL, o.tokenizer_hash = "two words";
  ck_assert_status(write_one(old, &o, "b"), DFLASH_E_INVALID_ARG, "tokenizer_hash");
  o.tokenizer_hash = "sha256:00", o.spool_budget = 1 << 20; /* a spool would drop it */
  ck_assert_status(write_one(old, &o, "b"), DFLASH_E_INVALID_ARG, "not a spool");
  df_test_rmtree(dir), df_test_rmtree(old);
  free(dir), free(old);
}
END_TEST

Suite *df_test_suite(void) {
  Suite *s = suite_create("hidden");
  TCase *tc = tcase_create("hidden");
  tcase_add_test(tc, e4m3_codes_round_trip);
  tcase_add_test(tc, accuracy_bf16_and_fp8);
  tcase_add_test(tc, shards_index_and_append);
  tcase_add_test(tc, stream_joins_and_reports);
  tcase_add_test(tc, zero_layers_refused_and_counted);
  tcase_add_test(tc, spool_order_budget_release);
  tcase_add_test(tc, vllm_names_and_layouts);
  tcase_add_test(tc, the_store_records_its_layers_and_tokenizer);
  suite_add_tcase(s, tc);
  return s;
}
