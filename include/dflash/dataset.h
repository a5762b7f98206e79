/*
 * Tokenized training datasets: shards of safetensors plus a manifest.
 *
 * A dataset is a directory with `dataset.json` and shards
 * `shard-NNNNN.safetensors`, each holding
 *   input_ids  I32 [T]      every sample's token ids, concatenated
 *   loss_mask  U8  [T]      1 where the token is supervised
 *   offsets    I64 [S + 1]  sample i is [offsets[i], offsets[i+1])
 * and `__metadata__` "sample_ids": a JSON array of the S sample ids. The
 * writer stores offsets, input_ids, loss_mask in that order, so each mapped
 * tensor is aligned to its element size; the reader copies a misaligned
 * tensor (shards from other writers) rather than read it unaligned.
 * dataset.json: {"format": "dflash-dataset", "version": 1, "samples",
 * "tokens", "supervised_tokens", "shards": [{"file", "samples", "tokens"}],
 * "tokenizer_hash", "template", "options"}. A shard is closed by the sample
 * that brings it to shard_tokens tokens or more.
 * Shards and the manifest are written atomically (temporary name, fsync,
 * rename), the manifest last: a directory without dataset.json is an
 * unfinished run.
 *
 * The writer is single-owner; an opened dataset is immutable and shareable.
 */
#ifndef DFLASH_DATASET_H
#define DFLASH_DATASET_H

#include <dflash/dflash.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dflash_dataset_writer dflash_dataset_writer;
typedef struct dflash_dataset dflash_dataset;

typedef struct dflash_dataset_writer_options {
  size_t struct_size;         /* sizeof(dflash_dataset_writer_options) */
  uint64_t shard_tokens;      /* start a new shard past this many tokens (default 2^26) */
  const char *tokenizer_hash; /* recorded in the manifest (may be NULL) */
  const char *template_name;  /* recorded in the manifest (may be NULL) */
  const char *options_json;   /* a JSON object recorded as "options" (may be NULL) */
} dflash_dataset_writer_options;

DFLASH_API void dflash_dataset_writer_options_default(dflash_dataset_writer_options *opts);
/* `dir` is created when missing; DFLASH_E_EXISTS when it already holds a dataset.json. */
DFLASH_API dflash_status dflash_dataset_writer_create(const char *dir,
                                                     const dflash_dataset_writer_options *opts,
                                                     dflash_dataset_writer **out);
/* Append one sample (`n` >= 1 tokens). `sample_id` is copied. */
DFLASH_API dflash_status dflash_dataset_writer_add(dflash_dataset_writer *w, const char *sample_id,
                                                  const int32_t *ids, const uint8_t *mask,
                                                  size_t n);
/* Write the last shard and the manifest. */
DFLASH_API dflash_status dflash_dataset_writer_finish(dflash_dataset_writer *w);
/* NULL-safe. Freeing an unfinished writer leaves finished shards but no manifest. */
DFLASH_API void dflash_dataset_writer_free(dflash_dataset_writer *w);

/* Open a dataset directory (memory-mapped shards, validated against the manifest). */
DFLASH_API dflash_status dflash_dataset_open(const char *dir, dflash_dataset **out);
DFLASH_API void dflash_dataset_free(dflash_dataset *ds);
DFLASH_API size_t dflash_dataset_count(const dflash_dataset *ds);
DFLASH_API uint64_t dflash_dataset_tokens(const dflash_dataset *ds);
/* Sample `index`: borrowed pointers into the mapped shard and its id. */
DFLASH_API dflash_status dflash_dataset_sample(const dflash_dataset *ds, size_t index,
                                              const int32_t **ids, const uint8_t **mask,
                                              size_t *n, const char **sample_id);
/*
 * Histogram of sample lengths: counts[b] = samples with length in
 * [b * bin_width, (b + 1) * bin_width); the last bin also takes longer ones.
 */
DFLASH_API dflash_status dflash_dataset_length_histogram(const dflash_dataset *ds,
                                                        size_t bin_width, size_t n_bins,
                                                        uint64_t *counts);

/* Bytes of a tokenizer hash, NUL included: "sha256:" + 64 lowercase hex digits. */
#define DFLASH_TOKENIZER_HASH_LEN 72

/*
 * Content hash of the tokenizer at `path` (what dflash_tokenizer_load()
 * takes), recorded by `dflash tokenize` as the manifest's "tokenizer_hash".
 * SHA-256 from OpenSSL's libcrypto. A file: the SHA-256 of its bytes (what
 * `sha256sum FILE` prints), except a vocab.json, which is hashed as its
 * directory. A directory: one SHA-256 over the tokenizer files present in it,
 * in the order tokenizer.json, tokenizer_config.json, vocab.json, merges.txt,
 * added_tokens.json, special_tokens_map.json, tiktoken.model, each fed as its
 * name, a NUL byte, its size (8 bytes, little-endian) and its bytes.
 * Writes DFLASH_TOKENIZER_HASH_LEN bytes to `out` (DFLASH_E_BUFFER when
 * `cap` is smaller); DFLASH_E_NOT_FOUND for a directory without such files.
 */
DFLASH_API dflash_status dflash_dataset_tokenizer_hash(const char *path, char *out, size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_DATASET_H */
