/*
 * `dflash tokenize`: conversations (JSONL) -> rendered, tokenized, loss-masked dataset shards.
 *
 * Lines are read in batches. Each batch is rendered and encoded on N threads
 * (a line per claim from an atomic counter, its result in the line's own
 * slot); the main thread then writes the slots in input order. So the
 * shards, manifest and rejected.jsonl are the same bytes for any thread count.
 */
#include <dflash/chat.h>
#include <dflash/dataset.h>
#include <dflash/fetch.h>
#include <dflash/progress.h>
#include <dflash/storage.h>
#include <dflash/tokenizer.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chat_cli.h"
#include "commands.h"

/* A batch ends at --batch-lines lines (default) or this many input bytes. */
#define BATCH_LINES 2048
#define BATCH_BYTES ((size_t)32 << 20)
/* Default --max-reject-ratio: above 5 % malformed lines the input is more likely the wrong
 * file or format than a few bad records. */
#define MAX_REJECT_RATIO 0.05
/* Sample ids are the records' own ("id", as fetch writes it) or fetch's derived hash id. */
#define ID_CAP 4096

typedef struct {
  const char *tok_path, *tmpl_name, *out_dir;
  size_t max_len;
  int truncate, last_only, threads, allow_split;
  size_t batch_lines;
  double max_reject_ratio;
  dflash_chat_reasoning reasoning;
} tok_args;

/* Ids written so far (open addressing, grows at half load): a second record with the same id
 * would join the hidden-state store to the wrong tokens, so it is rejected. */
typedef struct {
  char **slots;
  size_t cap, n;
} id_set;

typedef struct {
  uint64_t lines, samples, tokens, supervised, rejected, too_long, unreadable;
  FILE *rejects, *sources; /* rejected.jsonl, sources.jsonl (id, file, line per sample) */
  id_set ids;
} tok_stats;

/* One input line and what became of it. */
typedef struct {
  char *text;
  size_t len;
  const char *file;
  uint64_t line;
  char *id; /* the sample id (malloc'd), set when accepted */
  int32_t *ids;
  uint8_t *mask;
  size_t n, supervised;
  char *why; /* rejection reason (malloc'd); NULL when accepted */
  int too_long;
} tok_item;

/* Shared, read-only while workers run (except `next`). */
typedef struct {
  const tok_args *a;
  const dflash_tokenizer *tok;
  const dflash_chat_template *tmpl;
  int nfc;
  tok_item *items;
  size_t n_items;
  atomic_size_t next;
} tok_job;

static const char USAGE[] =
          "usage: dflash tokenize --tokenizer PATH --template NAME [--max-len N] [--truncate]\n"
          "                       [--last-turn-only] [--reasoning official|keep_all|\n"
          "                        keep_after_last_user|drop] [--threads N] [--batch-lines N]\n"
          "                       [--max-reject-ratio X] [--allow-split-control-tokens]\n"
          "                       -o DIR IN.jsonl...\n"
          "DIR and the inputs may be s3:// locations; an s3:// input ending in '/' means every\n"
          "*.jsonl object under it (e.g. a fetch output's completions/ chunks).\n"
          "Reads OpenAI `messages`, ShareGPT `conversations` or fetcher completion records,\n"
          "one per line; writes safetensors shards + dataset.json to DIR and rejected lines\n"
          "(file, line, reason) to DIR/rejected.jsonl. Default reasoning: keep_after_last_user.\n"
          "Sample ids are the records' \"id\" (fetch outputs carry it), else fetch's derived id\n"
          "(\"h\" + 32 hex digits of SHA-256); a repeated id is rejected. DIR/sources.jsonl\n"
          "gives each sample's id, file and line.\n"
          "The template's control tokens (turn markers, think and tool tags) must be single\n"
          "tokens of the tokenizer, as with the target's own; --allow-split-control-tokens\n"
          "accepts another family's tokenizer anyway.\n"
          "--threads: 0 (default) = one per CPU; the output is identical for any count.\n"
          "--batch-lines: lines read and processed together (default 2048; memory knob).\n"
          "Over-long samples (--max-len) are dropped, or cut to N tokens with --truncate.\n"
          "Exit status: 0 done; 1 an error, an input that cannot be read, no sample written, or\n"
          "more rejected lines than --max-reject-ratio (default 0.05; over-long samples are\n"
          "not counted) of the non-blank lines; 2 a usage error.\n";

