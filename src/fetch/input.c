/* Input conversations: OpenAI `messages` or ShareGPT `conversations`, one
 * JSON object per line, normalised to OpenAI messages. Ids are explicit or
 * derived from SHA-256 of the normalised messages (OpenSSL's, already linked
 * by libcurl), so they are stable across runs and machines. */
#include "fetch_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint32_t df_shard_of(const char *id, uint32_t n) {
  if (n <= 1) return 0;
  unsigned char h[32];
  df_sha256(id, strlen(id), h);
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v = v << 8 | h[i];
  return (uint32_t)(v % n);
}

/* ShareGPT speaker names seen in the wild (FastChat, Vicuna, SpecForge data). */
static const char *sharegpt_role(const char *from) {
  static const char *const map[][2] = {
      {"human", "user"},          {"user", "user"},       {"gpt", "assistant"},
      {"assistant", "assistant"}, {"model", "assistant"}, {"chatgpt", "assistant"},
      {"bing", "assistant"},      {"bard", "assistant"},  {"system", "system"},
      {"tool", "tool"},           {"function", "tool"},   {"observation", "tool"},
  };
  for (size_t i = 0; i < DF_ARRAY_LEN(map); i++)
    if (!strcmp(from, map[i][0])) return map[i][1];
  return NULL;
}

#define LINE_ERR(st, ...) df_error(st, "%s:%llu: " __VA_ARGS__)

static dflash_status check_messages(const json_t *msgs, const char *path, uint64_t ln) {
  size_t i;
  const json_t *m;
  json_array_foreach(msgs, i, m) {
    if (!json_is_object(m))
      return LINE_ERR(DFLASH_E_FORMAT, "messages[%zu] is not an object", path,
                      (unsigned long long)ln, i);
    const json_t *role = json_object_get(m, "role");
    if (!json_is_string(role) || !json_string_length(role))
      return LINE_ERR(DFLASH_E_FORMAT, "messages[%zu] has no \"role\" string", path,
                      (unsigned long long)ln, i);
    const json_t *c = json_object_get(m, "content");
    if (!json_is_string(c) && !json_is_array(c) &&
        !(json_is_null(c) && json_object_get(m, "tool_calls")))
      return LINE_ERR(DFLASH_E_FORMAT, "messages[%zu] (%s) has no \"content\" string or array",
                      path, (unsigned long long)ln, i, json_string_value(role));
  }
  return DFLASH_OK;
}

static dflash_status from_sharegpt(const json_t *convs, const json_t *system, const char *path,
                                   uint64_t ln, json_t **out) {
  json_t *msgs = json_array();
  if (json_is_string(system) && json_string_length(system))
    json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", "system", "content", system));
  size_t i;
  const json_t *t;
  json_array_foreach(convs, i, t) {
    const json_t *from = json_object_get(t, "from");
    const json_t *value = json_object_get(t, "value");
    const char *role = json_is_string(from) ? sharegpt_role(json_string_value(from)) : NULL;
    if (!role || !json_is_string(value)) {
      json_decref(msgs);
      if (!json_is_string(value))
        return LINE_ERR(DFLASH_E_FORMAT, "conversations[%zu] has no \"value\" string", path,
                        (unsigned long long)ln, i);
      return LINE_ERR(DFLASH_E_FORMAT, "conversations[%zu]: unknown speaker \"from\": %s", path,
                      (unsigned long long)ln, i,
                      json_is_string(from) ? json_string_value(from) : "(missing)");
    }
    json_array_append_new(msgs, json_pack("{s:s,s:O}", "role", role, "content", value));
  }
  *out = msgs;
  return DFLASH_OK;
}

static char *explicit_id(const json_t *v) {
  if (json_is_string(v) && json_string_length(v)) return df_strdup(json_string_value(v));
  if (json_is_integer(v)) return df_asprintf("%lld", (long long)json_integer_value(v));
  return NULL;
}

/* 32 hex digits of SHA-256 over the compact, key-sorted messages: a derived id's digits, and
 * every record's "digest", which tells two prompts under one id apart. false: out of memory. */
static bool messages_digest(const json_t *messages, char out[DF_DIGEST_LEN + 1]) {
  char *text = json_dumps(messages, JSON_COMPACT | JSON_SORT_KEYS);
  if (!text) return false;
  char hex[65];
  df_sha256_hex(text, strlen(text), hex);
  free(text);
  memcpy(out, hex, DF_DIGEST_LEN);
  out[DF_DIGEST_LEN] = 0;
  return true;
}

