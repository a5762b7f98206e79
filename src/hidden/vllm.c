/*
 * vLLM's hidden-state files as a hidden-state store: a folder of hs_{idx}.safetensors as
 * vLLM's extract_hidden_states connector and speculators' generate-offline-data write them,
 * `hidden_states` [T, K+1, H] in the model dtype (BF16, F16, F32) or F8_E4M3 with
 * `hidden_states_scales` [T, 1, 1], and `token_ids` I64 [T]. The last of the K+1 slots is the
 * target's final layer (not a drafter input: only the first K are read). The files carry no
 * sample ids, so they are joined with a tokenized dataset by token ids (df_vhidden_bind):
 * a dataset sample with no file of the same ids is reported by its id, never trained.
 * Files are opened per read (a large dump has more files than a process may map at once).
 */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hidden.h"
#include "core/bf16.h"

typedef struct vfile {
  char *stem;  /* "hs_12": the store's id for the file */
  char *alias; /* the dataset sample joined to it (df_vhidden_bind), or NULL */
  int64_t T;
  uint64_t hash; /* of its token ids */
} vfile;

struct df_vhidden {
  char *dir;
  int32_t K, H;
  bool fp8;
  vfile *files;
  size_t n;
  size_t *by_alias; /* file indices sorted by alias, after bind */
  size_t n_alias;
  size_t *by_hash; /* file indices sorted by token-id hash */
};

int dflash_hidden_is_vllm_file(const char *name) {
  if (!name) return 0;
  size_t n = strlen(name);
  if (n <= 3 + 12 || strncmp(name, "hs_", 3) || strcmp(name + n - 12, ".safetensors")) return false;
  for (size_t i = 3; i < n - 12; i++)
    if (name[i] < '0' || name[i] > '9') return 0;
  return 1;
}

dflash_hidden_layout dflash_hidden_layout_of(const char *dir) {
  if (!dir) return DFLASH_HIDDEN_LAYOUT_NONE;
  char *index = df_path_join(dir, DF_HIDDEN_INDEX);
  FILE *f = index ? fopen(index, "r") : NULL;
  free(index);
  if (f) return fclose(f), DFLASH_HIDDEN_LAYOUT_STORE;
  DIR *d = opendir(dir);
  bool found = false;
  for (struct dirent *e; d && !found && (e = readdir(d));)
    found = dflash_hidden_is_vllm_file(e->d_name);
  if (d) closedir(d);
  return found ? DFLASH_HIDDEN_LAYOUT_VLLM : DFLASH_HIDDEN_LAYOUT_NONE;
}

bool df_vhidden_is_layout(const char *dir) {
  return dflash_hidden_layout_of(dir) == DFLASH_HIDDEN_LAYOUT_VLLM;
}

/* FNV-1a over the ids as int64, so int32 dataset ids and int64 file ids hash alike. */
static uint64_t hash_ids(const void *ids, int64_t n, bool wide) {
  uint64_t h = 1469598103934665603ULL;
  for (int64_t i = 0; i < n; i++) {
    int64_t v = wide ? ((const int64_t *)ids)[i] : ((const int32_t *)ids)[i];
    for (int b = 0; b < 8; b++) h = (h ^ (uint8_t)(v >> (8 * b))) * 1099511628211ULL;
  }
  return h;
}

static dflash_status tensor(const dflash_safetensors *st, const char *path, const char *name,
                            dflash_tensor *t) {
  t->struct_size = sizeof *t;
  if (dflash_safetensors_find(st, name, t))
    return df_error(DFLASH_E_FORMAT,
                    "%s: no tensor \"%s\" (a vLLM hidden-state file has "
                    "hidden_states [T, K+1, H] and token_ids [T])",
                    path, name);
  return DFLASH_OK;
}

