/* The resume position of train_state (src/train/position.h): versioned JSON, refusals of what
 * this library does not understand, and states written before the format was versioned
 * ("epoch=... pos=..."), read and then resumed exactly. */
#include <dflash/safetensors.h>
#include <dflash/train.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "synth.h"
#include "testutil.h"
#include "train/position.h"

static df_position sample(void) {
  df_position p = {.epoch = 1,
                   .pos = 3,
                   .tokens = 96,
                   .metrics_bytes = 712,
                   .seed = UINT64_MAX, /* past jansson's integers: written as a string */
                   .samples = 8,
                   .elapsed_s = 0.5,
                   .has_schedule = true,
                   .next_lr = 0.001,
                   .sched_from = 2,
                   .sched_lr0 = 0.25,
                   .n_settings = 2};
  snprintf(p.settings[0].name, sizeof p.settings[0].name, "lr");
  p.settings[0].value = 0.005;
  snprintf(p.settings[1].name, sizeof p.settings[1].name, "anchors");
  p.settings[1].value = 8;
  return p;
}

static dflash_status parse(const char *text, df_position *p) {
  return df_position_parse(text, strlen(text), "state.safetensors", p);
}

START_TEST(json_is_the_documented_format) {
  df_position p = sample();
  char *text;
  ck_assert_ok(df_position_to_json(&p, &text));
  /* The layout src/train/README.md documents, written out by hand. */
  ck_assert_str_eq(text, "{\"format\":\"dflash-train-position\",\"version\":1,\"epoch\":1,"
                         "\"pos\":3,\"tokens\":96,\"metrics_bytes\":712,"
                         "\"seed\":\"18446744073709551615\",\"samples\":8,\"elapsed_s\":0.5,"
                         "\"settings\":{\"lr\":0.0050000000000000001,\"anchors\":8.0},"
                         "\"schedule\":{\"next_lr\":0.001,\"from\":2,\"lr0\":0.25}}");
  df_position back;
  ck_assert_ok(parse(text, &back));
  ck_assert_int_eq(back.epoch, 1);
  ck_assert_uint_eq(back.pos, 3);
  ck_assert_int_eq(back.tokens, 96);
  ck_assert_int_eq(back.metrics_bytes, 712);
  ck_assert_uint_eq(back.seed, UINT64_MAX);
  ck_assert_uint_eq(back.samples, 8);
  ck_assert(back.elapsed_s == 0.5 && back.has_schedule && back.next_lr == 0.001);
  ck_assert(back.sched_from == 2 && back.sched_lr0 == 0.25 && !back.spool);
  ck_assert_uint_eq(back.n_settings, 2);
  ck_assert(df_position_setting_find(&back, "lr")->value == 0.005);
  ck_assert(df_position_setting_find(&back, "anchors")->value == 8);
  ck_assert_ptr_null(df_position_setting_find(&back, "clip"));
  free(text);
  p.spool = true, p.spool_shard = 4, p.spool_offset = 2, p.spool_wait_s = 1.5;
  ck_assert_ok(df_position_to_json(&p, &text));
  ck_assert_ok(parse(text, &back));
  ck_assert(back.spool && back.spool_shard == 4 && back.spool_offset == 2);
  ck_assert(back.spool_wait_s == 1.5);
  free(text);
}
END_TEST

#define V1 "\"format\":\"dflash-train-position\",\"version\":1"
#define FIELDS                                                                              \
  "\"epoch\":0,\"pos\":3,\"tokens\":96,\"metrics_bytes\":712,\"seed\":\"5\",\"samples\":8," \
  "\"elapsed_s\":0.5,\"settings\":{}"

