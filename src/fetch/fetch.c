/* Fetcher setup (options, outputs, resume, input scan) and the public getters. The event
 * loop is in loop.c, jobs and records in jobs.c. */
#include "fetch_state.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

static void fetch_options_defaults(dflash_fetch_options *o) {
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->thinking = 1;
  o->temperature = o->top_p = o->min_p = -1;
  o->seed = -1;
  o->stream = 1;
  o->concurrency = 0; /* the controller */
  o->max_concurrency = 512;
  o->server_state = 1;
  o->state_interval_s = 2;
  o->connect_timeout_s = 10;
  o->idle_timeout_s = 120;
  o->deadline_base_s = 60;
  o->deadline_per_token_s = 0.25;
  o->max_attempts = 8;
  o->backoff_base_s = 0.5;
  o->backoff_max_s = 30;
  o->retry_after_max_s = 60;
  o->fsync_interval_s = 1;
  o->fail_threshold = 3;
  o->probe_interval_s = 5;
  o->max_response_bytes = 64u << 20;
  o->verify_tls = 1;
  o->drain_grace_s = 30;
  o->progress_interval_s = 0.5;
}

DF_DEFINE_INIT(dflash_fetch_options, fetch_options_defaults)

/* ---- options --------------------------------------------------------------- */

static dflash_status parse_json_opt(const char *text, const char *what, json_t **out) {
  *out = NULL;
  if (!text) return DFLASH_OK;
  dflash_status st = df_json_parse(text, strlen(text), what, out);
  return st ? df_error_wrap(DFLASH_E_CONFIG, "option") : DFLASH_OK;
}

static dflash_status check_guards_and_chunking(const dflash_fetch_options *o) {
  if (o->settings_change < DFLASH_FETCH_SETTINGS_WARN ||
      o->settings_change > DFLASH_FETCH_SETTINGS_ALLOW)
    return df_error(DFLASH_E_CONFIG, "fetch: unknown settings_change %d", (int)o->settings_change);
  if (o->down_timeout_s != o->down_timeout_s)
    return df_error(DFLASH_E_CONFIG, "fetch: down_timeout_s is not a number");
  const char *w = o->chunk_worker;
  if (w && (!*w || strchr(w, '/')))
    return df_error(DFLASH_E_CONFIG, "fetch: worker name \"%s\" must be non-empty, no '/'", w);
  if (!(o->chunk_max_seconds >= 0))
    return df_error(DFLASH_E_CONFIG, "fetch: chunk_max_seconds must be >= 0 (0: 60)");
  return DFLASH_OK;
}

static dflash_status check_options(const dflash_fetch_options *o) {
  if (!o->model || !*o->model) return df_error(DFLASH_E_CONFIG, "fetch: no model name");
  if (!o->servers || o->n_servers == 0) return df_error(DFLASH_E_CONFIG, "fetch: no server URL");
  if (o->family < 0 || o->family > DFLASH_FETCH_FAMILY_QWEN)
    return df_error(DFLASH_E_CONFIG, "fetch: unknown family %d", (int)o->family);
  if (o->concurrency < 0 || o->max_attempts < 1 || o->fail_threshold < 1)
    return df_error(DFLASH_E_CONFIG, "fetch: max_attempts and fail_threshold must be >= 1, "
                                     "concurrency >= 0 (0: the controller)");
  if (o->concurrency == 0 && o->max_concurrency < 1)
    return df_error(DFLASH_E_CONFIG, "fetch: max_concurrency must be >= 1 (it is %d)",
                    (int)o->max_concurrency);
  if (o->server_state && o->state_interval_s <= 0)
    return df_error(DFLASH_E_CONFIG, "fetch: state_interval_s must be positive");
  if (o->shard_count > 1 && o->shard_index >= o->shard_count)
    return df_error(DFLASH_E_CONFIG, "fetch: shard %u/%u out of range", o->shard_index,
                    o->shard_count);
  if (o->connect_timeout_s <= 0 || o->idle_timeout_s <= 0 || o->probe_interval_s <= 0)
    return df_error(DFLASH_E_CONFIG, "fetch: timeouts must be positive");
  for (size_t i = 0; i < o->n_servers; i++)
    if (!o->servers[i] ||
        (strncmp(o->servers[i], "http://", 7) && strncmp(o->servers[i], "https://", 8)))
      return df_error(DFLASH_E_CONFIG, "fetch: server %zu: not an http(s) URL: %s", i,
                      o->servers[i] ? o->servers[i] : "(null)");
  return check_guards_and_chunking(o);
}

