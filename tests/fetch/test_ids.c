/* An id means one prompt (dflash_fetch_options.new_ids, keep_first_duplicates): what
 * dflash_fetch_create decides from the input and the records already in the output, without a
 * network. The records are written here by hand, as an earlier run would have. */
#include <dflash/fetch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "fetch/fetch_internal.h"
#include "testutil.h"

#define LINE(id, text) \
  "{\"id\":\"" id "\",\"messages\":[{\"role\":\"user\",\"content\":\"" text "\"}]}\n"

#define ck_assert_error_has(text) \
  ck_assert_msg(strstr(dflash_last_error(), text), "message: %s", dflash_last_error())

typedef struct ids_case {
  char *dir, *in, *out;
} ids_case;

static ids_case case_open(void) {
  ids_case c;
  c.dir = df_test_tmpdir();
  c.in = df_path_join(c.dir, "in.jsonl");
  c.out = df_path_join(c.dir, "out");
  ck_assert(df_mkdir_p(c.out) == DFLASH_OK);
  return c;
}

static void case_close(ids_case *c) {
  df_test_rmtree(c->dir);
  free(c->dir);
  free(c->in);
  free(c->out);
}

/* The digest a record of the input line `line` carries. */
static void digest_of(const char *line, char out[DF_DIGEST_LEN + 1]) {
  df_conv c;
  char *explicit_id;
  ck_assert_ok(df_conv_parse(line, strlen(line), "t", 1, &c, &explicit_id));
  memcpy(out, c.digest, DF_DIGEST_LEN + 1);
  free(explicit_id);
  df_conv_free(&c);
}

/* completions.jsonl holding one record per (id, line) pair; a NULL line: no digest (a record
 * written before records had one). */
static void write_records(const ids_case *c, const char *const *ids, const char *const *lines,
                          size_t n) {
  df_buf b = {0};
  for (size_t i = 0; i < n; i++) {
    char d[DF_DIGEST_LEN + 1], *rec;
    if (lines[i]) {
      digest_of(lines[i], d);
      rec = df_asprintf("{\"id\":\"%s\",\"digest\":\"%s\",\"outcome\":\"ok\"}\n", ids[i], d);
    } else {
      rec = df_asprintf("{\"id\":\"%s\",\"outcome\":\"ok\"}\n", ids[i]);
    }
    ck_assert_ok(df_buf_append(&b, rec, strlen(rec)));
    free(rec);
  }
  char *path = df_path_join(c->out, "completions.jsonl");
  ck_assert(df_test_write(path, b.data ? b.data : "", b.len));
  free(path);
  df_buf_free(&b);
}

static int retry_errors; /* dflash_fetch_options.retry_errors of the next create() */

static dflash_status create(const ids_case *c, const char *input, int new_ids, int keep_first,
                            dflash_fetch_stats *s) {
  static const char *servers[] = {"http://127.0.0.1:9/v1"};
  dflash_fetch_options o;
  dflash_fetch_options_default(&o);
  o.servers = servers;
  o.n_servers = 1;
  o.model = "m";
  o.new_ids = new_ids;
  o.keep_first_duplicates = keep_first;
  o.retry_errors = retry_errors;
  ck_assert(df_test_write(c->in, input, strlen(input)));
  dflash_fetch *f = NULL;
  dflash_status st = dflash_fetch_create(&o, c->in, c->out, &f);
  if (!st) {
    *s = (dflash_fetch_stats){.struct_size = sizeof *s};
    ck_assert_ok(dflash_fetch_get_stats(f, s));
  }
  dflash_fetch_free(f);
  return st;
}

/* A second input whose ids overlap the first's is refused, naming the ids and how many; not
 * skipped as done (it was: "skipped": 100, exit 0). */
