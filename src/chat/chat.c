/* Template registry, rendering entry points, rendered results and loss masks. */
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

#define KIMI_TURNS "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"
#define KIMI_TOOLS                                                                     \
  "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", \
      "<|tool_call_argument_begin|>", "<|tool_call_end|>"
/* Qwen3's <tools>, <function=...> and <parameter=...> are ordinary text in its tokenizer. */
static const char *const kimi_controls[] = {KIMI_TURNS, KIMI_TOOLS, NULL};
static const char *const kimi_think_controls[] = {KIMI_TURNS, KIMI_TOOLS, "<think>", "</think>",
                                                  NULL};
static const char *const qwen_controls[] = {"<|im_start|>",    "<|im_end|>",       "<think>",
                                            "</think>",        "<tool_call>",      "</tool_call>",
                                            "<tool_response>", "</tool_response>", NULL};
static const char *const chatml_controls[] = {"<|im_start|>", "<|im_end|>", NULL};

static const struct dflash_chat_template templates[] = {
    {"kimi-k2", df_render_kimi_instruct, 0, "<|im_end|>", kimi_controls},
    {"kimi-k2-thinking", df_render_kimi_thinking, 0, "<|im_end|>", kimi_think_controls},
    {"kimi-k2.5", df_render_kimi_thinking, DF_FAM_K25, "<|im_end|>", kimi_think_controls},
    {"kimi-k2.6", df_render_kimi_thinking, DF_FAM_K25 | DF_FAM_PRESERVE, "<|im_end|>",
     kimi_think_controls},
    {"qwen3", df_render_qwen3, 0, "<|im_end|>", qwen_controls},
    {"qwen3.5", df_render_qwen35, DF_FAM_ARGS_OBJECT, "<|im_end|>", qwen_controls},
    {"qwen3.6", df_render_qwen35, DF_FAM_ARGS_OBJECT | DF_FAM_PRESERVE, "<|im_end|>",
     qwen_controls},
    {"smollm2", df_render_chatml, 0, "<|im_end|>", chatml_controls},
    {"chatml", df_render_chatml, 0, "<|im_end|>", chatml_controls},
};

struct dflash_chat_rendered {
  df_out out;
  int32_t last_assistant;
};

static void chat_options_defaults(dflash_chat_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->thinking = 1;
  o->reasoning = DFLASH_CHAT_REASONING_OFFICIAL;
}

DF_DEFINE_INIT(dflash_chat_options, chat_options_defaults)

/* Indexed by dflash_chat_reasoning: the one copy of the names (CLI, manifest, Python). */
static const char *const reasoning_names[] = {"official", "keep_all", "keep_after_last_user",
                                              "drop"};
_Static_assert(DF_ARRAY_LEN(reasoning_names) == DFLASH_CHAT_REASONING_DROP + 1,
               "a name for every reasoning mode");

const char *dflash_chat_reasoning_name(dflash_chat_reasoning mode) {
  size_t i = (size_t)mode; /* a negative value wraps past the table */
  return i < DF_ARRAY_LEN(reasoning_names) ? reasoning_names[i] : NULL;
}

dflash_status dflash_chat_reasoning_from_name(const char *name, dflash_chat_reasoning *out) {
  DF_CHECK_ARG(name && out);
  for (size_t i = 0; i < DF_ARRAY_LEN(reasoning_names); i++)
    if (!strcmp(name, reasoning_names[i])) {
      *out = (dflash_chat_reasoning)i;
      return DFLASH_OK;
    }
  df_buf known = {0};
  for (size_t i = 0; i < DF_ARRAY_LEN(reasoning_names); i++)
    df_buf_printf(&known, "%s%s", i ? ", " : "", reasoning_names[i]);
  dflash_status st = df_error(DFLASH_E_NOT_FOUND, "unknown reasoning mode \"%s\" (known: %s)", name,
                              known.data ? known.data : "");
  df_buf_free(&known);
  return st;
}