/* Credentials in a URL (user:secret@host) become ***@host: they never reach logs. */
static char *display_url(const char *url) {
  const char *scheme_end = strstr(url, "://") + 3;
  const char *slash = strchr(scheme_end, '/');
  const char *at = memchr(scheme_end, '@',
                          slash ? (size_t)(slash - scheme_end) : strlen(scheme_end));
  if (!at) return df_strdup(url);
  return df_asprintf("%.*s***%s", (int)(scheme_end - url), url, at);
}

static dflash_status add_servers(dflash_fetch *f, const dflash_fetch_options *o) {
  f->servers = calloc(o->n_servers, sizeof *f->servers);
  if (!f->servers) return df_error_nomem("servers");
  f->n_servers = o->n_servers;
  for (size_t i = 0; i < o->n_servers; i++) {
    df_server *s = &f->servers[i];
    size_t n = strlen(o->servers[i]);
    while (n && o->servers[i][n - 1] == '/') n--;
    s->base = df_strndup(o->servers[i], n);
    s->url = s->base ? df_asprintf("%s/chat/completions", s->base) : NULL;
    s->display = s->base ? display_url(s->base) : NULL;
    s->healthy = true;
    /* the load reports live at the root, not under the OpenAI prefix */
    size_t r = n >= 3 && !strncmp(s->base + n - 3, "/v1", 3) ? n - 3 : n;
    s->root = s->base ? df_strndup(s->base, r) : NULL;
    if (!s->url || !s->display || !s->root) return df_error_nomem("server URL");
  }
  return DFLASH_OK;
}

static dflash_status copy_options(dflash_fetch *f, const dflash_fetch_options *o) {
  f->o = *o;
  f->o.servers = NULL;
  f->o.stop_json = f->o.extra_json = f->o.api_key_env = f->o.api_key_file = NULL;
  if (!(f->model = df_strdup(o->model))) return df_error_nomem("model");
  f->o.model = f->model;
  dflash_status st;
  if ((st = parse_json_opt(o->stop_json, "stop", &f->stop))) return st;
  if ((st = parse_json_opt(o->extra_json, "extra JSON", &f->extra))) return st;
  if (f->stop && !json_is_string(f->stop) && !json_is_array(f->stop))
    return df_error(DFLASH_E_CONFIG, "fetch: stop must be a JSON string or array");
  if (f->extra && !json_is_object(f->extra))
    return df_error(DFLASH_E_CONFIG, "fetch: extra JSON must be an object");
  f->body_cfg = (df_body_cfg){.model = f->model,
                              .family = o->family,
                              .thinking = o->thinking,
                              .max_tokens = o->max_tokens,
                              .top_k = o->top_k,
                              .stream = o->stream,
                              .temperature = o->temperature,
                              .top_p = o->top_p,
                              .min_p = o->min_p,
                              .seed = o->seed,
                              .stop = f->stop,
                              .extra = f->extra};
  return add_servers(f, o);
}

/* ---- output directory and resume ------------------------------------------- */

static dflash_status lock_dir(dflash_fetch *f) {
  if (f->remote_out) return DFLASH_OK; /* workers are kept apart by their chunk names */
  dflash_status mk = df_mkdir_p(f->out_dir);
  if (mk) return df_error_wrap(mk, "output directory");
  char *path = df_path_join(f->out_dir, ".fetch.lock");
  if (!path) return df_error_nomem("path");
  f->lock_fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  dflash_status st = DFLASH_OK;
  if (f->lock_fd < 0) st = df_error_errno(DFLASH_E_IO, errno, "%s: cannot open", path);
  else if (flock(f->lock_fd, LOCK_EX | LOCK_NB) != 0)
    st = df_error(errno == EWOULDBLOCK ? DFLASH_E_STATE : DFLASH_E_IO,
                  "%s: another fetch is writing to %s", path, f->out_dir);
  free(path);
  return st;
}

