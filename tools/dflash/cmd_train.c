/* `dflash train`: a thin caller of dflash_train_run (`train --plan` is cmd_plan.c). */
#include <dflash/progress.h>
#include <dflash/storage.h>
#include <dflash/train.h>
#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "train_common.h"

const char train_usage[] =
    "usage: dflash train --config drafter.json --target DIR --data DIR --hidden DIR -o OUT\n"
    "                    [--backend cpu|cuda] [--resume | --overwrite] [--epochs N] [--batch N]\n"
    "                    [--lr X]"
    " [--warmup-ratio X] [--weight-decay X] [--clip X] [--anchors N]\n"
    "                    [--save-every N] [--max-steps N] [--schedule-steps N|epochs]\n"
    "                    [--seed N] [--threads N] [--bf16]\n"
    "                    [--embed-name NAME] [--lm-head-name NAME] [--quiet]\n"
    "                    [--spool-wait S] [--spool-reuse] [--labels data|target]\n"
    "                    [--final-norm-name NAME] [--save-minutes M]\n"
    "                    [--schedule cosine|linear|constant] [--min-lr-ratio X]\n"
    "                    [--weighting decay|none|adaptive] [--loss-gamma X]\n"
    "                    [--optimizer adamw|muon] [--muon-momentum X]\n"
    "                    [--muon-weight-decay X] [--muon-adjust-lr match-rms-adamw|original]\n"
    "                    [--allow-settings-change] [--allow-tokenizer-mismatch]\n"
    "                    [--grad-reduce-bf16] [--dist-timeout S]\n"
    "       dflash train --plan --config drafter.json [--world N] [--seq-len N]\n"
    "                    [--anchors N] [--batch N] [--gpu NAME] [--gpu-gb X]\n"
    "                    [--smem-kb X] [--vocab-chunk N] [--no-zero1]\n"
    "                    [--optimizer adamw|muon]\n"
    "Trains a DFlash drafter on a tokenized dataset and offline target hidden states\n"
    "(a DFlash 2 drafter, `dflash init-config --arch dflash2`, on --backend cpu; a DSpark\n"
    "drafter, `--arch dspark`, on --backend cpu only: on 0.1 CE + 0.9 L1 + 1.0 BCE from a\n"
    "store written with the target's final state, HiddenWriter(..., final_state=True);\n"
    "on 0.1 CE alone, with a warning, from any other store or a spool).\n"
    "OUT gets config.json + model.safetensors (SGLang/vLLM load it), train_state/ (for\n"
    "--resume) and metrics.jsonl (one line per step). A non-empty OUT is refused unless\n"
    "--resume continues the run in it or --overwrite replaces it. At the end a JSON summary\n"
    "(steps, epoch, tokens, final_loss, elapsed_s, checkpoint; spool_wait_s on a spool;\n"
    "launch: the vLLM and SGLang flags that serve OUT; SGLang has none for a pruned DSpark\n"
    "vocabulary) goes to stdout.\n"
    "Exit status: 0 trained; 1 an error (message on stderr); 2 a usage error; 3 stopped by\n"
    "Ctrl-C/SIGTERM: the step in flight is finished, the checkpoint and train_state/ saved,\n"
    "and --resume continues byte for byte (a second signal ends it at once).\n"
    "The state also saves every --save-minutes (30; 0: never) besides --save-every, so a\n"
    "kill -9 loses at most that. A sample that cannot be read stops the run with the state\n"
    "saved as of the step before. The state records the run's settings (--lr, --batch,\n"
    "--anchors, --warmup-ratio, --epochs, --weight-decay, --clip, --labels, ...): --resume\n"
    "with other ones is refused naming each change, unless --allow-settings-change: the\n"
    "learning rate then follows a new schedule to the new end, stated at the start: from\n"
    "the new --lr, or from --lr again when the saved schedule had ended (a finished run\n"
    "extended by --epochs), else from where it was (no jump). A run whose every step\n"
    "would train at learning rate 0 is refused.\n"
    "--max-steps N stops after N steps in all (a resume's saved ones included; a state past\n"
    "it is refused) and ends the learning-rate schedule there, unless --schedule-steps N\n"
    "(its length) or --schedule-steps epochs (the epochs', as if the run went on: to stop\n"
    "early and resume later) says otherwise.\n"
    "When --target holds tokenizer files, their hash must be the dataset's recorded\n"
    "tokenizer_hash (else refused: the ids would mean other tokens) unless\n"
    "--allow-tokenizer-mismatch.\n"
    "--plan prints the CUDA backend's memory per GPU, the attention's tiles and shared\n"
    "memory per block, and exits 1 when either does not fit. --gpu h100|h200|b200|b300|\n"
    "rtx-pro-6000 sets the memory and shared memory per block (--gpu-gb, --smem-kb\n"
    "override them; without any of them, the CUDA device present (device 0), else an\n"
    "80 GB GPU with 227 KB, as an H100). --plan --optimizer muon adds the Muon step's\n"
    "workspace to the activations.\n"
    "Data parallel: start one process per rank with RANK, WORLD_SIZE, MASTER_ADDR and\n"
    "MASTER_PORT set (torchrun, or Slurm's SLURM_PROCID/SLURM_NTASKS); --batch is per rank,\n"
    "rank 0 writes OUT, and --dist-timeout S (1800) bounds waiting for a rank.\n"
    "--hidden spool:PATH (a folder or s3:// prefix) trains on a spool while a producer\n"
    "writes it (libdflash.HiddenWriter(..., spool_budget=B)): each epoch is what the\n"
    "producer published for it, in its order, up to its end-of-epoch marker; shards are\n"
    "deleted once train_state/ records them (a state save once they reach half the\n"
    "producer's budget, or when waiting). --spool-wait S (600; -1: forever) bounds the\n"
    "wait for a shard; --spool-reuse keeps epoch 0's shards and replays them for every\n"
    "later epoch (the budget must hold a whole epoch).\n"
    "--grad-reduce-bf16 (--backend cuda over NCCL) reduce-scatters the gradients in bf16:\n"
    "half the bytes, each element within about (world+1)*2^-9 of the summed magnitudes.\n"
    "--labels target trains each drafted position on the target's own greedy token (what\n"
    "greedy verification accepts) instead of the data's: the store's target ids\n"
    "(HiddenWriter.append(..., target_ids=logits.argmax(-1))), or for vLLM's hs_*.safetensors\n"
    "their final layer through the target's final norm (--final-norm-name, default\n"
    "model.norm.weight; rms_norm_eps from --target's config.json) and LM head. A store with\n"
    "neither is refused. Default: --labels data.\n"
    "--batch: sequences per rank and optimizer step, accumulated one at a time (one\n"
    "gradient reduce-scatter and one weight all-gather per step). Without it the trainer\n"
    "picks: 1, or 4 when several ranks run on GPUs without NVLink (sm_86, sm_89, sm_120:\n"
    "RTX PRO 6000 Blackwell), whose PCIe collectives would otherwise decide the step;\n"
    "the choice is printed at the start. --plan reports the same count for --gpu NAME.\n"
    "--schedule: the learning rate after the warm-up: cosine (default) or linear decay to\n"
    "--min-lr-ratio x --lr (0) at the last step, or constant. --weighting: each drafted\n"
    "block position k's loss weight: decay (default) exp(-(k-1)/gamma), gamma --loss-gamma\n"
    "(default 7, 5, 4 for block 16, 10, 8, else block/2); none: 1; adaptive (CPU only): the\n"
    "drafter's current probability of reaching k, the product of its probabilities of the\n"
    "true tokens before k in the block, each block's weights rescaled to sum to its positions\n"
    "--optimizer muon (CPU and CUDA): torch.optim.Muon, as vLLM speculators trains with it, on\n"
    "the weight matrices (Nesterov momentum --muon-momentum 0.95, decoupled decay\n"
    "--muon-weight-decay 0.1, step scaled by --muon-adjust-lr, default match-rms-adamw:\n"
    "0.2 sqrt(max side)), AdamW (--lr, --weight-decay) on the norms; speculators' recipe\n"
    "adds --lr 1e-3 --weight-decay 0.01 --schedule linear.\n"
    "(docs/recipe-study.md has the study behind the defaults).\n"
    "Defaults: --backend cpu, --epochs 6, --lr 6e-4, --warmup-ratio 0.04,\n"
    "--weight-decay 0, --clip 1, --anchors 512, --save-every 0 (at the end), --max-steps 0\n"
    "(all epochs), --seed 0, --threads 0 (one per CPU).\n";

