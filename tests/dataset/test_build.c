/* dflash_dataset_build: the options-size rule, stats written only up to the caller's size,
 * options and inputs refused with a message, progress reports and stopping, the verdicts,
 * and the same bytes for any thread count and batch size. The qwen2 tokenizer fixture
 * with the qwen3 template (its think tags split, hence allow_split_control_tokens). */
#include <dflash/dataset.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "build_testutil.h"
#include "testutil.h"

#define CONV(q, a)                                                                           \
  "{\"messages\": [{\"role\": \"user\", \"content\": \"" q "\"}, {\"role\": \"assistant\", " \
  "\"content\": \"" a "\"}]}\n"

/* Eight lines: five samples, a blank line, a line that is not JSON, one without an answer. */
static const char INPUT[] = CONV("one", "1") CONV("two", "2") "\n{not json\n" CONV(
    "three", "3") "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}]}\n" CONV("four", "4")
    CONV("five plus some more words", "5 and a longer answer");

typedef struct {
  char *dir, *input, *tok;
} fixture;

static char *join(const char *dir, const char *name) {
  char *p = malloc(strlen(dir) + strlen(name) + 2);
  sprintf(p, "%s/%s", dir, name);
  return p;
}

/* NULL (the test returns) without the tokenizer fixture. */
static fixture *setup(const char *text) {
  char *vocab = df_test_fixture("tokenizers/qwen2/vocab.json");
  if (!vocab) return NULL;
  fixture *f = calloc(1, sizeof *f);
  f->tok = vocab;
  f->dir = df_test_tmpdir();
  f->input = join(f->dir, "in.jsonl");
  ck_assert(df_test_write(f->input, text, strlen(text)));
  return f;
}

static void teardown(fixture *f) {
  df_test_rmtree(f->dir);
  free(f->dir);
  free(f->input);
  free(f->tok);
  free(f);
}

static dflash_status build(const fixture *f, const char *out, const dflash_dataset_build_options *o,
                           dflash_dataset_build_stats *s) {
  char *dir = join(f->dir, out);
  const char *inputs[] = {f->input};
  dflash_status st = dflash_dataset_build(inputs, 1, dir, o, s);
  free(dir);
  return st;
}

static int exists(const fixture *f, const char *out, const char *name) {
  char *dir = join(f->dir, out), *path = join(dir, name);
  int yes = access(path, F_OK) == 0;
  free(path);
  free(dir);
  return yes;
}

static char *slurp(const char *path, size_t *n) {
  FILE *fp = fopen(path, "rb");
  ck_assert_ptr_nonnull(fp);
  fseek(fp, 0, SEEK_END);
  *n = (size_t)ftell(fp);
  rewind(fp);
  char *buf = malloc(*n + 1);
  ck_assert_uint_eq(fread(buf, 1, *n, fp), *n);
  fclose(fp);
  buf[*n] = 0;
  return buf;
}

static void same_file(const fixture *f, const char *a, const char *b, const char *name) {
  char *da = join(f->dir, a), *db = join(f->dir, b), *pa = join(da, name), *pb = join(db, name);
  size_t na, nb;
  char *x = slurp(pa, &na), *y = slurp(pb, &nb);
  ck_assert_msg(na == nb && !memcmp(x, y, na), "%s differs between %s and %s", name, a, b);
  free(x), free(y), free(pa), free(pb), free(da), free(db);
}

