/* Jobs and records: the next prompt of the input as a job (the scan's malformed lines written
 * out first), and a finished job's completion or error record. Used by the event loop
 * (loop.c); the fetcher's setup is in fetch.c. */
#include "fetch_state.h"

#include <stdlib.h>
#include <string.h>

/* ---- jobs and records -------------------------------------------------------- */

void df_job_free(df_job *job) {
  if (!job) return;
  df_conv_free(&job->conv);
  free(job->turns);
  json_decref(job->turn_info);
  free(job->err);
  free(job);
}

static dflash_status write_bad_line(dflash_fetch *f, const df_bad_line *b) {
  json_t *r = json_pack("{s:s?,s:s,s:s,s:n,s:i,s:n,s:I}", "id", b->id, "kind", "input", "error",
                        b->message, "http_status", "attempts", 0, "server", "line",
                        (json_int_t)b->line);
  dflash_status st = r ? df_out_append(&f->errors, r) : df_error_nomem("record");
  json_decref(r);
  if (!st) f->failed++;
  return st;
}

/* The next prompt from the input, parsed; malformed lines found by the scan
 * are written out on the way (they come first). NULL when none is left. */
dflash_status df_fetch_next_job(dflash_fetch *f, df_job **out) {
  *out = NULL;
  dflash_status st = DFLASH_OK;
  for (; f->next_bad < f->n_bad; f->next_bad++)
    if ((st = write_bad_line(f, &f->bad[f->next_bad]))) return st;
  if (f->next_prompt == f->n_prompts) return DFLASH_OK;
  const df_prompt *p = &f->prompts[f->next_prompt++];
  df_job *job = calloc(1, sizeof *job);
  if (!job) return df_error_nomem("job");
  char *explicit_id;
  job->line = p->line;
  st = df_conv_parse(f->map + p->offset, p->len, f->input_path, p->line, &job->conv, &explicit_id);
  free(explicit_id);
  if (!st && p->id) { /* new_ids: the suffixed id the scan chose */
    free(job->conv.id);
    if (!(job->conv.id = df_strdup(p->id))) st = df_error_nomem("id");
  }
  if (!st) st = df_conv_turns(job->conv.messages, f->o.all_turns, &job->turns, &job->n_turns);
  if (!st && !(job->turn_info = json_array())) st = df_error_nomem("job");
  if (st) {
    df_job_free(job);
    return df_error_wrap(st, "%s changed while fetching", f->input_path);
  }
  job->err_server = -1;
  *out = job;
  return DFLASH_OK;
}

/* The record's outcome is that of its first turn that was not "ok". */
static const char *record_outcome(const json_t *turn_info) {
  size_t i;
  const json_t *t;
  const char *last = "ok";
  json_array_foreach(turn_info, i, t) {
    last = json_string_value(json_object_get(t, "outcome"));
    if (strcmp(last, "ok")) return last;
  }
  return last;
}

static json_t *prompt_slice(const df_job *job) {
  json_t *m = json_array();
  for (size_t i = 0; i < job->turns[job->n_turns - 1]; i++)
    json_array_append(m, json_array_get(job->conv.messages, i));
  return m;
}

dflash_status df_fetch_record_completion(dflash_fetch *f, df_job *job, const char *server) {
  json_t *last = json_array_get(job->turn_info, job->n_turns - 1);
  const char *outcome = record_outcome(job->turn_info);
  size_t p = job->turns[job->n_turns - 1];
  /* "digest" right after "id", where a resume reads it without parsing the record */
  json_t *r = json_pack("{s:s,s:s,s:o,s:O,s:O,s:s,s:O,s:s,s:f,s:i,s:I,s:s}", "id", job->conv.id,
                        "digest", job->conv.digest, "messages", prompt_slice(job), "completion",
                        json_array_get(job->conv.messages, p), "finish_reason",
                        json_object_get(last, "finish_reason"), "outcome", outcome, "usage",
                        json_object_get(last, "usage"), "server", server, "latency_s",
                        df_now_seconds() - job->started, "attempts", job->attempts_total, "line",
                        (json_int_t)job->line, "settings_digest", f->settings_digest);
  if (r && job->n_turns > 1) json_object_set(r, "turns", job->turn_info);
  dflash_status st = r ? df_out_append(&f->completions, r) : df_error_nomem("record");
  json_decref(r);
  if (st) return st;
  f->completed++;
  if (!strcmp(outcome, "length")) f->length++;
  if (!strcmp(outcome, "empty")) f->empty++;
  return DFLASH_OK;
}

dflash_status df_fetch_record_error(dflash_fetch *f, df_job *job) {
  json_t *http = job->err_http ? json_integer(job->err_http) : json_null();
  const char *server = job->err_server >= 0 ? f->servers[job->err_server].display : NULL;
  json_t *r = json_pack("{s:s,s:s,s:s,s:s,s:o,s:i,s:s?,s:I,s:s}", "id", job->conv.id, "digest",
                        job->conv.digest, "kind", job->err_kind ? job->err_kind : "network",
                        "error", job->err ? job->err : "unknown error", "http_status", http,
                        "attempts", job->attempts_total, "server", server, "line",
                        (json_int_t)job->line, "settings_digest", f->settings_digest);
  dflash_status st = r ? df_out_append(&f->errors, r) : df_error_nomem("record");
  json_decref(r);
  if (!st) f->failed++;
  return st;
}
