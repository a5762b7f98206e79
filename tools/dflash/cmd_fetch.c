/* `dflash fetch`: regenerate completions with OpenAI-compatible servers. */
#include <dflash/fetch.h>
#include <dflash/progress.h>
#include <getopt.h>
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
    "\n"
    "  --server URL          OpenAI-compatible base URL, e.g. http://host:30000/v1 (repeatable)\n"
    "  --model NAME          model name sent in each request\n"
    "  --family F            kimi | qwen | none: reasoning switch in chat_template_kwargs\n"
    "  --no-thinking         send the family switch as false\n"
    "  --max-tokens N        cap on generated tokens (default: none sent)\n"
    "  --temperature T, --top-p P, --top-k K, --min-p P, --seed S\n"
    "  --stop JSON           stop string or array, as JSON\n"
    "  --extra JSON          object merged into every request body\n"
    "  --no-stream           ask for whole JSON responses instead of SSE\n"
    "  --all-turns           regenerate every assistant turn, feeding new turns back\n"
    "  --api-key-env VAR     read the API key from this environment variable\n"
    "  --api-key-file PATH   or from this file\n"
    "  --concurrency N       requests in flight per server (default 64)\n"
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
    "  --max-response-bytes N  per response (default 64 MiB)\n"
    "  --grace S             drain time after Ctrl-C/SIGTERM (default 30)\n"
    "  --insecure            do not verify TLS certificates\n"
    "  --send-rid            send SGLang's rid (\"<id>-<turn>-<attempt>\")\n"
    "  --log-interval S      plain progress line period when not on a terminal (default 10)\n"
    "  --worker NAME         chunk name prefix for s3:// outputs (default HOSTNAME-PID;\n"
    "                        concurrent workers on one OUTDIR need distinct names)\n"
    "  --chunk-records N     close an s3:// chunk after N records (default 1000)\n"
    "  --chunk-seconds S     or after S seconds (default 60)\n"
    "  -v, --verbose         log retries and server health changes\n"
    "\n"
    "Exit status: 0 all prompts have a record, 1 error, 2 usage, 3 stopped (run again to resume).\n"
    "The final summary is printed to stdout as JSON.\n"
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
  char *summary; /* the last dflash_fetch_summary, grown as needed */
  size_t cap;
} cli_state;

/* A top-level count of the summary JSON (its keys come before "servers"); 0 when absent. */
static unsigned long long summary_count(const char *json, const char *key) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *hit = strstr(json, pat), *servers = strstr(json, "\"servers\":");
  if (!hit || (servers && hit > servers)) return 0;
  return strtoull(hit + strlen(pat), NULL, 10);
}

/* Completion tokens per second over the answers whose server sent a count
 * (dflash_fetch_stats.completion_tokens sums only those; the summary says how many
 * came without one): "850 tok/s"; "850 tok/s (12 uncounted)" when some came without;
 * "? tok/s" when answers came but none with a count. */
static void tok_rate(dflash_fetch *f, const dflash_fetch_stats *s, cli_state *c, double el,
                     char *out, size_t cap) {
  unsigned long long counted = 0, uncounted = 0;
  size_t len = 0;
  dflash_status st = dflash_fetch_summary(f, c->summary, c->cap, &len);
  if (st == DFLASH_E_BUFFER) { /* rare: run() sized the buffer for the servers */
    char *grown = realloc(c->summary, len * 2);
    if (grown) {
      c->summary = grown;
      c->cap = len * 2;
      st = dflash_fetch_summary(f, c->summary, c->cap, &len);
    }
  }
  if (st == DFLASH_OK) {
    counted = summary_count(c->summary, "turns_counted");
    uncounted = summary_count(c->summary, "turns_uncounted");
  }
  if (uncounted && !counted) snprintf(out, cap, "? tok/s");
  else if (uncounted)
    snprintf(out, cap, "%.0f tok/s (%llu uncounted)", (double)s->completion_tokens / el, uncounted);
  else snprintf(out, cap, "%.0f tok/s", (double)s->completion_tokens / el);
}