START_TEST(test_build_counts_and_side_files) {
  fixture *f = setup(INPUT);
  if (!f) return;
  dflash_dataset_build_options o = build_test_options(f->tok);
  dflash_dataset_build_stats s = {.struct_size = sizeof s};
  ck_assert_ok(build(f, "out", &o, &s));
  ck_assert_uint_eq(s.lines, 8);
  ck_assert_uint_eq(s.samples, 5);
  ck_assert_uint_eq(s.rejected, 2);
  ck_assert_uint_eq(s.too_long, 0);
  ck_assert_int_eq(s.verdict, DFLASH_DATASET_BUILD_OK);
  ck_assert(s.tokens > s.supervised_tokens && s.supervised_tokens > 0);
  char *dir = join(f->dir, "out"), *rej = join(dir, "rejected.jsonl");
  dflash_dataset *ds;
  ck_assert_ok(dflash_dataset_open(dir, &ds));
  ck_assert_uint_eq(dflash_dataset_count(ds), 5);
  ck_assert_uint_eq(dflash_dataset_tokens(ds), s.tokens);
  dflash_dataset_free(ds);
  size_t n;
  char *text = slurp(rej, &n);
  ck_assert_msg(strstr(text, "\"line\": 4, \"reason\": \"") &&
                    strstr(text, "\"line\": 6, "
                                 "\"reason\": \"no assistant turn\", \"id\": \"h") &&
                    strstr(text, "\"id\": null, \"tokens\": null}\n"),
                "%s", text);
  free(text), free(rej), free(dir);
  /* The same directory again: refused, the first dataset kept; the message says how to
   * replace it. */
  ck_assert_status(build(f, "out", &o, NULL), DFLASH_E_EXISTS, "already holds a dataset");
  ck_assert_msg(strstr(dflash_last_error(), "--overwrite"), "%s", dflash_last_error());
  teardown(f);
}
END_TEST

/* Output is the same bytes for 1 and 4 threads, batches of 2048 and of 3 lines. */
START_TEST(test_build_threads_do_not_change_bytes) {
  fixture *f = setup(INPUT);
  if (!f) return;
  dflash_dataset_build_options o = build_test_options(f->tok);
  o.threads = 1;
  ck_assert_ok(build(f, "t1", &o, NULL));
  o.threads = 4;
  o.batch_lines = 3;
  ck_assert_ok(build(f, "t4", &o, NULL));
  const char *names[] = {"dataset.json", "shard-00000.safetensors", "rejected.jsonl",
                         "sources.jsonl"};
  for (size_t i = 0; i < 4; i++) same_file(f, "t1", "t4", names[i]);
  teardown(f);
}
END_TEST

/* The options struct of a newer caller: the library's, then a field it does not know. */
typedef struct {
  dflash_dataset_build_options o;
  uint64_t extra;
} newer_options;

#define ANY_VERDICT (-1)

/* An options struct_size (and the newer caller's extra field): what the build gives. */
typedef struct {
  size_t size;
  uint64_t extra;
  dflash_status status;
  const char *msg; /* NULL: it builds */
  int32_t verdict; /* dflash_dataset_build_verdict, or ANY_VERDICT */
} size_case;

static const size_case OPTION_SIZES[] = {
    /* An older caller's smaller struct: the defaults for its tail (without progress_user). */
    {sizeof(dflash_dataset_build_options) - 8, 0, DFLASH_OK, NULL, DFLASH_DATASET_BUILD_OK},
    /* Cut before max_reject_ratio: the default 0.05 applies, and 2 of 7 lines rejected fail
     * it (the caller's 1 in the cut-off bytes is not read). */
    {offsetof(dflash_dataset_build_options, max_reject_ratio), 0, DFLASH_E_FORMAT,
     "max_reject_ratio 0.05", DFLASH_DATASET_BUILD_REJECTS},
    /* A newer caller's larger struct: accepted while its unknown tail is zero. */
    {sizeof(newer_options), 0, DFLASH_OK, NULL, DFLASH_DATASET_BUILD_OK},
    {sizeof(newer_options), 1, DFLASH_E_UNSUPPORTED, "options of a newer libdflash", ANY_VERDICT},
    {4, 0, DFLASH_E_INVALID_ARG, "struct_size 4", ANY_VERDICT},
};

