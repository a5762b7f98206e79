/* dflash_dataset_build over fetch outputs: the settings.json fetch writes beside
 * completions.jsonl decide the rendering (thinking, family), an option that contradicts it
 * is refused naming both; a messages-only record cut by the length limit is not trained as
 * finished. The qwen2 tokenizer fixture with the qwen3 template, as test_build.c. */
#include <dflash/dataset.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "build_testutil.h"
#include "testutil.h"

static const char RECORD[] =
    "{\"id\": \"a\", \"messages\": [{\"role\": \"user\", \"content\": \"one\"}], \"completion\": "
    "{\"role\": \"assistant\", \"content\": \"1\"}, \"finish_reason\": \"stop\", \"outcome\": "
    "\"ok\"}\n"
    "{\"id\": \"b\", \"messages\": [{\"role\": \"user\", \"content\": \"two\"}], \"completion\": "
    "{\"role\": \"assistant\", \"content\": \"2\"}, \"finish_reason\": \"stop\", \"outcome\": "
    "\"ok\"}\n";

typedef struct {
  char *root, *tok;
} fx;

static char *path_of(const fx *f, const char *rel) {
  char *p = malloc(strlen(f->root) + strlen(rel) + 2);
  sprintf(p, "%s/%s", f->root, rel);
  return p;
}

/* `rel` under the fixture's folder, its folder made first. */
static void put(const fx *f, const char *rel, const char *text) {
  char *p = path_of(f, rel);
  char *slash = strrchr(p, '/');
  *slash = 0;
  mkdir(p, 0755);
  *slash = '/';
  ck_assert(df_test_write(p, text, strlen(text)));
  free(p);
}

static fx *setup(void) {
  char *vocab = df_test_fixture("tokenizers/qwen2/vocab.json");
  if (!vocab) return NULL;
  fx *f = calloc(1, sizeof *f);
  f->tok = vocab;
  f->root = df_test_tmpdir();
  return f;
}

static void teardown(fx *f) {
  df_test_rmtree(f->root);
  free(f->root), free(f->tok), free(f);
}

static dflash_status build(const fx *f, const char *in, const char *out,
                           const dflash_dataset_build_options *o, dflash_dataset_build_stats *s) {
  char *ip = path_of(f, in), *op = path_of(f, out);
  const char *inputs[] = {ip};
  dflash_status st = dflash_dataset_build(inputs, 1, op, o, s);
  free(ip), free(op);
  return st;
}

/* The file's bytes (NUL-terminated, *n of them), NULL when it cannot be read. */
static char *slurp_n(const fx *f, const char *rel, size_t *n) {
  char *p = path_of(f, rel);
  FILE *fp = fopen(p, "rb");
  free(p);
  if (!fp) return NULL;
  char *buf = malloc(1 << 16);
  *n = fread(buf, 1, (1 << 16) - 1, fp);
  fclose(fp);
  buf[*n] = 0;
  return buf;
}

static char *slurp_rel(const fx *f, const char *rel) {
  size_t n;
  return slurp_n(f, rel, &n);
}

static bool same(const fx *f, const char *a, const char *b) {
  size_t na = 0, nb = 0;
  char *x = slurp_n(f, a, &na), *y = slurp_n(f, b, &nb);
  bool eq = x && y && na == nb && !memcmp(x, y, na);
  free(x), free(y);
  return eq;
}

static bool there(const fx *f, const char *rel) {
  char *p = path_of(f, rel);
  bool yes = access(p, F_OK) == 0;
  free(p);
  return yes;
}

#define SETTINGS(family, kwargs, extra, earlier)                                            \
  "{\"dflash_fetch_settings\": 1, \"settings\": {\"model\": \"m\", \"family\": \"" family   \
  "\", \"chat_template_kwargs\": " kwargs ", \"extra\": " extra ", \"all_turns\": false}, " \
  "\"earlier\": " earlier "}\n"

/* Answers fetched with thinking off are rendered with thinking off without being told: the
 * same bytes as an explicit no_thinking, recorded in the manifest. */