/* The inputs are the positional arguments, in `inputs` (argc entries). */
static int parse_args(int argc, char **argv, tok_args *a, const char **inputs, int *n_inputs) {
  memset(a, 0, sizeof *a);
  a->reasoning = DFLASH_CHAT_REASONING_KEEP_AFTER_LAST_USER;
  a->batch_lines = BATCH_LINES;
  a->max_reject_ratio = MAX_REJECT_RATIO;
  const cli_opt opts[] = {
      {"--tokenizer", CLI_STR, &a->tok_path, 0, 0, NULL},
      {"--template", CLI_STR, &a->tmpl_name, 0, 0, NULL},
      {"-o", CLI_STR, &a->out_dir, 0, 0, NULL},
      {"--out", CLI_STR, &a->out_dir, 0, 0, NULL},
      {"--max-len", CLI_I64, &a->max_len, 1, (double)INT64_MAX, NULL},
      {"--threads", CLI_INT, &a->threads, 0, 4096, NULL},
      {"--batch-lines", CLI_I64, &a->batch_lines, 1, 1 << 20, NULL},
      {"--max-reject-ratio", CLI_REAL, &a->max_reject_ratio, 0, 1, NULL},
      {"--truncate", CLI_FLAG, &a->truncate, 0, 0, NULL},
      {"--allow-split-control-tokens", CLI_FLAG, &a->allow_split, 0, 0, NULL},
      {"--last-turn-only", CLI_FLAG, &a->last_only, 0, 0, NULL},
      {"--reasoning", CLI_FN, &a->reasoning, 0, 0, chat_cli_reasoning_opt},
      {NULL, 0, NULL, 0, 0, NULL}};
  int rc = cli_parse("tokenize", USAGE, opts, argc, argv, inputs, argc, n_inputs);
  if (rc == 1) chat_cli_list_templates(stdout);
  if (rc) return rc == 1 ? -1 : rc;
  if (!a->tok_path) return cli_missing("tokenize", "--tokenizer");
  if (!a->tmpl_name) return cli_missing("tokenize", "--template");
  if (!a->out_dir) return cli_missing("tokenize", "-o");
  if (!*n_inputs) return cli_missing("tokenize", "an input file (IN.jsonl)");
  if (a->threads <= 0) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    a->threads = cpus > 0 ? (int)cpus : 1;
  }
  return 0;
}

/* ---- one line (runs on any thread) ------------------------------------------ */

typedef struct {
  int32_t *ids;
  uint8_t *mask;
  size_t cap;
} tok_scratch;

static const char *grow(tok_scratch *s, size_t need) {
  if (need <= s->cap) return NULL;
  int32_t *ids = realloc(s->ids, need * sizeof *ids);
  if (ids) s->ids = ids;
  uint8_t *mask = realloc(s->mask, need);
  if (mask) s->mask = mask;
  if (!ids || !mask) return "out of memory";
  s->cap = need;
  return NULL;
}

/* Render + encode one record into `it`; returns a reason on rejection. */
static const char *encode_item(const tok_job *j, tok_item *it, tok_scratch *s) {
  dflash_chat_options o;
  dflash_chat_options_default(&o);
  o.reasoning = j->a->reasoning;
  dflash_chat_rendered *r;
  if (chat_cli_render(j->tmpl, it->text, it->len, j->nfc, &o, &r)) return dflash_last_error();
  const char *why = NULL;
  size_t tlen;
  dflash_chat_rendered_text(r, &tlen);
  if (dflash_chat_rendered_last_assistant(r) < 0) why = "no assistant turn";
  if (!why) why = grow(s, dflash_tokenizer_max_ids(j->tok, tlen));
  if (!why && dflash_chat_encode(r, j->tok, j->a->last_only ? DFLASH_CHAT_TURNS_LAST
                                                            : DFLASH_CHAT_TURNS_ALL,
                                 s->ids, s->mask, s->cap, &it->n, &it->supervised))
    why = dflash_last_error();
  dflash_chat_rendered_free(r);
  if (why) return why;
  if (j->a->max_len && it->n > j->a->max_len) {
    if (!j->a->truncate) {
      it->too_long = 1;
      return "longer than --max-len";
    }
    it->n = j->a->max_len;
    it->supervised = 0;
    for (size_t i = 0; i < it->n; i++) it->supervised += s->mask[i];
  }
  char id[ID_CAP];
  if (dflash_fetch_record_id(it->text, it->len, id, sizeof id)) return dflash_last_error();
  it->id = strdup(id);
  it->ids = malloc(it->n * sizeof *it->ids);
  it->mask = malloc(it->n);
  if (!it->id || !it->ids || !it->mask) return "out of memory";
  memcpy(it->ids, s->ids, it->n * sizeof *it->ids);
  memcpy(it->mask, s->mask, it->n);
  return NULL;
}

