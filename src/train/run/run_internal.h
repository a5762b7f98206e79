/*
 * The state of one dflash_train_run, shared by run.c (the loop over an offline store, the
 * step, the metrics), run_state.c (settings, save, resume) and run_spool.c (the spool batch
 * source). Internal to src/train.
 */
#ifndef DFLASH_TRAIN_RUN_INTERNAL_H
#define DFLASH_TRAIN_RUN_INTERNAL_H

#include <dflash/hidden.h>
#include <stdbool.h>
#include <stdio.h>

#include "train/cuda/dist.h"
#include "hidden/hidden.h"
#include "train/remote_files.h"
#include "stream.h"
#include "train/trainer.h"

typedef struct run {
  const dflash_train_run_options *o;
  dflash_trainer_options topt;      /* o->trainer, or the defaults, at this library's size */
  dflash_train_run_options local_o; /* an s3:// out_dir: o with its local mirror */
  df_train_remote remote;
  df_comm *comm; /* NULL: one process */
  int rank, world;
  dflash_drafter_config cfg;
  dflash_trainer *t;
  dflash_sample_stream *s;
  const dflash_dataset *tok;
  uint64_t *usable, *order, *mine; /* mine: this rank's share of order, from pos on */
  size_t n_usable, n_total, global_batch;
  int32_t *anchors; /* batch_size * num_anchors */
  int32_t *n_anchors;
  char *state_path, *metrics_path;
  FILE *metrics;
  dflash_train_stats stats;    /* rank 0: the last step, for the progress callback */
  bool stop_asked;             /* the progress callback asked for a stop */
  bool resumed;                /* continues a saved state (--resume, and a state exists) */
  int64_t total_steps, tokens; /* total_steps: the epochs' */
  int64_t sched_steps;         /* the learning-rate schedule's length (schedule_steps) */
  /* A resume under allow_settings_change that set a new schedule: why (for the start-up
   * statement), NULL when the saved one goes on. */
  const char *sched_why;
  double elapsed, t0;
  /* position (global: the next sample of the epoch order to visit) */
  int32_t epoch;
  uint64_t pos;
  /* --hidden spool:PATH: samples in the producer's order. Every rank reads the same order and
   * forms the same global batches; it keeps its share of each and passes over the rest. */
  dflash_spool *spool;
  dflash_dataset *own_tok;   /* the dataset, opened without a store */
  uint64_t *by_id;           /* dataset indices sorted by id */
  uint8_t *is_usable;        /* [n_total] */
  uint64_t *batch_idx;       /* the gathered batch: dataset indices and hidden states */
  bool stored_rows;          /* samples carry their hidden rows as stored (see open_data) */
  dflash_spool_info sp_info; /* the spool's K, H and dtype, read once at open */
  char **batch_h;            /* float32 rows, or the codes then (fp8) the scales */
  size_t *batch_cap;
  uint64_t sp_shard, sp_off; /* resume: the spool position within r->epoch */
  int32_t rel_epoch;         /* shards before (rel_epoch, rel_shard) are released */
  uint64_t rel_shard;
  int32_t bnd_epoch; /* the spool position after the last step (or at the start) */
  uint64_t bnd_shard, bnd_off, bnd_pos;
  df_spool_pos *batch_pos; /* [global_batch]: where the batch's samples are in the spool */
  size_t n_mine;           /* this rank's samples of the gathered batch (slots 0..n_mine-1) */
  FILE *trace;             /* DFLASH_TRAIN_TRACE: "epoch step id" per trained sample */
  int32_t **batch_t;       /* the gathered batch's target ids (NULL: none) */
  size_t *batch_tcap;
  bool sp_final;   /* spool samples carry the target's final state, and DSpark uses it */
  float **batch_f; /* the gathered batch's target final states [len, H] (sp_final) */
  size_t *batch_fcap;
  int32_t *labels; /* --labels target: one sequence's CE targets */
  size_t labels_cap;
  float *head, *norm_w; /* vLLM's final layer -> target ids: LM head, final norm */
  double spool_wait;    /* seconds spent waiting for the spool's next shard */
  /* A step's metrics line. Steps are made with dflash_trainer_step_async, so that the next
   * step's first sequence uploads while the device runs the optimizer; the line waits for
   * the norm (finish_step: after that sequence is enqueued, or before a save).
   * DFLASH_TRAIN_SYNC_STEP=1 waits at every step instead (the same results, to the bit). */
  bool sync_step, step_open;
  bool cfg_dflash2; /* a DFlash 2 drafter: its loss is reported by component */
  double last_save; /* when the state was last saved (or the run started) */
  bool bad_sample;  /* the failing step failed on its data (a sample), not the trainer */
  struct {
    int64_t step, total;
    int32_t epoch;
    double loss, lr, dt, elapsed, spool_wait, tokens;
    double sel_loss; /* DFlash 2: the selector's part of loss */
  } line;
} run;

/* After a step: nothing, a save (save_every_s has passed) or a stop (the caller's `stop`).
 * Rank 0 decides and tells the others (a broadcast a step, only with several ranks). */
enum { ACT_NONE, ACT_SAVE, ACT_STOP };

/* run.c */
void df_run_share(const run *r, size_t n, size_t *lo, size_t *hi);
DF_MUST_CHECK dflash_status df_run_barrier(run *r);
DF_MUST_CHECK dflash_status df_run_finish_step(run *r);
DF_MUST_CHECK dflash_status df_run_train_step(run *r, size_t gb);
DF_MUST_CHECK dflash_status df_run_next_action(run *r, bool last_step, int32_t *act);
DF_MUST_CHECK dflash_status df_run_stopped(const run *r);

/* run_state.c */
DF_MUST_CHECK dflash_status df_run_save_as(run *r, int32_t epoch, uint64_t pos, bool model);
DF_MUST_CHECK dflash_status df_run_save(run *r, int32_t epoch, uint64_t pos);
DF_MUST_CHECK dflash_status df_run_resume(run *r);
DF_MUST_CHECK dflash_status df_run_check_ranks_agree(run *r);
int64_t df_run_schedule_steps(const run *r);
void df_run_setting_text(const char *name, double value, char *buf, size_t cap);
DF_MUST_CHECK dflash_status df_run_check_schedule(run *r);

/* run_spool.c */
DF_MUST_CHECK dflash_status df_run_open_data(run *r);
int64_t df_run_spool_width(const run *r);
DF_MUST_CHECK dflash_status df_run_spool_buffers(run *r);
bool df_run_spool_usable(void *ctx, const char *id);
DF_MUST_CHECK dflash_status df_run_spool_sample(run *r, size_t i, dflash_sample *out,
                                                int32_t *done);
DF_MUST_CHECK dflash_status df_run_spool_loop(run *r);

#endif
