/*
 * `dflash tokenize`: conversations (JSONL) -> rendered, tokenized, loss-masked dataset shards.
 *
 * A thin caller of dflash_dataset_build (dataset.h), which holds the pipeline: this file
 * parses the arguments, draws the progress line and words the outcome.
 */
#include <dflash/chat.h>
#include <dflash/dataset.h>
#include <dflash/progress.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_cli.h"
#include "commands.h"

typedef struct {
  dflash_dataset_build_options o;
  const char *out_dir;
} tok_args;

static const char USAGE[] =
    "usage: dflash tokenize --tokenizer PATH --template NAME [--max-len N] [--truncate]\n"
    "                       [--last-turn-only] [--reasoning official|keep_all|\n"
    "                        keep_after_last_user|drop] [--threads N] [--batch-lines N]\n"
    "                       [--max-reject-ratio X] [--allow-split-control-tokens]\n"
    "                       [--keep-unfinished] [--overwrite] [--no-thinking]\n"
    "                       -o DIR IN.jsonl...\n"
    "DIR and the inputs may be s3:// locations; an s3:// input ending in '/' means every\n"
    "*.jsonl object under it (e.g. a fetch output's completions/ chunks).\n"
    "Reads OpenAI `messages`, ShareGPT `conversations` or fetcher completion records,\n"
    "one per line; writes safetensors shards + dataset.json to DIR and rejected lines\n"
    "(file, line, reason, id, tokens) to DIR/rejected.jsonl. Default reasoning:\n"
    "keep_after_last_user.\n"
    "An input with the settings.json `dflash fetch` wrote beside it (OUT/completions.jsonl,\n"
    "or an s3:// OUT/completions/ chunk or prefix) is rendered as fetched: thinking off\n"
    "there means --no-thinking, its family must be the --template's, and a flag that\n"
    "contradicts the file is refused, naming both.\n"
    "Sample ids are the records' \"id\" (fetch outputs carry it), else fetch's derived id\n"
    "(\"h\" + 32 hex digits of SHA-256); a repeated id is rejected. DIR/sources.jsonl\n"
    "gives each sample's id, file and line.\n"
    "The template's control tokens (turn markers, think and tool tags) must be single\n"
    "tokens of the tokenizer, as with the target's own; --allow-split-control-tokens\n"
    "accepts another family's tokenizer anyway.\n"
    "--threads: 0 (default) = one per CPU; the output is identical for any count.\n"
    "--batch-lines: lines read and processed together (default 2048; memory knob).\n"
    "Over-long samples (--max-len) are dropped, or cut to N tokens with --truncate; the\n"
    "limit must hold the prompt plus fetch's --max-tokens.\n"
    "A fetch record whose answer the target did not finish (outcome \"length\": cut by\n"
    "fetch's --max-tokens; or \"empty\") is dropped (rejected.jsonl says why); with\n"
    "--keep-unfinished its text is kept and the closing tokens the template adds after\n"
    "it (</think>, end of turn) are not supervised (`dflash render --mask` shows it).\n"
    "--no-thinking: answers written with thinking off (enable_thinking/thinking false):\n"
    "the empty think block is the prompt's, not supervised (render --no-thinking).\n"
    "A DIR that holds a dataset is refused; --overwrite replaces it (its dataset.json,\n"
    "shards, rejected.jsonl and sources.jsonl). A refused build (exit 1 below) leaves no\n"
    "dataset, only rejected.jsonl, so it is retried without --overwrite.\n"
    "Exit status: 0 done; 1 an error, an input that cannot be read, no sample written,\n"
    "more rejected lines than --max-reject-ratio (default 0.05; over-long and unfinished\n"
    "samples are not counted) of the non-blank lines, or more over-long lines than that;\n"
    "2 a usage error.\n";

/* The inputs are the positional arguments, in `inputs` (argc entries). */
static int parse_args(int argc, char **argv, tok_args *a, const char **inputs, int *n_inputs) {
  memset(a, 0, sizeof *a);
  dflash_dataset_build_options_default(&a->o);
  dflash_dataset_build_options *o = &a->o;
  const cli_opt opts[] = {{"--tokenizer", CLI_STR, &o->tokenizer_path, 0, 0, NULL},
                          {"--template", CLI_STR, &o->template_name, 0, 0, NULL},
                          {"-o", CLI_STR, &a->out_dir, 0, 0, NULL},
                          {"--out", CLI_STR, &a->out_dir, 0, 0, NULL},
                          {"--max-len", CLI_I64, &o->max_len, 1, (double)INT64_MAX, NULL},
                          {"--threads", CLI_INT, &o->threads, 0, 4096, NULL},
                          {"--batch-lines", CLI_I64, &o->batch_lines, 1, 1 << 20, NULL},
                          {"--max-reject-ratio", CLI_REAL, &o->max_reject_ratio, 0, 1, NULL},
                          {"--truncate", CLI_FLAG, &o->truncate, 0, 0, NULL},
                          {"--allow-split-control-tokens", CLI_FLAG, &o->allow_split_control_tokens,
                           0, 0, NULL},
                          {"--last-turn-only", CLI_FLAG, &o->last_turn_only, 0, 0, NULL},
                          {"--keep-unfinished", CLI_FLAG, &o->keep_unfinished, 0, 0, NULL},
                          {"--overwrite", CLI_FLAG, &o->overwrite, 0, 0, NULL},
                          {"--no-thinking", CLI_FLAG, &o->no_thinking, 0, 0, NULL},
                          {"--reasoning", CLI_FN, &o->reasoning, 0, 0, chat_cli_reasoning_opt},
                          {NULL, 0, NULL, 0, 0, NULL}};
  int rc = cli_parse("tokenize", USAGE, opts, argc, argv, inputs, argc, n_inputs);
  if (rc == 1) chat_cli_list_templates(stdout);
  if (rc) return rc == 1 ? -1 : rc;
  if (!o->tokenizer_path) return cli_missing("tokenize", "--tokenizer");
  if (!o->template_name) return cli_missing("tokenize", "--template");
  if (!a->out_dir) return cli_missing("tokenize", "-o");
  if (!*n_inputs) return cli_missing("tokenize", "an input file (IN.jsonl)");
  return 0;
}

