/*
 * Checkpoints: a directory SGLang/vLLM load (config.json + model.safetensors
 * with the spec's tensor names), and a training-state file (master weights,
 * AdamW moments, step, caller blob for data position and RNG) from which a
 * killed run resumes bit for bit.
 */
#include "backend.h"

#include <dflash/safetensors.h>
#include <dflash/storage.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/bf16.h"
#include "remote_files.h"

#define STATE_FORMAT "dflash-train-state-1"

static dflash_status ensure_dir(const char *dir) { return df_mkdir_p(dir); }

/* Stream `n` floats as F32 or BF16 through the writer. */
static dflash_status write_floats(dflash_safetensors_writer *w, const float *x, size_t n,
                                  bool bf16) {
  if (!bf16) return dflash_safetensors_writer_write(w, x, n * sizeof(float));
  uint16_t buf[4096];
  for (size_t i = 0; i < n; i += DF_ARRAY_LEN(buf)) {
    size_t k = n - i < DF_ARRAY_LEN(buf) ? n - i : DF_ARRAY_LEN(buf);
    for (size_t j = 0; j < k; j++) buf[j] = df_f32_to_bf16(x[i + j]);
    dflash_status st = dflash_safetensors_writer_write(w, buf, k * sizeof(uint16_t));
    if (st) return st;
  }
  return DFLASH_OK;
}

static dflash_status write_model(const df_model *m, const char *path, bool bf16) {
  dflash_safetensors_writer *w;
  dflash_status st = dflash_safetensors_writer_create(path, &w);
  if (st) return st;
  st = dflash_safetensors_writer_metadata(w, "format", "pt");
  for (size_t i = 0; !st && i < m->n_tensors; i++) {
    const df_tensor_info *t = &m->tensors[i];
    st = dflash_safetensors_writer_declare(w, t->name, bf16 ? DFLASH_DTYPE_BF16 : DFLASH_DTYPE_F32,
                                           (uint32_t)t->ndim, t->shape);
  }
  /* A pruned draft vocabulary (spec/dspark.md section 5): its LM head rows, d2t as offsets
   * (target id = i + d2t[i]) and t2d. */
  int64_t vd = m->Vd, v = m->V, head[2] = {m->Vd, m->H};
  if (!st && m->kept) {
    st = dflash_safetensors_writer_declare(w, "lm_head.weight",
                                           bf16 ? DFLASH_DTYPE_BF16 : DFLASH_DTYPE_F32, 2, head);
    if (!st) st = dflash_safetensors_writer_declare(w, "d2t", DFLASH_DTYPE_I64, 1, &vd);
    if (!st) st = dflash_safetensors_writer_declare(w, "t2d", DFLASH_DTYPE_BOOL, 1, &v);
  }
  for (size_t i = 0; !st && i < m->n_tensors; i++)
    st = write_floats(w, m->params + m->tensors[i].offset, m->tensors[i].numel, bf16);
  if (!st && m->kept) {
    st = write_floats(w, m->lm_head, (size_t)m->Vd * (size_t)m->H, bf16);
    int64_t *d2t = malloc(sizeof(int64_t) * (size_t)m->Vd);
    uint8_t *t2d = malloc((size_t)m->V);
    if (!st && (!d2t || !t2d)) st = df_error_nomem("d2t / t2d");
    for (int i = 0; !st && i < m->Vd; i++) d2t[i] = (int64_t)m->kept[i] - i;
    for (int i = 0; !st && i < m->V; i++) t2d[i] = m->t2d[i] >= 0;
    if (!st) st = dflash_safetensors_writer_write(w, d2t, sizeof(int64_t) * (size_t)m->Vd);
    if (!st) st = dflash_safetensors_writer_write(w, t2d, (size_t)m->V);
    free(d2t), free(t2d);
  }
  if (!st) st = dflash_safetensors_writer_commit(w);
  dflash_safetensors_writer_free(w);
  return st;
}

