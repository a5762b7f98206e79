/* Rendering: template names, bad input, exact output of small conversations
 * (expected strings written from the official templates), and span kinds. */
#include <dflash/chat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static dflash_chat_template *tmpl(const char *name) {
  dflash_chat_template *t = NULL;
  ck_assert_ok(dflash_chat_template_create(name, &t));
  return t;
}

static dflash_chat_rendered *render(const char *name, const char *json,
                                    const dflash_chat_options *o) {
  dflash_chat_template *t = tmpl(name);
  dflash_chat_rendered *r = NULL;
  ck_assert_ok(dflash_chat_render_json(t, json, strlen(json), o, &r));
  dflash_chat_template_free(t);
  return r;
}

static dflash_status render_status(const char *name, const char *json) {
  dflash_chat_template *t = tmpl(name);
  dflash_chat_rendered *r = NULL;
  dflash_status st = dflash_chat_render_json(t, json, strlen(json), NULL, &r);
  ck_assert(st != DFLASH_OK || r != NULL);
  dflash_chat_rendered_free(r);
  dflash_chat_template_free(t);
  return st;
}

/* Kind of the span holding the first occurrence of `needle` at or after `from`. */
static int kind_at(const dflash_chat_rendered *r, const char *needle, size_t from) {
  size_t len;
  const char *text = dflash_chat_rendered_text(r, &len);
  const char *p = strstr(text + from, needle);
  ck_assert_msg(p, "\"%s\" not in rendered text", needle);
  size_t pos = (size_t)(p - text);
  for (size_t i = 0; i < dflash_chat_rendered_span_count(r); i++) {
    dflash_chat_span s = {.struct_size = sizeof s};
    ck_assert_ok(dflash_chat_rendered_span(r, i, &s));
    if (s.begin <= pos && pos < s.end) return s.kind;
  }
  ck_abort_msg("no span at %zu", pos);
  return -1;
}

START_TEST(test_names) {
  size_t n = 0;
  while (dflash_chat_template_name_at(n)) n++;
  ck_assert_uint_eq(n, 9);
  dflash_chat_template *t = NULL;
  ck_assert_status(dflash_chat_template_create("llama3", &t), DFLASH_E_NOT_FOUND, "qwen3.5");
  ck_assert_ptr_null(t);
  t = tmpl("kimi-k2.6");
  ck_assert_str_eq(dflash_chat_template_name(t), "kimi-k2.6");
  ck_assert_str_eq(dflash_chat_template_end_of_turn(t), "<|im_end|>");
  dflash_chat_template_free(t);
  dflash_chat_template_free(NULL);
}
END_TEST

START_TEST(test_bad_input) {
  ck_assert_status(render_status("qwen3", "[{\"role\": \"user\", "), DFLASH_E_JSON, "at column 18");
  ck_assert_status(render_status("qwen3", "[{\"role\": \"robot\", \"content\": \"x\"}]"),
                   DFLASH_E_FORMAT, "unknown role \"robot\"");
  ck_assert_status(render_status("qwen3", "[{\"role\": \"user\", \"content\": 5}]"),
                   DFLASH_E_FORMAT, "message 0: content");
  ck_assert_status(render_status("qwen3", "[{\"content\": \"x\"}]"), DFLASH_E_FORMAT,
                   "no string \"role\"");
  ck_assert_status(render_status("kimi-k2-thinking", "[{\"role\": \"user\", \"content\": \"q\"},"
                                                     " {\"role\": \"tool\", \"content\": \"r\"}]"),
                   DFLASH_E_FORMAT, "message 1: tool message without tool_call_id");
  ck_assert_status(render_status("qwen3", "[{\"role\": \"user\", \"content\": \"\xff\"}]"),
                   DFLASH_E_UTF8, "conversation");
  ck_assert_status(render_status("qwen3.5", "[{\"role\": \"user\", \"content\": "
                                            "[{\"type\": \"image_url\", \"image_url\": \"u\"}]}]"),
                   DFLASH_E_UNSUPPORTED, "not text");
  ck_assert_status(render_status("qwen3.5", "[{\"role\": \"assistant\", \"content\": \"a\"}]"),
                   DFLASH_E_FORMAT, "No user query");
  ck_assert_status(render_status("smollm2", "{\"messages\": [{\"role\": \"user\", \"content\": "
                                            "\"q\"}], \"tools\": [{\"name\": \"f\"}]}"),
                   DFLASH_E_UNSUPPORTED, "cannot declare tools");
  ck_assert_status(render_status("qwen3", "{\"conversation\": []}"), DFLASH_E_FORMAT,
                   "no \"messages\"");
  dflash_chat_options o;
  dflash_chat_options_default(&o);
  o.reasoning = 9;
  dflash_chat_template *t = tmpl("qwen3");
  dflash_chat_rendered *r = NULL;
  ck_assert_status(dflash_chat_render_json(t, "[]", 2, &o, &r), DFLASH_E_INVALID_ARG,
                   "reasoning mode 9");
  dflash_chat_template_free(t);
}
END_TEST

