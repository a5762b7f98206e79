/* Chunks and bodies as SGLang, vLLM (old and new field names) and llama.cpp send them. */
#include <stdlib.h>
#include <string.h>

#include "fetch/fetch_internal.h"
#include "testutil.h"

static void feed(df_resp *r, const char *s) { df_resp_chunk(r, s, strlen(s)); }

START_TEST(stream_reasoning_both_names) {
  df_resp r = {0};
  feed(&r, "{\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}");
  feed(&r, "{\"choices\":[{\"delta\":{\"reasoning_content\":\"think \"}}]}");
  feed(&r, "{\"choices\":[{\"delta\":{\"reasoning\":\"more\"}}]}"); /* vLLM >= late 2025 */
  feed(&r, "{\"choices\":[{\"delta\":{\"content\":\"Hi \\u00e9\"}}]}");
  feed(&r, "{\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}");
  feed(&r, "{\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}");
  feed(&r, "[DONE]");
  ck_assert_str_eq(r.reasoning.data, "think more");
  ck_assert_str_eq(r.content.data, "Hi \xc3\xa9");
  ck_assert_str_eq(r.finish_reason, "stop");
  ck_assert_int_eq(json_integer_value(json_object_get(r.usage, "completion_tokens")), 4);
  ck_assert(r.done && !r.bad_json && !r.error);
  ck_assert_str_eq(df_outcome(&r), "ok");
  df_resp_free(&r);
}
END_TEST

START_TEST(error_event_after_200) {
  df_resp r = {0};
  feed(&r, "{\"choices\":[{\"delta\":{\"content\":\"a\"}}]}");
  feed(&r, "{\"error\":{\"message\":\"queue full\",\"code\":503}}");
  ck_assert_str_eq(r.error, "queue full");
  ck_assert_int_eq(r.error_code, 503);
  df_resp_reset(&r);
  /* vLLM's ErrorResponse shape, code as a string */
  feed(
      &r,
      "{\"object\":\"error\",\"message\":\"too long\",\"type\":\"BadRequestError\",\"code\":\"400\"}");
  ck_assert_str_eq(r.error, "too long");
  ck_assert_int_eq(r.error_code, 400);
  ck_assert(!df_http_retryable(r.error_code) && df_http_retryable(503) && df_http_retryable(429));
  df_resp_free(&r);
}
END_TEST

START_TEST(whole_body_and_outcomes) {
  df_resp r = {0};
  const char *b = "{\"choices\":[{\"message\":{\"role\":\"assistant\",\"content\":\"  \","
                  "\"reasoning_content\":\"all thought\"},\"finish_reason\":\"length\"}]}";
  df_resp_body(&r, b, strlen(b));
  ck_assert_str_eq(r.reasoning.data, "all thought");
  ck_assert_str_eq(df_outcome(&r), "length");
  free(r.finish_reason);
  r.finish_reason = strdup("stop");
  ck_assert_str_eq(df_outcome(&r), "empty"); /* whitespace-only answer */
  df_resp_reset(&r);
  df_resp_body(&r, "{\"choices\":[{\"message\":{\"content\":\"cut", 35);
  ck_assert(r.bad_json);
  df_resp_free(&r);
}
END_TEST

START_TEST(error_bodies) {
  long code = 0;
  char *m = df_error_body_message("{\"detail\":\"Not Found\"}", 22, &code);
  ck_assert_str_eq(m, "Not Found");
  free(m);
  ck_assert_ptr_null(df_error_body_message("<html>502</html>", 16, &code));
  m = df_error_body_message("{\"error\":\"rate limited\"}", 24, &code);
  ck_assert_str_eq(m, "rate limited");
  free(m);
}
END_TEST

/* A stream that stops without a finish_reason was aborted by the server, whether
 * [DONE] or a clean end of the body follows; only a finish_reason completes it. */
START_TEST(verdict_needs_finish_reason) {
  static const char *text =
      "{\"choices\":[{\"delta\":{\"content\":\"partial\"},\"finish_reason\":null}]}";
  df_resp r = {0};
  feed(&r, text);
  ck_assert_int_eq(df_resp_judge(&r), DF_RESP_UNFINISHED); /* cut mid-stream */
  feed(&r, "{\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}");
  feed(&r, "[DONE]");
  ck_assert(r.done && !r.bad_json && !r.error && !r.finish_reason);
  ck_assert_int_eq(df_resp_judge(&r), DF_RESP_UNFINISHED); /* [DONE] alone is not enough */
  ck_assert_str_eq(df_outcome(&r), "unknown");
  df_resp_reset(&r);
  feed(&r, text);
  feed(&r, "{\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}");
  ck_assert_int_eq(df_resp_judge(&r), DF_RESP_COMPLETE); /* usage chunk and [DONE] lost */
  df_resp_reset(&r);
  feed(&r, text);
  feed(&r, "{\"choices\":[{\"delta\":{\"content\":\"cut");
  feed(&r, "[DONE]");
  ck_assert_int_eq(df_resp_judge(&r), DF_RESP_BAD_JSON);
  df_resp_reset(&r);
  feed(&r, "{\"choices\":[{\"delta\":{},\"finish_reason\":\"abort\"}]}");
  feed(&r, "[DONE]");
  ck_assert_int_eq(df_resp_judge(&r), DF_RESP_ABORTED);
  df_resp_reset(&r);
  feed(&r, "{\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}");
  feed(&r, "{\"error\":{\"message\":\"queue full\",\"code\":503}}");
  ck_assert_int_eq(df_resp_judge(&r), DF_RESP_ERROR); /* an error beats a finish_reason */
  df_resp_free(&r);
}
END_TEST

