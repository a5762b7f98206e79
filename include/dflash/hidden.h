/*
 * Offline target hidden states: the store a target model's K selected layers
 * are dumped into (one [S, K*H] matrix per sample, keyed by sample id), and
 * the streaming reader that joins them with the tokenized dataset for
 * training.
 *
 * Layout of a store directory:
 *   hidden-00000.safetensors, hidden-00001.safetensors, ...  shards
 *   hidden.safetensors.index.json                             index
 * Each sample is tensor "h/<id>" [S, K*H]: BF16, or F8_E4M3 with a float32
 * scale tensor "s/<id>" [S, K] (one scale per token and layer: amax/448), and, when the
 * producer gave them, "t/<id>" I32 [S]: the target's greedy token after each position
 * (argmax of its logits there), the label `dflash train --labels target` trains on.
 * A store written with final_state also holds, per sample, "f/<id>" [S, H]: the target's
 * final hidden state AFTER its final norm (what feeds its LM head; DSpark's target
 * distribution), in the rows' dtype (fp8: with a float32 scale per token, "fs/<id>" [S, 1]).
 * Shard and index metadata: format "dflash-hidden-1", num_layers, hidden_size,
 * dtype ("bf16" | "fp8_e4m3"), and "final_state": "post_norm" in a store with the final
 * state (absent in one without, as in every store of older libdflash). Shards are written whole and renamed into
 * place, and the index is rewritten after each shard, so a killed dump keeps
 * every completed shard readable; reopening the directory appends.
 *
 * Accuracy (measured by tests/hidden/test_hidden.c, relative RMS error per
 * row, Gaussian rows / rows with 40x outlier channels): bf16 0.17% / 0.16%
 * mean, 0.34% worst; fp8 e4m3 with a scale per (token, layer) 2.5% / 1.4%
 * mean, 3.1% worst, at half of bf16's bytes (+4 bytes per token and layer).
 *
 * Writers are single-owner; an opened store is immutable and shareable.
 */
#ifndef DFLASH_HIDDEN_H
#define DFLASH_HIDDEN_H

#include <dflash/dflash.h>
#include <dflash/safetensors.h>
#include <dflash/sample.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dflash_hidden_writer_options {
  size_t struct_size;
  int32_t dtype;        /* dflash_dtype: DFLASH_DTYPE_BF16 (default) or DFLASH_DTYPE_F8_E4M3 */
  uint64_t shard_bytes; /* start a new shard past this many bytes (1 GiB) */
  /* Spool mode (see "spool" below) when nonzero: `dir` is a spool holding at most this many
   * bytes of unconsumed shards (plus the one being written); at least 2 * shard_bytes. (0) */
  uint64_t spool_budget;
  /* Spool full: how long a write waits for the trainer to consume shards, in seconds (0:
   * not at all; < 0: forever). Past it the call fails with DFLASH_E_TIMEOUT. (0) */
  double spool_wait_s;
  /* What the rows are, recorded in the store's metadata (NULL: not recorded, as in stores of
   * older libdflash and vLLM's files): target_layer_ids[k] (int32 [num_layers], >= 0) is the
   * target layer whose output a row's layer k holds, in the drafter config's order
   * (dflash_config.target_layer_ids), so that `dflash train` and `eval` refuse a drafter that
   * reads other layers; tokenizer_hash is the target tokenizer's, as a dataset records it
   * (dflash_dataset_tokenizer_hash, "sha256:..."), shown by `dflash inspect`. A store is one record: reopening one that records other values
   * (or shards without any, when these are given) is DFLASH_E_MISMATCH; given none, a reopened
   * store keeps its own. The store's hidden_size is the target's. Plain stores only: with
   * spool_budget either is DFLASH_E_INVALID_ARG. */
  const int32_t *target_layer_ids;
  const char *tokenizer_hash;
  /* 1: every sample also carries the target's final hidden state after its final norm
   * (dflash_hidden_rows.final_state, [len, H]; "f/<id>"), which a DSpark drafter needs for
   * its L1 term and confidence target (spec/dspark.md section 2): H more values per token,
   * (K+1)/K of the bytes. A reopened store must agree (DFLASH_E_MISMATCH). A spool too
   * (spool_budget): its spool.json and every shard say so, and a producer restarted on it
   * must agree (DFLASH_E_MISMATCH). (0) */
  int32_t final_state;
} dflash_hidden_writer_options;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_hidden_writer_options_default(&opts). */
DFLASH_API void dflash_hidden_writer_options_init(dflash_hidden_writer_options *opts, size_t size);
#define dflash_hidden_writer_options_default(opts) \
  dflash_hidden_writer_options_init((opts), sizeof *(opts))

typedef struct dflash_hidden_writer dflash_hidden_writer;

