/* Kimi K2 family: kimi-k2 (Instruct, July 2025 template), kimi-k2-thinking,
 * kimi-k2.5 and kimi-k2.6 (fixture kimi-k2.6.jinja; K2.5 is K2.6 without
 * preserve_thinking, see README.md). Each statement mirrors a line of the
 * official Jinja template; comments quote the template where its behaviour
 * is odd. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

enum {
  SCAF = DFLASH_CHAT_SPAN_SCAFFOLD,
  THINK = DFLASH_CHAT_SPAN_THINK_MARKUP,
  EOT = DFLASH_CHAT_SPAN_END_OF_TURN,
  CALL = DFLASH_CHAT_SPAN_TOOL_CALL
};

static int content_kind(df_role role) {
  switch (role) {
  case DF_ROLE_SYSTEM: return DFLASH_CHAT_SPAN_SYSTEM;
  case DF_ROLE_USER: return DFLASH_CHAT_SPAN_USER;
  case DF_ROLE_TOOL: return DFLASH_CHAT_SPAN_TOOL_RESULT;
  default: return DFLASH_CHAT_SPAN_CONTENT;
  }
}

/*
 * The tools as every Kimi tokenizer hands them to its template: each
 * object's keys sorted (tokenization_kimi.py's deep_sort_dict). NULL when
 * there are none or on failure (then recorded in the output's status).
 */
static json_t *sorted_tools(const df_render_ctx *x) {
  if (!x->conv->tools || x->out->st) return NULL;
  json_t *sorted = df_json_deep_sorted(x->conv->tools);
  if (!sorted) x->out->st = df_error_nomem("kimi tool declarations");
  return sorted;
}

/*
 * kimi-k2 / kimi-k2-thinking: the template prints `tools | tojson`, but the
 * model's tokenization_kimi.py overrides apply_chat_template to deep-sort
 * every object's keys first (deep_sort_dict), so the declaration the model
 * was served with has sorted keys whatever order the caller used.
 */
static void tools_declaration(const df_render_ctx *x, const char *item_sep, const char *key_sep) {
  df_out *o = x->out;
  json_t *sorted = sorted_tools(x);
  if (!sorted) return;
  df_out_cstr(o, "<|im_system|>tool_declare<|im_middle|>", SCAF, -1);
  df_pyjson_dump(o, sorted, item_sep, key_sep, DFLASH_CHAT_SPAN_TOOLS, -1);
  df_out_cstr(o, "<|im_end|>", SCAF, -1);
  json_decref(sorted);
}

/*
 * kimi-k2.5/2.6: what tokenization_kimi.py's apply_chat_template hands the
 * template. The tools with every object's keys sorted (deep_sort_dict),
 * declared by `tools_ts_str` (encode_tools_to_typescript_style, see
 * tools_ts.c). The template tests `{%- if tools_ts_str -%}`, so when that
 * conversion raises, or gives "" (no function tool to declare), its JSON
 * branch prints the sorted tools in compact JSON.
 */
static void k25_tools_declaration(const df_render_ctx *x) {
  df_out *o = x->out;
  json_t *sorted = sorted_tools(x);
  if (!sorted) return;
  df_out ts = {0};
  dflash_status st = df_tools_typescript(sorted, &ts);
  df_out_cstr(o, "<|im_system|>tool_declare<|im_middle|>", SCAF, -1);
  if (!st && ts.text.len) {
    df_out_put(o, ts.text.data, ts.text.len, DFLASH_CHAT_SPAN_TOOLS, -1);
  } else if (!st || st == DFLASH_E_FORMAT) {
    if (st)
      df_log(DFLASH_LOG_DEBUG, "%s; declaring the tools as JSON, as the tokenizer does",
             dflash_last_error());
    df_pyjson_dump(o, sorted, ",", ":", DFLASH_CHAT_SPAN_TOOLS, -1);
  } else if (!o->st) {
    o->st = st; /* the message is already set */
  }
  df_out_cstr(o, "<|im_end|>", SCAF, -1);
  df_buf_free(&ts.text);
  free(ts.spans);
  json_decref(sorted);
}

