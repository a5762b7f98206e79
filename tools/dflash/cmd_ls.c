/* `dflash ls PREFIX`: list objects or files under a prefix, with sizes. */
#include <dflash/storage.h>
#include <stdio.h>
#include <string.h>

#include "commands.h"

dflash_status cli_storage_create(dflash_storage **out); /* cmd_cp.c */

int cmd_ls(int argc, char **argv) {
  if (argc != 2 || !strcmp(argv[1], "--help")) {
    fprintf(argc == 2 ? stdout : stderr,
            "usage: dflash ls PREFIX\n"
            "Prints \"SIZE LOCATION\" for every object whose location starts with PREFIX\n"
            "(s3://bucket/prefix or a local path; end it with '/' for a folder).\n");
    return argc == 2 ? 0 : 2;
  }
  dflash_storage *st;
  dflash_status s = cli_storage_create(&st);
  dflash_storage_listing *l = NULL;
  if (!s) s = dflash_storage_list(st, argv[1], &l);
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
