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
  /* dflash_trainer_accumulate: the sums not yet returned by dflash_trainer_collect,
   * and a float32 buffer for stored rows a backend takes only decoded */
  double pend_loss, pend_weight;
  double pend_sel; /* DFlash 2: the selector's part of pend_loss (the run reports it apart) */
  float *decoded;
  size_t decoded_cap;
  /* dflash_trainer_step_async: a step whose norm dflash_trainer_step_result has not returned
   * (step_norm: a backend that stepped at once keeps its norm here). */
  bool step_open;
  double step_norm;
  /* A run resumed with other settings (dflash_train_run_options.allow_settings_change): from
   * step sched_from on (0: never) the learning rate decays by the cosine from sched_lr0, the
   * rate the saved schedule had reached, to the new floor at the new total_steps, instead of
   * jumping to the new schedule's value. */
  int64_t sched_from;
  double sched_lr0;
};

/* The target's final RMSNorm weight [H] (norm_name, NULL: model.norm.weight and variants)
 * from its local checkpoint, and rms_norm_eps from the config.json beside it (target.c). */
DF_MUST_CHECK dflash_status df_target_load_final_norm(const char *path, const char *norm_name,
                                                      int32_t hidden_size, float *norm_w,
                                                      float *eps);
/* The caller's sample at the library's size (the one struct rule) into *s, its length and
 * anchors checked (each in [0, len)): what every sequence call starts with. */
DF_MUST_CHECK dflash_status df_sample_in(const dflash_sample *caller, dflash_sample *s);
/* A checked sample's ids required and its rows as float32: its hidden, or its stored codes
 * decoded into the trainer's buffer (valid until the next call on t). */
DF_MUST_CHECK dflash_status df_sample_floats(dflash_trainer *t, const dflash_sample *s,
                                             const float **hidden);
/* dflash_trainer_accumulate with CE targets `labels` [len] (NULL: the ids), checked to lie
 * in the vocabulary: the target's greedy tokens of `--labels target`. */
DF_MUST_CHECK dflash_status df_trainer_accumulate_labels(dflash_trainer *t, const dflash_sample *s,
                                                         const int32_t *labels, double grad_scale);
/*
 * dflash_trainer_create for one rank of a data-parallel run: every step
 * first sums the gradients over comm's ranks (the CPU backend over comm
 * itself, the CUDA backend with NCCL, whose id travels over comm), so the
 * global norm is clipped and every rank applies the same update. The
 * caller scales each sequence by 1 / (global sum of weights). comm must
 * outlive the trainer; NULL is dflash_trainer_create.
 */
DF_MUST_CHECK dflash_status df_trainer_create(const dflash_drafter_config *cfg, const float *embed,
                                              const float *lm_head,
                                              const dflash_trainer_options *opts,
                                              struct df_comm *comm, dflash_trainer **out);

int64_t df_warmup_steps(const dflash_trainer_options *o);

/* A pruned DSpark drafter's kept ids picked from the dataset at data_dir (the run's training
 * data: dflash_draft_vocab_from_dataset, then set), its coverage logged (INFO) and stored in
 * *coverage (may be NULL); nothing for a drafter that is not pruned. What a training run
 * calls after creating its trainer (the same data picks the same set, so a resume agrees). */
DF_MUST_CHECK dflash_status df_trainer_draft_vocab_from_data(dflash_trainer *t,
                                                             const char *data_dir,
                                                             double *coverage);

/* dflash_anchors_sample by the drafter's rule: DFlash's for DFlash 1 and 2; for DSpark
 * (cfg->dspark) spec/dspark.md section 2's, candidates 0 <= a <= len - 2 with loss_mask[a] and
 * loss_mask[a + 1], whether or not the block fits (its tail slots are masked) and however few
 * tokens are supervised. The same generator and draw, so a seed picks alike. */
DF_MUST_CHECK dflash_status df_anchors_sample_cfg(const dflash_drafter_config *cfg,
                                                  const uint8_t *loss_mask, int64_t len,
                                                  int32_t max_anchors, uint64_t seed,
                                                  uint64_t stream, int32_t *out, int32_t *n_out);

#endif

struct dflash_safetensors;
/* Read tensor `name` (F32, BF16 or F16) of exactly `shape` into floats. */
DF_MUST_CHECK dflash_status df_read_float_tensor(const struct dflash_safetensors *st,
                                                 const char *name, int ndim, const int64_t *shape,
                                                 float *out);
struct dflash_tensor;
/* The same for a tensor view already found (its data in memory). */
DF_MUST_CHECK dflash_status df_tensor_floats(const struct dflash_tensor *t, const char *name,
                                             int ndim, const int64_t *shape, float *out);
