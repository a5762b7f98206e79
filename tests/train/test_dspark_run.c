/* dflash_train_run of a DSpark drafter from a hidden-state store (or a spool) that holds the
 * target's final state (HiddenWriter(..., final_state=True)): the stream (or the spool) gives
 * every sample its target_final, so the run trains on 0.1 CE + 0.9 L1 + 1.0 BCE and does not
 * warn; a store without it trains on 0.1 CE alone and warns; a DFlash drafter ignores it. */
#include <dflash/hidden.h>
#include <dflash/train.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "synth.h"
#include "testutil.h"

enum { H = 32 };

static const char dspark_cfg[] =
    "{\"architectures\": [\"Qwen3DSparkModel\"], \"hidden_size\": 32, \"intermediate_size\": "
    "64, \"num_hidden_layers\": 1, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
    "\"head_dim\": 8, \"vocab_size\": 17, \"num_target_layers\": 8, \"block_size\": 4, "
    "\"tie_word_embeddings\": false, \"markov_rank\": 4, \"enable_confidence_head\": true, "
    "\"sample_from_anchor\": true, "
    "\"dflash_config\": {\"mask_token_id\": 16, \"target_layer_ids\": [3]}}";

/* A copy of the store `from` (K = 1, H) at `to`, each sample with a final state:
 * scale * sin(0.3 t + 0.7 k + id), as float32 (stored in bf16). */
static void copy_with_final(const char *from, const char *to, float scale) {
  dflash_hidden *h;
  ck_assert_ok(dflash_hidden_open(from, &h));
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.final_state = 1;
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(to, 1, H, &o, &w));
  dflash_hidden_info info = {.struct_size = sizeof info};
  ck_assert_ok(dflash_hidden_get_info(h, &info));
  ck_assert_int_eq(info.final_state, 0);
  for (size_t i = 0; i < info.count; i++) {
    const char *id;
    int64_t len;
    ck_assert_ok(dflash_hidden_id(h, i, &id));
    ck_assert_ok(dflash_hidden_length(h, id, &len));
    float *x = malloc((size_t)len * H * sizeof *x), *f = malloc((size_t)len * H * sizeof *f);
    ck_assert_ok(dflash_hidden_read(h, id, x, len));
    for (int64_t t = 0; t < len * H; t++)
      f[t] = scale * sinf(0.3f * (float)(t / H) + 0.7f * (float)(t % H) + (float)i);
    dflash_hidden_rows r;
    dflash_hidden_rows_default(&r);
    r.len = len, r.states = x, r.final_state = f;
    ck_assert_ok(dflash_hidden_writer_add(w, id, &r));
    free(x), free(f);
  }
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  dflash_hidden_free(h);
}

static void count_ce_warning(dflash_log_level level, const char *msg, void *user) {
  if (level == DFLASH_LOG_WARN && strstr(msg, "DSpark drafter") && strstr(msg, "0.1 CE alone"))
    ++*(int *)user;
}

/* One run from `hidden` (root/`hidden`, or "spool:NAME": the spool root/NAME) into root/`out`;
 * its metrics into m (returns their count), the CE-alone warnings into *warned. */
static size_t run(dflash_train_run_options *o, const char *root, const char *hidden,
                  const char *out, synth_metric *m, int *warned) {
  char spool_root[4096];
  snprintf(spool_root, sizeof spool_root, "spool:%s", root);
  /* synth_at keeps what it returns, freed with the run's other paths */
  o->hidden_dir = strncmp(hidden, "spool:", 6) ? synth_at(root, hidden)
                                               : synth_at(spool_root, hidden + 6);
  o->out_dir = synth_at(root, out);
  *warned = 0;
  dflash_set_log_callback(count_ce_warning, warned, DFLASH_LOG_WARN);
  dflash_status st = dflash_train_run(o, NULL);
  dflash_set_log_callback(NULL, NULL, DFLASH_LOG_ERROR);
  ck_assert_ok(st);
  size_t n = synth_metrics(o->out_dir, m, 64);
  ck_assert_uint_gt(n, 0);
  return n;
}

/* Before: no store held the target's final state, so every DSpark run trained on 0.1 CE
 * alone. Same seed, data, anchors and initial weights in each run: the first step's loss
 * differs only by what the final state adds (0.9 L1 + 1.0 BCE, both positive here), and
 * changes with the final state itself. */
