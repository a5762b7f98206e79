/*
 * dflash_dataset_build: conversations (JSONL) -> rendered, tokenized, loss-masked dataset shards.
 *
 * Lines are read in batches. Each batch is rendered and encoded on the pool's
 * threads (a line per claim, its result in the line's own slot); the calling
 * thread then writes the slots in input order. So the shards, manifest,
 * rejected.jsonl and sources.jsonl are the same bytes for any thread count.
 * Reading inputs and writing the side files is in build_io.c.
 */
#include <dflash/chat.h>
#include <dflash/dataset.h>
#include <dflash/fetch.h>
#include <dflash/tokenizer.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "dataset/build.h"

/* Default batch_lines and max_reject_ratio: above 5 % malformed lines the input is more likely
 * the wrong file or format than a few bad records. */
#define BATCH_LINES 2048
#define MAX_REJECT_RATIO 0.05
/* More threads than this only contend for the batch. */
#define MAX_THREADS 256
/* Sample ids are the records' own ("id", as fetch writes it) or fetch's derived hash id. */
#define ID_CAP 4096

static void build_defaults(dflash_dataset_build_options *o) {
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->reasoning = DFLASH_CHAT_REASONING_KEEP_AFTER_LAST_USER;
  o->batch_lines = BATCH_LINES;
  o->max_reject_ratio = MAX_REJECT_RATIO;
}

void dflash_dataset_build_options_init(dflash_dataset_build_options *o, size_t size) {
  dflash_dataset_build_options d;
  build_defaults(&d);
  df_opts_fill(o, size, &d, sizeof d);
}

/* ---- one line (runs on any thread) ------------------------------------------ */

typedef df_build_scratch scratch;

/* An allocation failure is the build's, never the line's: it marks the item (the calling
 * thread fails the build with DFLASH_E_NOMEM) and returns this reason, which is not recorded. */
static const char OUT_OF_MEMORY[] = "out of memory";

static const char *nomem(df_build_item *it) {
  it->nomem = 1;
  return OUT_OF_MEMORY;
}

/* A failed library call: out of memory, or the reason the line is rejected. */
static const char *failed(df_build_item *it, dflash_status st) {
  return st == DFLASH_E_NOMEM ? nomem(it) : dflash_last_error();
}

static const char *grow(scratch *s, df_build_item *it, size_t need) {
  if (need <= s->cap) return NULL;
  int32_t *ids = realloc(s->ids, need * sizeof *ids);
  if (ids) s->ids = ids;
  uint8_t *mask = realloc(s->mask, need);
  if (mask) s->mask = mask;
  if (!ids || !mask) return nomem(it);
  s->cap = need;
  return NULL;
}

/* A fetch record the target did not finish: the reason it is rejected, NULL when it is kept
 * (keep_unfinished: rendering leaves the template's closing tokens unsupervised) or finished.
 * Its earlier turn cut (its last one whole) is rejected either way: the closing tokens of a
 * middle turn are not marked. */
static const char *unfinished(const df_build *b, const dflash_chat_conversation *conv,
                              df_build_item *it, char *why, size_t cap) {
  const char *outcome = dflash_chat_conversation_outcome(conv);
  int last = dflash_chat_conversation_unfinished(conv) >= 0;
  if (!last && !(outcome && (!strcmp(outcome, "length") || !strcmp(outcome, "empty")))) return NULL;
  it->unfinished = 1;
  if (last && b->opts.keep_unfinished) return NULL;
  snprintf(why, cap,
           "the target did not finish %s (outcome \"%.32s\"): not trained as a finished answer%s",
           last ? "this answer" : "an earlier turn", outcome ? outcome : "length",
           last ? " (--keep-unfinished keeps its text)" : "");
  return why;
}

/* Parse, NFC-normalise when the tokenizer does, and render; *why when the record is rejected
 * as unfinished. */
