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
#include <dflash/progress.h>
#include <dflash/storage.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "backend.h"
#include "dist.h"
#include "hidden/hidden.h"
#include "position.h"
#include "stream.h"
#include "rng.h"
#include "remote.h"
#include "trainer.h"

static void train_run_options_defaults(dflash_train_run_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->epochs = 6;
  o->batch_size = 1;
  o->save_every_s = 1800; /* a kill -9 loses at most half an hour */
}

DF_DEFINE_INIT(dflash_train_run_options, train_run_options_defaults)

typedef struct run {
  const dflash_train_run_options *o;
  dflash_trainer_options topt;      /* o->trainer, or the defaults, at this library's size */
  dflash_train_run_options local_o; /* an s3:// out_dir: o with its local mirror */
  df_train_remote remote;
  df_comm *comm; /* NULL: one process */
  int rank, world;
  dflash_drafter_config cfg;
  dflash_trainer *t;
  dflash_sample_stream *s;
  const df_tokens *tok;
  uint64_t *usable, *order, *mine; /* mine: this rank's share of order, from pos on */
  size_t n_usable, n_total, global_batch;
  int32_t *anchors; /* batch_size * num_anchors */
  int32_t *n_anchors;
  char *state_path, *metrics_path;
  FILE *metrics;
  dflash_progress *progress;
  int64_t total_steps, tokens;
  double elapsed, t0;
  /* position (global: the next sample of the epoch order to visit) */
  int32_t epoch;
  uint64_t pos;
  /* --hidden spool:PATH: samples in the producer's order. Every rank reads the same order and
   * forms the same global batches; it keeps its share of each and passes over the rest. */
  dflash_spool *spool;
  df_tokens *own_tok;  /* the dataset, opened without a store */
  uint64_t *by_id;     /* dataset indices sorted by id */
  uint8_t *is_usable;  /* [n_total] */
  uint64_t *batch_idx; /* the gathered batch: dataset indices and hidden states */
  bool stored_rows;    /* samples carry their hidden rows as stored (see open_data) */
  int32_t sp_dtype;    /* the spool's dtype */
  char **batch_h;      /* float32 rows, or the codes then (fp8) the scales */
  size_t *batch_cap;
  uint64_t sp_shard, sp_off; /* resume: the spool position within r->epoch */
  int32_t rel_epoch;         /* shards before (rel_epoch, rel_shard) are released */
  uint64_t rel_shard;
  int32_t bnd_epoch; /* the spool position after the last step (or at the start) */
  uint64_t bnd_shard, bnd_off, bnd_pos;
  df_spool_pos *batch_pos; /* [global_batch]: where the batch's samples are in the spool */
  size_t n_mine;           /* this rank's samples of the gathered batch (slots 0..n_mine-1) */
  FILE *trace;             /* DFLASH_TRAIN_TRACE: "epoch step id" per trained sample */
  int32_t **batch_t;       /* the gathered batch's target ids (NULL: none) */
  size_t *batch_tcap;
  int32_t *labels; /* --labels target: one sequence's CE targets */
  size_t labels_cap;
  float *head, *norm_w; /* vLLM's final layer -> target ids: LM head, final norm */
  double spool_wait;    /* seconds spent waiting for the spool's next shard */
  /* A step's metrics line. Steps are made with dflash_trainer_step_async, so that the next
   * step's first sequence uploads while the device runs the optimizer; the line waits for
   * the norm (finish_step: after that sequence is enqueued, or before a save).
   * DFLASH_TRAIN_SYNC_STEP=1 waits at every step instead (the same results, to the bit). */
  bool sync_step, step_open;
  bool cfg_dflash2; /* a DFlash 2 drafter: its loss is reported by component */
  double last_save; /* when the state was last saved (or the run started) */
  bool bad_sample;  /* the failing step failed on its data (a sample), not the trainer */
  struct {
    int64_t step, total;
    int32_t epoch;
    double loss, lr, dt, elapsed, spool_wait, tokens;
    double sel_loss; /* DFlash 2: the selector's part of loss */
  } line;
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
static void share(const run *r, size_t n, size_t *lo, size_t *hi) {
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
    share(r, batch_at(r, p), &lo, &hi);
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
  if (o->labels != DFLASH_LABELS_DATA && o->labels != DFLASH_LABELS_TARGET)
    return df_error(DFLASH_E_INVALID_ARG,
                    "train run options: labels %d is neither data (0) "
                    "nor target (1)",
                    o->labels);
  if (o->labels == DFLASH_LABELS_TARGET && r->s && !df_sample_stream_has_target_ids(r->s))
    return df_error(DFLASH_E_NOT_FOUND,
                    "--labels target: the hidden-state store %s carries "
                    "neither the target's greedy tokens (written without target_ids) nor its "
                    "final layer (vLLM's hs_*.safetensors)",
                    o->hidden_dir);
  return DFLASH_OK;
}

/* The CE targets of one sequence for --labels target: labels[t] = tids[t-1], the target's
 * argmax at t-1 (its prediction of token t); NULL for data labels. */
static dflash_status make_labels(run *r, const dflash_train_sample *smp, const int32_t **out) {
  *out = NULL;
  if (r->o->labels != DFLASH_LABELS_TARGET) return DFLASH_OK;
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
  free(e);
  if (!st && r->s && df_sample_stream_has_target_ids(r->s) == DFLASH_HIDDEN_TARGET_IDS_VLLM &&
      r->o->labels == DFLASH_LABELS_TARGET)
    return r->head = h, target_head(r);
  free(h);
  return st;
}

/* Wait for every rank (rank 0's failures reach the others here). */
static dflash_status barrier(run *r) {
  return r->comm ? df_comm_broadcast(r->comm, NULL, 0) : DFLASH_OK;
}

/* ---- the run's settings, recorded with the state ------------------------------------------ */

/* What shapes the training and must not change silently on --resume (the world size, threads
 * and backend may: the data position and the global batch are global, the maths the same). */
typedef struct setting {
  const char *name;
  double value;
} setting;

enum { N_SETTINGS = 17 };

static void settings_of(const run *r, setting *s) {
  const dflash_trainer_options *t = &r->topt;
  const dflash_train_run_options *o = r->o;
  const setting all[N_SETTINGS] = {
      {"lr", t->lr},
      {"global_batch", (double)o->batch_size * r->world}, /* any world with the same one */
      {"anchors", t->num_anchors},
      {"warmup_ratio", t->warmup_ratio},
      {"epochs", o->epochs},
      {"weight_decay", t->weight_decay},
      {"clip", t->grad_clip},
      {"labels", o->labels},
      {"beta1", t->beta1},
      {"beta2", t->beta2},
      {"adam_eps", t->adam_eps},
      {"min_lr_ratio", t->min_lr_ratio},
      {"loss_gamma", t->loss_gamma},
      {"selector_loss_weight", t->selector_loss_weight},
      {"selector_loss_mode", t->selector_loss_mode},
      {"lr_schedule", t->lr_schedule},
      {"position_weighting", t->position_weighting},
  };
  memcpy(s, all, sizeof all);
}

/* The learning rate after a resume: the saved continuation, if any, and when the settings
 * changed the rate the next step would take, a new continuation from the rate the saved
 * schedule had reached (no jump). Unchanged settings give the same rate: nothing moves. */
static void continue_schedule(const run *r, const df_position *p) {
  if (!p->has_schedule) return; /* a state from before the rate was recorded */
  int64_t step = dflash_trainer_steps(r->t);
  if (dflash_trainer_lr_at(r->t, step) == p->next_lr) return;
  r->t->sched_from = step > 0 ? step : 1;
  r->t->sched_lr0 = p->next_lr;
}

/* The state's settings against this run's: DFLASH_E_MISMATCH naming every change, unless
 * allow_settings_change. A state written before settings were recorded has none to compare;
 * one that records a setting this library does not know is refused. */
static dflash_status check_settings(const run *r, const df_position *p) {
  setting s[N_SETTINGS];
  settings_of(r, s);
  for (size_t k = 0; k < p->n_settings; k++) {
    int i = 0;
    while (i < N_SETTINGS && strcmp(s[i].name, p->settings[k].name)) i++;
    if (i == N_SETTINGS)
      return df_error(DFLASH_E_UNSUPPORTED,
                      "%s records the setting \"%s\", which this libdflash does not know "
                      "(written by a newer one?)",
                      r->state_path, p->settings[k].name);
  }
  char changes[1024] = "";
  size_t n = 0;
  for (int i = 0; i < N_SETTINGS; i++) {
    const df_position_setting *was = df_position_setting_find(p, s[i].name);
    if (!was || was->value == s[i].value) continue;
    int k = snprintf(changes + n, sizeof changes - n, "%s%s %.9g -> %.9g", n ? ", " : "", s[i].name,
                     was->value, s[i].value);
    if (k > 0 && (size_t)k < sizeof changes - n) n += (size_t)k;
  }
  if (!n) return DFLASH_OK;
  if (r->o->allow_settings_change) return continue_schedule(r, p), DFLASH_OK;
  return df_error(DFLASH_E_MISMATCH,
                  "%s was written with other settings: %s (resume with the run's own, or "
                  "allow the change: --allow-settings-change)",
                  r->state_path, changes);
}

/* Where the run stands after the last step, for the state (position.h). */
static void position_of(const run *r, int32_t epoch, uint64_t pos, df_position *p) {
  memset(p, 0, sizeof *p);
  p->epoch = epoch;
  p->pos = pos;
  p->tokens = r->tokens;
  p->metrics_bytes = r->metrics ? ftell(r->metrics) : 0;
  p->seed = r->topt.seed;
  p->samples = r->n_usable;
  p->elapsed_s = r->elapsed + df_now_seconds() - r->t0;
  p->spool = r->spool != NULL;
  p->spool_shard = r->bnd_shard; /* the spool: the last step's position (the producer's order) */
  p->spool_offset = r->bnd_off;
  p->spool_wait_s = r->spool_wait;
  p->has_schedule = true;
  p->next_lr = dflash_trainer_lr_at(r->t, dflash_trainer_steps(r->t));
  p->sched_from = r->t->sched_from;
  p->sched_lr0 = r->t->sched_lr0;
  setting s[N_SETTINGS];
  settings_of(r, s);
  for (int i = 0; i < N_SETTINGS; i++) {
    snprintf(p->settings[i].name, sizeof p->settings[i].name, "%s", s[i].name);
    p->settings[i].value = s[i].value;
  }
  p->n_settings = N_SETTINGS;
}

/* Save the checkpoint and the state; (epoch, pos) is the next sample to
 * visit. Every rank gathers the state (collective on a sharded device
 * backend), rank 0 writes it, and the barrier makes its outcome everyone's. */
static dflash_status finish_step(run *r);

static dflash_status save_as(run *r, int32_t epoch, uint64_t pos, bool model) {
  if (!r->spool && pos >= r->n_usable) epoch++, pos = 0;
  dflash_status st = finish_step(r); /* the last step's metrics line before the state */
  if (!st) st = df_trainer_pull(r->t, DF_BUF_PARAMS | DF_BUF_M1 | DF_BUF_M2);
  if (!st && r->rank == 0) {
    df_position p;
    position_of(r, epoch, pos, &p);
    char *blob = NULL;
    if (r->trace) fflush(r->trace);
    st = df_position_to_json(&p, &blob);
    if (!st && model) st = dflash_trainer_save(r->t, r->o->out_dir, r->o->bf16);
    if (!st) st = dflash_trainer_save_state(r->t, r->state_path, blob, strlen(blob) + 1);
    if (!st && r->remote.url) st = df_train_remote_publish(&r->remote, r->metrics);
    free(blob);
  }
  r->last_save = df_now_seconds();
  return st ? st : barrier(r);
}

static dflash_status save(run *r, int32_t epoch, uint64_t pos) {
  return save_as(r, epoch, pos, true);
}

/* Every rank reads the same state (a shared directory or the bucket);
 * rank 0 alone trims metrics.jsonl. */
static dflash_status resume(run *r) {
  char blob[4096];
  size_t len = 0;
  dflash_status st = dflash_trainer_load_state(r->t, r->state_path, blob, sizeof blob, &len);
  if (st && r->world > 1) return df_error_wrap(st, "resuming (rank %d)", r->rank);
  if (st) return df_error_wrap(st, "resuming");
  df_position p;
  if ((st = df_position_parse(blob, len, r->state_path, &p))) return st;
  if (p.seed != r->topt.seed)
    return df_error(DFLASH_E_MISMATCH,
                    "%s was written with seed %" PRIu64 ", this run has %" PRIu64, r->state_path,
                    p.seed, r->topt.seed);
  r->epoch = p.epoch, r->pos = p.pos, r->tokens = p.tokens, r->elapsed = p.elapsed_s;
  if (p.has_schedule) /* an earlier settings change's continuation */
    r->t->sched_from = p.sched_from, r->t->sched_lr0 = p.sched_lr0;
  dflash_status cs = check_settings(r, &p);
  if (cs) return cs;
  if (r->spool && !p.spool)
    return df_error(DFLASH_E_MISMATCH,
                    "%s has no spool position: written by a run on an "
                    "offline store",
                    r->state_path);
  if (!r->spool && p.spool)
    return df_error(DFLASH_E_MISMATCH,
                    "%s was written by a run on a spool; resume it with "
                    "--hidden spool:PATH",
                    r->state_path);
  r->sp_shard = p.spool_shard, r->sp_off = p.spool_offset;
  if (r->spool) r->spool_wait = p.spool_wait_s; /* states before the counter: from 0 */
  if (p.samples != r->n_usable)
    return df_error(DFLASH_E_MISMATCH,
                    "%s was written for %" PRIu64 " trainable samples, %s has %zu: "
                    "the data changed",
                    r->state_path, p.samples, r->o->data_dir, r->n_usable);
  /* Forget metrics lines written after the state was saved. */
  if (r->rank == 0 && truncate(r->metrics_path, (off_t)p.metrics_bytes) != 0 && p.metrics_bytes > 0)
    return df_error(DFLASH_E_IO, "cannot truncate %s to %" PRId64 " bytes", r->metrics_path,
                    p.metrics_bytes);
  return DFLASH_OK;
}

/* What every rank must agree on before the first step. */
typedef struct run_print {
  uint64_t seed, n_usable, pos, params_hash;
  int64_t step, tokens, total_steps;
  int32_t epoch, batch_size;
} run_print;

static uint64_t fnv1a(const void *p, size_t n) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 0x100000001b3ULL;
  return h;
}

