/*
 * The trainer's files on object storage (s3:// locations):
 *  - target weights: read in place with ranged GETs (only the embedding and
 *    LM head of a checkpoint that may be hundreds of GB), from a
 *    .safetensors object, a *.index.json, or a prefix holding
 *    model.safetensors.index.json or model.safetensors;
 *  - checkpoints and training state: written to a local staging directory,
 *    then uploaded (model.safetensors before config.json, as locally);
 *    read back by downloading into the cache directory (storage/stage.h);
 *  - a training run's output directory: a local mirror in the cache
 *    directory, uploaded at every save (df_train_remote_*).
 */
#include <dflash/safetensors.h>
#include <dflash/storage.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "remote_files.h"
#include "storage/stage.h"
#include "trainer.h"

/* ---- a remote safetensors checkpoint (one object or an index + shards) ---- */

struct df_rst {
  dflash_storage *st;
  char *url;          /* as given, for messages */
  char *base;         /* shard file names are relative to this prefix */
  json_t *weight_map; /* NULL: a single object, `single` */
  char *single;
  char **files; /* opened shards, by location */
  dflash_storage_safetensors **shards;
  size_t n_open;
};

static dflash_status shard_of(df_rst *r, const char *name, dflash_storage_safetensors **out);

static bool exists(dflash_storage *st, const char *loc) {
  dflash_storage_info info = {.struct_size = sizeof info};
  return dflash_storage_stat(st, loc, &info) == DFLASH_OK;
}

static dflash_status load_index(df_rst *r, const char *loc) {
  void *data;
  size_t len;
  dflash_status s = dflash_storage_read(r->st, loc, &data, &len);
  json_t *j = NULL;
  if (!s) s = df_json_parse(data, len, loc, &j);
  dflash_storage_buffer_free(data);
  if (s) return s;
  r->weight_map = json_incref(json_object_get(j, "weight_map"));
  json_decref(j);
  if (!json_is_object(r->weight_map))
    return df_error(DFLASH_E_FORMAT, "%s: no \"weight_map\" object", loc);
  r->base = df_path_dirname(loc);
  return r->base ? DFLASH_OK : df_error_nomem("path");
}

/* Which of the accepted spellings `url` is. */
static dflash_status resolve(df_rst *r, const char *url) {
  if (df_str_ends_with(url, ".safetensors"))
    return (r->single = df_strdup(url)) ? DFLASH_OK : df_error_nomem("path");
  if (df_str_ends_with(url, ".json")) return load_index(r, url);
  char *index = df_stage_join(url, "model.safetensors.index.json");
  char *one = df_stage_join(url, "model.safetensors");
  dflash_status s = index && one ? DFLASH_OK : df_error_nomem("path");
  if (!s && exists(r->st, index)) s = load_index(r, index);
  else if (!s && exists(r->st, one)) r->single = one, one = NULL;
  else if (!s)
    s = df_error(DFLASH_E_NOT_FOUND,
                 "%s: neither model.safetensors.index.json nor "
                 "model.safetensors is there",
                 url);
  free(index);
  free(one);
  return s;
}

dflash_status df_rst_open(const char *url, df_rst **out) {
  *out = NULL;
  df_rst *r = calloc(1, sizeof *r);
  if (!r || !(r->url = df_strdup(url))) {
    free(r);
    return df_error_nomem("remote checkpoint");
  }
  dflash_status s = dflash_storage_create(NULL, &r->st);
  if (!s) s = resolve(r, url);
  dflash_storage_safetensors *first;
  if (!s && r->single) s = shard_of(r, "", &first); /* surface access errors here */
  if (s) {
    df_rst_free(r);
    return s;
  }
  *out = r;
  return DFLASH_OK;
}

void df_rst_free(df_rst *r) {
  if (!r) return;
  for (size_t i = 0; i < r->n_open; i++) {
    dflash_storage_safetensors_free(r->shards[i]);
    free(r->files[i]);
  }
  free(r->shards);
  free(r->files);
  json_decref(r->weight_map);
  free(r->single);
  free(r->base);
  free(r->url);
  dflash_storage_free(r->st);
  free(r);
}

/* The opened shard holding `name`, or NULL (and DFLASH_E_NOT_FOUND). */
static dflash_status shard_of(df_rst *r, const char *name, dflash_storage_safetensors **out) {
  *out = NULL;
  char *loc = NULL;
  if (r->single) {
    loc = df_strdup(r->single);
  } else {
    const char *file = json_string_value(json_object_get(r->weight_map, name));
    if (!file) return DFLASH_E_NOT_FOUND;
    loc = df_stage_join(r->base, file);
  }
  if (!loc) return df_error_nomem("path");
  for (size_t i = 0; i < r->n_open; i++)
    if (!strcmp(r->files[i], loc)) {
      free(loc);
      *out = r->shards[i];
      return DFLASH_OK;
    }
  char **f = realloc(r->files, (r->n_open + 1) * sizeof *f);
  if (f) r->files = f;
  dflash_storage_safetensors **sh = f ? realloc(r->shards, (r->n_open + 1) * sizeof *sh) : NULL;
  if (sh) r->shards = sh;
  dflash_status s = sh ? dflash_storage_safetensors_open(r->st, loc, 0, &r->shards[r->n_open])
                       : df_error_nomem("shards");
  if (s) {
    free(loc);
    return s;
  }
  r->files[r->n_open] = loc;
  *out = r->shards[r->n_open++];
  return DFLASH_OK;
}

