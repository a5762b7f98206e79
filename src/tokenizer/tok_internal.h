/* Internals of the tokenizer module. */
#ifndef DFLASH_TOKENIZER_INTERNAL_H
#define DFLASH_TOKENIZER_INTERNAL_H

#include <dflash/tokenizer.h>
#include <stdatomic.h>
#include <string.h>

#include "core/internal.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

/* ---- membership filter (vocab.c) ------------------------------------------ */

/* A register-blocked Bloom filter: each key sets three bits of one 64-bit word, so a query
 * reads one word. About 10 bits per key (a few % false positives): small enough for L2,
 * where the tables it guards (several MiB each) are not, so most lookups of keys that are
 * absent never touch those tables. Read-only once built; NULL words: everything passes. */
/* malloc, or for 2 MiB and more 2 MiB-aligned memory the kernel is asked to back with huge
 * pages (THP "madvise"): the vocabulary index, merge table and piece caches are probed at
 * random, and on 4 KiB pages a probe (a prefetch too, which waited for the page walk) missed
 * the TLB as a rule. free() frees it. */
void *df_big_alloc(size_t size);

typedef struct df_filter {
  uint64_t *words;
  uint32_t mask; /* words - 1 */
} df_filter;

static inline uint64_t df_filter_bits(uint64_t h) {
  return 1ull << (h >> 46 & 63) | 1ull << (h >> 52 & 63) | 1ull << (h >> 58);
}
/* h: a well-mixed 64-bit hash of the key. */
static inline bool df_filter_may_have(const df_filter *f, uint64_t h) {
  if (!f->words) return true;
  uint64_t bits = df_filter_bits(h);
  return (f->words[(uint32_t)(h >> 20) & f->mask] & bits) == bits;
}
static inline void df_filter_add(df_filter *f, uint64_t h) {
  f->words[(uint32_t)(h >> 20) & f->mask] |= df_filter_bits(h);
}
/* Room for n keys (all bits clear). */
DF_MUST_CHECK dflash_status df_filter_init(df_filter *f, size_t n);
void df_filter_free(df_filter *f);

/* ---- vocabulary (vocab.c) ------------------------------------------------- */

enum { DF_TOK_NONE = 0, DF_TOK_ORDINARY = 1, DF_TOK_SPECIAL = 2, DF_TOK_ADDED = 3 };

/* A hash slot: the token's first 8 bytes inline, so short tokens compare
 * without touching the blob. id_plus1 == 0: empty. */
typedef struct df_vslot {
  uint64_t head;
  uint32_t id_plus1;
  uint32_t len;
} df_vslot;

/* Bytes of every token by id, and a bytes -> id hash for the ordinary ones. */
typedef struct df_vocab {
  uint32_t n_ids; /* one more than the largest id */
  uint32_t *off;  /* [n_ids] into blob */
  uint32_t *len;  /* [n_ids] */
  uint8_t *kind;  /* [n_ids] DF_TOK_* */
  df_buf blob;
  /* open addressing over ordinary tokens; one cache line answers most probes */
  struct df_vslot *slots;
  uint32_t mask;
  uint32_t byte_id[256]; /* id of each single byte, UINT32_MAX if missing */
  /* Some byte has no token (only when not strict): encoding drops such bytes
   * from each piece before merging, as Hugging Face does without unk_token. */
  bool byte_gaps;
  df_filter filter; /* over the hashes of the ordinary tokens */
} df_vocab;

/* Create with room for ids [0, n_ids). */
DF_MUST_CHECK dflash_status df_vocab_init(df_vocab *v, uint32_t n_ids);
void df_vocab_free(df_vocab *v);
/* Set token `id`; kind DF_TOK_*. DFLASH_E_DUPLICATE when the id is taken. */
DF_MUST_CHECK dflash_status df_vocab_set(df_vocab *v, uint32_t id, const void *bytes, size_t len,
                                         int kind);
/* Build the bytes -> id index over ordinary tokens. Duplicate bytes or a byte
 * without a single-byte token: error when `strict` (tiktoken), else the lowest
 * id wins and missing bytes set byte_gaps (Hugging Face). `what` names the file. */