static dflash_status mark_done(void *ctx, const char *id, uint64_t input_line, const char *text,
                               size_t len) {
  dflash_fetch *f = ctx;
  char key[40];
  if (!id) snprintf(key, sizeof key, "\1line:%llu", (unsigned long long)input_line);
  if (df_strset_add(&f->done, id ? id : key) < 0) return df_error_nomem("resume set");
  char digest[DF_DIGEST_LEN + 1];
  int has = id ? df_record_digest(text, len, digest) : 0;
  if (has < 0) return df_error_nomem("record digest");
  return has ? df_idset_add(&f->digests, id, digest) : DFLASH_OK;
}

/* A record of errors.jsonl: done, and an error unless completions.jsonl (read first)
 * has the id too. */
static dflash_status mark_error_done(void *ctx, const char *id, uint64_t input_line,
                                     const char *text, size_t len) {
  dflash_fetch *f = ctx;
  char key[40];
  if (!id) snprintf(key, sizeof key, "\1line:%llu", (unsigned long long)input_line);
  if (df_strset_has(&f->done, id ? id : key)) return DFLASH_OK;
  if (df_strset_add(&f->err_done, id ? id : key) < 0) return df_error_nomem("resume set");
  return mark_done(ctx, id, input_line, text, len);
}

/* With retry_errors, records of failed requests move from errors.jsonl to
 * errors.retried.jsonl (appended and synced first, so a crash in between
 * leaves them in errors.jsonl, where they are simply found again). */
static bool is_retryable_record(const char *line, size_t len) {
  json_t *r = json_loadb(line, len, 0, NULL);
  const char *kind = json_string_value(json_object_get(r, "kind"));
  bool retry = json_is_string(json_object_get(r, "id")) && kind && strcmp(kind, "input");
  json_decref(r);
  return retry;
}

/* A record of errors.retried: its prompt keeps its id (an id means one prompt), so other
 * messages under that id are a conflict, as while the error was in errors.jsonl. */
static dflash_status mark_retried(void *ctx, const char *id, uint64_t input_line, const char *text,
                                  size_t len) {
  (void)input_line;
  dflash_fetch *f = ctx;
  char digest[DF_DIGEST_LEN + 1];
  int has = id ? df_record_digest(text, len, digest) : 0;
  if (has < 0) return df_error_nomem("record digest");
  return has ? df_idset_add(&f->retried, id, digest) : DFLASH_OK;
}

/* The records retry_errors moved away, this run or an earlier one (read when there are any;
 * df_out_open and _open_remote leave `o` to close, failed or not). */
static dflash_status read_retried(dflash_fetch *f) {
  df_out o = {.fd = -1};
  dflash_status st = DFLASH_OK;
  char *loc = f->remote_out ? df_asprintf("%s/errors.retried/", f->out_dir)
                            : df_path_join(f->out_dir, "errors.retried.jsonl");
  struct stat sb;
  if (!loc) st = df_error_nomem("path");
  else if (f->remote_out) st = df_out_open_remote(f->storage, loc, mark_retried, f, &o);
  else if (stat(loc, &sb) == 0) st = df_out_open(loc, mark_retried, f, &o);
  df_out_close(&o);
  free(loc);
  return st;
}

static dflash_status move_retried_errors(dflash_fetch *f, const char *path) {
  df_out o;
  dflash_status st = df_out_open(path, NULL, NULL, &o); /* repairs a torn tail first */
  df_out_close(&o);
  char *text;
  size_t len;
  if (st || (st = df_read_file(path, &text, &len))) return st;
  df_buf keep = {0}, moved = {0};
  for (size_t i = 0; !st && i < len;) {
    size_t n = (size_t)((char *)memchr(text + i, '\n', len - i) - (text + i));
    df_buf *to = is_retryable_record(text + i, n) ? &moved : &keep;
    st = df_buf_append(to, text + i, n + 1);
    i += n + 1;
  }
  free(text);
  char *archive = df_path_join(f->out_dir, "errors.retried.jsonl");
  if (!st && moved.len) {
    df_out a;
    if (!archive) st = df_error_nomem("path");
    if (!st && !(st = df_out_open(archive, NULL, NULL, &a))) {
      st = df_write_all(a.fd, moved.data, moved.len, archive);
      a.dirty = true;
      df_out_close(&a);
    }
    if (!st) st = df_write_file_atomic(path, keep.data ? keep.data : "", keep.len);
  }
  free(archive);
  df_buf_free(&keep);
  df_buf_free(&moved);
  return st;
}

