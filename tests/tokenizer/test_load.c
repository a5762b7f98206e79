/* Malformed tokenizer files: a clear status naming the file (and line), never a crash. */
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include <dflash/experimental.h>

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

/* A file that does not load: its bytes (`len` 0: a string), the pattern it is loaded with,
 * and the status and the words of the message that names it. */
typedef struct {
  const char *name, *text;
  size_t len;
  const char *pattern;
  dflash_status status;
  const char *msg;
} bad_file;

static const bad_file BAD_FILES[] = {
    {"a.tiktoken", "IQ== 0\nIg== 1\n!!!! 2\n", 0, "cl100k", DFLASH_E_FORMAT,
     "a.tiktoken:3: bad base64"},
    {"b.tiktoken", "IQ== 0\nIg== one\n", 0, "cl100k", DFLASH_E_FORMAT,
     "b.tiktoken:2: rank \"one\" is not an integer"},
    {"c.tiktoken", "IQ== 0\nIg== 1\nIw== 1\n", 0, "cl100k", DFLASH_E_DUPLICATE,
     "c.tiktoken:3: rank 1 appears twice"},
    {"d.tiktoken", "IQ== 0\nIg== 2\n", 0, "cl100k", DFLASH_E_FORMAT, "rank 1 is missing"},
    {"e.tiktoken", "hello world, this is not a rank file\n", 0, "cl100k", DFLASH_E_FORMAT,
     "e.tiktoken:1"},
    {"f.tiktoken", "justoneword\n", 0, "cl100k", DFLASH_E_FORMAT, "not a tiktoken rank file"},
    {"g.tiktoken", "IQ== 0\nIQ== 1\n", 0, "cl100k", DFLASH_E_DUPLICATE, "same bytes"},
    {"h.tiktoken", "", 0, "cl100k", DFLASH_E_FORMAT, "empty"},
    {"i.tiktoken", "IQ== 0\nIg== 1\n", 0, "cl100k", DFLASH_E_FORMAT, "single byte 0x00"},
    {"i.tiktoken", "IQ== 0\nIg== 1\n", 0, NULL, DFLASH_E_CONFIG, "needs a pattern"},
    /* Not tokenizers at all: named for what they are, even without a pattern. */
    {"train.jsonl", "{\"messages\": []}\n", 0, NULL, DFLASH_E_FORMAT, "JSON lines"},
    {"model.safetensors", "x", 0, NULL, DFLASH_E_FORMAT, "safetensors file"},
    {"weights", "\x10\0\0\0\0\0\0\0{\"a\": 1}", 17, NULL, DFLASH_E_FORMAT, "safetensors file"},
    {"m.gguf", "GGUF\3", 0, NULL, DFLASH_E_FORMAT, "GGUF"},
    /* JSON that is not a tokenizer.json we read. */
    {"bad.json", "{\"model\": {\"type\": \"BPE\",\n \"vocab\": [1,}}", 0, NULL, DFLASH_E_JSON,
     "line 2"},
    {"uni.json", "{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}", 0, NULL,
     DFLASH_E_UNSUPPORTED, "model type \"Unigram\""},
    {"x.json", "{\"version\": \"1.0\"}", 0, NULL, DFLASH_E_FORMAT, "not a tokenizer.json"},
};

START_TEST(bad_file_is_named) {
  const bad_file *c = &BAD_FILES[_i];
  char *p = df_path_join(g_dir, c->name);
  ck_assert(df_test_write(p, c->text, c->len ? c->len : strlen(c->text)));
  ck_assert_status(load(p, c->pattern), c->status, c->msg);
  free(p);
}
END_TEST

