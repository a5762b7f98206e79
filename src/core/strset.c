/* A set of strings (open addressing, linear probing, FNV-1a 64): the ids
 * already finished, which can run to millions on a long job. */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

static uint64_t fnv1a(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
  return h;
}

static size_t find_slot(char *const *slots, size_t cap, const char *key) {
  size_t i = (size_t)fnv1a(key) & (cap - 1);
  while (slots[i] && strcmp(slots[i], key)) i = (i + 1) & (cap - 1);
  return i;
}

static int grow(df_strset *s) {
  size_t cap = s->cap ? s->cap * 2 : 1024;
  char **slots = calloc(cap, sizeof *slots);
  if (!slots) return -1;
  for (size_t i = 0; i < s->cap; i++)
    if (s->slots[i]) slots[find_slot(slots, cap, s->slots[i])] = s->slots[i];
  free(s->slots);
  s->slots = slots;
  s->cap = cap;
  return 0;
}

int df_strset_add(df_strset *s, const char *key) {
  if ((s->count + 1) * 4 > s->cap * 3 && grow(s)) return -1; /* load factor <= 3/4 */
  size_t i = find_slot(s->slots, s->cap, key);
  if (s->slots[i]) return 0;
  if (!(s->slots[i] = df_strdup(key))) return -1;
  s->count++;
  return 1;
}

bool df_strset_has(const df_strset *s, const char *key) {
  return s->cap && s->slots[find_slot(s->slots, s->cap, key)] != NULL;
}

void df_strset_free(df_strset *s) {
  for (size_t i = 0; i < s->cap; i++) free(s->slots[i]);
  free(s->slots);
  memset(s, 0, sizeof *s);
}
