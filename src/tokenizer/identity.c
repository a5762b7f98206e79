/* dflash_tokenizer_hash: a SHA-256 (OpenSSL's libcrypto) over what decides the ids a loaded
 * tokenizer gives a text, read from the loaded tables, not from its files' bytes: a
 * tokenizer_config.json with another model_max_length or chat template, or a tokenizer.json
 * with its keys in another order, is the same tokenizer and hashes the same. */
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>

#include "tok_internal.h"

/* Bumped whenever what is fed below changes, so two layouts never compare equal. */
static const char DOMAIN[] = "dflash-tokenizer-ids 1";

typedef struct {
  EVP_MD_CTX *md;
  bool failed;
} feed;

static void bytes(feed *f, const void *p, size_t n) {
  if (!f->failed && n && !EVP_DigestUpdate(f->md, p, n)) f->failed = true;
}

static void u64(feed *f, uint64_t v) {
  uint8_t b[8];
  for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
  bytes(f, b, 8);
}

/* A length-prefixed string, so that consecutive strings cannot run into each other. */
static void str(feed *f, const void *p, size_t n) {
  u64(f, n);
  bytes(f, p, n);
}

/* Every id's bytes and kind (ordinary, special, added; unused ids as kind 0). */
static void feed_vocab(feed *f, const df_vocab *v) {
  u64(f, v->n_ids);
  for (uint32_t id = 0; id < v->n_ids; id++) {
    u64(f, v->kind[id]);
    str(f, v->blob.data + v->off[id], v->len[id]);
  }
}

static int by_value(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

/* The merges as (rank, left, right, merged) in rank order: the table's slot order depends on
 * its size, not on the merges. tiktoken's pairs follow from the ranks (already fed). A table
 * that ranks by merged id (df_pairmap_ids_as_ranks) sorts the same way, and its k-th entry is
 * then the k-th rank that rank_merged holds: the hash is the same either way. */
static dflash_status feed_pairs(feed *f, const df_pairmap *m) {
  const uint32_t *merged = m->merged_of_rank ? m->merged_of_rank : m->rank_merged;
  if (!merged) return DFLASH_OK;
  uint64_t *all = malloc((m->count ? m->count : 1) * sizeof *all);
  if (!all) return df_error_nomem("tokenizer hash");
  size_t n = 0;
  for (size_t i = 0; i <= m->mask && n < m->count; i++) {
    uint64_t s = m->slots[i];
    if (s == UINT64_MAX) continue;
    uint64_t rank = s & ((1u << DF_PAIR_RANK_BITS) - 1);
    all[n++] = rank << (2 * DF_PAIR_ID_BITS) | s >> DF_PAIR_RANK_BITS;
  }
  qsort(all, n, sizeof *all, by_value);
  u64(f, n);
  const uint64_t pair = ((uint64_t)1 << (2 * DF_PAIR_ID_BITS)) - 1;
  for (size_t i = 0, r = 0; i < n; i++) {
    uint64_t rank = all[i] >> (2 * DF_PAIR_ID_BITS);
    if (!m->merged_of_rank) { /* the k-th rank in the list */
      while (r < m->n_ranks && merged[r] == DF_PAIR_NO_MERGE) r++;
      rank = r++;
    }
    u64(f, rank << (2 * DF_PAIR_ID_BITS) | (all[i] & pair));
    u64(f, rank < m->n_ranks ? merged[rank] : DF_PAIR_NO_MERGE);
  }
  free(all);
  return DFLASH_OK;
}

static int by_id(const void *a, const void *b) {
  uint32_t x = (*(const df_added *const *)a)->id, y = (*(const df_added *const *)b)->id;
  return (x > y) - (x < y);
}

/* Added tokens in id order (a file may list them in any order), with how they match. */
static dflash_status feed_added(feed *f, const dflash_tokenizer *t) {
  const df_added **order = malloc((t->n_added ? t->n_added : 1) * sizeof *order);
  if (!order) return df_error_nomem("tokenizer hash");
  for (size_t i = 0; i < t->n_added; i++) order[i] = &t->added[i];
  qsort(order, t->n_added, sizeof *order, by_id);
  u64(f, t->n_added);
  for (size_t i = 0; i < t->n_added; i++) {
    const df_added *a = order[i];
    u64(f, a->id);
    str(f, a->text, a->len);
    u64(f, (uint64_t)a->special | (uint64_t)a->lstrip << 1 | (uint64_t)a->rstrip << 2 |
               (uint64_t)a->normalized << 3);
  }
  free(order);
  return DFLASH_OK;
}

/* The pre-tokenizer's steps; which scanner runs a named pattern is not fed (it matches what
 * the regex matches, and an environment variable can turn it off). */
static void feed_pretok(feed *f, const df_pretok *p) {
  u64(f, p->n_steps);
  for (size_t i = 0; i < p->n_steps; i++) {
    const df_pretok_step *s = &p->steps[i];
    u64(f, (uint64_t)s->kind | (uint64_t)s->behavior << 8 | (uint64_t)s->invert << 16 |
               (uint64_t)s->keep_gaps << 17 | (uint64_t)s->individual_digits << 18 |
               (uint64_t)s->literal << 19);
    str(f, s->source ? s->source : "", s->source ? strlen(s->source) : 0);
  }
}

static dflash_status feed_all(feed *f, const dflash_tokenizer *t) {
  bytes(f, DOMAIN, sizeof DOMAIN);
  u64(f, (uint64_t)t->family | (uint64_t)t->whole_piece_lookup << 8 | (uint64_t)t->nfc << 9 |
             (uint64_t)t->vocab.byte_gaps << 10);
  feed_vocab(f, &t->vocab);
  dflash_status st = feed_pairs(f, &t->pairs);
  if (!st) st = feed_added(f, t);
  if (!st) feed_pretok(f, &t->pretok);
  return st;
}

dflash_status dflash_tokenizer_hash(const dflash_tokenizer *tok, char *out, size_t cap) {
  DF_CHECK_ARG(tok && out);
  if (cap < DFLASH_TOKENIZER_HASH_LEN)
    return df_error(DFLASH_E_BUFFER, "tokenizer hash needs %d bytes, got %zu",
                    DFLASH_TOKENIZER_HASH_LEN, cap);
  feed f = {.md = EVP_MD_CTX_new()};
  if (!f.md) return df_error_nomem("SHA-256 context");
  f.failed = !EVP_DigestInit_ex(f.md, EVP_sha256(), NULL);
  dflash_status st = feed_all(&f, tok);
  unsigned char d[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (!st && (f.failed || !EVP_DigestFinal_ex(f.md, d, &n) || n != 32))
    st = df_error(DFLASH_E_IO, "tokenizer hash: SHA-256 failed in libcrypto");
  EVP_MD_CTX_free(f.md);
  if (st) return st;
  memcpy(out, "sha256:", 7);
  for (unsigned i = 0; i < n; i++) snprintf(out + 7 + 2 * i, 3, "%02x", d[i]);
  return DFLASH_OK;
}
