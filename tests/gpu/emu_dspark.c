/*
 * DSpark on the CUDA backend (cuda/model.cu dspark_loss, kernels.cu dspark_*) against its CPU
 * twin (src/train/dspark.c, model_dspark.c) on the emulated device (suite cuda-emu, at the
 * sm_90 and sm_120 settings): the same small DSpark drafter, parameters, embedding, LM head,
 * inputs and target final state (all bf16-exact) through both backends; the loss and every
 * gradient tensor (markov_head.markov_w1 / markov_w2 and confidence_head.proj.* included)
 * within the DFlash parity tests' bf16 bounds (tests/gpu/gpu_parity.c):
 *   loss                     |gpu - cpu| / |cpu|         <= 0.01
 *   every gradient tensor    ||gpu - cpu|| / ||cpu||      <= 0.05
 * Cases: the confidence head with the target's final state (CE + L1 + BCE), without the head
 * (CE + L1), and without the final state (0.1 CE alone); each again with a pruned draft
 * vocabulary (V_d 217 of 300, a kept set that leaves out labels of some rows: no CE there,
 * L1 against the target renormalized over the kept ids, c* from the target over the full
 * vocabulary), which then trains again on a second kept set (the device takes the new ids).
 * Blocks run past the sequence's end and over unsupervised positions (the prefix mask), and
 * there are more rows than one pass of the CUDA loss takes (kDsparkRows). The deferred path
 * (accumulate, collect) must give the same loss and weight as forward_backward. The device
 * arena is poisoned before every call (DFLASH_CUDA_POISON). DFLASH_GPU_SEED fixes the inputs'
 * seed (default: fixed list). Refused on CUDA: a pruned drafter before its kept ids are set
 * (as on the CPU), and dflash_trainer_propose (DSpark's drafts chain on the CPU).
 */
#include <dflash/train.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu_common.h"
#include "core/bf16.h"

static int failures;
#define CHECK(cond, ...)            \
  do {                              \
    if (!(cond)) {                  \
      failures++;                   \
      printf("FAIL: " __VA_ARGS__); \
      printf("\n");                 \
    }                               \
  } while (0)

enum { LEN = 160, NA = 20, RANK = 16 };

static void round_bf16(float *x, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = df_bf16_to_f32(df_f32_to_bf16(x[i]));
}

static double rel_l2(const float *a, const float *b, size_t n) {
  double num = 0, den = 0;
  for (size_t i = 0; i < n; i++) {
    double d = (double)a[i] - b[i];
    num += d * d, den += (double)b[i] * b[i];
  }
  return den > 0 ? sqrt(num / den) : sqrt(num);
}

static dflash_trainer *make(const dflash_drafter_config *c, const float *E, const float *Hd,
                            int backend) {
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.backend = backend;
  o.seed = 5;
  o.vocab_chunk = 128;
  o.init_std = 0.05;
  o.warmup_ratio = 0;
  o.total_steps = 10;
  dflash_trainer *t = NULL;
  if (dflash_trainer_create(c, E, Hd, &o, &t)) {
    printf("FAIL: create (%s): %s\n", backend == DFLASH_BACKEND_CUDA ? "cuda" : "cpu",
           dflash_last_error());
    failures++;
    return NULL;
  }
  return t;
}

/* The heads' tensors larger than their init, so that the Markov bias and the confidence logit
 * weigh in the loss (W1 uniform 1, W2 0.2, the confidence weight 0.3, its bias 0.1). */
static void perturb_heads(dflash_trainer *t, float *p, uint64_t seed) {
  size_t off = 0, numel;
  for (size_t i = 0; i < dflash_trainer_param_count(t); i++) {
    const char *name;
    dflash_trainer_param_info(t, i, &name, NULL, NULL, &numel);
    float scale = strstr(name, "markov_w1")                     ? 1.0f
                  : strstr(name, "markov_w2")                   ? 0.2f
                  : strstr(name, "confidence_head.proj.weight") ? 0.3f
                  : strstr(name, "confidence_head.proj.bias")   ? 0.1f
                                                                : 0.0f;
    if (scale > 0) {
      float *u = g_random(numel, scale, seed + i);
      memcpy(p + off, u, numel * sizeof(float));
      free(u);
    }
    off += numel;
  }
}

