/* Rendered text -> token ids + loss mask, through the tokenizer's public API. */
#include <dflash/tokenizer.h>
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

/* Token byte ranges from the tokens' byte lengths; checks they spell `text`. */
static dflash_status token_ranges(const dflash_tokenizer *tok, const int32_t *ids, size_t n,
                                  const char *text, size_t len, uint32_t *begin, uint32_t *end) {
  size_t pos = 0;
  for (size_t i = 0; i < n; i++) {
    const char *bytes;
    size_t blen;
    dflash_status st = dflash_tokenizer_id_to_token(tok, ids[i], &bytes, &blen, NULL);
    if (st) return df_error_wrap(st, "token %zu", i);
    if (pos + blen > len || memcmp(text + pos, bytes, blen) != 0)
      return df_error(DFLASH_E_MISMATCH,
                      "token %zu (id %d) does not match the rendered text at byte %zu: the "
                      "tokenizer changed the text (normalisation or invalid UTF-8)",
                      i, ids[i], pos);
    begin[i] = (uint32_t)pos;
    pos += blen;
    end[i] = (uint32_t)pos;
  }
  if (pos != len)
    return df_error(DFLASH_E_MISMATCH, "tokens cover %zu of %zu rendered bytes", pos, len);
  return DFLASH_OK;
}

dflash_status dflash_chat_encode(const dflash_chat_rendered *r, const dflash_tokenizer *tok,
                                 dflash_chat_turns turns, int32_t *ids, uint8_t *mask, size_t cap,
                                 size_t *n, size_t *n_supervised) {
  DF_CHECK_ARG(r && tok && n && (cap == 0 || (ids && mask)));
  size_t len;
  const char *text = dflash_chat_rendered_text(r, &len);
  if (len > UINT32_MAX) return df_error(DFLASH_E_RANGE, "rendered text of %zu bytes", len);
  dflash_status st = dflash_tokenizer_encode(tok, text, len, DFLASH_SPECIAL_ALL, ids, cap, n);
  if (st) return st;
  uint32_t *begin = malloc((*n ? *n : 1) * sizeof *begin);
  uint32_t *end = malloc((*n ? *n : 1) * sizeof *end);
  if (!begin || !end) st = df_error_nomem("token offsets");
  if (!st) st = token_ranges(tok, ids, *n, text, len, begin, end);
  if (!st) st = dflash_chat_loss_mask(r, begin, end, *n, turns, mask, n_supervised);
  free(begin);
  free(end);
  return st;
}

dflash_status dflash_chat_template_check_tokenizer(const dflash_chat_template *tmpl,
                                                   const dflash_tokenizer *tok) {
  DF_CHECK_ARG(tmpl && tok);
  df_buf split = {0};
  dflash_status st = DFLASH_OK;
  for (const char *const *c = tmpl->controls; c && *c && !st; c++) {
    int32_t ids[64];
    size_t n = 0;
    st = dflash_tokenizer_encode(tok, *c, strlen(*c), DFLASH_SPECIAL_ALL, ids, 64, &n);
    if (!st && n != 1) df_buf_printf(&split, "%s%s (%zu ids)", split.len ? ", " : "", *c, n);
  }
  if (!st && split.len)
    st = df_error(DFLASH_E_MISMATCH,
                  "template %s: the tokenizer splits its control tokens: %s; "
                  "is this the target's own tokenizer?",
                  tmpl->name, split.data);
  df_buf_free(&split);
  return st;
}
