/* A string set for sample ids (open addressing, linear probing). */
#include <stdlib.h>
#include <string.h>

#include "hidden.h"

static uint64_t fnv1a(const char *s) {
  uint64_t h = 1469598103934665603ULL;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ULL;
  return h;
}

static char **probe(char **slots, size_t cap, const char *str) {
  size_t i = (size_t)fnv1a(str) & (cap - 1);
  while (slots[i] && strcmp(slots[i], str)) i = (i + 1) & (cap - 1);
  return &slots[i];
}

static dflash_status grow(df_strset *s) {
  size_t nc = s->cap ? s->cap * 2 : 1024;
  char **ns = calloc(nc, sizeof *ns);
  if (!ns) return df_error_nomem("id set");
  for (size_t i = 0; i < s->cap; i++)
    if (s->slots[i]) *probe(ns, nc, s->slots[i]) = s->slots[i];
  free(s->slots);
  s->slots = ns;
  s->cap = nc;
  return DFLASH_OK;
}

dflash_status df_strset_add(df_strset *s, const char *str) {
  if (2 * (s->n + 1) > s->cap) {
    dflash_status st = grow(s);
    if (st) return st;
  }
  char **slot = probe(s->slots, s->cap, str);
  if (*slot) return DFLASH_OK;
  if (!(*slot = df_strdup(str))) return df_error_nomem("id");
  s->n++;
  return DFLASH_OK;
}

bool df_strset_has(const df_strset *s, const char *str) {
  return s->cap && *probe(s->slots, s->cap, str) != NULL;
}

void df_strset_free(df_strset *s) {
  for (size_t i = 0; i < s->cap; i++) free(s->slots[i]);
  free(s->slots);
  memset(s, 0, sizeof *s);
}