/*
 * Create (or reopen, to append) the store in `dir` for `num_layers` (K)
 * layers of `hidden_size` (H). Reopening checks K, H and dtype against the
 * existing index.
 */
DFLASH_API dflash_status dflash_hidden_writer_create(const char *dir, int32_t num_layers,
                                                     int32_t hidden_size,
                                                     const dflash_hidden_writer_options *opts,
                                                     dflash_hidden_writer **out);
/* One sample's rows for dflash_hidden_writer_add (a versioned struct, dflash.h). */
typedef struct dflash_hidden_rows {
  size_t struct_size;
  int32_t dtype;      /* dflash_dtype of `states`: DFLASH_DTYPE_F32 (default) or _BF16 (bits, as a
                         target model produces them; kept bit-exact in a bf16 store) */
  int64_t len;        /* tokens */
  const void *states; /* [len, K*H] row-major */
  /* NULL, or the target's own greedy tokens: target_ids[t] (int32 [len], >= 0) is the argmax
   * of the target's logits at position t, i.e. its prediction of token t+1 (4 bytes per token;
   * `dflash train --labels target` trains on them). In spool mode too. */
  const int32_t *target_ids;
  /* The target's final hidden state after its final norm, [len, H] in `dtype` (Hugging
   * Face: hidden_states[-1], or last_hidden_state). Required by a writer created with
   * final_state, refused (DFLASH_E_INVALID_ARG) by one without; NaN/Inf refused naming the id. */
  const void *final_state;
} dflash_hidden_rows;

/* The defaults (F32, nothing set), written up to `size` bytes: the caller's sizeof. Call it
 * as dflash_hidden_rows_default(&rows). */
DFLASH_API void dflash_hidden_rows_init(dflash_hidden_rows *rows, size_t size);
#define dflash_hidden_rows_default(rows) dflash_hidden_rows_init((rows), sizeof *(rows))

/* Add one sample. Ids are unique (DFLASH_E_DUPLICATE) and non-empty; NaN/Inf are rejected
 * naming the id; a dtype other than F32 or BF16 is DFLASH_E_DTYPE. */
DFLASH_API dflash_status dflash_hidden_writer_add(dflash_hidden_writer *w, const char *sample_id,
                                                  const dflash_hidden_rows *rows);
/* Write the buffered samples as a shard and update the index. */
DFLASH_API dflash_status dflash_hidden_writer_flush(dflash_hidden_writer *w);
/* Flush; the writer accepts no more samples after this. */
DFLASH_API dflash_status dflash_hidden_writer_commit(dflash_hidden_writer *w);
/* NULL-safe. Samples added since the last flush or commit are dropped (flushed shards stay). */
DFLASH_API void dflash_hidden_writer_free(dflash_hidden_writer *w);

/* ---- spool: a bounded store that a trainer consumes while it is written ---- */

/*
 * Layout of a spool (a local folder or an s3:// prefix):
 *   spool.json                      {"format": "dflash-spool-1", num_layers, hidden_size, dtype}
 *                                   (+ "final_state": "post_norm" when written with final_state:
 *                                   every shard then holds "f/<id>" as a store does)
 *   e00000-s000000.safetensors ...  shard s of epoch e: a hidden-store shard (tensors as above)
 *   e00000-s000000.ids              its sample ids, one a line (the producer's record, kept)
 *   e00000.end                      end of epoch e: "shards=N samples=M"
 *   consumed                        "epoch=E shard=S": every shard before (E, S) is consumed
 *   budget                          "bytes=B": the producer's spool_budget (for the trainer)
 * A shard is visible once complete and durable: a local one is written under a temporary name,
 * fsynced and renamed; an object is PUT whole (S3 shows an object whole or not at all). Its
 * .ids is written before it, so a producer restarted after a crash knows every id it has
 * published in the current epoch (dflash_hidden_writer_contains) and republishes a shard lost
 * in the crash. A writer publishes a shard only while the shards present total less than
 * spool_budget, so they never exceed the budget plus one shard; DFLASH_E_TIMEOUT (after
 * spool_wait_s) says the spool is full. Appending a sample never takes it half: on
 * DFLASH_E_TIMEOUT from add the sample was NOT taken (add it again later); a full
 * shard that found no room is kept and published by the next add, flush or end_epoch.
 * Within an epoch a sample id is accepted once. One producer per spool at a time.
 */
/* Publish the buffered samples and mark the end of the current epoch; the next sample goes to
 * the next epoch (a re-prefill: the trainer draws fresh anchors per epoch). DFLASH_E_STATE
 * on a plain store. */
DFLASH_API dflash_status dflash_hidden_writer_end_epoch(dflash_hidden_writer *w);
/* Whether `sample_id` is already taken in the current epoch (buffered or published; after a
 * restart, published before the crash): 1 or 0. */
