/* `dflash fetch`: regenerate completions with OpenAI-compatible servers. */
#include <dflash/fetch.h>
#include <dflash/progress.h>
#include <dflash/storage.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "commands.h"

static const char usage_text[] =
    "usage: dflash fetch --server URL [--server URL...] --model NAME [options] IN.jsonl -o OUTDIR\n"
    "\n"
    "Regenerates the last assistant turn of every conversation in IN.jsonl (OpenAI\n"
    "`messages` or ShareGPT `conversations`) and writes OUTDIR/completions.jsonl and\n"
    "OUTDIR/errors.jsonl. Re-running the same command resumes: ids already written are\n"
    "skipped. Ctrl-C drains in-flight requests (up to --grace), a second Ctrl-C stops at once.\n"
    "IN.jsonl may be an s3:// object and OUTDIR an s3:// prefix: completions and errors are\n"
    "then uploaded as immutable chunks OUTDIR/completions/WORKER-NNNNNNNN.jsonl (and errors/).\n"
    "Options take `--opt value` or `--opt=value`, in any order with IN.jsonl.\n"
    "\n"
    "Before any request, every server must answer GET URL/models listing NAME: a refused API\n"
    "key (401/403) or a model it does not serve is named and the run refused (exit 6);\n"
    "--skip-bad-servers goes on with the servers that pass instead. A server that cannot be\n"
    "reached (refused, timed out, a host name that does not resolve) is taken for one that is\n"
    "restarting: it is probed and joins when it answers, and when no server answers for\n"
    "--down-timeout seconds (default 600) the run stops (exit 5), naming them.\n"
    "Only connections that fail or time out take a server out; 429 and 503 (with or without\n"
    "Retry-After) mean it is overloaded: the request is retried and the server gets fewer.\n"
    "The request settings (model, family/thinking, max tokens, sampling, stop, extra,\n"
    "--all-turns) are recorded in OUTDIR/settings.json; a resume with other settings is\n"
    "refused, naming what changed, unless --allow-settings-change.\n"
    "An id means one prompt: every record carries a digest of its messages, and an input\n"
    "whose ids name other messages than their records in OUTDIR, or that repeats an id with\n"
    "other messages, is refused naming them (exit 1), unless --new-ids (fetch those under\n"
    "\"ID#2\", \"ID#3\"...) or, for repeats inside IN.jsonl, --keep-first.\n"
    "\n"
    "  --server URL          OpenAI-compatible base URL, e.g. http://host:30000/v1 (repeatable)\n"
    "  --model NAME          model name sent in each request (as the servers list it)\n"
    "  --family F            kimi | qwen | none (default none): reasoning switch in\n"
    "                        chat_template_kwargs\n"
    "  --no-thinking         send the family switch as false\n"
    "  --max-tokens N        cap on generated tokens (default: none sent)\n"
    "  --temperature T, --top-p P, --top-k K, --min-p P, --seed S   (default: not sent)\n"
    "  --stop JSON           stop string or array, as JSON\n"
    "  --extra JSON          object merged into every request body\n"
    "  --no-stream           ask for whole JSON responses instead of SSE\n"
    "  --all-turns           regenerate every assistant turn, feeding new turns back\n"
    "  --api-key-env VAR     read the API key from this environment variable\n"
    "  --api-key-file PATH   or from this file\n"
    "  --concurrency N       exactly N requests in flight per server, fixed (default: each\n"
    "                        server's own best, found and followed by a controller)\n"
    "  --max-concurrency N   the controller's cap per server (default 512)\n"
    "  --no-server-state     the controller reads only the streams, not the servers' load\n"
    "                        reports (llama.cpp /props slots; vLLM or SGLang /metrics)\n"
    "  --connect-timeout S   (default 10)\n"
    "  --idle-timeout S      longest silence inside a stream (default 120)\n"
    "  --deadline S          whole-request limit (default 60 + 0.25 per max token)\n"
    "  --max-attempts N      per prompt (default 8)\n"
    "  --backoff S           first backoff step (default 0.5; full jitter, doubling, max 30)\n"
    "  --fsync-interval S    fsync outputs at most this often; 0: every record (default 1)\n"
    "  --retry-errors        fetch ids in errors.jsonl again (moved to errors.retried.jsonl)\n"
    "  --shard I/N           only ids whose hash % N == I (N machines cover the input once)\n"
    "  --fail-threshold N    failures in a row that take a server out (default 3)\n"
    "  --probe-interval S    1-token probe of a server taken out (default 5)\n"
    "  --down-timeout S      stop (exit 5) when every server has been out this long\n"
    "                        (default 600; 0: wait forever)\n"
    "  --no-server-check     skip the start-up GET /models check\n"
    "  --skip-bad-servers    leave out servers that fail the check instead of refusing\n"
    "  --allow-settings-change  resume with request settings other than settings.json's\n"
    "                        (recorded there; the old ones kept under \"earlier\")\n"
    "  --new-ids             fetch prompts whose id names other messages (in OUTDIR or\n"
    "                        earlier in IN.jsonl) under \"ID#2\" (the next free suffix)\n"
    "  --keep-first          skip a line whose id came earlier in IN.jsonl (the first wins)\n"
    "  --max-response-bytes N  per response (default 64 MiB)\n"
    "  --grace S             drain time after Ctrl-C/SIGTERM (default 30)\n"
    "  --insecure            do not verify TLS certificates\n"
    "  --send-rid            send SGLang's rid (\"<id>-<turn>-<attempt>\")\n"
    "  --log-interval S      plain progress line period when not on a terminal (default 10)\n"
    "  --worker NAME         chunk name prefix for s3:// outputs (default HOSTNAME-PID;\n"
    "                        concurrent workers on one OUTDIR need distinct names)\n"
    "  --chunk-records N     close an s3:// chunk after N records (default 1000)\n"
    "  --chunk-seconds S     or after S seconds (default 60)\n"
    "  -o, --output OUTDIR   where the outputs go\n"
    "  -v, --verbose         log retries, probes and server health changes\n"
    "\n"
    "Exit status:\n"
    "  0  every prompt has a completion\n"
    "  1  an error (message on stderr), e.g. settings that differ from settings.json's, or\n"
    "     ids that name other prompts (see --new-ids)\n"
    "  2  a usage error\n"
    "  3  stopped by Ctrl-C/SIGTERM: run the same command again to resume\n"
    "  4  every prompt has a record, but some are in errors.jsonl (from this run or an\n"
    "     earlier one): each says why; --retry-errors fetches the failed requests again\n"
    "  5  no server could be reached for --down-timeout seconds (at start too, e.g. a host\n"
    "     name typo): what finished is kept; run the same command again to resume\n"
    "  6  a server refused the API key or does not serve NAME: nothing was sent\n"
    "The progress line shows the prompts/s and tok/s of the last 10 s (the first answers\n"
    "divided by at least 2 s), each server as sN IN_FLIGHT/CONCURRENCY and its completed\n"
    "tok/s, DOWN after a server that cannot be reached, and overloaded answers (429/503);\n"
    "the summary's \"controller\" lists the controller's decisions over time.\n"
    "The final summary is printed to stdout as JSON (\"stop_reason\": null, \"stop\",\n"
    "\"down_timeout\", \"server_check\" or \"settings\").\n"
    "The progress line counts retries (attempts sent again), failed (prompts written to\n"
    "errors.jsonl) and attempts failed (every attempt that failed, connection errors included).\n"
    "Token counts come from the server's usage (streams ask for stream_options.include_usage)\n"
    "or llama.cpp's timings; an answer without either has \"usage\": null. The progress line's\n"
    "tok/s sums the counted answers only: \"(N uncounted)\" says how many came without a count,\n"
    "\"? tok/s\" that none had one.\n";

