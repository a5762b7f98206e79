/*
 * A whole training run over a tokenized dataset and a hidden-state store:
 * seeded epoch orders, fresh anchors per epoch, batches of sequences per
 * optimizer step, metrics JSONL, periodic checkpoints and an exact resume.
 * Everything random derives from (seed, epoch, sample index), so the data
 * position alone restores the generator.
 *
 * Data parallel (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT or Slurm's,
 * dist.h): a global batch is batch_size x world sequences of the epoch
 * order; rank r takes its contiguous share of it, every rank scales its
 * gradients by 1 / (the global batch's sum of weights), the backend sums
 * them over the ranks before the clip and AdamW, and rank 0 alone writes
 * the checkpoint, the state and metrics.jsonl (with global loss and
 * tokens). The data position is global, so a state resumes on any world.
 */
#include <dflash/hidden.h>
#include <dflash/storage.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/backend.h"
#include "train/cuda/dist.h"
#include "hidden/hidden.h"
#include "train/position.h"
#include "stream.h"
#include "train/rng.h"
#include "train/remote_files.h"
#include "train/trainer.h"
#include "run_internal.h"
#include "train/store_layers.h"

static void train_run_options_defaults(dflash_train_run_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->epochs = 6;
  o->batch_size = 0;      /* the backend picks (df_backend_auto_sequences) */
  o->save_every_s = 1800; /* a kill -9 loses at most half an hour */
  o->spool_wait_s = 600;  /* dflash_spool_options' wait_s */
}

DF_DEFINE_INIT(dflash_train_run_options, train_run_options_defaults)

/* Samples that can carry at least one anchor (>= 2B supervised tokens and
 * a candidate position). */
static dflash_status find_usable(run *r) {
  r->n_total = dflash_dataset_count(r->tok);
  r->usable = malloc((r->n_total ? r->n_total : 1) * sizeof *r->usable);
  if (!r->usable) return df_error_nomem("sample list");
  for (size_t i = 0; i < r->n_total; i++) {
    const char *id;
    const int32_t *ids;
    const uint8_t *mask;
    size_t n_ids;
    int32_t a, n;
    dflash_status st = dflash_dataset_sample(r->tok, i, &ids, &mask, &n_ids, &id);
    if (st) return st;
    int64_t len = (int64_t)n_ids;
    st = df_anchors_sample_cfg(&r->cfg, mask, len, 1, 0, 0, &a, &n);
    if (st) return st;
    if (n > 0) r->usable[r->n_usable++] = i;
    if (r->is_usable) r->is_usable[i] = n > 0;
  }
  if (r->n_usable == 0)
    return df_error(DFLASH_E_NOT_FOUND,
                    "%s: no sample has %d supervised tokens and room for a "
                    "block",
                    r->o->data_dir, 2 * r->cfg.block_size);
  return DFLASH_OK;
}

static void epoch_order(run *r, int32_t epoch) {
  memcpy(r->order, r->usable, r->n_usable * sizeof *r->order);
  df_rng rng;
  df_rng_seed(&rng, r->topt.seed ^ 0x6f7264657273ULL, (uint64_t)epoch);
  for (size_t i = r->n_usable; i > 1; i--) {
    size_t j = (size_t)df_rng_below(&rng, i);
    uint64_t tmp = r->order[i - 1];
    r->order[i - 1] = r->order[j];
    r->order[j] = tmp;
  }
}

/* This rank's share [*lo, *hi) of the global batch order[pos, pos+n):
 * contiguous and balanced, so a full batch gives every rank batch_size
 * sequences and a short last one may leave a rank none. */
void df_run_share(const run *r, size_t n, size_t *lo, size_t *hi) {
  *lo = n * (size_t)r->rank / (size_t)r->world;
  *hi = n * ((size_t)r->rank + 1) / (size_t)r->world;
}

static size_t batch_at(const run *r, uint64_t pos) {
  return r->n_usable - pos < r->global_batch ? r->n_usable - pos : r->global_batch;
}

