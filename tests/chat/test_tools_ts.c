/* Kimi K2.5/K2.6 TypeScript-like tool declarations: small cases whose
 * expected text was worked out by hand from the rules of Moonshot's
 * tool_declaration_ts.py (tests/chat/test_tools_ts.py compares with the
 * reference itself over generated schemas). */
#include <dflash/chat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define HEAD "# Tools\n\n## functions\nnamespace functions {\n"
#define TAIL "\n}\n"

static char *ts(const char *json, int sort_keys) {
  size_t n = 0;
  dflash_status st = dflash_chat_tools_typescript(json, strlen(json), sort_keys, NULL, 0, &n);
  ck_assert_msg(st == DFLASH_OK || st == DFLASH_E_BUFFER, "%s", dflash_last_error());
  char *buf = malloc(n + 1);
  ck_assert_ok(dflash_chat_tools_typescript(json, strlen(json), sort_keys, buf, n, &n));
  buf[n] = 0;
  return buf;
}

static void ck_ts(const char *json, const char *want) {
  char *got = ts(json, 1);
  ck_assert_str_eq(got, want);
  free(got);
}

#define FN(params) \
  "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": " params "}}]"

START_TEST(test_fields_order_and_comments) {
  /* Required fields first, each group by name; description lines, sorted
   * constraints (str() of values) and repr() defaults above each field. */
  ck_ts("[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
        "\"description\": \"Weather.\\n\\nBy city.\", \"parameters\": {\"type\": \"object\", "
        "\"required\": [\"city\"], \"properties\": {"
        "\"unit\": {\"type\": \"string\", \"enum\": [\"c\", \"f\"], \"default\": \"c\"}, "
        "\"days\": {\"type\": \"integer\", \"minimum\": 1, \"maximum\": 1e20, \"default\": 1.0}, "
        "\"city\": {\"type\": \"string\", \"description\": \"City\", \"pattern\": \"^[A-Z]\", "
        "\"maxLength\": 64, \"format\": \"x\"}, "
        "\"raw\": {\"type\": \"boolean\", \"default\": true}}}}}]",
        HEAD "// Weather.\n\n// By city.\n"
             "type get_weather = (_: {\n"
             "  // City\n"
             "  // maxLength: 64, pattern: ^[A-Z]\n"
             "  city: string,\n"
             "  // maximum: 1e+20, minimum: 1\n"
             "  // Default: 1.0\n"
             "  days?: number,\n"
             "  // Default: True\n"
             "  raw?: boolean,\n"
             "  // Default: \"c\"\n"
             "  unit?: \"c\" | \"f\"\n"
             "}) => any;" TAIL);
}
END_TEST

START_TEST(test_arrays_unions_enums) {
  /* Described items open a multi-line Array<...>; enums print str() of
   * non-strings; anyOf and type lists join with " | ". */
  ck_ts(FN("{\"type\": \"object\", \"properties\": {"
           "\"l\": {\"type\": \"array\", \"minItems\": 1, \"items\": {\"type\": \"string\", "
           "\"description\": \"a\\n\\nb\", \"maxLength\": 3}}, "
           "\"m\": {\"type\": \"array\"}, "
           "\"e\": {\"enum\": [1, \"a\", null, true, 0.1]}, "
           "\"u\": {\"type\": [\"integer\", \"null\", \"array\", \"object\"]}, "
           "\"o\": {\"anyOf\": [{\"type\": \"string\"}, {\"type\": \"object\", "
           "\"additionalProperties\": false}]}}}"),
        HEAD "type f = (_: {\n"
             "  e?: 1 | \"a\" | None | True | 0.1,\n"
             "  // minItems: 1\n"
             "  l?: Array<\n"
             "    // a\n\n"
             "    // b\n"
             "    // maxLength: 3\n"
             "    string\n"
             "  >,\n"
             "  m?: Array<any>,\n"
             "  o?: string | {\n"
             "    [k: string]: never\n"
             "  },\n"
             "  u?: number | null | Array<any> | {}\n"
             "}) => any;" TAIL);
}
END_TEST

START_TEST(test_defs_and_self_reference) {
  /* "#" makes the parameters an interface (fields in their given order);
   * every $defs entry is an interface, described above it. */
  ck_ts("[{\"type\": \"function\", \"function\": {\"name\": \"tree\", \"parameters\": "
        "{\"type\": \"object\", \"required\": [\"tag\"], \"$defs\": {\"Tag\": {\"type\": "
        "\"object\", \"description\": \"A tag\", \"properties\": {\"v\": {\"type\": "
        "\"string\"}}, \"additionalProperties\": {\"type\": \"integer\"}}}, \"properties\": {"
        "\"tag\": {\"$ref\": \"#/$defs/Tag\"}, \"children\": {\"type\": \"array\", "
        "\"items\": {\"$ref\": \"#\"}}}}}}, {\"type\": \"_plugin\"}, "
        "{\"type\": \"function\", \"function\": {\"name\": \"g\"}}]",
        HEAD "interface parameters {\n"
             "  children?: Array<parameters>,\n"
             "  tag: Tag\n"
             "}\n"
             "// A tag\n"
             "interface Tag {\n"
             "  v?: string,\n"
             "  [k: string]: number\n"
             "}\n"
             "type tree = (_: parameters) => any;\n"
             "type g = (_: {}) => any;" TAIL);
}
END_TEST

