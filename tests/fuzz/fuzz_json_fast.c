/* libFuzzer target: the fast conversation JSON parser (src/chat/json_fast.c) against
 * jansson, its reference, on arbitrary bytes. Checks, for every input:
 *  - whenever the fast parser accepts, jansson (json_loadb with JSON_REJECT_DUPLICATES |
 *    JSON_ALLOW_NUL, as the conversation parser's fallback calls it) accepts, and the
 *    two trees serialise to the same bytes (key order, integer/real kind and -0.0
 *    included);
 *  - whenever jansson accepts and the fast parser does not, the text holds a number
 *    token of 64 characters or more, the one case it leaves to jansson on purpose, or
 *    a NUL byte: jansson 2.14 drops a NUL that follows a number or a literal ("[1\0]"
 *    loads as [1]; its stream marks an empty look-ahead buffer with NUL, so a NUL it
 *    pushes back is lost), which the fast parser rightly refuses;
 *  - dflash_chat_conversation_parse, which goes fast path first and jansson second,
 *    accepts a document exactly when its tree is a conversation, never crashing. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "chat/chat_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const size_t FLAGS = JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL;

/* A run of 64+ number characters somewhere (strings included: a loose, safe bound). */
static bool long_number_run(const uint8_t *s, size_t n) {
  size_t run = 0;
  for (size_t i = 0; i < n; i++) {
    bool num = (s[i] >= '0' && s[i] <= '9') || s[i] == '-' || s[i] == '+' || s[i] == '.' ||
               s[i] == 'e' || s[i] == 'E';
    run = num ? run + 1 : 0;
    if (run >= 64) return true;
  }
  return false;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > 1 << 18) return 0;
  const char *text = (const char *)data;
  json_error_t err;
  json_t *ref = json_loadb(text, size, FLAGS, &err);
  json_t *fast = df_json_fast(text, size);
  if (fast) {
    if (!ref) __builtin_trap(); /* accepted what jansson refuses */
    char *a = json_dumps(ref, JSON_COMPACT | JSON_ENCODE_ANY);
    char *b = json_dumps(fast, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!a || !b || strcmp(a, b) || !json_equal(ref, fast)) __builtin_trap();
    free(a);
    free(b);
  } else if (ref && !long_number_run(data, size) && !memchr(data, 0, size)) {
    __builtin_trap(); /* left to jansson what it should have taken */
  }

  dflash_chat_conversation *conv = NULL;
  dflash_status st = dflash_chat_conversation_parse(text, size, &conv);
  if ((st == DFLASH_OK) != (conv != NULL)) __builtin_trap();
  /* jansson's verdict is final */
  if (!ref && st != DFLASH_E_JSON && st != DFLASH_E_DUPLICATE && st != DFLASH_E_UTF8)
    __builtin_trap();
  dflash_chat_conversation_free(conv);

  json_decref(ref);
  json_decref(fast);
  return 0;
}