/* Stream this rank's samples of the epoch from r->pos on. */
static dflash_status start_epoch(run *r) {
  epoch_order(r, r->epoch);
  size_t n = 0;
  for (uint64_t p = r->pos; p < r->n_usable; p += batch_at(r, p)) {
    size_t lo, hi;
    df_run_share(r, batch_at(r, p), &lo, &hi);
    for (size_t i = lo; i < hi; i++) r->mine[n++] = r->order[p + i];
  }
  return dflash_sample_stream_start(r->s, r->mine, n);
}

/* --labels target on vLLM's files: the stream turns their final layer into the target's greedy
 * tokens with its final norm and the LM head (r->head, kept). */
static dflash_status target_head(run *r) {
  float eps = 0;
  int32_t H = r->cfg.hidden_size;
  if (!(r->norm_w = malloc((size_t)H * sizeof *r->norm_w))) return df_error_nomem("final norm");
  dflash_status st = df_target_load_final_norm(r->o->target_path, r->o->final_norm_name, H,
                                               r->norm_w, &eps);
  if (st) return df_error_wrap(st, "--labels target on %s", r->o->hidden_dir);
  df_sample_stream_set_head(r->s, r->norm_w, eps, r->head, r->cfg.vocab_size);
  return DFLASH_OK;
}

/* --labels target needs the target's tokens in the store (refused here) or on each spool
 * sample (refused when it comes). */
static dflash_status check_labels(const run *r) {
  const dflash_train_run_options *o = r->o;
  if (o->labels != DFLASH_TRAIN_LABELS_DATA && o->labels != DFLASH_TRAIN_LABELS_TARGET)
    return df_error(DFLASH_E_INVALID_ARG,
                    "train run options: labels %d is neither data (0) "
                    "nor target (1)",
                    o->labels);
  if (o->labels == DFLASH_TRAIN_LABELS_TARGET && r->s && !df_sample_stream_has_target_ids(r->s))
    return df_error(DFLASH_E_NOT_FOUND,
                    "--labels target: the hidden-state store %s carries "
                    "neither the target's greedy tokens (written without target_ids) nor its "
                    "final layer (vLLM's hs_*.safetensors)",
                    o->hidden_dir);
  return DFLASH_OK;
}

/* The CE targets of one sequence for --labels target: labels[t] = tids[t-1], the target's
 * argmax at t-1 (its prediction of token t); NULL for data labels. */
static dflash_status make_labels(run *r, const dflash_sample *smp, const int32_t **out) {
  *out = NULL;
  if (r->o->labels != DFLASH_TRAIN_LABELS_TARGET) return DFLASH_OK;
  if (!smp->target_ids)
    return df_error(DFLASH_E_NOT_FOUND,
                    "--labels target: sample %s in %s carries no target "
                    "ids (written without target_ids)",
                    smp->id, r->o->hidden_dir);
  if ((size_t)smp->len > r->labels_cap) {
    free(r->labels);
    r->labels_cap = 0;
    if (!(r->labels = malloc((size_t)smp->len * sizeof *r->labels)))
      return df_error_nomem("labels");
    r->labels_cap = (size_t)smp->len;
  }
  r->labels[0] = smp->input_ids[0]; /* never a CE target: blocks start at an anchor */
  memcpy(r->labels + 1, smp->target_ids, (size_t)(smp->len - 1) * sizeof *r->labels);
  *out = r->labels;
  return DFLASH_OK;
}

