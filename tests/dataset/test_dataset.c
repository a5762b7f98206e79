/* Dataset writer and reader: shard rollover, atomicity, random access,
 * iteration, histogram, tokenizer hash, and errors that name the bad file. */
#include <dflash/dataset.h>
#include <dflash/safetensors.h>
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/internal.h"
#include "testutil.h"

/* Sample i: 1 + (i * 37) % 50 tokens, ids i * 1000 + k, mask set on (i + k) % 3 == 0. */
static size_t sample_len(size_t i) { return 1 + (i * 37) % 50; }

static void make_sample(size_t i, int32_t *ids, uint8_t *mask, char *id, size_t id_cap) {
  for (size_t k = 0; k < sample_len(i); k++) {
    ids[k] = (int32_t)(i * 1000 + k);
    mask[k] = (i + k) % 3 == 0;
  }
  snprintf(id, id_cap, "sample-%zu", i);
}

static void add_samples(dflash_dataset_writer *w, size_t from, size_t to) {
  int32_t ids[64];
  uint8_t mask[64];
  char id[32];
  for (size_t i = from; i < to; i++) {
    make_sample(i, ids, mask, id, sizeof id);
    ck_assert_ok(dflash_dataset_writer_add(w, id, ids, mask, sample_len(i)));
  }
}

/* Write `n` samples into a fresh directory with shards of `shard_tokens`. */
static char *write_dataset(size_t n, uint64_t shard_tokens) {
  char *dir = df_test_tmpdir();
  dflash_dataset_writer_options o;
  dflash_dataset_writer_options_default(&o);
  o.shard_tokens = shard_tokens;
  o.tokenizer_hash = "sha256:00";
  o.template_name = "qwen3";
  o.options_json = "{\"reasoning\": \"official\"}";
  dflash_dataset_writer *w;
  ck_assert_ok(dflash_dataset_writer_create(dir, &o, &w));
  add_samples(w, 0, n);
  ck_assert_ok(dflash_dataset_writer_commit(w));
  dflash_dataset_writer_free(w);
  return dir;
}

static char *path_in(const char *dir, const char *name) {
  char *p = malloc(strlen(dir) + strlen(name) + 2);
  sprintf(p, "%s/%s", dir, name);
  return p;
}

static size_t count_files(const char *dir, const char *prefix) {
  DIR *d = opendir(dir);
  ck_assert_ptr_nonnull(d);
  size_t n = 0;
  for (struct dirent *e; (e = readdir(d));)
    if (!strncmp(e->d_name, prefix, strlen(prefix))) n++;
  closedir(d);
  return n;
}

static void check_sample(const dflash_dataset *ds, size_t i) {
  const int32_t *ids;
  const uint8_t *mask;
  const char *sid;
  size_t n;
  ck_assert_ok(dflash_dataset_sample(ds, i, &ids, &mask, &n, &sid));
  int32_t want_ids[64];
  uint8_t want_mask[64];
  char want_id[32];
  make_sample(i, want_ids, want_mask, want_id, sizeof want_id);
  ck_assert_uint_eq(n, sample_len(i));
  ck_assert_str_eq(sid, want_id);
  ck_assert_mem_eq(ids, want_ids, n * sizeof *ids);
  ck_assert_mem_eq(mask, want_mask, n);
}

