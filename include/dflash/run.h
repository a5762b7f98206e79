/*
 * A whole training run (`dflash train`): dflash_train_run_options and
 * dflash_train_run, which reads a tokenized dataset and a hidden-state store
 * (or spool), trains a drafter on one or several ranks, and writes
 * checkpoints, the resumable state and metrics.jsonl.
 *
 * Part of train.h, which includes this header.
 */
#ifndef DFLASH_RUN_H
#define DFLASH_RUN_H

#include <dflash/dflash.h>
#include <dflash/trainer.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- a whole training run ------------------------------------------------- */

/* A run's progress, as rank 0 sees it after an optimizer step: handed to the options'
 * `progress` callback after every step, and written to dflash_train_run's `stats` at the end
 * (the one versioned-struct rule, dflash.h). The fields of metrics.jsonl's line. */
typedef struct dflash_train_stats {
  size_t struct_size;
  int64_t step;        /* optimizer steps taken */
  int64_t last_step;   /* the step this run ends at: max_steps when it comes first */
  int32_t epoch;       /* of the last step */
  double loss;         /* the last step's sum(w*CE) / sum(w) over its global batch */
  double grad_norm;    /* its pre-clip global norm */
  double lr;           /* its learning rate */
  int64_t tokens;      /* tokens trained on so far, every rank's */
  double tokens_per_s; /* the last step's */
  double elapsed_s;    /* since the run began (a resumed run: since the first one began) */
  /* How the run ended, so that a caller prints its summary from fields (never from
   * metrics.jsonl); rank 0's. A resumed run that trains no step keeps the saved run's last step
   * in the fields above. */
  int32_t stop_reason;     /* dflash_train_stop; DFLASH_TRAIN_STOP_NONE in the progress callback */
  int32_t spool;           /* 1: the samples came from a spool (spool_wait_s counts) */
  double spool_wait_s;     /* a spool run: seconds spent waiting for the producer's shards */
  int64_t checkpoint_step; /* the step of the last checkpoint (config.json + model.safetensors)
                              this call wrote in out_dir; 0: none */
  double selector_loss;    /* DFlash 2: the selector's part of loss (block loss = loss - it) */
} dflash_train_stats;

/* dflash_train_stats.stop_reason: why dflash_train_run returned. */
typedef enum dflash_train_stop {
  DFLASH_TRAIN_STOP_NONE = 0,      /* not ended: the progress callback's stats */
  DFLASH_TRAIN_STOP_FINISHED = 1,  /* every epoch trained */
  DFLASH_TRAIN_STOP_MAX_STEPS = 2, /* max_steps reached (also when it is the epochs' end) */
  DFLASH_TRAIN_STOP_REQUESTED = 3, /* the progress callback asked (DFLASH_E_CANCELLED) */
  DFLASH_TRAIN_STOP_ERROR = 4      /* any other failure: the call's status says which */
} dflash_train_stop;

/* Called on the calling thread of rank 0 after each optimizer step; `stats` is the library's
 * (its struct_size says which fields it has). A non-zero return stops the run. */
typedef int (*dflash_train_progress_fn)(const dflash_train_stats *stats, void *user);

typedef struct dflash_train_run_options {
  size_t struct_size;
  const char *config_path;  /* drafter config.json */
  const char *target_path;  /* target checkpoint: embedding + LM head */
  const char *embed_name;   /* NULL: usual names */
  const char *lm_head_name; /* NULL: usual names, else tied */
  const char *data_dir;     /* tokenized dataset */
  const char *hidden_dir;   /* hidden-state store */
  const char *out_dir;      /* checkpoint, train_state/state.safetensors, metrics.jsonl */
  int32_t epochs;           /* 6 */
  int32_t batch_size;       /* sequences per optimizer step and rank; the global batch is
                               batch_size * world size (see dflash_train_run). 0 (the
                               default): the trainer picks 1, or 4 when several ranks run on
                               CUDA GPUs without NVLink (sm_86, sm_89, sm_12x: the PCIe
                               collectives would decide a one-sequence step), and says so in
                               the library's log (INFO) */
  int32_t save_every;       /* steps between checkpoint + state saves (0: at the end only) */
  int32_t resume;           /* continue from out_dir/train_state/state.safetensors (every
                               rank reads it: a shared directory or s3:// for several ranks) */
  int64_t max_steps;        /* stop after this many steps in total, the saved ones of a
                               resumed run included (0: all epochs); it also ends the
                               learning-rate schedule unless schedule_steps says otherwise.
                               Resuming a state past it is refused, at it trains nothing */
  int32_t bf16;             /* write model.safetensors in bf16 */
  /* NULL: dflash_trainer_options_default. A pointer, so that either struct can grow on its
   * own (by value, a larger trainer struct moved every field after it). total_steps is
   * computed from the data. */
  const dflash_trainer_options *trainer;
  /* dflash_train_labels: what the CE trains each drafted position to predict (data). With
   * DFLASH_TRAIN_LABELS_TARGET the label at position t is the target's greedy token after t-1 (what
   * greedy verification accepts), from the store's target ids (HiddenWriter target_ids, in a
   * store or a spool) or, for vLLM's files, from their final-layer slot through the target's
   * final norm (final_norm_name, eps = rms_norm_eps of the target's config.json) and the LM
   * head; the block input and the context stay the data's. A store with neither is refused. */
  int32_t labels;
  const char *final_norm_name; /* NULL: model.norm.weight and its usual variants */
  /* Progress (the command line draws its bar from it), called after every optimizer step
   * (see dflash_train_progress_fn; NULL: none). A non-zero return stops the run at the next
   * step boundary (rank 0's answer counts): the checkpoint and train_state/ are saved as of
   * that step and the call returns DFLASH_E_CANCELLED ("--resume continues"). For a signal
   * handler or another thread to stop a run without losing it. */
  dflash_train_progress_fn progress;
  void *progress_user;
  /* Also save the checkpoint and train_state/ after the first step that ends at least this
   * many seconds after the last save (rank 0's clock), bounding what a kill -9 loses.
   * Default 1800 (30 minutes); 0: only save_every, max_steps and the end. */
  double save_every_s;
  /* The state records the run's settings (lr, batch, anchors, warmup_ratio, epochs, the
   * schedule's length, ...); resume with other ones is DFLASH_E_MISMATCH naming each change,
   * unless this is 1: the new ones are then taken from the state's step on, and the learning
   * rate follows a new schedule from that step to the new end (schedule_steps), stated in the
   * library's log (INFO) at the start:
   * - a new lr, or a saved schedule that had ended (a finished run extended by epochs or
   *   steps): from the new lr, which would otherwise never be used, or from lr again (a
   *   warm restart: the ended schedule sits at its floor, 0 by default, where the added
   *   steps would train nothing), decaying by the lr_schedule to lr * min_lr_ratio;
   * - else from the rate the saved schedule had reached (no jump), decaying the same way.
   * A run whose every step to train would take learning rate 0 while lr > 0 is refused
   * (DFLASH_E_INVALID_ARG), resumed or not. */
  int32_t allow_settings_change;
  /* The learning-rate schedule's length in steps (its warm-up and decay to the floor):
   * 0 (the default): max_steps when it ends the run before the epochs do, else the epochs';
   * N > 0: N steps; DFLASH_SCHEDULE_EPOCHS: the epochs' steps even with max_steps (a run
   * stopped early on purpose, to be resumed as if it had never stopped). Recorded with the
   * run's settings, so a resume that changes it is a settings change. */
  int64_t schedule_steps;
  /* A spool (hidden_dir "spool:..."; ignored for a store): the seconds to wait for the
   * producer's next shard before DFLASH_E_TIMEOUT (600; < 0: forever), and whether epoch 0's
   * shards are kept and replayed for every later epoch (1: the producer publishes one epoch,
   * and its budget must hold all of it). The options, not the environment, so that C, Python
   * and the command line set them alike. */
  double spool_wait_s;
  int32_t spool_reuse;
} dflash_train_run_options;