DF_MUST_CHECK dflash_status df_vocab_index(df_vocab *v, bool strict, const char *what);
/* Ordinary token with exactly these bytes, or UINT32_MAX. */
uint32_t df_vocab_find(const df_vocab *v, const void *bytes, size_t len);
/* Same, with hash = df_hash_bytes(bytes, len) already computed. */
uint32_t df_vocab_find_h(const df_vocab *v, const void *bytes, size_t len, uint64_t hash);
/* Start loading the filter word and the first slot df_vocab_find_h reads for `hash`. */
static inline void df_vocab_prefetch(const df_vocab *v, uint64_t hash) {
  if (!v->slots) return;
  __builtin_prefetch(&v->slots[(uint32_t)hash & v->mask]);
  if (v->filter.words)
    __builtin_prefetch(&v->filter.words[(uint32_t)(hash >> 20) & v->filter.mask]);
}

/* The n <= 8 bytes at s as a little-endian word, zero-extended, without reading outside them:
 * memcpy with a variable length is a call into libc whose size dispatch mispredicts on
 * nearly every piece. Two overlapping loads; the overlap holds the same bytes twice. */
static inline uint64_t df_load_upto8(const uint8_t *s, size_t n) {
  if (n >= 4) {
    uint32_t lo, hi;
    memcpy(&lo, s, 4);
    memcpy(&hi, s + n - 4, 4);
    return (uint64_t)lo | (uint64_t)hi << (8 * (n - 4));
  }
  if (!n) return 0;
  return (uint64_t)s[0] | (uint64_t)s[n / 2] << (8 * (n / 2)) | (uint64_t)s[n - 1] << (8 * (n - 1));
}

/* df_load_upto8 gives the bytes as a little-endian word (so one-to-one) only on such CPUs;
 * elsewhere the piece cache builds its keys a byte at a time (tokenizer.c, le_word) and the
 * scanned loop, which reads keys from the text a word at a time, is not used. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define DF_LITTLE_ENDIAN 1
#else
#define DF_LITTLE_ENDIAN 0
#endif

/* Whether an environment variable's value (getenv's) turns its hook on: set and not "0" (the
 * tokenizer's test and A/B hooks, HACKING.md's table). */
static inline bool df_env_on(const char *value) {
  return value && *value && strcmp(value, "0") != 0;
}

/* Hash of n > 8 bytes (vocab.c). */
uint64_t df_hash_long(const void *p, size_t n);
/* Hash of n <= 8 bytes given as w = df_load_upto8(bytes, n). Each step is invertible (an xor
 * with a constant of n, a multiply by an odd constant, x ^ x >> 29 ^ x >> 47), so two short
 * pieces of the same length have the same hash only if their bytes are the same. */
static inline uint64_t df_hash_word_key(uint64_t w, size_t n) {
  return (w ^ (n * 0x9E3779B97F4A7C15ull)) * 0xBF58476D1CE4E5B9ull;
}
/* df_hash_word from df_hash_word_key: the key's high bits are mixed, these spread them down. */
static inline uint64_t df_hash_word_finish(uint64_t key) { return key ^ (key >> 29) ^ (key >> 47); }
static inline uint64_t df_hash_word(uint64_t w, size_t n) {
  return df_hash_word_finish(df_hash_word_key(w, n));
}
/* The hash of a piece, its token or its cache entry. Inline for the short pieces (most of
 * them): a call per piece cost 10-16 % of encode on English text. */
static inline uint64_t df_hash_bytes(const void *p, size_t n) {
  return n > 8 ? df_hash_long(p, n) : df_hash_word(df_load_upto8(p, n), n);
}

/*
 * (left id, right id) -> rank, packed in one 8-byte slot (21 + 21 bits of key,
 * 22 of rank) so the table stays small enough for the cache; the merged id
 * comes from the rank (tiktoken: the rank is the id; HF: merged_of_rank).
 */
