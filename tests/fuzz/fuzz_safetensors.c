/* libFuzzer target: the safetensors header/layout validator on arbitrary bytes.
 * Whatever the input, parsing must return a status, never crash or leak. */
#include <stddef.h>
#include <stdint.h>

#include "core/safetensors_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  df_st_file f = {.path = "fuzz-input", .base = data, .size = size};
  dflash_status st = df_st_parse(&f, 0);
  if (st == DFLASH_OK) {
    /* A valid layout must describe exactly the bytes that exist. */
    uint64_t sum = 0;
    for (size_t i = 0; i < f.n_entries; i++) sum += f.entries[i].end - f.entries[i].begin;
    if (sum != size - f.data_start) __builtin_trap();
  }
  df_st_file_clear(&f);
  return 0;
}