/* The progress note: rates, and each server's load and health. */
static int on_progress(dflash_fetch *f, const dflash_fetch_stats *s, void *user) {
  cli_state *c = user;
  char note[512], rate[64];
  double el = s->elapsed_s > 0 ? s->elapsed_s : 1e-9;
  tok_rate(f, s, c, el, rate, sizeof rate);
  int n = snprintf(note, sizeof note, "%.1f req/s %s retries %llu failed %llu%s",
                   (double)(s->completed + s->failed) / el, rate,
                   (unsigned long long)s->retries, (unsigned long long)s->failed,
                   s->stopping ? " STOPPING" : "");
  for (size_t i = 0; i < dflash_fetch_server_count(f) && n > 0 && (size_t)n < sizeof note - 40; i++) {
    dflash_fetch_server_stats ss = {.struct_size = sizeof ss};
    if (dflash_fetch_get_server_stats(f, i, &ss) == DFLASH_OK)
      n += snprintf(note + n, sizeof note - (size_t)n, " | s%zu %u%s", i, ss.in_flight,
                    ss.healthy ? "" : " DOWN");
  }
  dflash_progress_update(c->progress, s->skipped + s->completed + s->failed, note);
  return 0;
}

typedef struct cli_args {
  dflash_fetch_options o;
  const char **servers;
  size_t n_servers;
  const char *input, *out_dir, *worker;
  double log_interval, chunk_records, chunk_seconds;
  int verbose;
} cli_args;

static int parse_shard(const char *s, dflash_fetch_options *o) {
  unsigned i, n;
  char extra;
  if (sscanf(s, "%u/%u%c", &i, &n, &extra) != 2 || n == 0 || i >= n) return -1;
  o->shard_index = i;
  o->shard_count = n;
  return 0;
}

static int parse_family(const char *s, dflash_fetch_options *o) {
  if (!strcmp(s, "kimi")) o->family = DFLASH_FETCH_FAMILY_KIMI;
  else if (!strcmp(s, "qwen")) o->family = DFLASH_FETCH_FAMILY_QWEN;
  else if (!strcmp(s, "none")) o->family = DFLASH_FETCH_FAMILY_NONE;
  else return -1;
  return 0;
}

enum {
  O_MODEL = 256, O_FAMILY, O_NO_THINKING, O_MAX_TOKENS, O_TEMP, O_TOP_P, O_TOP_K, O_MIN_P, O_SEED,
  O_STOP, O_EXTRA, O_NO_STREAM, O_ALL_TURNS, O_KEY_ENV, O_KEY_FILE, O_CONC, O_CONNECT, O_IDLE,
  O_DEADLINE, O_ATTEMPTS, O_BACKOFF, O_FSYNC, O_RETRY_ERRORS, O_SHARD, O_FAIL_THR, O_PROBE,
  O_MAX_RESP, O_GRACE, O_INSECURE, O_RID, O_LOG_INTERVAL, O_SERVER, O_HELP, O_WORKER,
  O_CHUNK_RECORDS, O_CHUNK_SECONDS
};

