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

static const char USAGE[] =
    "usage: dflash render --template NAME [--tokenizer PATH] [--mask] [--last-turn-only]\n"
    "                     [--generation-prompt] [--no-thinking] [--preserve-thinking]\n"
    "                     [--reasoning official|keep_all|keep_after_last_user|drop]\n"
    "Reads one conversation (JSON) on stdin and prints the rendered text. With --mask\n"
    "(needs --tokenizer) prints {\"text\", \"ids\", \"loss_mask\"} instead. With a tokenizer\n"
    "that normalises (NFC), the conversation is normalised first, so text and ids\n"
    "match. Default reasoning: official (what the template renders); with --mask\n"
    "keep_after_last_user, as `dflash tokenize` stores it.\n"
    "Exit status: 0 rendered; 1 an error (message on stderr); 2 a usage error.\n";

static int parse_args(int argc, char **argv, render_args *a) {
  memset(a, 0, sizeof *a);
  dflash_chat_options_default(&a->o);
  a->o.reasoning = (dflash_chat_reasoning)-1; /* not given */
  int gen = 0, no_thinking = 0, preserve = 0;
  const cli_opt opts[] = {{"--template", CLI_STR, &a->tmpl_name, 0, 0, NULL},
                          {"--tokenizer", CLI_STR, &a->tok_path, 0, 0, NULL},
                          {"--mask", CLI_FLAG, &a->mask, 0, 0, NULL},
                          {"--last-turn-only", CLI_FLAG, &a->last_only, 0, 0, NULL},
                          {"--generation-prompt", CLI_FLAG, &gen, 0, 0, NULL},
                          {"--no-thinking", CLI_FLAG, &no_thinking, 0, 0, NULL},
                          {"--preserve-thinking", CLI_FLAG, &preserve, 0, 0, NULL},
                          {"--reasoning", CLI_FN, &a->o.reasoning, 0, 0, chat_cli_reasoning_opt},
                          {NULL, 0, NULL, 0, 0, NULL}};
  int n_pos;
  int rc = cli_parse("render", USAGE, opts, argc, argv, NULL, 0, &n_pos);
  if (rc == 1) chat_cli_list_templates(stdout);
  if (rc) return rc == 1 ? -1 : rc;
  a->o.add_generation_prompt = gen;
  if (no_thinking) a->o.thinking = 0;
  a->o.preserve_thinking = preserve;
  /* --mask shows what `dflash tokenize` stores: its reasoning default too. */
  if ((int)a->o.reasoning < 0)
    a->o.reasoning = a->mask ? DFLASH_CHAT_REASONING_KEEP_AFTER_LAST_USER
                             : DFLASH_CHAT_REASONING_OFFICIAL;
  if (!a->tmpl_name) return cli_missing("render", "--template");
  if (a->mask && !a->tok_path) return cli_missing("render", "--tokenizer (for --mask)");
  return 0;
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
  int rc = parse_args(argc, argv, &a);
  if (rc) return rc < 0 ? 0 : rc;
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
