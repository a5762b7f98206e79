/*
 * CUDA vs CPU parity on fresh random inputs (suite 'gpu'; exits 77 without
 * a device). Inputs, weights, embedding and LM head are rounded to bf16 for
 * both backends, so the differences measured are the GPU's bf16 activations
 * and its summation order. Host outputs are NaN-poisoned before every read
 * and the device arena is poisoned before every call (DFLASH_CUDA_POISON).
 *
 * Tolerances (bf16 has an 8-bit mantissa, relative step 2^-8 = 0.0039):
 *   loss                     |gpu - cpu| / |cpu|             <= 0.01
 *   every gradient tensor    ||gpu - cpu|| / ||cpu||          <= 0.05
 *   AdamW update from the same gradients (the CPU optimizer given the GPU's)
 *                            ||dp_gpu - dp_cpu|| / ||dp_cpu|| <= 1e-4
 *   AdamW update, each from its own gradients                 <= 0.25
 *     (the first update is lr * g / (|g| + eps), about lr * sign(g): every element whose
 *     gradient lies within bf16 noise of zero may flip sign, a full 2 lr; 0.10-0.12 measured
 *     on the emulated device, so this only catches gross errors; the line above checks the
 *     optimizer itself)
 *   greedy predictions       agreement                        >= 0.95
 *   NCCL with one rank vs without: bit-identical gradients and parameters.
 *
 * Built as gpu_parity_emu (DFLASH_GPU_EMU) it runs on the emulated device (cuda/emu) at
 * smaller shapes: the same code paths (head_dim 64 and 128, block 8 and 16, full and sliding
 * layers, several vocabulary chunks), a few seconds on one core. The attention kernels alone
 * (WMMA) are checked against ops.c at more shapes (GQA 1-8, block 4-16, anchor 0, anchors
 * at the sequence end) by tests/gpu/emu_attention.cpp.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpu_common.h"
#include "train/bf16.h"
#include "train/trainer.h"

static int failures;
static int g_len = 300, g_anchors = 24; /* one sequence's length and anchors */
#define CHECK(cond, ...) \
  do { if (!(cond)) { failures++; printf("FAIL: " __VA_ARGS__); printf("\n"); } } while (0)

static void round_bf16(float *x, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = df_bf16_to_f32(df_f32_to_bf16(x[i]));
}

static size_t n_params(dflash_trainer *t) {
  size_t n = 0, numel;
  for (size_t i = 0; i < dflash_trainer_param_count(t); i++)
    dflash_trainer_param_info(t, i, NULL, NULL, NULL, &numel), n += numel;
  return n;
}

/* All parameters or gradients, NaN-poisoned first. */
static float *dump(dflash_trainer *t, int grads) {
  size_t n = n_params(t), numel;
  float *out = malloc(n * sizeof *out), *p = out;
  for (size_t i = 0; i < n; i++) out[i] = NAN;
  for (size_t i = 0; i < dflash_trainer_param_count(t); i++) {
    const char *name;
    dflash_trainer_param_info(t, i, &name, NULL, NULL, &numel);
    dflash_status st = grads ? dflash_trainer_get_grad(t, name, p, numel)
                             : dflash_trainer_get_param(t, name, p, numel);
    if (st) printf("get %s: %s\n", name, dflash_last_error());
    p += numel;
  }
  return out;
}