START_TEST(bad_pattern_and_missing_file) {
  char *p = tt_write_ranks(g_dir, "j.tiktoken", NULL);
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

#define BYTE_LEVEL ", \"pre_tokenizer\": {\"type\": \"ByteLevel\"}"

/* A tokenizer.json over the 256 byte tokens: more vocabulary, the merges and the members
 * after the model; what loading it gives (msg NULL: it loads). */
typedef struct {
  const char *name, *vocab, *merges, *rest;
  dflash_status status;
  const char *msg;
} bpe_doc;

static const bpe_doc BPE_DOCS[] = {
    {"m.json", ", \"ab\": 256", "[\"a b\", \"a q\"]", BYTE_LEVEL, DFLASH_E_FORMAT,
     "merges[1]: merge \"a q\": token \"aq\" is not in the vocabulary"},
    {"meta.json", "", "[]", ", \"pre_tokenizer\": {\"type\": \"Metaspace\"}", DFLASH_E_UNSUPPORTED,
     "pre-tokenizer \"Metaspace\""},
    {"norm.json", "", "[]", ", \"normalizer\": {\"type\": \"Lowercase\"}" BYTE_LEVEL,
     DFLASH_E_UNSUPPORTED, "normalizer \"Lowercase\""},
    {"ok.json", "", "[]", BYTE_LEVEL, DFLASH_OK, NULL},
};

START_TEST(tokenizer_json) {
  const bpe_doc *c = &BPE_DOCS[_i];
  char *vocab = byte_vocab_json();
  char *doc = df_asprintf("{\"model\": {\"type\": \"BPE\", \"vocab\": {%s%s}, \"merges\": %s}%s}",
                          vocab, c->vocab, c->merges, c->rest);
  char *p = tt_write(g_dir, c->name, doc);
  if (c->msg) ck_assert_status(load(p, NULL), c->status, c->msg);
  else ck_assert_ok(load(p, NULL));
  free(p);
  free(doc);
  free(vocab);
}
END_TEST

/* A merge may start from a character's own token only where every merge ranks after the
 * merges making its two tokens (df_pairmap_char_tokens): \u00e9 (bytes c3 a9) made before
 * \u00e9\u00e9, then the other way round, where the tables are not built. Both encode
 * \u00e9\u00e9 as one token. */
START_TEST(char_tokens_need_rising_ranks) {
  static const char *const order[2] = {"[\"\\u00c3 \\u00a9\", \"\\u00c3\\u00a9 \\u00c3\\u00a9\"]",
                                       "[\"\\u00c3\\u00a9 \\u00c3\\u00a9\", \"\\u00c3 \\u00a9\"]"};
  char *vocab = byte_vocab_json();
  const uint8_t e[4] = {0xC3,
                        0xA9}; /* 4 bytes: gcc's -Warray-bounds sees the decode's 4-byte case */
  for (int k = 0; k < 2; k++) {
    char *doc =
        df_asprintf("{\"model\": {\"type\": \"BPE\", \"vocab\": {%s, \"\\u00c3\\u00a9\": 256, "
                    "\"\\u00c3\\u00a9\\u00c3\\u00a9\": 257}, \"merges\": %s}" BYTE_LEVEL "}",
                    vocab, order[k]);
    char *p = tt_write(g_dir, "chars.json", doc);
    dflash_tokenizer *t = tt_load(p, NULL);
    if (k == 0) {
      ck_assert_ptr_nonnull(t->pairs.char_block);
      ck_assert_uint_eq(df_pairmap_char_token(&t->pairs, e, 2), 256);
    } else {
      ck_assert_ptr_null(t->pairs.char_block);
    }
    int32_t ids[8];
    size_t n = 0;
    ck_assert_ok(
        dflash_tokenizer_encode(t, "\xc3\xa9\xc3\xa9", 4, DFLASH_SPECIAL_NONE, ids, 8, &n));
    ck_assert_uint_eq(n, 1);
    ck_assert_int_eq(ids[0], 257);
    dflash_tokenizer_free(t);
    free(p);
    free(doc);
  }
  free(vocab);
}
END_TEST

/* vocab.json beside a merges.txt, loaded by the vocab's path or the folder's. */
typedef struct {
  const char *merges;
  bool by_folder;
  dflash_status status;
  const char *msg;
} merges_case;

static const merges_case MERGES[] = {
    {"#version: 0.2\na b\nzz b\n", false, DFLASH_E_FORMAT,
     "merges.txt:3: merge \"zz b\": token \"zz\""},
    {"#version: 0.2\na b c\n", true, DFLASH_E_FORMAT, "merges.txt:2"},
    {"#version: 0.2\na b\n", true, DFLASH_OK, NULL},
};

START_TEST(vocab_merges) {
  const merges_case *c = &MERGES[_i];
  char *vocab = byte_vocab_json();
  char *doc = df_asprintf("{%s, \"ab\": 256}", vocab);
  char *v = tt_write(g_dir, "vocab.json", doc);
  char *m = tt_write(g_dir, "merges.txt", c->merges);
  const char *path = c->by_folder ? g_dir : v;
  if (c->msg) ck_assert_status(load(path, NULL), c->status, c->msg);
  else ck_assert_ok(load(path, NULL));
  free(m);
  free(v);
  free(doc);
  free(vocab);
}
END_TEST

START_TEST(folder_without_tokenizer) {
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

/* The piece cache starts seeded with the short tokens (cache_seed_build), each holding what
 * encoding its bytes gives: "abc" is a token, but its merges give "ab" + "c" ("a bc" waits for
 * "bc", which "a b" took first), so first sight of "abc" gives those two ids, from the seed
 * (no miss counted), and the same again; with ignore_merges the token itself. */
START_TEST(seeded_cache_holds_merge_results) {
  char *vocab = byte_vocab_json();
  for (int ignore = 0; ignore < 2; ignore++) {
    char *doc = df_asprintf(
        "{\"model\": {\"type\": \"BPE\", \"ignore_merges\": %s, \"vocab\": {%s, \"ab\": 256,"
        " \"bc\": 257, \"abc\": 258}, \"merges\": [\"a b\", \"b c\", \"a bc\"]},"
        " \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false}}",
        ignore ? "true" : "false", vocab);
    char *p = tt_write(g_dir, "seed.json", doc);
    dflash_tokenizer *t = tt_load(p, NULL);
    uint64_t p0, m0, p1, m1;
    for (int pass = 0; pass < 2; pass++) {
      dflash_tokenizer_thread_stats(&p0, &m0, NULL);
      if (ignore) expect_ids(t, "abc", (const int32_t[]){258}, 1);
      else expect_ids(t, "abc", (const int32_t[]){256, 'c'}, 2);
      expect_ids(t, "bc", (const int32_t[]){257}, 1);
      dflash_tokenizer_thread_stats(&p1, &m1, NULL);
      ck_assert_uint_eq(p1 - p0, 2);
      ck_assert_uint_eq(m1 - m0, 0); /* both seeded */
    }
    expect_ids(t, "cab", (const int32_t[]){'c', 256}, 2); /* no token: a miss, merged */
    dflash_tokenizer_thread_stats(&p0, &m0, NULL);
    ck_assert_uint_eq(m0 - m1, 1);
    dflash_tokenizer_free(t);
    free(p);
    free(doc);
  }
  free(vocab);
}
END_TEST

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
  tcase_add_loop_test(tc, bad_file_is_named, 0, (int)DF_ARRAY_LEN(BAD_FILES));
  tcase_add_test(tc, bad_pattern_and_missing_file);
  tcase_add_test(tc, truncated_gzip);
  tcase_add_loop_test(tc, tokenizer_json, 0, (int)DF_ARRAY_LEN(BPE_DOCS));
  tcase_add_loop_test(tc, vocab_merges, 0, (int)DF_ARRAY_LEN(MERGES));
  tcase_add_test(tc, char_tokens_need_rising_ranks);
  tcase_add_test(tc, folder_without_tokenizer);
  tcase_add_test(tc, missing_byte_tokens);
  tcase_add_test(tc, seeded_cache_holds_merge_results);
  return tc;
}
