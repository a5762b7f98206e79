/* The event loop: one thread drives every transfer through libcurl's multi
 * interface with curl_multi_socket_action over epoll, so thousands of
 * streams cost one epoll_wait per wake-up, not a poll over every socket.
 *
 * Admission is ours, not libcurl's (CURLMOPT_MAX_HOST_CONNECTIONS would queue
 * transfers inside libcurl, where CURLOPT_TIMEOUT_MS already counts): a
 * transfer is added only when its server has a free slot, so every timeout
 * measures the server, never our own queue.
 *
 * About 870 lines, over the ~800 a file should hold, on purpose: every section below (headers,
 * transfers, scheduling, load reports, controllers, the loop) starts, finishes or times
 * transfers through the same static libcurl/epoll plumbing; what is pure (a transfer's outcome,
 * a load report's parsing) is in classify.c, jobs and records in jobs.c. */
#include "fetch_state.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#define ERROR_BODY_MAX 4096
#define STATE_BODY_MAX (8u << 20) /* a vLLM /metrics page is ~100 KB */
#define CTL_TICK_S 0.25
#define CTL_INITIAL 8     /* the controller's first limit (it doubles from there) */
#define CTL_LOG_MAX 10000 /* decisions kept for the summary */

/* What a server's load report is, once known. */
enum { STATE_PROPS = 0, STATE_METRICS, STATE_NONE, STATE_SLOTS };

/* ---- API key and shared headers ------------------------------------------ */

static dflash_status read_api_key(const dflash_fetch_options *o, char **key) {
  *key = NULL;
  const char *env = o->api_key_env ? getenv(o->api_key_env) : NULL;
  if (env && *env) return (*key = df_strdup(env)) ? DFLASH_OK : df_error_nomem("key");
  if (o->api_key_file) {
    size_t len;
    dflash_status st = df_read_file(o->api_key_file, key, &len);
    if (st) return df_error_wrap(DFLASH_E_AUTH, "API key file");
    (*key)[strcspn(*key, "\r\n")] = '\0';
    return DFLASH_OK;
  }
  if (o->api_key_env)
    return df_error(DFLASH_E_AUTH, "fetch: environment variable %s (API key) is not set",
                    o->api_key_env);
  return DFLASH_OK;
}

static dflash_status make_headers(dflash_fetch *f, const dflash_fetch_options *o) {
  char *key;
  dflash_status st = read_api_key(o, &key);
  if (st) return st;
  /* "Expect:" stops curl from waiting for 100-continue on large prompts. */
  const char *fixed[] = {"Content-Type: application/json", "Expect:"};
  for (size_t i = 0; i < DF_ARRAY_LEN(fixed); i++)
    f->headers = curl_slist_append(f->headers, fixed[i]);
  f->has_key = key && *key;
  if (key && *key) {
    char *h = df_asprintf("Authorization: Bearer %s", key);
    if (h) f->headers = curl_slist_append(f->headers, h);
    if (h) explicit_bzero(h, strlen(h));
    free(h);
  }
  if (key) explicit_bzero(key, strlen(key));
  free(key);
  return f->headers ? DFLASH_OK : df_error_nomem("headers");
}

/* ---- libcurl <-> epoll ----------------------------------------------------- */

static int on_socket(CURL *e, curl_socket_t s, int what, void *userp, void *socketp) {
  (void)e;
  (void)socketp;
  dflash_fetch *f = userp;
  if (what == CURL_POLL_REMOVE) {
    epoll_ctl(f->epfd, EPOLL_CTL_DEL, s, NULL); /* may already be closed: ignore errors */
    return 0;
  }
  struct epoll_event ev = {.data.fd = s};
  ev.events = (what & CURL_POLL_IN ? EPOLLIN : 0u) | (what & CURL_POLL_OUT ? EPOLLOUT : 0u);
  if (epoll_ctl(f->epfd, EPOLL_CTL_MOD, s, &ev) != 0 && errno == ENOENT &&
      epoll_ctl(f->epfd, EPOLL_CTL_ADD, s, &ev) != 0)
    df_log(DFLASH_LOG_ERROR, "fetch: epoll_ctl add failed: %s", strerror(errno));
  return 0;
}

static int on_timer(CURLM *m, long timeout_ms, void *userp) {
  (void)m;
  dflash_fetch *f = userp;
  f->timer_at = timeout_ms < 0 ? -1 : df_now_seconds() + (double)timeout_ms / 1000.0;
  return 0;
}

