/* What `dflash train`, `dflash train --plan` and `dflash eval` share (cmd_train.c,
 * cmd_plan.c, cmd_eval.c, train_common.c). */
#ifndef DFLASH_TOOLS_TRAIN_COMMON_H
#define DFLASH_TOOLS_TRAIN_COMMON_H

#include <jansson.h>

/* `dflash train`'s usage, which `train --plan` prints too (cmd_train.c). */
extern const char train_usage[];

/* `dflash train --plan` (cmd_plan.c), which cmd_train runs when argv holds --plan. */
int cmd_plan(int argc, char **argv);

/* cli_opt CLI_FN parsers: --labels data|target, --optimizer adamw|muon. */
int train_parse_labels(const char *v, void *dst);
int train_parse_optimizer(const char *v, void *dst);

/* The serving flags for checkpoint `dir`, {"vllm": ..., "sglang": ...}, or NULL. */
json_t *train_launch_json(const char *dir);

#endif
