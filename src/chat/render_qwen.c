/* Qwen family: qwen3 (hybrid thinking), qwen3.5 and qwen3.6. Statements
 * follow the official Jinja templates line by line. */
#include <jansson.h>
#include <string.h>

#include "chat_internal.h"

enum {
  SCAF = DFLASH_CHAT_SPAN_SCAFFOLD,
  THINK = DFLASH_CHAT_SPAN_THINK_MARKUP,
  CALL = DFLASH_CHAT_SPAN_TOOL_CALL,
  TEXT = DFLASH_CHAT_SPAN_CONTENT
};

static const char qwen3_tools_head[] =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
static const char qwen3_tools_tail[] =
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";
static const char qwen35_tools_head[] =
    "# Tools\n\nYou have access to the following functions:\n\n<tools>";
static const char qwen35_tools_tail[] =
    "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>"
    "\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second "
    "parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n"
    "<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner "
    "<function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your "
    "function call in natural language BEFORE the function call, but NOT after\n- If there is "
    "no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>";

static const char *role_name(df_role r) {
  static const char *const names[] = {[DF_ROLE_SYSTEM] = "system",
                                      [DF_ROLE_USER] = "user",
                                      [DF_ROLE_ASSISTANT] = "assistant",
                                      [DF_ROLE_TOOL] = "tool"};
  return names[r];
}

static int text_kind(df_role r) {
  return r == DF_ROLE_SYSTEM ? DFLASH_CHAT_SPAN_SYSTEM
         : r == DF_ROLE_USER ? DFLASH_CHAT_SPAN_USER
         : r == DF_ROLE_TOOL ? DFLASH_CHAT_SPAN_TOOL_RESULT
                             : TEXT;
}

static void tools_list(const df_render_ctx *x, const char *head, const char *tail) {
  df_out_cstr(x->out, head, SCAF, -1);
  for (size_t k = 0; k < json_array_size(x->conv->tools); k++) {
    df_out_cstr(x->out, "\n", SCAF, -1);
    df_pyjson_dump(x->out, json_array_get(x->conv->tools, k), ", ", ": ", DFLASH_CHAT_SPAN_TOOLS,
                   -1);
  }
  df_out_cstr(x->out, tail, SCAF, -1);
}

/* One "<|im_start|>role\n{content}<|im_end|>\n" turn of a non-assistant message. */
static void plain_turn(df_out *o, const df_message *m, df_str content, int i) {
  df_out_cstr(o, "<|im_start|>", SCAF, i);
  df_out_cstr(o, role_name(m->role), SCAF, i);
  df_out_cstr(o, "\n", SCAF, i);
  df_out_str(o, content, text_kind(m->role), i);
  df_out_cstr(o, "<|im_end|>\n", SCAF, i);
}

/* The turn's `<|im_end|>` is written by the target; the "\n" after it is not. */
static void assistant_end(df_out *o, int i) {
  df_out_cstr(o, "<|im_end|>", DFLASH_CHAT_SPAN_END_OF_TURN, i);
  df_out_cstr(o, "\n", SCAF, i);
}

/* Reasoning and answer of an assistant message, as both templates split them:
 * reasoning_content when given, else the text before "</think>" in content. */
static void split_reasoning(const df_message *m, df_str content, df_str *rc, df_str *answer) {
  *rc = (df_str){"", 0};
  *answer = content;
  if (m->has_reasoning) {
    *rc = m->reasoning;
  } else if (df_str_contains(content, "</think>")) {
    df_str before = df_str_strip_char(df_str_split_first(content, "</think>"), '\n', false, true);
    *rc = df_str_strip_char(df_str_split_last(before, "<think>"), '\n', true, false);
    *answer = df_str_strip_char(df_str_split_last(content, "</think>"), '\n', true, false);
  }
}

/* "<think>\n{rc}\n</think>\n\n". With thinking on, qwen3's prompt stops
 * before "<think>" and qwen3.5's includes "<think>\n"; with thinking off
 * the whole empty block is prompt. */
