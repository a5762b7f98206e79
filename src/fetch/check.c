/* What dflash_fetch_run checks before any work (the guards of dflash_fetch_options):
 * every server answers GET {base}/models with the model in its list, and the
 * request settings equal the ones recorded in OUT/settings.json. */
#include "fetch_state.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MODELS_BODY_MAX (4u << 20)
#define SETTINGS_NAME "settings.json"
#define SETTINGS_DUMP (JSON_INDENT(1) | JSON_SORT_KEYS | JSON_REAL_PRECISION(15))

/* ---- settings ---------------------------------------------------------------- */

static json_t *num_or_null(double v, bool sent) { return sent ? json_real(v) : json_null(); }

static json_t *int_or_null(json_int_t v, bool sent) { return sent ? json_integer(v) : json_null(); }

/* The settings that decide what a completion is: the request body without the
 * messages and the transport fields, and whether every turn is regenerated. */
json_t *df_fetch_settings(const dflash_fetch *f) {
  const df_body_cfg *c = &f->body_cfg;
  static const char *const families[] = {"none", "kimi", "qwen"};
  const char *key = c->family == DFLASH_FETCH_FAMILY_KIMI   ? "thinking"
                    : c->family == DFLASH_FETCH_FAMILY_QWEN ? "enable_thinking"
                                                            : NULL;
  json_t *kwargs = key ? json_pack("{s:b}", key, c->thinking ? 1 : 0) : json_null();
  return json_pack("{s:s,s:s,s:o,s:o,s:o,s:o,s:o,s:o,s:o,s:O,s:O,s:b}", "model", c->model, "family",
                   families[c->family], "chat_template_kwargs", kwargs, "max_tokens",
                   int_or_null(c->max_tokens, c->max_tokens > 0), "temperature",
                   num_or_null(c->temperature, c->temperature >= 0), "top_p",
                   num_or_null(c->top_p, c->top_p >= 0), "top_k",
                   int_or_null(c->top_k, c->top_k >= 1), "min_p",
                   num_or_null(c->min_p, c->min_p >= 0), "seed", int_or_null(c->seed, c->seed >= 0),
                   "stop", c->stop ? c->stop : json_null(), "extra",
                   c->extra ? c->extra : json_null(), "all_turns", f->o.all_turns != 0);
}

/* Numbers compare with a relative tolerance: the file keeps 15 significant digits. */
static bool same_value(const json_t *a, const json_t *b) {
  if (json_is_number(a) && json_is_number(b)) {
    double x = json_number_value(a), y = json_number_value(b);
    double scale = fmax(1.0, fmax(fabs(x), fabs(y)));
    return fabs(x - y) <= 1e-12 * scale;
  }
  return json_equal(a, b);
}

static void describe(df_buf *out, const json_t *v) {
  char *t = v ? json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY | JSON_REAL_PRECISION(15)) : NULL;
  const char *s = t ? t : "(absent)";
  size_t n = strlen(s);
  df_buf_append(out, s, n > 80 ? 77 : n);
  if (n > 80) df_buf_append(out, "...", 3);
  free(t);
}

/* "temperature 0.6 -> 1, max_tokens null -> 64": the keys of either object whose values differ. */
static char *changes(const json_t *old, const json_t *cur) {
  df_buf b = {0};
  const char *k;
  json_t *v;
  json_t *keys = json_object();
  json_object_foreach((json_t *)cur, k, v) json_object_set_new(keys, k, json_true());
  json_object_foreach((json_t *)old, k, v) json_object_set_new(keys, k, json_true());
  json_object_foreach(keys, k, v) {
    const json_t *a = json_object_get(old, k), *c = json_object_get(cur, k);
    if (a && c && same_value(a, c)) continue;
    if (b.len) df_buf_append(&b, ", ", 2);
    df_buf_append(&b, k, strlen(k));
    df_buf_append(&b, " ", 1);
    describe(&b, a);
    df_buf_append(&b, " -> ", 4);
    describe(&b, c);
  }
  json_decref(keys);
  if (!b.len) return NULL;
  df_buf_append(&b, "", 1);
  return b.data;
}

