/* Token table (id -> bytes), bytes -> id hash, and the merge-pair map. */
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>

#include "tok_internal.h"

uint64_t df_hash_long(const void *p, size_t n) {
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
  uint64_t w = df_load_upto8(s, n); /* n < 8 */
  h = (h ^ w) * 0x94D049BB133111EBull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  return h ^ (h >> 32);
}

void *df_big_alloc(size_t size) {
  enum { HUGE = 1 << 21 };
  if (size < HUGE) return malloc(size);
  size = (size + HUGE - 1) & ~(size_t)(HUGE - 1); /* aligned_alloc wants a multiple */
  void *p = aligned_alloc(HUGE, size);
#ifdef MADV_HUGEPAGE
  if (p) (void)madvise(p, size, MADV_HUGEPAGE); /* before the first touch: no 4 KiB pages yet */
#endif
  return p;
}

dflash_status df_filter_init(df_filter *f, size_t n) {
  size_t words = 64;
  while (words * 64 < n * 10) words <<= 1;
  f->words = calloc(words, sizeof *f->words);
  if (!f->words) return df_error_nomem("membership filter");
  f->mask = (uint32_t)(words - 1);
  return DFLASH_OK;
}

void df_filter_free(df_filter *f) {
  free(f->words);
  memset(f, 0, sizeof *f);
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
  free(v->slots);
  df_filter_free(&v->filter);
  df_buf_free(&v->blob);
  memset(v, 0, sizeof *v);
}

