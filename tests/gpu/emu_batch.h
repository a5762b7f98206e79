/* The CUDA backend's df_cu_batch for one test sequence, laid out as
 * backend_cuda.c's prepare() lays it out (the emulated-device tests that drive
 * df_cu_* directly share it). */
#ifndef DFLASH_TESTS_GPU_EMU_BATCH_H
#define DFLASH_TESTS_GPU_EMU_BATCH_H

#include <stdint.h>
#include <stdlib.h>

#include "train/cuda/dfcuda.h"
#include "gpu_common.h"
#include "core/bf16.h"
#include "train/model.h"

/* One sequence as backend_cuda.c's prepare() lays it out for the device. */
typedef struct batch {
  df_cu_batch b;
  int32_t *tok, *rows_t, *rows_target;
  float *coef;
  uint16_t *hidden;
} batch;

static inline void make_batch(const df_model *m, const g_seq *s, double grad_scale, batch *o) {
  int A = s->na, Sc = 0, max_pos = (int)s->len, R = 0, T = A * m->B;
  for (int n = 0; n < A; n++) {
    Sc = s->anchors[n] > Sc ? s->anchors[n] : Sc;
    max_pos = s->anchors[n] + m->B > max_pos ? s->anchors[n] + m->B : max_pos;
  }
  o->tok = malloc(sizeof(int32_t) * T);
  o->rows_t = malloc(sizeof(int32_t) * T);
  o->rows_target = malloc(sizeof(int32_t) * T);
  o->coef = malloc(sizeof(float) * T);
  for (int n = 0; n < A; n++)
    for (int j = 0; j < m->B; j++) {
      int t = n * m->B + j, p = s->anchors[n] + j;
      o->tok[t] = j == 0 ? s->ids[s->anchors[n]] : m->cfg.mask_token_id;
      if (j == 0 || !(p < s->len && s->mask[p] && df_position_weight(m, j) > 0)) continue;
      o->rows_t[R] = t, o->rows_target[R] = s->ids[p];
      o->coef[R] = (float)(df_position_weight(m, j) * grad_scale);
      R++;
    }
  size_t nh = (size_t)Sc * m->KH;
  o->hidden = malloc(2 * nh + 2);
  for (size_t i = 0; i < nh; i++) o->hidden[i] = df_f32_to_bf16(s->hidden[i]);
  o->b = (df_cu_batch){.T = T,
                       .Sc = Sc,
                       .R = R,
                       .A = A,
                       .max_pos = max_pos,
                       .anchors = s->anchors,
                       .block_tok = o->tok,
                       .rows_t = o->rows_t,
                       .rows_target = o->rows_target,
                       .coef = o->coef,
                       .hidden = o->hidden};
}

static inline void free_batch(batch *o) {
  free(o->tok), free(o->rows_t), free(o->rows_target), free(o->coef), free(o->hidden);
}

#endif