static void end_turn(df_out *o, const df_message *m, int i) {
  df_out_cstr(o, "<|im_end|>", m->role == DF_ROLE_ASSISTANT ? EOT : SCAF, i);
}

static dflash_status need_tool_call_id(const df_render_ctx *x, const df_message *m, int i) {
  if (m->role == DF_ROLE_TOOL && !m->tool_call_id.s)
    return df_out_fail(x->out, DFLASH_E_FORMAT, "message %d: tool message without tool_call_id", i);
  return DFLASH_OK;
}

/* ---- kimi-k2 (Instruct) ---------------------------------------------------- */

static void instruct_header(df_out *o, df_role role, int i) {
  static const char *const headers[] = {[DF_ROLE_SYSTEM] = "<|im_system|>system<|im_middle|>",
                                        [DF_ROLE_USER] = "<|im_user|>user<|im_middle|>",
                                        [DF_ROLE_ASSISTANT] =
                                            "<|im_assistant|>assistant<|im_middle|>",
                                        [DF_ROLE_TOOL] = "<|im_system|>tool<|im_middle|>"};
  df_out_cstr(o, headers[role], SCAF, i);
}

/* `{{ message['content'] }}` of a list prints its Python repr, which is
 * not reproduced: such messages are refused. */
static void instruct_plain_content(const df_render_ctx *x, const df_message *m, int i) {
  if (m->content_kind == DF_CONTENT_PARTS) {
    df_out_fail(x->out, DFLASH_E_UNSUPPORTED,
                "message %d: kimi-k2 prints a list here as a Python repr; give a string", i);
    return;
  }
  if (m->content_kind == DF_CONTENT_NULL) df_out_cstr(x->out, "None", content_kind(m->role), i);
  else df_out_str(x->out, m->text, content_kind(m->role), i);
}

static void instruct_calls(const df_render_ctx *x, const df_message *m, int i) {
  df_out *o = x->out;
  /* `{%- if message['content'] -%}{{ message['content'] }}` */
  if (m->content_kind == DF_CONTENT_PARTS && m->n_parts) return instruct_plain_content(x, m, i);
  if (m->content_kind == DF_CONTENT_STRING) df_out_str(o, m->text, DFLASH_CHAT_SPAN_CONTENT, i);
  df_out_cstr(o, "<|tool_calls_section_begin|>", CALL, i);
  for (size_t k = 0; k < m->n_calls; k++) {
    const df_tool_call *tc = &m->calls[k];
    if (!tc->has_function) {
      df_out_fail(o, DFLASH_E_FORMAT, "message %d: tool call %zu has no \"function\"", i, k);
      return;
    }
    df_out_cstr(o, "<|tool_call_begin|>functions.", CALL, i);
    df_out_str(o, tc->name, CALL, i);
    char idx[32];
    snprintf(idx, sizeof idx, ":%zu", k);
    df_out_cstr(o, idx, CALL, i);
    df_out_cstr(o, "<|tool_call_argument_begin|>", CALL, i);
    /* `arguments | tojson` even when arguments is already a JSON string. */
    df_pyjson_dump(o, tc->arguments, ", ", ": ", CALL, i);
    df_out_cstr(o, "<|tool_call_end|>", CALL, i);
  }
  df_out_cstr(o, "<|tool_calls_section_end|>", CALL, i);
}

