/* `dflash tokenize`: conversations (JSONL) -> rendered, tokenized, loss-masked dataset shards. */
#include <dflash/chat.h>
#include <dflash/dataset.h>
#include <dflash/progress.h>
#include <dflash/tokenizer.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"

typedef struct {
  const char *tok_path, *tmpl_name, *out_dir;
  size_t max_len;
  int truncate, last_only;
  dflash_chat_reasoning reasoning;
} tok_args;

typedef struct {
  uint64_t lines, samples, tokens, supervised, rejected, too_long;
  FILE *rejects;
} tok_stats;

static int usage(FILE *f, int rc) {
  fprintf(f,
          "usage: dflash tokenize --tokenizer PATH --template NAME [--max-len N] [--truncate]\n"
          "                       [--last-turn-only] [--reasoning official|keep_all|\n"
          "                        keep_after_last_user|drop] -o DIR IN.jsonl...\n"
          "Reads OpenAI `messages`, ShareGPT `conversations` or fetcher completion records,\n"
          "one per line; writes safetensors shards + dataset.json to DIR and rejected lines\n"
          "(file, line, reason) to DIR/rejected.jsonl. Default reasoning: keep_after_last_user.\n");
  return rc;
}

static int parse_reasoning(const char *s, dflash_chat_reasoning *out) {
  static const char *const names[] = {"official", "keep_all", "keep_after_last_user", "drop"};
  for (int i = 0; i < 4; i++)
    if (!strcmp(s, names[i])) {
      *out = (dflash_chat_reasoning)i;
      return 0;
    }
  return -1;
}

static int parse_args(int argc, char **argv, tok_args *a, int *first_input) {
  memset(a, 0, sizeof *a);
  a->reasoning = DFLASH_CHAT_REASONING_KEEP_AFTER_LAST_USER;
  int i = 1;
  for (; i < argc && argv[i][0] == '-'; i++) {
    const char *o = argv[i];
    int has = i + 1 < argc;
    if (!strcmp(o, "--tokenizer") && has) a->tok_path = argv[++i];
    else if (!strcmp(o, "--template") && has) a->tmpl_name = argv[++i];
    else if ((!strcmp(o, "-o") || !strcmp(o, "--out")) && has) a->out_dir = argv[++i];
    else if (!strcmp(o, "--max-len") && has) a->max_len = strtoull(argv[++i], NULL, 10);
    else if (!strcmp(o, "--truncate")) a->truncate = 1;
    else if (!strcmp(o, "--last-turn-only")) a->last_only = 1;
    else if (!strcmp(o, "--reasoning") && has) {
      if (parse_reasoning(argv[++i], &a->reasoning)) return -1;
    } else return -1;
  }
  *first_input = i;
  return (a->tok_path && a->tmpl_name && a->out_dir && i < argc) ? 0 : -1;
}

static void reject(tok_stats *s, const char *file, uint64_t line, const char *why) {
  s->rejected++;
  if (!s->rejects) return;
  fprintf(s->rejects, "{\"file\": \"%s\", \"line\": %llu, \"reason\": \"", file,
          (unsigned long long)line);
  for (const char *p = why; *p; p++) {
    if (*p == '"' || *p == '\\') fputc('\\', s->rejects);
    if ((unsigned char)*p >= 0x20) fputc(*p, s->rejects);
  }
  fputs("\"}\n", s->rejects);
}

typedef struct {
  const tok_args *a;
  const dflash_tokenizer *tok;
  const dflash_chat_template *tmpl;
  dflash_dataset_writer *w;
  int32_t *ids;
  uint8_t *mask;
  size_t cap;
} tok_ctx;

