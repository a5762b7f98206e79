/* Parsing conversations (OpenAI messages, ShareGPT conversations, fetcher
 * completion records) into df_message arrays that borrow from the JSON. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

static df_str jstr(const json_t *v) {
  return (df_str){json_string_value(v), json_string_length(v)};
}

static dflash_status parse_role(const char *role, size_t i, df_role *out) {
  static const struct {
    const char *name;
    df_role role;
  } roles[] = {{"system", DF_ROLE_SYSTEM},   {"user", DF_ROLE_USER},
               {"human", DF_ROLE_USER},      {"assistant", DF_ROLE_ASSISTANT},
               {"gpt", DF_ROLE_ASSISTANT},   {"tool", DF_ROLE_TOOL},
               {"observation", DF_ROLE_TOOL}};
  for (size_t k = 0; k < DF_ARRAY_LEN(roles); k++)
    if (!strcmp(role, roles[k].name)) {
      *out = roles[k].role;
      return DFLASH_OK;
    }
  return df_error(DFLASH_E_FORMAT, "message %zu: unknown role \"%s\"", i, role);
}

/* Optional string field: absent or null leaves out->s NULL. */
static dflash_status opt_string(const json_t *obj, const char *key, size_t i, df_str *out) {
  const json_t *v = json_object_get(obj, key);
  *out = (df_str){NULL, 0};
  if (!v || json_is_null(v)) return DFLASH_OK;
  if (!json_is_string(v))
    return df_error(DFLASH_E_FORMAT, "message %zu: \"%s\" is not a string", i, key);
  *out = jstr(v);
  return DFLASH_OK;
}

/* Text parts are concatenated into conv->parts_text storage; offsets are
 * recorded first and fixed up once the storage stops moving. */
static dflash_status parse_parts(const json_t *list, size_t i, df_buf *store, df_message *m) {
  size_t begin = store->len;
  for (size_t k = 0; k < json_array_size(list); k++) {
    const json_t *part = json_array_get(list, k);
    const json_t *type = json_object_get(part, "type");
    const json_t *text = json_object_get(part, "text");
    if (!json_is_object(part))
      return df_error(DFLASH_E_FORMAT, "message %zu: content part %zu is not an object", i, k);
    if (type && !(json_is_string(type) && !strcmp(json_string_value(type), "text")))
      return df_error(DFLASH_E_UNSUPPORTED, "message %zu: content part %zu is not text", i, k);
    if (json_object_get(part, "image") || json_object_get(part, "image_url") ||
        json_object_get(part, "video"))
      return df_error(DFLASH_E_UNSUPPORTED, "message %zu: content part %zu is media", i, k);
    if (!json_is_string(text))
      return df_error(DFLASH_E_FORMAT, "message %zu: content part %zu has no string \"text\"", i,
                      k);
    dflash_status st = df_buf_append(store, json_string_value(text), json_string_length(text));
    if (st) return st;
  }
  m->content_kind = DF_CONTENT_PARTS;
  m->n_parts = json_array_size(list);
  m->text = (df_str){(const char *)(uintptr_t)begin, store->len - begin};
  return DFLASH_OK;
}

static dflash_status parse_content(const json_t *v, size_t i, df_buf *store, df_message *m) {
  if (!v) m->content_kind = DF_CONTENT_MISSING;
  else if (json_is_null(v)) m->content_kind = DF_CONTENT_NULL;
  else if (json_is_string(v)) {
    m->content_kind = DF_CONTENT_STRING;
    m->text = jstr(v);
  } else if (json_is_array(v)) return parse_parts(v, i, store, m);
  else
    return df_error(DFLASH_E_FORMAT, "message %zu: content is neither a string, null nor a list",
                    i);
  return DFLASH_OK;
}

static dflash_status parse_call(json_t *call, size_t i, size_t k, df_tool_call *tc) {
  if (!json_is_object(call))
    return df_error(DFLASH_E_FORMAT, "message %zu: tool call %zu is not an object", i, k);
  json_t *fn = json_object_get(call, "function");
  tc->has_function = fn != NULL;
  if (!fn) fn = call;
  if (!json_is_object(fn))
    return df_error(DFLASH_E_FORMAT, "message %zu: tool call %zu: function is not an object", i, k);
  const json_t *id = json_object_get(call, "id");
  if (id && !json_is_null(id)) {
    if (!json_is_string(id))
      return df_error(DFLASH_E_FORMAT, "message %zu: tool call %zu: id is not a string", i, k);
    tc->id = jstr(id);
  }
  const json_t *name = json_object_get(fn, "name");
  if (!json_is_string(name))
    return df_error(DFLASH_E_FORMAT, "message %zu: tool call %zu has no string name", i, k);
  tc->name = jstr(name);
  tc->arguments = json_object_get(fn, "arguments");
  if (!tc->arguments)
    return df_error(DFLASH_E_FORMAT, "message %zu: tool call %zu has no arguments", i, k);
  if (json_is_string(tc->arguments)) {
    /* Kept for templates that need a mapping (qwen3.5), as vLLM does. */
    json_error_t err;
    tc->args_object = json_loadb(json_string_value(tc->arguments),
                                 json_string_length(tc->arguments), JSON_REJECT_DUPLICATES, &err);
    if (tc->args_object && !json_is_object(tc->args_object)) {
      json_decref(tc->args_object);
      tc->args_object = NULL;
    }
  }
  return DFLASH_OK;
}

