/* Chat-completion responses, streamed (chunks with choices[0].delta) or
 * whole (choices[0].message), from SGLang, vLLM and llama.cpp. Reasoning
 * arrives as `reasoning_content` (SGLang, older vLLM) or `reasoning` (newer
 * vLLM); both are read. Errors can arrive after HTTP 200 as an event. */
#include "fetch_internal.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

void df_resp_reset(df_resp *r) {
  r->content.len = r->reasoning.len = 0;
  if (r->content.data) r->content.data[0] = '\0';
  if (r->reasoning.data) r->reasoning.data[0] = '\0';
  free(r->finish_reason);
  free(r->error);
  json_decref(r->usage);
  json_decref(r->timings);
  json_decref(r->tool_calls);
  r->finish_reason = r->error = NULL;
  r->usage = r->timings = r->tool_calls = NULL;
  r->error_code = 0;
  r->done = r->bad_json = false;
  r->chunks = 0;
}

void df_resp_free(df_resp *r) {
  df_resp_reset(r);
  df_buf_free(&r->content);
  df_buf_free(&r->reasoning);
}

bool df_http_retryable(long status) {
  return status == 408 || status == 409 || status == 429 || status >= 500 || status == 0;
}

static long code_of(const json_t *v) {
  if (json_is_integer(v)) return (long)json_integer_value(v);
  if (json_is_string(v)) return strtol(json_string_value(v), NULL, 10);
  return 0;
}

/* The error described by a parsed body, or NULL. */
static char *error_of(const json_t *root, long *code) {
  if (!json_is_object(root)) return NULL;
  const json_t *err = json_object_get(root, "error");
  const json_t *msg = NULL;
  if (json_is_object(err)) {
    msg = json_object_get(err, "message");
    *code = code_of(json_object_get(err, "code"));
  } else if (json_is_string(err)) {
    msg = err;
  } else if (json_is_string(json_object_get(root, "object")) &&
             !strcmp(json_string_value(json_object_get(root, "object")), "error")) {
    msg = json_object_get(root, "message"); /* vLLM's ErrorResponse */
    *code = code_of(json_object_get(root, "code"));
  } else if ((msg = json_object_get(root, "detail")) == NULL) { /* FastAPI */
    return NULL;
  }
  if (json_is_string(msg)) return df_strdup(json_string_value(msg));
  char *text = json_dumps(msg ? msg : err, JSON_COMPACT | JSON_ENCODE_ANY);
  return text ? text : df_strdup("error");
}

char *df_error_body_message(const char *body, size_t len, long *code) {
  json_t *root = json_loadb(body, len, 0, NULL);
  char *msg = error_of(root, code);
  json_decref(root);
  return msg;
}

static void append_text(df_buf *b, const json_t *v) {
  if (json_is_string(v)) (void)df_buf_append(b, json_string_value(v), json_string_length(v));
}

/* Fields common to a delta and a message. */
static void take_message(df_resp *r, const json_t *m) {
  if (!json_is_object(m)) return;
  append_text(&r->content, json_object_get(m, "content"));
  const json_t *reasoning = json_object_get(m, "reasoning_content");
  if (!json_is_string(reasoning)) reasoning = json_object_get(m, "reasoning");
  append_text(&r->reasoning, reasoning);
}

static void take_choice_and_usage(df_resp *r, const json_t *root, const char *message_key) {
  const json_t *choices = json_object_get(root, "choices");
  const json_t *c0 = json_array_get(choices, 0);
  if (json_is_object(c0)) {
    const json_t *m = json_object_get(c0, message_key);
    take_message(r, m);
    const json_t *tc = json_object_get(m, "tool_calls");
    if (json_is_array(tc) && json_array_size(tc) && !strcmp(message_key, "message")) {
      json_decref(r->tool_calls);
      r->tool_calls = json_incref((json_t *)tc);
    }
    const json_t *fr = json_object_get(c0, "finish_reason");
    if (json_is_string(fr)) {
      free(r->finish_reason);
      r->finish_reason = df_strdup(json_string_value(fr));
    }
  }
  const json_t *usage = json_object_get(root, "usage");
  if (json_is_object(usage)) {
    json_decref(r->usage);
    r->usage = json_incref((json_t *)usage);
  }
  const json_t *timings = json_object_get(root, "timings"); /* llama.cpp */
  if (json_is_object(timings)) {
    json_decref(r->timings);
    r->timings = json_incref((json_t *)timings);
  }
}

bool df_usage_count(const json_t *usage, const char *key, uint64_t *n) {
  const json_t *v = json_object_get(usage, key);
  if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
  *n = (uint64_t)json_integer_value(v);
  return true;
}

json_t *df_resp_usage(const df_resp *r) {
  uint64_t gen, processed, cached = 0;
  if (r->usage && df_usage_count(r->usage, "completion_tokens", &gen)) return json_incref(r->usage);
  if (r->timings && df_usage_count(r->timings, "predicted_n", &gen)) {
    json_t *u = json_pack("{s:I}", "completion_tokens", (json_int_t)gen);
    if (u && df_usage_count(r->timings, "prompt_n", &processed)) {
      bool has_cache = df_usage_count(r->timings, "cache_n", &cached);
      json_object_set_new(u, "prompt_tokens", json_integer((json_int_t)(processed + cached)));
      json_object_set_new(u, "total_tokens", json_integer((json_int_t)(processed + cached + gen)));
      if (has_cache)
        json_object_set_new(u, "prompt_tokens_details",
                            json_pack("{s:I}", "cached_tokens", (json_int_t)cached));
    }
    return u;
  }
  return r->usage ? json_incref(r->usage) : NULL;
}

static void take_error(df_resp *r, const json_t *root) {
  long code = 0;
  char *msg = error_of(root, &code);
  if (!msg) return;
  free(r->error);
  r->error = msg;
  r->error_code = code;
}

void df_resp_chunk(df_resp *r, const char *data, size_t len) {
  r->chunks++;
  if (len == 6 && !memcmp(data, "[DONE]", 6)) {
    r->done = true;
    return;
  }
  json_t *root = json_loadb(data, len, 0, NULL);
  if (!json_is_object(root)) {
    r->bad_json = true;
  } else {
    take_error(r, root);
    take_choice_and_usage(r, root, "delta");
  }
  json_decref(root);
}

void df_resp_body(df_resp *r, const char *body, size_t len) {
  json_t *root = json_loadb(body, len, 0, NULL);
  if (!json_is_object(root)) {
    r->bad_json = true;
  } else {
    take_error(r, root);
    take_choice_and_usage(r, root, "message");
    r->done = true;
  }
  json_decref(root);
}

static bool only_space(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!isspace((unsigned char)s[i])) return false;
  return true;
}

df_resp_verdict df_resp_judge(const df_resp *r) {
  if (r->error) return DF_RESP_ERROR;
  if (!r->finish_reason) return r->bad_json ? DF_RESP_BAD_JSON : DF_RESP_UNFINISHED;
  if (!strcmp(r->finish_reason, "abort") || !strcmp(r->finish_reason, "error"))
    return DF_RESP_ABORTED;
  /* The finish_reason chunk is the last one carrying text: the answer is whole
   * even if the connection broke before the usage chunk or [DONE]. */
  return DF_RESP_COMPLETE;
}

const char *df_outcome(const df_resp *r) {
  if (!r->finish_reason) return "unknown";
  if (!strcmp(r->finish_reason, "length")) return "length";
  bool empty = only_space(r->content.data, r->content.len) && !r->tool_calls;
  if (empty) return "empty";
  return strcmp(r->finish_reason, "stop") ? r->finish_reason : "ok";
}
