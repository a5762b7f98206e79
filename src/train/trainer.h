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
  struct df_comm *comm;  /* data-parallel ranks (dist.h; borrowed), NULL: one process */
};

/*
 * dflash_trainer_create for one rank of a data-parallel run: every step
 * first sums the gradients over comm's ranks (the CPU backend over comm
 * itself, the CUDA backend with NCCL, whose id travels over comm), so the
 * global norm is clipped and every rank applies the same update. The
 * caller scales each sequence by 1 / (global sum of weights). comm must
 * outlive the trainer; NULL is dflash_trainer_create.
 */
dflash_status df_trainer_create(const dflash_drafter_config *cfg,
                                const dflash_drafter_config_ext *ext, const float *embed,
                                const float *lm_head, const dflash_trainer_options *opts,
                                struct df_comm *comm, dflash_trainer **out);

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