START_TEST(what_it_does_not_understand_is_refused) {
  df_position p;
  ck_assert_ok(parse("{" V1 "," FIELDS "}", &p));
  ck_assert_status(parse("{\"format\":\"dflash-train-position\",\"version\":2," FIELDS "}", &p),
                   DFLASH_E_UNSUPPORTED, "version 2 was written by a newer libdflash");
  ck_assert_status(parse("{" V1 "," FIELDS ",\"rng\":7}", &p), DFLASH_E_UNSUPPORTED,
                   "field \"rng\" is unknown");
  ck_assert_status(parse("{" V1 "," FIELDS ",\"spool\":{\"shard\":1,\"offset\":0,\"wait_s\":0,"
                         "\"lane\":2}}",
                         &p),
                   DFLASH_E_UNSUPPORTED, "field \"lane\" in \"spool\" is unknown");
  ck_assert_status(parse("{\"format\":\"dflash-hidden-1\",\"version\":1," FIELDS "}", &p),
                   DFLASH_E_FORMAT, "not \"dflash-train-position\"");
  ck_assert_status(parse("{\"version\":1," FIELDS "}", &p), DFLASH_E_FORMAT, "format missing");
  ck_assert_status(parse("{" V1 ",\"epoch\":0,\"tokens\":96,\"metrics_bytes\":712,\"seed\":\"5\","
                         "\"samples\":8,\"elapsed_s\":0.5,\"settings\":{}}",
                         &p),
                   DFLASH_E_FORMAT, "field \"pos\" is not an integer >= 0");
  ck_assert_status(parse("{" V1 ",\"epoch\":0,\"pos\":-1,\"tokens\":96,\"metrics_bytes\":712,"
                         "\"seed\":\"5\",\"samples\":8,\"elapsed_s\":0.5,\"settings\":{}}",
                         &p),
                   DFLASH_E_FORMAT, "\"pos\" is not an integer >= 0");
  ck_assert_status(parse("{" V1 ",\"epoch\":0,\"pos\":3,\"tokens\":96,\"metrics_bytes\":712,"
                         "\"seed\":5,\"samples\":8,\"elapsed_s\":0.5,\"settings\":{}}",
                         &p),
                   DFLASH_E_FORMAT, "\"seed\" is not a decimal string");
  ck_assert_status(
      parse("{" V1 ",\"epoch\":0,\"pos\":3,\"tokens\":96,\"metrics_bytes\":712,"
            "\"seed\":\"5\",\"samples\":8,\"elapsed_s\":0.5,\"settings\":{\"lr\":\"x\"}}",
            &p),
      DFLASH_E_FORMAT, "\"lr\" is not a number");
  ck_assert_status(parse("{" V1 "," FIELDS ",\"schedule\":{\"next_lr\":1}}", &p), DFLASH_E_FORMAT,
                   "\"from\" in \"schedule\" is not");
  ck_assert_status(parse("[1, 2]", &p), DFLASH_E_FORMAT, "not a JSON object");
  ck_assert_status(parse("{" V1, &p), DFLASH_E_JSON, "state.safetensors");
}
END_TEST

/* Texts as the writer before the versioned format wrote them (run.c's snprintf of the day). */
static const char OLD[] =
    "epoch=1 pos=3 tokens=96 metrics_bytes=712 seed=5 samples=8 elapsed=0.52000000000000002 "
    "lr=0.0050000000000000001 anchors=8 next_lr=0.001 sched=2,0.25";
static const char OLD_SPOOL[] = "epoch=0 pos=0 tokens=10 metrics_bytes=0 seed=5 samples=8 "
                                "elapsed=1 spool=4,2 spool_wait=1.500";
static const char OLDEST[] = "epoch=0 pos=5 tokens=10 metrics_bytes=9 seed=5 samples=8 elapsed=1";

START_TEST(unversioned_states_are_read) {
  df_position p;
  ck_assert_ok(parse(OLD, &p));
  ck_assert(p.epoch == 1 && p.pos == 3 && p.tokens == 96 && p.metrics_bytes == 712);
  ck_assert(p.seed == 5 && p.samples == 8 && p.elapsed_s == 0.52 && !p.spool);
  ck_assert(p.has_schedule && p.next_lr == 0.001 && p.sched_from == 2 && p.sched_lr0 == 0.25);
  ck_assert_uint_eq(p.n_settings, 2);
  ck_assert(df_position_setting_find(&p, "lr")->value == 0.005);
  ck_assert_ok(parse(OLD_SPOOL, &p));
  ck_assert(p.spool && p.spool_shard == 4 && p.spool_offset == 2 && p.spool_wait_s == 1.5);
  ck_assert_ok(parse(OLDEST, &p));
  ck_assert(!p.has_schedule && !p.n_settings && p.pos == 5);
  ck_assert_status(parse("epoch=0 pos=5 tokens=10 seed=5 samples=8 elapsed=1", &p), DFLASH_E_FORMAT,
                   "lacks a field");
  ck_assert_status(parse("epoch=0 pos=x tokens=10 metrics_bytes=9 seed=5 samples=8 elapsed=1", &p),
                   DFLASH_E_FORMAT, "unreadable resume position field \"pos=x\"");
  ck_assert_status(parse("epoch=0 pos=5 tokens=10 metrics_bytes=9 seed=5 samples=8 elapsed=1 "
                         "next_lr=0.1",
                         &p),
                   DFLASH_E_FORMAT, "half a schedule");
  ck_assert_status(parse("epoch=0 pos=5 tokens=10 metrics_bytes=9 seed=5 samples=8 elapsed=1 "
                         "spool=4",
                         &p),
                   DFLASH_E_FORMAT, "\"spool=4\"");
}
END_TEST

