/*
 * A training run's state: the settings it records, the save of the checkpoint and the
 * resume position (position.h), the exact resume, and the ranks' agreement before the
 * first step. Split out of run.c (the run struct: run_internal.h).
 */
#include <dflash/hidden.h>
#include <dflash/storage.h>
#include <inttypes.h>
#include <jansson.h>
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

/* ---- the run's settings, recorded with the state ------------------------------------------ */

/* What shapes the training and must not change silently on --resume (the world size, threads
 * and backend may: the data position and the global batch are global, the maths the same). */
typedef struct setting {
  const char *name;
  double value;
} setting;

enum { N_SETTINGS = 22 };

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
      {"optimizer", t->optimizer},
      {"muon_momentum", t->muon_momentum},
      {"muon_weight_decay", t->muon_weight_decay},
      {"muon_adjust_lr", t->muon_adjust_lr},
      {"schedule_steps", (double)r->sched_steps}, /* max_steps can set it: recorded apart */
  };
  memcpy(s, all, sizeof all);
}

/* A setting's value as the command line spells it: "labels data -> target" says what to pass
 * where "labels 0 -> 1" does not. Numbers stay numbers. */
void df_run_setting_text(const char *name, double v, char *buf, size_t cap) {
  static const struct {
    const char *setting, *names[3];
  } enums[] = {
      {"labels", {"data", "target", NULL}},
      {"lr_schedule", {"cosine", "linear", "constant"}},
      {"position_weighting", {"decay", "adaptive", NULL}},
      {"optimizer", {"adamw", "muon", NULL}},
      {"muon_adjust_lr", {"match-rms-adamw", "original", NULL}},
      {"selector_loss_mode", {"drop", "inject", NULL}},
  };
  for (size_t i = 0; i < sizeof enums / sizeof *enums; i++) {
    if (strcmp(enums[i].setting, name)) continue;
    int k = (int)v;
    if (k == v && k >= 0 && k < 3 && enums[i].names[k]) {
      snprintf(buf, cap, "%s", enums[i].names[k]);
      return;
    }
  }
  /* loss_gamma < 0 is --weighting none, 0 the block size's default gamma. */
  if (!strcmp(name, "loss_gamma") && v <= 0)
    snprintf(buf, cap, "%s", v < 0 ? "none (--weighting none)" : "default (--weighting decay)");
  else snprintf(buf, cap, "%.9g", v);
}

/* Whether the saved schedule had ended at `step`: the state's length says so, or (a state from
 * before it was recorded) its rate sits at the saved floor. */
static bool schedule_ended(const df_position *p, int64_t step) {
  const df_position_setting *len = df_position_setting_find(p, "schedule_steps");
  if (len) return (double)step >= len->value;
  const df_position_setting *lr = df_position_setting_find(p, "lr");
  const df_position_setting *ratio = df_position_setting_find(p, "min_lr_ratio");
  return lr && p->next_lr <= lr->value * (ratio ? ratio->value : 0);
}

/* The learning rate after a resume with other settings (allow_settings_change; run.h says
 * which rate each case starts from). Settings that leave the next step's rate where the saved
 * schedule had it move nothing. */
static void continue_schedule(run *r, const df_position *p) {
  if (!p->has_schedule) return; /* a state from before the rate was recorded */
  int64_t step = dflash_trainer_step_count(r->t);
  const df_position_setting *lr = df_position_setting_find(p, "lr");
  double lr0 = p->next_lr;
  if (lr && lr->value != r->topt.lr) {
    r->sched_why = "--lr changed", lr0 = r->topt.lr;
  } else if (schedule_ended(p, step)) {
    r->sched_why = "the saved schedule had ended", lr0 = r->topt.lr;
  } else {
    if (dflash_trainer_lr_at(r->t, step) == p->next_lr) return;
    r->sched_why = "the settings changed";
  }
  r->t->sched_from = step > 0 ? step : 1;
  r->t->sched_lr0 = lr0;
}

/* The state's settings against this run's: DFLASH_E_MISMATCH naming every change, unless
 * allow_settings_change. A state written before settings were recorded has none to compare;
 * one that records a setting this library does not know is refused. */