dflash_status df_vocab_set(df_vocab *v, uint32_t id, const void *bytes, size_t len, int kind) {
  if (id >= v->n_ids) return df_error(DFLASH_E_RANGE, "token id %u outside [0, %u)", id, v->n_ids);
  if (v->kind[id] != DF_TOK_NONE)
    return df_error(DFLASH_E_DUPLICATE, "token id %u appears twice", id);
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

static uint64_t head8(const void *bytes, size_t len) {
  return df_load_upto8(bytes, len < 8 ? len : 8);
}

static bool slot_matches(const df_vocab *v, const df_vslot *s, uint64_t head, const void *bytes,
                         size_t len) {
  if (s->len != len || s->head != head) return false;
  return len <= 8 ||
         memcmp(v->blob.data + v->off[s->id_plus1 - 1] + 8, (const char *)bytes + 8, len - 8) == 0;
}

uint32_t df_vocab_find(const df_vocab *v, const void *bytes, size_t len) {
  return df_vocab_find_h(v, bytes, len, df_hash_bytes(bytes, len));
}

uint32_t df_vocab_find_h(const df_vocab *v, const void *bytes, size_t len, uint64_t hash) {
  if (!v->slots) return UINT32_MAX;
  /* The slot starts loading with the filter word: both are out of L2 as often as not, and
   * most pieces looked up here are tokens, so the filter lets them through. */
  __builtin_prefetch(&v->slots[(uint32_t)hash & v->mask]);
  if (!df_filter_may_have(&v->filter, hash)) return UINT32_MAX;
  uint64_t head = head8(bytes, len);
  for (uint32_t i = (uint32_t)hash & v->mask;; i = (i + 1) & v->mask) {
    const df_vslot *s = &v->slots[i];
    if (!s->id_plus1) return UINT32_MAX;
    if (slot_matches(v, s, head, bytes, len)) return s->id_plus1 - 1;
  }
}

dflash_status df_vocab_index(df_vocab *v, bool strict, const char *what) {
  uint32_t cap = 16;
  while (cap < v->n_ids * 2u && cap < (1u << 31)) cap <<= 1;
  v->mask = cap - 1;
  v->slots = df_big_alloc(cap * sizeof *v->slots);
  if (!v->slots) return df_error_nomem("vocabulary index");
  memset(v->slots, 0, cap * sizeof *v->slots);
  for (uint32_t id = 0; id < v->n_ids; id++) {
    if (v->kind[id] != DF_TOK_ORDINARY) continue;
    const char *bytes = v->blob.data + v->off[id];
    uint64_t head = head8(bytes, v->len[id]);
    uint32_t i = (uint32_t)df_hash_bytes(bytes, v->len[id]) & v->mask;
    for (; v->slots[i].id_plus1; i = (i + 1) & v->mask) {
      if (!slot_matches(v, &v->slots[i], head, bytes, v->len[id])) continue;
      if (strict)
        return df_error(DFLASH_E_DUPLICATE, "%s: tokens %u and %u have the same bytes", what,
                        v->slots[i].id_plus1 - 1, id);
      break; /* lower id already there */
    }
    if (!v->slots[i].id_plus1) v->slots[i] = (df_vslot){head, id + 1, v->len[id]};
  }
  df_filter_free(&v->filter);
  df_filter tmp = {0};
  if (df_filter_init(&tmp, v->n_ids)) return DFLASH_E_NOMEM;
  for (uint32_t id = 0; id < v->n_ids; id++)
    if (v->kind[id] == DF_TOK_ORDINARY)
      df_filter_add(&tmp, df_hash_bytes(v->blob.data + v->off[id], v->len[id]));
  v->filter = tmp; /* set last: lookups while building pass through */
  v->byte_gaps = false;
  for (int b = 0; b < 256; b++) {
    if (v->byte_id[b] != UINT32_MAX) continue;
    /* Real Hugging Face vocabularies may lack bytes that never occur in
     * UTF-8 text (SmolLM2 lacks 21); tiktoken's rank files never do. */
    if (!strict) {
      v->byte_gaps = true;
      continue;
    }
    return df_error(DFLASH_E_FORMAT,
                    "%s: no token for the single byte 0x%02x (not a byte-level BPE vocabulary?)",
                    what, b);
  }
  return DFLASH_OK;
}

dflash_status df_pairmap_init(df_pairmap *m, size_t expected) {
  memset(m, 0, sizeof *m);
  size_t cap = 64;
  while (cap < expected * 2) cap <<= 1;
  m->mask = cap - 1;
  m->slots = df_big_alloc(cap * sizeof *m->slots);
  if (!m->slots) return df_error_nomem("merge table");
  memset(m->slots, 0xFF, cap * sizeof *m->slots);
  return DFLASH_OK;
}

/* The filter over every pair in the table. */
static dflash_status pairmap_filter(df_pairmap *m) {
  df_filter_free(&m->filter);
  df_filter f = {0};
  if (df_filter_init(&f, m->count)) return DFLASH_E_NOMEM;
  for (size_t i = 0; i <= m->mask; i++)
    if (m->slots[i] != UINT64_MAX)
      df_filter_add(&f, df_pair_filter_hash(m->slots[i] >> DF_PAIR_RANK_BITS));
  m->filter = f;
  return DFLASH_OK;
}

dflash_status df_pairmap_byte_ranks(df_pairmap *m, const df_vocab *v) {
  if (!m->slots) return DFLASH_OK; /* no merges: nothing to look up */
  if (pairmap_filter(m)) return DFLASH_E_NOMEM;
  free(m->byte_rank);
  m->byte_rank = malloc(256 * 256 * sizeof *m->byte_rank);
  if (!m->byte_rank) return df_error_nomem("byte-pair ranks");
  for (unsigned a = 0; a < 256; a++)
    for (unsigned b = 0; b < 256; b++)
      m->byte_rank[a << 8 | b] = df_pairmap_rank(m, v->byte_id[a], v->byte_id[b]);
  return DFLASH_OK;
}

void df_pairmap_free(df_pairmap *m) {
  free(m->slots);
  free(m->merged_of_rank);
  free(m->rank_merged);
  free(m->byte_rank);
  df_filter_free(&m->filter);
  if (m->char_block)
    for (size_t b = 0; b < DF_CHAR_BLOCKS; b++) free(m->char_block[b]);
  free(m->char_block);
  free(m->joined);
  memset(m, 0, sizeof *m);
}

void df_pairmap_ids_as_ranks(df_pairmap *m) {
  const uint32_t *mo = m->merged_of_rank;
  if (!mo || !m->slots || m->rank_merged) return;
  uint32_t last = 0;
  bool any = false;
  for (size_t r = 0; r < m->n_ranks; r++) {
    if (mo[r] == DF_PAIR_NO_MERGE) continue;
    if (any && mo[r] <= last) return; /* not in rank order: keep the ranks */
    last = mo[r];
    any = true;
  }
  const uint64_t low = ((uint64_t)1 << DF_PAIR_RANK_BITS) - 1;
  for (size_t i = 0; i <= m->mask; i++)
    if (m->slots[i] != UINT64_MAX) m->slots[i] = (m->slots[i] & ~low) | mo[m->slots[i] & low];
  m->rank_merged = m->merged_of_rank;
  m->merged_of_rank = NULL;
}

static void pairmap_insert(uint64_t *slots, size_t mask, uint64_t packed) {
  size_t i = df_pair_slot(packed >> DF_PAIR_RANK_BITS, mask);
  while (slots[i] != UINT64_MAX) i = (i + 1) & mask;
  slots[i] = packed;
}

/* Rehash into a table sized for `expected` entries. */
static dflash_status pairmap_resize(df_pairmap *m, size_t expected) {
  size_t cap = 64;
  while (cap < expected * 2) cap <<= 1;
  uint64_t *slots = df_big_alloc(cap * sizeof *slots);
  if (!slots) return df_error_nomem("merge table");
  memset(slots, 0xFF, cap * sizeof *slots);
  for (size_t i = 0; i <= m->mask; i++)
    if (m->slots[i] != UINT64_MAX) pairmap_insert(slots, cap - 1, m->slots[i]);
  free(m->slots);
  m->slots = slots;
  m->mask = cap - 1;
  return DFLASH_OK;
}

dflash_status df_pairmap_compact(df_pairmap *m) { return pairmap_resize(m, m->count); }

dflash_status df_pairmap_put(df_pairmap *m, uint32_t a, uint32_t b, uint32_t rank,
                             uint32_t merged) {
  if (a > DF_PAIR_MAX_ID || b > DF_PAIR_MAX_ID || merged > DF_PAIR_MAX_ID)
    return df_error(DFLASH_E_UNSUPPORTED, "token ids above %u are not supported", DF_PAIR_MAX_ID);
  if (rank > DF_PAIR_MAX_RANK)
    return df_error(DFLASH_E_UNSUPPORTED, "more than %u merges are not supported",
                    DF_PAIR_MAX_RANK);
  if ((m->count + 1) * 2 > m->mask + 1 && pairmap_resize(m, (m->mask + 1))) return DFLASH_E_NOMEM;
  uint64_t key = df_pair_key(a, b);
  for (size_t i = df_pair_slot(key, m->mask); m->slots[i] != UINT64_MAX; i = (i + 1) & m->mask)
    if (m->slots[i] >> DF_PAIR_RANK_BITS == key) return DFLASH_OK;
  pairmap_insert(m->slots, m->mask, key << DF_PAIR_RANK_BITS | rank);
  m->count++;
  if (m->merged_of_rank) {
    if (rank >= m->n_ranks) return df_error(DFLASH_E_INTERNAL, "merge rank %u out of range", rank);
    m->merged_of_rank[rank] = merged;
  }
  return DFLASH_OK;
}

/* Only canonical pairs go in. Any two adjacent tokens of a merge in progress cover bytes that
 * were merged among themselves, in rank order, as in BPE of their concatenation alone; so when
 * that concatenation is a token, they are its canonical split: the two tokens BPE of its bytes
 * stops at before its last merge. Other splits are never looked up: o200k has 446,189 splits
 * into two tokens and 199,742 canonical ones, and the table is half the size. Tokens are taken
 * in rank (= id) order, so BPE of each (df_bpe_encode, by the heap: byte_rank is not built yet)
 * merges only the pairs of lower ranks, and stops at its split or, for a token no merge makes,
 * at more than two. */
dflash_status df_pairmap_from_ranks(df_pairmap *m, const df_vocab *v) {
  dflash_status st = df_pairmap_init(m, v->n_ids);
  df_bpe_scratch scratch = {0};
  df_ids split = {0};
  for (uint32_t id = 0; !st && id < v->n_ids; id++) {
    if (v->kind[id] != DF_TOK_ORDINARY || v->len[id] < 2) continue;
    split.len = 0;
    st = df_bpe_encode(v, m, (const uint8_t *)v->blob.data + v->off[id], v->len[id], 0, &scratch,
                       &split);
    if (!st && split.len == 2)
      st = df_pairmap_put(m, (uint32_t)split.v[0], (uint32_t)split.v[1], id, id);
  }
  df_bpe_scratch_free(&scratch);
  free(split.v);
  return st ? st : df_pairmap_compact(m);
}

/* ---- characters' tokens ------------------------------------------------------------------- */

/* Whether the token p[0..n), not whole characters, lies within one: continuation bytes only,
 * or a lead byte and fewer continuation bytes than it announces. */
static bool within_one_char(const uint8_t *p, size_t n) {
  size_t lead = (p[0] & 0xC0) != 0x80;
  for (size_t i = lead; i < n; i++)
    if ((p[i] & 0xC0) != 0x80) return false;
  if (!lead) return n <= 3;
  size_t want = p[0] >= 0xF0 ? 4 : p[0] >= 0xE0 ? 3 : p[0] >= 0xC0 ? 2 : 1;
  return n < want;
}

/* Whether every merge ranks after the merges that make its two tokens (a token made by several
 * merges: after all of them), so that BPE merges in rising rank order: true of tiktoken's
 * tables by their making, checked for Hugging Face merge lists. */
static bool ranks_rise(const df_pairmap *m, size_t n_ids) {
  uint32_t *made = malloc(n_ids * sizeof *made); /* the last rank making each token */
  if (!made) return false;
  memset(made, 0xFF, n_ids * sizeof *made);
  const uint64_t rank_mask = ((uint64_t)1 << DF_PAIR_RANK_BITS) - 1;
  const uint64_t id_mask = ((uint64_t)1 << DF_PAIR_ID_BITS) - 1;
  for (size_t i = 0; i <= m->mask; i++) {
    if (m->slots[i] == UINT64_MAX) continue;
    uint32_t r = (uint32_t)(m->slots[i] & rank_mask), x = df_pairmap_merged(m, r);
    if (x < n_ids && (made[x] == UINT32_MAX || r > made[x])) made[x] = r;
  }
  bool rise = true;
  for (size_t i = 0; i <= m->mask && rise; i++) {
    if (m->slots[i] == UINT64_MAX) continue;
    uint64_t key = m->slots[i] >> DF_PAIR_RANK_BITS;
    uint32_t r = (uint32_t)(m->slots[i] & rank_mask);
    uint32_t a = (uint32_t)(key >> DF_PAIR_ID_BITS), b = (uint32_t)(key & id_mask);
    rise = (a >= n_ids || made[a] == UINT32_MAX || made[a] < r) &&
           (b >= n_ids || made[b] == UINT32_MAX || made[b] < r);
  }
  free(made);
  return rise;
}

/*
 * A merge may start from a character's own token where nothing can join part of that character
 * to anything else: then its bytes merge among themselves, as BPE of the character alone would,
 * and (the ranks rising along every merge) it is whole before any merge that takes it, so BPE
 * from its token gives the same ids. Part of a character joins something else only through a
 * token that is not whole characters and reaches past one; such a token holds, across the
 * character's boundary, the pair of the byte before it and the byte after (a byte that starts
 * a character). `joined` marks those pairs, so a character is taken whole when the byte pairs
 * at both its ends are unmarked (bpe.c, list_init_chars). o200k: 794 such tokens, 207 pairs.
 */
dflash_status df_pairmap_char_tokens(df_pairmap *m, const df_vocab *v) {
  if (!m->slots || !ranks_rise(m, v->n_ids)) return DFLASH_OK; /* merges start from bytes */
  m->joined = calloc(65536 / 64, sizeof *m->joined);
  m->char_block = calloc(DF_CHAR_BLOCKS, sizeof *m->char_block);
  if (!m->joined || !m->char_block) return df_error_nomem("character tokens");
  df_bpe_scratch scratch = {0};
  df_ids got = {0};
  dflash_status st = DFLASH_OK;
  for (uint32_t id = 0; !st && id < v->n_ids; id++) {
    size_t n = v->len[id];
    if (v->kind[id] != DF_TOK_ORDINARY || n < 2) continue;
    const uint8_t *p = (const uint8_t *)v->blob.data + v->off[id];
    if (!df_utf8_valid((const char *)p, n)) { /* not whole characters */
      if (within_one_char(p, n)) continue;
      for (size_t k = 1; k < n; k++)
        if ((p[k] & 0xC0) != 0x80) {
          uint32_t pair = (uint32_t)p[k - 1] << 8 | p[k];
          m->joined[pair >> 6] |= (uint64_t)1 << (pair & 63);
        }
      continue;
    }
    if (df_utf8_char_len(p, n) != n) continue; /* not one character of 2-4 bytes */
    got.len = 0;                               /* the character's own BPE must be this token */
    st = df_bpe_encode(v, m, p, n, 0, &scratch, &got);
    if (st || got.len != 1 || (uint32_t)got.v[0] != id) continue;
    size_t i = 0;
    uint32_t cp = df_utf8_next(p, &i);
    uint32_t **b = &m->char_block[cp >> 8];
    if (!*b) {
      if (!(*b = malloc(256 * sizeof **b))) {
        st = df_error_nomem("character tokens");
        break;
      }
      memset(*b, 0xFF, 256 * sizeof **b);
    }
    (*b)[cp & 0xFF] = id;
  }
  df_bpe_scratch_free(&scratch);
  free(got.v);
  return st;
}
