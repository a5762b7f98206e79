/*
 * Training-step benchmark of the CUDA backend at a drafter shape (run by
 * bench/gpu_check.sh, not a test): tokens/s, achieved TFLOP/s, MFU against
 * the cuBLAS bf16 GEMM rate measured in this process, device memory.
 *   gpu_bench qwen3-8b|kimi [seq_len] [anchors] [steps]
 */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <string.h>

#include "core/internal.h"
#include "gpu_common.h"

static void shape(const char *name, dflash_drafter_config *c) {
  dflash_drafter_config_default(c);
  c->num_attention_heads = 32, c->num_key_value_heads = 8, c->head_dim = 128;
  c->block_size = 16;
  if (!strcmp(name, "kimi")) {
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

/* Peak of this GPU for bf16 GEMMs with fp32 accumulation, as cuBLAS
 * reaches it: 8192^3 (and 16384x8192x8192) products, best of 20 runs. */
static double cublas_bf16_tflops(void) {
  const int n = 8192;
  void *A, *B, *C;
  cublasHandle_t h;
  if (cudaMalloc(&A, 2ull * n * n * 2) || cudaMalloc(&B, 2ull * n * n) ||
      cudaMalloc(&C, 2ull * n * n * 2) || cublasCreate(&h))
    return 0;
  cudaMemset(A, 0x3c, 2ull * n * n * 2), cudaMemset(B, 0x3c, 2ull * n * n);
  float one = 1, zero = 0, best = 1e30f;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  for (int i = 0; i < 23; i++) {
    cudaEventRecord(e0, 0);
    cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, 2 * n, n, &one, B, CUDA_R_16BF, n, A,
                 CUDA_R_16BF, n, &zero, C, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaEventRecord(e1, 0);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i >= 3 && ms < best) best = ms;
  }
  cublasDestroy(h), cudaFree(A), cudaFree(B), cudaFree(C);
  return 2.0 * n * 2.0 * n * n / (best * 1e-3) / 1e12;
}

/* Model FLOPs of one forward + backward (what the GPU must do at least):
 * 3x forward for every trainable GEMM (fc: forward + weight gradient only),
 * attention 3x forward over the visible keys, LM head forward + d(hidden). */
static double step_flops(const dflash_drafter_config *c, const g_seq *q) {
  double H = c->hidden_size, I = c->intermediate_size, KH = H * c->n_target_layer_ids;
  double qd = (double)c->num_attention_heads * c->head_dim, kd = (double)c->num_key_value_heads * c->head_dim;
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

int main(int argc, char **argv) {
  int n_dev = 0;
  if (dflash_cuda_device_count(&n_dev) || !n_dev) return printf("SKIP: %s\n", dflash_last_error()), 77;
  const char *name = argc > 1 ? argv[1] : "qwen3-8b";
  int64_t len = argc > 2 ? atoll(argv[2]) : 3072;
  int32_t na = argc > 3 ? atoi(argv[3]) : 512;
  int steps = argc > 4 ? atoi(argv[4]) : 5;
  dflash_drafter_config c;
  shape(name, &c);
  if (dflash_drafter_config_validate(&c)) return printf("config: %s\n", dflash_last_error()), 1;
  double peak = cublas_bf16_tflops();
  size_t vh = (size_t)c.vocab_size * c.hidden_size;
  float *E = g_random(vh, 1.0f, 1), *Hd = g_random(vh, 0.02f, 2);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.backend = DFLASH_BACKEND_CUDA;
  o.vocab_chunk = 16384;
  dflash_trainer *t;
  double t0 = df_now_seconds();
  if (dflash_trainer_create(&c, E, Hd, &o, &t)) return printf("create: %s\n", dflash_last_error()), 1;
  double t_create = df_now_seconds() - t0;
  free(E), free(Hd);
  g_seq q;
  if (g_seq_make(&c, len, na, 11, &q)) return printf("inputs\n"), 1;
  double flops = step_flops(&c, &q), step_s = 0;
  for (int s = -1; s < steps; s++) { /* one warm-up step */
    double a = df_now_seconds(), wsum = 0, loss;
    dflash_trainer_weight_sum(t, q.mask, q.len, q.anchors, q.na, &wsum);
    dflash_status st = dflash_trainer_zero_grad(t);
    if (!st) st = dflash_trainer_accumulate(t, q.ids, q.mask, q.len, q.hidden, q.anchors, q.na,
                                           1.0 / wsum, &loss, NULL);
    if (!st) st = dflash_trainer_step(t, NULL, NULL);
    if (st) return printf("step: %s\n", dflash_last_error()), 1;
    if (s >= 0) step_s += df_now_seconds() - a;
  }
  step_s /= steps;
  size_t fr = 0, tot = 0;
  cudaMemGetInfo(&fr, &tot);
  double tf = flops / step_s / 1e12;
  printf("%-9s seq %lld anchors %d x B%d: %.3f s/step, %.0f block tokens/s, %.0f seq tokens/s, "
         "%.1f TFLOP/s model, cuBLAS bf16 %.1f TFLOP/s, MFU %.1f%%, device memory in use %.1f GiB "
         "(of %.1f), create %.1f s\n",
         name, (long long)len, q.na, c.block_size, step_s, q.na * c.block_size / step_s,
         len / step_s, tf, peak, 100 * tf / peak, (tot - fr) / 1073741824.0, tot / 1073741824.0,
         t_create);
  g_seq_free(&q);
  dflash_trainer_free(t);
  return 0;
}
