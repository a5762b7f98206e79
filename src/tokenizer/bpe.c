/*
 * Byte-pair merging of one piece. Both paths apply the same rule as tiktoken
 * and Hugging Face: repeatedly merge the adjacent pair of lowest rank, the
 * leftmost one on ties. Short pieces scan a short list of the pairs that can
 * merge; long ones use a binary heap over a linked list, O(n log n), so a
 * megabyte without spaces is not quadratic.
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

#define DF_NIL UINT32_MAX

/* ---- list merge ----------------------------------------------------------- */

/*
 * Pieces up to the heap threshold. The tokens are a linked list over their first byte's
 * position, and the pairs that can merge are kept apart as (rank << 32 | position), so the
 * smallest entry is the lowest rank, leftmost. The pieces that reach BPE are mostly runs of
 * rare characters where few adjacent pairs merge: a round scans those few instead of the
 * whole piece (and relinks instead of moving the tail), which is what the O(n^2) flat array
 * spent its time on. at[p]: where the pair starting at token p sits in the list, or DF_NIL.
 */
typedef struct pair_list {
  uint32_t *ids, *next, *prev, *at;
  uint64_t *cand;
  uint32_t m, n;
} pair_list;

static void cand_drop(pair_list *l, uint32_t k) {
  l->at[(uint32_t)l->cand[k]] = DF_NIL;
  if (k != --l->m) {
    l->cand[k] = l->cand[l->m];
    l->at[(uint32_t)l->cand[k]] = k;
  }
}

/* Rank the pair starting at token p anew: its tokens changed. Inlined: two calls per merge,
 * and a call costs as much as the cached lookup. */
static inline __attribute__((always_inline)) void cand_set(pair_list *l, const df_pairmap *pairs,
                                                           uint64_t *cache, uint32_t p) {
  uint32_t q = l->next[p];
  uint32_t r = q < l->n ? pair_rank(pairs, cache, l->ids[p], l->ids[q]) : UINT32_MAX;
  uint32_t k = l->at[p];
  if (r == UINT32_MAX) {
    if (k != DF_NIL) cand_drop(l, k);
    return;
  }
  if (k == DF_NIL) l->at[p] = k = l->m++;
  l->cand[k] = (uint64_t)r << 32 | p;
}

/* First round: every pair is two bytes, ranked from the 256x256 table. */
static void list_init(pair_list *l, const df_pairmap *pairs, const uint32_t *byte_id,
                      const uint8_t *piece) {
  uint32_t n = l->n;
  for (uint32_t i = 0; i < n; i++) {
    l->ids[i] = byte_id[piece[i]];
    l->next[i] = i + 1;
    l->prev[i] = i - 1; /* DF_NIL for the first */
    l->at[i] = DF_NIL;
  }
  const uint32_t *byte_rank = pairs->byte_rank;
  for (uint32_t i = 0; i + 1 < n; i++) {
    uint32_t r = byte_rank[piece[i] << 8 | piece[i + 1]];
    if (r == UINT32_MAX) continue;
    l->at[i] = l->m;
    l->cand[l->m++] = (uint64_t)r << 32 | i;
  }
}

/* list_init where a character may start whole (df_pairmap_char_tokens): a character of 2-4
 * bytes with a token of its own, and no marked byte pair at either end, is one token of the
 * list from the start (at its first byte's position, so ties still go leftmost). On o200k's
 * first-sight CJK pieces 85,573 of their 107,431 characters are, and 171,138 of 260,384 merges
 * are not made. The other pairs are ranked from the bytes' table or looked up. */
static void list_init_chars(pair_list *l, const df_pairmap *pairs, uint64_t *cache,
                            const uint32_t *byte_id, const uint8_t *piece) {
  uint32_t n = l->n, prev = DF_NIL;
  for (uint32_t i = 0; i < n;) {
    uint32_t len = 1, id = byte_id[piece[i]];
    if (piece[i] >= 0xC2) {
      uint32_t k = (uint32_t)df_utf8_char_len(piece + i, n - i);
      uint32_t t = k ? df_pairmap_char_token(pairs, piece + i, k) : UINT32_MAX;
      /* (followed by a byte that starts a character: the marks are of such pairs only, and
       * only text that is not UTF-8 has a continuation byte there) */
      if (t != UINT32_MAX && (i == 0 || !df_pairmap_joined(pairs, piece[i - 1], piece[i])) &&
          (i + k == n || ((piece[i + k] & 0xC0) != 0x80 &&
                          !df_pairmap_joined(pairs, piece[i + k - 1], piece[i + k]))))
        len = k, id = t;
    }
    l->ids[i] = id;
    l->prev[i] = prev;
    l->at[i] = DF_NIL;
    if (prev != DF_NIL) l->next[prev] = i;
    prev = i;
    i += len;
  }
  l->next[prev] = n;
  for (uint32_t i = 0, j; (j = l->next[i]) < n; i = j) {
    bool bytes = j == i + 1 && l->next[j] == j + 1;
    uint32_t r = bytes ? pairs->byte_rank[piece[i] << 8 | piece[j]]
                       : pair_rank(pairs, cache, l->ids[i], l->ids[j]);
    if (r == UINT32_MAX) continue;
    l->at[i] = l->m;
    l->cand[l->m++] = (uint64_t)r << 32 | i;
  }
}

