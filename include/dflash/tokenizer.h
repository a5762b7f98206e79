/*
 * Tokenizers: byte-level BPE with exact tiktoken / Hugging Face parity.
 *
 * Formats, detected from the path given to dflash_tokenizer_load():
 *  - a tiktoken rank file (`tiktoken.model`, `*.tiktoken`, optionally gzip'd):
 *    one `base64(bytes) rank` per line;
 *  - a Hugging Face `tokenizer.json` (BPE model, normalizer none or NFC,
 *    Split / ByteLevel / Digits pre-tokenizers, added tokens, ignore_merges);
 *  - a `vocab.json` (+ `merges.txt` beside it), GPT-2 byte-level;
 *  - a model directory holding one of the above. A directory with
 *    `tiktoken.model` and a `tokenizer_config.json` naming Kimi's tokenizer
 *    class gets the Kimi K2 pattern and its special-token layout (256 slots
 *    after the ordinary tokens, unnamed ones `<|reserved_token_N|>`).
 *    `added_tokens.json` / `tokenizer_config.json` add special tokens to
 *    vocab.json + merges.txt.
 *
 * Token ids are int32. Tokens are byte strings: lookups and decode use the
 * raw bytes a token stands for (not the byte-level "Ġ" spelling).
 *
 * A loaded tokenizer is immutable: every function below may be called on the
 * same tokenizer from any number of threads at once. Each thread that encodes
 * keeps a context of about 21 MiB (caches of merged pieces, fixed: 16 MiB for
 * pieces of up to 15 bytes, 4 MiB for 16-64 bytes, 0.5 MiB for 65-128; and
 * scratch buffers) until it exits. A loaded tokenizer's tables take about 40 MiB
 * for o200k and 54 MiB for Qwen2 (20 MiB of each is the caches' starting image).
 */
#ifndef DFLASH_TOKENIZER_H
#define DFLASH_TOKENIZER_H

#include <dflash/dflash.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dflash_tokenizer dflash_tokenizer;

typedef struct dflash_tokenizer_options {
  size_t struct_size; /* sizeof(dflash_tokenizer_options) */
  /*
   * Pre-tokenizer: NULL to take the one the files imply (a tokenizer.json
   * names its own; a Kimi directory implies "kimi-k2"; a Qwen2 vocab.json
   * implies "qwen2"; a rank file whose name contains cl100k or o200k implies
   * that encoding). Otherwise one of "cl100k", "o200k", "kimi-k2", "qwen2"
   * (also applies NFC), "qwen3.5" (also NFC), "gpt2", or a regular
   * expression in tiktoken's (Rust regex) syntax, `&&` class intersections
   * included. A bare rank file needs one.
   */
  const char *pattern;
} dflash_tokenizer_options;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_tokenizer_options_default(&opts). */
DFLASH_API void dflash_tokenizer_options_init(dflash_tokenizer_options *opts, size_t size);
#define dflash_tokenizer_options_default(opts) dflash_tokenizer_options_init((opts), sizeof *(opts))

/* Load a tokenizer from a file or model directory (see above). opts may be NULL. */
DFLASH_API dflash_status dflash_tokenizer_load(const char *path,
                                               const dflash_tokenizer_options *opts,
                                               dflash_tokenizer **out);
DFLASH_API void dflash_tokenizer_free(dflash_tokenizer *tok);

/* One more than the largest token id (ordinary and special). */
DFLASH_API size_t dflash_tokenizer_vocab_size(const dflash_tokenizer *tok);

/* How literal special-token text in the input is treated by encode. */
typedef enum dflash_special_mode {
  /* Every special / added token is recognised (tiktoken allowed_special="all",
   * Hugging Face encode). */
  DFLASH_SPECIAL_ALL = 0,
  /* Special tokens are encoded as ordinary text (tiktoken encode_ordinary,
   * Hugging Face encode_special_tokens=True); non-special added tokens of a
   * tokenizer.json are still recognised. */
  DFLASH_SPECIAL_NONE = 1
} dflash_special_mode;

