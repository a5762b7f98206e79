/*
 * Held-out evaluation of a drafter: acceptance at given anchors, the mean
 * over sampled anchors (dflash_trainer_eval), and the speculative walk
 * (dflash_trainer_walk, dflash_trainer_eval_walk) that chains anchors the way
 * live greedy speculative decoding does, so its tau = tokens / steps is the
 * number a live run measures.
 *
 * A block drafts nd tokens, draft j (0-based) predicting anchor + j + 1: nd = B - 1 for
 * DFlash (position 0 holds the anchor), B for DSpark (anchor-first, slot 0 drafts too;
 * spec/dspark.md section 1). A DSpark walk also gives the confidence head's value along its
 * greedy chain (the calibration) and, with the target's final state, each block's
 * teacher-forced probabilistic tau (spec/dspark.md section 6).
 */
#include <dflash/hidden.h>
#include <dflash/run.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "backend.h"
#include "store_layers.h"
#include "trainer.h"

/* Anchors per propose call: bounds the block activations and logits held at
 * once (a block of B positions times the vocabulary chunk each). */
enum { EVAL_CHUNK = 64 };

/* Drafts a block: B - 1 (DFlash), B (DSpark). */
static int n_drafts(const dflash_trainer *t) { return t->m.dspark ? t->m.B : t->m.B - 1; }

/* Leading drafts equal to input_ids (counting stops at len): accept[i]; p [n, nd]. */
static void count_accept(int nd, const int32_t *ids, int64_t len, const int32_t *anchors, int32_t n,
                         const int32_t *p, int32_t *accept) {
  for (int32_t i = 0; i < n; i++) {
    int j = 0;
    while (j < nd && (int64_t)anchors[i] + j + 1 < len &&
           p[(size_t)i * nd + j] == ids[anchors[i] + j + 1])
      j++;
    accept[i] = j;
  }
}

/* Greedy drafts at a checked sample's anchors into pred [n_anchors, B-1]. */
static dflash_status drafts(dflash_trainer *t, const dflash_sample *s, int32_t *pred) {
  return dflash_trainer_propose(t, s, NULL, pred, NULL);
}

dflash_status dflash_trainer_acceptance(dflash_trainer *t, const dflash_sample *caller,
                                        int32_t *accept) {
  DF_CHECK_ARG(t && accept);
  dflash_sample s;
  dflash_status st = df_sample_in(caller, &s);
  if (st) return st;
  DF_CHECK_ARG(s.input_ids);
  int nd = n_drafts(t);
  int32_t *p = malloc(sizeof(int32_t) * (size_t)(s.n_anchors ? s.n_anchors : 1) * (size_t)nd);
  if (!p) return df_error_nomem("predictions");
  if (!(st = drafts(t, &s, p)))
    count_accept(nd, s.input_ids, s.len, s.anchors, s.n_anchors, p, accept);
  free(p);
  return st;
}

/* Open a dataset joined with its hidden states, started over every sample
 * in dataset order. The store must hold the trainer's K*H features per
 * token: propose reads len*K*H floats from each sample. */
static dflash_status stream_all(const dflash_trainer *t, const char *data_dir,
                                const char *hidden_dir, dflash_sample_stream **out) {
  dflash_sample_stream *s;
  dflash_status st = dflash_sample_stream_open(data_dir, hidden_dir, NULL, &s);
  if (st) return st;
  if (dflash_sample_stream_width(s) != t->m.KH)
    st = df_error(DFLASH_E_MISMATCH,
                  "%s holds %lld features per token; the drafter needs "
                  "K*H = %lld",
                  hidden_dir, (long long)dflash_sample_stream_width(s), (long long)t->m.KH);
  if (!st) st = df_check_store_layers(&t->m.cfg, s, hidden_dir);
  size_t n = dflash_sample_stream_count(s);
  uint64_t *order = st ? NULL : malloc((n ? n : 1) * sizeof *order);
  if (!st && !order) st = df_error_nomem("evaluation order");
  for (size_t i = 0; !st && i < n; i++) order[i] = i;
  if (!st) st = dflash_sample_stream_start(s, order, n); /* copies the order */
  free(order);
  if (st) dflash_sample_stream_free(s);
  else *out = s;
  return st;
}

