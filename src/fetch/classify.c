/* What a finished transfer means (a completion, a retry or a failure, and why) and what a
 * server's load report says (llama.cpp's /props, vLLM's or SGLang's /metrics). Pure: no I/O;
 * the event loop (loop.c) acts on the answers. */
#include "fetch_state.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

static result fail(result_kind k, const char *err_kind, long http, bool server_fault, char *msg) {
  return (result){k, err_kind, msg ? msg : df_strdup("unknown error"), http, server_fault, false};
}

/* 429 and 503 (SGLang's full queue, a proxy's rate limit; with or without Retry-After) say
 * the server is busy, not broken: it answered. */
static bool overload_status(long status) { return status == 429 || status == 503; }

static result from_curl(const df_xfer *x, CURLcode rc) {
  const char *detail = x->errbuf[0] ? x->errbuf : curl_easy_strerror(rc);
  bool timeout = rc == CURLE_OPERATION_TIMEDOUT;
  bool permanent = rc == CURLE_PEER_FAILED_VERIFICATION || rc == CURLE_SSL_CACERT_BADFILE ||
                   rc == CURLE_UNSUPPORTED_PROTOCOL || rc == CURLE_URL_MALFORMAT;
  return fail(permanent ? RES_FAIL : RES_RETRY, timeout ? "timeout" : "network", 0, true,
              df_asprintf("%s (curl %d)", detail, (int)rc));
}

static result from_http_error(const df_xfer *x) {
  long code = 0;
  char *msg = df_error_body_message(x->raw.data ? x->raw.data : "", x->raw.len, &code);
  char *text = df_asprintf("HTTP %ld: %.*s", x->http,
                           msg ? 1000 : (int)(x->raw.len < 300 ? x->raw.len : 300),
                           msg ? msg : (x->raw.data ? x->raw.data : ""));
  free(msg);
  /* The server answered, so it is up: only a connection that fails or times out takes a
   * server out (a 500 or a stream error is retried; after max_attempts it is recorded). */
  result r = fail(df_http_retryable(x->http) ? RES_RETRY : RES_FAIL, "http", x->http, false, text);
  r.overload = overload_status(x->http);
  return r;
}

/* Why an answer that parsed has no finish_reason (see df_resp_judge). */
static char *unfinished_msg(const df_xfer *x) {
  const df_resp *r = &x->resp;
  if (!x->sse)
    return df_asprintf("the response (HTTP %ld, %llu bytes) has no finish_reason: the server "
                       "did not finish the generation",
                       x->http, (unsigned long long)x->bytes);
  if (r->done)
    return df_asprintf("the stream ended with [DONE] after %llu events without a finish_reason: "
                       "the server aborted the generation",
                       (unsigned long long)r->chunks);
  return df_asprintf("the stream ended after %llu events without a finish_reason or [DONE]",
                     (unsigned long long)r->chunks);
}

/* An HTTP 2xx answer: complete, an error event, or cut short. */
static result from_success(df_xfer *x, CURLcode rc) {
  df_resp *r = &x->resp;
  if (!x->sse) df_resp_body(r, x->raw.data ? x->raw.data : "", x->raw.len);
  switch (df_resp_judge(r)) {
  case DF_RESP_COMPLETE: return (result){.kind = RES_OK};
  case DF_RESP_ERROR: {
    bool retry = r->error_code == 0 || df_http_retryable(r->error_code);
    result e = fail(retry ? RES_RETRY : RES_FAIL, "stream", r->error_code, false,
                    df_asprintf("error after HTTP %ld: %s", x->http, r->error));
    e.overload = overload_status(r->error_code); /* SGLang's full queue inside a stream */
    return e;
  }
  case DF_RESP_ABORTED:
    return fail(RES_RETRY, "stream", 0, false,
                df_asprintf("the server ended the generation with "
                            "finish_reason \"%s\"",
                            r->finish_reason));
  case DF_RESP_BAD_JSON:
  case DF_RESP_UNFINISHED: break;
  }
  if (rc != CURLE_OK) return from_curl(x, rc);
  if (r->bad_json)
    return fail(RES_RETRY, "response", 0, false,
                df_asprintf("invalid JSON in the %s (%llu bytes)", x->sse ? "stream" : "response",
                            (unsigned long long)x->bytes));
  return fail(RES_RETRY, "stream", 0, false, unfinished_msg(x));
}