START_TEST(test_build_options_sizes) {
  const size_case *c = &OPTION_SIZES[_i];
  fixture *f = setup(INPUT);
  if (!f) return;
  newer_options big = {.o = build_test_options(f->tok), .extra = c->extra};
  big.o.struct_size = c->size;
  dflash_dataset_build_stats s = {.struct_size = sizeof s};
  if (c->msg) ck_assert_status(build(f, "out", &big.o, &s), c->status, c->msg);
  else ck_assert_ok(build(f, "out", &big.o, &s));
  if (c->verdict != ANY_VERDICT) ck_assert_int_eq(s.verdict, c->verdict);
  /* A struct refused as a struct is refused before any output. */
  if (c->status == DFLASH_E_UNSUPPORTED || c->status == DFLASH_E_INVALID_ARG)
    ck_assert(!exists(f, "out", "."));
  teardown(f);
}
END_TEST

/* _default writes no further than the caller's size. */
START_TEST(test_build_options_init) {
  newer_options big;
  memset(&big, 0xab, sizeof big);
  dflash_dataset_build_options_init(&big.o, offsetof(dflash_dataset_build_options, threads));
  ck_assert_uint_eq(big.o.struct_size, offsetof(dflash_dataset_build_options, threads));
  ck_assert_int_eq(big.o.reasoning, DFLASH_CHAT_REASONING_KEEP_AFTER_LAST_USER);
  ck_assert_int_eq(big.o.threads, (int32_t)0xabababab);
  dflash_dataset_build_options_default(&big.o);
  ck_assert_uint_eq(big.o.struct_size, sizeof big.o);
  ck_assert_uint_eq(big.o.batch_lines, 2048);
  ck_assert(big.o.max_reject_ratio == 0.05);
}
END_TEST

/* Stats are written up to the caller's struct_size and not a byte further. */
START_TEST(test_build_stats_size) {
  fixture *f = setup(INPUT);
  if (!f) return;
  dflash_dataset_build_options o = build_test_options(f->tok);
  union {
    dflash_dataset_build_stats s;
    unsigned char bytes[sizeof(dflash_dataset_build_stats) + 8];
  } u;
  memset(&u, 0xab, sizeof u);
  size_t cut = offsetof(dflash_dataset_build_stats, rejected);
  u.s.struct_size = cut;
  ck_assert_ok(build(f, "out", &o, &u.s));
  ck_assert_uint_eq(u.s.struct_size, cut);
  ck_assert_uint_eq(u.s.lines, 8);
  ck_assert_uint_eq(u.s.samples, 5);
  for (size_t i = cut; i < sizeof u; i++) ck_assert_uint_eq(u.bytes[i], 0xab);
  /* A newer caller's larger struct: the library's fields, and zero in the fields it does not
   * know. */
  memset(&u, 0xab, sizeof u);
  u.s.struct_size = sizeof u;
  ck_assert_ok(build(f, "out2", &o, &u.s));
  ck_assert_uint_eq(u.s.struct_size, sizeof u);
  ck_assert_uint_eq(u.s.rejected, 2);
  ck_assert_int_eq(u.s.verdict, DFLASH_DATASET_BUILD_OK);
  for (size_t i = sizeof u.s; i < sizeof u; i++) ck_assert_uint_eq(u.bytes[i], 0);
  /* A struct_size that is no size: refused before any work. */
  u.s.struct_size = 0;
  ck_assert_status(build(f, "out3", &o, &u.s), DFLASH_E_INVALID_ARG, "dflash_dataset_build_stats");
  ck_assert(!exists(f, "out3", "."));
  teardown(f);
}
END_TEST

static void no_tokenizer(dflash_dataset_build_options *o) { o->tokenizer_path = NULL; }
static void no_template(dflash_dataset_build_options *o) { o->template_name = NULL; }
static void bad_reasoning(dflash_dataset_build_options *o) { o->reasoning = 7; }
static void no_batch(dflash_dataset_build_options *o) { o->batch_lines = 0; }
static void negative_threads(dflash_dataset_build_options *o) { o->threads = -1; }
static void ratio_over_one(dflash_dataset_build_options *o) { o->max_reject_ratio = 1.5; }
static void ratio_nan(dflash_dataset_build_options *o) { o->max_reject_ratio = NAN; }
static void unknown_template(dflash_dataset_build_options *o) { o->template_name = "nope"; }
static void split_tags(dflash_dataset_build_options *o) { o->allow_split_control_tokens = 0; }