static void eval_defaults(dflash_eval *e) {
  memset(e, 0, sizeof *e);
  e->struct_size = sizeof *e;
  e->anchors_per_seq = 64;
  e->seed = 1;
}

DF_DEFINE_INIT(dflash_eval, eval_defaults)

/* Sampled-anchor scratch of dflash_trainer_eval: anchors, acceptance, drafts, and hits and
 * drafts inside the sequence per draft, for anchors_per_seq anchors. */
typedef struct anchor_buf {
  int32_t *anc, *accept, *pred;
  int64_t *hits, *scored;
} anchor_buf;

static void anchor_buf_free(anchor_buf *b) {
  free(b->anc), free(b->accept), free(b->pred), free(b->hits), free(b->scored);
}

static dflash_status anchor_buf_alloc(int nd, int32_t n, anchor_buf *b) {
  memset(b, 0, sizeof *b);
  b->anc = malloc(sizeof(int32_t) * (size_t)n);
  b->accept = malloc(sizeof(int32_t) * (size_t)n);
  b->pred = malloc(sizeof(int32_t) * (size_t)n * (size_t)nd);
  b->hits = calloc((size_t)nd, sizeof *b->hits);
  b->scored = calloc((size_t)nd, sizeof *b->scored);
  if (b->anc && b->accept && b->pred && b->hits && b->scored) return DFLASH_OK;
  anchor_buf_free(b);
  memset(b, 0, sizeof *b);
  return df_error_nomem("evaluation");
}

/* One sample at its drawn anchors (the training rule: DSpark's lets a block leave the
 * sequence): their acceptance into tau_sum and blocks, per-draft hits. */
static dflash_status eval_sample(dflash_trainer *t, const dflash_eval *e, dflash_sample *smp,
                                 anchor_buf *b, double *tau_sum, int64_t *blocks) {
  int nd = n_drafts(t);
  dflash_status st = df_anchors_sample_cfg(&t->m.cfg, smp->loss_mask, smp->len, e->anchors_per_seq,
                                           e->seed, smp->index, b->anc, &smp->n_anchors);
  smp->anchors = b->anc;
  if (!st) st = drafts(t, smp, b->pred);
  if (st) return st;
  count_accept(nd, smp->input_ids, smp->len, b->anc, smp->n_anchors, b->pred, b->accept);
  for (int32_t a = 0; a < smp->n_anchors; a++) {
    *tau_sum += 1 + b->accept[a];
    (*blocks)++;
    for (int j = 0; j < nd && (int64_t)b->anc[a] + j + 1 < smp->len; j++) {
      b->hits[j] += b->pred[(size_t)a * nd + j] == smp->input_ids[b->anc[a] + j + 1];
      b->scored[j]++;
    }
  }
  return DFLASH_OK;
}

/* dflash_trainer_eval on the library's struct. */
static dflash_status eval_sampled(dflash_trainer *t, const char *data_dir, const char *hidden_dir,
                                  dflash_eval *e) {
  dflash_sample_stream *s;
  dflash_status st = stream_all(t, data_dir, hidden_dir, &s);
  if (st) return st;
  int nd = n_drafts(t);
  anchor_buf b;
  st = anchor_buf_alloc(nd, e->anchors_per_seq, &b);
  double tau_sum = 0;
  int64_t blocks = 0;
  for (;;) {
    dflash_sample smp = {.struct_size = sizeof smp};
    int32_t done;
    if (st || (st = dflash_sample_stream_next(s, &smp, &done)) || done) break;
    st = eval_sample(t, e, &smp, &b, &tau_sum, &blocks);
  }
  if (!st) {
    e->tau = blocks ? tau_sum / (double)blocks : 0;
    for (int j = 0; e->accuracy && j < nd; j++)
      e->accuracy[j] = b.scored[j] ? (double)b.hits[j] / (double)b.scored[j] : 0;
    e->n_blocks = blocks;
  }
  anchor_buf_free(&b);
  dflash_sample_stream_free(s);
  return st;
}

