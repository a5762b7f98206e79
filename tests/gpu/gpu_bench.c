/*
 * Training-step benchmark of the CUDA backend at a drafter shape (run by
 * bench/gpu_check.sh, not a test): tokens/s, achieved TFLOP/s, MFU against
 * the cuBLAS bf16 GEMM rate measured in this process, device memory.
 *   gpu_bench qwen3-8b|kimi|tiny [seq_len] [anchors] [steps]
 *   gpu_bench gemm < SHAPES     (lines "name M N K c_bytes beta", as
 *                                bench/gpu_model.py --gemms prints them):
 *                                each GEMM timed alone, as cuda/model.cu calls it
 * A step is dflash_train_run's: the sequence's rows as stored (bf16) through
 * accumulate, collect, dflash_trainer_step_async, and the norm asked for once
 * the next step's sequence is on its way (the model's `now` schedule); the time per step
 * is the whole loop's over the steps.
 * Every result also goes out as one "json {...}" line for gpu_check.sh. Built as
 * gpu_bench_emu (DFLASH_GPU_EMU) it runs on the emulated device, where times are
 * host times of the emulation: meaningless, but every path runs.
 */
#include <string.h>

#include <dflash/hidden.h>

#include "../train/seq.h"
#include "core/bf16.h"
#include "core/internal.h"
#include "gpu_bench_cuda.h"
#include "gpu_common.h"

#ifdef DFLASH_GPU_EMU
enum { kPeakN = 128, kReps = 1 }; /* the emulator multiplies on the CPU */
#else
enum { kPeakN = 8192, kReps = 5 }; /* 8192 x 16384 x 8192: cuBLAS's best case */
#endif

static void shape(const char *name, dflash_drafter_config *c) {
  dflash_drafter_config_default(c);
  c->num_attention_heads = 32, c->num_key_value_heads = 8, c->head_dim = 128;
  c->block_size = 16;
  if (!strcmp(name, "tiny")) { /* bench/gpu_model.py BUILTIN["tiny"] */
    c->hidden_size = 64, c->intermediate_size = 128, c->num_hidden_layers = 2;
    c->num_attention_heads = 4, c->num_key_value_heads = 2, c->head_dim = 16;
    c->vocab_size = 256, c->num_target_layers = 4, c->mask_token_id = 255, c->block_size = 4;
    c->n_target_layer_ids = 2, c->target_layer_ids[0] = 0, c->target_layer_ids[1] = 1;
  } else if (!strcmp(name, "kimi")) {
    int32_t ids[6] = {1, 12, 24, 35, 47, 58};
    c->hidden_size = 7168, c->intermediate_size = 18432, c->num_hidden_layers = 6;
    c->num_attention_heads = 64, c->vocab_size = 163840, c->num_target_layers = 61;
    c->mask_token_id = 163838, c->n_target_layer_ids = 6;
    memcpy(c->target_layer_ids, ids, sizeof ids);
    c->rope_theta = 50000, c->rope_type = DFLASH_ROPE_YARN, c->rope_factor = 64;
    c->rope_original_max_position = 4096, c->rope_attention_factor = 1.0;
  } else {
    int32_t ids[5] = {1, 9, 17, 25, 33};
    c->hidden_size = 4096, c->intermediate_size = 12288, c->num_hidden_layers = 5;
    c->vocab_size = 151936, c->num_target_layers = 36, c->mask_token_id = 151669;
    c->n_target_layer_ids = 5;
    memcpy(c->target_layer_ids, ids, sizeof ids);
    c->rope_theta = 1e6;
  }
}

/* Model FLOPs of one forward + backward (what the GPU must do at least):
 * 3x forward for every trainable GEMM (fc: forward + weight gradient only),
 * attention 3x forward over the visible keys, LM head forward + d(hidden). */
static double step_flops(const dflash_drafter_config *c, const g_seq *q) {
  double H = c->hidden_size, I = c->intermediate_size, KH = H * c->n_target_layer_ids;
  double qd = (double)c->num_attention_heads * c->head_dim,
         kd = (double)c->num_key_value_heads * c->head_dim;
  double T = (double)q->na * c->block_size, Sc = 0, keys = 0, R = 0;
  for (int n = 0; n < q->na; n++) {
    Sc = q->anchors[n] > Sc ? q->anchors[n] : Sc;
    keys += ((double)q->anchors[n] + c->block_size) * c->block_size;
    for (int k = 1; k < c->block_size; k++)
      R += q->anchors[n] + k < q->len && q->mask[q->anchors[n] + k];
  }
  double layer = 3 * 2 * T * (2 * qd * H + 2 * kd * H + 3 * I * H) + 3 * 2 * Sc * 2 * kd * H +
                 3 * 4 * keys * qd;
  return 2 * 2 * Sc * KH * H + c->num_hidden_layers * layer + 4 * R * c->vocab_size * H;
}

