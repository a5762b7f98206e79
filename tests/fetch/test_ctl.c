/* The concurrency controller (src/fetch/ctl.c) on a simulated clock against a
 * fluid model of one inference server: the step time of
 * bench/fetch_sim.py (kimi-pcie-bf16: t = max(a + bB, m0 + b2 B) + cK ms)
 * with a KV cache that holds `kv / per_stream` decoding streams; the streams
 * beyond it are preempted and wait, and each costs recompute (prefill) time
 * every step, so the rate peaks at the KV knee and falls after it. The best
 * rate is found here by scanning every concurrency, independently of the
 * controller. No wall clock anywhere. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "fetch/ctl.h"
#include "testutil.h"

typedef struct model {
  double a, b, m0, b2, c, p; /* ms, ms/stream, ms/KV token, ms/prefill token */
  double kv, per_stream;     /* KV capacity and mean KV tokens per stream */
  double recompute;          /* prefill tokens per step per preempted stream */
  double lifetime_s;         /* mean request lifetime: how fast in-flight drains */
  double slots;              /* > 0: a llama.cpp server reporting its slots */
  bool report;               /* the server reports waiting/running */
} model;

static model kimi_bf16(void) {
  return (model){37, 0.03, 14, 0.25, 4e-5, 0.06, 190000, 4700, 40, 80, 0, false};
}

/* Tokens per second with n streams in flight, and how many of them decode. */
static double rate_of(const model *m, double n, double *decoding) {
  double B = n < m->kv / m->per_stream ? n : floor(m->kv / m->per_stream);
  if (m->slots > 0 && B > m->slots) B = m->slots;
  if (decoding) *decoding = B;
  if (B < 1) return 0;
  double t = fmax(m->a + m->b * B, m->m0 + m->b2 * B) + m->c * B * m->per_stream;
  if (m->slots <= 0) t += m->p * m->recompute * (n - B);
  return B * 1000.0 / t;
}

static double best_rate(const model *m, double *at) {
  double best = 0;
  for (int n = 1; n <= 1024; n++) {
    double r = rate_of(m, n, NULL);
    if (r > best) {
      best = r;
      *at = n;
    }
  }
  return best;
}

typedef struct sim {
  df_ctl ctl;
  double now, in_flight, carry;
  int changes;
  bool feed_life; /* tell the controller how long requests take */
} sim;

static void sim_init(sim *s, uint32_t initial, uint32_t max, bool fixed) {
  *s = (sim){.now = 1000};
  df_ctl_init(&s->ctl, initial, max, fixed, s->now);
}

/* Run `seconds` of simulated time in 0.25 s ticks; the mean rate of the last
 * half of it. The loop refills at once; extra streams drain as requests end. */
static double run(sim *s, const model *m, double seconds, bool starved) {
  const double dt = 0.25;
  double sum = 0, t_sum = 0;
  for (double t = 0; t < seconds; t += dt) {
    double lim = s->ctl.limit;
    if (!starved && s->in_flight < lim) s->in_flight = lim;
    else if (s->in_flight > lim)
      s->in_flight = fmax(lim, s->in_flight - ceil(s->in_flight * dt / m->lifetime_s));
    double B;
    double r = rate_of(m, s->in_flight, &B);
    double tok = r * dt + s->carry;
    s->carry = tok - floor(tok);
    df_ctl_tokens(&s->ctl, (uint64_t)tok);
    if (s->feed_life) df_ctl_done(&s->ctl, m->lifetime_s);
    if (m->report || m->slots > 0) {
      df_ctl_state st = {m->slots > 0 ? m->slots : -1, B, s->in_flight - B, -1, -1};
      df_ctl_state_set(&s->ctl, &st);
    }
    s->now += dt;
    const char *why;
    uint32_t q = (uint32_t)(s->in_flight - B);
    if (df_ctl_tick(&s->ctl, s->now, (uint32_t)s->in_flight, q, starved, &why)) {
      s->changes++;
      ck_assert_ptr_nonnull(why);
    }
    ck_assert_uint_ge(s->ctl.limit, 1);
    ck_assert_uint_le(s->ctl.limit, s->ctl.max);
    if (t >= seconds / 2) {
      sum += r * dt;
      t_sum += dt;
    }
  }
  return sum / t_sum;
}

START_TEST(climbs_to_the_knee) {
  for (int report = 0; report < 2; report++) {
    model m = kimi_bf16();
    m.report = report;
    double at, best = best_rate(&m, &at);
    ck_assert_double_ge(at, 35); /* the model's knee is where the spec puts it: ~40 */
    ck_assert_double_le(at, 45);
    sim s;
    sim_init(&s, 8, 512, false);
    double got = run(&s, &m, 1200, false);
    ck_assert_msg(got >= 0.9 * best, "report %d: %.1f tok/s of the best %.1f (at %.0f), limit %u",
                  report, got, best, at, s.ctl.limit);
    ck_assert_uint_ge(s.ctl.limit, (uint32_t)(0.7 * at));
    ck_assert_uint_le(s.ctl.limit, (uint32_t)(1.3 * at));
  }
}
END_TEST

