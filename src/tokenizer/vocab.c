/* Token table (id -> bytes), bytes -> id hash, and the merge-pair map. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

uint64_t df_hash_bytes(const void *p, size_t n) {
  const uint8_t *s = p;
  uint64_t h = 0x243F6A8885A308D3ull ^ (n * 0x9E3779B97F4A7C15ull);
  while (n >= 8) {
    uint64_t w;
    memcpy(&w, s, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    s += 8;
    n -= 8;
  }
  uint64_t w = 0;
  memcpy(&w, s, n); /* n < 8 */
  h = (h ^ w) * 0x94D049BB133111EBull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 32);
}

dflash_status df_vocab_init(df_vocab *v, uint32_t n_ids) {
  memset(v, 0, sizeof *v);
  v->n_ids = n_ids;
  v->off = calloc(n_ids ? n_ids : 1, sizeof *v->off);
  v->len = calloc(n_ids ? n_ids : 1, sizeof *v->len);
  v->kind = calloc(n_ids ? n_ids : 1, 1);
  if (!v->off || !v->len || !v->kind) return df_error_nomem("vocabulary");
  for (int b = 0; b < 256; b++) v->byte_id[b] = UINT32_MAX;
  return DFLASH_OK;
}

void df_vocab_free(df_vocab *v) {
  free(v->off);
  free(v->len);
  free(v->kind);
  free(v->slot_id);
  free(v->slot_hash);
  df_buf_free(&v->blob);
  memset(v, 0, sizeof *v);
}

dflash_status df_vocab_set(df_vocab *v, uint32_t id, const void *bytes, size_t len, int kind) {
  if (id >= v->n_ids) return df_error(DFLASH_E_RANGE, "token id %u outside [0, %u)", id, v->n_ids);
  if (v->kind[id] != DF_TOK_NONE) return df_error(DFLASH_E_DUPLICATE, "token id %u appears twice", id);
  if (len > UINT32_MAX || v->blob.len + len > UINT32_MAX)
    return df_error(DFLASH_E_OVERFLOW, "token bytes exceed 4 GiB");
  v->off[id] = (uint32_t)v->blob.len;
  v->len[id] = (uint32_t)len;
  v->kind[id] = (uint8_t)kind;
  if (len && df_buf_append(&v->blob, bytes, len)) return DFLASH_E_NOMEM;
  if (kind == DF_TOK_ORDINARY && len == 1 && v->byte_id[*(const uint8_t *)bytes] == UINT32_MAX)
    v->byte_id[*(const uint8_t *)bytes] = id;
  return DFLASH_OK;
}

static bool same_bytes(const df_vocab *v, uint32_t id, const void *bytes, size_t len) {
  return v->len[id] == len && memcmp(v->blob.data + v->off[id], bytes, len) == 0;
}

uint32_t df_vocab_find(const df_vocab *v, const void *bytes, size_t len) {
  if (!v->slot_id) return UINT32_MAX;
  uint32_t h = (uint32_t)df_hash_bytes(bytes, len);
  for (uint32_t i = h & v->mask;; i = (i + 1) & v->mask) {
    uint32_t s = v->slot_id[i];
    if (!s) return UINT32_MAX;
    if (v->slot_hash[i] == h && same_bytes(v, s - 1, bytes, len)) return s - 1;
  }
}

