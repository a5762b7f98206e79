/* Storage against a real S3-compatible server: moto with IAM signature
 * checking, behind a proxy that injects faults (tests/storage/s3env.py starts
 * both and exports DFLASH_TEST_S3_*). Without that environment every test
 * here returns at once with a note; meson runs them through s3env.py. */
#include <curl/curl.h>
#include <dflash/storage.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "storage/storage_internal.h"
#include "testutil.h"

void check_chunks(dflash_storage *st, const char *prefix, size_t n_chunks, int n_records);
void expect_same_bytes(dflash_storage *st, const char *a, const char *b);
void append_records(dflash_chunk_writer *w, int from, int to);
char *make_safetensors(const char *dir, int n, int elems);
void check_remote_st(dflash_storage *st, const char *location, const char *local, uint64_t ra);
void check_stage_st(dflash_storage *st, const char *location, const char *local);

static const char *bucket(void) {
  const char *b = getenv("DFLASH_TEST_S3_BUCKET");
  if (!b || !*b) {
    fprintf(stderr, "note: DFLASH_TEST_S3_BUCKET unset: S3 test skipped (run via s3env.py)\n");
    return NULL;
  }
  return b;
}

static size_t collect(char *data, size_t size, size_t n, void *user) {
  return df_buf_append(user, data, size * n) ? 0 : size * n;
}

/* Set the proxy's fault plan and return the counters of the plan it replaces
 * (the counters restart at zero); plan NULL: the current counters. */
static json_t *faults(const char *plan) {
  CURL *c = curl_easy_init();
  df_buf out = {0};
  curl_easy_setopt(c, CURLOPT_URL, getenv("DFLASH_TEST_S3_FAULTS"));
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, collect);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &out);
  if (plan) {
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, "PUT");
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, plan);
  }
  ck_assert_int_eq(curl_easy_perform(c), CURLE_OK);
  curl_easy_cleanup(c);
  json_t *j = json_loadb(out.data, out.len, 0, NULL);
  ck_assert_ptr_nonnull(j);
  df_buf_free(&out);
  return j;
}

static long counter(json_t *stats, const char *kind) {
  json_t *inj = json_object_get(stats, "injected");
  return kind ? (long)json_integer_value(json_object_get(inj, kind))
              : (long)json_integer_value(json_object_get(stats, "requests"));
}

static dflash_storage *s3_client_with(dflash_storage_options *o) {
  o->backoff_base_s = 0.005;
  o->backoff_max_s = 0.05;
  dflash_storage *st = NULL;
  ck_assert_ok(dflash_storage_create(o, &st));
  return st;
}

static dflash_storage *s3_client(void) {
  dflash_storage_options o;
  dflash_storage_options_default(&o);
  return s3_client_with(&o);
}

static char *url(const char *key) { return df_asprintf("s3://%s/%s", bucket(), key); }

static void fill(char *buf, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) buf[i] = (char)((i * 2654435761u + seed) >> 13);
}

static void expect_object(dflash_storage *st, const char *loc, const char *want, size_t n) {
  void *data;
  size_t len;
  ck_assert_ok(dflash_storage_read(st, loc, &data, &len));
  ck_assert_uint_eq(len, n);
  ck_assert_msg(!memcmp(data, want, n), "%s: content differs", loc);
  dflash_storage_buffer_free(data);
}

