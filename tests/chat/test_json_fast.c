/* The fast conversation JSON parser against jansson (the reference): on
 * hand-picked edge cases and on many mutated documents, whenever the fast
 * parser accepts, jansson accepts and builds the same tree (same serialisation,
 * key order included); whenever jansson refuses, the fast parser refuses. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "chat/chat_internal.h"
#include "testutil.h"

static const size_t FLAGS = JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL;

/* 1 when both accepted (trees equal), 0 when both refused, -1 when jansson
 * accepted what the fast path left to it (allowed: the caller falls back). */
static int compare(const char *text, size_t len) {
  json_error_t err;
  json_t *ref = json_loadb(text, len, FLAGS, &err);
  json_t *fast = df_json_fast(text, len);
  int verdict = fast ? 1 : ref ? -1 : 0;
  if (fast) {
    ck_assert_msg(ref != NULL, "fast parser accepted what jansson refuses (%s): %.*s", err.text,
                  (int)(len < 200 ? len : 200), text);
    char *a = json_dumps(ref, JSON_COMPACT | JSON_ENCODE_ANY);
    char *b = json_dumps(fast, JSON_COMPACT | JSON_ENCODE_ANY);
    ck_assert_msg(a && b && !strcmp(a, b), "trees differ: %s vs %s", a, b);
    free(a);
    free(b);
  }
  json_decref(ref);
  json_decref(fast);
  return verdict;
}

static int compare_str(const char *s) { return compare(s, strlen(s)); }

START_TEST(test_edge_cases) {
  static const char *accept[] = {
      "{}",
      "[]",
      " [ ] \n",
      "{\"a\": 1, \"b\": [true, false, null]}",
      "[\"\\u00e9\\ud83d\\ude00\\u0000x\", \"\\\"\\\\\\/\\b\\f\\n\\r\\t\"]",
      "[0, -0, 1, -1, 9223372036854775807, -9223372036854775808, 1.5, -2.25e-3, 1E+2, 0.1]",
      "[1e-400, 123456789.125, 1e300]",
      "{\"\": \"\"}",
      "[\"caf\xc3\xa9 \xe6\x95\xb0 \xf0\x9f\x99\x82\"]",
      "{\"k\": {\"nested\": [[[{}]]]}}",
      "[\"\xef\xbf\xbf\xf4\x8f\xbf\xbf\"]"};
  static const char *refuse[] = {"",
                                 " ",
                                 "1",
                                 "\"s\"",
                                 "null",
                                 "[1,]",
                                 "[1 2]",
                                 "{\"a\" 1}",
                                 "{\"a\": 1,}",
                                 "{a: 1}",
                                 "[01]",
                                 "[1.]",
                                 "[.5]",
                                 "[1e]",
                                 "[-]",
                                 "[+1]",
                                 "[1e400]",
                                 "[9223372036854775808]",
                                 "[-9223372036854775809]",
                                 "{\"a\": 1, \"a\": 2}",
                                 "{\"\\u0000\": 1}",
                                 "[\"\\ud800\"]",
                                 "[\"\\udc00\"]",
                                 "[\"\\ud800\\u0041\"]",
                                 "[\"\\x\"]",
                                 "[\"\\u12\"]",
                                 "[\"a\tb\"]",
                                 "[\"\xc0\x80\"]",
                                 "[\"\xe0\x80\x80\"]",
                                 "[\"\xed\xa0\x80\"]",
                                 "[\"\xf4\x90\x80\x80\"]",
                                 "[\"\xc3\"]",
                                 "[\"\x80\"]",
                                 "[\"\xf8\x88\x80\x80\x80\"]",
                                 "[\"unterminated]",
                                 "[tru]",
                                 "[truex]",
                                 "[nul]",
                                 "{} x",
                                 "[] []",
                                 "\xef\xbb\xbf[]",
                                 "[\"a\"\x00]"};
  for (size_t i = 0; i < DF_ARRAY_LEN(accept); i++)
    ck_assert_msg(compare_str(accept[i]) == 1, "not accepted: %s", accept[i]);
  for (size_t i = 0; i < DF_ARRAY_LEN(refuse); i++)
    ck_assert_msg(compare_str(refuse[i]) == 0, "not refused: %s", refuse[i]);
  ck_assert_int_eq(compare("[\"a\"]\0", 6), 0); /* bytes after the document */
}
END_TEST

START_TEST(test_depth_limit) {
  /* jansson refuses nesting past 2048 values; the fast path must agree. */
  int depths[] = {2046, 2047, 2048, 2049, 2100};
  for (size_t d = 0; d < DF_ARRAY_LEN(depths); d++) {
    int n = depths[d];
    char *s = malloc((size_t)n * 2 + 1);
    memset(s, '[', (size_t)n);
    memset(s + n, ']', (size_t)n);
    s[2 * n] = 0;
    ck_assert_int_eq(compare_str(s), n <= 2048 ? 1 : 0);
    free(s);
  }
}
END_TEST

/* Mutate a realistic record byte by byte (deterministic LCG). */
START_TEST(test_mutations) {
  static const char base[] =
      "{\"id\": \"s1\", \"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
      " {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"caf\xc3\xa9 \\u00e9"
      " \\ud83d\\ude00 \\\"q\\\" \\n\"}]}, {\"role\": \"assistant\", \"reasoning_content\":"
      " \"\xe6\x95\xb0\xe6\x8d\xae\", \"content\": null, \"tool_calls\": [{\"id\": \"c1\","
      " \"type\": \"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"x\": -1.5e3,"
      " \"y\": [true, false, null, 0, 12345678901234]}}}]}], \"tools\": []}\n";
  static const char alphabet[] = "{}[]\":,\\u0123456789abcdefnrtlsE.-+ \n\t\x80\xc3\xa9\xed\xf0";
  size_t n = sizeof base - 1, counts[3] = {0};
  char *doc = malloc(n + 8);
  uint64_t x = 0x9E3779B97F4A7C15u;
  for (int it = 0; it < 30000; it++) {
    memcpy(doc, base, n);
    size_t len = n;
    int edits = 1 + it % 3;
    for (int e = 0; e < edits; e++) {
      x = x * 6364136223846793005u + 1442695040888963407u;
      size_t at = (size_t)(x >> 33) % len;
      int op = (int)(x >> 20) % 3;
      char c = alphabet[(x >> 40) % (sizeof alphabet - 1)];
      if (op == 0) doc[at] = c;                                                 /* replace */
      else if (op == 1 && len > 1) memmove(doc + at, doc + at + 1, --len - at); /* delete */
      else { /* insert */ memmove(doc + at + 1, doc + at, len++ - at);
        doc[at] = c;
      }
    }
    counts[compare(doc, len) + 1]++;
  }
  free(doc);
  /* Both verdicts occur often, and the fast path decides nearly everything. */
  ck_assert_uint_gt(counts[2], 1000);
  ck_assert_uint_gt(counts[1], 1000);
  ck_assert_uint_lt(counts[0], 100);
}
END_TEST

TCase *tc_chat_json_fast(void) {
  TCase *tc = tcase_create("json_fast");
  tcase_add_test(tc, test_edge_cases);
  tcase_add_test(tc, test_depth_limit);
  tcase_add_test(tc, test_mutations);
  return tc;
}