dflash_status df_vocab_index(df_vocab *v, bool strict, const char *what) {
  uint32_t cap = 16;
  while (cap < v->n_ids * 2u && cap < (1u << 31)) cap <<= 1;
  v->mask = cap - 1;
  v->slot_id = calloc(cap, sizeof *v->slot_id);
  v->slot_hash = calloc(cap, sizeof *v->slot_hash);
  if (!v->slot_id || !v->slot_hash) return df_error_nomem("vocabulary index");
  for (uint32_t id = 0; id < v->n_ids; id++) {
    if (v->kind[id] != DF_TOK_ORDINARY) continue;
    const char *bytes = v->blob.data + v->off[id];
    uint32_t h = (uint32_t)df_hash_bytes(bytes, v->len[id]);
    uint32_t i = h & v->mask;
    for (; v->slot_id[i]; i = (i + 1) & v->mask) {
      uint32_t other = v->slot_id[i] - 1;
      if (v->slot_hash[i] != h || !same_bytes(v, other, bytes, v->len[id])) continue;
      if (strict)
        return df_error(DFLASH_E_DUPLICATE, "%s: tokens %u and %u have the same bytes", what,
                        other, id);
      break; /* lower id already there */
    }
    if (!v->slot_id[i]) {
      v->slot_id[i] = id + 1;
      v->slot_hash[i] = h;
    }
  }
  for (int b = 0; b < 256; b++)
    if (v->byte_id[b] == UINT32_MAX)
      return df_error(DFLASH_E_FORMAT,
                      "%s: no token for the single byte 0x%02x (not a byte-level BPE vocabulary?)",
                      what, b);
  return DFLASH_OK;
}

dflash_status df_pairmap_init(df_pairmap *m, size_t expected) {
  memset(m, 0, sizeof *m);
  size_t cap = 64;
  while (cap < expected * 2) cap <<= 1;
  m->mask = cap - 1;
  m->keys = malloc(cap * sizeof *m->keys);
  m->rank = malloc(cap * sizeof *m->rank);
  m->merged = malloc(cap * sizeof *m->merged);
  if (!m->keys || !m->rank || !m->merged) return df_error_nomem("merge table");
  memset(m->keys, 0xFF, cap * sizeof *m->keys);
  return DFLASH_OK;
}

void df_pairmap_free(df_pairmap *m) {
  free(m->keys);
  free(m->rank);
  free(m->merged);
  memset(m, 0, sizeof *m);
}

static dflash_status pairmap_grow(df_pairmap *m) {
  df_pairmap bigger;
  if (df_pairmap_init(&bigger, (m->mask + 1)) != DFLASH_OK) return DFLASH_E_NOMEM;
  for (size_t i = 0; i <= m->mask; i++) {
    if (m->keys[i] == UINT64_MAX) continue;
    size_t j = df_pair_slot(m->keys[i], bigger.mask);
    while (bigger.keys[j] != UINT64_MAX) j = (j + 1) & bigger.mask;
    bigger.keys[j] = m->keys[i];
    bigger.rank[j] = m->rank[i];
    bigger.merged[j] = m->merged[i];
  }
  bigger.count = m->count;
  df_pairmap_free(m);
  *m = bigger;
  return DFLASH_OK;
}

dflash_status df_pairmap_put(df_pairmap *m, uint32_t a, uint32_t b, uint32_t rank, uint32_t merged) {
  if ((m->count + 1) * 2 > m->mask + 1 && pairmap_grow(m)) return DFLASH_E_NOMEM;
  uint64_t key = df_pair_key(a, b);
  size_t i = df_pair_slot(key, m->mask);
  for (; m->keys[i] != UINT64_MAX; i = (i + 1) & m->mask)
    if (m->keys[i] == key) return DFLASH_OK;
  m->keys[i] = key;
  m->rank[i] = rank;
  m->merged[i] = merged;
  m->count++;
  return DFLASH_OK;
}

dflash_status df_pairmap_from_ranks(df_pairmap *m, const df_vocab *v) {
  if (df_pairmap_init(m, (size_t)v->n_ids * 4)) return DFLASH_E_NOMEM;
  for (uint32_t id = 0; id < v->n_ids; id++) {
    if (v->kind[id] != DF_TOK_ORDINARY || v->len[id] < 2) continue;
    const char *s = v->blob.data + v->off[id];
    for (uint32_t cut = 1; cut < v->len[id]; cut++) {
      uint32_t a = df_vocab_find(v, s, cut);
      if (a == UINT32_MAX) continue;
      uint32_t b = df_vocab_find(v, s + cut, v->len[id] - cut);
      if (b == UINT32_MAX) continue;
      if (df_pairmap_put(m, a, b, id, id)) return DFLASH_E_NOMEM;
    }
  }
  return DFLASH_OK;
}