/* Rank 0's fingerprint against this rank's: same data, seed, position,
 * schedule and parameters (a rank that read another state, or none, stops
 * here instead of training on a different model). */
static dflash_status check_ranks_agree(run *r) {
  if (!r->comm) return DFLASH_OK;
  dflash_status st = df_trainer_pull(r->t, DF_BUF_PARAMS);
  if (st) return st;
  run_print mine = {.seed = r->topt.seed,
                    .n_usable = r->n_usable,
                    .pos = r->pos,
                    .params_hash = fnv1a(r->t->m.params, r->t->m.n_params * sizeof(float)),
                    .step = dflash_trainer_steps(r->t),
                    .tokens = r->tokens,
                    .total_steps = r->total_steps,
                    .epoch = r->epoch,
                    .batch_size = r->o->batch_size};
  run_print root = mine;
  if ((st = df_comm_broadcast(r->comm, &root, sizeof root))) return st;
  if (memcmp(&root, &mine, sizeof mine))
    return df_error(DFLASH_E_MISMATCH,
                    "rank %d disagrees with rank 0: samples %" PRIu64 " vs %" PRIu64
                    ", seed %" PRIu64 " vs %" PRIu64 ", batch %d vs %d, step %" PRId64
                    " vs %" PRId64 ", epoch %d pos %" PRIu64 " vs epoch %d pos %" PRIu64 ", "
                    "parameters %s (every rank must see the same data, options and "
                    "train_state)",
                    r->rank, mine.n_usable, root.n_usable, mine.seed, root.seed, mine.batch_size,
                    root.batch_size, mine.step, root.step, mine.epoch, mine.pos, root.epoch,
                    root.pos, mine.params_hash == root.params_hash ? "equal" : "differ");
  return DFLASH_OK;
}