START_TEST(overlapping_ids_with_other_messages_are_refused) {
  ids_case c = case_open();
  const char *ids[] = {"0", "1", "2"};
  const char *first[] = {LINE("0", "a"), LINE("1", "b"), LINE("2", "c")};
  write_records(&c, ids, first, 3);
  dflash_fetch_stats s;
  ck_assert_status(create(&c, LINE("0", "x") LINE("1", "b") LINE("2", "z"), 0, 0, &s),
                   DFLASH_E_MISMATCH, "2 ids already in");
  ck_assert_error_has("0 (line 1), 2 (line 3)");
  ck_assert_error_has("--new-ids");
  /* the same prompts under the same ids: done */
  ck_assert_ok(create(&c, LINE("0", "a") LINE("1", "b") LINE("2", "c"), 0, 0, &s));
  ck_assert_uint_eq(s.skipped, 3);
  ck_assert_uint_eq(s.pending, 0);
  case_close(&c);
}
END_TEST

/* new_ids: the conflicting prompts go under "<id>#2" (the next free one); a resume finds them
 * there (a record of "0#2" with these messages is done), a third prompt gets "#3". */
START_TEST(new_ids_fetch_conflicts_under_suffixed_ids) {
  ids_case c = case_open();
  const char *ids[] = {"0", "1"};
  const char *first[] = {LINE("0", "a"), LINE("1", "b")};
  write_records(&c, ids, first, 2);
  dflash_fetch_stats s;
  ck_assert_ok(create(&c, LINE("0", "x") LINE("1", "b"), 1, 0, &s));
  ck_assert_uint_eq(s.renamed, 1);
  ck_assert_uint_eq(s.skipped, 1);
  ck_assert_uint_eq(s.pending, 1);
  const char *ids2[] = {"0", "1", "0#2"};
  const char *second[] = {LINE("0", "a"), LINE("1", "b"), LINE("0", "x")};
  write_records(&c, ids2, second, 3);
  ck_assert_ok(create(&c, LINE("0", "x") LINE("1", "b") LINE("0", "y"), 1, 0, &s));
  ck_assert_uint_eq(s.renamed, 2); /* 0#2 found done, y goes to 0#3 */
  ck_assert_uint_eq(s.skipped, 2);
  ck_assert_uint_eq(s.pending, 1);
  /* keep_first_duplicates wins for repeats inside the input: y is a later line of id 0 */
  ck_assert_ok(create(&c, LINE("0", "x") LINE("1", "b") LINE("0", "y"), 1, 1, &s));
  ck_assert_uint_eq(s.renamed, 1);
  ck_assert_uint_eq(s.duplicates, 1);
  ck_assert_uint_eq(s.pending, 0);
  case_close(&c);
}
END_TEST

/* An error recorded for an id is a record too: other messages under it are a conflict. */
START_TEST(error_records_hold_their_prompt_too) {
  ids_case c = case_open();
  char d[DF_DIGEST_LEN + 1];
  digest_of(LINE("0", "a"), d);
  char *rec = df_asprintf("{\"id\":\"0\",\"digest\":\"%s\",\"kind\":\"http\"}\n", d);
  char *path = df_path_join(c.out, "errors.jsonl");
  ck_assert(df_test_write(path, rec, strlen(rec)));
  free(rec);
  free(path);
  dflash_fetch_stats s;
  ck_assert_status(create(&c, LINE("0", "x"), 0, 0, &s), DFLASH_E_MISMATCH, "1 ids already in");
  ck_assert_ok(create(&c, LINE("0", "a"), 0, 0, &s));
  ck_assert_uint_eq(s.skipped, 1);
  ck_assert_uint_eq(s.errors_earlier, 1);
  /* retry_errors moves the record to errors.retried.jsonl to fetch it again: the prompt keeps
   * its id there, refused or not, this run and the next */
  retry_errors = 1;
  ck_assert_status(create(&c, LINE("0", "x"), 0, 0, &s), DFLASH_E_MISMATCH, "1 ids already in");
  retry_errors = 0;
  ck_assert_status(create(&c, LINE("0", "x"), 0, 0, &s), DFLASH_E_MISMATCH, "1 ids already in");
  ck_assert_ok(create(&c, LINE("0", "a"), 0, 0, &s));
  ck_assert_uint_eq(s.pending, 1); /* the retried prompt itself */
  ck_assert_ok(create(&c, LINE("0", "x"), 1, 0, &s));
  ck_assert_uint_eq(s.renamed, 1);
  case_close(&c);
}
END_TEST