/* The file's shapes against the store's (K, H, fp8 set by the first file when K == 0). */
static dflash_status check_file(df_vhidden *v, const char *path, const dflash_tensor *hs,
                                const dflash_tensor *ids, const dflash_safetensors *st) {
  bool fp8 = hs->dtype == DFLASH_DTYPE_F8_E4M3;
  if (hs->ndim != 3 || hs->shape[1] < 2 ||
      (hs->dtype != DFLASH_DTYPE_BF16 && hs->dtype != DFLASH_DTYPE_F16 &&
       hs->dtype != DFLASH_DTYPE_F32 && !fp8))
    return df_error(DFLASH_E_FORMAT,
                    "%s: hidden_states is %s with %u dims, not BF16/F16/F32/"
                    "F8_E4M3 [T, K+1, H] with K >= 1",
                    path, dflash_dtype_name(hs->dtype), hs->ndim);
  if (ids->dtype != DFLASH_DTYPE_I64 || ids->ndim != 1 || ids->shape[0] != hs->shape[0])
    return df_error(DFLASH_E_FORMAT, "%s: token_ids is not I64 [%lld]", path,
                    (long long)hs->shape[0]);
  if (fp8) {
    dflash_tensor sc;
    dflash_status s = tensor(st, path, "hidden_states_scales", &sc);
    if (s) return s;
    if (sc.dtype != DFLASH_DTYPE_F32 || sc.ndim != 3 || sc.shape[0] != hs->shape[0] ||
        sc.shape[1] != 1 || sc.shape[2] != 1)
      return df_error(DFLASH_E_FORMAT, "%s: hidden_states_scales is not F32 [%lld, 1, 1]", path,
                      (long long)hs->shape[0]);
  }
  int32_t K = (int32_t)hs->shape[1] - 1, H = (int32_t)hs->shape[2];
  if (!v->K) v->K = K, v->H = H, v->fp8 = fp8;
  if (K != v->K || H != v->H || fp8 != v->fp8)
    return df_error(DFLASH_E_MISMATCH,
                    "%s: hidden_states [T, %d, %d] %s, the folder's first "
                    "file has [T, %d, %d] %s",
                    path, K + 1, H, dflash_dtype_name(hs->dtype), v->K + 1, v->H,
                    v->fp8 ? "F8_E4M3" : "(16/32-bit)");
  return DFLASH_OK;
}

static dflash_status scan_file(df_vhidden *v, vfile *f) {
  char name[64];
  snprintf(name, sizeof name, "%s.safetensors", f->stem);
  char *path = df_path_join(v->dir, name);
  if (!path) return df_error_nomem("path");
  dflash_safetensors *st = NULL;
  dflash_tensor hs, ids;
  dflash_status s = dflash_safetensors_open(path, &st);
  if (!s) s = tensor(st, path, "hidden_states", &hs);
  if (!s) s = tensor(st, path, "token_ids", &ids);
  if (!s) s = check_file(v, path, &hs, &ids, st);
  if (!s) f->T = hs.shape[0], f->hash = hash_ids(ids.data, f->T, true);
  dflash_safetensors_free(st);
  free(path);
  return s;
}

static int cmp_stem(const void *a, const void *b) {
  const vfile *x = a, *y = b;
  size_t nx = strlen(x->stem), ny = strlen(y->stem);
  return nx != ny ? (nx < ny ? -1 : 1) : strcmp(x->stem, y->stem); /* hs_2 before hs_10 */
}

static dflash_status list_files(df_vhidden *v) {
  DIR *d = opendir(v->dir);
  if (!d) return df_error_errno(DFLASH_E_IO, errno, "%s", v->dir);
  size_t cap = 0;
  dflash_status s = DFLASH_OK;
  for (struct dirent *e; !s && (e = readdir(d));) {
    if (!dflash_hidden_is_vllm_file(e->d_name)) continue;
    if (v->n == cap) {
      vfile *more = realloc(v->files, (cap = cap ? 2 * cap : 64) * sizeof *more);
      if (!more) s = df_error_nomem("vLLM file list");
      else v->files = more;
    }
    if (s) break;
    vfile *f = &v->files[v->n];
    memset(f, 0, sizeof *f);
    f->stem = df_strndup(e->d_name, strlen(e->d_name) - 12);
    if (!f->stem) s = df_error_nomem("vLLM file list");
    else v->n++;
  }
  closedir(d);
  if (!s) qsort(v->files, v->n, sizeof *v->files, cmp_stem);
  return s;
}