/* One option set wrong: the status and the words of the refusal. */
typedef struct {
  void (*spoil)(dflash_dataset_build_options *o);
  dflash_status status;
  const char *msg;
} bad_option;

static const bad_option BAD_OPTIONS[] = {
    {no_tokenizer, DFLASH_E_INVALID_ARG, "tokenizer_path is NULL"},
    {no_template, DFLASH_E_INVALID_ARG, "template_name is NULL"},
    {bad_reasoning, DFLASH_E_INVALID_ARG, "unknown reasoning mode"},
    {no_batch, DFLASH_E_INVALID_ARG, "batch_lines is 0"},
    {negative_threads, DFLASH_E_INVALID_ARG, "threads is negative"},
    {ratio_over_one, DFLASH_E_INVALID_ARG, "max_reject_ratio"},
    {ratio_nan, DFLASH_E_INVALID_ARG, "max_reject_ratio"},
    {unknown_template, DFLASH_E_NOT_FOUND, "unknown chat template"},
    {split_tags, DFLASH_E_MISMATCH, "<think>"},
};

/* Every refusal comes before any output. */
START_TEST(test_build_bad_option) {
  const bad_option *c = &BAD_OPTIONS[_i];
  fixture *f = setup(INPUT);
  if (!f) return;
  dflash_dataset_build_options o = build_test_options(f->tok);
  c->spoil(&o);
  ck_assert_status(build(f, "x", &o, NULL), c->status, c->msg);
  ck_assert(!exists(f, "x", "."));
  teardown(f);
}
END_TEST

START_TEST(test_build_bad_inputs) {
  fixture *f = setup(INPUT);
  if (!f) return;
  /* NULL options: every default, and the tokenizer is required. */
  ck_assert_status(build(f, "none", NULL, NULL), DFLASH_E_INVALID_ARG, "tokenizer_path is NULL");
  dflash_dataset_build_options o = build_test_options(f->tok);
  char *out = join(f->dir, "x"), *missing = join(f->dir, "missing.jsonl");
  const char *inputs[] = {f->input, missing};
  ck_assert_status(dflash_dataset_build(inputs, 2, out, &o, NULL), DFLASH_E_NOT_FOUND,
                   "cannot read input");
  ck_assert_msg(strstr(dflash_last_error(), "missing.jsonl"), "%s", dflash_last_error());
  ck_assert_status(dflash_dataset_build(inputs, 0, out, &o, NULL), DFLASH_E_INVALID_ARG,
                   "no input");
  ck_assert_status(dflash_dataset_build(inputs, 1, NULL, &o, NULL), DFLASH_E_INVALID_ARG,
                   "out_dir");
  ck_assert(!exists(f, "x", "."));
  free(missing), free(out);
  teardown(f);
}
END_TEST

typedef struct {
  int calls, stop_at;
  uint64_t last_lines;
  int ordered;
} progress_log;

static int on_progress(const dflash_dataset_build_stats *s, void *user) {
  progress_log *p = user;
  if (s->struct_size != sizeof *s || s->lines < p->last_lines) p->ordered = 0;
  p->last_lines = s->lines;
  return ++p->calls == p->stop_at;
}

/* Once when the outputs exist, then after every batch (8 lines in batches of 3: 3 more);
 * a non-zero return stops the build without a manifest. */