static dflash_fetch *volatile g_fetch;

static void on_signal(int sig) {
  (void)sig;
  if (g_fetch) dflash_fetch_stop(g_fetch);
}

static void on_log(dflash_log_level level, const char *msg, void *user) {
  (void)user;
  static const char *const names[] = {"error", "warning", "info", "debug"};
  fprintf(stderr, "\ndflash fetch: %s: %s\n", names[level], msg);
}

typedef struct cli_state {
  dflash_progress *progress;
  uint64_t total;      /* for the progress line, made at the first report: a run refused */
  double log_interval; /* by its start-up checks shows none */
} cli_state;

/* Completion tokens per second of the last window, over the answers whose server sent a
 * count (completion_tokens sums only those): "850 tok/s"; "850 tok/s (12 uncounted)" when
 * some came without; "? tok/s" when answers came but none with a count. */
static void tok_rate(const dflash_fetch_stats *s, char *out, size_t cap) {
  unsigned long long uncounted = s->turns_uncounted;
  if (uncounted && !s->turns_counted) snprintf(out, cap, "? tok/s");
  else if (uncounted)
    snprintf(out, cap, "%.0f tok/s (%llu uncounted)", s->completion_tok_per_s, uncounted);
  else snprintf(out, cap, "%.0f tok/s", s->completion_tok_per_s);
}

