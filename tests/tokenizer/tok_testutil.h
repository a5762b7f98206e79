/* Helpers for the tokenizer Check suite: synthetic tokenizer files. */
#ifndef DFLASH_TOK_TESTUTIL_H
#define DFLASH_TOK_TESTUTIL_H

#include <dflash/tokenizer.h>
#include <stddef.h>

/* Base64 of n bytes into out (NUL-terminated); returns out. */
char *tt_base64(const void *data, size_t n, char *out);
/* Write a rank file: the 256 single bytes, then `extra` tokens (NULL-terminated list)
 * ranked 256, 257, ... Returns the malloc'd path inside dir. */
char *tt_write_ranks(const char *dir, const char *name, const char *const *extra);
/* Load a tokenizer from path with an optional pattern; fails the test on error. */
dflash_tokenizer *tt_load(const char *path, const char *pattern);
/* Write `text` to dir/name; returns the malloc'd path. */
char *tt_write(const char *dir, const char *name, const char *text);

#endif