START_TEST(verdict_whole_body) {
  df_resp r = {0};
  const char *none = "{\"choices\":[{\"message\":{\"content\":\"hi\"},\"finish_reason\":null}]}";
  df_resp_body(&r, none, strlen(none));
  ck_assert(r.done && !r.bad_json);
  ck_assert_int_eq(df_resp_judge(&r), DF_RESP_UNFINISHED);
  df_resp_reset(&r);
  df_resp_body(&r, "{\"choices\":[]}", 14);
  ck_assert_int_eq(df_resp_judge(&r), DF_RESP_UNFINISHED);
  df_resp_reset(&r);
  const char *tools =
      "{\"choices\":[{\"message\":{\"content\":null,\"tool_calls\":[{\"id\":\"c\"}]},"
      "\"finish_reason\":\"tool_calls\"}]}";
  df_resp_body(&r, tools, strlen(tools));
  ck_assert_int_eq(df_resp_judge(&r), DF_RESP_COMPLETE);
  ck_assert_str_eq(df_outcome(&r), "tool_calls");
  df_resp_free(&r);
}
END_TEST

/* df_resp_usage over a whole answer; `want` NULL: unknown (no usage, no timings). */
static void check_usage(const df_resp *r, const char *want) {
  json_t *u = df_resp_usage(r);
  if (!want) {
    ck_assert_msg(u == NULL, "got %s", u ? json_dumps(u, JSON_COMPACT) : "");
    return;
  }
  json_t *w = json_loads(want, 0, NULL);
  ck_assert_ptr_nonnull(w);
  char *got = u ? json_dumps(u, JSON_COMPACT) : NULL;
  ck_assert_msg(json_equal(u, w), "got %s, want %s", got ? got : "NULL", want);
  free(got);
  json_decref(u);
  json_decref(w);
}

/* OpenAI, vLLM, SGLang with include_usage: "usage": null on every chunk (OpenAI), then
 * one chunk with empty choices and the counts. */
START_TEST(usage_openai_stream) {
  df_resp r = {0};
  feed(&r, "{\"choices\":[{\"index\":0,\"delta\":{\"content\":\"a\"}}],\"usage\":null}");
  feed(&r, "{\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":null}");
  check_usage(&r, NULL); /* cut here: no count yet */
  feed(&r, "{\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,"
           "\"total_tokens\":9}}");
  feed(&r, "[DONE]");
  check_usage(&r, "{\"prompt_tokens\":7,\"completion_tokens\":2,\"total_tokens\":9}");
  uint64_t n = 0;
  json_t *u = df_resp_usage(&r);
  ck_assert(df_usage_count(u, "completion_tokens", &n) && n == 2);
  json_decref(u);
  df_resp_free(&r);
}
END_TEST

/* llama-server b11434 asked for include_usage: the usage chunk carries the timings too;
 * usage wins. */
START_TEST(usage_llama_stream_with_include_usage) {
  df_resp r = {0};
  feed(&r, "{\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"role\":\"assistant\","
           "\"content\":null}}],\"object\":\"chat.completion.chunk\"}");
  feed(&r, "{\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}");
  feed(&r, "{\"choices\":[{\"finish_reason\":\"stop\",\"index\":0,\"delta\":{}}]}");
  feed(&r, "{\"choices\":[],\"usage\":{\"completion_tokens\":35,\"prompt_tokens\":237,"
           "\"total_tokens\":272,\"prompt_tokens_details\":{\"cached_tokens\":236}},"
           "\"timings\":{\"cache_n\":236,\"prompt_n\":1,\"prompt_ms\":30.9,\"predicted_n\":35,"
           "\"predicted_ms\":661.0,\"predicted_per_second\":52.9}}");
  feed(&r, "[DONE]");
  ck_assert_str_eq(r.content.data, "Hi");
  check_usage(&r, "{\"completion_tokens\":35,\"prompt_tokens\":237,\"total_tokens\":272,"
                  "\"prompt_tokens_details\":{\"cached_tokens\":236}}");
  df_resp_free(&r);
}
END_TEST

/* llama-server without include_usage (its default): timings on the finish_reason chunk
 * only. The counts are llama-server's own: predicted_n; prompt_n + cache_n. */
