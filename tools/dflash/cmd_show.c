/* `dflash show DATASET`: one stored sample with its supervised tokens marked, and the
 * dataset summary `dflash inspect DATASET` prints (instead of the shards' tensors and a
 * metadata line of every sample id). */
#include <dflash/dataset.h>
#include <dflash/hidden.h>
#include <dflash/storage.h>
#include <dflash/tokenizer.h>
#include <dirent.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "commands.h"

static const char USAGE[] =
    "usage: dflash show DATASET (--index N | --id ID) [--tokenizer PATH] [--color|--no-color]\n"
    "                   [--allow-tokenizer-mismatch]\n"
    "Prints one sample of a tokenized dataset: its id, length and supervised count, then its\n"
    "text (decoded with --tokenizer, the one `dflash tokenize` used) or its token ids, with\n"
    "the supervised tokens (loss_mask 1, what the drafter learns to predict) highlighted:\n"
    "in colour on a terminal, between [[ and ]] otherwise. A --tokenizer whose hash is not\n"
    "the dataset's recorded tokenizer_hash is refused (its ids would decode to other\n"
    "tokens) unless --allow-tokenizer-mismatch.\n"
    "Exit status: 0 shown; 1 an error (no such sample, unreadable dataset); 2 a usage error.\n";

typedef struct {
  const char *dir, *id, *tok_path;
  long long index;
  int color; /* -1: when stdout is a terminal */
  int allow_mismatch;
} show_args;

static int parse(int argc, char **argv, show_args *a) {
  *a = (show_args){.index = -1, .color = -1};
  int color = 0, no_color = 0, n_pos;
  int64_t index = -1;
  const cli_opt opts[] = {{"--index", CLI_I64, &index, 0, 9.2e18, NULL},
                          {"--id", CLI_STR, &a->id, 0, 0, NULL},
                          {"--tokenizer", CLI_STR, &a->tok_path, 0, 0, NULL},
                          {"--allow-tokenizer-mismatch", CLI_FLAG, &a->allow_mismatch, 0, 0, NULL},
                          {"--color", CLI_FLAG, &color, 0, 0, NULL},
                          {"--no-color", CLI_FLAG, &no_color, 0, 0, NULL},
                          {NULL, 0, NULL, 0, 0, NULL}};
  int rc = cli_parse("show", USAGE, opts, argc, argv, &a->dir, 1, &n_pos);
  if (rc) return rc == 1 ? -1 : rc;
  a->index = index;
  if (!a->dir) return cli_missing("show", "DATASET");
  if ((a->index < 0) == !a->id) return cli_missing("show", "exactly one of --index and --id");
  a->color = color ? 1 : no_color ? 0 : isatty(STDOUT_FILENO);
  return 0;
}

/* The index of sample `id`, or (size_t)-1 with a message. */
static size_t find_id(const dflash_dataset *ds, const char *id) {
  for (size_t i = 0, n = dflash_dataset_count(ds); i < n; i++) {
    const char *sid;
    if (!dflash_dataset_sample(ds, i, NULL, NULL, NULL, &sid) && !strcmp(sid, id)) return i;
  }
  fprintf(stderr, "dflash show: no sample has id \"%s\"\n", id);
  return (size_t)-1;
}

/* Opens or closes a highlighted run when the mask changes. */
static void mark(bool color, bool *inside, bool supervised) {
  if (supervised == *inside) return;
  if (color) fputs(supervised ? "\033[1;32m" : "\033[0m", stdout);
  else fputs(supervised ? "[[" : "]]", stdout);
  *inside = supervised;
}

static dflash_status print_tokens(const show_args *a, const dflash_tokenizer *tok,
                                  const int32_t *ids, const uint8_t *mask, size_t n) {
  bool inside = false;
  for (size_t i = 0; i < n; i++) {
    bool supervised = mask[i] != 0;
    if (!tok && i) { /* ids: "4 [[5 6]] 7" */
      if (!supervised) mark(a->color, &inside, false);
      putchar(' ');
    }
    mark(a->color, &inside, supervised);
    if (!tok) {
      printf("%d", ids[i]);
      continue;
    }
    const char *bytes;
    size_t len;
    dflash_status st = dflash_tokenizer_id_to_token(tok, ids[i], &bytes, &len, NULL);
    if (st) return st;
    fwrite(bytes, 1, len, stdout);
  }
  mark(a->color, &inside, false);
  putchar('\n');
  return DFLASH_OK;
}