/* ---- --hidden spool:PATH ---------------------------------------------------------------- */

static const char *spool_path(const char *hidden) {
  return strncmp(hidden, "spool:", 6) ? NULL : hidden + 6;
}

static const df_tokens *g_sort_tok; /* qsort has no context argument */

static const char *id_of(const df_tokens *t, uint64_t i) {
  const char *id;
  const int32_t *ids;
  const uint8_t *mask;
  int64_t len;
  df_tokens_get(t, (size_t)i, &id, &ids, &mask, &len);
  return id;
}

static int cmp_by_id(const void *a, const void *b) {
  return strcmp(id_of(g_sort_tok, *(const uint64_t *)a), id_of(g_sort_tok, *(const uint64_t *)b));
}

/* The dataset index of a sample id, or -1. */
static int64_t find_id(const run *r, const char *id) {
  size_t lo = 0, hi = df_tokens_count(r->tok);
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    int c = strcmp(id_of(r->tok, r->by_id[mid]), id);
    if (!c) return (int64_t)r->by_id[mid];
    if (c < 0) lo = mid + 1;
    else hi = mid;
  }
  return -1;
}

/* df_spool_share's test (read only: safe on the spool's thread). */
static bool spool_usable(void *ctx, const char *id) {
  const run *r = ctx;
  int64_t idx = find_id(r, id);
  return idx >= 0 && r->is_usable[idx];
}

