/* ChatML: smollm2 (SmolLM2-Instruct's template, with its default system
 * prompt) and the generic chatml template (no default system prompt). Both
 * templates ignore tools, tool calls and reasoning; tools and tool calls are
 * refused instead of being dropped silently, reasoning is not rendered. */
#include <string.h>

#include "chat_internal.h"

static const char *const roles[] = {[DF_ROLE_SYSTEM] = "system",
                                    [DF_ROLE_USER] = "user",
                                    [DF_ROLE_ASSISTANT] = "assistant",
                                    [DF_ROLE_TOOL] = "tool"};

static int text_kind(df_role r) {
  return r == DF_ROLE_SYSTEM ? DFLASH_CHAT_SPAN_SYSTEM
         : r == DF_ROLE_USER ? DFLASH_CHAT_SPAN_USER
         : r == DF_ROLE_TOOL ? DFLASH_CHAT_SPAN_TOOL_RESULT
                             : DFLASH_CHAT_SPAN_CONTENT;
}

dflash_status df_render_chatml(const df_render_ctx *x) {
  const dflash_chat_conversation *c = x->conv;
  df_out *o = x->out;
  bool smol = !strcmp(x->tmpl->name, "smollm2");
  if (c->tools)
    return df_out_fail(o, DFLASH_E_UNSUPPORTED, "template %s cannot declare tools", x->tmpl->name);
  for (size_t n = 0; n < c->n && !o->st; n++) {
    const df_message *m = &c->msgs[n];
    int i = (int)n;
    /* `'\n' + message['content'] + ...` is a TypeError unless content is a string. */
    if (m->content_kind != DF_CONTENT_STRING)
      return df_out_fail(o, DFLASH_E_FORMAT, "message %d: %s needs string content", i,
                         x->tmpl->name);
    if (m->n_calls)
      return df_out_fail(o, DFLASH_E_UNSUPPORTED, "message %d: %s cannot render tool calls", i,
                         x->tmpl->name);
    if (smol && n == 0 && m->role != DF_ROLE_SYSTEM)
      df_out_cstr(o,
                  "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                  "Hugging Face<|im_end|>\n",
                  DFLASH_CHAT_SPAN_SCAFFOLD, -1);
    df_out_cstr(o, "<|im_start|>", DFLASH_CHAT_SPAN_SCAFFOLD, i);
    df_out_cstr(o, roles[m->role], DFLASH_CHAT_SPAN_SCAFFOLD, i);
    df_out_cstr(o, "\n", DFLASH_CHAT_SPAN_SCAFFOLD, i);
    df_out_str(o, m->text, text_kind(m->role), i);
    bool asst = m->role == DF_ROLE_ASSISTANT;
    df_out_cstr(o, "<|im_end|>", asst ? DFLASH_CHAT_SPAN_END_OF_TURN : DFLASH_CHAT_SPAN_SCAFFOLD,
                i);
    df_out_cstr(o, "\n", DFLASH_CHAT_SPAN_SCAFFOLD, i);
  }
  if (x->opts->add_generation_prompt)
    df_out_cstr(o, "<|im_start|>assistant\n", DFLASH_CHAT_SPAN_GEN_PROMPT, -1);
  return o->st;
}
