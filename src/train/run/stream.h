/* The training-sample stream's internals (stream.c, labels.c): the tokenized dataset joined
 * with a hidden-state store, as the trainer reads it. It lives with the trainer, which is
 * its one user; the store it reads is hidden/'s. */
#ifndef DFLASH_TRAIN_STREAM_H
#define DFLASH_TRAIN_STREAM_H

#include "hidden/hidden.h"

/* Argmax over the V rows of head [V, H] of rmsnorm(x[t]) * norm_w, per token of x [len, H]:
 * the target's greedy tokens from its final hidden states (labels.c). */
DF_MUST_CHECK dflash_status df_greedy_tokens(const float *x, int64_t len, int32_t H,
                                             const float *norm_w, float eps, const float *head,
                                             int32_t V, int32_t *out);
/* The stream computes target ids from vLLM's final layer with these (borrowed; stream.c). */
void df_sample_stream_set_head(dflash_sample_stream *s, const float *norm_w, float eps,
                               const float *head, int32_t V);
/* Whether the stream's store carries the target's post-norm final state (final_state). */
bool df_sample_stream_has_final(const dflash_sample_stream *s);
/* Whether samples carry it (dflash_sample.target_final): on by default when the store has
 * it; a DFlash run turns it off (it is never read there). */
void df_sample_stream_set_final(dflash_sample_stream *s, bool on);
/* The dataset behind a stream (borrowed). */
const dflash_dataset *df_sample_stream_tokens(const dflash_sample_stream *s);
/* What the stream's store says its rows are (borrowed; record.c). */
const df_hidden_record *df_sample_stream_record(const dflash_sample_stream *s);

#endif