static double env_seconds(const char *name, double dflt) {
  const char *v = getenv(name);
  char *end;
  double x = v && *v ? strtod(v, &end) : dflt;
  return v && *v && *end ? dflt : x;
}

/* The dataset alone (the spool comes sample by sample), or the dataset joined with a store.
 * On CUDA the samples (from a store or the spool alike) carry their hidden rows as stored,
 * for the device to convert and check (DFLASH_TRAIN_STORED_ROWS=0 / 1 overrides, e.g. to
 * train the CPU backend through the same path). */
static dflash_status open_data(run *r) {
  const dflash_train_run_options *o = r->o;
  const char *path = spool_path(o->hidden_dir);
  const char *sr = getenv("DFLASH_TRAIN_STORED_ROWS");
  r->stored_rows = sr && *sr ? !strcmp(sr, "1") : r->topt.backend == DFLASH_BACKEND_CUDA;
  if (!path) {
    dflash_sample_stream_options so;
    dflash_sample_stream_options_default(&so);
    so.stored_rows = r->stored_rows;
    dflash_status st = dflash_sample_stream_open(o->data_dir, o->hidden_dir, &so, &r->s);
    if (!st) r->tok = df_sample_stream_tokens(r->s);
    return st;
  }
  dflash_spool_options so;
  dflash_spool_options_default(&so);
  so.wait_s = env_seconds("DFLASH_SPOOL_WAIT", so.wait_s);
  so.reuse = getenv("DFLASH_SPOOL_REUSE") && !strcmp(getenv("DFLASH_SPOOL_REUSE"), "1");
  so.stored_rows = r->stored_rows;
  dflash_status st = df_tokens_open(o->data_dir, &r->own_tok);
  if (!st) st = dflash_spool_open(path, &so, &r->spool);
  if (!st) st = dflash_spool_info(r->spool, NULL, NULL, &r->sp_dtype);
  if (st) return st;
  r->tok = r->own_tok;
  size_t n = df_tokens_count(r->tok);
  r->by_id = malloc((n ? n : 1) * sizeof *r->by_id);
  r->is_usable = calloc(n ? n : 1, 1);
  if (!r->by_id || !r->is_usable) return df_error_nomem("dataset ids");
  for (size_t i = 0; i < n; i++) r->by_id[i] = i;
  g_sort_tok = r->tok;
  qsort(r->by_id, n, sizeof *r->by_id, cmp_by_id);
  return DFLASH_OK;
}

/* dflash_spool_info cannot fail on an open spool with these pointers. */
static int64_t spool_width(const run *r) {
  int32_t K = 0, H = 0;
  DF_IGNORE(dflash_spool_info(r->spool, &K, &H, NULL));
  return (int64_t)K * H;
}

static dflash_status spool_buffers(run *r) {
  size_t b = (size_t)r->o->batch_size;
  r->batch_idx = malloc(b * sizeof *r->batch_idx);
  r->batch_h = calloc(b, sizeof *r->batch_h);
  r->batch_cap = calloc(b, sizeof *r->batch_cap);
  r->batch_t = calloc(b, sizeof *r->batch_t);
  r->batch_tcap = calloc(b, sizeof *r->batch_tcap);
  r->batch_pos = calloc(r->global_batch, sizeof *r->batch_pos);
  return r->batch_idx && r->batch_h && r->batch_cap && r->batch_t && r->batch_tcap && r->batch_pos
             ? DFLASH_OK
             : df_error_nomem("batch");
}

/* The next trainable sample of the spool into slot i of the batch: *got = 0 at the end of the
 * epoch. Samples that cannot carry an anchor are passed over, as offline. */
static dflash_status spool_checkpoint(run *r, bool model);

/* The spool sample's target ids into slot i of the batch (a flag of none). */
static dflash_status keep_tids(run *r, size_t i, const dflash_spool_sample *smp) {
  if (!smp->target_ids)
    return r->batch_tcap[i] = 0, free(r->batch_t[i]), r->batch_t[i] = NULL, DFLASH_OK;
  if ((size_t)smp->len > r->batch_tcap[i]) {
    free(r->batch_t[i]);
    r->batch_tcap[i] = 0;
    if (!(r->batch_t[i] = malloc((size_t)smp->len * sizeof(int32_t))))
      return df_error_nomem("batch");
    r->batch_tcap[i] = (size_t)smp->len;
  }
  memcpy(r->batch_t[i], smp->target_ids, (size_t)smp->len * sizeof(int32_t));
  return DFLASH_OK;
}

/* Bytes of a spool sample's codes (padded to 4) and scales, when the rows come as stored. */
static void spool_bytes(const run *r, int64_t len, size_t *codes, size_t *scales) {
  int32_t K = 0, H = 0;
  DF_IGNORE(dflash_spool_info(r->spool, &K, &H, NULL)); /* as in spool_width */
  size_t n = (size_t)len * (size_t)K * (size_t)H;
  bool fp8 = r->sp_dtype == DFLASH_HIDDEN_FP8_E4M3;
  *codes = ((fp8 ? n : 2 * n) + 3) & ~(size_t)3;
  *scales = fp8 ? 4 * (size_t)len * (size_t)K : 0;
}

/* The spool sample's hidden rows (float32, or as stored) into slot i of the batch. */
static dflash_status keep_rows(run *r, size_t i, const dflash_spool_sample *smp) {
  size_t n = (size_t)smp->len * (size_t)spool_width(r), code_b, scale_b;
  spool_bytes(r, smp->len, &code_b, &scale_b);
  size_t bytes = r->stored_rows ? code_b + scale_b : n * sizeof(float);
  if (bytes > r->batch_cap[i]) {
    free(r->batch_h[i]);
    r->batch_cap[i] = 0;
    if (!(r->batch_h[i] = malloc(bytes))) return df_error_nomem("batch");
    r->batch_cap[i] = bytes;
  }
  if (!r->stored_rows) {
    memcpy(r->batch_h[i], smp->hidden, n * sizeof(float));
  } else {
    memcpy(r->batch_h[i], smp->hidden_codes, r->sp_dtype == DFLASH_HIDDEN_FP8_E4M3 ? n : 2 * n);
    if (scale_b) memcpy(r->batch_h[i] + code_b, smp->hidden_scales, scale_b);
  }
  return DFLASH_OK;
}