START_TEST(test_rollover) {
  /* 300 samples of 1..50 tokens (7,650 in all) with shards of 1,000 tokens. */
  const uint64_t limit = 1000;
  char *dir = write_dataset(300, limit);
  dflash_dataset *ds;
  ck_assert_ok(dflash_dataset_open(dir, &ds));
  ck_assert_uint_eq(dflash_dataset_count(ds), 300);
  size_t shards = count_files(dir, "shard-");
  ck_assert_uint_ge(shards, 7);
  /* A shard closes with the sample that reaches the limit: every shard but
   * the last holds >= limit tokens, and fewer before its last sample. */
  size_t next = 0;
  uint64_t total = 0;
  for (size_t s = 0; s < shards; s++) {
    char name[64];
    snprintf(name, sizeof name, "shard-%05zu.safetensors", s);
    char *p = path_in(dir, name);
    dflash_safetensors *st;
    ck_assert_ok(dflash_safetensors_open(p, &st));
    dflash_tensor t = {.struct_size = sizeof t};
    ck_assert_ok(dflash_safetensors_find(st, "offsets", &t));
    ck_assert_uint_eq((uintptr_t)t.data % 8, 0); /* mapped tensors are aligned */
    dflash_tensor ti = {.struct_size = sizeof ti};
    ck_assert_ok(dflash_safetensors_find(st, "input_ids", &ti));
    ck_assert_uint_eq((uintptr_t)ti.data % 4, 0);
    size_t n_samples = (size_t)t.shape[0] - 1;
    const int64_t *off = t.data;
    uint64_t tokens = (uint64_t)off[n_samples];
    if (s + 1 < shards) {
      ck_assert_uint_ge(tokens, limit);
      ck_assert_uint_lt(tokens - sample_len(next + n_samples - 1), limit);
    } else {
      ck_assert_uint_lt(tokens, limit);
    }
    next += n_samples;
    total += tokens;
    dflash_safetensors_free(st);
    free(p);
  }
  ck_assert_uint_eq(next, 300);
  ck_assert_uint_eq(total, dflash_dataset_tokens(ds));
  dflash_dataset_free(ds);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(test_random_access_and_iteration) {
  char *dir = write_dataset(500, 777);
  dflash_dataset *ds;
  ck_assert_ok(dflash_dataset_open(dir, &ds));
  uint64_t tokens = 0;
  for (size_t i = 0; i < dflash_dataset_count(ds); i++) {
    check_sample(ds, i);
    tokens += sample_len(i);
  }
  ck_assert_uint_eq(tokens, dflash_dataset_tokens(ds));
  /* Random order, including both ends and shard boundaries. */
  size_t x = 12345;
  for (int k = 0; k < 2000; k++) {
    x = x * 1103515245u + 12345u;
    check_sample(ds, (x >> 8) % 500);
  }
  check_sample(ds, 0);
  check_sample(ds, 499);
  ck_assert_status(dflash_dataset_sample(ds, 500, NULL, NULL, NULL, NULL), DFLASH_E_RANGE,
                   "sample 500 of 500");
  dflash_dataset_free(ds);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(test_histogram) {
  char *dir = write_dataset(200, 1 << 20);
  dflash_dataset *ds;
  ck_assert_ok(dflash_dataset_open(dir, &ds));
  uint64_t counts[4], want[4] = {0};
  for (size_t i = 0; i < 200; i++) {
    size_t b = sample_len(i) / 16;
    want[b < 4 ? b : 3]++;
  }
  ck_assert_ok(dflash_dataset_length_histogram(ds, 16, 4, counts));
  ck_assert_mem_eq(counts, want, sizeof want);
  /* One bin takes everything; width 0 is refused. */
  ck_assert_ok(dflash_dataset_length_histogram(ds, 1, 1, counts));
  ck_assert_uint_eq(counts[0], 200);
  ck_assert_status(dflash_dataset_length_histogram(ds, 0, 4, counts), DFLASH_E_INVALID_ARG,
                   "bin_width");
  dflash_dataset_free(ds);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(test_manifest_contents) {
  char *dir = write_dataset(10, 1 << 20);
  char *p = path_in(dir, "dataset.json");
  FILE *f = fopen(p, "r");
  ck_assert_ptr_nonnull(f);
  char buf[4096];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  buf[n] = 0;
  fclose(f);
  ck_assert_ptr_nonnull(strstr(buf, "\"tokenizer_hash\": \"sha256:00\""));
  ck_assert_ptr_nonnull(strstr(buf, "\"template\": \"qwen3\""));
  ck_assert_ptr_nonnull(strstr(buf, "\"reasoning\": \"official\""));
  ck_assert_ptr_nonnull(strstr(buf, "\"samples\": 10"));
  free(p);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* An unfinished writer (freed, or its process gone) leaves finished shards,
 * no manifest and no temporary files; the directory does not open. */
START_TEST(test_unfinished_writer) {
  char *dir = df_test_tmpdir();
  dflash_dataset_writer_options o;
  dflash_dataset_writer_options_default(&o);
  o.shard_tokens = 100;
  dflash_dataset_writer *w;
  ck_assert_ok(dflash_dataset_writer_create(dir, &o, &w));
  add_samples(w, 0, 20);
  dflash_dataset_writer_free(w);
  ck_assert_uint_ge(count_files(dir, "shard-"), 2);
  ck_assert_uint_eq(count_files(dir, "dataset.json"), 0);
  ck_assert_uint_eq(count_files(dir, "."), 2); /* "." and "..": no temporary files */
  dflash_dataset *ds = NULL;
  ck_assert_status(dflash_dataset_open(dir, &ds), DFLASH_E_NOT_FOUND,
                   "dataset.json: missing: not a dataset, or an unfinished run");
  ck_assert_ptr_null(ds);
  /* A process killed mid-run: same picture. */
  char *dir2 = df_test_tmpdir();
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) {
    if (dflash_dataset_writer_create(dir2, &o, &w)) _exit(1);
    add_samples(w, 0, 20);
    raise(SIGKILL);
  }
  int status;
  ck_assert_int_eq(waitpid(pid, &status, 0), pid);
  ck_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  ck_assert_uint_ge(count_files(dir2, "shard-"), 2);
  ck_assert_uint_eq(count_files(dir2, "dataset.json"), 0);
  ck_assert_uint_eq(count_files(dir2, "."), 2);
  df_test_rmtree(dir);
  df_test_rmtree(dir2);
  free(dir);
  free(dir2);
}
END_TEST

START_TEST(test_writer_errors) {
  char *dir = write_dataset(3, 1 << 20);
  dflash_dataset_writer *w = NULL;
  ck_assert_status(dflash_dataset_writer_create(dir, NULL, &w), DFLASH_E_EXISTS, dir);
  char *fresh = df_test_tmpdir();
  dflash_dataset_writer_options o;
  dflash_dataset_writer_options_default(&o);
  o.options_json = "[1, 2]";
  ck_assert_status(dflash_dataset_writer_create(fresh, &o, &w), DFLASH_E_FORMAT,
                   "not a JSON object");
  o.options_json = "{oops";
  ck_assert_status(dflash_dataset_writer_create(fresh, &o, &w), DFLASH_E_JSON, "options_json");
  o.options_json = NULL;
  o.struct_size = 4;
  ck_assert_status(dflash_dataset_writer_create(fresh, &o, &w), DFLASH_E_INVALID_ARG,
                   "struct_size");
  ck_assert_ok(dflash_dataset_writer_create(fresh, NULL, &w));
  int32_t ids[2] = {1, 2};
  uint8_t mask[2] = {1, 0};
  ck_assert_status(dflash_dataset_writer_add(w, "x", ids, mask, 0), DFLASH_E_INVALID_ARG, "n > 0");
  ck_assert_status(dflash_dataset_writer_add(w, "bad\xff", ids, mask, 2), DFLASH_E_UTF8,
                   "not valid UTF-8");
  ck_assert_ok(dflash_dataset_writer_add(w, "ok", ids, mask, 2));
  ck_assert_ok(dflash_dataset_writer_commit(w));
  ck_assert_status(dflash_dataset_writer_add(w, "late", ids, mask, 2), DFLASH_E_STATE,
                   "already finished");
  ck_assert_status(dflash_dataset_writer_commit(w), DFLASH_E_STATE, "already finished");
  dflash_dataset_writer_free(w);
  dflash_dataset_writer_free(NULL);
  df_test_rmtree(dir);
  df_test_rmtree(fresh);
  free(dir);
  free(fresh);
}
END_TEST

static void put(const char *dir, const char *name, const char *text) {
  char *p = path_in(dir, name);
  ck_assert(df_test_write(p, text, strlen(text)));
  free(p);
}

/* Replace shard 0 with one whose tensors are given here. */
static void write_shard(const char *dir, dflash_dtype mask_dtype, const int64_t *offsets,
                        size_t n_off, const char *sample_ids) {
  char *p = path_in(dir, "shard-00000.safetensors");
  dflash_safetensors_writer *w;
  int32_t ids[4] = {1, 2, 3, 4};
  uint32_t mask32[4] = {1, 1, 1, 1};
  uint8_t mask8[4] = {1, 1, 1, 1};
  int64_t n = 4, no = (int64_t)n_off;
  ck_assert_ok(dflash_safetensors_writer_create(p, &w));
  if (sample_ids) ck_assert_ok(dflash_safetensors_writer_metadata(w, "sample_ids", sample_ids));
  ck_assert_ok(dflash_safetensors_writer_declare(w, "input_ids", DFLASH_DTYPE_I32, 1, &n));
  ck_assert_ok(dflash_safetensors_writer_declare(w, "loss_mask", mask_dtype, 1, &n));
  ck_assert_ok(dflash_safetensors_writer_declare(w, "offsets", DFLASH_DTYPE_I64, 1, &no));
  ck_assert_ok(dflash_safetensors_writer_write(w, ids, sizeof ids));
  if (mask_dtype == DFLASH_DTYPE_U8)
    ck_assert_ok(dflash_safetensors_writer_write(w, mask8, sizeof mask8));
  else ck_assert_ok(dflash_safetensors_writer_write(w, mask32, sizeof mask32));
  ck_assert_ok(dflash_safetensors_writer_write(w, offsets, n_off * sizeof *offsets));
  ck_assert_ok(dflash_safetensors_writer_commit(w));
  dflash_safetensors_writer_free(w);
  free(p);
}

static void expect_open_error(const char *dir, dflash_status st, const char *needle) {
  dflash_dataset *ds = NULL;
  ck_assert_status(dflash_dataset_open(dir, &ds), st, needle);
  ck_assert_ptr_null(ds);
}

START_TEST(test_bad_manifests) {
  char *dir = write_dataset(5, 1 << 20);
  char *manifest = path_in(dir, "dataset.json");
  char *shard = path_in(dir, "shard-00000.safetensors");
  put(dir, "dataset.json", "{\"shards\": [");
  expect_open_error(dir, DFLASH_E_JSON, manifest);
  put(dir, "dataset.json", "{\"samples\": 5}");
  expect_open_error(dir, DFLASH_E_FORMAT, "dataset.json: no shards");
  put(dir, "dataset.json", "{\"samples\": 5, \"shards\": [{\"file\": \"../x\"}]}");
  expect_open_error(dir, DFLASH_E_FORMAT, "shard 0 has no plain file name");
  put(dir, "dataset.json",
      "{\"samples\": 5, \"shards\": [{\"file\": \"shard-00009.safetensors\"}]}");
  expect_open_error(dir, DFLASH_E_NOT_FOUND, "shard-00009.safetensors");
  put(dir, "dataset.json",
      "{\"samples\": 6, \"shards\": [{\"file\": \"shard-00000.safetensors\"}]}");
  expect_open_error(dir, DFLASH_E_MISMATCH, "6 samples listed, shards hold 5");
  /* Bad shards, each named in the message. */
  put(dir, "dataset.json",
      "{\"samples\": 2, \"shards\": [{\"file\": \"shard-00000.safetensors\"}]}");
  int64_t good[3] = {0, 1, 4}, short_[3] = {0, 1, 3}, flat[3] = {0, 4, 4};
  write_shard(dir, DFLASH_DTYPE_U32, good, 3, "[\"a\", \"b\"]");
  expect_open_error(dir, DFLASH_E_FORMAT, "loss_mask is not a 1-D U8");
  write_shard(dir, DFLASH_DTYPE_U8, short_, 3, "[\"a\", \"b\"]");
  expect_open_error(dir, DFLASH_E_FORMAT, "offsets do not cover");
  write_shard(dir, DFLASH_DTYPE_U8, flat, 3, "[\"a\", \"b\"]");
  expect_open_error(dir, DFLASH_E_FORMAT, "offsets not increasing at sample 1");
  write_shard(dir, DFLASH_DTYPE_U8, good, 3, "[\"a\"]");
  expect_open_error(dir, DFLASH_E_FORMAT, "sample_ids metadata does not list 2 ids");
  write_shard(dir, DFLASH_DTYPE_U8, good, 3, NULL);
  expect_open_error(dir, DFLASH_E_NOT_FOUND, "sample_ids");
  write_shard(dir, DFLASH_DTYPE_U8, good, 3, "[\"a\", \"b\"]");
  dflash_dataset *ds;
  /* The repaired shard opens, although its offsets (after 20 bytes of ids
   * and mask) are not 8-byte aligned: the reader copies them. */
  ck_assert_ok(dflash_dataset_open(dir, &ds));
  const int32_t *ids;
  size_t n;
  ck_assert_ok(dflash_dataset_sample(ds, 1, &ids, NULL, &n, NULL));
  ck_assert_uint_eq(n, 3);
  ck_assert_int_eq(ids[0], 2);
  dflash_dataset_free(ds);
  put(dir, "shard-00000.safetensors", "\x08\0\0\0\0\0\0\0{}");
  dflash_status st = dflash_dataset_open(dir, &ds);
  ck_assert_int_ne(st, DFLASH_OK);
  ck_assert_msg(strstr(dflash_last_error(), shard), "%s", dflash_last_error());
  free(manifest);
  free(shard);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* `name` in `dir` as a link to the fixture folder's file. */
static void link_in(const char *dir, const char *fixture_dir, const char *name) {
  char *from = path_in(fixture_dir, name), *to = path_in(dir, name);
  unlink(to);
  ck_assert_int_eq(symlink(from, to), 0);
  free(from), free(to);
}

/* `dir`'s `name` (a link or a file) with the first `from` replaced by `to`, or its first
 * `keep` bytes, written back as a file of its own. */
static void edit(const char *dir, const char *name, const char *from, const char *to, size_t keep) {
  char *dst = path_in(dir, name), *text;
  size_t n;
  ck_assert_ok(df_read_file(dst, &text, &n));
  if (keep && keep < n) {
    for (n = keep; n && text[n - 1] != '\n';) n--; /* whole lines */
    text[n] = 0;
  }
  char *at = from ? strstr(text, from) : NULL;
  ck_assert(!from || at);
  unlink(dst);
  FILE *f = fopen(dst, "wb");
  ck_assert_ptr_nonnull(f);
  if (at) {
    fwrite(text, 1, (size_t)(at - text), f);
    fputs(to, f);
    fputs(at + strlen(from), f);
  } else {
    fwrite(text, 1, n, f);
  }
  fclose(f);
  free(text), free(dst);
}

/* The hash is the tokenizer's identity: what decides the ids, not the files' bytes. */
START_TEST(test_tokenizer_hash) {
  char *vocab_fixture = df_test_fixture("tokenizers/qwen2/vocab.json");
  if (!vocab_fixture) return;
  char *fix = df_path_dirname(vocab_fixture), *dir = df_test_tmpdir();
  const char *names[] = {"vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json",
                         "tokenizer_config.json"};
  for (size_t i = 0; i < 5; i++) link_in(dir, fix, names[i]);
  char a[DFLASH_TOKENIZER_HASH_LEN], b[DFLASH_TOKENIZER_HASH_LEN], hash[DFLASH_TOKENIZER_HASH_LEN];
  ck_assert_ok(dflash_dataset_tokenizer_hash(dir, a, sizeof a));
  ck_assert_int_eq((int)strlen(a), DFLASH_TOKENIZER_HASH_LEN - 1);
  ck_assert(!strncmp(a, "sha256:", 7));
  char *vocab = path_in(dir, "vocab.json");
  ck_assert_ok(dflash_dataset_tokenizer_hash(vocab, b, sizeof b)); /* vocab.json: its folder */
  ck_assert_str_eq(a, b);
  dflash_tokenizer *tok;
  ck_assert_ok(dflash_tokenizer_load(dir, NULL, &tok));
  ck_assert_ok(dflash_tokenizer_hash(tok, b, sizeof b));
  ck_assert_status(dflash_tokenizer_hash(tok, b, 71), DFLASH_E_BUFFER, "72 bytes");
  dflash_tokenizer_free(tok);
  ck_assert_str_eq(a, b);
  /* Another model_max_length and chat template: the same ids, the same hash (they were
   * refused as "other tokens"). */
  edit(dir, "tokenizer_config.json", "32768", "4096", 0);
  edit(dir, "tokenizer_config.json", "helpful assistant", "terse assistant", 0);
  put(dir, "model.safetensors", "weights are not hashed");
  ck_assert_ok(dflash_dataset_tokenizer_hash(dir, b, sizeof b));
  ck_assert_str_eq(a, b);
  ck_assert_ok(dflash_dataset_tokenizer_matches(dir, a));
  /* Fewer merges or another special token: other ids, another hash. */
  edit(dir, "merges.txt", NULL, NULL, 100000);
  ck_assert_ok(dflash_dataset_tokenizer_hash(dir, b, sizeof b));
  ck_assert_str_ne(a, b);
  link_in(dir, fix, "merges.txt");
  char *config = path_in(dir, "tokenizer_config.json");
  unlink(config); /* its added tokens repeat added_tokens.json's */
  free(config);
  char c[DFLASH_TOKENIZER_HASH_LEN];
  ck_assert_ok(dflash_dataset_tokenizer_hash(dir, c, sizeof c));
  edit(dir, "added_tokens.json", "<|im_end|>", "<|im_stop|>", 0);
  ck_assert_ok(dflash_dataset_tokenizer_hash(dir, b, sizeof b));
  ck_assert_str_ne(c, b);
  ck_assert_status(dflash_dataset_tokenizer_matches(dir, a), DFLASH_E_MISMATCH, a);
  ck_assert_msg(strstr(dflash_last_error(), b), "%s", dflash_last_error());
  ck_assert_status(dflash_dataset_tokenizer_hash(dir, hash, 71), DFLASH_E_BUFFER, "72 bytes");
  char *empty = df_test_tmpdir();
  ck_assert_status(dflash_dataset_tokenizer_hash(empty, hash, sizeof hash), DFLASH_E_NOT_FOUND,
                   empty);
  char *missing = path_in(dir, "nope.json");
  ck_assert_status(dflash_dataset_tokenizer_hash(missing, hash, sizeof hash), DFLASH_E_IO,
                   "nope.json");
  df_test_rmtree(empty);
  free(empty), free(missing), free(vocab), free(vocab_fixture), free(fix);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

TCase *tc_dataset(void) {
  TCase *tc = tcase_create("dataset");
  tcase_add_test(tc, test_rollover);
  tcase_add_test(tc, test_random_access_and_iteration);
  tcase_add_test(tc, test_histogram);
  tcase_add_test(tc, test_manifest_contents);
  tcase_add_test(tc, test_unfinished_writer);
  tcase_add_test(tc, test_writer_errors);
  tcase_add_test(tc, test_bad_manifests);
  tcase_add_test(tc, test_tokenizer_hash);
  return tc;
}
