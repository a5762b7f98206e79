/* Internals of the chat module: the parsed conversation, the span-tracking
 * output and Python-compatible string/JSON helpers the renderers share. */
#ifndef DFLASH_CHAT_INTERNAL_H
#define DFLASH_CHAT_INTERNAL_H

#include <dflash/chat.h>

#include "core/internal.h"

struct json_t;

/* A borrowed byte string. */
typedef struct df_str {
  const char *s;
  size_t n;
} df_str;

typedef enum { DF_ROLE_SYSTEM, DF_ROLE_USER, DF_ROLE_ASSISTANT, DF_ROLE_TOOL } df_role;

/* How a message's "content" was given: jinja distinguishes all four. */
typedef enum {
  DF_CONTENT_MISSING, /* key absent: Jinja Undefined (prints "") */
  DF_CONTENT_NULL,    /* null: None (prints "None") */
  DF_CONTENT_STRING,
  DF_CONTENT_PARTS /* list of text parts; `text` holds their concatenation */
} df_content_kind;

typedef struct df_tool_call {
  df_str id;                  /* s == NULL when absent */
  df_str name;                /* s == NULL when absent */
  bool has_function;          /* the call had a "function" object */
  struct json_t *arguments;   /* borrowed; NULL when absent */
  struct json_t *args_object; /* string arguments parsed as JSON (owned), or NULL */
} df_tool_call;

typedef struct df_message {
  df_role role;
  df_content_kind content_kind;
  df_str text;    /* string content, or the joined parts */
  size_t n_parts; /* number of text parts (DF_CONTENT_PARTS) */
  bool has_reasoning;
  df_str reasoning; /* reasoning_content or reasoning */
  df_str name;      /* s == NULL when absent */
  df_str tool_call_id;
  df_tool_call *calls;
  size_t n_calls;
  bool calls_args_error; /* some string arguments were not a JSON object */
} df_message;

struct dflash_chat_conversation {
  struct json_t *root; /* owns every borrowed string */
  df_message *msgs;
  size_t n;
  struct json_t *tools; /* borrowed array, NULL when absent or empty */
  char *parts_text;     /* storage for joined text parts */
  /* A fetch record's outcome ("outcome", else "length" from finish_reason; NULL: none), and
   * the assistant message the target did not finish (its last turn cut by the length limit,
   * or empty), -1 for none: its closing tokens are not the target's (see df_out_unfinish). */
  const char *outcome;
  int unfinished;
};


/* Parse JSON text as json_loadb(JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL)
 * would, faster; NULL when it does not accept the text (re-parse with
 * jansson for the verdict and message). */
struct json_t *df_json_fast(const char *text, size_t len);

/* (Re)build the message views of `c` from c->root. */
DF_MUST_CHECK dflash_status df_conv_build(dflash_chat_conversation *c);

/* Span-tracking output. Errors are sticky so renderers read straight through. */
typedef struct df_out {
  df_buf text;
  dflash_chat_span *spans;
  size_t n_spans, cap_spans;
  dflash_status st;
} df_out;

void df_out_put(df_out *o, const char *s, size_t n, int kind, int msg);
static inline void df_out_str(df_out *o, df_str s, int kind, int msg) {
  df_out_put(o, s.s, s.n, kind, msg);
}
void df_out_cstr(df_out *o, const char *s, int kind, int msg);
/* Record a rendering failure (first one wins, kept in `o`); returns it. Not DF_MUST_CHECK,
 * as df_error: the status is recorded either way. */
dflash_status df_out_fail(df_out *o, dflash_status st, const char *fmt, ...) DF_PRINTF(3, 4);

/* The target stopped writing message `msg` where its last text span ends: the generated
 * spans of `msg` after it (closing think tag, end of turn) are the template's, not the
 * target's, and lose their `generated` flag. */
void df_out_unfinish(df_out *o, int msg);

/* Python str helpers. */
df_str df_str_of(const char *s);
bool df_str_eq(df_str a, const char *b);
bool df_str_starts(df_str a, const char *prefix);
bool df_str_ends(df_str a, const char *suffix);
bool df_str_contains(df_str a, const char *needle);
df_str df_str_strip_char(df_str a, char c, bool left, bool right); /* str.strip('\n') etc. */
df_str df_str_trim(df_str a); /* str.strip(): Python's Unicode whitespace */
/* str.split(sep)[0] and str.split(sep)[-1]. */
df_str df_str_split_first(df_str a, const char *sep);
df_str df_str_split_last(df_str a, const char *sep);

/* json.dumps(value, ensure_ascii=False, separators=(item_sep, key_sep)). */
void df_pyjson_dump(df_out *o, const struct json_t *v, const char *item_sep, const char *key_sep,
                    int kind, int msg);
/* Python str(value) of a JSON scalar ("True", "None", repr of floats); other
 * types are dumped as JSON. */
void df_pystr(df_out *o, const struct json_t *v, int kind, int msg);

/* Kimi K2.5/K2.6 tool declarations (tools_ts.c): writes
 * encode_tools_to_typescript_style(tools) to `out` (span kind TOOLS). Fails
 * with DFLASH_E_FORMAT where that reference raises (the official tokenizer
 * then declares the tools as JSON) and DFLASH_E_UNSUPPORTED where it would
 * print a Python repr of a list or object; `out` then holds a partial text. */
DF_MUST_CHECK dflash_status df_tools_typescript(const struct json_t *tools, df_out *out);
/* A copy of `v` with the keys of every object sorted (deep_sort_dict of
 * tokenization_kimi.py); NULL when out of memory. */
struct json_t *df_json_deep_sorted(const struct json_t *v);

/* Per-family renderer. */
typedef struct df_render_ctx {
  const struct dflash_chat_template *tmpl;
  const dflash_chat_conversation *conv;
  const dflash_chat_options *opts;
  df_out *out;
} df_render_ctx;

typedef dflash_status (*df_render_fn)(const df_render_ctx *ctx);

struct dflash_chat_template {
  const char *name;
  df_render_fn render;
  int family_flags;
  const char *end_of_turn;
  /* Control tokens the target's tokenizer must hold as single tokens (NULL-terminated): split
   * into pieces, the drafter would learn to spell them. */
  const char *const *controls;
};

/* family_flags */
enum {
  DF_FAM_K25 = 1,        /* kimi-k2.5 conventions */
  DF_FAM_PRESERVE = 2,   /* honours preserve_thinking */
  DF_FAM_ARGS_OBJECT = 4 /* tool-call arguments must be mappings (string ones are parsed) */
};

DF_MUST_CHECK dflash_status df_render_kimi_instruct(const df_render_ctx *ctx);
DF_MUST_CHECK dflash_status df_render_kimi_thinking(const df_render_ctx *ctx);
DF_MUST_CHECK dflash_status df_render_qwen3(const df_render_ctx *ctx);
DF_MUST_CHECK dflash_status df_render_qwen35(const df_render_ctx *ctx);
DF_MUST_CHECK dflash_status df_render_chatml(const df_render_ctx *ctx);

/* Whether an assistant message's reasoning is shown, given the official
 * decision for it and the options' reasoning mode. `in_exchange` says whether
 * the turn belongs to the current exchange (see KEEP_AFTER_LAST_USER). */
bool df_keep_reasoning(const dflash_chat_options *o, bool official, bool in_exchange,
                       bool is_last_assistant);
/* Index of the last assistant message, or -1. */
int df_last_assistant(const dflash_chat_conversation *c);

#endif
