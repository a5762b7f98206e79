/* Helpers for the Check suites. */
#ifndef DFLASH_TESTUTIL_H
#define DFLASH_TESTUTIL_H

#include <check.h>
#include <dflash/dflash.h>
#include <dflash/hidden.h>
#include <stdbool.h>
#include <stddef.h>

/* DF_TEST_STRIDE: 4 in a sanitizer build (ASan, TSan: gcc's __SANITIZE_*__, clang's
 * __has_feature), else 1. An exhaustive loop that only compares two implementations' outputs
 * steps by it, its start turning with an outer index, so that the plain builds (gcc, clang,
 * both -O3) run every case and a sanitized run still covers every case class. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DF_TEST_STRIDE 4
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define DF_TEST_STRIDE 4
#endif
#endif
#ifndef DF_TEST_STRIDE
#define DF_TEST_STRIDE 1
#endif

/* Assert a libdflash call succeeds, printing the library's message when not. */
#define ck_assert_ok(expr)                                                               \
  do {                                                                                   \
    dflash_status ck_st_ = (expr);                                                       \
    ck_assert_msg(ck_st_ == DFLASH_OK, "%s -> %s: %s", #expr, dflash_status_str(ck_st_), \
                  dflash_last_error());                                                  \
  } while (0)

/* Assert a call fails with `status` and that its message contains `needle`. */
#define ck_assert_status(expr, status, needle)                                                \
  do {                                                                                        \
    dflash_status ck_st_ = (expr);                                                            \
    ck_assert_msg(ck_st_ == (status), "%s -> %s (wanted %s): %s", #expr,                      \
                  dflash_status_str(ck_st_), dflash_status_str(status), dflash_last_error()); \
    ck_assert_msg(strstr(dflash_last_error(), (needle)) != NULL,                              \
                  "%s: message \"%s\" lacks \"%s\"", #expr, dflash_last_error(), (needle));   \
  } while (0)

/* A fresh empty directory under $TMPDIR (malloc'd path); removed by df_test_rmtree. */
char *df_test_tmpdir(void);
void df_test_rmtree(const char *path);
/* Folder of shared fixtures: $DFLASH_FIXTURES, else the configured default.
 * NULL (after printing why) when it does not exist. */
const char *df_test_fixtures(void);
/* Path of a fixture file (malloc'd) or NULL when absent (prints a skip note). */
char *df_test_fixture(const char *relative);
/* Write bytes to a file; returns false on failure. */
bool df_test_write(const char *path, const void *data, size_t n);
/* dflash_hidden_writer_add of float32 rows [len, K*H] and, when not NULL, target ids [len]. */
dflash_status df_test_hidden_add(dflash_hidden_writer *w, const char *id, const float *states,
                                 const int32_t *target_ids, int64_t len);

#endif
