/* safetensors reader validation and writer behaviour. Interoperability with
 * Python's safetensors is tested in bindings/python/tests/test_safetensors.py. */
#include <dflash/safetensors.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <unistd.h>

#include "core/internal.h"
#include "testutil.h"

/* Write a file made of the 8-byte length, `header` and `data_len` zero bytes. */
static char *write_st(const char *dir, const char *name, const char *header, size_t data_len) {
  char *path = df_path_join(dir, name);
  size_t hl = strlen(header);
  size_t total = 8 + hl + data_len;
  unsigned char *buf = calloc(1, total);
  for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)hl >> (8 * i));
  memcpy(buf + 8, header, hl);
  ck_assert(df_test_write(path, buf, total));
  free(buf);
  return path;
}

static void expect_open_error(const char *header, size_t data_len, dflash_status want,
                              const char *needle) {
  char *dir = df_test_tmpdir();
  char *path = write_st(dir, "t.safetensors", header, data_len);
  dflash_safetensors *st = (void *)1;
  ck_assert_status(dflash_safetensors_open(path, &st), want, needle);
  ck_assert_ptr_null(st);
  ck_assert_msg(strstr(dflash_last_error(), path), "message lacks the path: %s",
                dflash_last_error());
  free(path);
  df_test_rmtree(dir);
  free(dir);
}

START_TEST(rejects_malformed_headers_with_specific_status) {
  expect_open_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4,
                    DFLASH_E_TRUNCATED, "truncated");
  expect_open_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                    "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                    8, DFLASH_E_RANGE, "overlaps");
  expect_open_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8,
                    DFLASH_E_FORMAT, "unused bytes before tensor \"a\"");
  expect_open_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8,
                    DFLASH_E_FORMAT, "after the last tensor");
  expect_open_error("{\"a\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
                    DFLASH_E_DTYPE, "\"Q4\"");
  expect_open_error("{\"a\":{\"dtype\":\"F64\",\"shape\":[4294967296,4294967296],"
                    "\"data_offsets\":[0,0]}}",
                    0, DFLASH_E_OVERFLOW, "\"a\"");
  expect_open_error("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                    "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
                    2, DFLASH_E_DUPLICATE, "duplicate");
  expect_open_error("{\"a\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,1]}}", 1,
                    DFLASH_E_FORMAT, "shape[0]");
  expect_open_error("{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,0]}}", 1,
                    DFLASH_E_FORMAT, "data_offsets");
  expect_open_error("{\"\xc3\x28\":1}", 0, DFLASH_E_UTF8, "UTF-8");
  expect_open_error("[1,2]", 0, DFLASH_E_FORMAT, "'{'");
  expect_open_error("{\"a\":", 0, DFLASH_E_JSON, "invalid JSON at column");
  expect_open_error("{\n\"a\":", 0, DFLASH_E_JSON, "at line 2");
  expect_open_error("{\"__metadata__\":{\"k\":1}}", 0, DFLASH_E_FORMAT, "\"k\"");
}
END_TEST

