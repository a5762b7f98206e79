/*
 * Hugging Face byte-level BPE: tokenizer.json, or vocab.json + merges.txt
 * with added_tokens.json / tokenizer_config.json.
 */
#include <jansson.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

/* GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves,
 * the other 68 take code points 256, 257, ... in byte order. */
uint32_t df_byte_to_char(uint8_t b) {
  if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE)) return b;
  uint32_t n = 0;
  for (uint32_t x = 0; x < b; x++)
    if (!((x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE))) n++;
  return 256 + n;
}

static int16_t g_char_byte[324]; /* byte-level character -> byte, -1 if none */
static pthread_once_t g_char_byte_once = PTHREAD_ONCE_INIT;

static void char_byte_init(void) {
  for (size_t i = 0; i < DF_ARRAY_LEN(g_char_byte); i++) g_char_byte[i] = -1;
  for (int b = 0; b < 256; b++) g_char_byte[df_byte_to_char((uint8_t)b)] = (int16_t)b;
}

static int char_to_byte(uint32_t c) {
  pthread_once(&g_char_byte_once, char_byte_init);
  return c < DF_ARRAY_LEN(g_char_byte) ? g_char_byte[c] : -1;
}

dflash_status df_bytelevel_decode(const char *s, size_t len, df_buf *out) {
  out->len = 0;
  if (df_buf_reserve(out, len)) return DFLASH_E_NOMEM;
  for (size_t i = 0; i < len;) {
    int b = char_to_byte(df_utf8_next((const uint8_t *)s, &i));
    if (b < 0) { /* not byte-level: the token is its own UTF-8 (HF's decoder does this) */
      out->len = 0;
      return df_buf_append(out, s, len);
    }
    out->data[out->len++] = (char)b;
  }
  return DFLASH_OK;
}

/* ---- vocabulary and merges --------------------------------------------------- */

static uint32_t max_id(json_t *vocab, json_t *added_ids) {
  uint32_t top = 0;
  const char *k;
  json_t *v;
  json_object_foreach(vocab, k, v) {
    json_int_t id = json_integer_value(v);
    if (id >= 0 && (uint64_t)id + 1 > top && id < INT32_MAX) top = (uint32_t)id + 1;
  }
  size_t i;
  json_array_foreach(added_ids, i, v) {
    json_int_t id = json_integer_value(v);
    if (id >= 0 && (uint64_t)id + 1 > top && id < INT32_MAX) top = (uint32_t)id + 1;
  }
  return top;
}

static dflash_status fill_vocab(dflash_tokenizer *t, json_t *vocab, json_t *added_ids,
                                const char *what) {
  if (!json_is_object(vocab))
    return df_error(DFLASH_E_FORMAT, "%s: the vocabulary is not a JSON object", what);
  dflash_status st = df_vocab_init(&t->vocab, max_id(vocab, added_ids));
  if (st) return st;
  df_buf bytes = {0};
  const char *k;
  json_t *v;
  json_object_foreach(vocab, k, v) {
    json_int_t id = json_integer_value(v);
    if (!json_is_integer(v) || id < 0 || id >= INT32_MAX) {
      st = df_error(DFLASH_E_FORMAT, "%s: vocabulary entry \"%s\" has no valid id", what, k);
      break;
    }
    if ((st = df_bytelevel_decode(k, strlen(k), &bytes))) break;
    st = df_vocab_set(&t->vocab, (uint32_t)id, bytes.data, bytes.len, DF_TOK_ORDINARY);
    if (st) {
      st = df_error_wrap(st, "%s: vocabulary entry \"%s\"", what, k);
      break;
    }
  }
  df_buf_free(&bytes);
  if (!st) st = df_vocab_index(&t->vocab, false, what);
  return st;
}

