/* Request bodies: family switches at the top level, extra JSON merged, probes. */
#include <stdlib.h>
#include <string.h>

#include "fetch/fetch_internal.h"
#include "testutil.h"

static json_t *build(const df_body_cfg *cfg, bool probe) {
  json_t *msgs = json_pack("[{s:s,s:s}]", "role", "user", "content", "Q");
  char *text;
  size_t len;
  ck_assert_ok(df_body_build(cfg, msgs, probe ? NULL : "id-1", probe, &text, &len));
  json_decref(msgs);
  json_t *j = json_loadb(text, len, 0, NULL);
  free(text);
  ck_assert_ptr_nonnull(j);
  return j;
}

static df_body_cfg base_cfg(void) {
  return (df_body_cfg){.model = "m",
                       .family = DFLASH_FETCH_FAMILY_KIMI,
                       .thinking = 1,
                       .max_tokens = 100,
                       .stream = 1,
                       .temperature = 0.6,
                       .top_p = -1,
                       .top_k = 0,
                       .min_p = -1,
                       .seed = 7};
}

START_TEST(kimi_streamed) {
  df_body_cfg cfg = base_cfg();
  json_t *j = build(&cfg, false);
  json_t *want = json_loads("{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"Q\"}],"
                            "\"max_tokens\":100,\"temperature\":0.6,\"seed\":7,\"stream\":true,"
                            "\"stream_options\":{\"include_usage\":true},"
                            "\"chat_template_kwargs\":{\"thinking\":true},\"rid\":\"id-1\"}",
                            0, NULL);
  ck_assert_msg(json_equal(j, want), "got %s", json_dumps(j, JSON_COMPACT));
  json_decref(j);
  json_decref(want);
}
END_TEST

START_TEST(qwen_extra_merge_and_probe) {
  df_body_cfg cfg = base_cfg();
  cfg.family = DFLASH_FETCH_FAMILY_QWEN;
  cfg.thinking = 0;
  cfg.extra = json_loads("{\"chat_template_kwargs\":{\"x\":1},\"repetition_penalty\":1.1,"
                         "\"stream\":true}",
                         0, NULL);
  json_t *j = build(&cfg, false);
  json_t *kw = json_object_get(j, "chat_template_kwargs");
  ck_assert(json_is_false(json_object_get(kw, "enable_thinking")));
  ck_assert_int_eq(json_integer_value(json_object_get(kw, "x")), 1);
  ck_assert(json_is_real(json_object_get(j, "repetition_penalty")));
  json_decref(j);
  j = build(&cfg, true);
  ck_assert_int_eq(json_integer_value(json_object_get(j, "max_tokens")), 1);
  ck_assert(json_is_false(json_object_get(j, "stream")));
  ck_assert_ptr_null(json_object_get(j, "stream_options"));
  json_decref(j);
  json_decref(cfg.extra);
}
END_TEST

START_TEST(reasoning_not_sent_back) {
  json_t *m = json_loads("[{\"role\":\"assistant\",\"content\":\"a\",\"reasoning\":\"r\"}]", 0,
                         NULL);
  json_t *s = df_messages_for_server(m);
  ck_assert_ptr_null(json_object_get(json_array_get(s, 0), "reasoning"));
  ck_assert_ptr_nonnull(json_object_get(json_array_get(m, 0), "reasoning"));
  json_decref(m);
  json_decref(s);
}
END_TEST

