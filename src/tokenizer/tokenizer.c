/* Public tokenizer API: loading dispatch, encode (single and batch), decode, lookups. */
#include <dflash/tokenizer.h>
#include <dflash/experimental.h>

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "tok_internal.h"

/* Pieces longer than this many bytes use the heap merge. */
#define DF_BPE_HEAP_THRESHOLD 128

static void tokenizer_options_defaults(dflash_tokenizer_options *opts) {
  if (!opts) return;
  memset(opts, 0, sizeof *opts);
  opts->struct_size = sizeof *opts;
}

DF_DEFINE_INIT(dflash_tokenizer_options, tokenizer_options_defaults)

void dflash_tokenizer_free(dflash_tokenizer *t) {
  if (!t) return;
  df_vocab_free(&t->vocab);
  df_pairmap_free(&t->pairs);
  for (size_t i = 0; i < t->n_added; i++) free(t->added[i].text);
  free(t->added);
  df_trie_free(&t->raw_trie);
  df_trie_free(&t->norm_trie);
  df_pretok_free(&t->pretok);
  df_pool_free(t->pool);
  free(t->cache_seed);
  free(t->long_seed);
  free(t);
}

dflash_status df_tok_add_added(dflash_tokenizer *t, const char *text, size_t len, uint32_t id,
                               bool special) {
  df_added *a = realloc(t->added, (t->n_added + 1) * sizeof *a);
  if (!a) return df_error_nomem("added tokens");
  t->added = a;
  char *copy = df_strndup(text, len);
  if (!copy) return df_error_nomem("added tokens");
  t->added[t->n_added++] = (df_added){.text = copy, .len = len, .id = id, .special = special};
  return DFLASH_OK;
}

