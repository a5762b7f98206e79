/* `dflash train` and `dflash eval`: thin callers of dflash_train_run,
 * dflash_trainer_eval and dflash_trainer_eval_walk. */
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

static const char TRAIN_USAGE[] =
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
    "(a DFlash 2 drafter, `dflash init-config --arch dflash2`, on --backend cpu).\n"
    "OUT gets config.json + model.safetensors (SGLang/vLLM load it), train_state/ (for\n"
    "--resume) and metrics.jsonl (one line per step). A non-empty OUT is refused unless\n"
    "--resume continues the run in it or --overwrite replaces it. At the end a JSON summary\n"
    "(steps, epoch, tokens, final_loss, elapsed_s, checkpoint; spool_wait_s on a spool;\n"
    "launch: the vLLM and SGLang flags that serve OUT) goes to stdout.\n"
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

static int parse_labels(const char *v, void *dst) {
  int32_t *l = dst; /* dflash_train_labels */
  if (!strcmp(v, "data")) *l = DFLASH_TRAIN_LABELS_DATA;
  else if (!strcmp(v, "target")) *l = DFLASH_TRAIN_LABELS_TARGET;
  else return -1;
  return 0;
}

static int parse_optimizer(const char *v, void *dst) {
  int32_t *o = dst; /* dflash_optimizer */
  if (!strcmp(v, "adamw")) *o = DFLASH_OPTIMIZER_ADAMW;
  else if (!strcmp(v, "muon")) *o = DFLASH_OPTIMIZER_MUON;
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

/* --allow-tokenizer-mismatch (train and eval): skip the tokenizer hash check. */
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
                          {"--labels", CLI_FN, &o->labels, 0, 0, parse_labels},
                          {"--final-norm-name", CLI_STR, &o->final_norm_name, 0, 0, NULL},
                          {"--save-minutes", CLI_REAL, &minutes, 0, 1e9, NULL},
                          {"--allow-settings-change", CLI_FLAG, &allow, 0, 0, NULL},
                          {"--allow-tokenizer-mismatch", CLI_FLAG, &g_allow_tok, 0, 0, NULL},
                          {"--schedule", CLI_FN, &t->lr_schedule, 0, 0, parse_schedule},
                          {"--min-lr-ratio", CLI_REAL, &t->min_lr_ratio, 0, 1, NULL},
                          {"--weighting", CLI_FN, &weighting, 0, 0, parse_weighting},
                          {"--loss-gamma", CLI_REAL, &gamma, 0, 1e9, NULL},
                          {"--optimizer", CLI_FN, &t->optimizer, 0, 0, parse_optimizer},
                          {"--muon-momentum", CLI_REAL, &t->muon_momentum, 0, 0.999999, NULL},
                          {"--muon-weight-decay", CLI_REAL, &t->muon_weight_decay, 0, 1e9, NULL},
                          {"--muon-adjust-lr", CLI_FN, &t->muon_adjust_lr, 0, 0, parse_adjust_lr},
                          {"--grad-reduce-bf16", CLI_FLAG, &rs_bf16, 0, 0, NULL},
                          {"--dist-timeout", CLI_REAL, &t->dist_timeout_s, 1e-3, 1e9, NULL},
                          {NULL, 0, NULL, 0, 0, NULL}};
  int n_pos;
  int rc = cli_parse("train", TRAIN_USAGE, opts, argc, argv, NULL, 0, &n_pos);
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

static void plan_line(const char *name, uint64_t bytes) {
  printf("  %-28s %10.2f GiB\n", name, (double)bytes / (double)(1ULL << 30));
}

/* The GPUs --plan knows: memory (bytes) and shared memory per block (opt-in, bytes). */
static const struct plan_gpu {
  const char *name;
  uint64_t bytes, smem;
  bool pcie; /* no NVLink: the collectives decide a one-sequence step */
} plan_gpus[] = {{"h100", 80000000000ULL, 232448, false},
                 {"h200", 141000000000ULL, 232448, false},
                 {"b200", 180000000000ULL, 232448, false},
                 {"b300", 288000000000ULL, 232448, false},
                 {"rtx-pro-6000", 96000000000ULL, 101376, true}};

static const struct plan_gpu *plan_gpu_named(const char *name) {
  for (size_t i = 0; i < sizeof plan_gpus / sizeof *plan_gpus; i++)
    if (!strcmp(plan_gpus[i].name, name)) return &plan_gpus[i];
  return NULL;
}