static dflash_status render(const df_build *b, df_build_item *it, dflash_chat_rendered **out,
                            const char **why, char *buf, size_t cap) {
  dflash_chat_options o;
  dflash_chat_options_default(&o);
  o.reasoning = b->opts.reasoning;
  o.thinking = !b->opts.no_thinking;
  o.preserve_thinking = b->preserve_thinking;
  dflash_chat_conversation *conv;
  *out = NULL;
  dflash_status st = dflash_chat_conversation_parse(it->text, it->len, &conv);
  if (!st && !(*why = unfinished(b, conv, it, buf, cap))) {
    if (b->nfc) st = dflash_chat_conversation_normalize_nfc(conv);
    if (!st) st = dflash_chat_render(b->tmpl, conv, &o, out);
  }
  dflash_chat_conversation_free(conv);
  return st;
}

/* Encode the rendered conversation into the scratch buffers; a reason on rejection. */
static const char *encode(const df_build *b, const dflash_chat_rendered *r, df_build_item *it,
                          scratch *s) {
  size_t tlen;
  dflash_chat_rendered_text(r, &tlen);
  if (dflash_chat_rendered_last_assistant(r) < 0) return "no assistant turn";
  const char *why = grow(s, it, dflash_tokenizer_max_ids(b->tok, tlen));
  if (why) return why;
  dflash_chat_turns turns = b->opts.last_turn_only ? DFLASH_CHAT_TURNS_LAST : DFLASH_CHAT_TURNS_ALL;
  dflash_status st = dflash_chat_encode(r, b->tok, turns, s->ids, s->mask, s->cap, &it->n,
                                        &it->supervised);
  it->encoded = !st;
  return st ? failed(it, st) : NULL;
}

/* max_len: reject the item, or cut it (the supervised count follows the cut). */
static const char *limit_length(const df_build *b, df_build_item *it, const scratch *s) {
  uint64_t max = b->opts.max_len;
  if (!max || it->n <= max) return NULL;
  if (!b->opts.truncate) {
    it->too_long = 1;
    return "longer than --max-len"; /* the words rejected.jsonl has always had */
  }
  it->n = (size_t)max;
  it->supervised = 0;
  for (size_t i = 0; i < it->n; i++) it->supervised += s->mask[i];
  return NULL;
}

/* The record's id into it->id, first: a rejected line names it too (rejected.jsonl). A line
 * that has none (not JSON) is rejected for that by rendering. */
static const char *item_id(df_build_item *it) {
  char id[ID_CAP];
  dflash_status st = dflash_fetch_record_id(it->text, it->len, id, sizeof id);
  if (st == DFLASH_E_NOMEM) return nomem(it);
  if (st) return NULL;
  return (it->id = df_strdup(id)) ? NULL : nomem(it);
}

/* Render + encode one record into `it`; returns a reason on rejection. */
static const char *encode_item(const df_build *b, df_build_item *it, scratch *s) {
  dflash_chat_rendered *r;
  const char *why = NULL;
  if (!it->text) return nomem(it); /* the line's copy (build_io.c) */
  if ((why = item_id(it))) return why;
  dflash_status st = render(b, it, &r, &why, s->why, sizeof s->why);
  if (st) return failed(it, st);
  if (why) return why;
  why = encode(b, r, it, s);
  dflash_chat_rendered_free(r);
  if (!why) why = limit_length(b, it, s);
  if (why) return why;
  char id[ID_CAP];
  if (!it->id && (st = dflash_fetch_record_id(it->text, it->len, id, sizeof id)))
    return failed(it, st);
  if (!it->id) it->id = df_strdup(id);
  it->ids = malloc(it->n * sizeof *it->ids);
  it->mask = malloc(it->n);
  if (!it->id || !it->ids || !it->mask) return nomem(it);
  memcpy(it->ids, s->ids, it->n * sizeof *it->ids);
  memcpy(it->mask, s->mask, it->n);
  return NULL;
}

/* df_pool_for body: items [begin, end) with worker `worker`'s scratch buffers. */
static void encode_range(void *ctx, size_t begin, size_t end, int worker) {
  df_build *b = ctx;
  for (size_t k = begin; k < end; k++) {
    df_build_item *it = &b->items[k];
    const char *why = encode_item(b, it, &b->scratch[worker]);
    if (why && !it->nomem && !(it->why = df_strdup(why))) it->nomem = 1;
  }
}

