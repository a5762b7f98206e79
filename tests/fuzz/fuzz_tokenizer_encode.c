/* libFuzzer target: encode arbitrary bytes with each named pre-tokenizer over a small
 * synthetic vocabulary with Kimi-style specials. Checks, for every input:
 *  - encode succeeds and decode(encode(x)) is x as the library reads it (invalid UTF-8
 *    replaced, NFC for the Qwen patterns);
 *  - the hand-written scanner splits exactly where the PCRE2 regex does;
 *  - the heap and flat BPE merges agree on the raw bytes as one piece. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tokenizer/tok_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define N_PATTERNS 5
static const char *const PATTERNS[N_PATTERNS] = {"cl100k", "o200k", "kimi-k2", "qwen2", "qwen3.5"};
static dflash_tokenizer *g_tok[N_PATTERNS];
static df_pretok g_regex_only[N_PATTERNS];

static void b64(const uint8_t *s, size_t n, df_buf *out) {
  static const char A[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  for (size_t i = 0; i < n; i += 3) {
    unsigned v = (unsigned)s[i] << 16 | (i + 1 < n ? (unsigned)s[i + 1] << 8 : 0) |
                 (i + 2 < n ? s[i + 2] : 0);
    char q[4] = {A[v >> 18 & 63], A[v >> 12 & 63], i + 1 < n ? A[v >> 6 & 63] : '=',
                 i + 2 < n ? A[v & 63] : '='};
    df_buf_append(out, q, 4);
  }
}

/* 256 bytes, then merges of frequent pairs (letters, spaces, UTF-8 of common CJK). */
static void build(void) {
  static const char *const extra[] = {"th",       "he",           "the",       " t",
                                      " the",     "in",           "er",        "an",
                                      "re",       "on",           " a",        "en",
                                      "at",       "es",           "  ",        "    ",
                                      "\n\n",     "'s",           "'t",        "ll",
                                      "ing",      " in",          "12",        "123",
                                      "\xe6\x97", "\xe6\x97\xa5", "\xe3\x80",  "\xe3\x80\x82",
                                      "\xc3\xa9", "e\xcc",        "e\xcc\x81", ".\n",
                                      ", ",       "<|",           "|>",        NULL};
  df_buf text = {0};
  int rank = 0;
  for (int b = 0; b < 256; b++, rank++) {
    uint8_t c = (uint8_t)b;
    b64(&c, 1, &text);
    df_buf_printf(&text, " %d\n", rank);
  }
  for (int k = 0; extra[k]; k++, rank++) {
    b64((const uint8_t *)extra[k], strlen(extra[k]), &text);
    df_buf_printf(&text, " %d\n", rank);
  }
  json_t *cfg = json_pack("{s:s, s:{s:{s:s}, s:{s:s}}}", "tokenizer_class", "TikTokenTokenizer",
                          "added_tokens_decoder", "292", "content", "<|im_end|>", "293", "content",
                          "<think>");
  for (int p = 0; p < N_PATTERNS; p++) {
    dflash_tokenizer *t = calloc(1, sizeof *t);
    t->serial = df_tokenizer_serial();
    if (df_load_tiktoken_data(t, "synthetic", text.data, text.len, PATTERNS[p], cfg, "cfg") ||
        df_tokenizer_finish(t) ||
        df_pretok_add_regex(&g_regex_only[p], PATTERNS[p], false, DF_SPLIT_ISOLATED, false, false,
                            NULL))
      __builtin_trap();
    g_regex_only[p].steps[0].scanner = DF_SCAN_NONE;
    g_tok[p] = t;
  }
  json_decref(cfg);
  df_buf_free(&text);
}

/* df_nfc normalises only the spans that may change; utf8proc over the whole
 * text must give the same bytes. */