static dflash_status load_target(run *r, dflash_trainer_options *topt) {
  size_t vh = (size_t)r->cfg.vocab_size * (size_t)r->cfg.hidden_size;
  float *e = malloc(vh * sizeof *e), *h = malloc(vh * sizeof *h);
  dflash_status st = e && h ? DFLASH_OK : df_error_nomem("target embedding and LM head");
  if (!st)
    st = dflash_target_load_head(r->o->target_path, r->o->embed_name, r->o->lm_head_name,
                                 r->cfg.vocab_size, r->cfg.hidden_size, e, h);
  if (!st) st = df_trainer_create(&r->cfg, e, h, topt, r->comm, &r->t);
  /* A pruned draft vocabulary is the run's dataset's most frequent supervised ids
   * (spec/dspark.md section 4), picked once here and logged with its coverage; a resume then
   * finds the same ids in the checkpoint's d2t. A spool run has no dataset to count. */
  if (!st && r->cfg.draft_vocab_size)
    st = df_trainer_draft_vocab_from_data(r->t, r->o->data_dir, NULL);
  /* A store or spool written with final_state gives every sample the target's post-norm final
   * state (the stream or the spool sets dflash_sample.target_final): 0.1 CE + 0.9 L1 + 1.0
   * BCE. Without it say what the objective loses. DFlash never reads it, so its stream or
   * spool does not decode it. */
  bool has = r->s ? df_sample_stream_has_final(r->s) : r->spool && r->sp_info.final_state;
  bool final = r->cfg.dspark && has;
  if (r->s) df_sample_stream_set_final(r->s, final);
  if (r->spool) df_spool_set_final(r->spool, final);
  r->sp_final = r->spool && final;
  if (!st && r->cfg.dspark && !final)
    df_log(DFLASH_LOG_WARN,
           "train: DSpark drafter: %s holds no target final state (write it with "
           "HiddenWriter(..., final_state=True)), so it trains on 0.1 CE alone, without the L1 "
           "term and the confidence target that need it (spec/dspark.md section 2)",
           r->o->hidden_dir);
  free(e);
  if (!st && r->s && df_sample_stream_has_target_ids(r->s) == DFLASH_HIDDEN_TARGET_IDS_VLLM &&
      r->o->labels == DFLASH_TRAIN_LABELS_TARGET)
    return r->head = h, target_head(r);
  free(h);
  return st;
}

/* Wait for every rank (rank 0's failures reach the others here). */
dflash_status df_run_barrier(run *r) {
  return r->comm ? df_comm_broadcast(r->comm, NULL, 0) : DFLASH_OK;
}


/* Rank 0: out_dir, its train_state/ and metrics.jsonl. */
static dflash_status open_outputs(run *r) {
  const dflash_train_run_options *o = r->o;
  if (r->rank != 0) return DFLASH_OK;
  /* In a subdirectory: engines load every *.safetensors at the top level. */
  char *state_dir = df_path_join(o->out_dir, "train_state");
  if (!state_dir) return df_error_nomem("paths");
  dflash_status st = df_mkdir_p(state_dir); /* creates out_dir too */
  free(state_dir);
  if (st) return st;
  r->metrics = fopen(r->metrics_path, r->resumed ? "a" : "w");
  if (!r->metrics) return df_error(DFLASH_E_IO, "cannot open %s", r->metrics_path);
  /* The last step of the progress stats: --max-steps when it comes first. */
  int64_t last = o->max_steps > 0 && o->max_steps < r->total_steps ? o->max_steps : r->total_steps;
  r->stats.last_step = last;
  r->stats.spool = r->spool != NULL;
  return DFLASH_OK;
}

/* --resume of a one-process local run that was stopped before its first state save: its
 * train_state/ exists (made at the start) but holds no state, and nothing of it is lost (a
 * spool releases shards only after a save), so it starts again from the first step. A folder
 * without train_state/ (a mistyped -o) still fails to resume. */
static bool never_saved(run *r) {
  struct stat sb;
  if (r->world > 1 || r->remote.url || stat(r->state_path, &sb) == 0) return false;
  char *dir = df_path_join(r->o->out_dir, "train_state");
  bool started = dir && stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode);
  free(dir);
  if (started)
    df_log(DFLASH_LOG_INFO,
           "train: %s holds no state yet (stopped before its first save): "
           "starting from the first step",
           r->o->out_dir);
  return started;
}