START_TEST(test_build_progress_and_stop) {
  fixture *f = setup(INPUT);
  if (!f) return;
  dflash_dataset_build_options o = build_test_options(f->tok);
  progress_log p = {.ordered = 1};
  o.batch_lines = 3;
  o.progress = on_progress;
  o.progress_user = &p;
  ck_assert_ok(build(f, "all", &o, NULL));
  ck_assert_int_eq(p.calls, 4);
  ck_assert(p.ordered);
  ck_assert_uint_eq(p.last_lines, 8);
  p = (progress_log){.ordered = 1, .stop_at = 2};
  dflash_dataset_build_stats s = {.struct_size = sizeof s};
  ck_assert_status(build(f, "stopped", &o, &s), DFLASH_E_CANCELLED, "stopped");
  ck_assert_int_eq(p.calls, 2);
  ck_assert_uint_eq(s.lines, 4); /* the first batch: 3 non-blank lines and the blank one */
  ck_assert(!exists(f, "stopped", "dataset.json"));
  ck_assert(exists(f, "stopped", "rejected.jsonl"));
  teardown(f);
}
END_TEST

/* A finished build that is refused: the dataset is on disk, the status and verdict say why. */
START_TEST(test_build_verdicts) {
  fixture *f = setup(INPUT);
  if (!f) return;
  dflash_dataset_build_options o = build_test_options(f->tok);
  o.max_reject_ratio = 0.25; /* 2 of 7 non-blank lines: 0.29 */
  dflash_dataset_build_stats s = {.struct_size = sizeof s};
  ck_assert_status(build(f, "ratio", &o, &s), DFLASH_E_FORMAT,
                   "28.6% of the lines were rejected, more than max_reject_ratio 0.25");
  ck_assert_int_eq(s.verdict, DFLASH_DATASET_BUILD_REJECTS);
  /* Refused: nothing that reads as a dataset is left (no manifest, shard or sources.jsonl),
   * the reasons are, and the retry needs no overwrite. */
  ck_assert(!exists(f, "ratio", "dataset.json"));
  ck_assert(!exists(f, "ratio", "shard-00000.safetensors"));
  ck_assert(!exists(f, "ratio", "sources.jsonl"));
  ck_assert(exists(f, "ratio", "rejected.jsonl"));
  o.max_reject_ratio = 0.3;
  ck_assert_ok(build(f, "ratio", &o, &s));
  ck_assert_int_eq(s.verdict, DFLASH_DATASET_BUILD_OK);
  ck_assert(exists(f, "ratio", "dataset.json"));
  /* Over-long samples do not count: the samples have 18, 18, 18, 18 and 26 tokens; with
   * max_len 20 the last is rejected as too long, and the ratio stays 2 / 7. */
  o.max_len = 20;
  ck_assert_ok(build(f, "long", &o, &s));
  ck_assert_uint_eq(s.too_long, 1);
  ck_assert_uint_eq(s.rejected, 3);
  /* rejected.jsonl says which record and how long. */
  char *dir = join(f->dir, "long"), *rej = join(dir, "rejected.jsonl");
  size_t n;
  char *text = slurp(rej, &n);
  ck_assert_msg(strstr(text, "\"line\": 8, \"reason\": \"longer than --max-len\", \"id\": \"h") &&
                    strstr(text, "\"tokens\": 26}\n"),
                "%s", text);
  free(text), free(rej), free(dir);
  o.truncate = 1;
  ck_assert_ok(build(f, "cut", &o, &s));
  ck_assert_uint_eq(s.samples, 5);
  ck_assert_uint_eq(s.tokens, 4 * 18 + 20);
  teardown(f);
  f = setup("{not json\n[]\n");
  if (!f) return;
  o = build_test_options(f->tok);
  ck_assert_status(build(f, "junk", &o, &s), DFLASH_E_FORMAT, "no sample written");
  ck_assert_int_eq(s.verdict, DFLASH_DATASET_BUILD_EMPTY);
  ck_assert_uint_eq(s.rejected, 2);
  teardown(f);
}
END_TEST

static int warnings;
static void count_warning(dflash_log_level level, const char *msg, void *user) {
  (void)user;
  if (level == DFLASH_LOG_WARN && strstr(msg, "no AWS credentials")) warnings++;
}

/* Whether `needle` occurs in the line that starts at `at`. */
static bool in_line(const char *at, const char *needle) {
  const char *p = strstr(at, needle), *end = strchr(at, '\n');
  return p && (!end || p < end);
}