/* Add one merge "a b" of rank `rank`; `where` names it in errors. */
static dflash_status add_merge(dflash_tokenizer *t, json_t *vocab, const char *a, size_t alen,
                               const char *b, size_t blen, uint32_t rank, const char *where) {
  char *ab = malloc(alen + blen + 1);
  if (!ab) return df_error_nomem("merges");
  memcpy(ab, a, alen);
  memcpy(ab + alen, b, blen);
  ab[alen + blen] = '\0';
  json_t *ja = json_object_getn(vocab, a, alen), *jb = json_object_getn(vocab, b, blen);
  json_t *jab = json_object_get(vocab, ab);
  dflash_status st = DFLASH_OK;
  if (!ja || !jb || !jab) {
    const char *missing = !ja ? a : !jb ? b : ab;
    size_t mlen = !ja ? alen : !jb ? blen : alen + blen;
    st = df_error(DFLASH_E_FORMAT,
                  "%s: merge \"%.*s %.*s\": token \"%.*s\" is not in the vocabulary", where,
                  (int)alen, a, (int)blen, b, (int)mlen, missing);
  }
  if (!st)
    st = df_pairmap_put(&t->pairs, (uint32_t)json_integer_value(ja),
                        (uint32_t)json_integer_value(jb), rank, (uint32_t)json_integer_value(jab));
  free(ab);
  return st;
}

/* HF ranks are merge indices; the merged id of each rank lives in a table. */
static dflash_status merged_table(df_pairmap *m, size_t n) {
  m->merged_of_rank = malloc((n ? n : 1) * sizeof *m->merged_of_rank);
  if (!m->merged_of_rank) return df_error_nomem("merges");
  for (size_t r = 0; r < n; r++) m->merged_of_rank[r] = DF_PAIR_NO_MERGE; /* lines, not merges */
  m->n_ranks = n;
  return DFLASH_OK;
}

static dflash_status merges_from_json(dflash_tokenizer *t, json_t *vocab, json_t *merges,
                                      const char *what) {
  if (!json_is_array(merges))
    return df_error(DFLASH_E_FORMAT, "%s: model.merges is not an array", what);
  dflash_status st = df_pairmap_init(&t->pairs, json_array_size(merges));
  if (!st) st = merged_table(&t->pairs, json_array_size(merges));
  size_t i;
  json_t *m;
  json_array_foreach(merges, i, m) {
    if (st) break;
    char where[64];
    snprintf(where, sizeof where, "%s merges[%zu]", what, i);
    const char *s = json_string_value(m);
    if (s) { /* "a b" */
      const char *sp = strchr(s, ' ');
      if (!sp || strchr(sp + 1, ' '))
        return df_error(DFLASH_E_FORMAT, "%s: \"%s\" is not two tokens", where, s);
      st = add_merge(t, vocab, s, (size_t)(sp - s), sp + 1, strlen(sp + 1), (uint32_t)i, where);
    } else if (json_is_array(m) && json_array_size(m) == 2 &&
               json_is_string(json_array_get(m, 0)) && json_is_string(json_array_get(m, 1))) {
      json_t *a = json_array_get(m, 0), *b = json_array_get(m, 1);
      st = add_merge(t, vocab, json_string_value(a), json_string_length(a), json_string_value(b),
                     json_string_length(b), (uint32_t)i, where);
    } else {
      st = df_error(DFLASH_E_FORMAT, "%s: neither \"a b\" nor [a, b]", where);
    }
  }
  return st ? st : df_pairmap_compact(&t->pairs);
}