static dflash_status open_all(run *r) {
  const dflash_train_run_options *o = r->o;
  dflash_drafter_config_default(&r->cfg);
  dflash_status st = dflash_drafter_config_load(o->config_path, &r->cfg);
  if (!st) { /* refuse now what the checkpoint save at the end would refuse */
    size_t json_len = 0;
    st = dflash_drafter_config_to_json(&r->cfg, NULL, 0, &json_len);
    if (st == DFLASH_E_BUFFER) {
      dflash_clear_error();
      st = DFLASH_OK;
    } else if (st) {
      st = df_error_wrap(st, "%s", o->config_path);
    }
  }
  if (!st) st = df_run_open_data(r);
  if (st) return st;
  int64_t width = (int64_t)r->cfg.n_target_layer_ids * r->cfg.hidden_size;
  int64_t have = r->spool ? df_run_spool_width(r) : dflash_sample_stream_width(r->s);
  if (have != width)
    return df_error(DFLASH_E_MISMATCH,
                    "%s holds %" PRId64 " features per token; the drafter "
                    "config needs K*H = %d*%d = %" PRId64,
                    o->hidden_dir, have, r->cfg.n_target_layer_ids, r->cfg.hidden_size, width);
  if (!r->spool && (st = df_check_store_layers(&r->cfg, r->s, o->hidden_dir))) return st;
  if (!r->spool && (st = dflash_sample_stream_check(r->s, NULL))) return st;
  if ((st = check_labels(r))) return st;
  if ((st = find_usable(r))) return st;
  r->global_batch = (size_t)o->batch_size * (size_t)r->world;
  if (r->spool && (st = df_run_spool_buffers(r))) return st;
  /* Several ranks: on S3 each reads only its share's samples (and every shard's header). */
  if (r->spool && r->world > 1)
    df_spool_share(r->spool, df_run_spool_usable, r, r->global_batch,
                   (uint64_t)o->batch_size * (uint64_t)r->rank,
                   (uint64_t)o->batch_size * ((uint64_t)r->rank + 1));
  int32_t A = r->topt.num_anchors;
  r->order = malloc(r->n_usable * sizeof *r->order);
  r->mine = malloc(r->n_usable * sizeof *r->mine);
  r->anchors = malloc((size_t)o->batch_size * (size_t)A * sizeof *r->anchors);
  r->n_anchors = malloc((size_t)o->batch_size * sizeof *r->n_anchors);
  if (!r->order || !r->mine || !r->anchors || !r->n_anchors) return df_error_nomem("run buffers");
  r->cfg_dflash2 = r->cfg.dflash2 != 0;
  int64_t per_epoch = (int64_t)((r->n_usable + r->global_batch - 1) / r->global_batch);
  r->total_steps = per_epoch * o->epochs;
  r->sched_steps = df_run_schedule_steps(r);
  dflash_trainer_options topt = r->topt;
  topt.total_steps = r->sched_steps;
  if ((st = load_target(r, &topt))) return st;
  /* An s3:// run on rank 0 writes into its local mirror; the other ranks
   * read the state from the bucket itself. */
  const char *state_base = r->rank == 0 || !r->remote.url ? o->out_dir : r->remote.url;
  r->state_path = df_asprintf("%s/train_state/state.safetensors", state_base);
  r->metrics_path = df_path_join(o->out_dir, "metrics.jsonl");
  if (!r->state_path || !r->metrics_path) return df_error_nomem("paths");
  r->resumed = o->resume && !never_saved(r);
  if (r->resumed && (st = df_run_resume(r))) return st;
  if ((st = df_run_check_schedule(r))) return st;
  if ((st = open_outputs(r))) return st;
  if (r->rank == 0 && getenv("DFLASH_TRAIN_TRACE") && *getenv("DFLASH_TRAIN_TRACE") &&
      !(r->trace = fopen(getenv("DFLASH_TRAIN_TRACE"), "a")))
    return df_error(DFLASH_E_IO, "cannot open DFLASH_TRAIN_TRACE=%s", getenv("DFLASH_TRAIN_TRACE"));
  if (r->trace) fputs("# run\n", r->trace); /* a resumed run's lines redo the killed one's */
  return df_run_check_ranks_agree(r);
}