result df_fetch_classify(df_xfer *x, CURLcode rc) {
  if (!x->type_known) curl_easy_getinfo(x->easy, CURLINFO_RESPONSE_CODE, &x->http);
  if (x->too_big)
    return fail(RES_FAIL, "response", x->http, false,
                df_asprintf("response larger than max_response_bytes (%llu)",
                            (unsigned long long)x->max_bytes));
  if (x->http / 100 == 2) return from_success(x, rc);
  if (x->http == 0 || rc != CURLE_OK) {
    if (x->http >= 300) return from_http_error(x); /* a status line, then a reset */
    return from_curl(x, rc);
  }
  return from_http_error(x);
}


void df_rate_sample(df_rate *r, double t, uint64_t v) {
  r->t[r->next] = t;
  r->v[r->next] = v;
  r->next = (r->next + 1) % DF_RATE_SAMPLES;
  if (r->n < DF_RATE_SAMPLES) r->n++;
}

double df_rate_per_s(const df_rate *r, double now, uint64_t v) {
  if (r->n == 0) return 0;
  unsigned oldest = (r->next + DF_RATE_SAMPLES - r->n) % DF_RATE_SAMPLES, pick = oldest;
  for (unsigned k = 0; k < r->n; k++) { /* oldest first: the first inside the window */
    pick = (oldest + k) % DF_RATE_SAMPLES;
    if (r->t[pick] >= now - DF_RATE_WINDOW_S) break;
  }
  double len = now - r->t[pick];
  uint64_t d = v >= r->v[pick] ? v - r->v[pick] : 0;
  return (double)d / (len > DF_RATE_FLOOR_S ? len : DF_RATE_FLOOR_S);
}

/* llama.cpp's GET /props: total_slots, or -1. */
double df_fetch_props_slots(const char *text, size_t len) {
  json_t *j = json_loadb(text, len, 0, NULL);
  json_t *v = json_object_get(j, "total_slots");
  double slots = json_is_integer(v) ? (double)json_integer_value(v) : -1;
  json_decref(j);
  return slots;
}

/* One Prometheus sample line "name{labels} value": adds value to the field it feeds. */
static void metrics_line(const char *l, const char *end, df_ctl_state *st) {
  static const struct {
    const char *name;
    size_t field;
  } names[] = {
      {"vllm:num_requests_waiting", offsetof(df_ctl_state, waiting)},
      {"sglang:num_queue_reqs", offsetof(df_ctl_state, waiting)},
      {"vllm:num_requests_running", offsetof(df_ctl_state, running)},
      {"sglang:num_running_reqs", offsetof(df_ctl_state, running)},
      {"vllm:kv_cache_usage_perc", offsetof(df_ctl_state, kv_usage)},
      {"vllm:gpu_cache_usage_perc", offsetof(df_ctl_state, kv_usage)},
      {"sglang:token_usage", offsetof(df_ctl_state, kv_usage)},
      {"vllm:num_preemptions_total", offsetof(df_ctl_state, preemptions)},
      {"sglang:num_retracted_reqs", offsetof(df_ctl_state, preemptions)},
  };
  size_t n = strcspn(l, "{ \n");
  const char *v = l + n;
  if (*v == '{') v = memchr(v, '}', (size_t)(end - v));
  if (!v || v >= end) return;
  char *e;
  double x = strtod(v + (*v == '}'), &e);
  if (e == v + (*v == '}') || x != x) return;
  for (size_t i = 0; i < DF_ARRAY_LEN(names); i++)
    if (strlen(names[i].name) == n && !strncmp(l, names[i].name, n)) {
      double *field = (double *)((char *)st + names[i].field);
      *field = *field < 0 ? x : *field + x; /* summed over label sets (DP ranks, engines) */
    }
}

/* vLLM's or SGLang's /metrics; false when it names none of their queue gauges. */
bool df_fetch_parse_metrics(const char *text, size_t len, df_ctl_state *st) {
  *st = (df_ctl_state){-1, -1, -1, -1, -1};
  char *copy = df_strndup(text, len); /* NUL-terminated for strtod */
  if (!copy) return false;
  for (char *l = copy; l && *l;) {
    char *nl = strchr(l, '\n');
    char *end = nl ? nl : l + strlen(l);
    if (*l != '#') metrics_line(l, end, st);
    l = nl ? nl + 1 : NULL;
  }
  free(copy);
  return st->waiting >= 0 || st->running >= 0;
}
