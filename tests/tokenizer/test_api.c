/* Public API behaviour: buffers, lookups, specials, decode errors, threads. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dflash/experimental.h>

#include "core/internal.h"
#include "testutil.h"
#include "tok_testutil.h"
#include "tokenizer/tok_internal.h"

static const char *const EXTRA[] = {"he", "ll",   "hell",   "hello", " w",
                                    "or", " wor", " world", NULL};

static dflash_tokenizer *synthetic(char **dir) {
  *dir = df_test_tmpdir();
  char *path = tt_write_ranks(*dir, "s.tiktoken", EXTRA);
  dflash_tokenizer *t = tt_load(path, "cl100k");
  free(path);
  return t;
}

START_TEST(encode_decode_and_buffers) {
  char *dir;
  dflash_tokenizer *t = synthetic(&dir);
  ck_assert_uint_eq(dflash_tokenizer_vocab_size(t), 256 + 8);
  int32_t ids[16];
  size_t n;
  ck_assert_ok(dflash_tokenizer_encode(t, "hello world", 11, DFLASH_SPECIAL_ALL, ids, 16, &n));
  ck_assert_uint_eq(n, 2);
  ck_assert_int_eq(ids[0], 256 + 3);
  ck_assert_int_eq(ids[1], 256 + 7);
  ck_assert_status(dflash_tokenizer_encode(t, "hello world", 11, DFLASH_SPECIAL_ALL, ids, 1, &n),
                   DFLASH_E_BUFFER, "2 ids");
  ck_assert_uint_eq(n, 2);
  ck_assert_ok(dflash_tokenizer_encode(t, "", 0, DFLASH_SPECIAL_ALL, ids, 0, &n));
  ck_assert_uint_eq(n, 0);
  char out[32];
  size_t len;
  ck_assert_status(dflash_tokenizer_decode(t, ids, 2, out, 4, &len), DFLASH_E_BUFFER, "11 bytes");
  ck_assert_uint_eq(len, 11);
  ck_assert_ok(dflash_tokenizer_decode(t, ids, 2, out, sizeof out, &len));
  ck_assert_int_eq(memcmp(out, "hello world", 11), 0);
  int32_t bad[] = {104, 5000};
  ck_assert_status(dflash_tokenizer_decode(t, bad, 2, out, sizeof out, &len), DFLASH_E_RANGE,
                   "id 5000 at position 1");
  bad[1] = -3;
  ck_assert_status(dflash_tokenizer_decode(t, bad, 2, out, sizeof out, &len), DFLASH_E_RANGE,
                   "id -3");
  ck_assert_status(dflash_tokenizer_encode(NULL, "x", 1, DFLASH_SPECIAL_ALL, ids, 16, &n),
                   DFLASH_E_INVALID_ARG, "invalid argument");
  ck_assert_status(dflash_tokenizer_encode(t, "x", 1, (dflash_special_mode)7, ids, 16, &n),
                   DFLASH_E_INVALID_ARG, "special");
  /* invalid UTF-8 becomes U+FFFD, whose bytes are three single-byte tokens here */
  ck_assert_ok(dflash_tokenizer_encode(t, "\xff", 1, DFLASH_SPECIAL_ALL, ids, 16, &n));
  ck_assert_uint_eq(n, 3);
  ck_assert_int_eq(ids[0], 0xEF);
  ck_assert_uint_le(n, dflash_tokenizer_max_ids(t, 1));
  dflash_tokenizer_free(t);
  dflash_tokenizer_free(NULL);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* dflash_tokenizer_thread_stats: every piece counted, a repeated piece answered by the cache,
 * a piece that is a token answered by the seeded cache on first sight, a one-byte piece never
 * a miss, the caches' bytes fixed and within the 64 MiB a thread may use. */
