#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/internal.h"
#include "testutil.h"

START_TEST(atomic_write_replaces_whole_file) {
  char *dir = df_test_tmpdir();
  char *path = df_path_join(dir, "out.bin");
  ck_assert(df_test_write(path, "old", 3));
  df_atomic_file f;
  ck_assert_ok(df_atomic_open(path, &f));
  ck_assert_ok(df_atomic_write(&f, "new-", 4));
  /* Until commit the old content is what readers see. */
  char *text;
  size_t len;
  ck_assert_ok(df_read_file(path, &text, &len));
  ck_assert_str_eq(text, "old");
  free(text);
  ck_assert_ok(df_atomic_write(&f, "content", 7));
  ck_assert_ok(df_atomic_commit(&f));
  ck_assert_ok(df_read_file(path, &text, &len));
  ck_assert_uint_eq(len, 11);
  ck_assert_str_eq(text, "new-content");
  free(text);
  free(path);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(abort_leaves_no_temp_file) {
  char *dir = df_test_tmpdir();
  char *path = df_path_join(dir, "x");
  df_atomic_file f;
  ck_assert_ok(df_atomic_open(path, &f));
  char *tmp = df_strdup(f.tmp_path);
  ck_assert_int_eq(access(tmp, F_OK), 0);
  df_atomic_abort(&f);
  ck_assert_int_ne(access(tmp, F_OK), 0);
  ck_assert_int_ne(access(path, F_OK), 0);
  free(tmp);
  free(path);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(read_missing_file_names_it) {
  char *text;
  ck_assert_status(df_read_file("/nonexistent/dflash-file", &text, NULL), DFLASH_E_NOT_FOUND,
                   "/nonexistent/dflash-file");
  df_atomic_file f;
  ck_assert_status(df_atomic_open("/nonexistent/dir/out", &f), DFLASH_E_IO, "/nonexistent/dir/out");
}
END_TEST

START_TEST(mkdir_p_creates_every_level) {
  char *dir = df_test_tmpdir();
  char *deep = df_asprintf("%s/a/b//c", dir);
  ck_assert_ok(df_mkdir_p(deep));
  ck_assert_ok(df_mkdir_p(deep)); /* existing directories are fine */
  char *file = df_asprintf("%s/a/b/c/f", dir);
  ck_assert(df_test_write(file, "x", 1));
  char *under = df_asprintf("%s/g", file);
  ck_assert_status(df_mkdir_p(file), DFLASH_E_EXISTS, "not a directory");
  ck_assert_status(df_mkdir_p(under), DFLASH_E_EXISTS, "/c/f exists"); /* the level at fault */
  free(under);
  free(file);
  free(deep);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

TCase *tc_fileio(void) {
  TCase *tc = tcase_create("fileio");
  tcase_add_test(tc, atomic_write_replaces_whole_file);
  tcase_add_test(tc, abort_leaves_no_temp_file);
  tcase_add_test(tc, read_missing_file_names_it);
  tcase_add_test(tc, mkdir_p_creates_every_level);
  return tc;
}
