/*
 * tiktoken rank files: one `base64(bytes) rank` per line (gzip'd or not),
 * plus the special tokens that go with the encoding: OpenAI's for cl100k /
 * o200k, or Kimi's 256 slots after the ordinary tokens, named from
 * tokenizer_config.json's added_tokens_decoder.
 */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "tok_internal.h"

#define KIMI_SPECIAL_SLOTS 256

static dflash_status gunzip(const char *path, const char *data, size_t len, df_buf *out) {
  z_stream z;
  memset(&z, 0, sizeof z);
  if (inflateInit2(&z, 16 + MAX_WBITS) != Z_OK) return df_error_nomem("zlib");
  z.next_in = (Bytef *)data;
  z.avail_in = (uInt)len;
  int rc = Z_OK;
  while (rc != Z_STREAM_END) {
    if (df_buf_reserve(out, 1 << 20)) {
      inflateEnd(&z);
      return DFLASH_E_NOMEM;
    }
    z.next_out = (Bytef *)out->data + out->len;
    z.avail_out = (uInt)(out->cap - out->len - 1);
    size_t before = z.avail_out;
    rc = inflate(&z, Z_NO_FLUSH);
    out->len += before - z.avail_out;
    if (rc == Z_BUF_ERROR && z.avail_in == 0) rc = Z_DATA_ERROR + 100; /* input ran out */
    if (rc != Z_OK && rc != Z_STREAM_END) break;
  }
  inflateEnd(&z);
  if (rc == Z_DATA_ERROR + 100)
    return df_error(DFLASH_E_TRUNCATED, "%s: gzip stream ends early (truncated file)", path);
  if (rc != Z_STREAM_END)
    return df_error(DFLASH_E_FORMAT, "%s: corrupt gzip data: %s", path, z.msg ? z.msg : "?");
  out->data[out->len] = '\0';
  return DFLASH_OK;
}