/* ---- a whole run resumed from an unversioned state ------------------------------------- */

/* Rewrite state.safetensors with `user` as its position (every other tensor as it was). */
static void replace_position(const char *path, const char *user) {
  dflash_safetensors *in;
  ck_assert_ok(dflash_safetensors_open(path, &in));
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.new", path);
  dflash_safetensors_writer *w;
  ck_assert_ok(dflash_safetensors_writer_create(tmp, &w));
  for (size_t i = 0; i < dflash_safetensors_metadata_count(in); i++) {
    const char *k, *v;
    ck_assert_ok(dflash_safetensors_metadata_get(in, i, &k, &v));
    ck_assert_ok(dflash_safetensors_writer_metadata(w, k, v));
  }
  size_t n = dflash_safetensors_count(in);
  int64_t ulen = (int64_t)strlen(user) + 1;
  for (size_t i = 0; i < n; i++) {
    dflash_tensor t = {.struct_size = sizeof t};
    ck_assert_ok(dflash_safetensors_get(in, i, &t));
    bool u = !strcmp(t.name, "user");
    ck_assert_ok(
        dflash_safetensors_writer_declare(w, t.name, t.dtype, u ? 1 : t.ndim, u ? &ulen : t.shape));
  }
  for (size_t i = 0; i < n; i++) {
    dflash_tensor t = {.struct_size = sizeof t};
    ck_assert_ok(dflash_safetensors_get(in, i, &t));
    bool u = !strcmp(t.name, "user");
    ck_assert_ok(
        dflash_safetensors_writer_write(w, u ? user : t.data, u ? (size_t)ulen : t.nbytes));
  }
  ck_assert_ok(dflash_safetensors_writer_commit(w));
  dflash_safetensors_writer_free(w);
  dflash_safetensors_free(in);
  ck_assert_int_eq(rename(tmp, path), 0);
}

/* The position a state holds, as text. */
static char *position_text(const char *path) {
  dflash_safetensors *st;
  ck_assert_ok(dflash_safetensors_open(path, &st));
  dflash_tensor t = {.struct_size = sizeof t};
  ck_assert_ok(dflash_safetensors_find(st, "user", &t));
  char *text = strndup(t.data, t.nbytes);
  dflash_safetensors_free(st);
  return text;
}

START_TEST(an_unversioned_state_resumes_exactly_and_is_saved_as_json) {
  char *root = df_test_tmpdir(), *full = synth_path(root, "full"), *part = synth_path(root, "part");
  synth_world(root, 8, 16, 3);
  dflash_train_run_options o;
  synth_run_options(&o, root, full);
  o.epochs = 1, o.max_steps = 4, o.save_every_s = 0;
  ck_assert_ok(dflash_train_run(&o, NULL));
  o.out_dir = part, o.max_steps = 2, o.schedule_steps = 4; /* stopped early: the same schedule */
  ck_assert_ok(dflash_train_run(&o, NULL));
  /* The same position as the old writer put it. */
  char *state = synth_path(part, "train_state/state.safetensors");
  char *json = position_text(state);
  df_position p;
  ck_assert_ok(parse(json, &p));
  ck_assert(p.has_schedule && p.n_settings == 22);
  char old[2048];
  int n = snprintf(old, sizeof old,
                   "epoch=%d pos=%" PRIu64 " tokens=%" PRId64 " metrics_bytes=%" PRId64
                   " seed=%" PRIu64 " samples=%" PRIu64 " elapsed=%.17g",
                   p.epoch, p.pos, p.tokens, p.metrics_bytes, p.seed, p.samples, p.elapsed_s);
  for (size_t i = 0; i < p.n_settings; i++)
    n += snprintf(old + n, sizeof old - (size_t)n, " %s=%.17g", p.settings[i].name,
                  p.settings[i].value);
  snprintf(old + n, sizeof old - (size_t)n, " next_lr=%.17g sched=%" PRId64 ",%.17g", p.next_lr,
           p.sched_from, p.sched_lr0);
  replace_position(state, old);
  char *back = position_text(state);
  ck_assert_str_eq(back, old);
  o.max_steps = 4, o.resume = 1;
  ck_assert_ok(dflash_train_run(&o, NULL));
  ck_assert(synth_max_abs_diff(full, part) == 0);
  char *after = position_text(state);
  ck_assert_msg(!strncmp(after, "{\"format\":\"dflash-train-position\",\"version\":1,", 45), "%s",
                after);
  /* A state from a newer library is refused, naming it. */
  replace_position(state, "{\"format\":\"dflash-train-position\",\"version\":2}");
  ck_assert_status(dflash_train_run(&o, NULL), DFLASH_E_UNSUPPORTED, "version 2");
  df_test_rmtree(root);
  free(root), free(full), free(part), free(state), free(json), free(back), free(after);
}
END_TEST

