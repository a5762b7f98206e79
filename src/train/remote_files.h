/* The trainer's files on object storage (remote_files.c). */
#ifndef DFLASH_TRAIN_REMOTE_FILES_H
#define DFLASH_TRAIN_REMOTE_FILES_H

#include <dflash/safetensors.h>
#include <dflash/train.h>
#include <stdio.h>

#include "core/internal.h"

struct dflash_storage;

/* A remote safetensors checkpoint: "s3://.../x.safetensors", an index JSON,
 * or a prefix with model.safetensors.index.json / model.safetensors. */
typedef struct df_rst df_rst;
DF_MUST_CHECK dflash_status df_rst_open(const char *url, df_rst **out);
void df_rst_free(df_rst *r);
/* DFLASH_E_NOT_FOUND (no message) when absent. The view's data is NULL. */
DF_MUST_CHECK dflash_status df_rst_find(df_rst *r, const char *name, dflash_tensor *t);
/* As df_read_float_tensor, with ranged GETs. */
DF_MUST_CHECK dflash_status df_rst_read_floats(df_rst *r, const char *name, int ndim,
                                               const int64_t *shape, float *out);

/* dflash_trainer_save / _save_state to s3:// (through a staging directory). */
DF_MUST_CHECK dflash_status df_remote_save(const dflash_trainer *t, const char *url, int32_t bf16);
DF_MUST_CHECK dflash_status df_remote_save_state(const dflash_trainer *t, const char *url,
                                                 const void *user, size_t user_len);
/* Download url (or url/file when `file` is set) into the cache directory;
 * *local (malloc'd) is the local copy. */
DF_MUST_CHECK dflash_status df_remote_fetch(const char *url, const char *file, char **local);

/* A training run whose output directory is s3://: the run writes into the
 * local mirror `local` (in the cache directory, rebuilt from the bucket;
 * on resume the state and metrics are downloaded first), and every save is
 * uploaded: model.safetensors, config.json, train_state/state.safetensors,
 * metrics.jsonl, in that order. */
typedef struct df_train_remote {
  struct dflash_storage *st;
  char *url, *local;
} df_train_remote;
DF_MUST_CHECK dflash_status df_train_remote_begin(df_train_remote *r, const char *url, bool resume);
DF_MUST_CHECK dflash_status df_train_remote_publish(df_train_remote *r, FILE *metrics);
void df_train_remote_end(df_train_remote *r);

#endif