dflash_status df_loop_init(dflash_fetch *f, const dflash_fetch_options *opts) {
  if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
    return df_error(DFLASH_E_NETWORK, "fetch: curl_global_init failed");
  f->curl_inited = true;
  dflash_status st = make_headers(f, opts);
  if (st) return st;
  int fds[2];
  if (pipe2(fds, O_NONBLOCK | O_CLOEXEC) != 0)
    return df_error_errno(DFLASH_E_IO, errno, "fetch: pipe");
  f->wake_r = fds[0];
  f->wake_w = fds[1];
  f->epfd = epoll_create1(EPOLL_CLOEXEC);
  if (f->epfd < 0) return df_error_errno(DFLASH_E_IO, errno, "fetch: epoll_create1");
  struct epoll_event ev = {.events = EPOLLIN, .data.fd = f->wake_r};
  epoll_ctl(f->epfd, EPOLL_CTL_ADD, f->wake_r, &ev);
  if (!(f->multi = curl_multi_init())) return df_error_nomem("curl multi handle");
  long per = f->o.concurrency ? f->o.concurrency : f->o.max_concurrency;
  long total = per * (long)f->n_servers;
  curl_multi_setopt(f->multi, CURLMOPT_SOCKETFUNCTION, on_socket);
  curl_multi_setopt(f->multi, CURLMOPT_SOCKETDATA, f);
  curl_multi_setopt(f->multi, CURLMOPT_TIMERFUNCTION, on_timer);
  curl_multi_setopt(f->multi, CURLMOPT_TIMERDATA, f);
  curl_multi_setopt(f->multi, CURLMOPT_MAXCONNECTS, total + 2 * (long)f->n_servers);
  f->timer_at = -1;
  double now = df_now_seconds();
  for (size_t i = 0; i < f->n_servers; i++) {
    df_server *s = &f->servers[i];
    bool fixed = f->o.concurrency > 0;
    df_ctl_init(&s->ctl, fixed ? (uint32_t)f->o.concurrency : CTL_INITIAL,
                fixed ? (uint32_t)f->o.concurrency : (uint32_t)f->o.max_concurrency, fixed, now);
    s->state_kind = f->o.server_state && !fixed ? STATE_PROPS : STATE_NONE;
  }
  if (!(f->decisions = json_array())) return df_error_nomem("controller log");
  f->rng = (uint64_t)time(NULL) * 0x9e3779b97f4a7c15ull ^ (uint64_t)getpid();
  return DFLASH_OK;
}

void df_loop_free(dflash_fetch *f) {
  for (size_t i = 0; i < f->n_easy_pool; i++) curl_easy_cleanup(f->easy_pool[i]);
  free(f->easy_pool);
  if (f->multi) curl_multi_cleanup(f->multi);
  curl_slist_free_all(f->headers); /* holds the key: it was only ever in memory */
  if (f->epfd >= 0) close(f->epfd);
  if (f->wake_r >= 0) close(f->wake_r);
  if (f->wake_w >= 0) close(f->wake_w);
  if (f->curl_inited) curl_global_cleanup();
  f->curl_inited = false;
  f->multi = NULL;
  f->headers = NULL;
}

/* ---- transfers -------------------------------------------------------------- */

static size_t on_header(char *buf, size_t size, size_t n, void *userp) {
  df_xfer *x = userp;
  size_t len = size * n;
  if (len > 12 && !strncasecmp(buf, "retry-after", 11)) {
    char v[128];
    bool ms = !strncasecmp(buf + 11, "-ms:", 4);
    size_t skip = ms ? 15 : 12;
    if (buf[11] == ':' || ms) {
      size_t m = len - skip < sizeof v - 1 ? len - skip : sizeof v - 1;
      memcpy(v, buf + skip, m);
      v[m] = '\0';
      double s = df_parse_retry_after(v, ms);
      if (s >= 0 && (ms || x->retry_after < 0)) x->retry_after = s; /* -ms is more precise */
    }
  }
  return len;
}

/* Each event of a stream carries about one token: the controller's rate. */
static int on_event(void *user, const char *event, const char *data, size_t len) {
  (void)event;
  df_xfer *x = user;
  df_resp_chunk(&x->resp, data, len);
  x->tokens++;
  return 0;
}

static size_t on_write(char *buf, size_t size, size_t n, void *userp) {
  df_xfer *x = userp;
  size_t len = size * n;
  x->bytes += len;
  if (x->bytes > x->max_bytes) {
    x->too_big = true;
    return 0; /* aborts the transfer */
  }
  if (!x->type_known) {
    char *ct = NULL;
    curl_easy_getinfo(x->easy, CURLINFO_RESPONSE_CODE, &x->http);
    curl_easy_getinfo(x->easy, CURLINFO_CONTENT_TYPE, &ct);
    x->sse = x->http / 100 == 2 && ct && !strncasecmp(ct, "text/event-stream", 17);
    x->type_known = true;
  }
  if (x->sse) {
    /* Out of memory in the parser: fail the transfer (retried), as for the raw body. */
    if (df_sse_feed(&x->parser, buf, len, on_event, x)) return 0;
  } else if (x->http / 100 == 2 || x->raw.len < ERROR_BODY_MAX) {
    if (df_buf_append(&x->raw, buf, len)) return 0;
  }
  return len;
}

static CURL *easy_get(dflash_fetch *f) {
  if (f->n_easy_pool) return f->easy_pool[--f->n_easy_pool];
  return curl_easy_init();
}