START_TEST(roundtrip_stat_range_list_delete) {
  if (!bucket()) return;
  json_decref(faults("{}"));
  dflash_storage *st = s3_client();
  char *a = url("rt/a b=c+\xc3\xbc.bin"); /* bytes that need encoding in path and query */
  char data[3000];
  fill(data, sizeof data, 1);
  ck_assert_ok(dflash_storage_write(st, a, data, sizeof data));
  expect_object(st, a, data, sizeof data);
  dflash_storage_info info = {.struct_size = sizeof info};
  ck_assert_ok(dflash_storage_stat(st, a, &info));
  ck_assert_uint_eq(info.size, sizeof data);
  ck_assert(info.mtime > 0);
  char buf[100];
  size_t got;
  ck_assert_ok(dflash_storage_read_range(st, a, 2990, buf, 100, &got));
  ck_assert_uint_eq(got, 10);
  ck_assert(!memcmp(buf, data + 2990, 10));
  ck_assert_ok(dflash_storage_read_range(st, a, 5000, buf, 100, &got));
  ck_assert_uint_eq(got, 0);
  char *empty = url("rt/empty");
  ck_assert_ok(dflash_storage_write(st, empty, "", 0));
  expect_object(st, empty, "", 0);

  /* more keys than one listing page holds */
  st->list_page_size = 3;
  for (int i = 0; i < 7; i++) {
    char key[64];
    snprintf(key, sizeof key, "rt/many/k%d", i);
    char *loc = url(key);
    ck_assert_ok(dflash_storage_write(st, loc, key, strlen(key)));
    free(loc);
  }
  char *prefix = url("rt/many/");
  dflash_storage_listing *l;
  ck_assert_ok(dflash_storage_list(st, prefix, &l));
  ck_assert_uint_eq(dflash_storage_listing_count(l), 7);
  const char *loc;
  uint64_t size;
  ck_assert_ok(dflash_storage_listing_get(l, 6, &loc, &size));
  char *want = url("rt/many/k6");
  ck_assert_str_eq(loc, want);
  ck_assert_uint_eq(size, 10);
  dflash_storage_listing_free(l);
  char *all = url("rt/");
  ck_assert_ok(dflash_storage_list(st, all, &l));
  ck_assert_uint_eq(dflash_storage_listing_count(l), 9);
  ck_assert_ok(dflash_storage_listing_get(l, 0, &loc, &size));
  ck_assert_str_eq(loc, a);
  dflash_storage_listing_free(l);

  ck_assert_ok(dflash_storage_delete(st, a));
  ck_assert_ok(dflash_storage_delete(st, a));
  ck_assert_status(dflash_storage_stat(st, a, &info), DFLASH_E_NOT_FOUND, a);
  void *d;
  size_t n;
  ck_assert_status(dflash_storage_read(st, a, &d, &n), DFLASH_E_NOT_FOUND, "NoSuchKey");
  ck_assert_msg(strstr(dflash_last_error(), a), "%s", dflash_last_error());
  free(want);
  free(all);
  free(prefix);
  free(empty);
  free(a);
  dflash_storage_free(st);
}
END_TEST

START_TEST(multipart_three_parts_byte_exact_with_part_retries) {
  if (!bucket()) return;
  dflash_storage *st = s3_client();
  size_t n = (size_t)(12u << 20) + 12345; /* 5 + 5 + 2 MiB parts */
  char *data = malloc(n);
  fill(data, n, 7);
  /* parts: one reset mid-body, one 503; the completion's answer is lost once */
  json_decref(faults("{\"script\": [\"pass\", \"reset\", \"503\"], \"methods\": [\"PUT\"], "
                     "\"match\": \"uploadId\"}"));
  st->cfg.part_size = 5u << 20;
  st->cfg.multipart_threshold = 5u << 20;
  char *loc = url("mp/big.bin");
  ck_assert_ok(dflash_storage_write(st, loc, data, n));
  json_t *stats = faults(
      "{\"script\": [\"lost\"], \"methods\": [\"POST\"], \"match\": \"uploadId\"}");
  ck_assert_int_eq(counter(stats, "reset"), 1);
  ck_assert_int_eq(counter(stats, "503"), 1);
  json_decref(stats);
  expect_object(st, loc, data, n);

  /* the streaming writer, odd write sizes, answer of CompleteMultipartUpload lost */
  char *loc2 = url("mp/streamed.bin");
  dflash_storage_writer *w;
  ck_assert_ok(dflash_storage_writer_open(st, loc2, &w));
  for (size_t off = 0; off < n;) {
    size_t k = n - off < 999983 ? n - off : 999983;
    ck_assert_ok(dflash_storage_writer_write(w, data + off, k));
    off += k;
  }
  ck_assert_ok(dflash_storage_writer_commit(w));
  dflash_storage_writer_free(w);
  stats = faults("{}");
  ck_assert_int_eq(counter(stats, "lost"), 1);
  json_decref(stats);
  expect_object(st, loc2, data, n);
  dflash_storage_info info = {.struct_size = sizeof info};
  ck_assert_ok(dflash_storage_stat(st, loc2, &info));
  ck_assert_uint_eq(info.size, n);
  free(loc2);
  free(loc);
  free(data);
  dflash_storage_free(st);
}
END_TEST

