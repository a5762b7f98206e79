/*
 * Completion fetcher: regenerate the assistant turns of a JSONL file of
 * conversations with one or more OpenAI-compatible servers (SGLang, vLLM,
 * llama.cpp), keeping every server saturated and losing nothing.
 *
 * Input: one JSON object per line with OpenAI `messages` ([{role, content}])
 * or ShareGPT `conversations` ([{from, value}]) and an optional `id` (string
 * or integer). Without an id the record's id is "h" followed by the first 32
 * hex digits of SHA-256 over the compact, key-sorted JSON of the normalised
 * messages (so the same conversation always gets the same id, on any
 * machine). The turn regenerated is the last assistant turn (trailing
 * assistant messages are dropped from the prompt); with `all_turns` every
 * assistant turn is regenerated in order and the new turns are fed back.
 *
 * Output, in `out_dir`:
 *  - completions.jsonl: {"id", "digest" (of the input line's messages: see
 *    new_ids), "messages" (the prompt sent), "completion"
 *    {"role":"assistant","reasoning","content"}, "finish_reason",
 *    "outcome" ("ok" | "length" | "empty" | another finish_reason), "usage",
 *    "server", "latency_s", "attempts", "line", "settings_digest" (32 hex digits
 *    of SHA-256 over settings.json's compact, key-sorted "settings")};
 *  - errors.jsonl: {"id" (null when the line has none), "digest", "kind", "error",
 *    "http_status", "attempts", "server", "line", "settings_digest"} (a malformed
 *    line's record has neither digest); kind is "input" (a
 *    malformed line), "http" (an error status), "network", "timeout",
 *    "response" (unparseable or over the size cap) or "stream" (an error
 *    reported inside an HTTP 200 answer, as SGLang and vLLM do, or an answer
 *    aborted or ended without a finish_reason; each is retried first).
 * Each record is one write() of one line; files are fsynced on the schedule
 * in the options. On start, a torn last line (a crash mid-write or a power
 * loss) is cut off, and ids already present in completions.jsonl (and in
 * errors.jsonl unless `retry_errors`) with the same digest are skipped, so
 * re-running the same command after any crash finishes the job with every id
 * exactly once (another digest under an id: see new_ids).
 * A lock file keeps two fetchers from writing to one directory.
 *
 * One dflash_fetch runs its event loop (libcurl multi interface over epoll)
 * on the thread that calls dflash_fetch_run(). It is single-owner (see
 * dflash.h) except for dflash_fetch_stop(), which any thread or a signal
 * handler may call.
 */
#ifndef DFLASH_FETCH_H
#define DFLASH_FETCH_H

#include <dflash/dflash.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dflash_fetch dflash_fetch;

/* Which per-family reasoning switch goes into the request body, at its top
 * level, as "chat_template_kwargs". */
typedef enum dflash_fetch_family {
  DFLASH_FETCH_FAMILY_NONE = 0, /* no switch */
  DFLASH_FETCH_FAMILY_KIMI = 1, /* {"thinking": true} */
  DFLASH_FETCH_FAMILY_QWEN = 2  /* {"enable_thinking": true} */
} dflash_fetch_family;

/* What a resumed run does when its request settings differ (dflash_fetch_options). */
typedef enum dflash_fetch_settings_change {
  DFLASH_FETCH_SETTINGS_WARN = 0,
  DFLASH_FETCH_SETTINGS_REFUSE = 1,
  DFLASH_FETCH_SETTINGS_ALLOW = 2
} dflash_fetch_settings_change;