static int parse_backend(const char *v, void *dst) {
  int32_t *b = dst; /* dflash_backend */
  if (!strcmp(v, "cpu")) *b = DFLASH_BACKEND_CPU;
  else if (!strcmp(v, "cuda")) *b = DFLASH_BACKEND_CUDA;
  else return -1;
  return 0;
}

static int parse_adjust_lr(const char *v, void *dst) {
  int32_t *a = dst; /* dflash_muon_adjust_lr */
  if (!strcmp(v, "match-rms-adamw")) *a = DFLASH_MUON_ADJUST_LR_MATCH_RMS_ADAMW;
  else if (!strcmp(v, "original")) *a = DFLASH_MUON_ADJUST_LR_ORIGINAL;
  else return -1;
  return 0;
}

static int parse_schedule(const char *v, void *dst) {
  int32_t *l = dst; /* dflash_lr_schedule */
  if (!strcmp(v, "cosine")) *l = DFLASH_LR_COSINE;
  else if (!strcmp(v, "linear")) *l = DFLASH_LR_LINEAR;
  else if (!strcmp(v, "constant")) *l = DFLASH_LR_CONSTANT;
  else return -1;
  return 0;
}

/* --weighting none is the decay with no decay (loss_gamma < 0); a later --loss-gamma
 * overrides it, so none is kept apart and applied after parsing. */