/* The progress line, drawn from the first report on (the outputs exist then). */
static int on_progress(const dflash_dataset_build_stats *s, void *user) {
  dflash_progress **p = user;
  /* Out of memory for the bar: go on without it (*p stays NULL, update takes NULL). */
  if (!*p && dflash_progress_create(NULL, NULL, 0, "tokenize", "lines", 0, 0, p)) *p = NULL;
  dflash_progress_update(*p, s->lines, NULL);
  return 0;
}

static void on_log(dflash_log_level level, const char *msg, void *user) {
  (void)level, (void)user;
  fprintf(stderr, "dflash tokenize: %s\n", msg);
}

static void summary(const tok_args *a, const dflash_dataset_build_stats *s) {
  fprintf(stderr,
          "tokenize: %llu samples, %llu tokens, supervised %.1f%%, %llu rejected (%llu too long, "
          "%llu unfinished %s)%s\n",
          (unsigned long long)s->samples, (unsigned long long)s->tokens,
          s->tokens ? 100.0 * (double)s->supervised_tokens / (double)s->tokens : 0.0,
          (unsigned long long)s->rejected, (unsigned long long)s->too_long,
          (unsigned long long)s->unfinished, a->o.keep_unfinished ? "kept" : "dropped",
          s->rejected ? "; see rejected.jsonl" : "");
  uint64_t lines = s->samples + s->rejected;
  if (lines && s->too_long && s->verdict != DFLASH_DATASET_BUILD_TOO_LONG &&
      10 * s->too_long >= lines)
    fprintf(stderr,
            "dflash tokenize: warning: %.1f%% of the lines are longer than --max-len %llu: "
            "raise it to hold the prompt plus fetch's --max-tokens\n",
            100.0 * (double)s->too_long / (double)lines, (unsigned long long)a->o.max_len);
}

/* A finished build the library refused, in the CLI's words (its option names). */
static int verdict(const tok_args *a, const dflash_dataset_build_stats *s) {
  uint64_t lines = s->samples + s->rejected; /* non-blank */
  uint64_t dropped = a->o.keep_unfinished ? 0 : s->unfinished;
  double ratio = lines ? (double)(s->rejected - s->too_long - dropped) / (double)lines : 0;
  switch (s->verdict) {
  case DFLASH_DATASET_BUILD_UNREADABLE:
    fprintf(stderr, "dflash tokenize: %llu input(s) could not be read (rejected.jsonl)\n",
            (unsigned long long)s->unreadable);
    break;
  case DFLASH_DATASET_BUILD_EMPTY:
    fprintf(stderr, "dflash tokenize: no sample written: is this the right input and "
                    "template?\n");
    break;
  case DFLASH_DATASET_BUILD_TOO_LONG:
    fprintf(stderr,
            "dflash tokenize: %.1f%% of the lines are longer than --max-len %llu, more than "
            "--max-reject-ratio %g allows: raise --max-len to hold the prompt plus fetch's "
            "--max-tokens, or --truncate\n",
            lines ? 100.0 * (double)s->too_long / (double)lines : 0.0,
            (unsigned long long)a->o.max_len, a->o.max_reject_ratio);
    break;
  case DFLASH_DATASET_BUILD_REJECTS:
    fprintf(stderr,
            "dflash tokenize: %.1f%% of the lines were rejected, more than "
            "--max-reject-ratio %g allows; reasons in rejected.jsonl\n",
            100 * ratio, a->o.max_reject_ratio);
    break;
  default: return 0;
  }
  return 1;
}

int cmd_tokenize(int argc, char **argv) {
  tok_args a;
  const char **inputs = malloc((size_t)argc * sizeof *inputs);
  int n_inputs = 0;
  int rc = inputs ? parse_args(argc, argv, &a, inputs, &n_inputs) : 1;
  if (rc) {
    free(inputs);
    return rc < 0 ? 0 : rc;
  }
  dflash_progress *p = NULL;
  a.o.progress = on_progress;
  a.o.progress_user = &p;
  dflash_set_log_callback(on_log, NULL, DFLASH_LOG_WARN);
  dflash_dataset_build_stats s = {.struct_size = sizeof s};
  dflash_status st = dflash_dataset_build(inputs, (size_t)n_inputs, a.out_dir, &a.o, &s);
  free(inputs);
  if (p) { /* the outputs were created: the run is summed up whatever its end */
    dflash_progress_finish(p);
    dflash_progress_free(p);
    summary(&a, &s);
  }
  if (st && s.verdict != DFLASH_DATASET_BUILD_OK) return verdict(&a, &s);
  return st ? cli_fail("tokenize", st) : 0;
}