static void *worker(void *arg) {
  tok_job *j = arg;
  tok_scratch s = {0};
  for (;;) {
    size_t k = atomic_fetch_add(&j->next, 1);
    if (k >= j->n_items) break;
    const char *why = encode_item(j, &j->items[k], &s);
    if (why) j->items[k].why = strdup(why);
  }
  free(s.ids);
  free(s.mask);
  return NULL;
}

/* Process the batch on `threads` threads (the caller is one of them). */
static void run_batch(tok_job *j, int threads) {
  atomic_store(&j->next, 0);
  if ((size_t)threads > j->n_items) threads = (int)j->n_items;
  pthread_t tids[256];
  int started = 0;
  for (int t = 1; t < threads && t < 256; t++)
    if (pthread_create(&tids[started], NULL, worker, j) == 0) started++;
  worker(j);
  for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
}

/* ---- input and output (main thread) ----------------------------------------- */

typedef struct {
  char **files;
  int n_files, at;
  FILE *f;
  uint64_t line;
  char *buf;
  size_t cap;
  dflash_storage *storage; /* s3:// inputs are read whole and parsed from memory */
  void *object;
} tok_reader;

static FILE *open_input(tok_reader *r, const char *name) {
  if (!dflash_storage_is_remote(name)) return fopen(name, "r");
  size_t len;
  if ((!r->storage && dflash_storage_create(NULL, &r->storage)) ||
      dflash_storage_read(r->storage, name, &r->object, &len)) {
    fprintf(stderr, "dflash tokenize: %s\n", dflash_last_error());
    return NULL;
  }
  FILE *f = len ? fmemopen(r->object, len, "r") : fopen("/dev/null", "r");
  return f;
}

static void close_input(tok_reader *r) {
  fclose(r->f);
  r->f = NULL;
  dflash_storage_buffer_free(r->object);
  r->object = NULL;
}

static void reject(tok_stats *s, const char *file, uint64_t line, const char *why) {
  s->rejected++;
  if (!s->rejects) return;
  fputs("{\"file\": ", s->rejects);
  chat_cli_json_string(s->rejects, file, strlen(file));
  fprintf(s->rejects, ", \"line\": %llu, \"reason\": ", (unsigned long long)line);
  chat_cli_json_string(s->rejects, why, strlen(why));
  fputs("}\n", s->rejects);
}

/* Fill `j` with the next batch of non-blank lines; 0 items at the end of input. */
static void read_batch(tok_reader *r, tok_job *j, tok_stats *s) {
  size_t bytes = 0;
  j->n_items = 0;
  while (j->n_items < j->a->batch_lines && bytes < BATCH_BYTES) {
    if (!r->f) {
      if (r->at >= r->n_files) return;
      r->line = 0;
      if (!(r->f = open_input(r, r->files[r->at]))) {
        reject(s, r->files[r->at++], 0, "cannot open file");
        continue;
      }
    }
    ssize_t len = getline(&r->buf, &r->cap, r->f);
    if (len <= 0) {
      close_input(r);
      r->at++;
      continue;
    }
    r->line++;
    s->lines++;
    if (len == 1 && r->buf[0] == '\n') continue;
    tok_item *it = &j->items[j->n_items++];
    memset(it, 0, sizeof *it);
    it->text = malloc((size_t)len);
    if (it->text) memcpy(it->text, r->buf, (size_t)len);
    it->len = it->text ? (size_t)len : 0;
    it->file = r->files[r->at];
    it->line = r->line;
    bytes += (size_t)len;
  }
}

