/* The target's frozen token embedding and LM head, read by tensor name from
 * its (sharded) safetensors checkpoint. */
#include <dflash/safetensors.h>
#include <dflash/storage.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "remote_files.h"
#include "trainer.h"

/* The target checkpoint: memory-mapped files, or an s3:// one read in place
 * with ranged GETs (train/remote_files.c). */
typedef struct tsrc {
  const dflash_safetensors *st;
  df_rst *remote;
} tsrc;

static bool has(const tsrc *s, const char *name) {
  dflash_tensor t = {.struct_size = sizeof t};
  return !(s->remote ? df_rst_find(s->remote, name, &t) : dflash_safetensors_find(s->st, name, &t));
}

static dflash_status read_floats(const tsrc *s, const char *name, const int64_t shape[2],
                                 float *out) {
  return s->remote ? df_rst_read_floats(s->remote, name, 2, shape, out)
                   : df_read_float_tensor(s->st, name, 2, shape, out);
}

/* Where common architectures keep them. */
static const char *const EMBED_NAMES[] = {"model.embed_tokens.weight",
                                          "model.language_model.embed_tokens.weight",
                                          "language_model.model.embed_tokens.weight",
                                          "embed_tokens.weight",
                                          "transformer.wte.weight",
                                          NULL};
static const char *const HEAD_NAMES[] = {"lm_head.weight", "language_model.lm_head.weight",
                                         "model.lm_head.weight", NULL};

/* The first of `names` present (or `given` alone when set). */
static const char *pick(const tsrc *st, const char *given, const char *const *names) {
  if (given) return has(st, given) ? given : NULL;
  for (size_t i = 0; names[i]; i++)
    if (has(st, names[i])) return names[i];
  return NULL;
}

static dflash_status read_vh(const tsrc *st, const char *path, const char *name, int32_t V,
                             int32_t H, float *out) {
  dflash_tensor t = {.struct_size = sizeof t};
  dflash_status s = st->remote ? df_rst_find(st->remote, name, &t)
                               : dflash_safetensors_find(st->st, name, &t);
  if (s) return df_error_wrap(s, "%s", path);
  if (t.ndim != 2 || t.shape[1] != H)
    return df_error(DFLASH_E_MISMATCH,
                    "%s: %s has hidden size %lld, the drafter config says %d "
                    "(hidden_size must equal the target's)",
                    path, name, (long long)(t.ndim == 2 ? t.shape[1] : -1), H);
  if (t.shape[0] != V)
    return df_error(DFLASH_E_MISMATCH,
                    "%s: %s has %lld rows, the drafter config's vocab_size "
                    "is %d",
                    path, name, (long long)t.shape[0], V);
  int64_t shape[2] = {V, H};
  return read_floats(st, name, shape, out);
}

dflash_status dflash_target_load_head(const char *path, const char *embed_name,
                                      const char *lm_head_name, int32_t vocab_size,
                                      int32_t hidden_size, float *embed, float *lm_head) {
  DF_CHECK_ARG(path && embed && lm_head && vocab_size > 0 && hidden_size > 0);
  dflash_safetensors *mapped = NULL;
  tsrc src = {0}, *st = &src;
  dflash_status s = dflash_storage_is_remote(path) ? df_rst_open(path, &src.remote)
                                                   : dflash_safetensors_open(path, &mapped);
  if (s) return df_error_wrap(s, "opening target checkpoint");
  src.st = mapped;
  const char *en = pick(st, embed_name, EMBED_NAMES);
  const char *hn = pick(st, lm_head_name, HEAD_NAMES);
  if (!en && embed_name)
    s = df_error(DFLASH_E_NOT_FOUND, "%s: target checkpoint has no tensor %s", path, embed_name);
  else if (!en)
    s = df_error(DFLASH_E_NOT_FOUND,
                 "%s: target checkpoint has no token embedding (tried "
                 "model.embed_tokens.weight and its variants; give its name explicitly)",
                 path);
  else if (!hn && lm_head_name)
    s = df_error(DFLASH_E_NOT_FOUND, "%s: target checkpoint has no tensor %s", path, lm_head_name);
  if (!s) s = read_vh(st, path, en, vocab_size, hidden_size, embed);
  /* No separate head: tied word embeddings. */
  if (!s) s = read_vh(st, path, hn ? hn : en, vocab_size, hidden_size, lm_head);
  dflash_safetensors_free(mapped);
  df_rst_free(src.remote);
  return s;
}

static const char *const NORM_NAMES[] = {
    "model.norm.weight", "model.language_model.norm.weight", "language_model.model.norm.weight",
    "norm.weight",       "transformer.ln_f.weight",          NULL};

/* rms_norm_eps of the target's config.json (beside its weights; text_config's for a
 * multimodal one). */
static dflash_status target_eps(const char *path, float *eps) {
  struct stat sb;
  bool dir = !stat(path, &sb) && S_ISDIR(sb.st_mode);
  const char *slash = strrchr(path, '/');
  char *cfg = dir     ? df_path_join(path, "config.json")
              : slash ? df_asprintf("%.*s/config.json", (int)(slash - path), path)
                      : df_strdup("config.json");
  if (!cfg) return df_error_nomem("path");
  json_error_t err;
  json_t *root = json_load_file(cfg, 0, &err), *text = json_object_get(root, "text_config");
  json_t *v = json_object_get(root, "rms_norm_eps");
  if (!v) v = json_object_get(text, "rms_norm_eps");
  dflash_status s = DFLASH_OK;
  if (!root)
    s = df_error(DFLASH_E_NOT_FOUND,
                 "%s: cannot read the target's config (%s): --labels "
                 "target on vLLM's files needs its rms_norm_eps",
                 cfg, err.text);
  else if (!json_is_number(v) || json_number_value(v) <= 0)
    s = df_error(DFLASH_E_CONFIG, "%s: no positive rms_norm_eps (the target's final norm)", cfg);
  else *eps = (float)json_number_value(v);
  json_decref(root);
  free(cfg);
  return s;
}

dflash_status df_target_load_final_norm(const char *path, const char *norm_name,
                                        int32_t hidden_size, float *norm_w, float *eps) {
  if (dflash_storage_is_remote(path))
    return df_error(DFLASH_E_UNSUPPORTED,
                    "%s: --labels target on vLLM's files reads the "
                    "target's final norm from a local checkpoint",
                    path);
  dflash_safetensors *st = NULL;
  dflash_status s = dflash_safetensors_open(path, &st);
  if (s) return df_error_wrap(s, "opening target checkpoint");
  tsrc src = {.st = st};
  const char *n = pick(&src, norm_name, NORM_NAMES);
  int64_t shape[1] = {hidden_size};
  if (!n)
    s = df_error(DFLASH_E_NOT_FOUND,
                 "%s: target checkpoint has no final norm %s (--labels "
                 "target on vLLM's files needs it; give its name with --final-norm-name)",
                 path, norm_name ? norm_name : "model.norm.weight (or a variant)");
  else s = df_read_float_tensor(st, n, 1, shape, norm_w);
  dflash_safetensors_free(st);
  return s ? s : target_eps(path, eps);
}