dflash_status dflash_trainer_eval(dflash_trainer *t, const char *data_dir, const char *hidden_dir,
                                  dflash_eval *out) {
  DF_CHECK_ARG(t && data_dir && hidden_dir && out);
  dflash_eval e;
  dflash_eval_default(&e);
  dflash_status st = df_opts_in(&e, out, sizeof e, "dflash_eval");
  if (st) return st;
  if (e.anchors_per_seq <= 0)
    return df_error(DFLASH_E_INVALID_ARG, "eval: anchors_per_seq %d (must be > 0)",
                    e.anchors_per_seq);
  st = eval_sampled(t, data_dir, hidden_dir, &e);
  dflash_status o = df_opts_out(out, &e, sizeof e, "dflash_eval");
  return st ? st : o;
}

/* ---- the speculative walk -------------------------------------------------- */

/* End of the supervised run that starts at s, cut to max_tokens. */
static int64_t run_end(const uint8_t *mask, int64_t len, int64_t s, int32_t max_tokens) {
  int64_t e = s;
  while (e < len && mask[e]) e++;
  return max_tokens > 0 && e - s > max_tokens ? s + max_tokens : e;
}

/* Per draft j of the anchors scored: the drafted token's hits, the drafts inside the run
 * (the denominator), the plain argmax's hits and the true token among the candidates
 * (DFlash 2). */
enum { HIT_DRAFT, HIT_SCORED, HIT_ARGMAX, HIT_CAND, HIT_KINDS };

/* Bins of the confidence head's expected calibration error. */
enum { ECE_BINS = 10 };

/* What a DSpark walk keeps beyond the acceptance, per position p of the sample (each NULL
 * when not asked): the confidence at each slot of the block anchored at p, conf [len, B],
 * and the block's probabilistic tau, ptau [len] (needs `final`, the target's final state). */
typedef struct dspark_io {
  const float *final;
  float *conf;
  double *ptau;
} dspark_io;

/* Scratch of one run_accept call: EVAL_CHUNK anchors' worth. */
typedef struct eval_buf {
  int32_t *anc, *pred, *argmax, *cand;
  dflash_propose_outputs o; /* DFlash 2: argmax and candidates with the drafts */
} eval_buf;

static void eval_buf_free(eval_buf *b) {
  free(b->anc), free(b->pred), free(b->argmax), free(b->cand);
}

static dflash_status eval_buf_alloc(const dflash_trainer *t, eval_buf *b) {
  size_t n = EVAL_CHUNK * (size_t)n_drafts(t), K = (size_t)t->m.ext.selector_top_k;
  memset(b, 0, sizeof *b);
  b->anc = malloc(sizeof(int32_t) * EVAL_CHUNK);
  b->pred = malloc(sizeof(int32_t) * n);
  if (t->m.dflash2) {
    b->argmax = malloc(sizeof(int32_t) * n);
    b->cand = malloc(sizeof(int32_t) * n * K);
    b->o = (dflash_propose_outputs){.struct_size = sizeof b->o,
                                    .argmax = b->argmax,
                                    .candidates = b->cand};
  }
  if (b->anc && b->pred && (!t->m.dflash2 || (b->argmax && b->cand))) return DFLASH_OK;
  eval_buf_free(b);
  return df_error_nomem("speculative walk");
}

/* Add anchor i's per-draft hits (`hits` [HIT_KINDS, nd]). */
static void add_hits(const dflash_trainer *t, const eval_buf *b, int32_t i, const int32_t *ids,
                     int64_t e, int64_t *hits) {
  int nd = n_drafts(t), K = t->m.ext.selector_top_k;
  size_t n = (size_t)nd;
  for (int j = 0; j < nd && (int64_t)b->anc[i] + j + 1 < e; j++) {
    size_t at = (size_t)i * n + (size_t)j;
    int32_t y = ids[b->anc[i] + j + 1];
    bool draft = b->pred[at] == y, cand = false;
    for (int c = 0; b->cand && c < K; c++) cand |= b->cand[at * (size_t)K + (size_t)c] == y;
    hits[HIT_DRAFT * n + j] += draft;
    hits[HIT_SCORED * n + j]++;
    hits[HIT_ARGMAX * n + j] += b->argmax ? b->argmax[at] == y : draft;
    hits[HIT_CAND * n + j] += cand;
  }
}

/* The drafts at the anchors of q: DSpark's chain with its extras (dx, may be NULL; written
 * at the anchors' rows from `at` on), else dflash_trainer_propose. */