static int parse_weighting(const char *v, void *dst) {
  int32_t *w = dst; /* dflash_position_weighting, or -1: none */
  if (!strcmp(v, "decay")) *w = DFLASH_POSITION_WEIGHTING_DECAY;
  else if (!strcmp(v, "adaptive")) *w = DFLASH_POSITION_WEIGHTING_ADAPTIVE;
  else if (!strcmp(v, "none")) *w = -1;
  else return -1;
  return 0;
}

/* --schedule-steps N|epochs (run.h's schedule_steps). */
static int parse_schedule_steps(const char *v, void *dst) {
  int64_t *n = dst;
  char *end;
  if (!strcmp(v, "epochs")) return *n = DFLASH_SCHEDULE_EPOCHS, 0;
  errno = 0;
  long long k = strtoll(v, &end, 10);
  if (errno || end == v || *end || k < 1) return -1;
  *n = k;
  return 0;
}

/* --allow-tokenizer-mismatch: skip the tokenizer hash check (cmd_eval.c has its own). */
static int g_allow_tok;
/* --quiet: no progress bar. */
static int g_quiet;

static int parse_train(int argc, char **argv, dflash_train_run_options *o,
                       dflash_trainer_options *t, int *overwrite) {
  int quiet = 0, resume = 0, bf16 = 0, reuse = 0, allow = 0, rs_bf16 = 0;
  int32_t weighting = DFLASH_POSITION_WEIGHTING_DECAY;
  double gamma = 0;
  double minutes = o->save_every_s / 60;
  o->trainer = t;
  const cli_opt opts[] = {{"--config", CLI_STR, &o->config_path, 0, 0, NULL},
                          {"--target", CLI_STR, &o->target_path, 0, 0, NULL},
                          {"--data", CLI_STR, &o->data_dir, 0, 0, NULL},
                          {"--hidden", CLI_STR, &o->hidden_dir, 0, 0, NULL},
                          {"-o", CLI_STR, &o->out_dir, 0, 0, NULL},
                          {"--out", CLI_STR, &o->out_dir, 0, 0, NULL},
                          {"--embed-name", CLI_STR, &o->embed_name, 0, 0, NULL},
                          {"--lm-head-name", CLI_STR, &o->lm_head_name, 0, 0, NULL},
                          {"--backend", CLI_FN, &t->backend, 0, 0, parse_backend},
                          {"--resume", CLI_FLAG, &resume, 0, 0, NULL},
                          {"--overwrite", CLI_FLAG, overwrite, 0, 0, NULL},
                          {"--bf16", CLI_FLAG, &bf16, 0, 0, NULL},
                          {"--quiet", CLI_FLAG, &quiet, 0, 0, NULL},
                          {"--epochs", CLI_INT, &o->epochs, 1, INT32_MAX, NULL},
                          {"--batch", CLI_INT, &o->batch_size, 1, INT32_MAX, NULL},
                          {"--lr", CLI_REAL, &t->lr, 0, 1e9, NULL},
                          {"--warmup-ratio", CLI_REAL, &t->warmup_ratio, 0, 1, NULL},
                          {"--weight-decay", CLI_REAL, &t->weight_decay, 0, 1e9, NULL},
                          {"--clip", CLI_REAL, &t->grad_clip, 0, 1e300, NULL},
                          {"--anchors", CLI_INT, &t->num_anchors, 1, INT32_MAX, NULL},
                          {"--save-every", CLI_INT, &o->save_every, 0, INT32_MAX, NULL},
                          {"--max-steps", CLI_I64, &o->max_steps, 0, (double)INT64_MAX, NULL},
                          {"--schedule-steps", CLI_FN, &o->schedule_steps, 0, 0,
                           parse_schedule_steps},
                          {"--seed", CLI_I64, &t->seed, 0, (double)INT64_MAX, NULL},
                          {"--threads", CLI_INT, &t->n_threads, 0, 4096, NULL},
                          {"--spool-wait", CLI_REAL, &o->spool_wait_s, -1, 1e9, NULL},
                          {"--spool-reuse", CLI_FLAG, &reuse, 0, 0, NULL},
                          {"--labels", CLI_FN, &o->labels, 0, 0, train_parse_labels},
                          {"--final-norm-name", CLI_STR, &o->final_norm_name, 0, 0, NULL},
                          {"--save-minutes", CLI_REAL, &minutes, 0, 1e9, NULL},
                          {"--allow-settings-change", CLI_FLAG, &allow, 0, 0, NULL},
                          {"--allow-tokenizer-mismatch", CLI_FLAG, &g_allow_tok, 0, 0, NULL},
                          {"--schedule", CLI_FN, &t->lr_schedule, 0, 0, parse_schedule},
                          {"--min-lr-ratio", CLI_REAL, &t->min_lr_ratio, 0, 1, NULL},
                          {"--weighting", CLI_FN, &weighting, 0, 0, parse_weighting},
                          {"--loss-gamma", CLI_REAL, &gamma, 0, 1e9, NULL},
                          {"--optimizer", CLI_FN, &t->optimizer, 0, 0, train_parse_optimizer},
                          {"--muon-momentum", CLI_REAL, &t->muon_momentum, 0, 0.999999, NULL},
                          {"--muon-weight-decay", CLI_REAL, &t->muon_weight_decay, 0, 1e9, NULL},
                          {"--muon-adjust-lr", CLI_FN, &t->muon_adjust_lr, 0, 0, parse_adjust_lr},
                          {"--grad-reduce-bf16", CLI_FLAG, &rs_bf16, 0, 0, NULL},
                          {"--dist-timeout", CLI_REAL, &t->dist_timeout_s, 1e-3, 1e9, NULL},
                          {NULL, 0, NULL, 0, 0, NULL}};
  int n_pos;
  int rc = cli_parse("train", train_usage, opts, argc, argv, NULL, 0, &n_pos);
  if (rc) return rc == 1 ? -1 : rc;
  if (weighting == -1 && gamma > 0)
    return fputs("dflash train: --weighting none and --loss-gamma exclude each other\n", stderr), 2;
  t->position_weighting = weighting == -1 ? DFLASH_POSITION_WEIGHTING_DECAY : weighting;
  t->loss_gamma = weighting == -1 ? -1 : gamma;
  o->resume = resume, o->bf16 = bf16, o->allow_settings_change = allow;
  o->save_every_s = minutes * 60;
  o->spool_reuse = reuse, t->grad_reduce_bf16 = rs_bf16;
  static const char *const required[] = {"--config", "--target", "--data", "--hidden", "-o"};
  const char *const have[] = {o->config_path, o->target_path, o->data_dir, o->hidden_dir,
                              o->out_dir};
  for (int i = 0; i < 5; i++)
    if (!have[i]) return cli_missing("train", required[i]);
  if (o->resume && *overwrite)
    return fputs("dflash train: --resume and --overwrite exclude each other\n", stderr), 2;
  g_quiet = quiet;
  return 0;
}