/* A directory input is refused before any output. s3:// inputs that cannot be read (no
 * credentials here: no request is sent) are logged, rejected, counted, and refuse the build;
 * so is fetch's settings.json beside each (the folder above a prefix's). */
START_TEST(test_build_unreadable_inputs) {
  fixture *f = setup(INPUT);
  if (!f) return;
  dflash_dataset_build_options o = build_test_options(f->tok);
  char *out = join(f->dir, "x");
  const char *dir_input[] = {f->input, f->dir};
  ck_assert_status(dflash_dataset_build(dir_input, 2, out, &o, NULL), DFLASH_E_IO, "a directory");
  ck_assert(!exists(f, "x", "."));
  unsetenv("AWS_ACCESS_KEY_ID");
  unsetenv("AWS_SECRET_ACCESS_KEY");
  unsetenv("AWS_PROFILE");
  setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials", 1); /* not this machine's */
  setenv("AWS_CONFIG_FILE", "/nonexistent/config", 1);
  warnings = 0;
  dflash_set_log_callback(count_warning, NULL, DFLASH_LOG_WARN);
  const char *inputs[] = {f->input, "s3://no-bucket/a.jsonl", "s3://no-bucket/prefix/"};
  dflash_dataset_build_stats s = {.struct_size = sizeof s};
  ck_assert_status(dflash_dataset_build(inputs, 3, out, &o, &s), DFLASH_E_IO,
                   "4 input(s) could not be read");
  dflash_set_log_callback(NULL, NULL, DFLASH_LOG_ERROR);
  ck_assert_int_eq(warnings, 4);
  ck_assert_int_eq(s.verdict, DFLASH_DATASET_BUILD_UNREADABLE);
  ck_assert_uint_eq(s.unreadable, 4);
  ck_assert_uint_eq(s.samples, 5);
  ck_assert_uint_eq(s.rejected, 6);
  char *rej = join(out, "rejected.jsonl");
  size_t n;
  char *text = slurp(rej, &n);
  /* The real reason is kept (it was only "cannot open file"). */
  const char *open_fail = strstr(text, "{\"file\": \"s3://no-bucket/a.jsonl\", \"line\": 0, "
                                       "\"reason\": \"cannot open file: ");
  const char *list_fail = strstr(text, "{\"file\": \"s3://no-bucket/prefix/\", \"line\": 0, "
                                       "\"reason\": \"cannot list the prefix: ");
  ck_assert_msg(open_fail && list_fail, "%s", text);
  ck_assert_msg(strstr(text, "{\"file\": \"s3://no-bucket/settings.json\", \"line\": 0, "
                             "\"reason\": \"cannot read fetch's settings: ") &&
                    strstr(text, "{\"file\": \"s3://no-bucket/prefix/settings.json\""),
                "%s", text);
  ck_assert_msg(in_line(open_fail, "no AWS credentials") &&
                    in_line(list_fail, "no AWS credentials"),
                "%s", text);
  free(text), free(rej), free(out);
  teardown(f);
}
END_TEST

TCase *tc_dataset_build(void) {
  TCase *tc = tcase_create("dataset_build");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_build_counts_and_side_files);
  tcase_add_test(tc, test_build_threads_do_not_change_bytes);
  tcase_add_loop_test(tc, test_build_options_sizes, 0,
                      (int)(sizeof OPTION_SIZES / sizeof *OPTION_SIZES));
  tcase_add_test(tc, test_build_options_init);
  tcase_add_test(tc, test_build_stats_size);
  tcase_add_loop_test(tc, test_build_bad_option, 0,
                      (int)(sizeof BAD_OPTIONS / sizeof *BAD_OPTIONS));
  tcase_add_test(tc, test_build_bad_inputs);
  tcase_add_test(tc, test_build_progress_and_stop);
  tcase_add_test(tc, test_build_verdicts);
  tcase_add_test(tc, test_build_unreadable_inputs);
  return tc;
}