/* While every server is down: how long for, and when the run gives up. */
static void down_note(const dflash_fetch_stats *s, char *out, size_t cap) {
  if (s->down_s > 0 && s->down_timeout_s > 0)
    snprintf(out, cap, "all servers down for %.0f s, waiting (stop at %.0f s) |", s->down_s,
             s->down_timeout_s);
  else if (s->down_s > 0) snprintf(out, cap, "all servers down for %.0f s, waiting |", s->down_s);
  else out[0] = 0;
}

/* Each server's load, completed-token rate, and DOWN only when it is (unreachable); one left
 * out by --skip-bad-servers is not down. */
static int server_notes(dflash_fetch *f, char *note, int n, size_t cap) {
  for (size_t i = 0; i < dflash_fetch_server_count(f) && n > 0 && (size_t)n < cap - 40; i++) {
    dflash_fetch_server_stats ss = {.struct_size = sizeof ss};
    if (dflash_fetch_get_server_stats(f, i, &ss) == DFLASH_OK)
      n += snprintf(note + n, cap - (size_t)n, " | s%zu %u/%u %.0f tok/s%s", i, ss.in_flight,
                    ss.concurrency, ss.tok_per_s,
                    ss.excluded  ? " LEFT OUT"
                    : ss.healthy ? ""
                                 : " DOWN");
  }
  return n;
}

/* The progress note: rates, failures, overloads, and each server. The count drawn is this
 * run's (skipped prompts left out): the reporter's rate divides it by the time since the
 * first report. */
static int on_progress(dflash_fetch *f, const dflash_fetch_stats *s, void *user) {
  cli_state *c = user;
  char note[1024], rate[64], down[128], over[48] = "";
  tok_rate(s, rate, sizeof rate);
  down_note(s, down, sizeof down);
  if (s->overloaded)
    snprintf(over, sizeof over, " overloaded %llu", (unsigned long long)s->overloaded);
  int n = down[0] ? snprintf(note, sizeof note, "%s", down)
                  : snprintf(note, sizeof note, "%.1f prompts/s %s", s->prompts_per_s, rate);
  n += snprintf(note + n, sizeof note - (size_t)n,
                " retries %llu attempts failed %llu prompts failed %llu%s%s",
                (unsigned long long)s->retries, (unsigned long long)s->attempts_failed,
                (unsigned long long)s->failed, over, s->stopping ? " STOPPING" : "");
  server_notes(f, note, n, sizeof note);
  if (!c->progress && dflash_progress_create(NULL, NULL, 0, "fetch", "prompts", c->total,
                                             c->log_interval, &c->progress))
    return 0;
  dflash_progress_update(c->progress, s->completed + s->failed, note);
  return 0;
}

