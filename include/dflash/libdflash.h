/*
 * libdflash: every stable header at once, the one a program includes first.
 *
 * dflash.h is the base (version, status codes, error detail, logging, the
 * versioned-struct rule) that each module header includes; this header adds
 * every module. experimental.h (the oracle hooks, outside the stable ABI) is
 * not included: a caller includes it on purpose.
 */
#ifndef DFLASH_LIBDFLASH_H
#define DFLASH_LIBDFLASH_H

#include <dflash/dflash.h>

#include <dflash/chat.h>
#include <dflash/dataset.h>
#include <dflash/fetch.h>
#include <dflash/hidden.h>
#include <dflash/progress.h>
#include <dflash/safetensors.h>
#include <dflash/sample.h>
#include <dflash/storage.h>
#include <dflash/tokenizer.h>
#include <dflash/train.h>

#endif /* DFLASH_LIBDFLASH_H */