typedef struct dflash_fetch_options {
  size_t struct_size;
  /* Base URLs such as "http://host:30000/v1"; requests go to
   * {base}/chat/completions. Copied at create time. */
  const char *const *servers;
  size_t n_servers;
  const char *model;      /* required */
  int32_t family;         /* dflash_fetch_family */
  int32_t thinking;       /* value of the family switch: 1 true (default), 0 false */
  int32_t max_tokens;     /* 0: no cap sent */
  double temperature;     /* < 0: not sent (default -1) */
  double top_p;           /* < 0: not sent */
  int32_t top_k;          /* < 1: not sent */
  double min_p;           /* < 0: not sent */
  int64_t seed;           /* < 0: not sent */
  const char *stop_json;  /* JSON string or array for "stop"; NULL: none */
  const char *extra_json; /* JSON object merged into the body last; NULL: none */
  int32_t stream;         /* 1 (default): SSE with stream_options.include_usage */
  /* API key: the environment variable named here, else the first line of
   * this file; sent as "Authorization: Bearer", never logged or written. */
  const char *api_key_env;
  const char *api_key_file;
  /* In-flight requests per server. 0 (the default): each server's own, found
   * and followed by a controller (see max_concurrency); N >= 1: exactly N, fixed. */
  int32_t concurrency;
  double connect_timeout_s; /* default 10 */
  double idle_timeout_s;    /* streamed only: longest silence between bytes (default 120) */
  /* Overall deadline of one attempt: deadline_s when > 0, else
   * deadline_base_s + deadline_per_token_s * max_tokens (32768 tokens when
   * max_tokens is 0). Defaults 60 s + 0.25 s per token. */
  double deadline_s;
  double deadline_base_s;
  double deadline_per_token_s;
  int32_t max_attempts;     /* per prompt, including the first (default 8) */
  double backoff_base_s;    /* full-jitter exponential backoff: default 0.5 */
  double backoff_max_s;     /* default 30 */
  double retry_after_max_s; /* longest Retry-After honoured (default 60) */
  /* fsync both output files at most this often; 0: after every record.
   * Default 1 s. Records are written (to the page cache) immediately either
   * way, so a killed process loses nothing; fsync covers power loss. */
  double fsync_interval_s;
  int32_t retry_errors;        /* 1: ids in errors.jsonl are fetched again (default 0) */
  uint32_t shard_index;        /* process only ids whose hash % shard_count == shard_index */
  uint32_t shard_count;        /* 0 or 1: no sharding */
  int32_t fail_threshold;      /* consecutive failures that take a server out (default 3) */
  double probe_interval_s;     /* 1-token probe of an unhealthy server (default 5) */
  uint64_t max_response_bytes; /* per attempt; larger responses fail (default 64 MiB) */
  int32_t verify_tls;          /* 1 (default) */
  int32_t all_turns;           /* 1: regenerate every assistant turn in order */
  double drain_grace_s;        /* after stop: wait this long for in-flight work (default 30) */
  double progress_interval_s;  /* progress callback period (default 0.5) */
  int32_t send_rid;            /* 1: send SGLang's "rid" = "<id>-<attempt>" (default 0) */
  /* The controller (concurrency 0) keeps on each server the number of requests
   * that gives the highest generated-token rate, measured from the streams, and
   * follows it as it moves (output lengths drift, a server slows or restarts);
   * a server's own report narrows it (llama.cpp's GET /props total_slots, vLLM's
   * or SGLang's /metrics queue: see server_state). Routing sends each request to
   * the server with the lowest load relative to its limit. The summary records
   * every decision ("controller"). */
  int32_t max_concurrency; /* the controller's cap per server (default 512) */
  /* 1 (default): read each server's own load report (GET {root}/props, /metrics,
   * {root} being the URL without a trailing /v1) from the event loop every
   * state_interval_s; 0: the stream signals only. */
  int32_t server_state;
  double state_interval_s; /* default 2 */
  /*
   * Guards of a run (the fields of dflash_fetch_options after state_interval_s),
   * checked by dflash_fetch_run before any work, so that a run never hangs and
   * never mixes settings silently. Zero gives the defaults.
   *
   * Start-up check (unless no_server_check, or when no prompt is left to send):
   * GET {base}/models of every server, concurrently, with the API key. A server fails it when it is unreachable
   * (DFLASH_E_NETWORK), refuses the key or its absence with 401/403
   * (DFLASH_E_AUTH), answers another status (DFLASH_E_HTTP) or no model list
   * (DFLASH_E_FORMAT), or does not list the model by its id (DFLASH_E_NOT_FOUND,
   * the message gives the ids it serves). Each failure is one message naming
   * the server. When any fails the run is refused with the first failure's
   * status, the message listing them all, unless skip_bad_servers: then the
   * failures are logged as warnings and the run goes on without those servers
   * (they are never sent work or probed; "excluded" in the summary). A run with
   * no server left is refused either way. The summary's "stop_reason" is then
   * "server_check".
   *
   * Down timeout: when every server in use has been taken out (fail_threshold
   * failures in a row, probes failing) for down_timeout_s seconds while work is
   * left, the run stops as after dflash_fetch_stop and returns DFLASH_E_TIMEOUT;
   * what finished is on disk and running again resumes. Default 600 s; < 0:
   * wait forever. The summary's "down_s" says how long all have been down
   * (0 while one is up), "stop_reason" "down_timeout" after such a stop.
   *
   * Settings: the request settings (model, family and chat_template_kwargs,
   * max_tokens, temperature, top_p, top_k, min_p, seed, stop, extra,
   * all_turns) are recorded in OUT/settings.json (written atomically and
   * synced, after the start-up check, before any request; an s3:// OUT gets an
   * object). When the file exists and this run's settings differ, what changed
   * is named ("temperature 0.6 -> 1") and settings_change decides:
   * DFLASH_FETCH_SETTINGS_WARN (0, the default): a warning, the file is updated
   * and the old settings kept in its "earlier" list; _REFUSE: the run is
   * refused with DFLASH_E_MISMATCH before anything is sent or written
   * ("stop_reason" "settings"); _ALLOW: updated as WARN, logged at info level.
   */
  int32_t no_server_check;  /* 1: skip the start-up check (servers without GET /models) */
  int32_t skip_bad_servers; /* 1: go on with the servers that pass it */
  double down_timeout_s;    /* 0: the default, 600 s; < 0: never stop for servers down */
  int32_t settings_change;  /* dflash_fetch_settings_change */
  /* Chunks of an s3:// output (see "Object storage" below; no effect on a local one): the
   * worker name (NULL: "<hostname>-<pid>"; non-empty, no '/'), and when a chunk closes. */
  const char *chunk_worker;
  uint64_t chunk_max_records; /* 0: 1000 */
  double chunk_max_seconds;   /* 0: 60 */
  /*
   * An id means one prompt. Every record carries "digest", 32 hex digits of SHA-256 over
   * the compact, key-sorted normalised messages of its input line (a derived id is "h" and
   * the same digits). dflash_fetch_create refuses, naming the ids and how many:
   *  - an id whose record in OUT has another digest (a second input whose ids overlap the
   *    first's: skipping it as done would drop its prompts) with DFLASH_E_MISMATCH;
   *  - an id that comes again later in the input with other messages with DFLASH_E_FORMAT
   *    (the same id with the same messages is a repeat: counted in "duplicates", skipped).
   * new_ids: fetch each such prompt under "<id>#2" (or "#3"... the first that is free or
   * names these messages), so a resume finds it again; keep_first_duplicates: a later line
   * with an id seen earlier in the input is skipped (counted in "duplicates"), as before
   * 0.1.0; it wins over new_ids for repeats inside the input. Records written before records
   * had a digest are taken as the same prompt (there is nothing to compare).
   */
  int32_t new_ids;
  int32_t keep_first_duplicates;
} dflash_fetch_options;