typedef struct cli_args {
  dflash_fetch_options o;
  const char **servers;
  size_t n_servers;
  const char *input, *out_dir, *worker;
  double log_interval, chunk_seconds, down_timeout;
  int64_t chunk_records;
  int verbose, no_thinking, no_stream, insecure, allow_settings_change, no_server_state;
} cli_args;

static int add_server(const char *v, void *dst) {
  cli_args *a = dst;
  a->servers[a->n_servers++] = v; /* room for argc entries */
  return 0;
}

static int parse_shard(const char *s, void *dst) {
  dflash_fetch_options *o = dst;
  unsigned i, n;
  char extra;
  if (sscanf(s, "%u/%u%c", &i, &n, &extra) != 2 || n == 0 || i >= n) return -1;
  o->shard_index = i;
  o->shard_count = n;
  return 0;
}

static int parse_family(const char *s, void *dst) {
  dflash_fetch_options *o = dst;
  if (!strcmp(s, "kimi")) o->family = DFLASH_FETCH_FAMILY_KIMI;
  else if (!strcmp(s, "qwen")) o->family = DFLASH_FETCH_FAMILY_QWEN;
  else if (!strcmp(s, "none")) o->family = DFLASH_FETCH_FAMILY_NONE;
  else return -1;
  return 0;
}

