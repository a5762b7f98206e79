/*
 * Chat rendering for the template families DFlash drafters are trained for,
 * with structural spans and loss masks.
 *
 * Renderers are written in C (there is no Jinja engine). In the default
 * (official) reasoning mode each one produces exactly the bytes Hugging Face
 * `apply_chat_template` produces with the family's official template:
 *
 *   name               official template                  extra switches
 *   kimi-k2            moonshotai/Kimi-K2-Instruct (2025-07)  -
 *   kimi-k2-thinking   moonshotai/Kimi-K2-Thinking        -
 *   kimi-k2.5          (no official copy at hand: see below) thinking
 *   kimi-k2.6          kimi-k2.5 + preserve_thinking       thinking, preserve_thinking
 *   qwen3              Qwen/Qwen3-*                       thinking (enable_thinking)
 *   qwen3.5            Qwen/Qwen3.5-*                     thinking (enable_thinking)
 *   qwen3.6            qwen3.5 + preserve_thinking (no official copy at hand)
 *   smollm2            HuggingFaceTB/SmolLM2-*-Instruct    -
 *   chatml             the generic ChatML template: <|im_start|>{role}\n{content}<|im_end|>\n
 *                      per message, no default system prompt
 *
 * kimi-k2.5 / kimi-k2.6 follow the K2-Thinking layout with the differences
 * public renderers describe: tools declared as the official tokenizer
 * declares them, in the TypeScript-like `tools_ts_str` form of the tools
 * with sorted keys (dflash_chat_tools_typescript(); compact JSON of the
 * sorted tools where that conversion fails), generation prompt ending in "<think>" (thinking on) or
 * "<think></think>" (off), every assistant turn collapsed to
 * "<think></think>" when thinking is off, and with preserve_thinking (K2.6)
 * every turn keeping its reasoning. qwen3.6 is qwen3.5 where
 * preserve_thinking keeps the think block of every assistant turn.
 *
 * Conversations
 * -------------
 * JSON: an array of messages, or an object with "messages" (OpenAI) or
 * "conversations" (ShareGPT: from human|user|gpt|assistant|system|tool,
 * value), optional "tools" (array of declarations), and an optional
 * "completion" object (the fetcher's record: appended as a final assistant
 * message). A message has "role" (system, user, assistant, tool), "content"
 * (a string, null, or a list of {"type": "text", "text": ...} parts),
 * optional "name", "reasoning_content" or "reasoning" (the first string
 * wins; both are read as `reasoning_content`, which is what the templates
 * use), "tool_calls" ([{"id", "type", "function": {"name", "arguments"}}],
 * arguments a JSON string or object) and, for tool results, "tool_call_id".
 * Inputs that a template cannot render faithfully are rejected with
 * DFLASH_E_FORMAT or DFLASH_E_UNSUPPORTED and a message naming the message
 * index (see each template's notes in src/chat/README.md).
 *
 * Spans
 * -----
 * Rendering records, as it writes, which bytes came from where: every byte
 * of the text belongs to exactly one span (byte range, kind, message index).
 * Spans of a "generated" kind are bytes the target model itself emits when it
 * writes that assistant turn after the generation prompt (reasoning, think
 * tags it writes, answer, tool-call text, the end-of-turn token); loss masks
 * come from these spans and never from searching the text.
 *
 * Thread safety: templates are immutable and shareable; conversations and
 * rendered results are single-owner (read-only use may be shared).
 */
#ifndef DFLASH_CHAT_H
#define DFLASH_CHAT_H

#include <dflash/dflash.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dflash_chat_template dflash_chat_template;
typedef struct dflash_chat_conversation dflash_chat_conversation;
typedef struct dflash_chat_rendered dflash_chat_rendered;

