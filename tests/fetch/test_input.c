/* Input lines: OpenAI and ShareGPT, ids, turns, and messages that name file and line. */
#include <stdlib.h>
#include <string.h>

#include "fetch/fetch_internal.h"
#include "testutil.h"

static dflash_status parse(const char *line, df_conv *c) {
  char *explicit_id;
  dflash_status st = df_conv_parse(line, strlen(line), "in.jsonl", 7, c, &explicit_id);
  free(explicit_id);
  return st;
}

START_TEST(openai_and_sharegpt_agree) {
  df_conv a, b;
  ck_assert_ok(parse("{\"messages\":[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\","
                     "\"content\":\"Q\"},{\"role\":\"assistant\",\"content\":\"A\"}]}",
                     &a));
  ck_assert_ok(parse("{\"system\":\"S\",\"conversations\":[{\"from\":\"human\",\"value\":\"Q\"},"
                     "{\"from\":\"gpt\",\"value\":\"A\"}]}",
                     &b));
  ck_assert(json_equal(a.messages, b.messages));
  ck_assert_str_eq(a.id, b.id); /* same conversation, same derived id */
  ck_assert(!a.id_explicit);
  ck_assert_int_eq(strlen(a.id), 33);
  ck_assert_int_eq(a.id[0], 'h');
  df_conv_free(&a);
  df_conv_free(&b);
}
END_TEST

START_TEST(explicit_ids) {
  df_conv c;
  ck_assert_ok(parse("{\"id\":42,\"messages\":[{\"role\":\"user\",\"content\":\"Q\"}]}", &c));
  ck_assert_str_eq(c.id, "42");
  ck_assert(c.id_explicit);
  df_conv_free(&c);
  ck_assert_status(parse("{\"id\":[1],\"messages\":[]}", &c), DFLASH_E_FORMAT,
                   "in.jsonl:7: \"id\"");
}
END_TEST

START_TEST(malformed_lines_name_file_and_line) {
  df_conv c;
  ck_assert_status(parse("{\"messages\":[", &c), DFLASH_E_JSON,
                   "in.jsonl:7: invalid JSON at column 13");
  ck_assert_status(parse("[1]", &c), DFLASH_E_FORMAT, "in.jsonl:7: not a JSON object");
  ck_assert_status(parse("{\"text\":\"x\"}", &c), DFLASH_E_FORMAT, "no \"messages\" or");
  ck_assert_status(parse("{\"messages\":[]}", &c), DFLASH_E_FORMAT, "empty");
  ck_assert_status(parse("{\"messages\":[{\"content\":\"x\"}]}", &c), DFLASH_E_FORMAT,
                   "messages[0] has no \"role\"");
  ck_assert_status(parse("{\"messages\":[{\"role\":\"user\",\"content\":5}]}", &c), DFLASH_E_FORMAT,
                   "messages[0] (user) has no \"content\"");
  ck_assert_status(parse("{\"conversations\":[{\"from\":\"alien\",\"value\":\"x\"}]}", &c),
                   DFLASH_E_FORMAT, "unknown speaker \"from\": alien");
  ck_assert_status(parse("{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}", &c),
                   DFLASH_E_UTF8, "in.jsonl");
}
END_TEST

static void turns_of(const char *line, bool all, const size_t *want, size_t n_want) {
  df_conv c;
  ck_assert_ok(parse(line, &c));
  size_t *pos, n;
  ck_assert_ok(df_conv_turns(c.messages, all, &pos, &n));
  ck_assert_uint_eq(n, n_want);
  for (size_t i = 0; i < n; i++) ck_assert_uint_eq(pos[i], want[i]);
  free(pos);
  df_conv_free(&c);
}

START_TEST(turn_positions) {
  const char *conv =
      "{\"messages\":[{\"role\":\"system\",\"content\":\"S\"},"
      "{\"role\":\"user\",\"content\":\"1\"},{\"role\":\"assistant\",\"content\":\"a\"},"
      "{\"role\":\"user\",\"content\":\"2\"},{\"role\":\"assistant\",\"content\":\"b\"}]}";
  turns_of(conv, false, (size_t[]){4}, 1);
  turns_of(conv, true, (size_t[]){2, 4}, 2);
  const char *open_end =
      "{\"messages\":[{\"role\":\"user\",\"content\":\"1\"},"
      "{\"role\":\"assistant\",\"content\":\"a\"},{\"role\":\"user\",\"content\":\"2\"}]}";
  turns_of(open_end, false, (size_t[]){3}, 1);
  turns_of(open_end, true, (size_t[]){1, 3}, 2);
  df_conv c;
  ck_assert_ok(parse("{\"messages\":[{\"role\":\"system\",\"content\":\"S\"}]}", &c));
  size_t *pos, n;
  ck_assert_status(df_conv_turns(c.messages, false, &pos, &n), DFLASH_E_FORMAT, "no user turn");
  df_conv_free(&c);
}
END_TEST

START_TEST(shards_partition_ids) {
  int counts[4] = {0};
  char id[32];
  for (int i = 0; i < 4000; i++) {
    snprintf(id, sizeof id, "id-%d", i);
    uint32_t s = df_shard_of(id, 4);
    ck_assert_uint_lt(s, 4);
    ck_assert_uint_eq(s, df_shard_of(id, 4)); /* deterministic */
    counts[s]++;
  }
  for (int s = 0; s < 4; s++)
    ck_assert_msg(counts[s] > 850 && counts[s] < 1150, "shard %d: %d", s, counts[s]);
  ck_assert_uint_eq(df_shard_of("anything", 1), 0);
}
END_TEST

START_TEST(public_record_id) {
  char out[64];
  const char *line = "{\"messages\":[{\"role\":\"user\",\"content\":\"Q\"}]}";
  ck_assert_ok(dflash_fetch_record_id(line, strlen(line), out, sizeof out));
  ck_assert_int_eq(out[0], 'h');
  ck_assert_status(dflash_fetch_record_id(line, strlen(line), out, 10), DFLASH_E_BUFFER,
                   "34 bytes");
}
END_TEST

TCase *tc_input(void) {
  TCase *tc = tcase_create("input");
  tcase_add_test(tc, openai_and_sharegpt_agree);
  tcase_add_test(tc, explicit_ids);
  tcase_add_test(tc, malformed_lines_name_file_and_line);
  tcase_add_test(tc, turn_positions);
  tcase_add_test(tc, shards_partition_ids);
  tcase_add_test(tc, public_record_id);
  return tc;
}