/* 0 parsed, 1 help printed, 2 usage error. */
static int parse_args(int argc, char **argv, cli_args *a) {
  dflash_fetch_options_default(&a->o);
  a->log_interval = 10;
  a->down_timeout = 600;
  a->servers = calloc((size_t)argc, sizeof *a->servers);
  if (!a->servers) return 2;
  dflash_fetch_options *o = &a->o;
  const double big = 1e9;
  const cli_opt opts[] = {{"--server", CLI_FN, a, 0, 0, add_server},
                          {"--model", CLI_STR, &o->model, 0, 0, NULL},
                          {"--family", CLI_FN, o, 0, 0, parse_family},
                          {"--no-thinking", CLI_FLAG, &a->no_thinking, 0, 0, NULL},
                          {"--max-tokens", CLI_INT, &o->max_tokens, 0, INT32_MAX, NULL},
                          {"--temperature", CLI_REAL, &o->temperature, 0, 100, NULL},
                          {"--top-p", CLI_REAL, &o->top_p, 0, 1, NULL},
                          {"--top-k", CLI_INT, &o->top_k, -1, INT32_MAX, NULL},
                          {"--min-p", CLI_REAL, &o->min_p, 0, 1, NULL},
                          {"--seed", CLI_I64, &o->seed, 0, 9.2e18, NULL},
                          {"--stop", CLI_STR, &o->stop_json, 0, 0, NULL},
                          {"--extra", CLI_STR, &o->extra_json, 0, 0, NULL},
                          {"--no-stream", CLI_FLAG, &a->no_stream, 0, 0, NULL},
                          {"--all-turns", CLI_FLAG, &o->all_turns, 0, 0, NULL},
                          {"--api-key-env", CLI_STR, &o->api_key_env, 0, 0, NULL},
                          {"--api-key-file", CLI_STR, &o->api_key_file, 0, 0, NULL},
                          {"--concurrency", CLI_INT, &o->concurrency, 1, 100000, NULL},
                          {"--max-concurrency", CLI_INT, &o->max_concurrency, 1, 100000, NULL},
                          {"--no-server-state", CLI_FLAG, &a->no_server_state, 0, 0, NULL},
                          {"--connect-timeout", CLI_REAL, &o->connect_timeout_s, 0.001, 3600, NULL},
                          {"--idle-timeout", CLI_REAL, &o->idle_timeout_s, 0.001, big, NULL},
                          {"--deadline", CLI_REAL, &o->deadline_s, 0, big, NULL},
                          {"--max-attempts", CLI_INT, &o->max_attempts, 1, 1000, NULL},
                          {"--backoff", CLI_REAL, &o->backoff_base_s, 0, 3600, NULL},
                          {"--fsync-interval", CLI_REAL, &o->fsync_interval_s, 0, 3600, NULL},
                          {"--retry-errors", CLI_FLAG, &o->retry_errors, 0, 0, NULL},
                          {"--shard", CLI_FN, o, 0, 0, parse_shard},
                          {"--fail-threshold", CLI_INT, &o->fail_threshold, 1, 1000000, NULL},
                          {"--probe-interval", CLI_REAL, &o->probe_interval_s, 0.001, 3600, NULL},
                          {"--max-response-bytes", CLI_I64, &o->max_response_bytes, 0, 9.2e18,
                           NULL},
                          {"--grace", CLI_REAL, &o->drain_grace_s, 0, big, NULL},
                          {"--insecure", CLI_FLAG, &a->insecure, 0, 0, NULL},
                          {"--send-rid", CLI_FLAG, &o->send_rid, 0, 0, NULL},
                          {"--log-interval", CLI_REAL, &a->log_interval, 0, big, NULL},
                          {"--worker", CLI_STR, &a->worker, 0, 0, NULL},
                          {"--chunk-records", CLI_I64, &a->chunk_records, 0, big, NULL},
                          {"--chunk-seconds", CLI_REAL, &a->chunk_seconds, 0, big, NULL},
                          {"--down-timeout", CLI_REAL, &a->down_timeout, 0, big, NULL},
                          {"--no-server-check", CLI_FLAG, &a->o.no_server_check, 0, 0, NULL},
                          {"--skip-bad-servers", CLI_FLAG, &a->o.skip_bad_servers, 0, 0, NULL},
                          {"--allow-settings-change", CLI_FLAG, &a->allow_settings_change, 0, 0,
                           NULL},
                          {"--new-ids", CLI_FLAG, &o->new_ids, 0, 0, NULL},
                          {"--keep-first", CLI_FLAG, &o->keep_first_duplicates, 0, 0, NULL},
                          {"-o", CLI_STR, &a->out_dir, 0, 0, NULL},
                          {"--output", CLI_STR, &a->out_dir, 0, 0, NULL},
                          {"-v", CLI_FLAG, &a->verbose, 0, 0, NULL},
                          {"--verbose", CLI_FLAG, &a->verbose, 0, 0, NULL},
                          {NULL, 0, NULL, 0, 0, NULL}};
  _Static_assert(sizeof(int32_t) == sizeof(int) && sizeof(uint64_t) == sizeof(int64_t),
                 "option destinations");
  int n_pos, rc = cli_parse("fetch", usage_text, opts, argc, argv, &a->input, 1, &n_pos);
  if (rc) return rc;
  if (!a->n_servers) return cli_missing("fetch", "--server URL");
  if (!o->model) return cli_missing("fetch", "--model NAME");
  if (!a->input) return cli_missing("fetch", "the input file IN.jsonl");
  if (!a->out_dir) return cli_missing("fetch", "-o OUTDIR");
  if (a->no_thinking) o->thinking = 0;
  if (a->no_stream) o->stream = 0;
  if (a->no_server_state) o->server_state = 0;
  if (a->insecure) o->verify_tls = 0;
  o->servers = a->servers;
  o->n_servers = a->n_servers;
  o->down_timeout_s = a->down_timeout > 0 ? a->down_timeout : -1; /* 0: wait forever */
  o->settings_change = a->allow_settings_change ? DFLASH_FETCH_SETTINGS_ALLOW
                                                : DFLASH_FETCH_SETTINGS_REFUSE;
  o->chunk_worker = a->worker;
  o->chunk_max_records = (uint64_t)a->chunk_records;
  o->chunk_max_seconds = a->chunk_seconds;
  return 0;
}

