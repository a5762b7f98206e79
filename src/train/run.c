/*
 * A whole training run over a tokenized dataset and a hidden-state store:
 * seeded epoch orders, fresh anchors per epoch, batches of sequences per
 * optimizer step, metrics JSONL, periodic checkpoints and an exact resume.
 * Everything random derives from (seed, epoch, sample index), so the data
 * position alone restores the generator.
 */
#include <dflash/hidden.h>
#include <dflash/progress.h>
#include <dflash/storage.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hidden/hidden.h"
#include "rng.h"
#include "remote.h"
#include "trainer.h"

void dflash_train_run_options_default(dflash_train_run_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->epochs = 6;
  o->batch_size = 1;
  dflash_trainer_options_default(&o->trainer);
}

typedef struct run {
  const dflash_train_run_options *o;
  dflash_train_run_options local_o; /* an s3:// out_dir: o with its local mirror */
  df_train_remote remote;
  dflash_drafter_config cfg;
  dflash_trainer *t;
  dflash_sample_stream *s;
  const df_tokens *tok;
  uint64_t *usable, *order;
  size_t n_usable, n_total;
  int32_t *anchors; /* batch_size * num_anchors */
  int32_t *n_anchors;
  char *state_path, *metrics_path;
  FILE *metrics;
  dflash_progress *progress;
  int64_t total_steps, tokens;
  double elapsed, t0;
  /* position */
  int32_t epoch;
  uint64_t pos;
} run;

/* Samples that can carry at least one anchor (>= 2B supervised tokens and
 * a candidate position). */
static dflash_status find_usable(run *r) {
  r->n_total = df_tokens_count(r->tok);
  r->usable = malloc((r->n_total ? r->n_total : 1) * sizeof *r->usable);
  if (!r->usable) return df_error_nomem("sample list");
  for (size_t i = 0; i < r->n_total; i++) {
    const char *id;
    const int32_t *ids;
    const uint8_t *mask;
    int64_t len;
    int32_t a, n;
    df_tokens_get(r->tok, i, &id, &ids, &mask, &len);
    dflash_status st = dflash_sample_anchors(mask, len, r->cfg.block_size, 1, 0, 0, &a, &n);
    if (st) return st;
    if (n > 0) r->usable[r->n_usable++] = i;
  }
  if (r->n_usable == 0)
    return df_error(DFLASH_E_NOT_FOUND, "%s: no sample has %d supervised tokens and room for a "
                    "block", r->o->data_dir, 2 * r->cfg.block_size);
  return DFLASH_OK;
}

static void epoch_order(run *r, int32_t epoch) {
  memcpy(r->order, r->usable, r->n_usable * sizeof *r->order);
  df_rng rng;
  df_rng_seed(&rng, r->o->trainer.seed ^ 0x6f7264657273ULL, (uint64_t)epoch);
  for (size_t i = r->n_usable; i > 1; i--) {
    size_t j = (size_t)df_rng_below(&rng, i);
    uint64_t tmp = r->order[i - 1];
    r->order[i - 1] = r->order[j];
    r->order[j] = tmp;
  }
}

static dflash_status load_target(run *r, dflash_trainer_options *topt) {
  size_t vh = (size_t)r->cfg.vocab_size * (size_t)r->cfg.hidden_size;
  float *e = malloc(vh * sizeof *e), *h = malloc(vh * sizeof *h);
  dflash_status st = e && h ? DFLASH_OK : df_error_nomem("target embedding and LM head");
  if (!st) st = dflash_target_load_head(r->o->target_path, r->o->embed_name, r->o->lm_head_name,
                                        r->cfg.vocab_size, r->cfg.hidden_size, e, h);
  if (!st) st = dflash_trainer_create(&r->cfg, e, h, topt, &r->t);
  free(e);
  free(h);
  return st;
}

/* Save the checkpoint and the state; (epoch, pos) is the next sample to visit. */
static dflash_status save(run *r, int32_t epoch, uint64_t pos) {
  if (pos >= r->n_usable) epoch++, pos = 0;
  long mbytes = r->metrics ? ftell(r->metrics) : 0;
  char blob[256];
  int n = snprintf(blob, sizeof blob, "epoch=%d pos=%" PRIu64 " tokens=%" PRId64
                   " metrics_bytes=%ld seed=%" PRIu64 " samples=%zu elapsed=%.17g",
                   epoch, pos, r->tokens, mbytes, r->o->trainer.seed, r->n_usable,
                   r->elapsed + df_now_seconds() - r->t0);
  dflash_status st = dflash_trainer_save(r->t, r->o->out_dir, r->o->bf16);
  if (!st) st = dflash_trainer_save_state(r->t, r->state_path, blob, (size_t)n + 1);
  if (!st && r->remote.url) st = df_train_remote_publish(&r->remote, r->metrics);
  return st;
}

