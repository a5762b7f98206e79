/* Renders a conversation with a built-in chat template, tokenizes it and
 * builds the loss mask: prints each token, marking the supervised ones (the
 * bytes the target generates), and checks that the supervised tokens spell
 * exactly the assistant's answer plus the template's end-of-turn token.
 * usage: render_mask TEMPLATE TOKENIZER_PATH    (exit 77 when the path is absent) */
#include <dflash/chat.h>
#include <dflash/tokenizer.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char CONVERSATION[] =
    "{\"messages\": [{\"role\": \"user\", \"content\": \"What is 6 x 7?\"},"
    " {\"role\": \"assistant\", \"content\": \"6 x 7 = 42.\"}]}";
static const char ANSWER[] = "6 x 7 = 42.";

static int fail(dflash_status st) {
  fprintf(stderr, "error: %s: %s\n", dflash_status_str(st), dflash_last_error());
  return 1;
}

/* Append the bytes of the supervised tokens to `buf` (capacity cap). */
static dflash_status supervised_bytes(const dflash_tokenizer *tok, const int32_t *ids,
                                      const uint8_t *mask, size_t n, char *buf, size_t cap,
                                      size_t *len) {
  *len = 0;
  for (size_t i = 0; i < n; i++) {
    const char *b;
    size_t bl;
    dflash_status st = dflash_tokenizer_id_to_token(tok, ids[i], &b, &bl, NULL);
    if (st) return st;
    printf("%s%.*s%s", mask[i] ? "[" : "", (int)bl, b, mask[i] ? "]" : "");
    if (mask[i] && *len + bl <= cap) memcpy(buf + *len, b, bl), *len += bl;
  }
  printf("\n");
  return DFLASH_OK;
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s TEMPLATE TOKENIZER_PATH\n", argv[0]);
    return 2;
  }
  struct stat sb;
  if (stat(argv[2], &sb) != 0) {
    printf("skip: no tokenizer at %s\n", argv[2]);
    return 77;
  }
  dflash_chat_template *tmpl = NULL;
  dflash_tokenizer *tok = NULL;
  dflash_chat_rendered *r = NULL;
  int32_t *ids = NULL;
  uint8_t *mask = NULL;
  char got[256];
  size_t n = 0, n_sup = 0, got_len = 0, text_len = 0;
  dflash_status st = dflash_chat_template_create(argv[1], &tmpl);
  if (!st) st = dflash_tokenizer_load(argv[2], NULL, &tok);
  if (!st) st = dflash_chat_render_json(tmpl, CONVERSATION, strlen(CONVERSATION), NULL, &r);
  if (!st) {
    printf("%s", dflash_chat_rendered_text(r, &text_len));
    size_t cap = dflash_tokenizer_max_ids(tok, text_len);
    ids = malloc(cap * sizeof *ids);
    mask = malloc(cap);
    st = ids && mask ? dflash_chat_encode(r, tok, DFLASH_CHAT_TURNS_ALL, ids, mask, cap, &n, &n_sup)
                     : DFLASH_E_NOMEM;
  }
  if (!st) st = supervised_bytes(tok, ids, mask, n, got, sizeof got, &got_len);
  int bad = 0;
  if (!st) {
    char want[256];
    int wl = snprintf(want, sizeof want, "%s%s", ANSWER, dflash_chat_template_end_of_turn(tmpl));
    bad = (size_t)wl != got_len || memcmp(want, got, got_len) != 0;
    printf("%zu tokens, %zu supervised: %s\n", n, n_sup,
           bad ? "NOT the answer + end of turn" : "exactly the answer + end of turn");
  }
  free(ids);
  free(mask);
  dflash_chat_rendered_free(r);
  dflash_tokenizer_free(tok);
  dflash_chat_template_free(tmpl);
  return st ? fail(st) : bad;
}