/* Which assistant turns show their reasoning. */
typedef enum dflash_chat_reasoning {
  /* Exactly what the official template renders (parity with Hugging Face). */
  DFLASH_CHAT_REASONING_OFFICIAL = 0,
  /* Every assistant turn renders its reasoning in the family's think block. */
  DFLASH_CHAT_REASONING_KEEP_ALL = 1,
  /*
   * What the target sees and emits when it writes the conversation's last
   * assistant turn: turns of the current exchange keep their reasoning,
   * earlier turns render as history (think block empty or absent), and the
   * last assistant turn always keeps it. The current exchange starts after
   * Qwen: the last user query (a user message that is not a wrapped tool
   *       response), which is the official rule;
   * Kimi: the last assistant turn without tool calls before the final
   *       assistant turn (the split the official template makes at inference
   *       time; in ordinary chats that is just before the last user message).
   * The default for datasets.
   */
  DFLASH_CHAT_REASONING_KEEP_AFTER_LAST_USER = 2,
  /* No assistant turn renders reasoning (history form for every turn). */
  DFLASH_CHAT_REASONING_DROP = 3
} dflash_chat_reasoning;

typedef struct dflash_chat_options {
  size_t struct_size;            /* sizeof(dflash_chat_options) */
  int32_t add_generation_prompt; /* 0 (default) or 1 */
  int32_t thinking;          /* 1 (default): thinking on; 0: `enable_thinking`/`thinking` = false */
  int32_t preserve_thinking; /* 0 (default); kimi-k2.6 and qwen3.6 only */
  int32_t reasoning;         /* dflash_chat_reasoning; default DFLASH_CHAT_REASONING_OFFICIAL */
} dflash_chat_options;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_chat_options_default(&opts). */
DFLASH_API void dflash_chat_options_init(dflash_chat_options *opts, size_t size);
#define dflash_chat_options_default(opts) dflash_chat_options_init((opts), sizeof *(opts))

/*
 * The reasoning modes' names, as the `dflash` CLI takes them and a dataset
 * manifest records them: "official", "keep_all", "keep_after_last_user",
 * "drop". The values are 0, 1, 2, ... so a caller lists every mode by asking
 * for names from 0 until NULL. NULL for a value outside the enum.
 */
DFLASH_API const char *dflash_chat_reasoning_name(dflash_chat_reasoning mode);
/* The mode named exactly `name`; DFLASH_E_NOT_FOUND (listing the names) for another. */
DFLASH_API dflash_status dflash_chat_reasoning_from_name(const char *name,
                                                         dflash_chat_reasoning *out);

/* Built-in template names, in a fixed order; NULL past the end. */
DFLASH_API const char *dflash_chat_template_name_at(size_t index);
/* DFLASH_E_NOT_FOUND (listing the known names) for an unknown name. */
DFLASH_API dflash_status dflash_chat_template_create(const char *name, dflash_chat_template **out);
DFLASH_API void dflash_chat_template_free(dflash_chat_template *tmpl);
/* Borrowed from the template. */
DFLASH_API const char *dflash_chat_template_name(const dflash_chat_template *tmpl);
/* The end-of-turn string the template closes turns with ("<|im_end|>"). */
DFLASH_API const char *dflash_chat_template_end_of_turn(const dflash_chat_template *tmpl);

/* Parse a conversation (see above). `len` bytes of UTF-8 JSON. */
DFLASH_API dflash_status dflash_chat_conversation_parse(const char *json, size_t len,
                                                        dflash_chat_conversation **out);
DFLASH_API void dflash_chat_conversation_free(dflash_chat_conversation *conv);
DFLASH_API size_t dflash_chat_conversation_message_count(const dflash_chat_conversation *conv);
/*
 * A fetch completion record's outcome: its "outcome" ("ok", "length", "empty", ...; fetch
 * writes the first turn's that was not "ok"), else "length" when its "finish_reason" is,
 * else NULL (no such field, or not an object). A messages-only record's top-level fields
 * count as well. Borrowed from the conversation.
 */
DFLASH_API const char *dflash_chat_conversation_outcome(const dflash_chat_conversation *conv);
/*
 * The index of the assistant message the target did not finish, -1 for none: a completion
 * record whose last turn was cut by the length limit (finish_reason "length") or came back
 * empty; also a messages-only record whose last message is the assistant's and whose
 * "finish_reason" or "outcome" says so. Rendering keeps the text the target wrote; the closing tokens the template adds
 * after it (a closing think tag, the end of turn) are spans of that message that are not
 * generated, so no loss mask supervises them.
 */
DFLASH_API int32_t dflash_chat_conversation_unfinished(const dflash_chat_conversation *conv);

struct dflash_tokenizer;