static dflash_status resume(run *r) {
  char blob[256];
  size_t len = sizeof blob;
  dflash_status st = dflash_trainer_load_state(r->t, r->state_path, blob, &len);
  if (st) return df_error_wrap(st, "resuming");
  blob[sizeof blob - 1] = 0;
  long mbytes;
  uint64_t seed;
  size_t samples;
  if (sscanf(blob, "epoch=%d pos=%" SCNu64 " tokens=%" SCNd64 " metrics_bytes=%ld seed=%" SCNu64
             " samples=%zu elapsed=%lf", &r->epoch, &r->pos, &r->tokens, &mbytes, &seed,
             &samples, &r->elapsed) != 7)
    return df_error(DFLASH_E_FORMAT, "%s: unreadable data position \"%s\"", r->state_path, blob);
  if (seed != r->o->trainer.seed)
    return df_error(DFLASH_E_MISMATCH, "%s was written with seed %" PRIu64 ", this run has %"
                    PRIu64, r->state_path, seed, r->o->trainer.seed);
  if (samples != r->n_usable)
    return df_error(DFLASH_E_MISMATCH, "%s was written for %zu trainable samples, %s has %zu: "
                    "the data changed", r->state_path, samples, r->o->data_dir, r->n_usable);
  /* Forget metrics lines written after the state was saved. */
  if (truncate(r->metrics_path, mbytes) != 0 && mbytes > 0)
    return df_error(DFLASH_E_IO, "cannot truncate %s to %ld bytes", r->metrics_path, mbytes);
  return DFLASH_OK;
}

static dflash_status open_all(run *r) {
  const dflash_train_run_options *o = r->o;
  dflash_status st = dflash_drafter_config_load(o->config_path, &r->cfg);
  if (!st) st = dflash_sample_stream_open(o->data_dir, o->hidden_dir, NULL, &r->s);
  if (st) return st;
  r->tok = df_sample_stream_tokens(r->s);
  int64_t width = (int64_t)r->cfg.n_target_layer_ids * r->cfg.hidden_size;
  if (dflash_sample_stream_width(r->s) != width)
    return df_error(DFLASH_E_MISMATCH, "%s holds %" PRId64 " features per token; the drafter "
                    "config needs K*H = %d*%d = %" PRId64, o->hidden_dir,
                    dflash_sample_stream_width(r->s), r->cfg.n_target_layer_ids,
                    r->cfg.hidden_size, width);
  if ((st = dflash_sample_stream_check(r->s, NULL))) return st;
  if ((st = find_usable(r))) return st;
  int32_t A = o->trainer.num_anchors;
  r->order = malloc(r->n_usable * sizeof *r->order);
  r->anchors = malloc((size_t)o->batch_size * (size_t)A * sizeof *r->anchors);
  r->n_anchors = malloc((size_t)o->batch_size * sizeof *r->n_anchors);
  if (!r->order || !r->anchors || !r->n_anchors) return df_error_nomem("run buffers");
  int64_t per_epoch = (int64_t)((r->n_usable + (size_t)o->batch_size - 1) / (size_t)o->batch_size);
  r->total_steps = per_epoch * o->epochs;
  dflash_trainer_options topt = o->trainer;
  topt.total_steps = r->total_steps;
  if ((st = load_target(r, &topt))) return st;
  /* In a subdirectory: engines load every *.safetensors at the top level. */
  char *state_dir = df_path_join(o->out_dir, "train_state");
  if (!state_dir) return df_error_nomem("paths");
  if ((st = df_mkdir_p(state_dir))) { /* creates out_dir too */
    free(state_dir);
    return st;
  }
  r->state_path = df_path_join(state_dir, "state.safetensors");
  free(state_dir);
  r->metrics_path = df_path_join(o->out_dir, "metrics.jsonl");
  if (!r->state_path || !r->metrics_path) return df_error_nomem("paths");
  if (o->resume && (st = resume(r))) return st;
  r->metrics = fopen(r->metrics_path, o->resume ? "a" : "w");
  if (!r->metrics) return df_error(DFLASH_E_IO, "cannot open %s", r->metrics_path);
  if (o->progress)
    dflash_progress_create(o->progress, "train", "steps", (uint64_t)r->total_steps, 0,
                           &r->progress);
  return DFLASH_OK;
}