static const struct option long_opts[] = {
    {"server", 1, 0, O_SERVER}, {"model", 1, 0, O_MODEL}, {"family", 1, 0, O_FAMILY},
    {"no-thinking", 0, 0, O_NO_THINKING}, {"max-tokens", 1, 0, O_MAX_TOKENS},
    {"temperature", 1, 0, O_TEMP}, {"top-p", 1, 0, O_TOP_P}, {"top-k", 1, 0, O_TOP_K},
    {"min-p", 1, 0, O_MIN_P}, {"seed", 1, 0, O_SEED}, {"stop", 1, 0, O_STOP},
    {"extra", 1, 0, O_EXTRA}, {"no-stream", 0, 0, O_NO_STREAM}, {"all-turns", 0, 0, O_ALL_TURNS},
    {"api-key-env", 1, 0, O_KEY_ENV}, {"api-key-file", 1, 0, O_KEY_FILE},
    {"concurrency", 1, 0, O_CONC}, {"connect-timeout", 1, 0, O_CONNECT},
    {"idle-timeout", 1, 0, O_IDLE}, {"deadline", 1, 0, O_DEADLINE},
    {"max-attempts", 1, 0, O_ATTEMPTS}, {"backoff", 1, 0, O_BACKOFF},
    {"fsync-interval", 1, 0, O_FSYNC}, {"retry-errors", 0, 0, O_RETRY_ERRORS},
    {"shard", 1, 0, O_SHARD}, {"fail-threshold", 1, 0, O_FAIL_THR},
    {"probe-interval", 1, 0, O_PROBE}, {"max-response-bytes", 1, 0, O_MAX_RESP},
    {"grace", 1, 0, O_GRACE}, {"insecure", 0, 0, O_INSECURE}, {"send-rid", 0, 0, O_RID},
    {"log-interval", 1, 0, O_LOG_INTERVAL}, {"worker", 1, 0, O_WORKER},
    {"chunk-records", 1, 0, O_CHUNK_RECORDS}, {"chunk-seconds", 1, 0, O_CHUNK_SECONDS}, {"output", 1, 0, 'o'}, {"verbose", 0, 0, 'v'},
    {"help", 0, 0, O_HELP}, {0, 0, 0, 0}};

static const char *option_name(int opt) {
  for (size_t i = 0; long_opts[i].name; i++)
    if (long_opts[i].val == opt) return long_opts[i].name;
  return "?";
}

/* Options that set a number: one table instead of a case each. */
static int set_number(cli_args *a, int opt, const char *v) {
  char *end;
  double d = strtod(v, &end);
  if (end == v || *end) return -1;
  dflash_fetch_options *o = &a->o;
  switch (opt) {
  case O_MAX_TOKENS: o->max_tokens = (int32_t)d; break;
  case O_TEMP: o->temperature = d; break;
  case O_TOP_P: o->top_p = d; break;
  case O_TOP_K: o->top_k = (int32_t)d; break;
  case O_MIN_P: o->min_p = d; break;
  case O_SEED: o->seed = (int64_t)d; break;
  case O_CONC: o->concurrency = (int32_t)d; break;
  case O_CONNECT: o->connect_timeout_s = d; break;
  case O_IDLE: o->idle_timeout_s = d; break;
  case O_DEADLINE: o->deadline_s = d; break;
  case O_ATTEMPTS: o->max_attempts = (int32_t)d; break;
  case O_BACKOFF: o->backoff_base_s = d; break;
  case O_FSYNC: o->fsync_interval_s = d; break;
  case O_FAIL_THR: o->fail_threshold = (int32_t)d; break;
  case O_PROBE: o->probe_interval_s = d; break;
  case O_MAX_RESP: o->max_response_bytes = (uint64_t)d; break;
  case O_GRACE: o->drain_grace_s = d; break;
  case O_LOG_INTERVAL: a->log_interval = d; break;
  case O_CHUNK_RECORDS: a->chunk_records = d; break;
  case O_CHUNK_SECONDS: a->chunk_seconds = d; break;
  default: return -1;
  }
  return 0;
}

