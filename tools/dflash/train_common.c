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
 * folder name) and num_speculative_tokens (it never reads block_size): block_size - 1 for
 * DFlash, block_size for DSpark (Qwen3DSparkModel: anchor-first, every slot a draft). SGLang
 * builds the draft in config.json's dtype under --dtype auto, and a float32 one in float16,
 * so such a checkpoint gets --dtype; for DSpark its draft tokens are gamma + 1 = block_size
 * + 1 (the verify window), and a pruned draft vocabulary (draft_vocab_size) has no SGLang
 * line: SGLang builds markov_w2 over the whole vocabulary and the target's LM head, so it
 * refuses the checkpoint (spec/dspark.md sections 4 and 6). */
json_t *train_launch_json(const char *dir) {
  size_t len;
  void *data = train_read_in(dir, "config.json", &len);
  json_t *c = len ? json_loadb(data, len, 0, NULL) : NULL;
  dflash_storage_buffer_free(data);
  json_t *dc = json_object_get(c, "dflash_config"), *bs = json_object_get(dc, "block_size");
  const char *dtype = json_string_value(json_object_get(c, "dtype"));
  bool half = dtype && (!strcmp(dtype, "bfloat16") || !strcmp(dtype, "float16"));
  int B = (int)json_integer_value(bs ? bs : json_object_get(c, "block_size"));
  const char *arch = json_string_value(json_array_get(json_object_get(c, "architectures"), 0));
  bool dspark = arch && !strcmp(arch, "Qwen3DSparkModel");
  json_t *dv = json_object_get(c, "draft_vocab_size");
  json_t *vs = json_object_get(c, "vocab_size");
  bool pruned = dspark && json_is_integer(dv) && json_is_integer(vs) &&
                json_integer_value(dv) < json_integer_value(vs);
  json_decref(c);
  if (B < 2) return NULL;
  char v[4300], g[4400];
  snprintf(v, sizeof v,
           "--speculative-config '{\"method\": \"%s\", \"model\": \"%s\", "
           "\"num_speculative_tokens\": %d}'",
           dspark ? "dspark" : "dflash", dir, dspark ? B : B - 1);
  snprintf(g, sizeof g,
           "--speculative-algorithm %s --speculative-draft-model-path %s "
           "--speculative-num-draft-tokens %d%s",
           dspark ? "DSPARK" : "DFLASH", dir, dspark ? B + 1 : B, half ? "" : " --dtype bfloat16");
  if (pruned) return json_pack("{s:s}", "vllm", v);
  return json_pack("{s:s,s:s}", "vllm", v, "sglang", g);
}