/* Merge piece[0..n) (n >= 2) and append the ids to out. s holds n ids and n heap slots. */
static dflash_status merge_list(const df_pairmap *pairs, uint64_t *cache, const uint32_t *byte_id,
                                const uint8_t *piece, df_bpe_scratch *s, size_t n, df_ids *out) {
  if (df_ids_reserve(out, n)) return DFLASH_E_NOMEM;
  pair_list l = {s->ids, s->next, s->prev, s->rank, s->heap, 0, (uint32_t)n};
  if (pairs->char_block) list_init_chars(&l, pairs, cache, byte_id, piece);
  else list_init(&l, pairs, byte_id, piece);
  while (l.m) {
    uint32_t b = 0;
    for (uint32_t k = 1; k < l.m; k++)
      if (l.cand[k] < l.cand[b]) b = k;
    uint32_t i = (uint32_t)l.cand[b], j = l.next[i];
    l.ids[i] = df_pairmap_merged(pairs, (uint32_t)(l.cand[b] >> 32));
    if (l.at[j] != DF_NIL) cand_drop(&l, l.at[j]);
    l.next[i] = l.next[j];
    if (l.next[i] < n) l.prev[l.next[i]] = i;
    cand_set(&l, pairs, cache, i);
    if (l.prev[i] != DF_NIL) cand_set(&l, pairs, cache, l.prev[i]);
  }
  for (uint32_t i = 0; i < n; i = l.next[i]) out->v[out->len++] = (int32_t)l.ids[i];
  return DFLASH_OK;
}

/* ---- several short merges at once ----------------------------------------- */

/*
 * A merge's rounds form a chain: which pair merges decides which pairs are ranked next, and
 * each ranking is a load from a table of megabytes, cold where the piece cache's traffic evicts
 * it (a merge took 1,830 cycles, 480 the second time with its lines warm: src/tokenizer/README.md,
 * "Where a miss's time goes"). The merges of different pieces are independent, so up to
 * DF_BPE_MANY of them run in turn, a round each: a lane merges, prefetches the table slots of
 * the two pairs it must rank next, and ranks them only on its next turn, while the other lanes'
 * rounds run. One lane's state: the ids and, rank[k], the rank of (ids[k], ids[k + 1]),
 * UINT32_MAX past the last pair; arrays padded so that the tail's shift reads and writes inside.
 */
enum { LANE_PAD = 2 * DF_BPE_SHORT + 2, LANE_NONE = UINT32_MAX };
typedef struct bpe_lane {
  uint32_t ids[LANE_PAD], rank[LANE_PAD];
  uint32_t m;  /* tokens left */
  uint32_t at; /* the last merge's position, whose two pairs wait to be ranked; or LANE_NONE */
} bpe_lane;

/* A lane's rank of (a, b): the table's slot, without the pair cache and the filter (each a
 * dependent load before it in pair_rank): one line for a pair that merges and one that does
 * not alike, as the table is at most half full, and lane_round prefetched it a turn before.
 * (Through the pair cache, with its line prefetched too, the lanes were no faster than one
 * merge at a time: drv4, English 115.6 against 116.2 MB/CPU-s.) */
static inline uint32_t lane_rank(const df_pairmap *m, uint32_t a, uint32_t b) {
  return df_pairmap_probe(m, df_pair_key(a, b));
}

static void shift_down(uint32_t *v, uint32_t at) { /* v[at..at + 32) = v[at + 1..at + 33) */
  uint32_t t[DF_BPE_SHORT];
  memcpy(t, v + at + 1, sizeof t);
  memcpy(v + at, t, sizeof t);
}