#define DF_PAIR_ID_BITS 21
#define DF_PAIR_RANK_BITS 22
#define DF_PAIR_MAX_ID ((1u << DF_PAIR_ID_BITS) - 2)
#define DF_PAIR_MAX_RANK ((1u << DF_PAIR_RANK_BITS) - 2)
typedef struct df_pairmap {
  uint64_t *slots; /* UINT64_MAX: empty */
  size_t mask;
  size_t count;
  uint32_t *merged_of_rank; /* NULL: the rank is the merged id */
  size_t n_ranks;
  /* HF merges whose merged ids rise with the rank (df_pairmap_ids_as_ranks): the table ranks
   * by merged id, and the merge list's ids stay here, for the tokenizer's hash only. */
  uint32_t *rank_merged;
  /* [a << 8 | b]: df_pairmap_rank of the single-byte tokens of bytes a and b, so the first
   * round of a merge (all byte pairs) reads 256 KiB instead of the whole table. NULL until
   * df_pairmap_byte_ranks. */
  uint32_t *byte_rank;
  df_filter filter; /* over the pairs' keys; built by df_pairmap_byte_ranks */
  /* df_pairmap_char_tokens (where ranks rise along every merge): the token of each character
   * of 2-4 bytes whose BPE alone is one token, in blocks of 256 code points (char_block[cp >> 8],
   * NULL where the block has none; UINT32_MAX where the character has none), and `joined`, a
   * bit for each byte pair (a << 8 | b) that some token holding part of a character and more
   * holds across a character boundary. NULL: merges start from bytes. */
  uint32_t **char_block;
  uint64_t *joined;
} df_pairmap;

DF_MUST_CHECK dflash_status df_pairmap_init(df_pairmap *m, size_t expected);
void df_pairmap_free(df_pairmap *m);
/* Insert unless present (a repeated merge keeps its first, lowest rank).
 * With merged_of_rank, also records merged for this rank. */
DF_MUST_CHECK dflash_status df_pairmap_put(df_pairmap *m, uint32_t a, uint32_t b, uint32_t rank,
                                           uint32_t merged);
/* Shrink the table to its final size once every pair is in. */
DF_MUST_CHECK dflash_status df_pairmap_compact(df_pairmap *m);
static inline uint64_t df_pair_key(uint32_t a, uint32_t b) {
  return (uint64_t)a << DF_PAIR_ID_BITS | b;
}
static inline size_t df_pair_slot(uint64_t key, size_t mask) {
  return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 24) & mask;
}
static inline uint64_t df_pair_filter_hash(uint64_t key) { return key * 0xD6E8FEB86659FD93ull; }
/* The table's answer for key, without the filter. */
static inline uint32_t df_pairmap_probe(const df_pairmap *m, uint64_t key) {
  for (size_t i = df_pair_slot(key, m->mask);; i = (i + 1) & m->mask) {
    uint64_t s = m->slots[i];
    if (s >> DF_PAIR_RANK_BITS == key) return (uint32_t)(s & ((1u << DF_PAIR_RANK_BITS) - 1));
    if (s == UINT64_MAX) return UINT32_MAX;
  }
}
/* Rank of merging a then b, UINT32_MAX when they do not merge. */
static inline uint32_t df_pairmap_rank(const df_pairmap *m, uint32_t a, uint32_t b) {
  uint64_t key = df_pair_key(a, b);
  if (!df_filter_may_have(&m->filter, df_pair_filter_hash(key))) return UINT32_MAX;
  return df_pairmap_probe(m, key);
}
static inline uint32_t df_pairmap_merged(const df_pairmap *m, uint32_t rank) {
  return m->merged_of_rank ? m->merged_of_rank[rank] : rank;
}
static inline void df_pairmap_prefetch(const df_pairmap *m, uint32_t a, uint32_t b) {
  __builtin_prefetch(&m->slots[df_pair_slot(df_pair_key(a, b), m->mask)]);
}
/* An HF table whose merged ids rise with the rank (DF_PAIR_NO_MERGE where a rank is not in
 * the table) ranks by merged id instead: the same order, so the same merges, and a merge
 * round no longer loads merged_of_rank (600 KB for Qwen2) before it can rank the next pairs.
 * Call once every pair is in, before df_pairmap_byte_ranks. */
#define DF_PAIR_NO_MERGE UINT32_MAX
void df_pairmap_ids_as_ranks(df_pairmap *m);
/* Fill byte_rank from the table and the single-byte tokens (v->byte_id); call once every
 * pair is in. */
DF_MUST_CHECK dflash_status df_pairmap_byte_ranks(df_pairmap *m, const struct df_vocab *v);
/* tiktoken's merge rule: a and b merge when their concatenation is a token,
 * ranked by that token. Holds each token's canonical split only (the one BPE ever makes). */
