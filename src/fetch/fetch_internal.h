/* Internals of the completion fetcher, split by concern:
 *   sse.c     incremental server-sent-events parser
 *   response.c  chat completion chunks / bodies -> reasoning, content, finish_reason, usage
 *   input.c   JSONL conversations -> normalised messages, ids, shard hash
 *   request.c request bodies
 *   output.c  durable JSONL appends, torn-line repair, resume sets
 *   fetch.c   servers, scheduling, retries, the libcurl event loop, public API */
#ifndef DFLASH_FETCH_INTERNAL_H
#define DFLASH_FETCH_INTERNAL_H

#include <dflash/fetch.h>
#include <dflash/storage.h>
#include <jansson.h>
#include <stdbool.h>

#include "core/internal.h"

/* ---- SSE ----------------------------------------------------------------- */

/* Called once per complete event with its data lines joined by '\n'.
 * A non-zero return stops parsing; df_sse_feed then returns DFLASH_E_CANCELLED. */
typedef int (*df_sse_event_fn)(void *user, const char *event, const char *data, size_t len);

typedef struct df_sse {
  df_buf line;  /* the current, unfinished line */
  df_buf data;  /* data lines of the current event */
  df_buf event; /* the event's "event:" field */
  bool has_data;
  bool last_cr; /* previous byte ended a line with '\r': swallow a following '\n' */
} df_sse;

DF_MUST_CHECK dflash_status df_sse_feed(df_sse *p, const char *buf, size_t n, df_sse_event_fn fn,
                                        void *user);
void df_sse_reset(df_sse *p); /* keeps the buffers' memory */
void df_sse_free(df_sse *p);

/* ---- responses ----------------------------------------------------------- */

typedef struct df_resp {
  df_buf content;
  df_buf reasoning;
  char *finish_reason; /* NULL until a chunk carries one */
  json_t *usage;       /* last usage object seen, or NULL */
  json_t *timings;     /* last llama.cpp "timings" object seen, or NULL */
  json_t *tool_calls;  /* non-streamed only */
  char *error;         /* an error object in the body or an event after 200 */
  long error_code;     /* its numeric code, 0 when none */
  bool done;           /* data: [DONE] seen */
  bool bad_json;       /* a chunk that is not JSON */
  uint64_t chunks;
} df_resp;

void df_resp_reset(df_resp *r);
void df_resp_free(df_resp *r);
/* One SSE data payload ("[DONE]" or a chat.completion.chunk). */
void df_resp_chunk(df_resp *r, const char *data, size_t len);
/* A whole non-streamed body. */
void df_resp_body(df_resp *r, const char *body, size_t len);
/* The token counts of a finished answer, a new reference: the server's usage when it
 * has an integer completion_tokens (OpenAI, vLLM and SGLang send it in bodies, and in
 * streams asked for stream_options.include_usage; llama-server too); else, from
 * llama.cpp's timings (on its last chunk or in its body), the usage llama-server itself
 * reports: completion_tokens = predicted_n, prompt_tokens = prompt_n + cache_n (cache_n:
 * prompt tokens reused from its cache, also as prompt_tokens_details.cached_tokens);
 * else the usage object as sent (without a count), or NULL: the count is unknown. */
json_t *df_resp_usage(const df_resp *r);
/* Whether `usage` (from df_resp_usage) carries a completion token count, into *n. */
bool df_usage_count(const json_t *usage, const char *key, uint64_t *n);
/* Message of an OpenAI-style error body (`{"error": {...}}`, `{"object":"error",...}`,
 * `{"detail": ...}`); malloc'd, NULL when the body is not one. Sets *code when found. */
char *df_error_body_message(const char *body, size_t len, long *code);
/* What an HTTP 2xx answer amounts to, judged from what was parsed of it.
 * SGLang, vLLM and llama.cpp end every generation they finish with a
 * finish_reason in the last choice chunk (or the body's choice); an answer
 * without one was cut off by the server (SGLang aborts a request on an abort
 * call or a client disconnect and can still end the stream with [DONE]), so it
 * is unfinished even when [DONE] or a clean end of the body arrived. */
typedef enum {
  DF_RESP_COMPLETE,   /* a finish_reason other than "abort"/"error": the answer is whole */
  DF_RESP_ERROR,      /* an error object (r->error, r->error_code) */
  DF_RESP_ABORTED,    /* finish_reason "abort" or "error" */
  DF_RESP_BAD_JSON,   /* no finish_reason, and a chunk or body that is not JSON */
  DF_RESP_UNFINISHED, /* no finish_reason: cut, or [DONE] / end of body without one */
} df_resp_verdict;
df_resp_verdict df_resp_judge(const df_resp *r);
/* Outcome of a complete turn: "ok", "length" (finish_reason length, whatever the
 * content), "empty" (no visible answer) or the finish_reason itself
 * ("tool_calls", "content_filter"...); "unknown" without a finish_reason (not
 * a complete turn: df_resp_judge says DF_RESP_UNFINISHED). */