START_TEST(test_sorting_and_empty) {
  /* Key order matters for $defs (interfaces in registration order): sorted
   * when asked. No function tool: "". */
  const char *tools = FN("{\"type\": \"object\", \"$defs\": {\"B\": {\"type\": \"string\"}, "
                         "\"A\": {\"type\": \"number\"}}}");
  char *sorted = ts(tools, 1), *given = ts(tools, 0);
  ck_assert_str_eq(sorted,
                   HEAD "interface A number\ninterface B string\ntype f = (_: {}) => any;" TAIL);
  ck_assert_str_eq(given,
                   HEAD "interface B string\ninterface A number\ntype f = (_: {}) => any;" TAIL);
  free(sorted);
  free(given);
  char *none = ts("[{\"type\": \"retrieval\"}, {\"type\": \"function\"}]", 1);
  ck_assert_str_eq(none, "");
  free(none);
}
END_TEST

START_TEST(test_errors_and_buffer) {
  const char *tools = FN(
      "{\"type\": \"object\", \"properties\": {\"x\": {\"description\": \"d\"}}}");
  size_t n = 0;
  ck_assert_status(dflash_chat_tools_typescript(tools, strlen(tools), 1, NULL, 0, &n),
                   DFLASH_E_FORMAT, "tools[0] (function f), parameters.properties.x");
  tools = FN("{\"type\": \"object\", \"properties\": {\"x\": {\"$ref\": \"#/$defs/Later\"}, "
             "\"y\": {\"type\": \"object\", \"$defs\": {\"Later\": {}}}}}");
  ck_assert_status(dflash_chat_tools_typescript(tools, strlen(tools), 1, NULL, 0, &n),
                   DFLASH_E_FORMAT, "not registered before");
  tools = FN("{\"type\": \"object\", \"properties\": {\"x\": {\"type\": \"integer\", "
             "\"enum\": [1, 2.5]}}}");
  ck_assert_status(dflash_chat_tools_typescript(tools, strlen(tools), 1, NULL, 0, &n),
                   DFLASH_E_FORMAT, "not an integer");
  tools = FN("{\"type\": \"object\", \"properties\": {\"x\": {\"enum\": [[1]]}}}");
  ck_assert_status(dflash_chat_tools_typescript(tools, strlen(tools), 1, NULL, 0, &n),
                   DFLASH_E_UNSUPPORTED, "Python repr");
  tools = FN("{}");
  char small[8];
  ck_assert_status(dflash_chat_tools_typescript(tools, strlen(tools), 1, small, sizeof small, &n),
                   DFLASH_E_BUFFER, "bytes");
  ck_assert_uint_eq(n, strlen(HEAD "type f = (_: {}) => any;" TAIL));
  ck_assert_status(dflash_chat_tools_typescript("{}", 2, 1, NULL, 0, &n), DFLASH_E_FORMAT, "list");
}
END_TEST

static char *render_text(const char *name, const char *conv) {
  dflash_chat_template *t = NULL;
  dflash_chat_rendered *r = NULL;
  ck_assert_ok(dflash_chat_template_create(name, &t));
  ck_assert_ok(dflash_chat_render_json(t, conv, strlen(conv), NULL, &r));
  char *text = strdup(dflash_chat_rendered_text(r, NULL));
  dflash_chat_rendered_free(r);
  dflash_chat_template_free(t);
  return text;
}

