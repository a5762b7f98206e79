/* Backend selection helpers and the host-cache protocol (backend.h). */
#include "backend.h"

#include <math.h>
#include <stdio.h>

void df_adam_constants(const df_adam *a, df_adam_consts *k) {
  double n = (double)a->step;
  double bc1 = 1.0 - pow(a->beta1, n), bc2 = 1.0 - pow(a->beta2, n);
  k->decay = (float)(1.0 - a->lr * a->weight_decay);
  k->b1 = (float)a->beta1;
  k->b2 = (float)a->beta2;
  k->eps = (float)a->eps;
  k->step_size = (float)(a->lr / bc1);
  k->bc2_sqrt = (float)sqrt(bc2);
}

double df_clip_coef(double clip, double norm) {
  if (clip <= 0) return 1.0;
  double coef = clip / (norm + 1e-6);
  return coef < 1.0 ? coef : 1.0;
}

static float *host_buffer(const dflash_trainer *t, df_buf_kind kind) {
  switch (kind) {
  case DF_BUF_PARAMS: return t->m.params;
  case DF_BUF_GRADS: return t->m.grads;
  case DF_BUF_M1: return t->m1;
  case DF_BUF_M2: return t->m2;
  }
  return NULL;
}

static const df_buf_kind all_kinds[] = {DF_BUF_PARAMS, DF_BUF_GRADS, DF_BUF_M1, DF_BUF_M2};

dflash_status df_trainer_pull(const dflash_trainer *t, unsigned kinds) {
  df_backend *b = t->be;
  for (size_t i = 0; i < DF_ARRAY_LEN(all_kinds); i++) {
    df_buf_kind k = all_kinds[i];
    if (!(kinds & k & b->stale)) continue;
    dflash_status st = b->vt->pull(b, k, host_buffer(t, k));
    if (st) return st;
    b->stale &= ~(unsigned)k;
  }
  return DFLASH_OK;
}

dflash_status df_trainer_push(const dflash_trainer *t, unsigned kinds) {
  df_backend *b = t->be;
  for (size_t i = 0; i < DF_ARRAY_LEN(all_kinds); i++) {
    df_buf_kind k = all_kinds[i];
    if (!(kinds & k)) continue;
    dflash_status st = b->vt->push(b, k, host_buffer(t, k));
    if (st) return st;
    b->stale &= ~(unsigned)k;
  }
  return DFLASH_OK;
}

dflash_status df_backend_auto_sequences(int32_t backend, int world, int32_t *out, char *note,
                                        size_t note_len) {
  if (backend == DFLASH_BACKEND_CUDA)
    return df_backend_cuda_auto_sequences(world, out, note, note_len);
  *out = 1; /* the CPU's compute outlasts its TCP sums */
  snprintf(note, note_len, "1 sequence per rank per optimizer step (CPU backend)");
  return DFLASH_OK;
}