static char *settings_location(const dflash_fetch *f) {
  return f->remote_out ? df_asprintf("%s/%s", f->out_dir, SETTINGS_NAME)
                       : df_path_join(f->out_dir, SETTINGS_NAME);
}

/* The recorded settings document, or NULL with DFLASH_OK when there is none. */
static dflash_status read_settings(dflash_fetch *f, const char *loc, json_t **doc) {
  *doc = NULL;
  char *text = NULL;
  size_t len = 0;
  dflash_status st;
  if (f->remote_out) {
    void *data;
    st = dflash_storage_read(f->storage, loc, &data, &len);
    if (!st) {
      text = malloc(len + 1);
      if (text) memcpy(text, data, len), text[len] = 0;
      dflash_storage_buffer_free(data);
      if (!text) return df_error_nomem("settings");
    }
  } else {
    st = df_read_file(loc, &text, &len);
  }
  if (st == DFLASH_E_NOT_FOUND) return DFLASH_OK;
  if (st) return df_error_wrap(st, "fetch: reading the recorded settings");
  json_error_t err;
  json_t *j = json_loadb(text, len, 0, &err);
  free(text);
  if (!j || !json_is_object(json_object_get(j, "settings"))) {
    json_decref(j);
    return df_error(DFLASH_E_FORMAT,
                    "fetch: %s is not the settings record dflash fetch writes "
                    "(%s); move it away to start afresh",
                    loc, j ? "no \"settings\" object" : err.text);
  }
  *doc = j;
  return DFLASH_OK;
}

static json_t *utc_now(void) {
  char buf[32];
  time_t t = time(NULL);
  struct tm tm;
  gmtime_r(&t, &tm);
  strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return json_string(buf);
}

/* Compare this run's settings with the recorded ones. *to_write: the document to
 * record once the run goes ahead (a new one, or the changed settings with the old
 * ones kept in "earlier"); NULL when the record already says the same. */
/* 32 hex digits of SHA-256 over the compact, key-sorted settings: each record names the
 * settings it was fetched with ("settings_digest"), also after an allowed change. */
static dflash_status settings_digest(dflash_fetch *f) {
  char *text = json_dumps(f->settings, JSON_COMPACT | JSON_SORT_KEYS);
  if (!text) return df_error_nomem("settings");
  unsigned char h[32];
  df_sha256(text, strlen(text), h);
  free(text);
  for (int i = 0; i < DF_DIGEST_LEN / 2; i++) snprintf(f->settings_digest + 2 * i, 3, "%02x", h[i]);
  return DFLASH_OK;
}

dflash_status df_fetch_check_settings(dflash_fetch *f, json_t **to_write) {
  *to_write = NULL;
  if (!f->settings && !(f->settings = df_fetch_settings(f))) return df_error_nomem("settings");
  if (settings_digest(f)) return DFLASH_E_NOMEM;
  char *loc = settings_location(f);
  if (!loc) return df_error_nomem("path");
  json_t *old;
  dflash_status st = read_settings(f, loc, &old);
  if (st) {
    free(loc);
    return st;
  }
  json_t *earlier = old ? json_object_get(old, "earlier") : NULL;
  earlier = json_is_array(earlier) ? json_copy(earlier) : json_array();
  char *diff = old ? changes(json_object_get(old, "settings"), f->settings) : NULL;
  if (old && !diff) {
    json_decref(earlier);
  } else if (diff && f->guards.settings_change == DFLASH_FETCH_SETTINGS_REFUSE) {
    json_decref(earlier);
    f->stop_reason = "settings";
    st = df_error(DFLASH_E_MISMATCH,
                  "fetch: %s records other request settings than this run's: "
                  "%s. The outputs would mix them; run with the recorded settings, or allow the "
                  "change (dflash fetch --allow-settings-change) to go on and record it",
                  loc, diff);
  } else {
    if (diff)
      df_log(f->guards.settings_change == DFLASH_FETCH_SETTINGS_ALLOW ? DFLASH_LOG_INFO
                                                                      : DFLASH_LOG_WARN,
             "fetch: the request settings changed from the ones recorded in %s: %s; the "
             "earlier ones are kept there under \"earlier\"",
             loc, diff);
    if (old)
      json_array_append_new(earlier, json_pack("{s:O,s:O*,s:o}", "settings",
                                               json_object_get(old, "settings"), "since",
                                               json_object_get(old, "since"), "until", utc_now()));
    *to_write = json_pack("{s:i,s:O,s:o,s:o}", "dflash_fetch_settings", 1, "settings", f->settings,
                          "since", utc_now(), "earlier", earlier);
    if (!*to_write) st = df_error_nomem("settings");
  }
  free(diff);
  json_decref(old);
  free(loc);
  return st;
}