START_TEST(rejects_truncated_files) {
  char *dir = df_test_tmpdir();
  char *path = df_path_join(dir, "short.safetensors");
  ck_assert(df_test_write(path, "\x10\0\0", 3));
  dflash_safetensors *st;
  ck_assert_status(dflash_safetensors_open(path, &st), DFLASH_E_TRUNCATED, "too short");
  ck_assert(df_test_write(path, "\xff\xff\xff\xff\xff\xff\xff\x7f{}", 10));
  ck_assert_status(dflash_safetensors_open(path, &st), DFLASH_E_TRUNCATED, "header length");
  ck_assert_msg(strstr(dflash_last_error(), "truncated"), "%s", dflash_last_error());
  free(path);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(names_files_that_are_not_safetensors) {
  static const struct {
    const char bytes[48], *looks_like; /* zero-padded: 16 bytes are written */
  } cases[] = {{"{\"messages\": [{\"role\": \"user\"}]}\n", "JSON or JSONL"},
               {"GGUF\3\0\0\0\0\0\0\0\0\0", "GGUF"},
               {"PK\3\4\24\0\0\0\10\0", "zip"},
               {"\x80\2}q\0(X\4\0\0\0", "pickle"}};
  char *dir = df_test_tmpdir();
  char *path = df_path_join(dir, "model.bin");
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ck_assert(df_test_write(path, cases[i].bytes, 16));
    dflash_safetensors *st;
    ck_assert_status(dflash_safetensors_open(path, &st), DFLASH_E_FORMAT, "not a safetensors file");
    ck_assert_msg(strstr(dflash_last_error(), cases[i].looks_like), "%s", dflash_last_error());
  }
  free(path);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

static void write_two(const char *path) {
  dflash_safetensors_writer *w;
  ck_assert_ok(dflash_safetensors_writer_create(path, &w));
  int64_t s1[2] = {2, 3}, s0[1] = {0};
  ck_assert_ok(dflash_safetensors_writer_metadata(w, "format", "pt"));
  ck_assert_ok(dflash_safetensors_writer_declare(w, "w", DFLASH_DTYPE_F32, 2, s1));
  ck_assert_ok(dflash_safetensors_writer_declare(w, "empty", DFLASH_DTYPE_BF16, 1, s0));
  ck_assert_ok(dflash_safetensors_writer_declare(w, "scalar", DFLASH_DTYPE_I64, 0, NULL));
  ck_assert_status(dflash_safetensors_writer_declare(w, "w", DFLASH_DTYPE_F32, 2, s1),
                   DFLASH_E_DUPLICATE, "\"w\"");
  float v[6] = {1, 2, 3, 4, 5, 6};
  int64_t scalar = -5;
  /* Data streams in arbitrary chunks. */
  ck_assert_ok(dflash_safetensors_writer_write(w, v, 5));
  ck_assert_ok(dflash_safetensors_writer_write(w, (char *)v + 5, sizeof v - 5));
  ck_assert_status(dflash_safetensors_writer_declare(w, "late", DFLASH_DTYPE_U8, 0, NULL),
                   DFLASH_E_STATE, "after");
  ck_assert_ok(dflash_safetensors_writer_write(w, &scalar, sizeof scalar));
  ck_assert_status(dflash_safetensors_writer_write(w, &scalar, 1), DFLASH_E_RANGE, "more bytes");
  ck_assert_ok(dflash_safetensors_writer_commit(w));
  dflash_safetensors_writer_free(w);
}

START_TEST(writer_round_trips_through_reader) {
  char *dir = df_test_tmpdir();
  char *path = df_path_join(dir, "w.safetensors");
  write_two(path);
  dflash_safetensors *st;
  ck_assert_ok(dflash_safetensors_open(path, &st));
  ck_assert_uint_eq(dflash_safetensors_count(st), 3);
  dflash_tensor t = {.struct_size = sizeof t};
  ck_assert_ok(dflash_safetensors_get(st, 0, &t)); /* sorted by name */
  ck_assert_str_eq(t.name, "empty");
  ck_assert_uint_eq(t.nbytes, 0);
  ck_assert_ok(dflash_safetensors_find(st, "w", &t));
  ck_assert_int_eq(t.dtype, DFLASH_DTYPE_F32);
  ck_assert_uint_eq(t.ndim, 2);
  ck_assert_int_eq(t.shape[1], 3);
  ck_assert_float_eq(((const float *)t.data)[5], 6.0f);
  ck_assert_ok(dflash_safetensors_find(st, "scalar", &t));
  ck_assert_uint_eq(t.ndim, 0);
  int64_t scalar;
  memcpy(&scalar, t.data, sizeof scalar);
  ck_assert_int_eq(scalar, -5);
  const char *value;
  ck_assert_ok(dflash_safetensors_metadata_find(st, "format", &value));
  ck_assert_str_eq(value, "pt");
  ck_assert_status(dflash_safetensors_find(st, "nope", &t), DFLASH_E_NOT_FOUND, "\"nope\"");
  ck_assert_status(dflash_safetensors_get(st, 3, &t), DFLASH_E_RANGE, "3");
  /* A caller's older, smaller struct is written up to its size and no further. */
  dflash_tensor old;
  memset(&old, 0xab, sizeof old);
  old.struct_size = offsetof(dflash_tensor, dtype);
  ck_assert_ok(dflash_safetensors_get(st, 0, &old));
  ck_assert_ptr_nonnull(old.name);
  ck_assert_uint_eq(old.struct_size, offsetof(dflash_tensor, dtype));
  for (size_t i = offsetof(dflash_tensor, dtype); i < sizeof old; i++)
    ck_assert_uint_eq(((unsigned char *)&old)[i], 0xab);
  old.struct_size = 3;
  ck_assert_status(dflash_safetensors_get(st, 0, &old), DFLASH_E_INVALID_ARG, "struct_size");
  dflash_safetensors_free(st);
  free(path);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(unfinished_writer_leaves_nothing_and_keeps_old_file) {
  char *dir = df_test_tmpdir();
  char *path = df_path_join(dir, "w.safetensors");
  write_two(path);
  dflash_safetensors_writer *w;
  ck_assert_ok(dflash_safetensors_writer_create(path, &w));
  int64_t s[1] = {4};
  ck_assert_ok(dflash_safetensors_writer_declare(w, "x", DFLASH_DTYPE_U8, 1, s));
  ck_assert_ok(dflash_safetensors_writer_write(w, "ab", 2));
  ck_assert_status(dflash_safetensors_writer_commit(w), DFLASH_E_TRUNCATED, "2 of 4");
  dflash_safetensors_writer_free(w);
  dflash_safetensors *st; /* the previous complete file is still there */
  ck_assert_ok(dflash_safetensors_open(path, &st));
  ck_assert_uint_eq(dflash_safetensors_count(st), 3);
  dflash_safetensors_free(st);
  char *tmp = df_asprintf("%s.tmp.%ld", path, (long)getpid());
  ck_assert_int_ne(access(tmp, F_OK), 0);
  free(tmp);
  free(path);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(shards_with_duplicate_names_are_rejected) {
  char *dir = df_test_tmpdir();
  const char *h = "{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
  free(write_st(dir, "a.safetensors", h, 1));
  free(write_st(dir, "b.safetensors", h, 1));
  dflash_safetensors *st;
  ck_assert_status(dflash_safetensors_open(dir, &st), DFLASH_E_DUPLICATE, "\"x\"");
  char *empty = df_test_tmpdir();
  ck_assert_status(dflash_safetensors_open(empty, &st), DFLASH_E_NOT_FOUND, "no .safetensors");
  df_test_rmtree(empty);
  free(empty);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(dtype_table) {
  dflash_dtype d;
  ck_assert_ok(dflash_dtype_from_name("F8_E5M2", &d));
  ck_assert_int_eq(d, DFLASH_DTYPE_F8_E5M2);
  ck_assert_uint_eq(dflash_dtype_size(DFLASH_DTYPE_BF16), 2);
  ck_assert_uint_eq(dflash_dtype_size((dflash_dtype)99), 0);
  ck_assert_ptr_null(dflash_dtype_name((dflash_dtype)-1));
  ck_assert_status(dflash_dtype_from_name("bf16", &d), DFLASH_E_DTYPE, "bf16");
}
END_TEST

TCase *tc_safetensors(void) {
  TCase *tc = tcase_create("safetensors");
  tcase_add_test(tc, rejects_malformed_headers_with_specific_status);
  tcase_add_test(tc, rejects_truncated_files);
  tcase_add_test(tc, names_files_that_are_not_safetensors);
  tcase_add_test(tc, writer_round_trips_through_reader);
  tcase_add_test(tc, unfinished_writer_leaves_nothing_and_keeps_old_file);
  tcase_add_test(tc, shards_with_duplicate_names_are_rejected);
  tcase_add_test(tc, dtype_table);
  return tc;
}