/* The multipart uploads in progress in the bucket (ListMultipartUploads). */
static size_t open_uploads(dflash_storage *st) {
  df_loc b = {.s3 = true, .bucket = (char *)bucket(), .key = "", .text = "uploads"};
  df_s3_req req = {.method = "GET", .loc = &b, .query = "uploads="};
  df_s3_resp resp = {0};
  ck_assert_ok(df_s3_request(st, &req, &resp));
  size_t n = 0, pos = 0;
  char *u;
  while ((u = df_xml_next(resp.body.data, resp.body.len, "Upload", &pos))) {
    free(u);
    n++;
  }
  df_s3_resp_free(&resp);
  return n;
}

START_TEST(failed_multipart_is_aborted) {
  if (!bucket()) return;
  json_decref(faults("{}"));
  dflash_storage *st = s3_client();
  st->cfg.part_size = 5u << 20;
  size_t n = (size_t)(6u << 20);
  char *data = calloc(1, n);
  ck_assert_uint_eq(open_uploads(st), 0);
  /* every part upload is refused: not retried, and the upload is aborted */
  json_decref(faults(
      "{\"rate\": 1, \"kinds\": [\"403\"], \"methods\": [\"PUT\"], \"match\": \"partNumber\"}"));
  char *loc = url("mp/refused.bin");
  dflash_storage_writer *w;
  ck_assert_ok(dflash_storage_writer_open(st, loc, &w));
  ck_assert_status(dflash_storage_writer_write(w, data, n), DFLASH_E_AUTH, "AccessDenied");
  ck_assert_msg(strstr(dflash_last_error(), loc), "%s", dflash_last_error());
  ck_assert_status(dflash_storage_writer_commit(w), DFLASH_E_STATE, "failed");
  dflash_storage_writer_free(w);
  json_t *stats = faults("{}");
  ck_assert_int_eq(counter(stats, "403"), 1); /* 403 is final: no retry */
  json_decref(stats);
  ck_assert_uint_eq(open_uploads(st), 0);
  dflash_storage_info info = {.struct_size = sizeof info};
  ck_assert_status(dflash_storage_stat(st, loc, &info), DFLASH_E_NOT_FOUND, loc);
  free(loc);
  free(data);
  dflash_storage_free(st);
}
END_TEST

START_TEST(random_5xx_resets_and_delays_are_retried) {
  if (!bucket()) return;
  dflash_storage *st = s3_client();
  json_decref(faults("{\"rate\": 0.35, \"seed\": 7, \"kinds\": [\"500\", \"503\", \"reset\", "
                     "\"lost\", \"delay\"], \"delay_s\": 0.2}"));
  char data[20][700];
  for (int i = 0; i < 20; i++) {
    fill(data[i], sizeof data[i], (unsigned)i);
    char key[32];
    snprintf(key, sizeof key, "flaky/%02d", i);
    char *loc = url(key);
    ck_assert_ok(dflash_storage_write(st, loc, data[i], sizeof data[i]));
    free(loc);
  }
  for (int i = 0; i < 20; i++) {
    char key[32];
    snprintf(key, sizeof key, "flaky/%02d", i);
    char *loc = url(key);
    expect_object(st, loc, data[i], sizeof data[i]);
    free(loc);
  }
  char *prefix = url("flaky/");
  dflash_storage_listing *l;
  ck_assert_ok(dflash_storage_list(st, prefix, &l));
  ck_assert_uint_eq(dflash_storage_listing_count(l), 20);
  dflash_storage_listing_free(l);
  json_t *stats = faults("{}");
  long injected = counter(stats, "500") + counter(stats, "503") + counter(stats, "reset") +
                  counter(stats, "lost");
  ck_assert_msg(injected >= 5, "only %ld faults injected", injected);
  /* every error answer costs one of our retries (a dropped connection may be
   * retried by libcurl itself first, when it was a reused one) */
  long answers = counter(stats, "500") + counter(stats, "503");
  ck_assert_msg(st->n_retries >= (uint64_t)answers, "%llu retries for %ld error answers",
                (unsigned long long)st->n_retries, answers);
  json_decref(stats);
  free(prefix);
  dflash_storage_free(st);
}
END_TEST