/* A state written before schedule_steps was recorded ran the epochs' schedule with max_steps;
 * resumed with the default it keeps that schedule (the new default, max_steps', would change
 * the rate mid-run). */
START_TEST(a_state_without_schedule_steps_keeps_the_epochs_schedule) {
  char *root = df_test_tmpdir(), *full = synth_path(root, "full"), *part = synth_path(root, "part");
  synth_world(root, 8, 16, 3);
  dflash_train_run_options o;
  synth_run_options(&o, root, full);
  o.epochs = 1, o.max_steps = 4, o.save_every_s = 0, o.schedule_steps = DFLASH_SCHEDULE_EPOCHS;
  ck_assert_ok(dflash_train_run(&o, NULL));
  o.out_dir = part, o.max_steps = 2;
  ck_assert_ok(dflash_train_run(&o, NULL));
  char *state = synth_path(part, "train_state/state.safetensors");
  char *json = position_text(state);
  df_position p;
  ck_assert_ok(parse(json, &p));
  char old[2048];
  int n = snprintf(old, sizeof old,
                   "epoch=%d pos=%" PRIu64 " tokens=%" PRId64 " metrics_bytes=%" PRId64
                   " seed=%" PRIu64 " samples=%" PRIu64 " elapsed=%.17g",
                   p.epoch, p.pos, p.tokens, p.metrics_bytes, p.seed, p.samples, p.elapsed_s);
  for (size_t i = 0; i < p.n_settings; i++)
    if (strcmp(p.settings[i].name, "schedule_steps"))
      n += snprintf(old + n, sizeof old - (size_t)n, " %s=%.17g", p.settings[i].name,
                    p.settings[i].value);
  snprintf(old + n, sizeof old - (size_t)n, " next_lr=%.17g sched=%" PRId64 ",%.17g", p.next_lr,
           p.sched_from, p.sched_lr0);
  replace_position(state, old);
  o.max_steps = 4, o.resume = 1, o.schedule_steps = 0;
  ck_assert_ok(dflash_train_run(&o, NULL));
  ck_assert(synth_max_abs_diff(full, part) == 0);
  df_test_rmtree(root);
  free(root), free(full), free(part), free(state), free(json);
}
END_TEST

/* A Muon run resumes exactly (its momentum is the state's adam_m); a resume that changes the
 * optimizer is refused even with allow_settings_change (the saved moments are the other
 * optimizer's). */
START_TEST(a_muon_run_resumes_exactly_and_keeps_its_optimizer) {
  char *root = df_test_tmpdir(), *full = synth_path(root, "full"), *part = synth_path(root, "part");
  synth_world(root, 8, 16, 3);
  dflash_train_run_options o;
  synth_run_options(&o, root, full);
  synth_trainer(&o)->optimizer = DFLASH_OPTIMIZER_MUON;
  o.epochs = 1, o.max_steps = 4, o.save_every_s = 0;
  ck_assert_ok(dflash_train_run(&o, NULL));
  o.out_dir = part, o.max_steps = 2, o.schedule_steps = 4; /* stopped early: the same schedule */
  ck_assert_ok(dflash_train_run(&o, NULL));
  o.max_steps = 4, o.resume = 1, o.allow_settings_change = 1;
  synth_trainer(&o)->optimizer = DFLASH_OPTIMIZER_ADAMW;
  ck_assert_status(dflash_train_run(&o, NULL), DFLASH_E_MISMATCH, "optimizer muon");
  synth_trainer(&o)->optimizer = DFLASH_OPTIMIZER_MUON, o.allow_settings_change = 0;
  ck_assert_ok(dflash_train_run(&o, NULL));
  ck_assert(synth_max_abs_diff(full, part) == 0);
  df_test_rmtree(root);
  free(root), free(full), free(part);
}
END_TEST