DF_MUST_CHECK dflash_status df_pairmap_from_ranks(df_pairmap *m, const df_vocab *v);
#define DF_CHAR_BLOCKS (0x110000 >> 8)
/* The length of the well-formed UTF-8 character of 2-4 bytes at p[0..avail), or 0. */
static inline size_t df_utf8_char_len(const uint8_t *p, size_t avail) {
  uint8_t c = p[0];
  size_t n = c >= 0xC2 && c <= 0xDF   ? 2
             : c >= 0xE0 && c <= 0xEF ? 3
             : c >= 0xF0 && c <= 0xF4 ? 4
                                      : 0;
  if (!n || n > avail) return 0;
  uint8_t lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
  uint8_t hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
  if (p[1] < lo || p[1] > hi) return 0;
  for (size_t i = 2; i < n; i++)
    if ((p[i] & 0xC0) != 0x80) return 0;
  return n;
}
/* The tables that let a merge start from characters' tokens (bpe.c, list_init_chars), built
 * only where every merge ranks after the merges that make its two tokens (tiktoken's tables by
 * their making; a Hugging Face list is checked); elsewhere char_block stays NULL. */
DF_MUST_CHECK dflash_status df_pairmap_char_tokens(df_pairmap *m, const df_vocab *v);

/* ---- BPE (bpe.c) ---------------------------------------------------------- */

typedef struct df_bpe_scratch {
  uint32_t *ids;
  uint32_t *rank;
  uint32_t *prev, *next;
  uint64_t *heap;
  size_t cap, heap_cap;
  /* Not owned, may be NULL: a per-thread cache of pair ranks (DF_PAIR_CACHE_SLOTS slots, all
   * UINT64_MAX when empty) for one pair table. The table is several MiB, out of L2, while the
   * pairs one text merges repeat: most lookups are then one L2 read. */
  uint64_t *pair_cache;
} df_bpe_scratch;
#define DF_PAIR_CACHE_BITS 15
#define DF_PAIR_CACHE_SLOTS ((size_t)1 << DF_PAIR_CACHE_BITS)

void df_bpe_scratch_free(df_bpe_scratch *s);
/* Merge the bytes of one piece into token ids appended to `out`.
 * Pieces longer than `heap_threshold` bytes use the O(n log n) heap merge. */
typedef struct df_ids {
  int32_t *v;
  size_t len, cap;
} df_ids;
DF_MUST_CHECK dflash_status df_ids_push(df_ids *ids, int32_t id);
/* Room for n more ids. */
DF_MUST_CHECK dflash_status df_ids_reserve(df_ids *ids, size_t n);
DF_MUST_CHECK dflash_status df_bpe_encode(const df_vocab *v, const df_pairmap *pairs,
                                          const uint8_t *piece, size_t n, size_t heap_threshold,
                                          df_bpe_scratch *s, df_ids *out);
/* 16: the callers merge pieces of up to DF_CACHE_PIECE bytes; a lane's shifts move half what
 * they did at 32 (drv4, o200k: every category +1 %, CJK +6 %, medians of 9). */
#define DF_BPE_SHORT 16
#define DF_BPE_MANY 8
/* Merge k <= DF_BPE_MANY pieces of 2..DF_BPE_SHORT bytes (every byte with a token) at once,
 * their rounds in turn so that one's waits on the pair table overlap the others' work: piece
 * j's ids go to ids[j][0..count[j]), as df_bpe_encode gives them. Needs pairs->byte_rank
 * (df_pairmap_byte_ranks). */
void df_bpe_merge_many(const df_vocab *v, const df_pairmap *pairs, const uint8_t *const *piece,
                       const size_t *len, size_t k, uint32_t (*ids)[DF_BPE_SHORT], uint8_t *count);

/* ---- pre-tokenization (pretok.c) ------------------------------------------ */

typedef enum df_scanner {
  DF_SCAN_NONE = 0, /* run the regex */
  DF_SCAN_CL100K,
  DF_SCAN_O200K,
  DF_SCAN_KIMI,
  DF_SCAN_QWEN2,
  DF_SCAN_QWEN35,
} df_scanner;

typedef enum df_step_kind { DF_STEP_REGEX, DF_STEP_DIGITS, DF_STEP_PREFIX_SPACE } df_step_kind;
typedef enum df_split_behavior {
  DF_SPLIT_ISOLATED,
  DF_SPLIT_REMOVED,
  DF_SPLIT_MERGED_PREV,
  DF_SPLIT_MERGED_NEXT,
  DF_SPLIT_CONTIGUOUS
} df_split_behavior;

