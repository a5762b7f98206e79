/* Hidden-state sanity: per-layer RMS and all-zero rows of a store, and the check the sample
 * stream makes before a sample reaches the trainer or eval. An all-zero layer is the peers'
 * most reported failure (a capture or cache configuration that stores nothing): drafters
 * trained on it reach ~0 % acceptance while their validation loss looks fine. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "hidden.h"

/* Whether n values from `f32` or `bf16` (one of them) at element `at` are all (+-)0. */
static bool row_is_zero(const float *f32, const uint16_t *bf16, size_t at, int32_t n) {
  for (int32_t i = 0; i < n; i++)
    if (f32 ? f32[at + (size_t)i] != 0.0f : (bf16[at + (size_t)i] & 0x7fff) != 0) return false;
  return true;
}

int32_t df_hidden_zero_layer(const float *f32, const uint16_t *bf16, int64_t len, int32_t K,
                             int32_t H) {
  for (int32_t k = 0; k < K; k++) {
    bool zero = true;
    for (int64_t r = 0; zero && r < len; r++)
      zero = row_is_zero(f32, bf16, ((size_t)r * (size_t)K + (size_t)k) * (size_t)H, H);
    if (zero) return k;
  }
  return -1;
}

dflash_status df_hidden_check_sample(const char *id, const float *x, int64_t len, int32_t K,
                                     int32_t H) {
  int32_t k = df_hidden_zero_layer(x, NULL, len, K, H);
  if (k >= 0)
    return df_error(DFLASH_E_FORMAT,
                    "sample %s: layer %d of %d of its hidden states is all "
                    "zeros over its %lld tokens: the producer captured nothing for that layer "
                    "(a wrong layer id or cache configuration?)",
                    id, k, K, (long long)len);
  return DFLASH_OK;
}

/* Row r of layer k of e4m3 codes is zero when its scale is or every code is (+-)0. */
static bool fp8_row_is_zero(const uint8_t *codes, const float *scales, size_t row, int32_t H) {
  float sc;
  memcpy(&sc, (const char *)scales + 4 * row, 4); /* scales may sit at any byte offset */
  if (sc == 0.0f) return true;
  for (int32_t i = 0; i < H; i++)
    if (codes[row * (size_t)H + (size_t)i] & 0x7f) return false;
  return true;
}

dflash_status df_hidden_check_codes(const char *id, int32_t dtype, const void *codes,
                                    const float *scales, int64_t len, int32_t K, int32_t H) {
  int32_t bad = -1;
  if (dtype == DFLASH_DTYPE_BF16) bad = df_hidden_zero_layer(NULL, codes, len, K, H);
  for (int32_t k = 0; dtype != DFLASH_DTYPE_BF16 && bad < 0 && k < K; k++) {
    bool zero = true;
    for (int64_t r = 0; zero && r < len; r++)
      zero = fp8_row_is_zero(codes, scales, (size_t)r * (size_t)K + (size_t)k, H);
    if (zero) bad = k;
  }
  if (bad >= 0)
    return df_error(DFLASH_E_FORMAT,
                    "sample %s: layer %d of %d of its hidden states is all "
                    "zeros over its %lld tokens: the producer captured nothing for that layer "
                    "(a wrong layer id or cache configuration?)",
                    id, bad, K, (long long)len);
  return DFLASH_OK;
}

/* Adds one sample's rows to the sums. */
static void add_sample(const float *x, int64_t len, int32_t K, int32_t H, double *sumsq,
                       uint64_t *zero_rows) {
  for (int64_t r = 0; r < len; r++)
    for (int32_t k = 0; k < K; k++) {
      const float *row = x + ((size_t)r * (size_t)K + (size_t)k) * (size_t)H;
      double s = 0;
      for (int32_t i = 0; i < H; i++) s += (double)row[i] * row[i];
      sumsq[k] += s;
      zero_rows[k] += s == 0.0;
    }
}

dflash_status dflash_hidden_stats(const dflash_hidden *h, double *rms, uint64_t *zero_rows,
                                  uint64_t *rows) {
  DF_CHECK_ARG(h && rms && zero_rows && rows);
  dflash_hidden_info info = {.struct_size = sizeof info};
  dflash_status st = dflash_hidden_get_info(h, &info);
  if (st) return st;
  int32_t K = info.num_layers, H = info.hidden_size;
  size_t count = (size_t)info.count;
  double *sumsq = calloc((size_t)K, sizeof *sumsq);
  if (!sumsq) return df_error_nomem("hidden stats");
  memset(zero_rows, 0, (size_t)K * sizeof *zero_rows);
  *rows = 0;
  float *buf = NULL;
  size_t cap = 0;
  for (size_t i = 0; !st && i < count; i++) {
    const char *id;
    int64_t len = 0;
    st = dflash_hidden_id(h, i, &id);
    if (!st) st = dflash_hidden_length(h, id, &len);
    size_t need = (size_t)len * (size_t)K * (size_t)H;
    if (!st && need > cap) {
      free(buf);
      buf = malloc(need * sizeof *buf);
      cap = buf ? need : 0;
      if (!buf) st = df_error_nomem("hidden stats");
    }
    if (!st) st = dflash_hidden_read(h, id, buf, len);
    if (!st) add_sample(buf, len, K, H, sumsq, zero_rows);
    *rows += (uint64_t)len;
  }
  for (int32_t k = 0; k < K; k++) rms[k] = *rows ? sqrt(sumsq[k] / ((double)*rows * H)) : 0.0;
  free(buf);
  free(sumsq);
  return st;
}