static dflash_status merges_from_txt(dflash_tokenizer *t, json_t *vocab, const char *path) {
  char *text;
  size_t len;
  dflash_status st = df_read_file(path, &text, &len);
  if (st) return st;
  size_t lines = 1;
  for (size_t i = 0; i < len; i++) lines += text[i] == '\n';
  st = df_pairmap_init(&t->pairs, lines);
  if (!st) st = merged_table(&t->pairs, lines);
  uint32_t rank = 0, line_no = 0;
  for (char *p = text, *end = text + len; p < end && !st;) {
    char *nl = memchr(p, '\n', (size_t)(end - p)), *eol = nl ? nl : end, *q = p;
    p = nl ? nl + 1 : end;
    line_no++;
    if (eol > q && eol[-1] == '\r') eol--;
    if (eol == q || (line_no == 1 && !strncmp(q, "#version", 8))) continue;
    char *sp = memchr(q, ' ', (size_t)(eol - q));
    char where[64 + 4096];
    snprintf(where, sizeof where, "%s:%u", path, line_no);
    if (!sp || memchr(sp + 1, ' ', (size_t)(eol - sp - 1))) {
      st = df_error(DFLASH_E_FORMAT, "%s: \"%.*s\" is not two tokens", where, (int)(eol - q), q);
      break;
    }
    st = add_merge(t, vocab, q, (size_t)(sp - q), sp + 1, (size_t)(eol - sp - 1), rank++, where);
  }
  free(text);
  return st ? st : df_pairmap_compact(&t->pairs);
}

/* ---- added tokens ------------------------------------------------------------- */

static bool flag(json_t *o, const char *key, bool dflt) {
  json_t *v = json_object_get(o, key);
  return v ? json_is_true(v) : dflt;
}

/* An added token from its JSON description (content + flags). */
static dflash_status add_token_json(dflash_tokenizer *t, uint32_t id, json_t *o, bool dflt_special,
                                    const char *what) {
  const char *content = json_string_value(json_object_get(o, "content"));
  if (!content) return df_error(DFLASH_E_FORMAT, "%s: added token %u has no content", what, id);
  if (flag(o, "single_word", false))
    return df_error(DFLASH_E_UNSUPPORTED, "%s: added token \"%s\" uses single_word", what, content);
  size_t len = strlen(content);
  if (!len) return df_error(DFLASH_E_FORMAT, "%s: added token %u is empty", what, id);
  if (id >= t->vocab.n_ids) return df_error(DFLASH_E_RANGE, "%s: added token id %u", what, id);
  bool special = flag(o, "special", dflt_special);
  if (t->vocab.kind[id] != DF_TOK_NONE) {
    /* Also in the model vocabulary (GPT-2's <|endoftext|>): fine if the bytes agree. */
    if (t->vocab.len[id] != len || memcmp(t->vocab.blob.data + t->vocab.off[id], content, len))
      return df_error(DFLASH_E_DUPLICATE, "%s: added token \"%s\" reuses id %u of another token",
                      what, content, id);
  } else {
    dflash_status st = df_vocab_set(&t->vocab, id, content, len,
                                    special ? DF_TOK_SPECIAL : DF_TOK_ADDED);
    if (st) return st;
  }
  for (size_t k = 0; k < t->n_added; k++)
    if (t->added[k].id == id) return DFLASH_OK; /* declared twice (config + added_tokens.json) */
  dflash_status st = df_tok_add_added(t, content, len, id, special);
  if (st) return st;
  df_added *a = &t->added[t->n_added - 1];
  a->lstrip = flag(o, "lstrip", false);
  a->rstrip = flag(o, "rstrip", false);
  /* HF: special tokens default to normalized=false, others to true. */
  a->normalized = flag(o, "normalized", !special) && t->nfc;
  return DFLASH_OK;
}

/* ---- normalizer and pre-tokenizer ----------------------------------------------- */

static dflash_status parse_normalizer(dflash_tokenizer *t, json_t *n, const char *what) {
  if (!n || json_is_null(n)) return DFLASH_OK;
  const char *type = json_string_value(json_object_get(n, "type"));
  if (type && !strcmp(type, "NFC")) {
    t->nfc = true;
    return DFLASH_OK;
  }
  if (type && !strcmp(type, "Sequence")) {
    json_t *list = json_object_get(n, "normalizers"), *e;
    size_t i;
    json_array_foreach(list, i, e) {
      dflash_status st = parse_normalizer(t, e, what);
      if (st) return st;
    }
    return DFLASH_OK;
  }
  return df_error(DFLASH_E_UNSUPPORTED, "%s: normalizer \"%s\" is not supported (only NFC)", what,
                  type ? type : "?");
}