/* The metrics line (and progress stats) of the step in r->line, with its norm. */
static void write_metrics(run *r, double norm) {
  const double tok = r->line.tokens, dt = r->line.dt;
  fprintf(r->metrics,
          "{\"step\": %" PRId64 ", \"epoch\": %d, \"loss\": %.9g, \"grad_norm\": "
          "%.9g, \"lr\": %.9g, \"tokens\": %" PRId64 ", \"tokens_per_s\": %.1f, \"elapsed_s\": "
          "%.3f",
          r->line.step, r->line.epoch, r->line.loss, norm, r->line.lr, r->line.total,
          dt > 0 ? tok / dt : 0.0, r->line.elapsed);
  /* A spool run: the seconds spent so far waiting for the producer's shards. */
  if (r->spool) fprintf(r->metrics, ", \"spool_wait_s\": %.3f", r->line.spool_wait);
  /* DFlash 2: loss is the block CE plus the weighted selector loss; each apart, since they
   * move apart (the block CE can fall, and tau rise, while the selector's grows). */
  if (r->cfg_dflash2)
    fprintf(r->metrics, ", \"block_loss\": %.9g, \"selector_loss\": %.9g",
            r->line.loss - r->line.sel_loss, r->line.sel_loss);
  fputs("}\n", r->metrics);
  fflush(r->metrics);
  dflash_train_stats *s = &r->stats;
  s->step = r->line.step, s->epoch = r->line.epoch, s->loss = r->line.loss;
  s->grad_norm = norm, s->lr = r->line.lr, s->tokens = r->line.total;
  s->tokens_per_s = dt > 0 ? tok / dt : 0.0, s->elapsed_s = r->line.elapsed;
  s->spool_wait_s = r->line.spool_wait, s->selector_loss = r->cfg_dflash2 ? r->line.sel_loss : 0;
  if (r->o->progress && r->o->progress(s, r->o->progress_user)) r->stop_asked = true;
}

/* The outstanding step's norm (every rank: a non-finite one fails the run here) and its
 * metrics line (rank 0). */
dflash_status df_run_finish_step(run *r) {
  if (!r->step_open) return DFLASH_OK;
  r->step_open = false;
  double norm = 0;
  dflash_status st = dflash_trainer_step_result(r->t, &norm);
  if (!st && r->rank == 0) write_metrics(r, norm);
  return st;
}

/* One optimizer step over the global batch order[pos, pos+gb): this rank's
 * share, gradients scaled by the global weight, summed over the ranks. */