START_TEST(test_kimi_renderers) {
  /* K2.5/K2.6 declare tools_ts_str; where the conversion raises, the compact
   * JSON of the deep-sorted tools; K2 and K2-Thinking print the sorted tools
   * with the template's tojson. */
  const char *ok = "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}], \"tools\": "
                   "[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]}";
  const char *bad = "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}], \"tools\": "
                    "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": "
                    "{\"type\": \"object\", \"properties\": {\"x\": {\"b\": 1, \"a\": 2}}}}}]}";
  char *t = render_text("kimi-k2.6", ok);
  ck_assert_ptr_nonnull(strstr(t, "<|im_system|>tool_declare<|im_middle|>" HEAD
                                  "type f = (_: {}) => any;" TAIL "<|im_end|>"));
  free(t);
  t = render_text("kimi-k2.5", bad);
  ck_assert_ptr_nonnull(strstr(
      t, "tool_declare<|im_middle|>[{\"function\":{\"name\":\"f\",\"parameters\":{\"properties\":"
         "{\"x\":{\"a\":2,\"b\":1}},\"type\":\"object\"}},\"type\":\"function\"}]<|im_end|>"));
  free(t);
  /* No function tool: tools_ts_str is "", which the template's `if tools_ts_str`
   * takes for false, so the sorted tools are declared as compact JSON. */
  const char *plugin = "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}], \"tools\": "
                       "[{\"type\": \"_plugin\", \"_plugin\": {\"name\": \"web\"}}]}";
  t = render_text("kimi-k2.6", plugin);
  ck_assert_str_eq(t, "<|im_system|>tool_declare<|im_middle|>[{\"_plugin\":{\"name\":\"web\"},"
                      "\"type\":\"_plugin\"}]<|im_end|><|im_user|>user<|im_middle|>q<|im_end|>");
  free(t);
  for (int k = 0; k < 2; k++) { /* tojson of the deep-sorted tools */
    t = render_text(k ? "kimi-k2" : "kimi-k2-thinking", bad);
    ck_assert_ptr_nonnull(strstr(t,
                                 "<|im_middle|>[{\"function\": {\"name\": \"f\", "
                                 "\"parameters\": {\"properties\": {\"x\": {\"a\": 2, "
                                 "\"b\": 1}}, \"type\": \"object\"}}, \"type\": \"function\"}]"));
    free(t);
  }
  const char *repr = "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}], \"tools\": "
                     "[{\"type\": \"function\", \"function\": {\"name\": [\"f\"]}}]}";
  dflash_chat_template *tm = NULL;
  dflash_chat_rendered *r = NULL;
  ck_assert_ok(dflash_chat_template_create("kimi-k2.5", &tm));
  ck_assert_status(dflash_chat_render_json(tm, repr, strlen(repr), NULL, &r), DFLASH_E_UNSUPPORTED,
                   "function name");
  ck_assert_ptr_null(r);
  dflash_chat_template_free(tm);
}
END_TEST

/* Depth: jansson refuses JSON nested deeper than 2048 with a message, and
 * every schema nesting it accepts converts without exhausting the stack
 * (the conversion and the deep sort recurse once per level). */
static char *nested(const char *open, const char *leaf, const char *close, int depth) {
  size_t n = strlen(open) + strlen(close);
  char *s = malloc(n * (size_t)depth + strlen(leaf) + 256), *p = s;
  p += sprintf(p, "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": "
                  "{\"type\": \"object\", \"properties\": {\"x\": ");
  for (int i = 0; i < depth; i++) p = stpcpy(p, open);
  p = stpcpy(p, leaf);
  for (int i = 0; i < depth; i++) p = stpcpy(p, close);
  strcpy(p, "}}}}]");
  return s;
}

START_TEST(test_deep_nesting) {
  enum { DEEP = 100000 };
  char *deep = malloc(2 * DEEP);
  memset(deep, '[', DEEP);
  memset(deep + DEEP, ']', DEEP);
  size_t n;
  ck_assert_status(dflash_chat_tools_typescript(deep, 2 * DEEP, 1, NULL, 0, &n), DFLASH_E_JSON,
                   "maximum parsing depth");
  free(deep);
  /* The deepest nestings accepted (6 JSON levels outside x; 2 per object
   * level, 2 per anyOf, 1 per array), then one level more. */
  static const struct {
    const char *open, *leaf, *close;
    int depth;
  } kinds[3] = {
      {"{\"type\": \"object\", \"properties\": {\"a\": ", "{\"type\": \"string\"}",
       "}, \"required\": [\"a\"]}", 1020},
      {"{\"anyOf\": [", "{\"type\": \"string\"}", "]}", 1020},
      {"{\"type\": \"array\", \"items\": ", "{\"type\": \"string\", \"description\": \"d\"}", "}",
       2041},
  };
  for (int i = 0; i < 3; i++) {
    char *ok = nested(kinds[i].open, kinds[i].leaf, kinds[i].close, kinds[i].depth);
    for (int sort = 0; sort < 2; sort++) free(ts(ok, sort));
    free(ok);
    char *deeper = nested(kinds[i].open, kinds[i].leaf, kinds[i].close, kinds[i].depth + 1);
    ck_assert_status(dflash_chat_tools_typescript(deeper, strlen(deeper), 1, NULL, 0, &n),
                     DFLASH_E_JSON, "maximum parsing depth");
    free(deeper);
  }
}
END_TEST

TCase *tc_chat_tools_ts(void) {
  TCase *tc = tcase_create("tools_ts");
  tcase_add_test(tc, test_fields_order_and_comments);
  tcase_add_test(tc, test_arrays_unions_enums);
  tcase_add_test(tc, test_defs_and_self_reference);
  tcase_add_test(tc, test_sorting_and_empty);
  tcase_add_test(tc, test_errors_and_buffer);
  tcase_add_test(tc, test_kimi_renderers);
  tcase_add_test(tc, test_deep_nesting);
  return tc;
}