static dflash_status check_settings(run *r, const df_position *p) {
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
    char a[48], b[48];
    df_run_setting_text(s[i].name, was->value, a, sizeof a);
    df_run_setting_text(s[i].name, s[i].value, b, sizeof b);
    int k = snprintf(changes + n, sizeof changes - n, "%s%s %s -> %s", n ? ", " : "", s[i].name, a,
                     b);
    if (k > 0 && (size_t)k < sizeof changes - n) n += (size_t)k;
  }
  if (!n) return DFLASH_OK;
  /* adam_m holds Muon's momentum on the matrices and adam_v nothing there: neither
   * optimizer can continue from the other's state. */
  const df_position_setting *opt = df_position_setting_find(p, "optimizer");
  if (opt && opt->value != r->topt.optimizer)
    return df_error(DFLASH_E_MISMATCH,
                    "%s was written with optimizer %s; a run cannot change its optimizer (the "
                    "saved moments are the other optimizer's)",
                    r->state_path, opt->value == DFLASH_OPTIMIZER_MUON ? "muon" : "adamw");
  if (r->o->allow_settings_change) return continue_schedule(r, p), DFLASH_OK;
  return df_error(DFLASH_E_MISMATCH,
                  "%s was written with other settings: %s (resume with the run's own, or "
                  "allow the change: --allow-settings-change)",
                  r->state_path, changes);
}

/* The schedule's length (run.h, schedule_steps): max_steps ends it by default, so that a run
 * cut short on purpose decays over the steps it trains instead of stopping at its peak. */
int64_t df_run_schedule_steps(const run *r) {
  const dflash_train_run_options *o = r->o;
  if (o->schedule_steps > 0) return o->schedule_steps;
  if (o->schedule_steps == DFLASH_SCHEDULE_EPOCHS) return r->total_steps;
  return o->max_steps > 0 && o->max_steps < r->total_steps ? o->max_steps : r->total_steps;
}

/* The step the run ends at: max_steps when it comes before the epochs' end. */
static int64_t last_step(const run *r) {
  int64_t m = r->o->max_steps;
  return m > 0 && m < r->total_steps ? m : r->total_steps;
}

/* Says (INFO, rank 0) which learning rates the steps to train take, so that a resumed or
 * shortened run's schedule is seen before it trains, not read off metrics.jsonl after. */
static void state_schedule(const run *r, int64_t step, int64_t end) {
  if (r->rank != 0 || step >= end) return;
  const dflash_trainer_options *t = &r->t->opt;
  static const char *const kind[] = {"cosine", "linear", "constant"};
  const char *k = t->lr_schedule >= 0 && t->lr_schedule < 3 ? kind[t->lr_schedule] : "?";
  const char *len = r->o->schedule_steps > 0          ? "schedule_steps"
                    : r->sched_steps < r->total_steps ? "max_steps"
                                                      : "the epochs";
  if (r->sched_why)
    df_log(DFLASH_LOG_INFO,
           "train: resuming at step %" PRId64 " with a new learning-rate schedule (%s): %.6g, "
           "%s to %.6g at step %" PRId64 " (%s); the run ends at step %" PRId64,
           step, r->sched_why, r->t->sched_lr0, k, t->lr * t->min_lr_ratio, t->total_steps, len,
           end);
  else
    df_log(DFLASH_LOG_INFO,
           "train: %s step %" PRId64 ": learning rate %.6g (peak %.6g, warm-up %" PRId64
           " steps, %s to %.6g at step %" PRId64 ", %s); the run ends at step %" PRId64,
           step ? "resuming at" : "from", step, dflash_trainer_lr_at(r->t, step), t->lr,
           df_warmup_steps(t), k, t->lr * t->min_lr_ratio, t->total_steps, len, end);
}

/* Before the first step: a run whose every step would take learning rate 0 while lr > 0 is
 * refused (it would write an unchanged model and call it trained). */
dflash_status df_run_check_schedule(run *r) {
  int64_t step = dflash_trainer_step_count(r->t), end = last_step(r);
  bool any = step >= end || r->topt.lr <= 0;
  for (int64_t k = step; !any && k < end; k++) any = dflash_trainer_lr_at(r->t, k) > 0;
  if (!any)
    return df_error(DFLASH_E_INVALID_ARG,
                    "every step from %" PRId64 " to %" PRId64 " would train at learning rate 0: "
                    "the schedule ends at step %" PRId64 " with floor lr * min_lr_ratio = %g "
                    "(a longer schedule_steps / --schedule-steps, a min_lr_ratio above 0, or "
                    "--allow-settings-change with more epochs restarts it)",
                    step, end, r->sched_steps, r->topt.lr * r->topt.min_lr_ratio);
  state_schedule(r, step, end);
  return DFLASH_OK;
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
  p->next_lr = dflash_trainer_lr_at(r->t, dflash_trainer_step_count(r->t));
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
dflash_status df_run_save_as(run *r, int32_t epoch, uint64_t pos, bool model) {
  if (!r->spool && pos >= r->n_usable) epoch++, pos = 0;
  dflash_status st = df_run_finish_step(r); /* the last step's metrics line before the state */
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
    if (!st && model) r->stats.checkpoint_step = dflash_trainer_step_count(r->t);
    free(blob);
  }
  r->last_save = df_now_seconds();
  return st ? st : df_run_barrier(r);
}