static dflash_status parse_behavior(const char *b, df_split_behavior *out, const char *what) {
  static const struct {
    const char *name;
    df_split_behavior v;
  } names[] = {{"Isolated", DF_SPLIT_ISOLATED},
               {"Removed", DF_SPLIT_REMOVED},
               {"MergedWithPrevious", DF_SPLIT_MERGED_PREV},
               {"MergedWithNext", DF_SPLIT_MERGED_NEXT},
               {"Contiguous", DF_SPLIT_CONTIGUOUS}};
  for (size_t i = 0; b && i < DF_ARRAY_LEN(names); i++)
    if (!strcmp(b, names[i].name)) {
      *out = names[i].v;
      return DFLASH_OK;
    }
  return df_error(DFLASH_E_UNSUPPORTED, "%s: Split behavior \"%s\" is unknown", what, b ? b : "?");
}

static dflash_status parse_pretok(dflash_tokenizer *t, json_t *p, const char *what,
                                  bool *byte_level) {
  const char *type = json_string_value(json_object_get(p, "type"));
  if (!type) return df_error(DFLASH_E_FORMAT, "%s: pre_tokenizer without a type", what);
  if (!strcmp(type, "Sequence")) {
    json_t *list = json_object_get(p, "pretokenizers"), *e;
    size_t i;
    json_array_foreach(list, i, e) {
      dflash_status st = parse_pretok(t, e, what, byte_level);
      if (st) return st;
    }
    return DFLASH_OK;
  }
  if (!strcmp(type, "Split")) {
    json_t *pat = json_object_get(p, "pattern");
    const char *rx = json_string_value(json_object_get(pat, "Regex"));
    const char *lit = json_string_value(json_object_get(pat, "String"));
    if (!rx && !lit) return df_error(DFLASH_E_FORMAT, "%s: Split without a pattern", what);
    df_split_behavior b = DF_SPLIT_ISOLATED;
    dflash_status st = parse_behavior(json_string_value(json_object_get(p, "behavior")), &b, what);
    if (!st)
      st = df_pretok_add_regex(&t->pretok, rx ? rx : lit, !rx, b, flag(p, "invert", false), true,
                               NULL);
    return st ? df_error_wrap(st, "%s: Split pre-tokenizer", what) : DFLASH_OK;
  }
  if (!strcmp(type, "ByteLevel")) {
    *byte_level = true;
    if (flag(p, "add_prefix_space", false)) {
      df_pretok_step step = {.kind = DF_STEP_PREFIX_SPACE};
      dflash_status st = df_pretok_add_step(&t->pretok, step);
      if (st) return st;
    }
    if (!flag(p, "use_regex", true)) return DFLASH_OK;
    return df_pretok_add_regex(&t->pretok, "gpt2", false, DF_SPLIT_ISOLATED, false, true, NULL);
  }
  if (!strcmp(type, "Digits")) {
    const char *rx = flag(p, "individual_digits", false) ? "\\p{N}" : "\\p{N}+";
    return df_pretok_add_regex(&t->pretok, rx, false, DF_SPLIT_ISOLATED, false, true, NULL);
  }
  return df_error(DFLASH_E_UNSUPPORTED, "%s: pre-tokenizer \"%s\" is not supported", what, type);
}

