/* Hidden-state store reader: the index maps ids to memory-mapped shards;
 * a sample is decoded (bf16 or scaled fp8 -> float32) only when read. */
#include <dflash/storage.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hidden.h"
#include "core/bf16.h"

struct dflash_hidden {
  dflash_safetensors *st; /* a local store, memory-mapped */
  df_rhidden *remote;     /* or an s3:// one, read with ranged GETs */
  df_vhidden *vllm;       /* or a folder of vLLM's hidden-state files */
  char *dir;
  int32_t K, H, dtype;
  size_t first, count;  /* tensors [first, first+count) are the "h/" ones */
  size_t n_tids;        /* "t/" tensors: samples with the target's greedy tokens */
  bool final;           /* "final_state": "post_norm": every sample has "f/<id>" */
  df_hidden_record rec; /* what the metadata says the rows are (record.c) */
};

/* The same questions of a mapped store or a remote one. */
static dflash_status meta_find(const dflash_hidden *h, const char *key, const char **v) {
  return h->remote ? df_rhidden_meta(h->remote, key, v)
                   : dflash_safetensors_metadata_find(h->st, key, v);
}

static size_t n_tensors(const dflash_hidden *h) {
  return h->remote ? df_rhidden_count(h->remote) : dflash_safetensors_count(h->st);
}

/* i < n_tensors(h): cannot fail (the remote index was built from the same shards). */
static void tensor_at(const dflash_hidden *h, size_t i, dflash_tensor *t) {
  if (h->remote) df_rhidden_get(h->remote, i, t);
  else DF_IGNORE(dflash_safetensors_get(h->st, i, t));
}

static dflash_status tensor_find(const dflash_hidden *h, const char *name, dflash_tensor *t) {
  return h->remote ? df_rhidden_find(h->remote, name, t) : dflash_safetensors_find(h->st, name, t);
}

static dflash_status meta_int(const dflash_hidden *h, const char *dir, const char *key,
                              int32_t *out) {
  const char *v;
  char *end;
  if (meta_find(h, key, &v))
    return df_error(DFLASH_E_FORMAT, "%s: hidden-state store lacks metadata \"%s\"", dir, key);
  long x = strtol(v, &end, 10);
  if (*end || x <= 0 || x > INT32_MAX)
    return df_error(DFLASH_E_FORMAT, "%s: metadata %s = \"%s\" is not a positive integer", dir, key,
                    v);
  *out = (int32_t)x;
  return DFLASH_OK;
}

/* The metadata's final-state claim (`fin`, NULL when absent) against the "f/" tensors found. */
static dflash_status check_final(dflash_hidden *h, const char *fin, size_t n_final) {
  if (fin && strcmp(fin, DF_HIDDEN_FINAL_POST_NORM))
    return df_error(DFLASH_E_FORMAT,
                    "%s: metadata %s = \"%s\": this libdflash reads \"%s\" (the target's final "
                    "state after its final norm) only",
                    h->dir, DF_HIDDEN_FINAL_KEY, fin, DF_HIDDEN_FINAL_POST_NORM);
  if (!fin && n_final)
    return df_error(DFLASH_E_FORMAT,
                    "%s: %zu final-state tensors (f/<id>), but the metadata does not declare %s",
                    h->dir, n_final, DF_HIDDEN_FINAL_KEY);
  if (fin && n_final != h->count)
    return df_error(DFLASH_E_FORMAT,
                    "%s: declares %s, but holds %zu final-state tensors (f/<id>) for %zu samples",
                    h->dir, DF_HIDDEN_FINAL_KEY, n_final, h->count);
  h->final = fin != NULL;
  return DFLASH_OK;
}