/* The pruned cases' draft vocabulary: VD of the 300 ids, by a permutation of them (37 i +
 * 150 set mod 300; `set` 0 or 1, two different sets), ascending. */
enum { VD = 217 };
static void kept_ids(int set, int32_t *kept) {
  int n = 0;
  for (int i = 0; i < 300; i++)
    if ((i * 37 + 150 * set) % 300 >= 300 - VD) kept[n++] = i;
}

/* Both trainers' loss and every gradient tensor after one forward_backward of s, within the
 * bounds; the loss of the CUDA one into *lg. */
static void compare(dflash_trainer *cpu, dflash_trainer *gpu, const dflash_sample *s,
                    int with_final, const char *what, double *lg_out) {
  double lc = NAN, lg = NAN;
  size_t off = 0, numel;
  CHECK(!dflash_trainer_forward_backward(cpu, s, &lc), "%s: cpu fb: %s", what, dflash_last_error());
  CHECK(!dflash_trainer_forward_backward(gpu, s, &lg), "%s: gpu fb: %s", what, dflash_last_error());
  double le = fabs(lg - lc) / fabs(lc);
  printf("%s: loss cpu %.6f gpu %.6f (relative %.2e, bound 0.01)\n", what, lc, lg, le);
  CHECK(le <= 0.01, "%s: loss relative error %.4f > 0.01", what, le);
  float *gc = g_dump(cpu, 1), *gg = g_dump(gpu, 1);
  double worst = 0;
  const char *worst_name = "";
  for (size_t i = 0; i < dflash_trainer_param_count(cpu); i++) {
    const char *name;
    dflash_trainer_param_info(cpu, i, &name, NULL, NULL, &numel);
    double e = rel_l2(gg + off, gc + off, numel), nc = 0;
    for (size_t k = 0; k < numel; k++) nc += (double)gc[off + k] * gc[off + k];
    bool head = !strncmp(name, "markov_head.", 12) || !strncmp(name, "confidence_head.", 16);
    if (head)
      printf("%s: gradient %s relative L2 error %.4f (|cpu| %.3e)\n", what, name, e, sqrt(nc));
    if (!(e <= worst)) worst = e, worst_name = name;
    CHECK(e <= 0.05, "%s: gradient %s relative L2 error %.4f > 0.05", what, name, e);
    /* A head the loss reaches has a gradient (not a vacuous comparison of zeros). */
    if (head && (with_final || !strncmp(name, "markov_head.", 12)))
      CHECK(nc > 0, "%s: gradient %s is zero on the CPU", what, name);
    off += numel;
  }
  printf("%s: worst gradient relative L2 error %.4f (%s), bound 0.05\n", what, worst, worst_name);
  free(gc), free(gg);
  *lg_out = lg;
}

