/* `dflash init-config`: a drafter config.json for a target model, from the target's own
 * config.json and the spec's defaults, so nobody writes drafter.json by hand. The drafter
 * JSON is assembled here and then parsed and saved by the library, so YaRN's derived
 * attention factor and the validation are the library's. */
#include <dflash/dataset.h>
#include <dflash/train.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"

static const char USAGE[] =
    "usage: dflash init-config --target DIR [--layers N] [--block B] [--mask-token-id ID]\n"
    "                          [--arch dflash|dflash2|dspark] [--conv-kernel K] [--conv-group G]\n"
    "                          [--selector-top-k N] [--selector-rank R] [--markov-rank R]\n"
    "                          [--no-confidence-head] [--draft-vocab N --data DIR]\n"
    "                          [-o drafter.json]\n"
    "Writes a DFlash drafter config.json (z-lab's layout, what `dflash train --config` and\n"
    "the engines read) for the target whose config.json is in DIR (or DIR itself is that\n"
    "file; a multimodal config's text_config is used):\n"
    "  hidden and intermediate size, vocabulary, RMSNorm eps, RoPE theta and scaling (YaRN\n"
    "  included) and the number of target layers L from the target;\n"
    "  --layers N drafter layers (5 for Qwen targets, 6 for Kimi, as z-lab's drafters), and\n"
    "  as many target layers by the spec's rule: round(1 + i*(L-4)/(N-1));\n"
    "  heads as the target's (Kimi: 64 query / 8 KV heads of 128, z-lab's Kimi drafter);\n"
    "  --block B (16; 8 for dspark); the mask token of the family (Qwen3 vocabulary: 151669, Kimi:\n"
    "  163838; other targets need --mask-token-id).\n"
    "--arch dflash2: a DFlash 2 drafter (DFlash2DraftModel: a grouped dynamic causal\n"
    "  convolution around every sublayer and a candidate selector; `dflash train` trains it\n"
    "  on the CPU backend) with --conv-kernel 2, --conv-group 16, --selector-top-k 16,\n"
    "  --selector-rank 256 (examples/pipeline's sizes). Default --arch dflash.\n"
    "--arch dspark: a DSpark drafter (Qwen3DSparkModel: an anchor-first block, a vanilla\n"
    "  low-rank Markov head on the previous token, --markov-rank 256, and a confidence head,\n"
    "  off with --no-confidence-head; num_anchors 512), block 8 by default (16 offered:\n"
    "  train the block the engine will draft). `dflash train` trains it on the CPU backend.\n"
    "--draft-vocab N --data DIR (dspark only): a pruned draft vocabulary of N tokens,\n"
    "  draft_vocab_size N: the N token ids most often supervised (loss_mask 1) in the\n"
    "  tokenized dataset DIR (ties: the lower id; too few seen: the lowest unused ids),\n"
    "  spec/dspark.md section 4. Prints the kept set's coverage of the supervised tokens\n"
    "  (acceptance cannot exceed it); training picks the same set\n"
    "  from its own data, and the checkpoint stores it (d2t, t2d).\n"
    "-o: the output file (default drafter.json; an existing file is refused).\n"
    "Exit status: 0 written; 1 an error (message on stderr); 2 a usage error.\n";

typedef struct {
  const char *target, *out;
  int layers, block, mask;
  int arch, kernel, group, top_k, rank;
  int markov_rank, no_confidence;
  int draft_vocab;
  const char *data;
} init_args;

enum { ARCH_DFLASH, ARCH_DFLASH2, ARCH_DSPARK };

static int parse_arch(const char *v, void *dst) {
  int *arch = dst;
  if (!strcmp(v, "dflash")) *arch = ARCH_DFLASH;
  else if (!strcmp(v, "dflash2")) *arch = ARCH_DFLASH2;
  else if (!strcmp(v, "dspark")) *arch = ARCH_DSPARK;
  else return -1;
  return 0;
}