START_TEST(usage_llama_timings_only) {
  df_resp r = {0};
  feed(&r, "{\"choices\":[{\"finish_reason\":null,\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}");
  feed(&r, "{\"choices\":[{\"finish_reason\":\"length\",\"index\":0,\"delta\":{}}],"
           "\"timings\":{\"cache_n\":236,\"prompt_n\":1,\"prompt_ms\":30.958,"
           "\"prompt_per_token_ms\":30.958,\"prompt_per_second\":32.3,\"predicted_n\":35,"
           "\"predicted_ms\":661.064,\"predicted_per_token_ms\":18.9,"
           "\"predicted_per_second\":52.9}}");
  feed(&r, "[DONE]");
  check_usage(&r, "{\"completion_tokens\":35,\"prompt_tokens\":237,\"total_tokens\":272,"
                  "\"prompt_tokens_details\":{\"cached_tokens\":236}}");
  df_resp_reset(&r);
  check_usage(&r, NULL); /* reset forgets the timings */
  /* timings_per_token: every chunk has running timings; the last one counts. Older
   * llama.cpp has no cache_n: prompt_n is all we know of the prompt. */
  feed(&r, "{\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"timings\":{\"prompt_n\":5,"
           "\"predicted_n\":1}}");
  feed(&r, "{\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}],\"timings\":{\"prompt_n\":5,"
           "\"predicted_n\":2}}");
  check_usage(&r, "{\"completion_tokens\":2,\"prompt_tokens\":5,\"total_tokens\":7}");
  df_resp_reset(&r);
  /* a timings object without predicted_n is no count */
  feed(&r, "{\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}],"
           "\"timings\":{\"prompt_n\":5}}");
  check_usage(&r, NULL);
  df_resp_free(&r);
}
END_TEST

/* Neither usage nor timings (llama-cpp-python's server, a proxy): unknown, not 0. A usage
 * object without a completion count is kept as sent, and counts for nothing. */
START_TEST(usage_unknown) {
  df_resp r = {0};
  feed(&r, "{\"choices\":[{\"delta\":{\"content\":\"a\"}}]}");
  feed(&r, "{\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}");
  feed(&r, "[DONE]");
  check_usage(&r, NULL);
  feed(&r, "{\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":null}}");
  check_usage(&r, "{\"prompt_tokens\":3,\"completion_tokens\":null}");
  json_t *u = df_resp_usage(&r);
  uint64_t n = 99;
  ck_assert(!df_usage_count(u, "completion_tokens", &n) && n == 99);
  ck_assert(df_usage_count(u, "prompt_tokens", &n) && n == 3);
  ck_assert(!df_usage_count(NULL, "completion_tokens", &n));
  json_decref(u);
  df_resp_reset(&r);
  feed(&r, "{\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}],"
           "\"usage\":{\"completion_tokens\":-1}}");
  check_usage(&r, "{\"completion_tokens\":-1}");
  u = df_resp_usage(&r);
  ck_assert(!df_usage_count(u, "completion_tokens", &n));
  json_decref(u);
  df_resp_free(&r);
}
END_TEST

/* Non-streamed: usage in the body (every server); llama-server adds timings. */
START_TEST(usage_whole_body) {
  df_resp r = {0};
  const char *b = "{\"choices\":[{\"message\":{\"content\":\"x\"},\"finish_reason\":\"stop\"}],"
                  "\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":1,\"total_tokens\":5},"
                  "\"timings\":{\"cache_n\":0,\"prompt_n\":4,\"predicted_n\":1}}";
  df_resp_body(&r, b, strlen(b));
  check_usage(&r, "{\"prompt_tokens\":4,\"completion_tokens\":1,\"total_tokens\":5}");
  df_resp_reset(&r);
  b = "{\"choices\":[{\"message\":{\"content\":\"x\"},\"finish_reason\":\"stop\"}],"
      "\"timings\":{\"cache_n\":2,\"prompt_n\":4,\"predicted_n\":1}}";
  df_resp_body(&r, b, strlen(b));
  check_usage(&r, "{\"completion_tokens\":1,\"prompt_tokens\":6,\"total_tokens\":7,"
                  "\"prompt_tokens_details\":{\"cached_tokens\":2}}");
  df_resp_reset(&r);
  b = "{\"choices\":[{\"message\":{\"content\":\"x\"},\"finish_reason\":\"stop\"}]}";
  df_resp_body(&r, b, strlen(b));
  check_usage(&r, NULL);
  df_resp_free(&r);
}
END_TEST

TCase *tc_response(void) {
  TCase *tc = tcase_create("response");
  tcase_add_test(tc, stream_reasoning_both_names);
  tcase_add_test(tc, error_event_after_200);
  tcase_add_test(tc, whole_body_and_outcomes);
  tcase_add_test(tc, error_bodies);
  tcase_add_test(tc, verdict_needs_finish_reason);
  tcase_add_test(tc, verdict_whole_body);
  tcase_add_test(tc, usage_openai_stream);
  tcase_add_test(tc, usage_llama_stream_with_include_usage);
  tcase_add_test(tc, usage_llama_timings_only);
  tcase_add_test(tc, usage_unknown);
  tcase_add_test(tc, usage_whole_body);
  return tc;
}
