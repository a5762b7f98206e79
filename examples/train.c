/* Trains a tiny drafter with the C trainer on a synthetic sequence whose next
 * tokens follow a rule (t -> t + 5 mod 60), measures the acceptance length tau
 * before and after, and saves the checkpoint (config.json + model.safetensors).
 * The target's "hidden states" are its token embeddings, and its embedding /
 * LM head are random: the drafter has to learn the rule itself.
 * usage: train OUT_DIR [STEPS] */
#include <dflash/train.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { H = 32, V = 64, B = 4, LEN = 96, ANCHORS = 16 };

static int fail(dflash_status st) {
  fprintf(stderr, "error: %s: %s\n", dflash_status_str(st), dflash_last_error());
  return 1;
}

static void drafter_config(dflash_drafter_config *c) {
  dflash_drafter_config_default(c);
  c->hidden_size = H, c->intermediate_size = 2 * H, c->num_hidden_layers = 1;
  c->num_attention_heads = 4, c->num_key_value_heads = 2, c->head_dim = H / 4;
  c->vocab_size = V, c->max_position_embeddings = 256, c->num_target_layers = 4;
  c->block_size = B, c->mask_token_id = V - 1;
  c->n_target_layer_ids = 1, c->target_layer_ids[0] = 2;
}

/* Mean acceptance length over every anchor that has a whole block. */
static dflash_status tau_of(dflash_trainer *t, const int32_t *ids, const float *hid, double *tau) {
  int32_t anchors[LEN], accept[LEN], n = 0;
  for (int32_t a = 0; a + B <= LEN; a++) anchors[n++] = a;
  dflash_sample smp = {.struct_size = sizeof smp,
                       .len = LEN,
                       .input_ids = ids,
                       .hidden = hid,
                       .anchors = anchors,
                       .n_anchors = n};
  dflash_status st = dflash_trainer_acceptance(t, &smp, accept);
  double sum = 0;
  for (int32_t i = 0; i < n; i++) sum += 1 + accept[i];
  *tau = sum / n;
  return st;
}

int main(int argc, char **argv) {
  if (argc < 2 || argc > 3) {
    fprintf(stderr, "usage: %s OUT_DIR [STEPS]\n", argv[0]);
    return 2;
  }
  int steps = argc == 3 ? atoi(argv[2]) : 300;
  static float embed[V * H], hidden[LEN * H];
  static int32_t ids[LEN];
  static uint8_t mask[LEN];
  srand(1);
  for (int i = 0; i < V * H; i++) /* Box-Muller normal, scaled like a real embedding */
    embed[i] = (float)(0.5 * sqrt(-2 * log((rand() + 1.0) / ((double)RAND_MAX + 2.0))) *
                       cos(6.2831853 * rand() / (double)RAND_MAX));
  for (int i = 0; i < LEN; i++) {
    ids[i] = (7 + 5 * i) % 60, mask[i] = 1;
    for (int j = 0; j < H; j++) hidden[i * H + j] = embed[ids[i] * H + j];
  }
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  drafter_config(&cfg);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.lr = 3e-3, o.total_steps = steps, o.num_anchors = ANCHORS, o.n_threads = 1;
  dflash_trainer *t;
  dflash_status st = dflash_drafter_config_validate(&cfg);
  if (!st) st = dflash_trainer_create(&cfg, embed, embed, &o, &t);
  if (st) return fail(st);
  double before = 0, after = 0, loss = 0;
  st = tau_of(t, ids, hidden, &before);
  /* One sequence, one struct: the sample carries ids, mask, rows and this step's anchors. */
  int32_t anchors[ANCHORS];
  dflash_sample smp = {.struct_size = sizeof smp,
                       .len = LEN,
                       .input_ids = ids,
                       .loss_mask = mask,
                       .hidden = hidden,
                       .anchors = anchors};
  for (int s = 0; s < steps && !st; s++) {
    double norm, lr;
    st = dflash_anchors_sample(mask, LEN, B, ANCHORS, 1, (uint64_t)s, anchors, &smp.n_anchors);
    if (!st) st = dflash_trainer_forward_backward(t, &smp, &loss);
    if (!st) st = dflash_trainer_step(t, &norm, &lr);
    if (!st && (s % 50 == 0 || s == steps - 1))
      printf("step %4d  loss %.4f  grad norm %.3f  lr %.2e\n", s, loss, norm, lr);
  }
  if (!st) st = tau_of(t, ids, hidden, &after);
  if (!st) st = dflash_trainer_save(t, argv[1], 0);
  dflash_trainer_free(t);
  if (st) return fail(st);
  printf("tau before %.3f, after %.3f (block size %d); checkpoint in %s\n", before, after, B,
         argv[1]);
  return after > before + 0.5 ? 0 : 1; /* the drafter must have learned the rule */
}