static dflash_status check_model(json_t *model, const char *what) {
  const char *type = json_string_value(json_object_get(model, "type"));
  if (!json_is_object(model)) return df_error(DFLASH_E_FORMAT, "%s: no \"model\" object", what);
  if (type && strcmp(type, "BPE"))
    return df_error(DFLASH_E_UNSUPPORTED, "%s: model type \"%s\" is not supported (only BPE)", what,
                    type);
  json_t *dropout = json_object_get(model, "dropout");
  if (dropout && !json_is_null(dropout) && json_number_value(dropout) != 0.0)
    return df_error(DFLASH_E_UNSUPPORTED, "%s: BPE dropout is not supported", what);
  static const char *const empty_keys[] = {"continuing_subword_prefix", "end_of_word_suffix"};
  for (size_t i = 0; i < DF_ARRAY_LEN(empty_keys); i++) {
    const char *s = json_string_value(json_object_get(model, empty_keys[i]));
    if (s && *s)
      return df_error(DFLASH_E_UNSUPPORTED, "%s: BPE %s \"%s\" is not supported", what,
                      empty_keys[i], s);
  }
  if (flag(model, "byte_fallback", false))
    return df_error(DFLASH_E_UNSUPPORTED,
                    "%s: BPE byte_fallback is not supported (byte-level only)", what);
  return DFLASH_OK;
}

dflash_status df_load_hf_doc(dflash_tokenizer *t, json_t *doc, const char *path,
                             const char *pattern) {
  json_t *model = json_object_get(doc, "model");
  dflash_status st = check_model(model, path);
  json_t *added = json_object_get(doc, "added_tokens"), *ids = json_array(), *e;
  size_t i;
  /* The vocabulary's size counts the added ids: one lost here would make a later one "out of
   * range". */
  if (!st && !ids) st = df_error_nomem("added token ids");
  json_array_foreach(added, i, e) {
    json_t *id = json_object_get(e, "id"); /* none: refused below */
    if (!st && id && json_array_append(ids, id)) st = df_error_nomem("added token ids");
  }
  if (!st) st = fill_vocab(t, json_object_get(model, "vocab"), ids, path);
  json_decref(ids);
  if (!st)
    st = merges_from_json(t, json_object_get(model, "vocab"), json_object_get(model, "merges"),
                          path);
  if (!st) st = parse_normalizer(t, json_object_get(doc, "normalizer"), path);
  bool byte_level = false;
  json_t *pre = json_object_get(doc, "pre_tokenizer");
  if (!st && pattern) {
    st = df_pretok_add_regex(&t->pretok, pattern, false, DF_SPLIT_ISOLATED, false, true, &t->nfc);
    byte_level = true;
  } else if (!st && pre && !json_is_null(pre)) {
    st = parse_pretok(t, pre, path, &byte_level);
  }
  json_t *dec = json_object_get(doc, "decoder");
  const char *dec_type = json_string_value(json_object_get(dec, "type"));
  if (dec_type && !strcmp(dec_type, "ByteLevel")) byte_level = true;
  if (!st && !byte_level)
    st = df_error(DFLASH_E_UNSUPPORTED,
                  "%s: not a byte-level BPE (no ByteLevel pre-tokenizer or "
                  "decoder)",
                  path);
  json_array_foreach(added, i, e) {
    if (st) break;
    json_int_t id = json_integer_value(json_object_get(e, "id"));
    if (!json_is_integer(json_object_get(e, "id")) || id < 0 || id >= INT32_MAX)
      st = df_error(DFLASH_E_FORMAT, "%s: added_tokens[%zu] has no valid id", path, i);
    else st = add_token_json(t, (uint32_t)id, e, false, path);
  }
  t->family = DF_FAMILY_HF;
  t->whole_piece_lookup = flag(model, "ignore_merges", false);
  return st;
}

dflash_status df_load_hf_json(dflash_tokenizer *t, const char *path, const char *pattern) {
  json_t *doc;
  dflash_status st = df_json_load_file(path, &doc);
  if (st) return st;
  if (!json_is_object(doc)) st = df_error(DFLASH_E_FORMAT, "%s: not a JSON object", path);
  else if (!json_object_get(doc, "model"))
    st = df_error(DFLASH_E_FORMAT, "%s: no \"model\": not a tokenizer.json", path);
  else st = df_load_hf_doc(t, doc, path, pattern);
  json_decref(doc);
  return st;
}

/* ---- vocab.json + merges.txt ------------------------------------------------------ */