static dflash_status chunk_drafts(dflash_trainer *t, const dflash_sample *q, eval_buf *b,
                                  bool extras, const dspark_io *dx, int64_t at) {
  if (!t->m.dspark)
    return dflash_trainer_propose(t, q, NULL, b->pred, extras && t->m.dflash2 ? &b->o : NULL);
  /* The float32 reference on the host copy of the parameters, as dflash_trainer_propose's
   * extras (on CUDA pulled from the device first; the chain runs on the host). */
  dflash_status st = df_trainer_pull(t, DF_BUF_PARAMS);
  if (st) return st;
  float *conf = dx && dx->conf ? dx->conf + (size_t)at * (size_t)t->m.B : NULL;
  double *ptau = dx && dx->ptau ? dx->ptau + at : NULL;
  return df_model_dspark_eval(&t->m, q->input_ids, q->len, q->hidden, dx ? dx->final : NULL,
                              q->anchors, q->n_anchors, b->pred, conf, ptau);
}

/* Acceptance at anchors [s, e-1) of one run, counting stops at e, into
 * accept[]; per-draft hits into `hits` (may be NULL). */
static dflash_status run_accept(dflash_trainer *t, const int32_t *ids, const int32_t *lab,
                                const float *hidden, int64_t s, int64_t e, eval_buf *b,
                                const dspark_io *dx, int32_t *accept, int64_t *hits) {
  for (int64_t p0 = s; p0 < e - 1; p0 += EVAL_CHUNK) {
    int32_t n = (int32_t)(e - 1 - p0 < EVAL_CHUNK ? e - 1 - p0 : EVAL_CHUNK);
    for (int32_t i = 0; i < n; i++) b->anc[i] = (int32_t)(p0 + i);
    /* Passing e as the length stops the count at the run's end; the
     * context (strictly before each anchor) lies inside it too. The
     * selector's extras only when they are counted. */
    dflash_sample q = {.struct_size = sizeof q,
                       .input_ids = ids,
                       .len = e,
                       .hidden = hidden,
                       .anchors = b->anc,
                       .n_anchors = n};
    dflash_status st = chunk_drafts(t, &q, b, hits != NULL, dx, p0);
    if (st) return st;
    count_accept(n_drafts(t), lab, e, b->anc, n, b->pred, accept + p0);
    for (int32_t i = 0; hits && i < n; i++) add_hits(t, b, i, lab, e, hits);
  }
  return DFLASH_OK;
}

/* The confidence head against the walk: per draft j, the predicted acceptance summed
 * (pred), the accepted (obs) and the slots (n) over the steps that reached slot j, and the
 * same in ECE_BINS bins of predicted acceptance. */
typedef struct calib {
  double *pred, *obs;
  int64_t *n;
  double bin_pred[ECE_BINS], bin_obs[ECE_BINS];
  int64_t bin_n[ECE_BINS];
} calib;

/* A walk step at p of run [s, e): the slots j it reached (the drafts before j all
 * accepted, p + j + 1 inside the run), each accepted when j < accept[p]. */
static void calib_step(calib *c, const float *conf, int B, const int32_t *accept, int64_t p,
                       int64_t e) {
  for (int j = 0; j < B && j <= accept[p] && p + j + 1 < e; j++) {
    double q = conf[(size_t)p * (size_t)B + (size_t)j];
    double ok = j < accept[p];
    int bin = (int)(q * ECE_BINS);
    bin = bin < 0 ? 0 : bin >= ECE_BINS ? ECE_BINS - 1 : bin;
    c->pred[j] += q, c->obs[j] += ok, c->n[j]++;
    c->bin_pred[bin] += q, c->bin_obs[bin] += ok, c->bin_n[bin]++;
  }
}

/* Chain the anchors of run [s, e) through accept[]: tokens and steps (step_hist [nd + 1]:
 * gains 1..nd + 1); the steps' slots into c (may be NULL) from conf [len, B]. */
static void run_walk(const int32_t *accept, int64_t s, int64_t e, int nd, int64_t *tokens,
                     int64_t *steps, int64_t *step_hist, calib *c, const float *conf, int B) {
  for (int64_t p = s; p < e - 1;) {
    int64_t gain = accept[p] + 1 < e - 1 - p ? accept[p] + 1 : e - 1 - p;
    if (step_hist) step_hist[(gain < nd + 1 ? gain : nd + 1) - 1]++;
    if (c && conf) calib_step(c, conf, B, accept, p, e);
    *tokens += gain;
    (*steps)++;
    p += gain;
  }
}