/* Why a run stopped early (dflash_fetch_stats.stop_reason; the summary's "stop_reason"). */
typedef enum dflash_fetch_stop_reason {
  DFLASH_FETCH_STOP_NONE = 0,         /* not stopped (null) */
  DFLASH_FETCH_STOP_REQUESTED = 1,    /* dflash_fetch_stop or the callback ("stop") */
  DFLASH_FETCH_STOP_DOWN_TIMEOUT = 2, /* every server down for down_timeout_s ("down_timeout") */
  DFLASH_FETCH_STOP_SERVER_CHECK = 3, /* the start-up check refused the run ("server_check") */
  DFLASH_FETCH_STOP_SETTINGS = 4      /* settings.json differs, refused ("settings") */
} dflash_fetch_stop_reason;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_fetch_options_default(&opts). */
DFLASH_API void dflash_fetch_options_init(dflash_fetch_options *opts, size_t size);
#define dflash_fetch_options_default(opts) dflash_fetch_options_init((opts), sizeof *(opts))

typedef struct dflash_fetch_stats {
  size_t struct_size;
  uint64_t total;        /* prompts of this shard in the input (valid lines) */
  uint64_t skipped;      /* already finished by an earlier run */
  uint64_t completed;    /* completions written by this run */
  uint64_t failed;       /* errors written by this run (input errors included) */
  uint64_t input_errors; /* malformed input lines found by this run */
  /* input lines skipped as repeats: an earlier line's id and messages, or (with
   * keep_first_duplicates) an earlier line's id */
  uint64_t duplicates;
  uint64_t length;  /* completions with outcome "length" */
  uint64_t empty;   /* completions with outcome "empty" */
  uint64_t retries; /* attempts beyond the first */
  uint64_t in_flight;
  uint64_t pending; /* not yet finished, not in flight */
  uint64_t prompt_tokens;
  uint64_t completion_tokens;
  double elapsed_s;
  uint32_t servers_healthy;
  int32_t stopping; /* 1 once stop was requested */
  /* What the summary JSON also says, as fields (so no caller parses the text). */
  int32_t stop_reason;      /* dflash_fetch_stop_reason */
  uint32_t servers_down;    /* servers in use taken out (connection failures, timeouts) */
  uint64_t errors_earlier;  /* prompts skipped because an earlier run recorded an error */
  uint64_t attempts_failed; /* every attempt that failed, retried or not */
  uint64_t probes_failed;
  uint64_t overloaded; /* attempts answered 429 or 503: retried, the server's limit lowered */
  /* Answers with and without a completion token count (completion_tokens sums the first). */
  uint64_t turns_counted;
  uint64_t turns_uncounted;
  uint64_t renamed;      /* prompts under a suffixed id (dflash_fetch_options.new_ids) */
  double down_s;         /* how long every server in use has been down; 0 while one is up */
  double down_timeout_s; /* the down timeout in force; < 0: none */
  /* Rates of this run over its last 10 s (less at the start: the window is never counted
   * shorter than 2 s, so the first answers are not divided by a few milliseconds); the
   * whole run's averages once it has ended. */
  double prompts_per_s;        /* records written (completions and errors) */
  double completion_tok_per_s; /* counted completion tokens */
} dflash_fetch_stats;