static void lane_init(bpe_lane *l, const df_vocab *v, const df_pairmap *pairs, const uint8_t *p,
                      uint32_t n) {
  l->m = n;
  l->at = LANE_NONE;
  /* the entries past the piece are shifted down but never read: left unwritten (filling them,
   * a memset and a loop, was 1-2 % of English and code in drv4) */
  for (uint32_t i = 0; i < n; i++) l->ids[i] = v->byte_id[p[i]];
  for (uint32_t i = 0; i + 1 < n; i++) l->rank[i] = pairs->byte_rank[p[i] << 8 | p[i + 1]];
}

/* One round of lane l: rank the pairs its last merge made, merge the least (rank << 32 |
 * position: lowest rank, leftmost), prefetch the next pairs' slots. False when nothing merges. */
static bool lane_round(bpe_lane *l, const df_pairmap *pairs) {
  if (l->at != LANE_NONE) {
    uint32_t i = l->at;
    l->rank[i] = i + 1 < l->m ? lane_rank(pairs, l->ids[i], l->ids[i + 1]) : UINT32_MAX;
    if (i) l->rank[i - 1] = lane_rank(pairs, l->ids[i - 1], l->ids[i]);
  }
  uint64_t best = UINT64_MAX;
  for (uint32_t k = 0; k + 1 < l->m; k++) {
    uint64_t v = (uint64_t)l->rank[k] << 32 | k;
    best = v < best ? v : best; /* no branch: which pair wins is data */
  }
  if (best >> 32 == UINT32_MAX) return false;
  uint32_t i = (uint32_t)best;
  l->ids[i] = df_pairmap_merged(pairs, (uint32_t)(best >> 32));
  shift_down(l->ids, i + 1); /* ids[i + 1] is gone; rank[i + 1] was its pair */
  shift_down(l->rank, i + 1);
  l->m--;
  if (i + 1 < l->m) df_pairmap_prefetch(pairs, l->ids[i], l->ids[i + 1]);
  if (i) df_pairmap_prefetch(pairs, l->ids[i - 1], l->ids[i]);
  l->at = i;
  return true;
}

void df_bpe_merge_many(const df_vocab *v, const df_pairmap *pairs, const uint8_t *const *piece,
                       const size_t *len, size_t k, uint32_t (*ids)[DF_BPE_SHORT], uint8_t *count) {
  bpe_lane lanes[DF_BPE_MANY];
  unsigned live = 0;
  for (size_t j = 0; j < k; j++) {
    lane_init(&lanes[j], v, pairs, piece[j], (uint32_t)len[j]);
    live |= 1u << j;
  }
  while (live)
    for (size_t j = 0; j < k; j++)
      if (live >> j & 1 && !lane_round(&lanes[j], pairs)) {
        memcpy(ids[j], lanes[j].ids, lanes[j].m * sizeof *lanes[j].ids);
        count[j] = (uint8_t)lanes[j].m;
        live &= ~(1u << j);
      }
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

static void heap_update(const df_pairmap *pairs, df_bpe_scratch *s, size_t *hn, uint32_t i) {
  uint32_t j = s->next[i];
  s->rank[i] = j == DF_NIL ? UINT32_MAX : pair_rank(pairs, s->pair_cache, s->ids[i], s->ids[j]);
  if (s->rank[i] != UINT32_MAX) heap_push(s->heap, hn, (uint64_t)s->rank[i] << 32 | i);
}

static dflash_status heap_reserve(df_bpe_scratch *s, size_t n) {
  if (s->heap_cap >= n) return DFLASH_OK;
  uint64_t *h = realloc(s->heap, n * sizeof *h);
  if (!h) return df_error_nomem("BPE heap");
  s->heap = h;
  s->heap_cap = n;
  return DFLASH_OK;
}

static dflash_status merge_heap(const df_pairmap *pairs, df_bpe_scratch *s, size_t n, df_ids *out) {
  if (heap_reserve(s, 3 * n)) return DFLASH_E_NOMEM;
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
  if (n > heap_threshold || !pairs->byte_rank) { /* the list needs df_pairmap_byte_ranks */
    for (size_t i = 0; i < n; i++) s->ids[i] = v->byte_id[piece[i]];
    return merge_heap(pairs, s, n, out);
  }
  if (heap_reserve(s, n)) return DFLASH_E_NOMEM;
  return merge_list(pairs, s->pair_cache, v->byte_id, piece, s, n, out);
}
