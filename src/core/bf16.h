/* bfloat16 / float16 / float8 e4m3 conversions (bit-exact, no hardware needed). */
#ifndef DFLASH_TRAIN_BF16_H
#define DFLASH_TRAIN_BF16_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float df_bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Round to nearest even, as torch's .to(torch.bfloat16); NaN stays NaN. */
static inline uint16_t df_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float df_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = ldexpf((float)man, -24);
  } else if (exp == 31) {
    f = man ? NAN : INFINITY;
  } else {
    uint32_t u = ((exp + 112) << 23) | (man << 13);
    memcpy(&f, &u, 4);
  }
  return sign ? -f : f;
}

/* float8 e4m3fn (no infinities, max 448, NaN = 0x7f/0xff). */
static inline float df_e4m3_to_f32(uint8_t v) {
  int sign = v >> 7, exp = (v >> 3) & 0xf, man = v & 7;
  float f;
  if (exp == 15 && man == 7) return NAN;
  if (exp == 0) f = ldexpf((float)man, -9);
  else f = ldexpf(1.0f + man / 8.0f, exp - 7);
  return sign ? -f : f;
}

/* Round to nearest even, saturating at +-448 (as torch's float8_e4m3fn cast
 * of finite values within range; larger values saturate here). */
static inline uint8_t df_f32_to_e4m3(float x) {
  if (isnan(x)) return 0x7f;
  uint8_t sign = signbit(x) ? 0x80 : 0;
  float a = fabsf(x);
  if (a >= 448.0f) return sign | 0x7e;
  if (a < ldexpf(1.0f, -10)) return sign; /* below half the smallest subnormal */
  int e;
  frexpf(a, &e);       /* a = m * 2^e, m in [0.5, 1) */
  int exp = e - 1 + 7; /* biased exponent of 1.m form */
  float q;             /* value in units of the last mantissa bit */
  if (exp <= 0) {
    q = rintf(ldexpf(a, 9)); /* subnormal: units of 2^-9 */
    if (q >= 8) return sign | 0x08;
    return sign | (uint8_t)q;
  }
  q = rintf(ldexpf(a, 3 - (e - 1))); /* 8..16 */
  if (q >= 16) {
    q = 8;
    exp++;
  }
  if (exp > 15 || (exp == 15 && q - 8 > 6)) return sign | 0x7e;
  return sign | (uint8_t)(exp << 3) | (uint8_t)(q - 8);
}

#endif