static dflash_status read_header(dflash_hidden *h) {
  const char *fmt, *dt;
  if (meta_find(h, "format", &fmt) || strcmp(fmt, DF_HIDDEN_FORMAT))
    return df_error(DFLASH_E_FORMAT,
                    "%s: not a libdflash hidden-state store (metadata format "
                    "is not %s)",
                    h->dir, DF_HIDDEN_FORMAT);
  dflash_status st = meta_int(h, h->dir, "num_layers", &h->K);
  if (!st) st = meta_int(h, h->dir, "hidden_size", &h->H);
  if (st) return st;
  if (meta_find(h, "dtype", &dt))
    return df_error(DFLASH_E_FORMAT, "%s: metadata lacks dtype", h->dir);
  if (!strcmp(dt, "bf16")) h->dtype = DFLASH_DTYPE_BF16;
  else if (!strcmp(dt, "fp8_e4m3")) h->dtype = DFLASH_DTYPE_F8_E4M3;
  else return df_error(DFLASH_E_DTYPE, "%s: unknown hidden dtype \"%s\"", h->dir, dt);
  const char *ids = NULL, *hash = NULL;
  if (meta_find(h, "target_layer_ids", &ids)) ids = NULL;
  if (meta_find(h, "tokenizer_hash", &hash)) hash = NULL;
  const char *fin = NULL;
  if (meta_find(h, DF_HIDDEN_FINAL_KEY, &fin)) fin = NULL;
  dflash_clear_error(); /* an absent key: a store without the record */
  if ((st = df_hidden_record_parse(ids, hash, h->K, h->dir, &h->rec))) return st;
  size_t n = n_tensors(h), n_final = 0;
  h->first = n;
  for (size_t i = 0; i < n; i++) {
    dflash_tensor t = {.struct_size = sizeof t};
    tensor_at(h, i, &t);
    if (!strncmp(t.name, "h/", 2)) {
      if (h->first == n) h->first = i;
      h->count++;
    }
    h->n_tids += !strncmp(t.name, "t/", 2);
    n_final += !strncmp(t.name, "f/", 2);
  }
  return check_final(h, fin, n_final);
}

dflash_status dflash_hidden_open(const char *dir, dflash_hidden **out) {
  DF_CHECK_ARG(dir && out);
  *out = NULL;
  dflash_hidden *h = calloc(1, sizeof *h);
  if (!h || !(h->dir = df_strdup(dir))) {
    free(h);
    return df_error_nomem("hidden store");
  }
  dflash_status st;
  if (dflash_storage_is_remote(dir)) st = df_rhidden_open(dir, &h->remote);
  else if (df_vhidden_is_layout(dir)) st = df_vhidden_open(dir, &h->vllm);
  else st = dflash_safetensors_open(dir, &h->st);
  if (!st && h->vllm) df_vhidden_info(h->vllm, &h->K, &h->H, &h->dtype, &h->count);
  else if (!st) st = read_header(h);
  if (st) {
    dflash_hidden_free(h);
    return st;
  }
  *out = h;
  return DFLASH_OK;
}

void dflash_hidden_free(dflash_hidden *h) {
  if (!h) return;
  dflash_safetensors_free(h->st);
  df_rhidden_free(h->remote);
  df_vhidden_free(h->vllm);
  df_hidden_record_free(&h->rec);
  free(h->dir);
  free(h);
}

const df_hidden_record *df_hidden_record_of(const dflash_hidden *h) { return &h->rec; }

dflash_status dflash_hidden_get_info(const dflash_hidden *h, dflash_hidden_info *out) {
  DF_CHECK_ARG(h && out);
  dflash_hidden_info info = {.struct_size = sizeof info,
                             .num_layers = h->K,
                             .hidden_size = h->H,
                             .dtype = h->dtype,
                             .count = h->count,
                             .final_state = h->final};
  return df_opts_out(out, &info, sizeof info, "dflash_hidden_info");
}

dflash_status dflash_hidden_id(const dflash_hidden *h, size_t index, const char **id) {
  DF_CHECK_ARG(h && id);
  if (index >= h->count)
    return df_error(DFLASH_E_RANGE, "%s: sample index %zu is outside [0, %zu)", h->dir, index,
                    h->count);
  if (h->vllm) return *id = df_vhidden_id(h->vllm, index), DFLASH_OK;
  dflash_tensor t = {.struct_size = sizeof t};
  tensor_at(h, h->first + index, &t);
  *id = t.name + 2;
  return DFLASH_OK;
}