/* fp8 KV: the knee moves up ~2.4x mid-run, then back (the output lengths drift). */
START_TEST(follows_a_moving_knee) {
  model m = kimi_bf16();
  sim s;
  sim_init(&s, 8, 512, false);
  (void)run(&s, &m, 1200, false);
  double at;
  m.kv = 450000;
  double best = best_rate(&m, &at);
  double got = run(&s, &m, 1200, false);
  ck_assert_msg(got >= 0.9 * best, "after the knee moved up: %.1f of %.1f (at %.0f), limit %u", got,
                best, at, s.ctl.limit);
  m.per_stream = 4700 * 2.4; /* longer outputs: the knee back near 40 */
  best = best_rate(&m, &at);
  got = run(&s, &m, 1800, false);
  ck_assert_msg(got >= 0.9 * best, "after the knee moved down: %.1f of %.1f (at %.0f), limit %u",
                got, best, at, s.ctl.limit);
}
END_TEST

/* With requests that take 80 s, a probe near the knee is judged over about one
 * lifetime after half of one (a cost in KV shows only as the requests grow),
 * while the doubling at the start stays quick; and it still climbs. */
START_TEST(measures_in_request_lifetimes) {
  model m = kimi_bf16();
  sim s;
  sim_init(&s, 8, 512, false);
  s.feed_life = true;
  double t0 = s.now;
  while (s.ctl.phase == DF_CTL_START && s.now - t0 < 600) (void)run(&s, &m, 0.25, false);
  ck_assert_int_ne(s.ctl.phase, DF_CTL_START);
  ck_assert_double_lt(s.now - t0, 30); /* 8 -> 64 in a few short windows */
  uint64_t d0 = s.ctl.decisions;
  (void)run(&s, &m, 0.5 * 80 + 80 - 5, false);
  ck_assert_uint_eq(s.ctl.decisions, d0);
  (void)run(&s, &m, 10, false);
  ck_assert_uint_gt(s.ctl.decisions, d0);
  double at, best = best_rate(&m, &at);
  double got = run(&s, &m, 4000, false);
  ck_assert_msg(got >= 0.9 * best, "%.1f tok/s of the best %.1f (at %.0f), limit %u", got, best, at,
                s.ctl.limit);
}
END_TEST

START_TEST(takes_the_slot_count) {
  model m = {20, 2.0, 0, 0, 0, 0.3, 8 * 32768, 1000, 0, 40, 8, false};
  sim s;
  sim_init(&s, 8, 512, false);
  (void)run(&s, &m, 5, false);
  ck_assert_uint_eq(s.ctl.limit, 10); /* 8 slots + 2 queued so none idles */
  ck_assert_int_eq(s.ctl.phase, DF_CTL_SLOTS);
  int changes = s.changes;
  (void)run(&s, &m, 600, false);
  ck_assert_int_eq(s.changes, changes);
}
END_TEST

START_TEST(fixed_never_moves) {
  model m = kimi_bf16();
  sim s;
  sim_init(&s, 64, 512, true);
  (void)run(&s, &m, 600, false);
  ck_assert_uint_eq(s.ctl.limit, 64);
  ck_assert_int_eq(s.changes, 0);
}
END_TEST

START_TEST(stays_under_the_cap) {
  model m = kimi_bf16();
  sim s;
  sim_init(&s, 8, 16, false);
  (void)run(&s, &m, 900, false);
  ck_assert_uint_le(s.ctl.limit, 16);
  ck_assert_uint_ge(s.ctl.limit, 12); /* the rate still rises at 16: it stays near the cap */
}
END_TEST

/* The end of a job: nothing left to send, so no window counts and nothing moves. */
START_TEST(starved_windows_do_not_count) {
  model m = kimi_bf16();
  sim s;
  sim_init(&s, 8, 512, false);
  s.in_flight = 3;
  (void)run(&s, &m, 600, true);
  ck_assert_uint_eq(s.ctl.limit, 8);
  ck_assert_int_eq(s.changes, 0);
}
END_TEST

TCase *tc_ctl(void) {
  TCase *tc = tcase_create("ctl");
  tcase_add_test(tc, climbs_to_the_knee);
  tcase_add_test(tc, follows_a_moving_knee);
  tcase_add_test(tc, measures_in_request_lifetimes);
  tcase_add_test(tc, takes_the_slot_count);
  tcase_add_test(tc, fixed_never_moves);
  tcase_add_test(tc, stays_under_the_cap);
  tcase_add_test(tc, starved_windows_do_not_count);
  return tc;
}