/* Rank 0 of a data-parallel run (or a single process) owns OUT. */
static bool is_rank0(void) {
  const char *r = getenv("RANK");
  if (!r) r = getenv("SLURM_PROCID");
  return !r || !strcmp(r, "0");
}

/* 1 when OUT holds anything, 0 when empty or absent, -1 (message printed) when it cannot be
 * read. */
static int out_nonempty(const char *out) {
  if (!dflash_storage_is_remote(out)) {
    DIR *d = opendir(out);
    if (!d)
      return errno == ENOENT
                 ? 0
                 : (fprintf(stderr, "dflash train: %s: %s\n", out, strerror(errno)), -1);
    struct dirent *e;
    int any = 0;
    while (!any && (e = readdir(d))) any = strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return any;
  }
  dflash_storage *st = NULL;
  dflash_storage_listing *l = NULL;
  size_t n = 0;
  char prefix[4096];
  snprintf(prefix, sizeof prefix, "%s%s", out, out[strlen(out) - 1] == '/' ? "" : "/");
  dflash_status s = dflash_storage_create(NULL, &st);
  if (!s) s = dflash_storage_list(st, prefix, &l);
  if (!s) n = dflash_storage_listing_count(l);
  dflash_storage_listing_free(l);
  dflash_storage_free(st);
  if (s) return cli_fail("train", s), -1;
  return n > 0;
}