static const char conv_qwen[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"},"
    " {\"role\": \"user\", \"content\": \"Q1\"},"
    " {\"role\": \"assistant\", \"reasoning_content\": \"R1\", \"content\": \"A1\"},"
    " {\"role\": \"user\", \"content\": \"Q2\"},"
    " {\"role\": \"assistant\", \"reasoning\": \"R2\", \"content\": \"A2\"}]}";

START_TEST(test_qwen3_exact_and_spans) {
  dflash_chat_rendered *r = render("qwen3", conv_qwen, NULL);
  size_t len;
  const char *text = dflash_chat_rendered_text(r, &len);
  /* Reasoning of turns before the last user query is dropped; the final turn keeps it. */
  ck_assert_str_eq(text, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
                         "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
                         "<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n");
  ck_assert_uint_eq(len, strlen(text));
  ck_assert_int_eq(dflash_chat_rendered_last_assistant(r), 4);
  ck_assert_int_eq(kind_at(r, "<think>", 0), DFLASH_CHAT_SPAN_THINK_MARKUP);
  ck_assert_int_eq(kind_at(r, "R2", 0), DFLASH_CHAT_SPAN_REASONING);
  ck_assert_int_eq(kind_at(r, "A2", 0), DFLASH_CHAT_SPAN_CONTENT);
  ck_assert_int_eq(kind_at(r, "Q2", 0), DFLASH_CHAT_SPAN_USER);
  ck_assert_int_eq(kind_at(r, "S<", 0), DFLASH_CHAT_SPAN_SYSTEM);
  ck_assert_int_eq(kind_at(r, "assistant\n<think>", 0), DFLASH_CHAT_SPAN_SCAFFOLD);
  ck_assert_int_eq(kind_at(r, "<|im_end|>", len - 11), DFLASH_CHAT_SPAN_END_OF_TURN);
  ck_assert_int_eq(kind_at(r, "\n", len - 1), DFLASH_CHAT_SPAN_SCAFFOLD);
  /* Spans tile the text and agree with their kinds on `generated`. */
  size_t pos = 0;
  for (size_t i = 0; i < dflash_chat_rendered_span_count(r); i++) {
    dflash_chat_span s = {.struct_size = sizeof s};
    ck_assert_ok(dflash_chat_rendered_span(r, i, &s));
    ck_assert_uint_eq(s.begin, pos);
    ck_assert(s.end > s.begin);
    ck_assert_int_eq(s.generated, s.kind >= DFLASH_CHAT_SPAN_THINK_MARKUP);
    pos = s.end;
  }
  ck_assert_uint_eq(pos, len);
  dflash_chat_span s = {.struct_size = sizeof s};
  ck_assert_status(dflash_chat_rendered_span(r, 999, &s), DFLASH_E_RANGE, "span 999");
  dflash_chat_rendered_free(r);

  /* keep_all shows the first turn's reasoning too. */
  dflash_chat_options o;
  dflash_chat_options_default(&o);
  o.reasoning = DFLASH_CHAT_REASONING_KEEP_ALL;
  r = render("qwen3", conv_qwen, &o);
  ck_assert_ptr_nonnull(strstr(dflash_chat_rendered_text(r, NULL), "<think>\nR1\n</think>\n\nA1"));
  dflash_chat_rendered_free(r);
}
END_TEST

START_TEST(test_kimi_thinking_final_turn) {
  const char *conv =
      "[{\"role\": \"user\", \"content\": \"Q\"},"
      " {\"role\": \"assistant\", \"reasoning_content\": \"R\", \"content\": \"A\"}]";
  /* The official template drops the final answer's reasoning: "<think></think>"
   * stands in for it and is scaffolding, not something the target wrote. */
  dflash_chat_rendered *r = render("kimi-k2-thinking", conv, NULL);
  ck_assert_str_eq(dflash_chat_rendered_text(r, NULL),
                   "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by "
                   "Moonshot AI.<|im_end|><|im_user|>user<|im_middle|>Q<|im_end|>"
                   "<|im_assistant|>assistant<|im_middle|><think></think>A<|im_end|>");
  ck_assert_int_eq(kind_at(r, "<think>", 0), DFLASH_CHAT_SPAN_SCAFFOLD);
  dflash_chat_rendered_free(r);
  /* The dataset default keeps it, and the target wrote the tags. */
  dflash_chat_options o;
  dflash_chat_options_default(&o);
  o.reasoning = DFLASH_CHAT_REASONING_KEEP_AFTER_LAST_USER;
  r = render("kimi-k2-thinking", conv, &o);
  ck_assert_ptr_nonnull(strstr(dflash_chat_rendered_text(r, NULL), "<think>R</think>A<|im_end|>"));
  ck_assert_int_eq(kind_at(r, "<think>", 0), DFLASH_CHAT_SPAN_THINK_MARKUP);
  dflash_chat_rendered_free(r);
  /* kimi-k2.5 puts "<think>" in the prompt: only "</think>" is generated. */
  r = render("kimi-k2.5", conv, &o);
  ck_assert_int_eq(kind_at(r, "<think>", 0), DFLASH_CHAT_SPAN_SCAFFOLD);
  ck_assert_int_eq(kind_at(r, "</think>", 0), DFLASH_CHAT_SPAN_THINK_MARKUP);
  dflash_chat_rendered_free(r);
}
END_TEST

/* kimi-k2.5/2.6 (fixture kimi-k2.6.jinja): no default system prompt; with
 * thinking off the suffix collapses to "<think></think>" unless K2.6's
 * preserve_thinking keeps every turn's reasoning (kimi-k2.5 has no such switch). */
START_TEST(test_kimi_k26_thinking_switches) {
  const char *conv = "[{\"role\": \"user\", \"content\": \"Q1\"},"
                     " {\"role\": \"assistant\", \"reasoning\": \"R1\", \"content\": \"A1\"},"
                     " {\"role\": \"user\", \"content\": \"Q2\"},"
                     " {\"role\": \"assistant\", \"reasoning_content\": \"R2\","
                     "  \"content\": \"A2\"}]";
  const char *q1 = "<|im_user|>user<|im_middle|>Q1<|im_end|><|im_assistant|>assistant<|im_middle|>";
  const char *q2 = "<|im_end|><|im_user|>user<|im_middle|>Q2<|im_end|>"
                   "<|im_assistant|>assistant<|im_middle|>";
  struct {
    const char *name;
    int thinking, preserve;
    const char *t1, *t2;
  } cases[] = {
      {"kimi-k2.6", 1, 0, "<think></think>A1", "<think></think>A2<|im_end|>"},
      {"kimi-k2.6", 1, 1, "<think>R1</think>A1", "<think>R2</think>A2<|im_end|>"},
      {"kimi-k2.6", 0, 0, "<think></think>A1", "<think></think>A2<|im_end|>"},
      {"kimi-k2.6", 0, 1, "<think>R1</think>A1", "<think>R2</think>A2<|im_end|>"},
      {"kimi-k2.5", 0, 1, "<think></think>A1", "<think></think>A2<|im_end|>"},
  };
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    dflash_chat_options o;
    dflash_chat_options_default(&o);
    o.thinking = cases[k].thinking;
    o.preserve_thinking = cases[k].preserve;
    dflash_chat_rendered *r = render(cases[k].name, conv, &o);
    char want[512];
    snprintf(want, sizeof want, "%s%s%s%s", q1, cases[k].t1, q2, cases[k].t2);
    ck_assert_str_eq(dflash_chat_rendered_text(r, NULL), want);
    dflash_chat_rendered_free(r);
  }
  /* The split: only the turn after the last final answer is suffix. */
  const char *open = "[{\"role\": \"user\", \"content\": \"Q1\"},"
                     " {\"role\": \"assistant\", \"reasoning\": \"R1\", \"content\": \"A1\"},"
                     " {\"role\": \"user\", \"content\": \"Q2\"}]";
  dflash_chat_options o;
  dflash_chat_options_default(&o);
  o.add_generation_prompt = 1;
  dflash_chat_rendered *r = render("kimi-k2.6", open, &o);
  ck_assert_str_eq(dflash_chat_rendered_text(r, NULL),
                   "<|im_user|>user<|im_middle|>Q1<|im_end|><|im_assistant|>assistant"
                   "<|im_middle|><think></think>A1<|im_end|><|im_user|>user<|im_middle|>Q2"
                   "<|im_end|><|im_assistant|>assistant<|im_middle|><think>");
  dflash_chat_rendered_free(r);
  o.thinking = 0;
  o.preserve_thinking = 1;
  r = render("kimi-k2.6", open, &o);
  ck_assert_ptr_nonnull(
      strstr(dflash_chat_rendered_text(r, NULL), "<think>R1</think>A1<|im_end|>"));
  ck_assert_ptr_nonnull(strstr(dflash_chat_rendered_text(r, NULL), "<|im_middle|><think></think>"));
  dflash_chat_rendered_free(r);
}
END_TEST