dflash_status df_run_save(run *r, int32_t epoch, uint64_t pos) {
  return df_run_save_as(r, epoch, pos, true);
}

/* A resumed run that trains no step (at max_steps, or its epochs done) still reports the saved
 * run's last step in its stats: rank 0 reads it back from the last line of its own metrics.jsonl,
 * just cut to the state's `bytes`, since the state does not hold the loss. A line that cannot be
 * read leaves zeros (the stats are a report; the run goes on). */
static void stats_of_last_line(run *r, int64_t bytes) {
  char buf[4096];
  FILE *f = bytes > 0 ? fopen(r->metrics_path, "rb") : NULL;
  if (!f) return;
  int64_t from = bytes >= (int64_t)sizeof buf ? bytes - (int64_t)sizeof buf + 1 : 0;
  size_t n = fseeko(f, (off_t)from, SEEK_SET) ? 0 : fread(buf, 1, (size_t)(bytes - from), f);
  fclose(f);
  while (n && buf[n - 1] == '\n') n--;
  buf[n] = 0;
  const char *line = strrchr(buf, '\n');
  line = line ? line + 1 : buf;
  json_t *m = NULL;
  if (df_json_parse(line, strlen(line), r->metrics_path, &m)) {
    dflash_clear_error();
    return;
  }
  dflash_train_stats *s = &r->stats;
  s->step = json_integer_value(json_object_get(m, "step"));
  s->epoch = (int32_t)json_integer_value(json_object_get(m, "epoch"));
  s->loss = json_number_value(json_object_get(m, "loss"));
  s->grad_norm = json_number_value(json_object_get(m, "grad_norm"));
  s->lr = json_number_value(json_object_get(m, "lr"));
  s->tokens = json_integer_value(json_object_get(m, "tokens"));
  s->tokens_per_s = json_number_value(json_object_get(m, "tokens_per_s"));
  s->elapsed_s = json_number_value(json_object_get(m, "elapsed_s"));
  s->spool_wait_s = json_number_value(json_object_get(m, "spool_wait_s"));
  s->selector_loss = json_number_value(json_object_get(m, "selector_loss"));
  json_decref(m);
}

/* Every rank reads the same state (a shared directory or the bucket);
 * rank 0 alone trims metrics.jsonl. */
dflash_status df_run_resume(run *r) {
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
  /* Before the settings: max_steps also sets the schedule's length, but what is wrong is the
   * stop (the run would take one step past it and report "20/3 steps"). */
  int64_t step = dflash_trainer_step_count(r->t);
  if (r->o->max_steps > 0 && step > r->o->max_steps)
    return df_error(DFLASH_E_INVALID_ARG,
                    "%s is at step %" PRId64 ", past --max-steps %" PRId64
                    " (it counts every step of the run, the saved ones included): give more "
                    "than %" PRId64 " or leave it out",
                    r->state_path, step, r->o->max_steps, step);
  /* A state from before schedule_steps was recorded ran the epochs' schedule whatever
   * max_steps said: resumed with the default, it goes on with that one, as it would have. */
  if (!df_position_setting_find(&p, "schedule_steps") && r->o->schedule_steps == 0)
    r->sched_steps = r->total_steps, r->t->opt.total_steps = r->total_steps;
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
  if (r->rank == 0) stats_of_last_line(r, p.metrics_bytes);
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
dflash_status df_run_check_ranks_agree(run *r) {
  if (!r->comm) return DFLASH_OK;
  dflash_status st = df_trainer_pull(r->t, DF_BUF_PARAMS);
  if (st) return st;
  run_print mine = {.seed = r->topt.seed,
                    .n_usable = r->n_usable,
                    .pos = r->pos,
                    .params_hash = fnv1a(r->t->m.params, r->t->m.n_params * sizeof(float)),
                    .step = dflash_trainer_step_count(r->t),
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
