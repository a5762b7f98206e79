/* `dflash render`: one conversation (JSON on stdin) -> its rendered text, or
 * with --mask a JSON object {text, ids, loss_mask}. */
#include <dflash/chat.h>
#include <dflash/tokenizer.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_cli.h"
#include "commands.h"

typedef struct {
  const char *tmpl_name, *tok_path;
  int mask, last_only;
  dflash_chat_options o;
} render_args;

static int usage(FILE *f, int rc) {
  fprintf(f,
          "usage: dflash render --template NAME [--tokenizer PATH] [--mask] [--last-turn-only]\n"
          "                     [--generation-prompt] [--no-thinking] [--preserve-thinking]\n"
          "                     [--reasoning official|keep_all|keep_after_last_user|drop]\n"
          "Reads one conversation (JSON) on stdin and prints the rendered text. With --mask\n"
          "(needs --tokenizer) prints {\"text\", \"ids\", \"loss_mask\"} instead. With a tokenizer\n"
          "that normalises (NFC), the conversation is normalised first, so text and ids\n"
          "match. Default reasoning: official (what the template renders); with --mask\n"
          "keep_after_last_user, as `dflash tokenize` stores it.\n");
  return rc;
}

static int parse_args(int argc, char **argv, render_args *a) {
  memset(a, 0, sizeof *a);
  dflash_chat_options_default(&a->o);
  bool reasoning_given = false;
  for (int i = 1; i < argc; i++) {
    const char *o = argv[i];
    int has = i + 1 < argc;
    if (!strcmp(o, "--template") && has) a->tmpl_name = argv[++i];
    else if (!strcmp(o, "--tokenizer") && has) a->tok_path = argv[++i];
    else if (!strcmp(o, "--mask")) a->mask = 1;
    else if (!strcmp(o, "--last-turn-only")) a->last_only = 1;
    else if (!strcmp(o, "--generation-prompt")) a->o.add_generation_prompt = 1;
    else if (!strcmp(o, "--no-thinking")) a->o.thinking = 0;
    else if (!strcmp(o, "--preserve-thinking")) a->o.preserve_thinking = 1;
    else if (!strcmp(o, "--reasoning") && has) {
      if (chat_cli_reasoning(argv[++i], &a->o.reasoning)) return -1;
      reasoning_given = true;
    } else return -1;
  }
  /* --mask shows what `dflash tokenize` stores: its reasoning default too. */
  if (a->mask && !reasoning_given) a->o.reasoning = DFLASH_CHAT_REASONING_KEEP_AFTER_LAST_USER;
  return a->tmpl_name && (!a->mask || a->tok_path) ? 0 : -1;
}

static char *read_stdin(size_t *len) {
  size_t cap = 1 << 16;
  char *buf = malloc(cap);
  *len = 0;
  while (buf) {
    size_t n = fread(buf + *len, 1, cap - *len, stdin);
    *len += n;
    if (n == 0) break;
    if (*len == cap) {
      char *bigger = realloc(buf, cap *= 2);
      if (!bigger) free(buf);
      buf = bigger;
    }
  }
  return buf;
}

static void print_mask(const char *text, size_t len, const int32_t *ids, const uint8_t *mask,
                       size_t n) {
  fputs("{\"text\": ", stdout);
  chat_cli_json_string(stdout, text, len);
  fputs(", \"ids\": [", stdout);
  for (size_t i = 0; i < n; i++) printf(i ? ", %d" : "%d", ids[i]);
  fputs("], \"loss_mask\": [", stdout);
  for (size_t i = 0; i < n; i++) printf(i ? ", %d" : "%d", mask[i]);
  fputs("]}\n", stdout);
}

/* Tokenize + mask the rendered text and print the JSON object. */
static dflash_status encode_and_print(const render_args *a, const dflash_chat_rendered *r,
                                      const dflash_tokenizer *tok) {
  size_t len, n = 0;
  const char *text = dflash_chat_rendered_text(r, &len);
  size_t cap = dflash_tokenizer_max_ids(tok, len);
  int32_t *ids = malloc((cap ? cap : 1) * sizeof *ids);
  uint8_t *mask = malloc(cap ? cap : 1);
  dflash_status st = ids && mask ? DFLASH_OK : DFLASH_E_NOMEM;
  if (!st)
    st = dflash_chat_encode(r, tok, a->last_only ? DFLASH_CHAT_TURNS_LAST : DFLASH_CHAT_TURNS_ALL,
                            ids, mask, cap, &n, NULL);
  if (!st) print_mask(text, len, ids, mask, n);
  free(ids);
  free(mask);
  return st;
}

int cmd_render(int argc, char **argv) {
  render_args a;
  if (argc >= 2 && !strcmp(argv[1], "--help")) return usage(stdout, 0);
  if (parse_args(argc, argv, &a)) return usage(stderr, 2);
  dflash_chat_template *tmpl = NULL;
  dflash_tokenizer *tok = NULL;
  dflash_chat_rendered *r = NULL;
  int nfc = 0;
  size_t len;
  char *json = read_stdin(&len);
  dflash_status st = json ? DFLASH_OK : DFLASH_E_NOMEM;
  if (!st) st = dflash_chat_template_create(a.tmpl_name, &tmpl);
  if (!st && a.tok_path) st = dflash_tokenizer_load(a.tok_path, NULL, &tok);
  if (!st && tok) st = dflash_chat_tokenizer_nfc(tok, &nfc);
  if (!st) st = chat_cli_render(tmpl, json, len, nfc, &a.o, &r);
  if (!st && a.mask) st = encode_and_print(&a, r, tok);
  else if (!st) {
    const char *text = dflash_chat_rendered_text(r, &len);
    fwrite(text, 1, len, stdout);
  }
  dflash_chat_rendered_free(r);
  dflash_tokenizer_free(tok);
  dflash_chat_template_free(tmpl);
  free(json);
  return st ? cli_fail("render", st) : 0;
}