/* The summary JSON, malloc'd (NULL on failure); the size query logs nothing. */
static char *summary_text(const dflash_fetch *f) {
  size_t len = 0;
  if (dflash_fetch_summary(f, NULL, 0, &len) != DFLASH_E_BUFFER) return NULL;
  char *buf = len ? malloc(len) : NULL;
  if (buf && dflash_fetch_summary(f, buf, len, &len) != DFLASH_OK) {
    free(buf);
    buf = NULL;
  }
  return buf;
}

/* Thousands of streams need thousands of sockets: lift the soft limit to the hard one. */
static void raise_fd_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

/* The exit status of a finished run (see the usage text); messages on stderr. */
static int exit_status(const cli_args *a, dflash_status st, const char *err,
                       const dflash_fetch_stats *s) {
  if (st == DFLASH_E_CANCELLED) {
    fprintf(stderr, "dflash fetch: %s\n", err);
    return 3;
  }
  if (st && s->stop_reason == DFLASH_FETCH_STOP_DOWN_TIMEOUT) {
    fprintf(stderr, "dflash fetch: %s\n", err);
    return 5;
  }
  if (st && s->stop_reason == DFLASH_FETCH_STOP_SERVER_CHECK) {
    fprintf(stderr, "dflash fetch: %s: %s\n", dflash_status_str(st), err);
    return 6;
  }
  if (st) {
    fprintf(stderr, "dflash fetch: %s: %s\n", dflash_status_str(st), err);
    return 1;
  }
  unsigned long long now = s->failed, before = s->errors_earlier;
  if (now + before == 0) return 0;
  size_t n = strlen(a->out_dir);
  while (n > 1 && a->out_dir[n - 1] == '/') n--;
  fprintf(stderr,
          "dflash fetch: %llu prompts ended in %.*s/%s (%llu in this run, %llu before); "
          "each record says why. --retry-errors fetches the failed requests again (malformed "
          "input lines stay)\n",
          now + before, (int)n, a->out_dir,
          dflash_storage_is_remote(a->out_dir) ? "errors/" : "errors.jsonl", now, before);
  return 4;
}

static int run(cli_args *a) {
  raise_fd_limit();
  dflash_fetch *f;
  dflash_status st = dflash_fetch_create(&a->o, a->input, a->out_dir, &f);
  if (st) return cli_fail("fetch", st);
  dflash_fetch_stats s = {.struct_size = sizeof s};
  if ((st = dflash_fetch_get_stats(f, &s))) {
    int rc = cli_fail("fetch", st);
    dflash_fetch_free(f);
    return rc;
  }
  cli_state c = {.total = s.total - s.skipped, .log_interval = a->log_interval};
  g_fetch = f;
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  st = dflash_fetch_run(f, on_progress, &c);
  /* the run's message, before anything else can replace it */
  char *err = strdup(st ? dflash_last_error() : "");
  if (c.progress) dflash_progress_finish(c.progress);
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  g_fetch = NULL;
  char *summary = summary_text(f);
  if (summary) printf("%s\n", summary);
  fflush(stdout);
  s = (dflash_fetch_stats){.struct_size = sizeof s};
  if (dflash_fetch_get_stats(f, &s)) s.failed = 1; /* cannot fail; never report success then */
  int rc = exit_status(a, st, err ? err : "out of memory", &s);
  free(summary);
  free(err);
  dflash_progress_free(c.progress);
  dflash_fetch_free(f);
  return rc;
}

int cmd_fetch(int argc, char **argv) {
  cli_args a = {0};
  int p = parse_args(argc, argv, &a);
  int rc = p == 1 ? 0 : p;
  if (p == 0) {
    dflash_set_log_callback(on_log, NULL, a.verbose ? DFLASH_LOG_DEBUG : DFLASH_LOG_WARN);
    rc = run(&a);
  }
  free(a.servers);
  return rc;
}
