/* A drafter config against what its hidden-state store records (store_layers.c). Internal. */
#ifndef DFLASH_TRAIN_STORE_LAYERS_H
#define DFLASH_TRAIN_STORE_LAYERS_H

#include <dflash/drafter.h>

#include "train/run/stream.h"

/* DFLASH_E_MISMATCH naming both lists when the store records target layers other than the
 * config's dflash_config.target_layer_ids; a store without the record (older libdflash,
 * vLLM's files) passes: its width (K*H) is checked as before. */
DF_MUST_CHECK dflash_status df_check_store_layers(const dflash_drafter_config *cfg,
                                                  const dflash_sample_stream *s,
                                                  const char *hidden_dir);

#endif