dflash_status dflash_trainer_save(const dflash_trainer *t, const char *dir, int32_t bf16) {
  DF_CHECK_ARG(t && dir);
  if (dflash_storage_is_remote(dir)) return df_remote_save(t, dir, bf16);
  /* A config that cannot be written (no num_target_layers, ...) fails
   * before anything lands in `dir`. */
  size_t json_len = 0;
  dflash_status st = dflash_drafter_config_to_json(&t->m.cfg, NULL, 0, &json_len);
  if (st != DFLASH_E_BUFFER)
    return df_error_wrap(st ? st : DFLASH_E_INTERNAL, "saving checkpoint %s", dir);
  dflash_clear_error();
  st = ensure_dir(dir);
  if (!st) st = df_trainer_pull(t, DF_BUF_PARAMS);
  if (st) return st;
  char *model = df_path_join(dir, "model.safetensors"), *cfg = df_path_join(dir, "config.json");
  if (!model || !cfg) st = df_error_nomem("checkpoint paths");
  /* Weights first: config.json is what makes the directory loadable. */
  if (!st) st = write_model(&t->m, model, bf16 != 0);
  if (!st) st = df_drafter_config_save_dtype(&t->m.cfg, bf16 ? "bfloat16" : "float32", cfg);
  if (st) df_error_wrap(st, "saving checkpoint %s", dir);
  free(model);
  free(cfg);
  return st;
}

/* Convert a stored tensor (F32, BF16 or F16) into floats. */
static dflash_status read_floats(const dflash_tensor *src, float *out, size_t n) {
  if (src->nbytes != n * dflash_dtype_size(src->dtype))
    return df_error(DFLASH_E_MISMATCH, "%s: tensor %s holds %llu bytes, expected %zu elements",
                    src->file, src->name, (unsigned long long)src->nbytes, n);
  switch (src->dtype) {
  case DFLASH_DTYPE_F32: memcpy(out, src->data, n * sizeof(float)); return DFLASH_OK;
  case DFLASH_DTYPE_BF16: {
    const uint16_t *p = src->data;
    for (size_t i = 0; i < n; i++) out[i] = df_bf16_to_f32(p[i]);
    return DFLASH_OK;
  }
  case DFLASH_DTYPE_F16: {
    const uint16_t *p = src->data;
    for (size_t i = 0; i < n; i++) out[i] = df_f16_to_f32(p[i]);
    return DFLASH_OK;
  }
  default:
    return df_error(DFLASH_E_DTYPE, "%s: tensor %s has dtype %s (F32, BF16 or F16 expected)",
                    src->file, src->name, dflash_dtype_name(src->dtype));
  }
}

dflash_status df_read_float_tensor(const dflash_safetensors *st, const char *name, int ndim,
                                   const int64_t *shape, float *out) {
  dflash_tensor src = {.struct_size = sizeof src};
  dflash_status s = dflash_safetensors_find(st, name, &src);
  return s ? s : df_tensor_floats(&src, name, ndim, shape, out);
}

dflash_status df_tensor_floats(const dflash_tensor *t, const char *name, int ndim,
                               const int64_t *shape, float *out) {
  const dflash_tensor src = *t;
  size_t n = 1;
  bool same = (int)src.ndim == ndim;
  for (int d = 0; d < ndim; d++) {
    n *= (size_t)shape[d];
    same = same && src.shape[d] == shape[d];
  }
  if (!same)
    return df_error(DFLASH_E_MISMATCH,
                    "%s: tensor %s has the wrong shape for this config "
                    "(expected %lld x %lld)",
                    src.file, name, (long long)shape[0], (long long)(ndim > 1 ? shape[1] : 1));
  return read_floats(&src, out, n);
}

/* An s3:// checkpoint (prefix or .safetensors object) or state: read from a
 * copy in the cache directory. */
static dflash_status load_remote(dflash_trainer *t, const char *url, bool state, void *user,
                                 size_t cap, size_t *user_len) {
  char *local = NULL;
  bool object = state || df_str_ends_with(url, ".safetensors");
  dflash_status s = df_remote_fetch(url, object ? NULL : "model.safetensors", &local);
  if (!s)
    s = state ? dflash_trainer_load_state(t, local, user, cap, user_len)
              : dflash_trainer_load(t, local);
  free(local);
  return s;
}