const char *dflash_chat_template_name_at(size_t index) {
  return index < DF_ARRAY_LEN(templates) ? templates[index].name : NULL;
}

dflash_status dflash_chat_template_create(const char *name, dflash_chat_template **out) {
  DF_CHECK_ARG(name && out);
  *out = NULL;
  for (size_t i = 0; i < DF_ARRAY_LEN(templates); i++)
    if (!strcmp(name, templates[i].name)) {
      /* Templates are static tables; the handle is a copy so free() is uniform. */
      dflash_chat_template *t = malloc(sizeof *t);
      if (!t) return df_error_nomem("chat template");
      *t = templates[i];
      *out = t;
      return DFLASH_OK;
    }
  df_buf known = {0};
  for (size_t i = 0; i < DF_ARRAY_LEN(templates); i++)
    df_buf_printf(&known, "%s%s", i ? ", " : "", templates[i].name);
  dflash_status st = df_error(DFLASH_E_NOT_FOUND, "unknown chat template \"%s\" (known: %s)", name,
                              known.data ? known.data : "");
  df_buf_free(&known);
  return st;
}

void dflash_chat_template_free(dflash_chat_template *t) { free(t); }

const char *dflash_chat_template_name(const dflash_chat_template *t) { return t ? t->name : NULL; }

const char *dflash_chat_template_end_of_turn(const dflash_chat_template *t) {
  return t ? t->end_of_turn : NULL;
}

int df_last_assistant(const dflash_chat_conversation *c) {
  for (size_t i = c->n; i-- > 0;)
    if (c->msgs[i].role == DF_ROLE_ASSISTANT) return (int)i;
  return -1;
}

bool df_keep_reasoning(const dflash_chat_options *o, bool official, bool in_exchange,
                       bool is_last_assistant) {
  switch (o->reasoning) {
  case DFLASH_CHAT_REASONING_KEEP_ALL: return true;
  case DFLASH_CHAT_REASONING_DROP: return false;
  case DFLASH_CHAT_REASONING_KEEP_AFTER_LAST_USER: return in_exchange || is_last_assistant;
  default: return official;
  }
}

static dflash_status check_options(const dflash_chat_options *o) {
  if (o->reasoning < DFLASH_CHAT_REASONING_OFFICIAL || o->reasoning > DFLASH_CHAT_REASONING_DROP)
    return df_error(DFLASH_E_INVALID_ARG, "dflash_chat_options: unknown reasoning mode %d",
                    (int)o->reasoning);
  return DFLASH_OK;
}

dflash_status dflash_chat_render(const dflash_chat_template *tmpl,
                                 const dflash_chat_conversation *conv,
                                 const dflash_chat_options *opts, dflash_chat_rendered **out) {
  DF_CHECK_ARG(tmpl && conv && out);
  *out = NULL;
  dflash_chat_options o;
  dflash_chat_options_default(&o);
  dflash_status st = df_opts_in(&o, opts, sizeof o, "dflash_chat_options");
  if (!st) st = check_options(&o);
  if (st) return st;
  opts = &o;
  dflash_chat_rendered *r = calloc(1, sizeof *r);
  if (!r) return df_error_nomem("rendered chat");
  df_render_ctx ctx = {.tmpl = tmpl, .conv = conv, .opts = opts, .out = &r->out};
  st = tmpl->render(&ctx);
  if (!st) st = r->out.st;
  /* The text is always NUL-terminated, even when empty. */
  if (!st) st = df_buf_reserve(&r->out.text, 1);
  if (st) {
    dflash_chat_rendered_free(r);
    return df_error_wrap(st, "template %s", tmpl->name);
  }
  r->out.text.data[r->out.text.len] = 0;
  r->last_assistant = df_last_assistant(conv);
  if (conv->unfinished >= 0) df_out_unfinish(&r->out, conv->unfinished);
  *out = r;
  return DFLASH_OK;
}