/* ---- writing a batch (calling thread) --------------------------------------- */

static void item_free(df_build_item *it) {
  free(it->text);
  free(it->id);
  free(it->ids);
  free(it->mask);
  free(it->why);
}

/* 1 when an earlier sample has the item's id, 0 when new (now remembered), -1 out of memory. */
static int seen_before(df_build *b, const df_build_item *it) {
  int added = df_strset_add(&b->ids, it->id);
  return added < 0 ? -1 : !added;
}

static dflash_status write_sample(df_build *b, const df_build_item *it) {
  dflash_status st = dflash_dataset_writer_add(b->writer, it->id, it->ids, it->mask, it->n);
  df_build_write_source(b, it);
  b->stats.samples++;
  b->stats.tokens += it->n;
  b->stats.supervised_tokens += it->supervised;
  return st;
}

/* Write the batch's samples in input order; the writer's first failure is returned (later
 * samples are then dropped, rejections still recorded). */
static dflash_status write_batch(df_build *b) {
  dflash_status st = DFLASH_OK;
  for (size_t k = 0; k < b->n_items; k++) {
    df_build_item *it = &b->items[k];
    int dup = !it->why && !it->nomem && !st ? seen_before(b, it) : 0;
    if (it->nomem) {
      if (!st)
        st = df_error(DFLASH_E_NOMEM, "dataset build: out of memory at %s line %llu", it->file,
                      (unsigned long long)it->line);
    } else if (dup > 0) {
      char why[ID_CAP + 64];
      snprintf(why, sizeof why, "duplicate id \"%s\" (an earlier line has it)", it->id);
      df_build_reject_item(b, it, why);
    } else if (it->why) {
      df_build_reject_item(b, it, it->why);
      b->stats.too_long += (uint64_t)it->too_long;
      b->stats.unfinished += (uint64_t)it->unfinished;
    } else if (!st && dup < 0) {
      st = df_error_nomem("dataset build: sample ids");
    } else if (!st) {
      b->stats.unfinished += (uint64_t)it->unfinished;
      st = write_sample(b, it);
    }
    item_free(it);
  }
  return st;
}

/* ---- setup ------------------------------------------------------------------ */

static dflash_status check_options(const dflash_dataset_build_options *o) {
  const char *bad = !o->tokenizer_path                          ? "tokenizer_path is NULL"
                    : !o->template_name                         ? "template_name is NULL"
                    : !dflash_chat_reasoning_name(o->reasoning) ? "unknown reasoning mode"
                    : o->threads < 0                            ? "threads is negative"
                    : !o->batch_lines                           ? "batch_lines is 0"
                    : !(o->max_reject_ratio >= 0 && o->max_reject_ratio <= 1)
                        ? "max_reject_ratio is outside [0, 1]"
                        : NULL;
  if (bad) return df_error(DFLASH_E_INVALID_ARG, "dataset build options: %s", bad);
  return DFLASH_OK;
}

/* The options that shape the samples, for the manifest (not threads: they change nothing). */
static char *options_json(const df_build *b) {
  const dflash_dataset_build_options *o = &b->opts;
  char *s = malloc(256);
  if (s)
    snprintf(s, 256,
             "{\"reasoning\": \"%s\", \"turns\": \"%s\", \"max_len\": %llu, \"truncate\": %s, "
             "\"nfc\": %s%s%s%s}",
             dflash_chat_reasoning_name(o->reasoning), o->last_turn_only ? "last" : "all",
             (unsigned long long)o->max_len, o->truncate ? "true" : "false",
             b->nfc ? "true" : "false", o->keep_unfinished ? ", \"unfinished\": \"keep\"" : "",
             o->no_thinking ? ", \"thinking\": false" : "",
             b->preserve_thinking ? ", \"preserve_thinking\": true" : "");
  return s;
}