dflash_status df_render_kimi_instruct(const df_render_ctx *x) {
  const dflash_chat_conversation *c = x->conv;
  df_out *o = x->out;
  tools_declaration(x, ", ", ": ");
  for (size_t n = 0; n < c->n && !o->st; n++) {
    const df_message *m = &c->msgs[n];
    int i = (int)n;
    if (n == 0 && m->role != DF_ROLE_SYSTEM)
      df_out_cstr(o, "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>", SCAF,
                  -1);
    if (need_tool_call_id(x, m, i)) break;
    instruct_header(o, m->role, i);
    if (m->role == DF_ROLE_ASSISTANT && m->n_calls) {
      instruct_calls(x, m, i);
    } else if (m->role == DF_ROLE_TOOL) {
      /* The template's "\n" is a literal backslash-n (text, not a string literal). */
      df_out_cstr(o, "## Return of ", SCAF, i);
      df_out_str(o, m->tool_call_id, DFLASH_CHAT_SPAN_TOOL_RESULT, i);
      df_out_cstr(o, "\\n", SCAF, i);
      instruct_plain_content(x, m, i);
    } else if (m->content_kind != DF_CONTENT_NULL) {
      df_out_str(o, m->text, content_kind(m->role), i); /* Undefined prints nothing */
    }
    end_turn(o, m, i);
  }
  if (x->opts->add_generation_prompt)
    df_out_cstr(o, "<|im_assistant|>assistant<|im_middle|>", DFLASH_CHAT_SPAN_GEN_PROMPT, -1);
  return o->st;
}

/* ---- kimi-k2-thinking, kimi-k2.5, kimi-k2.6 --------------------------------- */

static void thinking_header(df_out *o, const df_message *m, int i) {
  /* `message.get('name') or message['role']`; system and tool use <|im_system|>. */
  static const char *const roles[] = {[DF_ROLE_SYSTEM] = "system",
                                      [DF_ROLE_USER] = "user",
                                      [DF_ROLE_ASSISTANT] = "assistant",
                                      [DF_ROLE_TOOL] = "tool"};
  df_out_cstr(o,
              m->role == DF_ROLE_USER        ? "<|im_user|>"
              : m->role == DF_ROLE_ASSISTANT ? "<|im_assistant|>"
                                             : "<|im_system|>",
              SCAF, i);
  if (m->name.s && m->name.n) df_out_str(o, m->name, SCAF, i);
  else df_out_cstr(o, roles[m->role], SCAF, i);
  df_out_cstr(o, "<|im_middle|>", SCAF, i);
}

/* render_content(): strings and joined text parts; null or absent: nothing. */
static void thinking_content(df_out *o, const df_message *m, int i) {
  if (m->content_kind == DF_CONTENT_STRING || m->content_kind == DF_CONTENT_PARTS)
    df_out_str(o, m->text, content_kind(m->role), i);
}

static void thinking_calls(const df_render_ctx *x, const df_message *m, int i) {
  df_out *o = x->out;
  df_out_cstr(o, "<|tool_calls_section_begin|>", CALL, i);
  for (size_t k = 0; k < m->n_calls && !o->st; k++) {
    const df_tool_call *tc = &m->calls[k];
    if (!tc->has_function || !tc->id.s) {
      df_out_fail(o, DFLASH_E_FORMAT, "message %d: tool call %zu lacks %s", i, k,
                  tc->id.s ? "\"function\"" : "an id");
      return;
    }
    df_out_cstr(o, "<|tool_call_begin|>", CALL, i);
    df_out_str(o, tc->id, CALL, i);
    df_out_cstr(o, "<|tool_call_argument_begin|>", CALL, i);
    if (json_is_string(tc->arguments)) df_pystr(o, tc->arguments, CALL, i);
    else df_pyjson_dump(o, tc->arguments, ", ", ": ", CALL, i);
    df_out_cstr(o, "<|tool_call_end|>", CALL, i);
  }
  df_out_cstr(o, "<|tool_calls_section_end|>", CALL, i);
}

/* Last assistant message without tool calls in msgs[0, end), or -1. */
static int last_final_answer(const dflash_chat_conversation *c, int end) {
  for (int i = end - 1; i >= 0; i--)
    if (c->msgs[i].role == DF_ROLE_ASSISTANT && !c->msgs[i].n_calls) return i;
  return -1;
}