START_TEST(thread_stats_count_pieces_and_misses) {
  char *dir;
  dflash_tokenizer *t = synthetic(&dir);
  int32_t ids[32];
  size_t n, bytes;
  uint64_t p0, m0, p1, m1;
  dflash_tokenizer_thread_stats(&p0, &m0, NULL);
  /* pieces "hello", " world", " hello", " world": "hello" and " world" are tokens, in the
   * cache from the start (its seed); " hello" is not, merged once; the last is " world" again */
  const char *text = "hello world hello world";
  ck_assert_ok(dflash_tokenizer_encode(t, text, strlen(text), DFLASH_SPECIAL_ALL, ids, 32, &n));
  dflash_tokenizer_thread_stats(&p1, &m1, &bytes);
  ck_assert_uint_eq(p1 - p0, 4);
  ck_assert_uint_eq(m1 - m0, 1);
  ck_assert_uint_ge(bytes, (size_t)1 << 20);
  ck_assert_uint_le(bytes, (size_t)64 << 20);
  ck_assert_ok(dflash_tokenizer_encode(t, text, strlen(text), DFLASH_SPECIAL_ALL, ids, 32, &n));
  ck_assert_ok(dflash_tokenizer_encode(t, "x", 1, DFLASH_SPECIAL_ALL, ids, 32, &n));
  dflash_tokenizer_thread_stats(&p0, &m0, NULL);
  ck_assert_uint_eq(p0 - p1, 5);
  ck_assert_uint_eq(m0 - m1, 0);
  dflash_tokenizer_thread_stats(NULL, NULL, NULL);
  dflash_tokenizer_free(t);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* Tokens of 16-64 bytes start in the long cache (its seed), as short ones start in the piece
 * cache: a first sight of each is no miss; without the seeds (DFLASH_TOKENIZER_NO_SEED) each
 * is one. Their ids are the tokens' own either way; through the scanned loop and the general
 * one (DFLASH_TOKENIZER_NO_SCANNER). */
static const char *const LONG_TOKENS[] = {
    "ab", "abab", "abababab", "abababababababab", "abababababababababababababababab", NULL};

static void long_tokens_first_sight(bool seeded, bool general) {
  char *dir = df_test_tmpdir();
  char *path = tt_write_ranks(dir, "l.tiktoken", LONG_TOKENS);
  if (!seeded) setenv("DFLASH_TOKENIZER_NO_SEED", "1", 1);
  if (general) setenv("DFLASH_TOKENIZER_NO_SCANNER", "1", 1);
  dflash_tokenizer *t = tt_load(path, "cl100k");
  unsetenv("DFLASH_TOKENIZER_NO_SEED");
  unsetenv("DFLASH_TOKENIZER_NO_SCANNER");
  const char *pieces[] = {"abababababababab", "abababababababababababababababab"};
  for (int k = 0; k < 2; k++) {
    int32_t ids[40];
    size_t n;
    uint64_t m0, m1;
    dflash_tokenizer_thread_stats(NULL, &m0, NULL);
    ck_assert_ok(
        dflash_tokenizer_encode(t, pieces[k], strlen(pieces[k]), DFLASH_SPECIAL_ALL, ids, 40, &n));
    dflash_tokenizer_thread_stats(NULL, &m1, NULL);
    ck_assert_uint_eq(n, 1);
    ck_assert_int_eq(ids[0], 256 + 3 + k);
    ck_assert_uint_eq(m1 - m0, (seeded ? 0u : 1u));
  }
  dflash_tokenizer_free(t);
  free(path);
  df_test_rmtree(dir);
  free(dir);
}

START_TEST(long_tokens_seeded) {
  for (int general = 0; general < 2; general++) { /* the scanned loop, the general one */
    long_tokens_first_sight(true, general);
    long_tokens_first_sight(false, general);
  }
}
END_TEST

/* The piece cache keeps a real text's working set: 8000 distinct words (man pages hold more),
 * encoded twice, miss less than 5 % of the time the second time. 2^15 buckets of 2 entries,
 * first in first out: a word misses when two later words took its bucket (measured: 190, 2.4 %;
 * 2^18 buckets since, fewer). The words are of 4 bytes and up to 4 ids, as a real
 * vocabulary's words are (longer ones go to the long cache, direct-mapped: long_pieces_hit).
 * Direct-mapped, when one of the 7999 others took its slot: 1 - e^(-7999/slots), 11.7 % with
 * 2^16 entries (measured: 934), 38 % with 2^14 (measured: 3039). */
START_TEST(piece_cache_keeps_8000_words) {
  char *dir;
  dflash_tokenizer *t = synthetic(&dir);
  enum { WORDS = 8000 };
  char *text = malloc(WORDS * 4 + 1);
  ck_assert_ptr_nonnull(text);
  for (int w = 0; w < WORDS; w++) { /* " abc": letters, one piece each */
    char *q = text + 4 * w;
    q[0] = ' ';
    for (int k = 0, v = w; k < 3; k++, v /= 26) q[1 + k] = (char)('a' + v % 26);
  }
  size_t len = WORDS * 4, n, cap = dflash_tokenizer_max_ids(t, len);
  int32_t *ids = malloc(cap * sizeof *ids);
  ck_assert_ptr_nonnull(ids);
  uint64_t p0, m0, p1, m1;
  ck_assert_ok(dflash_tokenizer_encode(t, text, len, DFLASH_SPECIAL_ALL, ids, cap, &n));
  dflash_tokenizer_thread_stats(&p0, &m0, NULL);
  ck_assert_ok(dflash_tokenizer_encode(t, text, len, DFLASH_SPECIAL_ALL, ids, cap, &n));
  dflash_tokenizer_thread_stats(&p1, &m1, NULL);
  ck_assert_uint_eq(p1 - p0, WORDS);
  ck_assert_uint_lt((m1 - m0) * 100, (uint64_t)WORDS * 5);
  free(ids);
  free(text);
  dflash_tokenizer_free(t);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* Cache hits write their ids from locals in encode_plain: pieces of 1 to 6 ids, encoded twice,
 * give the same ids and the second time every piece is a hit (5 and 6 ids from the long cache,
 * through the piece cache's mark); each alone gives its own count (a hit writes four ids, a
 * long hit thirteen, and only the piece's count may stand). */
START_TEST(repeated_pieces_hit) {
  char *dir;
  dflash_tokenizer *t = synthetic(&dir);
  /* pieces "hello" (one id), " xy" and " qq" (three), " xyzw" (five), " ab" (three), " abcde"
   * (six), " hello" (two) twice, " qq" */
  const char *text = "hello xy xyzw qq ab abcde hello hello qq";
  size_t len = strlen(text), n1, n2;
  int32_t a[64], b[64];
  uint64_t p0, m0, p1, m1;
  ck_assert_ok(dflash_tokenizer_encode(t, text, len, DFLASH_SPECIAL_ALL, a, 64, &n1));
  dflash_tokenizer_thread_stats(&p0, &m0, NULL);
  ck_assert_ok(dflash_tokenizer_encode(t, text, len, DFLASH_SPECIAL_ALL, b, 64, &n2));
  dflash_tokenizer_thread_stats(&p1, &m1, NULL);
  ck_assert_uint_eq(n1, n2);
  ck_assert_int_eq(memcmp(a, b, n1 * sizeof *a), 0);
  ck_assert_uint_eq(m1 - m0, 0);
  ck_assert_uint_eq(p1 - p0, 9);
  /* and each piece alone (the ids of a hit are written past the end and must not count) */
  const char *words[] = {"hello", " xy", " xyzw", " qq", " abcde"};
  for (size_t w = 0; w < sizeof words / sizeof *words; w++) {
    ck_assert_ok(
        dflash_tokenizer_encode(t, words[w], strlen(words[w]), DFLASH_SPECIAL_ALL, a, 64, &n1));
    ck_assert_uint_eq(n1, w == 0 ? 1 : strlen(words[w]));
  }
  dflash_tokenizer_free(t);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

/* Pieces of 16-64 bytes with up to 13 ids are cached too (a cache of their own), and pieces
 * of 65-128 bytes with up to 29 ids (the XL cache): each encoded alone, twice, the second time
 * only the three that cannot be (27 one-byte ids; 130 bytes; 65 bytes of 37 ids) miss, and the
 * ids are the same; through the scanned loop and the general one (no scanner). The counts
 * follow from the vocabulary: "hello" x k is k ids, "hell" one, a space one, a letter of
 * "abcd..." one. */
enum { LONG_TEXTS = 8 };
static void long_pieces_round(dflash_tokenizer *t, int32_t (*ids)[48], bool again) {
  /* 65 bytes, " " 26, " " 61, +"hell" 64, 27 letters, +"hell" x 2 128, 130, +30 letters 65 */
  static const int hellos[] = {13, 5, 12, 12, 0, 24, 26, 7};
  static const size_t want[] = {13, 6, 13, 13, 27, 26, 26, 37};
  for (size_t k = 0; k < LONG_TEXTS; k++) {
    char text[160] = "";
    if (k == 1 || k == 2) strcat(text, " ");
    for (int h = 0; h < hellos[k]; h++) strcat(text, "hello");
    if (k == 3) strcat(text, "hell");
    if (k == 4) strcat(text, " abcdefghijklmnopqrstuvwxyz"); /* 27 bytes, 27 ids */
    if (k == 5) strcat(text, "hellhell");
    if (k == 7) strcat(text, "abcdefghijklmnopqrstuvwxyzabcd");
    int32_t got[48];
    size_t m;
    ck_assert_ok(dflash_tokenizer_encode(t, text, strlen(text), DFLASH_SPECIAL_ALL, got, 48, &m));
    ck_assert_uint_eq(m, want[k]);
    if (again) ck_assert_int_eq(memcmp(got, ids[k], m * sizeof *got), 0);
    memcpy(ids[k], got, m * sizeof *got);
  }
}

START_TEST(long_pieces_hit) {
  for (int general = 0; general < 2; general++) {
    char *dir;
    if (general) setenv("DFLASH_TOKENIZER_NO_SCANNER", "1", 1);
    dflash_tokenizer *t = synthetic(&dir);
    unsetenv("DFLASH_TOKENIZER_NO_SCANNER");
    int32_t ids[LONG_TEXTS][48];
    uint64_t p0, m0, p1, m1;
    long_pieces_round(t, ids, false);
    dflash_tokenizer_thread_stats(&p0, &m0, NULL);
    long_pieces_round(t, ids, true);
    dflash_tokenizer_thread_stats(&p1, &m1, NULL);
    ck_assert_uint_eq(p1 - p0, LONG_TEXTS);
    ck_assert_uint_eq(m1 - m0, 3);
    dflash_tokenizer_free(t);
    df_test_rmtree(dir);
    free(dir);
  }
}
END_TEST

/* The misses of a scanned text are merged together (waiting_misses), their ids written into the
 * room the probe loop left for them: the same ids as one miss at a time (DFLASH_TOKENIZER_NO_AHEAD),
 * and a piece twice among them merged once. Ten distinct pieces of 2-3 ids (" hellq" and
 * " worx" merge: he+ll, hell; " w"+"or"), each twice while it waits, so two batches of
 * up to 8: 10 misses, not 20. */
static void encode_ahead_or_not(const char *path, const char *pattern, const char *text,
                                int32_t *ids, size_t cap, size_t *n, uint64_t *missed, bool ahead) {
  if (!ahead) setenv("DFLASH_TOKENIZER_NO_AHEAD", "1", 1);
  dflash_tokenizer *t = tt_load(path, pattern);
  unsetenv("DFLASH_TOKENIZER_NO_AHEAD");
  uint64_t p0, m0, p1, m1;
  dflash_tokenizer_thread_stats(&p0, &m0, NULL);
  ck_assert_ok(dflash_tokenizer_encode(t, text, strlen(text), DFLASH_SPECIAL_ALL, ids, cap, n));
  dflash_tokenizer_thread_stats(&p1, &m1, NULL);
  *missed = m1 - m0;
  dflash_tokenizer_free(t);
}

START_TEST(misses_merged_ahead) {
  char *dir = df_test_tmpdir();
  char *path = tt_write_ranks(dir, "s.tiktoken", EXTRA);
  const char *text =
      "hello xy qq ab xyz xy zq qz qq ab xyz zq qz yy xx yy xx hellq worx hellq worx";
  int32_t a[64], b[64];
  size_t na, nb;
  uint64_t ma, mb;
  encode_ahead_or_not(path, "cl100k", text, a, 64, &na, &ma, true);
  encode_ahead_or_not(path, "cl100k", text, b, 64, &nb, &mb, false);
  ck_assert_uint_eq(na, nb);
  ck_assert_int_eq(memcmp(a, b, na * sizeof *a), 0);
  /* " xy" " qq" " ab" " xyz" " zq" " qz" " yy" " xx", then " hellq" " worx" */
  ck_assert_uint_eq(ma, 10);
  ck_assert_uint_eq(mb, 10);
  free(path);
  df_test_rmtree(dir);
  free(dir);
  /* a real vocabulary: 3,000 random words of 2-12 letters, each again a few words on */
  char *real = df_test_fixture("tokenizers/openai/o200k_base.tiktoken.gz");
  if (!real) return;
  enum { WORDS = 3000 };
  char *big = malloc(WORDS * 2 * 14 + 1), word[16];
  size_t len = 0;
  unsigned seed = 44;
  for (int w = 0; w < WORDS; w++) {
    size_t k = 2 + (size_t)rand_r(&seed) % 11;
    for (size_t i = 0; i < k; i++) word[i] = (char)('a' + rand_r(&seed) % 26);
    word[k] = 0;
    len += (size_t)sprintf(big + len, " %s%s", word, w % 3 ? "" : ",");
    if (w % 2) len += (size_t)sprintf(big + len, " %s", word); /* seen again at once */
  }
  size_t cap = len + 16;
  int32_t *x = malloc(cap * sizeof *x), *y = malloc(cap * sizeof *y);
  encode_ahead_or_not(real, NULL, big, x, cap, &na, &ma, true);
  encode_ahead_or_not(real, NULL, big, y, cap, &nb, &mb, false);
  ck_assert_uint_eq(na, nb);
  ck_assert_int_eq(memcmp(x, y, na * sizeof *x), 0);
  /* no more merges than one at a time, give or take the cache's evictions (entries put
   * earlier push out others: 1 %, not the 2x of a batch that merged a piece twice) */
  ck_assert_uint_le(ma, mb + mb / 100);
  ck_assert_uint_gt(ma, WORDS / 2);
  free(x), free(y), free(big), free(real);
}
END_TEST

/* Qwen2's merged ids rise with the rank (256 + rank), so its table ranks by merged id
 * (df_pairmap_ids_as_ranks): the same ids as ranking by the merge list's order
 * (DFLASH_TOKENIZER_NO_ID_RANKS), and the same tokenizer hash, which dataset manifests
 * record. The random words make first-sight merges of 2-12 letters, and the other scripts
 * longer ones. */
static dflash_tokenizer *load_ranked(const char *dir, bool by_id) {
  if (!by_id) setenv("DFLASH_TOKENIZER_NO_ID_RANKS", "1", 1);
  dflash_tokenizer *t = tt_load(dir, NULL);
  unsetenv("DFLASH_TOKENIZER_NO_ID_RANKS");
  return t;
}

START_TEST(merge_ids_as_ranks) {
  char *dir = df_test_fixture("tokenizers/qwen2");
  if (!dir) return;
  dflash_tokenizer *a = load_ranked(dir, true), *b = load_ranked(dir, false);
  /* the table of a ranks by merged id (the list kept for the hash), b's by the list */
  ck_assert_ptr_null(a->pairs.merged_of_rank);
  ck_assert_ptr_nonnull(a->pairs.rank_merged);
  ck_assert_ptr_nonnull(b->pairs.merged_of_rank);
  char ha[DFLASH_TOKENIZER_HASH_LEN], hb[DFLASH_TOKENIZER_HASH_LEN];
  ck_assert_ok(dflash_tokenizer_hash(a, ha, sizeof ha));
  ck_assert_ok(dflash_tokenizer_hash(b, hb, sizeof hb));
  ck_assert_str_eq(ha, hb);
  enum { WORDS = 4000 };
  char *text = malloc(WORDS * 16 + 256);
  size_t len = (size_t)sprintf(text, "Жж привет мир, नमस्ते दुनिया; 東京都の天気は晴れ 1234567");
  unsigned seed = 45;
  for (int w = 0; w < WORDS; w++) {
    text[len++] = w % 5 ? ' ' : '\n';
    for (size_t i = 0, k = 2 + (size_t)rand_r(&seed) % 11; i < k; i++)
      text[len++] = (char)((w % 7 ? 'a' : 'A') + rand_r(&seed) % 26);
  }
  size_t cap = len + 16, na, nb;
  int32_t *x = malloc(cap * sizeof *x), *y = malloc(cap * sizeof *y);
  ck_assert_ok(dflash_tokenizer_encode(a, text, len, DFLASH_SPECIAL_NONE, x, cap, &na));
  ck_assert_ok(dflash_tokenizer_encode(b, text, len, DFLASH_SPECIAL_NONE, y, cap, &nb));
  ck_assert_uint_eq(na, nb);
  ck_assert_int_eq(memcmp(x, y, na * sizeof *x), 0);
  free(x);
  free(y);
  free(text);
  dflash_tokenizer_free(a);
  dflash_tokenizer_free(b);
  free(dir);
}
END_TEST

START_TEST(lookups) {
  char *dir;
  dflash_tokenizer *t = synthetic(&dir);
  int32_t id;
  ck_assert_ok(dflash_tokenizer_token_to_id(t, " world", 6, &id));
  ck_assert_int_eq(id, 263);
  ck_assert_status(dflash_tokenizer_token_to_id(t, "xyz", 3, &id), DFLASH_E_NOT_FOUND, "3 bytes");
  const char *bytes;
  size_t len;
  int special = -1;
  ck_assert_ok(dflash_tokenizer_id_to_token(t, 259, &bytes, &len, &special));
  ck_assert_uint_eq(len, 5);
  ck_assert_int_eq(memcmp(bytes, "hello", 5), 0);
  ck_assert_int_eq(special, 0);
  ck_assert_status(dflash_tokenizer_id_to_token(t, 264, &bytes, &len, NULL), DFLASH_E_RANGE, "264");
  dflash_tokenizer_free(t);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

START_TEST(openai_specials) {
  char *path = df_test_fixture("tokenizers/openai/cl100k_base.tiktoken.gz");
  if (!path) return;
  dflash_tokenizer *t = tt_load(path, NULL);
  ck_assert_uint_eq(dflash_tokenizer_vocab_size(t), 100277);
  const char *text = "a<|endoftext|>b<|endofprompt|>";
  int32_t ids[64];
  size_t n;
  ck_assert_ok(dflash_tokenizer_encode(t, text, strlen(text), DFLASH_SPECIAL_ALL, ids, 64, &n));
  ck_assert_uint_eq(n, 4);
  ck_assert_int_eq(ids[1], 100257);
  ck_assert_int_eq(ids[3], 100276);
  ck_assert_ok(dflash_tokenizer_encode(t, text, strlen(text), DFLASH_SPECIAL_NONE, ids, 64, &n));
  ck_assert_uint_gt(n, 4);
  for (size_t i = 0; i < n; i++) ck_assert_int_lt(ids[i], 100256);
  const char *bytes;
  size_t len;
  int special;
  ck_assert_ok(dflash_tokenizer_id_to_token(t, 100276, &bytes, &len, &special));
  ck_assert_int_eq(special, 1);
  ck_assert_status(dflash_tokenizer_id_to_token(t, 100262, &bytes, &len, &special),
                   DFLASH_E_NOT_FOUND, "unused");
  int32_t id;
  ck_assert_ok(dflash_tokenizer_token_to_id(t, "<|endoftext|>", 13, &id));
  ck_assert_int_eq(id, 100257);
  dflash_tokenizer_free(t);
  free(path);
}
END_TEST

/* One tokenizer, several threads encoding at once, and the batch encoder: same ids. */
typedef struct worker {
  const dflash_tokenizer *t;
  const char *const *texts;
  size_t n;
  int32_t *ids;
  size_t *counts;
} worker;

static void *encode_all(void *arg) {
  worker *w = arg;
  for (size_t i = 0; i < w->n; i++)
    if (dflash_tokenizer_encode(w->t, w->texts[i], strlen(w->texts[i]), DFLASH_SPECIAL_ALL,
                                w->ids + i * 256, 256, &w->counts[i]))
      w->counts[i] = SIZE_MAX;
  return NULL;
}

/* One encode_batch of every text, for running several at once on one tokenizer. */
typedef struct batch_worker {
  const dflash_tokenizer *t;
  const char *const *texts;
  const size_t *lens;
  size_t n, cap;
  int32_t *ids;
  size_t *offsets;
  dflash_status st;
} batch_worker;

static void *batch_all(void *arg) {
  batch_worker *b = arg;
  for (int round = 0; round < 4 && !b->st; round++)
    b->st = dflash_tokenizer_encode_batch(b->t, b->texts, b->lens, b->n, DFLASH_SPECIAL_ALL, 2,
                                          b->ids, b->cap, b->offsets);
  return NULL;
}

START_TEST(shared_across_threads_and_batch) {
  char *path = df_test_fixture("tokenizers/openai/o200k_base.tiktoken.gz");
  if (!path) return;
  dflash_tokenizer *t = tt_load(path, NULL);
  enum { N = 64, THREADS = 4 };
  char *texts[N];
  unsigned seed = 3;
  for (int i = 0; i < N; i++) {
    texts[i] = malloc(200);
    size_t len = (size_t)(rand_r(&seed) % 150);
    for (size_t k = 0; k < len; k++) texts[i][k] = " abcXYZ,.\n'日"[rand_r(&seed) % 13];
    texts[i][len] = '\0';
    if (!df_utf8_valid(texts[i], len)) texts[i][0] = '\0';
  }
  worker w[THREADS];
  pthread_t th[THREADS];
  for (int k = 0; k < THREADS; k++) {
    w[k] = (worker){t, (const char *const *)texts, N, malloc(N * 256 * sizeof(int32_t)),
                    malloc(N * sizeof(size_t))};
    pthread_create(&th[k], NULL, encode_all, &w[k]);
  }
  for (int k = 0; k < THREADS; k++) pthread_join(th[k], NULL);
  size_t lens[N], offsets[N + 1], cap = 0;
  for (int i = 0; i < N; i++) cap += dflash_tokenizer_max_ids(t, lens[i] = strlen(texts[i]));
  int32_t *batch = malloc(cap * sizeof *batch);
  ck_assert_ok(dflash_tokenizer_encode_batch(t, (const char *const *)texts, lens, N,
                                             DFLASH_SPECIAL_ALL, 3, batch, cap, offsets));
  for (int i = 0; i < N; i++) {
    for (int k = 0; k < THREADS; k++) {
      ck_assert_uint_eq(w[k].counts[i], w[0].counts[i]);
      ck_assert(!memcmp(w[k].ids + i * 256, w[0].ids + i * 256, w[0].counts[i] * sizeof(int32_t)));
    }
    ck_assert_uint_eq(offsets[i + 1] - offsets[i], w[0].counts[i]);
    ck_assert(!memcmp(batch + offsets[i], w[0].ids + i * 256, w[0].counts[i] * sizeof(int32_t)));
  }
  /* Batches at once: one holds the tokenizer's kept pool, the others make their own;
   * each, repeated on the kept pool's workers (whose caches persist), gives the same ids. */
  enum { BATCHES = 3 };
  batch_worker bw[BATCHES];
  pthread_t bth[BATCHES];
  for (int k = 0; k < BATCHES; k++) {
    bw[k] = (batch_worker){t,
                           (const char *const *)texts,
                           lens,
                           N,
                           cap,
                           malloc(cap * sizeof(int32_t)),
                           malloc((N + 1) * sizeof(size_t)),
                           DFLASH_OK};
    pthread_create(&bth[k], NULL, batch_all, &bw[k]);
  }
  for (int k = 0; k < BATCHES; k++) {
    pthread_join(bth[k], NULL);
    ck_assert_int_eq(bw[k].st, DFLASH_OK);
    ck_assert(!memcmp(bw[k].offsets, offsets, (N + 1) * sizeof *offsets));
    ck_assert(!memcmp(bw[k].ids, batch, offsets[N] * sizeof *batch));
    free(bw[k].ids);
    free(bw[k].offsets);
  }
  ck_assert_status(dflash_tokenizer_encode_batch(t, (const char *const *)texts, lens, N,
                                                 DFLASH_SPECIAL_ALL, 2, batch, 3, offsets),
                   DFLASH_E_BUFFER, "do not fit");
  ck_assert_uint_eq(offsets[N], offsets[N]);
  for (int k = 0; k < THREADS; k++) {
    free(w[k].ids);
    free(w[k].counts);
  }
  for (int i = 0; i < N; i++) free(texts[i]);
  free(batch);
  dflash_tokenizer_free(t);
  free(path);
}
END_TEST

/* A Kimi model directory: tiktoken.model + tokenizer_config.json naming Kimi's class. */
START_TEST(kimi_directory_layout) {
  char *dir = df_test_tmpdir();
  char *ranks = tt_write_ranks(dir, "tiktoken.model", EXTRA);
  char *cfg = tt_write(dir, "tokenizer_config.json",
                       "{\"tokenizer_class\": \"TikTokenTokenizer\", \"added_tokens_decoder\": {"
                       "\"266\": {\"content\": \"<|im_end|>\", \"special\": true},"
                       "\"264\": {\"content\": \"[BOS]\", \"special\": true}}}");
  dflash_tokenizer *t = tt_load(dir, NULL);
  ck_assert_uint_eq(dflash_tokenizer_vocab_size(t), 264 + 256);
  const char *bytes;
  size_t len;
  int special;
  ck_assert_ok(dflash_tokenizer_id_to_token(t, 266, &bytes, &len, &special));
  ck_assert_int_eq(memcmp(bytes, "<|im_end|>", len), 0);
  ck_assert_int_eq(special, 1);
  ck_assert_ok(dflash_tokenizer_id_to_token(t, 519, &bytes, &len, &special));
  ck_assert_int_eq(memcmp(bytes, "<|reserved_token_519|>", len), 0);
  int32_t ids[32];
  size_t n;
  ck_assert_ok(dflash_tokenizer_encode(t, "hello<|im_end|>", 15, DFLASH_SPECIAL_ALL, ids, 32, &n));
  ck_assert_uint_eq(n, 2);
  ck_assert_int_eq(ids[1], 266);
  dflash_tokenizer_free(t);
  t = tt_load(ranks, NULL); /* the rank file itself: same layout from the config beside it */
  ck_assert_uint_eq(dflash_tokenizer_vocab_size(t), 264 + 256);
  dflash_tokenizer_free(t);
  free(ranks);
  free(cfg);
  df_test_rmtree(dir);
  free(dir);
}
END_TEST

TCase *tc_tok_api(void) {
  TCase *tc = tcase_create("api");
  tcase_add_test(tc, encode_decode_and_buffers);
  tcase_add_test(tc, thread_stats_count_pieces_and_misses);
  tcase_add_test(tc, piece_cache_keeps_8000_words);
  tcase_add_test(tc, long_pieces_hit);
  tcase_add_test(tc, misses_merged_ahead);
  tcase_add_test(tc, merge_ids_as_ranks);
  tcase_add_test(tc, long_tokens_seeded);
  tcase_add_test(tc, repeated_pieces_hit);
  tcase_add_test(tc, lookups);
  tcase_add_test(tc, openai_specials);
  tcase_add_test(tc, shared_across_threads_and_batch);
  tcase_add_test(tc, kimi_directory_layout);
  return tc;
}