/* dflash_trainer_walk with per-draft hits and DSpark's extras (dx, c: may be NULL) for the
 * dataset evaluation; drafts are compared with lab (the target's greedy tokens, labels
 * target) or, NULL, with ids. */
static dflash_status walk(dflash_trainer *t, const int32_t *ids, const int32_t *lab,
                          const uint8_t *mask, int64_t len, const float *hidden, int32_t max_tokens,
                          int64_t *tokens, int64_t *steps, int32_t *accept, int64_t *step_hist,
                          int64_t *hits, const dspark_io *dx, calib *c) {
  int32_t *acc = accept ? accept : malloc(sizeof(int32_t) * (size_t)(len ? len : 1));
  eval_buf b;
  dflash_status st = eval_buf_alloc(t, &b);
  if (!st && !acc) {
    eval_buf_free(&b);
    st = df_error_nomem("speculative walk");
  }
  if (st) {
    if (acc != accept) free(acc);
    return st;
  }
  *tokens = *steps = 0;
  for (int64_t i = 0; !st && i < len; i++) acc[i] = -1;
  for (int64_t s = 0; !st && s < len;) {
    if (!mask[s]) {
      s++;
      continue;
    }
    int64_t e = run_end(mask, len, s, max_tokens);
    st = run_accept(t, ids, lab ? lab : ids, hidden, s, e, &b, dx, acc, hits);
    if (!st)
      run_walk(acc, s, e, n_drafts(t), tokens, steps, step_hist, c, dx ? dx->conf : NULL, t->m.B);
    s = e;
    while (s < len && mask[s]) s++; /* the rest of a run cut by max_tokens */
  }
  if (acc != accept) free(acc);
  eval_buf_free(&b);
  return st;
}

dflash_status dflash_trainer_walk(dflash_trainer *t, const dflash_sample *caller,
                                  int32_t max_tokens, int64_t *tokens, int64_t *steps,
                                  int32_t *accept, int64_t *step_hist) {
  DF_CHECK_ARG(t && tokens && steps && max_tokens >= 0);
  dflash_sample s;
  const float *hidden = NULL;
  dflash_status st = df_sample_in(caller, &s);
  if (!st) st = df_sample_floats(t, &s, &hidden);
  if (st) return st;
  DF_CHECK_ARG(s.loss_mask);
  return walk(t, s.input_ids, NULL, s.loss_mask, s.len, hidden, max_tokens, tokens, steps, accept,
              step_hist, NULL, NULL, NULL);
}

static void eval_walk_defaults(dflash_eval_walk *w) {
  if (!w) return;
  memset(w, 0, sizeof *w);
  w->struct_size = sizeof *w;
  w->prob_tau = w->prob_tau_se = w->conf_ece = -1;
}

DF_DEFINE_INIT(dflash_eval_walk, eval_walk_defaults)

/* Sums over sequences of x_i and n_i (and their squares and product) give
 * the ratio R = sum x / sum n and its delta-method standard error
 * sqrt(sum (x_i - R n_i)^2 / (m (m-1))) / mean n. */
typedef struct ratio {
  double x, n, xx, nn, xn;
  int64_t m;
} ratio;

static void ratio_add(ratio *r, double x, double n) {
  r->x += x, r->n += n, r->xx += x * x, r->nn += n * n, r->xn += x * n;
  r->m++;
}

static void ratio_get(const ratio *r, double *value, double *se) {
  double R = r->n > 0 ? r->x / r->n : 0;
  *value = R;
  *se = 0;
  if (r->m < 2 || r->n <= 0) return;
  double ss = r->xx - 2 * R * r->xn + R * R * r->nn; /* sum (x_i - R n_i)^2 */
  double mean_n = r->n / (double)r->m;
  *se = sqrt((ss > 0 ? ss : 0) / ((double)r->m * (double)(r->m - 1))) / mean_n;
}

/* Add one sample's walk and per-position acceptance (and DSpark's probabilistic tau at the
 * same positions: ptau, may be NULL) to the totals. */
