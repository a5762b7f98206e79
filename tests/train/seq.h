/* Test helper: a sequence as the trainer's one struct (dflash_sample), built in place. */
#ifndef DFLASH_TESTS_TRAIN_SEQ_H
#define DFLASH_TESTS_TRAIN_SEQ_H

#include <dflash/sample.h>

/* A pointer to a dflash_sample living until the end of the enclosing block: ids, mask (NULL
 * where the call reads none), len, float32 rows and n anchors. */
#define SEQ(ids_, mask_, len_, hidden_, anchors_, n_)     \
  (&(dflash_sample){.struct_size = sizeof(dflash_sample), \
                    .input_ids = (ids_),                  \
                    .loss_mask = (mask_),                 \
                    .len = (len_),                        \
                    .hidden = (hidden_),                  \
                    .anchors = (anchors_),                \
                    .n_anchors = (n_)})

/* `s` with its anchors set (a sample from a stream or spool comes without). */
static inline const dflash_sample *seq_at(dflash_sample *s, const int32_t *anchors, int32_t n) {
  s->anchors = anchors;
  s->n_anchors = n;
  return s;
}

#endif
