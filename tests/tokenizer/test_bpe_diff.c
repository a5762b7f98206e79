/*
 * The list merge (pieces up to the heap threshold), and df_bpe_merge_many on the pieces of up
 * to DF_BPE_SHORT bytes (1 to DF_BPE_MANY of them at once), against the heap merge, on real
 * vocabularies: every token's own bytes, random bytes, and random runs of tokens, 1-300 bytes.
 * The heap merge is the reference: written apart, and the oracles check the whole encoder
 * against tiktoken and Hugging Face, so two paths that agree here agree with them.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tok_testutil.h"
#include "tokenizer/tok_internal.h"

typedef struct diff_ctx {
  const dflash_tokenizer *t;
  df_bpe_scratch sc;
  df_ids list, heap;
  size_t pieces;
  /* The short pieces (2..DF_BPE_SHORT bytes) wait here, DF_BPE_MANY at a time, for
   * df_bpe_merge_many, whose lanes run their rounds in turn. */
  uint8_t held[DF_BPE_MANY][DF_BPE_SHORT];
  size_t held_len[DF_BPE_MANY], n_held, many;
} diff_ctx;

static void hex_of(char *hex, const uint8_t *s, size_t n) {
  hex[0] = 0;
  for (size_t i = 0; i < n && i < 64; i++) snprintf(hex + 2 * i, 3, "%02x", s[i]);
}

/* The held pieces merged together, each against the heap merge on its own. */
static void flush_many(diff_ctx *d) {
  const dflash_tokenizer *t = d->t;
  const uint8_t *p[DF_BPE_MANY];
  uint32_t ids[DF_BPE_MANY][DF_BPE_SHORT];
  uint8_t count[DF_BPE_MANY];
  for (size_t j = 0; j < d->n_held; j++) p[j] = d->held[j];
  df_bpe_merge_many(&t->vocab, &t->pairs, p, d->held_len, d->n_held, ids, count);
  for (size_t j = 0; j < d->n_held; j++) {
    d->heap.len = 0;
    ck_assert_ok(df_bpe_encode(&t->vocab, &t->pairs, p[j], d->held_len[j], 0, &d->sc, &d->heap));
    bool same = d->heap.len == count[j];
    for (size_t k = 0; same && k < count[j]; k++) same = (uint32_t)d->heap.v[k] == ids[j][k];
    char hex[2 * 64 + 1];
    hex_of(hex, p[j], d->held_len[j]);
    ck_assert_msg(same,
                  "lane %zu of %zu gives %u ids, the heap merge %zu, for the %zu-byte piece %s", j,
                  d->n_held, count[j], d->heap.len, d->held_len[j], hex);
    d->many++;
  }
  d->n_held = 0;
}

/* Merge s both ways; on a difference, fail naming the piece. */
static void same_ids(diff_ctx *d, const uint8_t *s, size_t n) {
  d->list.len = d->heap.len = 0;
  const dflash_tokenizer *t = d->t;
  ck_assert_ok(df_bpe_encode(&t->vocab, &t->pairs, s, n, SIZE_MAX, &d->sc, &d->list));
  ck_assert_ok(df_bpe_encode(&t->vocab, &t->pairs, s, n, 0, &d->sc, &d->heap));
  bool same = d->list.len == d->heap.len &&
              memcmp(d->list.v, d->heap.v, d->list.len * sizeof *d->list.v) == 0;
  if (!same) {
    char hex[2 * 64 + 1];
    hex_of(hex, s, n);
    ck_abort_msg("list merge gives %zu ids, heap merge %zu, for the %zu-byte piece %s%s",
                 d->list.len, d->heap.len, n, hex, n > 64 ? "..." : "");
  }
  d->pieces++;
  if (n < 2 || n > DF_BPE_SHORT || !t->pairs.byte_rank) return;
  memcpy(d->held[d->n_held], s, n);
  d->held_len[d->n_held++] = n;
  /* batches of 1..DF_BPE_MANY lanes, as the encoder makes them */
  if (d->n_held == DF_BPE_MANY || (d->pieces % 7 == 0)) flush_many(d);
}

