/*
 * Special / added tokens: a byte trie for leftmost-longest matching (as
 * Hugging Face's aho-corasick LeftmostLongest does; tiktoken never has one
 * special that is a prefix of another at the same place in practice).
 */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

#define NO_NODE UINT32_MAX

static dflash_status trie_node(df_trie *t, uint8_t byte, uint32_t *out) {
  if (t->n == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 64;
    uint32_t *fc = realloc(t->first_child, cap * sizeof *fc);
    if (fc) t->first_child = fc;
    uint32_t *sb = realloc(t->sibling, cap * sizeof *sb);
    if (sb) t->sibling = sb;
    uint8_t *by = realloc(t->byte, cap);
    if (by) t->byte = by;
    int32_t *tk = realloc(t->token, cap * sizeof *tk);
    if (tk) t->token = tk;
    if (!fc || !sb || !by || !tk) return df_error_nomem("special-token trie");
    t->cap = cap;
  }
  t->first_child[t->n] = NO_NODE;
  t->sibling[t->n] = NO_NODE;
  t->byte[t->n] = byte;
  t->token[t->n] = -1;
  *out = (uint32_t)t->n++;
  return DFLASH_OK;
}

static uint32_t child(const df_trie *t, uint32_t node, uint8_t byte) {
  for (uint32_t c = t->first_child[node]; c != NO_NODE; c = t->sibling[c])
    if (t->byte[c] == byte) return c;
  return NO_NODE;
}

dflash_status df_trie_build(df_trie *t, const df_added *added, size_t n, bool normalized) {
  memset(t, 0, sizeof *t);
  uint32_t root;
  if (trie_node(t, 0, &root)) return DFLASH_E_NOMEM;
  for (size_t k = 0; k < n; k++) {
    if (added[k].normalized != normalized || added[k].len == 0) continue;
    uint32_t node = root;
    for (size_t i = 0; i < added[k].len; i++) {
      uint8_t b = (uint8_t)added[k].text[i];
      uint32_t c = child(t, node, b);
      if (c == NO_NODE) {
        if (trie_node(t, b, &c)) return DFLASH_E_NOMEM;
        t->sibling[c] = t->first_child[node];
        t->first_child[node] = c;
      }
      node = c;
    }
    if (t->token[node] < 0) t->token[node] = (int32_t)k; /* first declaration wins */
    uint8_t b0 = (uint8_t)added[k].text[0];
    if (!(t->first_bytes[b0 >> 3] & (1u << (b0 & 7))) && t->n_first++ < 2)
      t->first[t->n_first - 1] = b0;
    t->first_bytes[b0 >> 3] |= (uint8_t)(1u << (b0 & 7));
    t->has_ordinary |= !added[k].special;
  }
  return DFLASH_OK;
}

void df_trie_free(df_trie *t) {
  free(t->first_child);
  free(t->sibling);
  free(t->byte);
  free(t->token);
  memset(t, 0, sizeof *t);
}

/* Longest enabled token starting at text[p]; -1 if none. */
static int longest_at(const df_trie *t, const df_added *added, dflash_special_mode mode,
                      const char *text, size_t p, size_t len, size_t *end) {
  int best = -1;
  uint32_t node = 0;
  for (size_t i = p; i < len; i++) {
    node = child(t, node, (uint8_t)text[i]);
    if (node == NO_NODE) break;
    int32_t k = t->token[node];
    if (k >= 0 && !(mode == DFLASH_SPECIAL_NONE && added[k].special)) {
      best = k;
      *end = i + 1;
    }
  }
  return best;
}

static size_t prev_char_start(const char *s, size_t i) {
  do i--;
  while (i > 0 && ((uint8_t)s[i] & 0xC0) == 0x80);
  return i;
}

/* The first position in [p, len) whose byte may start a token, or len. With one or two
 * first bytes, memchr for each (na, nb: the next of each, kept across calls of one search). */
static size_t next_start(const df_trie *t, const char *text, size_t p, size_t len, size_t *na,
                         size_t *nb) {
  if (t->n_first > 2) {
    for (; p < len; p++) {
      uint8_t b = (uint8_t)text[p];
      if (t->first_bytes[b >> 3] & (1u << (b & 7))) return p;
    }
    return len;
  }
  if (*na == SIZE_MAX || *na < p) {
    const char *q = memchr(text + p, t->first[0], len - p);
    *na = q ? (size_t)(q - text) : len;
  }
  if (t->n_first == 2 && (*nb == SIZE_MAX || *nb < p)) {
    const char *q = memchr(text + p, t->first[1], len - p);
    *nb = q ? (size_t)(q - text) : len;
  }
  return t->n_first == 2 && *nb < *na ? *nb : *na;
}

int df_trie_find(const df_trie *t, const df_added *added, dflash_special_mode mode,
                 const char *text, size_t from, size_t len, size_t *mb, size_t *me) {
  if (!t->n || t->first_child[0] == NO_NODE) return -1;
  if (mode == DFLASH_SPECIAL_NONE && !t->has_ordinary) return -1; /* nothing can match */
  size_t na = SIZE_MAX, nb = SIZE_MAX;                            /* not searched yet */
  for (size_t p = from; p < len; p++) {
    if ((p = next_start(t, text, p, len, &na, &nb)) >= len) break;
    size_t end;
    int k = longest_at(t, added, mode, text, p, len, &end);
    if (k < 0) continue;
    size_t start = p;
    if (added[k].lstrip) /* swallow white space before it, back to the previous match */
      while (start > from) {
        size_t q = prev_char_start(text, start), i = q;
        if (!df_is_white_space(df_utf8_next((const uint8_t *)text, &i))) break;
        start = q;
      }
    if (added[k].rstrip)
      while (end < len) {
        size_t i = end;
        if (!df_is_white_space(df_utf8_next((const uint8_t *)text, &i))) break;
        end = i;
      }
    *mb = start;
    *me = end;
    return k;
  }
  return -1;
}