static void easy_put(dflash_fetch *f, CURL *e) {
  if (f->n_easy_pool == f->cap_easy_pool) {
    size_t cap = f->cap_easy_pool ? f->cap_easy_pool * 2 : 64;
    CURL **p = realloc(f->easy_pool, cap * sizeof *p);
    if (!p) {
      curl_easy_cleanup(e);
      return;
    }
    f->easy_pool = p;
    f->cap_easy_pool = cap;
  }
  curl_easy_reset(e);
  f->easy_pool[f->n_easy_pool++] = e;
}

static long deadline_ms(const dflash_fetch *f) {
  if (f->o.deadline_s > 0) return (long)(f->o.deadline_s * 1000);
  double tokens = f->o.max_tokens > 0 ? f->o.max_tokens : 32768;
  return (long)((f->o.deadline_base_s + f->o.deadline_per_token_s * tokens) * 1000);
}

static void set_easy_options(dflash_fetch *f, df_xfer *x, const df_server *s, size_t body_len,
                             bool streamed) {
  CURL *e = x->easy;
  curl_easy_setopt(e, CURLOPT_URL, s->url);
  curl_easy_setopt(e, CURLOPT_POSTFIELDS, x->body);
  curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)body_len);
  curl_easy_setopt(e, CURLOPT_HTTPHEADER, f->headers);
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_write);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, x);
  curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(e, CURLOPT_HEADERDATA, x);
  curl_easy_setopt(e, CURLOPT_PRIVATE, x);
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, x->errbuf);
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
  curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L);
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long)(f->o.connect_timeout_s * 1000));
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS,
                   x->job ? deadline_ms(f) : (long)(f->o.connect_timeout_s * 1000 + 60000));
  if (streamed) { /* idle timeout: under 1 byte/s for idle_timeout_s seconds */
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(e, CURLOPT_LOW_SPEED_TIME, (long)ceil(f->o.idle_timeout_s));
  }
  curl_easy_setopt(e, CURLOPT_SSL_VERIFYPEER, f->o.verify_tls ? 1L : 0L);
  curl_easy_setopt(e, CURLOPT_SSL_VERIFYHOST, f->o.verify_tls ? 2L : 0L);
}

static void link_xfer(dflash_fetch *f, df_xfer *x) {
  x->prev = NULL;
  x->next = f->xfers;
  if (f->xfers) f->xfers->prev = x;
  f->xfers = x;
}

static void unlink_xfer(dflash_fetch *f, df_xfer *x) {
  if (x->prev) x->prev->next = x->next;
  else f->xfers = x->next;
  if (x->next) x->next->prev = x->prev;
}

static void xfer_free(df_xfer *x) {
  df_sse_free(&x->parser);
  df_resp_free(&x->resp);
  df_buf_free(&x->raw);
  free(x->body);
  free(x);
}

/* Start one attempt of `job` (or a probe when job is NULL) on server `si`. */
static dflash_status start_xfer(dflash_fetch *f, df_job *job, int si) {
  df_server *s = &f->servers[si];
  df_xfer *x = calloc(1, sizeof *x);
  if (!x) return df_error_nomem("transfer");
  x->job = job;
  x->server = si;
  x->retry_after = -1;
  x->max_bytes = f->o.max_response_bytes ? f->o.max_response_bytes : UINT64_MAX;
  x->started = df_now_seconds();
  json_t *msgs;
  char rid[160];
  const char *rid_p = NULL;
  if (job) {
    json_t *prompt = json_array();
    for (size_t i = 0; prompt && i < job->turns[job->turn]; i++)
      if (json_array_append(prompt, json_array_get(job->conv.messages, i)))
        json_decref(prompt), prompt = NULL; /* out of memory: NULL messages below */
    msgs = df_messages_for_server(prompt);
    json_decref(prompt);
    if (f->o.send_rid) {
      snprintf(rid, sizeof rid, "%.100s-%zu-%d", job->conv.id, job->turn, job->attempts_total + 1);
      rid_p = rid;
    }
  } else {
    msgs = json_pack("[{s:s,s:s}]", "role", "user", "content", "Hi");
  }
  size_t body_len = 0;
  dflash_status st = msgs ? df_body_build(&f->body_cfg, msgs, rid_p, job == NULL, &x->body,
                                          &body_len)
                          : df_error_nomem("messages");
  json_decref(msgs);
  if (!st && !(x->easy = easy_get(f))) st = df_error_nomem("curl handle");
  if (st) {
    xfer_free(x);
    return st;
  }
  set_easy_options(f, x, s, body_len, job && f->o.stream);
  if (curl_multi_add_handle(f->multi, x->easy) != CURLM_OK) {
    easy_put(f, x->easy);
    xfer_free(x);
    return df_error(DFLASH_E_INTERNAL, "fetch: curl_multi_add_handle failed");
  }
  link_xfer(f, x);
  s->in_flight++;
  if (job) {
    s->requests++;
    f->jobs_in_flight++;
    job->attempts++;
    job->attempts_total++;
    if (job->attempts_total > 1) f->retries++;
    if (!job->started) job->started = x->started;
  } else {
    s->probing = true;
  }
  return DFLASH_OK;
}