/* retry_errors on object storage: each errors chunk holding retryable
 * records is split: those records are written to errors.retried/ under the
 * chunk's own name, then the chunk is rewritten without them (an empty
 * object stays, so sequence numbers never go back). A crash in between
 * repeats the same two idempotent writes. */
static dflash_status move_retried_chunk(dflash_fetch *f, const char *loc, size_t plen) {
  void *data;
  size_t len;
  dflash_status st = dflash_storage_read(f->storage, loc, &data, &len);
  if (st) return st;
  const char *text = data;
  df_buf keep = {0}, moved = {0};
  for (size_t i = 0; !st && i < len;) {
    const char *nl = memchr(text + i, '\n', len - i);
    size_t n = nl ? (size_t)(nl - (text + i)) : len - i;
    if (n) st = df_buf_append(is_retryable_record(text + i, n) ? &moved : &keep, text + i, n + 1);
    i += n + 1;
  }
  dflash_storage_buffer_free(data);
  char *archive = df_asprintf("%s/errors.retried/%s", f->out_dir, loc + plen);
  if (!st && !archive) st = df_error_nomem("path");
  if (!st && moved.len) st = dflash_storage_write(f->storage, archive, moved.data, moved.len);
  if (!st && moved.len) st = dflash_storage_write(f->storage, loc, keep.data, keep.len);
  free(archive);
  df_buf_free(&keep);
  df_buf_free(&moved);
  return st;
}

static dflash_status move_retried_chunks(dflash_fetch *f, const char *prefix) {
  dflash_storage_listing *l = NULL;
  dflash_status st = dflash_storage_list(f->storage, prefix, &l);
  for (size_t i = 0; !st && i < dflash_storage_listing_count(l); i++) {
    const char *loc;
    st = dflash_storage_listing_get(l, i, &loc, NULL);
    if (!st && df_str_ends_with(loc, ".jsonl")) st = move_retried_chunk(f, loc, strlen(prefix));
  }
  dflash_storage_listing_free(l);
  return st;
}

static dflash_status open_remote_outputs(dflash_fetch *f) {
  char *cpre = df_asprintf("%s/completions/", f->out_dir);
  char *epre = df_asprintf("%s/errors/", f->out_dir);
  dflash_status st = (cpre && epre) ? DFLASH_OK : df_error_nomem("path");
  if (!st) st = df_out_open_remote(f->storage, cpre, mark_done, f, &f->completions);
  if (!st && f->o.retry_errors) st = move_retried_chunks(f, epre);
  if (!st) st = df_out_open_remote(f->storage, epre, mark_error_done, f, &f->errors);
  if (!st) st = read_retried(f);
  free(cpre);
  free(epre);
  return st;
}

static dflash_status open_outputs(dflash_fetch *f) {
  if (f->remote_out) return open_remote_outputs(f);
  char *cpath = df_path_join(f->out_dir, "completions.jsonl");
  char *epath = df_path_join(f->out_dir, "errors.jsonl");
  dflash_status st = (cpath && epath) ? DFLASH_OK : df_error_nomem("path");
  if (!st) st = df_out_open(cpath, mark_done, f, &f->completions);
  if (!st && f->o.retry_errors) st = move_retried_errors(f, epath);
  if (!st) st = df_out_open(epath, mark_error_done, f, &f->errors);
  if (!st) st = read_retried(f);
  free(cpath);
  free(epath);
  return st;
}

/* A storage client when the input or the output is on object storage; the
 * output prefix loses trailing '/'s (chunk names are joined with one). */
