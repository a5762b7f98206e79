/* Malformed tokenizer files: a clear status naming the file (and line), never a crash. */
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "tokenizer/tok_internal.h"
#include "testutil.h"
#include "tok_testutil.h"

static char *g_dir;

static void setup(void) { g_dir = df_test_tmpdir(); }
static void teardown(void) {
  df_test_rmtree(g_dir);
  free(g_dir);
}

static dflash_status load(const char *path, const char *pattern) {
  dflash_tokenizer_options o;
  dflash_tokenizer_options_default(&o);
  o.pattern = pattern;
  dflash_tokenizer *t = NULL;
  dflash_status st = dflash_tokenizer_load(path, &o, &t);
  ck_assert(st != DFLASH_OK || t != NULL);
  dflash_tokenizer_free(t);
  return st;
}

START_TEST(rank_file_errors) {
  char *p = tt_write(g_dir, "a.tiktoken", "IQ== 0\nIg== 1\n!!!! 2\n");
  ck_assert_status(load(p, "cl100k"), DFLASH_E_FORMAT, "a.tiktoken:3: bad base64");
  free(p);
  p = tt_write(g_dir, "b.tiktoken", "IQ== 0\nIg== one\n");
  ck_assert_status(load(p, "cl100k"), DFLASH_E_FORMAT,
                   "b.tiktoken:2: rank \"one\" is not an integer");
  free(p);
  p = tt_write(g_dir, "c.tiktoken", "IQ== 0\nIg== 1\nIw== 1\n");
  ck_assert_status(load(p, "cl100k"), DFLASH_E_DUPLICATE, "c.tiktoken:3: rank 1 appears twice");
  free(p);
  p = tt_write(g_dir, "d.tiktoken", "IQ== 0\nIg== 2\n");
  ck_assert_status(load(p, "cl100k"), DFLASH_E_FORMAT, "rank 1 is missing");
  free(p);
  p = tt_write(g_dir, "e.tiktoken", "hello world, this is not a rank file\n");
  ck_assert_status(load(p, "cl100k"), DFLASH_E_FORMAT, "e.tiktoken:1");
  free(p);
  p = tt_write(g_dir, "f.tiktoken", "justoneword\n");
  ck_assert_status(load(p, "cl100k"), DFLASH_E_FORMAT, "not a tiktoken rank file");
  free(p);
  p = tt_write(g_dir, "g.tiktoken", "IQ== 0\nIQ== 1\n");
  ck_assert_status(load(p, "cl100k"), DFLASH_E_DUPLICATE, "same bytes");
  free(p);
  p = tt_write(g_dir, "h.tiktoken", "");
  ck_assert_status(load(p, "cl100k"), DFLASH_E_FORMAT, "empty");
  free(p);
  p = tt_write(g_dir, "i.tiktoken", "IQ== 0\nIg== 1\n");
  ck_assert_status(load(p, "cl100k"), DFLASH_E_FORMAT, "single byte 0x00");
  ck_assert_status(load(p, NULL), DFLASH_E_CONFIG, "needs a pattern");
  free(p);
  /* Not tokenizers at all: named for what they are, even without a pattern. */
  p = tt_write(g_dir, "train.jsonl", "{\"messages\": []}\n");
  ck_assert_status(load(p, NULL), DFLASH_E_FORMAT, "JSON lines");
  free(p);
  p = tt_write(g_dir, "model.safetensors", "x");
  ck_assert_status(load(p, NULL), DFLASH_E_FORMAT, "safetensors file");
  free(p);
  p = df_path_join(g_dir, "weights");
  ck_assert(df_test_write(p, "\x10\0\0\0\0\0\0\0{\"a\": 1}", 17));
  ck_assert_status(load(p, NULL), DFLASH_E_FORMAT, "safetensors file");
  free(p);
  p = tt_write(g_dir, "m.gguf", "GGUF\3");
  ck_assert_status(load(p, NULL), DFLASH_E_FORMAT, "GGUF");
  free(p);
  p = tt_write_ranks(g_dir, "j.tiktoken", NULL);
  ck_assert_status(load(p, "(unclosed"), DFLASH_E_REGEX, "(unclosed");
  free(p);
  char *missing = df_path_join(g_dir, "nope.tiktoken");
  ck_assert_status(load(missing, "cl100k"), DFLASH_E_IO, "nope.tiktoken");
  free(missing);
}
END_TEST

