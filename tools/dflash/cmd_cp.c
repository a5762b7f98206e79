/* `dflash cp [-r] SRC DST`: copy between local paths and s3:// URLs. */
#include <dflash/storage.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"

dflash_status cli_storage_create(dflash_storage **out);

/* Library messages on stderr: warnings, and everything when tracing S3. */
dflash_status cli_storage_create(dflash_storage **out) {
  const char *trace = getenv("DFLASH_S3_TRACE");
  bool verbose = trace && *trace && strcmp(trace, "0");
  dflash_set_log_callback(cli_log_to_stderr, NULL, verbose ? DFLASH_LOG_DEBUG : DFLASH_LOG_WARN);
  return dflash_storage_create(NULL, out);
}

static const char USAGE[] =
    "usage: dflash cp SRC DST        copy one object or file (DST '-': stdout;\n"
    "                                DST ending in '/': keep SRC's name)\n"
    "       dflash cp -r SRC/ DST/   copy everything under a prefix\n"
    "SRC, DST: local paths or s3://bucket/key. Credentials and endpoint from\n"
    "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION,\n"
    "AWS_ENDPOINT_URL; DFLASH_S3_ADDRESSING=path|virtual; DFLASH_S3_TRACE=1.\n"
    "Exit status: 0 copied; 1 an error (message on stderr); 2 a usage error.\n";

static dflash_status to_stdout(dflash_storage *st, const char *src) {
  void *data;
  size_t len;
  dflash_status s = dflash_storage_read(st, src, &data, &len);
  if (s) return s;
  size_t w = fwrite(data, 1, len, stdout);
  dflash_storage_buffer_free(data);
  return w == len && fflush(stdout) == 0 ? DFLASH_OK : DFLASH_E_IO;
}

static int copy_one(dflash_storage *st, const char *src, const char *dst) {
  if (!strcmp(dst, "-")) {
    dflash_status s = to_stdout(st, src);
    return s ? cli_fail("cp", s) : 0;
  }
  char *target = NULL;
  size_t n = strlen(dst);
  if (n && dst[n - 1] == '/') {
    const char *base = strrchr(src, '/');
    base = base ? base + 1 : src;
    target = malloc(n + strlen(base) + 1);
    if (!target) return cli_fail("cp", DFLASH_E_NOMEM);
    sprintf(target, "%s%s", dst, base);
  }
  dflash_status s = dflash_storage_copy(st, src, target ? target : dst);
  free(target);
  return s ? cli_fail("cp", s) : 0;
}

static int copy_tree(dflash_storage *st, const char *src, const char *dst) {
  dflash_storage_listing *l;
  dflash_status s = dflash_storage_list(st, src, &l);
  if (s) return cli_fail("cp", s);
  size_t n = dflash_storage_listing_count(l), plen = strlen(src);
  int rc = 0;
  for (size_t i = 0; i < n && !rc; i++) {
    const char *loc;
    if ((s = dflash_storage_listing_get(l, i, &loc, NULL))) {
      rc = cli_fail("cp", s);
      break;
    }
    char *target = malloc(strlen(dst) + strlen(loc) + 1);
    if (!target) {
      rc = cli_fail("cp", DFLASH_E_NOMEM);
      break;
    }
    sprintf(target, "%s%s", dst, loc + plen);
    s = dflash_storage_copy(st, loc, target);
    if (s) rc = cli_fail("cp", s);
    else fprintf(stderr, "%s -> %s\n", loc, target);
    free(target);
  }
  dflash_storage_listing_free(l);
  return rc;
}

int cmd_cp(int argc, char **argv) {
  int recursive = 0, n_pos;
  const char *pos[2];
  const cli_opt opts[] = {{"-r", CLI_FLAG, &recursive, 0, 0, NULL},
                          {"--recursive", CLI_FLAG, &recursive, 0, 0, NULL},
                          {NULL, 0, NULL, 0, 0, NULL}};
  int rc = cli_parse("cp", USAGE, opts, argc, argv, pos, 2, &n_pos);
  if (rc) return rc == 1 ? 0 : rc;
  if (n_pos < 2) return cli_missing("cp", n_pos ? "DST" : "SRC and DST");
  dflash_storage *st;
  dflash_status s = cli_storage_create(&st);
  if (s) return cli_fail("cp", s);
  rc = recursive ? copy_tree(st, pos[0], pos[1]) : copy_one(st, pos[0], pos[1]);
  dflash_storage_free(st);
  return rc;
}