START_TEST(test_completion_record_and_sharegpt) {
  const char *rec = "{\"id\": \"p1\", \"messages\": [{\"role\": \"user\", \"content\": \"Q\"}],"
                    " \"completion\": {\"role\": \"assistant\", \"reasoning\": \"R\","
                    " \"content\": \"A\"}, \"finish_reason\": \"stop\"}";
  dflash_chat_rendered *r = render("qwen3", rec, NULL);
  ck_assert_str_eq(dflash_chat_rendered_text(r, NULL),
                   "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nR\n</think>"
                   "\n\nA<|im_end|>\n");
  dflash_chat_rendered_free(r);
  const char *sg = "{\"conversations\": [{\"from\": \"human\", \"value\": \"Q\"},"
                   " {\"from\": \"gpt\", \"value\": \"A\"}]}";
  r = render("chatml", sg, NULL);
  ck_assert_str_eq(dflash_chat_rendered_text(r, NULL),
                   "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n");
  dflash_chat_rendered_free(r);
}
END_TEST

/* A messages-only record cut by the length limit is unfinished in its last (assistant)
 * message, as a completion record is; one whose last message is not the answer keeps the
 * outcome only (a dataset build rejects it). */
START_TEST(test_messages_only_finish_reason) {
  static const struct {
    const char *json, *outcome;
    int32_t unfinished;
  } cases[] = {
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": "
       "\"assistant\", \"content\": \"A\"}], \"finish_reason\": \"length\"}",
       "length", 1},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": "
       "\"assistant\", \"content\": \"\"}], \"outcome\": \"empty\"}",
       "empty", 1},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": "
       "\"assistant\", \"content\": \"A\"}], \"finish_reason\": \"stop\"}",
       NULL, -1},
      {"{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}], \"finish_reason\": "
       "\"length\"}",
       "length", -1},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    dflash_chat_conversation *c;
    ck_assert_ok(dflash_chat_conversation_parse(cases[i].json, strlen(cases[i].json), &c));
    const char *outcome = dflash_chat_conversation_outcome(c);
    ck_assert_msg(cases[i].outcome ? outcome && !strcmp(outcome, cases[i].outcome) : !outcome,
                  "case %zu: %s", i, outcome ? outcome : "(null)");
    ck_assert_int_eq(dflash_chat_conversation_unfinished(c), cases[i].unfinished);
    dflash_chat_conversation_free(c);
  }
}
END_TEST