/* Records from before records had a digest cannot be compared: taken as the same prompt. */
START_TEST(records_without_digest_count_as_the_same) {
  ids_case c = case_open();
  const char *ids[] = {"0"};
  const char *lines[] = {NULL};
  write_records(&c, ids, lines, 1);
  dflash_fetch_stats s;
  ck_assert_ok(create(&c, LINE("0", "x"), 0, 0, &s));
  ck_assert_uint_eq(s.skipped, 1);
  case_close(&c);
}
END_TEST

/* Inside one input: a reused id with other messages is an error (it was a warning and the
 * second prompt dropped), unless keep_first_duplicates or new_ids; the same messages again
 * are a harmless repeat. */
START_TEST(duplicate_ids_in_one_input) {
  ids_case c = case_open();
  const char *merged = LINE("0", "a") LINE("1", "b") LINE("0", "c") LINE("1", "d") LINE("1", "b");
  dflash_fetch_stats s;
  ck_assert_status(create(&c, merged, 0, 0, &s), DFLASH_E_FORMAT, "2 ids come again");
  ck_assert_error_has("0 (line 3), 1 (line 4)");
  ck_assert_error_has("--keep-first");
  ck_assert_ok(create(&c, merged, 0, 1, &s));
  ck_assert_uint_eq(s.duplicates, 3);
  ck_assert_uint_eq(s.pending, 2);
  ck_assert_ok(create(&c, merged, 1, 0, &s));
  ck_assert_uint_eq(s.duplicates, 1); /* the exact repeat of line 2 */
  ck_assert_uint_eq(s.renamed, 2);
  ck_assert_uint_eq(s.pending, 4);
  case_close(&c);
}
END_TEST

/* The digest is written right after the id, where a resume reads it without a parse; a record
 * written otherwise is parsed. */
START_TEST(record_digest_read_back) {
  char d[DF_DIGEST_LEN + 1];
  const char *ours = "{\"id\":\"a\\\"b\",\"digest\":\"0123456789abcdef0123456789abcdef\",\"x\":1}";
  ck_assert_int_eq(df_record_digest(ours, strlen(ours), d), 1);
  ck_assert_str_eq(d, "0123456789abcdef0123456789abcdef");
  const char *other = "{\"x\":{\"digest\":\"no\"},\"id\":\"a\",\"digest\":"
                      "\"fedcba9876543210fedcba9876543210\"}";
  ck_assert_int_eq(df_record_digest(other, strlen(other), d), 1);
  ck_assert_str_eq(d, "fedcba9876543210fedcba9876543210");
  const char *none =
      "{\"id\":\"a\",\"messages\":[{\"digest\":\"0123456789abcdef0123456789abcdef\"}]}";
  ck_assert_int_eq(df_record_digest(none, strlen(none), d), 0);
  const char *spaced = "{ \"id\": \"a\", \"digest\": \"0123456789abcdef0123456789abcdef\"}";
  ck_assert_int_eq(df_record_digest(spaced, strlen(spaced), d), 1); /* by another tool */
  const char *bad = "{\"id\":\"a\",\"digest\":\"0123456789ABCDEF0123456789abcdef\"}";
  ck_assert_int_eq(df_record_digest(bad, strlen(bad), d), 0);
}
END_TEST

TCase *tc_ids(void) {
  TCase *tc = tcase_create("ids");
  tcase_add_test(tc, overlapping_ids_with_other_messages_are_refused);
  tcase_add_test(tc, new_ids_fetch_conflicts_under_suffixed_ids);
  tcase_add_test(tc, error_records_hold_their_prompt_too);
  tcase_add_test(tc, records_without_digest_count_as_the_same);
  tcase_add_test(tc, duplicate_ids_in_one_input);
  tcase_add_test(tc, record_digest_read_back);
  return tc;
}
