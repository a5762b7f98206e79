/* dflash_dataset_build's state, shared by build.c (batches) and build_io.c (inputs, side
 * files). Internal. */
#ifndef DFLASH_DATASET_BUILD_H
#define DFLASH_DATASET_BUILD_H

#include <dflash/chat.h>
#include <dflash/dataset.h>
#include <dflash/storage.h>
#include <dflash/tokenizer.h>
#include <stdio.h>

#include "core/internal.h"

/* One input line and what became of it. */
typedef struct {
  char *text;
  size_t len;
  const char *file; /* borrowed from the input list */
  uint64_t line;
  char *id; /* the sample id, set when accepted */
  int32_t *ids;
  uint8_t *mask;
  size_t n, supervised;
  char *why;   /* rejection reason; NULL when accepted */
  int encoded; /* n is its length in tokens */
  int too_long;
  int unfinished; /* a fetch record the target did not finish (outcome length or empty) */
  int nomem;      /* out of memory while encoding it: the build fails (not a rejection) */
} df_build_item;

/* A worker's token buffers, kept across lines and batches. */
typedef struct {
  int32_t *ids;
  uint8_t *mask;
  size_t cap;
  char why[256]; /* a rejection reason written for the item being encoded */
} df_build_scratch;

/* The input being read: local files line by line, s3:// objects read whole. */
typedef struct {
  char **files;
  size_t n_files, at;
  FILE *f;
  uint64_t line;
  char *buf;
  size_t cap;
  dflash_storage *storage;
  void *object;
} df_build_reader;

/* What fetch's settings.json (beside an input) says about rendering; where == NULL: none. */
typedef struct {
  char *where;              /* the file's location, for messages */
  char family[16];          /* "none", "kimi", "qwen" */
  int thinking;             /* the thinking switch: 0, 1, -1 not sent */
  const char *thinking_key; /* its name in chat_template_kwargs */
  int preserve;             /* preserve_thinking: 0, 1, -1 not sent */
} df_build_fetch;

/* A settings object that could not be read, rejected once rejected.jsonl exists. */
typedef struct {
  char *where, *why;
} df_build_failed;

typedef struct {
  dflash_dataset_build_options opts;
  const char *out_dir;
  dflash_tokenizer *tok;
  dflash_chat_template *tmpl;
  int nfc;
  dflash_dataset_writer *writer;
  df_pool *pool;
  df_build_scratch *scratch; /* one per pool thread; read-only to others while they run */
  df_build_item *items;      /* the batch: opts.batch_lines slots */
  size_t n_items;
  df_build_reader in;
  FILE *rejects, *sources; /* rejected.jsonl, sources.jsonl */
  df_strset ids;           /* sample ids written so far */
  dflash_dataset_build_stats stats;
  df_build_fetch fetch;  /* fetch's settings, when an input has them */
  int preserve_thinking; /* from them: render with preserve_thinking */
  df_build_failed settings_failed[8];
  size_t n_settings_failed;
} df_build;

/* Read fetch's settings.json beside the inputs into b->fetch, refuse options that contradict
 * them (DFLASH_E_MISMATCH naming both) and take the rendering from them (settings.c). */
DF_MUST_CHECK dflash_status df_build_read_settings(df_build *b, const char *const *inputs,
                                                   size_t n);
/* Reject (as unreadable inputs) the s3:// settings that could not be read. */
void df_build_reject_settings(df_build *b);
void df_build_free_settings(df_build *b);

/* Local inputs that cannot be read fail before any output is created. */
DF_MUST_CHECK dflash_status df_build_check_inputs(const char *const *inputs, size_t n);
/* The input list into b->in: an s3:// input ending in '/' becomes every *.jsonl under it. */
DF_MUST_CHECK dflash_status df_build_expand_inputs(df_build *b, const char *const *inputs,
                                                   size_t n);
/* Fill b->items with the next batch of non-blank lines; none at the end of the input. */
void df_build_read_batch(df_build *b);
void df_build_close_input(df_build *b);
void df_build_free_inputs(df_build *b);

DF_MUST_CHECK dflash_status df_build_open_side(df_build *b);
void df_build_reject(df_build *b, const char *file, uint64_t line, const char *why);
/* A rejected line, with its record's id (null when it has none) and its length in tokens
 * (null when it was not encoded). */
void df_build_reject_item(df_build *b, const df_build_item *it, const char *why);
/* Remove the files of a dataset at `dir` (local or s3://): its manifest, shards and side
 * files, nothing else (dataset build's overwrite); rejected.jsonl stays with keep_rejects (a
 * refused build's reasons). */
DF_MUST_CHECK dflash_status df_build_clear_old(const char *dir, bool keep_rejects);
void df_build_write_source(df_build *b, const df_build_item *it);
/* Close (for an s3:// output: upload) rejected.jsonl and sources.jsonl. */
DF_MUST_CHECK dflash_status df_build_finish_side(df_build *b);

#endif
