/* `dflash eval`: a thin caller of dflash_trainer_eval and dflash_trainer_eval_walk. */
#include <dflash/dataset.h>
#include <dflash/train.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "train_common.h"

/* --allow-tokenizer-mismatch: skip the tokenizer hash check. */
static int g_allow_tok;

static const char EVAL_USAGE[] =
    "usage: dflash eval --checkpoint DIR --target DIR --data DIR --hidden DIR\n"
    "                   [--anchors N] [--seed N] [--max-tokens N] [--json]\n"
    "                   [--embed-name NAME] [--lm-head-name NAME] [--labels data|target]\n"
    "                   [--threads N] [--allow-tokenizer-mismatch]\n"
    "Prints the mean acceptance length tau (1 + leading block positions whose greedy\n"
    "prediction equals the target's token) over --anchors sampled anchors per sample\n"
    "and the per-position accuracy; then the same mean over every position (uniform\n"
    "anchors, exact) and the speculative walk's tau = tokens / verification steps, the\n"
    "number live greedy speculative decoding gets, each with its standard error over\n"
    "sequences. Then, over every position, the accuracy of the drafted tokens (DFlash 2:\n"
    "the candidate selector's greedy path) and of the drafter's plain argmax, and for\n"
    "DFlash 2 the candidate recall (true token among the top selector_top_k logits).\n"
    "--max-tokens: walk at most N tokens per answer (the generation cap).\n"
    "--labels: what a draft is compared with in the uniform-anchor and walk numbers: the\n"
    "data's next token (data, default) or the target's greedy token from the store's\n"
    "target ids (target: what greedy verification accepts). Live greedy acceptance is the\n"
    "walk tau on data the target wrote greedily (T = 0) or, on data sampled at T > 0 (the\n"
    "K2.6 recipe in docs/deployment.md), the walk tau with --labels target; the walk tau\n"
    "with data labels on sampled data is not. The sampled-anchor tau always uses data\n"
    "labels. Every line says which labels it used. In --json, \"tau\" uses --labels (with\n"
    "target labels it is the uniform-anchor tau) and \"sampled_tau\" is the sampled-anchor\n"
    "one (data).\n"
    "--threads N: CPU threads (0, default: one per CPU).\n"
    "Tokenizer files in --target whose hash is not the dataset's tokenizer_hash are refused\n"
    "unless --allow-tokenizer-mismatch.\n"
    "A DSpark drafter (architectures Qwen3DSparkModel) drafts B tokens a block, anchor-first,\n"
    "chained greedily through its Markov head (each slot on the token drafted before it, as\n"
    "llama.cpp, vLLM and SGLang draft at T = 0), so its accuracy lists B drafts and a step\n"
    "gains up to B + 1 tokens; the keys above are the same, so a DSpark and a DFlash drafter\n"
    "compare directly (drafts_per_block says B - 1 or B). It adds the probabilistic tau,\n"
    "1 + sum_k prod_{j<=k} (1 - L1_j/2), teacher-forced against the target's distribution\n"
    "(needs a store written with the target's final state, final_state; else unavailable:\n"
    "null in --json), and the confidence head's calibration: per slot, over the walk's steps\n"
    "that reached it, the mean predicted acceptance against the fraction accepted, and the\n"
    "expected calibration error (10 bins).\n"
    "--json: one JSON object instead (with launch: the vLLM and SGLang flags that serve\n"
    "the checkpoint). Defaults: --anchors 64, --seed 1, --max-tokens 0\n"
    "(no cap). Exit status: 0 evaluated; 1 an error (message on stderr); 2 a usage error.\n";

static void print_doubles(const char *sep, const double *v, int n) {
  for (int k = 0; k < n; k++) printf("%s%.4f", k ? sep : "", v[k]);
}

static void print_ints(const char *sep, const int64_t *v, int n) {
  for (int k = 0; k < n; k++) printf("%s%lld", k ? sep : "", (long long)v[k]);
}

/* A number, or null when it is negative (unavailable). */
static void print_opt(double v) {
  if (v >= 0) printf("%.6f", v);
  else printf("null");
}