/* The next trainable sample of the spool: its data into slot i when `keep` (else passed over,
 * unread: another rank's), its place in *at; *got = 0 at the end of the epoch. Samples that
 * cannot carry an anchor are passed over, as offline. */
static dflash_status spool_take(run *r, size_t i, bool keep, int *got, df_spool_pos *at) {
  for (;;) {
    /* About to wait: the producer may be waiting for room, so give back what the last step used
     * up (the state then is the last step's: nothing has changed since). One process only: the
     * save is collective, and ranks do not wait at the same moments (spool_maybe_free). */
    bool unreleased = r->bnd_epoch != r->rel_epoch || r->bnd_shard != r->rel_shard;
    dflash_status cst = r->world == 1 && unreleased && !df_spool_ready(r->spool)
                            ? spool_checkpoint(r, false)
                            : DFLASH_OK;
    if (cst) return cst;
    dflash_spool_sample smp = {.struct_size = sizeof smp};
    int end;
    /* The trainer's own wait counter: time in a next that had no shard ready to read. */
    bool ready = df_spool_ready(r->spool);
    double t_wait = df_now_seconds();
    dflash_status st = keep ? dflash_spool_next(r->spool, &smp, &end)
                            : df_spool_pass(r->spool, &smp, &end);
    if (!ready) r->spool_wait += df_now_seconds() - t_wait;
    if (st || end) return *got = 0, st;
    int64_t idx = find_id(r, smp.id);
    if (idx < 0)
      return df_error(DFLASH_E_NOT_FOUND, "spool sample %s is not in the dataset %s", smp.id,
                      r->o->data_dir);
    const char *id;
    const int32_t *ids;
    const uint8_t *mask;
    int64_t len;
    df_tokens_get(r->tok, (size_t)idx, &id, &ids, &mask, &len);
    if (len != smp.len)
      return df_error(DFLASH_E_MISMATCH,
                      "sample %s: %" PRId64 " tokens but %" PRId64 " rows of "
                      "hidden states in the spool",
                      id, len, smp.len);
    if (!r->is_usable[idx]) continue;
    *at = (df_spool_pos){smp.epoch, smp.shard, smp.offset};
    if (!keep) return *got = 1, DFLASH_OK;
    if ((st = keep_rows(r, i, &smp))) return st;
    r->batch_idx[i] = (uint64_t)idx;
    if ((st = keep_tids(r, i, &smp))) return st;
    return *got = 1, DFLASH_OK;
  }
}

/* Gather the next global batch (*n samples; *ended at the epoch's end marker) and keep this
 * rank's share: the full batch's share as the samples come, and for a short last batch, whose
 * share is known only at the end, the samples of that share read again. */
static dflash_status spool_batch(run *r, size_t *n, bool *ended) {
  size_t B = (size_t)r->o->batch_size, lo = B * (size_t)r->rank, hi = lo + B, lo2, hi2;
  int one = 1;
  dflash_status st = DFLASH_OK;
  for (*n = 0; *n < r->global_batch && one && !st; *n += (size_t)one) {
    bool keep = *n >= lo && *n < hi;
    st = spool_take(r, keep ? *n - lo : 0, keep, &one, &r->batch_pos[*n]);
  }
  if (st) return st;
  *ended = !one;
  share(r, *n, &lo2, &hi2);
  hi = hi < *n ? hi : *n;
  r->n_mine = hi > lo ? hi - lo : 0;
  if (lo2 == lo && hi2 == hi) return DFLASH_OK; /* always with one rank */
  df_spool_pos back;
  st = dflash_spool_tell(r->spool, &back.epoch, &back.shard, &back.offset);
  for (size_t k = lo2; k < hi2 && !st; k++) {
    const df_spool_pos *p = &r->batch_pos[k];
    df_spool_pos at;
    st = dflash_spool_seek(r->spool, p->epoch, p->shard, p->offset);
    if (!st) st = spool_take(r, k - lo2, true, &one, &at);
    if (!st && (!one || at.epoch != p->epoch || at.shard != p->shard || at.offset != p->offset))
      st = df_error(DFLASH_E_INTERNAL,
                    "spool %s: sample at e%d s%" PRIu64 " +%" PRIu64 " not found again",
                    r->o->hidden_dir, p->epoch, p->shard, p->offset);
  }
  /* Back to where the end marker left it: the next epoch's start (no usable sample before). */
  if (!st) st = df_spool_seek_k(r->spool, back.epoch, back.shard, back.offset, 0);
  r->n_mine = hi2 - lo2;
  return st;
}