/* A checkpoint's pruned-vocabulary tables (spec/dspark.md section 5) into kept [m->Vd], each
 * refused naming the tensor: absent, another dtype, length or shape, an id out of range, not
 * ascending or repeated, t2d other than d2t's ids. A drafter that is not pruned refuses d2t. */
static dflash_status read_draft_vocab(const df_model *m, const dflash_safetensors *st,
                                      const char *path, int32_t *kept) {
  dflash_tensor d = {.struct_size = sizeof d}, tt = {.struct_size = sizeof tt};
  bool has_d2t = !dflash_safetensors_find(st, "d2t", &d);
  dflash_clear_error();
  if (!m->kept) {
    if (has_d2t)
      return df_error(DFLASH_E_MISMATCH,
                      "%s: the checkpoint has a pruned draft vocabulary (tensor d2t) but this "
                      "drafter's config has none (draft_vocab_size)",
                      path);
    return DFLASH_OK;
  }
  if (!has_d2t)
    return df_error(DFLASH_E_NOT_FOUND,
                    "%s: checkpoint lacks tensor d2t (draft_vocab_size %d below vocab_size %d)",
                    path, m->Vd, m->V);
  if (dflash_safetensors_find(st, "t2d", &tt))
    return df_error(DFLASH_E_NOT_FOUND, "%s: checkpoint lacks tensor t2d", path);
  if (d.dtype != DFLASH_DTYPE_I64)
    return df_error(DFLASH_E_DTYPE, "%s: tensor d2t has dtype %s (I64 expected)", path,
                    dflash_dtype_name(d.dtype));
  if (tt.dtype != DFLASH_DTYPE_BOOL)
    return df_error(DFLASH_E_DTYPE, "%s: tensor t2d has dtype %s (BOOL expected)", path,
                    dflash_dtype_name(tt.dtype));
  if (d.ndim != 1 || d.shape[0] != m->Vd)
    return df_error(DFLASH_E_MISMATCH,
                    "%s: tensor d2t must be [%d] (draft_vocab_size), got %u dims, first %lld", path,
                    m->Vd, d.ndim, (long long)(d.ndim ? d.shape[0] : 0));
  if (tt.ndim != 1 || tt.shape[0] != m->V)
    return df_error(DFLASH_E_MISMATCH,
                    "%s: tensor t2d must be [%d] (vocab_size), got %u dims, first %lld", path, m->V,
                    tt.ndim, (long long)(tt.ndim ? tt.shape[0] : 0));
  const int64_t *off = d.data;
  for (int i = 0; i < m->Vd; i++) {
    int64_t id;
    memcpy(&id, off + i, sizeof id); /* the mapped tensor may be misaligned */
    id += i;
    if (id < 0 || id >= m->V)
      return df_error(DFLASH_E_FORMAT,
                      "%s: tensor d2t: entry %d maps to target id %lld, outside the vocabulary "
                      "[0, %d) (d2t holds offsets: id = i + d2t[i])",
                      path, i, (long long)id, m->V);
    kept[i] = (int32_t)id;
  }
  char what[600];
  snprintf(what, sizeof what, "%s: tensor d2t", path);
  dflash_status s = df_draft_vocab_check(kept, m->Vd, m->V, what);
  if (s) return s;
  const uint8_t *mask = tt.data;
  for (int v = 0, i = 0; v < m->V; v++) {
    bool in = i < m->Vd && kept[i] == v;
    if (in) i++;
    if ((mask[v] != 0) != in)
      return df_error(DFLASH_E_FORMAT, "%s: tensor t2d[%d] is %s but d2t %s id %d", path, v,
                      mask[v] ? "true" : "false", in ? "keeps" : "does not keep", v);
  }
  dflash_tensor h = {.struct_size = sizeof h};
  if (!dflash_safetensors_find(st, "lm_head.weight", &h) &&
      (h.ndim != 2 || h.shape[0] != m->Vd || h.shape[1] != m->H))
    return df_error(DFLASH_E_MISMATCH,
                    "%s: tensor lm_head.weight must be [%d, %d] (draft_vocab_size, hidden_size)",
                    path, m->Vd, m->H);
  dflash_clear_error();
  return DFLASH_OK;
}

