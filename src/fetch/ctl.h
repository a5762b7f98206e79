/* The per-server concurrency controller: how many requests to keep in flight
 * on one server so that its generated-token rate is the highest it sustains.
 *
 * Pure: no I/O, no clock of its own. The loop feeds it the tokens streamed
 * (df_ctl_tokens), what the server says about itself when it says anything
 * (df_ctl_state: slots, queue, KV use, preemptions) and calls df_ctl_tick
 * with the time; the unit tests drive it with a simulated clock.
 *
 * Why a hill-climber on the token rate: latency-based limiters stop far too
 * early (per-token latency rises 2.7x from 8 to 64 streams while throughput
 * still triples) and the best concurrency tolerates some preemption, so the
 * only reliable objective is the rate itself. A limit is judged only once the
 * server holds it (in flight == limit) and a settle time has passed, because
 * fewer streams take effect only as requests finish. The windows are measured
 * in request lifetimes (a change shows fully only after about one), with short
 * floors, so the same controller follows a llama.cpp server whose requests last
 * seconds and a Kimi node whose requests last minutes. Server state narrows the
 * search: llama.cpp's slot count is the answer; a queue on the server (vLLM
 * or SGLang "waiting", or streams in flight that have not started) means more
 * streams only wait, so the climber does not go up while it lasts. */
#ifndef DFLASH_FETCH_CTL_H
#define DFLASH_FETCH_CTL_H

#include <stdbool.h>
#include <stdint.h>

/* What a server exposes; each field < 0 when unknown. */
typedef struct df_ctl_state {
  double slots;       /* llama.cpp /props total_slots */
  double running;     /* requests decoding */
  double waiting;     /* requests queued on the server */
  double kv_usage;    /* 0..1 */
  double preemptions; /* cumulative preemptions + retractions */
} df_ctl_state;

typedef enum df_ctl_phase {
  DF_CTL_FIXED = 0, /* --concurrency N: never moves */
  DF_CTL_START,     /* doubling while the rate grows */
  DF_CTL_BASE,      /* measuring the current limit */
  DF_CTL_UP,        /* measuring limit + step */
  DF_CTL_DOWN,      /* measuring limit - step */
  DF_CTL_SLOTS      /* the server said how many it runs at once */
} df_ctl_phase;

typedef struct df_ctl {
  uint32_t max;   /* cap (max_concurrency) */
  uint32_t limit; /* what the loop admits now */
  uint32_t base;  /* the limit the climber holds between probes */
  uint32_t step;
  df_ctl_phase phase;
  double window_s; /* shortest measuring window */
  double settle_s; /* after the limit is reached, before measuring */
  double life_s;   /* mean time a request takes (sent to done); 0 until one is */
  /* the window being measured */
  bool held;         /* in flight reached the limit */
  double held_since; /* when it did (settle runs from here) */
  double win_start;  /* < 0 until the settle time has passed */
  uint64_t win_tokens, tokens_total;
  double win_queue_s; /* time-weighted sum of the queue seen */
  double win_preempt0;
  double last_tick;
  double base_rate, prev_rate; /* tokens/s at base, and of the last START window */
  double rate;                 /* the last window's rate, for the progress line */
  df_ctl_state st;
  bool have_state;
  uint64_t decisions;
  double last_cut; /* when an overload last lowered the limit */
} df_ctl;

/* A controller starting at `initial` streams (fixed when `fixed`), capped at `max`. */
void df_ctl_init(df_ctl *c, uint32_t initial, uint32_t max, bool fixed, double now);
/* Tokens streamed by the server since the last call. */
void df_ctl_tokens(df_ctl *c, uint64_t n);
/* A request took `seconds` from sent to done: the controller's time scale. */
void df_ctl_done(df_ctl *c, double seconds);
/* The server's own report (df_ctl_state fields < 0 when unknown). */
void df_ctl_state_set(df_ctl *c, const df_ctl_state *s);
/* The server answered 429 or 503 (overloaded): the limit drops to three quarters of the
 * requests it holds and the climb measures from there. One cut per measuring window, since
 * the refusals of one burst are one signal. A fixed limit stays (the caller chose it).
 * Returns true when the limit changed. */
bool df_ctl_overload(df_ctl *c, double now, uint32_t in_flight);
/* Periodic decision. `in_flight`: requests sent to the server; `queued`: of
 * them, those the server has not started streaming; `starved`: the loop had no
 * work to send (the end of a job), so the window does not count. Returns true
 * when the limit changed; *why (static text) says why. */
bool df_ctl_tick(df_ctl *c, double now, uint32_t in_flight, uint32_t queued, bool starved,
                 const char **why);

#endif