static int b64_value(unsigned char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

/* Strict base64 with padding; returns the decoded length or -1. */
static long b64_decode(const char *s, size_t n, uint8_t *out) {
  if (n == 0 || n % 4) return -1;
  size_t pad = s[n - 1] == '=' ? (s[n - 2] == '=' ? 2 : 1) : 0;
  long len = 0;
  for (size_t i = 0; i < n; i += 4) {
    int v[4];
    for (int k = 0; k < 4; k++) {
      bool is_pad = i + (size_t)k >= n - pad;
      v[k] = is_pad ? 0 : b64_value((unsigned char)s[i + k]);
      if (v[k] < 0 || (is_pad && s[i + k] != '=')) return -1;
    }
    uint32_t w = (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
    size_t keep = i + 4 == n ? 3 - pad : 3;
    for (size_t k = 0; k < keep; k++) out[len++] = (uint8_t)(w >> (16 - 8 * k));
  }
  return len;
}

typedef struct rank_line {
  uint32_t off, len; /* decoded bytes in a scratch blob */
  uint32_t rank;
  uint32_t line;
} rank_line;

/* Parse every line; fills lines[] and the decoded bytes. */
static dflash_status parse_ranks(const char *path, const char *text, size_t text_len,
                                 rank_line **out, size_t *n_out, df_buf *bytes,
                                 uint32_t *max_rank) {
  size_t cap = 1024, n = 0;
  rank_line *lines = malloc(cap * sizeof *lines);
  if (!lines) return df_error_nomem("rank file");
  uint8_t dec[1024];
  uint32_t line_no = 0;
  *max_rank = 0;
  dflash_status st = DFLASH_OK;
  for (const char *p = text, *end = text + text_len; p < end && !st;) {
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    const char *eol = nl ? nl : end;
    line_no++;
    const char *q = p;
    p = nl ? nl + 1 : end;
    while (eol > q && (eol[-1] == '\r' || eol[-1] == ' ' || eol[-1] == '\t')) eol--;
    if (eol == q) continue;
    const char *sp = memchr(q, ' ', (size_t)(eol - q));
    if (!sp) {
      st = df_error(DFLASH_E_FORMAT, "%s:%u: expected `base64 rank`, not a tiktoken rank file?",
                    path, line_no);
      break;
    }
    size_t b64_len = (size_t)(sp - q);
    long dl = b64_len / 4 * 3 <= sizeof dec ? b64_decode(q, b64_len, dec) : -1;
    if (dl < 0) {
      st = df_error(DFLASH_E_FORMAT, "%s:%u: bad base64 \"%.*s\"", path, line_no,
                    (int)(b64_len > 40 ? 40 : b64_len), q);
      break;
    }
    const char *num = sp + 1;
    uint64_t rank = 0;
    bool digits_only = num < eol;
    for (const char *d = num; d < eol && digits_only; d++) { /* the text need not end in NUL */
      digits_only = *d >= '0' && *d <= '9';
      if (rank < (1ull << 40)) rank = rank * 10 + (uint64_t)(*d - '0');
    }
    if (!digits_only || rank >= (1ull << 31)) {
      st = df_error(DFLASH_E_FORMAT, "%s:%u: rank \"%.*s\" is not an integer in [0, 2^31)", path,
                    line_no, (int)(eol - num > 20 ? 20 : eol - num), num);
      break;
    }
    if (n == cap) {
      rank_line *more = realloc(lines, (cap *= 2) * sizeof *lines);
      if (!more) {
        st = df_error_nomem("rank file");
        break;
      }
      lines = more;
    }
    lines[n++] = (rank_line){(uint32_t)bytes->len, (uint32_t)dl, (uint32_t)rank, line_no};
    if (rank > *max_rank) *max_rank = (uint32_t)rank;
    st = df_buf_append(bytes, dec, (size_t)dl);
  }
  if (!st && n == 0) st = df_error(DFLASH_E_FORMAT, "%s: no ranks (empty file)", path);
  if (st) {
    free(lines);
    return st;
  }
  *out = lines;
  *n_out = n;
  return DFLASH_OK;
}

/* The specials tiktoken_ext/openai_public.py pairs with these rank files. */
typedef struct openai_special {
  const char *pattern;
  uint32_t n_ranks;
  const char *text;
  uint32_t id;
} openai_special;

static const openai_special OPENAI_SPECIALS[] = {
    {"cl100k", 100256, "<|endoftext|>", 100257},   {"cl100k", 100256, "<|fim_prefix|>", 100258},
    {"cl100k", 100256, "<|fim_middle|>", 100259},  {"cl100k", 100256, "<|fim_suffix|>", 100260},
    {"cl100k", 100256, "<|endofprompt|>", 100276}, {"o200k", 199998, "<|endoftext|>", 199999},
    {"o200k", 199998, "<|endofprompt|>", 200018},
};

static bool names_kimi(json_t *cfg) {
  const char *cls = json_string_value(json_object_get(cfg, "tokenizer_class"));
  if (cls && (strstr(cls, "Kimi") || !strcmp(cls, "TikTokenTokenizer"))) return true;
  json_t *am = json_object_get(json_object_get(cfg, "auto_map"), "AutoTokenizer");
  json_t *first = json_is_array(am) ? json_array_get(am, 0) : am;
  const char *mod = json_string_value(first);
  return mod && strstr(mod, "tokenization_kimi");
}

/* Kimi layout: slots [n_base, n_base + 256) named by added_tokens_decoder or
 * `<|reserved_token_N|>`. */
static dflash_status kimi_specials(dflash_tokenizer *t, json_t *cfg, const char *cfg_path,
                                   uint32_t n_base) {
  json_t *dec = json_object_get(cfg, "added_tokens_decoder");
  for (uint32_t id = n_base; id < n_base + KIMI_SPECIAL_SLOTS; id++) {
    char key[16], name[48];
    snprintf(key, sizeof key, "%u", id);
    json_t *e = json_object_get(dec, key);
    const char *content = json_string_value(json_object_get(e, "content"));
    if (e && !content)
      return df_error(DFLASH_E_FORMAT, "%s: added_tokens_decoder[\"%u\"] has no content", cfg_path,
                      id);
    if (!content) {
      snprintf(name, sizeof name, "<|reserved_token_%u|>", id);
      content = name;
    }
    dflash_status st = df_vocab_set(&t->vocab, id, content, strlen(content), DF_TOK_SPECIAL);
    if (!st) st = df_tok_add_added(t, content, strlen(content), id, true);
    if (st) return df_error_wrap(st, "%s", cfg_path);
  }
  return DFLASH_OK;
}

static dflash_status openai_specials(dflash_tokenizer *t, const char *pattern, uint32_t n_ranks) {
  for (size_t i = 0; i < DF_ARRAY_LEN(OPENAI_SPECIALS); i++) {
    const openai_special *s = &OPENAI_SPECIALS[i];
    if (strcmp(s->pattern, pattern) || s->n_ranks != n_ranks) continue;
    dflash_status st = df_vocab_set(&t->vocab, s->id, s->text, strlen(s->text), DF_TOK_SPECIAL);
    if (!st) st = df_tok_add_added(t, s->text, strlen(s->text), s->id, true);
    if (st) return st;
  }
  return DFLASH_OK;
}

static uint32_t openai_extent(const char *pattern, uint32_t n_ranks) {
  uint32_t top = n_ranks;
  for (size_t i = 0; i < DF_ARRAY_LEN(OPENAI_SPECIALS); i++)
    if (!strcmp(OPENAI_SPECIALS[i].pattern, pattern) && OPENAI_SPECIALS[i].n_ranks == n_ranks &&
        OPENAI_SPECIALS[i].id + 1 > top)
      top = OPENAI_SPECIALS[i].id + 1;
  return top;
}

/* Which pattern a rank file gets when none is given. */
static const char *infer_pattern(const char *path, bool kimi) {
  if (kimi) return "kimi-k2";
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  if (strstr(base, "cl100k")) return "cl100k";
  if (strstr(base, "o200k")) return "o200k";
  return NULL;
}

static dflash_status fill_ranks(dflash_tokenizer *t, const char *path, const rank_line *lines,
                                size_t n, const df_buf *bytes) {
  for (size_t i = 0; i < n; i++) {
    dflash_status st = df_vocab_set(&t->vocab, lines[i].rank, bytes->data + lines[i].off,
                                    lines[i].len, DF_TOK_ORDINARY);
    if (st == DFLASH_E_DUPLICATE)
      return df_error(DFLASH_E_DUPLICATE, "%s:%u: rank %u appears twice", path, lines[i].line,
                      lines[i].rank);
    if (st) return st;
  }
  for (uint32_t r = 0; r < n; r++)
    if (t->vocab.kind[r] == DF_TOK_NONE)
      return df_error(DFLASH_E_FORMAT, "%s: rank %u is missing (%zu lines, ranks must be 0..%zu)",
                      path, r, n, n - 1);
  return DFLASH_OK;
}

/* Decompress when gzip'd; *text then points into unz. */
static dflash_status maybe_gunzip(const char *name, const char *data, size_t len, const char **text,
                                  size_t *text_len, df_buf *unz) {
  *text = data;
  *text_len = len;
  if (len < 2 || (uint8_t)data[0] != 0x1F || (uint8_t)data[1] != 0x8B) return DFLASH_OK;
  dflash_status st = gunzip(name, data, len, unz);
  *text = unz->data;
  *text_len = unz->len;
  return st;
}

dflash_status df_load_tiktoken_data(dflash_tokenizer *t, const char *name, const char *data,
                                    size_t data_len, const char *pattern, json_t *cfg,
                                    const char *cfg_name) {
  bool kimi = cfg && names_kimi(cfg);
  const char *pat = pattern ? pattern : infer_pattern(name, kimi);
  const char *text = NULL;
  size_t len = 0, n = 0;
  df_buf unz = {0}, bytes = {0};
  rank_line *lines = NULL;
  uint32_t max_rank = 0;
  dflash_status st = DFLASH_OK;
  if (!pat)
    st = df_error(
        DFLASH_E_CONFIG,
        "%s: a bare rank file needs a pattern (cl100k, o200k, kimi-k2, qwen2, qwen3.5 or a "
        "regex)",
        name);
  if (!st) st = maybe_gunzip(name, data, data_len, &text, &len, &unz);
  if (!st) st = parse_ranks(name, text, len, &lines, &n, &bytes, &max_rank);
  if (!st && max_rank >= n + (1u << 20))
    st = df_error(DFLASH_E_FORMAT, "%s: %zu lines but ranks reach %u (ranks missing)", name, n,
                  max_rank);
  if (!st) {
    /* Room for every rank seen, so a duplicate is reported as such before a hole. */
    uint32_t n_ids = max_rank + 1 > n ? max_rank + 1 : (uint32_t)n;
    n_ids = kimi ? n_ids + KIMI_SPECIAL_SLOTS : openai_extent(pat, n_ids);
    st = df_vocab_init(&t->vocab, n_ids);
  }
  if (!st) st = fill_ranks(t, name, lines, n, &bytes);
  if (!st) st = df_vocab_index(&t->vocab, true, name);
  if (!st) st = df_pairmap_from_ranks(&t->pairs, &t->vocab);
  if (!st)
    st = kimi ? kimi_specials(t, cfg, cfg_name, (uint32_t)n) : openai_specials(t, pat, (uint32_t)n);
  if (!st)
    st = df_pretok_add_regex(&t->pretok, pat, false, DF_SPLIT_ISOLATED, false, false, &t->nfc);
  t->family = DF_FAMILY_TIKTOKEN;
  t->whole_piece_lookup = true;
  free(lines);
  df_buf_free(&unz);
  df_buf_free(&bytes);
  return st;
}

dflash_status df_load_tiktoken(dflash_tokenizer *t, const char *path, const char *pattern,
                               const char *config_path) {
  json_t *cfg = NULL;
  char *data = NULL;
  size_t len = 0;
  dflash_status st = config_path ? df_json_load_file(config_path, &cfg) : DFLASH_OK;
  if (!st) st = df_read_file(path, &data, &len);
  if (!st) st = df_load_tiktoken_data(t, path, data, len, pattern, cfg, config_path);
  free(data);
  json_decref(cfg);
  return st;
}