/* ---- scheduling ----------------------------------------------------------------- */

/* Full-jitter exponential backoff, at least what the server's Retry-After asks. */
static double backoff_s(dflash_fetch *f, int attempt, double retry_after) {
  return df_backoff_s(&f->rng, (unsigned)attempt, f->o.backoff_base_s, f->o.backoff_max_s,
                      retry_after, f->o.retry_after_max_s);
}

static dflash_status push_waiting(dflash_fetch *f, df_job *job) {
  if (f->n_waiting == f->cap_waiting) {
    size_t cap = f->cap_waiting ? f->cap_waiting * 2 : 64;
    df_job **w = realloc(f->waiting, cap * sizeof *w);
    if (!w) return df_error_nomem("retry queue");
    f->waiting = w;
    f->cap_waiting = cap;
  }
  f->waiting[f->n_waiting++] = job;
  return DFLASH_OK;
}

/* The waiting job due first, if it is due. */
static df_job *pop_due(dflash_fetch *f, double now) {
  size_t best = SIZE_MAX;
  for (size_t i = 0; i < f->n_waiting; i++)
    if (f->waiting[i]->not_before <= now &&
        (best == SIZE_MAX || f->waiting[i]->not_before < f->waiting[best]->not_before))
      best = i;
  if (best == SIZE_MAX) return NULL;
  df_job *job = f->waiting[best];
  f->waiting[best] = f->waiting[--f->n_waiting];
  return job;
}

/* The healthy server with a free slot and the lowest load relative to its
 * limit (a slow server has a lower limit, so it is given fewer streams); -1
 * when none. */
static int pick_server(const dflash_fetch *f) {
  int best = -1;
  double best_load = 0;
  for (size_t i = 0; i < f->n_servers; i++) {
    const df_server *s = &f->servers[i];
    if (!s->healthy || s->in_flight >= s->ctl.limit) continue;
    double load = (double)s->in_flight / (double)s->ctl.limit;
    if (best < 0 || load < best_load) {
      best = (int)i;
      best_load = load;
    }
  }
  return best;
}

static dflash_status dispatch(dflash_fetch *f, double now) {
  int si;
  f->out_of_work = false;
  while ((si = pick_server(f)) >= 0) {
    df_job *job = pop_due(f, now);
    dflash_status st = DFLASH_OK;
    if (!job && !(st = df_fetch_next_job(f, &job)) && !job) f->out_of_work = true;
    if (st || !job) return st;
    if ((st = start_xfer(f, job, si))) {
      df_job_free(job);
      return st;
    }
  }
  return DFLASH_OK;
}

static dflash_status start_probes(dflash_fetch *f, double now) {
  for (size_t i = 0; i < f->n_servers; i++) {
    df_server *s = &f->servers[i];
    if (s->excluded || s->healthy || s->probing || s->next_probe > now) continue;
    dflash_status st = start_xfer(f, NULL, (int)i);
    if (st) return st;
  }
  return DFLASH_OK;
}

/* ---- the servers' own load reports ----------------------------------------------- */

static dflash_status start_state(dflash_fetch *f, int si, double now) {
  df_server *s = &f->servers[si];
  df_xfer *x = calloc(1, sizeof *x);
  char *url = df_asprintf("%s%s", s->root, s->state_kind == STATE_METRICS ? "/metrics" : "/props");
  if (!x || !url || !(x->easy = easy_get(f))) {
    free(url);
    free(x);
    return df_error_nomem("load report request");
  }
  x->state = true;
  x->server = si;
  x->retry_after = -1;
  x->max_bytes = STATE_BODY_MAX;
  x->started = now;
  CURL *e = x->easy;
  curl_easy_setopt(e, CURLOPT_URL, url); /* libcurl keeps its own copy */
  free(url);
  curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
  curl_easy_setopt(e, CURLOPT_HTTPHEADER, f->headers);
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_write);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, x);
  curl_easy_setopt(e, CURLOPT_PRIVATE, x);
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, x->errbuf);
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long)(f->o.connect_timeout_s * 1000));
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)(f->o.connect_timeout_s * 1000 + 10000));
  curl_easy_setopt(e, CURLOPT_SSL_VERIFYPEER, f->o.verify_tls ? 1L : 0L);
  curl_easy_setopt(e, CURLOPT_SSL_VERIFYHOST, f->o.verify_tls ? 2L : 0L);
  if (curl_multi_add_handle(f->multi, e) != CURLM_OK) {
    easy_put(f, e);
    xfer_free(x);
    return df_error(DFLASH_E_INTERNAL, "fetch: curl_multi_add_handle failed");
  }
  link_xfer(f, x);
  s->state_busy = true;
  return DFLASH_OK;
}