START_TEST(options_validation) {
  dflash_fetch_options o;
  dflash_fetch_options_default(&o);
  dflash_fetch *f;
  ck_assert_status(dflash_fetch_create(&o, "in", "out", &f), DFLASH_E_CONFIG, "no model");
  o.model = "m";
  const char *bad[] = {"ftp://x"};
  o.servers = bad;
  o.n_servers = 1;
  ck_assert_status(dflash_fetch_create(&o, "in", "out", &f), DFLASH_E_CONFIG, "not an http(s) URL");
  const char *ok[] = {"http://127.0.0.1:9/v1"};
  o.servers = ok;
  o.shard_count = 2;
  o.shard_index = 2;
  ck_assert_status(dflash_fetch_create(&o, "in", "out", &f), DFLASH_E_CONFIG, "shard 2/2");
  o.shard_count = 0;
  o.api_key_env = "DFLASH_TEST_SURELY_UNSET_KEY";
  ck_assert_status(dflash_fetch_create(&o, "in", "out", &f), DFLASH_E_AUTH,
                   "DFLASH_TEST_SURELY_UNSET_KEY");
  o.api_key_env = NULL;
  o.extra_json = "[1]";
  ck_assert_status(dflash_fetch_create(&o, "in", "out", &f), DFLASH_E_CONFIG, "must be an object");
  o.extra_json = NULL;
  char *dir = df_test_tmpdir();
  char *out = df_path_join(dir, "out");
  ck_assert_status(dflash_fetch_create(&o, "/nonexistent/in.jsonl", out, &f), DFLASH_E_NOT_FOUND,
                   "/nonexistent/in.jsonl");
  df_test_rmtree(dir);
  free(out);
  free(dir);
  dflash_fetch_free(NULL);
}
END_TEST

/* stream_options goes with the stream the body finally asks for: OpenAI and vLLM answer
 * 400 to stream_options on an unstreamed request. */
START_TEST(stream_options_only_when_streamed) {
  df_body_cfg cfg = base_cfg();
  cfg.stream = 0; /* --no-stream */
  json_t *j = build(&cfg, false);
  ck_assert(json_is_false(json_object_get(j, "stream")));
  ck_assert_ptr_null(json_object_get(j, "stream_options"));
  json_decref(j);
  cfg.extra = json_loads("{\"stream\":true}", 0, NULL); /* extra turns the stream on */
  j = build(&cfg, false);
  ck_assert(json_is_true(json_object_get(j, "stream")));
  ck_assert(json_is_true(json_object_get(json_object_get(j, "stream_options"), "include_usage")));
  json_decref(j);
  json_decref(cfg.extra);
  cfg.stream = 1;
  cfg.extra = json_loads("{\"stream\":false}", 0, NULL); /* extra turns it off */
  j = build(&cfg, false);
  ck_assert(json_is_false(json_object_get(j, "stream")));
  ck_assert_ptr_null(json_object_get(j, "stream_options"));
  json_decref(j);
  json_decref(cfg.extra);
  /* extra's own stream options merge in; an explicit include_usage false is kept */
  cfg.extra = json_loads("{\"stream_options\":{\"continuous_usage_stats\":true}}", 0, NULL);
  j = build(&cfg, false);
  json_t *want = json_loads("{\"include_usage\":true,\"continuous_usage_stats\":true}", 0, NULL);
  ck_assert(json_equal(json_object_get(j, "stream_options"), want));
  json_decref(want);
  json_decref(j);
  json_decref(cfg.extra);
  cfg.extra = json_loads("{\"stream_options\":{\"include_usage\":false}}", 0, NULL);
  j = build(&cfg, false);
  ck_assert(json_is_false(json_object_get(json_object_get(j, "stream_options"), "include_usage")));
  json_decref(j);
  j = build(&cfg, true); /* a probe never streams */
  ck_assert_ptr_null(json_object_get(j, "stream_options"));
  json_decref(j);
  json_decref(cfg.extra);
}
END_TEST

TCase *tc_request(void) {
  TCase *tc = tcase_create("request");
  tcase_add_test(tc, kimi_streamed);
  tcase_add_test(tc, qwen_extra_merge_and_probe);
  tcase_add_test(tc, reasoning_not_sent_back);
  tcase_add_test(tc, options_validation);
  tcase_add_test(tc, stream_options_only_when_streamed);
  return tc;
}
