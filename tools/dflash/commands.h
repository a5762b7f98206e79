/* Subcommands of the `dflash` tool. Each returns the process exit status:
 * 0 success, 1 failure (message already printed), 2 usage error. */
#ifndef DFLASH_TOOLS_COMMANDS_H
#define DFLASH_TOOLS_COMMANDS_H

#include <dflash/dflash.h>

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

/* Print "dflash <cmd>: <status>: <last error>" to stderr and return 1. */
int cli_fail(const char *cmd, dflash_status st);

#endif