/* Sample i of the gathered batch, as the stream would give it. */
static dflash_status spool_sample(run *r, size_t i, dflash_train_sample *out, int *done) {
  const char *id;
  *done = 0;
  out->struct_size = sizeof *out;
  out->index = r->batch_idx[i];
  df_tokens_get(r->tok, (size_t)out->index, &id, &out->input_ids, &out->loss_mask, &out->len);
  out->id = id;
  out->target_ids = r->batch_t[i];
  out->hidden = r->stored_rows ? NULL : (const float *)r->batch_h[i];
  out->hidden_dtype = r->sp_dtype;
  out->hidden_codes = r->stored_rows ? r->batch_h[i] : NULL;
  size_t code_b, scale_b;
  spool_bytes(r, out->len, &code_b, &scale_b);
  out->hidden_scales = r->stored_rows && scale_b ? (const float *)(r->batch_h[i] + code_b) : NULL;
  return DFLASH_OK;
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
  r->metrics = fopen(r->metrics_path, o->resume ? "a" : "w");
  if (!r->metrics) return df_error(DFLASH_E_IO, "cannot open %s", r->metrics_path);
  /* The bar and ETA end where this run stops: --max-steps when it comes first. */
  int64_t last = o->max_steps > 0 && o->max_steps < r->total_steps ? o->max_steps : r->total_steps;
  if (o->progress)
    return dflash_progress_create(o->progress, "train", "steps", (uint64_t)last, 0, &r->progress);
  return DFLASH_OK;
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
  if (!st) st = open_data(r);
  if (st) return st;
  int64_t width = (int64_t)r->cfg.n_target_layer_ids * r->cfg.hidden_size;
  int64_t have = r->spool ? spool_width(r) : dflash_sample_stream_width(r->s);
  if (have != width)
    return df_error(DFLASH_E_MISMATCH,
                    "%s holds %" PRId64 " features per token; the drafter "
                    "config needs K*H = %d*%d = %" PRId64,
                    o->hidden_dir, have, r->cfg.n_target_layer_ids, r->cfg.hidden_size, width);
  if (!r->spool && (st = dflash_sample_stream_check(r->s, NULL))) return st;
  if ((st = check_labels(r))) return st;
  if ((st = find_usable(r))) return st;
  r->global_batch = (size_t)o->batch_size * (size_t)r->world;
  if (r->spool && (st = spool_buffers(r))) return st;
  /* Several ranks: on S3 each reads only its share's samples (and every shard's header). */
  if (r->spool && r->world > 1)
    df_spool_share(r->spool, spool_usable, r, r->global_batch,
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
  dflash_trainer_options topt = r->topt;
  topt.total_steps = r->total_steps;
  if ((st = load_target(r, &topt))) return st;
  /* An s3:// run on rank 0 writes into its local mirror; the other ranks
   * read the state from the bucket itself. */
  const char *state_base = r->rank == 0 || !r->remote.url ? o->out_dir : r->remote.url;
  r->state_path = df_asprintf("%s/train_state/state.safetensors", state_base);
  r->metrics_path = df_path_join(o->out_dir, "metrics.jsonl");
  if (!r->state_path || !r->metrics_path) return df_error_nomem("paths");
  if (o->resume && (st = resume(r))) return st;
  if ((st = open_outputs(r))) return st;
  if (r->rank == 0 && getenv("DFLASH_TRAIN_TRACE") && *getenv("DFLASH_TRAIN_TRACE") &&
      !(r->trace = fopen(getenv("DFLASH_TRAIN_TRACE"), "a")))
    return df_error(DFLASH_E_IO, "cannot open DFLASH_TRAIN_TRACE=%s", getenv("DFLASH_TRAIN_TRACE"));
  if (r->trace) fputs("# run\n", r->trace); /* a resumed run's lines redo the killed one's */
  return check_ranks_agree(r);
}

/* The metrics line (and progress note) of the step in r->line, with its norm. */
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
  if (r->progress) {
    char note[96];
    snprintf(note, sizeof note, "loss %.4f  %.0f tok/s", r->line.loss, dt > 0 ? tok / dt : 0.0);
    dflash_progress_update(r->progress, (uint64_t)r->line.step, note);
  }
}

/* The outstanding step's norm (every rank: a non-finite one fails the run here) and its
 * metrics line (rank 0). */
static dflash_status finish_step(run *r) {
  if (!r->step_open) return DFLASH_OK;
  r->step_open = false;
  double norm = 0;
  dflash_status st = dflash_trainer_step_result(r->t, &norm);
  if (!st && r->rank == 0) write_metrics(r, norm);
  return st;
}

/* One optimizer step over the global batch order[pos, pos+gb): this rank's
 * share, gradients scaled by the global weight, summed over the ranks. */