static void think_block(const df_render_ctx *x, df_str rc, bool open_in_prompt, int i) {
  bool on = x->opts->thinking;
  df_out_cstr(x->out, "<think>\n", on && !open_in_prompt ? THINK : SCAF, i);
  df_out_str(x->out, rc, DFLASH_CHAT_SPAN_REASONING, i);
  df_out_cstr(x->out, "\n</think>\n\n", on ? THINK : SCAF, i);
}

static void gen_prompt(const df_render_ctx *x, bool qwen35) {
  if (!x->opts->add_generation_prompt) return;
  df_out_cstr(x->out, "<|im_start|>assistant\n", DFLASH_CHAT_SPAN_GEN_PROMPT, -1);
  if (!x->opts->thinking)
    df_out_cstr(x->out, "<think>\n\n</think>\n\n", DFLASH_CHAT_SPAN_GEN_PROMPT, -1);
  else if (qwen35) df_out_cstr(x->out, "<think>\n", DFLASH_CHAT_SPAN_GEN_PROMPT, -1);
}

static bool is_tool_response(df_str s) {
  return df_str_starts(s, "<tool_response>") && df_str_ends(s, "</tool_response>");
}

/* Tool messages: consecutive ones share one user turn. `open` says whether
 * this one starts it, `close` whether it ends it. */
static void tool_turn(df_out *o, df_str content, bool open, bool close, int i) {
  if (open) df_out_cstr(o, "<|im_start|>user", SCAF, i);
  df_out_cstr(o, "\n<tool_response>\n", SCAF, i);
  df_out_str(o, content, DFLASH_CHAT_SPAN_TOOL_RESULT, i);
  df_out_cstr(o, "\n</tool_response>", SCAF, i);
  if (close) df_out_cstr(o, "<|im_end|>\n", SCAF, i);
}

static bool next_is_tool(const dflash_chat_conversation *c, size_t n) {
  return n + 1 < c->n && c->msgs[n + 1].role == DF_ROLE_TOOL;
}

/* ---- qwen3 ----------------------------------------------------------------- */

static df_str qwen3_content(const df_message *m) {
  return m->content_kind == DF_CONTENT_STRING ? m->text : (df_str){"", 0};
}

static dflash_status qwen3_system(const df_render_ctx *x) {
  const dflash_chat_conversation *c = x->conv;
  df_out *o = x->out;
  bool sys = c->msgs[0].role == DF_ROLE_SYSTEM;
  /* `messages[0].content + ...` fails in Jinja unless content is a string. */
  if (sys && c->msgs[0].content_kind != DF_CONTENT_STRING)
    return df_out_fail(o, DFLASH_E_FORMAT, "message 0: qwen3 needs string system content");
  if (c->tools) {
    df_out_cstr(o, "<|im_start|>system\n", SCAF, sys ? 0 : -1);
    if (sys) {
      df_out_str(o, c->msgs[0].text, DFLASH_CHAT_SPAN_SYSTEM, 0);
      df_out_cstr(o, "\n\n", SCAF, 0);
    }
    tools_list(x, qwen3_tools_head, qwen3_tools_tail);
  } else if (sys) {
    plain_turn(o, &c->msgs[0], c->msgs[0].text, 0);
  }
  return o->st;
}

static int qwen3_last_query(const dflash_chat_conversation *c) {
  for (size_t i = c->n; i-- > 0;) {
    const df_message *m = &c->msgs[i];
    if (m->role == DF_ROLE_USER && m->content_kind == DF_CONTENT_STRING &&
        !is_tool_response(m->text))
      return (int)i;
  }
  return (int)c->n - 1;
}

