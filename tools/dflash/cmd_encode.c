/* `dflash encode --tokenizer PATH [--pattern P] [--special all|none]`: UTF-8 text on
 * stdin, one token id per line on stdout. */
#include <dflash/tokenizer.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"

static const char USAGE[] =
    "usage: dflash encode --tokenizer PATH [--pattern NAME|REGEX] [--special all|none]\n"
    "Reads UTF-8 text on stdin and prints its token ids, one per line.\n"
    "PATH: tiktoken rank file, tokenizer.json, vocab.json or a model directory.\n"
    "NAME: cl100k, o200k, kimi-k2, qwen2, qwen3.5, gpt2 (needed for a bare rank file).\n"
    "--special all (default) recognises special-token text; none encodes it as text.\n"
    "Exit status: 0 encoded; 1 an error (message on stderr); 2 a usage error.\n";

/* Read all of stdin into a malloc'd buffer. */
static char *read_stdin(size_t *len) {
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  while (buf) {
    size_t got = fread(buf + n, 1, cap - n, stdin);
    n += got;
    if (n < cap) break;
    char *bigger = realloc(buf, cap *= 2);
    if (!bigger) free(buf);
    buf = bigger;
  }
  if (buf && ferror(stdin)) {
    free(buf);
    buf = NULL;
  }
  *len = n;
  return buf;
}

/* Shared by encode and decode: --tokenizer (required), --pattern and --special (encode). */
int cli_tokenizer_args(const char *cmd, const char *usage, int argc, char **argv, const char **path,
                       const char **pattern, const char **special);
int cli_tokenizer_args(const char *cmd, const char *usage, int argc, char **argv, const char **path,
                       const char **pattern, const char **special) {
  /* decode (no pattern) ends the table after --tokenizer. */
  const cli_opt opts[] = {{"--tokenizer", CLI_STR, path, 0, 0, NULL},
                          {pattern ? "--pattern" : NULL, CLI_STR, pattern, 0, 0, NULL},
                          {"--special", CLI_STR, special, 0, 0, NULL},
                          {NULL, 0, NULL, 0, 0, NULL}};
  int n_pos, rc = cli_parse(cmd, usage, opts, argc, argv, NULL, 0, &n_pos);
  if (rc) return rc == 1 ? -1 : rc;
  if (!*path) return cli_missing(cmd, "--tokenizer");
  if (special && strcmp(*special, "all") && strcmp(*special, "none")) {
    fprintf(stderr, "dflash %s: --special is all or none, not '%s'\n", cmd, *special);
    return 2;
  }
  return 0;
}

int cmd_encode(int argc, char **argv) {
  const char *path = NULL, *pattern = NULL, *special = "all";
  int rc = cli_tokenizer_args("encode", USAGE, argc, argv, &path, &pattern, &special);
  if (rc) return rc < 0 ? 0 : rc;
  dflash_tokenizer_options opts;
  dflash_tokenizer_options_default(&opts);
  opts.pattern = pattern;
  dflash_tokenizer *tok;
  dflash_status st = dflash_tokenizer_load(path, &opts, &tok);
  if (st) return cli_fail("encode", st);
  size_t len;
  char *text = read_stdin(&len);
  if (!text) {
    dflash_tokenizer_free(tok);
    fprintf(stderr, "dflash encode: cannot read stdin\n");
    return 1;
  }
  size_t cap = dflash_tokenizer_max_ids(tok, len), n = 0;
  int32_t *ids = malloc(cap * sizeof *ids);
  st = ids ? dflash_tokenizer_encode(tok, text, len,
                                     strcmp(special, "none") ? DFLASH_SPECIAL_ALL
                                                             : DFLASH_SPECIAL_NONE,
                                     ids, cap, &n)
           : DFLASH_E_NOMEM;
  for (size_t i = 0; !st && i < n; i++) printf("%d\n", ids[i]);
  free(ids);
  free(text);
  dflash_tokenizer_free(tok);
  if (st) return cli_fail("encode", st);
  return fflush(stdout) == 0 ? 0 : 1;
}