/* schedule_steps: the epochs' steps, whatever max_steps says. */
#define DFLASH_SCHEDULE_EPOCHS (-1)

typedef enum dflash_train_labels {
  DFLASH_TRAIN_LABELS_DATA = 0,  /* the data's next tokens */
  DFLASH_TRAIN_LABELS_TARGET = 1 /* the target's greedy next tokens */
} dflash_train_labels;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_train_run_options_default(&opts). */
DFLASH_API void dflash_train_run_options_init(dflash_train_run_options *opts, size_t size);
#define dflash_train_run_options_default(opts) dflash_train_run_options_init((opts), sizeof *(opts))

/*
 * Train: samples with fewer than 2*B supervised tokens are skipped; each
 * epoch visits the rest in a fresh seeded order with fresh anchors; every
 * step's metrics go to out_dir/metrics.jsonl (step, epoch, loss, grad_norm,
 * lr, tokens, tokens_per_s, elapsed_s). The training state records the data
 * position, and resuming truncates metrics.jsonl to what that state had
 * seen, so a killed and resumed run reproduces the uninterrupted run's
 * lines exactly (timings aside).
 *
 * A sample that cannot be read or is malformed (its hidden states, or --labels target's
 * ids) stops a one-process run with the state saved as of the step before it
 * (train_state/, "--resume continues" in the message); the options' `stop` and
 * `save_every_s` bound what an interruption loses.
 *
 * Data parallel: one process per rank, found from the environment as
 * torchrun sets it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
 * or Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID with MASTER_ADDR and
 * MASTER_PORT); none of them set: one process. Every rank is given the same
 * options. The global batch of a step is the next batch_size * world
 * sequences of the epoch's seeded order (fewer at the end of an epoch);
 * rank r takes its contiguous, balanced share of it (with a full batch,
 * sequences [r * batch_size, (r+1) * batch_size)). The loss is sum(w*CE) /
 * sum(w) over the whole global batch, so the gradients are summed over the
 * ranks before global-norm clipping and AdamW, and N ranks with batch_size
 * b train the same model as one process with batch_size N*b (up to float
 * rounding). The CPU backend sums over TCP between the ranks (rank 0 adds
 * in rank order: reproducible), the CUDA backend with NCCL. Rank 0 alone
 * writes the checkpoint, the state and metrics.jsonl (loss and tokens of
 * the global batch). The state's data position is global, so it resumes on
 * any world size (the learning-rate schedule follows the new number of
 * steps per epoch). Every rank checks with rank 0 that it has the same
 * data, seed, options, position and parameters before the first step. A
 * rank that fails tells the others, which stop with DFLASH_E_CANCELLED
 * naming it; a rank that dies is reported as DFLASH_E_NETWORK, one that
 * stops answering as DFLASH_E_TIMEOUT after the trainer option dist_timeout_s
 * (default 1800) in one collective.
 *
 * `stats` (may be NULL) gets the last step's dflash_train_stats and how the run ended
 * (stop_reason, checkpoint_step), on failure too (zeros before the first step, stop_reason
 * DFLASH_TRAIN_STOP_ERROR; on ranks other than 0 only `step`).
 */
DFLASH_API dflash_status dflash_train_run(const dflash_train_run_options *opts,
                                          dflash_train_stats *stats);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_RUN_H */