static dflash_status find(const dflash_hidden *h, const char *prefix, const char *id,
                          dflash_tensor *t) {
  char name[DF_HIDDEN_MAX_ID + 8];
  if (strlen(id) > DF_HIDDEN_MAX_ID)
    return df_error(DFLASH_E_NOT_FOUND, "%s: sample id too long", h->dir);
  snprintf(name, sizeof name, "%s%s", prefix, id);
  t->struct_size = sizeof *t;
  if (tensor_find(h, name, t))
    return df_error(DFLASH_E_NOT_FOUND, "%s: no hidden states for sample %s", h->dir, id);
  return DFLASH_OK;
}

static dflash_status states_tensor(const dflash_hidden *h, const char *id, dflash_tensor *t) {
  dflash_status st = find(h, "h/", id, t);
  if (st) return st;
  dflash_dtype want = h->dtype == DFLASH_DTYPE_BF16 ? DFLASH_DTYPE_BF16 : DFLASH_DTYPE_F8_E4M3;
  if (t->dtype != (int32_t)want || t->ndim != 2 || t->shape[1] != (int64_t)h->K * h->H)
    return df_error(DFLASH_E_FORMAT, "%s: sample %s is not %s [S, %lld]", t->file, id,
                    dflash_dtype_name(want), (long long)h->K * h->H);
  return DFLASH_OK;
}

/* The sample's states tensor, checked to have one row per token of its `len`. */
static dflash_status states_rows(const dflash_hidden *h, const char *id, int64_t len,
                                 dflash_tensor *t) {
  dflash_status st = states_tensor(h, id, t);
  if (st) return st;
  if (t->shape[0] != len)
    return df_error(DFLASH_E_MISMATCH,
                    "sample %s: %lld tokens but %lld rows of hidden states in %s", id,
                    (long long)len, (long long)t->shape[0], t->file);
  return DFLASH_OK;
}

dflash_status dflash_hidden_length(const dflash_hidden *h, const char *sample_id, int64_t *len) {
  DF_CHECK_ARG(h && sample_id && len);
  if (h->vllm) return df_vhidden_length(h->vllm, sample_id, len);
  dflash_tensor t;
  dflash_status st = states_tensor(h, sample_id, &t);
  if (!st) *len = t.shape[0];
  return st;
}

void df_hidden_decode(int32_t K, int32_t H, int32_t dtype, const void *codes, const void *scales,
                      float *out, int64_t len) {
  size_t n = (size_t)len * K * H;
  if (dtype == DFLASH_DTYPE_BF16) {
    const uint16_t *p = codes;
    for (size_t i = 0; i < n; i++) out[i] = df_bf16_to_f32(p[i]);
    return;
  }
  const uint8_t *p = codes;
  const char *sc = scales;
  for (size_t r = 0; r < (size_t)len * K; r++) {
    float scale;
    memcpy(&scale, sc + 4 * r, 4);
    for (int32_t i = 0; i < H; i++) out[r * H + i] = df_e4m3_to_f32(p[r * H + i]) * scale;
  }
}

static dflash_status decode(const dflash_hidden *h, const void *codes, const void *scales,
                            float *out, int64_t len) {
  df_hidden_decode(h->K, h->H, h->dtype, codes, scales, out, len);
  return DFLASH_OK;
}

static dflash_status check_scales(const dflash_hidden *h, const char *sample_id,
                                  const dflash_tensor *s, int64_t len) {
  if (s->dtype != DFLASH_DTYPE_F32 || s->ndim != 2 || s->shape[0] != len || s->shape[1] != h->K)
    return df_error(DFLASH_E_FORMAT, "%s: scales of sample %s are not F32 [%lld, %d]", s->file,
                    sample_id, (long long)len, h->K);
  return DFLASH_OK;
}

