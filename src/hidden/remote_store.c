/* A hidden-state store on object storage (an s3:// prefix), read in place:
 * every shard's header is read once at open (a ranged GET each), and a
 * sample's tensors are fetched with ranged GETs when it is read. Nothing is
 * copied to local disk: GPU nodes have little of it next to their weights,
 * and a store can be far larger than a dataset. Reads are serialised by a
 * mutex (the store is shareable across threads; one storage client serves
 * them), which costs nothing next to the transfer itself. */
#include <dflash/storage.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "hidden.h"
#include "storage/stage.h"

/* Small window: samples are read in shuffled order, and each shard keeps one. */
#define DF_RHIDDEN_READAHEAD (256u << 10)

typedef struct rentry {
  const char *name; /* borrowed from its shard */
  uint32_t shard;
} rentry;

struct df_rhidden {
  dflash_storage *st;
  pthread_mutex_t mu;
  dflash_storage_safetensors **shards;
  size_t n_shards;
  rentry *ents; /* every tensor of every shard, sorted by name */
  size_t n;
};

static int cmp_entry(const void *a, const void *b) {
  return strcmp(((const rentry *)a)->name, ((const rentry *)b)->name);
}

static bool is_shard(const char *loc, size_t plen) {
  const char *base = loc + plen;
  return !strncmp(base, "hidden-", 7) && !strchr(base, '/') &&
         df_str_ends_with(base, ".safetensors");
}

static dflash_status open_shards(df_rhidden *r, const char *url) {
  char *prefix = df_stage_join(url, "");
  if (!prefix) return df_error_nomem("prefix");
  dflash_storage_listing *l = NULL;
  dflash_status s = dflash_storage_list(r->st, prefix, &l);
  size_t n = dflash_storage_listing_count(l), plen = strlen(prefix);
  if (!s && !(r->shards = calloc(n + 1, sizeof *r->shards))) s = df_error_nomem("shards");
  for (size_t i = 0; !s && i < n; i++) {
    const char *loc;
    if ((s = dflash_storage_listing_get(l, i, &loc, NULL))) break;
    if (!is_shard(loc, plen)) continue;
    s = dflash_storage_safetensors_open(r->st, loc, DF_RHIDDEN_READAHEAD, &r->shards[r->n_shards]);
    if (!s) r->n += dflash_storage_safetensors_count(r->shards[r->n_shards++]);
  }
  if (!s && r->n_shards == 0)
    s = df_error(DFLASH_E_NOT_FOUND, "%s: no hidden-*.safetensors shards under this prefix", url);
  dflash_storage_listing_free(l);
  free(prefix);
  return s;
}

static dflash_status index_tensors(df_rhidden *r) {
  if (!(r->ents = malloc((r->n + 1) * sizeof *r->ents))) return df_error_nomem("tensor index");
  size_t k = 0;
  for (size_t s = 0; s < r->n_shards; s++)
    for (size_t i = 0; i < dflash_storage_safetensors_count(r->shards[s]); i++) {
      dflash_tensor t = {.struct_size = sizeof t};
      dflash_status st = dflash_storage_safetensors_get(r->shards[s], i, &t);
      if (st) return st;
      r->ents[k++] = (rentry){t.name, (uint32_t)s};
    }
  qsort(r->ents, r->n, sizeof *r->ents, cmp_entry);
  for (size_t i = 1; i < r->n; i++)
    if (!strcmp(r->ents[i].name, r->ents[i - 1].name)) {
      dflash_tensor a = {.struct_size = sizeof a}, b = {.struct_size = sizeof b};
      df_rhidden_get(r, i - 1, &a);
      df_rhidden_get(r, i, &b);
      return df_error(DFLASH_E_DUPLICATE, "tensor %s is in both %s and %s", r->ents[i].name, a.file,
                      b.file);
    }
  return DFLASH_OK;
}

dflash_status df_rhidden_open(const char *url, df_rhidden **out) {
  *out = NULL;
  df_rhidden *r = calloc(1, sizeof *r);
  if (!r) return df_error_nomem("remote hidden store");
  pthread_mutex_init(&r->mu, NULL);
  dflash_status s = dflash_storage_create(NULL, &r->st);
  if (!s) s = open_shards(r, url);
  if (!s) s = index_tensors(r);
  if (s) {
    df_rhidden_free(r);
    return df_error_wrap(s, "opening hidden-state store %s", url);
  }
  *out = r;
  return DFLASH_OK;
}

void df_rhidden_free(df_rhidden *r) {
  if (!r) return;
  for (size_t i = 0; i < r->n_shards; i++) dflash_storage_safetensors_free(r->shards[i]);
  free(r->shards);
  free(r->ents);
  dflash_storage_free(r->st);
  pthread_mutex_destroy(&r->mu);
  free(r);
}

dflash_status df_rhidden_meta(const df_rhidden *r, const char *key, const char **value) {
  return dflash_storage_safetensors_metadata_find(r->shards[0], key, value);
}

size_t df_rhidden_count(const df_rhidden *r) { return r->n; }

void df_rhidden_get(const df_rhidden *r, size_t i, dflash_tensor *t) {
  /* Cannot fail: the entry was read from this shard's own index (build_index). */
  DF_IGNORE(dflash_storage_safetensors_find(r->shards[r->ents[i].shard], r->ents[i].name, t));
}

static const rentry *lookup(const df_rhidden *r, const char *name) {
  rentry key = {name, 0};
  return bsearch(&key, r->ents, r->n, sizeof *r->ents, cmp_entry);
}

dflash_status df_rhidden_find(const df_rhidden *r, const char *name, dflash_tensor *t) {
  const rentry *e = lookup(r, name);
  if (!e) return DFLASH_E_NOT_FOUND;
  return dflash_storage_safetensors_find(r->shards[e->shard], name, t);
}

dflash_status df_rhidden_read(df_rhidden *r, const char *name, void *buf, size_t len) {
  const rentry *e = lookup(r, name);
  if (!e) return df_error(DFLASH_E_NOT_FOUND, "no tensor %s in the remote store", name);
  pthread_mutex_lock(&r->mu);
  dflash_status s = dflash_storage_safetensors_read(r->shards[e->shard], name, buf, len, NULL);
  pthread_mutex_unlock(&r->mu);
  return s;
}