static int cmp_hash(const void *a, const void *b, void *ctx) {
  const vfile *x = (const vfile *)ctx + *(const size_t *)a,
              *y = (const vfile *)ctx + *(const size_t *)b;
  return x->hash != y->hash ? (x->hash < y->hash ? -1 : 1) : 0;
}

void df_vhidden_free(df_vhidden *v) {
  if (!v) return;
  for (size_t i = 0; i < v->n; i++) free(v->files[i].stem), free(v->files[i].alias);
  free(v->files);
  free(v->by_alias);
  free(v->by_hash);
  free(v->dir);
  free(v);
}

dflash_status df_vhidden_open(const char *dir, df_vhidden **out) {
  df_vhidden *v = calloc(1, sizeof *v);
  dflash_status s = v && (v->dir = df_strdup(dir)) ? list_files(v) : df_error_nomem("store");
  for (size_t i = 0; !s && i < v->n; i++) s = scan_file(v, &v->files[i]);
  if (!s && !v->n) s = df_error(DFLASH_E_NOT_FOUND, "%s: no hs_*.safetensors files", dir);
  if (!s && !(v->by_hash = malloc(v->n * sizeof *v->by_hash))) s = df_error_nomem("vLLM index");
  for (size_t i = 0; !s && i < v->n; i++) v->by_hash[i] = i;
  if (!s) qsort_r(v->by_hash, v->n, sizeof *v->by_hash, cmp_hash, v->files);
  if (s) {
    df_vhidden_free(v);
    return s;
  }
  *out = v;
  return DFLASH_OK;
}

void df_vhidden_info(const df_vhidden *v, int32_t *K, int32_t *H, int32_t *dtype, size_t *n) {
  if (K) *K = v->K;
  if (H) *H = v->H;
  if (dtype) *dtype = v->fp8 ? DFLASH_DTYPE_F8_E4M3 : DFLASH_DTYPE_BF16;
  if (n) *n = v->n;
}

const char *df_vhidden_id(const df_vhidden *v, size_t i) { return v->files[i].stem; }

static int cmp_alias(const void *a, const void *b, void *ctx) {
  const vfile *files = ctx;
  return strcmp(files[*(const size_t *)a].alias, files[*(const size_t *)b].alias);
}

/* The first unclaimed file whose ids hash to `h` over `len` tokens, or NULL. */
static vfile *unclaimed(df_vhidden *v, uint64_t h, int64_t len, size_t *index) {
  size_t lo = 0, hi = v->n;
  while (lo < hi) { /* first position with hash >= h */
    size_t mid = (lo + hi) / 2;
    if (v->files[v->by_hash[mid]].hash < h) lo = mid + 1;
    else hi = mid;
  }
  for (; lo < v->n && v->files[v->by_hash[lo]].hash == h; lo++) {
    vfile *f = &v->files[v->by_hash[lo]];
    if (!f->alias && f->T == len) return *index = v->by_hash[lo], f;
  }
  return NULL;
}

/* The file for `id`: a dataset id once bound, else the file's own stem; NULL if none. */
static const vfile *lookup(const df_vhidden *v, const char *id) {
  size_t lo = 0, hi = v->n_alias;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    int c = strcmp(v->files[v->by_alias[mid]].alias, id);
    if (!c) return &v->files[v->by_alias[mid]];
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  vfile key = {.stem = (char *)id};
  return bsearch(&key, v->files, v->n, sizeof *v->files, cmp_stem);
}

