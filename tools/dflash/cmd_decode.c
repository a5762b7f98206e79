/* `dflash decode --tokenizer PATH`: token ids (whitespace separated) on stdin, the bytes
 * they stand for on stdout. */
#include <dflash/tokenizer.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"

int cli_tokenizer_args(const char *cmd, const char *usage, int argc, char **argv, const char **path,
                       const char **pattern, const char **special);

static const char USAGE[] =
    "usage: dflash decode --tokenizer PATH\n"
    "Reads token ids (whitespace separated) on stdin and writes their bytes to stdout.\n"
    "Exit status: 0 decoded; 1 an error (message on stderr); 2 a usage error.\n";

/* Read whitespace-separated integers from stdin; returns -1 naming the bad word. */
static int read_ids(int32_t **out, size_t *n) {
  size_t cap = 1024;
  int32_t *ids = malloc(cap * sizeof *ids);
  char word[32];
  *n = 0;
  while (ids && scanf("%31s", word) == 1) {
    char *end;
    errno = 0;
    long v = strtol(word, &end, 10);
    if (*end || errno || v < INT32_MIN || v > INT32_MAX) {
      fprintf(stderr, "dflash decode: \"%s\" (id number %zu) is not a token id\n", word, *n + 1);
      free(ids);
      return -1;
    }
    if (*n == cap) {
      int32_t *more = realloc(ids, (cap *= 2) * sizeof *ids);
      if (!more) free(ids);
      ids = more;
      if (!ids) break;
    }
    ids[(*n)++] = (int32_t)v;
  }
  *out = ids;
  return ids ? 0 : -1;
}

int cmd_decode(int argc, char **argv) {
  const char *path = NULL;
  int rc = cli_tokenizer_args("decode", USAGE, argc, argv, &path, NULL, NULL);
  if (rc) return rc < 0 ? 0 : rc;
  dflash_tokenizer *tok;
  dflash_status st = dflash_tokenizer_load(path, NULL, &tok);
  if (st) return cli_fail("decode", st);
  int32_t *ids;
  size_t n, len = 0;
  if (read_ids(&ids, &n)) {
    dflash_tokenizer_free(tok);
    return 1;
  }
  st = dflash_tokenizer_decode(tok, ids, n, NULL, 0, &len);
  char *out = st == DFLASH_E_BUFFER ? malloc(len ? len : 1) : NULL;
  if (st == DFLASH_E_BUFFER)
    st = out ? dflash_tokenizer_decode(tok, ids, n, out, len, &len) : DFLASH_E_NOMEM;
  if (!st && fwrite(out, 1, len, stdout) != len) st = DFLASH_E_IO;
  free(out);
  free(ids);
  dflash_tokenizer_free(tok);
  if (st) return cli_fail("decode", st);
  return fflush(stdout) == 0 ? 0 : 1;
}
