/*
 * A fast path for parsing conversation JSON into a jansson tree.
 *
 * jansson's decoder reads one byte per call through a stream abstraction,
 * which makes it the largest cost of `dflash tokenize` after the tokenizer
 * (records are mostly long strings). This parser builds the same tree with
 * jansson's constructors but scans strings in tight loops, and copies a
 * string once when it has no escapes. It accepts exactly what
 * json_loadb(JSON_REJECT_DUPLICATES | JSON_ALLOW_NUL) accepts; on anything
 * it does not accept it gives up (NULL), and the caller re-parses with
 * jansson, so error messages stay jansson's. tests/chat/test_json_fast.c
 * compares the two on valid and broken documents.
 */
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

#define MAX_DEPTH 2048 /* jansson's JSON_PARSER_MAX_DEPTH */

typedef struct {
  const unsigned char *p, *end;
  df_buf scratch; /* unescaped strings */
  int depth;
} jparser;

static void skip_ws(jparser *j) {
  while (j->p < j->end && (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t')) j->p++;
}

/* Length of the valid UTF-8 sequence at p (lead byte >= 0x80), 0 if invalid. */
static size_t utf8_seq(const unsigned char *p, const unsigned char *end) {
  unsigned char c = p[0];
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;      /* no overlongs */
    else if (c == 0xED) hi = 0x9F; /* no surrogates */
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    else if (c == 0xF4) hi = 0x8F; /* <= U+10FFFF */
  } else return 0;
  if ((size_t)(end - p) < n || p[1] < lo || p[1] > hi) return 0;
  for (size_t i = 2; i < n; i++)
    if ((p[i] & 0xC0) != 0x80) return 0;
  return n;
}

static int hex4(const unsigned char *p, const unsigned char *end) {
  if (end - p < 4) return -1;
  int v = 0;
  for (int i = 0; i < 4; i++) {
    int c = p[i], d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return -1;
    v = v * 16 + d;
  }
  return v;
}

static bool put_utf8(df_buf *b, uint32_t cp) {
  char u[4];
  size_t n = df_utf8_put(u, cp);
  return n && df_buf_append(b, u, n) == DFLASH_OK;
}

/* One escape after the backslash at j->p; appends its bytes. */
static bool unescape(jparser *j) {
  const unsigned char *p = ++j->p;
  if (p >= j->end) return false;
  static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
  const char *k = *p ? strchr(from, *p) : NULL;
  if (k) {
    j->p++;
    return df_buf_append(&j->scratch, &to[k - from], 1) == DFLASH_OK;
  }
  if (*p != 'u') return false;
  int v = hex4(p + 1, j->end);
  if (v < 0) return false;
  j->p = p + 5;
  uint32_t cp = (uint32_t)v;
  if (cp >= 0xDC00 && cp <= 0xDFFF) return false; /* lone low surrogate */
  if (cp >= 0xD800 && cp <= 0xDBFF) {             /* needs its low half */
    if (j->end - j->p < 6 || j->p[0] != '\\' || j->p[1] != 'u') return false;
    int lo = hex4(j->p + 2, j->end);
    if (lo < 0xDC00 || lo > 0xDFFF) return false;
    cp = 0x10000 + ((cp - 0xD800) << 10) + ((uint32_t)lo - 0xDC00);
    j->p += 6;
  }
  return put_utf8(&j->scratch, cp);
}

/* The string at j->p (just past the opening quote): its bytes and length,
 * pointing into the input when it had no escapes, else into the scratch. */
static bool string_body(jparser *j, const char **s, size_t *n) {
  const unsigned char *start = j->p;
  bool escaped = false;
  j->scratch.len = 0;
  for (;;) {
    const unsigned char *p = j->p;
    while (p < j->end && *p >= 0x20 && *p < 0x80 && *p != '"' && *p != '\\') p++;
    if (escaped && p > j->p && df_buf_append(&j->scratch, j->p, (size_t)(p - j->p))) return false;
    j->p = p;
    if (p >= j->end || *p < 0x20) return false;
    if (*p == '"') break;
    if (*p == '\\') {
      if (!escaped && df_buf_append(&j->scratch, start, (size_t)(p - start))) return false;
      escaped = true;
      if (!unescape(j)) return false;
      continue;
    }
    size_t k = utf8_seq(p, j->end);
    if (!k) return false;
    if (escaped && df_buf_append(&j->scratch, p, k)) return false;
    j->p += k;
  }
  *s = escaped ? (j->scratch.data ? j->scratch.data : "") : (const char *)start;
  *n = escaped ? j->scratch.len : (size_t)(j->p - start);
  j->p++; /* closing quote */
  return true;
}

static json_t *number(jparser *j) {
  const unsigned char *p = j->p, *s = p;
  bool real = false;
  if (p < j->end && *p == '-') p++;
  if (p >= j->end || *p < '0' || *p > '9') return NULL;
  if (*p == '0') p++;
  else
    while (p < j->end && *p >= '0' && *p <= '9') p++;
  if (p < j->end && *p == '.') {
    real = true;
    if (++p >= j->end || *p < '0' || *p > '9') return NULL;
    while (p < j->end && *p >= '0' && *p <= '9') p++;
  }
  if (p < j->end && (*p == 'e' || *p == 'E')) {
    real = true;
    p++;
    if (p < j->end && (*p == '+' || *p == '-')) p++;
    if (p >= j->end || *p < '0' || *p > '9') return NULL;
    while (p < j->end && *p >= '0' && *p <= '9') p++;
  }
  char buf[64];
  if ((size_t)(p - s) >= sizeof buf) return NULL; /* rare: let jansson decide */
  memcpy(buf, s, (size_t)(p - s));
  buf[p - s] = 0;
  j->p = p;
  errno = 0;
  if (!real) {
    long long v = strtoll(buf, NULL, 10);
    return errno == ERANGE ? NULL : json_integer((json_int_t)v);
  }
  double d = strtod(buf, NULL);
  /* jansson refuses overflow (HUGE_VAL with ERANGE), accepts underflow. */
  if (errno == ERANGE && (d > 1.0 || d < -1.0)) return NULL;
  return json_real(d);
}

static json_t *value(jparser *j);

/* Skip whitespace; consume `c` when it comes next. */
static bool eat(jparser *j, char c) {
  skip_ws(j);
  if (j->p >= j->end || *j->p != (unsigned char)c) return false;
  j->p++;
  return true;
}

static json_t *array(jparser *j) {
  json_t *a = json_array();
  j->p++;
  if (a && eat(j, ']')) return a;
  while (a) {
    json_t *v = value(j);
    if (!v || json_array_append_new(a, v)) break;
    if (eat(j, ',')) continue;
    if (eat(j, ']')) return a;
    break;
  }
  json_decref(a);
  return NULL;
}

/* One "key": value member into `o`. */
static bool member(jparser *j, json_t *o) {
  const char *k;
  size_t kn;
  /* jansson refuses NUL in keys. */
  if (!eat(j, '"') || !string_body(j, &k, &kn) || memchr(k, 0, kn)) return false;
  char small[128], *key = kn < sizeof small ? small : malloc(kn + 1);
  if (!key) return false;
  memcpy(key, k, kn);
  key[kn] = 0;
  json_t *v = eat(j, ':') && !json_object_get(o, key) ? value(j) : NULL;
  bool ok = v && json_object_set_new_nocheck(o, key, v) == 0;
  if (key != small) free(key);
  return ok;
}

static json_t *object(jparser *j) {
  json_t *o = json_object();
  j->p++;
  if (o && eat(j, '}')) return o;
  while (o && member(j, o)) {
    if (eat(j, ',')) continue;
    if (eat(j, '}')) return o;
    break;
  }
  json_decref(o);
  return NULL;
}

static json_t *literal(jparser *j, const char *word, json_t *v) {
  size_t n = strlen(word);
  if ((size_t)(j->end - j->p) < n || memcmp(j->p, word, n)) return NULL;
  j->p += n;
  return v;
}

static json_t *value(jparser *j) {
  skip_ws(j);
  if (j->p >= j->end) return NULL;
  if (++j->depth > MAX_DEPTH) return NULL;
  json_t *v = NULL;
  const char *s;
  size_t n;
  switch (*j->p) {
  case '{': v = object(j); break;
  case '[': v = array(j); break;
  case '"':
    j->p++;
    if (string_body(j, &s, &n)) v = json_stringn_nocheck(s, n);
    break;
  case 't': v = literal(j, "true", json_true()); break;
  case 'f': v = literal(j, "false", json_false()); break;
  case 'n': v = literal(j, "null", json_null()); break;
  default: v = number(j);
  }
  j->depth--;
  return v;
}

json_t *df_json_fast(const char *text, size_t len) {
  jparser j = {.p = (const unsigned char *)text, .end = (const unsigned char *)text + len};
  skip_ws(&j);
  /* jansson without JSON_DECODE_ANY takes only an object or an array. */
  json_t *v = j.p < j.end && (*j.p == '{' || *j.p == '[') ? value(&j) : NULL;
  skip_ws(&j);
  if (v && j.p != j.end) {
    json_decref(v);
    v = NULL;
  }
  df_buf_free(&j.scratch);
  return v;
}