/* A remote sample: its codes (and scales) with ranged GETs, then decoded. */
static dflash_status read_remote(const dflash_hidden *h, const char *sample_id,
                                 const dflash_tensor *t, float *out, int64_t len) {
  dflash_tensor s = {.struct_size = sizeof s};
  bool fp8 = h->dtype != DFLASH_DTYPE_BF16;
  dflash_status st = fp8 ? find(h, "s/", sample_id, &s) : DFLASH_OK;
  if (!st && fp8) st = check_scales(h, sample_id, &s, len);
  if (st) return st;
  void *codes = malloc(t->nbytes ? t->nbytes : 1), *scales = fp8 ? malloc(s.nbytes) : NULL;
  if (!codes || (fp8 && !scales)) st = df_error_nomem("hidden states");
  if (!st) st = df_rhidden_read(h->remote, t->name, codes, t->nbytes);
  if (!st && fp8) st = df_rhidden_read(h->remote, s.name, scales, s.nbytes);
  if (!st) st = decode(h, codes, scales, out, len);
  free(codes);
  free(scales);
  return st;
}

dflash_status dflash_hidden_read(const dflash_hidden *h, const char *sample_id, float *out,
                                 int64_t len) {
  DF_CHECK_ARG(h && sample_id && out);
  if (h->vllm) return df_vhidden_read(h->vllm, sample_id, out, len);
  dflash_tensor t, s;
  dflash_status st = states_rows(h, sample_id, len, &t);
  if (st) return st;
  if (h->remote) return read_remote(h, sample_id, &t, out, len);
  if (h->dtype == DFLASH_DTYPE_BF16) return decode(h, t.data, NULL, out, len);
  if ((st = find(h, "s/", sample_id, &s)) || (st = check_scales(h, sample_id, &s, len))) return st;
  return decode(h, t.data, s.data, out, len); /* scales may sit at any byte offset */
}

dflash_status df_hidden_read_codes(const dflash_hidden *h, const char *sample_id, int64_t len,
                                   void *codes, float *scales) {
  if (h->vllm) return df_error(DFLASH_E_UNSUPPORTED, "%s: a vLLM store gives float32 only", h->dir);
  dflash_tensor t, s = {.struct_size = sizeof s};
  dflash_status st = states_rows(h, sample_id, len, &t);
  if (st) return st;
  bool fp8 = h->dtype != DFLASH_DTYPE_BF16;
  if (fp8 && ((st = find(h, "s/", sample_id, &s)) || (st = check_scales(h, sample_id, &s, len))))
    return st;
  if (h->remote) {
    st = df_rhidden_read(h->remote, t.name, codes, t.nbytes);
    if (!st && fp8) st = df_rhidden_read(h->remote, s.name, scales, s.nbytes);
    return st;
  }
  memcpy(codes, t.data, t.nbytes);
  if (fp8) memcpy(scales, s.data, s.nbytes); /* scales may sit at any byte offset */
  return DFLASH_OK;
}

bool df_hidden_has_codes(const dflash_hidden *h) { return !h->vllm; }

dflash_status df_hidden_bind_tokens(dflash_hidden *h, const dflash_dataset *tokens) {
  return h->vllm ? df_vhidden_bind(h->vllm, tokens) : DFLASH_OK;
}

dflash_hidden_target_ids dflash_hidden_has_target_ids(const dflash_hidden *h) {
  if (!h) return DFLASH_HIDDEN_TARGET_IDS_NONE;
  if (h->vllm) return DFLASH_HIDDEN_TARGET_IDS_VLLM;
  return h->n_tids > 0 ? DFLASH_HIDDEN_TARGET_IDS_STORED : DFLASH_HIDDEN_TARGET_IDS_NONE;
}