/* Whether the tokenizer at `path` hashes to `want`: the path itself, or for a directory that
 * is not a tokenizer directory of its own (--target) also its tokenizer.json or tiktoken.model
 * alone, as `dflash tokenize --tokenizer DIR/tokenizer.json` records them. -1: no tokenizer
 * files there (error cleared); -2: an error (printed). */
static int hash_matches(const char *cmd, const char *path, const char *want, bool required,
                        char *got) {
  static const char *const alone[] = {"", "/tokenizer.json", "/tiktoken.model"};
  int found = 0;
  for (size_t i = 0; i < sizeof alone / sizeof *alone && (i == 0 || !required); i++) {
    char p[4096];
    snprintf(p, sizeof p, "%s%s", path, alone[i]);
    if (i && access(p, R_OK)) continue;
    dflash_status st = dflash_dataset_tokenizer_hash(p, got, DFLASH_TOKENIZER_HASH_LEN);
    if (st == DFLASH_E_NOT_FOUND && !required) {
      dflash_clear_error();
      continue;
    }
    if (st) return cli_fail(cmd, st), -2;
    /* Not the identity: an older manifest holds the hash of the files' bytes. */
    if (!strcmp(want, got) || dflash_dataset_tokenizer_matches(p, want) == DFLASH_OK) return 1;
    found = 1;
  }
  return found ? 0 : -1;
}

int cli_tokenizer_matches(const char *cmd, const char *data_dir, const char *tok_path,
                          bool required) {
  if (dflash_storage_is_remote(data_dir)) return 0; /* the manifest is read where it lies */
  char path[4096], hash[DFLASH_TOKENIZER_HASH_LEN] = "";
  snprintf(path, sizeof path, "%s/dataset.json", data_dir);
  json_t *m = json_load_file(path, 0, NULL);
  const char *want = json_string_value(json_object_get(m, "tokenizer_hash"));
  int match = want ? hash_matches(cmd, tok_path, want, required, hash) : 1;
  if (!match)
    fprintf(stderr,
            "dflash %s: %s was tokenized with another tokenizer than %s (%s, not %s): its ids "
            "would mean other tokens; use the tokenizer `dflash tokenize` used, or "
            "--allow-tokenizer-mismatch\n",
            cmd, data_dir, tok_path, want, hash);
  json_decref(m);
  return match == 0 || match == -2;
}

int cmd_show(int argc, char **argv) {
  show_args a;
  int rc = parse(argc, argv, &a);
  if (rc) return rc < 0 ? 0 : rc;
  if (a.tok_path && !a.allow_mismatch && cli_tokenizer_matches("show", a.dir, a.tok_path, true))
    return 1;
  dflash_dataset *ds = NULL;
  dflash_tokenizer *tok = NULL;
  dflash_status st = dflash_dataset_open(a.dir, &ds);
  if (!st && a.tok_path) st = dflash_tokenizer_load(a.tok_path, NULL, &tok);
  if (st) {
    dflash_dataset_free(ds);
    return cli_fail("show", st);
  }
  size_t index = a.id ? find_id(ds, a.id) : (size_t)a.index;
  const int32_t *ids = NULL;
  const uint8_t *mask = NULL;
  size_t n = 0, sup = 0;
  const char *sid = NULL;
  if (index != (size_t)-1) st = dflash_dataset_sample(ds, index, &ids, &mask, &n, &sid);
  if (index != (size_t)-1 && !st) {
    for (size_t i = 0; i < n; i++) sup += mask[i] != 0;
    printf("# sample %zu, id %s: %zu tokens, %zu supervised\n", index, sid, n, sup);
    st = print_tokens(&a, tok, ids, mask, n);
  }
  dflash_tokenizer_free(tok);
  dflash_dataset_free(ds);
  if (st) return cli_fail("show", st);
  return index == (size_t)-1 ? 1 : 0;
}

/* ---- `dflash inspect DATASET` -------------------------------------------------------- */

int cli_is_dataset(const char *path) {
  char p[4096];
  snprintf(p, sizeof p, "%s/dataset.json", path);
  return access(p, R_OK) == 0;
}

