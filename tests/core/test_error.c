#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "core/internal.h"
#include "testutil.h"

START_TEST(status_names_are_distinct_and_total) {
  ck_assert_str_eq(dflash_status_str(DFLASH_OK), "DFLASH_OK");
  ck_assert_str_eq(dflash_status_str(DFLASH_E_EXISTS), "DFLASH_E_EXISTS");
  ck_assert_str_eq(dflash_status_str((dflash_status)9999), "DFLASH_E_UNKNOWN");
  for (int a = 0; a <= DFLASH_E_EXISTS; a++) {
    ck_assert_str_ne(dflash_status_str((dflash_status)a), "DFLASH_E_UNKNOWN");
    for (int b = a + 1; b <= DFLASH_E_EXISTS; b++)
      ck_assert_str_ne(dflash_status_str((dflash_status)a), dflash_status_str((dflash_status)b));
  }
}
END_TEST

START_TEST(version_matches_header) {
  ck_assert_int_eq(dflash_version_number(), DFLASH_VERSION_NUMBER);
  ck_assert_str_eq(dflash_version_string(), DFLASH_VERSION_STRING);
}
END_TEST

static void *set_in_thread(void *arg) {
  (void)arg;
  df_error(DFLASH_E_IO, "other thread");
  return NULL;
}

START_TEST(last_error_is_per_thread_and_wraps) {
  dflash_clear_error();
  ck_assert_str_eq(dflash_last_error(), "");
  ck_assert_int_eq(df_error(DFLASH_E_FORMAT, "%s:%d bad", "f.json", 3), DFLASH_E_FORMAT);
  pthread_t t;
  pthread_create(&t, NULL, set_in_thread, NULL);
  pthread_join(t, NULL);
  ck_assert_str_eq(dflash_last_error(), "f.json:3 bad");
  df_error_wrap(DFLASH_E_FORMAT, "loading %s", "model");
  ck_assert_str_eq(dflash_last_error(), "loading model: f.json:3 bad");
  df_error_errno(DFLASH_E_IO, 2, "x");
  ck_assert_str_eq(dflash_last_error(), "x: No such file or directory");
}
END_TEST

static int log_calls;
static char log_last[256];
static void log_fn(dflash_log_level level, const char *msg, void *user) {
  (void)level;
  *(int *)user += 1;
  snprintf(log_last, sizeof log_last, "%s", msg);
}

START_TEST(log_callback_filters_by_level) {
  dflash_set_log_callback(log_fn, &log_calls, DFLASH_LOG_INFO);
  df_log(DFLASH_LOG_DEBUG, "hidden");
  df_log(DFLASH_LOG_WARN, "shown %d", 7);
  dflash_set_log_callback(NULL, NULL, DFLASH_LOG_INFO);
  df_log(DFLASH_LOG_ERROR, "dropped");
  ck_assert_int_eq(log_calls, 1);
  ck_assert_str_eq(log_last, "shown 7");
}
END_TEST

START_TEST(cuda_query_fails_cleanly_without_device) {
  int n = -1;
  dflash_status st = dflash_cuda_device_count(&n);
  /* CI has no GPU: either the build lacks CUDA or the driver finds no device. */
  if (st != DFLASH_OK) {
    ck_assert(st == DFLASH_E_UNSUPPORTED || st == DFLASH_E_NO_DEVICE);
    ck_assert_int_eq(n, 0);
    ck_assert(strlen(dflash_last_error()) > 10);
  } else {
    ck_assert_int_gt(n, 0);
  }
  ck_assert_int_eq(dflash_cuda_device_count(NULL), DFLASH_E_INVALID_ARG);
}
END_TEST

TCase *tc_error(void) {
  TCase *tc = tcase_create("error");
  tcase_add_test(tc, status_names_are_distinct_and_total);
  tcase_add_test(tc, version_matches_header);
  tcase_add_test(tc, last_error_is_per_thread_and_wraps);
  tcase_add_test(tc, log_callback_filters_by_level);
  tcase_add_test(tc, cuda_query_fails_cleanly_without_device);
  return tc;
}