/* DSpark's keys (--json) or lines: the probabilistic tau and the confidence calibration. */
static void print_dspark(bool json, int B, const dflash_eval_walk *w) {
  bool conf = w->conf_ece >= 0;
  if (json) {
    printf(", \"probabilistic_tau\": ");
    print_opt(w->prob_tau);
    printf(", \"probabilistic_tau_se\": ");
    print_opt(w->prob_tau >= 0 ? w->prob_tau_se : -1);
    printf(", \"confidence_predicted\": ");
    if (conf) printf("["), print_doubles(", ", w->conf_predicted, B), printf("]");
    else printf("null");
    printf(", \"confidence_observed\": ");
    if (conf) printf("["), print_doubles(", ", w->conf_observed, B), printf("]");
    else printf("null");
    printf(", \"confidence_count\": ");
    if (conf) printf("["), print_ints(", ", w->conf_count, B), printf("]");
    else printf("null");
    printf(", \"confidence_ece\": ");
    print_opt(w->conf_ece);
    return;
  }
  if (w->prob_tau >= 0)
    printf("probabilistic tau %.4f +- %.4f over every position (teacher-forced, against the "
           "target's distribution)\n",
           w->prob_tau, w->prob_tau_se);
  else
    printf("probabilistic tau unavailable: the store holds no target final state (write it "
           "with final_state)\n");
  if (!conf) {
    printf("confidence calibration: none (no confidence head, or no walk step)\n");
    return;
  }
  printf("confidence by slot, predicted / accepted over the walk's steps that reached it:");
  for (int k = 0; k < B; k++)
    printf(" %.4f/%.4f (%lld)", w->conf_predicted[k], w->conf_observed[k],
           (long long)w->conf_count[k]);
  printf("\nconfidence ECE %.4f\n", w->conf_ece);
}

/* A pruned drafter's kept ids against the evaluation data: the share of its supervised
 * tokens the draft vocabulary holds, which no drafted token outside can be accepted for
 * (acceptance cannot exceed it). -1 when the drafter is not pruned. */
static dflash_status vocab_coverage(const dflash_trainer *t, const dflash_drafter_config *cfg,
                                    const char *data, double *coverage) {
  *coverage = -1;
  if (cfg->draft_vocab_size <= 0 || cfg->draft_vocab_size >= cfg->vocab_size) return DFLASH_OK;
  int32_t *kept = malloc(sizeof *kept * (size_t)cfg->draft_vocab_size), n = 0;
  int64_t *counts = malloc(sizeof *counts * (size_t)cfg->vocab_size), total = 0;
  dflash_dataset *ds = NULL;
  dflash_status st = kept && counts ? DFLASH_OK : DFLASH_E_NOMEM;
  if (!st) st = dflash_trainer_draft_vocab(t, kept, cfg->draft_vocab_size, &n);
  if (!st) st = dflash_dataset_open(data, &ds);
  if (!st) st = dflash_dataset_token_counts(ds, cfg->vocab_size, counts, &total);
  if (!st) {
    int64_t in = 0;
    for (int32_t i = 0; i < n; i++) in += counts[kept[i]];
    *coverage = total > 0 ? (double)in / (double)total : 0;
  }
  dflash_dataset_free(ds);
  free(kept), free(counts);
  return st;
}

