/* Writes a small drafter-shaped checkpoint with the streaming safetensors
 * writer: declare every tensor, stream the bytes, finish (fsync + rename).
 * usage: write_safetensors OUT.safetensors */
#include <dflash/safetensors.h>
#include <stdio.h>
#include <stdlib.h>

static int fail(dflash_status st) {
  fprintf(stderr, "error: %s: %s\n", dflash_status_str(st), dflash_last_error());
  return 1;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s OUT.safetensors\n", argv[0]);
    return 2;
  }
  enum { H = 64, K = 3, I = 192 };
  const struct {
    const char *name;
    int64_t rows, cols;
  } tensors[] = {
      {"fc.weight", H, K * H},
      {"hidden_norm.weight", H, 0},
      {"layers.0.mlp.gate_proj.weight", I, H},
      {"norm.weight", H, 0},
  };
  dflash_safetensors_writer *w;
  dflash_status st = dflash_safetensors_writer_create(argv[1], &w);
  if (st) return fail(st);
  if ((st = dflash_safetensors_writer_metadata(w, "format", "pt"))) goto out;
  for (size_t i = 0; i < sizeof tensors / sizeof tensors[0]; i++) {
    int64_t shape[2] = {tensors[i].rows, tensors[i].cols};
    if ((st = dflash_safetensors_writer_declare(w, tensors[i].name, DFLASH_DTYPE_F32,
                                                tensors[i].cols ? 2 : 1, shape)))
      goto out;
  }
  for (size_t i = 0; i < sizeof tensors / sizeof tensors[0]; i++) {
    int64_t n = tensors[i].rows * (tensors[i].cols ? tensors[i].cols : 1);
    for (int64_t j = 0; j < n; j++) { /* stream one row-sized value at a time */
      float v = tensors[i].cols ? (float)((j * 7919) % 1000) / 1000.0f - 0.5f : 1.0f;
      if ((st = dflash_safetensors_writer_write(w, &v, sizeof v))) goto out;
    }
  }
  st = dflash_safetensors_writer_commit(w);
out:
  dflash_safetensors_writer_free(w);
  if (st) return fail(st);
  printf("wrote %s\n", argv[1]);
  return 0;
}
