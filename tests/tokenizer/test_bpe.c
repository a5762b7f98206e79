/* BPE merge: the heap path equals the flat path; long pieces stay fast. */
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tok_testutil.h"
#include "tokenizer/tok_internal.h"

static const char *const MERGES[] = {"ab",   "bc", "abc", "aa",  "aaaa", "ca",   "cab", "bca",
                                     "abca", "bb", "cc",  "ccc", "aab",  "bcab", NULL};

/* Merge `s` both ways and require the same ids. */
static void same_both_ways(const dflash_tokenizer *t, const char *s, size_t n) {
  df_bpe_scratch sc = {0};
  df_ids flat = {0}, heap = {0};
  ck_assert_ok(df_bpe_encode(&t->vocab, &t->pairs, (const uint8_t *)s, n, SIZE_MAX, &sc, &flat));
  ck_assert_ok(df_bpe_encode(&t->vocab, &t->pairs, (const uint8_t *)s, n, 0, &sc, &heap));
  ck_assert_uint_eq(flat.len, heap.len);
  ck_assert(memcmp(flat.v, heap.v, flat.len * sizeof *flat.v) == 0);
  free(flat.v);
  free(heap.v);
  df_bpe_scratch_free(&sc);
}

START_TEST(heap_merge_equals_flat_merge) {
  char *dir = df_test_tmpdir();
  char *path = tt_write_ranks(dir, "t.tiktoken", MERGES);
  dflash_tokenizer *t = tt_load(path, "cl100k");
  unsigned seed = 12345;
  char buf[300];
  for (int iter = 0; iter < 3000; iter++) {
    size_t n = 1 + (size_t)(rand_r(&seed) % 299);
    for (size_t i = 0; i < n; i++) buf[i] = "abc"[rand_r(&seed) % (iter % 2 ? 2 : 3)];
    same_both_ways(t, buf, n);
  }
  dflash_tokenizer_free(t);
  free(path);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* A megabyte without a single split point: a quadratic merge would take minutes
 * (the Check timeout catches it); the heap merge takes well under a second. */
START_TEST(megabyte_piece_is_not_quadratic) {
  char *dir = df_test_tmpdir();
  char *path = tt_write_ranks(dir, "t.tiktoken", MERGES);
  dflash_tokenizer *t = tt_load(path, "cl100k");
  size_t n = 1 << 20;
  char *text = malloc(n);
  unsigned seed = 7;
  for (size_t i = 0; i < n; i++) text[i] = "abc"[rand_r(&seed) % 3];
  size_t cap = dflash_tokenizer_max_ids(t, n), got;
  int32_t *ids = malloc(cap * sizeof *ids);
  ck_assert_ok(dflash_tokenizer_encode(t, text, n, DFLASH_SPECIAL_ALL, ids, cap, &got));
  ck_assert_uint_lt(got, n); /* merges happened */
  char *back = malloc(n);
  size_t blen;
  ck_assert_ok(dflash_tokenizer_decode(t, ids, got, back, n, &blen));
  ck_assert_uint_eq(blen, n);
  ck_assert(memcmp(back, text, n) == 0);
  free(back);
  free(ids);
  free(text);
  dflash_tokenizer_free(t);
  free(path);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* With a real vocabulary: random words, both merge paths. */
START_TEST(heap_equals_flat_on_cl100k) {
  char *path = df_test_fixture("tokenizers/openai/cl100k_base.tiktoken.gz");
  if (!path) return;
  dflash_tokenizer *t = tt_load(path, NULL);
  unsigned seed = 99;
  char buf[400];
  for (int iter = 0; iter < 2000; iter++) {
    size_t n = 1 + (size_t)(rand_r(&seed) % 399);
    for (size_t i = 0; i < n; i++)
      buf[i] = (char)(rand_r(&seed) % 4 ? 'a' + rand_r(&seed) % 26 : 0x80 + rand_r(&seed) % 64);
    same_both_ways(t, buf, n);
  }
  dflash_tokenizer_free(t);
  free(path);
}
END_TEST

TCase *tc_tok_bpe(void) {
  TCase *tc = tcase_create("bpe");
  tcase_add_test(tc, heap_merge_equals_flat_merge);
  tcase_add_test(tc, megabyte_piece_is_not_quadratic);
  tcase_add_test(tc, heap_equals_flat_on_cl100k);
  return tc;
}