/* Every ordinary token whose bytes all have tokens (the merge's precondition). */
static void every_token(diff_ctx *d) {
  const df_vocab *v = &d->t->vocab;
  for (uint32_t id = 0; id < v->n_ids; id++) {
    if (v->kind[id] != DF_TOK_ORDINARY) continue;
    const uint8_t *p = (const uint8_t *)v->blob.data + v->off[id];
    bool ok = true;
    for (uint32_t i = 0; i < v->len[id] && ok; i++) ok = v->byte_id[p[i]] != UINT32_MAX;
    if (ok) same_ids(d, p, v->len[id]);
  }
}

/* A random ordinary token id whose bytes all have tokens, or UINT32_MAX. */
static uint32_t random_token(const df_vocab *v, unsigned *seed) {
  uint32_t id = (uint32_t)rand_r(seed) % v->n_ids;
  if (v->kind[id] != DF_TOK_ORDINARY || !v->len[id]) return UINT32_MAX;
  const uint8_t *p = (const uint8_t *)v->blob.data + v->off[id];
  for (uint32_t i = 0; i < v->len[id]; i++)
    if (v->byte_id[p[i]] == UINT32_MAX) return UINT32_MAX;
  return id;
}

/* Random bytes (those with a token), then random runs of tokens, each 1-300 bytes. */
static void random_pieces(diff_ctx *d, unsigned seed, int count) {
  const df_vocab *v = &d->t->vocab;
  uint8_t buf[300], bytes[256];
  size_t nb = 0;
  for (int b = 0; b < 256; b++)
    if (v->byte_id[b] != UINT32_MAX) bytes[nb++] = (uint8_t)b;
  ck_assert_uint_gt(nb, 0);
  for (int iter = 0; iter < count; iter++) {
    size_t n = 1 + (size_t)rand_r(&seed) % sizeof buf;
    for (size_t i = 0; i < n; i++) buf[i] = bytes[rand_r(&seed) % nb];
    same_ids(d, buf, n);
  }
  for (int iter = 0; iter < count; iter++) {
    size_t want = 1 + (size_t)rand_r(&seed) % sizeof buf, n = 0;
    while (n < want) {
      uint32_t id = random_token(v, &seed);
      if (id == UINT32_MAX) continue;
      size_t k = v->len[id] < want - n ? v->len[id] : want - n; /* the last one cut short */
      memcpy(buf + n, v->blob.data + v->off[id], k);
      n += k;
    }
    same_ids(d, buf, n);
  }
}

/* t[0..n), a token that holds part of a character, made whole characters: a lead byte before
 * leading continuation bytes, continuation bytes after a character cut short (a valid second
 * byte after E0, ED, F0, F4). Its length, or 0 when it cannot be (more than 3 continuation
 * bytes, bytes that are no UTF-8). */
static size_t made_whole(const uint8_t *t, size_t n, uint8_t *out) {
  size_t k = 0, o = 0;
  while (k < n && (t[k] & 0xC0) == 0x80) k++;
  if (k > 3) return 0;
  if (k) out[o++] = k == 1 ? 0xC3 : k == 2 ? 0xE5 : 0xF1;
  memcpy(out + o, t, n);
  o += n;
  size_t i = o - n + k; /* the last character's start, if it is cut short */
  for (size_t j = i; j < o;) {
    size_t want = out[j] < 0x80    ? 1
                  : out[j] >= 0xF0 ? 4
                  : out[j] >= 0xE0 ? 3
                  : out[j] >= 0xC0 ? 2
                                   : 0;
    if (!want) return 0;
    if (j + want <= o) {
      j += want;
      continue;
    }
    uint8_t lead = out[j];
    while (o < j + want) {
      bool second = o == j + 1;
      out[o++] = second && lead == 0xE0 ? 0xA0 : second && lead == 0xF0 ? 0x90 : 0x80;
    }
    break;
  }
  return df_utf8_valid((const char *)out, o) ? o : 0;
}

