/*
 * Byte-pair merging of one piece. Both paths apply the same rule as tiktoken
 * and Hugging Face: repeatedly merge the adjacent pair of lowest rank, the
 * leftmost one on ties. Short pieces use a flat array (cache friendly);
 * long ones a binary heap over a linked list, O(n log n), so a megabyte
 * without spaces is not quadratic.
 */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

dflash_status df_ids_reserve(df_ids *ids, size_t n) {
  if (ids->cap - ids->len >= n) return DFLASH_OK;
  size_t cap = ids->cap ? ids->cap : 256;
  while (cap - ids->len < n) cap *= 2;
  int32_t *v = realloc(ids->v, cap * sizeof *v);
  if (!v) return df_error_nomem("token ids");
  ids->v = v;
  ids->cap = cap;
  return DFLASH_OK;
}

dflash_status df_ids_push(df_ids *ids, int32_t id) {
  if (ids->len == ids->cap && df_ids_reserve(ids, 1)) return DFLASH_E_NOMEM;
  ids->v[ids->len++] = id;
  return DFLASH_OK;
}

/* df_pairmap_rank through the scratch's pair cache: a slot holds the key and the rank as the
 * table does, with an all-ones rank for a pair that does not merge. */
#define NO_MERGE ((1u << DF_PAIR_RANK_BITS) - 1)
static inline uint32_t pair_rank(const df_pairmap *m, uint64_t *cache, uint32_t a, uint32_t b) {
  if (!cache) return df_pairmap_rank(m, a, b);
  uint64_t key = df_pair_key(a, b);
  uint64_t *slot = &cache[(key * 0x9E3779B97F4A7C15ull) >> (64 - DF_PAIR_CACHE_BITS)];
  if (*slot >> DF_PAIR_RANK_BITS == key) {
    uint32_t r = (uint32_t)(*slot & NO_MERGE);
    return r == NO_MERGE ? UINT32_MAX : r;
  }
  uint32_t r = df_pairmap_rank(m, a, b);
  *slot = key << DF_PAIR_RANK_BITS | (r == UINT32_MAX ? NO_MERGE : r);
  return r;
}

void df_bpe_scratch_free(df_bpe_scratch *s) {
  free(s->ids);
  free(s->rank);
  free(s->prev);
  free(s->next);
  free(s->heap);
  uint64_t *cache = s->pair_cache; /* not ours */
  memset(s, 0, sizeof *s);
  s->pair_cache = cache;
}

static dflash_status scratch_reserve(df_bpe_scratch *s, size_t n) {
  if (n <= s->cap) return DFLASH_OK;
  size_t cap = s->cap ? s->cap : 64;
  while (cap < n) cap *= 2;
  uint32_t **arrays[] = {&s->ids, &s->rank, &s->prev, &s->next};
  for (size_t k = 0; k < DF_ARRAY_LEN(arrays); k++) {
    uint32_t *p = realloc(*arrays[k], cap * sizeof *p);
    if (!p) return df_error_nomem("BPE scratch");
    *arrays[k] = p;
  }
  s->cap = cap;
  return DFLASH_OK;
}

static dflash_status emit(df_ids *out, const uint32_t *ids, size_t n) {
  if (df_ids_reserve(out, n)) return DFLASH_E_NOMEM;
  for (size_t i = 0; i < n; i++) out->v[out->len++] = (int32_t)ids[i];
  return DFLASH_OK;
}

/* Flat array merge: O(n^2) worst case, fastest for the short pieces of real text. */
static size_t merge_flat(const df_pairmap *pairs, uint64_t *cache, const uint32_t *byte_id,
                         const uint8_t *piece, uint32_t *ids, uint32_t *rank, size_t n) {
  if (pairs->byte_rank) { /* first round: every pair is two bytes */
    for (size_t i = 0; i + 1 < n; i++) {
      ids[i] = byte_id[piece[i]];
      rank[i] = pairs->byte_rank[piece[i] << 8 | piece[i + 1]];
    }
    ids[n - 1] = byte_id[piece[n - 1]];
  } else {
    for (size_t i = 0; i < n; i++) ids[i] = byte_id[piece[i]];
    /* The pair table is larger than the cache: start every first-round miss at once. */
    for (size_t i = 0; i + 1 < n; i++) df_pairmap_prefetch(pairs, ids[i], ids[i + 1]);
    for (size_t i = 0; i + 1 < n; i++) rank[i] = df_pairmap_rank(pairs, ids[i], ids[i + 1]);
  }
  rank[n - 1] = UINT32_MAX;
  while (n > 1) {
    size_t best = 0;
    uint32_t best_rank = rank[0];
    for (size_t i = 1; i + 1 < n; i++)
      if (rank[i] < best_rank) best_rank = rank[i], best = i;
    if (best_rank == UINT32_MAX) break;
    ids[best] = df_pairmap_merged(pairs, best_rank);
    size_t tail = n - best - 2;
    memmove(ids + best + 1, ids + best + 2, tail * sizeof *ids);
    memmove(rank + best + 1, rank + best + 2, tail * sizeof *rank);
    n--;
    rank[n - 1] = UINT32_MAX;
    if (!cache && best + 1 < n) df_pairmap_prefetch(pairs, ids[best], ids[best + 1]);
    if (!cache && best > 0) df_pairmap_prefetch(pairs, ids[best - 1], ids[best]);
    if (best + 1 < n) rank[best] = pair_rank(pairs, cache, ids[best], ids[best + 1]);
    if (best > 0) rank[best - 1] = pair_rank(pairs, cache, ids[best - 1], ids[best]);
  }
  return n;
}

