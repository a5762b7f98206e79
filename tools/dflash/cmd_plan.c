/* `dflash train --plan`: a thin caller of dflash_train_plan_compute. */
#include <dflash/train.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "commands.h"
#include "train_common.h"

static void plan_line(const char *name, uint64_t bytes) {
  printf("  %-28s %10.2f GiB\n", name, (double)bytes / (double)(1ULL << 30));
}

/* What the hidden store holds per token for this drafter, which decides the disk or the
 * spool budget a run needs: K layers x H values, BF16 (2 bytes) or FP8 (1 byte plus a
 * float32 scale per layer); a DSpark drafter also needs the target's final state, H more. */
static void plan_hidden_line(const dflash_drafter_config *c) {
  double K = c->n_target_layer_ids, H = c->hidden_size, n = K + (c->dspark ? 1 : 0);
  printf("  hidden states per token     %10.1f KiB bf16 (%.1f fp8): %d layers x %d",
         2 * n * H / 1024, n * (H + 4) / 1024, (int)K, (int)H);
  if (c->dspark)
    printf(", + the target's final state for DSpark's L1 and confidence (without it %.1f KiB, "
           "CE alone)",
           2 * K * H / 1024);
  printf("\n");
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
int cmd_plan(int argc, char **argv) {
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
                          {"--optimizer", CLI_FN, &po.optimizer, 0, 0, train_parse_optimizer},
                          {NULL, 0, NULL, 0, 0, NULL}};
  int n_pos;
  int rc = cli_parse("train --plan", train_usage, opts, argc, argv, NULL, 0, &n_pos);
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
  plan_hidden_line(&cfg);
  plan_attention_lines(&p, &po, gpu);
  if (st) return cli_fail("train --plan", st), 1;
  printf("fits\n");
  return 0;
}
