/* Unicode NFC of a conversation's strings, for tokenizers that normalise
 * their input: rendering the normalised strings makes the spans refer to the
 * bytes the tokenizer actually sees, so token offsets stay byte-exact. */
#include <dflash/tokenizer.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

/* NFC of one JSON string value, in place (df_nfc: utf8proc on the spans that may change). */
static dflash_status nfc_string(json_t *v) {
  const char *s = json_string_value(v);
  size_t n = json_string_length(v);
  if (df_utf8_quick_nfc(s, n)) return DFLASH_OK;
  df_buf out = {0};
  bool changed;
  dflash_status st = df_nfc(s, n, &out, &changed);
  if (!st && changed && json_string_setn(v, out.data, out.len)) st = df_error_nomem("NFC string");
  df_buf_free(&out);
  return st;
}

static dflash_status nfc_tree(json_t *v);

/* Re-insert the members of `obj` under NFC keys, keeping their order. */
static dflash_status nfc_keys(json_t *obj) {
  size_t n = json_object_size(obj), k = 0;
  char **keys = calloc(n ? n : 1, sizeof *keys);
  json_t **vals = calloc(n ? n : 1, sizeof *vals);
  dflash_status st = (keys && vals) ? DFLASH_OK : df_error_nomem("NFC keys");
  bool changed = false;
  const char *key;
  json_t *val;
  json_object_foreach(obj, key, val) {
    if (st) break;
    json_t *s = json_string(key);
    st = s ? nfc_string(s) : df_error_nomem("NFC key");
    if (!st) {
      keys[k] = df_strdup(json_string_value(s));
      vals[k] = json_incref(val);
      if (!keys[k++]) st = df_error_nomem("NFC key");
      else changed |= strcmp(keys[k - 1], key) != 0;
    }
    json_decref(s);
  }
  if (!st && changed) {
    json_object_clear(obj);
    for (size_t i = 0; i < k && !st; i++) {
      if (json_object_get(obj, keys[i]))
        st = df_error(DFLASH_E_DUPLICATE, "key \"%s\" occurs twice once normalised to NFC",
                      keys[i]);
      else if (json_object_set(obj, keys[i], vals[i])) st = df_error_nomem("NFC key");
    }
  }
  for (size_t i = 0; i < k; i++) {
    free(keys[i]);
    json_decref(vals[i]);
  }
  free(keys);
  free(vals);
  return st;
}

static dflash_status nfc_tree(json_t *v) {
  dflash_status st = DFLASH_OK;
  if (json_is_string(v)) return nfc_string(v);
  if (json_is_array(v))
    for (size_t i = 0; i < json_array_size(v) && !st; i++) st = nfc_tree(json_array_get(v, i));
  if (json_is_object(v)) {
    const char *key;
    json_t *val;
    json_object_foreach(v, key, val) {
      if ((st = nfc_tree(val))) return st;
    }
    st = nfc_keys(v);
  }
  return st;
}

dflash_status dflash_chat_conversation_normalize_nfc(dflash_chat_conversation *conv) {
  DF_CHECK_ARG(conv);
  dflash_status st = nfc_tree(conv->root);
  /* The message views borrow the replaced strings: rebuild them. */
  if (!st) st = df_conv_build(conv);
  return st ? df_error_wrap(st, "conversation") : DFLASH_OK;
}

dflash_status dflash_chat_tokenizer_nfc(const struct dflash_tokenizer *tok, int32_t *nfc) {
  DF_CHECK_ARG(tok && nfc);
  /* "e" + COMBINING ACUTE ACCENT composes to U+00E9 under NFC and under no
   * other normalisation this tokenizer supports. */
  static const char probe[] = "e\xCC\x81";
  int32_t ids[16];
  char back[64];
  size_t n, len;
  dflash_status st = dflash_tokenizer_encode(tok, probe, 3, DFLASH_SPECIAL_NONE, ids, 16, &n);
  if (!st) st = dflash_tokenizer_decode(tok, ids, n, back, sizeof back, &len);
  if (st) return df_error_wrap(st, "probing the tokenizer's normalisation");
  *nfc = len == 2 && !memcmp(back, "\xC3\xA9", 2);
  return DFLASH_OK;
}