dflash_status df_vhidden_bind(df_vhidden *v, const dflash_dataset *tokens) {
  size_t n = dflash_dataset_count(tokens);
  free(v->by_alias);
  v->by_alias = malloc((n ? n : 1) * sizeof *v->by_alias);
  if (!v->by_alias) return df_error_nomem("vLLM join");
  v->n_alias = 0;
  for (size_t i = 0; i < n; i++) {
    const char *id;
    const int32_t *ids;
    const uint8_t *mask;
    size_t n_ids;
    dflash_status st = dflash_dataset_sample(tokens, i, &ids, &mask, &n_ids, &id);
    if (st) return st;
    int64_t len = (int64_t)n_ids;
    size_t k;
    vfile *f = unclaimed(v, hash_ids(ids, len, false), len, &k);
    if (!f) continue; /* reported by id when the sample is read */
    if (!(f->alias = df_strdup(id))) return df_error_nomem("vLLM join");
    v->by_alias[v->n_alias++] = k;
  }
  qsort_r(v->by_alias, v->n_alias, sizeof *v->by_alias, cmp_alias, v->files);
  return DFLASH_OK;
}

dflash_status df_vhidden_length(const df_vhidden *v, const char *id, int64_t *len) {
  const vfile *f = lookup(v, id);
  if (!f)
    return df_error(DFLASH_E_NOT_FOUND,
                    "sample %s: no hs_*.safetensors file in %s has its "
                    "token ids (tokenized differently from what the target saw?)",
                    id, v->dir);
  *len = f->T;
  return DFLASH_OK;
}

static float element(const dflash_tensor *hs, size_t i) {
  switch (hs->dtype) {
  case DFLASH_DTYPE_BF16: return df_bf16_to_f32(((const uint16_t *)hs->data)[i]);
  case DFLASH_DTYPE_F16: return df_f16_to_f32(((const uint16_t *)hs->data)[i]);
  case DFLASH_DTYPE_F32: return ((const float *)hs->data)[i];
  default: return df_e4m3_to_f32(((const uint8_t *)hs->data)[i]);
  }
}

/* Slots [k0, k0+nk) of each row into out [T, nk*H] (the drafter's K, or the final one). */
static dflash_status read_slots(const df_vhidden *v, const char *id, float *out, int64_t len,
                                size_t k0, size_t nk) {
  int64_t T = 0;
  dflash_status s = df_vhidden_length(v, id, &T);
  if (s) return s;
  if (T != len)
    return df_error(DFLASH_E_MISMATCH, "sample %s: %lld tokens but %lld rows of hidden states", id,
                    (long long)len, (long long)T);
  const vfile *f = lookup(v, id);
  char name[64];
  snprintf(name, sizeof name, "%s.safetensors", f->stem);
  char *path = df_path_join(v->dir, name);
  dflash_safetensors *st = NULL;
  dflash_tensor hs, sc = {0};
  s = path ? dflash_safetensors_open(path, &st) : df_error_nomem("path");
  if (!s) s = tensor(st, path, "hidden_states", &hs);
  if (!s && v->fp8) s = tensor(st, path, "hidden_states_scales", &sc);
  size_t K = (size_t)v->K, H = (size_t)v->H;
  for (size_t t = 0; !s && t < (size_t)T; t++) {
    float scale = 1.0f;
    if (v->fp8) memcpy(&scale, (const char *)sc.data + 4 * t, 4);
    for (size_t k = 0; k < nk; k++)
      for (size_t i = 0; i < H; i++)
        out[(t * nk + k) * H + i] = element(&hs, (t * (K + 1) + k0 + k) * H + i) * scale;
  }
  dflash_safetensors_free(st);
  free(path);
  return s;
}

/* The drafter's K layers: slots 0..K-1 (slot K, the final layer, is dropped). */
dflash_status df_vhidden_read(const df_vhidden *v, const char *id, float *out, int64_t len) {
  return read_slots(v, id, out, len, 0, (size_t)v->K);
}

/* The target's final layer: slot K, the labels' source for --labels target. */
dflash_status df_vhidden_read_final(const df_vhidden *v, const char *id, float *out, int64_t len) {
  return read_slots(v, id, out, len, (size_t)v->K, 1);
}