dflash_status dflash_trainer_load(dflash_trainer *t, const char *path) {
  DF_CHECK_ARG(t && path);
  if (dflash_storage_is_remote(path)) return load_remote(t, path, false, NULL, 0, NULL);
  dflash_safetensors *st;
  dflash_status s = dflash_safetensors_open(path, &st);
  if (s) return s;
  df_model *m = &t->m;
  /* Read into a copy so a failure leaves the parameters untouched. */
  float *tmp = malloc(m->n_params * sizeof(float));
  int32_t *kept = m->kept ? malloc(sizeof(int32_t) * (size_t)m->Vd) : NULL;
  if (!tmp || (m->kept && !kept)) s = df_error_nomem("checkpoint parameters");
  /* A pruned draft vocabulary's tables first: a mismatch there explains the shapes after. */
  if (!s) s = read_draft_vocab(m, st, path, kept);
  for (size_t i = 0; !s && i < m->n_tensors; i++) {
    const df_tensor_info *ti = &m->tensors[i];
    s = df_read_float_tensor(st, ti->name, ti->ndim, ti->shape, tmp + ti->offset);
    if (s == DFLASH_E_NOT_FOUND) {
      /* Some trainers save under a "model." prefix. */
      char alt[128];
      snprintf(alt, sizeof alt, "model.%s", ti->name);
      s = df_read_float_tensor(st, alt, ti->ndim, ti->shape, tmp + ti->offset);
      /* DFlash 2's codebooks are nn.Embedding modules: a writer that does not
       * map them back as z-lab's from_pretrained does names them ".weight". */
      size_t nl = strlen(ti->name);
      if (s == DFLASH_E_NOT_FOUND && nl > 9 && !strcmp(ti->name + nl - 9, "_codebook")) {
        snprintf(alt, sizeof alt, "%s.weight", ti->name);
        s = df_read_float_tensor(st, alt, ti->ndim, ti->shape, tmp + ti->offset);
      }
      if (s == DFLASH_E_NOT_FOUND)
        s = df_error(DFLASH_E_NOT_FOUND, "%s: checkpoint lacks tensor %s", path, ti->name);
    }
  }
  /* The tables set the head rows once every tensor has been read (nothing fails past it). */
  if (!s && kept) s = df_model_set_draft_vocab(m, kept, path);
  free(kept);
  if (!s) memcpy(m->params, tmp, m->n_params * sizeof(float));
  if (!s) s = df_trainer_push(t, DF_BUF_PARAMS);
  free(tmp);
  dflash_safetensors_free(st);
  return s;
}

/* ---- training state ------------------------------------------------------- */

dflash_status dflash_trainer_save_state(const dflash_trainer *t, const char *path, const void *user,
                                        size_t user_len) {
  DF_CHECK_ARG(t && path && (user || user_len == 0));
  if (dflash_storage_is_remote(path)) return df_remote_save_state(t, path, user, user_len);
  const df_model *m = &t->m;
  char num[64];
  dflash_safetensors_writer *w;
  dflash_status st = df_trainer_pull(t, DF_BUF_PARAMS | DF_BUF_M1 | DF_BUF_M2);
  if (!st && (t->be->not_on_host & (DF_BUF_M1 | DF_BUF_M2)))
    st = df_error(DFLASH_E_STATE,
                  "training state: this rank holds no host copy of the AdamW "
                  "moments (ZeRO-1 over several ranks: rank 0 gathers and writes the state)");
  if (!st) st = dflash_safetensors_writer_create(path, &w);
  if (st) return st;
  int64_t n = (int64_t)m->n_params, ulen = (int64_t)user_len;
  st = dflash_safetensors_writer_metadata(w, "format", STATE_FORMAT);
  snprintf(num, sizeof num, "%lld", (long long)t->step);
  if (!st) st = dflash_safetensors_writer_metadata(w, "step", num);
  snprintf(num, sizeof num, "%zu", m->n_tensors);
  if (!st) st = dflash_safetensors_writer_metadata(w, "n_tensors", num);
  const char *names[] = {"params", "adam_m", "adam_v"};
  const float *bufs[] = {m->params, t->m1, t->m2};
  for (size_t i = 0; !st && i < 3; i++)
    st = dflash_safetensors_writer_declare(w, names[i], DFLASH_DTYPE_F32, 1, &n);
  if (!st) st = dflash_safetensors_writer_declare(w, "user", DFLASH_DTYPE_U8, 1, &ulen);
  for (size_t i = 0; !st && i < 3; i++) st = write_floats(w, bufs[i], m->n_params, false);
  if (!st && user_len) st = dflash_safetensors_writer_write(w, user, user_len);
  if (!st) st = dflash_safetensors_writer_commit(w);
  dflash_safetensors_writer_free(w);
  return st;
}