static dflash_status parse_calls(json_t *calls, size_t i, df_message *m) {
  if (!calls || json_is_null(calls)) return DFLASH_OK;
  if (!json_is_array(calls))
    return df_error(DFLASH_E_FORMAT, "message %zu: tool_calls is not a list", i);
  size_t n = json_array_size(calls);
  if (!n) return DFLASH_OK;
  if (m->role != DF_ROLE_ASSISTANT)
    return df_error(DFLASH_E_FORMAT, "message %zu: tool_calls on a non-assistant message", i);
  m->calls = calloc(n, sizeof *m->calls);
  if (!m->calls) return df_error_nomem("tool calls");
  m->n_calls = n;
  for (size_t k = 0; k < n; k++) {
    dflash_status st = parse_call(json_array_get(calls, k), i, k, &m->calls[k]);
    if (st) return st;
  }
  return DFLASH_OK;
}

static dflash_status parse_reasoning(const json_t *obj, size_t i, df_message *m) {
  static const char *const keys[] = {"reasoning_content", "reasoning"};
  for (size_t k = 0; k < 2; k++) {
    df_str s;
    dflash_status st = opt_string(obj, keys[k], i, &s);
    if (st) return st;
    if (s.s && !m->has_reasoning) {
      m->has_reasoning = true;
      m->reasoning = s;
    }
  }
  return DFLASH_OK;
}

static dflash_status parse_message(json_t *obj, size_t i, df_buf *store, df_message *m) {
  if (!json_is_object(obj)) return df_error(DFLASH_E_FORMAT, "message %zu is not an object", i);
  bool sharegpt = !json_object_get(obj, "role") && json_object_get(obj, "from");
  const json_t *role = json_object_get(obj, sharegpt ? "from" : "role");
  if (!json_is_string(role))
    return df_error(DFLASH_E_FORMAT, "message %zu has no string \"role\"", i);
  dflash_status st = parse_role(json_string_value(role), i, &m->role);
  if (st) return st;
  st = parse_content(json_object_get(obj, sharegpt ? "value" : "content"), i, store, m);
  if (!st) st = parse_reasoning(obj, i, m);
  if (!st) st = opt_string(obj, "name", i, &m->name);
  if (!st) st = opt_string(obj, "tool_call_id", i, &m->tool_call_id);
  if (!st) st = parse_calls(json_object_get(obj, "tool_calls"), i, m);
  return st;
}

/* Drop the message views (they borrow from root), keeping root. */
static void clear_messages(dflash_chat_conversation *c) {
  for (size_t i = 0; i < c->n; i++) {
    for (size_t k = 0; k < c->msgs[i].n_calls; k++) json_decref(c->msgs[i].calls[k].args_object);
    free(c->msgs[i].calls);
  }
  free(c->msgs);
  free(c->parts_text);
  c->msgs = NULL;
  c->parts_text = NULL;
  c->n = 0;
  c->tools = NULL;
}

void dflash_chat_conversation_free(dflash_chat_conversation *c) {
  if (!c) return;
  clear_messages(c);
  json_decref(c->root);
  free(c);
}

/* The message list of a record, plus a trailing completion when present. */
static dflash_status collect(json_t *root, json_t **list, json_t **completion, json_t **tools) {
  *completion = *tools = NULL;
  if (json_is_array(root)) {
    *list = root;
    return DFLASH_OK;
  }
  if (!json_is_object(root))
    return df_error(DFLASH_E_FORMAT, "conversation is neither a list nor an object");
  *list = json_object_get(root, "messages");
  if (!*list) *list = json_object_get(root, "conversations");
  if (!json_is_array(*list))
    return df_error(DFLASH_E_FORMAT, "conversation has no \"messages\" or \"conversations\" list");
  *tools = json_object_get(root, "tools");
  if (*tools && !json_is_null(*tools) && !json_is_array(*tools))
    return df_error(DFLASH_E_FORMAT, "\"tools\" is not a list");
  if (*tools && !json_array_size(*tools)) *tools = NULL;
  *completion = json_object_get(root, "completion");
  if (*completion && json_is_null(*completion)) *completion = NULL;
  if (*completion && !json_is_object(*completion))
    return df_error(DFLASH_E_FORMAT, "\"completion\" is not an object");
  return DFLASH_OK;
}