/*
 * Normalise every string of the conversation to Unicode NFC in place:
 * contents and text parts, reasoning, names, ids, tool calls (names and
 * arguments, object keys included) and tool declarations. Do this before
 * rendering for a tokenizer that normalises with NFC (Qwen's): its tokens
 * then spell the rendered bytes exactly, so spans and masks line up.
 * Template scaffolding is ASCII; a string that starts with a combining mark
 * could still compose with the scaffold byte before it (e.g. ">" + U+0338),
 * which dflash_chat_encode() reports as DFLASH_E_MISMATCH.
 * DFLASH_E_DUPLICATE when two object keys become equal.
 */
DFLASH_API dflash_status dflash_chat_conversation_normalize_nfc(dflash_chat_conversation *conv);
/* *nfc = 1 when `tok` normalises its input with NFC (probed through encode/decode), else 0. */
DFLASH_API dflash_status dflash_chat_tokenizer_nfc(const struct dflash_tokenizer *tok,
                                                   int32_t *nfc);

/*
 * DFLASH_OK when `tok` encodes each control token of `tmpl` (turn markers, think and tool-call
 * tags) as one token, as the target's own tokenizer does; DFLASH_E_MISMATCH naming every
 * control token it splits (with the number of ids) otherwise: a tokenizer of another family
 * would teach the drafter to spell them piece by piece.
 */
DFLASH_API dflash_status dflash_chat_template_check_tokenizer(const dflash_chat_template *tmpl,
                                                              const struct dflash_tokenizer *tok);

/* Render. `opts` may be NULL (defaults). */
DFLASH_API dflash_status dflash_chat_render(const dflash_chat_template *tmpl,
                                            const dflash_chat_conversation *conv,
                                            const dflash_chat_options *opts,
                                            dflash_chat_rendered **out);
/* Parse + render in one call. */
DFLASH_API dflash_status dflash_chat_render_json(const dflash_chat_template *tmpl, const char *json,
                                                 size_t len, const dflash_chat_options *opts,
                                                 dflash_chat_rendered **out);
DFLASH_API void dflash_chat_rendered_free(dflash_chat_rendered *r);
/* The rendered text: borrowed, NUL-terminated, `*len` bytes (may be NULL). */
DFLASH_API const char *dflash_chat_rendered_text(const dflash_chat_rendered *r, size_t *len);

/* Span kinds. Append only. */
typedef enum dflash_chat_span_kind {
  DFLASH_CHAT_SPAN_SCAFFOLD = 0,    /* template text: role headers, separators, default prompts,
                                       think tags standing in for dropped reasoning */
  DFLASH_CHAT_SPAN_SYSTEM = 1,      /* system message content */
  DFLASH_CHAT_SPAN_USER = 2,        /* user message content */
  DFLASH_CHAT_SPAN_TOOL_RESULT = 3, /* tool message content */
  DFLASH_CHAT_SPAN_TOOLS = 4,       /* tool declarations */
  DFLASH_CHAT_SPAN_GEN_PROMPT = 5,  /* the generation prompt (add_generation_prompt) */
  /* Generated kinds (the target writes these bytes): */
  DFLASH_CHAT_SPAN_THINK_MARKUP = 6, /* think tags and their newlines, as the target writes them */
  DFLASH_CHAT_SPAN_REASONING = 7,    /* reasoning text */
  DFLASH_CHAT_SPAN_CONTENT = 8,      /* answer text */
  DFLASH_CHAT_SPAN_TOOL_CALL = 9,    /* tool-call text with its markup */
  DFLASH_CHAT_SPAN_END_OF_TURN = 10  /* the end-of-turn token ending an assistant turn */
} dflash_chat_span_kind;

/* An output struct (dflash.h): set struct_size before dflash_chat_rendered_span. */
typedef struct dflash_chat_span {
  size_t struct_size;
  size_t begin, end; /* byte range [begin, end) of the rendered text */
  int32_t kind;      /* dflash_chat_span_kind */
  int32_t message;   /* index of the message it renders, -1 for none */
  int32_t generated; /* 1 when kind is a generated kind, else 0; 0 also for the closing
                        tokens after the text of an answer the target did not finish
                        (dflash_chat_conversation_unfinished) */
} dflash_chat_span;