DFLASH_API int dflash_hidden_writer_contains(const dflash_hidden_writer *w, const char *sample_id);
/* A spool writer's progress (an output struct: set struct_size before the call). */
typedef struct dflash_hidden_writer_spool_status {
  size_t struct_size;
  int32_t epoch;        /* the current epoch */
  uint64_t samples;     /* samples taken in it */
  uint64_t spool_bytes; /* shard bytes present in the spool at the last look */
  uint64_t high_water;  /* the most ever seen there right after a publish */
} dflash_hidden_writer_spool_status;

/* Fill `out` with the spool's progress (zeros on a plain store). */
DFLASH_API dflash_status dflash_hidden_writer_get_spool_status(
    const dflash_hidden_writer *w, dflash_hidden_writer_spool_status *out);

/* The consumer side: samples in publication order (shard by shard, each in the order added). */
typedef struct dflash_spool dflash_spool;

typedef struct dflash_spool_options {
  size_t struct_size;
  double wait_s; /* how long to wait for spool.json or the next shard (600; < 0: forever) */
  int32_t reuse; /* 1: epoch e >= 1 replays epoch 0's shards, which are never deleted (0) */
  /* 1: samples carry their hidden rows as stored (hidden_codes, hidden_scales) and hidden is
   * NULL: the rows are not decoded and their NaN/Inf check is left to the consumer (the CUDA
   * trainer makes it on the device); all-zero layers are still refused here, and a spool's
   * final state still comes decoded and checked (target_final, float32). (0) */
  int32_t stored_rows;
} dflash_spool_options;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_spool_options_default(&opts). */
DFLASH_API void dflash_spool_options_init(dflash_spool_options *opts, size_t size);
#define dflash_spool_options_default(opts) dflash_spool_options_init((opts), sizeof *(opts))
/* Open (waiting for spool.json up to wait_s); the position is (epoch 0, shard 0, sample 0). */
DFLASH_API dflash_status dflash_spool_open(const char *spool, const dflash_spool_options *opts,
                                           dflash_spool **out);
DFLASH_API void dflash_spool_free(dflash_spool *sp);
/* What a spool holds, from its spool.json (an output struct: set struct_size before the call). */
typedef struct dflash_spool_info {
  size_t struct_size;
  int32_t num_layers;  /* K */
  int32_t hidden_size; /* H */
  int32_t dtype;       /* dflash_dtype: DFLASH_DTYPE_BF16 or DFLASH_DTYPE_F8_E4M3 */
  /* 1: every sample carries the target's post-norm final state (written with final_state;
   * dflash_spool_next gives it as dflash_sample.target_final); 0: the spool has none */
  int32_t final_state;
} dflash_spool_info;

DFLASH_API dflash_status dflash_spool_get_info(const dflash_spool *sp, dflash_spool_info *out);

/* Move to sample `offset` of shard `shard` of `epoch` (a resume). */
DFLASH_API dflash_status dflash_spool_seek(dflash_spool *sp, int32_t epoch, uint64_t shard,
                                           uint64_t offset);
/* The position of the next sample dflash_spool_next returns. */
DFLASH_API dflash_status dflash_spool_tell(const dflash_spool *sp, int32_t *epoch, uint64_t *shard,
                                           uint64_t *offset);
/* The next sample (its id, len, hidden rows or stored codes, target_ids, target_final from a
 * spool with final_state, and epoch, shard and offset: where it is; no tokens), waiting up to wait_s for its shard (DFLASH_E_TIMEOUT names the spool and the
 * shard); or *end_of_epoch = 1 (no sample) at the producer's end marker, and the position moves
 * to the next epoch. NaN/Inf and all-zero layers are refused naming the sample. */
DFLASH_API dflash_status dflash_spool_next(dflash_spool *sp, dflash_sample *out,
                                           int32_t *end_of_epoch);
/* The caller's state is durable up to (epoch, shard): record that, then delete every shard
 * before it (except epoch 0's with reuse), which makes room for the producer. */
DFLASH_API dflash_status dflash_spool_release(dflash_spool *sp, int32_t epoch, uint64_t shard);

/* ---- reading -------------------------------------------------------------- */

typedef struct dflash_hidden dflash_hidden;

/* What a local folder holds, as dflash_hidden_open tells them apart. */
typedef enum dflash_hidden_layout {
  DFLASH_HIDDEN_LAYOUT_NONE = 0,  /* neither (or no such folder) */
  DFLASH_HIDDEN_LAYOUT_STORE = 1, /* a libdflash store (hidden.safetensors.index.json) */
  DFLASH_HIDDEN_LAYOUT_VLLM = 2   /* vLLM's hidden-state files, hs_<digits>.safetensors */
} dflash_hidden_layout;