static void print_eval(bool json, int B, bool dspark, double tau, const double *acc, int64_t blocks,
                       const dflash_eval_walk *w, const char *ckpt, int32_t vd, double coverage) {
  const char *lab = w->labels == DFLASH_TRAIN_LABELS_TARGET ? "target" : "data";
  int nd = dspark ? B : B - 1; /* drafts a block */
  if (json) {
    /* "tau" is the labels' own: the sampled-anchor tau (blocks, accuracy) knows data labels
     * only, so with target labels it is the uniform-anchor tau, the same mean over every
     * position; the sampled one stays as sampled_tau. */
    double own = w->labels == DFLASH_TRAIN_LABELS_TARGET ? w->position_tau : tau;
    printf("{\"block_size\": %d, \"drafter\": \"%s\", \"drafts_per_block\": %d, "
           "\"labels\": \"%s\", \"tau\": %.6f, \"sampled_tau\": %.6f, "
           "\"sampled_labels\": \"data\", \"blocks\": %lld, \"accuracy\": [",
           B, dspark ? "dspark" : "dflash", nd, lab, own, tau, (long long)blocks);
    print_doubles(", ", acc, nd);
    printf("], \"position_tau\": %.6f, \"position_tau_se\": %.6f, \"positions\": %lld, "
           "\"position_accuracy\": [",
           w->position_tau, w->position_tau_se, (long long)w->positions);
    print_doubles(", ", w->accuracy, nd);
    printf("], \"walk_tau\": %.6f, \"walk_tau_se\": %.6f, \"steps\": %lld, \"tokens\": %lld, "
           "\"sequences\": %lld, \"tokens_per_step_histogram\": [",
           w->walk_tau, w->walk_tau_se, (long long)w->steps, (long long)w->tokens,
           (long long)w->sequences);
    print_ints(", ", w->step_hist, nd + 1);
    printf("], \"scored\": %lld, \"selector_accuracy\": %.6f, \"backbone_accuracy\": %.6f, "
           "\"candidate_recall\": ",
           (long long)w->scored, w->selector_accuracy, w->backbone_accuracy);
    if (w->candidate_recall >= 0) printf("%.6f", w->candidate_recall);
    else printf("null");
    if (dspark) print_dspark(true, B, w);
    if (coverage >= 0)
      printf(", \"draft_vocab_size\": %d, \"draft_vocab_coverage\": %.6f", vd, coverage);
    else printf(", \"draft_vocab_size\": null, \"draft_vocab_coverage\": null");
    json_t *l = train_launch_json(ckpt);
    char *ls = l ? json_dumps(l, JSON_COMPACT) : NULL;
    printf(", \"launch\": %s}\n", ls ? ls : "null");
    free(ls);
    json_decref(l);
    return;
  }
  printf("tau %.4f over %lld blocks (block size %d%s; data labels)\naccuracy by position: ", tau,
         (long long)blocks, B, dspark ? ", DSpark: B drafts a block" : "");
  print_doubles(" ", acc, nd);
  printf("\nuniform-anchor tau %.4f +- %.4f over every position (%lld; %s labels)\n"
         "accuracy by position: ",
         w->position_tau, w->position_tau_se, (long long)w->positions, lab);
  print_doubles(" ", w->accuracy, nd);
  printf("\nwalk tau %.4f +- %.4f (%s labels): %lld tokens in %lld verification steps, %lld "
         "sequences\ntokens per step 1..%d: ",
         w->walk_tau, w->walk_tau_se, lab, (long long)w->tokens, (long long)w->steps,
         (long long)w->sequences, nd + 1);
  print_ints(" ", w->step_hist, nd + 1);
  printf("\naccuracy over every position (%lld): drafted %.4f, backbone argmax %.4f",
         (long long)w->scored, w->selector_accuracy, w->backbone_accuracy);
  if (w->candidate_recall >= 0) printf(", candidate recall (top-K) %.4f", w->candidate_recall);
  printf("\n");
  if (dspark) print_dspark(false, B, w);
  if (coverage >= 0)
    printf("draft vocabulary: %d tokens, holding %.4f of the data's supervised tokens (no "
           "draft outside it can be accepted)\n",
           vd, coverage);
}