static int parse(int argc, char **argv, init_args *a) {
  *a = (init_args){.out = "drafter.json",
                   .block = 0, /* the architecture's: 16, DSpark 8 (spec/dspark.md) */
                   .mask = -1,
                   .kernel = 2,
                   .group = 16,
                   .top_k = 16,
                   .rank = 256,
                   .markov_rank = 256};
  const cli_opt opts[] = {{"--target", CLI_STR, &a->target, 0, 0, NULL},
                          {"-o", CLI_STR, &a->out, 0, 0, NULL},
                          {"--out", CLI_STR, &a->out, 0, 0, NULL},
                          {"--layers", CLI_INT, &a->layers, 1, 64, NULL},
                          {"--block", CLI_INT, &a->block, 2, 1024, NULL},
                          {"--mask-token-id", CLI_INT, &a->mask, 0, INT32_MAX, NULL},
                          {"--arch", CLI_FN, &a->arch, 0, 0, parse_arch},
                          {"--conv-kernel", CLI_INT, &a->kernel, 1, 64, NULL},
                          {"--conv-group", CLI_INT, &a->group, 1, INT32_MAX, NULL},
                          {"--selector-top-k", CLI_INT, &a->top_k, 1, 1024, NULL},
                          {"--selector-rank", CLI_INT, &a->rank, 1, 65536, NULL},
                          {"--markov-rank", CLI_INT, &a->markov_rank, 1, 65536, NULL},
                          {"--no-confidence-head", CLI_FLAG, &a->no_confidence, 0, 0, NULL},
                          {"--draft-vocab", CLI_INT, &a->draft_vocab, 1, INT32_MAX, NULL},
                          {"--data", CLI_STR, &a->data, 0, 0, NULL},
                          {NULL, 0, NULL, 0, 0, NULL}};
  int n_pos, rc = cli_parse("init-config", USAGE, opts, argc, argv, NULL, 0, &n_pos);
  if (rc) return rc == 1 ? -1 : rc;
  if (!a->block) a->block = a->arch == ARCH_DSPARK ? 8 : 16;
  if ((a->draft_vocab || a->data) && a->arch != ARCH_DSPARK)
    return fprintf(stderr,
                   "dflash init-config: --draft-vocab is for --arch dspark only (no "
                   "engine's DFlash loader reads d2t)\n%s",
                   USAGE),
           2;
  if (!a->draft_vocab != !a->data)
    return fprintf(stderr, "dflash init-config: --draft-vocab N and --data DIR go together\n%s",
                   USAGE),
           2;
  return a->target ? 0 : cli_missing("init-config", "--target");
}

/* The target's text-model config: DIR/config.json or the file itself, text_config inside. */
static json_t *load_target(const char *target, json_t **root) {
  char path[4096];
  size_t n = strlen(target);
  bool file = n > 5 && !strcmp(target + n - 5, ".json");
  snprintf(path, sizeof path, "%s%s", target, file ? "" : "/config.json");
  json_error_t err;
  *root = json_load_file(path, JSON_REJECT_DUPLICATES, &err);
  if (!*root) {
    fprintf(stderr, "dflash init-config: %s: %s (line %d)\n", path, err.text, err.line);
    return NULL;
  }
  json_t *text = json_object_get(*root, "text_config");
  return json_is_object(text) ? text : *root;
}

static bool is_kimi(const char *model_type) {
  return model_type && (strstr(model_type, "kimi") || !strcmp(model_type, "deepseek_v3"));
}

static int get_int(json_t *t, const char *key) {
  json_t *v = json_object_get(t, key);
  return json_is_integer(v) ? (int)json_integer_value(v) : 0;
}

/* The sizes the drafter takes from the target, refused (named) outside 1..2^31-1 instead of
 * being cut to 32 bits. */
static bool sizes_in_range(json_t *t) {
  static const char *const keys[] = {
      "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
      "head_dim",    "vocab_size",        "num_hidden_layers"};
  for (size_t i = 0; i < sizeof keys / sizeof *keys; i++) {
    json_t *v = json_object_get(t, keys[i]);
    json_int_t x = json_is_integer(v) ? json_integer_value(v) : 1;
    if (x < 1 || x > INT32_MAX) {
      fprintf(stderr, "dflash init-config: the target's %s %lld is outside 1..%d\n", keys[i],
              (long long)x, INT32_MAX);
      return false;
    }
  }
  return true;
}

/* The drafter's JSON text from the target's config; NULL (message printed) when a field the
 * drafter needs is missing. */
/* More drafter layers than the rule has distinct target layers (1..L-3) would feed the drafter
 * the same layer twice: K*H features of which some repeat, a wider fc for nothing. Refused
 * with the most that do not repeat. (ids ascend, so a repeat is a neighbour.) */