/* `v` as metrics.jsonl's line prints it (`fmt`), so that the summary's numbers equal the
 * last line's to the digit. */
static json_t *as_printed(const char *fmt, double v) {
  char text[64];
  snprintf(text, sizeof text, fmt, v);
  return json_real(strtod(text, NULL));
}

/* The run's JSON summary, from the stats dflash_train_run filled (rank 0's). */
static void print_summary(const char *out, const dflash_train_stats *st) {
  json_t *sum = json_pack("{s:I,s:i,s:I,s:o?,s:o?,s:s}", "steps", (json_int_t)st->step, "epoch",
                          (int)st->epoch, "tokens", (json_int_t)st->tokens, "final_loss",
                          as_printed("%.9g", st->loss), "elapsed_s",
                          as_printed("%.3f", st->elapsed_s), "checkpoint", out);
  if (sum && st->spool) /* a spool run's wait for shards */
    json_object_set_new(sum, "spool_wait_s", as_printed("%.3f", st->spool_wait_s));
  if (sum) json_object_set_new(sum, "launch", train_launch_json(out));
  char *s = sum ? json_dumps(sum, JSON_COMPACT | JSON_REAL_PRECISION(12)) : NULL;
  if (s) printf("%s\n", s);
  free(s);
  json_decref(sum);
}

/* Ctrl-C / SIGTERM (Slurm's preemption): the run stops after the step in flight, with its
 * state saved; a second signal ends the process at once (the default action). */
static volatile sig_atomic_t g_stop;

static void on_signal(int sig) {
  g_stop = 1;
  signal(sig, SIG_DFL);
}

/* The progress bar (unless --quiet), drawn from the run's stats; the answer is the signal's
 * flag, which stops the run. */
static int on_progress(const dflash_train_stats *s, void *user) {
  dflash_progress **bar = user;
  if (!g_quiet && !*bar &&
      dflash_progress_create(NULL, NULL, 0, "train", "steps", (uint64_t)s->last_step, 0, bar))
    *bar = NULL;
  if (*bar) {
    char note[96];
    snprintf(note, sizeof note, "loss %.4f  %.0f tok/s", s->loss, s->tokens_per_s);
    dflash_progress_update(*bar, (uint64_t)s->step, note);
  }
  return g_stop;
}

static dflash_status run_with_signals(dflash_train_run_options *o, dflash_train_stats *stats) {
  /* The run's start-up notes (sequences per step, GPU links, NCCL settings) are INFO; --quiet
   * keeps warnings and errors only. */
  dflash_set_log_callback(cli_log_to_stderr, NULL, g_quiet ? DFLASH_LOG_WARN : DFLASH_LOG_INFO);
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  dflash_progress *bar = NULL;
  o->progress = on_progress;
  o->progress_user = &bar;
  dflash_status st = dflash_train_run(o, stats);
  dflash_progress_free(bar); /* the bar's last state, before the outcome's message */
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  dflash_set_log_callback(NULL, NULL, DFLASH_LOG_ERROR);
  return st;
}

int cmd_train(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (!strcmp(argv[i], "--plan")) return cmd_plan(argc, argv);
  dflash_train_run_options o;
  dflash_train_run_options_default(&o);
  dflash_trainer_options topt;
  dflash_trainer_options_default(&topt);
  int overwrite = 0;
  int rc = parse_train(argc, argv, &o, &topt, &overwrite);
  if (rc) return rc < 0 ? 0 : rc;
  if (!g_allow_tok && cli_tokenizer_matches("train", o.data_dir, o.target_path, false)) return 1;
  if (!o.resume && !overwrite && is_rank0()) {
    int full = out_nonempty(o.out_dir);
    if (full < 0) return 1;
    if (full)
      return fprintf(stderr,
                     "dflash train: %s is not empty (an earlier run?): --resume "
                     "continues it, --overwrite replaces it\n",
                     o.out_dir),
             1;
  }
  dflash_train_stats stats = {.struct_size = sizeof stats};
  dflash_status st = run_with_signals(&o, &stats);
  if (st == DFLASH_E_CANCELLED && g_stop) {
    fprintf(stderr, "dflash train: interrupted: %s\n", dflash_last_error());
    return 3;
  }
  if (st) return cli_fail("train", st);
  fprintf(stderr, "dflash train: checkpoint in %s\n", o.out_dir);
  if (is_rank0()) print_summary(o.out_dir, &stats);
  return 0;
}
