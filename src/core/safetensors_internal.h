/* Internals of the safetensors reader, shared with the fuzz target. */
#ifndef DFLASH_CORE_SAFETENSORS_INTERNAL_H
#define DFLASH_CORE_SAFETENSORS_INTERNAL_H

#include <dflash/safetensors.h>

#include "internal.h"

/* One tensor of an opened set. */
typedef struct df_st_entry {
  char *name;
  dflash_dtype dtype;
  uint32_t ndim;
  int64_t *shape;
  uint64_t begin, end; /* relative to the file's data section */
  size_t file;         /* index into the set's files */
} df_st_entry;

/* One parsed file: its bytes (mapped, or borrowed for the fuzzer) and tensors. */
typedef struct df_st_file {
  char *path;
  const uint8_t *base;
  uint64_t size;
  bool mapped;
  uint64_t data_start; /* 8 + header length */
  df_st_entry *entries;
  size_t n_entries;
  char **meta_keys, **meta_values;
  size_t n_meta;
} df_st_file;

/* Validate and index the bytes of one file (`f->path`, `f->base`, `f->size`
 * set by the caller). Entries get file index `file_index`. On failure the
 * message names the file and the tensor. */
DF_MUST_CHECK dflash_status df_st_parse(df_st_file *f, size_t file_index);
/* Release what df_st_parse allocated (not the bytes themselves). */
void df_st_file_clear(df_st_file *f);

#endif
