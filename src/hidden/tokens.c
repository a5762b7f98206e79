/* The tokenized dataset behind a sample stream: a thin view of the dataset
 * module (include/dflash/dataset.h). */
#include <dflash/dataset.h>

#include "hidden.h"

dflash_status df_tokens_open(const char *dir, df_tokens **out) {
  return dflash_dataset_open(dir, out);
}

void df_tokens_free(df_tokens *t) { dflash_dataset_free(t); }

size_t df_tokens_count(const df_tokens *t) { return dflash_dataset_count(t); }

void df_tokens_get(const df_tokens *t, size_t i, const char **id, const int32_t **ids,
                   const uint8_t **mask, int64_t *len) {
  size_t n = 0;
  /* i < count is guaranteed by every caller, and an index out of range is the only failure
   * dflash_dataset_sample has: the empty sample below is never seen. */
  if (dflash_dataset_sample(t, i, ids, mask, &n, id)) {
    *ids = NULL, *mask = NULL, *id = "";
  }
  *len = (int64_t)n;
}
