/* Storage without a network: helpers (SHA-256, URI encoding, XML, locations,
 * backoff), the local backend, the chunk writer and on-demand safetensors on
 * local files, and the credential checks that fail before any connection. */
#include <dflash/storage.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "storage/stage.h"
#include "storage/storage_internal.h"
#include "testutil.h"

START_TEST(sha256_matches_fips_180_vectors) {
  char hex[65];
  df_sha256_hex("", 0, hex);
  ck_assert_str_eq(hex, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  df_sha256_hex("abc", 3, hex);
  ck_assert_str_eq(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const char *m = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  df_sha256_hex(m, strlen(m), hex);
  ck_assert_str_eq(hex, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  char *a = malloc(1000000);
  memset(a, 'a', 1000000);
  df_sha256_hex(a, 1000000, hex);
  ck_assert_str_eq(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  free(a);
}
END_TEST

/* Expected strings from the SigV4 rules (RFC 3986 unreserved kept, UTF-8
 * bytes as upper-case %XX), as botocore encodes them. */
START_TEST(uri_encoding_follows_sigv4) {
  static const struct {
    const char *in;
    bool slash;
    const char *out;
  } cases[] = {
      {"a/pl+us.bin", true, "a/pl%2Bus.bin"}, {"a/sp ace~_-.x", true, "a/sp%20ace~_-.x"},
      {"\xc3\xbc/%", true, "%C3%BC/%25"},     {"run1/chunk-", false, "run1%2Fchunk-"},
      {"a=b&c", false, "a%3Db%26c"},
  };
  for (size_t i = 0; i < DF_ARRAY_LEN(cases); i++) {
    df_buf b = {0};
    ck_assert_ok(df_uri_encode(&b, cases[i].in, strlen(cases[i].in), cases[i].slash));
    ck_assert_str_eq(b.data, cases[i].out);
    df_buf_free(&b);
  }
}
END_TEST

START_TEST(locations_parse_and_reject) {
  df_loc l;
  ck_assert_ok(df_loc_parse("s3://my-bucket/a/b.jsonl", &l));
  ck_assert(l.s3);
  ck_assert_str_eq(l.bucket, "my-bucket");
  ck_assert_str_eq(l.key, "a/b.jsonl");
  df_loc_clear(&l);
  ck_assert_ok(df_loc_parse("s3://b", &l));
  ck_assert_str_eq(l.key, "");
  df_loc_clear(&l);
  ck_assert_ok(df_loc_parse("file:///tmp/x", &l));
  ck_assert(!l.s3);
  ck_assert_str_eq(l.path, "/tmp/x");
  df_loc_clear(&l);
  ck_assert_status(df_loc_parse("s3:///key", &l), DFLASH_E_INVALID_ARG, "s3:///key");
  ck_assert_status(df_loc_parse("s3://bad bucket/k", &l), DFLASH_E_INVALID_ARG, "bad bucket");
  ck_assert_status(df_loc_parse("gs://b/k", &l), DFLASH_E_UNSUPPORTED, "gs://b/k");
  ck_assert_status(df_loc_parse_object("s3://b/dir/", &l), DFLASH_E_INVALID_ARG, "s3://b/dir/");
  ck_assert_status(df_loc_parse_object("s3://b", &l), DFLASH_E_INVALID_ARG, "s3://b");
  ck_assert(dflash_storage_is_remote("s3://b/k"));
  ck_assert(!dflash_storage_is_remote("/s3://b"));
}
END_TEST

START_TEST(xml_fields_decode_entities) {
  const char *x = "<R><Key>a&amp;b&lt;&#x263A;&#65;</Key><Key>second</Key><E>&bogus;</E></R>";
  size_t pos = 0;
  char *k = df_xml_next(x, strlen(x), "Key", &pos);
  ck_assert_str_eq(k, "a&b<\xe2\x98\xba"
                      "A");
  free(k);
  k = df_xml_next(x, strlen(x), "Key", &pos);
  ck_assert_str_eq(k, "second");
  free(k);
  ck_assert_ptr_null(df_xml_next(x, strlen(x), "Key", &pos));
  k = df_xml_first(x, strlen(x), "E");
  ck_assert_str_eq(k, "&bogus;");
  free(k);
  ck_assert_ptr_null(df_xml_first(x, strlen(x), "Missing"));
}
END_TEST

static dflash_storage *client(void) {
  dflash_storage_options o;
  dflash_storage_options_default(&o);
  o.backoff_base_s = 0.1;
  o.backoff_max_s = 1;
  dflash_storage *st = NULL;
  ck_assert_ok(dflash_storage_create(&o, &st));
  return st;
}

START_TEST(backoff_is_full_jitter_capped_and_honours_retry_after) {
  dflash_storage *st = client();
  double max_seen = 0;
  for (uint32_t attempt = 1; attempt <= 8; attempt++) {
    double ceil = attempt >= 5 ? 1.0 : 0.1 * (double)(1u << (attempt - 1));
    for (int i = 0; i < 200; i++) {
      double w = df_s3_backoff(st, attempt, -1);
      ck_assert_msg(w >= 0 && w <= ceil + 1e-9, "attempt %u: wait %f above %f", attempt, w, ceil);
      if (attempt == 8 && w > max_seen) max_seen = w;
    }
  }
  ck_assert_msg(max_seen > 0.5, "jitter never used the upper half of the range");
  ck_assert(df_s3_backoff(st, 1, 0.7) >= 0.7);
  ck_assert(df_s3_backoff(st, 1, 30) <= 1.0); /* capped at backoff_max */
  dflash_storage_free(st);
}
END_TEST

/* Times are seconds (double): 0 means the default, a positive one stays positive in
 * whole milliseconds, a negative or NaN one is refused naming its field. */
START_TEST(options_times_are_seconds) {
  dflash_storage_options o;
  dflash_storage_options_default(&o);
  ck_assert(o.connect_timeout_s == 10 && o.idle_timeout_s == 60 && o.request_timeout_s == 0);
  ck_assert(o.backoff_base_s == 0.2 && o.backoff_max_s == 20);
  o.connect_timeout_s = 0.0004;
  o.idle_timeout_s = 2.5;
  o.request_timeout_s = 0.7;
  o.backoff_max_s = 0;
  dflash_storage *st = NULL;
  ck_assert_ok(dflash_storage_create(&o, &st));
  ck_assert_uint_eq(st->cfg.connect_timeout_ms, 1);
  ck_assert_uint_eq(st->cfg.idle_timeout_ms, 2500);
  ck_assert_uint_eq(st->cfg.request_timeout_ms, 700);
  ck_assert_uint_eq(st->cfg.backoff_base_ms, 200);
  ck_assert_uint_eq(st->cfg.backoff_max_ms, 20000);
  dflash_storage_free(st);
  o.idle_timeout_s = -1;
  ck_assert_status(dflash_storage_create(&o, &st), DFLASH_E_CONFIG, "idle_timeout_s");
  o.idle_timeout_s = 1;
  o.backoff_base_s = NAN;
  ck_assert_status(dflash_storage_create(&o, &st), DFLASH_E_CONFIG, "backoff_base_s");
  o.backoff_base_s = 1;
  o.request_timeout_s = 3e6;
  ck_assert_status(dflash_storage_create(&o, &st), DFLASH_E_CONFIG, "request_timeout_s");
}
END_TEST

START_TEST(options_validate_addressing_region_and_part_size) {
  dflash_storage_options o;
  dflash_storage_options_default(&o);
  dflash_storage *st = NULL;
  o.part_size = 1 << 20;
  ck_assert_status(dflash_storage_create(&o, &st), DFLASH_E_CONFIG, "5 MiB");
  dflash_storage_options_default(&o);
  o.endpoint_url = "ftp://x";
  ck_assert_status(dflash_storage_create(&o, &st), DFLASH_E_CONFIG, "ftp://x");
  dflash_storage_options_default(&o);
  o.struct_size = 3;
  ck_assert_status(dflash_storage_create(&o, &st), DFLASH_E_INVALID_ARG, "struct_size");
  setenv("DFLASH_S3_ADDRESSING", "sideways", 1);
  ck_assert_status(dflash_storage_create(NULL, &st), DFLASH_E_CONFIG, "sideways");
  setenv("DFLASH_S3_ADDRESSING", "", 1);
  /* default: virtual-hosted for AWS, path-style with a custom endpoint */
  setenv("AWS_ENDPOINT_URL", "", 1);
  setenv("AWS_ENDPOINT_URL_S3", "", 1);
  setenv("AWS_REGION", "eu-west-3", 1);
  ck_assert_ok(dflash_storage_create(NULL, &st));
  ck_assert_int_eq(st->cfg.addressing, DFLASH_S3_ADDRESSING_VIRTUAL);
  ck_assert_str_eq(st->cfg.endpoint, "https://s3.eu-west-3.amazonaws.com");
  dflash_storage_free(st);
  setenv("AWS_ENDPOINT_URL", "http://minio.local:9000/", 1);
  ck_assert_ok(dflash_storage_create(NULL, &st));
  ck_assert_int_eq(st->cfg.addressing, DFLASH_S3_ADDRESSING_PATH);
  ck_assert_str_eq(st->cfg.endpoint, "http://minio.local:9000");
  dflash_storage_free(st);
}
END_TEST

START_TEST(missing_credentials_fail_before_connecting) {
  unsetenv("AWS_ACCESS_KEY_ID");
  unsetenv("AWS_SECRET_ACCESS_KEY");
  unsetenv("AWS_PROFILE");
  setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials", 1); /* not this machine's */
  setenv("AWS_CONFIG_FILE", "/nonexistent/config", 1);
  setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9", 1);
  dflash_storage *st = client();
  void *data;
  size_t len;
  ck_assert_status(dflash_storage_read(st, "s3://bkt/some/key", &data, &len), DFLASH_E_AUTH,
                   "s3://bkt/some/key");
  ck_assert_msg(strstr(dflash_last_error(), "AWS_ACCESS_KEY_ID"), "%s", dflash_last_error());
  ck_assert_int_eq(st->n_requests, 0);
  dflash_storage_free(st);
}
END_TEST

static char *join(const char *dir, const char *name) { return df_path_join(dir, name); }

/* Two locations hold the same bytes. */
void expect_same_bytes(dflash_storage *st, const char *a, const char *b);
void expect_same_bytes(dflash_storage *st, const char *a, const char *b) {
  void *x, *y;
  size_t nx, ny;
  ck_assert_ok(dflash_storage_read(st, a, &x, &nx));
  ck_assert_ok(dflash_storage_read(st, b, &y, &ny));
  ck_assert_msg(nx == ny && !memcmp(x, y, nx), "%s and %s differ", a, b);
  dflash_storage_buffer_free(x);
  dflash_storage_buffer_free(y);
}

START_TEST(local_read_write_stat_list_delete) {
  char *dir = df_test_tmpdir();
  dflash_storage *st = client();
  char *a = join(dir, "run/a/one.jsonl"), *b = join(dir, "run/b/two.jsonl");
  char *c = join(dir, "run/b2.txt"), *other = join(dir, "runner.txt");
  ck_assert_ok(dflash_storage_write(st, a, "hello\n", 6));
  ck_assert_ok(dflash_storage_write(st, b, "0123456789", 10));
  ck_assert_ok(dflash_storage_write(st, c, "", 0));
  ck_assert_ok(dflash_storage_write(st, other, "x", 1));
  char *tmp = join(dir, "run/b/two.jsonl.tmp.1234"); /* an unfinished atomic write */
  ck_assert(df_test_write(tmp, "junk", 4));

  void *data;
  size_t len;
  ck_assert_ok(dflash_storage_read(st, a, &data, &len));
  ck_assert_uint_eq(len, 6);
  ck_assert_str_eq(data, "hello\n");
  dflash_storage_buffer_free(data);
  char buf[16];
  size_t got;
  ck_assert_ok(dflash_storage_read_range(st, b, 3, buf, 4, &got));
  ck_assert_uint_eq(got, 4);
  ck_assert(!memcmp(buf, "3456", 4));
  ck_assert_ok(dflash_storage_read_range(st, b, 8, buf, 16, &got));
  ck_assert_uint_eq(got, 2);
  ck_assert_ok(dflash_storage_read_range(st, b, 50, buf, 16, &got));
  ck_assert_uint_eq(got, 0);
  dflash_storage_info info = {.struct_size = sizeof info};
  ck_assert_ok(dflash_storage_stat(st, b, &info));
  ck_assert_uint_eq(info.size, 10);
  ck_assert(info.mtime > 0);

  char *prefix = join(dir, "run/");
  dflash_storage_listing *l;
  ck_assert_ok(dflash_storage_list(st, prefix, &l));
  ck_assert_uint_eq(dflash_storage_listing_count(l), 3);
  const char *loc;
  uint64_t size;
  ck_assert_ok(dflash_storage_listing_get(l, 0, &loc, &size));
  ck_assert_str_eq(loc, a);
  ck_assert_ok(dflash_storage_listing_get(l, 1, &loc, &size));
  ck_assert_str_eq(loc, b);
  ck_assert_uint_eq(size, 10);
  ck_assert_ok(dflash_storage_listing_get(l, 2, &loc, &size));
  ck_assert_str_eq(loc, c);
  ck_assert_status(dflash_storage_listing_get(l, 3, &loc, &size), DFLASH_E_RANGE, "3");
  dflash_storage_listing_free(l);
  /* a plain string prefix, as S3 has it: "run/b" matches b/two.jsonl and b2.txt */
  char *pb = join(dir, "run/b");
  ck_assert_ok(dflash_storage_list(st, pb, &l));
  ck_assert_uint_eq(dflash_storage_listing_count(l), 2);
  dflash_storage_listing_free(l);
  char *none = join(dir, "nothing/here/");
  ck_assert_ok(dflash_storage_list(st, none, &l));
  ck_assert_uint_eq(dflash_storage_listing_count(l), 0);
  dflash_storage_listing_free(l);

  ck_assert_ok(dflash_storage_delete(st, b));
  ck_assert_ok(dflash_storage_delete(st, b)); /* absent: still fine */
  ck_assert_status(dflash_storage_stat(st, b, &info), DFLASH_E_NOT_FOUND, b);
  ck_assert_status(dflash_storage_read(st, b, &data, &len), DFLASH_E_NOT_FOUND, b);
  char *pieces[] = {a, b, c, other, tmp, prefix, pb, none};
  for (size_t i = 0; i < DF_ARRAY_LEN(pieces); i++) free(pieces[i]);
  dflash_storage_free(st);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(local_writer_streams_and_abandons_cleanly) {
  char *dir = df_test_tmpdir();
  dflash_storage *st = client();
  char *path = join(dir, "ckpt/model.bin");
  dflash_storage_writer *w;
  ck_assert_ok(dflash_storage_writer_open(st, path, &w));
  for (int i = 0; i < 100; i++) ck_assert_ok(dflash_storage_writer_write(w, "0123456789", 10));
  dflash_storage_info info = {.struct_size = sizeof info};
  ck_assert_status(dflash_storage_stat(st, path, &info), DFLASH_E_NOT_FOUND, path);
  ck_assert_ok(dflash_storage_writer_commit(w));
  ck_assert_status(dflash_storage_writer_write(w, "x", 1), DFLASH_E_STATE, "committed");
  dflash_storage_writer_free(w);
  ck_assert_ok(dflash_storage_stat(st, path, &info));
  ck_assert_uint_eq(info.size, 1000);
  char *other = join(dir, "ckpt/abandoned.bin");
  ck_assert_ok(dflash_storage_writer_open(st, other, &w));
  ck_assert_ok(dflash_storage_writer_write(w, "abc", 3));
  dflash_storage_writer_free(w);
  char *prefix = join(dir, "ckpt/");
  dflash_storage_listing *l;
  ck_assert_ok(dflash_storage_list(st, prefix, &l));
  ck_assert_uint_eq(dflash_storage_listing_count(l), 1); /* no temporary file left */
  dflash_storage_listing_free(l);
  char *copy = join(dir, "copy/model.bin");
  ck_assert_ok(dflash_storage_copy(st, path, copy));
  expect_same_bytes(st, path, copy);
  free(copy);
  free(prefix);
  free(other);
  free(path);
  dflash_storage_free(st);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* Read every chunk under `prefix` and check it holds records 0..n-1 once each, in order. */
void check_chunks(dflash_storage *st, const char *prefix, size_t n_chunks, int n_records);
void check_chunks(dflash_storage *st, const char *prefix, size_t n_chunks, int n_records) {
  dflash_storage_listing *l;
  ck_assert_ok(dflash_storage_list(st, prefix, &l));
  ck_assert_uint_eq(dflash_storage_listing_count(l), n_chunks);
  int next = 0;
  for (size_t i = 0; i < n_chunks; i++) {
    const char *loc;
    ck_assert_ok(dflash_storage_listing_get(l, i, &loc, NULL));
    char suffix[32];
    snprintf(suffix, sizeof suffix, "-%08zu.jsonl", i);
    ck_assert_msg(df_str_ends_with(loc, suffix), "%s lacks %s", loc, suffix);
    void *data;
    size_t len;
    ck_assert_ok(dflash_storage_read(st, loc, &data, &len));
    for (char *line = data; line < (char *)data + len;) {
      char want[64];
      int k = snprintf(want, sizeof want, "{\"id\": %d}\n", next++);
      ck_assert_msg(!strncmp(line, want, (size_t)k), "%s: record %d: got %.20s", loc, next - 1,
                    line);
      line += k;
    }
    dflash_storage_buffer_free(data);
  }
  ck_assert_int_eq(next, n_records);
  dflash_storage_listing_free(l);
}

void append_records(dflash_chunk_writer *w, int from, int to);
void append_records(dflash_chunk_writer *w, int from, int to) {
  for (int i = from; i < to; i++) {
    char rec[64];
    int k = snprintf(rec, sizeof rec, "{\"id\": %d}", i);
    ck_assert_ok(dflash_chunk_writer_add(w, rec, (size_t)k));
  }
}

START_TEST(chunk_writer_local_closes_by_count_and_age_and_resumes) {
  char *dir = df_test_tmpdir();
  dflash_storage *st = client();
  char *prefix = join(dir, "completions/");
  dflash_chunk_writer_options o;
  dflash_chunk_writer_options_default(&o);
  o.max_records = 10;
  o.max_seconds = 0;
  dflash_chunk_writer *w;
  ck_assert_ok(dflash_chunk_writer_open(st, prefix, "w0", &o, &w));
  ck_assert_uint_eq(dflash_chunk_writer_next_seq(w), 0);
  append_records(w, 0, 25);
  ck_assert_uint_eq(dflash_chunk_writer_next_seq(w), 2);
  ck_assert_status(dflash_chunk_writer_add(w, "a\nb", 3), DFLASH_E_FORMAT, "newline");
  ck_assert_ok(dflash_chunk_writer_commit(w));
  ck_assert_ok(dflash_chunk_writer_commit(w)); /* again: nothing more to do */
  ck_assert_status(dflash_chunk_writer_add(w, "{}", 2), DFLASH_E_STATE, "committed");
  dflash_chunk_writer_free(w);
  check_chunks(st, prefix, 3, 25);
  /* a restarted worker continues after the last chunk, never overwriting it */
  o.max_seconds = 0.05;
  ck_assert_ok(dflash_chunk_writer_open(st, prefix, "w0", &o, &w));
  ck_assert_uint_eq(dflash_chunk_writer_next_seq(w), 3);
  ck_assert(df_str_ends_with(dflash_chunk_writer_last_chunk(w), "w0-00000002.jsonl"));
  append_records(w, 25, 27);
  usleep(120 * 1000);
  ck_assert_ok(dflash_chunk_writer_poll(w)); /* older than max_seconds: closed */
  ck_assert_uint_eq(dflash_chunk_writer_next_seq(w), 4);
  dflash_chunk_writer_free(w);
  check_chunks(st, prefix, 4, 27);
  ck_assert_status(dflash_chunk_writer_open(st, prefix, "a/b", NULL, &w), DFLASH_E_INVALID_ARG,
                   "a/b");
  free(prefix);
  dflash_storage_free(st);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* A safetensors file with `n` F32 tensors t000.. of `elems` elements each. */
char *make_safetensors(const char *dir, int n, int elems);
char *make_safetensors(const char *dir, int n, int elems) {
  char *path = df_path_join(dir, "model.safetensors");
  dflash_safetensors_writer *w;
  ck_assert_ok(dflash_safetensors_writer_create(path, &w));
  ck_assert_ok(dflash_safetensors_writer_metadata(w, "format", "pt"));
  for (int i = 0; i < n; i++) {
    char name[32];
    snprintf(name, sizeof name, "t%03d", i);
    int64_t shape[1] = {elems};
    ck_assert_ok(dflash_safetensors_writer_declare(w, name, DFLASH_DTYPE_F32, 1, shape));
  }
  for (int i = 0; i < n; i++)
    for (int j = 0; j < elems; j++) {
      float v = (float)i * 1000.0f + (float)j;
      ck_assert_ok(dflash_safetensors_writer_write(w, &v, sizeof v));
    }
  ck_assert_ok(dflash_safetensors_writer_commit(w));
  dflash_safetensors_writer_free(w);
  return path;
}

/* Every tensor read through `location` equals the mmap'd local copy. */
void check_remote_st(dflash_storage *st, const char *location, const char *local, uint64_t ra);
void check_remote_st(dflash_storage *st, const char *location, const char *local, uint64_t ra) {
  dflash_safetensors *ref;
  ck_assert_ok(dflash_safetensors_open(local, &ref));
  dflash_storage_safetensors *f;
  ck_assert_ok(dflash_storage_safetensors_open(st, location, ra, &f));
  ck_assert_uint_eq(dflash_storage_safetensors_count(f), dflash_safetensors_count(ref));
  const char *v;
  ck_assert_ok(dflash_storage_safetensors_metadata_find(f, "format", &v));
  ck_assert_str_eq(v, "pt");
  for (size_t i = 0; i < dflash_storage_safetensors_count(f); i++) {
    dflash_tensor t = {.struct_size = sizeof t}, r = {.struct_size = sizeof r};
    ck_assert_ok(dflash_storage_safetensors_get(f, i, &t));
    ck_assert_ok(dflash_safetensors_get(ref, i, &r));
    ck_assert_str_eq(t.name, r.name);
    ck_assert_uint_eq(t.nbytes, r.nbytes);
    ck_assert_ptr_null(t.data);
    void *buf = malloc(t.nbytes + 1);
    uint64_t need = 0;
    ck_assert_ok(dflash_storage_safetensors_read(f, t.name, buf, t.nbytes, &need));
    ck_assert_uint_eq(need, t.nbytes);
    ck_assert_msg(!memcmp(buf, r.data, t.nbytes), "tensor %s differs", t.name);
    if (t.nbytes)
      ck_assert_status(dflash_storage_safetensors_read(f, t.name, buf, t.nbytes - 1, &need),
                       DFLASH_E_BUFFER, t.name);
    free(buf);
  }
  dflash_tensor t = {.struct_size = sizeof t};
  ck_assert_status(dflash_storage_safetensors_find(f, "nope", &t), DFLASH_E_NOT_FOUND, location);
  dflash_storage_safetensors_free(f);
  dflash_safetensors_free(ref);
}

/* A whole object into a reused buffer (df_stage_read_object, df_stage_st_load: the spool
 * consumer's read): the views equal the mmap'd local copy, in file order; a second object that
 * fits reuses the buffer (same address); a size other than the object's is refused, naming it. */
void check_stage_st(dflash_storage *st, const char *location, const char *local);
void check_stage_st(dflash_storage *st, const char *location, const char *local) {
  dflash_safetensors *ref;
  ck_assert_ok(dflash_safetensors_open(local, &ref));
  dflash_storage_info info = {.struct_size = sizeof info};
  ck_assert_ok(dflash_storage_stat(st, location, &info));
  df_stage_buf b = {0};
  const uint8_t *first = NULL;
  for (int round = 0; round < 2; round++) {
    df_stage_st *f = NULL;
    ck_assert_ok(df_stage_st_load(st, location, info.size, &b, &f));
    ck_assert_uint_eq(df_stage_st_count(f), dflash_safetensors_count(ref));
    const char *v;
    ck_assert_ok(df_stage_st_metadata_find(f, "format", &v));
    ck_assert_str_eq(v, "pt");
    ck_assert_int_eq(df_stage_st_metadata_find(f, "nope", &v), DFLASH_E_NOT_FOUND);
    const uint8_t *prev = NULL;
    for (size_t i = 0; i < df_stage_st_count(f); i++) {
      dflash_tensor t = {.struct_size = sizeof t}, r = {.struct_size = sizeof r};
      ck_assert_ok(df_stage_st_get(f, i, &t));
      ck_assert_ok(dflash_safetensors_find(ref, t.name, &r));
      ck_assert_uint_eq(t.nbytes, r.nbytes);
      ck_assert_msg(!memcmp(t.data, r.data, t.nbytes), "tensor %s differs", t.name);
      ck_assert_msg(!prev || (const uint8_t *)t.data > prev, "not in file order at %s", t.name);
      prev = t.data;
      dflash_tensor u = {.struct_size = sizeof u};
      ck_assert_ok(df_stage_st_find(f, t.name, &u));
      ck_assert_ptr_eq(u.data, t.data);
    }
    dflash_tensor t = {.struct_size = sizeof t};
    ck_assert_int_eq(df_stage_st_find(f, "nope", &t), DFLASH_E_NOT_FOUND);
    ck_assert_uint_eq(df_stage_st_count(f), 40);
    df_stage_st_free(f);
    if (dflash_storage_is_remote(location)) { /* local objects are mapped, not read */
      ck_assert_uint_eq(b.len, info.size);
      if (round) ck_assert_ptr_eq(b.data, first);
      first = b.data;
    }
  }
  /* The size from an older listing: shorter or longer than the object now. */
  ck_assert_status(df_stage_read_object(st, location, info.size + 1, &b), DFLASH_E_TRUNCATED,
                   location);
  ck_assert_status(df_stage_read_object(st, location, info.size - 1, &b), DFLASH_E_MISMATCH,
                   location);
  size_t cap = b.cap;
  ck_assert_ok(df_stage_read_object(st, location, info.size, &b));
  ck_assert_uint_eq(b.cap, cap);
  ck_assert_uint_eq(b.len, info.size);
  df_stage_st *g = NULL; /* the bytes read ahead, parsed later (the spool's next shard) */
  ck_assert_ok(df_stage_st_parse(location, &b, &g));
  ck_assert_uint_eq(df_stage_st_count(g), dflash_safetensors_count(ref));
  dflash_tensor t0 = {.struct_size = sizeof t0}, r0 = {.struct_size = sizeof r0};
  ck_assert_ok(df_stage_st_get(g, 0, &t0));
  ck_assert_ok(dflash_safetensors_find(ref, t0.name, &r0));
  ck_assert(!memcmp(t0.data, r0.data, r0.nbytes) && (const uint8_t *)t0.data > b.data);
  df_stage_st_free(g);
  char *missing = df_asprintf("%s.missing", location);
  ck_assert_int_eq(df_stage_read_object(st, missing, 10, &b), DFLASH_E_NOT_FOUND);
  free(missing);
  df_stage_buf_free(&b);
  dflash_safetensors_free(ref);
}

START_TEST(safetensors_on_demand_from_local_files) {
  char *dir = df_test_tmpdir();
  dflash_storage *st = client();
  char *path = make_safetensors(dir, 40, 300); /* header ~3 KB, tensors 1200 B */
  check_remote_st(st, path, path, 4096);       /* window smaller than header + data */
  check_remote_st(st, path, path, 0);          /* default window holds it all */
  check_stage_st(st, path, path);
  char *bad = join(dir, "records.jsonl");
  ck_assert(df_test_write(bad, "{\"id\": 1}\n{\"id\": 2}\n", 20));
  dflash_storage_safetensors *f = (void *)1;
  dflash_status s = dflash_storage_safetensors_open(st, bad, 0, &f);
  ck_assert_msg(s == DFLASH_E_TRUNCATED || s == DFLASH_E_FORMAT, "%s", dflash_status_str(s));
  ck_assert_msg(strstr(dflash_last_error(), bad), "%s", dflash_last_error());
  ck_assert_ptr_null(f);
  free(bad);
  free(path);
  dflash_storage_free(st);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

TCase *tc_storage_local(void);
TCase *tc_storage_local(void) {
  TCase *tc = tcase_create("local");
  tcase_add_test(tc, sha256_matches_fips_180_vectors);
  tcase_add_test(tc, uri_encoding_follows_sigv4);
  tcase_add_test(tc, locations_parse_and_reject);
  tcase_add_test(tc, xml_fields_decode_entities);
  tcase_add_test(tc, backoff_is_full_jitter_capped_and_honours_retry_after);
  tcase_add_test(tc, options_times_are_seconds);
  tcase_add_test(tc, options_validate_addressing_region_and_part_size);
  tcase_add_test(tc, missing_credentials_fail_before_connecting);
  tcase_add_test(tc, local_read_write_stat_list_delete);
  tcase_add_test(tc, local_writer_streams_and_abandons_cleanly);
  tcase_add_test(tc, chunk_writer_local_closes_by_count_and_age_and_resumes);
  tcase_add_test(tc, safetensors_on_demand_from_local_files);
  return tc;
}
