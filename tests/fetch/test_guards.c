/* The guards of dflash_fetch_options and what dflash_fetch_run checks before any work, without a
 * network: the settings record (settings.json), and a summary size query that logs nothing. */
#include <dflash/fetch.h>
#include <jansson.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "testutil.h"

static int logged, saw_change;

static void on_log(dflash_log_level level, const char *msg, void *user) {
  (void)level, (void)user;
  logged++;
  if (strstr(msg, "request settings changed") && strstr(msg, "temperature 0.5 -> 1.25"))
    saw_change = 1;
}

/* Options of one prompt; the server is the discard port. */
static void base_options(dflash_fetch_options *o, double temperature) {
  static const char *servers[] = {"http://127.0.0.1:9/v1"};
  dflash_fetch_options_default(o);
  o->servers = servers;
  o->n_servers = 1;
  o->model = "m";
  o->temperature = temperature;
  o->connect_timeout_s = 2;
  o->fail_threshold = 1;
}

/* A fetcher of one prompt in `dir` (its input written there). */
static dflash_status create(const char *dir, const dflash_fetch_options *o, dflash_fetch **f) {
  char *in = df_path_join(dir, "in.jsonl");
  char *out = df_path_join(dir, "out");
  static const char line[] =
      "{\"id\":\"a\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}\n";
  ck_assert(df_test_write(in, line, sizeof line - 1));
  *f = NULL;
  dflash_status st = dflash_fetch_create(o, in, out, f);
  free(in);
  free(out);
  return st;
}

static dflash_fetch *make(const char *dir, double temperature) {
  dflash_fetch_options o;
  base_options(&o, temperature);
  dflash_fetch *f;
  ck_assert_ok(create(dir, &o, &f));
  return f;
}

/* Runs that never reach a server: the down timeout (no server check) stops them. */
static dflash_fetch *make_quick(const char *dir, double temperature, int settings_change) {
  dflash_fetch_options o;
  base_options(&o, temperature);
  o.no_server_check = 1;
  o.down_timeout_s = 0.3;
  o.settings_change = settings_change;
  dflash_fetch *f;
  ck_assert_ok(create(dir, &o, &f));
  return f;
}

