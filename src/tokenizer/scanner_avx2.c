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

DF_AVX2 static inline __m256i eq(__m256i v, char c) {
  return _mm256_cmpeq_epi8(v, _mm256_set1_epi8(c));
}

/* The masks of 32 bytes. Straight-line, one half at a time: a loop over arrays of the two
 * halves kept its vectors on the stack (~195 instructions a block of 64, now ~110). */
typedef struct half_masks {
  uint32_t up, lo, digit, space, nl, slash, high, other, quote, blank;
} half_masks;

DF_AVX2 static inline half_masks classify(__m256i v) {
  __m256i up = in_range(v, 'A', 'Z'), lo = in_range(v, 'a', 'z'), dg = in_range(v, '0', '9');
  __m256i sp = _mm256_or_si256(in_range(v, '\t', '\r'), eq(v, ' '));
  __m256i any = _mm256_or_si256(_mm256_or_si256(up, lo), _mm256_or_si256(dg, sp));
  half_masks h;
  h.up = (uint32_t)_mm256_movemask_epi8(up);
  h.lo = (uint32_t)_mm256_movemask_epi8(lo);
  h.digit = (uint32_t)_mm256_movemask_epi8(dg);
  h.space = (uint32_t)_mm256_movemask_epi8(sp);
  h.nl = (uint32_t)_mm256_movemask_epi8(_mm256_or_si256(eq(v, '\r'), eq(v, '\n')));
  h.slash = (uint32_t)_mm256_movemask_epi8(eq(v, '/'));
  h.quote = (uint32_t)_mm256_movemask_epi8(eq(v, '\''));
  h.blank = (uint32_t)_mm256_movemask_epi8(eq(v, ' '));
  h.high = (uint32_t)_mm256_movemask_epi8(v); /* the sign bit is the non-ASCII bit */
  h.other = ~((uint32_t)_mm256_movemask_epi8(any) | h.high);
  return h;
}

static inline uint64_t join(uint32_t lo, uint32_t hi) { return lo | (uint64_t)hi << 32; }

DF_AVX2 void df_scan_masks_avx2(const uint8_t *p, df_scan_masks *m) {
  half_masks a = classify(_mm256_loadu_si256((const __m256i *)p));
  half_masks b = classify(_mm256_loadu_si256((const __m256i *)(p + 32)));
  m->up = join(a.up, b.up);
  m->lo = join(a.lo, b.lo);
  m->digit = join(a.digit, b.digit);
  m->space = join(a.space, b.space);
  m->nl = join(a.nl, b.nl);
  m->slash = join(a.slash, b.slash);
  m->high = join(a.high, b.high);
  m->other = join(a.other, b.other);
  m->quote = join(a.quote, b.quote);
  m->blank = join(a.blank, b.blank);
}

bool df_scan_cpu_has_avx2(void) { return __builtin_cpu_supports("avx2"); }

#else

void df_scan_masks_avx2(const uint8_t *p, df_scan_masks *m) { /* never called: no AVX2 */
  (void)p;
  *m = (df_scan_masks){0};
}

bool df_scan_cpu_has_avx2(void) { return false; }

#endif
