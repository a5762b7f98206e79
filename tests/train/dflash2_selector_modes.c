/* The measurement behind DFlash 2's default selector_loss_mode (src/train/README.md):
 * a tiny DFlash 2 drafter (H 32, V 64, B 4, top-8, rank 16) trained on a Markov chain
 * (next = succ[prev] with probability 0.8, else uniform) for STEPS AdamW steps of one
 * 64-token sequence, then its greedy selector path (dflash_trainer_propose) scored on 50
 * held-out sequences: drafted-token accuracy, position 1, accepted tokens per block.
 * Usage: dflash2_selector_modes MODE(0 drop, 1 inject) STEPS WEIGHT SEED. Built, not a test. */
#include <dflash/train.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "seq.h"
enum { H = 32, V = 64, B = 4, LEN = 64, K = 8 };
static uint64_t z;
static double u(void) {
  z = z * 6364136223846793005ULL + 1442695040888963407ULL;
  return (double)(z >> 11) / 9007199254740992.0;
}
static int succ[V];
static void seq(int32_t *ids, float *hid) {
  ids[0] = (int)(u() * (V - 1));
  for (int i = 1; i < LEN; i++) ids[i] = u() < 0.8 ? succ[ids[i - 1]] : (int)(u() * (V - 1));
  for (int i = 0; i < LEN; i++)
    for (int j = 0; j < H; j++)
      hid[i * H + j] = (j == ids[i] % H) ? 1.0f : 0.1f * (float)sin(i + j);
}
int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s MODE STEPS WEIGHT SEED\n", argv[0]);
    return 2;
  }
  int mode = atoi(argv[1]), steps = atoi(argv[2]);
  double wt = atof(argv[3]);
  z = 7;
  for (int v = 0; v < V; v++) succ[v] = (int)(u() * (V - 1));
  dflash_drafter_config c = {.struct_size = sizeof c};
  dflash_drafter_config_default(&c);
  c.hidden_size = H, c.intermediate_size = 64, c.num_hidden_layers = 1, c.num_attention_heads = 4,
  c.num_key_value_heads = 2, c.head_dim = 8, c.vocab_size = V, c.num_target_layers = 4,
  c.block_size = B, c.mask_token_id = V - 1, c.n_target_layer_ids = 1, c.target_layer_ids[0] = 1;
  c.dflash2 = 1, c.conv_kernel_size = 2, c.conv_group_size = 8, c.selector_top_k = K,
  c.selector_rank = 16;
  float *E = malloc(sizeof(float) * V * H), *Hd = malloc(sizeof(float) * V * H);
  z = 99;
  for (int i = 0; i < V * H; i++) E[i] = (float)(u() - 0.5), Hd[i] = (float)(u() - 0.5);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.seed = (uint64_t)atoi(argv[4]), o.lr = 3e-3, o.warmup_ratio = 0, o.selector_loss_mode = mode,
  o.selector_loss_weight = wt;
  dflash_trainer *t;
  if (dflash_trainer_create(&c, E, Hd, &o, &t)) {
    printf("create failed\n");
    return 1;
  }
  int32_t ids[LEN], anchors[15];
  float hid[LEN * H];
  uint8_t mask[LEN];
  for (int i = 0; i < LEN; i++) mask[i] = 1;
  for (int a = 0; a < 15; a++) anchors[a] = a * 4;
  z = 1234 + (uint64_t)atoi(argv[4]);
  double loss;
  for (int s = 0; s < steps; s++) {
    seq(ids, hid);
    if (dflash_trainer_forward_backward(t, SEQ(ids, mask, LEN, hid, anchors, 15), &loss)) return 1;
    dflash_trainer_step(t, NULL, NULL);
  }
  z = 555;
  long hit = 0, n = 0, first = 0, tau = 0;
  for (int s = 0; s < 50; s++) {
    seq(ids, hid);
    int32_t pred[15 * (B - 1)];
    dflash_trainer_propose(t, SEQ(ids, NULL, LEN, hid, anchors, 15), NULL, pred, NULL);
    for (int a = 0; a < 15; a++) {
      int ok = 1;
      for (int j = 1; j < B; j++) {
        int y = ids[anchors[a] + j] == pred[a * (B - 1) + j - 1];
        hit += y, n++;
        if (j == 1) first += y;
        ok = ok && y;
        tau += ok;
      }
    }
  }
  printf(
      "mode %s weight %g steps %d: held-out accuracy %.4f, pos1 %.4f, accepted/block %.3f, last loss %.3f\n",
      mode ? "inject" : "drop", wt, steps, (double)hit / n, (double)first / (n / (B - 1)),
      (double)tau / (n / (B - 1)), loss);
  dflash_trainer_free(t);
  return 0;
}
