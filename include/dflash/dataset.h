/*
 * Tokenized training datasets: shards of safetensors plus a manifest.
 *
 * A dataset is a directory with `dataset.json` and shards
 * `shard-NNNNN.safetensors`, each holding
 *   input_ids  I32 [T]      every sample's token ids, concatenated
 *   loss_mask  U8  [T]      1 where the token is supervised
 *   offsets    I64 [S + 1]  sample i is [offsets[i], offsets[i+1])
 * and `__metadata__` "sample_ids": a JSON array of the S sample ids. The
 * writer stores offsets, input_ids, loss_mask in that order, so each mapped
 * tensor is aligned to its element size; the reader copies a misaligned
 * tensor (shards from other writers) rather than read it unaligned.
 * dataset.json: {"format": "dflash-dataset", "version": 1, "samples",
 * "tokens", "supervised_tokens", "shards": [{"file", "samples", "tokens"}],
 * "tokenizer_hash", "template", "options"}. A shard is closed by the sample
 * that brings it to shard_tokens tokens or more.
 * Shards and the manifest are written atomically (temporary name, fsync,
 * rename), the manifest last: a directory without dataset.json is an
 * unfinished run.
 *
 * The writer is single-owner; an opened dataset is immutable and shareable.
 */
#ifndef DFLASH_DATASET_H
#define DFLASH_DATASET_H

#include <dflash/chat.h>
#include <dflash/dflash.h>
#include <dflash/tokenizer.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dflash_dataset_writer dflash_dataset_writer;
typedef struct dflash_dataset dflash_dataset;

typedef struct dflash_dataset_writer_options {
  size_t struct_size;         /* sizeof(dflash_dataset_writer_options) */
  uint64_t shard_tokens;      /* start a new shard past this many tokens (default 2^26) */
  const char *tokenizer_hash; /* recorded in the manifest (may be NULL) */
  const char *template_name;  /* recorded in the manifest (may be NULL) */
  const char *options_json;   /* a JSON object recorded as "options" (may be NULL) */
} dflash_dataset_writer_options;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_dataset_writer_options_default(&opts). */
DFLASH_API void dflash_dataset_writer_options_init(dflash_dataset_writer_options *opts,
                                                   size_t size);
#define dflash_dataset_writer_options_default(opts) \
  dflash_dataset_writer_options_init((opts), sizeof *(opts))
/* `dir` is created when missing; DFLASH_E_EXISTS when it already holds a dataset.json. */
DFLASH_API dflash_status dflash_dataset_writer_create(const char *dir,
                                                      const dflash_dataset_writer_options *opts,
                                                      dflash_dataset_writer **out);
/* Append one sample (`n` >= 1 tokens). `sample_id` is copied. */
DFLASH_API dflash_status dflash_dataset_writer_add(dflash_dataset_writer *w, const char *sample_id,
                                                   const int32_t *ids, const uint8_t *mask,
                                                   size_t n);
/* Write the last shard and the manifest. */
DFLASH_API dflash_status dflash_dataset_writer_commit(dflash_dataset_writer *w);
/* NULL-safe. Freeing an unfinished writer leaves finished shards but no manifest. */
DFLASH_API void dflash_dataset_writer_free(dflash_dataset_writer *w);

/* Open a dataset directory (memory-mapped shards, validated against the manifest). */
DFLASH_API dflash_status dflash_dataset_open(const char *dir, dflash_dataset **out);
DFLASH_API void dflash_dataset_free(dflash_dataset *ds);
DFLASH_API size_t dflash_dataset_count(const dflash_dataset *ds);
DFLASH_API uint64_t dflash_dataset_tokens(const dflash_dataset *ds);
/* Sample `index`: borrowed pointers into the mapped shard and its id. */
DFLASH_API dflash_status dflash_dataset_sample(const dflash_dataset *ds, size_t index,
                                               const int32_t **ids, const uint8_t **mask, size_t *n,
                                               const char **sample_id);
/*
 * How often each token id is supervised: counts[id] += 1 for every token at loss_mask 1, over
 * every sample (counts [vocab_size], overwritten). *supervised (may be NULL) gets the total.
 * DFLASH_E_RANGE naming the sample and position for a supervised id outside [0, vocab_size).
 * What dflash_draft_vocab_select (drafter.h) picks a pruned draft vocabulary from.
 */
DFLASH_API dflash_status dflash_dataset_token_counts(const dflash_dataset *ds, int32_t vocab_size,
                                                     int64_t *counts, int64_t *supervised);
/*
 * Histogram of sample lengths: counts[b] = samples with length in
 * [b * bin_width, (b + 1) * bin_width); the last bin also takes longer ones.
 */
DFLASH_API dflash_status dflash_dataset_length_histogram(const dflash_dataset *ds, size_t bin_width,
                                                         size_t n_bins, uint64_t *counts);