/*
 * The think block. K2.5/K2.6 put "<think>" (thinking on) or "<think></think>"
 * (off) in the generation prompt, so those tags are prompt, not generated;
 * tags standing in for reasoning that was dropped are scaffolding too.
 */
static void think_block(const df_render_ctx *x, const df_message *m, int i, bool keep) {
  df_out *o = x->out;
  bool k25 = x->tmpl->family_flags & DF_FAM_K25;
  bool dropped = !keep && m->has_reasoning && m->reasoning.n;
  bool open_gen = !k25 && !dropped;
  bool close_gen = !dropped && !(k25 && !x->opts->thinking);
  df_out_cstr(o, "<think>", open_gen ? THINK : SCAF, i);
  if (keep && m->has_reasoning) df_out_str(o, m->reasoning, DFLASH_CHAT_SPAN_REASONING, i);
  df_out_cstr(o, "</think>", close_gen ? THINK : SCAF, i);
}

/*
 * Whether the official template keeps turn i's reasoning when `split` is the
 * last final answer of the messages it is given. K2.6's preserve_thinking
 * comes first: it leaves the split at -1 (no history) and its suffix test is
 * `thinking is false and preserve_thinking is false`, so the reasoning stays
 * even with thinking off. Otherwise K2.5/K2.6 with thinking off write
 * `<think></think>` for the suffix too.
 */
static bool official_keep(const df_render_ctx *x, int i, int split) {
  int fam = x->tmpl->family_flags;
  if ((fam & DF_FAM_PRESERVE) && x->opts->preserve_thinking) return true;
  if ((fam & DF_FAM_K25) && !x->opts->thinking) return false;
  return i > split;
}

dflash_status df_render_kimi_thinking(const df_render_ctx *x) {
  const dflash_chat_conversation *c = x->conv;
  df_out *o = x->out;
  int last = df_last_assistant(c);
  int split = last_final_answer(c, (int)c->n); /* the template's history/suffix split */
  int exchange = last_final_answer(c, last < 0 ? 0 : last); /* the split when `last` is generated */
  bool k25 = x->tmpl->family_flags & DF_FAM_K25;
  if (k25) k25_tools_declaration(x);
  else tools_declaration(x, ", ", ": ");
  /* K2-Thinking only: K2.5/K2.6 insert no default system prompt. */
  if (!k25 && (c->n == 0 || c->msgs[0].role != DF_ROLE_SYSTEM))
    df_out_cstr(o,
                "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by "
                "Moonshot AI.<|im_end|>",
                SCAF, -1);
  for (size_t n = 0; n < c->n && !o->st; n++) {
    const df_message *m = &c->msgs[n];
    int i = (int)n;
    if (need_tool_call_id(x, m, i)) break;
    thinking_header(o, m, i);
    if (m->role == DF_ROLE_ASSISTANT) {
      /* in_exchange: kept in the prompt the target saw when it wrote `last`. */
      bool keep = df_keep_reasoning(x->opts, official_keep(x, i, split),
                                    official_keep(x, i, exchange), i == last);
      think_block(x, m, i, keep);
      thinking_content(o, m, i);
      if (m->n_calls) thinking_calls(x, m, i);
    } else if (m->role == DF_ROLE_TOOL) {
      df_out_cstr(o, "## Return of ", SCAF, i);
      df_out_str(o, m->tool_call_id, DFLASH_CHAT_SPAN_TOOL_RESULT, i);
      df_out_cstr(o, "\n", SCAF, i);
      thinking_content(o, m, i);
    } else {
      thinking_content(o, m, i);
    }
    end_turn(o, m, i);
  }
  if (x->opts->add_generation_prompt) {
    df_out_cstr(o, "<|im_assistant|>assistant<|im_middle|>", DFLASH_CHAT_SPAN_GEN_PROMPT, -1);
    if (k25)
      df_out_cstr(o, x->opts->thinking ? "<think>" : "<think></think>", DFLASH_CHAT_SPAN_GEN_PROMPT,
                  -1);
  }
  return o->st;
}