dflash_status df_run_train_step(run *r, size_t gb) {
  int32_t A = r->topt.num_anchors;
  size_t lo = 0, hi = r->n_mine; /* the spool's: gathered by spool_batch */
  if (!r->spool) df_run_share(r, gb, &lo, &hi);
  size_t b = hi - lo;
  double sums[3] = {0, 0, 0}; /* weight, tokens, then sum(w*CE) */
  for (size_t i = 0; i < b; i++) {
    uint64_t idx = r->spool ? r->batch_idx[i] : r->order[r->pos + lo + i];
    const char *id;
    const int32_t *ids;
    const uint8_t *mask;
    size_t n_ids;
    double w;
    dflash_status st = dflash_dataset_sample(r->tok, (size_t)idx, &ids, &mask, &n_ids, &id);
    if (st) return st;
    int64_t len = (int64_t)n_ids;
    st = df_anchors_sample_cfg(&r->cfg, mask, len, A, r->topt.seed,
                               (uint64_t)r->epoch * r->n_total + idx, r->anchors + i * (size_t)A,
                               &r->n_anchors[i]);
    dflash_sample q = {.struct_size = sizeof q,
                       .id = id,
                       .len = len,
                       .loss_mask = mask,
                       .anchors = r->anchors + i * (size_t)A,
                       .n_anchors = r->n_anchors[i]};
    if (!st) st = dflash_trainer_weight_sum(r->t, &q, &w);
    if (st) return st;
    sums[0] += w;
    sums[1] += (double)len;
  }
  dflash_status st = r->comm ? df_comm_sum_f64(r->comm, sums, 2) : DFLASH_OK;
  if (st) return st;
  double W = sums[0];
  int64_t tokens = (int64_t)sums[1];
  if ((st = dflash_trainer_zero_grad(r->t))) return st;
  double t_start = df_now_seconds(), lsum = 0;
  /* Offline store and spool alike: accumulate does not wait for the device, whose
   * losses (and NaN/Inf checks) are collected once, after the batch. The step before's norm
   * is asked for once the first sequence is on its way (it uploads behind the optimizer). */
  for (size_t i = 0; i < b; i++) {
    dflash_sample smp = {.struct_size = sizeof smp};
    int32_t done;
    st = r->spool ? df_run_spool_sample(r, i, &smp, &done)
                  : dflash_sample_stream_next(r->s, &smp, &done);
    if (!st && done) st = df_error(DFLASH_E_INTERNAL, "sample stream ended early");
    const int32_t *labels = NULL;
    if (!st) st = make_labels(r, &smp, &labels);
    r->bad_sample = st != DFLASH_OK;
    smp.anchors = r->anchors + i * (size_t)A;
    smp.n_anchors = r->n_anchors[i];
    if (!st) st = df_trainer_accumulate_labels(r->t, &smp, labels, 1.0 / W);
    if (st) return df_error_wrap(st, "sample %s", smp.id ? smp.id : "?");
    if (i == 0 && (st = df_run_finish_step(r))) return st;
  }
  if ((st = df_run_finish_step(r))) return st; /* no sequence on this rank */
  if ((st = dflash_trainer_collect(r->t, &lsum, NULL))) return st;
  double losses[2] = {lsum, r->t->pend_sel}; /* the whole loss, DFlash 2's selector part */
  r->t->pend_sel = 0;
  /* Also the point where every rank is known alive before the backend's
   * own (NCCL) collectives, which could not time out as cleanly. */
  if (r->comm && (st = df_comm_sum_f64(r->comm, losses, 2))) return st;
  lsum = losses[0];
  double norm = 0, lr;
  st = r->sync_step ? dflash_trainer_step(r->t, &norm, &lr) : dflash_trainer_step_async(r->t, &lr);
  if (st) return st;
  r->step_open = !r->sync_step;
  r->tokens += tokens;
  double now = df_now_seconds();
  int64_t step = dflash_trainer_step_count(r->t);
  r->line.step = step, r->line.epoch = r->epoch, r->line.loss = lsum / W, r->line.lr = lr;
  r->line.sel_loss = losses[1] / W;
  r->line.dt = now - t_start, r->line.elapsed = r->elapsed + now - r->t0;
  r->line.spool_wait = r->spool_wait, r->line.tokens = (double)tokens, r->line.total = r->tokens;
  if (r->rank != 0) return DFLASH_OK;
  for (size_t i = 0; r->trace && i < b; i++) {
    const char *id;
    const int32_t *ids;
    const uint8_t *mask;
    size_t n_ids;
    if ((st = dflash_dataset_sample(
             r->tok, (size_t)(r->spool ? r->batch_idx[i] : r->order[r->pos + lo + i]), &ids, &mask,
             &n_ids, &id)))
      return st;
    fprintf(r->trace, "%d %" PRId64 " %s\n", r->epoch, step, id);
  }
  if (r->sync_step) write_metrics(r, norm);
  return DFLASH_OK;
}

dflash_status df_run_next_action(run *r, bool last_step, int32_t *act) {
  const dflash_train_run_options *o = r->o;
  *act = ACT_NONE;
  if (r->rank == 0 && !last_step) {
    if (r->stop_asked) *act = ACT_STOP;
    else if (o->save_every_s > 0 && df_now_seconds() - r->last_save >= o->save_every_s)
      *act = ACT_SAVE;
  }
  return r->comm ? df_comm_broadcast(r->comm, act, sizeof *act) : DFLASH_OK;
}

dflash_status df_run_stopped(const run *r) {
  return df_error(DFLASH_E_CANCELLED,
                  "training stopped on request after step %" PRId64
                  ": checkpoint and state saved in %s; --resume continues",
                  dflash_trainer_step_count(r->t), r->o->out_dir);
}

/* A step that failed on a sample's data (one process): the state as of the step before is
 * saved, so that nothing is lost, and the error says so. */
static dflash_status failed_on_sample(run *r, dflash_status st) {
  if (!r->bad_sample || r->comm) return st;
  char *why = df_strdup(dflash_last_error());
  dflash_status saved = df_run_save(r, r->epoch, r->pos);
  st = df_error(st, "%s; the run stopped at step %" PRId64 " with %s", why ? why : "",
                dflash_trainer_step_count(r->t),
                saved ? "its state NOT saved"
                      : "its state saved in train_state/ (--resume continues once the "
                        "sample is fixed)");
  free(why);
  return st;
}