static dflash_status start_states(dflash_fetch *f, double now) {
  for (size_t i = 0; i < f->n_servers; i++) {
    df_server *s = &f->servers[i];
    if (s->excluded || !s->healthy || s->state_busy || s->state_kind == STATE_NONE ||
        s->next_state > now || s->ctl.phase == DF_CTL_FIXED)
      continue;
    dflash_status st = start_state(f, (int)i, now);
    if (st) return st;
  }
  return DFLASH_OK;
}

static void state_done(dflash_fetch *f, df_xfer *x, CURLcode rc, double now) {
  df_server *s = &f->servers[x->server];
  s->state_busy = false;
  s->next_state = now + f->o.state_interval_s;
  if (rc != CURLE_OK || x->http == 0) return; /* not answering: ask the same again later */
  bool ok = x->http == 200 && x->raw.data;
  df_ctl_state st = {-1, -1, -1, -1, -1};
  if (s->state_kind == STATE_PROPS || s->state_kind == STATE_SLOTS) {
    st.slots = ok ? df_fetch_props_slots(x->raw.data, x->raw.len) : -1;
    if (st.slots > 0) {
      if (s->state_kind == STATE_PROPS)
        df_log(DFLASH_LOG_INFO, "fetch: %s runs %.0f slots (GET /props)", s->display, st.slots);
      s->state_kind = STATE_SLOTS;
      s->next_state = now + 30 * f->o.state_interval_s; /* a restart may change it */
      df_ctl_state_set(&s->ctl, &st);
    } else if (s->state_kind == STATE_PROPS) {
      s->state_kind = STATE_METRICS;
      s->next_state = now;
    }
  } else if (ok && df_fetch_parse_metrics(x->raw.data, x->raw.len, &st)) {
    df_ctl_state_set(&s->ctl, &st);
  } else if (!s->ctl.have_state) {
    s->state_kind = STATE_NONE; /* no report we read: the stream signals alone */
  }
}

/* ---- the controllers ------------------------------------------------------------- */

static void log_decision(dflash_fetch *f, size_t i, double now, const char *why) {
  df_server *s = &f->servers[i];
  df_log(DFLASH_LOG_DEBUG, "fetch: %s: concurrency %u (%s; %.0f tok/s)", s->display, s->ctl.limit,
         why, s->ctl.rate);
  if (json_array_size(f->decisions) >= CTL_LOG_MAX) {
    f->decisions_dropped++;
    return;
  }
  json_array_append_new(f->decisions,
                        json_pack("{s:f,s:I,s:I,s:f,s:s}", "t", now - f->start_time, "server",
                                  (json_int_t)i, "concurrency", (json_int_t)s->ctl.limit,
                                  "tok_per_s", s->ctl.rate, "why", why));
}

/* Tokens streamed since the last tick, and the requests not streaming yet. */
static void collect_streams(dflash_fetch *f) {
  for (size_t i = 0; i < f->n_servers; i++) f->servers[i].queued = 0;
  for (df_xfer *x = f->xfers; x; x = x->next) {
    if (!x->job) continue;
    f->servers[x->server].tokens += x->tokens;
    x->tokens = 0;
    if (x->resp.chunks == 0) f->servers[x->server].queued++;
  }
}

/* The counts whose rates the progress line and the summary show. */
static void sample_rates(dflash_fetch *f, double now) {
  df_rate_sample(&f->records_rate, now, f->completed + f->failed);
  df_rate_sample(&f->tokens_rate, now, f->completion_tokens);
  for (size_t i = 0; i < f->n_servers; i++)
    df_rate_sample(&f->servers[i].completed_tokens, now, f->servers[i].completion_tokens);
}

static void ctl_tick(dflash_fetch *f, double now) {
  if (now < f->next_ctl) return;
  f->next_ctl = now + CTL_TICK_S;
  collect_streams(f);
  sample_rates(f, now);
  for (size_t i = 0; i < f->n_servers; i++) {
    df_server *s = &f->servers[i];
    uint64_t n = s->tokens - s->tokens_tick;
    s->tokens_tick = s->tokens;
    df_ctl_tokens(&s->ctl, n);
    const char *why;
    bool starved = !s->healthy || s->excluded || f->out_of_work;
    if (df_ctl_tick(&s->ctl, now, s->in_flight, s->queued, starved, &why))
      log_decision(f, i, now, why);
  }
}

/* What an attempt's end says about its server: an answer keeps it in service (an overload
 * lowers its limit); a connection that failed or timed out fail_threshold times in a row
 * takes it out, to be probed. */
static void server_result(dflash_fetch *f, size_t i, const result *r, double now) {
  df_server *s = &f->servers[i];
  if (r->kind == RES_OK || !r->server_fault) s->consecutive_failures = 0;
  if (r->kind == RES_OK) {
    s->completed++;
    return;
  }
  s->failures++;
  if (r->overload) {
    s->overloads++;
    f->overloaded++;
    if (df_ctl_overload(&s->ctl, now, s->in_flight))
      log_decision(f, i, now, "overloaded (HTTP 429/503): fewer streams");
  }
  if (!r->server_fault) return;
  if (++s->consecutive_failures >= f->o.fail_threshold && s->healthy) {
    s->healthy = false;
    s->next_probe = now + f->o.probe_interval_s;
    df_log(DFLASH_LOG_WARN, "fetch: %s taken out after %d failures in a row (last: %s)", s->display,
           s->consecutive_failures, r->msg);
  }
}

