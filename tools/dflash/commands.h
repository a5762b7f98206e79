/* Subcommands of the `dflash` tool. Each returns the process exit status:
 * 0 success, 1 failure (message already printed), 2 usage error. */
#ifndef DFLASH_TOOLS_COMMANDS_H
#define DFLASH_TOOLS_COMMANDS_H

#include <dflash/dflash.h>

#include <stdbool.h>

int cmd_inspect(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_fetch(int argc, char **argv);
int cmd_cp(int argc, char **argv);
int cmd_ls(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_render(int argc, char **argv);
int cmd_encode(int argc, char **argv);
int cmd_decode(int argc, char **argv);
int cmd_init_config(int argc, char **argv);
int cmd_show(int argc, char **argv);

/* `dflash inspect` of a dataset directory (one with dataset.json): its summary. */
int cli_is_dataset(const char *path);
int cli_dataset_summary(const char *dir);

/* Print "dflash <cmd>: <status>: <last error>" to stderr and return 1. */
int cli_fail(const char *cmd, dflash_status st);

/* Strict option values: the whole string must be a number in [lo, hi] (atoi
 * would read "8x" as 8 and "abc" as 0). On a bad value print
 * "dflash: OPT wants ..., got 'V'" to stderr, set *bad and return lo. */
long long cli_int(const char *opt, const char *v, long long lo, long long hi, bool *bad);
double cli_real(const char *opt, const char *v, double lo, double hi, bool *bad);

#endif
