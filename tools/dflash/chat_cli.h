/* Helpers shared by the chat subcommands (`tokenize`, `render`). */
#ifndef DFLASH_TOOLS_CHAT_CLI_H
#define DFLASH_TOOLS_CHAT_CLI_H

#include <dflash/chat.h>
#include <stdio.h>
#include <string.h>

/* --reasoning NAME (dflash_chat_reasoning_from_name) as a cli_opt CLI_FN. */
static inline int chat_cli_reasoning_opt(const char *s, void *dst) {
  return dflash_chat_reasoning_from_name(s, (dflash_chat_reasoning *)dst) ? -1 : 0;
}

/* "Templates: kimi-k2, ..." from the library's registry. */
static inline void chat_cli_list_templates(FILE *f) {
  fputs("Templates:", f);
  const char *name;
  for (size_t i = 0; (name = dflash_chat_template_name_at(i)); i++)
    fprintf(f, "%s %s", i ? "," : "", name);
  fputc('\n', f);
}

/* Write `n` bytes as a JSON string literal (UTF-8 passes through). */
static inline void chat_cli_json_string(FILE *f, const char *s, size_t n) {
  fputc('"', f);
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c == '\n') fputs("\\n", f);
    else if (c < 0x20 || c == 0x7f) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

/* Parse, NFC-normalise when the tokenizer does (`nfc`), and render. */
static inline dflash_status chat_cli_render(const dflash_chat_template *tmpl, const char *json,
                                            size_t len, int nfc, const dflash_chat_options *o,
                                            dflash_chat_rendered **out) {
  dflash_chat_conversation *conv;
  dflash_status st = dflash_chat_conversation_parse(json, len, &conv);
  if (!st && nfc) st = dflash_chat_conversation_normalize_nfc(conv);
  if (!st) st = dflash_chat_render(tmpl, conv, o, out);
  dflash_chat_conversation_free(conv);
  return st;
}

#endif