/* Atomic and synced (local: temporary file, fsync, rename, fsync of the folder). */
dflash_status df_fetch_write_settings(dflash_fetch *f, json_t *doc) {
  char *loc = settings_location(f);
  char *text = json_dumps(doc, SETTINGS_DUMP);
  dflash_status st = loc && text ? DFLASH_OK : df_error_nomem("settings");
  if (!st) {
    size_t n = strlen(text);
    text[n] = '\n'; /* json_dumps leaves room for its NUL: a final newline instead */
    st = f->remote_out ? dflash_storage_write(f->storage, loc, text, n + 1)
                       : df_write_file_atomic(loc, text, n + 1);
    if (st) st = df_error_wrap(st, "fetch: recording the settings in %s", loc);
  }
  free(text);
  free(loc);
  return st;
}

/* ---- start-up check of the servers ----------------------------------------------- */

typedef struct check {
  CURL *easy;
  size_t server;
  df_buf body;
  bool too_big;
  char errbuf[CURL_ERROR_SIZE];
} check;

static size_t on_body(char *buf, size_t size, size_t n, void *userp) {
  check *c = userp;
  size_t len = size * n;
  if (c->body.len + len > MODELS_BODY_MAX) {
    c->too_big = true;
    return 0;
  }
  return df_buf_append(&c->body, buf, len) ? 0 : len;
}

/* `"a", "b", "c" and 7 more` */
static char *served_list(const json_t *data) {
  df_buf b = {0};
  size_t i, shown = 0;
  const json_t *m;
  json_array_foreach(data, i, m) {
    const char *id = json_string_value(json_object_get(m, "id"));
    if (!id) continue;
    if (shown == 10) {
      char more[48];
      snprintf(more, sizeof more, " and %zu more", json_array_size(data) - i);
      df_buf_append(&b, more, strlen(more));
      break;
    }
    if (shown++) df_buf_append(&b, ", ", 2);
    char *q = df_asprintf("\"%.200s\"", id);
    if (q) df_buf_append(&b, q, strlen(q));
    free(q);
  }
  if (!shown) df_buf_append(&b, "no model", 8);
  df_buf_append(&b, "", 1);
  return b.data;
}

