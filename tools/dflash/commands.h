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
/* `dflash inspect` of a hidden-state store: per-layer RMS and all-zero rows. */
int cli_is_hidden_store(const char *path);
/* 0 when the dataset at data_dir (local) records the hash of the tokenizer at tok_path, or
 * records none, or (not required: a --target directory) tok_path holds no tokenizer files or
 * its tokenizer.json / tiktoken.model alone has the hash; else 1, the mismatch or error
 * printed as `dflash CMD: ...`. */
int cli_tokenizer_matches(const char *cmd, const char *data_dir, const char *tok_path,
                          bool required);
int cli_hidden_summary(const char *dir);

/* Options of a subcommand, for cli_parse (a table ended by a NULL name). */
typedef enum { CLI_FLAG, CLI_STR, CLI_INT, CLI_I64, CLI_REAL, CLI_FN } cli_kind;
typedef struct cli_opt {
  const char *name; /* "--max-len", "-o" */
  cli_kind kind;    /* FLAG: int set to 1; STR: const char *; INT: int (int32_t); I64: int64_t
                       (uint64_t, size_t); REAL: double; FN: fn(value, dst) */
  void *dst;
  double lo, hi;                           /* accepted range of a number */
  int (*fn)(const char *value, void *dst); /* 0 when the value is valid */
} cli_opt;
_Static_assert(sizeof(int) == 4 && sizeof(long long) == 8, "cli_opt destinations");

/*
 * Parse argv[1..]: options as `--opt value` or `--opt=value`, in any order with up to
 * `max_pos` positional arguments (into `pos`), `--` ending the options. 0 when parsed; 1
 * after printing `usage` to stdout for --help/-h; 2 after naming, on stderr, an unknown
 * option (and the nearest valid one), a missing value, or a malformed number.
 */
int cli_parse(const char *cmd, const char *usage, const cli_opt *opts, int argc, char **argv,
              const char **pos, int max_pos, int *n_pos);
/* A command of one positional argument `what` and no options: 0 with *arg set, -1 after
 * --help, 2 after a usage error. */
int cli_parse_one(const char *cmd, const char *usage, int argc, char **argv, const char *what,
                  const char **arg);
/* "dflash CMD: missing WHAT" on stderr; returns 2. */
int cli_missing(const char *cmd, const char *what);
/* A dflash_log_fn writing each library message on its own line of standard error. */
void cli_log_to_stderr(dflash_log_level level, const char *message, void *user);

/* Print "dflash <cmd>: <status>: <last error>" to stderr and return 1. */
int cli_fail(const char *cmd, dflash_status st);

/* Strict option values: the whole string must be a number in [lo, hi] (atoi
 * would read "8x" as 8 and "abc" as 0). On a bad value print
 * "dflash: OPT wants ..., got 'V'" to stderr, set *bad and return lo. */
long long cli_int(const char *opt, const char *v, long long lo, long long hi, bool *bad);
double cli_real(const char *opt, const char *v, double lo, double hi, bool *bad);

#endif