static bool is_dir(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static bool exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

/* Pick a loader for a model directory. */
static dflash_status load_dir(dflash_tokenizer *t, const char *dir, const char *pattern) {
  char *p = df_path_join(dir, "tokenizer.json");
  char *cfg = df_path_join(dir, "tokenizer_config.json");
  char *vocab = df_path_join(dir, "vocab.json");
  char *merges = df_path_join(dir, "merges.txt");
  char *tt = df_path_join(dir, "tiktoken.model");
  dflash_status st;
  if (!p || !cfg || !vocab || !merges || !tt) st = df_error_nomem("paths");
  else if (exists(p)) st = df_load_hf_json(t, p, pattern);
  else if (exists(tt)) st = df_load_tiktoken(t, tt, pattern, exists(cfg) ? cfg : NULL);
  else if (exists(vocab)) st = df_load_vocab_merges(t, vocab, merges, pattern);
  else
    st = df_error(DFLASH_E_NOT_FOUND,
                  "%s: no tokenizer.json, tiktoken.model or vocab.json in this directory", dir);
  free(p);
  free(cfg);
  free(vocab);
  free(merges);
  free(tt);
  return st;
}

/* What a file that is no tokenizer is (NULL when it may be a rank file), from its first bytes
 * and name: users point --tokenizer at the weights or the data now and then. */
static const char *not_a_tokenizer(const char *path) {
  unsigned char b[16] = {0};
  FILE *f = fopen(path, "rb");
  size_t n = f ? fread(b, 1, sizeof b, f) : 0;
  if (f) fclose(f);
  if (df_str_ends_with(path, ".safetensors") || (n > 8 && b[8] == '{' && !b[7] && !b[6]))
    return "a safetensors file (model weights or a dataset shard?)";
  if (n >= 4 && !memcmp(b, "GGUF", 4)) return "a GGUF model";
  if (df_str_ends_with(path, ".jsonl") || (n && b[0] == '{'))
    return "JSON lines (conversations or completions?)";
  return NULL;
}

static dflash_status load_file(dflash_tokenizer *t, const char *path, const char *pattern) {
  if (df_str_ends_with(path, "vocab.json")) {
    char *dir = df_path_dirname(path);
    char *merges = dir ? df_path_join(dir, "merges.txt") : NULL;
    dflash_status st = merges ? df_load_vocab_merges(t, path, merges, pattern)
                              : df_error_nomem("paths");
    free(dir);
    free(merges);
    return st;
  }
  if (df_str_ends_with(path, ".json")) return df_load_hf_json(t, path, pattern);
  const char *what = not_a_tokenizer(path);
  if (what)
    return df_error(DFLASH_E_FORMAT,
                    "%s is %s, not a tokenizer: give a model directory, a "
                    "tokenizer.json, a vocab.json (beside merges.txt) or a tiktoken rank file",
                    path, what);
  /* A rank file inside a model directory takes that directory's special-token layout. */
  char *dir = df_path_dirname(path);
  char *cfg = dir ? df_path_join(dir, "tokenizer_config.json") : NULL;
  dflash_status st = dir && cfg ? df_load_tiktoken(t, path, pattern, exists(cfg) ? cfg : NULL)
                                : df_error_nomem("paths");
  free(dir);
  free(cfg);
  return st;
}

uint64_t df_tokenizer_serial(void) {
  static atomic_uint_fast64_t serials = 1;
  return atomic_fetch_add(&serials, 1);
}

static dflash_status cache_seed_build(dflash_tokenizer *t);

/* Tries over added tokens, the byte-pair rank table and the piece cache's seed, once the
 * loader has filled in the tokens and merges. */
dflash_status df_tokenizer_finish(dflash_tokenizer *t) {
  dflash_status st = df_trie_build(&t->raw_trie, t->added, t->n_added, false);
  if (!st) st = df_trie_build(&t->norm_trie, t->added, t->n_added, true);
  if (!st && !df_env_on(getenv("DFLASH_TOKENIZER_NO_ID_RANKS"))) df_pairmap_ids_as_ranks(&t->pairs);
  if (!st) st = df_pairmap_byte_ranks(&t->pairs, &t->vocab);
  if (!st && !df_env_on(getenv("DFLASH_TOKENIZER_NO_CHARS")))
    st = df_pairmap_char_tokens(&t->pairs, &t->vocab);
  if (!st) st = cache_seed_build(t);
  t->merge_ahead = t->pairs.byte_rank && !df_env_on(getenv("DFLASH_TOKENIZER_NO_AHEAD"));
  return st;
}

dflash_status dflash_tokenizer_load(const char *path, const dflash_tokenizer_options *opts,
                                    dflash_tokenizer **out) {
  DF_CHECK_ARG(path && out);
  *out = NULL;
  dflash_tokenizer_options o;
  dflash_tokenizer_options_default(&o);
  dflash_status st = df_opts_in(&o, opts, sizeof o, "dflash_tokenizer_options");
  if (st) return st;
  if (o.pattern && !*o.pattern) o.pattern = NULL;
  struct stat sb;
  if (stat(path, &sb) != 0) return df_error_errno(DFLASH_E_IO, errno, "tokenizer %s", path);
  dflash_tokenizer *t = calloc(1, sizeof *t);
  if (!t) return df_error_nomem("tokenizer");
  t->serial = df_tokenizer_serial();
  st = is_dir(path) ? load_dir(t, path, o.pattern) : load_file(t, path, o.pattern);
  if (!st) st = df_tokenizer_finish(t);
  if (st) {
    dflash_tokenizer_free(t);
    return st;
  }
  *out = t;
  return DFLASH_OK;
}

size_t dflash_tokenizer_vocab_size(const dflash_tokenizer *t) { return t ? t->vocab.n_ids : 0; }

size_t dflash_tokenizer_max_ids(const dflash_tokenizer *t, size_t len) {
  bool prefix = false;
  for (size_t i = 0; t && i < t->pretok.n_steps; i++)
    prefix |= t->pretok.steps[i].kind == DF_STEP_PREFIX_SPACE;
  return (prefix ? 6 : 3) * len + 1;
}

/* ---- encode --------------------------------------------------------------- */

/* Merged pieces are remembered per thread: real text repeats its words, and a
 * BPE merge costs several cache misses in the pair table. Entries hold the
 * piece bytes, so a hit is exact. 16 MiB a thread (+ 256 KiB of pair cache),
 * fixed: real text (bench --real) holds more distinct words than 2^14 keep,
 * misses went 7.7 % -> 4.3 % of the pieces of the reasoning mix at 2^16;
 * seeded with the short tokens (cache_seed_build), 2^17 holds twice the seeds (o200k,
 * 1 MB of English from a fresh cache: misses 4.22 % at 2^16, 3.41 % at 2^17), and 2^18 the
 * words of the whole bench run besides (o200k, bench --real: hit 97.6 -> 98.3 % on the mix,
 * 97.3 -> 97.7 % English; 2^19 98.6 %, 97.9 %). A miss costs ~1,100 instructions, a hit
 * ~100: misses were half of encode's time on real text.
 *
 * An entry is 32 bytes, two to a 64-byte line (a bucket: both ways in the line its prefetch
 * loads), so 16 MiB holds 2^19: the key is the piece itself, up to DF_CACHE_PIECE bytes and
 * its length (piece_key), and a hit is two compares of words, with no hash kept and no
 * bytes compared after. Pieces of up to 15 bytes with up to 4 ids were 99.4-99.8 % of the
 * pieces of the bench's English, code, math and mix (o200k); the rest go to the long cache,
 * and a short piece of more ids leaves a mark here (DF_CACHE_MORE) that sends its next
 * sight there. (Entries of 64 bytes, 24 bytes and 6 ids, at 2^19 and 32 MiB, took the mix
 * 162.9 -> 167.4 MB/CPU-s in drv4 and code 140.8 -> 144.5, medians of 9.) */
#define DF_CACHE_BITS 19
#define DF_CACHE_PIECE 15
#define DF_CACHE_IDS 4
#define DF_CACHE_MORE 7 /* an entry's id count: the piece's ids are in the long cache */

/* Longer pieces, 16..64 bytes, and short ones of 5-13 ids have a cache of their own,
 * direct-mapped, 2^15 entries of two lines (4 MiB a thread), seeded with the tokens of 16-64
 * bytes. Few pieces are that long, but each merge is long, and they repeat:
 * words of other scripts (Cyrillic, Devanagari: 2-3 bytes a letter) and runs of Han; on the
 * bench's text, pieces over 24 bytes were 3.2 % of the other scripts' pieces and 2.6 % were
 * repeats (CJK 4.1 % and 1.5 %, code 0.29 % and 0.26 %: long names), each merged again.
 * With 16-24 bytes here too, 2^14 entries unseeded missed 14,254 times on the bench's 1.85 MB
 * of other scripts (o200k), 2^15 seeded 13,279, the piece cache of 24-byte entries 12,989. */
#define DF_LONG_BITS 15
#define DF_LONG_PIECE 64
#define DF_LONG_IDS 13

/* Pieces of 65-128 bytes have a third cache, direct-mapped, 2^11 entries of four lines
 * (512 KiB a thread), not seeded. They are code's rulers and indents: lines of dashes, stars
 * or equals signs in comments, runs of spaces, each merged whole (a heap merge from 128 bytes)
 * every time it came. On the bench's 0.5 MB of code (o200k) there were 400 such pieces, 1.4 %
 * of the bytes, and 325 of them repeats of 75; over 128 bytes, none in 15 MB. */
#define DF_XL_BITS 11
#define DF_XL_PIECE 128
#define DF_XL_IDS 29

/* A piece's key: for up to DF_CACHE_PIECE bytes, its bytes 0-7 (lo) and 8-14 (hi), zero past
 * its end, as little-endian words, and its length in hi's top byte, bits 0-4; h, a hash of the
 * two, picks the bucket (its top bits) and the long cache's slot. A longer piece has lo 0, its
 * length (31 for any over 30 bytes) in hi, and h from all its bytes: it matches no entry, as no
 * entry is longer than DF_CACHE_PIECE. */
typedef struct piece_key {
  uint64_t lo, hi, h;
} piece_key;

/* A cache entry: the key's two words, the top byte of hi with the id count in bits 5-7. */
typedef struct piece_entry {
  uint64_t lo, hi;
  uint32_t ids[DF_CACHE_IDS];
} piece_entry;
_Static_assert(sizeof(piece_entry) == 32, "two piece-cache entries to a cache line");
#define DF_KEY_COUNT_SHIFT 61
#define DF_KEY_MATCH (~(uint64_t)0 >> 3) /* hi without the count */

typedef struct long_entry {
  uint64_t hash; /* the key's h */
  uint8_t len, n;
  uint32_t ids[DF_LONG_IDS];
  uint8_t bytes[DF_LONG_PIECE];
} long_entry;
_Static_assert(sizeof(long_entry) == 128, "a long entry is two cache lines");

typedef struct xl_entry { /* a long_entry, with room for twice the bytes */
  uint64_t hash;
  uint8_t len, n;
  uint32_t ids[DF_XL_IDS];
  uint8_t bytes[DF_XL_PIECE];
} xl_entry;
_Static_assert(sizeof(xl_entry) == 256, "an XL entry is four cache lines");

typedef struct enc_ctx {
  df_buf repaired, normed;
  df_buf nfc_part; /* NFC of one region (df_nfc_regions) */
  df_buf kept;     /* a piece without its unencodable bytes (vocab.byte_gaps) */
  df_pretok_scratch ps;
  df_bpe_scratch bs;
  df_ids out;
  dflash_special_mode mode;
  piece_entry *cache;
  long_entry *long_cache;
  xl_entry *xl_cache;
  uint64_t *pair_cache; /* lent to bs */
  uint64_t cache_serial;
  /* Counters for dflash_tokenizer_thread_stats (experimental): every piece, and those that
   * went past the piece cache (one add per call, one per miss: off the hit path). */
  uint64_t n_pieces, n_missed;
} enc_ctx;

static void ctx_free(enc_ctx *c) {
  df_buf_free(&c->repaired);
  df_buf_free(&c->normed);
  df_buf_free(&c->nfc_part);
  df_buf_free(&c->kept);
  df_pretok_scratch_free(&c->ps);
  df_bpe_scratch_free(&c->bs);
  free(c->out.v);
  free(c->cache);
  free(c->long_cache);
  free(c->xl_cache);
  free(c->pair_cache);
  memset(c, 0, sizeof *c);
}

/* Drop scratch that one huge text grew, so a thread does not keep it pinned. */
static void ctx_trim(enc_ctx *c) {
  enum { BIG = 1 << 22 };
  if (c->out.cap * sizeof *c->out.v > BIG) {
    free(c->out.v);
    memset(&c->out, 0, sizeof c->out);
  }
  if (c->bs.cap * 4 * sizeof(uint32_t) + c->bs.heap_cap * sizeof(uint64_t) > BIG)
    df_bpe_scratch_free(&c->bs);
  if ((c->ps.a.cap + c->ps.b.cap) * sizeof(df_range) + c->ps.prefixed.cap > BIG)
    df_pretok_scratch_free(&c->ps);
  if (c->repaired.cap > BIG) df_buf_free(&c->repaired);
  if (c->normed.cap > BIG) df_buf_free(&c->normed);
  if (c->nfc_part.cap > BIG) df_buf_free(&c->nfc_part);
  if (c->kept.cap > BIG) df_buf_free(&c->kept);
}

/* A piece cache (16 MiB), on huge pages where the kernel gives them (df_big_alloc). */
static piece_entry *cache_alloc(void) { return df_big_alloc(sizeof(piece_entry) << DF_CACHE_BITS); }

/* Make the cache belong to tokenizer t (reset to t's seed, or cleared, when it held another's
 * pieces). */
static void cache_for(enc_ctx *c, const dflash_tokenizer *t) {
  c->bs.pair_cache = c->pair_cache; /* a trim may have cleared the loan */
  if (c->cache && c->pair_cache && c->cache_serial == t->serial) return;
  /* line-aligned: a bucket (two entries) is one cache line, so a hit (or its prefetch) is one */
  if (!c->cache) c->cache = cache_alloc();
  if (c->cache && t->cache_seed) memcpy(c->cache, t->cache_seed, sizeof *c->cache << DF_CACHE_BITS);
  else if (c->cache) memset(c->cache, 0, sizeof *c->cache << DF_CACHE_BITS);
  if (!c->long_cache) c->long_cache = df_big_alloc(sizeof *c->long_cache << DF_LONG_BITS);
  if (c->long_cache && t->long_seed)
    memcpy(c->long_cache, t->long_seed, sizeof *c->long_cache << DF_LONG_BITS);
  else if (c->long_cache) memset(c->long_cache, 0, sizeof *c->long_cache << DF_LONG_BITS);
  if (!c->xl_cache) c->xl_cache = df_big_alloc(sizeof *c->xl_cache << DF_XL_BITS);
  if (c->xl_cache) memset(c->xl_cache, 0, sizeof *c->xl_cache << DF_XL_BITS);
  if (!c->pair_cache) c->pair_cache = aligned_alloc(64, DF_PAIR_CACHE_SLOTS * sizeof(uint64_t));
  if (c->pair_cache) memset(c->pair_cache, 0xFF, DF_PAIR_CACHE_SLOTS * sizeof(uint64_t));
  c->bs.pair_cache = c->pair_cache;
  c->cache_serial = t->serial;
}

/* The n <= 8 bytes at p as a little-endian word. */
static inline uint64_t le_word(const uint8_t *p, size_t n) {
#if DF_LITTLE_ENDIAN
  return df_load_upto8(p, n);
#else
  uint64_t w = 0;
  for (size_t i = 0; i < n; i++) w |= (uint64_t)p[i] << (8 * i);
  return w;
#endif
}

/* The key of words lo and hi (hi's top byte the length). The two multiplies mix every bit into
 * h's top bits, the bucket; the vocabulary has its own hash (df_hash_bytes, on a miss). */
static inline piece_key key_of(uint64_t lo, uint64_t hi) {
  return (piece_key){lo, hi, (lo ^ hi * 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull};
}

/* The key of the piece p[0..n). A piece over DF_CACHE_PIECE bytes keeps only its length
 * (capped) in the words, and h from all its bytes. */
static inline piece_key piece_key_of(const uint8_t *p, size_t n) {
  uint64_t len = (uint64_t)(n < 31 ? n : 31) << 56;
  if (n > DF_CACHE_PIECE) return (piece_key){0, len, df_hash_bytes(p, n)};
  if (n <= 8) return key_of(le_word(p, n), len);
  return key_of(le_word(p, 8), le_word(p + 8, n - 8) | len);
}

/* Whether entry e holds the piece of key k (its count aside). */
static inline bool entry_is(const piece_entry *e, const piece_key *k) {
  return ((e->lo ^ k->lo) | ((e->hi ^ k->hi) & DF_KEY_MATCH)) == 0;
}

static inline unsigned entry_count(const piece_entry *e) {
  return (unsigned)(e->hi >> DF_KEY_COUNT_SHIFT);
}

/* A bucket, the even entry of its pair (one line: the array is line-aligned). */
static inline size_t bucket_of(uint64_t h) {
  return (size_t)(h >> (64 - DF_CACHE_BITS)) & ~(size_t)1;
}

_Static_assert(offsetof(piece_key, hi) == 8 && offsetof(piece_entry, hi) == 8,
               "a key's and an entry's words are their first 16 bytes");

/* Whether each way of bucket e holds the piece of key k (its count aside): with SSE2, each
 * way's two words are compared with the key's as 16 bytes (the scalar compares, two words and
 * a mask a way, were 5-7 % slower on Kimi K2's English, code and mix in drv4, 2-4 % on o200k's
 * and Qwen2's). */
static inline __attribute__((always_inline)) void bucket_ways(const piece_entry *e,
                                                              const piece_key *k, bool *w0,
                                                              bool *w1) {
#ifdef __SSE2__
  const __m128i match = _mm_set_epi64x((long long)DF_KEY_MATCH, -1);
  const __m128i kv = _mm_loadu_si128((const __m128i *)(const void *)k);
  __m128i a = _mm_and_si128(_mm_loadu_si128((const __m128i *)(const void *)&e[0]), match);
  __m128i b = _mm_and_si128(_mm_loadu_si128((const __m128i *)(const void *)&e[1]), match);
  *w0 = _mm_movemask_epi8(_mm_cmpeq_epi8(a, kv)) == 0xFFFF;
  *w1 = _mm_movemask_epi8(_mm_cmpeq_epi8(b, kv)) == 0xFFFF;
#else
  *w0 = entry_is(&e[0], k);
  *w1 = entry_is(&e[1], k);
#endif
}

/* The entry holding the piece of key k, or NULL. A bucket is two entries (2-way set
 * associative), the newer first. */
static inline __attribute__((always_inline)) const piece_entry *cache_find(const piece_entry *cache,
                                                                           const piece_key *k) {
  if (!cache) return NULL;
  const piece_entry *e = &cache[bucket_of(k->h)];
  if (entry_is(e, k)) return e;
  return entry_is(e + 1, k) ? e + 1 : NULL;
}

/* The ids of the piece of key k appended from the cache; false when it is not there (or
 * marked DF_CACHE_MORE: the long cache may have it). */
static inline __attribute__((always_inline)) bool cache_get(enc_ctx *c, const piece_key *k) {
  const piece_entry *e = cache_find(c->cache, k);
  if (!e || entry_count(e) > DF_CACHE_IDS) return false;
  /* All four, unconditionally: a loop over the count reloads and stores out.len per id (the
   * ids might alias it). The caller made room for them. */
  memcpy(c->out.v + c->out.len, e->ids, sizeof e->ids);
  c->out.len += entry_count(e);
  return true;
}

/* The long cache's entry for the piece of key k and n bytes, when the piece goes there: over
 * DF_CACHE_PIECE bytes (up to DF_LONG_PIECE), or marked DF_CACHE_MORE in the piece cache. */
static inline long_entry *long_slot(const enc_ctx *c, const piece_key *k, size_t n) {
  if (!c->long_cache || n > DF_LONG_PIECE) return NULL;
  if (n <= DF_CACHE_PIECE) {
    const piece_entry *e = cache_find(c->cache, k);
    if (!e || entry_count(e) != DF_CACHE_MORE) return NULL;
  }
  return &c->long_cache[k->h >> (64 - DF_LONG_BITS)];
}

/* The XL cache's entry for the piece of key k and n bytes, when the piece goes there. */
static inline xl_entry *xl_slot(const enc_ctx *c, const piece_key *k, size_t n) {
  if (!c->xl_cache || n <= DF_LONG_PIECE || n > DF_XL_PIECE) return NULL;
  return &c->xl_cache[k->h >> (64 - DF_XL_BITS)];
}

/* Write entry e: the piece of key k, `count` ids (at most DF_CACHE_IDS), or DF_CACHE_MORE with
 * none. */
static void entry_write(piece_entry *e, const piece_key *k, const uint32_t *ids, size_t count) {
  e->lo = k->lo;
  e->hi = k->hi | (uint64_t)count << DF_KEY_COUNT_SHIFT;
  memset(e->ids, 0, sizeof e->ids);
  if (count <= DF_CACHE_IDS) memcpy(e->ids, ids, count * sizeof *ids);
}

/* Write a long or an XL entry E (the same fields, of two sizes: one writer for both): the piece
 * P[0..LEN) with hash H, COUNT ids (at most the entry's). */
#define RUN_WRITE(E, H, P, LEN, IDS, COUNT)                               \
  ((E)->hash = (H), (E)->len = (uint8_t)(LEN), (E)->n = (uint8_t)(COUNT), \
   (void)memcpy((E)->bytes, (P), (LEN)), (void)memcpy((E)->ids, (IDS), (COUNT) * sizeof *(IDS)))

/* Cache the piece p[0..n) of key k as the `count` ids at ids: in the piece cache, the older
 * way pushed out, when it fits; else in the long cache, with a mark in the piece cache for a
 * short piece. A piece the bucket holds already (a mark whose long entry was overwritten, met
 * again) is written where it is, so a bucket never holds it twice. */
static void cache_put_ids(enc_ctx *c, const piece_key *k, const uint8_t *p, size_t n,
                          const uint32_t *ids, size_t count) {
  if (!c->cache || !count) return;
  bool fits = count <= DF_CACHE_IDS, long_fits = c->long_cache && count <= DF_LONG_IDS;
  if (n <= DF_CACHE_PIECE && (fits || long_fits)) {
    piece_entry *e = &c->cache[bucket_of(k->h)];
    if (!entry_is(e, k)) e[1] = e[0]; /* (a copy in way 1 is overwritten) */
    entry_write(e, k, ids, fits ? count : DF_CACHE_MORE);
    if (fits) return;
  }
  long_entry *le = long_slot(c, k, n);
  if (le && count <= DF_LONG_IDS) RUN_WRITE(le, k->h, p, n, ids, count);
  xl_entry *xe = xl_slot(c, k, n);
  if (xe && count <= DF_XL_IDS) RUN_WRITE(xe, k->h, p, n, ids, count);
}

/* Cache the piece as the ids the output holds from `first` on. */
static void cache_put(enc_ctx *c, const piece_key *k, const uint8_t *p, size_t n, size_t first) {
  cache_put_ids(c, k, p, n, (const uint32_t *)(c->out.v + first), c->out.len - first);
}

/* Whether the n bytes at a and at p are the same: from 8 bytes on whole words, the last
 * overlapping, instead of a memcmp call of variable length (fewer bytes, a short piece of 5-13
 * ids marked DF_CACHE_MORE: memcmp). */
static inline bool same_bytes(const uint8_t *a, const uint8_t *p, size_t n) {
  if (n < 8) return memcmp(a, p, n) == 0;
  uint64_t x, y, diff = 0;
  for (size_t i = 0; i + 8 < n; i += 8) {
    memcpy(&x, a + i, 8);
    memcpy(&y, p + i, 8);
    diff |= x ^ y;
  }
  memcpy(&x, a + n - 8, 8);
  memcpy(&y, p + n - 8, 8);
  return !(diff | (x ^ y));
}

/* Whether a long or an XL entry E (the same fields, of two sizes) holds the N bytes at P with
 * hash H. */
#define RUN_HOLDS(E, H, P, N) \
  ((E)->hash == (H) && (E)->len == (N) && same_bytes((E)->bytes, (P), (N)))

/* The `count` ids at ids appended to the output (false when it cannot grow: the merge will
 * say so). */
static bool append_ids(enc_ctx *c, const uint32_t *ids, size_t count) {
  if (df_ids_reserve(&c->out, count)) return false;
  memcpy(c->out.v + c->out.len, ids, count * sizeof *ids);
  c->out.len += count;
  return true;
}

/* The ids of the piece p[0..n) of key k appended from the long or the XL cache, when the
 * entry the piece goes to holds it. */
static bool long_get(enc_ctx *c, const piece_key *k, const uint8_t *p, size_t n) {
  const long_entry *le = long_slot(c, k, n);
  if (le) return RUN_HOLDS(le, k->h, p, n) && append_ids(c, le->ids, le->n);
  const xl_entry *xe = xl_slot(c, k, n);
  return xe && RUN_HOLDS(xe, k->h, p, n) && append_ids(c, xe->ids, xe->n);
}

/* Where a seed is a merge (HF without ignore_merges; ~1,250 instructions each, the load's
 * cost), every short token is merged (2^18 holds any vocabulary's). With 2^15, the budget
 * before, most of Qwen2's 149,444 short tokens went unseeded, and a first-sight word of one
 * token merged on the text's time. Seeding all: Qwen2's load 1,395 -> 1,496 M instructions
 * (+7 %, 240 -> 263 ms), piece-cache hits on the bench's English 97.10 -> 97.90 %, code 97.39
 * -> 97.79 %, the mix 98.08 -> 98.38 %, and drv4 English +7 %, code and the mix +5 %. The long
 * cache's seed keeps a budget of 2^12 (its tokens merge longer; 2^16 cost 30 ms of load and
 * gained nothing measurable). */
enum { SEED_MERGES = 1 << 18, SEED_LONG_MERGES = 1 << 12 };

/* The ids encode_missed gives the token p[0..n) into c->out (the whole-piece lookup's id, or
 * the merge's result, counted in *merged, at most `limit`); false where it has none to seed. */
static bool seed_ids(const dflash_tokenizer *t, enc_ctx *c, const uint8_t *p, size_t n,
                     size_t *merged, size_t limit, dflash_status *st) {
  const df_vocab *v = &t->vocab;
  c->out.len = 0;
  if (t->whole_piece_lookup) {
    uint32_t found = df_vocab_find_h(v, p, n, df_hash_bytes(p, n));
    if (found == UINT32_MAX) return false; /* (not for an ordinary token; encode_missed merges) */
    *st = df_ids_push(&c->out, (int32_t)found);
  } else {
    if (*merged == limit) return false;
    ++*merged;
    *st = df_bpe_encode(v, &t->pairs, p, n, DF_BPE_HEAP_THRESHOLD, &c->bs, &c->out);
  }
  return !*st;
}

/* Seed a short token (at most DF_CACHE_PIECE bytes) into the piece cache's seed, unless both
 * ways of its bucket are taken. */
static void seed_short(piece_entry *seed, const dflash_tokenizer *t, enc_ctx *c, const uint8_t *p,
                       size_t n, size_t *merged, dflash_status *st) {
  piece_key k = piece_key_of(p, n);
  piece_entry *e = &seed[bucket_of(k.h)];
  if (e[1].hi || entry_is(&e[0], &k)) return; /* both ways taken (way 0 fills first) */
  if (!seed_ids(t, c, p, n, merged, SEED_MERGES, st) || c->out.len > DF_CACHE_IDS) return;
  entry_write(e[0].hi ? &e[1] : &e[0], &k, (const uint32_t *)c->out.v, c->out.len);
}

/* Seed a longer token (up to DF_LONG_PIECE bytes) into the long cache's seed, unless a lower
 * id took its slot. */
static void seed_long(long_entry *seed, const dflash_tokenizer *t, enc_ctx *c, const uint8_t *p,
                      size_t n, size_t *merged, dflash_status *st) {
  uint64_t h = df_hash_bytes(p, n); /* piece_key_of's h for such a piece */
  long_entry *le = &seed[h >> (64 - DF_LONG_BITS)];
  if (le->len || !seed_ids(t, c, p, n, merged, SEED_LONG_MERGES, st) || c->out.len > DF_LONG_IDS)
    return;
  RUN_WRITE(le, h, p, n, (const uint32_t *)c->out.v, c->out.len);
}

/*
 * The piece cache's seed. Most pieces the cache misses on real text are first sight, and a
 * first-sight word is often one token: it cost a vocabulary probe (filter word, then slot,
 * out of L2) or a merge. So every thread's cache starts holding the short tokens, each with
 * the ids encode_missed gives for its bytes (the whole-piece lookup's id, or the merge's
 * result: the same ids by construction), placed in its bucket as cache_put would place it,
 * lower ids (earlier merges, commoner) first, a token skipped where both ways are taken.
 * Tokens of 1..DF_CACHE_PIECE bytes (with a 24-byte limit, before entries of 32 bytes, more
 * than half the buckets of 2^17 held two); not for tokenizers with bytes that have no token
 * (their cache is keyed by the bytes kept). Built once at load, read-only, 16 MiB a tokenizer
 * (and 4 MiB for the long cache's seed, seed_long);
 * cache_for copies it where it cleared the cache, so a hit costs what it did and a thread's
 * cache stays the size it was.
 */
static dflash_status cache_seed_build(dflash_tokenizer *t) {
  const df_vocab *v = &t->vocab;
  if (v->byte_gaps || !v->slots || df_env_on(getenv("DFLASH_TOKENIZER_NO_SEED"))) return DFLASH_OK;
  piece_entry *seed = df_big_alloc(sizeof *seed << DF_CACHE_BITS);
  long_entry *long_seed = df_big_alloc(sizeof *long_seed << DF_LONG_BITS);
  if (!seed || !long_seed) {
    free(seed);
    free(long_seed);
    return df_error_nomem("piece cache seed");
  }
  memset(seed, 0, sizeof *seed << DF_CACHE_BITS);
  memset(long_seed, 0, sizeof *long_seed << DF_LONG_BITS);
  enc_ctx c = {0};
  dflash_status st = DFLASH_OK;
  size_t merged = 0, merged_long = 0; /* two budgets: the short seeds keep theirs */
  for (uint32_t id = 0; id < v->n_ids && !st; id++) {
    size_t n = v->len[id];
    if (v->kind[id] != DF_TOK_ORDINARY || !n || n > DF_LONG_PIECE) continue;
    const uint8_t *p = (const uint8_t *)v->blob.data + v->off[id];
    if (n <= DF_CACHE_PIECE) seed_short(seed, t, &c, p, n, &merged, &st);
    else seed_long(long_seed, t, &c, p, n, &merged_long, &st);
  }
  df_bpe_scratch_free(&c.bs);
  free(c.out.v);
  if (st) {
    free(seed);
    free(long_seed);
    return st;
  }
  t->cache_seed = seed;
  t->long_seed = long_seed;
  return DFLASH_OK;
}

/* Merge a piece and remember the result in the cache. */
static dflash_status merge_put(const dflash_tokenizer *t, const uint8_t *p, size_t n,
                               const piece_key *k, enc_ctx *c) {
  size_t first = c->out.len;
  dflash_status st = df_bpe_encode(&t->vocab, &t->pairs, p, n, DF_BPE_HEAP_THRESHOLD, &c->bs,
                                   &c->out);
  if (!st) cache_put(c, k, p, n, first);
  return st;
}

/*
 * A piece holding a byte that has no token (vocab.byte_gaps). Hugging Face
 * (no unk_token) looks the whole word up first (ignore_merges), then drops
 * the characters it cannot encode, so their neighbours become adjacent and
 * may merge. The cache is keyed by the bytes kept, and holds merge results
 * only: with whole-piece lookup a cached entry could be a lookup result,
 * which HF never gives for a piece that lost bytes.
 */
static dflash_status encode_gapped(const dflash_tokenizer *t, const uint8_t *p, size_t n,
                                   enc_ctx *c) {
  const df_vocab *v = &t->vocab;
  if (t->whole_piece_lookup) {
    uint32_t id = df_vocab_find(v, (const char *)p, n);
    if (id != UINT32_MAX) return df_ids_push(&c->out, (int32_t)id);
  }
  c->kept.len = 0;
  if (df_buf_reserve(&c->kept, n)) return DFLASH_E_NOMEM;
  uint8_t *k = (uint8_t *)c->kept.data;
  size_t m = 0;
  c->n_missed++; /* a gapped piece counts as a miss even when its kept bytes hit */
  for (size_t i = 0; i < n; i++)
    if (v->byte_id[p[i]] != UINT32_MAX) k[m++] = p[i];
  if (m <= 1) return m ? df_ids_push(&c->out, (int32_t)v->byte_id[k[0]]) : DFLASH_OK;
  if (t->whole_piece_lookup)
    return df_bpe_encode(v, &t->pairs, k, m, DF_BPE_HEAP_THRESHOLD, &c->bs, &c->out);
  piece_key key = piece_key_of(k, m);
  if (cache_get(c, &key)) return DFLASH_OK;
  return long_get(c, &key, k, m) ? DFLASH_OK : merge_put(t, k, m, &key, c);
}

/* Whether some byte of the piece has no token. */
static bool has_gap(const df_vocab *v, const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (v->byte_id[p[i]] == UINT32_MAX) return true;
  return false;
}

/* Ids of a piece the piece cache does not hold: from the long or the XL cache, else the
 * whole-piece lookup, else the merge. */
static dflash_status encode_missed(const dflash_tokenizer *t, const uint8_t *p, size_t n,
                                   const piece_key *k, enc_ctx *c) {
  size_t first = c->out.len;
  if (long_get(c, k, p, n)) return DFLASH_OK;
  c->n_missed++;
  uint32_t id = t->whole_piece_lookup ? df_vocab_find(&t->vocab, (const char *)p, n) : UINT32_MAX;
  if (id == UINT32_MAX) return merge_put(t, p, n, k, c);
  dflash_status st = df_ids_push(&c->out, (int32_t)id);
  if (!st) cache_put(c, k, p, n, first);
  return st;
}

/* Whether the piece of key k, of at most DF_CACHE_PIECE bytes, is all ASCII: the pieces
 * merge_ahead takes. Without this test (drv4, o200k, the same library with and without
 * DFLASH_TOKENIZER_NO_AHEAD, medians of 11) English went 130.6 -> 140.8 MB/CPU-s and the mix
 * 152.5 -> 164.3, but the other scripts 82.3 -> 76.7 and CJK 47.9 -> 46.0: their merges are
 * longer, and one at a time the list merge scans only the pairs that can merge. */
static inline bool key_ascii(const piece_key *k) {
  return !((k->lo | (k->hi & 0x00FFFFFFFFFFFFFFull)) & 0x8080808080808080ull);
}

/*
 * The misses of a scanned text, merged together (waiting_misses): a merge waits on memory
 * (1,830 cycles, 480 with its lines warm: README, "Where a miss's time goes"), and
 * df_bpe_merge_many overlaps the waits of several. The probe loop leaves room in the output for
 * each such miss (an ASCII piece of 2..DF_CACHE_PIECE bytes: one id a byte at most) and goes on,
 * across chunks; up to DF_BPE_MANY distinct pieces wait (their whole-piece lookups' lines
 * loading meanwhile), a piece met again while it waits waits once, and the batch resolves when
 * it is full or the text ends: ids written into the room left, the pieces cached. The output is
 * closed up at the text's end, or when MISS_OCC occurrences wait (misses_close). Before, the
 * first miss of a chunk of 128 pieces merged at once with the misses found by probing the rest
 * of the chunk a second time (10-11 % of encode_scanned's cycles on English), and a batch held
 * only one chunk's misses.
 */
enum { SCAN_CHUNK = 128, MISS_OCC = 128 };
typedef struct waiting_misses {
  size_t k;             /* distinct pieces waiting */
  size_t n_occ, n_done; /* occurrences, and those whose ids are written */
  const uint8_t *p[DF_BPE_MANY];
  size_t len[DF_BPE_MANY];
  piece_key key[DF_BPE_MANY];
  uint64_t vh[DF_BPE_MANY]; /* the vocabulary's hash, where pieces are looked up whole */
  uint8_t count[DF_BPE_MANY];
  uint32_t ids[DF_BPE_MANY][DF_BPE_SHORT];
  struct {
    size_t at; /* where its room starts in the output */
    uint8_t room, piece, count;
  } occ[MISS_OCC];
} waiting_misses;

/* The index of the piece of key k (at most DF_CACHE_PIECE bytes: the key is its bytes) among
 * the waiting ones, or -1. */
static int misses_find(const waiting_misses *a, const piece_key *k) {
  for (size_t x = 0; x < a->k; x++)
    if (a->key[x].lo == k->lo && a->key[x].hi == k->hi) return (int)x;
  return -1;
}

/* The waiting pieces resolved: looked up whole where the tokenizer does so, the rest merged
 * together; their ids written into their occurrences' room and cached. */
static void misses_resolve(const dflash_tokenizer *t, enc_ctx *c, waiting_misses *a) {
  const uint8_t *mp[DF_BPE_MANY];
  size_t mlen[DF_BPE_MANY], nm = 0;
  uint32_t mids[DF_BPE_MANY][DF_BPE_SHORT];
  uint8_t mcount[DF_BPE_MANY], slot[DF_BPE_MANY];
  for (size_t x = 0; x < a->k; x++) {
    uint32_t id = t->whole_piece_lookup ? df_vocab_find_h(&t->vocab, a->p[x], a->len[x], a->vh[x])
                                        : UINT32_MAX;
    if (id != UINT32_MAX) {
      a->ids[x][0] = id, a->count[x] = 1;
    } else {
      mp[nm] = a->p[x], mlen[nm] = a->len[x], slot[nm++] = (uint8_t)x;
    }
  }
  if (nm) df_bpe_merge_many(&t->vocab, &t->pairs, mp, mlen, nm, mids, mcount);
  for (size_t x = 0; x < nm; x++) {
    memcpy(a->ids[slot[x]], mids[x], mcount[x] * sizeof **mids);
    a->count[slot[x]] = mcount[x];
  }
  c->n_missed += a->k;
  for (size_t x = 0; x < a->k; x++)
    cache_put_ids(c, &a->key[x], a->p[x], a->len[x], a->ids[x], a->count[x]);
  for (size_t o = a->n_done; o < a->n_occ; o++) {
    size_t x = a->occ[o].piece;
    memcpy(c->out.v + a->occ[o].at, a->ids[x], a->count[x] * sizeof **a->ids);
    a->occ[o].count = a->count[x];
  }
  a->n_done = a->n_occ;
  a->k = 0;
}

static void misses_close(const dflash_tokenizer *t, enc_ctx *c, waiting_misses *a);

/* The miss at piece p[0..m) of key k (2..DF_CACHE_PIECE ASCII bytes) made to wait: m ids of
 * room at the output's end (the caller made it), the batch resolved first when it is full, the
 * output closed up first when MISS_OCC occurrences wait. */
static void misses_add(const dflash_tokenizer *t, enc_ctx *c, const uint8_t *p, size_t m,
                       const piece_key *k, waiting_misses *a) {
  if (a->n_occ == MISS_OCC) misses_close(t, c, a);
  int x = misses_find(a, k);
  if (x < 0) {
    if (a->k == DF_BPE_MANY) misses_resolve(t, c, a);
    x = (int)a->k++;
    a->p[x] = p, a->len[x] = m, a->key[x] = *k;
    if (t->whole_piece_lookup) df_vocab_prefetch(&t->vocab, a->vh[x] = df_hash_bytes(p, m));
  }
  a->occ[a->n_occ].at = c->out.len;
  a->occ[a->n_occ].room = (uint8_t)m;
  a->occ[a->n_occ++].piece = (uint8_t)x;
  c->out.len += m;
}

/* The waiting misses resolved and the output, from the first occurrence's room on, closed up:
 * each occurrence's ids, then the output up to the next one, moved down. */
static void misses_close(const dflash_tokenizer *t, enc_ctx *c, waiting_misses *a) {
  if (!a->n_occ) return;
  if (a->k) misses_resolve(t, c, a);
  int32_t *v = c->out.v;
  size_t w = a->occ[0].at;
  for (size_t o = 0; o < a->n_occ; o++) {
    size_t at = a->occ[o].at, from = at + a->occ[o].room;
    size_t to = o + 1 < a->n_occ ? a->occ[o + 1].at : c->out.len;
    memmove(v + w, v + at, a->occ[o].count * sizeof *v);
    w += a->occ[o].count;
    memmove(v + w, v + from, (to - from) * sizeof *v);
    w += to - from;
  }
  c->out.len = w;
  a->n_occ = a->n_done = 0;
}
_Static_assert(DF_CACHE_PIECE <= DF_BPE_SHORT, "a cached piece fits df_bpe_merge_many");

/* Token ids of one piece, with room for n + DF_CACHE_IDS ids made by the caller, through
 * c->out: the path of a tokenizer with bytes that have no token (vocab.byte_gaps).
 * encode_plain writes the common cases of the others itself. */
static dflash_status encode_piece(const dflash_tokenizer *t, const uint8_t *p, size_t n,
                                  const piece_key *k, enc_ctx *c) {
  if (t->vocab.byte_gaps && has_gap(&t->vocab, p, n)) return encode_gapped(t, p, n, c);
  if (n == 1) {
    c->out.v[c->out.len++] = (int32_t)t->vocab.byte_id[p[0]];
    return DFLASH_OK;
  }
  if (cache_get(c, k)) return DFLASH_OK; /* L2-resident, cheaper than the vocabulary */
  return encode_missed(t, p, n, k, c);
}

/* Start loading a piece's cache bucket (16 MiB, out of L2): one line, both ways (with entries
 * of 64 bytes, a way a line, prefetching both was no faster, best of 32 passes over 10 MB of
 * English: 110.0 against 112.9 MB/CPU-s). Its vocabulary filter word and slot are not
 * prefetched: five pieces in six hit the cache or are one byte, and loading those lines for
 * every piece cost 4-5 % of encode on the bench corpus. */
static inline void prefetch_piece(const piece_entry *cache, uint64_t h) {
  /* an address, not a pointer into nothing, when there is no cache: a prefetch never faults */
  __builtin_prefetch((const void *)((uintptr_t)cache + bucket_of(h) * sizeof *cache));
}

/* Two empty entries, for a key that can match none. */
static const piece_entry no_entry[2];

/* prefetch_piece, or for a piece over DF_CACHE_PIECE bytes the first line of its long cache
 * entry: one prefetch either way, the address chosen without a branch. */
static inline void prefetch_key(const piece_entry *cache, const long_entry *lc, const piece_key *k,
                                size_t n) {
  uintptr_t a = (uintptr_t)cache + bucket_of(k->h) * sizeof *cache;
  uintptr_t b = (uintptr_t)lc + (k->h >> (64 - DF_LONG_BITS)) * sizeof *lc;
  __builtin_prefetch((const void *)(n > DF_CACHE_PIECE ? b : a));
}

/* piece_key_of a piece of the text at base. A piece of up to 15 bytes not at the very start
 * is read as the 8 bytes that end where it ends, shifted down to its bytes 0-7 (up to 8) or
 * 8-14, and for 9-15 the 8 it starts with: one or two loads instead of df_load_upto8's
 * branches on the length (choosing the two keys with masks, no branch, was 11 % more
 * instructions and slower). */
static inline piece_key text_key(const char *base, const df_range *r) {
  size_t n = r->end - r->begin;
#if DF_LITTLE_ENDIAN
  if (n - 1 > DF_CACHE_PIECE - 1 || r->end < 8)
    return piece_key_of((const uint8_t *)base + r->begin, n);
  uint64_t last, first, len = (uint64_t)n << 56;
  memcpy(&last, base + r->end - 8, 8);
  if (n <= 8) return key_of(last >> (64 - 8 * n), len);
  memcpy(&first, base + r->begin, 8);
  return key_of(first, last >> (8 * (16 - n)) | len);
#else
  return piece_key_of((const uint8_t *)base + r->begin, n);
#endif
}
_Static_assert(DF_CACHE_PIECE <= 15, "text_key reads a piece as at most two words");

/* Pre-tokenize and merge text that holds no added token. The two common cases, a one-byte
 * piece and a piece in the cache, are written here with the output's pointer, length and
 * capacity in locals: through c->out they were stored and loaded again for every piece (a
 * copy of ids may alias anything), a store-to-load chain through the whole loop. The rest
 * (misses, pieces with bytes that have no token) goes through c->out as before. */
static dflash_status encode_general(const dflash_tokenizer *t, const char *text, size_t len,
                                    enc_ctx *c) {
  if (!len) return DFLASH_OK;
  const char *base;
  df_ranges *pieces;
  dflash_status st = df_pretok_run(&t->pretok, text, len, &c->ps, &base, &pieces);
  if (st) return st;
  const size_t np = pieces->len;
  c->n_pieces += np;
  enum { AHEAD = 8 };
  /* AHEAD one-byte pieces past the end, so the loop hashes the piece AHEAD on without a test
   * (their hashes only prefetch) */
  if (pieces->cap - np < AHEAD) { /* grow (rare); else in place: a push each cost 0.03 us */
    for (size_t k = 0; k < AHEAD; k++)
      if (df_ranges_push(pieces, 0, 1)) return DFLASH_E_NOMEM;
    pieces->len = np;
  }
  for (size_t k = 0; k < AHEAD; k++) pieces->v[np + k] = (df_range){0, 1};
  piece_key keys[AHEAD];
  const piece_entry *cache = c->cache;
  const uint32_t *byte_id = t->vocab.byte_id;
  const bool fast = !t->vocab.byte_gaps && cache;
  const df_range *rv = pieces->v;
  /* Hash a few pieces ahead and prefetch their cache entries, so the misses overlap. */
  for (size_t i = 0; i < AHEAD; i++) { /* (not the padding: short texts, per-call cost) */
    keys[i] = i < np ? text_key(base, &rv[i]) : (piece_key){0, 0, 0};
    prefetch_piece(cache, keys[i].h);
  }
  int32_t *ov = c->out.v;
  size_t olen = c->out.len;
  enum { BLOCK = 64 };
  for (size_t i = 0; i < np; i++) {
    /* Room for the ids of the next BLOCK pieces at once: byte-level BPE gives at most one
     * id per byte, and a cache hit copies DF_CACHE_IDS. */
    if (i % BLOCK == 0) {
      size_t last = (np - i < BLOCK ? np : i + BLOCK) - 1;
      c->out.len = olen;
      if (df_ids_reserve(&c->out, rv[last].end - rv[i].begin + DF_CACHE_IDS)) return DFLASH_E_NOMEM;
      ov = c->out.v;
    }
    const df_range *r = &rv[i];
    const uint8_t *p = (const uint8_t *)base + r->begin;
    size_t n = r->end - r->begin;
    piece_key k = keys[i % AHEAD];
    keys[i % AHEAD] = text_key(base, &rv[i + AHEAD]);
    prefetch_piece(cache, keys[i % AHEAD].h);
    if (fast) {
      if (n == 1) {
        ov[olen++] = (int32_t)byte_id[p[0]];
        continue;
      }
      const piece_entry *e = cache_find(cache, &k);
      if (e && entry_count(e) <= DF_CACHE_IDS) { /* all four ids (room is made above) */
        memcpy(ov + olen, e->ids, sizeof e->ids);
        olen += entry_count(e);
        continue;
      }
    }
    c->out.len = olen;
    st = fast ? encode_missed(t, p, n, &k, c) : encode_piece(t, p, n, &k, c);
    if (st) return st;
    ov = c->out.v;
    olen = c->out.len;
  }
  c->out.len = olen;
  return DFLASH_OK;
}

/* The scanner of a pretokenizer that is one named pattern splitting into isolated pieces
 * (tiktoken's patterns, and HF's where the Split is the only step), else DF_SCAN_NONE. */
static df_scanner sole_scanner(const df_pretok *p) {
  if (p->n_steps != 1) return DF_SCAN_NONE;
  const df_pretok_step *st = &p->steps[0];
  if (st->kind != DF_STEP_REGEX || st->behavior != DF_SPLIT_ISOLATED || st->invert)
    return DF_SCAN_NONE;
  return st->scanner;
}

/* The ids of piece i of a scanned chunk that the piece cache did not answer (`marked`: it
 * holds the piece marked DF_CACHE_MORE), appended through c->out: a long hit, a miss. A call
 * of its own, not inlined: the probe loop then keeps its locals in registers (inlined, the
 * miss paths' code took them, and the loop spilled its counter and bases to the stack). */
static __attribute__((noinline)) dflash_status scanned_slow(const dflash_tokenizer *t, enc_ctx *c,
                                                            const char *text, const df_range *r,
                                                            const piece_key *key, size_t i,
                                                            bool marked, waiting_misses *misses) {
  const uint8_t *p = (const uint8_t *)text + r[i].begin;
  size_t m = r[i].end - r[i].begin;
  const piece_key *k = &key[i];
  /* a long hit here, copying all its ids as a short hit does: through encode_missed's long_get
   * (a reserve and a copy of its count) the other scripts and CJK were 3-4 % slower in drv4 */
  if (m > DF_CACHE_PIECE && c->long_cache) { /* its line prefetched with the key */
    const long_entry *le = &c->long_cache[k->h >> (64 - DF_LONG_BITS)];
    if (m <= DF_LONG_PIECE && RUN_HOLDS(le, k->h, p, m)) {
      memcpy(c->out.v + c->out.len, le->ids, sizeof le->ids); /* all, as a short hit */
      c->out.len += le->n;
      return DFLASH_OK;
    }
  }
  if (marked) return encode_missed(t, p, m, k, c); /* its ids are in the long cache */
  if (m == 1) { /* a seed pushed out: the byte's id, cached again */
    size_t at = c->out.len;
    c->out.v[c->out.len++] = (int32_t)t->vocab.byte_id[p[0]];
    cache_put(c, k, p, m, at);
    return DFLASH_OK;
  }
  if (m <= DF_CACHE_PIECE && t->merge_ahead && key_ascii(k)) {
    misses_add(t, c, p, m, k, misses);
    return DFLASH_OK;
  }
  return encode_missed(t, p, m, k, c);
}

/*
 * encode_plain for a sole scanner (sole_scanner), a piece cache and no bytes without a token:
 * the pieces come CHUNK at a time into arrays on the stack (5 KiB), their keys are taken and
 * their buckets prefetched in one loop, and a second loop probes and copies. The whole text's list
 * of ranges (16 bytes a piece: a 10 KB document's did not fit L1) is not written and read back,
 * and the probe loop branches only on misses and long pieces: both ways are compared and a hit's
 * ids copied unconditionally; a one-byte piece is in the cache from its seed. A miss of the
 * batch kind waits (waiting_misses), so nothing is probed twice and a batch is as wide as the
 * text's misses allow: drv4 against misses merged a chunk at a time from the first on, medians
 * of 7, o200k English +10 %, code +10 %, the mix +12 %; Kimi K2 +8 %, +11 %, +13 %; Qwen2 +7 %,
 * +8 %, +11 %. (Waiting for a chunk's end only: chunks of 128 +4-5 %, 512 +9-11 %; across
 * chunks the chunk's size is level from 128 to 512, and 12 or 16 lanes in place of 8 were level
 * or 2-5 % slower on CJK and other scripts.)
 * Returns DFLASH_E_UNSUPPORTED, nothing appended, where the scanner stops before the end (a place
 * it matches nothing), for encode_plain's general path to take the text.
 */
static dflash_status encode_scanned(const dflash_tokenizer *t, df_scanner sc, const char *text,
                                    size_t len, enc_ctx *c) {
  enum { CHUNK = SCAN_CHUNK };
  df_range r[CHUNK];
  piece_key key[CHUNK];
  waiting_misses misses;
  misses.k = misses.n_occ = misses.n_done = 0;
  const piece_entry *cache = c->cache;
  const long_entry *lc = c->long_cache;
  const size_t first = c->out.len;
  uint64_t pieces = 0;
  for (size_t pos = 0; pos < len;) {
    size_t stop, n = df_scan_pieces(sc, (const uint8_t *)text, len, pos, 0, r, CHUNK, &stop);
    if (!n) {
      c->out.len = first;
      return DFLASH_E_UNSUPPORTED;
    }
    pieces += n;
    for (size_t i = 0; i < n; i++) {
      key[i] = text_key(text, &r[i]);
      prefetch_key(cache, lc, &key[i], r[i].end - r[i].begin);
    }
    /* at most one id a byte, plus the DF_LONG_IDS a hit copies */
    if (df_ids_reserve(&c->out, stop - pos + DF_LONG_IDS)) return DFLASH_E_NOMEM;
    int32_t *ov = c->out.v;
    size_t olen = c->out.len;
    for (size_t i = 0; i < n; i++) {
      size_t m = r[i].end - r[i].begin;
      const piece_key *k = &key[i];
      /* a long piece matches no entry: it reads an empty pair (in L1) instead of a bucket that
       * was not prefetched (prefetch_key loaded its long entry), chosen without a branch */
      const piece_entry *e = m > DF_CACHE_PIECE ? no_entry : &cache[bucket_of(k->h)];
      bool w0, w1;
      bucket_ways(e, k, &w0, &w1);
      e += !w0;
      memcpy(ov + olen, e->ids, sizeof e->ids);
      unsigned count = entry_count(e);
      /* the key is the piece: one test of both ways and the count, no bytes compared after */
      if ((w0 | w1) & (count <= DF_CACHE_IDS)) {
        olen += count;
        continue;
      }
      c->out.len = olen;
      dflash_status st = scanned_slow(t, c, text, r, key, i, w0 | w1, &misses);
      if (st) return st;
      ov = c->out.v;
      olen = c->out.len;
    }
    c->out.len = olen;
    pos = stop;
  }
  misses_close(t, c, &misses);
  c->n_pieces += pieces;
  return DFLASH_OK;
}

/* Pre-tokenize and merge text that holds no added token. */
static dflash_status encode_plain(const dflash_tokenizer *t, const char *text, size_t len,
                                  enc_ctx *c) {
  df_scanner sc = sole_scanner(&t->pretok);
  if (DF_LITTLE_ENDIAN && sc != DF_SCAN_NONE && c->cache && !t->vocab.byte_gaps) {
    dflash_status st = encode_scanned(t, sc, text, len, c);
    if (st != DFLASH_E_UNSUPPORTED) return st;
  }
  return encode_general(t, text, len, c);
}

/* Split by the added tokens of `trie`, encoding the text between with `plain`. */
static dflash_status split_added(const dflash_tokenizer *t, const df_trie *trie, const char *text,
                                 size_t len, enc_ctx *c,
                                 dflash_status (*plain)(const dflash_tokenizer *, const char *,
                                                        size_t, enc_ctx *)) {
  size_t pos = 0;
  dflash_status st = DFLASH_OK;
  while (!st && pos <= len) {
    size_t mb = len, me = len;
    int k = df_trie_find(trie, t->added, c->mode, text, pos, len, &mb, &me);
    if (k < 0) mb = me = len;
    st = plain(t, text + pos, mb - pos, c);
    if (k < 0 || st) break;
    st = df_ids_push(&c->out, (int32_t)t->added[k].id);
    pos = me;
  }
  return st;
}

/* Normalise one stretch between raw added tokens, then split by normalised ones. */
/* The bytes df_nfc acts on are those from 0xCC (a character from U+0300); below them it only
 * steps forward, ~10 instructions a byte (10 % of Qwen2's encode on English). Of 8 bytes, the
 * high bit of each that is >= 0xCC: the high bit, and the low 7 bits + 0x34 carrying into it
 * (no carry leaves a byte). */
static inline uint64_t bytes_from_cc(uint64_t x) {
  return x & ((x & 0x7F7F7F7F7F7F7F7Full) + 0x3434343434343434ull) & 0x8080808080808080ull;
}

/* Where the first byte >= 0xCC of s[i..n) is, or n. */
static size_t next_from_cc(const uint8_t *s, size_t i, size_t n) {
#if DF_LITTLE_ENDIAN
  for (; i + 8 <= n; i += 8) {
    uint64_t x;
    memcpy(&x, s + i, 8);
    uint64_t m = bytes_from_cc(x);
    if (m) return i + (size_t)__builtin_ctzll(m) / 8;
  }
#endif
  for (; i < n; i++)
    if (s[i] >= 0xCC) return i;
  return n;
}

/*
 * NFC of text[0..len) into out (*changed), as df_nfc gives it, with df_nfc run only on
 * the regions around bytes >= 0xCC. A region starts at the character before the first such
 * byte (its lead byte is below 0xCC: a boundary, where df_nfc's own span would start) and ends
 * at an ASCII byte (a boundary: df_nfc's span stops at or before it) with no such byte in the
 * 64 after it; the text between regions has no byte df_nfc acts on, so it comes through
 * unchanged. Many short regions (Cyrillic words between spaces) merge into one.
 */
dflash_status df_nfc_regions(const char *text, size_t len, df_buf *out, df_buf *part,
                             bool *changed) {
  const uint8_t *s = (const uint8_t *)text;
  *changed = false;
  size_t i = next_from_cc(s, 0, len), copied = 0;
  while (i < len) {
    size_t b = i;
    if (b) /* back to the start of the character before */
      do b--;
      while (b && (s[b] & 0xC0) == 0x80);
    size_t e = i;
    for (;;) {
      while (e < len && s[e] >= 0x80) e++;
      size_t stop = len - e > 64 ? e + 64 : len, k = next_from_cc(s, e, stop);
      if (k == stop) break;
      e = k;
    }
    bool region = false;
    dflash_status st = df_nfc(text + b, e - b, part, &region);
    if (st) return st;
    if (region) {
      if (!*changed) out->len = 0;
      *changed = true;
      if (df_buf_append(out, text + copied, b - copied) ||
          df_buf_append(out, part->data, part->len))
        return df_error_nomem("NFC");
      copied = e;
    }
    i = next_from_cc(s, e, len);
  }
  if (*changed && df_buf_append(out, text + copied, len - copied)) return df_error_nomem("NFC");
  return DFLASH_OK;
}

static dflash_status encode_segment(const dflash_tokenizer *t, const char *text, size_t len,
                                    enc_ctx *c) {
  if (!len) return DFLASH_OK;
  bool changed = false;
  if (t->nfc) {
    dflash_status st = df_nfc_regions(text, len, &c->normed, &c->nfc_part, &changed);
    if (st) return st;
  }
  if (changed) {
    text = c->normed.data;
    len = c->normed.len;
  }
  if (t->norm_trie.n > 1) return split_added(t, &t->norm_trie, text, len, c, encode_plain);
  return encode_plain(t, text, len, c);
}

static dflash_status encode_into(const dflash_tokenizer *t, const char *text, size_t len,
                                 dflash_special_mode mode, enc_ctx *c) {
  c->out.len = 0;
  bool changed;
  dflash_status st = df_utf8_repair(text, len, &c->repaired, &changed);
  if (st) return st;
  if (changed) {
    text = c->repaired.data;
    len = c->repaired.len;
  }
  c->mode = mode;
  return split_added(t, &t->raw_trie, text, len, c, encode_segment);
}

/* Each thread keeps one encoding context (scratch buffers and piece cache)
 * between calls; it is freed when the thread exits. */
static pthread_key_t ctx_key;
static pthread_once_t ctx_once = PTHREAD_ONCE_INIT;
static bool ctx_key_ok;

static void ctx_destroy(void *p) {
  ctx_free(p);
  free(p);
}

static void ctx_key_init(void) { ctx_key_ok = pthread_key_create(&ctx_key, ctx_destroy) == 0; }

static enc_ctx *thread_ctx(void) {
  pthread_once(&ctx_once, ctx_key_init);
  if (!ctx_key_ok) return NULL;
  enc_ctx *c = pthread_getspecific(ctx_key);
  if (!c && (c = calloc(1, sizeof *c)) && pthread_setspecific(ctx_key, c)) {
    free(c);
    c = NULL;
  }
  return c;
}

void dflash_tokenizer_thread_stats(uint64_t *pieces, uint64_t *cache_misses, size_t *cache_bytes) {
  const enc_ctx *c = thread_ctx();
  if (pieces) *pieces = c ? c->n_pieces : 0;
  if (cache_misses) *cache_misses = c ? c->n_missed : 0;
  if (cache_bytes)
    *cache_bytes = c && c->cache ? (sizeof *c->cache << DF_CACHE_BITS) +
                                       (c->long_cache ? sizeof *c->long_cache << DF_LONG_BITS : 0) +
                                       (c->xl_cache ? sizeof *c->xl_cache << DF_XL_BITS : 0) +
                                       DF_PAIR_CACHE_SLOTS * sizeof(uint64_t)
                                 : 0;
}

dflash_status dflash_tokenizer_encode(const dflash_tokenizer *t, const char *text, size_t len,
                                      dflash_special_mode special, int32_t *ids, size_t cap,
                                      size_t *n_ids) {
  DF_CHECK_ARG(t && (text || !len) && (ids || !cap) && n_ids);
  DF_CHECK_ARG(special == DFLASH_SPECIAL_ALL || special == DFLASH_SPECIAL_NONE);
  enc_ctx local = {0}, *c = thread_ctx();
  if (!c) c = &local;
  cache_for(c, t);
  dflash_status st = encode_into(t, text ? text : "", len, special, c);
  if (!st) {
    *n_ids = c->out.len;
    if (c->out.len > cap)
      st = df_error(DFLASH_E_BUFFER, "encode: %zu ids do not fit in %zu", c->out.len, cap);
    else if (c->out.len) memcpy(ids, c->out.v, c->out.len * sizeof *ids);
  }
  if (c == &local) ctx_free(&local);
  else ctx_trim(c);
  return st;
}

/* ---- batch ---------------------------------------------------------------- */

typedef struct batch_job {
  const dflash_tokenizer *t;
  const char *const *texts;
  const size_t *lens;
  dflash_special_mode mode;
  enc_ctx *ctx;          /* per worker */
  df_ids *arena;         /* per worker: ids of the texts it encoded */
  size_t *where;         /* per text: offset in its worker's arena */
  size_t *count;         /* per text */
  int *worker_of;        /* per text */
  dflash_status *status; /* per worker: first failure */
  char **message;        /* per worker */
  int32_t *ids;          /* the caller's array, and where each text's ids start in it */
  size_t *offsets;
} batch_job;

static dflash_status ids_append(df_ids *dst, const int32_t *v, size_t n) {
  if (df_ids_reserve(dst, n)) return DFLASH_E_NOMEM;
  if (n) memcpy(dst->v + dst->len, v, n * sizeof *v);
  dst->len += n;
  return DFLASH_OK;
}

static void batch_range(void *arg, size_t begin, size_t end, int worker) {
  batch_job *j = arg;
  enc_ctx *c = thread_ctx(); /* the pool's threads live on, and so do their caches */
  if (!c) c = &j->ctx[worker];
  cache_for(c, j->t);
  df_ids *arena = &j->arena[worker];
  for (size_t i = begin; i < end && !j->status[worker]; i++) {
    dflash_status st = encode_into(j->t, j->texts[i] ? j->texts[i] : "", j->lens[i], j->mode, c);
    if (!st) st = ids_append(arena, c->out.v, c->out.len);
    if (st) {
      df_error_wrap(st, "text %zu", i);
      j->status[worker] = st;
      j->message[worker] = df_strdup(dflash_last_error());
      return;
    }
    j->where[i] = arena->len - c->out.len;
    j->count[i] = c->out.len;
    j->worker_of[i] = worker;
  }
  ctx_trim(c);
}

/* Copy the ids of texts [begin, end) to their place in the caller's array. */
static void gather_range(void *arg, size_t begin, size_t end, int worker) {
  (void)worker;
  batch_job *j = arg;
  for (size_t i = begin; i < end; i++)
    if (j->count[i])
      memcpy(j->ids + j->offsets[i], j->arena[j->worker_of[i]].v + j->where[i],
             j->count[i] * sizeof *j->ids);
}

/* The texts' offsets, then their ids copied on the pool: copied by one thread, they were
 * ~5 % of a 2-thread batch, which kept it under 1.8x one thread. */
static dflash_status batch_gather(batch_job *j, df_pool *pool, size_t n, int workers, size_t cap) {
  size_t *offsets = j->offsets;
  for (int w = 0; w < workers; w++)
    if (j->status[w]) return df_error(j->status[w], "%s", j->message[w] ? j->message[w] : "");
  size_t at = 0;
  for (size_t i = 0; i < n; i++) {
    offsets[i] = at;
    at += j->count[i];
  }
  offsets[n] = at;
  if (at > cap)
    return df_error(DFLASH_E_BUFFER, "encode_batch: %zu ids do not fit in %zu", at, cap);
  df_pool_for(pool, n, n / ((size_t)workers * 4) + 1, gather_range, j);
  return DFLASH_OK;
}

/* The tokenizer's own pool when no other batch holds it (made or remade for this thread
 * count), else a pool for this call only (*own). The tokenizer is shared read-only; its
 * pool is the one field a batch changes, under pool_busy. */
static dflash_status batch_pool(const dflash_tokenizer *ct, int32_t n_threads, df_pool **out,
                                bool *own) {
  dflash_tokenizer *t = (dflash_tokenizer *)ct;
  if (n_threads <= 0) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    n_threads = cpus > 0 ? (int32_t)cpus : 1;
  }
  *own = atomic_exchange(&t->pool_busy, true);
  if (*own) return df_pool_create(n_threads, out);
  if (t->pool && df_pool_size(t->pool) != n_threads) {
    df_pool_free(t->pool);
    t->pool = NULL;
  }
  dflash_status st = t->pool ? DFLASH_OK : df_pool_create(n_threads, &t->pool);
  if (st) atomic_store(&t->pool_busy, false);
  *out = t->pool;
  return st;
}

static void batch_pool_release(const dflash_tokenizer *ct, df_pool *pool, bool own) {
  if (own) df_pool_free(pool);
  else if (pool) atomic_store(&((dflash_tokenizer *)ct)->pool_busy, false);
}

dflash_status dflash_tokenizer_encode_batch(const dflash_tokenizer *t, const char *const *texts,
                                            const size_t *lens, size_t n,
                                            dflash_special_mode special, int32_t n_threads,
                                            int32_t *ids, size_t cap, size_t *offsets) {
  DF_CHECK_ARG(t && (texts || !n) && (lens || !n) && (ids || !cap) && offsets);
  DF_CHECK_ARG(special == DFLASH_SPECIAL_ALL || special == DFLASH_SPECIAL_NONE);
  bool own = false;
  df_pool *pool = NULL;
  dflash_status st = n > 1 ? batch_pool(t, n_threads, &pool, &own) : DFLASH_OK;
  if (st) return st;
  int workers = df_pool_size(pool);
  batch_job j = {
      .t = t, .texts = texts, .lens = lens, .mode = special, .ids = ids, .offsets = offsets};
  j.ctx = calloc((size_t)workers, sizeof *j.ctx);
  j.arena = calloc((size_t)workers, sizeof *j.arena);
  j.status = calloc((size_t)workers, sizeof *j.status);
  j.message = calloc((size_t)workers, sizeof *j.message);
  j.where = calloc(n + 1, sizeof *j.where);
  j.count = calloc(n + 1, sizeof *j.count);
  j.worker_of = calloc(n + 1, sizeof *j.worker_of);
  if (!j.ctx || !j.arena || !j.status || !j.message || !j.where || !j.count || !j.worker_of) {
    st = df_error_nomem("encode_batch");
  } else {
    /* Small grains balance uneven text lengths; texts are independent. */
    size_t grain = n / ((size_t)workers * 16) + 1;
    df_pool_for(pool, n, grain, batch_range, &j);
    st = batch_gather(&j, pool, n, workers, cap);
  }
  for (int w = 0; j.ctx && w < workers; w++) {
    ctx_free(&j.ctx[w]);
    if (j.arena) free(j.arena[w].v);
    if (j.message) free(j.message[w]);
  }
  free(j.ctx);
  free(j.arena);
  free(j.status);
  free(j.message);
  free(j.where);
  free(j.count);
  free(j.worker_of);
  batch_pool_release(t, pool, own);
  return st;
}

/* ---- decode and lookups ----------------------------------------------------- */

dflash_status dflash_tokenizer_decode(const dflash_tokenizer *t, const int32_t *ids, size_t n,
                                      char *out, size_t cap, size_t *out_len) {
  DF_CHECK_ARG(t && (ids || !n) && (out || !cap) && out_len);
  const df_vocab *v = &t->vocab;
  size_t total = 0;
  for (size_t i = 0; i < n; i++) {
    int32_t id = ids[i];
    if (id < 0 || (uint32_t)id >= v->n_ids || v->kind[id] == DF_TOK_NONE)
      return df_error(DFLASH_E_RANGE,
                      "decode: id %d at position %zu is not a token (vocabulary "
                      "size %u)",
                      id, i, v->n_ids);
    if (total + v->len[id] <= cap) memcpy(out + total, v->blob.data + v->off[id], v->len[id]);
    total += v->len[id];
  }
  *out_len = total;
  if (total > cap)
    return df_error(DFLASH_E_BUFFER, "decode: %zu bytes do not fit in %zu", total, cap);
  return DFLASH_OK;
}

dflash_status dflash_tokenizer_token_to_id(const dflash_tokenizer *t, const char *bytes, size_t len,
                                           int32_t *id) {
  DF_CHECK_ARG(t && (bytes || !len) && id);
  for (size_t k = 0; k < t->n_added; k++)
    if (t->added[k].len == len && !memcmp(t->added[k].text, bytes, len)) {
      *id = (int32_t)t->added[k].id;
      return DFLASH_OK;
    }
  uint32_t found = df_vocab_find(&t->vocab, bytes ? bytes : "", len);
  if (found == UINT32_MAX) return df_error(DFLASH_E_NOT_FOUND, "no token has these %zu bytes", len);
  *id = (int32_t)found;
  return DFLASH_OK;
}

dflash_status dflash_tokenizer_id_to_token(const dflash_tokenizer *t, int32_t id,
                                           const char **bytes, size_t *len, int32_t *is_special) {
  DF_CHECK_ARG(t && bytes && len);
  const df_vocab *v = &t->vocab;
  if (id < 0 || (uint32_t)id >= v->n_ids)
    return df_error(DFLASH_E_RANGE, "token id %d outside [0, %u)", id, v->n_ids);
  if (v->kind[id] == DF_TOK_NONE) return df_error(DFLASH_E_NOT_FOUND, "token id %d is unused", id);
  *bytes = v->blob.data + v->off[id];
  *len = v->len[id];
  if (is_special) {
    *is_special = v->kind[id] != DF_TOK_ORDINARY;
    for (size_t k = 0; k < t->n_added && !*is_special; k++)
      *is_special = t->added[k].id == (uint32_t)id;
  }
  return DFLASH_OK;
}
