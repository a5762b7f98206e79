/* `dflash ls PREFIX`: list objects or files under a prefix, with sizes. */
#include <dflash/storage.h>
#include <stdio.h>
#include <string.h>

#include "commands.h"

dflash_status cli_storage_create(dflash_storage **out); /* cmd_cp.c */

int cmd_ls(int argc, char **argv) {
  static const char usage[] =
      "usage: dflash ls PREFIX\n"
      "Prints \"SIZE LOCATION\" for every object whose location starts with PREFIX\n"
      "(s3://bucket/prefix or a local path; end it with '/' for a folder).\n"
      "Exit status: 0 listed; 1 an error (message on stderr); 2 a usage error.\n";
  const char *prefix;
  int rc = cli_parse_one("ls", usage, argc, argv, "PREFIX", &prefix);
  if (rc) return rc < 0 ? 0 : rc;
  dflash_storage *st;
  dflash_status s = cli_storage_create(&st);
  dflash_storage_listing *l = NULL;
  if (!s) s = dflash_storage_list(st, prefix, &l);
  for (size_t i = 0; !s && i < dflash_storage_listing_count(l); i++) {
    const char *loc;
    uint64_t size;
    if (dflash_storage_listing_get(l, i, &loc, &size) == DFLASH_OK)
      printf("%12llu %s\n", (unsigned long long)size, loc);
  }
  dflash_storage_listing_free(l);
  dflash_storage_free(st);
  return s ? cli_fail("ls", s) : 0;
}
