/* Chat-completion request bodies. Reasoning switches go at the top level as
 * "chat_template_kwargs" (the OpenAI SDK's extra_body is merged there by the
 * SDK; on the wire it is just another field). */
#include "fetch_internal.h"

#include <string.h>

json_t *df_messages_for_server(const json_t *messages) {
  json_t *out = json_array();
  size_t i;
  const json_t *m;
  json_array_foreach(messages, i, m) {
    json_t *c = json_deep_copy(m);
    json_object_del(c, "reasoning"); /* regenerated turns keep theirs only in the record */
    json_array_append_new(out, c);
  }
  return out;
}

static void set_sampling(const df_body_cfg *cfg, json_t *body) {
  if (cfg->temperature >= 0) json_object_set_new(body, "temperature", json_real(cfg->temperature));
  if (cfg->top_p >= 0) json_object_set_new(body, "top_p", json_real(cfg->top_p));
  if (cfg->top_k >= 1) json_object_set_new(body, "top_k", json_integer(cfg->top_k));
  if (cfg->min_p >= 0) json_object_set_new(body, "min_p", json_real(cfg->min_p));
  if (cfg->seed >= 0) json_object_set_new(body, "seed", json_integer(cfg->seed));
  if (cfg->stop) json_object_set(body, "stop", cfg->stop);
}

static void set_family(const df_body_cfg *cfg, json_t *body) {
  const char *key = cfg->family == DFLASH_FETCH_FAMILY_KIMI   ? "thinking"
                    : cfg->family == DFLASH_FETCH_FAMILY_QWEN ? "enable_thinking"
                                                              : NULL;
  if (key)
    json_object_set_new(body, "chat_template_kwargs",
                        json_pack("{s:b}", key, cfg->thinking ? 1 : 0));
}

dflash_status df_body_build(const df_body_cfg *cfg, json_t *messages, const char *rid, bool probe,
                            char **out, size_t *out_len) {
  json_t *body = json_object();
  json_object_set_new(body, "model", json_string(cfg->model));
  json_object_set(body, "messages", messages);
  bool stream = cfg->stream && !probe;
  if (probe) json_object_set_new(body, "max_tokens", json_integer(1));
  else if (cfg->max_tokens > 0)
    json_object_set_new(body, "max_tokens", json_integer(cfg->max_tokens));
  set_sampling(cfg, body);
  json_object_set_new(body, "stream", json_boolean(stream));
  /* Without include_usage, OpenAI, vLLM, SGLang and llama-server (since
   * ggml-org/llama.cpp#16052) send no token counts in a stream. */
  if (stream) json_object_set_new(body, "stream_options", json_pack("{s:b}", "include_usage", 1));
  set_family(cfg, body);
  if (rid) json_object_set_new(body, "rid", json_string(rid));
  if (cfg->extra && json_object_update_recursive(body, cfg->extra) != 0) {
    json_decref(body);
    return df_error(DFLASH_E_CONFIG, "extra JSON cannot be merged into the request body");
  }
  if (probe) { /* whatever extra says, a probe is one short unstreamed token */
    json_object_set_new(body, "max_tokens", json_integer(1));
    json_object_set_new(body, "stream", json_false());
  }
  /* stream_options goes with the stream the body finally asks for (extra may have
   * changed it): OpenAI and vLLM refuse it (400) on an unstreamed request, and a stream
   * that extra turned on still needs include_usage (unless extra set stream_options). */
  if (!json_is_true(json_object_get(body, "stream"))) json_object_del(body, "stream_options");
  else if (!json_object_get(body, "stream_options"))
    json_object_set_new(body, "stream_options", json_pack("{s:b}", "include_usage", 1));
  char *text = json_dumps(body, JSON_COMPACT);
  json_decref(body);
  if (!text) return df_error_nomem("request body");
  *out = text;
  *out_len = strlen(text);
  return DFLASH_OK;
}