static dflash_status create_writer(df_build *b, const char *out_dir) {
  char hash[DFLASH_TOKENIZER_HASH_LEN];
  dflash_status st = dflash_tokenizer_hash(b->tok, hash, sizeof hash); /* the one loaded */
  char *opts = st ? NULL : options_json(b);
  if (!st && !opts) st = df_error_nomem("dataset build: options");
  if (!st) {
    dflash_dataset_writer_options wo;
    dflash_dataset_writer_options_default(&wo);
    if (b->opts.shard_tokens) wo.shard_tokens = b->opts.shard_tokens;
    wo.tokenizer_hash = hash;
    wo.template_name = b->opts.template_name;
    wo.options_json = opts;
    st = dflash_dataset_writer_create(out_dir, &wo, &b->writer);
  }
  if (st == DFLASH_E_EXISTS)
    st = df_error(DFLASH_E_EXISTS,
                  "dataset build: %s already holds a dataset (its dataset.json); overwrite "
                  "(dflash tokenize --overwrite) replaces it",
                  out_dir);
  free(opts);
  return st;
}

/* Tokenizer, template (and its control tokens), NFC probe, then the writer: a tokenizer that
 * does not fit fails before any output exists. */
static dflash_status open_all(df_build *b, const char *out_dir) {
  dflash_status st = dflash_tokenizer_load(b->opts.tokenizer_path, NULL, &b->tok);
  if (!st) st = dflash_chat_template_create(b->opts.template_name, &b->tmpl);
  if (!st && !b->opts.allow_split_control_tokens)
    st = dflash_chat_template_check_tokenizer(b->tmpl, b->tok);
  if (!st) st = dflash_chat_tokenizer_nfc(b->tok, &b->nfc);
  if (!st && b->opts.overwrite) st = df_build_clear_old(out_dir, false);
  if (!st) st = create_writer(b, out_dir);
  return st;
}

/* The thread pool, a scratch per thread and the batch's slots. */
static dflash_status alloc_work(df_build *b) {
  int threads = b->opts.threads > MAX_THREADS ? MAX_THREADS : b->opts.threads;
  dflash_status st = df_pool_create(threads, &b->pool);
  if (st) return st;
  b->scratch = calloc((size_t)df_pool_size(b->pool), sizeof *b->scratch);
  b->items = calloc((size_t)b->opts.batch_lines, sizeof *b->items);
  if (!b->scratch || !b->items) return df_error_nomem("dataset build: batch");
  return DFLASH_OK;
}

static void build_free(df_build *b) {
  for (int i = 0; b->scratch && i < df_pool_size(b->pool); i++) {
    free(b->scratch[i].ids);
    free(b->scratch[i].mask);
  }
  free(b->scratch);
  df_pool_free(b->pool);
  free(b->items);
  df_strset_free(&b->ids);
  dflash_dataset_writer_free(b->writer);
  dflash_tokenizer_free(b->tok);
  dflash_chat_template_free(b->tmpl);
}

/* ---- the run ---------------------------------------------------------------- */

static int report(df_build *b) {
  if (!b->opts.progress) return 0;
  b->stats.struct_size = sizeof b->stats;
  return b->opts.progress(&b->stats, b->opts.progress_user);
}

static dflash_status run_batches(df_build *b) {
  dflash_status st = report(b) ? df_error(DFLASH_E_CANCELLED, "dataset build: stopped") : DFLASH_OK;
  while (!st) {
    df_build_read_batch(b);
    if (!b->n_items) break;
    df_pool_for(b->pool, b->n_items, 1, encode_range, b);
    st = write_batch(b);
    if (!st && report(b)) st = df_error(DFLASH_E_CANCELLED, "dataset build: stopped");
  }
  return st;
}