/* gpu_bench gemm: each line "name M N K c_bytes beta" of stdin timed alone. */
static int gemm_mode(void) {
  char line[512], name[256];
  int bad = 0;
  while (fgets(line, sizeof line, stdin)) {
    int M, N, K, cb;
    float beta;
    if (line[0] == '#' || sscanf(line, "%255s %d %d %d %d %f", name, &M, &N, &K, &cb, &beta) != 6)
      continue;
    double ms = gb_time_gemm(M, N, K, cb == 4, beta, kReps);
    if (ms < 0) bad++;
    printf("json {\"gemm\": \"%s\", \"M\": %d, \"N\": %d, \"K\": %d, \"ms\": %.6f, "
           "\"tflops\": %.3f}\n",
           name, M, N, K, ms, ms > 0 ? 2.0 * M * N * K / ms / 1e9 : 0.0);
  }
  return bad ? 1 : 0;
}

int main(int argc, char **argv) {
  int n_dev = 0;
  if (dflash_cuda_device_count(&n_dev) || !n_dev)
    return printf("SKIP: %s\n", dflash_last_error()), 77;
  if (argc > 1 && !strcmp(argv[1], "gemm")) return gemm_mode();
  const char *name = argc > 1 ? argv[1] : "qwen3-8b";
  int64_t len = argc > 2 ? atoll(argv[2]) : 3072;
  int32_t na = argc > 3 ? atoi(argv[3]) : 512;
  int steps = argc > 4 ? atoi(argv[4]) : 5;
  dflash_drafter_config c = {.struct_size = sizeof c};
  shape(name, &c);
  if (dflash_drafter_config_validate(&c)) return printf("config: %s\n", dflash_last_error()), 1;
  /* DFLASH_BENCH_NO_PEAK: no reference GEMMs (a kernel profile of the step alone) */
  double peak = getenv("DFLASH_BENCH_NO_PEAK") ? 0.0 : gb_cublas_tflops(kPeakN);
  size_t vh = (size_t)c.vocab_size * c.hidden_size;
  float *E = g_random(vh, 1.0f, 1), *Hd = g_random(vh, 0.02f, 2);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.backend = DFLASH_BACKEND_CUDA;
  o.vocab_chunk = 16384;
  dflash_trainer *t;
  double t0 = df_now_seconds();
  if (dflash_trainer_create(&c, E, Hd, &o, &t))
    return printf("create: %s\n", dflash_last_error()), 1;
  double t_create = df_now_seconds() - t0;
  free(E), free(Hd);
  g_seq q;
  if (g_seq_make(&c, len, na, 11, &q)) return printf("inputs\n"), 1;
  double flops = step_flops(&c, &q), step_s = 0, a = 0;
  size_t nh = (size_t)q.len * c.n_target_layer_ids * c.hidden_size;
  uint16_t *codes = malloc(2 * nh);
  for (size_t i = 0; codes && i < nh; i++) codes[i] = df_f32_to_bf16(q.hidden[i]);
  dflash_sample smp = {.struct_size = sizeof smp,
                       .id = "bench",
                       .len = q.len,
                       .input_ids = q.ids,
                       .loss_mask = q.mask,
                       .hidden_dtype = DFLASH_DTYPE_BF16,
                       .hidden_codes = codes};
  bool open = false;
  for (int s = -1; s < steps; s++) { /* one warm-up step */
    if (s == 0) a = df_now_seconds();
    double wsum = 0, norm;
    dflash_trainer_weight_sum(t, SEQ(NULL, q.mask, q.len, NULL, q.anchors, q.na), &wsum);
    dflash_status st = codes ? dflash_trainer_zero_grad(t) : DFLASH_E_NOMEM;
    if (!st) st = dflash_trainer_accumulate(t, seq_at(&smp, q.anchors, q.na), 1.0 / wsum);
    if (!st && open) st = dflash_trainer_step_result(t, &norm); /* the step before's */
    if (!st) st = dflash_trainer_collect(t, NULL, NULL);
    if (!st) st = dflash_trainer_step_async(t, NULL);
    open = !st;
    if (!st && s == steps - 1) st = dflash_trainer_step_result(t, &norm), open = false;
    if (st) return printf("step: %s\n", dflash_last_error()), 1;
  }
  step_s = (df_now_seconds() - a) / steps;
  free(codes);
  size_t fr = 0, tot = 0;
  gb_mem_info(&fr, &tot);
  double tf = flops / step_s / 1e12, mfu = peak > 0 ? tf / peak : 0.0;
  printf("%-9s seq %lld anchors %d x B%d: %.3f s/step, %.0f block tokens/s, %.0f seq tokens/s, "
         "%.1f TFLOP/s model, cuBLAS bf16 %.1f TFLOP/s, MFU %.1f%%, device memory in use %.1f GiB "
         "(of %.1f), create %.1f s\n",
         name, (long long)len, q.na, c.block_size, step_s, q.na * c.block_size / step_s,
         len / step_s, tf, peak, 100 * mfu, (tot - fr) / 1073741824.0, tot / 1073741824.0,
         t_create);
  printf("json {\"shape\": \"%s\", \"seq_len\": %lld, \"anchors\": %d, \"step_s\": %.6f, "
         "\"block_tokens_per_s\": %.1f, \"model_tflop\": %.6f, \"cublas_tflops\": %.2f, "
         "\"mfu_vs_cublas\": %.4f, \"device_in_use_gib\": %.3f, \"create_s\": %.2f}\n",
         name, (long long)len, q.na, step_s, q.na * c.block_size / step_s, flops / 1e12, peak, mfu,
         (tot - fr) / 1073741824.0, t_create);
  g_seq_free(&q);
  dflash_trainer_free(t);
  return 0;
}