static void print_histogram(const dflash_dataset *ds, size_t longest) {
  enum { BINS = 8 };
  size_t width = longest / BINS + 1;
  uint64_t counts[BINS] = {0}, most = 1;
  if (dflash_dataset_length_histogram(ds, width, BINS, counts)) return;
  for (int b = 0; b < BINS; b++) most = counts[b] > most ? counts[b] : most;
  printf("length histogram (tokens):\n");
  for (int b = 0; b < BINS; b++)
    printf("  %7zu-%-7zu %8llu %.*s\n", b * width, (b + 1) * width - 1,
           (unsigned long long)counts[b], (int)(40 * counts[b] / most),
           "########################################");
}

static const char *str_or(const char *s, const char *dflt) { return s ? s : dflt; }

int cli_dataset_summary(const char *dir) {
  dflash_dataset *ds;
  dflash_status st = dflash_dataset_open(dir, &ds);
  if (st) return cli_fail("inspect", st);
  char path[4096];
  snprintf(path, sizeof path, "%s/dataset.json", dir);
  json_t *m = json_load_file(path, 0, NULL);
  size_t n = dflash_dataset_count(ds), longest = 0;
  uint64_t tokens = dflash_dataset_tokens(ds), sup = 0;
  for (size_t i = 0; i < n; i++) {
    const uint8_t *mask;
    size_t len;
    if (dflash_dataset_sample(ds, i, NULL, &mask, &len, NULL)) continue;
    for (size_t k = 0; k < len; k++) sup += mask[k] != 0;
    longest = len > longest ? len : longest;
  }
  char *opts = json_dumps(json_object_get(m, "options"), JSON_COMPACT);
  printf("dataset %s: %zu samples, %llu tokens (mean %.1f, longest %zu), supervised %llu "
         "(%.1f%%)\ntemplate %s, options %s\ntokenizer %s\nshards %zu\n",
         dir, n, (unsigned long long)tokens, n ? (double)tokens / (double)n : 0.0, longest,
         (unsigned long long)sup, tokens ? 100.0 * (double)sup / (double)tokens : 0.0,
         str_or(json_string_value(json_object_get(m, "template")), "?"), opts ? opts : "{}",
         str_or(json_string_value(json_object_get(m, "tokenizer_hash")), "?"),
         json_array_size(json_object_get(m, "shards")));
  free(opts);
  if (n) print_histogram(ds, longest);
  json_decref(m);
  dflash_dataset_free(ds);
  return 0;
}

/* ---- `dflash inspect HIDDEN` ----------------------------------------------------------- */

/* A libdflash store (its index), or a folder of vLLM's hs_*.safetensors files. */
int cli_is_hidden_store(const char *path) {
  return dflash_hidden_layout_of(path) != DFLASH_HIDDEN_LAYOUT_NONE;
}

int cli_hidden_summary(const char *dir) {
  dflash_hidden *h;
  dflash_status st = dflash_hidden_open(dir, &h);
  if (st) return cli_fail("inspect", st);
  dflash_hidden_info info = {.struct_size = sizeof info};
  if ((st = dflash_hidden_get_info(h, &info))) {
    dflash_hidden_free(h);
    return cli_fail("inspect", st);
  }
  int32_t K = info.num_layers, H = info.hidden_size;
  double *rms = calloc((size_t)K, sizeof *rms);
  uint64_t *zero = calloc((size_t)K, sizeof *zero), rows = 0;
  st = rms && zero ? dflash_hidden_stats(h, rms, zero, &rows) : DFLASH_E_NOMEM;
  if (!st) {
    printf("hidden-state store %s: %llu samples, %llu tokens, %d layers x %d (%s)\n", dir,
           (unsigned long long)info.count, (unsigned long long)rows, K, H,
           info.dtype == DFLASH_DTYPE_BF16 ? "bf16" : "fp8_e4m3");
    int bad = 0;
    for (int32_t k = 0; k < K; k++) {
      bool dead = rows && zero[k] == rows;
      bad += dead;
      printf("  layer %d: rms %.6g, all-zero rows %llu%s\n", k, rms[k], (unsigned long long)zero[k],
             dead ? "  <- never captured: training refuses it" : "");
    }
    if (bad) printf("%d layer(s) hold only zeros\n", bad);
  }
  free(rms);
  free(zero);
  dflash_hidden_free(h);
  return st ? cli_fail("inspect", st) : 0;
}