dflash_status dflash_chat_render_json(const dflash_chat_template *tmpl, const char *json,
                                      size_t len, const dflash_chat_options *opts,
                                      dflash_chat_rendered **out) {
  DF_CHECK_ARG(tmpl && json && out);
  dflash_chat_conversation *c;
  dflash_status st = dflash_chat_conversation_parse(json, len, &c);
  if (st) return st;
  st = dflash_chat_render(tmpl, c, opts, out);
  dflash_chat_conversation_free(c);
  return st;
}

void dflash_chat_rendered_free(dflash_chat_rendered *r) {
  if (!r) return;
  df_buf_free(&r->out.text);
  free(r->out.spans);
  free(r);
}

const char *dflash_chat_rendered_text(const dflash_chat_rendered *r, size_t *len) {
  if (len) *len = r ? r->out.text.len : 0;
  return r ? r->out.text.data : NULL;
}

size_t dflash_chat_rendered_span_count(const dflash_chat_rendered *r) {
  return r ? r->out.n_spans : 0;
}

dflash_status dflash_chat_rendered_span(const dflash_chat_rendered *r, size_t index,
                                        dflash_chat_span *out) {
  DF_CHECK_ARG(r && out);
  if (index >= r->out.n_spans)
    return df_error(DFLASH_E_RANGE, "span %zu of %zu", index, r->out.n_spans);
  return df_opts_out(out, &r->out.spans[index], sizeof *out, "dflash_chat_span");
}

int32_t dflash_chat_rendered_last_assistant(const dflash_chat_rendered *r) {
  return r ? r->last_assistant : -1;
}

static bool text_span(const dflash_chat_span *s) {
  return s->end > s->begin &&
         (s->kind == DFLASH_CHAT_SPAN_REASONING || s->kind == DFLASH_CHAT_SPAN_CONTENT ||
          s->kind == DFLASH_CHAT_SPAN_TOOL_CALL);
}

void df_out_unfinish(df_out *o, int msg) {
  size_t from = 0; /* the spans after the message's last text span */
  for (size_t i = 0; i < o->n_spans; i++)
    if (o->spans[i].message == msg && text_span(&o->spans[i])) from = i + 1;
  for (size_t i = from; i < o->n_spans; i++)
    if (o->spans[i].message == msg) o->spans[i].generated = 0;
}

static bool span_trained(const dflash_chat_rendered *r, const dflash_chat_span *s,
                         dflash_chat_turns turns) {
  return s->generated && (turns == DFLASH_CHAT_TURNS_ALL || s->message == r->last_assistant);
}

dflash_status dflash_chat_loss_mask(const dflash_chat_rendered *r, const uint32_t *begin,
                                    const uint32_t *end, size_t n_tokens, dflash_chat_turns turns,
                                    uint8_t *mask, size_t *n_supervised) {
  DF_CHECK_ARG(r && (n_tokens == 0 || (begin && end && mask)));
  size_t si = 0, count = 0;
  const df_out *o = &r->out;
  for (size_t i = 0; i < n_tokens; i++) {
    if (begin[i] > end[i] || end[i] > o->text.len || (i && begin[i] < end[i - 1]))
      return df_error(DFLASH_E_RANGE,
                      "token %zu: bytes [%u, %u) out of order or past the %zu-byte text", i,
                      begin[i], end[i], o->text.len);
    mask[i] = 0;
    if (begin[i] == end[i]) continue;
    /* Spans are sorted and contiguous: advance to the one holding begin[i],
     * then require every span up to end[i] to be trained. */
    while (si < o->n_spans && o->spans[si].end <= begin[i]) si++;
    bool ok = true;
    for (size_t k = si; k < o->n_spans && o->spans[k].begin < end[i]; k++)
      if (!span_trained(r, &o->spans[k], turns)) {
        ok = false;
        break;
      }
    mask[i] = ok;
    count += ok;
  }
  if (n_supervised) *n_supervised = count;
  return DFLASH_OK;
}