static void item_free(tok_item *it) {
  free(it->text);
  free(it->id);
  free(it->ids);
  free(it->mask);
  free(it->why);
}

static uint64_t fnv1a(const char *k) {
  uint64_t h = 1469598103934665603ULL;
  for (; *k; k++) h = (h ^ (unsigned char)*k) * 1099511628211ULL;
  return h;
}

/* Adds `id` (ownership passes to the set); 1 when it was there already (then freed), -1 when
 * out of memory. */
static int id_set_add(id_set *set, char *id) {
  if (2 * (set->n + 1) > set->cap) {
    size_t cap = set->cap ? 2 * set->cap : 4096;
    char **slots = calloc(cap, sizeof *slots);
    if (!slots) return free(id), -1;
    for (size_t i = 0; i < set->cap; i++) {
      if (!set->slots[i]) continue;
      size_t h = fnv1a(set->slots[i]);
      while (slots[h & (cap - 1)]) h++;
      slots[h & (cap - 1)] = set->slots[i];
    }
    free(set->slots);
    set->slots = slots, set->cap = cap;
  }
  for (size_t h = fnv1a(id);; h++) {
    char **slot = &set->slots[h & (set->cap - 1)];
    if (!*slot) return *slot = id, set->n++, 0;
    if (!strcmp(*slot, id)) return free(id), 1;
  }
}

static void id_set_free(id_set *set) {
  for (size_t i = 0; i < set->cap; i++) free(set->slots[i]);
  free(set->slots);
}

static void write_source(FILE *f, const tok_item *it) {
  if (!f) return;
  fputs("{\"id\": ", f);
  chat_cli_json_string(f, it->id, strlen(it->id));
  fputs(", \"file\": ", f);
  chat_cli_json_string(f, it->file, strlen(it->file));
  fprintf(f, ", \"line\": %llu}\n", (unsigned long long)it->line);
}

/* Write the batch's samples in input order; the writer's first failure is returned. */
static dflash_status write_batch(tok_job *j, dflash_dataset_writer *w, tok_stats *s) {
  dflash_status st = DFLASH_OK;
  for (size_t k = 0; k < j->n_items; k++) {
    tok_item *it = &j->items[k];
    int dup = 0;
    if (!it->why && !st) {
      char *key = strdup(it->id);
      dup = key ? id_set_add(&s->ids, key) : -1;
    }
    if (dup > 0) {
      char why[ID_CAP + 64];
      snprintf(why, sizeof why, "duplicate id \"%s\" (an earlier line has it)", it->id);
      reject(s, it->file, it->line, why);
    } else if (it->why) {
      reject(s, it->file, it->line, it->why);
      s->too_long += (uint64_t)it->too_long;
    } else if (!st && dup < 0) {
      st = DFLASH_E_NOMEM;
    } else if (!st) {
      st = dflash_dataset_writer_add(w, it->id, it->ids, it->mask, it->n);
      write_source(s->sources, it);
      s->samples++;
      s->tokens += it->n;
      s->supervised += it->supervised;
    }
    item_free(it);
  }
  return st;
}

/* The options that shape the samples, for the manifest (not --threads: it changes nothing). */
static char *options_json(const tok_args *a, int nfc) {
  static const char *const modes[] = {"official", "keep_all", "keep_after_last_user", "drop"};
  char *s = malloc(256);
  if (s)
    snprintf(s, 256,
             "{\"reasoning\": \"%s\", \"turns\": \"%s\", \"max_len\": %zu, \"truncate\": %s, "
             "\"nfc\": %s}",
             modes[a->reasoning], a->last_only ? "last" : "all", a->max_len,
             a->truncate ? "true" : "false", nfc ? "true" : "false");
  return s;
}

