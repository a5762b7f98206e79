/* A small deterministic generator (xoshiro256**, seeded by splitmix64): its
 * whole state is four words, saved in the training state for exact resume. */
#ifndef DFLASH_TRAIN_RNG_H
#define DFLASH_TRAIN_RNG_H

#include <math.h>
#include <stdint.h>

typedef struct df_rng {
  uint64_t s[4];
} df_rng;

static inline uint64_t df_splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/* Seed from two words (a seed and a stream id: epoch, sample...). */
static inline void df_rng_seed(df_rng *r, uint64_t seed, uint64_t stream) {
  uint64_t x = seed ^ (stream * 0xd1b54a32d192ed03ULL);
  for (int i = 0; i < 4; i++) r->s[i] = df_splitmix64(&x);
}

static inline uint64_t df_rng_next(df_rng *r) {
  uint64_t *s = r->s;
  uint64_t x = s[1] * 5, result = ((x << 7) | (x >> 57)) * 9, t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = (s[3] << 45) | (s[3] >> 19);
  return result;
}

/* Uniform in [0, n) without modulo bias (n > 0). */
static inline uint64_t df_rng_below(df_rng *r, uint64_t n) {
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do x = df_rng_next(r);
  while (x >= limit);
  return x % n;
}

/* Uniform in (0, 1). */
static inline double df_rng_unit(df_rng *r) {
  return ((double)(df_rng_next(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

/* Standard normal (Box-Muller). */
static inline double df_rng_normal(df_rng *r) {
  double u = df_rng_unit(r), v = df_rng_unit(r);
  return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

#endif