static void probe_done(dflash_fetch *f, df_xfer *x, CURLcode rc, double now) {
  df_server *s = &f->servers[x->server];
  s->probing = false;
  bool ok = false;
  if (rc == CURLE_OK && x->http == 200) {
    df_resp_body(&x->resp, x->raw.data ? x->raw.data : "", x->raw.len);
    ok = !x->resp.error && !x->resp.bad_json;
  }
  if (ok) {
    s->healthy = true;
    s->consecutive_failures = 0;
    df_log(DFLASH_LOG_INFO, "fetch: %s answers again; back in service", s->display);
  } else {
    s->next_probe = now + f->o.probe_interval_s;
    s->probes_failed++;
    f->probes_failed++;
    df_log(DFLASH_LOG_DEBUG, "fetch: probe of %s failed (%s)", s->display,
           rc != CURLE_OK ? (x->errbuf[0] ? x->errbuf : curl_easy_strerror(rc))
                          : "no valid 1-token answer");
  }
}

/* Store the finished turn in the conversation; the job goes on or is written. */
static dflash_status turn_done(dflash_fetch *f, df_job *job, df_xfer *x, double now) {
  df_resp *r = &x->resp;
  df_server *s = &f->servers[x->server];
  json_t *msg = json_pack("{s:s,s:s%,s:s%}", "role", "assistant", "reasoning",
                          r->reasoning.data ? r->reasoning.data : "", r->reasoning.len, "content",
                          r->content.data ? r->content.data : "", r->content.len);
  if (!msg) return df_error_nomem("message");
  if (r->tool_calls) json_object_set(msg, "tool_calls", r->tool_calls);
  size_t p = job->turns[job->turn];
  if (p < json_array_size(job->conv.messages)) json_array_set_new(job->conv.messages, p, msg);
  else json_array_append_new(job->conv.messages, msg);
  /* null when the server sent no count: never a 0 that reads as an empty answer */
  json_t *usage = df_resp_usage(r);
  uint64_t ct, pt;
  if (df_usage_count(usage, "completion_tokens", &ct)) {
    f->completion_tokens += ct;
    s->completion_tokens += ct;
    if (!x->sse) s->tokens += ct; /* no events to count: the controller's rate */
    f->turns_counted++;
  } else {
    f->turns_uncounted++;
    s->turns_uncounted++;
  }
  if (df_usage_count(usage, "prompt_tokens", &pt)) f->prompt_tokens += pt;
  json_array_append_new(job->turn_info,
                        json_pack("{s:s?,s:s,s:o,s:i}", "finish_reason", r->finish_reason,
                                  "outcome", df_outcome(r), "usage", usage ? usage : json_null(),
                                  "attempts", job->attempts));
  if (++job->turn < job->n_turns) { /* the next turn, at once */
    job->attempts = 0;
    job->not_before = now;
    return push_waiting(f, job);
  }
  dflash_status st = df_fetch_record_completion(f, job, s->display);
  df_job_free(job);
  return st;
}

static dflash_status job_failed(dflash_fetch *f, df_job *job, df_xfer *x, result *r, double now) {
  free(job->err);
  job->err = r->msg;
  r->msg = NULL;
  job->err_kind = r->err_kind;
  job->err_http = r->http;
  job->err_server = x->server;
  if (r->kind == RES_RETRY && job->attempts < f->o.max_attempts) {
    job->not_before = now + backoff_s(f, job->attempts, x->retry_after);
    df_log(DFLASH_LOG_DEBUG, "fetch: %s attempt %d on %s failed (%s); retrying in %.2f s",
           job->conv.id, job->attempts, f->servers[x->server].display, job->err,
           job->not_before - now);
    return push_waiting(f, job);
  }
  if (r->kind == RES_RETRY) {
    char *m = df_asprintf("gave up after %d attempts: %s", job->attempts, job->err);
    if (m) {
      free(job->err);
      job->err = m;
    }
  }
  dflash_status st = df_fetch_record_error(f, job);
  df_job_free(job);
  return st;
}

static dflash_status xfer_done(dflash_fetch *f, df_xfer *x, CURLcode rc) {
  double now = df_now_seconds();
  df_server *s = &f->servers[x->server];
  if (x->state) {
    state_done(f, x, rc, now);
    return DFLASH_OK;
  }
  s->in_flight--;
  s->tokens += x->tokens;
  dflash_status st = DFLASH_OK;
  if (!x->job) {
    probe_done(f, x, rc, now);
  } else {
    f->jobs_in_flight--;
    result r = df_fetch_classify(x, rc);
    if (r.kind != RES_OK) f->attempts_failed++;
    server_result(f, (size_t)x->server, &r, now);
    if (r.kind == RES_OK) df_ctl_done(&s->ctl, now - x->started);
    st = r.kind == RES_OK ? turn_done(f, x->job, x, now) : job_failed(f, x->job, x, &r, now);
    free(r.msg);
  }
  return st;
}

