/*
 * Held-out evaluation of a drafter: acceptance at given anchors, the mean
 * over sampled anchors (dflash_trainer_eval), and the speculative walk
 * (dflash_trainer_walk, dflash_trainer_eval_walk) that chains anchors the way
 * live greedy speculative decoding does, so its tau = tokens / steps is the
 * number a live run measures.
 */
#include <dflash/hidden.h>
#include <dflash/run.h>
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "store_layers.h"
#include "trainer.h"

/* Anchors per propose call: bounds the block activations and logits held at
 * once (a block of B positions times the vocabulary chunk each). */
enum { EVAL_CHUNK = 64 };

/* Leading drafts equal to input_ids (counting stops at len): accept[i]. */
static void count_accept(int B, const int32_t *ids, int64_t len, const int32_t *anchors, int32_t n,
                         const int32_t *p, int32_t *accept) {
  for (int32_t i = 0; i < n; i++) {
    int k = 1;
    while (k < B && anchors[i] + k < len && p[(size_t)i * (B - 1) + k - 1] == ids[anchors[i] + k])
      k++;
    accept[i] = k - 1;
  }
}

/* Greedy drafts at a checked sample's anchors into pred [n_anchors, B-1]. */
static dflash_status drafts(dflash_trainer *t, const dflash_sample *s, int32_t *pred) {
  return dflash_trainer_propose(t, s, NULL, pred, NULL);
}

/* Why evaluation refuses a DSpark drafter (df_dspark_unsupported). */
#define DSPARK_EVAL "acceptance and the walk count DFlash's B - 1 drafts a block, not DSpark's B"