static void check_nfc_spans(const char *s, size_t n, const char *got, size_t got_n) {
  utf8proc_uint8_t *want = NULL;
  utf8proc_ssize_t m = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &want,
                                    UTF8PROC_STABLE | UTF8PROC_COMPOSE);
  if (m < 0 || (size_t)m != got_n || memcmp(want, got, got_n)) __builtin_trap();
  free(want);
}

/* The text as the library reads it: UTF-8 repaired, NFC when the pattern implies it. */
static void expected(const dflash_tokenizer *t, const char *s, size_t n, df_buf *out) {
  bool changed;
  df_buf rep = {0}, nfc = {0};
  if (df_utf8_repair(s, n, &rep, &changed)) __builtin_trap();
  const char *x = changed ? rep.data : s;
  size_t xn = changed ? rep.len : n;
  out->len = 0;
  if (t->nfc) {
    /* specials are matched before normalisation: NFC applies between them */
    if (df_nfc(x, xn, &nfc, &changed)) __builtin_trap();
    check_nfc_spans(x, xn, changed ? nfc.data : x, changed ? nfc.len : xn);
    if (changed) x = nfc.data, xn = nfc.len;
  }
  df_buf_append(out, x, xn);
  df_buf_free(&rep);
  df_buf_free(&nfc);
}

static void check_scanner(int p, const char *s, size_t n) {
  df_pretok_scratch a = {0}, b = {0};
  const char *ba, *bb;
  df_ranges *ra, *rb;
  if (df_pretok_run(&g_tok[p]->pretok, s, n, &a, &ba, &ra) ||
      df_pretok_run(&g_regex_only[p], s, n, &b, &bb, &rb))
    __builtin_trap();
  if (ra->len != rb->len || (ra->len && memcmp(ra->v, rb->v, ra->len * sizeof *ra->v)))
    __builtin_trap();
  df_pretok_scratch_free(&a);
  df_pretok_scratch_free(&b);
}

static void check_bpe(const dflash_tokenizer *t, const uint8_t *s, size_t n) {
  df_bpe_scratch sc = {0};
  df_ids flat = {0}, heap = {0};
  if (df_bpe_encode(&t->vocab, &t->pairs, s, n, SIZE_MAX, &sc, &flat) ||
      df_bpe_encode(&t->vocab, &t->pairs, s, n, 0, &sc, &heap))
    __builtin_trap();
  if (flat.len != heap.len || (flat.len && memcmp(flat.v, heap.v, flat.len * sizeof *flat.v)))
    __builtin_trap();
  free(flat.v);
  free(heap.v);
  df_bpe_scratch_free(&sc);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!g_tok[0]) build();
  if (size < 1 || size > 1 << 16) return 0;
  int p = data[0] % N_PATTERNS;
  dflash_special_mode mode = data[0] & 0x80 ? DFLASH_SPECIAL_NONE : DFLASH_SPECIAL_ALL;
  const dflash_tokenizer *t = g_tok[p];
  const char *s = (const char *)data + 1;
  size_t n = size - 1;
  size_t cap = dflash_tokenizer_max_ids(t, n), got = 0, out_len = 0;
  int32_t *ids = malloc(cap * sizeof *ids);
  if (dflash_tokenizer_encode(t, s, n, mode, ids, cap, &got)) __builtin_trap();
  char *back = malloc(3 * n + 64);
  if (dflash_tokenizer_decode(t, ids, got, back, 3 * n + 64, &out_len)) __builtin_trap();
  df_buf want = {0};
  expected(t, s, n, &want);
  /* NFC across a special-token boundary can differ from NFC of the whole; only
   * compare when no special text is present. */
  if (!t->nfc || !memmem(s, n, "<", 1))
    if (out_len != want.len || memcmp(back, want.data ? want.data : "", out_len)) __builtin_trap();
  check_scanner(p, want.data ? want.data : "", want.len);
  check_bpe(t, data + 1, n < 2048 ? n : 2048);
  df_buf_free(&want);
  free(back);
  free(ids);
  return 0;
}