/* The verdict on one server: DFLASH_OK, or a status with *msg (malloc'd) naming it. */
static dflash_status judge(dflash_fetch *f, check *c, CURLcode rc, char **msg) {
  const df_server *s = &f->servers[c->server];
  long http = 0;
  curl_easy_getinfo(c->easy, CURLINFO_RESPONSE_CODE, &http);
  *msg = NULL;
  if (c->too_big) {
    *msg = df_asprintf("%s: GET %s/models answered more than %u bytes: not a model list",
                       s->display, s->display, MODELS_BODY_MAX);
    return DFLASH_E_FORMAT;
  }
  if (rc != CURLE_OK && http == 0) {
    *msg = df_asprintf("%s: unreachable: %s (curl %d)", s->display,
                       c->errbuf[0] ? c->errbuf : curl_easy_strerror(rc), (int)rc);
    return rc == CURLE_OPERATION_TIMEDOUT ? DFLASH_E_TIMEOUT : DFLASH_E_NETWORK;
  }
  long code = 0;
  char *detail = http != 200
                     ? df_error_body_message(c->body.data ? c->body.data : "", c->body.len, &code)
                     : NULL;
  if (http == 401 || http == 403) {
    *msg = df_asprintf("%s: GET /models answered HTTP %ld (%s): the server refused %s", s->display,
                       http, detail ? detail : "no detail",
                       f->has_key ? "the API key (api_key_env / api_key_file)"
                                  : "a request without an API key (give one with --api-key-env "
                                    "or --api-key-file)");
    free(detail);
    return DFLASH_E_AUTH;
  }
  if (http != 200) {
    *msg = df_asprintf("%s: GET %s/models answered HTTP %ld%s%s: is it the server's OpenAI base "
                       "URL, such as http://host:30000/v1? (--no-server-check skips this check "
                       "for a server without /models)",
                       s->display, s->display, http, detail ? ": " : "", detail ? detail : "");
    free(detail);
    return DFLASH_E_HTTP;
  }
  json_t *j = json_loadb(c->body.data ? c->body.data : "", c->body.len, 0, NULL);
  json_t *data = json_object_get(j, "data");
  dflash_status st = DFLASH_OK;
  if (!json_is_array(data)) {
    *msg = df_asprintf("%s: GET /models answered HTTP 200 without a model list "
                       "({\"data\": [{\"id\": ...}]})",
                       s->display);
    st = DFLASH_E_FORMAT;
  } else {
    size_t i;
    const json_t *m;
    bool found = false;
    json_array_foreach(data, i, m) {
      const char *id = json_string_value(json_object_get(m, "id"));
      if (id && !strcmp(id, f->model)) found = true;
    }
    if (!found) {
      char *list = served_list(data);
      *msg = df_asprintf("%s does not serve model \"%s\"; it serves %s", s->display, f->model,
                         list ? list : "?");
      free(list);
      st = DFLASH_E_NOT_FOUND;
    }
  }
  json_decref(j);
  return st;
}

static dflash_status start_check(dflash_fetch *f, CURLM *m, check *c) {
  const df_server *s = &f->servers[c->server];
  char *url = df_asprintf("%s/models", s->base);
  if (!url || !(c->easy = curl_easy_init())) {
    free(url);
    return df_error_nomem("server check");
  }
  CURL *e = c->easy;
  curl_easy_setopt(e, CURLOPT_URL, url);
  curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
  curl_easy_setopt(e, CURLOPT_HTTPHEADER, f->headers);
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, c);
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, c->errbuf);
  curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, (long)(f->o.connect_timeout_s * 1000));
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)(f->o.connect_timeout_s * 1000) + 30000L);
  curl_easy_setopt(e, CURLOPT_SSL_VERIFYPEER, f->o.verify_tls ? 1L : 0L);
  curl_easy_setopt(e, CURLOPT_SSL_VERIFYHOST, f->o.verify_tls ? 2L : 0L);
  curl_easy_setopt(e, CURLOPT_PRIVATE, c);
  CURLMcode mc = curl_multi_add_handle(m, e); /* curl copies the URL */
  free(url);
  return mc == CURLM_OK ? DFLASH_OK
                        : df_error(DFLASH_E_INTERNAL, "fetch: curl_multi_add_handle failed");
}

/* GET /models of every server at once; a stop request ends it (DFLASH_E_CANCELLED). */
static dflash_status run_checks(dflash_fetch *f, check *cs, size_t n, dflash_status *verdict) {
  CURLM *m = curl_multi_init();
  if (!m) return df_error_nomem("curl multi handle");
  dflash_status st = DFLASH_OK;
  for (size_t i = 0; !st && i < n; i++) st = start_check(f, m, &cs[i]);
  int running = 1;
  while (!st && running) {
    if (atomic_load(&f->stop_requests)) {
      st = df_error(DFLASH_E_CANCELLED, "fetch: stopped during the start-up check of the servers");
      break;
    }
    curl_multi_perform(m, &running);
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(m, &left)))
      if (msg->msg == CURLMSG_DONE) {
        check *c;
        curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, (char **)&c);
        char *why = NULL;
        verdict[c - cs] = judge(f, c, msg->data.result, &why);
        f->servers[c->server].check_msg = why;
      }
    if (running) curl_multi_poll(m, NULL, 0, 100, NULL);
  }
  for (size_t i = 0; i < n; i++)
    if (cs[i].easy) {
      curl_multi_remove_handle(m, cs[i].easy);
      curl_easy_cleanup(cs[i].easy);
    }
  curl_multi_cleanup(m);
  return st;
}