/*
 * An upper bound on the number of ids encoding `len` bytes can produce
 * (invalid bytes become U+FFFD and normalisation may lengthen text, so it
 * is a small multiple of len); a buffer this large never fails.
 */
DFLASH_API size_t dflash_tokenizer_max_ids(const dflash_tokenizer *tok, size_t len);

/*
 * Encode `len` bytes of UTF-8 text into `ids` (capacity `cap`). Invalid
 * UTF-8 is read as Python's bytes.decode("utf-8", "replace") reads it (each
 * maximal invalid subsequence becomes U+FFFD). *n_ids receives the count;
 * DFLASH_E_BUFFER (with the required count in *n_ids) when cap is too small:
 * real text needs about len / 4 ids, dflash_tokenizer_max_ids() is safe.
 */
DFLASH_API dflash_status dflash_tokenizer_encode(const dflash_tokenizer *tok, const char *text,
                                                 size_t len, dflash_special_mode special,
                                                 int32_t *ids, size_t cap, size_t *n_ids);

/*
 * Encode `n` texts on `n_threads` threads (<= 0: one per CPU). Text i's
 * ids are written to ids[offsets[i] .. offsets[i+1]); `offsets` holds n + 1
 * entries. When the total exceeds `cap`, DFLASH_E_BUFFER with the total in
 * offsets[n] (nothing else written); the sum of dflash_tokenizer_max_ids()
 * over the texts always suffices.
 */
DFLASH_API dflash_status dflash_tokenizer_encode_batch(const dflash_tokenizer *tok,
                                                       const char *const *texts, const size_t *lens,
                                                       size_t n, dflash_special_mode special,
                                                       int32_t n_threads, int32_t *ids, size_t cap,
                                                       size_t *offsets);

/*
 * Decode ids into the bytes they stand for (specials included). Writes at
 * most `cap` bytes to `out` (no terminating NUL); *out_len receives the full
 * length, and DFLASH_E_BUFFER when it exceeds cap. An id without a token
 * yields DFLASH_E_RANGE naming it and its position.
 */
DFLASH_API dflash_status dflash_tokenizer_decode(const dflash_tokenizer *tok, const int32_t *ids,
                                                 size_t n, char *out, size_t cap, size_t *out_len);

/* Id of the token with exactly these bytes (ordinary or special); DFLASH_E_NOT_FOUND if none. */
DFLASH_API dflash_status dflash_tokenizer_token_to_id(const dflash_tokenizer *tok,
                                                      const char *bytes, size_t len, int32_t *id);

/*
 * Bytes of token `id` (borrowed; valid while the tokenizer lives; not NUL-
 * terminated) and whether it is a special / added token (may be NULL).
 * DFLASH_E_RANGE for an id outside [0, vocab_size), DFLASH_E_NOT_FOUND for
 * an unused id inside it.
 */
DFLASH_API dflash_status dflash_tokenizer_id_to_token(const dflash_tokenizer *tok, int32_t id,
                                                      const char **bytes, size_t *len,
                                                      int32_t *is_special);

/* Bytes of a tokenizer hash, NUL included: "sha256:" + 64 lowercase hex digits. */
#define DFLASH_TOKENIZER_HASH_LEN 72

/*
 * The tokenizer's identity: a SHA-256 (OpenSSL's libcrypto) over what decides the ids it
 * gives a text (every id's bytes and kind, the merges in rank order, the added tokens with
 * their matching flags, the pre-tokenizer's patterns, the normalizer), as "sha256:" and 64
 * hex digits. Two tokenizers with the same hash give the same ids for every text, whatever
 * their files' bytes: a tokenizer_config.json with another model_max_length or chat
 * template hashes the same. Writes DFLASH_TOKENIZER_HASH_LEN bytes to `out`
 * (DFLASH_E_BUFFER when `cap` is smaller).
 */
DFLASH_API dflash_status dflash_tokenizer_hash(const dflash_tokenizer *tok, char *out, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_TOKENIZER_H */