/* ---- heap merge ----------------------------------------------------------- */

/* Min-heap of (rank << 32 | position): lowest rank first, then leftmost. */
static void heap_push(uint64_t *h, size_t *n, uint64_t v) {
  size_t i = (*n)++;
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (h[p] <= v) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n) {
  uint64_t top = h[0], v = h[--*n];
  size_t i = 0, len = *n;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= len) break;
    if (c + 1 < len && h[c + 1] < h[c]) c++;
    if (v <= h[c]) break;
    h[i] = h[c];
    i = c;
  }
  if (len) h[i] = v;
  return top;
}

#define DF_NIL UINT32_MAX

static void heap_update(const df_pairmap *pairs, df_bpe_scratch *s, size_t *hn, uint32_t i) {
  uint32_t j = s->next[i];
  s->rank[i] = j == DF_NIL ? UINT32_MAX : pair_rank(pairs, s->pair_cache, s->ids[i], s->ids[j]);
  if (s->rank[i] != UINT32_MAX) heap_push(s->heap, hn, (uint64_t)s->rank[i] << 32 | i);
}

static dflash_status merge_heap(const df_pairmap *pairs, df_bpe_scratch *s, size_t n, df_ids *out) {
  if (s->heap_cap < 3 * n) {
    uint64_t *h = realloc(s->heap, 3 * n * sizeof *h);
    if (!h) return df_error_nomem("BPE heap");
    s->heap = h;
    s->heap_cap = 3 * n;
  }
  size_t hn = 0;
  for (uint32_t i = 0; i < n; i++) {
    s->prev[i] = i ? i - 1 : DF_NIL;
    s->next[i] = i + 1 < n ? i + 1 : DF_NIL;
  }
  for (uint32_t i = 0; i < n; i++) heap_update(pairs, s, &hn, i);
  while (hn) {
    uint64_t top = heap_pop(s->heap, &hn);
    uint32_t i = (uint32_t)top, r = (uint32_t)(top >> 32);
    if (s->rank[i] != r) continue; /* stale: the pair at i changed since */
    uint32_t j = s->next[i];
    s->ids[i] = df_pairmap_merged(pairs, r);
    s->next[i] = s->next[j];
    if (s->next[j] != DF_NIL) s->prev[s->next[j]] = i;
    s->rank[j] = UINT32_MAX; /* j is gone */
    heap_update(pairs, s, &hn, i);
    if (s->prev[i] != DF_NIL) heap_update(pairs, s, &hn, s->prev[i]);
  }
  for (uint32_t i = 0; i != DF_NIL; i = s->next[i])
    if (df_ids_push(out, (int32_t)s->ids[i])) return DFLASH_E_NOMEM;
  return DFLASH_OK;
}

dflash_status df_bpe_encode(const df_vocab *v, const df_pairmap *pairs, const uint8_t *piece,
                            size_t n, size_t heap_threshold, df_bpe_scratch *s, df_ids *out) {
  if (n == 0) return DFLASH_OK;
  if (n == 1) return df_ids_push(out, (int32_t)v->byte_id[piece[0]]);
  if (n > UINT32_MAX - 1) return df_error(DFLASH_E_OVERFLOW, "piece of %zu bytes", n);
  if (scratch_reserve(s, n)) return DFLASH_E_NOMEM;
  if (n > heap_threshold) {
    for (size_t i = 0; i < n; i++) s->ids[i] = v->byte_id[piece[i]];
    return merge_heap(pairs, s, n, out);
  }
  size_t m = merge_flat(pairs, s->pair_cache, v->byte_id, piece, s->ids, s->rank, n);
  return emit(out, s->ids, m);
}