static void run_case(int conf, int with_final, int pruned, uint64_t seed, const char *what) {
  dflash_drafter_config c = {.struct_size = sizeof c};
  g_small_config(&c);
  c.block_size = 8, c.tie_word_embeddings = 0;
  c.dspark = 1, c.markov_rank = RANK, c.confidence_head = conf;
  if (pruned) c.draft_vocab_size = VD;
  int H = c.hidden_size;
  size_t vh = (size_t)c.vocab_size * H;
  float *E = g_random(vh, 1.0f, seed + 1), *Hd = g_random(vh, 0.05f, seed + 2);
  round_bf16(E, vh), round_bf16(Hd, vh);
  dflash_trainer *cpu = make(&c, E, Hd, DFLASH_BACKEND_CPU);
  dflash_trainer *gpu = make(&c, E, Hd, DFLASH_BACKEND_CUDA);
  int32_t kept[VD];
  if (!cpu || !gpu) goto out;
  {
    float *p0 = g_dump(cpu, 0);
    size_t off = 0, numel;
    perturb_heads(cpu, p0, seed + 40);
    round_bf16(p0, g_n_params(cpu));
    for (size_t i = 0; i < dflash_trainer_param_count(cpu); i++) {
      const char *name;
      dflash_trainer_param_info(cpu, i, &name, NULL, NULL, &numel);
      CHECK(!dflash_trainer_set_param(cpu, name, p0 + off, numel), "set cpu %s", name);
      CHECK(!dflash_trainer_set_param(gpu, name, p0 + off, numel), "set gpu %s", name);
      off += numel;
    }
    free(p0);
    g_seq q;
    if (g_seq_make(&c, LEN, NA, seed + 3, &q)) {
      CHECK(0, "%s: inputs", what);
      goto out;
    }
    round_bf16(q.hidden, (size_t)q.len * c.n_target_layer_ids * H);
    /* Two blocks that leave the sequence (DFlash's sampler keeps blocks inside it): the
     * prefix mask ends them. */
    q.anchors[q.na - 2] = LEN - 5, q.anchors[q.na - 1] = LEN - 2;
    float *fin = g_random((size_t)LEN * H, 1.0f, seed + 9);
    round_bf16(fin, (size_t)LEN * H);
    dflash_sample s = g_seq_sample(&q, with_final ? fin : NULL);
    if (pruned) {
      /* As on the CPU: no training on the fresh 0..V_d-1 before the kept ids are set. */
      double l0;
      dflash_status st = dflash_trainer_forward_backward(gpu, &s, &l0);
      CHECK(st == DFLASH_E_STATE && strstr(dflash_last_error(), "pruned draft vocabulary"),
            "%s: gpu trains before the kept ids are set: status %d (%s)", what, (int)st,
            dflash_last_error());
      kept_ids(0, kept);
      CHECK(!dflash_trainer_set_draft_vocab(cpu, kept, VD), "%s: set cpu kept ids", what);
      CHECK(!dflash_trainer_set_draft_vocab(gpu, kept, VD), "%s: set gpu kept ids", what);
      /* Some supervised labels outside the kept set (the rows without CE). */
      bool in[300] = {false};
      int out_of_set = 0, supervised = 0;
      for (int i = 0; i < VD; i++) in[kept[i]] = true;
      for (int p = 0; p < q.len; p++)
        if (q.mask[p]) supervised++, out_of_set += !in[q.ids[p]];
      printf("%s: %d of %d supervised labels outside the kept set\n", what, out_of_set, supervised);
      CHECK(out_of_set > 0 && out_of_set < supervised, "%s: labels outside the kept set: %d", what,
            out_of_set);
    }
    double lg = NAN;
    compare(cpu, gpu, &s, with_final, what, &lg);
    /* The deferred path: the same loss and weight, and the same gradients as at once. */
    double wc = 0, wg = 0, ls = 0;
    CHECK(!dflash_trainer_weight_sum(cpu, &s, &wc), "%s: weight_sum", what);
    float *g1 = g_dump(gpu, 1);
    CHECK(!dflash_trainer_zero_grad(gpu), "%s: zero_grad", what);
    CHECK(!dflash_trainer_accumulate(gpu, &s, 1.0 / wc), "%s: accumulate: %s", what,
          dflash_last_error());
    CHECK(!dflash_trainer_collect(gpu, &ls, &wg), "%s: collect: %s", what, dflash_last_error());
    printf("%s: deferred loss %.6f weight %.6f (cpu weight %.6f)\n", what, ls / wg, wg, wc);
    CHECK(fabs(wg - wc) <= 1e-6 * wc, "%s: deferred weight %.6f, cpu %.6f", what, wg, wc);
    CHECK(fabs(ls / wg - lg) <= 1e-5 * fabs(lg), "%s: deferred loss %.6f, at once %.6f", what,
          ls / wg, lg);
    float *g2 = g_dump(gpu, 1);
    double ed = rel_l2(g2, g1, g_n_params(gpu));
    CHECK(ed <= 1e-5, "%s: deferred gradients differ from forward_backward's by %.2e", what, ed);
    free(g1), free(g2);
    if (pruned) {
      /* Another kept set: the device's head rows and ids follow it. */
      kept_ids(1, kept);
      CHECK(!dflash_trainer_set_draft_vocab(cpu, kept, VD), "%s: set cpu kept ids", what);
      CHECK(!dflash_trainer_set_draft_vocab(gpu, kept, VD), "%s: set gpu kept ids", what);
      char what2[160];
      snprintf(what2, sizeof what2, "%s, second kept set", what);
      double lg2 = NAN;
      compare(cpu, gpu, &s, with_final, what2, &lg2);
      CHECK(fabs(lg2 - lg) > 1e-3 * fabs(lg), "%s: the loss %.6f did not change with the set",
            what2, lg2);
      /* DSpark's drafts chain through the Markov head, on the CPU only: refused by name. */
      int32_t pred[NA * 8];
      dflash_status st = dflash_trainer_propose(gpu, &s, NULL, pred, NULL);
      CHECK(st == DFLASH_E_UNSUPPORTED && strstr(dflash_last_error(), "predict (backend CUDA)"),
            "%s: propose on CUDA: status %d (%s)", what, (int)st, dflash_last_error());
    }
    free(fin);
    g_seq_free(&q);
  }
out:
  dflash_trainer_free(cpu), dflash_trainer_free(gpu);
  free(E), free(Hd);
}

