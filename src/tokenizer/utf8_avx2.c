/*
 * Whether text is well-formed UTF-8, 32 bytes at a time with AVX2: the lookup algorithm of
 * Keiser and Lemire ("Validating UTF-8 in less than one instruction per byte", 2021). Each
 * byte is checked against the one before it by three 16-entry tables (high nibble of the
 * previous byte, its low nibble, high nibble of this byte) whose AND is non-zero for exactly
 * the invalid pairs; a continuation byte that must be the 3rd or 4th of a sequence is then
 * checked against the bytes two and three back. Most text is valid, so encode asks this first
 * and runs the scalar repair (unicode.c) only when it says no; the Check test `utf8_simd`
 * compares the two on random and adversarial bytes. Only this file is compiled for AVX2, per
 * function, as scanner_avx2.c is.
 */
#include "tok_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#include <string.h>

#define DF_AVX2 __attribute__((target("avx2")))

/* What a pair (previous byte, this byte) can be wrong by: one bit per kind of error. */
enum {
  TOO_SHORT = 1 << 0,      /* a lead byte (11______) then a lead or ASCII byte */
  TOO_LONG = 1 << 1,       /* ASCII then a continuation (10______) */
  OVERLONG_3 = 1 << 2,     /* 11100000 100_____ */
  TOO_LARGE = 1 << 3,      /* above U+10FFFF: 11110100 1001____ or 101_____, and larger leads */
  SURROGATE = 1 << 4,      /* 11101101 101_____ */
  OVERLONG_2 = 1 << 5,     /* 1100000_ 10______ */
  TOO_LARGE_1000 = 1 << 6, /* 11110101 1000____ and larger leads */
  OVERLONG_4 = 1 << 6,     /* 11110000 1000____ (shares the bit: the low nibbles differ) */
  TWO_CONTS = 1 << 7,      /* a continuation then a continuation: valid only as 3rd/4th byte */
  CARRY = TOO_SHORT | TOO_LONG | TWO_CONTS /* errors the previous byte's low nibble allows */
};

/* The three tables, indexed by a nibble (the same 16 bytes in both 128-bit lanes). */
static const uint8_t T1_HI[16] = {TOO_LONG,
                                  TOO_LONG,
                                  TOO_LONG,
                                  TOO_LONG,
                                  TOO_LONG,
                                  TOO_LONG,
                                  TOO_LONG,
                                  TOO_LONG,
                                  TWO_CONTS,
                                  TWO_CONTS,
                                  TWO_CONTS,
                                  TWO_CONTS,
                                  TOO_SHORT | OVERLONG_2,
                                  TOO_SHORT,
                                  TOO_SHORT | OVERLONG_3 | SURROGATE,
                                  TOO_SHORT | TOO_LARGE | TOO_LARGE_1000 | OVERLONG_4};
#define LARGE (CARRY | TOO_LARGE | TOO_LARGE_1000)
static const uint8_t T1_LO[16] = {CARRY | OVERLONG_3 | OVERLONG_2 | OVERLONG_4,
                                  CARRY | OVERLONG_2,
                                  CARRY,
                                  CARRY,
                                  CARRY | TOO_LARGE,
                                  LARGE,
                                  LARGE,
                                  LARGE,
                                  LARGE,
                                  LARGE,
                                  LARGE,
                                  LARGE,
                                  LARGE,
                                  LARGE | SURROGATE,
                                  LARGE,
                                  LARGE};
#undef LARGE
static const uint8_t T2_HI[16] = {TOO_SHORT,
                                  TOO_SHORT,
                                  TOO_SHORT,
                                  TOO_SHORT,
                                  TOO_SHORT,
                                  TOO_SHORT,
                                  TOO_SHORT,
                                  TOO_SHORT,
                                  TOO_LONG | OVERLONG_2 | TWO_CONTS | OVERLONG_3 | TOO_LARGE_1000 |
                                      OVERLONG_4,
                                  TOO_LONG | OVERLONG_2 | TWO_CONTS | OVERLONG_3 | TOO_LARGE,
                                  TOO_LONG | OVERLONG_2 | TWO_CONTS | SURROGATE | TOO_LARGE,
                                  TOO_LONG | OVERLONG_2 | TWO_CONTS | SURROGATE | TOO_LARGE,
                                  TOO_SHORT,
                                  TOO_SHORT,
                                  TOO_SHORT,
                                  TOO_SHORT};

DF_AVX2 static inline __m256i table(const uint8_t t[16]) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t));
}

DF_AVX2 static inline __m256i nibble_hi(__m256i v) {
  return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F));
}

/* The bytes of `in` moved n places later, the last n of `prev` coming in first. */
#define PREV(in, prev, n) \
  _mm256_alignr_epi8((in), _mm256_permute2x128_si256((prev), (in), 0x21), 16 - (n))

/* Error bits of one block given the block before it (zero bits: every pair is valid). */
DF_AVX2 static inline __m256i block_errors(__m256i in, __m256i prev) {
  const __m256i t1_hi = table(T1_HI), t1_lo = table(T1_LO), t2_hi = table(T2_HI);
  __m256i prev1 = PREV(in, prev, 1);
  __m256i sc = _mm256_and_si256(
      _mm256_and_si256(_mm256_shuffle_epi8(t1_hi, nibble_hi(prev1)),
                       _mm256_shuffle_epi8(t1_lo, _mm256_and_si256(prev1, _mm256_set1_epi8(0x0F)))),
      _mm256_shuffle_epi8(t2_hi, nibble_hi(in)));
  /* Bytes 2 and 3 back at or above 0xE0 / 0xF0: this byte must be a continuation, which
   * is what TWO_CONTS said of it; the two must agree. */
  __m256i third = _mm256_subs_epu8(PREV(in, prev, 2), _mm256_set1_epi8((char)(0xE0 - 0x80)));
  __m256i fourth = _mm256_subs_epu8(PREV(in, prev, 3), _mm256_set1_epi8((char)(0xF0 - 0x80)));
  __m256i must = _mm256_and_si256(_mm256_or_si256(third, fourth), _mm256_set1_epi8((char)0x80));
  return _mm256_xor_si256(must, sc);
}

DF_AVX2 bool df_utf8_valid_avx2(const uint8_t *s, size_t n) {
  __m256i prev = _mm256_setzero_si256(), err = _mm256_setzero_si256();
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    __m256i in = _mm256_loadu_si256((const __m256i *)(s + i));
    err = _mm256_or_si256(err, block_errors(in, prev));
    prev = in;
  }
  /* The tail padded with NUL bytes (ASCII), then one block of NULs: a sequence cut short
   * by the end of the text fails as one cut short by ASCII. */
  uint8_t tail[32] = {0};
  memcpy(tail, s + i, n - i);
  __m256i in = _mm256_loadu_si256((const __m256i *)tail);
  err = _mm256_or_si256(err, block_errors(in, prev));
  err = _mm256_or_si256(err, block_errors(_mm256_setzero_si256(), in));
  return _mm256_testz_si256(err, err);
}

#else

bool df_utf8_valid_avx2(const uint8_t *s, size_t n) { /* never called: no AVX2 */
  (void)s;
  (void)n;
  return false;
}

#endif