/* Spans cover the text in order, without gaps; adjacent equal spans merge. */
DFLASH_API size_t dflash_chat_rendered_span_count(const dflash_chat_rendered *r);
DFLASH_API dflash_status dflash_chat_rendered_span(const dflash_chat_rendered *r, size_t index,
                                                   dflash_chat_span *out);
/* Index of the last assistant message, -1 when there is none. */
DFLASH_API int32_t dflash_chat_rendered_last_assistant(const dflash_chat_rendered *r);

/* Which assistant turns are trained. */
typedef enum dflash_chat_turns {
  DFLASH_CHAT_TURNS_ALL = 0, /* every assistant turn */
  DFLASH_CHAT_TURNS_LAST = 1 /* the last assistant turn only */
} dflash_chat_turns;

/*
 * Loss mask from token byte offsets. Token i covers bytes
 * [begin[i], end[i]) of the rendered text (as a tokenizer's encode with
 * offsets returns them; tokens must be in order and may not overlap).
 * mask[i] = 1 exactly when every byte of token i lies in generated spans of
 * trained turns, and the token is not empty; otherwise 0. So a token that
 * straddles a boundary between prompt bytes and generated bytes is 0: the
 * target never emits it (its prompt side is fixed at inference time).
 * Returns the number of supervised tokens through `*n_supervised` (may be NULL).
 */
DFLASH_API dflash_status dflash_chat_loss_mask(const dflash_chat_rendered *r, const uint32_t *begin,
                                               const uint32_t *end, size_t n_tokens,
                                               dflash_chat_turns turns, uint8_t *mask,
                                               size_t *n_supervised);

/*
 * Tokenize a rendered conversation and build its loss mask in one call:
 * the text is encoded with every special token recognised, token byte ranges
 * are the running sum of the tokens' byte lengths, and the mask follows the
 * rule of dflash_chat_loss_mask(). Writes up to `cap` entries to `ids` and
 * `mask`; *n receives the count, with DFLASH_E_BUFFER when cap is too small
 * (dflash_tokenizer_max_ids() of the text length always suffices).
 * DFLASH_E_MISMATCH when the tokens do not spell the rendered bytes exactly
 * (a normalising tokenizer changed the text, e.g. NFC on non-NFC input;
 * dflash_chat_conversation_normalize_nfc() before rendering avoids it):
 * masks need byte-exact offsets.
 */
DFLASH_API dflash_status dflash_chat_encode(const dflash_chat_rendered *r,
                                            const struct dflash_tokenizer *tok,
                                            dflash_chat_turns turns, int32_t *ids, uint8_t *mask,
                                            size_t cap, size_t *n, size_t *n_supervised);

/*
 * Kimi K2.5/K2.6 tool declarations in the TypeScript-like form the official
 * tokenizer puts in the prompt (`tools_ts_str`, from Moonshot's
 * tool_declaration_ts.py encode_tools_to_typescript_style): "# Tools",
 * "## functions", then `namespace functions { ... }` with one
 * `type NAME = (_: {...}) => any;` per function tool (interfaces for $defs
 * and for a self reference "#", descriptions, constraints and defaults as
 * `// ` comments). kimi-k2.5/2.6 render tools this way.
 * `tools_json`: `len` bytes of a JSON list of {"type": "function",
 * "function": {...}} declarations (other types are skipped; none at all
 * gives ""). `sort_keys` = 1 first sorts every object's keys, as the
 * tokenizer does before converting (deep_sort_dict); 0 converts as given.
 * Writes at most `cap` bytes to `buf` (no terminating NUL); *out_len
 * receives the full length, with DFLASH_E_BUFFER when it exceeds cap.
 * DFLASH_E_FORMAT, naming the tool and schema path, where the reference
 * raises (an unsupported $ref, an enum value of the wrong type, a schema
 * with none of $ref/anyOf/enum/type...): the tokenizer then declares the
 * tools as compact JSON of the sorted tools, and so do the renderers.
 * DFLASH_E_UNSUPPORTED where the reference would print the Python repr of
 * a list or object (an enum member, constraint value, "type" or function
 * name that is one); the renderers refuse such tools.
 */
DFLASH_API dflash_status dflash_chat_tools_typescript(const char *tools_json, size_t len,
                                                      int32_t sort_keys, char *buf, size_t cap,
                                                      size_t *out_len);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_CHAT_H */
