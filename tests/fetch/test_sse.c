/* The SSE parser must give the same events however the bytes are split. */
#include <stdlib.h>
#include <string.h>

#include "fetch/fetch_internal.h"
#include "testutil.h"

typedef struct events {
  df_buf log; /* "event|data\n" per event */
  int n;
} events;

static int collect(void *user, const char *event, const char *data, size_t len) {
  events *e = user;
  df_buf_printf(&e->log, "%s|", event);
  df_buf_append(&e->log, data, len);
  df_buf_append(&e->log, "\n", 1);
  e->n++;
  return 0;
}

static const char stream[] = ": keep-alive\n\n"
                             "data: {\"a\":1}\n\n"
                             "data: {\"b\":\r\n"
                             "data: 2}\r\n\r\n"
                             "event: error\rdata: {\"error\":{\"message\":\"x\"}}\r\r"
                             ":comment\n"
                             "data:nospace\n"
                             "id: 7\n"
                             "retry: 100\n\n"
                             "data\n\n"
                             "data: [DONE]\n\n"
                             "data: unterminated";

static const char expected[] = "|{\"a\":1}\n"
                               "|{\"b\":\n2}\n"
                               "error|{\"error\":{\"message\":\"x\"}}\n"
                               "|nospace\n"
                               "|\n"
                               "|[DONE]\n";

START_TEST(whole_stream) {
  df_sse p = {0};
  events e = {0};
  ck_assert_ok(df_sse_feed(&p, stream, strlen(stream), collect, &e));
  ck_assert_str_eq(e.log.data, expected);
  df_buf_free(&e.log);
  df_sse_free(&p);
}
END_TEST

/* Every split into two reads, and byte by byte. */
START_TEST(every_split_point) {
  size_t n = strlen(stream);
  for (size_t cut = 0; cut <= n; cut++) {
    df_sse p = {0};
    events e = {0};
    ck_assert_ok(df_sse_feed(&p, stream, cut, collect, &e));
    ck_assert_ok(df_sse_feed(&p, stream + cut, n - cut, collect, &e));
    ck_assert_msg(!strcmp(e.log.data, expected), "split at %zu: %s", cut, e.log.data);
    df_buf_free(&e.log);
    df_sse_free(&p);
  }
  df_sse p = {0};
  events e = {0};
  for (size_t i = 0; i < n; i++) { /* byte by byte, an empty read between (fuzz finding) */
    ck_assert_ok(df_sse_feed(&p, stream + i, 1, collect, &e));
    ck_assert_ok(df_sse_feed(&p, "", 0, collect, &e));
  }
  ck_assert_str_eq(e.log.data, expected);
  df_buf_free(&e.log);
  df_sse_free(&p);
}
END_TEST

static int stop_at_first(void *user, const char *event, const char *data, size_t len) {
  (void)event, (void)data, (void)len;
  (*(int *)user)++;
  return 1;
}

START_TEST(callback_can_stop) {
  df_sse p = {0};
  int calls = 0;
  ck_assert_int_eq(df_sse_feed(&p, stream, strlen(stream), stop_at_first, &calls),
                   DFLASH_E_CANCELLED);
  ck_assert_int_eq(calls, 1);
  df_sse_free(&p);
}
END_TEST

TCase *tc_sse(void) {
  TCase *tc = tcase_create("sse");
  tcase_add_test(tc, whole_stream);
  tcase_add_test(tc, every_split_point);
  tcase_add_test(tc, callback_can_stop);
  return tc;
}