static dflash_status open_storage(dflash_fetch *f) {
  f->remote_in = dflash_storage_is_remote(f->input_path);
  f->remote_out = dflash_storage_is_remote(f->out_dir);
  dflash_chunk_writer_options_default(&f->chunk_opts);
  f->chunk_opts.max_records = 1000;
  f->chunk_opts.max_seconds = 60;
  if (!f->remote_in && !f->remote_out) return DFLASH_OK;
  for (size_t n = strlen(f->out_dir); n > 5 && f->out_dir[n - 1] == '/';) f->out_dir[--n] = 0;
  char host[64] = "worker";
  gethostname(host, sizeof host);
  host[sizeof host - 1] = 0;
  for (char *p = host; *p; p++)
    if (*p == '/') *p = '_';
  f->worker = df_asprintf("%s-%ld", host, (long)getpid());
  if (!f->worker) return df_error_nomem("worker name");
  return dflash_storage_create(NULL, &f->storage);
}

/* The guards and the chunking of the options (checked by check_options). */
static dflash_status take_guards_and_chunking(dflash_fetch *f, const dflash_fetch_options *o) {
  f->guards.no_server_check = o->no_server_check != 0;
  f->guards.skip_bad_servers = o->skip_bad_servers != 0;
  f->guards.settings_change = o->settings_change;
  f->guards.new_ids = o->new_ids != 0;
  f->guards.keep_first_duplicates = o->keep_first_duplicates != 0;
  f->guards.down_timeout_s = o->down_timeout_s == 0 ? 600 : o->down_timeout_s;
  if (o->chunk_max_records) f->chunk_opts.max_records = o->chunk_max_records;
  if (o->chunk_max_seconds != 0) f->chunk_opts.max_seconds = o->chunk_max_seconds;
  if (!o->chunk_worker || !f->worker) return DFLASH_OK; /* a local output has no worker */
  char *w = df_strdup(o->chunk_worker);
  if (!w) return df_error_nomem("worker name");
  free(f->worker);
  f->worker = w;
  return DFLASH_OK;
}

DFLASH_API dflash_status dflash_fetch_create(const dflash_fetch_options *opts,
                                             const char *input_path, const char *out_dir,
                                             dflash_fetch **out) {
  DF_CHECK_ARG(opts && input_path && out_dir && out);
  *out = NULL;
  dflash_fetch_options o;
  dflash_fetch_options_default(&o);
  dflash_status st = df_opts_in(&o, opts, sizeof o, "dflash_fetch_options");
  if (!st) st = check_options(&o);
  if (st) return st;
  opts = &o;
  dflash_fetch *f = calloc(1, sizeof *f);
  if (!f) return df_error_nomem("fetcher");
  f->lock_fd = f->epfd = f->wake_r = f->wake_w = -1;
  f->all_down_since = -1;
  f->completions.fd = f->errors.fd = -1;
  f->input_path = df_strdup(input_path);
  f->out_dir = df_strdup(out_dir);
  if (!f->input_path || !f->out_dir) st = df_error_nomem("paths");
  if (!st) st = open_storage(f);
  if (!st) st = take_guards_and_chunking(f, opts);
  if (!st) st = copy_options(f, opts);
  if (!st) st = df_loop_init(f, opts); /* reads the API key: fail before touching files */
  if (!st) st = lock_dir(f);
  if (!st) st = open_outputs(f);
  if (!st) st = df_fetch_map_input(f);
  if (!st) st = df_fetch_scan_input(f);
  if (st) {
    dflash_fetch_free(f);
    return st;
  }
  *out = f;
  return DFLASH_OK;
}

/* ---- public API ----------------------------------------------------------------- */