dflash_status dflash_trainer_acceptance(dflash_trainer *t, const dflash_sample *caller,
                                        int32_t *accept) {
  DF_CHECK_ARG(t && accept);
  dflash_sample s;
  dflash_status st = df_dspark_unsupported(&t->m.ext, "acceptance", DSPARK_EVAL);
  if (!st) st = df_sample_in(caller, &s);
  if (st) return st;
  DF_CHECK_ARG(s.input_ids);
  int B = t->m.B;
  int32_t *p = malloc(sizeof(int32_t) * (size_t)(s.n_anchors ? s.n_anchors : 1) * (B - 1));
  if (!p) return df_error_nomem("predictions");
  if (!(st = drafts(t, &s, p)))
    count_accept(B, s.input_ids, s.len, s.anchors, s.n_anchors, p, accept);
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

/* Sampled-anchor scratch of dflash_trainer_eval: anchors, acceptance, drafts and hits per
 * block position, for anchors_per_seq anchors. */
typedef struct anchor_buf {
  int32_t *anc, *accept, *pred;
  int64_t *hits;
} anchor_buf;

static void anchor_buf_free(anchor_buf *b) {
  free(b->anc), free(b->accept), free(b->pred), free(b->hits);
}

static dflash_status anchor_buf_alloc(int B, int32_t n, anchor_buf *b) {
  memset(b, 0, sizeof *b);
  b->anc = malloc(sizeof(int32_t) * (size_t)n);
  b->accept = malloc(sizeof(int32_t) * (size_t)n);
  b->pred = malloc(sizeof(int32_t) * (size_t)n * (size_t)(B - 1));
  b->hits = calloc((size_t)B, sizeof *b->hits);
  if (b->anc && b->accept && b->pred && b->hits) return DFLASH_OK;
  anchor_buf_free(b);
  memset(b, 0, sizeof *b);
  return df_error_nomem("evaluation");
}

/* One sample at its drawn anchors: their acceptance into tau_sum and blocks, per-position hits. */
static dflash_status eval_sample(dflash_trainer *t, const dflash_eval *e, dflash_sample *smp,
                                 anchor_buf *b, double *tau_sum, int64_t *blocks) {
  int B = t->m.B;
  dflash_status st = dflash_anchors_sample(smp->loss_mask, smp->len, B, e->anchors_per_seq, e->seed,
                                           smp->index, b->anc, &smp->n_anchors);
  smp->anchors = b->anc;
  if (!st) st = drafts(t, smp, b->pred);
  if (st) return st;
  count_accept(B, smp->input_ids, smp->len, b->anc, smp->n_anchors, b->pred, b->accept);
  for (int32_t a = 0; a < smp->n_anchors; a++) {
    *tau_sum += 1 + b->accept[a];
    (*blocks)++;
    for (int k = 1; k < B; k++)
      b->hits[k - 1] += b->pred[(size_t)a * (B - 1) + k - 1] == smp->input_ids[b->anc[a] + k];
  }
  return DFLASH_OK;
}

/* dflash_trainer_eval on the library's struct. */
static dflash_status eval_sampled(dflash_trainer *t, const char *data_dir, const char *hidden_dir,
                                  dflash_eval *e) {
  dflash_sample_stream *s;
  dflash_status st = stream_all(t, data_dir, hidden_dir, &s);
  if (st) return st;
  int B = t->m.B;
  anchor_buf b;
  st = anchor_buf_alloc(B, e->anchors_per_seq, &b);
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
    for (int k = 0; e->accuracy && k < B - 1; k++)
      e->accuracy[k] = blocks ? (double)b.hits[k] / (double)blocks : 0;
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
  dflash_status st = df_dspark_unsupported(&t->m.ext, "eval", DSPARK_EVAL);
  if (!st) st = df_opts_in(&e, out, sizeof e, "dflash_eval");
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

/* Per block position k (index k-1) of the anchors scored: the drafted
 * token's hits, the positions inside the run (the denominator), the plain
 * argmax's hits and the true token among the candidates (DFlash 2). */
enum { HIT_DRAFT, HIT_SCORED, HIT_ARGMAX, HIT_CAND, HIT_KINDS };

/* Scratch of one run_accept call: EVAL_CHUNK anchors' worth. */
typedef struct eval_buf {
  int32_t *anc, *pred, *argmax, *cand;
  dflash_propose_outputs o; /* DFlash 2: argmax and candidates with the drafts */
} eval_buf;

static void eval_buf_free(eval_buf *b) {
  free(b->anc), free(b->pred), free(b->argmax), free(b->cand);
}

static dflash_status eval_buf_alloc(const dflash_trainer *t, eval_buf *b) {
  size_t n = EVAL_CHUNK * (size_t)(t->m.B - 1), K = (size_t)t->m.ext.selector_top_k;
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

/* Add anchor i's per-position hits (`hits` [HIT_KINDS, B-1]). */
static void add_hits(const dflash_trainer *t, const eval_buf *b, int32_t i, const int32_t *ids,
                     int64_t e, int64_t *hits) {
  int B = t->m.B, K = t->m.ext.selector_top_k;
  size_t n = (size_t)(B - 1);
  for (int k = 1; k < B && b->anc[i] + k < e; k++) {
    size_t at = (size_t)i * n + (size_t)k - 1;
    int32_t y = ids[b->anc[i] + k];
    bool draft = b->pred[at] == y, cand = false;
    for (int c = 0; b->cand && c < K; c++) cand |= b->cand[at * (size_t)K + (size_t)c] == y;
    hits[HIT_DRAFT * n + k - 1] += draft;
    hits[HIT_SCORED * n + k - 1]++;
    hits[HIT_ARGMAX * n + k - 1] += b->argmax ? b->argmax[at] == y : draft;
    hits[HIT_CAND * n + k - 1] += cand;
  }
}

/* Acceptance at anchors [s, e-1) of one run, counting stops at e, into
 * accept[]; per-position hits into `hits` (may be NULL). */
static dflash_status run_accept(dflash_trainer *t, const int32_t *ids, const int32_t *lab,
                                const float *hidden, int64_t s, int64_t e, eval_buf *b,
                                int32_t *accept, int64_t *hits) {
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
    dflash_status st = dflash_trainer_propose(t, &q, NULL, b->pred,
                                              hits && t->m.dflash2 ? &b->o : NULL);
    if (st) return st;
    count_accept(t->m.B, lab, e, b->anc, n, b->pred, accept + p0);
    for (int32_t i = 0; hits && i < n; i++) add_hits(t, b, i, lab, e, hits);
  }
  return DFLASH_OK;
}

/* Chain the anchors of run [s, e) through accept[]: tokens and steps. */
static void run_walk(const int32_t *accept, int64_t s, int64_t e, int B, int64_t *tokens,
                     int64_t *steps, int64_t *step_hist) {
  for (int64_t p = s; p < e - 1;) {
    int64_t gain = accept[p] + 1 < e - 1 - p ? accept[p] + 1 : e - 1 - p;
    if (step_hist) step_hist[(gain < B ? gain : B) - 1]++;
    *tokens += gain;
    (*steps)++;
    p += gain;
  }
}

/* dflash_trainer_walk with per-position hits for the dataset evaluation; drafts are compared
 * with lab (the target's greedy tokens, labels target) or, NULL, with ids. */
static dflash_status walk(dflash_trainer *t, const int32_t *ids, const int32_t *lab,
                          const uint8_t *mask, int64_t len, const float *hidden, int32_t max_tokens,
                          int64_t *tokens, int64_t *steps, int32_t *accept, int64_t *step_hist,
                          int64_t *hits) {
  int B = t->m.B;
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
    st = run_accept(t, ids, lab ? lab : ids, hidden, s, e, &b, acc, hits);
    if (!st) run_walk(acc, s, e, B, tokens, steps, step_hist);
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
  dflash_status st = df_dspark_unsupported(&t->m.ext, "walk", DSPARK_EVAL);
  if (!st) st = df_sample_in(caller, &s);
  if (!st) st = df_sample_floats(t, &s, &hidden);
  if (st) return st;
  DF_CHECK_ARG(s.loss_mask);
  return walk(t, s.input_ids, NULL, s.loss_mask, s.len, hidden, max_tokens, tokens, steps, accept,
              step_hist, NULL);
}

static void eval_walk_defaults(dflash_eval_walk *w) {
  if (!w) return;
  memset(w, 0, sizeof *w);
  w->struct_size = sizeof *w;
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

/* Add one sample's walk and per-position acceptance to the totals. */
static void eval_add(dflash_eval_walk *w, ratio *wr, ratio *pr, const int32_t *accept, int64_t len,
                     int64_t tokens, int64_t steps) {
  double x = 0, n = 0;
  for (int64_t p = 0; p < len; p++)
    if (accept[p] >= 0) x += 1 + accept[p], n++;
  if (n > 0) ratio_add(pr, x, n);
  if (steps > 0) ratio_add(wr, (double)tokens, (double)steps), w->sequences++;
  w->tokens += tokens, w->steps += steps, w->positions += (int64_t)n;
}

/* The appended totals over every block position scored. */
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

/* The caller's struct is read (its inputs) and written (its outputs) at its own size, the
 * walk itself done on a struct of the library's. */
static dflash_status eval_walk(dflash_trainer *t, const char *data_dir, const char *hidden_dir,
                               dflash_eval_walk *w);

dflash_status dflash_trainer_eval_walk(dflash_trainer *t, const char *data_dir,
                                       const char *hidden_dir, dflash_eval_walk *out) {
  DF_CHECK_ARG(t && data_dir && hidden_dir && out);
  dflash_eval_walk w;
  dflash_eval_walk_default(&w);
  dflash_status st = df_dspark_unsupported(&t->m.ext, "eval walk", DSPARK_EVAL);
  if (!st) st = df_opts_in(&w, out, sizeof w, "dflash_eval_walk");
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

static dflash_status eval_walk(dflash_trainer *t, const char *data_dir, const char *hidden_dir,
                               dflash_eval_walk *w) {
  dflash_sample_stream *s;
  dflash_status st = stream_all(t, data_dir, hidden_dir, &s);
  if (st) return st;
  int B = t->m.B;
  int64_t *hits = calloc(HIT_KINDS * (size_t)B, sizeof *hits);
  int32_t *accept = NULL, *lab = NULL;
  int64_t cap = 0;
  bool target = w->labels == DFLASH_TRAIN_LABELS_TARGET;
  if (!hits) st = df_error_nomem("evaluation");
  w->sequences = w->steps = w->tokens = w->positions = 0;
  if (w->step_hist) memset(w->step_hist, 0, sizeof(int64_t) * (size_t)B);
  ratio wr = {0}, pr = {0};
  for (;;) {
    dflash_sample smp = {.struct_size = sizeof smp};
    int32_t done;
    if (st || (st = dflash_sample_stream_next(s, &smp, &done)) || done) break;
    if (smp.len > cap) {
      int32_t *grown = realloc(accept, sizeof(int32_t) * (size_t)smp.len);
      if (grown) accept = grown;
      int32_t *grown_lab = grown ? realloc(lab, sizeof(int32_t) * (size_t)smp.len) : NULL;
      if (grown_lab) lab = grown_lab;
      if (!grown || !grown_lab) {
        st = df_error_nomem("acceptance per position");
        break;
      }
      cap = smp.len;
    }
    if (target && smp.len > 0 && (st = target_labels(&smp, hidden_dir, lab))) break;
    int64_t tokens, steps;
    st = walk(t, smp.input_ids, target ? lab : NULL, smp.loss_mask, smp.len, smp.hidden,
              w->max_tokens, &tokens, &steps, accept, w->step_hist, hits);
    if (!st) eval_add(w, &wr, &pr, accept, smp.len, tokens, steps);
  }
  if (!st) {
    ratio_get(&wr, &w->walk_tau, &w->walk_tau_se);
    ratio_get(&pr, &w->position_tau, &w->position_tau_se);
    size_t n = (size_t)(B - 1);
    for (size_t k = 0; w->accuracy && k < n; k++)
      w->accuracy[k] = hits[HIT_SCORED * n + k]
                           ? (double)hits[HIT_DRAFT * n + k] / (double)hits[HIT_SCORED * n + k]
                           : 0;
    eval_totals(t, hits, n, w);
  }
  free(hits), free(accept), free(lab);
  dflash_sample_stream_free(s);
  return st;
}