static dflash_status parse_all(dflash_chat_conversation *c, json_t *list, json_t *completion) {
  size_t n = json_array_size(list) + (completion ? 1 : 0);
  c->msgs = calloc(n ? n : 1, sizeof *c->msgs);
  if (!c->msgs) return df_error_nomem("messages");
  df_buf store = {0};
  dflash_status st = DFLASH_OK;
  for (; c->n < n && !st; c->n++) {
    json_t *obj = c->n < json_array_size(list) ? json_array_get(list, c->n) : completion;
    if (obj == completion && !json_object_get(completion, "role"))
      json_object_set_new(completion, "role", json_string("assistant"));
    st = parse_message(obj, c->n, &store, &c->msgs[c->n]);
  }
  /* Point joined text parts into their final storage. */
  c->parts_text = store.data;
  for (size_t i = 0; i < c->n; i++)
    if (c->msgs[i].content_kind == DF_CONTENT_PARTS)
      c->msgs[i].text.s = store.data ? store.data + (uintptr_t)c->msgs[i].text.s : "";
  return st;
}

static bool cut_off(const char *outcome) {
  return outcome && (!strcmp(outcome, "length") || !strcmp(outcome, "empty"));
}

/* A fetch record's outcome, and whether its completion (its last turn) is unfinished: the
 * record's outcome is its first turn that was not "ok", its last turn's is in "turns". A
 * record without "completion" (messages only, e.g. a fetch output reshaped by hand) whose
 * "finish_reason" or "outcome" says it was cut is unfinished too: in its last message when
 * that is the assistant's (the length limit cut that answer), else somewhere unknown (the
 * outcome alone says so, and a dataset build rejects it). */
static void find_outcome(dflash_chat_conversation *c, const json_t *completion) {
  c->outcome = NULL;
  c->unfinished = -1;
  if (!json_is_object(c->root)) return;
  bool last_is_answer = completion || (c->n && c->msgs[c->n - 1].role == DF_ROLE_ASSISTANT);
  const char *fr = json_string_value(json_object_get(c->root, "finish_reason"));
  c->outcome = json_string_value(json_object_get(c->root, "outcome"));
  if (!c->outcome && fr && !strcmp(fr, "length")) c->outcome = "length";
  const json_t *turns = json_object_get(c->root, "turns");
  const char *last = c->outcome;
  if (json_is_array(turns) && json_array_size(turns))
    last = json_string_value(
        json_object_get(json_array_get(turns, json_array_size(turns) - 1), "outcome"));
  if (last_is_answer && (cut_off(last) || (fr && !strcmp(fr, "length"))))
    c->unfinished = (int)c->n - 1;
}

dflash_status df_conv_build(dflash_chat_conversation *c) {
  clear_messages(c);
  json_t *list = NULL, *completion = NULL;
  dflash_status st = collect(c->root, &list, &completion, &c->tools);
  if (!st) st = parse_all(c, list, completion);
  if (!st) find_outcome(c, completion);
  return st;
}

const char *dflash_chat_conversation_outcome(const dflash_chat_conversation *c) {
  return c ? c->outcome : NULL;
}

int32_t dflash_chat_conversation_unfinished(const dflash_chat_conversation *c) {
  return c ? c->unfinished : -1;
}

dflash_status dflash_chat_conversation_parse(const char *json, size_t len,
                                             dflash_chat_conversation **out) {
  DF_CHECK_ARG(json && out);
  *out = NULL;
  dflash_chat_conversation *c = calloc(1, sizeof *c);
  if (!c) return df_error_nomem("conversation");
  /* The fast parser accepts what jansson accepts; anything else goes to
   * jansson, which then either accepts it too or explains the error. */
  c->root = df_json_fast(json, len);
  dflash_status st = c->root ? DFLASH_OK : df_json_parse(json, len, "conversation", &c->root);
  if (!st) st = df_conv_build(c);
  if (st) {
    dflash_chat_conversation_free(c);
    return st;
  }
  *out = c;
  return DFLASH_OK;
}

size_t dflash_chat_conversation_message_count(const dflash_chat_conversation *c) {
  return c ? c->n : 0;
}
