/* Durable outputs: torn lines cut, corrupt lines set aside, every valid record reported once. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fetch/fetch_internal.h"
#include "testutil.h"

typedef struct seen {
  df_buf ids;
  int n;
} seen;

static dflash_status note(void *ctx, const char *id, uint64_t line, const char *text, size_t len) {
  (void)text, (void)len;
  seen *s = ctx;
  df_buf_printf(&s->ids, "%s:%llu,", id ? id : "null", (unsigned long long)line);
  s->n++;
  return DFLASH_OK;
}

static char *slurp(const char *path) {
  char *t;
  size_t n;
  ck_assert_ok(df_read_file(path, &t, &n));
  return t;
}

static const char good[] = "{\"id\":\"a\",\"x\":1}\n"
                           "{\"id\":\"b\\\"q\",\"x\":2}\n"
                           "{\"id\":null,\"kind\":\"input\",\"line\":9}\n";

START_TEST(torn_last_line_is_cut) {
  char *dir = df_test_tmpdir();
  char *path = df_path_join(dir, "c.jsonl");
  char text[256];
  snprintf(text, sizeof text, "%s{\"id\":\"c\",\"x\":", good);
  ck_assert(df_test_write(path, text, strlen(text)));
  df_out o;
  seen s = {0};
  ck_assert_ok(df_out_open(path, note, &s, &o));
  ck_assert_str_eq(s.ids.data, "a:0,b\"q:0,null:9,");
  ck_assert_uint_eq(o.records, 3);
  json_t *r = json_pack("{s:s,s:i}", "id", "c", "x", 3);
  ck_assert_ok(df_out_append(&o, r));
  json_decref(r);
  df_out_close(&o);
  char *after = slurp(path);
  snprintf(text, sizeof text, "%s{\"id\":\"c\",\"x\":3}\n", good);
  ck_assert_str_eq(after, text);
  free(after);
  df_buf_free(&s.ids);
  df_test_rmtree(dir);
  free(path);
  free(dir);
}
END_TEST

/* Garbage (here NULs, as after a power loss) followed by valid lines. */
START_TEST(corrupt_middle_moves_aside) {
  char *dir = df_test_tmpdir();
  char *path = df_path_join(dir, "c.jsonl");
  static const char text[] = "{\"id\":\"a\"}\n\0\0\0\0\n{\"id\":\"b\"}\n{\"id\":";
  ck_assert(df_test_write(path, text, sizeof text - 1));
  df_out o;
  seen s = {0};
  ck_assert_ok(df_out_open(path, note, &s, &o));
  ck_assert_str_eq(s.ids.data, "a:0,b:0,");
  df_out_close(&o);
  char *after = slurp(path);
  ck_assert_str_eq(after, "{\"id\":\"a\"}\n{\"id\":\"b\"}\n");
  free(after);
  char *bad_path = df_asprintf("%s.corrupt", path);
  char *bad;
  size_t bad_len;
  ck_assert_ok(df_read_file(bad_path, &bad, &bad_len));
  ck_assert_uint_eq(bad_len, 5 + 7); /* the NUL line and the torn tail, each with '\n' */
  free(bad);
  free(bad_path);
  df_buf_free(&s.ids);
  df_test_rmtree(dir);
  free(path);
  free(dir);
}
END_TEST

START_TEST(fresh_file_and_sync) {
  char *dir = df_test_tmpdir();
  char *path = df_path_join(dir, "new.jsonl");
  df_out o;
  ck_assert_ok(df_out_open(path, NULL, NULL, &o));
  ck_assert_uint_eq(o.records, 0);
  json_t *r = json_pack("{s:n}", "id");
  ck_assert_ok(df_out_append(&o, r));
  json_decref(r);
  ck_assert(o.dirty);
  ck_assert_ok(df_out_sync(&o, 3600, df_now_seconds())); /* not due yet */
  ck_assert(o.dirty);
  ck_assert_ok(df_out_sync(&o, 0, df_now_seconds()));
  ck_assert(!o.dirty);
  df_out_close(&o);
  df_test_rmtree(dir);
  free(path);
  free(dir);
}
END_TEST

START_TEST(id_prefix_fast_path) {
  char *id;
  ck_assert(df_record_id_prefix("{\"id\":\"x\\u00e9\\\"\",\"a\":1}", 24, &id));
  ck_assert_str_eq(id, "x\xc3\xa9\"");
  free(id);
  ck_assert(df_record_id_prefix("{\"id\":null,\"a\":1}", 17, &id));
  ck_assert_ptr_null(id);
  ck_assert(!df_record_id_prefix("{\"a\":1,\"id\":\"x\"}", 16, &id));
  ck_assert(!df_record_id_prefix("{\"id\":\"unterminated", 19, &id));
}
END_TEST

START_TEST(string_set) {
  df_strset s = {0};
  char key[32];
  for (int i = 0; i < 5000; i++) {
    snprintf(key, sizeof key, "k%d", i);
    ck_assert_int_eq(df_strset_add(&s, key), 1);
  }
  ck_assert_int_eq(df_strset_add(&s, "k17"), 0);
  ck_assert(df_strset_has(&s, "k4999") && !df_strset_has(&s, "k5000"));
  ck_assert_uint_eq(s.count, 5000);
  df_strset_free(&s);
  ck_assert(!df_strset_has(&s, "k1"));
}
END_TEST

TCase *tc_output(void) {
  TCase *tc = tcase_create("output");
  tcase_add_test(tc, torn_last_line_is_cut);
  tcase_add_test(tc, corrupt_middle_moves_aside);
  tcase_add_test(tc, fresh_file_and_sync);
  tcase_add_test(tc, id_prefix_fast_path);
  tcase_add_test(tc, string_set);
  return tc;
}