static void qwen3_calls(df_out *o, const df_message *m, df_str content, int i) {
  for (size_t k = 0; k < m->n_calls; k++) {
    const df_tool_call *tc = &m->calls[k];
    if (k || content.n) df_out_cstr(o, "\n", CALL, i);
    df_out_cstr(o, "<tool_call>\n{\"name\": \"", CALL, i);
    df_out_str(o, tc->name, CALL, i);
    df_out_cstr(o, "\", \"arguments\": ", CALL, i);
    if (json_is_string(tc->arguments)) df_pystr(o, tc->arguments, CALL, i);
    else df_pyjson_dump(o, tc->arguments, ", ", ": ", CALL, i);
    df_out_cstr(o, "}\n</tool_call>", CALL, i);
  }
}

static void qwen3_assistant(const df_render_ctx *x, size_t n, int lqi, int last) {
  df_out *o = x->out;
  const df_message *m = &x->conv->msgs[n];
  int i = (int)n;
  df_str rc, content;
  split_reasoning(m, qwen3_content(m), &rc, &content);
  bool after = df_keep_reasoning(x->opts, i > lqi, i > lqi, i == last);
  df_out_cstr(o, "<|im_start|>assistant\n", SCAF, i);
  if (after && (n + 1 == x->conv->n || rc.n)) {
    think_block(x, df_str_strip_char(rc, '\n', true, true), false, i);
    df_out_str(o, df_str_strip_char(content, '\n', true, false), TEXT, i);
  } else {
    df_out_str(o, content, TEXT, i);
  }
  qwen3_calls(o, m, content, i);
  assistant_end(o, i);
}

dflash_status df_render_qwen3(const df_render_ctx *x) {
  const dflash_chat_conversation *c = x->conv;
  df_out *o = x->out;
  if (!c->n) return df_out_fail(o, DFLASH_E_FORMAT, "qwen3 needs at least one message");
  if (qwen3_system(x)) return o->st;
  int lqi = qwen3_last_query(c), last = df_last_assistant(c);
  for (size_t n = 0; n < c->n && !o->st; n++) {
    const df_message *m = &c->msgs[n];
    switch (m->role) {
    case DF_ROLE_SYSTEM:
      if (n) plain_turn(o, m, qwen3_content(m), (int)n);
      break;
    case DF_ROLE_USER: plain_turn(o, m, qwen3_content(m), (int)n); break;
    case DF_ROLE_ASSISTANT: qwen3_assistant(x, n, lqi, last); break;
    case DF_ROLE_TOOL:
      tool_turn(o, qwen3_content(m), n == 0 || c->msgs[n - 1].role != DF_ROLE_TOOL,
                !next_is_tool(c, n), (int)n);
      break;
    }
  }
  gen_prompt(x, false);
  return o->st;
}

/* ---- qwen3.5 / qwen3.6 ------------------------------------------------------ */

/* render_content(...)|trim: strings and text parts, trimmed of Python whitespace. */
static df_str qwen35_content(const df_message *m) {
  if (m->content_kind == DF_CONTENT_STRING || m->content_kind == DF_CONTENT_PARTS)
    return df_str_trim(m->text);
  return (df_str){"", 0};
}

static void qwen35_system(const df_render_ctx *x) {
  const dflash_chat_conversation *c = x->conv;
  df_out *o = x->out;
  bool sys = c->msgs[0].role == DF_ROLE_SYSTEM;
  df_str content = sys ? qwen35_content(&c->msgs[0]) : (df_str){"", 0};
  if (c->tools) {
    df_out_cstr(o, "<|im_start|>system\n", SCAF, -1);
    tools_list(x, qwen35_tools_head, qwen35_tools_tail);
    if (content.n) {
      df_out_cstr(o, "\n\n", SCAF, 0);
      df_out_str(o, content, DFLASH_CHAT_SPAN_SYSTEM, 0);
    }
    df_out_cstr(o, "<|im_end|>\n", SCAF, sys ? 0 : -1);
  } else if (sys) {
    plain_turn(o, &c->msgs[0], content, 0);
  }
}

static int qwen35_last_query(const dflash_chat_conversation *c) {
  for (size_t i = c->n; i-- > 0;)
    if (c->msgs[i].role == DF_ROLE_USER && !is_tool_response(qwen35_content(&c->msgs[i])))
      return (int)i;
  return -1;
}