START_TEST(stalled_answer_times_out_then_succeeds) {
  if (!bucket()) return;
  json_decref(faults("{}"));
  dflash_storage_options o;
  dflash_storage_options_default(&o);
  o.request_timeout_s = 0.7;
  dflash_storage *st = s3_client_with(&o);
  char *loc = url("slow/x");
  ck_assert_ok(dflash_storage_write(st, loc, "payload", 7));
  json_decref(faults("{\"script\": [\"delay\"], \"delay_s\": 2.0, \"methods\": [\"GET\"]}"));
  uint64_t before = st->n_retries;
  expect_object(st, loc, "payload", 7);
  ck_assert_uint_eq(st->n_retries, before + 1);
  /* out of attempts: a timeout status naming the URL */
  st->cfg.max_attempts = 2;
  json_decref(
      faults("{\"script\": [\"delay\", \"delay\"], \"delay_s\": 1.5, \"methods\": [\"GET\"]}"));
  void *d;
  size_t n;
  ck_assert_status(dflash_storage_read(st, loc, &d, &n), DFLASH_E_TIMEOUT, loc);
  json_decref(faults("{}"));
  free(loc);
  dflash_storage_free(st);
}
END_TEST

START_TEST(chunk_writer_never_duplicates_records_across_retries) {
  if (!bucket()) return;
  json_decref(faults("{}"));
  dflash_storage *st = s3_client();
  char *prefix = url("chunks/run1/");
  dflash_chunk_writer_options o;
  dflash_chunk_writer_options_default(&o);
  o.max_records = 7;
  dflash_chunk_writer *w;
  ck_assert_ok(dflash_chunk_writer_open(st, prefix, "w0", &o, &w));
  /* answers lost after the object was stored, 500s, a reset mid-body */
  json_decref(faults("{\"script\": [\"lost\", \"500\", \"pass\", \"reset\", \"lost\", \"lost\"], "
                     "\"methods\": [\"PUT\"]}"));
  append_records(w, 0, 41); /* chunks 0-4 stored, records 35-40 buffered */
  ck_assert_uint_eq(dflash_chunk_writer_next_seq(w), 5);
  /* an upload that fails for good keeps its records; the next attempt
   * stores them under the same name */
  st->cfg.max_attempts = 2;
  json_t *stats = faults("{\"script\": [\"503\", \"503\"], \"methods\": [\"PUT\"]}");
  ck_assert_int_eq(counter(stats, "lost"), 3);
  ck_assert_int_eq(counter(stats, "reset"), 1);
  ck_assert_int_eq(json_integer_value(json_object_get(stats, "pending_script")), 0);
  json_decref(stats);
  ck_assert_status(dflash_chunk_writer_add(w, "{\"id\": 41}", 10), DFLASH_E_HTTP, "SlowDown");
  ck_assert_msg(strstr(dflash_last_error(), "w0-00000005.jsonl"), "%s", dflash_last_error());
  ck_assert_uint_eq(dflash_chunk_writer_next_seq(w), 5);
  append_records(w, 42, 43);
  ck_assert_uint_eq(dflash_chunk_writer_next_seq(w), 6);
  append_records(w, 43, 50);
  ck_assert_uint_eq(dflash_chunk_writer_next_seq(w), 7);
  ck_assert_ok(dflash_chunk_writer_commit(w));
  dflash_chunk_writer_free(w);
  stats = faults("{}");
  ck_assert_int_eq(counter(stats, "503"), 2);
  json_decref(stats);
  check_chunks(st, prefix, 7, 50);
  /* resume: a new writer continues after chunk 6 */
  ck_assert_ok(dflash_chunk_writer_open(st, prefix, "w0", &o, &w));
  ck_assert_uint_eq(dflash_chunk_writer_next_seq(w), 7);
  dflash_chunk_writer_free(w);
  free(prefix);
  dflash_storage_free(st);
}
END_TEST

static char *g_log;
static void keep_log(dflash_log_level level, const char *msg, void *user) {
  (void)level;
  (void)user;
  char *prev = g_log;
  g_log = df_asprintf("%s%s\n", prev ? prev : "", msg);
  free(prev);
}

static void assert_hidden(const char *text, const char *secret, const char *token) {
  ck_assert_msg(!strstr(text, secret), "secret leaked into: %s", text);
  ck_assert_msg(!strstr(text, token), "token leaked into: %s", text);
}