START_TEST(dspark_run_trains_l1_and_bce_from_a_final_state_store) {
  dflash_train_run_options o;
  char *out;
  char *root = synth_small_run(&o, &out);
  char *dflash_cfg = synth_at(root, "dflash.json"), *hid = synth_at(root, "hidden");
  ck_assert_int_eq(rename(o.config_path, dflash_cfg), 0);
  ck_assert(df_test_write(o.config_path, dspark_cfg, sizeof dspark_cfg - 1));
  copy_with_final(hid, synth_at(root, "hidden-final"), 1.0f);
  copy_with_final(hid, synth_at(root, "hidden-final3"), 3.0f);
  synth_metric ce[64], full[64], full3[64];
  int warned;
  size_t n_ce = run(&o, root, "hidden", "out-ce", ce, &warned);
  ck_assert_int_eq(warned, 1);
  size_t n_full = run(&o, root, "hidden-final", "out-full", full, &warned);
  ck_assert_int_eq(warned, 0);
  ck_assert_uint_eq(n_full, n_ce);
  run(&o, root, "hidden-final3", "out-full3", full3, &warned);
  ck_assert_int_eq(warned, 0);
  printf("dspark run, first step: loss %.6f (the CE term alone), %.6f (CE + L1 + BCE), %.6f "
         "(final state x3)\n",
         ce[0].loss, full[0].loss, full3[0].loss);
  for (size_t i = 0; i < n_full; i++) ck_assert(isfinite(full[i].loss));
  /* 0.9 L1 + BCE: L1 between a near-uniform draft and a peaked target, and BCE >= 0. */
  ck_assert_double_gt(full[0].loss - ce[0].loss, 0.1);
  ck_assert_double_gt(fabs(full3[0].loss - full[0].loss), 1e-3);
  /* A DFlash drafter ignores the final state: the same run from either store, bit for bit. */
  ck_assert_int_eq(rename(dflash_cfg, o.config_path), 0);
  synth_metric a[64], b[64];
  size_t na = run(&o, root, "hidden", "out-dflash", a, &warned);
  size_t nb = run(&o, root, "hidden-final", "out-dflash-final", b, &warned);
  ck_assert_uint_eq(na, nb);
  for (size_t i = 0; i < na; i++) ck_assert_double_eq(a[i].loss, b[i].loss);
  df_test_rmtree(root);
  free(root);
}
END_TEST

/* The store `from`'s samples (with their final state when `final`) published into the spool
 * `to` in the order of the trace file `trace` ("epoch step id" lines), as one epoch. */
static void spool_in_order(const char *from, const char *to, const char *trace, int final) {
  dflash_hidden *h;
  ck_assert_ok(dflash_hidden_open(from, &h));
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.final_state = final, o.shard_bytes = 1 << 14, o.spool_budget = 1 << 24;
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(to, 1, H, &o, &w));
  FILE *fp = fopen(trace, "r");
  ck_assert_ptr_nonnull(fp);
  char line[256], id[200];
  int e, n = 0;
  long step;
  while (fgets(line, sizeof line, fp)) {
    if (line[0] == '#') continue;
    ck_assert_int_eq(sscanf(line, "%d %ld %199s", &e, &step, id), 3);
    int64_t len;
    ck_assert_ok(dflash_hidden_length(h, id, &len));
    float *x = malloc((size_t)len * H * sizeof *x), *f = malloc((size_t)len * H * sizeof *f);
    ck_assert_ok(dflash_hidden_read(h, id, x, len));
    ck_assert_ok(dflash_hidden_read_final_state(h, id, f, len));
    dflash_hidden_rows r;
    dflash_hidden_rows_default(&r);
    r.len = len, r.states = x, r.final_state = final ? f : NULL;
    ck_assert_ok(dflash_hidden_writer_add(w, id, &r));
    free(x), free(f);
    n++;
  }
  fclose(fp);
  ck_assert_int_gt(n, 0);
  ck_assert_ok(dflash_hidden_writer_end_epoch(w));
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  dflash_hidden_free(h);
}

/* A spool written with the final state trains DSpark as a store with it does: fed the offline
 * run's order (DFLASH_TRAIN_TRACE), the spool run's loss equals the offline run's at every step
 * (the spool gives each sample its target_final, bf16 as stored), without the CE-alone
 * warning; the same spool without the final state trains on CE alone, warns, and its first
 * loss is the L1 and BCE terms lower. */
START_TEST(dspark_run_from_a_spool_with_final_state) {
  dflash_train_run_options o;
  char *out;
  char *root = synth_small_run(&o, &out);
  ck_assert(df_test_write(o.config_path, dspark_cfg, sizeof dspark_cfg - 1));
  char *fin = synth_at(root, "hidden-final"), *trace = synth_at(root, "offline.trace");
  copy_with_final(synth_at(root, "hidden"), fin, 1.0f);
  synth_metric off[64], sp[64], ce[64];
  int warned;
  setenv("DFLASH_TRAIN_TRACE", trace, 1);
  size_t n_off = run(&o, root, "hidden-final", "out-offline", off, &warned);
  unsetenv("DFLASH_TRAIN_TRACE");
  ck_assert_int_eq(warned, 0);
  spool_in_order(fin, synth_at(root, "spool-final"), trace, 1);
  spool_in_order(fin, synth_at(root, "spool-plain"), trace, 0);
  o.spool_wait_s = 10;
  size_t n_sp = run(&o, root, "spool:spool-final", "out-spool", sp, &warned);
  ck_assert_int_eq(warned, 0);
  ck_assert_uint_eq(n_sp, n_off);
  for (size_t i = 0; i < n_off; i++) ck_assert_double_eq(sp[i].loss, off[i].loss);
  size_t n_ce = run(&o, root, "spool:spool-plain", "out-spool-ce", ce, &warned);
  ck_assert_int_eq(warned, 1);
  ck_assert_uint_eq(n_ce, n_off);
  printf("dspark run from a spool, first step: loss %.6f (CE + L1 + BCE; offline %.6f), %.6f "
         "(CE alone)\n",
         sp[0].loss, off[0].loss, ce[0].loss);
  ck_assert_double_gt(sp[0].loss - ce[0].loss, 0.1);
  df_test_rmtree(root);
  free(root);
}
END_TEST

TCase *tc_dspark_run(void) {
  TCase *tc = tcase_create("dspark_run");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, dspark_run_trains_l1_and_bce_from_a_final_state_store);
  tcase_add_test(tc, dspark_run_from_a_spool_with_final_state);
  return tc;
}
