/* For tests/reference/torch_dflash2_conv.py: runs DFlash 2's convolution
 * forward and backward (src/train/dflash2.c) on the inputs in argv[1] and
 * writes the results to argv[2]. Input: int32 T, B, H, k, g, then float32
 * x [T, H], dyn [T, k, H/g], base [k, H], residual [T, H], dout [T, H].
 * Output: float32 out [T, H], dx [T, H], ddyn [T, k, H/g], dbase [k, H]. */
#include <stdio.h>
#include <stdlib.h>

#include "core/internal.h"
#include "train/dflash2.h"

static float *read_floats(FILE *f, size_t n) {
  float *p = malloc(n * sizeof(float));
  if (p && fread(p, sizeof(float), n, f) != n) {
    free(p);
    return NULL;
  }
  return p;
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
    return 2;
  }
  FILE *in = fopen(argv[1], "rb");
  int32_t d[5];
  if (!in || fread(d, sizeof d, 1, in) != 1) return 2;
  int T = d[0], B = d[1], H = d[2], k = d[3], g = d[4];
  if (T < 1 || B < 1 || T % B || H < 1 || k < 1 || g < 1 || H % g) return 2;
  size_t th = (size_t)T * H, nd = (size_t)T * k * (H / g), kh = (size_t)k * H;
  float *x = read_floats(in, th), *dyn = read_floats(in, nd), *base = read_floats(in, kh);
  float *res = read_floats(in, th), *dout = read_floats(in, th);
  fclose(in);
  float *out = malloc(th * 4), *dx = malloc(th * 4), *ddyn = malloc(nd * 4);
  float *dbase = calloc(kh, 4);
  if (!x || !dyn || !base || !res || !dout || !out || !dx || !ddyn || !dbase) return 2;
  df_pool *pool;
  if (df_pool_create(2, &pool)) return 2;
  size_t stride = (size_t)k * (H / g);
  df2_conv_apply(pool, out, x, dyn, stride, base, res, T, B, H, k, g);
  df2_conv_backward(pool, dx, ddyn, dbase, dout, x, dyn, stride, base, T, B, H, k, g);
  df_pool_free(pool);
  FILE *o = fopen(argv[2], "wb");
  if (!o || fwrite(out, 4, th, o) != th || fwrite(dx, 4, th, o) != th ||
      fwrite(ddyn, 4, nd, o) != nd || fwrite(dbase, 4, kh, o) != kh || fclose(o))
    return 2;
  free(x), free(dyn), free(base), free(res), free(dout), free(out), free(dx), free(ddyn);
  free(dbase);
  return 0;
}