static bool repeats_layers(const int *ids, int layers, int target_layers) {
  for (int i = 1; i < layers; i++)
    if (ids[i] == ids[i - 1]) {
      fprintf(stderr,
              "dflash init-config: %d drafter layers would repeat target layer %d: the rule "
              "spreads them over layers 1..%d of the %d-layer target, so --layers %d at most "
              "(or write dflash_config.target_layer_ids by hand)\n",
              layers, ids[i], target_layers - 3, target_layers, target_layers - 3);
      return true;
    }
  return false;
}

static char *drafter_json(json_t *t, const init_args *a) {
  const char *type = json_string_value(json_object_get(t, "model_type"));
  bool kimi = is_kimi(type);
  if (!sizes_in_range(t)) return NULL;
  int heads = get_int(t, "num_attention_heads"), kv = get_int(t, "num_key_value_heads");
  int hidden = get_int(t, "hidden_size"), vocab = get_int(t, "vocab_size");
  int head_dim = get_int(t, "head_dim"), target_layers = get_int(t, "num_hidden_layers");
  if (kimi) kv = 8, head_dim = 128; /* z-lab's Kimi drafter (the target attends with MLA) */
  if (!head_dim && heads) head_dim = hidden / heads;
  int mask = a->mask >= 0 ? a->mask : kimi ? 163838 : vocab == 151936 ? 151669 : -1;
  if (!hidden || !heads || !vocab || !target_layers || !get_int(t, "intermediate_size")) {
    fprintf(stderr, "dflash init-config: the target config lacks hidden_size, "
                    "intermediate_size, num_attention_heads, vocab_size or num_hidden_layers\n");
    return NULL;
  }
  if (mask < 0) {
    fprintf(stderr,
            "dflash init-config: no known mask token for model_type %s with a "
            "%d-token vocabulary: pass --mask-token-id\n",
            type ? type : "(none)", vocab);
    return NULL;
  }
  int layers = a->layers ? a->layers : kimi ? 6 : 5;
  int ids[64];
  if (dflash_drafter_default_target_layers(target_layers, layers, ids)) {
    cli_fail("init-config", DFLASH_E_CONFIG);
    return NULL;
  }
  if (repeats_layers(ids, layers, target_layers)) return NULL;
  json_t *ids_json = json_array();
  for (int i = 0; i < layers; i++) json_array_append_new(ids_json, json_integer(ids[i]));
  json_t *d = json_pack("{s:[s],s:s,s:i,s:O,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:{s:i,s:o,s:i}}",
                        "architectures", "DFlashDraftModel", "model_type", "qwen3", "hidden_size",
                        hidden, "intermediate_size", json_object_get(t, "intermediate_size"),
                        "num_hidden_layers", layers, "num_attention_heads", heads,
                        "num_key_value_heads", kv ? kv : heads, "head_dim", head_dim, "vocab_size",
                        vocab, "num_target_layers", target_layers, "block_size", a->block,
                        "dflash_config", "mask_token_id", mask, "target_layer_ids", ids_json,
                        "block_size", a->block);
  if (d && a->arch == ARCH_DSPARK) {
    /* The spec's top-level keys; the library writes them into dflash_config as well. */
    json_object_set_new(d, "architectures", json_pack("[s]", "Qwen3DSparkModel"));
    json_object_set_new(d, "markov_rank", json_integer(a->markov_rank));
    json_object_set_new(d, "markov_head_type", json_string("vanilla"));
    json_object_set_new(d, "enable_confidence_head", json_boolean(!a->no_confidence));
    json_object_set_new(d, "confidence_head_with_markov", json_true());
    json_object_set_new(d, "sample_from_anchor", json_true());
    json_object_set_new(d, "num_anchors", json_integer(512)); /* DeepSpec's recipe */
    if (a->draft_vocab) json_object_set_new(d, "draft_vocab_size", json_integer(a->draft_vocab));
  }
  if (d && a->arch == ARCH_DFLASH2) {
    json_object_set_new(d, "architectures", json_pack("[s]", "DFlash2DraftModel"));
    json_t *dc = json_object_get(d, "dflash_config");
    json_object_set_new(dc, "conv_kernel_size", json_integer(a->kernel));
    json_object_set_new(dc, "conv_group_size", json_integer(a->group));
    json_object_set_new(dc, "selector_top_k", json_integer(a->top_k));
    json_object_set_new(dc, "selector_rank", json_integer(a->rank));
  }
  /* RoPE and norms as the target has them (the library derives YaRN's attention factor). */
  static const char *const copied[] = {"rms_norm_eps", "rope_theta", "rope_scaling",
                                       "max_position_embeddings", "partial_rotary_factor"};
  for (size_t i = 0; d && i < sizeof copied / sizeof *copied; i++) {
    json_t *v = json_object_get(t, copied[i]);
    if (v) json_object_set(d, copied[i], v);
  }
  /* YaRN: transformers versions read the factor or max/original; make them agree (Qwen's
   * docs pair factor 4 with original 32768 on a 40960-position config). */
  json_t *rs = json_object_get(t, "rope_scaling");
  json_t *f = json_object_get(rs, "factor"),
         *orig = json_object_get(rs, "original_max_position_embeddings");
  if (d && json_is_number(f) && json_is_integer(orig))
    json_object_set_new(
        d, "max_position_embeddings",
        json_integer((json_int_t)(json_number_value(f) * (double)json_integer_value(orig) + 0.5)));
  char *s = d ? json_dumps(d, JSON_COMPACT) : NULL;
  json_decref(d);
  return s;
}

