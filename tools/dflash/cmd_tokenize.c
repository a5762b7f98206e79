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
#include <dflash/progress.h>
#include <dflash/storage.h>
#include <dflash/tokenizer.h>
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

typedef struct {
  const char *tok_path, *tmpl_name, *out_dir;
  size_t max_len;
  int truncate, last_only, threads;
  size_t batch_lines;
  dflash_chat_reasoning reasoning;
} tok_args;

typedef struct {
  uint64_t lines, samples, tokens, supervised, rejected, too_long;
  FILE *rejects;
} tok_stats;

/* One input line and what became of it. */
typedef struct {
  char *text;
  size_t len;
  const char *file;
  uint64_t line;
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

static int usage(FILE *f, int rc) {
  fprintf(f,
          "usage: dflash tokenize --tokenizer PATH --template NAME [--max-len N] [--truncate]\n"
          "                       [--last-turn-only] [--reasoning official|keep_all|\n"
          "                        keep_after_last_user|drop] [--threads N] [--batch-lines N]\n"
          "                       -o DIR IN.jsonl...\n"
          "DIR and the inputs may be s3:// locations; an s3:// input ending in '/' means every\n"
          "*.jsonl object under it (e.g. a fetch output's completions/ chunks).\n"
          "Reads OpenAI `messages`, ShareGPT `conversations` or fetcher completion records,\n"
          "one per line; writes safetensors shards + dataset.json to DIR and rejected lines\n"
          "(file, line, reason) to DIR/rejected.jsonl. Default reasoning: keep_after_last_user.\n"
          "--threads: 0 (default) = one per CPU; the output is identical for any count.\n"
          "--batch-lines: lines read and processed together (default 2048; memory knob).\n"
          "Over-long samples (--max-len) are dropped, or cut to N tokens with --truncate.\n");
  return rc;
}

static int parse_args(int argc, char **argv, tok_args *a, int *first_input) {
  memset(a, 0, sizeof *a);
  a->reasoning = DFLASH_CHAT_REASONING_KEEP_AFTER_LAST_USER;
  a->batch_lines = BATCH_LINES;
  int i = 1;
  bool bad = false; /* a malformed number (cli_int printed it) */
  for (; i < argc && argv[i][0] == '-'; i++) {
    const char *o = argv[i];
    int has = i + 1 < argc;
    if (!strcmp(o, "--tokenizer") && has) a->tok_path = argv[++i];
    else if (!strcmp(o, "--template") && has) a->tmpl_name = argv[++i];
    else if ((!strcmp(o, "-o") || !strcmp(o, "--out")) && has) a->out_dir = argv[++i];
    else if (!strcmp(o, "--max-len") && has)
      a->max_len = (uint64_t)cli_int(o, argv[++i], 1, INT64_MAX, &bad);
    else if (!strcmp(o, "--threads") && has) a->threads = (int)cli_int(o, argv[++i], 0, 4096, &bad);
    else if (!strcmp(o, "--batch-lines") && has)
      a->batch_lines = (uint64_t)cli_int(o, argv[++i], 1, 1 << 20, &bad);
    else if (!strcmp(o, "--truncate")) a->truncate = 1;
    else if (!strcmp(o, "--last-turn-only")) a->last_only = 1;
    else if (!strcmp(o, "--reasoning") && has) {
      if (chat_cli_reasoning(argv[++i], &a->reasoning)) return -1;
    } else return -1;
  }
  if (bad) return -1;
  *first_input = i;
  if (a->threads <= 0) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    a->threads = cpus > 0 ? (int)cpus : 1;
  }
  int batch_ok = a->batch_lines > 0 && a->batch_lines <= ((size_t)1 << 20);
  return (a->tok_path && a->tmpl_name && a->out_dir && i < argc && batch_ok) ? 0 : -1;
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
  it->ids = malloc(it->n * sizeof *it->ids);
  it->mask = malloc(it->n);
  if (!it->ids || !it->mask) return "out of memory";
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

/* Write the batch's samples in input order; the writer's first failure is returned. */
static dflash_status write_batch(tok_job *j, dflash_dataset_writer *w, tok_stats *s) {
  dflash_status st = DFLASH_OK;
  for (size_t k = 0; k < j->n_items; k++) {
    tok_item *it = &j->items[k];
    if (it->why) {
      reject(s, it->file, it->line, it->why);
      s->too_long += (uint64_t)it->too_long;
    } else if (!st) {
      char id[4200];
      snprintf(id, sizeof id, "%s:%llu", it->file, (unsigned long long)it->line);
      st = dflash_dataset_writer_add(w, id, it->ids, it->mask, it->n);
      s->samples++;
      s->tokens += it->n;
      s->supervised += it->supervised;
    }
    free(it->text);
    free(it->ids);
    free(it->mask);
    free(it->why);
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
static char **expand_inputs(char **args, int n, int *n_out) {
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

/* rejected.jsonl: a file in DIR, or for an s3:// DIR a temporary file
 * uploaded by finish_rejects. */
static FILE *open_rejects(const char *out_dir) {
  if (dflash_storage_is_remote(out_dir)) return tmpfile();
  char rej[4096];
  snprintf(rej, sizeof rej, "%s/rejected.jsonl", out_dir);
  return fopen(rej, "w");
}

static dflash_status finish_rejects(FILE *f, const char *out_dir) {
  if (!f) return DFLASH_OK;
  dflash_status st = DFLASH_OK;
  if (dflash_storage_is_remote(out_dir)) {
    long n = ftell(f);
    char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
    rewind(f);
    size_t got = buf ? fread(buf, 1, (size_t)n, f) : 0;
    char loc[4096];
    snprintf(loc, sizeof loc, "%s%srejected.jsonl", out_dir,
             out_dir[strlen(out_dir) - 1] == '/' ? "" : "/");
    dflash_storage *s = NULL;
    st = buf && got == (size_t)n ? dflash_storage_create(NULL, &s) : DFLASH_E_IO;
    if (!st) st = dflash_storage_write(s, loc, buf, got);
    dflash_storage_free(s);
    free(buf);
  }
  fclose(f);
  return st;
}

int cmd_tokenize(int argc, char **argv) {
  tok_args a;
  int first;
  if (argc >= 2 && !strcmp(argv[1], "--help")) return usage(stdout, 0);
  if (parse_args(argc, argv, &a, &first)) return usage(stderr, 2);
  tok_job j = {0};
  dflash_tokenizer *tok = NULL;
  dflash_chat_template *tmpl = NULL;
  dflash_dataset_writer *w = NULL;
  dflash_status st = open_all(&a, &j, &tok, &tmpl, &w);
  if (st) return cli_fail("tokenize", st);
  tok_stats s = {0};
  s.rejects = open_rejects(a.out_dir);
  j.items = malloc(a.batch_lines * sizeof *j.items);
  if (!j.items) st = DFLASH_E_NOMEM;
  dflash_progress *p = NULL;
  dflash_progress_create(stderr, "tokenize", "lines", 0, 0, &p);
  tok_reader r = {0};
  r.files = expand_inputs(argv + first, argc - first, &r.n_files);
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
  dflash_status rs = finish_rejects(s.rejects, a.out_dir);
  if (!st) st = rs;
  for (int i = 0; r.files && i < r.n_files; i++) free(r.files[i]);
  free(r.files);
  summary(&s);
  dflash_dataset_writer_free(w);
  dflash_tokenizer_free(tok);
  dflash_chat_template_free(tmpl);
  free(j.items);
  return st ? cli_fail("tokenize", st) : 0;
}