static dflash_status train_loop(run *r) {
  const dflash_train_run_options *o = r->o;
  /* Resumed exactly at max_steps: the run is done (the loop below would take one more). */
  if (o->max_steps > 0 && dflash_trainer_step_count(r->t) >= o->max_steps) return DFLASH_OK;
  for (; r->epoch < o->epochs; r->epoch++, r->pos = 0) {
    dflash_status st = start_epoch(r);
    if (st) return st;
    while (r->pos < r->n_usable) {
      size_t gb = batch_at(r, r->pos);
      if ((st = df_run_train_step(r, gb))) return failed_on_sample(r, st);
      r->pos += gb;
      int64_t step = dflash_trainer_step_count(r->t);
      bool stop = o->max_steps > 0 && step >= o->max_steps;
      bool last = stop || (r->epoch + 1 >= o->epochs && r->pos >= r->n_usable);
      int32_t act;
      if ((st = df_run_next_action(r, last, &act))) return st;
      if ((o->save_every > 0 && step % o->save_every == 0) || stop || act != ACT_NONE)
        if ((st = df_run_save(r, r->epoch, r->pos))) return st;
      if (stop) return DFLASH_OK;
      if (act == ACT_STOP) return df_run_stopped(r);
    }
  }
  return df_run_save(r, r->epoch, 0);
}

/* This process's rank, and the connections to the others when there are. */
static dflash_status join_run(run *r) {
  df_dist_env env;
  double timeout = r->topt.dist_timeout_s; /* checked here: the trainer comes later */
  dflash_status st = df_dist_env_from_environ(&env);
  if (!st && !(timeout > 0 && timeout <= 1e9))
    st = df_error(DFLASH_E_INVALID_ARG,
                  "trainer options: dist_timeout_s must be in (0, 1e9] "
                  "seconds (got %g)",
                  timeout);
  if (st) return df_error_wrap(st, "training run");
  r->rank = env.rank;
  r->world = env.world;
  if (env.world > 1 && (st = df_comm_open(&env, timeout, &r->comm)))
    return df_error_wrap(st, "training run, rank %d of %d", env.rank, env.world);
  return DFLASH_OK;
}

/* batch_size 0: the backend picks the sequences per rank and step (backend.h) for this
 * world and device; rank 0 says which in the library's log (INFO). Every rank picks for itself,
 * and check_ranks_agree refuses ranks that picked differently. On CUDA rank 0 also says
 * how its GPU reaches the others (P2P, NCCL and its settings), so that a mis-tuned PCIe box
 * shows before the first step; a device that cannot be read fails at the trainer instead. */
static dflash_status start_notes(run *r, dflash_train_run_options *o) {
  char note[1536];
  bool say = r->rank == 0;
  if (o->batch_size == 0) {
    dflash_status st = df_backend_auto_sequences(r->topt.backend, r->world, &o->batch_size, note,
                                                 sizeof note);
    if (st) return st;
    if (say) df_log(DFLASH_LOG_INFO, "train: %s", note);
  }
  if (!say || r->topt.backend != DFLASH_BACKEND_CUDA) return DFLASH_OK;
  if (df_backend_cuda_link_note(r->world, note, sizeof note)) dflash_clear_error();
  else df_log(DFLASH_LOG_INFO, "train: %s", note);
  return DFLASH_OK;
}

