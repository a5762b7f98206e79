/* The tokenized dataset behind a sample stream: a thin view of the dataset
 * module (include/dflash/dataset.h). */
#include <dflash/dataset.h>

#include "hidden.h"

dflash_status df_tokens_open(const char *dir, df_tokens **out) {
  return dflash_dataset_open(dir, (dflash_dataset **)out);
}

void df_tokens_free(df_tokens *t) { dflash_dataset_free((dflash_dataset *)t); }

size_t df_tokens_count(const df_tokens *t) {
  return dflash_dataset_count((const dflash_dataset *)t);
}

void df_tokens_get(const df_tokens *t, size_t i, const char **id, const int32_t **ids,
                   const uint8_t **mask, int64_t *len) {
  size_t n = 0;
  /* i < count is guaranteed by every caller. */
  if (dflash_dataset_sample((const dflash_dataset *)t, i, ids, mask, &n, id)) {
    *ids = NULL, *mask = NULL, *id = "";
  }
  *len = (int64_t)n;
}