static void plan_attention_lines(const dflash_train_plan *p, const dflash_train_plan_options *po,
                                 const struct plan_gpu *gpu) {
  printf("  attention: %d rows per CTA, %d keys per tile, %llu bytes of shared memory per "
         "block of %llu\n",
         p->attention_rows, p->attention_key_tile, (unsigned long long)p->attention_smem,
         (unsigned long long)po->smem_per_block);
  printf("  sequences per GPU per step: %d (%s; one reduce-scatter and one all-gather per "
         "step)\n",
         p->sequences_per_step,
         po->batch_size                   ? "--batch"
         : po->pcie && po->world_size > 1 ? "the trainer's pick for PCIe GPUs"
                                          : "the trainer's pick");
  if (gpu && gpu->pcie && po->world_size > 1 && p->sequences_per_step < 4)
    printf("  note: %s GPUs talk over PCIe, where one sequence per step leaves the step to "
           "the collectives; 4 or more spread them (bench/gpu_model.py --gpu "
           "RTX-PRO-6000 --world %d --batch N predicts the step)\n",
           gpu->name, po->world_size);
}

/* `dflash train --plan`: memory per GPU for a config, batch and world size. */
static int cmd_plan(int argc, char **argv) {
  dflash_train_plan_options po;
  dflash_train_plan_options_default(&po);
  const char *config = NULL;
  int plan = 0, no_zero1 = 0;
  double gpu_gb = -1, smem_kb = -1;
  const char *gpu_name = NULL;
  const cli_opt opts[] = {{"--plan", CLI_FLAG, &plan, 0, 0, NULL},
                          {"--no-zero1", CLI_FLAG, &no_zero1, 0, 0, NULL},
                          {"--config", CLI_STR, &config, 0, 0, NULL},
                          {"--world", CLI_INT, &po.world_size, 1, INT32_MAX, NULL},
                          {"--seq-len", CLI_INT, &po.seq_len, 1, INT32_MAX, NULL},
                          {"--anchors", CLI_INT, &po.num_anchors, 1, INT32_MAX, NULL},
                          {"--batch", CLI_INT, &po.batch_size, 1, INT32_MAX, NULL},
                          {"--gpu-gb", CLI_REAL, &gpu_gb, 0, 1e9, NULL},
                          {"--gpu", CLI_STR, &gpu_name, 0, 0, NULL},
                          {"--smem-kb", CLI_REAL, &smem_kb, 0, 1e6, NULL},
                          {"--vocab-chunk", CLI_INT, &po.vocab_chunk, 1, INT32_MAX, NULL},
                          {"--optimizer", CLI_FN, &po.optimizer, 0, 0, parse_optimizer},
                          {NULL, 0, NULL, 0, 0, NULL}};
  int n_pos;
  int rc = cli_parse("train --plan", TRAIN_USAGE, opts, argc, argv, NULL, 0, &n_pos);
  if (rc) return rc == 1 ? 0 : rc;
  if (no_zero1) po.zero1 = 0;
  const struct plan_gpu *gpu = gpu_name ? plan_gpu_named(gpu_name) : NULL;
  if (gpu_name && !gpu) {
    fprintf(stderr,
            "dflash train --plan: unknown --gpu '%s' (h100, h200, b200, b300, rtx-pro-6000)\n",
            gpu_name);
    return 2;
  }
  if (gpu) po.gpu_bytes = gpu->bytes, po.smem_per_block = gpu->smem, po.pcie = gpu->pcie;
  /* Neither --gpu nor its figures: the CUDA device present, if any (device 0). */
  int n_dev = 0;
  if (!gpu && gpu_gb < 0 && smem_kb < 0 && !dflash_cuda_device_count(&n_dev) && n_dev > 0)
    po.device = 0;
  dflash_clear_error();
  if (gpu_gb >= 0) po.gpu_bytes = (uint64_t)(gpu_gb * 1e9);
  if (smem_kb >= 0) po.smem_per_block = (uint64_t)(smem_kb * 1024);
  if (!config) return cli_missing("train --plan", "--config");
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  dflash_status st = dflash_drafter_config_load(config, &cfg);
  if (st) return cli_fail("train --plan", st);
  dflash_train_plan p = {.struct_size = sizeof p};
  st = dflash_train_plan_compute(&cfg, &po, &p);
  if (st && st != DFLASH_E_NOMEM && st != DFLASH_E_UNSUPPORTED) return cli_fail("train --plan", st);
  printf("%s: %llu trainable parameters; %d GPU(s), sequence %d, %d anchors x block %d, "
         "batch %d (accumulated one sequence at a time), ZeRO-1 %s\n",
         config, (unsigned long long)p.n_params, po.world_size, po.seq_len, po.num_anchors,
         cfg.block_size, p.sequences_per_step, po.zero1 ? "on" : "off");
  if (p.device_name[0]) printf("  GPU: CUDA device %d, %s\n", po.device, p.device_name);
  plan_line("weights (bf16)", p.weights);
  plan_line("master weights (fp32)", p.masters);
  plan_line("AdamW moments (fp32)", p.moments);
  plan_line("gradients (fp32)", p.grads);
  plan_line("activations (1 sequence)", p.activations);
  plan_line("frozen embedding + LM head", p.frozen);
  plan_line("reserve", p.reserve);
  plan_line("total per GPU", p.total);
  plan_line("GPU memory", p.gpu_bytes);
  plan_attention_lines(&p, &po, gpu);
  if (st) return cli_fail("train --plan", st), 1;
  printf("fits\n");
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

/* The whole of file NAME in folder DIR (local or s3://), or NULL with *len 0 when it cannot
 * be read; free with dflash_storage_buffer_free. */
static void *read_in(const char *dir, const char *name, size_t *len) {
  char path[4096];
  snprintf(path, sizeof path, "%s%s%s", dir, dir[strlen(dir) - 1] == '/' ? "" : "/", name);
  void *data = NULL;
  dflash_storage *st = NULL;
  *len = 0;
  if (dflash_storage_create(NULL, &st) || dflash_storage_read(st, path, &data, len)) *len = 0;
  dflash_storage_free(st);
  return data;
}

/* The serving flags for checkpoint `dir` (docs/deployment.md, "Serving the checkpoint"):
 * {"vllm": ..., "sglang": ...}. vLLM needs the method (it guesses it from the
 * folder name) and num_speculative_tokens = block_size - 1 (it never reads
 * block_size); SGLang builds the draft in config.json's dtype under --dtype
 * auto, and a float32 one in float16, so such a checkpoint gets --dtype. */
static json_t *launch_json(const char *dir) {
  size_t len;
  void *data = read_in(dir, "config.json", &len);
  json_t *c = len ? json_loadb(data, len, 0, NULL) : NULL;
  dflash_storage_buffer_free(data);
  json_t *dc = json_object_get(c, "dflash_config"), *bs = json_object_get(dc, "block_size");
  const char *dtype = json_string_value(json_object_get(c, "dtype"));
  bool half = dtype && (!strcmp(dtype, "bfloat16") || !strcmp(dtype, "float16"));
  int B = (int)json_integer_value(bs ? bs : json_object_get(c, "block_size"));
  json_decref(c);
  if (B < 2) return NULL;
  char v[4300], g[4400];
  snprintf(v, sizeof v,
           "--speculative-config '{\"method\": \"dflash\", \"model\": \"%s\", "
           "\"num_speculative_tokens\": %d}'",
           dir, B - 1);
  snprintf(g, sizeof g,
           "--speculative-algorithm DFLASH --speculative-draft-model-path %s "
           "--speculative-num-draft-tokens %d%s",
           dir, B, half ? "" : " --dtype bfloat16");
  return json_pack("{s:s,s:s}", "vllm", v, "sglang", g);
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
  if (sum) json_object_set_new(sum, "launch", launch_json(out));
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
    "--json: one JSON object instead (with launch: the vLLM and SGLang flags that serve\n"
    "the checkpoint). Defaults: --anchors 64, --seed 1, --max-tokens 0\n"
    "(no cap). Exit status: 0 evaluated; 1 an error (message on stderr); 2 a usage error.\n";

static void print_doubles(const char *sep, const double *v, int n) {
  for (int k = 0; k < n; k++) printf("%s%.4f", k ? sep : "", v[k]);
}

static void print_ints(const char *sep, const int64_t *v, int n) {
  for (int k = 0; k < n; k++) printf("%s%lld", k ? sep : "", (long long)v[k]);
}

static void print_eval(bool json, int B, double tau, const double *acc, int64_t blocks,
                       const dflash_eval_walk *w, const char *ckpt) {
  const char *lab = w->labels == DFLASH_TRAIN_LABELS_TARGET ? "target" : "data";
  if (json) {
    /* "tau" is the labels' own: the sampled-anchor tau (blocks, accuracy) knows data labels
     * only, so with target labels it is the uniform-anchor tau, the same mean over every
     * position; the sampled one stays as sampled_tau. */
    double own = w->labels == DFLASH_TRAIN_LABELS_TARGET ? w->position_tau : tau;
    printf("{\"block_size\": %d, \"labels\": \"%s\", \"tau\": %.6f, \"sampled_tau\": %.6f, "
           "\"sampled_labels\": \"data\", \"blocks\": %lld, \"accuracy\": [",
           B, lab, own, tau, (long long)blocks);
    print_doubles(", ", acc, B - 1);
    printf("], \"position_tau\": %.6f, \"position_tau_se\": %.6f, \"positions\": %lld, "
           "\"position_accuracy\": [",
           w->position_tau, w->position_tau_se, (long long)w->positions);
    print_doubles(", ", w->accuracy, B - 1);
    printf("], \"walk_tau\": %.6f, \"walk_tau_se\": %.6f, \"steps\": %lld, \"tokens\": %lld, "
           "\"sequences\": %lld, \"tokens_per_step_histogram\": [",
           w->walk_tau, w->walk_tau_se, (long long)w->steps, (long long)w->tokens,
           (long long)w->sequences);
    print_ints(", ", w->step_hist, B);
    printf("], \"scored\": %lld, \"selector_accuracy\": %.6f, \"backbone_accuracy\": %.6f, "
           "\"candidate_recall\": ",
           (long long)w->scored, w->selector_accuracy, w->backbone_accuracy);
    if (w->candidate_recall >= 0) printf("%.6f", w->candidate_recall);
    else printf("null");
    json_t *l = launch_json(ckpt);
    char *ls = l ? json_dumps(l, JSON_COMPACT) : NULL;
    printf(", \"launch\": %s}\n", ls ? ls : "null");
    free(ls);
    json_decref(l);
    return;
  }
  printf("tau %.4f over %lld blocks (block size %d; data labels)\naccuracy by position: ", tau,
         (long long)blocks, B);
  print_doubles(" ", acc, B - 1);
  printf("\nuniform-anchor tau %.4f +- %.4f over every position (%lld; %s labels)\n"
         "accuracy by position: ",
         w->position_tau, w->position_tau_se, (long long)w->positions, lab);
  print_doubles(" ", w->accuracy, B - 1);
  printf("\nwalk tau %.4f +- %.4f (%s labels): %lld tokens in %lld verification steps, %lld "
         "sequences\ntokens per step 1..%d: ",
         w->walk_tau, w->walk_tau_se, lab, (long long)w->tokens, (long long)w->steps,
         (long long)w->sequences, B);
  print_ints(" ", w->step_hist, B);
  printf("\naccuracy over every position (%lld): drafted %.4f, backbone argmax %.4f",
         (long long)w->scored, w->selector_accuracy, w->backbone_accuracy);
  if (w->candidate_recall >= 0) printf(", candidate recall (top-K) %.4f", w->candidate_recall);
  printf("\n");
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
                          {"--labels", CLI_FN, &labels, 0, 0, parse_labels},
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
  w.step_hist = calloc((size_t)cfg.block_size, sizeof *w.step_hist);
  if (!e || !h || !acc || !w.accuracy || !w.step_hist) st = DFLASH_E_NOMEM;
  if (!st) st = dflash_target_load_head(target, en, hn, cfg.vocab_size, cfg.hidden_size, e, h);
  if (!st) st = dflash_trainer_create(&cfg, e, h, &topt, &t);
  if (!st) st = dflash_trainer_load(t, ckpt);
  if (!st) st = dflash_trainer_eval(t, data, hidden, &ev);
  if (!st) st = dflash_trainer_eval_walk(t, data, hidden, &w);
  if (!st) print_eval(json, cfg.block_size, ev.tau, acc, ev.n_blocks, &w, ckpt);
  dflash_trainer_free(t);
  free(e), free(h), free(acc), free(w.accuracy), free(w.step_hist);
  return st ? cli_fail("eval", st) : 0;
}