static void summary(const tok_stats *s) {
  fprintf(stderr,
          "tokenize: %llu samples, %llu tokens, supervised %.1f%%, %llu rejected (%llu too long)%s\n",
          (unsigned long long)s->samples, (unsigned long long)s->tokens,
          s->tokens ? 100.0 * (double)s->supervised / (double)s->tokens : 0.0,
          (unsigned long long)s->rejected, (unsigned long long)s->too_long,
          s->rejected ? "; see rejected.jsonl" : "");
}

/* Tokenizer, template, NFC probe and writer; on failure everything is freed. */
static dflash_status open_all(const tok_args *a, tok_job *j, dflash_tokenizer **tok,
                              dflash_chat_template **tmpl, dflash_dataset_writer **w) {
  char hash[DFLASH_TOKENIZER_HASH_LEN];
  dflash_status st = dflash_tokenizer_load(a->tok_path, NULL, tok);
  if (!st) st = dflash_chat_template_create(a->tmpl_name, tmpl);
  if (!st && !a->allow_split) st = dflash_chat_template_check_tokenizer(*tmpl, *tok);
  if (!st) st = dflash_chat_tokenizer_nfc(*tok, &j->nfc);
  if (!st) st = dflash_dataset_tokenizer_hash(a->tok_path, hash, sizeof hash);
  char *opts = st ? NULL : options_json(a, j->nfc);
  if (!st) {
    dflash_dataset_writer_options wo;
    dflash_dataset_writer_options_default(&wo);
    wo.tokenizer_hash = hash;
    wo.template_name = a->tmpl_name;
    wo.options_json = opts;
    st = dflash_dataset_writer_create(a->out_dir, &wo, w);
  }
  free(opts);
  if (st) {
    dflash_tokenizer_free(*tok);
    dflash_chat_template_free(*tmpl);
    *tok = NULL;
    *tmpl = NULL;
  }
  j->a = a;
  j->tok = *tok;
  j->tmpl = *tmpl;
  return st;
}

/* The input list: an s3:// argument ending in '/' stands for every *.jsonl
 * object under that prefix, in name order (a fetch output's chunks). */
static char **expand_inputs(const char **args, int n, int *n_out) {
  size_t cap = (size_t)n + 16, k = 0;
  char **v = malloc(cap * sizeof *v);
  dflash_storage *st = NULL;
  for (int i = 0; v && i < n; i++) {
    size_t len = strlen(args[i]);
    if (!dflash_storage_is_remote(args[i]) || args[i][len - 1] != '/') {
      v[k++] = strdup(args[i]);
      continue;
    }
    dflash_storage_listing *l = NULL;
    if ((!st && dflash_storage_create(NULL, &st)) || dflash_storage_list(st, args[i], &l)) {
      fprintf(stderr, "dflash tokenize: %s\n", dflash_last_error());
      continue; /* counted as no lines; the summary shows it */
    }
    size_t m = dflash_storage_listing_count(l);
    char **nv = realloc(v, (cap += m) * sizeof *v);
    if (nv) v = nv;
    for (size_t e = 0; nv && e < m; e++) {
      const char *loc;
      dflash_storage_listing_get(l, e, &loc, NULL);
      size_t ll = strlen(loc);
      if (ll > 6 && !strcmp(loc + ll - 6, ".jsonl")) v[k++] = strdup(loc);
    }
    dflash_storage_listing_free(l);
  }
  dflash_storage_free(st);
  *n_out = (int)k;
  return v;
}

/* rejected.jsonl and sources.jsonl: a file in DIR, or for an s3:// DIR a
 * temporary file uploaded by finish_side. */
static FILE *open_side(const char *out_dir, const char *name) {
  if (dflash_storage_is_remote(out_dir)) return tmpfile();
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", out_dir, name);
  return fopen(path, "w");
}

static dflash_status finish_side(FILE *f, const char *out_dir, const char *name) {
  if (!f) return DFLASH_OK;
  dflash_status st = DFLASH_OK;
  if (dflash_storage_is_remote(out_dir)) {
    long n = ftell(f);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    rewind(f);
    size_t got = buf ? fread(buf, 1, (size_t)n, f) : 0;
    char loc[4096];
    snprintf(loc, sizeof loc, "%s%s%s", out_dir, out_dir[strlen(out_dir) - 1] == '/' ? "" : "/",
             name);
    dflash_storage *s = NULL;
    st = buf && got == (size_t)n ? dflash_storage_create(NULL, &s) : DFLASH_E_IO;
    if (!st) st = dflash_storage_write(s, loc, buf, got);
    dflash_storage_free(s);
    free(buf);
  }
  fclose(f);
  return st;
}

