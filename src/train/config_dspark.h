/*
 * DSpark's part of the drafter config.json (config_dspark.c), for config.c. Its validation
 * and refusals of untrained paths (df_dspark_validate, df_dspark_unsupported) are declared
 * in model.h with the other config helpers. Internal to src/train.
 */
#ifndef DFLASH_TRAIN_CONFIG_DSPARK_H
#define DFLASH_TRAIN_CONFIG_DSPARK_H

#include <dflash/drafter.h>
#include <jansson.h>

#include "core/internal.h"

/* In `obj` (the top level or dflash_config, named by the prefix `where`), the keys the spec
 * says to omit, each refused naming the engine it would mislead: speculators_model_type,
 * transformer_layer_config, aux_hidden_state_layer_ids, logit_scale other than 1. */
DF_MUST_CHECK dflash_status df_config_dspark_refused_keys(const char *what, json_t *obj,
                                                          const char *where);
/* DSpark's fields into `c` (dspark set), each from dflash_config or the top level (equal
 * when both hold it); `what` names the file in errors. */
DF_MUST_CHECK dflash_status df_config_dspark_parse(const char *what, json_t *root,
                                                   dflash_drafter_config *c);
/* DSpark's head keys into config.json's top level `o` and its dflash_config `dc`; nonzero
 * when jansson failed. */
int df_config_dspark_json(json_t *o, json_t *dc, const dflash_drafter_config *c);

#endif
