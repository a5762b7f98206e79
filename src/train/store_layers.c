/*
 * A drafter trained or evaluated on a store holding other target layers than its config
 * names learns, or is scored on, features it will never see when served (the engine feeds it
 * the config's layers): refused when the store records its layers (hidden/record.c).
 */
#include "store_layers.h"

#include <stdio.h>
#include <string.h>

dflash_status df_check_store_layers(const dflash_drafter_config *cfg, const dflash_sample_stream *s,
                                    const char *hidden_dir) {
  const df_hidden_record *rec = df_sample_stream_record(s);
  if (!rec->n_layer_ids) return DFLASH_OK;
  bool same = rec->n_layer_ids == cfg->n_target_layer_ids &&
              !memcmp(rec->layer_ids, cfg->target_layer_ids,
                      (size_t)rec->n_layer_ids * sizeof *rec->layer_ids);
  if (same) return DFLASH_OK;
  char have[512], want[512] = "";
  df_hidden_record_ids_text(rec, have, sizeof have);
  df_hidden_record want_rec = {.n_layer_ids = cfg->n_target_layer_ids,
                               .layer_ids = (int32_t *)cfg->target_layer_ids};
  df_hidden_record_ids_text(&want_rec, want, sizeof want);
  return df_error(DFLASH_E_MISMATCH,
                  "%s holds the target layers [%s]; the drafter config's "
                  "dflash_config.target_layer_ids are [%s] (an engine would feed the drafter "
                  "those): dump the store with the config's layers, or set them in the config",
                  hidden_dir, have, want);
}
