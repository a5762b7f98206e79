/* The per-server concurrency controller (see ctl.h for why it climbs the rate).
 *
 * Cycle: START doubles the limit while each doubling raises the rate by more
 * than START_GAIN; then BASE measures the held limit, UP tries limit + step,
 * DOWN limit - step. A better UP is kept and the step grows (so a knee that
 * moves is followed quickly); a DOWN that keeps the rate within DOWN_LOSS is
 * kept too (fewer streams for the same rate: less KV pressure, shorter
 * latency); a probe that loses halves the step. Every cycle re-measures the
 * base, so a slow drift of the workload never compares stale rates. */
#include "ctl.h"

#include <math.h>
#include <string.h>

#define START_GAIN 0.15  /* a doubling must raise the rate this much to go on */
#define START_LINEAR 0.8 /* a rate that grows this near linearly quadruples the next step */
#define UP_GAIN 0.02     /* an UP probe must beat the base by this much */
#define DOWN_LOSS 0.01   /* a DOWN probe may lose this much and still be kept */
#define QUEUE_FRAC 0.1   /* a reported queue over this fraction of the limit: more only wait */
/* Blind, a stream counts as queued until its first token, which every short
 * request spends a good part of its life doing: only half of them is a queue. */
#define BLIND_QUEUE_FRAC 0.5
#define WINDOW_TOKENS 8 /* a window counts at least this many tokens per stream */
/* Probes near the best are judged over LIFE_WINDOW request lifetimes after
 * LIFE_SETTLE of one: a limit moved up shows at once (more streams decode), its
 * cost in KV pressure and preemptions only as the new requests grow. The
 * doubling at the start needs neither: a queue or a flat rate shows at once. */
#define LIFE_WINDOW 1.0
#define LIFE_SETTLE 0.5
#define LIFE_WEIGHT 0.05 /* EWMA weight of one request's lifetime */

static uint32_t clamp_limit(const df_ctl *c, double v) {
  if (v < 1) return 1;
  if (v > c->max) return c->max;
  return (uint32_t)v;
}

void df_ctl_init(df_ctl *c, uint32_t initial, uint32_t max, bool fixed, double now) {
  memset(c, 0, sizeof *c);
  c->max = max ? max : 1;
  c->limit = c->base = clamp_limit(c, initial);
  c->step = c->limit / 4 ? c->limit / 4 : 1;
  c->phase = fixed ? DF_CTL_FIXED : DF_CTL_START;
  c->window_s = 0.5;
  c->settle_s = 0.25;
  c->win_start = -1;
  c->last_tick = now;
  c->st = (df_ctl_state){-1, -1, -1, -1, -1};
  c->last_cut = -INFINITY;
}

void df_ctl_tokens(df_ctl *c, uint64_t n) {
  c->tokens_total += n;
  if (c->win_start >= 0) c->win_tokens += n;
}

void df_ctl_done(df_ctl *c, double seconds) {
  if (!(seconds >= 0)) return;
  c->life_s = c->life_s > 0 ? c->life_s + LIFE_WEIGHT * (seconds - c->life_s) : seconds;
}

/* The settle time and the window of the phase being measured. */
static double settle_time(const df_ctl *c) {
  double l = c->phase == DF_CTL_START ? 0 : LIFE_SETTLE * c->life_s;
  return l > c->settle_s ? l : c->settle_s;
}

static double window_time(const df_ctl *c) {
  double l = c->phase == DF_CTL_START ? 0 : LIFE_WINDOW * c->life_s;
  return l > c->window_s ? l : c->window_s;
}

void df_ctl_state_set(df_ctl *c, const df_ctl_state *s) {
  c->st = *s;
  c->have_state = true;
}

/* Start measuring `limit` afresh. */
static void set_limit(df_ctl *c, uint32_t limit, df_ctl_phase phase) {
  c->limit = clamp_limit(c, limit);
  c->phase = phase;
  c->held = false;
  c->win_start = -1;
  c->decisions++;
}

static uint32_t min_step(const df_ctl *c) { return c->base / 16 ? c->base / 16 : 1; }

/* At most a quarter of the base: a probe down by half would cost a third of
 * the rate for a whole window on the steep side of the hill. */
static void grow_step(df_ctl *c) {
  uint32_t cap = c->base / 4 ? c->base / 4 : 1;
  c->step = c->step * 2 < cap ? c->step * 2 : cap;
}

static void shrink_step(df_ctl *c) {
  c->step = c->step / 2 > min_step(c) ? c->step / 2 : min_step(c);
}

/* From BASE: probe up unless the server queues or the cap is reached. */
static const char *probe(df_ctl *c, bool queue) {
  if (c->step < 1) c->step = 1;
  if (!queue && c->base < c->max) {
    set_limit(c, c->base + c->step, DF_CTL_UP);
    return "probe up";
  }
  if (c->base > 1) {
    set_limit(c, c->base > c->step ? c->base - c->step : 1, DF_CTL_DOWN);
    return queue ? "server queues: probe down" : "at the cap: probe down";
  }
  set_limit(c, c->base, DF_CTL_BASE);
  return "hold";
}