dflash_status df_rst_find(df_rst *r, const char *name, dflash_tensor *t) {
  dflash_storage_safetensors *sh;
  dflash_status s = shard_of(r, name, &sh);
  if (s) return s;
  return dflash_storage_safetensors_find(sh, name, t) ? DFLASH_E_NOT_FOUND : DFLASH_OK;
}

dflash_status df_rst_read_floats(df_rst *r, const char *name, int ndim, const int64_t *shape,
                                 float *out) {
  dflash_storage_safetensors *sh;
  dflash_tensor t = {.struct_size = sizeof t};
  dflash_status s = shard_of(r, name, &sh);
  if (!s) s = dflash_storage_safetensors_find(sh, name, &t);
  if (s) return s;
  void *buf = malloc(t.nbytes ? t.nbytes : 1);
  if (!buf) return df_error_nomem(name);
  s = dflash_storage_safetensors_read(sh, name, buf, t.nbytes, NULL);
  t.data = buf;
  if (!s) s = df_tensor_floats(&t, name, ndim, shape, out);
  free(buf);
  return s;
}

/* ---- checkpoints ------------------------------------------------------------ */

dflash_status df_remote_save(const dflash_trainer *t, const char *url, int32_t bf16) {
  char *tmp = NULL;
  dflash_storage *st = NULL;
  dflash_status s = df_stage_tmpdir("checkpoint", &tmp);
  if (!s) s = dflash_trainer_save(t, tmp, bf16);
  if (!s) s = dflash_storage_create(NULL, &st);
  if (!s) s = df_stage_out(st, tmp, url, "model.safetensors");
  if (!s) s = df_stage_out(st, tmp, url, "config.json"); /* last: it makes it loadable */
  if (s) df_error_wrap(s, "saving checkpoint %s", url);
  dflash_storage_free(st);
  df_stage_rmtree(tmp);
  free(tmp);
  return s;
}

dflash_status df_remote_save_state(const dflash_trainer *t, const char *url, const void *user,
                                   size_t user_len) {
  char *tmp = NULL, *file = NULL;
  dflash_storage *st = NULL;
  dflash_status s = df_stage_tmpdir("state", &tmp);
  if (!s && !(file = df_path_join(tmp, "state.safetensors"))) s = df_error_nomem("path");
  if (!s) s = dflash_trainer_save_state(t, file, user, user_len);
  if (!s) s = dflash_storage_create(NULL, &st);
  if (!s) s = dflash_storage_copy(st, file, url);
  dflash_storage_free(st);
  df_stage_rmtree(tmp);
  free(tmp);
  free(file);
  return s;
}

dflash_status df_remote_fetch(const char *url, const char *file, char **local) {
  char *cache = NULL, *src = NULL;
  dflash_storage *st = NULL;
  *local = NULL;
  dflash_status s = df_stage_cache_path(url, &cache);
  if (!s && !(src = file ? df_stage_join(url, file) : df_strdup(url))) s = df_error_nomem("path");
  if (!s && !(*local = file ? df_path_join(cache, file) : df_strdup(cache)))
    s = df_error_nomem("path");
  if (!s) s = dflash_storage_create(NULL, &st);
  if (!s) s = dflash_storage_copy(st, src, *local);
  dflash_storage_free(st);
  free(cache);
  free(src);
  if (s) {
    free(*local);
    *local = NULL;
  }
  return s;
}

/* ---- a training run's output directory ---------------------------------------- */

static const char *const RUN_FILES[] = {"model.safetensors", "config.json",
                                        "train_state/state.safetensors", "metrics.jsonl"};

dflash_status df_train_remote_begin(df_train_remote *r, const char *url, bool resume) {
  memset(r, 0, sizeof *r);
  dflash_status s = dflash_storage_create(NULL, &r->st);
  if (!s && !(r->url = df_strdup(url))) s = df_error_nomem("path");
  if (!s) s = df_stage_cache_path(url, &r->local);
  if (s) return s;
  df_stage_rmtree(r->local); /* the bucket is the truth */
  if (!(s = df_stage_mkdirs(r->local)) && resume) {
    /* What resuming reads: the state and the metrics so far. */
    for (size_t i = 2; !s && i < DF_ARRAY_LEN(RUN_FILES); i++) {
      char *src = df_stage_join(url, RUN_FILES[i]), *dst = df_path_join(r->local, RUN_FILES[i]);
      s = src && dst ? dflash_storage_copy(r->st, src, dst) : df_error_nomem("path");
      free(src);
      free(dst);
    }
    if (s) df_error_wrap(s, "resuming from %s", url);
  }
  return s;
}

dflash_status df_train_remote_publish(df_train_remote *r, FILE *metrics) {
  if (metrics && fflush(metrics) != 0) return df_error(DFLASH_E_IO, "cannot flush metrics");
  dflash_status s = DFLASH_OK;
  for (size_t i = 0; !s && i < DF_ARRAY_LEN(RUN_FILES); i++)
    s = df_stage_out(r->st, r->local, r->url, RUN_FILES[i]);
  return s ? df_error_wrap(s, "uploading the checkpoint to %s", r->url) : DFLASH_OK;
}

void df_train_remote_end(df_train_remote *r) {
  if (r->local) df_stage_rmtree(r->local);
  free(r->local);
  free(r->url);
  dflash_storage_free(r->st);
  memset(r, 0, sizeof *r);
}
