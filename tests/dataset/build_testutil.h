/* Helpers shared by the dflash_dataset_build tests (test_build.c, test_build_fetch.c). */
#ifndef DFLASH_BUILD_TESTUTIL_H
#define DFLASH_BUILD_TESTUTIL_H

#include <dflash/dataset.h>

/* The options both suites build with: the qwen2 tokenizer fixture at `tokenizer` with the
 * qwen3 template (its think tags split, hence allow_split_control_tokens) and every
 * rejection allowed, so that a test sets only what it checks. */
dflash_dataset_build_options build_test_options(const char *tokenizer);

#endif