/*
 * The identity of the tokenizer at `path` (what dflash_tokenizer_load() takes, loaded with
 * the default options): dflash_tokenizer_hash() of it, recorded by `dflash tokenize` as the
 * manifest's "tokenizer_hash" (DFLASH_TOKENIZER_HASH_LEN, tokenizer.h). It covers what
 * decides the ids, not the files' bytes: a tokenizer_config.json with another
 * model_max_length or chat template hashes the same. Writes DFLASH_TOKENIZER_HASH_LEN bytes
 * to `out` (DFLASH_E_BUFFER when `cap` is smaller); DFLASH_E_NOT_FOUND for a directory
 * without tokenizer files (tokenizer.json, vocab.json, tiktoken.model...), the loader's
 * error for files it cannot load.
 */
DFLASH_API dflash_status dflash_dataset_tokenizer_hash(const char *path, char *out, size_t cap);
/*
 * Whether `recorded` (a manifest's "tokenizer_hash") names the tokenizer at `path`:
 * DFLASH_OK when it is its dflash_dataset_tokenizer_hash(), or the hash of its files' bytes
 * that libdflash recorded before (one SHA-256 over the tokenizer files present, in the order
 * tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, added_tokens.json,
 * special_tokens_map.json, tiktoken.model, each fed as name, NUL, 8-byte little-endian size
 * and bytes; a single file: its bytes), so that older datasets stay readable with the files
 * they were made with. DFLASH_E_MISMATCH naming both hashes otherwise.
 */
DFLASH_API dflash_status dflash_dataset_tokenizer_matches(const char *path, const char *recorded);

/*
 * Building a dataset from conversations: what `dflash tokenize` does.
 *
 * Each input is JSONL of OpenAI `messages`, ShareGPT `conversations` or
 * fetcher completion records, one per line (see chat.h). Every non-blank
 * line becomes a sample or a line of OUT/rejected.jsonl
 * {"file", "line", "reason", "id", "tokens"} (the record's id, null when the line has none;
 * its length in tokens, null when it was not encoded; a whole input that cannot be read has
 * "file", "line" 0 and "reason" only); OUT/sources.jsonl gives each sample's
 * {"id", "file", "line"}. A sample's id is its record's "id", else fetch's
 * derived id (dflash_fetch_record_id); a repeated id is rejected. Lines are
 * read in batches of batch_lines (or 32 MiB), each batch rendered and encoded
 * on `threads` threads and written in input order, so the output is the same
 * bytes for any thread count and batch size. The manifest's "options" records
 * what shapes the samples: {"reasoning", "turns", "max_len", "truncate", "nfc"}, and
 * "unfinished": "keep" with keep_unfinished, "thinking": false with no_thinking.
 * Inputs and OUT may be s3:// locations; an s3:// input ending in '/' stands
 * for every *.jsonl object under it, in name order. An s3:// input that cannot
 * be read or listed is logged (DFLASH_LOG_WARN, see dflash_set_log_callback),
 * rejected (line 0, "cannot open file" or "cannot list the prefix") and counted
 * in `unreadable`: the build goes on, and is refused at the end.
 *
 * Fetch's settings: an input with a settings.json beside it that `dflash fetch` wrote (an
 * s3:// chunk or prefix under OUT/completions/: OUT/settings.json) is rendered as it was
 * fetched: its chat_template_kwargs ("extra"'s merged over them) set thinking off
 * (enable_thinking / thinking false: no_thinking becomes 1) and preserve_thinking, and its
 * family must be the template's ("qwen": a qwen* template, "kimi": a kimi* one). Options that
 * contradict the file (no_thinking with thinking true, another family's template), two
 * inputs' files that disagree, or a file whose "earlier" settings rendered otherwise are
 * refused with DFLASH_E_MISMATCH naming both, before any output. An s3:// settings.json that
 * cannot be read (other than absent) is rejected and counted in `unreadable` as an input.
 * The manifest's "options" then say "thinking": false, "preserve_thinking": true.
 */

/* Why a finished build is refused (dflash_dataset_build_stats.verdict). */
typedef enum dflash_dataset_build_verdict {
  DFLASH_DATASET_BUILD_OK = 0,
  DFLASH_DATASET_BUILD_UNREADABLE = 1, /* an input could not be read */
  DFLASH_DATASET_BUILD_EMPTY = 2,      /* no sample was written */
  DFLASH_DATASET_BUILD_REJECTS = 3,    /* more rejected lines than max_reject_ratio allows */
  /* more lines longer than max_len than max_reject_ratio allows (the length limit, not the
   * data, is likely wrong: fetch's max_tokens plus the prompt must fit) */
  DFLASH_DATASET_BUILD_TOO_LONG = 4
} dflash_dataset_build_verdict;