typedef struct df_pretok_step {
  df_step_kind kind;
  pcre2_code *re;
  df_scanner scanner;
  df_split_behavior behavior;
  bool invert;
  bool keep_gaps; /* HF keeps unmatched text as pieces; tiktoken drops it */
  bool individual_digits;
  /* The regex the step runs (a named pattern's own text), NULL for other kinds: what
   * dflash_tokenizer_hash reads (a compiled pattern cannot be read back). */
  char *source;
  bool literal;
} df_pretok_step;

typedef struct df_pretok {
  df_pretok_step *steps;
  size_t n_steps;
} df_pretok;

/* Append a regex step. `pattern` is a name (cl100k, o200k, kimi-k2, qwen2,
 * qwen3.5, gpt2) or a regex in Rust syntax; *nfc is set when the named
 * pattern implies NFC. `literal`: match the pattern text literally. */
DF_MUST_CHECK dflash_status df_pretok_add_regex(df_pretok *p, const char *pattern, bool literal,
                                                df_split_behavior behavior, bool invert,
                                                bool keep_gaps, bool *nfc);
DF_MUST_CHECK dflash_status df_pretok_add_step(df_pretok *p, df_pretok_step step);
void df_pretok_free(df_pretok *p);
/* Whether `name` is one of the named patterns. */
bool df_pattern_is_named(const char *name);
/* Translate a Rust-syntax regex to PCRE2 syntax (malloc'd): `&&` class
 * intersections and script names. */
DF_MUST_CHECK dflash_status df_regex_translate(const char *rx, char **out);

typedef struct df_range {
  size_t begin, end;
} df_range;
typedef struct df_ranges {
  df_range *v;
  size_t len, cap;
} df_ranges;
DF_MUST_CHECK dflash_status df_ranges_push(df_ranges *r, size_t b, size_t e);

typedef struct df_pretok_scratch {
  pcre2_match_data *md;
  pcre2_match_context *mctx;
  pcre2_jit_stack *jit_stack;
  df_ranges a, b;
  df_buf prefixed;
} df_pretok_scratch;
void df_pretok_scratch_free(df_pretok_scratch *s);

/* Split text[0..len) (valid UTF-8) into pieces, as byte ranges into `*text_out`
 * (the text itself, or a copy with a prefix space). */
DF_MUST_CHECK dflash_status df_pretok_run(const df_pretok *p, const char *text, size_t len,
                                          df_pretok_scratch *s, const char **text_out,
                                          df_ranges **out);
/* One regex step over text[b..e), appending matches to out. */
DF_MUST_CHECK dflash_status df_regex_split(const df_pretok_step *st, const char *text, size_t b,
                                           size_t e, df_pretok_scratch *s, df_ranges *out);

/* ---- hand-written scanners (scanner.c) ------------------------------------- */

/* Length of the match of the named pattern starting at text[pos] (text valid
 * UTF-8, pos < len); always > 0 for these patterns. */
size_t df_scan_next(df_scanner sc, const uint8_t *text, size_t len, size_t pos);
/* Initialise the scanners' character-class table (from PCRE2's own Unicode
 * tables, so scanner and regex agree); thread-safe, runs once. */
DF_MUST_CHECK dflash_status df_scan_init(void);
/* Match pieces back to back from text[pos] (pos < len), writing at most `cap` (> 0) of
 * them to `out` as ranges shifted by `shift`. Returns how many; *stop is where it stopped
 * (len, where `out` filled, or where the pattern matches nothing). */
size_t df_scan_pieces(df_scanner sc, const uint8_t *text, size_t len, size_t pos, size_t shift,
                      df_range *out, size_t cap, size_t *stop);

/* How df_scan_pieces finds pieces: one df_scan_next call each, or from bitmasks of byte
 * classes 64 bytes at a time, built by portable C or by AVX2. The default is the fastest
 * this CPU has (DFLASH_TOKENIZER_NO_SIMD=1 at first load: no AVX2); tests pick one. */
/* DF_SCAN_MASK*: the block scanner, where o200k, Kimi K2, Qwen2 and Qwen3.5 find the pieces of
 * an ASCII window from bit algebra on its masks (scanner.c, mask_window) instead of piece by
 * piece. */
typedef enum df_scan_impl {
  DF_SCAN_PIECE,
  DF_SCAN_BLOCK,
  DF_SCAN_BLOCK_AVX2,
  DF_SCAN_MASK,
  DF_SCAN_MASK_AVX2
} df_scan_impl;
/* Use `impl` from now on (not thread-safe; for tests). False when this CPU lacks it. */
bool df_scan_set_impl(df_scan_impl impl);
df_scan_impl df_scan_get_impl(void);