static int set_option(cli_args *a, int opt, const char *v) {
  dflash_fetch_options *o = &a->o;
  switch (opt) {
  case O_SERVER: a->servers[a->n_servers++] = v; return 0;
  case O_MODEL: o->model = v; return 0;
  case O_FAMILY: return parse_family(v, o);
  case O_NO_THINKING: o->thinking = 0; return 0;
  case O_STOP: o->stop_json = v; return 0;
  case O_EXTRA: o->extra_json = v; return 0;
  case O_NO_STREAM: o->stream = 0; return 0;
  case O_ALL_TURNS: o->all_turns = 1; return 0;
  case O_KEY_ENV: o->api_key_env = v; return 0;
  case O_KEY_FILE: o->api_key_file = v; return 0;
  case O_RETRY_ERRORS: o->retry_errors = 1; return 0;
  case O_SHARD: return parse_shard(v, o);
  case O_INSECURE: o->verify_tls = 0; return 0;
  case O_RID: o->send_rid = 1; return 0;
  case 'o': a->out_dir = v; return 0;
  case O_WORKER: a->worker = v; return 0;
  case 'v': a->verbose = 1; return 0;
  default: return set_number(a, opt, v);
  }
}

/* 0 parsed, 1 help printed, 2 usage error. */
static int parse_args(int argc, char **argv, cli_args *a) {
  dflash_fetch_options_default(&a->o);
  a->servers = calloc((size_t)argc, sizeof *a->servers);
  if (!a->servers) return 2;
  int opt;
  while ((opt = getopt_long(argc, argv, "o:v", long_opts, NULL)) != -1) {
    if (opt == O_HELP) {
      fputs(usage_text, stdout);
      return 1;
    }
    if (opt == '?' || set_option(a, opt, optarg) != 0) {
      if (opt != '?') fprintf(stderr, "dflash fetch: bad value for --%s: %s\n",
                              option_name(opt), optarg ? optarg : "");
      fputs(usage_text, stderr);
      return 2;
    }
  }
  if (optind != argc - 1 || !a->out_dir || !a->n_servers || !a->o.model) {
    fprintf(stderr, "dflash fetch: need --server, --model, -o OUTDIR and one input file\n");
    fputs(usage_text, stderr);
    return 2;
  }
  a->input = argv[optind];
  a->o.servers = a->servers;
  a->o.n_servers = a->n_servers;
  return 0;
}

static void print_summary(const dflash_fetch *f) {
  size_t len = 0;
  dflash_fetch_summary(f, NULL, 0, &len);
  char *buf = malloc(len);
  if (buf && dflash_fetch_summary(f, buf, len, &len) == DFLASH_OK) printf("%s\n", buf);
  free(buf);
}

/* Thousands of streams need thousands of sockets: lift the soft limit to the hard one. */
static void raise_fd_limit(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
}

static int run(cli_args *a) {
  raise_fd_limit();
  dflash_fetch *f;
  dflash_status st = dflash_fetch_create(&a->o, a->input, a->out_dir, &f);
  if (st) return cli_fail("fetch", st);
  st = dflash_fetch_set_chunking(f, a->worker, (uint64_t)a->chunk_records, a->chunk_seconds);
  if (st) {
    dflash_fetch_free(f);
    return cli_fail("fetch", st);
  }
  dflash_fetch_stats s = {.struct_size = sizeof s};
  dflash_fetch_get_stats(f, &s);
  cli_state c = {0};
  st = dflash_progress_create(stderr, "fetch", "prompts", s.total, a->log_interval, &c.progress);
  if (st) {
    dflash_fetch_free(f);
    return cli_fail("fetch", st);
  }
  c.cap = 4096 + 256 * dflash_fetch_server_count(f); /* the summary the progress note reads */
  c.summary = malloc(c.cap);
  if (!c.summary) c.cap = 0;
  g_fetch = f;
  struct sigaction sa = {.sa_handler = on_signal};
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  st = dflash_fetch_run(f, on_progress, &c);
  dflash_progress_finish(c.progress);
  signal(SIGINT, SIG_DFL);
  signal(SIGTERM, SIG_DFL);
  g_fetch = NULL;
  print_summary(f);
  int rc = 0;
  if (st == DFLASH_E_CANCELLED) {
    fprintf(stderr, "dflash fetch: %s\n", dflash_last_error());
    rc = 3;
  } else if (st) {
    rc = cli_fail("fetch", st);
  }
  dflash_progress_free(c.progress);
  free(c.summary);
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