static dflash_status state_tensor(const dflash_safetensors *st, const char *path, const char *name,
                                  dflash_dtype dtype, uint64_t nbytes, dflash_tensor *out) {
  out->struct_size = sizeof *out;
  if (dflash_safetensors_find(st, name, out))
    return df_error(DFLASH_E_FORMAT, "%s: training state lacks tensor %s", path, name);
  if (out->dtype != (int32_t)dtype || (nbytes != UINT64_MAX && out->nbytes != nbytes))
    return df_error(DFLASH_E_MISMATCH, "%s: tensor %s does not match this drafter (%llu bytes)",
                    path, name, (unsigned long long)out->nbytes);
  return DFLASH_OK;
}

dflash_status dflash_trainer_load_state(dflash_trainer *t, const char *path, void *user, size_t cap,
                                        size_t *user_len) {
  DF_CHECK_ARG(t && path && user_len);
  if (dflash_storage_is_remote(path)) return load_remote(t, path, true, user, cap, user_len);
  dflash_safetensors *st;
  dflash_status s = dflash_safetensors_open(path, &st);
  if (s) return s;
  df_model *m = &t->m;
  const char *fmt = NULL, *step = NULL;
  /* A missing key leaves NULL, refused just below. */
  DF_IGNORE(dflash_safetensors_metadata_find(st, "format", &fmt));
  DF_IGNORE(dflash_safetensors_metadata_find(st, "step", &step));
  dflash_tensor p, m1, m2, u;
  uint64_t nb = (uint64_t)m->n_params * sizeof(float);
  if (!fmt || strcmp(fmt, STATE_FORMAT) || !step)
    s = df_error(DFLASH_E_FORMAT, "%s: not a libdflash training state (format %s)", path,
                 fmt ? fmt : "missing");
  if (!s) s = state_tensor(st, path, "params", DFLASH_DTYPE_F32, nb, &p);
  if (!s) s = state_tensor(st, path, "adam_m", DFLASH_DTYPE_F32, nb, &m1);
  if (!s) s = state_tensor(st, path, "adam_v", DFLASH_DTYPE_F32, nb, &m2);
  if (!s) s = state_tensor(st, path, "user", DFLASH_DTYPE_U8, UINT64_MAX, &u);
  if (!s && (!user || cap < u.nbytes)) {
    *user_len = (size_t)u.nbytes;
    if (user)
      s = df_error(DFLASH_E_BUFFER, "%s: user state needs %llu bytes", path,
                   (unsigned long long)u.nbytes);
    dflash_safetensors_free(st);
    return s;
  }
  if (!s) {
    memcpy(m->params, p.data, nb);
    memcpy(t->m1, m1.data, nb);
    memcpy(t->m2, m2.data, nb);
    if (u.nbytes) memcpy(user, u.data, (size_t)u.nbytes);
    *user_len = (size_t)u.nbytes;
    t->step = strtoll(step, NULL, 10);
    s = df_trainer_push(t, DF_BUF_PARAMS | DF_BUF_M1 | DF_BUF_M2);
  }
  dflash_safetensors_free(st);
  return s;
}
