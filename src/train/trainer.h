/* The trainer object, shared by the API, checkpoints and the training loop. */
#ifndef DFLASH_TRAIN_TRAINER_H
#define DFLASH_TRAIN_TRAINER_H

#include "model.h"

struct dflash_trainer {
  df_model m;
  dflash_trainer_options opt;
  float *m1, *m2; /* AdamW first and second moments, same layout as params */
  int64_t step;
};

int64_t df_warmup_steps(const dflash_trainer_options *o);

#endif
