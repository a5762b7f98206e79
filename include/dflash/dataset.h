/*
 * Tokenized training datasets: shards of safetensors plus a manifest.
 *
 * A dataset is a directory with `dataset.json` and shards
 * `shard-NNNNN.safetensors`, each holding
 *   input_ids  I32 [T]      every sample's token ids, concatenated
 *   loss_mask  U8  [T]      1 where the token is supervised
 *   offsets    I64 [S + 1]  sample i is [offsets[i], offsets[i+1])
 * and `__metadata__` "sample_ids": a JSON array of the S sample ids.
 * dataset.json: {"format": "dflash-dataset", "version": 1, "samples",
 * "tokens", "supervised_tokens", "shards": [{"file", "samples", "tokens"}],
 * "tokenizer_hash", "template", "options"}.
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

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_DATASET_H */