dflash_status dflash_hidden_read_target_ids(const dflash_hidden *h, const char *sample_id,
                                            int32_t *out, int64_t len) {
  DF_CHECK_ARG(h && sample_id && out);
  dflash_tensor t;
  if (h->vllm || find(h, "t/", sample_id, &t))
    return df_error(DFLASH_E_NOT_FOUND,
                    "%s: no stored target ids for sample %s (written "
                    "without target_ids)",
                    h->dir, sample_id);
  if (t.dtype != DFLASH_DTYPE_I32 || t.ndim != 1 || t.shape[0] != len)
    return df_error(DFLASH_E_FORMAT, "%s: target ids of sample %s are not I32 [%lld]", t.file,
                    sample_id, (long long)len);
  if (h->remote) return df_rhidden_read(h->remote, t.name, out, (size_t)len * 4);
  memcpy(out, t.data, (size_t)len * 4); /* any byte offset */
  return DFLASH_OK;
}

dflash_status dflash_hidden_read_final(const dflash_hidden *h, const char *sample_id, float *out,
                                       int64_t len) {
  DF_CHECK_ARG(h && sample_id && out);
  if (!h->vllm)
    return df_error(DFLASH_E_UNSUPPORTED,
                    "%s: a libdflash store keeps no final layer (only "
                    "vLLM's hs_*.safetensors files do)",
                    h->dir);
  return df_vhidden_read_final(h->vllm, sample_id, out, len);
}

dflash_status dflash_hidden_read_final_state(const dflash_hidden *h, const char *sample_id,
                                             float *out, int64_t len) {
  DF_CHECK_ARG(h && sample_id && out);
  if (!h->final)
    return df_error(DFLASH_E_NOT_FOUND,
                    "%s: the store holds no target final state (written without final_state%s)",
                    h->dir, h->vllm ? "; vLLM's final slot is the raw layer output" : "");
  dflash_tensor t, s = {.struct_size = sizeof s};
  bool fp8 = h->dtype != DFLASH_DTYPE_BF16;
  dflash_dtype want = fp8 ? DFLASH_DTYPE_F8_E4M3 : DFLASH_DTYPE_BF16;
  dflash_status st = find(h, "f/", sample_id, &t);
  if (st) {
    /* The store declares it for every sample: a missing one is a broken store. */
    dflash_status hs = find(h, "h/", sample_id, &s);
    if (hs) return hs;
    dflash_clear_error();
    return df_error(DFLASH_E_FORMAT,
                    "%s: sample %s has no final state (f/%s), though the store declares %s", s.file,
                    sample_id, sample_id, DF_HIDDEN_FINAL_KEY);
  }
  if (t.dtype != (int32_t)want || t.ndim != 2 || t.shape[0] != len || t.shape[1] != h->H)
    return df_error(DFLASH_E_FORMAT, "%s: final state of sample %s is not %s [%lld, %d]", t.file,
                    sample_id, dflash_dtype_name(want), (long long)len, h->H);
  if (fp8) {
    if (find(h, "fs/", sample_id, &s))
      return dflash_clear_error(),
             df_error(DFLASH_E_FORMAT, "%s: final state of sample %s lacks its scales (fs/%s)",
                      t.file, sample_id, sample_id);
    if (s.dtype != DFLASH_DTYPE_F32 || s.ndim != 2 || s.shape[0] != len || s.shape[1] != 1)
      return df_error(DFLASH_E_FORMAT, "%s: final-state scales of sample %s are not F32 [%lld, 1]",
                      s.file, sample_id, (long long)len);
  }
  if (!h->remote) {
    df_hidden_decode(1, h->H, h->dtype, t.data, fp8 ? s.data : NULL, out, len);
    return DFLASH_OK;
  }
  void *codes = malloc(t.nbytes ? t.nbytes : 1), *scales = fp8 ? malloc(s.nbytes) : NULL;
  st = codes && (!fp8 || scales) ? DFLASH_OK : df_error_nomem("final state");
  if (!st) st = df_rhidden_read(h->remote, t.name, codes, t.nbytes);
  if (!st && fp8) st = df_rhidden_read(h->remote, s.name, scales, s.nbytes);
  if (!st) df_hidden_decode(1, h->H, h->dtype, codes, scales, out, len);
  free(codes);
  free(scales);
  return st;
}