static const char *decide_start(df_ctl *c, double rate, bool queue) {
  bool grew = c->prev_rate <= 0 || rate > c->prev_rate * (1 + START_GAIN);
  if (grew && c->limit < c->max) { /* the rate is the evidence, whatever queues */
    /* Far below the knee the rate grows with the streams: then the next step
     * quadruples (the start is paid in windows, and an overshoot shows at once
     * as a flat rate, which ends the start a quarter lower). */
    double k = c->base > 0 && c->limit > c->base ? (double)c->limit / c->base : 2;
    bool linear = c->prev_rate > 0 && rate >= c->prev_rate * k * START_LINEAR;
    c->prev_rate = rate;
    c->base = c->limit;
    set_limit(c, (double)c->limit * (linear ? 4 : 2), DF_CTL_START);
    return linear ? "start: rate grew with the streams, quadrupling" : "start: rate grew, doubling";
  }
  /* The best lies between the last two limits: settle in the middle of them
   * (or at the last one when it still gained something). */
  bool gained = c->prev_rate > 0 && rate > c->prev_rate * (1 + UP_GAIN);
  c->base = gained && !queue ? c->limit : clamp_limit(c, c->limit * 0.75);
  if (c->prev_rate <= 0) c->base = c->limit;
  c->step = c->base / 4 ? c->base / 4 : 1;
  set_limit(c, c->base, DF_CTL_BASE);
  return queue ? "start: the server queues" : "start: rate flat, climbing";
}

static const char *decide(df_ctl *c, double rate, bool queue) {
  switch (c->phase) {
  case DF_CTL_START: return decide_start(c, rate, queue);
  case DF_CTL_BASE: c->base_rate = rate; return probe(c, queue);
  case DF_CTL_UP:
    if (rate > c->base_rate * (1 + UP_GAIN)) {
      c->base = c->limit;
      c->base_rate = rate;
      grow_step(c);
      set_limit(c, c->base + c->step, DF_CTL_UP);
      return "up: better, climbing";
    }
    if (c->base > 1) {
      set_limit(c, c->base > c->step ? c->base - c->step : 1, DF_CTL_DOWN);
      return "up: no better, probe down";
    }
    shrink_step(c);
    set_limit(c, c->base, DF_CTL_BASE);
    return "up: no better";
  case DF_CTL_DOWN:
    if (rate >= c->base_rate * (1 - DOWN_LOSS)) {
      c->base = c->limit;
      grow_step(c);
      set_limit(c, c->base, DF_CTL_BASE);
      return "down: as good with fewer";
    }
    shrink_step(c);
    set_limit(c, c->base, DF_CTL_BASE);
    return "down: worse, back";
  default: return NULL;
  }
}

bool df_ctl_overload(df_ctl *c, double now, uint32_t in_flight) {
  if (c->phase == DF_CTL_FIXED || now - c->last_cut < window_time(c)) return false;
  c->last_cut = now;
  uint32_t held = in_flight < c->limit ? in_flight : c->limit;
  uint32_t before = c->limit;
  c->base = clamp_limit(c, held * 0.75);
  c->step = c->base / 4 ? c->base / 4 : 1;
  c->prev_rate = 0;
  set_limit(c, c->base, DF_CTL_BASE);
  return c->limit != before;
}

/* llama.cpp runs total_slots requests at once and queues the rest: the slots,
 * plus a few waiting so that a slot never idles between two requests. */
static bool follow_slots(df_ctl *c, const char **why) {
  double s = c->st.slots;
  uint32_t want = clamp_limit(c, s + ceil(s / 4));
  if (c->phase == DF_CTL_SLOTS && c->limit == want) return false;
  c->base = want;
  set_limit(c, want, DF_CTL_SLOTS);
  *why = "server slots";
  return true;
}

/* Whether this tick completes a window; resets it when it cannot count. */
static bool window_ready(df_ctl *c, double now, uint32_t in_flight, uint32_t queued, bool starved) {
  double dt = now - c->last_tick;
  c->last_tick = now;
  uint32_t slack = c->limit / 16 ? c->limit / 16 : 1;
  if (starved) { /* no work to send: the rate says nothing about the limit */
    c->held = false;
    c->win_start = -1;
    return false;
  }
  if (!c->held) {
    if (in_flight + slack < c->limit || in_flight > c->limit + slack) return false;
    c->held = true;
    c->held_since = now;
  }
  if (c->win_start < 0) {
    if (now - c->held_since < settle_time(c)) return false;
    c->win_start = now;
    c->win_tokens = 0;
    c->win_queue_s = 0;
    c->win_preempt0 = c->st.preemptions;
    return false;
  }
  double q = c->have_state && c->st.waiting >= 0 ? c->st.waiting : (double)queued;
  c->win_queue_s += q * dt;
  double len = now - c->win_start;
  return len >= window_time(c) && c->win_tokens >= (uint64_t)WINDOW_TOKENS * c->limit;
}

bool df_ctl_tick(df_ctl *c, double now, uint32_t in_flight, uint32_t queued, bool starved,
                 const char **why) {
  *why = NULL;
  if (c->phase == DF_CTL_FIXED) return false;
  if (c->have_state && c->st.slots > 0) return follow_slots(c, why);
  if (!window_ready(c, now, in_flight, queued, starved)) return false;
  double len = now - c->win_start;
  c->rate = (double)c->win_tokens / len;
  double limit = c->limit;
  double frac = c->have_state && c->st.waiting >= 0 ? QUEUE_FRAC : BLIND_QUEUE_FRAC;
  bool queue = c->win_queue_s / len > (limit * frac > 1 ? limit * frac : 1);
  uint32_t before = c->limit;
  *why = decide(c, c->rate, queue);
  if (c->limit == before) { /* same limit, new phase: measure again */
    c->held = true;
    c->held_since = now - settle_time(c);
    c->win_start = -1;
  }
  return c->limit != before;
}
