/* Fetch reporting that is true: what an attempt's end says about its server (classify.c: only
 * a connection that fails or times out counts towards taking it out; 429 and 503 are overload),
 * the controller's answer to an overload (ctl.c), and rates over a window with a floor on its
 * length. No network, no wall clock. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fetch/fetch_state.h"
#include "testutil.h"

/* A finished attempt whose status line and body are known (no curl handle is read). */
static result classify(long http, const char *body, CURLcode rc) {
  df_xfer x;
  memset(&x, 0, sizeof x);
  x.type_known = true;
  x.http = http;
  x.retry_after = -1;
  if (body) ck_assert_ok(df_buf_append(&x.raw, body, strlen(body)));
  result r = df_fetch_classify(&x, rc);
  df_buf_free(&x.raw);
  df_resp_free(&x.resp);
  return r;
}

START_TEST(overload_is_not_a_server_fault) {
  static const long busy[] = {503, 429};
  for (size_t i = 0; i < 2; i++) {
    result r = classify(busy[i], "{\"error\":{\"message\":\"queue full\"}}", CURLE_OK);
    ck_assert_int_eq(r.kind, RES_RETRY);
    ck_assert(r.overload && !r.server_fault); /* a 503 took a server out after three */
    free(r.msg);
  }
  result r = classify(500, "oops", CURLE_OK); /* answered: retried, the server stays */
  ck_assert(r.kind == RES_RETRY && !r.server_fault && !r.overload);
  free(r.msg);
}
END_TEST

START_TEST(stream_errors_are_not_server_faults) {
  /* SGLang's full queue as an error event after 200: overload */
  const char *queue_full = "data: {\"error\":{\"message\":\"queue full\",\"code\":503}}\n\n";
  df_xfer x;
  memset(&x, 0, sizeof x);
  x.type_known = x.sse = true;
  x.http = 200;
  df_resp_chunk(&x.resp, queue_full + 6, strlen(queue_full) - 8);
  result r = df_fetch_classify(&x, CURLE_OK);
  ck_assert(r.kind == RES_RETRY && r.overload && !r.server_fault);
  free(r.msg);
  df_resp_free(&x.resp);
  /* an answer cut without a finish_reason, the connection intact: retried, not a fault */
  memset(&x, 0, sizeof x);
  x.type_known = x.sse = true;
  x.http = 200;
  r = df_fetch_classify(&x, CURLE_OK);
  ck_assert(r.kind == RES_RETRY && !r.server_fault);
  free(r.msg);
  df_resp_free(&x.resp);
}
END_TEST

START_TEST(connection_failures_and_timeouts_are) {
  static const CURLcode codes[] = {CURLE_COULDNT_CONNECT, CURLE_OPERATION_TIMEDOUT,
                                   CURLE_COULDNT_RESOLVE_HOST, CURLE_RECV_ERROR};
  for (size_t i = 0; i < 4; i++) {
    result r = classify(0, NULL, codes[i]);
    ck_assert(r.kind == RES_RETRY && r.server_fault && !r.overload);
    free(r.msg);
  }
}
END_TEST

START_TEST(overload_lowers_the_limit_once_per_window) {
  df_ctl c;
  df_ctl_init(&c, 64, 512, false, 0);
  ck_assert(df_ctl_overload(&c, 10, 60));
  ck_assert_uint_eq(c.limit, 45); /* three quarters of the 60 it held */
  ck_assert_int_eq(c.phase, DF_CTL_BASE);
  ck_assert(!df_ctl_overload(&c, 10.1, 45)); /* the same burst */
  ck_assert(df_ctl_overload(&c, 20, 45));
  ck_assert_uint_eq(c.limit, 33);
  df_ctl_init(&c, 1, 512, false, 0);
  ck_assert(!df_ctl_overload(&c, 10, 0)); /* never below 1 */
  ck_assert_uint_eq(c.limit, 1);
  df_ctl_init(&c, 16, 512, true, 0); /* a fixed limit is the caller's */
  ck_assert(!df_ctl_overload(&c, 10, 16));
  ck_assert_uint_eq(c.limit, 16);
}
END_TEST

START_TEST(rates_have_a_window_and_a_floor) {
  df_rate r;
  memset(&r, 0, sizeof r);
  ck_assert_double_eq(df_rate_per_s(&r, 5, 100), 0);
  df_rate_sample(&r, 100, 9000000); /* a resume's count at the start */
  /* 3 more after 1 ms: over at least 2 s, not thousands per second */
  ck_assert_double_eq_tol(df_rate_per_s(&r, 100.001, 9000003), 1.5, 1e-9);
  for (int i = 1; i <= 80; i++) df_rate_sample(&r, 100 + i * 0.25, 9000000 + (uint64_t)i * 10);
  /* 40 per second; the window is the last 10 s, whatever came before */
  ck_assert_double_eq_tol(df_rate_per_s(&r, 120, 9000800), 40, 1e-9);
  df_rate_sample(&r, 200, 9000800); /* after a pause: the oldest sample left in the window */
  ck_assert_double_eq_tol(df_rate_per_s(&r, 200.5, 9000804), 2, 1e-9);
}
END_TEST

TCase *tc_health(void) {
  TCase *tc = tcase_create("health");
  tcase_add_test(tc, overload_is_not_a_server_fault);
  tcase_add_test(tc, stream_errors_are_not_server_faults);
  tcase_add_test(tc, connection_failures_and_timeouts_are);
  tcase_add_test(tc, overload_lowers_the_limit_once_per_window);
  tcase_add_test(tc, rates_have_a_window_and_a_floor);
  return tc;
}