START_TEST(test_json_numbers) {
  /* json.dumps spellings of floats and escapes, through a tool declaration. */
  const char *conv = "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}], \"tools\": "
                     "[{\"a\": [1.0, 1e16, 1e-05, 0.0001, -0.0, 123456789.125, 1e300, 2.5e-7],"
                     " \"s\": \"\\u0001\\\"\\\\\\n\\u00e9\\u2028\"}]}";
  dflash_chat_rendered *r = render("kimi-k2", conv, NULL);
  ck_assert_ptr_nonnull(
      strstr(dflash_chat_rendered_text(r, NULL),
             "[{\"a\": [1.0, 1e+16, 1e-05, 0.0001, -0.0, 123456789.125, "
             "1e+300, 2.5e-07], \"s\": \"\\u0001\\\"\\\\\\n\xc3\xa9\xe2\x80\xa8\"}]"));
  dflash_chat_rendered_free(r);
}
END_TEST

/* The reasoning modes' names: one per enum value, in order, and back. */
START_TEST(test_reasoning_names) {
  static const char *const want[] = {"official", "keep_all", "keep_after_last_user", "drop"};
  const dflash_chat_reasoning modes[] = {DFLASH_CHAT_REASONING_OFFICIAL,
                                         DFLASH_CHAT_REASONING_KEEP_ALL,
                                         DFLASH_CHAT_REASONING_KEEP_AFTER_LAST_USER,
                                         DFLASH_CHAT_REASONING_DROP};
  for (size_t i = 0; i < 4; i++) {
    ck_assert_str_eq(dflash_chat_reasoning_name(modes[i]), want[i]);
    dflash_chat_reasoning back = (dflash_chat_reasoning)-1;
    ck_assert_ok(dflash_chat_reasoning_from_name(want[i], &back));
    ck_assert_int_eq(back, modes[i]);
  }
  ck_assert_ptr_null(dflash_chat_reasoning_name((dflash_chat_reasoning)4));
  ck_assert_ptr_null(dflash_chat_reasoning_name((dflash_chat_reasoning)-1));
  dflash_chat_reasoning m = DFLASH_CHAT_REASONING_DROP;
  ck_assert_status(dflash_chat_reasoning_from_name("Official", &m), DFLASH_E_NOT_FOUND,
                   "\"Official\" (known: official, keep_all, keep_after_last_user, drop)");
  ck_assert_int_eq(m, DFLASH_CHAT_REASONING_DROP); /* untouched on failure */
  ck_assert_status(dflash_chat_reasoning_from_name("", &m), DFLASH_E_NOT_FOUND, "\"\"");
  ck_assert_status(dflash_chat_reasoning_from_name(NULL, &m), DFLASH_E_INVALID_ARG, "name");
  ck_assert_status(dflash_chat_reasoning_from_name("drop", NULL), DFLASH_E_INVALID_ARG, "out");
}
END_TEST

TCase *tc_chat_render(void) {
  TCase *tc = tcase_create("render");
  tcase_add_test(tc, test_names);
  tcase_add_test(tc, test_bad_input);
  tcase_add_test(tc, test_reasoning_names);
  tcase_add_test(tc, test_qwen3_exact_and_spans);
  tcase_add_test(tc, test_kimi_thinking_final_turn);
  tcase_add_test(tc, test_kimi_k26_thinking_switches);
  tcase_add_test(tc, test_completion_record_and_sharegpt);
  tcase_add_test(tc, test_messages_only_finish_reason);
  tcase_add_test(tc, test_json_numbers);
  return tc;
}