/* What the progress callback saw: each step's stats, and the step to ask for a stop at. */
typedef struct seen {
  int n;
  dflash_train_stats s[8];
  int64_t stop_at;
} seen;

static int record(const dflash_train_stats *s, void *user) {
  seen *v = user;
  ck_assert_uint_eq(s->struct_size, sizeof *s);
  if (v->n < 8) v->s[v->n++] = *s;
  return s->step == v->stop_at;
}

/* The "loss" of every line of metrics.jsonl in `out` into loss[] (at most 8); the count. */
static int metrics_losses(const char *out, double *loss) {
  char *path = synth_path(out, "metrics.jsonl"), line[4096];
  FILE *f = fopen(path, "r");
  ck_assert_ptr_nonnull(f);
  int n = 0;
  while (n < 8 && fgets(line, sizeof line, f)) {
    const char *l = strstr(line, "\"loss\": ");
    ck_assert_ptr_nonnull(l);
    loss[n++] = strtod(l + 8, NULL);
  }
  fclose(f);
  free(path);
  return n;
}

START_TEST(progress_reports_every_step_and_stops_the_run) {
  char *root = df_test_tmpdir(), *out = synth_path(root, "out");
  synth_world(root, 8, 16, 3);
  dflash_train_run_options o;
  synth_run_options(&o, root, out);
  seen v = {.stop_at = -1};
  o.epochs = 1, o.max_steps = 4, o.save_every_s = 0, o.progress = record, o.progress_user = &v;
  dflash_train_stats end = {.struct_size = sizeof end};
  ck_assert_ok(dflash_train_run(&o, &end));
  double loss[8];
  ck_assert_int_eq(metrics_losses(out, loss), 4);
  ck_assert_int_eq(v.n, 4);
  for (int i = 0; i < 4; i++) {
    ck_assert_int_eq(v.s[i].step, i + 1);
    ck_assert_int_eq(v.s[i].last_step, 4);
    ck_assert_double_eq_tol(v.s[i].loss, loss[i], 1e-6 * loss[i]);
    ck_assert(v.s[i].lr > 0 && v.s[i].grad_norm > 0 && v.s[i].tokens > 0);
  }
  ck_assert_int_eq(end.step, 4);
  ck_assert_double_eq(end.loss, v.s[3].loss);
  /* Asked to stop at step 2, whose report comes while step 3 computes: the run stops after
   * step 3 with its state saved, and --resume (here: resume = 1) finishes it. */
  df_test_rmtree(out);
  v = (seen){.stop_at = 2};
  ck_assert_status(dflash_train_run(&o, &end), DFLASH_E_CANCELLED, "--resume continues");
  ck_assert_int_eq(end.step, 3);
  ck_assert_int_eq(v.n, 3);
  v = (seen){.stop_at = -1};
  o.resume = 1;
  ck_assert_ok(dflash_train_run(&o, &end));
  ck_assert_int_eq(end.step, 4);
  ck_assert_int_eq(v.n, 1);
  df_test_rmtree(root);
  free(root), free(out);
}
END_TEST

TCase *tc_position(void);
TCase *tc_position(void) {
  TCase *tc = tcase_create("position");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, json_is_the_documented_format);
  tcase_add_test(tc, what_it_does_not_understand_is_refused);
  tcase_add_test(tc, unversioned_states_are_read);
  tcase_add_test(tc, an_unversioned_state_resumes_exactly_and_is_saved_as_json);
  tcase_add_test(tc, a_muon_run_resumes_exactly_and_keeps_its_optimizer);
  tcase_add_test(tc, a_state_without_schedule_steps_keeps_the_epochs_schedule);
  tcase_add_test(tc, progress_reports_every_step_and_stops_the_run);
  return tc;
}