/* Byte classes of 64 bytes, bit i for byte i (scanner_avx2.c builds them with AVX2). */
typedef struct df_scan_masks {
  uint64_t up, lo, digit; /* A-Z, a-z, 0-9 */
  uint64_t space, nl;     /* ASCII \s; \r or \n */
  uint64_t slash, other;  /* '/'; the rest of ASCII (not letter, digit or space) */
  uint64_t high;          /* bytes >= 0x80 */
  uint64_t quote;         /* '\'' (where a contraction may follow a word) */
  uint64_t blank;         /* ' ' (the space ` ?` takes before punctuation) */
} df_scan_masks;
void df_scan_masks_avx2(const uint8_t *p, df_scan_masks *m);
bool df_scan_cpu_has_avx2(void);

/* ---- Unicode helpers (unicode.c) -------------------------------------------- */

/* Replace invalid UTF-8 as Python's decode("utf-8", "replace") does. Returns
 * false (nothing written) when the input is already valid. */
DF_MUST_CHECK dflash_status df_utf8_repair(const char *s, size_t len, df_buf *out, bool *changed);
/* Whether s[0..n) is well-formed UTF-8, with AVX2 (utf8_avx2.c; only where the CPU has it). */
bool df_utf8_valid_avx2(const uint8_t *s, size_t n);
/* Let df_utf8_repair ask df_utf8_valid_avx2 first (on at first load where the CPU has AVX2,
 * unless DFLASH_TOKENIZER_NO_SIMD; not thread-safe, for tests). False when it cannot. */
bool df_utf8_set_avx2(bool on);
/* Decode one code point from valid UTF-8 at s[*i], advancing *i. */
static inline uint32_t df_utf8_next(const uint8_t *s, size_t *i) {
  uint32_t c = s[*i];
  if (c < 0x80) {
    *i += 1;
    return c;
  }
  if (c < 0xE0) {
    uint32_t r = (c & 0x1F) << 6 | (s[*i + 1] & 0x3F);
    *i += 2;
    return r;
  }
  if (c < 0xF0) {
    uint32_t r = (c & 0x0F) << 12 | (uint32_t)(s[*i + 1] & 0x3F) << 6 | (s[*i + 2] & 0x3F);
    *i += 3;
    return r;
  }
  uint32_t r = (c & 0x07) << 18 | (uint32_t)(s[*i + 1] & 0x3F) << 12 |
               (uint32_t)(s[*i + 2] & 0x3F) << 6 | (s[*i + 3] & 0x3F);
  *i += 4;
  return r;
}
/* The token a merge may start from for the character at p[0..len) (2-4 bytes), or UINT32_MAX. */
static inline uint32_t df_pairmap_char_token(const df_pairmap *m, const uint8_t *p, size_t len) {
  size_t i = 0;
  uint32_t cp = df_utf8_next(p, &i);
  const uint32_t *b = i == len && cp <= 0x10FFFF ? m->char_block[cp >> 8] : NULL;
  return b ? b[cp & 0xFF] : UINT32_MAX;
}
static inline bool df_pairmap_joined(const df_pairmap *m, uint8_t a, uint8_t b) {
  uint32_t k = (uint32_t)a << 8 | b;
  return m->joined[k >> 6] >> (k & 63) & 1;
}
/* df_nfc of s[0..len) (into out when *changed), with df_nfc run only on the regions around the
 * bytes it acts on (>= 0xCC); `part` is scratch (tokenizer.c). */
DF_MUST_CHECK dflash_status df_nfc_regions(const char *s, size_t len, df_buf *out, df_buf *part,
                                           bool *changed);
/* Unicode White_Space (Rust char::is_whitespace). */
bool df_is_white_space(uint32_t c);

/* ---- added / special tokens (special.c) ------------------------------------- */

typedef struct df_added {
  char *text;
  size_t len;
  uint32_t id;
  bool special; /* skipped in DFLASH_SPECIAL_NONE */
  bool lstrip, rstrip;
  bool normalized; /* matched on normalised text (HF) */
} df_added;

