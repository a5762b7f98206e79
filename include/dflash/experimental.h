/*
 * Experimental calls: OUTSIDE the stable ABI.
 *
 * What is declared here is exported (its symbols keep the dflash_ prefix) but
 * may change or go in any release, minor or patch, without a SONAME bump and
 * without a compatibility function left behind; the ABI check leaves it out.
 * These are the hooks the project's oracles use to compare the trainer with
 * independent implementations (tests/train/oracle_*.py, tests/gpu): raw
 * gradients and whole-block logits, whose layout follows the implementation.
 * A program that includes this header accepts that; train.h does not
 * include it.
 *
 * The environment variable DFLASH_TRAIN_TRACE (the samples of every step of
 * dflash_train_run, for checks) is experimental in the same sense.
 */
#ifndef DFLASH_EXPERIMENTAL_H
#define DFLASH_EXPERIMENTAL_H

#include <dflash/dflash.h>
#include <dflash/trainer.h>

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Copy a parameter's gradient out (after forward_backward, or the accumulated
 * batch); `n` must equal the tensor's element count. */
DFLASH_API dflash_status dflash_trainer_get_grad(const dflash_trainer *t, const char *name,
                                                 float *out, size_t n);

/*
 * The drafter's logits for whole blocks, as an engine drafts them: block n
 * is input_ids[anchors[n]] followed by B-1 mask tokens at positions
 * anchors[n] .. anchors[n]+B-1, seeing the context 0 .. anchors[n]-1 (the
 * training mask), for the sample's ids, hidden rows (float32) and anchors.
 * `logits` [n_anchors, B, vocab_size] float32 (caller's buffer) gets the LM
 * head of the final norm at every block position, position 0 included. For a DSpark drafter
 * these are the backbone's logits, without the Markov bias (which depends on the token chosen
 * at the slot before: dflash_trainer_propose chains it).
 */
DFLASH_API dflash_status dflash_trainer_logits(dflash_trainer *t, const dflash_sample *s,
                                               float *logits);

/*
 * The calling thread's tokenizer counters, for the benchmark: `pieces` every pre-tokenized
 * piece its single-text encodes (dflash_tokenizer_encode) have seen, `cache_misses` those that
 * went past its piece caches, short and long (to the vocabulary or a merge; a piece of one byte
 * never does), both since the thread began, over every tokenizer. `cache_bytes` is the memory
 * of the thread's piece caches and pair cache (0 before its first encode): fixed, whatever the
 * text. The threads of encode_batch keep their own counters. Any pointer may be NULL.
 */
DFLASH_API void dflash_tokenizer_thread_stats(uint64_t *pieces, uint64_t *cache_misses,
                                              size_t *cache_bytes);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_EXPERIMENTAL_H */