const char *df_outcome(const df_resp *r);
/* Whether an HTTP status (or an error event code) is worth another attempt. */
bool df_http_retryable(long status);

/* ---- input --------------------------------------------------------------- */

#define DF_DIGEST_LEN 32 /* hex digits of a conversation's digest */

typedef struct df_conv {
  char *id; /* explicit or derived */
  bool id_explicit;
  char digest[DF_DIGEST_LEN + 1]; /* of the normalised messages (a derived id is "h" + it) */
  json_t *messages;               /* normalised: [{role, content, ...}] */
} df_conv;

/* Parse one JSONL line. On failure, returns the status with a message naming
 * `path` and `line_no`; *id_out gets the line's explicit id when it had a valid one. */
DF_MUST_CHECK dflash_status df_conv_parse(const char *line, size_t len, const char *path,
                                          uint64_t line_no, df_conv *out, char **id_out);
void df_conv_free(df_conv *c);
/* Message positions to regenerate: position p means prompt = messages[0, p) and the
 * answer replaces messages[p] (or is appended when p == size). Last only, or all. */
DF_MUST_CHECK dflash_status df_conv_turns(const json_t *messages, bool all_turns, size_t **pos,
                                          size_t *n);
/* Deterministic shard of an id: first 8 bytes of SHA-256(id), big endian, mod n. */
uint32_t df_shard_of(const char *id, uint32_t n);

/* ---- request ------------------------------------------------------------- */

typedef struct df_body_cfg {
  const char *model;
  int family, thinking, max_tokens, top_k, stream;
  double temperature, top_p, min_p;
  int64_t seed;
  json_t *stop;  /* borrowed; NULL: none */
  json_t *extra; /* borrowed object; NULL: none */
} df_body_cfg;

/* The JSON body of a chat completion for `messages` (borrowed). `rid` may be NULL.
 * `probe`: a 1-token non-streamed request. malloc'd text in *out. */
DF_MUST_CHECK dflash_status df_body_build(const df_body_cfg *cfg, json_t *messages, const char *rid,
                                          bool probe, char **out, size_t *out_len);
/* Messages as sent to a server: role/content (+ name, tool fields), no "reasoning". */
json_t *df_messages_for_server(const json_t *messages);


/* ---- output -------------------------------------------------------------- */

typedef struct df_out {
  int fd;
  dflash_chunk_writer *cw; /* s3:// outputs: records go to immutable chunks instead of fd */
  char *path;
  double last_sync;
  bool dirty;
  uint64_t records; /* valid records found on open + written since */
} df_out;

/* Called for every valid record of an existing output file on open: its id (NULL when
 * the record's id is null) and, for records written from a malformed input line,
 * its "line" (0 otherwise). The whole record is given when `want_json` is set. */
typedef dflash_status (*df_out_record_fn)(void *ctx, const char *id, uint64_t input_line,
                                          const char *text, size_t len);

/* Open (creating) `path` for appending after repairing it: a torn last line is
 * cut off; invalid lines elsewhere are moved to `path`.corrupt. Every valid
 * record is reported to `fn`. */
DF_MUST_CHECK dflash_status df_out_open(const char *path, df_out_record_fn fn, void *ctx,
                                        df_out *o);
/* Append one record (a JSON object, "id" first) as one line. */
DF_MUST_CHECK dflash_status df_out_append(df_out *o, const json_t *record);
/* fsync when dirty and `interval` seconds have passed since the last (0: always). */
DF_MUST_CHECK dflash_status df_out_sync(df_out *o, double interval, double now);
void df_out_close(df_out *o);
/* Check one record line (no '\n'): 1 a record, *id as in df_out_record_fn (malloc'd); 0 not
 * one; -1 out of memory (the message recorded). `full`: always parse the JSON, not only the
 * fast prefix path. */
int df_out_check_line(const char *line, size_t len, bool full, char **id, uint64_t *input_line);
/* Outputs in chunks on object storage (remote_chunks.c): report every record of
 * every chunk under `prefix` to `fn`; appends go nowhere until
 * df_out_start_chunks. */
DF_MUST_CHECK dflash_status df_out_open_remote(dflash_storage *st, const char *prefix,
                                               df_out_record_fn fn, void *ctx, df_out *o);
DF_MUST_CHECK dflash_status df_out_start_chunks(df_out *o, dflash_storage *st, const char *name,
                                                const dflash_chunk_writer_options *co);
/* Upload the open chunk (remote outputs; a no-op for files). */
DF_MUST_CHECK dflash_status df_out_flush(df_out *o);
/* The "id" a record line starts with, decoded; fast path for our own lines.
 * Returns false when the line does not start that way. *id is NULL for null. */
bool df_record_id_prefix(const char *line, size_t len, char **id);
/* The "digest" of a record line (df_conv.digest) into `out`: 1 found, 0 the record has none
 * (written before records had one), -1 out of memory (the message recorded). Our own lines
 * carry it right after the id (a line in our layout without it there has none); a line that
 * does not start with a string "id" is parsed. */
int df_record_digest(const char *line, size_t len, char out[DF_DIGEST_LEN + 1]);

#endif
