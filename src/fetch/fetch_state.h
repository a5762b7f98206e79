/* The fetcher object, shared by fetch.c (setup, input scan, records, public
 * getters) and loop.c (libcurl event loop, scheduling, retries). */
#ifndef DFLASH_FETCH_STATE_H
#define DFLASH_FETCH_STATE_H

#include <curl/curl.h>
#include <stdatomic.h>

#include "ctl.h"
#include "fetch_internal.h"

/* A count sampled on every controller tick, for its rate over the last RATE_WINDOW_S
 * (classify.c). 64 samples of 0.25 s hold 16 s. */
#define DF_RATE_SAMPLES 64
#define DF_RATE_WINDOW_S 10.0
/* The shortest time a rate is divided by: the first answers of a run, or of a window after a
 * pause, are not divided by the few milliseconds since the last sample. */
#define DF_RATE_FLOOR_S 2.0

typedef struct df_rate {
  double t[DF_RATE_SAMPLES];
  uint64_t v[DF_RATE_SAMPLES];
  unsigned next, n;
} df_rate;

void df_rate_sample(df_rate *r, double t, uint64_t v);
/* Per second: (v - the oldest sample inside the window) / at least DF_RATE_FLOOR_S; 0 with
 * no sample. */
double df_rate_per_s(const df_rate *r, double now, uint64_t v);

typedef struct df_server {
  char *base;    /* as given, without a trailing '/' */
  char *url;     /* {base}/chat/completions */
  char *display; /* base with any user:password@ removed, for logs and records */
  uint32_t in_flight;
  bool healthy;
  bool probing;
  int consecutive_failures;
  double next_probe;
  uint64_t requests, completed, failures, completion_tokens;
  uint64_t turns_uncounted; /* answers whose usage had no completion count */
  uint64_t probes_failed;
  bool excluded;   /* failed the start-up check (skip_bad_servers): never used */
  char *check_msg; /* why it failed the start-up check, NULL when it passed or none ran */
  /* the concurrency controller and what it is fed */
  df_ctl ctl;
  uint64_t tokens;          /* streamed events (~tokens) and counted non-streamed tokens */
  uint64_t tokens_tick;     /* `tokens` at the last controller tick */
  df_rate completed_tokens; /* completion_tokens over time: its tok_per_s */
  uint64_t overloads;       /* attempts it answered 429 or 503 */
  /* the server's own load report: GET {root}/props, then {root}/metrics */
  char *root;      /* base without a trailing /v1 */
  int state_kind;  /* STATE_* in loop.c */
  uint32_t queued; /* requests in flight not streaming yet (this tick) */
  bool state_busy;
  double next_state;
} df_server;

/* A valid input line still to fetch. */
typedef struct df_prompt {
  uint64_t offset;
  uint64_t len;
  uint64_t line;
  char *id; /* the suffixed id it is fetched under (new_ids), NULL: its own */
} df_prompt;

/* Ids and the digest of the messages each stands for: `ids` every id, `pairs` "<digest><id>"
 * (the digest has a fixed length, so a pair never reads as another). An id without a pair
 * was recorded before records had a digest. */
typedef struct df_idset {
  df_strset ids, pairs;
} df_idset;

/* Ids of the input that name another prompt than before (an id means one prompt): those
 * recorded on disk with other messages, and those repeated in the input with other ones;
 * the first few named in the refusal. */
typedef struct df_conflicts {
  uint64_t on_disk, in_input;
  df_buf disk_names, input_names;
} df_conflicts;

/* A malformed input line, recorded in errors.jsonl when the run starts. */
typedef struct df_bad_line {
  uint64_t line;
  char *id; /* NULL when the line has no usable id */
  char *message;
} df_bad_line;

/* One prompt being worked on: its turns, attempts and last error. */
typedef struct df_job {
  uint64_t line;
  df_conv conv; /* messages; regenerated turns replace the originals in place */
  size_t *turns;
  size_t n_turns, turn;
  json_t *turn_info; /* per-turn finish_reason/outcome/usage/attempts */
  int attempts;      /* of the current turn */
  int attempts_total;
  double not_before;
  double started;
  char *err;
  const char *err_kind;
  long err_http;
  int err_server;
} df_job;

/* One HTTP attempt (or a health probe when job is NULL). */
typedef struct df_xfer {
  struct df_xfer *prev, *next; /* every transfer in flight */
  CURL *easy;
  df_job *job;
  int server;
  bool state; /* a GET of the server's load report (job NULL) */
  bool sse;   /* the response is an event stream */
  bool type_known;
  bool too_big;
  long http;
  double retry_after; /* seconds, < 0 when absent */
  uint64_t bytes;
  uint64_t tokens;    /* events seen, not yet given to the server's controller */
  uint64_t max_bytes; /* response cap of this attempt */
  char *body;
  df_sse parser;
  df_resp resp;
  df_buf raw; /* non-streamed body or error body */
  double started;
  char errbuf[CURL_ERROR_SIZE];
} df_xfer;

struct dflash_fetch {
  dflash_fetch_options o; /* string fields point at the copies below */
  char *model, *input_path, *out_dir;
  json_t *stop, *extra;
  df_body_cfg body_cfg;