static dflash_status train_step(run *r, size_t gb) {
  int32_t A = r->topt.num_anchors, B = r->cfg.block_size;
  size_t lo = 0, hi = r->n_mine; /* the spool's: gathered by spool_batch */
  if (!r->spool) share(r, gb, &lo, &hi);
  size_t b = hi - lo;
  double sums[3] = {0, 0, 0}; /* weight, tokens, then sum(w*CE) */
  for (size_t i = 0; i < b; i++) {
    uint64_t idx = r->spool ? r->batch_idx[i] : r->order[r->pos + lo + i];
    const char *id;
    const int32_t *ids;
    const uint8_t *mask;
    int64_t len;
    double w;
    df_tokens_get(r->tok, (size_t)idx, &id, &ids, &mask, &len);
    dflash_status st = dflash_sample_anchors(mask, len, B, A, r->topt.seed,
                                             (uint64_t)r->epoch * r->n_total + idx,
                                             r->anchors + i * (size_t)A, &r->n_anchors[i]);
    if (!st)
      st = dflash_trainer_weight_sum(r->t, mask, len, r->anchors + i * (size_t)A, r->n_anchors[i],
                                     &w);
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
  /* Offline store and spool alike: accumulate_sample does not wait for the device, whose
   * losses (and NaN/Inf checks) are collected once, after the batch. The step before's norm
   * is asked for once the first sequence is on its way (it uploads behind the optimizer). */
  for (size_t i = 0; i < b; i++) {
    dflash_train_sample smp = {.struct_size = sizeof smp};
    int done;
    st = r->spool ? spool_sample(r, i, &smp, &done) : dflash_sample_stream_next(r->s, &smp, &done);
    if (!st && done) st = df_error(DFLASH_E_INTERNAL, "sample stream ended early");
    const int32_t *labels = NULL;
    if (!st) st = make_labels(r, &smp, &labels);
    r->bad_sample = st != DFLASH_OK;
    if (!st)
      st = df_trainer_accumulate_sample_labels(r->t, &smp, labels, r->anchors + i * (size_t)A,
                                               r->n_anchors[i], 1.0 / W);
    if (st) return df_error_wrap(st, "sample %s", smp.id ? smp.id : "?");
    if (i == 0 && (st = finish_step(r))) return st;
  }
  if ((st = finish_step(r))) return st; /* no sequence on this rank */
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
  int64_t step = dflash_trainer_steps(r->t);
  r->line.step = step, r->line.epoch = r->epoch, r->line.loss = lsum / W, r->line.lr = lr;
  r->line.sel_loss = losses[1] / W;
  r->line.dt = now - t_start, r->line.elapsed = r->elapsed + now - r->t0;
  r->line.spool_wait = r->spool_wait, r->line.tokens = (double)tokens, r->line.total = r->tokens;
  if (r->rank != 0) return DFLASH_OK;
  for (size_t i = 0; r->trace && i < b; i++) {
    const char *id;
    const int32_t *ids;
    const uint8_t *mask;
    int64_t len;
    df_tokens_get(r->tok, (size_t)(r->spool ? r->batch_idx[i] : r->order[r->pos + lo + i]), &id,
                  &ids, &mask, &len);
    fprintf(r->trace, "%d %" PRId64 " %s\n", r->epoch, step, id);
  }
  if (r->sync_step) write_metrics(r, norm);
  return DFLASH_OK;
}

/* After a step: nothing, a save (save_every_s has passed) or a stop (the caller's `stop`).
 * Rank 0 decides and tells the others (a broadcast a step, only with several ranks). */
enum { ACT_NONE, ACT_SAVE, ACT_STOP };

static dflash_status next_action(run *r, bool last_step, int32_t *act) {
  const dflash_train_run_options *o = r->o;
  *act = ACT_NONE;
  if (r->rank == 0 && !last_step) {
    if (o->stop && o->stop(o->stop_user)) *act = ACT_STOP;
    else if (o->save_every_s > 0 && df_now_seconds() - r->last_save >= o->save_every_s)
      *act = ACT_SAVE;
  }
  return r->comm ? df_comm_broadcast(r->comm, act, sizeof *act) : DFLASH_OK;
}

static dflash_status stopped(const run *r) {
  return df_error(DFLASH_E_CANCELLED,
                  "training stopped on request after step %" PRId64
                  ": checkpoint and state saved in %s; --resume continues",
                  dflash_trainer_steps(r->t), r->o->out_dir);
}

/* A step that failed on a sample's data (one process): the state as of the step before is
 * saved, so that nothing is lost, and the error says so. */
static dflash_status failed_on_sample(run *r, dflash_status st) {
  if (!r->bad_sample || r->comm) return st;
  char *why = df_strdup(dflash_last_error());
  dflash_status saved = save(r, r->epoch, r->pos);
  st = df_error(st, "%s; the run stopped at step %" PRId64 " with %s", why ? why : "",
                dflash_trainer_steps(r->t),
                saved ? "its state NOT saved"
                      : "its state saved in train_state/ (--resume continues once the "
                        "sample is fixed)");
  free(why);
  return st;
}

static dflash_status train_loop(run *r) {
  const dflash_train_run_options *o = r->o;
  for (; r->epoch < o->epochs; r->epoch++, r->pos = 0) {
    dflash_status st = start_epoch(r);
    if (st) return st;
    while (r->pos < r->n_usable) {
      size_t gb = batch_at(r, r->pos);
      if ((st = train_step(r, gb))) return failed_on_sample(r, st);
      r->pos += gb;
      int64_t step = dflash_trainer_steps(r->t);
      bool stop = o->max_steps > 0 && step >= o->max_steps;
      bool last = stop || (r->epoch + 1 >= o->epochs && r->pos >= r->n_usable);
      int32_t act;
      if ((st = next_action(r, last, &act))) return st;
      if ((o->save_every > 0 && step % o->save_every == 0) || stop || act != ACT_NONE)
        if ((st = save(r, r->epoch, r->pos))) return st;
      if (stop) return DFLASH_OK;
      if (act == ACT_STOP) return stopped(r);
    }
  }
  return save(r, r->epoch, 0);
}

/* The state is durable up to the last step's spool position: let the producer reuse the room. */
static dflash_status spool_release(run *r) {
  if (r->bnd_epoch == r->rel_epoch && r->bnd_shard == r->rel_shard) return DFLASH_OK;
  dflash_status st = DFLASH_OK;
  if (r->rank == 0) st = dflash_spool_release(r->spool, r->bnd_epoch, r->bnd_shard);
  else df_spool_forget(r->spool, r->bnd_epoch, r->bnd_shard); /* rank 0 deletes */
  if (!st) r->rel_epoch = r->bnd_epoch, r->rel_shard = r->bnd_shard;
  return st;
}

/* Save the state as of the last step (and the checkpoint with `model`), then release. */
static dflash_status spool_checkpoint(run *r, bool model) {
  dflash_status st = save_as(r, r->bnd_epoch, r->bnd_pos, model);
  return st ? st : spool_release(r);
}

static void spool_boundary(run *r, bool ended) {
  /* Cannot fail on an open spool with these pointers. */
  DF_IGNORE(dflash_spool_tell(r->spool, &r->bnd_epoch, &r->bnd_shard, &r->bnd_off));
  r->bnd_pos = ended ? 0 : r->pos;
}

/* After a step that used up shards: a state save to free them only once they are half the
 * producer's budget (every save writes the whole optimizer state), or always when the
 * producer's budget is unknown. Waiting for a shard saves anyway (spool_take); with several
 * ranks, which cannot agree on when to wait, rank 0 decides here instead, saving also when
 * the next shard is not there yet, and tells the others. */
static dflash_status spool_maybe_free(run *r) {
  if (r->bnd_epoch == r->rel_epoch && r->bnd_shard == r->rel_shard) return DFLASH_OK;
  uint64_t used = 0, budget = 0;
  int32_t save = 0;
  dflash_status st = DFLASH_OK;
  if (r->rank == 0) {
    st = df_spool_pressure(r->spool, r->bnd_epoch, r->bnd_shard, &used, &budget);
    save = !budget || 2 * used >= budget || (r->world > 1 && !df_spool_ready(r->spool));
  }
  if (!st && r->comm) st = df_comm_broadcast(r->comm, &save, sizeof save);
  return st || !save ? st : spool_checkpoint(r, false);
}

/*
 * Training from a spool: each epoch is what the producer published for it, in its order, up to
 * its end marker; a step takes the next batch_size trainable samples (fewer at the end). Used-up
 * shards are released after a state save (train_state only) when they reach half the budget or
 * the trainer would wait; checkpoints as offline (save_every, max_steps, the end).
 */
static dflash_status spool_loop(run *r) {
  const dflash_train_run_options *o = r->o;
  dflash_status st = DFLASH_OK;
  bool reuse = getenv("DFLASH_SPOOL_REUSE") && !strcmp(getenv("DFLASH_SPOOL_REUSE"), "1");
  if ((st = df_spool_seek_k(r->spool, r->epoch, r->sp_shard, r->sp_off, r->pos))) return st;
  spool_boundary(r, false);
  r->bnd_pos = r->pos;
  r->rel_epoch = r->epoch, r->rel_shard = r->sp_shard;
  if (o->resume) { /* a kill between the state and the deletes: finish them */
    r->rel_epoch = -1;
    if ((st = spool_release(r))) return st;
  }
  for (; r->epoch < o->epochs; r->epoch++, r->pos = 0, r->sp_shard = r->sp_off = 0) {
    if ((st = df_spool_seek_k(r->spool, r->epoch, r->sp_shard, r->sp_off, r->pos))) return st;
    for (bool ended = false; !ended;) {
      size_t got = 0;
      if ((st = spool_batch(r, &got, &ended))) return st;
      if (got && (st = train_step(r, got))) return st;
      r->pos += got;
      spool_boundary(r, ended);
      int64_t step = dflash_trainer_steps(r->t);
      bool stop = o->max_steps > 0 && step >= o->max_steps;
      bool full = stop || (got && o->save_every > 0 && step % o->save_every == 0);
      int32_t act;
      if ((st = next_action(r, stop || r->bnd_epoch >= o->epochs, &act))) return st;
      if (r->bnd_epoch >= o->epochs) break; /* the final save follows */
      if (full || act != ACT_NONE) st = spool_checkpoint(r, true);
      else if (!reuse) st = spool_maybe_free(r);
      if (st) return st;
      if (stop) return DFLASH_OK;
      if (act == ACT_STOP) return stopped(r);
    }
  }
  return spool_checkpoint(r, true);
}

/* This process's rank, and the connections to the others when there are. */
static dflash_status join_run(run *r) {
  df_dist_env env;
  double timeout;
  dflash_status st = df_dist_env_from_environ(&env);
  if (!st) st = df_dist_timeout(&timeout);
  if (st) return df_error_wrap(st, "training run");
  r->rank = env.rank;
  r->world = env.world;
  if (env.world > 1 && (st = df_comm_open(&env, timeout, &r->comm)))
    return df_error_wrap(st, "training run, rank %d of %d", env.rank, env.world);
  return DFLASH_OK;
}

dflash_status dflash_train_run(const dflash_train_run_options *opts) {
  DF_CHECK_ARG(opts);
  /* The caller's structs at this library's size (the one rule, core/internal.h). */
  dflash_train_run_options oo;
  dflash_train_run_options_default(&oo);
  dflash_status st = df_opts_in(&oo, opts, sizeof oo, "dflash_train_run_options");
  if (st) return st;
  const dflash_train_run_options *o = &oo;
  DF_CHECK_ARG(o->config_path && o->target_path && o->data_dir && o->hidden_dir && o->out_dir &&
               o->epochs > 0 && o->batch_size > 0);
  run r = {.o = o, .t0 = df_now_seconds()};
  r.last_save = r.t0;
  const char *sync = getenv("DFLASH_TRAIN_SYNC_STEP");
  r.sync_step = sync && !strcmp(sync, "1");
  dflash_trainer_options_default(&r.topt);
  st = df_opts_in(&r.topt, o->trainer, sizeof r.topt, "dflash_train_run_options.trainer");
  if (st) return st;
  st = join_run(&r);
  if (!st && dflash_storage_is_remote(o->out_dir)) {
    /* Rank 0 mirrors the bucket; the barrier keeps the others from reading
     * the state before that mirror is rebuilt (it may share their cache). */
    if (r.rank == 0) st = df_train_remote_begin(&r.remote, o->out_dir, o->resume != 0);
    else r.remote.url = (char *)o->out_dir;
    if (!st) st = barrier(&r);
    r.local_o = *o;
    r.local_o.out_dir = r.rank == 0 ? r.remote.local : o->out_dir;
    r.o = &r.local_o;
  }
  if (!st) st = open_all(&r);
  if (!st) st = r.spool ? spool_loop(&r) : train_loop(&r);
  if (st) df_comm_abort(r.comm, st); /* the other ranks stop too, naming this one */
  if (r.progress) dflash_progress_free(r.progress);
  if (r.metrics) fclose(r.metrics);
  dflash_trainer_free(r.t);
  df_comm_free(r.comm);
  dflash_sample_stream_free(r.s);
  if (r.trace) fclose(r.trace);
  dflash_spool_free(r.spool);
  df_tokens_free(r.own_tok);
  for (size_t i = 0; r.batch_h && i < (size_t)o->batch_size; i++) free(r.batch_h[i]);
  for (size_t i = 0; r.batch_t && i < (size_t)o->batch_size; i++) free(r.batch_t[i]);
  free(r.batch_t), free(r.batch_pos), free(r.batch_tcap), free(r.labels), free(r.head),
      free(r.norm_w);
  free(r.batch_h), free(r.batch_cap), free(r.batch_idx), free(r.by_id), free(r.is_usable);
  free(r.usable), free(r.order), free(r.mine), free(r.anchors), free(r.n_anchors);
  free(r.state_path), free(r.metrics_path);
  if (r.rank == 0) df_train_remote_end(&r.remote);
  return st;
}