/* Arguments as a mapping: `tool_call.arguments|items` needs one; JSON-string
 * arguments are parsed first (as vLLM does before templating). */
static const json_t *qwen35_args(df_out *o, const df_tool_call *tc, int i, size_t k) {
  if (json_is_object(tc->arguments)) return tc->arguments;
  if (tc->args_object) return tc->args_object;
  df_out_fail(o, DFLASH_E_FORMAT, "message %d: tool call %zu: arguments are not a JSON object", i,
              k);
  return NULL;
}

static void qwen35_calls(df_out *o, const df_message *m, df_str content, int i) {
  for (size_t k = 0; k < m->n_calls && !o->st; k++) {
    const df_tool_call *tc = &m->calls[k];
    const json_t *args = qwen35_args(o, tc, i, k);
    if (!args) return;
    df_out_cstr(o,
                k           ? "\n<tool_call>\n<function="
                : content.n ? "\n\n<tool_call>\n<function="
                            : "<tool_call>\n<function=",
                CALL, i);
    df_out_str(o, tc->name, CALL, i);
    df_out_cstr(o, ">\n", CALL, i);
    const char *key;
    json_t *val;
    json_object_foreach((json_t *)args, key, val) {
      df_out_cstr(o, "<parameter=", CALL, i);
      df_out_cstr(o, key, CALL, i);
      df_out_cstr(o, ">\n", CALL, i);
      if (json_is_object(val) || json_is_array(val)) df_pyjson_dump(o, val, ", ", ": ", CALL, i);
      else df_pystr(o, val, CALL, i);
      df_out_cstr(o, "\n</parameter>\n", CALL, i);
    }
    df_out_cstr(o, "</function>\n</tool_call>", CALL, i);
  }
}

static void qwen35_assistant(const df_render_ctx *x, size_t n, int lqi, int last) {
  df_out *o = x->out;
  const df_message *m = &x->conv->msgs[n];
  int i = (int)n;
  df_str rc, content;
  split_reasoning(m, qwen35_content(m), &rc, &content);
  rc = df_str_trim(rc);
  bool preserve = (x->tmpl->family_flags & DF_FAM_PRESERVE) && x->opts->preserve_thinking;
  bool keep = df_keep_reasoning(x->opts, preserve || i > lqi, preserve || i > lqi, i == last);
  df_out_cstr(o, "<|im_start|>assistant\n", SCAF, i);
  if (keep) think_block(x, rc, true, i);
  df_out_str(o, content, TEXT, i);
  qwen35_calls(o, m, df_str_trim(content), i);
  assistant_end(o, i);
}

dflash_status df_render_qwen35(const df_render_ctx *x) {
  const dflash_chat_conversation *c = x->conv;
  df_out *o = x->out;
  if (!c->n) return df_out_fail(o, DFLASH_E_FORMAT, "No messages provided.");
  qwen35_system(x);
  int lqi = qwen35_last_query(c), last = df_last_assistant(c);
  if (lqi < 0) return df_out_fail(o, DFLASH_E_FORMAT, "No user query found in messages.");
  for (size_t n = 0; n < c->n && !o->st; n++) {
    const df_message *m = &c->msgs[n];
    switch (m->role) {
    case DF_ROLE_SYSTEM:
      if (n)
        df_out_fail(o, DFLASH_E_FORMAT, "message %zu: System message must be at the beginning.", n);
      break;
    case DF_ROLE_USER: plain_turn(o, m, qwen35_content(m), (int)n); break;
    case DF_ROLE_ASSISTANT: qwen35_assistant(x, n, lqi, last); break;
    case DF_ROLE_TOOL:
      /* `loop.previtem and loop.previtem.role != "tool"`: no header for a first message. */
      tool_turn(o, qwen35_content(m), n > 0 && c->msgs[n - 1].role != DF_ROLE_TOOL,
                !next_is_tool(c, n), (int)n);
      break;
    }
  }
  gen_prompt(x, true);
  return o->st;
}
