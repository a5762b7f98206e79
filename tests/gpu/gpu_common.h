/* Shared by the GPU tests, their emulated-device twins and the benchmark: random drafter
 * inputs, the small drafter and trainer most emulated-device tests train, and reading a
 * trainer's parameters back. One copy, so that a test's setup reads as what it changes. */
#ifndef DFLASH_TESTS_GPU_COMMON_H
#define DFLASH_TESTS_GPU_COMMON_H

#include <dflash/experimental.h>
#include <dflash/train.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* The whole sequence as the trainer's sample, with the target's final state `final`
 * ([len, H], or NULL: a DSpark drafter then trains on CE alone). */
static inline dflash_sample g_seq_sample(const g_seq *q, const float *final) {
  return (dflash_sample){.struct_size = sizeof(dflash_sample),
                         .input_ids = q->ids,
                         .loss_mask = q->mask,
                         .len = q->len,
                         .hidden = q->hidden,
                         .anchors = q->anchors,
                         .n_anchors = q->na,
                         .target_final = final};
}

/* The start of a parity test against the CPU: 0 and the inputs' seed in *seed (from
 * DFLASH_GPU_SEED, else `fallback`, printed so that a failure reproduces), with the device
 * arena poisoned before every call (DFLASH_CUDA_POISON); 77 (meson's skip) without a device. */
static inline int g_parity_start(uint64_t fallback, uint64_t *seed) {
  int n = 0;
  if (dflash_cuda_device_count(&n) || n == 0) {
    printf("SKIP: %s\n", dflash_last_error());
    return 77;
  }
  setenv("DFLASH_CUDA_POISON", "1", 1);
  const char *fixed = getenv("DFLASH_GPU_SEED");
  *seed = fixed ? strtoull(fixed, NULL, 10) : fallback;
  printf("seed %llu (DFLASH_GPU_SEED=%llu reproduces)\n", (unsigned long long)*seed,
         (unsigned long long)*seed);
  return 0;
}

static inline void g_seq_free(g_seq *q) {
  free(q->ids), free(q->mask), free(q->anchors), free(q->hidden);
}

/* The drafter the emulated-device tests train: 2 layers, H 64, 4 heads over 2 KV heads,
 * vocab 300, blocks of 4, K = 2 of 8 target layers. Small enough for seconds a step on the
 * emulator, large enough that every kernel runs more than one block and tile. */
static inline void g_small_config(dflash_drafter_config *c) {
  dflash_drafter_config_default(c);
  c->hidden_size = 64, c->intermediate_size = 128, c->num_hidden_layers = 2;
  c->num_attention_heads = 4, c->num_key_value_heads = 2, c->head_dim = 16, c->vocab_size = 300;
  c->num_target_layers = 8, c->block_size = 4, c->mask_token_id = 299;
  c->n_target_layer_ids = 2, c->target_layer_ids[0] = 1, c->target_layer_ids[1] = 5;
}

/* The target's embedding and LM head for `c` (uniform, scales 1 and 0.05, seeds 11 and 12):
 * the same in every test, so that a CPU and a CUDA trainer made apart start equal. */
static inline void g_small_embeddings(const dflash_drafter_config *c, float **E, float **Hd) {
  size_t vh = (size_t)c->vocab_size * c->hidden_size;
  *E = g_random(vh, 1.0f, 11), *Hd = g_random(vh, 0.05f, 12);
}

/* The trainer options of those tests on `backend`: vocab chunks of 128 (the LM head's
 * chunked pass runs three times at vocab 300), a fixed seed and init, no warm-up and 10
 * steps, so the learning rate of the first steps is known. */
static inline void g_small_options(dflash_trainer_options *o, int32_t backend) {
  dflash_trainer_options_default(o);
  o->backend = backend;
  o->seed = 3;
  o->vocab_chunk = 128;
  o->init_std = 0.05;
  o->warmup_ratio = 0;
  o->total_steps = 10;
}

/* A trainer on g_small_config's drafter and embeddings (freed here: create copies them). */
static inline dflash_status g_small_trainer(const dflash_drafter_config *c,
                                            const dflash_trainer_options *o, dflash_trainer **t) {
  float *E, *Hd;
  g_small_embeddings(c, &E, &Hd);
  *t = NULL;
  dflash_status st = E && Hd ? dflash_trainer_create(c, E, Hd, o, t) : DFLASH_E_NOMEM;
  free(E), free(Hd);
  return st;
}

/* The parameters' element count (the sum over param_info). */
static inline size_t g_n_params(const dflash_trainer *t) {
  size_t n = 0, numel;
  for (size_t i = 0; i < dflash_trainer_param_count(t); i++)
    if (!dflash_trainer_param_info(t, i, NULL, NULL, NULL, &numel)) n += numel;
  return n;
}

/* Every parameter (grads 0) or gradient (1) into out[g_n_params], in param_info's order. */
static inline dflash_status g_dump_into(dflash_trainer *t, int grads, float *out) {
  size_t numel, off = 0;
  for (size_t i = 0; i < dflash_trainer_param_count(t); i++) {
    const char *name;
    dflash_status st = dflash_trainer_param_info(t, i, &name, NULL, NULL, &numel);
    if (!st)
      st = grads ? dflash_trainer_get_grad(t, name, out + off, numel)
                 : dflash_trainer_get_param(t, name, out + off, numel);
    if (st) return st;
    off += numel;
  }
  return DFLASH_OK;
}

/* The same into a new buffer, NaN first so that an element no read wrote stands out. A
 * failed read aborts, naming it: the callers compare dumps to the bit, and two dumps left
 * NaN would compare equal. */
static inline float *g_dump(dflash_trainer *t, int grads) {
  size_t n = g_n_params(t);
  float *out = malloc((n ? n : 1) * sizeof *out);
  if (!out) abort();
  for (size_t i = 0; i < n; i++) out[i] = NAN;
  dflash_status st = g_dump_into(t, grads, out);
  if (st) {
    fprintf(stderr, "g_dump(%s): %s\n", grads ? "grads" : "params", dflash_last_error());
    abort();
  }
  return out;
}

/* The environment torchrun gives rank `rank` of `world` on one host, LOCAL_RANK included
 * (each rank on its own device), the rendezvous at 127.0.0.1:port; the rendezvous waits
 * 120 s, not the 30 min default, so a rank whose peer died fails within a test's timeout. */
static inline void g_rank_env(int rank, int world, int port) {
  char s[32];
  snprintf(s, sizeof s, "%d", rank);
  setenv("RANK", s, 1), setenv("LOCAL_RANK", s, 1);
  snprintf(s, sizeof s, "%d", world);
  setenv("WORLD_SIZE", s, 1);
  snprintf(s, sizeof s, "%d", port);
  setenv("MASTER_PORT", s, 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("DFLASH_DIST_TIMEOUT", "120", 1);
}

/* How many elements differ in their bits (0 and -0 differ, a NaN equals the same NaN). */
static inline size_t g_n_differ(const float *a, const float *b, size_t n) {
  size_t d = 0;
  for (size_t i = 0; i < n; i++) d += memcmp(a + i, b + i, sizeof *a) != 0;
  return d;
}

#endif