static void eval_add(dflash_eval_walk *w, ratio *wr, ratio *pr, ratio *qr, const int32_t *accept,
                     const double *ptau, int64_t len, int64_t tokens, int64_t steps) {
  double x = 0, n = 0, xp = 0;
  for (int64_t p = 0; p < len; p++)
    if (accept[p] >= 0) x += 1 + accept[p], n++, xp += ptau ? ptau[p] : 0;
  if (n > 0) ratio_add(pr, x, n);
  if (n > 0 && ptau) ratio_add(qr, xp, n);
  if (steps > 0) ratio_add(wr, (double)tokens, (double)steps), w->sequences++;
  w->tokens += tokens, w->steps += steps, w->positions += (int64_t)n;
}

/* The appended totals over every draft scored. */
static void eval_totals(const dflash_trainer *t, const int64_t *hits, size_t n,
                        dflash_eval_walk *w) {
  int64_t sum[HIT_KINDS] = {0};
  for (int h = 0; h < HIT_KINDS; h++)
    for (size_t k = 0; k < n; k++) sum[h] += hits[(size_t)h * n + k];
  double d = sum[HIT_SCORED] > 0 ? (double)sum[HIT_SCORED] : 1;
  w->scored = sum[HIT_SCORED];
  w->selector_accuracy = (double)sum[HIT_DRAFT] / d;
  w->backbone_accuracy = (double)sum[HIT_ARGMAX] / d;
  w->candidate_recall = t->m.dflash2 ? (double)sum[HIT_CAND] / d : -1;
}

/* The confidence head's results from c: per-slot means into the caller's arrays, and the
 * ECE (-1 without a slot). */
static void calib_out(const calib *c, int B, dflash_eval_walk *w) {
  int64_t all = 0;
  double gap = 0;
  for (int b = 0; b < ECE_BINS; b++)
    all += c->bin_n[b], gap += fabs(c->bin_pred[b] - c->bin_obs[b]);
  w->conf_ece = all > 0 ? gap / (double)all : -1;
  for (int j = 0; j < B; j++) {
    double n = (double)c->n[j];
    if (w->conf_predicted) w->conf_predicted[j] = n > 0 ? c->pred[j] / n : 0;
    if (w->conf_observed) w->conf_observed[j] = n > 0 ? c->obs[j] / n : 0;
    if (w->conf_count) w->conf_count[j] = c->n[j];
  }
}

/* The caller's struct is read (its inputs) and written (its outputs) at its own size, the
 * walk itself done on a struct of the library's. */
static dflash_status eval_walk(dflash_trainer *t, const char *data_dir, const char *hidden_dir,
                               dflash_eval_walk *w);

dflash_status dflash_trainer_eval_walk(dflash_trainer *t, const char *data_dir,
                                       const char *hidden_dir, dflash_eval_walk *out) {
  DF_CHECK_ARG(t && data_dir && hidden_dir && out);
  dflash_eval_walk w;
  dflash_eval_walk_default(&w);
  dflash_status st = df_opts_in(&w, out, sizeof w, "dflash_eval_walk");
  if (st) return st;
  DF_CHECK_ARG(w.max_tokens >= 0);
  if (w.labels != DFLASH_TRAIN_LABELS_DATA && w.labels != DFLASH_TRAIN_LABELS_TARGET)
    return df_error(DFLASH_E_INVALID_ARG, "eval walk: labels %d is neither data (0) nor target (1)",
                    w.labels);
  st = eval_walk(t, data_dir, hidden_dir, &w);
  dflash_status o = df_opts_out(out, &w, sizeof w, "dflash_eval_walk");
  return st ? st : o;
}

/* labels target: lab[p] = the target's greedy token after p-1 (what greedy verification
 * accepts at p); lab[0] is never compared (blocks start after an anchor). */
static dflash_status target_labels(const dflash_sample *smp, const char *hidden_dir, int32_t *lab) {
  if (!smp->target_ids)
    return df_error(DFLASH_E_NOT_FOUND,
                    "eval labels target: sample %s in %s carries no target ids (a store "
                    "written with HiddenWriter.append(..., target_ids=...); vLLM's files are "
                    "not read for it yet)",
                    smp->id, hidden_dir);
  lab[0] = smp->input_ids[0];
  memcpy(lab + 1, smp->target_ids, (size_t)(smp->len - 1) * sizeof *lab);
  return DFLASH_OK;
}

/* Per-sample buffers of eval_walk, grown to the longest sample: acceptance and labels [len],
 * DSpark's confidence [len, B] and probabilistic tau [len]. */
