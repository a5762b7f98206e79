/* libFuzzer target: the tokenizer loaders on arbitrary bytes. The first byte picks the
 * format (tiktoken rank file, gzip'd or not, or tokenizer.json); whatever the input,
 * loading returns a status, and a tokenizer that loads encodes and decodes its own
 * input without crashing or leaking. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tok_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void exercise(dflash_tokenizer *t, const char *text, size_t len) {
  size_t cap = dflash_tokenizer_max_ids(t, len), n = 0;
  int32_t *ids = malloc(cap * sizeof *ids);
  if (!ids) return;
  if (dflash_tokenizer_encode(t, text, len, DFLASH_SPECIAL_ALL, ids, cap, &n) == DFLASH_OK) {
    size_t out_len = 0;
    dflash_status st = dflash_tokenizer_decode(t, ids, n, NULL, 0, &out_len);
    if (st != DFLASH_OK && st != DFLASH_E_BUFFER) __builtin_trap(); /* ids it made must decode */
  }
  free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  dflash_tokenizer *t = calloc(1, sizeof *t);
  if (!t) return 0;
  t->serial = df_tokenizer_serial();
  const char *body = (const char *)data + 1;
  size_t len = size - 1;
  dflash_status st;
  if (data[0] & 1) {
    json_t *doc = NULL;
    st = df_json_parse(body, len, "fuzz.json", &doc);
    if (!st) st = df_load_hf_doc(t, doc, "fuzz.json", NULL);
    json_decref(doc);
  } else {
    static const char *const patterns[] = {"cl100k", "o200k",   "kimi-k2",
                                           "qwen2",  "qwen3.5", "gpt2"};
    st = df_load_tiktoken_data(t, "fuzz.tiktoken", body, len, patterns[(data[0] >> 1) % 6], NULL,
                               NULL);
  }
  if (!st) st = df_tokenizer_finish(t);
  if (!st) exercise(t, body, len < 4096 ? len : 4096);
  dflash_tokenizer_free(t);
  return 0;
}
