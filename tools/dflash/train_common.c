/* What `dflash train`, `train --plan` and `dflash eval` share (train_common.h). */
#include <dflash/storage.h>
#include <dflash/train.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "train_common.h"

int train_parse_labels(const char *v, void *dst) {
  int32_t *l = dst; /* dflash_train_labels */
  if (!strcmp(v, "data")) *l = DFLASH_TRAIN_LABELS_DATA;
  else if (!strcmp(v, "target")) *l = DFLASH_TRAIN_LABELS_TARGET;
  else return -1;
  return 0;
}

int train_parse_optimizer(const char *v, void *dst) {
  int32_t *o = dst; /* dflash_optimizer */
  if (!strcmp(v, "adamw")) *o = DFLASH_OPTIMIZER_ADAMW;
  else if (!strcmp(v, "muon")) *o = DFLASH_OPTIMIZER_MUON;
  else return -1;
  return 0;
}

/* The whole of file NAME in folder DIR (local or s3://), or NULL with *len 0 when it cannot
 * be read; free with dflash_storage_buffer_free. */
static void *train_read_in(const char *dir, const char *name, size_t *len) {
  char path[4096];
  snprintf(path, sizeof path, "%s%s%s", dir, dir[strlen(dir) - 1] == '/' ? "" : "/", name);
  void *data = NULL;
  dflash_storage *st = NULL;
  *len = 0;
  if (dflash_storage_create(NULL, &st) || dflash_storage_read(st, path, &data, len)) *len = 0;
  dflash_storage_free(st);
  return data;
}

/* The serving flags for checkpoint `dir` (docs/deployment.md, "Serving the checkpoint"):
 * {"vllm": ..., "sglang": ...}. vLLM needs the method (it guesses it from the
 * folder name) and num_speculative_tokens = block_size - 1 (it never reads
 * block_size); SGLang builds the draft in config.json's dtype under --dtype
 * auto, and a float32 one in float16, so such a checkpoint gets --dtype.
 * A DSpark checkpoint (config.json's markov_rank) drafts a token at every slot
 * of its anchor-first block: vLLM's method "dspark" with num_speculative_tokens
 * = block_size slots, SGLang's DSPARK, which takes gamma = block_size from
 * config.json (spec/dspark.md section 6). */
json_t *train_launch_json(const char *dir) {
  size_t len;
  void *data = train_read_in(dir, "config.json", &len);
  json_t *c = len ? json_loadb(data, len, 0, NULL) : NULL;
  dflash_storage_buffer_free(data);
  json_t *dc = json_object_get(c, "dflash_config"), *bs = json_object_get(dc, "block_size");
  const char *dtype = json_string_value(json_object_get(c, "dtype"));
  bool half = dtype && (!strcmp(dtype, "bfloat16") || !strcmp(dtype, "float16"));
  bool dspark = json_object_get(c, "markov_rank") != NULL;
  int B = (int)json_integer_value(bs ? bs : json_object_get(c, "block_size"));
  json_decref(c);
  if (B < 2) return NULL;
  char v[4300], g[4400];
  snprintf(v, sizeof v,
           "--speculative-config '{\"method\": \"%s\", \"model\": \"%s\", "
           "\"num_speculative_tokens\": %d}'",
           dspark ? "dspark" : "dflash", dir, dspark ? B : B - 1);
  if (dspark)
    snprintf(g, sizeof g, "--speculative-algorithm DSPARK --speculative-draft-model-path %s%s",
             dir, half ? "" : " --dtype bfloat16");
  else
    snprintf(g, sizeof g,
             "--speculative-algorithm DFLASH --speculative-draft-model-path %s "
             "--speculative-num-draft-tokens %d%s",
             dir, B, half ? "" : " --dtype bfloat16");
  return json_pack("{s:s,s:s}", "vllm", v, "sglang", g);
}