typedef struct dflash_fetch_server_stats {
  size_t struct_size;
  const char *url;  /* borrowed from the fetcher */
  uint32_t healthy; /* 0 once connections failed or timed out fail_threshold times in a row */
  uint32_t in_flight;
  uint64_t requests; /* attempts sent, probes excluded */
  uint64_t completed;
  uint64_t failures;
  uint64_t completion_tokens;
  uint32_t concurrency; /* the requests it is allowed now (the controller's limit or the fixed N) */
  /* Its completed answers' counted tokens per second, over the same window as
   * dflash_fetch_stats.completion_tok_per_s (the servers' rates add up to it). */
  double tok_per_s;
  /* 1: left out after failing the start-up check (skip_bad_servers): never sent work, and
   * not "down" (healthy is 0 for it too) */
  uint32_t excluded;
  uint32_t overloaded; /* attempts it answered 429 or 503 (at most UINT32_MAX) */
} dflash_fetch_server_stats;

/*
 * Called on the loop thread every progress_interval_s and once at the end.
 * It may call the getters below on `f`. A non-zero return asks for a stop
 * (as dflash_fetch_stop()).
 */
typedef int (*dflash_fetch_progress_fn)(dflash_fetch *f, const dflash_fetch_stats *stats,
                                        void *user);