START_TEST(truncated_gzip) {
  char *plain = tt_write_ranks(g_dir, "r.tiktoken", NULL);
  char *data;
  size_t len;
  ck_assert_ok(df_read_file(plain, &data, &len));
  char *gz = df_path_join(g_dir, "r.tiktoken.gz");
  gzFile f = gzopen(gz, "wb");
  ck_assert(f != NULL);
  ck_assert_int_eq(gzwrite(f, data, (unsigned)len), (int)len);
  gzclose(f);
  ck_assert_ok(load(gz, "o200k")); /* whole: loads */
  char *zdata;
  size_t zlen;
  ck_assert_ok(df_read_file(gz, &zdata, &zlen));
  ck_assert(df_test_write(gz, zdata, zlen / 2));
  ck_assert_status(load(gz, "o200k"), DFLASH_E_TRUNCATED, "r.tiktoken.gz");
  zdata[12] ^= 0x55; /* corrupt deflate data */
  ck_assert(df_test_write(gz, zdata, zlen));
  dflash_status st = load(gz, "o200k");
  ck_assert_msg(st == DFLASH_E_FORMAT || st == DFLASH_E_TRUNCATED, "%s", dflash_last_error());
  ck_assert(strstr(dflash_last_error(), "r.tiktoken.gz"));
  free(zdata);
  free(data);
  free(gz);
  free(plain);
}
END_TEST

/* A minimal byte-level vocabulary (the 256 byte characters, id = byte) as JSON
 * object members, without the bytes listed in `skip`. */
static char *byte_vocab_json_except(const char *skip) {
  df_buf b = {0};
  for (int i = 0; i < 256; i++) {
    if (memchr(skip, i, strlen(skip))) continue;
    uint32_t c = df_byte_to_char((uint8_t)i);
    char u[8];
    size_t n = c < 0x80 ? 1 : 2;
    if (n == 1) u[0] = (char)c;
    else {
      u[0] = (char)(0xC0 | c >> 6);
      u[1] = (char)(0x80 | (c & 0x3F));
    }
    u[n] = '\0';
    const char *sep = b.len ? ", " : "";
    if (c == '"' || c == '\\') df_buf_printf(&b, "%s\"\\%s\": %d", sep, u, i);
    else df_buf_printf(&b, "%s\"%s\": %d", sep, u, i);
  }
  return b.data;
}

static char *byte_vocab_json(void) { return byte_vocab_json_except(""); }

START_TEST(tokenizer_json_errors) {
  char *p = tt_write(g_dir, "bad.json", "{\"model\": {\"type\": \"BPE\",\n \"vocab\": [1,}}");
  ck_assert_status(load(p, NULL), DFLASH_E_JSON, "line 2");
  free(p);
  p = tt_write(g_dir, "uni.json", "{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}");
  ck_assert_status(load(p, NULL), DFLASH_E_UNSUPPORTED, "model type \"Unigram\"");
  free(p);
  p = tt_write(g_dir, "x.json", "{\"version\": \"1.0\"}");
  ck_assert_status(load(p, NULL), DFLASH_E_FORMAT, "not a tokenizer.json");
  free(p);
  char *vocab = byte_vocab_json();
  char *doc = df_asprintf(
      "{\"model\": {\"type\": \"BPE\", \"vocab\": {%s, \"ab\": 256}, \"merges\": [\"a b\", \"a q\"]},"
      " \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}",
      vocab);
  p = tt_write(g_dir, "m.json", doc);
  ck_assert_status(load(p, NULL), DFLASH_E_FORMAT,
                   "merges[1]: merge \"a q\": token \"aq\" is not in the vocabulary");
  free(p);
  free(doc);
  doc = df_asprintf("{\"model\": {\"type\": \"BPE\", \"vocab\": {%s}, \"merges\": []},"
                    " \"pre_tokenizer\": {\"type\": \"Metaspace\"}}",
                    vocab);
  p = tt_write(g_dir, "meta.json", doc);
  ck_assert_status(load(p, NULL), DFLASH_E_UNSUPPORTED, "pre-tokenizer \"Metaspace\"");
  free(p);
  free(doc);
  doc = df_asprintf("{\"model\": {\"type\": \"BPE\", \"vocab\": {%s}, \"merges\": []},"
                    " \"normalizer\": {\"type\": \"Lowercase\"},"
                    " \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}",
                    vocab);
  p = tt_write(g_dir, "norm.json", doc);
  ck_assert_status(load(p, NULL), DFLASH_E_UNSUPPORTED, "normalizer \"Lowercase\"");
  free(p);
  free(doc);
  doc = df_asprintf("{\"model\": {\"type\": \"BPE\", \"vocab\": {%s}, \"merges\": []},"
                    " \"pre_tokenizer\": {\"type\": \"ByteLevel\"}}",
                    vocab);
  p = tt_write(g_dir, "ok.json", doc);
  ck_assert_ok(load(p, NULL));
  free(p);
  free(doc);
  free(vocab);
}
END_TEST