dflash_status dflash_train_run(const dflash_train_run_options *opts, dflash_train_stats *stats) {
  DF_CHECK_ARG(opts);
  /* The caller's structs at this library's size (the one rule, core/internal.h). */
  dflash_train_run_options oo;
  dflash_train_run_options_default(&oo);
  dflash_status st = df_opts_in(&oo, opts, sizeof oo, "dflash_train_run_options");
  const dflash_train_stats none = {.struct_size = sizeof none};
  /* Until the end overwrites it: an options error below returns with a failed run's stats. */
  dflash_train_stats failed = {.struct_size = sizeof failed,
                               .stop_reason = DFLASH_TRAIN_STOP_ERROR};
  if (!st && stats) st = df_opts_out(stats, &failed, sizeof failed, "dflash_train_stats");
  if (st) return st;
  const dflash_train_run_options *o = &oo;
  DF_CHECK_ARG(o->config_path && o->target_path && o->data_dir && o->hidden_dir && o->out_dir &&
               o->epochs > 0 && o->batch_size >= 0);
  if (o->schedule_steps < DFLASH_SCHEDULE_EPOCHS || o->max_steps < 0)
    return df_error(DFLASH_E_INVALID_ARG,
                    "train run options: schedule_steps %" PRId64 " / max_steps %" PRId64
                    " (schedule_steps: > 0, 0 or DFLASH_SCHEDULE_EPOCHS; max_steps >= 0)",
                    o->schedule_steps, o->max_steps);
  run r = {.o = o, .t0 = df_now_seconds(), .stats = none};
  r.last_save = r.t0;
  const char *sync = getenv("DFLASH_TRAIN_SYNC_STEP");
  r.sync_step = sync && !strcmp(sync, "1");
  dflash_trainer_options_default(&r.topt);
  st = df_opts_in(&r.topt, o->trainer, sizeof r.topt, "dflash_train_run_options.trainer");
  if (st) return st;
  st = join_run(&r);
  if (!st) st = start_notes(&r, &oo);
  if (!st && dflash_storage_is_remote(o->out_dir)) {
    /* Rank 0 mirrors the bucket; the barrier keeps the others from reading
     * the state before that mirror is rebuilt (it may share their cache). */
    if (r.rank == 0) st = df_train_remote_begin(&r.remote, o->out_dir, o->resume != 0);
    else r.remote.url = (char *)o->out_dir;
    if (!st) st = df_run_barrier(&r);
    r.local_o = *o;
    r.local_o.out_dir = r.rank == 0 ? r.remote.local : o->out_dir;
    r.o = &r.local_o;
  }
  if (!st) st = open_all(&r);
  if (!st) st = r.spool ? df_run_spool_loop(&r) : train_loop(&r);
  if (st) df_comm_abort(r.comm, st); /* the other ranks stop too, naming this one */
  r.stats.step = r.t ? dflash_trainer_step_count(r.t) : 0;
  if (!st)
    r.stats.stop_reason = o->max_steps > 0 && r.stats.step >= o->max_steps
                              ? DFLASH_TRAIN_STOP_MAX_STEPS
                              : DFLASH_TRAIN_STOP_FINISHED;
  else
    r.stats.stop_reason = st == DFLASH_E_CANCELLED && r.stop_asked ? DFLASH_TRAIN_STOP_REQUESTED
                                                                   : DFLASH_TRAIN_STOP_ERROR;
  if (stats) DF_IGNORE(df_opts_out(stats, &r.stats, sizeof r.stats, "dflash_train_stats"));
  if (r.metrics) fclose(r.metrics);
  dflash_trainer_free(r.t);
  df_comm_free(r.comm);
  dflash_sample_stream_free(r.s);
  if (r.trace) fclose(r.trace);
  dflash_spool_free(r.spool);
  dflash_dataset_free(r.own_tok);
  for (size_t i = 0; r.batch_h && i < (size_t)o->batch_size; i++) free(r.batch_h[i]);
  for (size_t i = 0; r.batch_t && i < (size_t)o->batch_size; i++) free(r.batch_t[i]);
  for (size_t i = 0; r.batch_f && i < (size_t)o->batch_size; i++) free(r.batch_f[i]);
  free(r.batch_f), free(r.batch_fcap);
  free(r.batch_t), free(r.batch_pos), free(r.batch_tcap), free(r.labels), free(r.head),
      free(r.norm_w);
  free(r.batch_h), free(r.batch_cap), free(r.batch_idx), free(r.by_id), free(r.is_usable);
  free(r.usable), free(r.order), free(r.mine), free(r.anchors), free(r.n_anchors);
  free(r.state_path), free(r.metrics_path);
  if (r.rank == 0) df_train_remote_end(&r.remote);
  return st;
}