typedef struct walk_buf {
  int32_t *accept, *lab;
  float *conf;
  double *ptau;
  int64_t cap;
} walk_buf;

static dflash_status walk_buf_grow(walk_buf *b, int64_t len, int B, bool dspark) {
  if (len <= b->cap) return DFLASH_OK;
  free(b->accept), free(b->lab), free(b->conf), free(b->ptau);
  b->accept = malloc(sizeof(int32_t) * (size_t)len);
  b->lab = malloc(sizeof(int32_t) * (size_t)len);
  b->conf = dspark ? malloc(sizeof(float) * (size_t)len * (size_t)B) : NULL;
  b->ptau = dspark ? malloc(sizeof(double) * (size_t)len) : NULL;
  b->cap = len;
  if (b->accept && b->lab && (!dspark || (b->conf && b->ptau))) return DFLASH_OK;
  b->cap = 0;
  return df_error_nomem("acceptance per position");
}

static dflash_status eval_walk(dflash_trainer *t, const char *data_dir, const char *hidden_dir,
                               dflash_eval_walk *w) {
  dflash_sample_stream *s;
  dflash_status st = stream_all(t, data_dir, hidden_dir, &s);
  if (st) return st;
  int B = t->m.B, nd = n_drafts(t);
  bool dspark = t->m.dspark, conf = dspark && t->m.ext.confidence_head;
  /* the probabilistic tau while every sample carries the target's final state */
  bool final_all = dspark;
  int64_t *hits = calloc(HIT_KINDS * (size_t)nd, sizeof *hits);
  calib c = {.pred = calloc((size_t)B, sizeof(double)),
             .obs = calloc((size_t)B, sizeof(double)),
             .n = calloc((size_t)B, sizeof(int64_t))};
  walk_buf wb = {0};
  bool target = w->labels == DFLASH_TRAIN_LABELS_TARGET;
  if (!hits || !c.pred || !c.obs || !c.n) st = df_error_nomem("evaluation");
  w->sequences = w->steps = w->tokens = w->positions = 0;
  if (w->step_hist) memset(w->step_hist, 0, sizeof(int64_t) * (size_t)(nd + 1));
  ratio wr = {0}, pr = {0}, qr = {0};
  for (;;) {
    dflash_sample smp = {.struct_size = sizeof smp};
    int32_t done;
    if (st || (st = dflash_sample_stream_next(s, &smp, &done)) || done) break;
    if ((st = walk_buf_grow(&wb, smp.len, B, dspark))) break;
    if (target && smp.len > 0 && (st = target_labels(&smp, hidden_dir, wb.lab))) break;
    final_all &= smp.target_final != NULL;
    dspark_io dx = {.final = final_all ? smp.target_final : NULL,
                    .conf = conf ? wb.conf : NULL,
                    .ptau = final_all ? wb.ptau : NULL};
    int64_t tokens, steps;
    st = walk(t, smp.input_ids, target ? wb.lab : NULL, smp.loss_mask, smp.len, smp.hidden,
              w->max_tokens, &tokens, &steps, wb.accept, w->step_hist, hits, dspark ? &dx : NULL,
              conf ? &c : NULL);
    if (!st) eval_add(w, &wr, &pr, &qr, wb.accept, dx.ptau, smp.len, tokens, steps);
  }
  if (!st) {
    ratio_get(&wr, &w->walk_tau, &w->walk_tau_se);
    ratio_get(&pr, &w->position_tau, &w->position_tau_se);
    w->prob_tau = w->prob_tau_se = -1;
    if (final_all && qr.m > 0) ratio_get(&qr, &w->prob_tau, &w->prob_tau_se);
    size_t n = (size_t)nd;
    for (size_t k = 0; w->accuracy && k < n; k++)
      w->accuracy[k] = hits[HIT_SCORED * n + k]
                           ? (double)hits[HIT_DRAFT * n + k] / (double)hits[HIT_SCORED * n + k]
                           : 0;
    eval_totals(t, hits, n, w);
    w->conf_ece = -1;
    if (conf) calib_out(&c, B, w);
  }
  free(hits), free(c.pred), free(c.obs), free(c.n);
  free(wb.accept), free(wb.lab), free(wb.conf), free(wb.ptau);
  dflash_sample_stream_free(s);
  return st;
}
