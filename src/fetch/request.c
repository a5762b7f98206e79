/* Chat-completion request bodies. Reasoning switches go at the top level as
 * "chat_template_kwargs" (the OpenAI SDK's extra_body is merged there by the
 * SDK; on the wire it is just another field). */
#include "fetch_internal.h"

#include <string.h>

json_t *df_messages_for_server(const json_t *messages) {
  json_t *out = messages ? json_array() : NULL;
  size_t i;
  const json_t *m;
  json_array_foreach(messages, i, m) {
    json_t *c = out ? json_deep_copy(m) : NULL;
    if (c) json_object_del(c, "reasoning"); /* regenerated turns keep theirs only in the record */
    if (!c || json_array_append_new(out, c)) { /* out of memory: no half a conversation */
      json_decref(out);
      return NULL;
    }
  }
  return out;
}

/* Each returns non-zero when an allocation failed (jansson's setters free the value). */
static int set_sampling(const df_body_cfg *cfg, json_t *body) {
  int bad = 0;
  if (cfg->temperature >= 0)
    bad |= json_object_set_new(body, "temperature", json_real(cfg->temperature));
  if (cfg->top_p >= 0) bad |= json_object_set_new(body, "top_p", json_real(cfg->top_p));
  if (cfg->top_k >= 1) bad |= json_object_set_new(body, "top_k", json_integer(cfg->top_k));
  if (cfg->min_p >= 0) bad |= json_object_set_new(body, "min_p", json_real(cfg->min_p));
  if (cfg->seed >= 0) bad |= json_object_set_new(body, "seed", json_integer(cfg->seed));
  if (cfg->stop) bad |= json_object_set(body, "stop", cfg->stop);
  return bad;
}

static int set_family(const df_body_cfg *cfg, json_t *body) {
  const char *key = cfg->family == DFLASH_FETCH_FAMILY_KIMI   ? "thinking"
                    : cfg->family == DFLASH_FETCH_FAMILY_QWEN ? "enable_thinking"
                                                              : NULL;
  return key ? json_object_set_new(body, "chat_template_kwargs",
                                   json_pack("{s:b}", key, cfg->thinking ? 1 : 0))
             : 0;
}

/* The fields every body has; non-zero when an allocation failed. */
static int set_base(const df_body_cfg *cfg, json_t *body, json_t *messages, const char *rid,
                    bool probe) {
  bool stream = cfg->stream && !probe;
  int bad = json_object_set_new(body, "model", json_string(cfg->model));
  bad |= json_object_set(body, "messages", messages);
  if (probe) bad |= json_object_set_new(body, "max_tokens", json_integer(1));
  else if (cfg->max_tokens > 0)
    bad |= json_object_set_new(body, "max_tokens", json_integer(cfg->max_tokens));
  bad |= set_sampling(cfg, body);
  bad |= json_object_set_new(body, "stream", json_boolean(stream));
  /* Without include_usage, OpenAI, vLLM, SGLang and llama-server (since
   * ggml-org/llama.cpp#16052) send no token counts in a stream. */
  if (stream)
    bad |= json_object_set_new(body, "stream_options", json_pack("{s:b}", "include_usage", 1));
  bad |= set_family(cfg, body);
  if (rid) bad |= json_object_set_new(body, "rid", json_string(rid));
  return bad;
}

dflash_status df_body_build(const df_body_cfg *cfg, json_t *messages, const char *rid, bool probe,
                            char **out, size_t *out_len) {
  json_t *body = json_object();
  if (!body || set_base(cfg, body, messages, rid, probe)) {
    json_decref(body);
    return df_error_nomem("request body");
  }
  /* json_object_update_recursive fails only for lack of memory once both are objects. */
  if (cfg->extra && json_object_update_recursive(body, cfg->extra) != 0) {
    json_decref(body);
    return json_is_object(cfg->extra)
               ? df_error_nomem("request body")
               : df_error(DFLASH_E_CONFIG, "extra JSON cannot be merged into the request body");
  }
  int bad = 0;
  if (probe) { /* whatever extra says, a probe is one short unstreamed token */
    bad |= json_object_set_new(body, "max_tokens", json_integer(1));
    bad |= json_object_set_new(body, "stream", json_false());
  }
  /* stream_options goes with the stream the body finally asks for (extra may have
   * changed it): OpenAI and vLLM refuse it (400) on an unstreamed request, and a stream
   * that extra turned on still needs include_usage (unless extra set stream_options). */
  if (!json_is_true(json_object_get(body, "stream"))) json_object_del(body, "stream_options");
  else if (!json_object_get(body, "stream_options"))
    bad |= json_object_set_new(body, "stream_options", json_pack("{s:b}", "include_usage", 1));
  char *text = bad ? NULL : json_dumps(body, JSON_COMPACT);
  json_decref(body);
  if (!text) return df_error_nomem("request body");
  *out = text;
  *out_len = strlen(text);
  return DFLASH_OK;
}