START_TEST(test_settings_decide_thinking) {
  fx *f = setup();
  if (!f) return;
  put(f, "fetch/completions.jsonl", RECORD);
  put(f, "fetch/settings.json", SETTINGS("qwen", "{\"enable_thinking\": false}", "null", "[]"));
  put(f, "plain/completions.jsonl", RECORD);
  dflash_dataset_build_options o = build_test_options(f->tok);
  ck_assert_ok(build(f, "fetch/completions.jsonl", "from-settings", &o, NULL));
  ck_assert_ok(build(f, "plain/completions.jsonl", "thinking-on", &o, NULL));
  o.no_thinking = 1;
  ck_assert_ok(build(f, "plain/completions.jsonl", "told", &o, NULL));
  ck_assert(same(f, "from-settings/shard-00000.safetensors", "told/shard-00000.safetensors"));
  ck_assert(
      !same(f, "from-settings/shard-00000.safetensors", "thinking-on/shard-00000.safetensors"));
  char *manifest = slurp_rel(f, "from-settings/dataset.json");
  ck_assert_msg(strstr(manifest, "\"thinking\": false"), "%s", manifest);
  free(manifest);
  /* Saying it again agrees with the file. */
  ck_assert_ok(build(f, "fetch/completions.jsonl", "agreed", &o, NULL));
  /* "extra"'s chat_template_kwargs are merged over the family switch (fetch sends them last). */
  put(f, "extra/completions.jsonl", RECORD);
  put(f, "extra/settings.json",
      SETTINGS("qwen", "{\"enable_thinking\": true}",
               "{\"chat_template_kwargs\": {\"enable_thinking\": false}}", "[]"));
  o.no_thinking = 0;
  ck_assert_ok(build(f, "extra/completions.jsonl", "extra-out", &o, NULL));
  ck_assert(same(f, "extra-out/shard-00000.safetensors", "told/shard-00000.safetensors"));
  /* Another tool's settings.json is not fetch's: not read. */
  put(f, "other/completions.jsonl", RECORD);
  put(f, "other/settings.json", "{\"settings\": {\"family\": \"kimi\"}}\n");
  ck_assert_ok(build(f, "other/completions.jsonl", "other-out", &o, NULL));
  ck_assert(same(f, "other-out/shard-00000.safetensors", "thinking-on/shard-00000.safetensors"));
  teardown(f);
}
END_TEST

/* An option that contradicts the file is refused before any output, naming both. */
START_TEST(test_settings_contradicted) {
  fx *f = setup();
  if (!f) return;
  put(f, "on/completions.jsonl", RECORD);
  put(f, "on/settings.json", SETTINGS("qwen", "{\"enable_thinking\": true}", "null", "[]"));
  dflash_dataset_build_options o = build_test_options(f->tok);
  o.no_thinking = 1;
  ck_assert_status(build(f, "on/completions.jsonl", "x", &o, NULL), DFLASH_E_MISMATCH,
                   "--no-thinking");
  ck_assert_msg(strstr(dflash_last_error(), "on/settings.json") &&
                    strstr(dflash_last_error(), "enable_thinking true"),
                "%s", dflash_last_error());
  put(f, "kimi/completions.jsonl", RECORD);
  put(f, "kimi/settings.json", SETTINGS("kimi", "{\"thinking\": true}", "null", "[]"));
  o = build_test_options(f->tok);
  ck_assert_status(build(f, "kimi/completions.jsonl", "x", &o, NULL), DFLASH_E_MISMATCH,
                   "template \"qwen3\" (--template)");
  ck_assert_msg(strstr(dflash_last_error(), "kimi/settings.json") &&
                    strstr(dflash_last_error(), "family \"kimi\""),
                "%s", dflash_last_error());
  /* A fetch whose thinking changed on the way: its completions mix both. */
  put(f, "mixed/completions.jsonl", RECORD);
  put(f, "mixed/settings.json",
      SETTINGS("qwen", "{\"enable_thinking\": true}", "null",
               "[{\"settings\": {\"family\": \"qwen\", \"chat_template_kwargs\": "
               "{\"enable_thinking\": false}}}]"));
  ck_assert_status(build(f, "mixed/completions.jsonl", "x", &o, NULL), DFLASH_E_MISMATCH,
                   "earlier");
  /* Two fetch outputs that disagree. */
  put(f, "off/completions.jsonl", RECORD);
  put(f, "off/settings.json", SETTINGS("qwen", "{\"enable_thinking\": false}", "null", "[]"));
  char *a = path_of(f, "on/completions.jsonl"), *b = path_of(f, "off/completions.jsonl");
  char *out = path_of(f, "x");
  const char *inputs[] = {a, b};
  ck_assert_status(dflash_dataset_build(inputs, 2, out, &o, NULL), DFLASH_E_MISMATCH,
                   "on/settings.json and ");
  ck_assert_msg(strstr(dflash_last_error(), "off/settings.json"), "%s", dflash_last_error());
  free(a), free(b), free(out);
  ck_assert(!there(f, "x"));
  teardown(f);
}
END_TEST