START_TEST(summary_size_query_is_quiet) {
  char *dir = df_test_tmpdir();
  dflash_fetch *f = make(dir, -1);
  dflash_set_log_callback(on_log, NULL, DFLASH_LOG_DEBUG);
  dflash_clear_error();
  logged = 0;
  size_t len = 0;
  ck_assert_int_eq(dflash_fetch_summary(f, NULL, 0, &len), DFLASH_E_BUFFER);
  ck_assert_int_gt(len, 100);
  ck_assert_int_eq(logged, 0);               /* `dflash fetch -v` printed it */
  ck_assert_str_eq(dflash_last_error(), ""); /* and a stop printed it as the reason */
  char small[8];
  ck_assert_status(dflash_fetch_summary(f, small, sizeof small, &len), DFLASH_E_BUFFER, "needs");
  char *buf = malloc(len);
  ck_assert_ok(dflash_fetch_summary(f, buf, len, &len));
  ck_assert(strstr(buf, "\"stop_reason\":null") && strstr(buf, "\"down_timeout_s\":600"));
  ck_assert(strstr(buf, "\"attempts_failed\":0") < strstr(buf, "\"servers\":"));
  free(buf);
  dflash_set_log_callback(NULL, NULL, DFLASH_LOG_WARN);
  dflash_fetch_free(f);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(guards_are_checked) {
  char *dir = df_test_tmpdir();
  dflash_fetch_options o;
  base_options(&o, -1);
  dflash_fetch *f;
  o.settings_change = 7;
  ck_assert_status(create(dir, &o, &f), DFLASH_E_CONFIG, "settings_change");
  o.settings_change = DFLASH_FETCH_SETTINGS_REFUSE;
  o.down_timeout_s = 0.0 / 0.0;
  ck_assert_status(create(dir, &o, &f), DFLASH_E_CONFIG, "down_timeout_s");
  o.down_timeout_s = 0;
  o.chunk_worker = "a/b";
  ck_assert_status(create(dir, &o, &f), DFLASH_E_CONFIG, "worker name \"a/b\"");
  o.chunk_worker = "";
  ck_assert_status(create(dir, &o, &f), DFLASH_E_CONFIG, "worker name");
  o.chunk_worker = "w1"; /* a local output: no effect */
  o.chunk_max_seconds = -1;
  ck_assert_status(create(dir, &o, &f), DFLASH_E_CONFIG, "chunk_max_seconds");
  o.chunk_max_seconds = 0;
  /* a dead port at start is a server restarting: kept and probed; the run stops
   * only after the down timeout, naming it (nothing recorded: the prompts wait) */
  o.down_timeout_s = 0.3;
  ck_assert_ok(create(dir, &o, &f));
  ck_assert_status(dflash_fetch_run(f, NULL, NULL), DFLASH_E_TIMEOUT,
                   "127.0.0.1:9/v1: unreachable");
  dflash_fetch_free(f);
  char *comps = df_path_join(dir, "out/completions.jsonl");
  char *text = NULL;
  size_t len = 0;
  if (df_read_file(comps, &text, &len) == DFLASH_OK) ck_assert_uint_eq(len, 0);
  free(text);
  free(comps);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(settings_recorded_then_refused_or_warned) {
  char *dir = df_test_tmpdir();
  dflash_fetch *f = make_quick(dir, 0.5, DFLASH_FETCH_SETTINGS_REFUSE);
  ck_assert_status(dflash_fetch_run(f, NULL, NULL), DFLASH_E_TIMEOUT, "down timeout");
  dflash_fetch_free(f);
  char *path = df_path_join(dir, "out/settings.json");
  char *text;
  size_t len;
  ck_assert_ok(df_read_file(path, &text, &len));
  ck_assert(strstr(text, "\"temperature\": 0.5") && strstr(text, "\"model\": \"m\""));
  free(text);
  /* the same settings: fine (and the down timeout again) */
  f = make_quick(dir, 0.5, DFLASH_FETCH_SETTINGS_REFUSE);
  ck_assert_status(dflash_fetch_run(f, NULL, NULL), DFLASH_E_TIMEOUT, "down timeout");
  dflash_fetch_free(f);
  /* other settings: refused, naming the change; the record stays */
  f = make_quick(dir, 1.25, DFLASH_FETCH_SETTINGS_REFUSE);
  ck_assert_status(dflash_fetch_run(f, NULL, NULL), DFLASH_E_MISMATCH, "temperature 0.5 -> 1.25");
  size_t n = 0;
  dflash_fetch_summary(f, NULL, 0, &n);
  char *sum = malloc(n);
  ck_assert_ok(dflash_fetch_summary(f, sum, n, &n));
  ck_assert(strstr(sum, "\"stop_reason\":\"settings\""));
  free(sum);
  dflash_fetch_free(f);
  ck_assert_ok(df_read_file(path, &text, &len));
  ck_assert(strstr(text, "\"temperature\": 0.5") && !strstr(text, "earlier\": [{"));
  free(text);
  /* the library's default: a warning, the change recorded, the old settings kept */
  dflash_set_log_callback(on_log, NULL, DFLASH_LOG_WARN);
  saw_change = 0;
  f = make_quick(dir, 1.25, DFLASH_FETCH_SETTINGS_WARN);
  ck_assert_status(dflash_fetch_run(f, NULL, NULL), DFLASH_E_TIMEOUT, "down timeout");
  ck_assert(saw_change);
  dflash_set_log_callback(NULL, NULL, DFLASH_LOG_WARN);
  dflash_fetch_free(f);
  ck_assert_ok(df_read_file(path, &text, &len));
  json_t *doc = json_loads(text, 0, NULL);
  ck_assert_double_eq(json_real_value(
                          json_object_get(json_object_get(doc, "settings"), "temperature")),
                      1.25);
  json_t *earlier = json_object_get(doc, "earlier");
  ck_assert_int_eq(json_array_size(earlier), 1);
  ck_assert_double_eq(json_real_value(
                          json_object_get(json_object_get(json_array_get(earlier, 0), "settings"),
                                          "temperature")),
                      0.5);
  json_decref(doc);
  free(text);
  free(path);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

TCase *tc_guards(void) {
  TCase *tc = tcase_create("guards");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, summary_size_query_is_quiet);
  tcase_add_test(tc, guards_are_checked);
  tcase_add_test(tc, settings_recorded_then_refused_or_warned);
  return tc;
}