/* A server that refuses connections or times out is one that is restarting, not
 * a misconfiguration: it is kept, marked down and probed at once, and joins
 * when it answers (the run goes on with the others; every server down past
 * down_timeout_s stops it). Its verdict is cleared; returns how many. */
static size_t mark_down(dflash_fetch *f, const check *cs, dflash_status *verdict, size_t n) {
  size_t down = 0;
  for (size_t i = 0; i < n; i++) {
    if (verdict[i] != DFLASH_E_NETWORK && verdict[i] != DFLASH_E_TIMEOUT) continue;
    df_server *s = &f->servers[cs[i].server];
    s->healthy = false;
    s->next_probe = 0;
    verdict[i] = DFLASH_OK;
    down++;
    df_log(DFLASH_LOG_WARN, "fetch: %s; it is probed and joins when it answers",
           s->check_msg ? s->check_msg : s->display);
  }
  return down;
}

dflash_status df_fetch_check_servers(dflash_fetch *f) {
  size_t n = 0;
  for (size_t i = 0; i < f->n_servers; i++) n += !f->servers[i].excluded;
  check *cs = calloc(n ? n : 1, sizeof *cs);
  dflash_status *verdict = calloc(n ? n : 1, sizeof *verdict);
  if (!cs || !verdict) {
    free(cs);
    free(verdict);
    return df_error_nomem("server check");
  }
  for (size_t i = 0, k = 0; i < f->n_servers; i++)
    if (!f->servers[i].excluded) cs[k++].server = i;
  for (size_t i = 0; i < n; i++) verdict[i] = DFLASH_E_INTERNAL; /* until judged */
  dflash_status st = run_checks(f, cs, n, verdict);
  size_t bad = 0, down = mark_down(f, cs, verdict, st ? 0 : n);
  dflash_status first = DFLASH_OK;
  df_buf why = {0};
  for (size_t i = 0; !st && i < n; i++) {
    df_server *s = &f->servers[cs[i].server];
    if (!verdict[i]) continue;
    if (!s->check_msg) s->check_msg = df_asprintf("%s: no verdict", s->display);
    if (!bad++) first = verdict[i];
    if (why.len) df_buf_append(&why, "; ", 2);
    if (s->check_msg) df_buf_append(&why, s->check_msg, strlen(s->check_msg));
  }
  df_buf_append(&why, "", 1);
  size_t good = n - bad - down;
  if (!st && bad && (!f->guards.skip_bad_servers || good + down == 0)) {
    f->stop_reason = "server_check";
    if (good + down == 0 && f->guards.skip_bad_servers)
      st = df_error(first, "fetch: no server passed the start-up check (GET /models): %s",
                    why.data);
    else
      st = df_error(first,
                    "fetch: %zu of %zu servers failed the start-up check (GET /models), "
                    "so nothing was sent: %s%s",
                    bad, n, why.data,
                    good + down
                        ? ". --skip-bad-servers (skip_bad_servers) goes on with the ones that "
                          "passed"
                        : "");
  } else if (!st && bad) {
    for (size_t i = 0; i < n; i++) {
      df_server *s = &f->servers[cs[i].server];
      if (!verdict[i]) continue;
      s->excluded = true;
      s->healthy = false;
      df_log(DFLASH_LOG_WARN, "fetch: leaving out %s", s->check_msg);
    }
    df_log(DFLASH_LOG_WARN, "fetch: going on with %zu of %zu servers", good + down, n);
  }
  for (size_t i = 0; i < n; i++) df_buf_free(&cs[i].body);
  df_buf_free(&why);
  free(cs);
  free(verdict);
  return st;
}