/* Render + encode one record; returns a reason string on rejection (NULL on success). */
static const char *one_line(tok_ctx *c, const char *line, size_t len, const char *id,
                            tok_stats *s) {
  dflash_chat_options o;
  dflash_chat_options_default(&o);
  o.reasoning = c->a->reasoning;
  dflash_chat_rendered *r;
  if (dflash_chat_render_json(c->tmpl, line, len, &o, &r)) return dflash_last_error();
  if (dflash_chat_rendered_last_assistant(r) < 0) {
    dflash_chat_rendered_free(r);
    return "no assistant turn";
  }
  size_t tlen, n = 0, sup = 0;
  dflash_chat_rendered_text(r, &tlen);
  size_t need = dflash_tokenizer_max_ids(c->tok, tlen);
  if (need > c->cap) {
    c->cap = need;
    c->ids = realloc(c->ids, need * sizeof *c->ids);
    c->mask = realloc(c->mask, need);
  }
  dflash_status st = dflash_chat_encode(r, c->tok, c->a->last_only ? DFLASH_CHAT_TURNS_LAST
                                                                   : DFLASH_CHAT_TURNS_ALL,
                                        c->ids, c->mask, c->cap, &n, &sup);
  dflash_chat_rendered_free(r);
  if (st) return dflash_last_error();
  if (c->a->max_len && n > c->a->max_len) {
    if (!c->a->truncate) {
      s->too_long++;
      return "longer than --max-len";
    }
    n = c->a->max_len;
  }
  if (dflash_dataset_writer_add(c->w, id, c->ids, c->mask, n)) return dflash_last_error();
  s->samples++;
  s->tokens += n;
  for (size_t i = 0; i < n; i++) s->supervised += c->mask[i];
  return NULL;
}

static void one_file(tok_ctx *c, const char *path, tok_stats *s, dflash_progress *p) {
  FILE *f = fopen(path, "r");
  if (!f) {
    reject(s, path, 0, "cannot open file");
    return;
  }
  char *line = NULL;
  size_t cap = 0;
  ssize_t len;
  uint64_t lineno = 0;
  while ((len = getline(&line, &cap, f)) > 0) {
    lineno++;
    s->lines++;
    if (len == 1 && line[0] == '\n') continue;
    char id[4200];
    snprintf(id, sizeof id, "%s:%llu", path, (unsigned long long)lineno);
    const char *why = one_line(c, line, (size_t)len, id, s);
    if (why) reject(s, path, lineno, why);
    dflash_progress_update(p, s->lines, NULL);
  }
  free(line);
  fclose(f);
}

int cmd_tokenize(int argc, char **argv) {
  tok_args a;
  int first;
  if (argc >= 2 && !strcmp(argv[1], "--help")) return usage(stdout, 0);
  if (parse_args(argc, argv, &a, &first)) return usage(stderr, 2);
  tok_ctx c = {.a = &a};
  dflash_tokenizer *tok = NULL;
  dflash_chat_template *tmpl = NULL;
  dflash_status st = dflash_tokenizer_load(a.tok_path, NULL, &tok);
  if (!st) st = dflash_chat_template_create(a.tmpl_name, &tmpl);
  dflash_dataset_writer_options wo;
  dflash_dataset_writer_options_default(&wo);
  wo.tokenizer_hash = a.tok_path;
  wo.template_name = a.tmpl_name;
  if (!st) st = dflash_dataset_writer_create(a.out_dir, &wo, &c.w);
  if (st) {
    dflash_tokenizer_free(tok);
    dflash_chat_template_free(tmpl);
    return cli_fail("tokenize", st);
  }
  c.tok = tok;
  c.tmpl = tmpl;
  tok_stats s = {0};
  char rej[4096];
  snprintf(rej, sizeof rej, "%s/rejected.jsonl", a.out_dir);
  s.rejects = fopen(rej, "w");
  dflash_progress *p = NULL;
  dflash_progress_create(stderr, "tokenize", "lines", 0, 0, &p);
  for (int i = first; i < argc; i++) one_file(&c, argv[i], &s, p);
  dflash_progress_finish(p);
  dflash_progress_free(p);
  st = dflash_dataset_writer_finish(c.w);
  if (s.rejects) fclose(s.rejects);
  fprintf(stderr,
          "tokenize: %llu samples, %llu tokens, supervised %.1f%%, %llu rejected (%llu too long)%s\n",
          (unsigned long long)s.samples, (unsigned long long)s.tokens,
          s.tokens ? 100.0 * (double)s.supervised / (double)s.tokens : 0.0,
          (unsigned long long)s.rejected, (unsigned long long)s.too_long,
          s.rejected ? "; see rejected.jsonl" : "");
  dflash_dataset_writer_free(c.w);
  dflash_tokenizer_free(tok);
  dflash_chat_template_free(tmpl);
  free(c.ids);
  free(c.mask);
  return st ? cli_fail("tokenize", st) : 0;
}