  const char *map; /* the input, memory-mapped (or read whole from object storage) */
  size_t map_len;
  int lock_fd;
  dflash_storage *storage; /* when the input or the output directory is s3:// */
  bool remote_in, remote_out;
  char *worker; /* chunk name of remote outputs */
  dflash_chunk_writer_options chunk_opts;

  df_server *servers;
  size_t n_servers;

  df_prompt *prompts;
  size_t n_prompts, next_prompt;
  df_bad_line *bad;
  size_t n_bad, next_bad;
  df_strset done;         /* ids (and "\1line:N" for id-less bad lines) already on disk */
  df_idset digests;       /* the records on disk that carry a digest */
  df_idset retried;       /* the error records retry_errors moved away, to fetch again */
  df_conflicts conflicts; /* found by the scan: the run is refused unless options allow them */
  uint64_t renamed;       /* prompts under a suffixed id (new_ids) */
  df_rate records_rate, tokens_rate; /* records written, completion tokens: over time */
  uint64_t overloaded;               /* attempts answered 429 or 503 */
  df_out completions, errors;

  df_job **waiting; /* retries in backoff and next turns */
  size_t n_waiting, cap_waiting;

  CURLM *multi;
  df_xfer *xfers; /* in flight */
  int epfd, wake_r, wake_w;
  double timer_at; /* libcurl's next timeout, < 0 when none */
  struct curl_slist *headers;
  CURL **easy_pool;
  size_t n_easy_pool, cap_easy_pool;
  uint64_t rng;
  double next_ctl;   /* the controllers' next tick */
  bool out_of_work;  /* the last dispatch found a free slot and nothing to send */
  json_t *decisions; /* [{t, server, concurrency, tok_per_s, why}], at most CTL_LOG_MAX */
  uint64_t decisions_dropped;

  /* The guards of dflash_fetch_options; down_timeout_s resolved: > 0, or < 0 for never. */
  struct {
    int32_t no_server_check, skip_bad_servers, settings_change, new_ids, keep_first_duplicates;
    double down_timeout_s;
  } guards;
  bool has_key;            /* an Authorization header is sent */
  df_strset err_done;      /* ids (and "\1line:N" keys) found only in errors.jsonl */
  uint64_t errors_earlier; /* prompts of this input whose record is an error from a run before */
  uint64_t attempts_failed, probes_failed;
  double all_down_since;   /* < 0 while a server in use is healthy */
  double end_time;         /* when the run ended, 0 before */
  const char *stop_reason; /* NULL, "stop", "down_timeout", "server_check", "settings" */
  json_t *settings;        /* this run's request settings (settings.json) */
  char settings_digest[DF_DIGEST_LEN + 1]; /* of `settings`, in every record */

  atomic_int stop_requests;
  bool stopping, ran, curl_inited;
  double start_time, stop_deadline;
  dflash_status fatal;

  uint64_t skipped, completed, failed, duplicates, length, empty, retries;
  uint64_t jobs_in_flight, prompt_tokens, completion_tokens;
  /* answers (turns) with and without a completion token count: completion_tokens sums
   * the counted ones only */
  uint64_t turns_counted, turns_uncounted;
  double elapsed;
};

/* scan.c: the input scan and the id sets */
DF_MUST_CHECK dflash_status df_idset_add(df_idset *s, const char *id, const char *digest);
void df_idset_free(df_idset *s);
DF_MUST_CHECK dflash_status df_fetch_map_input(dflash_fetch *f);
/* Fails, naming them, when ids name other prompts than before (see new_ids). */
DF_MUST_CHECK dflash_status df_fetch_scan_input(dflash_fetch *f);

/* jobs.c */
DF_MUST_CHECK dflash_status df_fetch_record_completion(dflash_fetch *f, df_job *job,
                                                       const char *server);
DF_MUST_CHECK dflash_status df_fetch_record_error(dflash_fetch *f, df_job *job);
DF_MUST_CHECK dflash_status df_fetch_next_job(dflash_fetch *f, df_job **out);
void df_job_free(df_job *job);

/* check.c: the start-up check of the servers and the recorded settings */
json_t *df_fetch_settings(const dflash_fetch *f);
DF_MUST_CHECK dflash_status df_fetch_check_settings(dflash_fetch *f, json_t **to_write);
DF_MUST_CHECK dflash_status df_fetch_write_settings(dflash_fetch *f, json_t *doc);
DF_MUST_CHECK dflash_status df_fetch_check_servers(dflash_fetch *f);

/* classify.c: a finished transfer's outcome, a server's load report */
typedef enum { RES_OK, RES_RETRY, RES_FAIL } result_kind;

typedef struct result {
  result_kind kind;
  const char *err_kind; /* "http", "network", "timeout", "response", "stream" */
  char *msg;            /* malloc'd */
  long http;
  bool server_fault; /* counts towards taking the server out: the connection failed */
  bool overload;     /* 429 or 503: the server asks for fewer requests at once */
} result;


result df_fetch_classify(df_xfer *x, CURLcode rc);
double df_fetch_props_slots(const char *text, size_t len);
bool df_fetch_parse_metrics(const char *text, size_t len, df_ctl_state *st);

/* loop.c */
DF_MUST_CHECK dflash_status df_loop_init(dflash_fetch *f, const dflash_fetch_options *opts);
void df_loop_free(dflash_fetch *f);
DF_MUST_CHECK dflash_status df_loop_run(dflash_fetch *f, dflash_fetch_progress_fn progress,
                                        void *user);

#endif