static double rel_l2(const float *a, const float *b, const float *base, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    double ref = base ? (double)b[i] - base[i] : b[i], got = base ? (double)a[i] - base[i] : a[i];
    num += (got - ref) * (got - ref);
    den += ref * ref;
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void compare_grads(dflash_trainer *cpu, dflash_trainer *gpu, const char *what) {
  float *gc = dump(cpu, 1), *gg = dump(gpu, 1);
  size_t off = 0, numel;
  double worst = 0;
  const char *worst_name = "";
  for (size_t i = 0; i < dflash_trainer_param_count(cpu); i++) {
    const char *name;
    dflash_trainer_param_info(cpu, i, &name, NULL, NULL, &numel);
    double e = rel_l2(gg + off, gc + off, NULL, numel);
    if (!(e <= worst)) worst = e, worst_name = name;
    CHECK(e <= 0.05, "%s: gradient %s relative L2 error %.4f > 0.05", what, name, e);
    off += numel;
  }
  printf("%s: worst gradient relative L2 error %.4f (%s)\n", what, worst, worst_name);
  free(gc), free(gg);
}

static dflash_trainer *make(const dflash_drafter_config *c, const dflash_drafter_config_ext *ext,
                            const float *E, const float *Hd, int backend, dflash_status *st) {
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.backend = backend;
  o.seed = 5;
  o.lr = 1e-3;
  o.total_steps = 100;
  o.warmup_ratio = 0;
  o.vocab_chunk = 384; /* several chunks, the last one partial */
  o.init_std = 0.05;
  dflash_trainer *t = NULL;
  *st = dflash_trainer_create_ext(c, ext, E, Hd, &o, &t);
  return t;
}

static void run_config(const dflash_drafter_config *c, const dflash_drafter_config_ext *ext,
                       const char *what, uint64_t seed) {
  size_t vh = (size_t)c->vocab_size * c->hidden_size;
  float *E = g_random(vh, 1.0f, seed + 1), *Hd = g_random(vh, 0.05f, seed + 2);
  round_bf16(E, vh), round_bf16(Hd, vh);
  dflash_status st;
  dflash_trainer *cpu = make(c, ext, E, Hd, DFLASH_BACKEND_CPU, &st);
  dflash_trainer *gpu = make(c, ext, E, Hd, DFLASH_BACKEND_CUDA, &st);
  if (!cpu || !gpu) {
    CHECK(0, "%s: create: %s", what, dflash_last_error());
    return;
  }
  /* Same bf16-exact weights on both. */
  float *p0 = dump(cpu, 0);
  size_t n = n_params(cpu), off = 0, numel;
  round_bf16(p0, n);
  for (size_t i = 0; i < dflash_trainer_param_count(cpu); i++) {
    const char *name;
    dflash_trainer_param_info(cpu, i, &name, NULL, NULL, &numel);
    dflash_trainer_set_param(cpu, name, p0 + off, numel);
    dflash_trainer_set_param(gpu, name, p0 + off, numel);
    off += numel;
  }
  g_seq q;
  if (g_seq_make(c, g_len, g_anchors, seed + 3, &q)) {
    CHECK(0, "%s: inputs", what);
    return;
  }
  round_bf16(q.hidden, (size_t)q.len * c->n_target_layer_ids * c->hidden_size);
  double lc = NAN, lg = NAN;
  CHECK(!dflash_trainer_forward_backward(cpu, q.ids, q.mask, q.len, q.hidden, q.anchors, q.na, &lc),
        "%s: cpu fb: %s", what, dflash_last_error());
  CHECK(!dflash_trainer_forward_backward(gpu, q.ids, q.mask, q.len, q.hidden, q.anchors, q.na, &lg),
        "%s: gpu fb: %s", what, dflash_last_error());
  double le = fabs(lg - lc) / fabs(lc);
  printf("%s: loss cpu %.6f gpu %.6f (relative %.2e)\n", what, lc, lg, le);
  CHECK(le <= 0.01, "%s: loss relative error %.4f > 0.01", what, le);
  compare_grads(cpu, gpu, what);
  /* Greedy predictions from the same (bf16-exact) parameters, before the step. */
  int32_t *pr_c = malloc(sizeof(int32_t) * q.na * (c->block_size - 1));
  int32_t *pr_g = malloc(sizeof(int32_t) * q.na * (c->block_size - 1));
  for (int i = 0; i < q.na * (c->block_size - 1); i++) pr_g[i] = -1;
  dflash_trainer_predict(cpu, q.ids, q.len, q.hidden, q.anchors, q.na, pr_c);
  CHECK(!dflash_trainer_predict(gpu, q.ids, q.len, q.hidden, q.anchors, q.na, pr_g),
        "%s: predict: %s", what, dflash_last_error());
  int same = 0, tot = q.na * (c->block_size - 1);
  for (int i = 0; i < tot; i++) same += pr_c[i] == pr_g[i];
  printf("%s: greedy agreement %d / %d\n", what, same, tot);
  CHECK(same >= 0.95 * tot, "%s: predictions agree on %d of %d", what, same, tot);
  /* A third trainer, on the CPU, steps from the GPU's own gradients. */
  dflash_trainer *twin = make(c, ext, E, Hd, DFLASH_BACKEND_CPU, &st);
  float *gg = dump(gpu, 1);
  off = 0;
  for (size_t i = 0; twin && i < dflash_trainer_param_count(twin); i++) {
    const char *name;
    dflash_trainer_param_info(twin, i, &name, NULL, NULL, &numel);
    dflash_trainer_set_param(twin, name, p0 + off, numel);
    memcpy(twin->m.grads + twin->m.tensors[i].offset, gg + off, numel * sizeof(float));
    off += numel;
  }
  double nc = NAN, ng = NAN, ns = NAN; /* NaN unless the steps ran (clang -Wsometimes-uninitialized) */
  CHECK(twin && !dflash_trainer_step(twin, &ns, NULL), "%s: step from the GPU's gradients: %s",
        what, dflash_last_error());
  CHECK(!dflash_trainer_step(cpu, &nc, NULL) && !dflash_trainer_step(gpu, &ng, NULL),
        "%s: step: %s", what, dflash_last_error());
  printf("%s: grad norm cpu %.6f gpu %.6f (cpu from the gpu's gradients %.6f)\n", what, nc, ng,
         ns);
  CHECK(fabs(ng - nc) <= 0.05 * nc, "%s: grad norm differs", what);
  CHECK(fabs(ng - ns) <= 1e-5 * ns, "%s: grad norm of the same gradients differs", what);
  float *pc = dump(cpu, 0), *pg = dump(gpu, 0), *ps = twin ? dump(twin, 0) : NULL;
  double ue = rel_l2(pg, pc, p0, n), us = ps ? rel_l2(pg, ps, p0, n) : NAN;
  printf("%s: AdamW update relative L2 error %.4f, %.2e from the same gradients\n", what, ue,
         us);
  CHECK(us <= 1e-4, "%s: update error from the same gradients %.2e > 1e-4", what, us);
  CHECK(ue <= 0.25, "%s: update error %.4f > 0.25", what, ue);
  free(gg), free(ps);
  dflash_trainer_free(twin);
  /* NCCL with one rank must change nothing. */
  setenv("DFLASH_NCCL", "1", 1);
  dflash_trainer *nc1 = make(c, ext, E, Hd, DFLASH_BACKEND_CUDA, &st);
  unsetenv("DFLASH_NCCL");
  if (!nc1 && st == DFLASH_E_UNSUPPORTED) {
    printf("%s: NCCL path skipped: %s\n", what, dflash_last_error());
  } else if (!nc1) {
    CHECK(0, "%s: NCCL create: %s", what, dflash_last_error());
  } else {
    off = 0;
    for (size_t i = 0; i < dflash_trainer_param_count(nc1); i++) {
      const char *name;
      dflash_trainer_param_info(nc1, i, &name, NULL, NULL, &numel);
      dflash_trainer_set_param(nc1, name, p0 + off, numel);
      off += numel;
    }
    double l1;
    CHECK(!dflash_trainer_forward_backward(nc1, q.ids, q.mask, q.len, q.hidden, q.anchors, q.na,
                                           &l1) && !dflash_trainer_step(nc1, NULL, NULL),
          "%s: NCCL step: %s", what, dflash_last_error());
    float *pn = dump(nc1, 0);
    CHECK(!memcmp(pn, pg, n * sizeof(float)), "%s: NCCL 1-rank parameters differ", what);
    printf("%s: NCCL 1 rank: loss %.6f, parameters %s\n", what, l1,
           memcmp(pn, pg, n * sizeof(float)) ? "DIFFER" : "bit-identical");
    free(pn);
    dflash_trainer_free(nc1);
  }
  free(pr_c), free(pr_g), free(pc), free(pg), free(p0), free(E), free(Hd);
  g_seq_free(&q);
  dflash_trainer_free(cpu);
  dflash_trainer_free(gpu);
}

int main(void) {
  int n = 0;
  if (dflash_cuda_device_count(&n) || n == 0) {
    printf("SKIP: %s\n", dflash_last_error());
    return 77;
  }
  setenv("DFLASH_CUDA_POISON", "1", 1);
  const char *fixed = getenv("DFLASH_GPU_SEED");
  uint64_t seed = fixed ? strtoull(fixed, NULL, 10) : (uint64_t)time(NULL);
  printf("seed %llu (DFLASH_GPU_SEED=%llu reproduces)\n", (unsigned long long)seed,
         (unsigned long long)seed);
  dflash_drafter_config c;
  dflash_drafter_config_default(&c);
#ifdef DFLASH_GPU_EMU
  /* The emulated device runs every CUDA thread on the CPU: small widths, same code paths. */
  const int H1 = 128, I1 = 256, V = 500, H2 = 128, nh2 = 4;
  g_len = 160, g_anchors = 12;
#else
  const int H1 = 256, I1 = 512, V = 1000, H2 = 512, nh2 = 8;
#endif
  c.hidden_size = H1, c.intermediate_size = I1, c.num_hidden_layers = 2;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 64, c.vocab_size = V;
  c.num_target_layers = 12, c.block_size = 8, c.mask_token_id = V - 1;
  c.n_target_layer_ids = 3, c.target_layer_ids[0] = 1, c.target_layer_ids[1] = 4;
  c.target_layer_ids[2] = 8;
  dflash_drafter_config_ext ext;
  dflash_drafter_config_ext_default(&ext);
  run_config(&c, &ext, "full/rope", seed);
  ext.partial_rotary_factor = 0.5; /* RoPE on 32 of each head's 64 dims */
  run_config(&c, &ext, "partial rotary 0.5", seed + 50);
  ext.partial_rotary_factor = 1.0;
  c.hidden_size = H2, c.num_attention_heads = nh2, c.head_dim = 128, c.block_size = 16;
  c.rope_type = DFLASH_ROPE_YARN, c.rope_theta = 50000, c.rope_factor = 64;
  c.rope_original_max_position = 64, c.rope_attention_factor = 1.0;
  c.layer_types[1] = DFLASH_LAYER_SLIDING, c.sliding_window = 40;
  if (dflash_drafter_config_validate(&c)) {
    printf("config: %s\n", dflash_last_error());
    return 1;
  }
  run_config(&c, &ext, "yarn/sliding", seed + 100);
  printf("%s (%d failures)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
