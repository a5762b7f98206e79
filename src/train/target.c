/* The target's frozen token embedding and LM head, read by tensor name from
 * its (sharded) safetensors checkpoint. */
#include <dflash/safetensors.h>
#include <dflash/storage.h>
#include <stdlib.h>
#include <string.h>

#include "remote.h"
#include "trainer.h"

/* The target checkpoint: memory-mapped files, or an s3:// one read in place
 * with ranged GETs (train/remote.c). */
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
static const char *const EMBED_NAMES[] = {
    "model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight", "embed_tokens.weight",
    "transformer.wte.weight", NULL};
static const char *const HEAD_NAMES[] = {
    "lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight", NULL};

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
  if (st->remote) df_rst_find(st->remote, name, &t);
  else dflash_safetensors_find(st->st, name, &t);
  if (t.ndim != 2 || t.shape[1] != H)
    return df_error(DFLASH_E_MISMATCH, "%s: %s has hidden size %lld, the drafter config says %d "
                    "(hidden_size must equal the target's)", path, name,
                    (long long)(t.ndim == 2 ? t.shape[1] : -1), H);
  if (t.shape[0] != V)
    return df_error(DFLASH_E_MISMATCH, "%s: %s has %lld rows, the drafter config's vocab_size "
                    "is %d", path, name, (long long)t.shape[0], V);
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
    s = df_error(DFLASH_E_NOT_FOUND, "%s: target checkpoint has no token embedding (tried "
                 "model.embed_tokens.weight and its variants; give its name explicitly)", path);
  else if (!hn && lm_head_name)
    s = df_error(DFLASH_E_NOT_FOUND, "%s: target checkpoint has no tensor %s", path,
                 lm_head_name);
  if (!s) s = read_vh(st, path, en, vocab_size, hidden_size, embed);
  /* No separate head: tied word embeddings. */
  if (!s) s = read_vh(st, path, hn ? hn : en, vocab_size, hidden_size, lm_head);
  dflash_safetensors_free(mapped);
  df_rst_free(src.remote);
  return s;
}