/* Local inputs that cannot be read fail before any output is created. */
static int check_inputs(const char **files, int n) {
  for (int i = 0; i < n; i++)
    if (!dflash_storage_is_remote(files[i]) && access(files[i], R_OK) != 0) {
      fprintf(stderr, "dflash tokenize: cannot read input %s: %s\n", files[i], strerror(errno));
      return 1;
    }
  return 0;
}

/* The run's verdict beyond library errors: 1 (with a message) when the output cannot be what
 * the user meant. */
static int verdict(const tok_args *a, const tok_stats *s) {
  uint64_t lines = s->samples + s->rejected; /* non-blank */
  double ratio = lines ? (double)(s->rejected - s->too_long) / (double)lines : 0;
  if (s->unreadable)
    fprintf(stderr, "dflash tokenize: %llu input(s) could not be read (rejected.jsonl)\n",
            (unsigned long long)s->unreadable);
  else if (!s->samples)
    fprintf(stderr, "dflash tokenize: no sample written: is this the right input and "
                    "template?\n");
  else if (ratio > a->max_reject_ratio)
    fprintf(stderr, "dflash tokenize: %.1f%% of the lines were rejected, more than "
                    "--max-reject-ratio %g allows; reasons in rejected.jsonl\n",
            100 * ratio, a->max_reject_ratio);
  else
    return 0;
  return 1;
}

int cmd_tokenize(int argc, char **argv) {
  tok_args a;
  const char **inputs = malloc((size_t)argc * sizeof *inputs);
  int n_inputs = 0;
  int rc = inputs ? parse_args(argc, argv, &a, inputs, &n_inputs) : 1;
  if (!rc) rc = check_inputs(inputs, n_inputs);
  if (rc) {
    free(inputs);
    return rc < 0 ? 0 : rc;
  }
  tok_job j = {0};
  dflash_tokenizer *tok = NULL;
  dflash_chat_template *tmpl = NULL;
  dflash_dataset_writer *w = NULL;
  dflash_status st = open_all(&a, &j, &tok, &tmpl, &w);
  if (st) {
    free(inputs);
    return cli_fail("tokenize", st);
  }
  tok_stats s = {0};
  s.rejects = open_side(a.out_dir, "rejected.jsonl");
  s.sources = open_side(a.out_dir, "sources.jsonl");
  j.items = malloc(a.batch_lines * sizeof *j.items);
  if (!j.items) st = DFLASH_E_NOMEM;
  dflash_progress *p = NULL;
  dflash_progress_create(stderr, "tokenize", "lines", 0, 0, &p);
  tok_reader r = {0};
  r.files = expand_inputs(inputs, n_inputs, &r.n_files);
  free(inputs);
  if (!r.files) st = DFLASH_E_NOMEM;
  while (!st) {
    read_batch(&r, &j, &s);
    if (!j.n_items) break;
    run_batch(&j, a.threads);
    st = write_batch(&j, w, &s);
    dflash_progress_update(p, s.lines, NULL);
  }
  if (r.f) close_input(&r);
  dflash_storage_free(r.storage);
  free(r.buf);
  dflash_progress_finish(p);
  dflash_progress_free(p);
  if (!st) st = dflash_dataset_writer_finish(w);
  dflash_status rs = finish_side(s.rejects, a.out_dir, "rejected.jsonl");
  if (!st) st = rs;
  rs = finish_side(s.sources, a.out_dir, "sources.jsonl");
  if (!st) st = rs;
  id_set_free(&s.ids);
  for (int i = 0; r.files && i < r.n_files; i++) free(r.files[i]);
  free(r.files);
  summary(&s);
  dflash_dataset_writer_free(w);
  dflash_tokenizer_free(tok);
  dflash_chat_template_free(tmpl);
  free(j.items);
  return st ? cli_fail("tokenize", st) : verdict(&a, &s);
}