/* The layout of the folder `dir` (its index file, else its file names; nothing is opened). */
DFLASH_API dflash_hidden_layout dflash_hidden_layout_of(const char *dir);
/* 1 when `name` (a file name, no folder) is one of vLLM's hidden-state files,
 * hs_<digits>.safetensors, else 0. */
DFLASH_API int dflash_hidden_is_vllm_file(const char *name);

/* Open a store directory (memory-mapped; nothing is read up front beyond
 * the headers). A local folder of vLLM's hidden-state files (hs_{idx}.safetensors from the
 * extract_hidden_states connector or speculators' generate-offline-data: hidden_states
 * [T, K+1, H] in BF16/F16/F32, or F8_E4M3 with hidden_states_scales [T, 1, 1], token_ids I64
 * [T]) opens too: its ids are the file stems, its K layers the first K slots (the last slot is
 * the target's final layer), and a sample stream joins it with the dataset by token ids,
 * reporting a sample no file matches by its id. Every file's header and token ids are read at
 * open. */
DFLASH_API dflash_status dflash_hidden_open(const char *dir, dflash_hidden **out);
DFLASH_API void dflash_hidden_free(dflash_hidden *h);
/* What an open store holds (an output struct: set struct_size before the call). */
typedef struct dflash_hidden_info {
  size_t struct_size;
  int32_t num_layers;  /* K */
  int32_t hidden_size; /* H */
  int32_t dtype;       /* dflash_dtype of the stored rows (vLLM's files: theirs) */
  uint64_t count;      /* samples */
  /* 1: every sample carries the target's post-norm final state (dflash_hidden_read_final_state);
   * 0: the store has none (written without final_state, by older libdflash, or vLLM's files) */
  int32_t final_state;
} dflash_hidden_info;

DFLASH_API dflash_status dflash_hidden_get_info(const dflash_hidden *h, dflash_hidden_info *out);
/* Id of sample `index` (ordered by id); borrowed. */
DFLASH_API dflash_status dflash_hidden_id(const dflash_hidden *h, size_t index, const char **id);
/* Token count of a sample; DFLASH_E_NOT_FOUND naming the id when absent. */
DFLASH_API dflash_status dflash_hidden_length(const dflash_hidden *h, const char *sample_id,
                                              int64_t *len);
/* Decode a sample into float32 [len, K*H]; `len` must equal its length. */
DFLASH_API dflash_status dflash_hidden_read(const dflash_hidden *h, const char *sample_id,
                                            float *out, int64_t len);
/* Where a store's target greedy tokens come from. */
typedef enum dflash_hidden_target_ids {
  DFLASH_HIDDEN_TARGET_IDS_NONE = 0,   /* nowhere */
  DFLASH_HIDDEN_TARGET_IDS_STORED = 1, /* some sample has stored ids ("t/<id>") */
  /* vLLM's files: their final-layer slot, turned into ids through the target's final norm and
   * LM head by the trainer */
  DFLASH_HIDDEN_TARGET_IDS_VLLM = 2
} dflash_hidden_target_ids;

/* Whether (and how) the store carries the target's greedy tokens. */
DFLASH_API dflash_hidden_target_ids dflash_hidden_has_target_ids(const dflash_hidden *h);
/* The stored greedy tokens of a sample into out [len]; DFLASH_E_NOT_FOUND naming the sample
 * and the store when it has none. */
DFLASH_API dflash_status dflash_hidden_read_target_ids(const dflash_hidden *h,
                                                       const char *sample_id, int32_t *out,
                                                       int64_t len);
/* vLLM's files only: the final-layer slot (the last of K+1) of a sample as float32 [len, H];
 * DFLASH_E_UNSUPPORTED for a store without it. */
DFLASH_API dflash_status dflash_hidden_read_final(const dflash_hidden *h, const char *sample_id,
                                                  float *out, int64_t len);
/* The target's final hidden state after its final norm of a sample, decoded into float32
 * out [len, H] (a store written with final_state). DFLASH_E_NOT_FOUND naming the store when it
 * has none (vLLM's final slot is the layer's raw output: dflash_hidden_read_final);
 * DFLASH_E_FORMAT naming the file and the sample when its tensor is missing or malformed. */
DFLASH_API dflash_status dflash_hidden_read_final_state(const dflash_hidden *h,
                                                        const char *sample_id, float *out,
                                                        int64_t len);
/*
 * Sanity of a whole store (reads every sample): per layer k of K, the RMS over all its
 * values into rms[k] and the number of all-zero rows (tokens) into zero_rows[k]; the total
 * token count into *rows. (The writer refuses NaN/Inf, and the sample stream, so training and
 * eval, refuses a sample with an all-zero layer.)
 */
DFLASH_API dflash_status dflash_hidden_stats(const dflash_hidden *h, double *rms,
                                             uint64_t *zero_rows, uint64_t *rows);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_HIDDEN_H */