DFLASH_API dflash_status dflash_fetch_run(dflash_fetch *f, dflash_fetch_progress_fn progress,
                                          void *user) {
  DF_CHECK_ARG(f);
  if (f->ran) return df_error(DFLASH_E_STATE, "fetch: run was already called on this fetcher");
  f->ran = true;
  f->start_time = df_now_seconds();
  /* Before any work: settings first (nothing on the network), then the servers;
   * the settings are recorded only once the run goes ahead. */
  json_t *doc = NULL;
  dflash_status st = df_fetch_check_settings(f, &doc);
  if (!st && !f->guards.no_server_check && f->n_prompts > 0) /* nothing to send: no server */
    st = df_fetch_check_servers(f);
  if (!st && doc) st = df_fetch_write_settings(f, doc);
  json_decref(doc);
  if (st) {
    f->end_time = df_now_seconds();
    f->elapsed = f->end_time - f->start_time;
    if (f->elapsed <= 0) f->elapsed = 1e-9;
    if (st == DFLASH_E_CANCELLED) f->stopping = true, f->stop_reason = "stop";
    return st;
  }
  if (f->remote_out) {
    dflash_status st = df_out_start_chunks(&f->completions, f->storage, f->worker, &f->chunk_opts);
    if (!st) st = df_out_start_chunks(&f->errors, f->storage, f->worker, &f->chunk_opts);
    if (st) return st;
  }
  return df_loop_run(f, progress, user);
}

DFLASH_API void dflash_fetch_stop(dflash_fetch *f) {
  if (!f) return;
  atomic_fetch_add(&f->stop_requests, 1);
  if (f->wake_w >= 0) {
    ssize_t r = write(f->wake_w, "s", 1); /* async-signal-safe wake-up of epoll_wait */
    (void)r;
  }
}

static int32_t stop_reason_code(const char *reason) {
  static const char *const names[] = {"stop", "down_timeout", "server_check", "settings"};
  for (size_t i = 0; reason && i < DF_ARRAY_LEN(names); i++)
    if (!strcmp(reason, names[i])) return (int32_t)i + DFLASH_FETCH_STOP_REQUESTED;
  return DFLASH_FETCH_STOP_NONE;
}

/* A rate of this run: over the recent window while it runs, the whole run's once it ended. */
static double run_rate(const dflash_fetch *f, const df_rate *r, uint64_t v, double now) {
  if (f->end_time > 0) return f->elapsed > 0 ? (double)v / f->elapsed : 0;
  return f->ran ? df_rate_per_s(r, now, v) : 0;
}

/* The guards' counters and the rates (the fields after `stopping`). */
static void fill_run_stats(const dflash_fetch *f, dflash_fetch_stats *t) {
  double now = f->end_time > 0 ? f->end_time : df_now_seconds();
  t->stop_reason = stop_reason_code(f->stop_reason);
  for (size_t i = 0; i < f->n_servers; i++)
    t->servers_down += !f->servers[i].excluded && !f->servers[i].healthy;
  t->errors_earlier = f->errors_earlier;
  t->attempts_failed = f->attempts_failed;
  t->probes_failed = f->probes_failed;
  t->overloaded = f->overloaded;
  t->turns_counted = f->turns_counted;
  t->turns_uncounted = f->turns_uncounted;
  t->renamed = f->renamed;
  t->down_s = f->all_down_since >= 0 ? now - f->all_down_since : 0;
  t->down_timeout_s = f->guards.down_timeout_s > 0 ? f->guards.down_timeout_s : -1;
  t->prompts_per_s = run_rate(f, &f->records_rate, f->completed + f->failed, now);
  t->completion_tok_per_s = run_rate(f, &f->tokens_rate, f->completion_tokens, now);
}

DFLASH_API dflash_status dflash_fetch_get_stats(const dflash_fetch *f, dflash_fetch_stats *s) {
  DF_CHECK_ARG(f && s);
  dflash_fetch_stats t = {.struct_size = sizeof t};
  uint64_t bad_left = f->n_bad - f->next_bad;
  /* total: every record this shard ends with: already done + prompts + malformed lines. */
  t.total = f->skipped + f->n_prompts + f->n_bad;
  t.input_errors = f->n_bad;
  t.skipped = f->skipped;
  t.completed = f->completed;
  t.failed = f->failed;
  t.duplicates = f->duplicates;
  t.length = f->length;
  t.empty = f->empty;
  t.retries = f->retries;
  t.in_flight = f->jobs_in_flight;
  t.pending = (f->n_prompts - f->next_prompt) + f->n_waiting + bad_left;
  t.prompt_tokens = f->prompt_tokens;
  t.completion_tokens = f->completion_tokens;
  t.elapsed_s = f->ran ? (f->elapsed > 0 ? f->elapsed : df_now_seconds() - f->start_time) : 0;
  for (size_t i = 0; i < f->n_servers; i++) t.servers_healthy += f->servers[i].healthy;
  t.stopping = f->stopping;
  fill_run_stats(f, &t);
  return df_opts_out(s, &t, sizeof t, "dflash_fetch_stats");
}