static dflash_status drain_messages(dflash_fetch *f) {
  CURLMsg *m;
  int left;
  dflash_status st = DFLASH_OK;
  while ((m = curl_multi_info_read(f->multi, &left))) {
    if (m->msg != CURLMSG_DONE) continue;
    CURL *e = m->easy_handle;
    CURLcode rc = m->data.result;
    df_xfer *x;
    curl_easy_getinfo(e, CURLINFO_PRIVATE, (char **)&x);
    curl_multi_remove_handle(f->multi, e);
    unlink_xfer(f, x);
    dflash_status s2 = xfer_done(f, x, rc);
    if (!st) st = s2;
    easy_put(f, e);
    xfer_free(x);
  }
  return st;
}

/* Stop everything still in flight; their prompts stay unrecorded, to be resumed. */
static void abort_all(dflash_fetch *f) {
  while (f->xfers) {
    df_xfer *x = f->xfers;
    unlink_xfer(f, x);
    curl_multi_remove_handle(f->multi, x->easy);
    if (x->state) {
      f->servers[x->server].state_busy = false;
      easy_put(f, x->easy);
      xfer_free(x);
      continue;
    }
    f->servers[x->server].in_flight--;
    if (x->job) {
      f->jobs_in_flight--;
      df_job_free(x->job);
    } else {
      f->servers[x->server].probing = false;
    }
    easy_put(f, x->easy);
    xfer_free(x);
  }
}

/* ---- the loop --------------------------------------------------------------------- */

static bool finished(const dflash_fetch *f) {
  return f->next_bad == f->n_bad && f->next_prompt == f->n_prompts && f->n_waiting == 0 &&
         f->jobs_in_flight == 0;
}

/* How long epoll may sleep: until libcurl's timer, a retry falling due (when a
 * server could take it), a probe, the stop deadline or the next tick. */
static int wait_ms(const dflash_fetch *f, double now, double tick) {
  double t = tick;
  if (f->timer_at >= 0 && f->timer_at < t) t = f->timer_at;
  if (!f->stopping && pick_server(f) >= 0)
    for (size_t i = 0; i < f->n_waiting; i++)
      if (f->waiting[i]->not_before < t) t = f->waiting[i]->not_before;
  for (size_t i = 0; !f->stopping && i < f->n_servers; i++) {
    const df_server *s = &f->servers[i];
    if (!s->excluded && !s->healthy && !s->probing && s->next_probe < t) t = s->next_probe;
    if (s->state_kind != STATE_NONE && !s->excluded && !s->state_busy && s->healthy &&
        s->next_state < t)
      t = s->next_state;
  }
  if (!f->stopping && f->next_ctl < t) t = f->next_ctl;
  if (f->stopping && f->stop_deadline < t) t = f->stop_deadline;
  double ms = ceil((t - now) * 1000.0);
  return ms < 0 ? 0 : ms > 1000 ? 1000 : (int)ms;
}

static void poll_once(dflash_fetch *f, int timeout_ms) {
  struct epoll_event evs[256];
  int n = epoll_wait(f->epfd, evs, (int)DF_ARRAY_LEN(evs), timeout_ms);
  int running;
  for (int i = 0; i < n; i++) {
    int fd = evs[i].data.fd;
    if (fd == f->wake_r) {
      char buf[64];
      while (read(f->wake_r, buf, sizeof buf) > 0) {
      }
      continue;
    }
    int flags = (evs[i].events & (EPOLLIN | EPOLLHUP) ? CURL_CSELECT_IN : 0) |
                (evs[i].events & EPOLLOUT ? CURL_CSELECT_OUT : 0) |
                (evs[i].events & EPOLLERR ? CURL_CSELECT_ERR : 0);
    curl_multi_socket_action(f->multi, fd, flags, &running);
  }
  if (f->timer_at >= 0 && df_now_seconds() >= f->timer_at) {
    f->timer_at = -1;
    curl_multi_socket_action(f->multi, CURL_SOCKET_TIMEOUT, 0, &running);
  }
}

static dflash_status sync_outputs(dflash_fetch *f, double interval, double now) {
  dflash_status st = df_out_sync(&f->completions, interval, now);
  dflash_status st2 = df_out_sync(&f->errors, interval, now);
  return st ? st : st2;
}

static void report(dflash_fetch *f, dflash_fetch_progress_fn progress, void *user) {
  if (!progress) return;
  dflash_fetch_stats s = {.struct_size = sizeof s};
  /* Cannot fail: f is valid and s is this library's size. */
  DF_IGNORE(dflash_fetch_get_stats(f, &s));
  /* A callback that keeps returning non-zero asks for one graceful stop, not a hard one. */
  if (progress(f, &s, user) && atomic_load(&f->stop_requests) == 0) dflash_fetch_stop(f);
}