int cmd_eval(int argc, char **argv) {
  const char *ckpt = NULL, *target = NULL, *data = NULL, *hidden = NULL, *en = NULL, *hn = NULL;
  int anchors = 64, max_tokens = 0, json = 0, threads = 0;
  int32_t labels = DFLASH_TRAIN_LABELS_DATA;
  int64_t seed = 1;
  const cli_opt opts[] = {{"--checkpoint", CLI_STR, &ckpt, 0, 0, NULL},
                          {"--target", CLI_STR, &target, 0, 0, NULL},
                          {"--data", CLI_STR, &data, 0, 0, NULL},
                          {"--hidden", CLI_STR, &hidden, 0, 0, NULL},
                          {"--anchors", CLI_INT, &anchors, 1, INT32_MAX, NULL},
                          {"--seed", CLI_I64, &seed, 0, (double)INT64_MAX, NULL},
                          {"--max-tokens", CLI_INT, &max_tokens, 0, INT32_MAX, NULL},
                          {"--json", CLI_FLAG, &json, 0, 0, NULL},
                          {"--embed-name", CLI_STR, &en, 0, 0, NULL},
                          {"--lm-head-name", CLI_STR, &hn, 0, 0, NULL},
                          {"--labels", CLI_FN, &labels, 0, 0, train_parse_labels},
                          {"--threads", CLI_INT, &threads, 0, 4096, NULL},
                          {"--allow-tokenizer-mismatch", CLI_FLAG, &g_allow_tok, 0, 0, NULL},
                          {NULL, 0, NULL, 0, 0, NULL}};
  int n_pos;
  int rc = cli_parse("eval", EVAL_USAGE, opts, argc, argv, NULL, 0, &n_pos);
  if (rc) return rc == 1 ? 0 : rc;
  static const char *const required[] = {"--checkpoint", "--target", "--data", "--hidden"};
  const char *const have[] = {ckpt, target, data, hidden};
  for (int i = 0; i < 4; i++)
    if (!have[i]) return cli_missing("eval", required[i]);
  if (!g_allow_tok && cli_tokenizer_matches("eval", data, target, false)) return 1;
  char path[4096];
  snprintf(path, sizeof path, "%s/config.json", ckpt);
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  dflash_status st = dflash_drafter_config_load(path, &cfg);
  if (st) return cli_fail("eval", st);
  size_t vh = (size_t)cfg.vocab_size * (size_t)cfg.hidden_size;
  float *e = malloc(vh * sizeof *e), *h = malloc(vh * sizeof *h);
  /* [B] holds the drafts a block, B - 1 or (DSpark) B; the step histogram B + 1 */
  double *acc = calloc((size_t)cfg.block_size, sizeof *acc);
  dflash_trainer *t = NULL;
  dflash_eval ev;
  dflash_eval_default(&ev);
  ev.anchors_per_seq = anchors;
  ev.seed = (uint64_t)seed;
  ev.accuracy = acc;
  dflash_eval_walk w;
  dflash_eval_walk_default(&w);
  w.max_tokens = max_tokens;
  w.labels = labels;
  dflash_trainer_options topt;
  dflash_trainer_options_default(&topt);
  topt.n_threads = threads;
  w.accuracy = calloc((size_t)cfg.block_size, sizeof *w.accuracy);
  w.step_hist = calloc((size_t)cfg.block_size + 1, sizeof *w.step_hist);
  w.conf_predicted = calloc((size_t)cfg.block_size, sizeof *w.conf_predicted);
  w.conf_observed = calloc((size_t)cfg.block_size, sizeof *w.conf_observed);
  w.conf_count = calloc((size_t)cfg.block_size, sizeof *w.conf_count);
  if (!e || !h || !acc || !w.accuracy || !w.step_hist || !w.conf_predicted || !w.conf_observed ||
      !w.conf_count)
    st = DFLASH_E_NOMEM;
  if (!st) st = dflash_target_load_head(target, en, hn, cfg.vocab_size, cfg.hidden_size, e, h);
  if (!st) st = dflash_trainer_create(&cfg, e, h, &topt, &t);
  if (!st) st = dflash_trainer_load(t, ckpt);
  if (!st) st = dflash_trainer_eval(t, data, hidden, &ev);
  if (!st) st = dflash_trainer_eval_walk(t, data, hidden, &w);
  double coverage = -1;
  if (!st) st = vocab_coverage(t, &cfg, data, &coverage);
  if (!st)
    print_eval(json, cfg.block_size, cfg.dspark != 0, ev.tau, acc, ev.n_blocks, &w, ckpt,
               cfg.draft_vocab_size, coverage);
  dflash_trainer_free(t);
  free(e), free(h), free(acc), free(w.accuracy), free(w.step_hist);
  free(w.conf_predicted), free(w.conf_observed), free(w.conf_count);
  return st ? cli_fail("eval", st) : 0;
}