/* One optimizer step over order[pos, pos+b). */
static dflash_status train_step(run *r, size_t b) {
  const dflash_train_run_options *o = r->o;
  int32_t A = o->trainer.num_anchors, B = r->cfg.block_size;
  double W = 0, lsum = 0;
  int64_t tokens = 0;
  for (size_t i = 0; i < b; i++) {
    uint64_t idx = r->order[r->pos + i];
    const char *id;
    const int32_t *ids;
    const uint8_t *mask;
    int64_t len;
    double w;
    df_tokens_get(r->tok, (size_t)idx, &id, &ids, &mask, &len);
    dflash_status st = dflash_sample_anchors(mask, len, B, A, o->trainer.seed,
                                             (uint64_t)r->epoch * r->n_total + idx,
                                             r->anchors + i * (size_t)A, &r->n_anchors[i]);
    if (!st) st = dflash_trainer_weight_sum(r->t, mask, len, r->anchors + i * (size_t)A,
                                            r->n_anchors[i], &w);
    if (st) return st;
    W += w;
    tokens += len;
  }
  dflash_trainer_zero_grad(r->t);
  double t_start = df_now_seconds();
  for (size_t i = 0; i < b; i++) {
    dflash_train_sample smp;
    int done;
    double ls;
    dflash_status st = dflash_sample_stream_next(r->s, &smp, &done);
    if (!st && done) st = df_error(DFLASH_E_INTERNAL, "sample stream ended early");
    if (!st) st = dflash_trainer_accumulate(r->t, smp.input_ids, smp.loss_mask, smp.len,
                                            smp.hidden, r->anchors + i * (size_t)A,
                                            r->n_anchors[i], 1.0 / W, &ls, NULL);
    if (st) return df_error_wrap(st, "sample %s", smp.id ? smp.id : "?");
    lsum += ls;
  }
  double norm, lr;
  dflash_status st = dflash_trainer_step(r->t, &norm, &lr);
  if (st) return st;
  r->tokens += tokens;
  double now = df_now_seconds(), dt = now - t_start;
  int64_t step = dflash_trainer_steps(r->t);
  fprintf(r->metrics, "{\"step\": %" PRId64 ", \"epoch\": %d, \"loss\": %.9g, \"grad_norm\": "
          "%.9g, \"lr\": %.9g, \"tokens\": %" PRId64 ", \"tokens_per_s\": %.1f, \"elapsed_s\": "
          "%.3f}\n", step, r->epoch, lsum / W, norm, lr, r->tokens, dt > 0 ? tokens / dt : 0.0,
          r->elapsed + now - r->t0);
  fflush(r->metrics);
  if (r->progress) {
    char note[96];
    snprintf(note, sizeof note, "loss %.4f  %.0f tok/s", lsum / W, dt > 0 ? tokens / dt : 0.0);
    dflash_progress_update(r->progress, (uint64_t)step, note);
  }
  return DFLASH_OK;
}

static dflash_status train_loop(run *r) {
  const dflash_train_run_options *o = r->o;
  for (; r->epoch < o->epochs; r->epoch++, r->pos = 0) {
    epoch_order(r, r->epoch);
    dflash_status st = dflash_sample_stream_start(r->s, r->order + r->pos, r->n_usable - r->pos);
    if (st) return st;
    while (r->pos < r->n_usable) {
      size_t b = r->n_usable - r->pos < (size_t)o->batch_size ? r->n_usable - r->pos
                                                                : (size_t)o->batch_size;
      if ((st = train_step(r, b))) return st;
      r->pos += b;
      int64_t step = dflash_trainer_steps(r->t);
      bool stop = o->max_steps > 0 && step >= o->max_steps;
      if ((o->save_every > 0 && step % o->save_every == 0) || stop)
        if ((st = save(r, r->epoch, r->pos))) return st;
      if (stop) return DFLASH_OK;
    }
  }
  return save(r, r->epoch, 0);
}

dflash_status dflash_train_run(const dflash_train_run_options *o) {
  DF_CHECK_ARG(o && o->config_path && o->target_path && o->data_dir && o->hidden_dir &&
               o->out_dir && o->epochs > 0 && o->batch_size > 0);
  if (o->struct_size != sizeof *o)
    return df_error(DFLASH_E_INVALID_ARG, "train run options: struct_size %zu, expected %zu",
                    o->struct_size, sizeof *o);
  run r = {.o = o, .t0 = df_now_seconds()};
  dflash_status st = DFLASH_OK;
  if (dflash_storage_is_remote(o->out_dir)) {
    st = df_train_remote_begin(&r.remote, o->out_dir, o->resume != 0);
    r.local_o = *o;
    r.local_o.out_dir = r.remote.local;
    r.o = &r.local_o;
  }
  if (!st) st = open_all(&r);
  if (!st) st = train_loop(&r);
  if (r.progress) dflash_progress_free(r.progress);
  if (r.metrics) fclose(r.metrics);
  dflash_trainer_free(r.t);
  dflash_sample_stream_free(r.s);
  free(r.usable), free(r.order), free(r.anchors), free(r.n_anchors);
  free(r.state_path), free(r.metrics_path);
  df_train_remote_end(&r.remote);
  return st;
}