/* `check`: refuse messages the fetcher cannot send (an id needs only their shape). */
static dflash_status conv_parse(const char *line, size_t len, const char *path, uint64_t ln,
                                bool check, df_conv *out, char **id_out) {
  memset(out, 0, sizeof *out);
  *id_out = NULL;
  char what[4200];
  snprintf(what, sizeof what, "%s:%llu", path, (unsigned long long)ln);
  json_t *root;
  dflash_status st = df_json_parse(line, len, what, &root);
  if (st) return st;
  if (!json_is_object(root)) {
    json_decref(root);
    return LINE_ERR(DFLASH_E_FORMAT, "not a JSON object", path, (unsigned long long)ln);
  }
  const json_t *idv = json_object_get(root, "id");
  bool id_ok = !idv || json_is_null(idv) || json_is_integer(idv) ||
               (json_is_string(idv) && json_string_length(idv));
  if (!id_ok) {
    json_decref(root);
    return LINE_ERR(DFLASH_E_FORMAT, "\"id\" must be a non-empty string or an integer", path,
                    (unsigned long long)ln);
  }
  if (idv && !json_is_null(idv) && !(*id_out = explicit_id(idv))) {
    json_decref(root);
    return df_error_nomem("id");
  }
  json_t *msgs = json_object_get(root, "messages");
  const json_t *convs = json_object_get(root, "conversations");
  if (json_is_array(msgs)) {
    json_incref(msgs);
    st = check ? check_messages(msgs, path, ln) : DFLASH_OK;
  } else if (json_is_array(convs)) {
    st = from_sharegpt(convs, json_object_get(root, "system"), path, ln, &msgs);
  } else {
    msgs = NULL;
    st = LINE_ERR(DFLASH_E_FORMAT, "no \"messages\" or \"conversations\" array", path,
                  (unsigned long long)ln);
  }
  json_decref(root);
  if (!st && json_array_size(msgs) == 0)
    st = LINE_ERR(DFLASH_E_FORMAT, "the conversation is empty", path, (unsigned long long)ln);
  if (st) {
    json_decref(msgs);
    return st;
  }
  out->messages = msgs;
  out->id_explicit = *id_out != NULL;
  bool hashed = messages_digest(msgs, out->digest);
  out->id = !hashed ? NULL : *id_out ? df_strdup(*id_out) : df_asprintf("h%s", out->digest);
  if (!out->id) {
    df_conv_free(out);
    return df_error_nomem("id");
  }
  return DFLASH_OK;
}

dflash_status df_conv_parse(const char *line, size_t len, const char *path, uint64_t ln,
                            df_conv *out, char **id_out) {
  return conv_parse(line, len, path, ln, true, out, id_out);
}

void df_conv_free(df_conv *c) {
  free(c->id);
  json_decref(c->messages);
  memset(c, 0, sizeof *c);
}

static bool is_role(const json_t *m, const char *role) {
  const char *r = json_string_value(json_object_get(m, "role"));
  return r && !strcmp(r, role);
}

/* A prompt needs something other than system messages to answer. */
static bool answerable(const json_t *msgs, size_t p) {
  for (size_t i = 0; i < p; i++)
    if (!is_role(json_array_get(msgs, i), "system") &&
        !is_role(json_array_get(msgs, i), "assistant"))
      return true;
  return false;
}

dflash_status df_conv_turns(const json_t *msgs, bool all_turns, size_t **pos_out, size_t *n_out) {
  size_t n = json_array_size(msgs);
  size_t *pos = malloc((n + 1) * sizeof *pos);
  if (!pos) return df_error_nomem("turns");
  size_t k = 0;
  if (all_turns) {
    for (size_t i = 0; i < n; i++)
      if (is_role(json_array_get(msgs, i), "assistant") && answerable(msgs, i)) pos[k++] = i;
    if (!is_role(json_array_get(msgs, n - 1), "assistant") && answerable(msgs, n)) pos[k++] = n;
  } else {
    size_t p = n;
    while (p > 0 && is_role(json_array_get(msgs, p - 1), "assistant")) p--;
    if (answerable(msgs, p)) pos[k++] = p;
  }
  if (k == 0) {
    free(pos);
    return df_error(DFLASH_E_FORMAT, "the conversation has no user turn to answer");
  }
  *pos_out = pos;
  *n_out = k;
  return DFLASH_OK;
}

DFLASH_API dflash_status dflash_fetch_record_id(const char *line, size_t len, char *out,
                                                size_t cap) {
  DF_CHECK_ARG(line && out);
  df_conv c;
  char *explicit;
  dflash_status st = conv_parse(line, len, "record", 1, false, &c, &explicit);
  free(explicit);
  if (st) return st;
  size_t n = strlen(c.id);
  if (n + 1 > cap) st = df_error(DFLASH_E_BUFFER, "id needs %zu bytes, buffer has %zu", n + 1, cap);
  else memcpy(out, c.id, n + 1);
  df_conv_free(&c);
  return st;
}