/* A byte trie over the added tokens for leftmost-longest matching. */
typedef struct df_trie {
  uint32_t *first_child; /* per node */
  uint32_t *sibling;
  uint8_t *byte;
  int32_t *token; /* index into added[], -1 */
  size_t n, cap;
  uint8_t first_bytes[32]; /* bitmap of bytes that start a token */
  /* The distinct first bytes when there are at most two (the usual "<" of "<|...|>", or "<"
   * and "["): the search then jumps between them with memchr instead of testing every byte. */
  uint8_t first[2];
  int n_first;       /* distinct first bytes, counted up to 3 */
  bool has_ordinary; /* a token that DFLASH_SPECIAL_NONE still matches */
} df_trie;

DF_MUST_CHECK dflash_status df_trie_build(df_trie *t, const df_added *added, size_t n,
                                          bool normalized);
void df_trie_free(df_trie *t);
/* Find the leftmost-longest enabled token in text[from..len). Returns the
 * added[] index and its span (after lstrip/rstrip), or -1. */
int df_trie_find(const df_trie *t, const df_added *added, dflash_special_mode mode,
                 const char *text, size_t from, size_t len, size_t *mb, size_t *me);

/* ---- the tokenizer ---------------------------------------------------------- */

typedef enum df_family { DF_FAMILY_TIKTOKEN, DF_FAMILY_HF } df_family;

struct dflash_tokenizer {
  uint64_t serial; /* unique per load: tags per-thread caches */
  df_family family;
  df_vocab vocab;
  df_pairmap pairs;
  bool whole_piece_lookup; /* tiktoken; HF ignore_merges */
  /* A scanned text's misses are merged together (tokenizer.c, waiting_misses); off without
   * byte ranks, or with DFLASH_TOKENIZER_NO_AHEAD set at load (a test and measuring hook). */
  bool merge_ahead;
  bool nfc;
  df_added *added;
  size_t n_added;
  df_trie raw_trie;  /* matched before normalisation */
  df_trie norm_trie; /* HF added tokens with normalized=true */
  df_pretok pretok;
  /* The piece cache's starting contents (tokenizer.c, cache_seed_build): every short token's
   * own ids, placed as the per-thread cache would hold them; copied into a thread's cache
   * when it starts on this tokenizer. Read-only after load; NULL where not built. */
  void *cache_seed;
  void *long_seed; /* the same for the long cache: tokens of 16-64 bytes, by slot */
  /* encode_batch's thread pool, made on first use and kept with the tokenizer, so
   * its workers keep their per-thread piece caches across calls. One batch at a
   * time holds it (pool_busy); a concurrent batch makes a pool of its own. */
  atomic_bool pool_busy;
  struct df_pool *pool;
};

/* Loaders fill a zeroed tokenizer; the caller finishes (tries) or frees it. */
DF_MUST_CHECK dflash_status df_load_tiktoken(dflash_tokenizer *t, const char *path,
                                             const char *pattern, const char *config_path);
DF_MUST_CHECK dflash_status df_load_hf_json(dflash_tokenizer *t, const char *path,
                                            const char *pattern);
/* The same from memory (fuzzing, tests): `name` stands for the file in messages. */
struct json_t;
DF_MUST_CHECK dflash_status df_load_tiktoken_data(dflash_tokenizer *t, const char *name,
                                                  const char *data, size_t len, const char *pattern,
                                                  struct json_t *cfg, const char *cfg_name);
DF_MUST_CHECK dflash_status df_load_hf_doc(dflash_tokenizer *t, struct json_t *doc,
                                           const char *name, const char *pattern);
/* A fresh serial number for a loaded tokenizer (tags per-thread caches). */
uint64_t df_tokenizer_serial(void);
/* Build the added-token tries once a loader is done. */
DF_MUST_CHECK dflash_status df_tokenizer_finish(dflash_tokenizer *t);
DF_MUST_CHECK dflash_status df_load_vocab_merges(dflash_tokenizer *t, const char *vocab_path,
                                                 const char *merges_path, const char *pattern);
/* Append an added token (copied). */
DF_MUST_CHECK dflash_status df_tok_add_added(dflash_tokenizer *t, const char *text, size_t len,
                                             uint32_t id, bool special);
/* GPT-2 byte-level alphabet: the character standing for byte b, and back. */
uint32_t df_byte_to_char(uint8_t b);
/* Decode a byte-level token string into raw bytes. When a character is not
 * in the alphabet the token's UTF-8 itself is its bytes (as HF decodes). */
DF_MUST_CHECK dflash_status df_bytelevel_decode(const char *s, size_t len, df_buf *out);

#endif