/* The emulator refuses a kernel by name (as the hardware refuses a launch): each of DSpark's
 * must fail the call naming it, never leave its outputs unwritten without a word. */
void dfemu_refuse_kernel(const char *name);

static void refused_launches(void) {
  static const char *kernels[] = {"dspark_loss_rows", "dspark_conf_rows", "dspark_param_grads"};
  dflash_drafter_config c = {.struct_size = sizeof c};
  g_small_config(&c);
  c.block_size = 8, c.tie_word_embeddings = 0;
  c.dspark = 1, c.markov_rank = RANK, c.confidence_head = 1;
  float *E, *Hd;
  g_small_embeddings(&c, &E, &Hd);
  dflash_trainer *t = make(&c, E, Hd, DFLASH_BACKEND_CUDA);
  g_seq q;
  float *fin = g_random((size_t)60 * c.hidden_size, 1.0f, 31);
  if (!t || g_seq_make(&c, 60, 6, 21, &q)) {
    CHECK(0, "refused launches: setup");
    return;
  }
  dflash_sample s = g_seq_sample(&q, fin);
  double loss;
  CHECK(!dflash_trainer_forward_backward(t, &s, &loss), "no refusal: %s", dflash_last_error());
  for (size_t k = 0; k < sizeof kernels / sizeof *kernels; k++) {
    dfemu_refuse_kernel(kernels[k]);
    dflash_status st = dflash_trainer_forward_backward(t, &s, &loss);
    dfemu_refuse_kernel(NULL);
    CHECK(st == DFLASH_E_CUDA && strstr(dflash_last_error(), kernels[k]),
          "kernel %s refused: status %d, \"%s\"", kernels[k], (int)st, dflash_last_error());
  }
  printf("refused launches: each of DSpark's %zu kernels named\n",
         sizeof kernels / sizeof *kernels);
  g_seq_free(&q);
  free(fin), free(E), free(Hd);
  dflash_trainer_free(t);
}

int main(void) {
  uint64_t seed;
  int rc = g_parity_start(1234, &seed);
  if (rc) return rc;
  run_case(1, 1, 0, seed, "confidence head, final state");
  run_case(0, 1, 0, seed + 100, "no confidence head, final state");
  run_case(1, 0, 0, seed + 200, "confidence head, no final state (CE alone)");
  run_case(1, 1, 1, seed + 300, "pruned, confidence head, final state");
  run_case(0, 1, 1, seed + 400, "pruned, no confidence head, final state");
  run_case(1, 0, 1, seed + 500, "pruned, confidence head, no final state (CE alone)");
  refused_launches();
  printf(failures ? "%d FAILURES\n" : "OK\n", failures);
  return failures ? 1 : 0;
}