/* Valid UTF-8 pieces of up to 128 bytes around the tokens that join part of a character to
 * something else (made whole, so that the characters next to them are what text has there),
 * mixed with characters that are tokens of their own and ASCII: where list_init_chars takes a
 * character whole, and must not. */
static void joined_pieces(diff_ctx *d, unsigned seed, int count) {
  const df_vocab *v = &d->t->vocab;
  enum { MAXJ = 4096, MAXC = 4096 };
  static uint8_t joiners[MAXJ][160], chars[MAXC][4];
  static size_t jlen[MAXJ], clen[MAXC];
  size_t nj = 0, nc = 0;
  for (uint32_t id = 0; id < v->n_ids; id++) {
    const uint8_t *p = (const uint8_t *)v->blob.data + v->off[id];
    size_t n = v->len[id];
    if (v->kind[id] != DF_TOK_ORDINARY || n < 2 || n > 150) continue;
    size_t c = df_utf8_char_len(p, n);
    if (c == n && n <= 4 && nc < MAXC) {
      memcpy(chars[nc], p, n);
      clen[nc++] = n;
    } else if (!df_utf8_valid((const char *)p, n) && nj < MAXJ &&
               (jlen[nj] = made_whole(p, n, joiners[nj]))) {
      nj++;
    }
  }
  if (!nj || !nc) return; /* a vocabulary of whole characters only */
  uint8_t buf[128 + 160];
  for (int iter = 0; iter < count; iter++) {
    size_t want = 2 + (size_t)rand_r(&seed) % 127, n = 0;
    while (n < want) {
      int kind = rand_r(&seed) % 10;
      if (kind < 5) {
        size_t c = (size_t)rand_r(&seed) % nc;
        memcpy(buf + n, chars[c], clen[c]), n += clen[c];
      } else if (kind < 8) {
        size_t j = (size_t)rand_r(&seed) % nj;
        memcpy(buf + n, joiners[j], jlen[j]), n += jlen[j];
      } else {
        buf[n++] = " ab.\n"[rand_r(&seed) % 5];
      }
    }
    same_ids(d, buf, n > 128 ? 128 : n); /* (cut at 128: maybe mid-character, as bytes go) */
  }
}

static void check_vocabulary(const char *relative, unsigned seed) {
  char *path = df_test_fixture(relative);
  if (!path) return; /* the note says which fixture is absent */
  dflash_tokenizer *t = tt_load(path, NULL);
  diff_ctx d = {.t = t};
  every_token(&d);
  ck_assert_uint_gt(d.pieces, 1000); /* a real vocabulary, not an empty one */
  random_pieces(&d, seed, 3000);
  joined_pieces(&d, seed, 20000);
  flush_many(&d);
  ck_assert_uint_gt(d.many, 1000);
  free(d.list.v);
  free(d.heap.v);
  df_bpe_scratch_free(&d.sc);
  dflash_tokenizer_free(t);
  free(path);
}

START_TEST(list_equals_heap_o200k) {
  check_vocabulary("tokenizers/openai/o200k_base.tiktoken.gz", 200);
}
END_TEST

START_TEST(list_equals_heap_cl100k) {
  check_vocabulary("tokenizers/openai/cl100k_base.tiktoken.gz", 100);
}
END_TEST

START_TEST(list_equals_heap_qwen2) { check_vocabulary("tokenizers/qwen2", 2); }
END_TEST

/* Kimi K2's rank file, where a fixture has it (the oracles otherwise build Kimi's layout
 * from o200k's ranks, which list_equals_heap_o200k covers). */
START_TEST(list_equals_heap_kimi) { check_vocabulary("tokenizers/kimi-k2/tiktoken.model", 163); }
END_TEST

TCase *tc_tok_bpe_diff(void) {
  TCase *tc = tcase_create("bpe_diff");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, list_equals_heap_o200k);
  tcase_add_test(tc, list_equals_heap_cl100k);
  tcase_add_test(tc, list_equals_heap_qwen2);
  tcase_add_test(tc, list_equals_heap_kimi);
  return tc;
}