START_TEST(vocab_merges_errors) {
  char *vocab = byte_vocab_json();
  char *doc = df_asprintf("{%s, \"ab\": 256}", vocab);
  char *v = tt_write(g_dir, "vocab.json", doc);
  char *m = tt_write(g_dir, "merges.txt", "#version: 0.2\na b\nzz b\n");
  ck_assert_status(load(v, NULL), DFLASH_E_FORMAT, "merges.txt:3: merge \"zz b\": token \"zz\"");
  free(m);
  m = tt_write(g_dir, "merges.txt", "#version: 0.2\na b c\n");
  ck_assert_status(load(g_dir, NULL), DFLASH_E_FORMAT, "merges.txt:2");
  free(m);
  m = tt_write(g_dir, "merges.txt", "#version: 0.2\na b\n");
  ck_assert_ok(load(g_dir, NULL));
  free(m);
  free(v);
  free(doc);
  free(vocab);
  ck_assert_status(load("/proc/self", NULL), DFLASH_E_NOT_FOUND, "no tokenizer.json");
}
END_TEST

static void expect_ids(const dflash_tokenizer *t, const char *text, const int32_t *want, size_t n) {
  int32_t ids[16];
  size_t got = 0;
  ck_assert_ok(dflash_tokenizer_encode(t, text, strlen(text), DFLASH_SPECIAL_ALL, ids, 16, &got));
  ck_assert_msg(got == n, "\"%s\": %zu ids, want %zu", text, got, n);
  for (size_t i = 0; i < n; i++) ck_assert_int_eq(ids[i], want[i]);
}

/* Hugging Face vocabularies may lack single-byte tokens (SmolLM2 lacks 21):
 * they load, and encoding drops those bytes before merging, as HF does
 * (the parity on a real vocabulary is in oracle_hf.py). tiktoken stays strict. */
START_TEST(missing_byte_tokens) {
  char *vocab = byte_vocab_json_except("x\xff");
  char *doc = df_asprintf("{\"model\": {\"type\": \"BPE\", \"vocab\": {%s, \"ab\": 256},"
                          " \"merges\": [\"a b\"]}, \"pre_tokenizer\": {\"type\": \"ByteLevel\","
                          " \"add_prefix_space\": false}}",
                          vocab);
  char *p = tt_write(g_dir, "gaps.json", doc);
  char *q = df_asprintf("{%s, \"ab\": 256}", vocab);
  char *v = tt_write(g_dir, "vocab.json", q);
  char *m = tt_write(g_dir, "merges.txt", "#version: 0.2\na b\n");
  const char *paths[] = {p, g_dir};
  for (size_t k = 0; k < DF_ARRAY_LEN(paths); k++) {
    dflash_tokenizer *t = tt_load(paths[k], NULL);
    expect_ids(t, "x", NULL, 0);                     /* n == 1, dropped */
    expect_ids(t, "axb", (const int32_t[]){256}, 1); /* neighbours merge */
    expect_ids(t, "axb axb ab", (const int32_t[]){256, ' ', 256, ' ', 256}, 5); /* cache */
    expect_ids(t, "xxaxc", (const int32_t[]){'a', 'c'}, 2);
    expect_ids(t, "ab", (const int32_t[]){256}, 1);
    dflash_tokenizer_free(t);
  }
  free(m);
  free(v);
  free(q);
  free(p);
  free(doc);
  free(vocab);
  /* a rank file without byte 0x78 is refused */
  df_buf b = {0};
  for (int i = 0, rank = 0; i < 256; i++) {
    if (i == 'x') continue;
    uint8_t byte = (uint8_t)i;
    char enc[16];
    df_buf_printf(&b, "%s %d\n", tt_base64(&byte, 1, enc), rank++);
  }
  p = tt_write(g_dir, "gaps.tiktoken", b.data);
  ck_assert_status(load(p, "cl100k"), DFLASH_E_FORMAT, "no token for the single byte 0x78");
  free(p);
  df_buf_free(&b);
}
END_TEST

TCase *tc_tok_load_errors(void) {
  TCase *tc = tcase_create("load_errors");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_add_test(tc, rank_file_errors);
  tcase_add_test(tc, truncated_gzip);
  tcase_add_test(tc, tokenizer_json_errors);
  tcase_add_test(tc, vocab_merges_errors);
  tcase_add_test(tc, missing_byte_tokens);
  return tc;
}