/*
 * Scan `input_path`, repair and read the outputs already in `out_dir`
 * (created when missing) and prepare the work. Input lines that are
 * malformed are recorded in errors.jsonl (naming file and line) when the run
 * starts, not here: a bad line never stops the job.
 */
DFLASH_API dflash_status dflash_fetch_create(const dflash_fetch_options *opts,
                                             const char *input_path, const char *out_dir,
                                             dflash_fetch **out);

/*
 * Object storage. `input_path` may be an s3:// object (read whole into
 * memory), and `out_dir` an s3:// prefix (see include/dflash/storage.h for
 * credentials). Remote outputs are immutable JSONL chunks:
 *   OUT/completions/<worker>-<seq>.jsonl, OUT/errors/<worker>-<seq>.jsonl
 * (errors.retried/ with retry_errors), each closed after max_records records
 * or max_seconds seconds (defaults 1000 and 60; also at the end of a run and
 * after a stop) and uploaded under a name fixed before the upload, so a
 * retried upload never duplicates a record. Resume reads every chunk under
 * OUT (all workers) and skips the ids found; records of a chunk not yet
 * uploaded when a process dies are fetched again. No lock file: concurrent
 * workers on one OUT need distinct worker names (the default is
 * "<hostname>-<pid>") and disjoint inputs (shard_index / shard_count).
 * dflash_fetch_options.chunk_worker, chunk_max_records and chunk_max_seconds
 * set them. Without an s3:// output they change nothing.
 */

/*
 * Fetch everything. Returns DFLASH_OK when every prompt has a record (some
 * may be in errors.jsonl: the summary's "failed" and "errors_earlier" count
 * them), DFLASH_E_CANCELLED after a stop (what finished is on disk; run again
 * to resume), DFLASH_E_TIMEOUT after every server stayed down for the down
 * timeout (likewise resumable), the start-up check's or the settings check's
 * status (see the guards of dflash_fetch_options; nothing was sent), or an I/O error when
 * an output file cannot be written.
 */
DFLASH_API dflash_status dflash_fetch_run(dflash_fetch *f, dflash_fetch_progress_fn progress,
                                          void *user);

/*
 * Ask a running fetcher to stop: no new requests; in-flight ones may finish
 * within drain_grace_s. A second call stops at once. Async-signal-safe and
 * callable from any thread.
 */
DFLASH_API void dflash_fetch_stop(dflash_fetch *f);

DFLASH_API dflash_status dflash_fetch_get_stats(const dflash_fetch *f, dflash_fetch_stats *out);
DFLASH_API size_t dflash_fetch_server_count(const dflash_fetch *f);
DFLASH_API dflash_status dflash_fetch_get_server_stats(const dflash_fetch *f, size_t index,
                                                       dflash_fetch_server_stats *out);

/*
 * A JSON summary of the run (the stats, per-server stats, outcome counts)
 * into `buf` of `cap` bytes, NUL-terminated. DFLASH_E_BUFFER with the size
 * needed (NUL included) in *len when `cap` is too small; `buf` may be NULL
 * to ask for the size (that query sets no error message and logs nothing).
 */
DFLASH_API dflash_status dflash_fetch_summary(const dflash_fetch *f, char *buf, size_t cap,
                                              size_t *len);

/* NULL-safe. Flushes and fsyncs the outputs. */
DFLASH_API void dflash_fetch_free(dflash_fetch *f);

/*
 * The id dflash_fetch uses for the JSON line `line` of `len` bytes (OpenAI or
 * ShareGPT): its "id" when it has one, else "h" + 32 hex digits of SHA-256
 * (see the top of this header). NUL-terminated into `out` of `cap` bytes
 * (34 suffice for derived ids); DFLASH_E_BUFFER when too small. Useful to join
 * other files with the outputs. Messages are not checked beyond their shape
 * (an array, or ShareGPT turns), so every conversation has an id, also ones the
 * fetcher would refuse to send; `dflash tokenize` names its samples with it.
 */
DFLASH_API dflash_status dflash_fetch_record_id(const char *line, size_t len, char *out,
                                                size_t cap);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_FETCH_H */
