/*
 * Training samples: one sample struct (dflash_sample, also what a spool gives, hidden.h) and
 * the sample stream, a tokenized dataset (dataset.h) joined by sample id with a hidden-state
 * store (hidden.h), streamed in a caller-given order with decoding done ahead on a background
 * thread. A stream is single-owner (see dflash.h).
 */
#ifndef DFLASH_SAMPLE_H
#define DFLASH_SAMPLE_H

#include <dflash/dflash.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * One sample, from a sample stream (dflash_sample_stream_next) or a spool (dflash_spool_next,
 * hidden.h); every pointer stays valid until the next call on the stream or spool that gave
 * it (next, start, free).
 */
typedef struct dflash_sample {
  size_t struct_size;
  uint64_t index; /* position in the dataset (0 from a spool) */
  const char *id;
  int64_t len;
  const int32_t *input_ids; /* [len]; NULL from a spool, which holds no tokens */
  const uint8_t *loss_mask; /* [len]; NULL from a spool */
  const float *hidden;      /* [len, K*H]; NULL when the rows come as stored (below) */
  /* [len]: the target's greedy token after each position (stored by the producer, or from
   * vLLM's final layer once a trainer gave the stream the target's head); NULL when none. */
  const int32_t *target_ids;
  /* The rows as stored, with the stream's or spool's stored_rows option (else NULL): codes
   * [len, K*H] in hidden_dtype (dflash_dtype: BF16 or F8_E4M3), and for fp8 the float scales [len, K]
   * (one per token and layer). */
  int32_t hidden_dtype;
  const void *hidden_codes;
  const float *hidden_scales;
  /* From a spool: where the sample is (epoch, shard, index in the shard); 0 from a stream. */
  int32_t epoch;
  uint64_t shard, offset;
  /* Set by the caller, never by a stream or spool (they write NULL / 0): the block anchors
   * [n_anchors] in [0, len) that a trainer call (trainer.h) trains or drafts at. They sit
   * here, not beside the sample as arguments, so that every trainer call takes one sequence
   * as one struct: a field appended later (labels, a second hidden view) reaches every call
   * without a new signature. dflash_trainer_walk chooses its own anchors and ignores these. */
  const int32_t *anchors;
  int32_t n_anchors;
  /* DSpark's target distribution, the target's final hidden state AFTER its final norm
   * (Hugging Face's last_hidden_state) [len, hidden_size] float32, which the trainer puts
   * through the frozen LM head for the L1 term and the confidence target (spec/dspark.md
   * section 2). A sample stream or a spool sets it from a store or spool written with
   * final_state (hidden.h), else NULL; a caller may set its own. NULL: a DSpark drafter
   * trains on 0.1 CE alone; DFlash ignores it. */
  const float *target_final;
} dflash_sample;

/* The sample stream (see the top of this header). */
typedef struct dflash_sample_stream dflash_sample_stream;

typedef struct dflash_sample_stream_options {
  size_t struct_size;
  int32_t prefetch; /* samples decoded ahead (4) */
  /* 1: samples of a libdflash store (bf16 or fp8) carry their hidden rows as stored
   * (dflash_sample.hidden_codes) and hidden is NULL: the prefetch thread only copies
   * codes, and the NaN/Inf check is left to the consumer (the CUDA trainer makes it on the
   * device; dflash_trainer_accumulate decodes them for the CPU backend). A vLLM store
   * still gives float32. All-zero layers are refused here either way. (0) */
  int32_t stored_rows;
} dflash_sample_stream_options;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_sample_stream_options_default(&opts). */
DFLASH_API void dflash_sample_stream_options_init(dflash_sample_stream_options *opts, size_t size);
#define dflash_sample_stream_options_default(opts) \
  dflash_sample_stream_options_init((opts), sizeof *(opts))

DFLASH_API dflash_status dflash_sample_stream_open(const char *data_dir, const char *hidden_dir,
                                                   const dflash_sample_stream_options *opts,
                                                   dflash_sample_stream **out);
DFLASH_API void dflash_sample_stream_free(dflash_sample_stream *s);
/* Samples in the dataset, and K*H of the store. */
DFLASH_API size_t dflash_sample_stream_count(const dflash_sample_stream *s);
DFLASH_API int64_t dflash_sample_stream_width(const dflash_sample_stream *s);
/*
 * Check the join without decoding: every dataset id has hidden states of
 * the same length. Returns the first problem (DFLASH_E_NOT_FOUND for a
 * missing id, DFLASH_E_MISMATCH for a length) with the id; *n_bad (may be
 * NULL) gets how many samples are affected.
 */
DFLASH_API dflash_status dflash_sample_stream_check(const dflash_sample_stream *s, size_t *n_bad);
/* Visit dataset indices order[0..n) (copied); restarts the prefetcher. */
DFLASH_API dflash_status dflash_sample_stream_start(dflash_sample_stream *s, const uint64_t *order,
                                                    size_t n);
/* Next sample, or *done = 1 at the end. A missing id, a length mismatch or
 * NaN/Inf is reported here with the sample id. */
DFLASH_API dflash_status dflash_sample_stream_next(dflash_sample_stream *s, dflash_sample *out,
                                                   int32_t *done);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_SAMPLE_H */
