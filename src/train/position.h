/*
 * A training run's resume position: where the data stands, the schedule's continuation and
 * the settings it was trained with, kept as the "user" tensor of train_state/state.safetensors
 * (dflash_trainer_save_state). Internal. The format is documented in src/train/README.md
 * ("The resume position").
 */
#ifndef DFLASH_TRAIN_POSITION_H
#define DFLASH_TRAIN_POSITION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/internal.h"

#define DF_POSITION_FORMAT "dflash-train-position"
#define DF_POSITION_VERSION 1
/* More than run.c records (15): room for a newer library's, which the reader refuses. */
#define DF_POSITION_MAX_SETTINGS 32

typedef struct df_position_setting {
  char name[32];
  double value;
} df_position_setting;

typedef struct df_position {
  int32_t epoch;         /* the next sample to visit: epoch and position in its order */
  uint64_t pos;          /* (offline store) */
  int64_t tokens;        /* trained so far */
  int64_t metrics_bytes; /* metrics.jsonl's length at the save */
  uint64_t seed;         /* the trainer's seed */
  uint64_t samples;      /* trainable samples of the data */
  double elapsed_s;      /* training time so far */
  bool spool;            /* written by a run on a spool: */
  uint64_t spool_shard;  /*   its position (the producer's order) */
  uint64_t spool_offset; /*   sample within the shard */
  double spool_wait_s;   /*   time spent waiting for the producer */
  bool has_schedule;     /* the learning rate's continuation (absent in early states) */
  double next_lr;        /*   the rate the next step takes */
  int64_t sched_from;    /*   a settings change's continuation: from this step */
  double sched_lr0;      /*   at this rate */
  size_t n_settings;     /* the run's settings (none in early states) */
  df_position_setting settings[DF_POSITION_MAX_SETTINGS];
} df_position;

/* The position as JSON (format DF_POSITION_FORMAT, version DF_POSITION_VERSION), malloc'd. */
DF_MUST_CHECK dflash_status df_position_to_json(const df_position *p, char **out);
/*
 * Read a position: JSON of a version this library knows, or the text "epoch=... pos=..."
 * states had before the format was versioned (read the same way; the next save writes JSON).
 * Anything else (another format, a newer version, an unknown or malformed field) is
 * DFLASH_E_FORMAT or DFLASH_E_UNSUPPORTED naming `what` and the field.
 */
DF_MUST_CHECK dflash_status df_position_parse(const char *text, size_t len, const char *what,
                                              df_position *out);
/* The setting called `name`, or NULL. */
const df_position_setting *df_position_setting_find(const df_position *p, const char *name);

#endif
