/*
 * The block scanner's byte classes for 64 bytes at a time with AVX2. Only this file is
 * compiled for AVX2 (per function, so the library still runs on any x86-64 and builds
 * elsewhere); scanner.c calls it only when the CPU has AVX2 and its masks match the
 * portable ones on every byte value.
 */
#include "tok_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define DF_AVX2 __attribute__((target("avx2")))

/* Bytes in [lo, hi] (unsigned): v - lo <= hi - lo. */
DF_AVX2 static inline __m256i in_range(__m256i v, uint8_t lo, uint8_t hi) {
  __m256i d = _mm256_sub_epi8(v, _mm256_set1_epi8((char)lo));
  return _mm256_cmpeq_epi8(_mm256_min_epu8(d, _mm256_set1_epi8((char)(hi - lo))), d);
}

DF_AVX2 static inline uint64_t bits(__m256i a, __m256i b) {
  return (uint32_t)_mm256_movemask_epi8(a) | (uint64_t)(uint32_t)_mm256_movemask_epi8(b) << 32;
}

DF_AVX2 static inline __m256i eq(__m256i v, char c) {
  return _mm256_cmpeq_epi8(v, _mm256_set1_epi8(c));
}

DF_AVX2 void df_scan_masks_avx2(const uint8_t *p, df_scan_masks *m) {
  __m256i v[2] = {_mm256_loadu_si256((const __m256i *)p),
                  _mm256_loadu_si256((const __m256i *)(p + 32))};
  __m256i up[2], lo[2], dg[2], sp[2], nl[2], sl[2], hi[2], ot[2], qu[2];
  for (int h = 0; h < 2; h++) {
    up[h] = in_range(v[h], 'A', 'Z');
    lo[h] = in_range(v[h], 'a', 'z');
    dg[h] = in_range(v[h], '0', '9');
    nl[h] = _mm256_or_si256(eq(v[h], '\r'), eq(v[h], '\n'));
    sp[h] = _mm256_or_si256(in_range(v[h], '\t', '\r'), eq(v[h], ' '));
    sl[h] = eq(v[h], '/');
    qu[h] = eq(v[h], '\'');
    hi[h] = v[h]; /* the sign bit is the non-ASCII bit */
    __m256i any = _mm256_or_si256(_mm256_or_si256(up[h], lo[h]), _mm256_or_si256(dg[h], sp[h]));
    ot[h] = _mm256_or_si256(any, _mm256_cmpgt_epi8(_mm256_setzero_si256(), v[h]));
  }
  m->up = bits(up[0], up[1]);
  m->lo = bits(lo[0], lo[1]);
  m->digit = bits(dg[0], dg[1]);
  m->space = bits(sp[0], sp[1]);
  m->nl = bits(nl[0], nl[1]);
  m->slash = bits(sl[0], sl[1]);
  m->high = bits(hi[0], hi[1]);
  m->other = ~bits(ot[0], ot[1]);
  m->quote = bits(qu[0], qu[1]);
}

bool df_scan_cpu_has_avx2(void) { return __builtin_cpu_supports("avx2"); }

#else

void df_scan_masks_avx2(const uint8_t *p, df_scan_masks *m) { /* never called: no AVX2 */
  (void)p;
  *m = (df_scan_masks){0};
}

bool df_scan_cpu_has_avx2(void) { return false; }

#endif