/* A server's completed-token rate, as run_rate. */
static double server_rate(const dflash_fetch *f, const df_server *v) {
  return run_rate(f, &v->completed_tokens, v->completion_tokens,
                  f->end_time > 0 ? f->end_time : df_now_seconds());
}

DFLASH_API size_t dflash_fetch_server_count(const dflash_fetch *f) { return f ? f->n_servers : 0; }

DFLASH_API dflash_status dflash_fetch_get_server_stats(const dflash_fetch *f, size_t i,
                                                       dflash_fetch_server_stats *s) {
  DF_CHECK_ARG(f && s);
  if (i >= f->n_servers)
    return df_error(DFLASH_E_RANGE, "fetch: server %zu of %zu", i, f->n_servers);
  const df_server *v = &f->servers[i];
  dflash_fetch_server_stats t = {.struct_size = sizeof t,
                                 .url = v->display,
                                 .healthy = v->healthy,
                                 .in_flight = v->in_flight,
                                 .requests = v->requests,
                                 .completed = v->completed,
                                 .failures = v->failures,
                                 .completion_tokens = v->completion_tokens,
                                 .concurrency = v->ctl.limit,
                                 .tok_per_s = server_rate(f, v),
                                 .excluded = v->excluded,
                                 .overloaded = v->overloads > UINT32_MAX ? UINT32_MAX
                                                                         : (uint32_t)v->overloads};
  return df_opts_out(s, &t, sizeof t, "dflash_fetch_server_stats");
}

