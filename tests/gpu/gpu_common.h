/* Shared by the GPU parity test and benchmark: random drafter inputs. */
#ifndef DFLASH_TESTS_GPU_COMMON_H
#define DFLASH_TESTS_GPU_COMMON_H

#include <dflash/experimental.h>
#include <dflash/train.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static inline uint64_t g_next(uint64_t *s) {
  *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
  return *s;
}
static inline float g_unif(uint64_t *s) {
  return (float)((g_next(s) >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

static inline float *g_random(size_t n, float scale, uint64_t seed) {
  float *x = malloc(n * sizeof *x);
  uint64_t s = seed * 2654435761u + 88172645463325252ull;
  for (size_t i = 0; x && i < n; i++) x[i] = scale * g_unif(&s);
  return x;
}

/* A sequence of `len` tokens, all supervised, with `na` sampled anchors. */
typedef struct g_seq {
  int32_t *ids, *anchors;
  uint8_t *mask;
  float *hidden;
  int64_t len;
  int32_t na;
} g_seq;

static inline int g_seq_make(const dflash_drafter_config *c, int64_t len, int32_t na, uint64_t seed,
                             g_seq *q) {
  q->len = len;
  q->ids = malloc(sizeof(int32_t) * len);
  q->mask = malloc(len);
  q->anchors = malloc(sizeof(int32_t) * na);
  uint64_t s = seed | 1;
  for (int64_t i = 0; i < len; i++)
    q->ids[i] = (int32_t)(g_next(&s) % (uint64_t)c->vocab_size),
    q->mask[i] = i > len / 8; /* a prompt without loss */
  q->hidden = g_random((size_t)len * c->n_target_layer_ids * c->hidden_size, 1.0f, seed + 7);
  if (!q->ids || !q->mask || !q->anchors || !q->hidden) return -1;
  return dflash_anchors_sample(q->mask, len, c->block_size, na, seed, 0, q->anchors, &q->na) ? -1
                                                                                             : 0;
}

static inline void g_seq_free(g_seq *q) {
  free(q->ids), free(q->mask), free(q->anchors), free(q->hidden);
}

#endif
