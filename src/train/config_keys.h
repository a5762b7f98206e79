/*
 * The keys of a drafter config.json that nothing reads (config_keys.c). Internal to src/train.
 */
#ifndef DFLASH_TRAIN_CONFIG_KEYS_H
#define DFLASH_TRAIN_CONFIG_KEYS_H

#include <jansson.h>

#include "core/internal.h"

/* DFLASH_E_CONFIG naming the key (and the closest field, as "did you mean ...?") for an
 * unknown key in dflash_config, a top-level target_layer_ids that dflash_config does not
 * hold, or a top-level key within an edit or two of a field the library reads; `what` names
 * the file. Other top-level keys (transformers' PretrainedConfig has many) are accepted. */
DF_MUST_CHECK dflash_status df_config_check_keys(const char *what, json_t *root);

/* What config.json's "architectures" names (absent: DFlash). */
typedef enum df_config_arch_kind {
  DF_ARCH_DFLASH,
  DF_ARCH_DFLASH2,
  DF_ARCH_DSPARK,
  DF_ARCH_OTHER
} df_config_arch_kind;
df_config_arch_kind df_config_arch(json_t *root);

/* A key of DSpark's heads, which a DFlash config must leave unset. */
bool df_config_dspark_key(const char *key);

/* DFLASH_E_UNSUPPORTED: `what`: `where`"key" = value is not implemented by libdflash (why).
 * config.c's and config_dspark.c's refusal of a key whose value libdflash would read
 * differently from the engines. */
DF_MUST_CHECK dflash_status df_config_refuse_key(const char *what, const char *where,
                                                 const char *key, json_t *v, const char *why);

#endif
