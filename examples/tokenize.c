/* Encodes a text with a real tokenizer, prints the ids and the bytes of each
 * token, and decodes them back (the round trip must give the text again).
 * usage: tokenize TOKENIZER_PATH [TEXT]    (exit 77 when the path is absent) */
#include <dflash/tokenizer.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int fail(dflash_status st) {
  fprintf(stderr, "error: %s: %s\n", dflash_status_str(st), dflash_last_error());
  return 1;
}

int main(int argc, char **argv) {
  if (argc < 2 || argc > 3) {
    fprintf(stderr, "usage: %s TOKENIZER_PATH [TEXT]\n", argv[0]);
    return 2;
  }
  struct stat sb;
  if (stat(argv[1], &sb) != 0) {
    printf("skip: no tokenizer at %s\n", argv[1]);
    return 77;
  }
  const char *text = argc == 3 ? argv[2]
                               : "Hello, world! 12345 <|im_start|>user\nnaïve café ☕<|im_end|>";
  size_t len = strlen(text);
  dflash_tokenizer *tok;
  dflash_status st = dflash_tokenizer_load(argv[1], NULL, &tok);
  if (st) return fail(st);
  size_t cap = dflash_tokenizer_max_ids(tok, len), n = 0, out_len = 0;
  int32_t *ids = malloc(cap * sizeof *ids);
  char *back = malloc(len + 1);
  if (!ids || !back) st = DFLASH_E_NOMEM;
  if (!st) st = dflash_tokenizer_encode(tok, text, len, DFLASH_SPECIAL_ALL, ids, cap, &n);
  if (!st) {
    printf("vocabulary: %zu tokens\n%zu ids for %zu bytes:\n", dflash_tokenizer_vocab_size(tok), n,
           len);
    for (size_t i = 0; i < n && !st; i++) {
      const char *bytes;
      size_t blen;
      int special;
      st = dflash_tokenizer_id_to_token(tok, ids[i], &bytes, &blen, &special);
      if (!st) printf("  %6d %s\"%.*s\"\n", ids[i], special ? "special " : "", (int)blen, bytes);
    }
  }
  if (!st) st = dflash_tokenizer_decode(tok, ids, n, back, len, &out_len);
  int bad = !st && (out_len != len || memcmp(back, text, len) != 0);
  if (bad) fprintf(stderr, "round trip differs: got %zu bytes back\n", out_len);
  else if (!st) printf("decode(encode(text)) == text\n");
  free(ids);
  free(back);
  dflash_tokenizer_free(tok);
  return st ? fail(st) : bad;
}