/* The build's verdict beyond errors: the output cannot be what the caller meant. */
static dflash_status judge(df_build *b) {
  const dflash_dataset_build_stats *s = &b->stats;
  uint64_t lines = s->samples + s->rejected;                      /* non-blank */
  uint64_t dropped = b->opts.keep_unfinished ? 0 : s->unfinished; /* all of them rejected */
  double ratio = lines ? (double)(s->rejected - s->too_long - dropped) / (double)lines : 0;
  double long_ratio = lines ? (double)s->too_long / (double)lines : 0;
  if (s->unreadable) {
    b->stats.verdict = DFLASH_DATASET_BUILD_UNREADABLE;
    return df_error(DFLASH_E_IO,
                    "dataset build: %llu input(s) could not be read "
                    "(rejected.jsonl)",
                    (unsigned long long)s->unreadable);
  }
  if (!s->samples) {
    b->stats.verdict = DFLASH_DATASET_BUILD_EMPTY;
    return df_error(DFLASH_E_FORMAT, "dataset build: no sample written: is this the right "
                                     "input and template?");
  }
  if (long_ratio > b->opts.max_reject_ratio) {
    b->stats.verdict = DFLASH_DATASET_BUILD_TOO_LONG;
    return df_error(DFLASH_E_FORMAT,
                    "dataset build: %.1f%% of the lines are longer than max_len %llu, more "
                    "than max_reject_ratio %g allows: raise the limit (the prompt plus fetch's "
                    "max_tokens) or truncate",
                    100 * long_ratio, (unsigned long long)b->opts.max_len,
                    b->opts.max_reject_ratio);
  }
  if (ratio > b->opts.max_reject_ratio) {
    b->stats.verdict = DFLASH_DATASET_BUILD_REJECTS;
    return df_error(DFLASH_E_FORMAT,
                    "dataset build: %.1f%% of the lines were rejected, more "
                    "than max_reject_ratio %g allows; reasons in rejected.jsonl",
                    100 * ratio, b->opts.max_reject_ratio);
  }
  return DFLASH_OK;
}

/* Everything after the outputs exist; the first failure wins, the side files are closed
 * (uploaded for an s3:// output) whatever happened. A build refused by its verdict writes no
 * manifest and removes its shards and sources.jsonl: nothing is left that reads as a
 * dataset or blocks a retry, and rejected.jsonl keeps the reasons. */
static dflash_status produce(df_build *b, const char *const *inputs, size_t n_inputs) {
  dflash_status st = df_build_open_side(b);
  if (!st) df_build_reject_settings(b);
  if (!st) st = alloc_work(b);
  if (!st) st = df_build_expand_inputs(b, inputs, n_inputs);
  if (!st) st = run_batches(b);
  df_build_close_input(b);
  bool refused = !st && (st = judge(b));
  if (!st) st = dflash_dataset_writer_commit(b->writer);
  dflash_status side = df_build_finish_side(b);
  if (refused) {
    char why[1024]; /* the verdict's message, kept over the clean-up's */
    snprintf(why, sizeof why, "%s", dflash_last_error());
    dflash_status rm = df_build_clear_old(b->out_dir, true);
    return rm ? rm : df_error(st, "%s", why);
  }
  return st ? st : side;
}

/* The caller's stats (may be NULL), written up to its struct_size. */
static dflash_status put_stats(dflash_dataset_build_stats *out,
                               const dflash_dataset_build_stats *s) {
  return out ? df_opts_out(out, s, sizeof *s, "dflash_dataset_build_stats") : DFLASH_OK;
}

dflash_status dflash_dataset_build(const char *const *inputs, size_t n_inputs, const char *out_dir,
                                   const dflash_dataset_build_options *opts,
                                   dflash_dataset_build_stats *stats) {
  DF_CHECK_ARG(out_dir && (inputs || !n_inputs));
  df_build b = {.out_dir = out_dir};
  b.stats.struct_size = sizeof b.stats;
  build_defaults(&b.opts);
  /* The stats first: a bad struct_size there is refused before any work. */
  dflash_status st = put_stats(stats, &b.stats);
  bool stats_ok = !st;
  if (!st) st = df_opts_in(&b.opts, opts, sizeof b.opts, "dflash_dataset_build_options");
  if (!st) st = check_options(&b.opts);
  if (!st && !n_inputs) st = df_error(DFLASH_E_INVALID_ARG, "dataset build: no input");
  if (!st) st = df_build_check_inputs(inputs, n_inputs);
  if (!st) st = df_build_read_settings(&b, inputs, n_inputs);
  if (!st) st = open_all(&b, out_dir);
  if (!st) st = produce(&b, inputs, n_inputs);
  df_build_free_settings(&b);
  df_build_free_inputs(&b);
  build_free(&b);
  dflash_status put = stats_ok ? put_stats(stats, &b.stats) : DFLASH_OK;
  return st ? st : put;
}
