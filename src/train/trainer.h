/* The trainer object, shared by the API, checkpoints and the training loop. */
#ifndef DFLASH_TRAIN_TRAINER_H
#define DFLASH_TRAIN_TRAINER_H

#include "model.h"

struct dflash_trainer {
  df_model m;
  dflash_trainer_options opt;
  float *m1, *m2; /* AdamW first and second moments, same layout as params */
  int64_t step;
  struct df_backend *be; /* where the maths runs (backend.h) */
};

int64_t df_warmup_steps(const dflash_trainer_options *o);

#endif

struct dflash_safetensors;
/* Read tensor `name` (F32, BF16 or F16) of exactly `shape` into floats. */
dflash_status df_read_float_tensor(const struct dflash_safetensors *st, const char *name,
                                   int ndim, const int64_t *shape, float *out);
struct dflash_tensor;
/* The same for a tensor view already found (its data in memory). */
dflash_status df_tensor_floats(const struct dflash_tensor *t, const char *name, int ndim,
                               const int64_t *shape, float *out);