START_TEST(errors_name_the_url_and_never_the_secret) {
  if (!bucket()) return;
  const char *key = getenv("DFLASH_TEST_S3_SESSION_KEY");
  const char *secret = getenv("DFLASH_TEST_S3_SESSION_SECRET");
  const char *token = getenv("DFLASH_TEST_S3_SESSION_TOKEN");
  json_decref(faults("{}"));
  dflash_set_log_callback(keep_log, NULL, DFLASH_LOG_DEBUG);
  dflash_storage_options o;
  dflash_storage_options_default(&o);
  o.access_key_id = key;
  o.secret_access_key = secret;
  o.session_token = token;
  o.trace = 1;
  dflash_storage *st = s3_client_with(&o);
  char *loc = url("sec/obj");
  ck_assert_ok(dflash_storage_write(st, loc, "x", 1)); /* temporary credentials work */
  expect_object(st, loc, "x", 1);
  void *d;
  size_t n;
  char *missing = url("sec/missing");
  ck_assert_status(dflash_storage_read(st, missing, &d, &n), DFLASH_E_NOT_FOUND, missing);
  assert_hidden(dflash_last_error(), secret, token);
  dflash_storage_free(st);

  /* wrong secret, wrong token, unknown key, a user without permission */
  char wrong[256];
  snprintf(wrong, sizeof wrong, "%sX", secret);
  o.secret_access_key = wrong;
  st = s3_client_with(&o);
  ck_assert_status(dflash_storage_read(st, loc, &d, &n), DFLASH_E_AUTH, "SignatureDoesNotMatch");
  ck_assert_msg(strstr(dflash_last_error(), loc), "%s", dflash_last_error());
  assert_hidden(dflash_last_error(), wrong, token);
  ck_assert_uint_eq(st->n_requests, 1); /* not retried */
  dflash_storage_free(st);
  o.secret_access_key = secret;
  o.session_token = "bogus-token";
  st = s3_client_with(&o);
  ck_assert_status(dflash_storage_read(st, loc, &d, &n), DFLASH_E_AUTH, loc);
  dflash_storage_free(st);
  o.session_token = NULL;
  o.access_key_id = "AKIAUNKNOWN000000000";
  st = s3_client_with(&o);
  ck_assert_status(dflash_storage_write(st, loc, "y", 1), DFLASH_E_AUTH, "InvalidAccessKeyId");
  dflash_storage_free(st);
  o.access_key_id = getenv("DFLASH_TEST_S3_DENY_KEY");
  o.secret_access_key = getenv("DFLASH_TEST_S3_DENY_SECRET");
  st = s3_client_with(&o);
  ck_assert_status(dflash_storage_read(st, loc, &d, &n), DFLASH_E_AUTH, "AccessDenied");
  ck_assert_msg(strstr(dflash_last_error(), loc), "%s", dflash_last_error());
  dflash_storage_free(st);
  dflash_set_log_callback(NULL, NULL, DFLASH_LOG_ERROR);

  ck_assert_ptr_nonnull(g_log);
  /* the trace did capture request headers, so the check below means something */
  ck_assert_msg(strstr(g_log, "x-amz-date") && strstr(g_log, "Signature=***") &&
                    strstr(g_log, "x-amz-security-token: ***"),
                "%.600s", g_log);
  assert_hidden(g_log, secret, token);
  ck_assert_msg(!strstr(g_log, wrong), "wrong secret in the log");
  free(g_log);
  g_log = NULL;
  free(missing);
  free(loc);
}
END_TEST

START_TEST(missing_bucket_and_injected_access_denied) {
  if (!bucket()) return;
  json_decref(faults("{}"));
  dflash_storage *st = s3_client();
  void *d;
  size_t n;
  ck_assert_status(dflash_storage_read(st, "s3://no-such-bucket-here/k", &d, &n),
                   DFLASH_E_NOT_FOUND, "NoSuchBucket");
  ck_assert_msg(strstr(dflash_last_error(), "s3://no-such-bucket-here/k"), "%s",
                dflash_last_error());
  dflash_storage_listing *l;
  ck_assert_status(dflash_storage_list(st, "s3://no-such-bucket-here/", &l), DFLASH_E_NOT_FOUND,
                   "NoSuchBucket");
  ck_assert_status(dflash_storage_write(st, "s3://no-such-bucket-here/k", "x", 1),
                   DFLASH_E_NOT_FOUND, "NoSuchBucket");
  json_decref(faults("{\"script\": [\"403\"]}"));
  char *loc = url("denied/x");
  ck_assert_status(dflash_storage_write(st, loc, "x", 1), DFLASH_E_AUTH, "AccessDenied");
  ck_assert_msg(strstr(dflash_last_error(), loc), "%s", dflash_last_error());
  free(loc);
  dflash_storage_free(st);
}
END_TEST