/* --draft-vocab N --data DIR: the kept set's coverage (the checkpoint's tables are picked
 * again by training, by the same rule); N above the vocabulary was refused by the parse. */
static dflash_status draft_vocab(const init_args *a, const dflash_drafter_config *cfg,
                                 double *coverage) {
  dflash_dataset *ds = NULL;
  int32_t *kept = malloc(sizeof(int32_t) * (size_t)a->draft_vocab);
  dflash_status st = kept ? dflash_dataset_open(a->data, &ds) : DFLASH_E_NOMEM;
  if (!st)
    st = dflash_draft_vocab_from_dataset(ds, cfg->vocab_size, a->draft_vocab, kept, coverage);
  dflash_dataset_free(ds);
  free(kept);
  return st;
}

int cmd_init_config(int argc, char **argv) {
  init_args a;
  int rc = parse(argc, argv, &a);
  if (rc) return rc < 0 ? 0 : rc;
  FILE *exists = fopen(a.out, "r");
  if (exists) {
    fclose(exists);
    return fprintf(stderr, "dflash init-config: %s exists; remove it or pass another -o\n", a.out),
           1;
  }
  json_t *root;
  json_t *t = load_target(a.target, &root);
  char *text = t ? drafter_json(t, &a) : NULL;
  json_decref(root);
  if (!text) return 1;
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  dflash_status st = dflash_drafter_config_parse(text, strlen(text), a.target, &cfg);
  free(text);
  double coverage = 0;
  if (!st && a.draft_vocab) st = draft_vocab(&a, &cfg, &coverage);
  if (!st) st = dflash_drafter_config_save(&cfg, a.out);
  if (st) return cli_fail("init-config", st);
  fprintf(stderr, "dflash init-config: %s: %d layers over target layers", a.out,
          cfg.num_hidden_layers);
  for (int i = 0; i < cfg.n_target_layer_ids; i++)
    fprintf(stderr, "%s%d", i ? ", " : " ", cfg.target_layer_ids[i]);
  fprintf(stderr, " of %d, block %d, mask token %d", cfg.num_target_layers, cfg.block_size,
          cfg.mask_token_id);
  if (cfg.dflash2)
    fprintf(stderr, "; DFlash 2: conv kernel %d, group %d, selector top-%d, rank %d",
            cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_top_k, cfg.selector_rank);
  if (cfg.dspark)
    fprintf(stderr, "; DSpark: Markov rank %d, confidence head %s", cfg.markov_rank,
            cfg.confidence_head ? "on" : "off");
  if (a.draft_vocab)
    fprintf(stderr,
            "; draft vocabulary %d of %d tokens, covering %.4f%% of the supervised tokens in "
            "%s (acceptance cannot exceed it)",
            a.draft_vocab, cfg.vocab_size, 100.0 * coverage, a.data);
  fputc('\n', stderr);
  return 0;
}
