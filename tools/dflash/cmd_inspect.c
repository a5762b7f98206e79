/* `dflash inspect PATH`: list tensors (name, dtype, shape, bytes) and metadata. */
#include <dflash/hidden.h>
#include <dflash/safetensors.h>
#include <stdio.h>
#include <string.h>

#include "commands.h"

static void print_shape(const dflash_tensor *t) {
  putchar('[');
  for (uint32_t d = 0; d < t->ndim; d++) printf(d ? ", %lld" : "%lld", (long long)t->shape[d]);
  putchar(']');
}

/* A store's metadata value `key`, or `none`: what the writer recorded (HiddenWriter's
 * target_layer_ids, tokenizer_hash); vLLM's files record neither. */
static void print_meta(dflash_safetensors *st, const char *label, const char *key,
                       const char *none) {
  const char *v = NULL;
  if (!st || dflash_safetensors_metadata_find(st, key, &v)) v = NULL;
  printf("  %s: %s\n", label, v ? v : none);
}

/* What the store says its rows are, and whether --labels target can train on it. */
static int hidden_record_lines(const char *dir) {
  dflash_hidden *h;
  dflash_status s = dflash_hidden_open(dir, &h);
  if (s) return cli_fail("inspect", s);
  dflash_hidden_target_ids t = dflash_hidden_has_target_ids(h);
  dflash_hidden_info info = {.struct_size = sizeof info};
  if (dflash_hidden_get_info(h, &info)) info.final_state = 0;
  dflash_hidden_free(h);
  dflash_safetensors *st = NULL;
  bool vllm = dflash_hidden_layout_of(dir) == DFLASH_HIDDEN_LAYOUT_VLLM;
  if (!vllm && dflash_safetensors_open(dir, &st)) st = NULL;
  dflash_clear_error();
  print_meta(st, "target layer ids", "target_layer_ids",
             vllm ? "not recorded (vLLM's files: the aux layers the extraction was started with)"
                  : "not recorded (written without target_layer_ids: train and eval check only "
                    "the width)");
  print_meta(st, "tokenizer hash", "tokenizer_hash", "not recorded");
  printf("  target ids (--labels target): %s\n", t == DFLASH_HIDDEN_TARGET_IDS_STORED ? "stored"
                                                 : t == DFLASH_HIDDEN_TARGET_IDS_VLLM
                                                     ? "from the final-layer slot (vLLM's files)"
                                                     : "none (written without target_ids)");
  printf("  target final state (DSpark's L1 and confidence): %s\n",
         info.final_state ? "stored, after the final norm ([S, H] per sample)"
                          : "none (written without final_state: a DSpark drafter trains on "
                            "0.1 CE alone)");
  dflash_safetensors_free(st);
  return 0;
}

int cmd_inspect(int argc, char **argv) {
  static const char usage[] =
      "usage: dflash inspect PATH\n"
      "PATH: a .safetensors file, a *.safetensors.index.json, or a directory of shards;\n"
      "a dataset directory (with dataset.json) gets a summary: samples, tokens,\n"
      "supervised share, length histogram, template and tokenizer hash; a hidden-state\n"
      "store gets RMS and all-zero rows per layer (it reads every sample), the target\n"
      "layer ids and tokenizer hash it records, whether it has target ids and the\n"
      "target's final state.\n"
      "Exit status: 0 shown; 1 an error (message on stderr); 2 a usage error.\n";
  const char *path;
  int rc = cli_parse_one("inspect", usage, argc, argv, "PATH", &path);
  if (rc) return rc < 0 ? 0 : rc;
  if (cli_is_dataset(path)) return cli_dataset_summary(path);
  if (cli_is_hidden_store(path)) {
    rc = cli_hidden_summary(path);
    return rc ? rc : hidden_record_lines(path);
  }
  dflash_safetensors *st;
  dflash_status s = dflash_safetensors_open(path, &st);
  if (s) return cli_fail("inspect", s);
  size_t n = dflash_safetensors_count(st);
  uint64_t total = 0;
  for (size_t i = 0; i < n; i++) {
    dflash_tensor t = {.struct_size = sizeof t};
    if ((s = dflash_safetensors_get(st, i, &t))) {
      dflash_safetensors_free(st);
      return cli_fail("inspect", s);
    }
    printf("%-48s %-8s ", t.name, dflash_dtype_name(t.dtype));
    print_shape(&t);
    printf(" %llu\n", (unsigned long long)t.nbytes);
    total += t.nbytes;
  }
  for (size_t i = 0; i < dflash_safetensors_metadata_count(st); i++) {
    const char *k, *v;
    if (dflash_safetensors_metadata_get(st, i, &k, &v) == DFLASH_OK) printf("# %s = %s\n", k, v);
  }
  printf("# %zu tensors, %llu bytes, %zu file(s)\n", n, (unsigned long long)total,
         dflash_safetensors_file_count(st));
  dflash_safetensors_free(st);
  return 0;
}