START_TEST(virtual_hosted_addressing) {
  if (!bucket()) return;
  json_decref(faults("{}"));
  /* curl resolves *.localhost to loopback, so bucket.localhost:PORT works */
  const char *ep = getenv("AWS_ENDPOINT_URL");
  const char *port = strrchr(ep, ':');
  char *local = df_asprintf("http://localhost%s", port);
  dflash_storage_options o;
  dflash_storage_options_default(&o);
  o.endpoint_url = local;
  o.addressing = DFLASH_S3_ADDRESSING_VIRTUAL;
  dflash_storage *st = s3_client_with(&o);
  char *loc = url("virt/a.txt");
  ck_assert_ok(dflash_storage_write(st, loc, "virtual", 7));
  json_t *stats = faults(NULL);
  char *host = df_asprintf("%s.localhost%s", bucket(), port);
  ck_assert_str_eq(json_string_value(json_object_get(stats, "last_host")), host);
  json_decref(stats);
  expect_object(st, loc, "virtual", 7);
  char *prefix = url("virt/");
  dflash_storage_listing *l;
  ck_assert_ok(dflash_storage_list(st, prefix, &l));
  ck_assert_uint_eq(dflash_storage_listing_count(l), 1);
  dflash_storage_listing_free(l);
  free(prefix);
  free(host);
  free(loc);
  dflash_storage_free(st);
  free(local);
}
END_TEST

START_TEST(safetensors_on_demand_over_s3_with_read_ahead) {
  if (!bucket()) return;
  json_decref(faults("{}"));
  char *dir = df_test_tmpdir();
  dflash_storage *st = s3_client();
  char *path = make_safetensors(dir, 40, 300);
  char *loc = url("st/model.safetensors");
  ck_assert_ok(dflash_storage_copy(st, path, loc));
  check_remote_st(st, loc, path, 4096);
  check_stage_st(st, loc, path); /* the whole object in memory, as the spool reads a shard */
  /* with the default window, the header and every tensor take 1 HEAD + 1 GET */
  json_t *s0 = faults(NULL);
  long before = counter(s0, NULL);
  json_decref(s0);
  dflash_storage_safetensors *f;
  ck_assert_ok(dflash_storage_safetensors_open(st, loc, 0, &f));
  char buf[1200];
  for (size_t i = 0; i < dflash_storage_safetensors_count(f); i++) {
    dflash_tensor t = {.struct_size = sizeof t};
    ck_assert_ok(dflash_storage_safetensors_get(f, i, &t));
    ck_assert_ok(dflash_storage_safetensors_read(f, t.name, buf, sizeof buf, NULL));
  }
  dflash_storage_safetensors_free(f);
  json_t *s1 = faults(NULL);
  ck_assert_int_eq(counter(s1, NULL) - before, 2);
  json_decref(s1);

  char *bad = url("st/records.jsonl");
  ck_assert_ok(dflash_storage_write(st, bad, "{\"id\": 1}\n{\"id\": 2}\n", 20));
  f = (void *)1;
  dflash_status s = dflash_storage_safetensors_open(st, bad, 0, &f);
  ck_assert_msg(s == DFLASH_E_TRUNCATED || s == DFLASH_E_FORMAT, "%s", dflash_status_str(s));
  ck_assert_msg(strstr(dflash_last_error(), bad), "%s", dflash_last_error());
  ck_assert_ptr_null(f);
  char *missing = url("st/none.safetensors");
  ck_assert_status(dflash_storage_safetensors_open(st, missing, 0, &f), DFLASH_E_NOT_FOUND,
                   missing);

  /* copy back down: byte-exact */
  char *back = df_path_join(dir, "back.safetensors");
  ck_assert_ok(dflash_storage_copy(st, loc, back));
  expect_same_bytes(st, path, back);
  free(back);
  free(missing);
  free(bad);
  free(loc);
  free(path);
  dflash_storage_free(st);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

TCase *tc_storage_s3(void);
TCase *tc_storage_s3(void) {
  TCase *tc = tcase_create("s3");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, roundtrip_stat_range_list_delete);
  tcase_add_test(tc, multipart_three_parts_byte_exact_with_part_retries);
  tcase_add_test(tc, failed_multipart_is_aborted);
  tcase_add_test(tc, random_5xx_resets_and_delays_are_retried);
  tcase_add_test(tc, stalled_answer_times_out_then_succeeds);
  tcase_add_test(tc, chunk_writer_never_duplicates_records_across_retries);
  tcase_add_test(tc, errors_name_the_url_and_never_the_secret);
  tcase_add_test(tc, missing_bucket_and_injected_access_denied);
  tcase_add_test(tc, virtual_hosted_addressing);
  tcase_add_test(tc, safetensors_on_demand_over_s3_with_read_ahead);
  return tc;
}