/* fetch's remote layout: the settings of OUT/completions/ chunks are OUT/settings.json (no
 * credentials here: it cannot be read, and rejected.jsonl names where it was looked for). */
START_TEST(test_settings_of_remote_chunks) {
  fx *f = setup();
  if (!f) return;
  put(f, "in/a.jsonl", RECORD);
  unsetenv("AWS_ACCESS_KEY_ID");
  unsetenv("AWS_SECRET_ACCESS_KEY");
  unsetenv("AWS_PROFILE");
  setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/credentials", 1);
  setenv("AWS_CONFIG_FILE", "/nonexistent/config", 1);
  char *local = path_of(f, "in/a.jsonl"), *out = path_of(f, "out");
  const char *inputs[] = {local, "s3://no-bucket/run/completions/",
                          "s3://no-bucket/run/completions/w-1.jsonl"};
  dflash_dataset_build_options o = build_test_options(f->tok);
  ck_assert_status(dflash_dataset_build(inputs, 3, out, &o, NULL), DFLASH_E_IO,
                   "could not be read");
  char *rej = slurp_rel(f, "out/rejected.jsonl");
  ck_assert_msg(strstr(rej, "{\"file\": \"s3://no-bucket/run/settings.json\", \"line\": 0") &&
                    !strstr(rej, "completions/settings.json"),
                "%s", rej);
  /* The two inputs share it: looked for once. */
  const char *line = "{\"file\": \"s3://no-bucket/run/settings.json\"";
  ck_assert_msg(!strstr(strstr(rej, line) + 1, line), "%s", rej);
  free(rej), free(local), free(out);
  teardown(f);
}
END_TEST

#define USER "{\"role\": \"user\", \"content\": \"Count to ten.\"}"
#define ANSWER "{\"role\": \"assistant\", \"content\": \"One, two, three\"}"

/* A messages-only record whose finish_reason says the length limit cut it: dropped as
 * unfinished, or kept without its closing tokens supervised, as a completion record is. */
START_TEST(test_messages_only_cut_by_length) {
  fx *f = setup();
  if (!f) return;
  put(f, "in/whole.jsonl", "{\"id\": \"w\", \"messages\": [" USER ", " ANSWER "]}\n");
  put(f, "in/cut.jsonl",
      "{\"id\": \"w\", \"messages\": [" USER ", " ANSWER "]}\n"
      "{\"id\": \"c\", \"messages\": [" USER ", " ANSWER "], \"finish_reason\": \"length\"}\n");
  dflash_dataset_build_options o = build_test_options(f->tok);
  dflash_dataset_build_stats s = {.struct_size = sizeof s};
  ck_assert_ok(build(f, "in/cut.jsonl", "drop", &o, &s));
  ck_assert_uint_eq(s.samples, 1);
  ck_assert_uint_eq(s.unfinished, 1);
  ck_assert_uint_eq(s.rejected, 1);
  char *rej = slurp_rel(f, "drop/rejected.jsonl");
  ck_assert_msg(strstr(rej, "\"line\": 2") && strstr(rej, "did not finish this answer"), "%s", rej);
  free(rej);
  dflash_dataset_build_stats whole = {.struct_size = sizeof whole};
  ck_assert_ok(build(f, "in/whole.jsonl", "whole", &o, &whole));
  o.keep_unfinished = 1;
  ck_assert_ok(build(f, "in/cut.jsonl", "keep", &o, &s));
  ck_assert_uint_eq(s.samples, 2);
  ck_assert_uint_eq(s.tokens, 2 * whole.tokens); /* the same text */
  ck_assert_uint_lt(s.supervised_tokens, 2 * whole.supervised_tokens);
  teardown(f);
}
END_TEST

TCase *tc_dataset_build_fetch(void) {
  TCase *tc = tcase_create("dataset_build_fetch");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, test_settings_decide_thinking);
  tcase_add_test(tc, test_settings_contradicted);
  tcase_add_test(tc, test_messages_only_cut_by_length);
  tcase_add_test(tc, test_settings_of_remote_chunks);
  return tc;
}
