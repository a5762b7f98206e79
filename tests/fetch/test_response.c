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
  feed(&r, "{\"object\":\"error\",\"message\":\"too long\",\"type\":\"BadRequestError\",\"code\":\"400\"}");
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
  static const char *text = "{\"choices\":[{\"delta\":{\"content\":\"partial\"},\"finish_reason\":null}]}";
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
  const char *tools = "{\"choices\":[{\"message\":{\"content\":null,\"tool_calls\":[{\"id\":\"c\"}]},"
                      "\"finish_reason\":\"tool_calls\"}]}";
  df_resp_body(&r, tools, strlen(tools));
  ck_assert_int_eq(df_resp_judge(&r), DF_RESP_COMPLETE);
  ck_assert_str_eq(df_outcome(&r), "tool_calls");
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
  return tc;
}