DFLASH_API dflash_status dflash_fetch_summary(const dflash_fetch *f, char *buf, size_t cap,
                                              size_t *len) {
  DF_CHECK_ARG(f && len && (buf || cap == 0));
  dflash_fetch_stats s = {.struct_size = sizeof s};
  dflash_status st = dflash_fetch_get_stats(f, &s);
  if (st) return st;
  json_t *servers = json_array();
  for (size_t i = 0; i < f->n_servers; i++) {
    const df_server *v = &f->servers[i];
    json_t *one = json_pack("{s:s,s:b,s:I,s:I,s:I,s:I,s:I,s:I,s:b,s:s?}", "url", v->display,
                            "healthy", v->healthy, "requests", (json_int_t)v->requests, "completed",
                            (json_int_t)v->completed, "failures", (json_int_t)v->failures,
                            "completion_tokens", (json_int_t)v->completion_tokens,
                            "turns_uncounted", (json_int_t)v->turns_uncounted, "probes_failed",
                            (json_int_t)v->probes_failed, "excluded", v->excluded, "check",
                            v->check_msg);
    if (one) { /* the limit the loop admits now and the smoothed streamed rate */
      json_object_set_new(one, "concurrency", json_integer((json_int_t)v->ctl.limit));
      json_object_set_new(one, "tok_per_s", json_real(server_rate(f, v)));
      json_object_set_new(one, "overloaded", json_integer((json_int_t)v->overloads));
    }
    json_array_append_new(servers, one);
  }
  /* completion_tokens sums the answers that came with a count (turns_counted); the rate is
   * null while answers came but none with a count, rather than a false 0 */
  json_t *rate = f->turns_counted == 0 && f->turns_uncounted > 0
                     ? json_null()
                     : json_real(s.elapsed_s > 0 ? (double)s.completion_tokens / s.elapsed_s : 0.0);
  json_t *j =
      json_pack("{s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:f,s:o,s:b}", "total",
                (json_int_t)s.total, "skipped", (json_int_t)s.skipped, "completed",
                (json_int_t)s.completed, "failed", (json_int_t)s.failed, "duplicates",
                (json_int_t)s.duplicates, "length", (json_int_t)s.length, "empty",
                (json_int_t)s.empty, "retries", (json_int_t)s.retries, "pending",
                (json_int_t)(s.pending + s.in_flight), "prompt_tokens", (json_int_t)s.prompt_tokens,
                "completion_tokens", (json_int_t)s.completion_tokens, "turns_counted",
                (json_int_t)f->turns_counted, "turns_uncounted", (json_int_t)f->turns_uncounted,
                "elapsed_s", s.elapsed_s, "completion_tok_per_s", rate, "stopped", (int)s.stopping);
  if (j) { /* the guards' counters (dflash_fetch_options); "servers" stays last */
    double now = f->end_time > 0 ? f->end_time : df_now_seconds();
    json_object_set_new(j, "attempts_failed", json_integer((json_int_t)f->attempts_failed));
    json_object_set_new(j, "probes_failed", json_integer((json_int_t)f->probes_failed));
    json_object_set_new(j, "errors_earlier", json_integer((json_int_t)f->errors_earlier));
    json_object_set_new(j, "overloaded", json_integer((json_int_t)f->overloaded));
    json_object_set_new(j, "renamed", json_integer((json_int_t)f->renamed));
    json_object_set_new(j, "down_s",
                        json_real(f->all_down_since >= 0 ? now - f->all_down_since : 0.0));
    json_object_set_new(j, "down_timeout_s",
                        f->guards.down_timeout_s > 0 ? json_real(f->guards.down_timeout_s)
                                                     : json_null());
    json_object_set_new(j, "stop_reason",
                        f->stop_reason ? json_string(f->stop_reason) : json_null());
    json_t *ctl = json_pack("{s:s,s:O,s:I}", "mode", f->o.concurrency ? "fixed" : "adaptive",
                            "decisions", f->decisions ? f->decisions : json_null(), "dropped",
                            (json_int_t)f->decisions_dropped);
    json_object_set_new(j, "controller", ctl);
    json_object_set(j, "servers", servers);
  }
  json_decref(servers);
  char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
  json_decref(j);
  if (!text) return df_error_nomem("summary");
  size_t n = strlen(text) + 1;
  *len = n;
  st = DFLASH_OK;
  if (n > cap && !buf) st = DFLASH_E_BUFFER; /* a size query: no message, nothing logged */
  else if (n > cap) st = df_error(DFLASH_E_BUFFER, "fetch summary needs %zu bytes", n);
  else memcpy(buf, text, n);
  free(text);
  return st;
}

DFLASH_API void dflash_fetch_free(dflash_fetch *f) {
  if (!f) return;
  df_loop_free(f);
  for (size_t i = 0; i < f->n_waiting; i++) df_job_free(f->waiting[i]);
  free(f->waiting);
  df_out_close(&f->completions);
  df_out_close(&f->errors);
  if (f->map && f->remote_in) dflash_storage_buffer_free((void *)f->map);
  else if (f->map) df_unmap_file((const uint8_t *)f->map, f->map_len);
  dflash_storage_free(f->storage);
  free(f->worker);
  for (size_t i = 0; i < f->n_bad; i++) {
    free(f->bad[i].id);
    free(f->bad[i].message);
  }
  free(f->bad);
  for (size_t i = 0; i < f->n_prompts; i++) free(f->prompts[i].id);
  free(f->prompts);
  df_strset_free(&f->done);
  df_idset_free(&f->digests);
  df_idset_free(&f->retried);
  df_buf_free(&f->conflicts.disk_names);
  df_buf_free(&f->conflicts.input_names);
  df_strset_free(&f->err_done);
  json_decref(f->settings);
  for (size_t i = 0; i < f->n_servers; i++) {
    free(f->servers[i].check_msg);
    free(f->servers[i].base);
    free(f->servers[i].url);
    free(f->servers[i].display);
    free(f->servers[i].root);
  }
  free(f->servers);
  json_decref(f->decisions);
  json_decref(f->stop);
  json_decref(f->extra);
  free(f->model);
  free(f->input_path);
  free(f->out_dir);
  if (f->lock_fd >= 0) close(f->lock_fd);
  free(f);
}
