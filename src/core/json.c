/* JSON through jansson, with error messages that name the input. */
#include <string.h>

#include "internal.h"

#include <jansson.h>
#include <stdlib.h>

dflash_status df_json_parse(const char *text, size_t len, const char *what, json_t **out) {
  json_error_t err;
  /* Duplicate keys are ambiguous (which one wins differs between parsers), so refuse them. */
  json_t *j = json_loadb(text, len, JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL, &err);
  if (!j) {
    dflash_status st = DFLASH_E_JSON;
    if (json_error_code(&err) == json_error_out_of_memory) return df_error_nomem(what);
    if (json_error_code(&err) == json_error_duplicate_key) st = DFLASH_E_DUPLICATE;
    else if (json_error_code(&err) == json_error_invalid_utf8) st = DFLASH_E_UTF8;
    /* One-line texts (JSONL records) are named by their file and line in `what`: a "line 1"
     * here would contradict it. */
    if (err.line <= 1 && !memchr(text, '\n', len ? len - 1 : 0))
      return df_error(st, "%s: invalid JSON at column %d: %s", what, err.column, err.text);
    return df_error(st, "%s: invalid JSON at line %d, column %d: %s", what, err.line, err.column,
                    err.text);
  }
  *out = j;
  return DFLASH_OK;
}

dflash_status df_json_load_file(const char *path, json_t **out) {
  char *text;
  size_t len;
  dflash_status st = df_read_file(path, &text, &len);
  if (st) return st;
  st = df_json_parse(text, len, path, out);
  free(text);
  return st;
}

dflash_status df_json_dump(const json_t *json, int indent, char **out) {
  size_t flags = (indent > 0 ? JSON_INDENT(indent) : JSON_COMPACT);
  char *s = json_dumps(json, flags);
  if (!s) return df_error_nomem("JSON text");
  *out = s;
  return DFLASH_OK;
}