/* Every server in use taken out: how long for, and the stop once it lasts
 * down_timeout_s (the prompts left stay unrecorded, to be resumed). */
static void watch_down(dflash_fetch *f, double now) {
  for (size_t i = 0; i < f->n_servers; i++)
    if (!f->servers[i].excluded && f->servers[i].healthy) {
      if (f->all_down_since >= 0)
        df_log(DFLASH_LOG_INFO, "fetch: a server is back after all were down for %.0f s",
               now - f->all_down_since);
      f->all_down_since = -1;
      return;
    }
  double limit = f->guards.down_timeout_s;
  if (f->all_down_since < 0) {
    f->all_down_since = now;
    if (limit > 0)
      df_log(DFLASH_LOG_WARN,
             "fetch: every server is down; waiting up to %.0f s for one to "
             "come back",
             limit);
    else df_log(DFLASH_LOG_WARN, "fetch: every server is down; waiting for one to come back");
  } else if (limit > 0 && now - f->all_down_since >= limit) {
    f->stop_reason = "down_timeout";
    f->stopping = true;
    f->stop_deadline = now + f->o.drain_grace_s;
    df_log(DFLASH_LOG_ERROR,
           "fetch: every server has been down for %.0f s (the down timeout); "
           "stopping",
           now - f->all_down_since);
  }
}

/* One step: admit work, wait for sockets or timers, collect finished transfers.
 * Returns false when the loop should end. */
static bool step(dflash_fetch *f, dflash_status *st, double tick) {
  double now = df_now_seconds();
  int requests = atomic_load(&f->stop_requests);
  if (requests && !f->stopping) {
    f->stopping = true;
    f->stop_reason = "stop";
    f->stop_deadline = now + f->o.drain_grace_s;
    df_log(DFLASH_LOG_INFO, "fetch: stopping; waiting up to %.0f s for %llu requests in flight",
           f->o.drain_grace_s, (unsigned long long)f->jobs_in_flight);
  }
  if (f->stopping) {
    if (f->jobs_in_flight == 0 || now >= f->stop_deadline || requests >= 2) return false;
  } else {
    if ((*st = dispatch(f, now)) || finished(f)) return false;
    if ((*st = start_probes(f, now))) return false;
    if ((*st = start_states(f, now))) return false;
    ctl_tick(f, now);
    watch_down(f, now);
  }
  poll_once(f, wait_ms(f, now, tick));
  if ((*st = drain_messages(f))) return false;
  return !(*st = sync_outputs(f, f->o.fsync_interval_s, df_now_seconds()));
}

dflash_status df_loop_run(dflash_fetch *f, dflash_fetch_progress_fn progress, void *user) {
  f->start_time = df_now_seconds();
  f->next_ctl = f->start_time + CTL_TICK_S;
  sample_rates(f, f->start_time);
  for (size_t i = 0; i < f->n_servers; i++) f->servers[i].ctl.last_tick = f->start_time;
  double interval = f->o.progress_interval_s > 0 ? f->o.progress_interval_s : 0.5;
  double next_report = f->start_time + interval;
  dflash_status st = DFLASH_OK;
  while (step(f, &st, next_report)) {
    double now = df_now_seconds();
    if (now >= next_report) {
      report(f, progress, user);
      next_report = now + interval;
    }
  }
  abort_all(f);
  f->end_time = df_now_seconds();
  f->elapsed = f->end_time - f->start_time;
  dflash_status sync = sync_outputs(f, 0, df_now_seconds());
  if (!sync) sync = df_out_flush(&f->completions); /* remote outputs: upload the open chunks */
  if (!sync) sync = df_out_flush(&f->errors);
  report(f, progress, user);
  if (st || (st = sync)) return st;
  if (finished(f)) return DFLASH_OK;
  unsigned long long left = f->n_prompts - f->next_prompt + f->n_waiting + (f->n_bad - f->next_bad);
  if (f->stop_reason && !strcmp(f->stop_reason, "down_timeout")) {
    df_buf names = {0};
    for (size_t i = 0; i < f->n_servers; i++) {
      const df_server *s = &f->servers[i];
      if (s->excluded) continue;
      const char *what = s->check_msg ? s->check_msg : s->display;
      if (names.len) df_buf_append(&names, "; ", 2);
      df_buf_append(&names, what, strlen(what));
    }
    df_buf_append(&names, "", 1);
    st = df_error(DFLASH_E_TIMEOUT,
                  "fetch: every server was down for %.0f s (the down timeout): %s; "
                  "stopped with %llu prompts unfinished; run the same command again to resume "
                  "once a server answers",
                  f->guards.down_timeout_s, names.data ? names.data : "", left);
    df_buf_free(&names);
    return st;
  }
  return df_error(DFLASH_E_CANCELLED,
                  "fetch stopped with %llu prompts unfinished; run the "
                  "same command again to resume",
                  left);
}
