/* A hidden-state store that records its target layers (dflash_hidden_writer_options) is refused
 * by a run and by eval when the drafter config names other layers; one without the record, and
 * one that agrees, are taken. Before the record, the synth config's layer 3 trained happily on
 * a store of layer 5. */
#include <dflash/hidden.h>
#include <dflash/train.h>
#include <stdlib.h>
#include <string.h>

#include "synth.h"
#include "testutil.h"

enum { SYNTH_H = 32 };

/* root/hidden copied into root/name with `layer` (and a tokenizer hash) recorded. */
static char *recorded_copy(const char *root, const char *name, int32_t layer) {
  char *from = synth_path(root, "hidden"), *to = synth_at(root, name);
  dflash_hidden *h;
  ck_assert_ok(dflash_hidden_open(from, &h));
  dflash_hidden_writer_options o;
  dflash_hidden_writer_options_default(&o);
  o.target_layer_ids = &layer;
  o.tokenizer_hash = "sha256:abc";
  dflash_hidden_writer *w;
  ck_assert_ok(dflash_hidden_writer_create(to, 1, SYNTH_H, &o, &w));
  dflash_hidden_info info = {.struct_size = sizeof info};
  ck_assert_ok(dflash_hidden_get_info(h, &info));
  for (size_t i = 0; i < info.count; i++) {
    const char *id;
    int64_t len;
    ck_assert_ok(dflash_hidden_id(h, i, &id));
    ck_assert_ok(dflash_hidden_length(h, id, &len));
    float *x = malloc((size_t)len * SYNTH_H * sizeof *x);
    ck_assert_ok(dflash_hidden_read(h, id, x, len));
    ck_assert_ok(df_test_hidden_add(w, id, x, NULL, len));
    free(x);
  }
  ck_assert_ok(dflash_hidden_writer_commit(w));
  dflash_hidden_writer_free(w);
  dflash_hidden_free(h);
  free(from);
  return to;
}

START_TEST(a_store_of_other_layers_is_refused) {
  char *root = df_test_tmpdir();
  synth_world(root, 8, 16, 3); /* the config reads target layer 3 */
  dflash_train_run_options o;
  synth_run_options(&o, root, synth_at(root, "out"));
  o.epochs = 1, o.max_steps = 1, o.save_every_s = 0;
  o.hidden_dir = recorded_copy(root, "hidden5", 5);
  ck_assert_status(dflash_train_run(&o, NULL), DFLASH_E_MISMATCH,
                   "holds the target layers [5]; the drafter config's "
                   "dflash_config.target_layer_ids are [3]");
  o.hidden_dir = recorded_copy(root, "hidden3", 3);
  ck_assert_ok(dflash_train_run(&o, NULL));
  /* eval, on the checkpoint just written */
  char *cfg_path = synth_path(o.out_dir, "config.json");
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  ck_assert_ok(dflash_drafter_config_load(cfg_path, &cfg));
  float *e = calloc((size_t)cfg.vocab_size * SYNTH_H, sizeof *e);
  dflash_trainer *t;
  ck_assert_ok(dflash_trainer_create(&cfg, e, e, NULL, &t));
  dflash_eval ev;
  dflash_eval_default(&ev);
  ev.anchors_per_seq = 4;
  char *five = synth_path(root, "hidden5");
  ck_assert_status(dflash_trainer_eval(t, o.data_dir, five, &ev), DFLASH_E_MISMATCH,
                   "holds the target layers [5]");
  dflash_eval_walk ew;
  dflash_eval_walk_default(&ew);
  ck_assert_status(dflash_trainer_eval_walk(t, o.data_dir, five, &ew), DFLASH_E_MISMATCH, "[3]");
  ck_assert_ok(dflash_trainer_eval(t, o.data_dir, o.hidden_dir, &ev));
  dflash_trainer_free(t);
  free(e), free(cfg_path), free(five);
  df_test_rmtree(root);
  free(root);
}
END_TEST

TCase *tc_store_layers(void);
TCase *tc_store_layers(void) {
  TCase *tc = tcase_create("store_layers");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, a_store_of_other_layers_is_refused);
  return tc;
}