typedef struct dflash_dataset_build_stats {
  size_t struct_size;         /* sizeof(dflash_dataset_build_stats) */
  uint64_t lines;             /* input lines read so far, blank ones included */
  uint64_t samples;           /* samples written */
  uint64_t tokens;            /* their tokens */
  uint64_t supervised_tokens; /* their tokens with loss mask 1 */
  uint64_t rejected;          /* lines in rejected.jsonl (too_long included) */
  uint64_t too_long;          /* rejected as longer than max_len */
  uint64_t unreadable;        /* inputs that could not be read */
  int32_t verdict;            /* dflash_dataset_build_verdict, set when the build has finished */
  /* Fetch records whose answer the target did not finish (outcome "length" or "empty"):
   * rejected (counted in `rejected` too), or with keep_unfinished kept without supervised
   * closing tokens. */
  uint64_t unfinished;
} dflash_dataset_build_stats;

/*
 * Called on the calling thread once the outputs are created, then after every
 * batch. `stats` is the library's (its struct_size says which fields it has).
 * A non-zero return stops the build: DFLASH_E_CANCELLED, no manifest written.
 */
typedef int (*dflash_dataset_build_progress_fn)(const dflash_dataset_build_stats *stats,
                                                void *user);

typedef struct dflash_dataset_build_options {
  size_t struct_size;         /* sizeof(dflash_dataset_build_options) */
  const char *tokenizer_path; /* required: what dflash_tokenizer_load() takes */
  const char *template_name;  /* required: a built-in chat template */
  int32_t reasoning; /* dflash_chat_reasoning; default DFLASH_CHAT_REASONING_KEEP_AFTER_LAST_USER */
  int32_t last_turn_only; /* 1: only the last assistant turn is supervised (default 0) */
  uint64_t max_len;       /* longer samples are rejected, or cut (0: no limit) */
  int32_t truncate;       /* 1: cut samples to max_len tokens instead (default 0) */
  /* 1: accept a tokenizer that splits the template's control tokens (another
   * family's); 0 (default): DFLASH_E_MISMATCH before any output. */
  int32_t allow_split_control_tokens;
  int32_t threads;      /* 0 (default): one per CPU; at most 256 are used */
  uint64_t batch_lines; /* lines processed together (default 2048; a memory knob) */
  /* Refuse a build where more than this fraction of the non-blank lines was rejected,
   * over-long and unfinished ones not counted (default 0.05), in [0, 1]; or where more than
   * this fraction is longer than max_len (DFLASH_DATASET_BUILD_TOO_LONG). */
  double max_reject_ratio;
  uint64_t shard_tokens;                     /* 0 (default): the writer's default (2^26) */
  dflash_dataset_build_progress_fn progress; /* may be NULL */
  void *progress_user;
  /* A fetch record whose answer the target did not finish (outcome "length": cut by the
   * length limit, or "empty"): 0 (default) rejects it ("the target did not finish ...");
   * 1 keeps the text the target wrote, with the closing tokens the template adds after it
   * (closing think tag, end of turn) unsupervised (dflash_chat_conversation_unfinished). */
  int32_t keep_unfinished;
  /* 1: a dataset already at out_dir (its dataset.json, shards, rejected.jsonl and
   * sources.jsonl; nothing else) is removed once the tokenizer and template are checked,
   * instead of DFLASH_E_EXISTS; 0 (default) refuses it. A build refused by its verdict
   * (UNREADABLE, EMPTY, REJECTS, TOO_LONG) leaves no dataset (only rejected.jsonl, the
   * reasons), so its retry needs no overwrite. */
  int32_t overwrite;
  /* 1: render with thinking off (dflash_chat_options.thinking = 0), for answers the target
   * wrote without thinking: the empty think block is then the template's prompt, never
   * supervised; 0 (default): thinking on, unless fetch's settings.json says off (above). */
  int32_t no_thinking;
} dflash_dataset_build_options;

/* The defaults, written up to `size` bytes (the caller's sizeof). Call it as
 * dflash_dataset_build_options_default(&opts). */
DFLASH_API void dflash_dataset_build_options_init(dflash_dataset_build_options *opts, size_t size);
#define dflash_dataset_build_options_default(opts) \
  dflash_dataset_build_options_init((opts), sizeof *(opts))

/*
 * Tokenize `n_inputs` JSONL inputs into the dataset directory `out_dir`
 * (created; DFLASH_E_EXISTS when it holds a dataset.json, the message naming
 * overwrite). A local input that
 * cannot be read, or is a directory, fails before any output is created
 * (DFLASH_E_NOT_FOUND or DFLASH_E_IO, naming it). `opts` and `stats` (may
 * be NULL) follow the versioned-struct rule (dflash.h); stats are written on
 * failure too. When every line was processed but the
 * verdict is not DFLASH_DATASET_BUILD_OK, no manifest is written, the shards
 * and sources.jsonl are removed (rejected.jsonl stays: the reasons), and the
 * call returns DFLASH_E_IO (UNREADABLE) or DFLASH_E_FORMAT (EMPTY, REJECTS,
 * TOO_LONG) with a message saying why.
 */
DFLASH_API dflash_status dflash_dataset_build(const char *const *inputs, size_t n_inputs,
                                              const char *out_dir,
                                              const dflash_dataset_build_options *opts,
                                              dflash_dataset_build_stats *stats);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_DATASET_H */