/* Added tokens of a transformers directory: tokenizer_config.json's
 * added_tokens_decoder, then added_tokens.json. */
static dflash_status dir_added_tokens(dflash_tokenizer *t, json_t *cfg, json_t *extra,
                                      const char *cfg_path, const char *extra_path) {
  json_t *dec = json_object_get(cfg, "added_tokens_decoder"), *e;
  const char *key;
  json_object_foreach(dec, key, e) {
    char *endp;
    unsigned long id = strtoul(key, &endp, 10);
    if (*endp || id >= INT32_MAX)
      return df_error(DFLASH_E_FORMAT, "%s: added_tokens_decoder key \"%s\" is not an id", cfg_path,
                      key);
    dflash_status st = add_token_json(t, (uint32_t)id, e, true, cfg_path);
    if (st) return st;
  }
  json_object_foreach(extra, key, e) {
    json_int_t id = json_integer_value(e);
    if (!json_is_integer(e) || id < 0 || id >= INT32_MAX)
      return df_error(DFLASH_E_FORMAT, "%s: \"%s\" has no valid id", extra_path, key);
    json_t *o = json_pack("{s:s}", "content", key);
    dflash_status st = o ? add_token_json(t, (uint32_t)id, o, true, extra_path) : DFLASH_E_NOMEM;
    json_decref(o);
    if (st) return st;
  }
  return DFLASH_OK;
}

static json_t *added_ids(json_t *cfg, json_t *extra) {
  json_t *ids = json_array(), *e;
  const char *key;
  json_object_foreach(json_object_get(cfg, "added_tokens_decoder"), key, e)
      json_array_append_new(ids, json_integer(strtol(key, NULL, 10)));
  json_object_foreach(extra, key, e) json_array_append(ids, e);
  return ids;
}

static dflash_status load_optional_json(const char *dir, const char *name, json_t **out,
                                        char **path) {
  *out = NULL;
  *path = df_path_join(dir, name);
  if (!*path) return df_error_nomem("paths");
  FILE *f = fopen(*path, "rb");
  if (!f) return DFLASH_OK;
  fclose(f);
  return df_json_load_file(*path, out);
}

dflash_status df_load_vocab_merges(dflash_tokenizer *t, const char *vocab_path,
                                   const char *merges_path, const char *pattern) {
  char *dir = df_path_dirname(vocab_path), *cfg_path = NULL, *extra_path = NULL;
  json_t *vocab = NULL, *cfg = NULL, *extra = NULL;
  dflash_status st = dir ? df_json_load_file(vocab_path, &vocab) : df_error_nomem("paths");
  if (!st) st = load_optional_json(dir, "tokenizer_config.json", &cfg, &cfg_path);
  if (!st) st = load_optional_json(dir, "added_tokens.json", &extra, &extra_path);
  if (!st) {
    const char *cls = json_string_value(json_object_get(cfg, "tokenizer_class"));
    const char *pat = pattern ? pattern : cls && strstr(cls, "Qwen2") ? "qwen2" : "gpt2";
    st = df_pretok_add_regex(&t->pretok, pat, false, DF_SPLIT_ISOLATED, false, true, &t->nfc);
    if (!st && flag(cfg, "add_prefix_space", false)) {
      /* transformers puts ByteLevel(add_prefix_space) after the split */
      df_pretok_step step = {.kind = DF_STEP_PREFIX_SPACE};
      st = df_pretok_add_step(&t->pretok, step);
    }
  }
  json_t *ids = st ? NULL : added_ids(cfg, extra);
  if (!st) st = fill_vocab(t, vocab, ids, vocab_path);
  json_decref(ids);
  if (!st) st = merges_from_txt(t, vocab, merges_path);
  if (!st) st = dir_added_tokens(t, cfg, extra, cfg_path, extra_path);
  t->family = DF_FAMILY_HF;
  json_decref(vocab);
  json_decref(cfg);
  json_decref(extra);
  free(dir);
  free(cfg_path);
  free(extra_path);
  return st;
}
