/* Python-compatible text helpers: the span-tracking output buffer, str
 * methods the templates call (strip, split, startswith), json.dumps with
 * ensure_ascii=False, and str() of scalars, all byte-exact with CPython. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_internal.h"

/* ---- output with spans --------------------------------------------------- */

static bool kind_generated(int kind) { return kind >= DFLASH_CHAT_SPAN_THINK_MARKUP; }

static void add_span(df_out *o, size_t begin, size_t end, int kind, int msg) {
  if (o->n_spans) {
    dflash_chat_span *last = &o->spans[o->n_spans - 1];
    if (last->kind == kind && last->message == msg && last->end == begin) {
      last->end = end;
      return;
    }
  }
  if (o->n_spans == o->cap_spans) {
    size_t cap = o->cap_spans ? o->cap_spans * 2 : 32;
    dflash_chat_span *s = realloc(o->spans, cap * sizeof *s);
    if (!s) {
      o->st = df_error_nomem("chat spans");
      return;
    }
    o->spans = s;
    o->cap_spans = cap;
  }
  o->spans[o->n_spans++] = (dflash_chat_span){.struct_size = sizeof(dflash_chat_span),
                                              .begin = begin,
                                              .end = end,
                                              .kind = kind,
                                              .message = msg,
                                              .generated = kind_generated(kind)};
}

void df_out_put(df_out *o, const char *s, size_t n, int kind, int msg) {
  if (o->st || n == 0) return;
  size_t begin = o->text.len;
  dflash_status st = df_buf_append(&o->text, s, n);
  if (st) {
    o->st = st;
    return;
  }
  add_span(o, begin, o->text.len, kind, msg);
}

void df_out_cstr(df_out *o, const char *s, int kind, int msg) {
  df_out_put(o, s, strlen(s), kind, msg);
}

dflash_status df_out_fail(df_out *o, dflash_status st, const char *fmt, ...) {
  if (o->st) return o->st;
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  o->st = df_error(st, "%s", msg);
  return o->st;
}

/* ---- str methods --------------------------------------------------------- */

df_str df_str_of(const char *s) { return (df_str){s, s ? strlen(s) : 0}; }

bool df_str_eq(df_str a, const char *b) {
  size_t n = strlen(b);
  return a.n == n && memcmp(a.s, b, n) == 0;
}

bool df_str_starts(df_str a, const char *prefix) {
  size_t n = strlen(prefix);
  return a.n >= n && memcmp(a.s, prefix, n) == 0;
}

bool df_str_ends(df_str a, const char *suffix) {
  size_t n = strlen(suffix);
  return a.n >= n && memcmp(a.s + a.n - n, suffix, n) == 0;
}

static const char *find(df_str a, const char *needle, size_t from) {
  size_t n = strlen(needle);
  if (a.n < n) return NULL;
  return memmem(a.s + from, a.n - from, needle, n);
}

bool df_str_contains(df_str a, const char *needle) { return find(a, needle, 0) != NULL; }

df_str df_str_strip_char(df_str a, char c, bool left, bool right) {
  while (left && a.n && a.s[0] == c) a.s++, a.n--;
  while (right && a.n && a.s[a.n - 1] == c) a.n--;
  return a;
}

/* Length of the UTF-8 sequence at p (n bytes left) when it is a character
 * Python's str.isspace() accepts, else 0. The set: bidi classes WS, B, S and
 * category Zs (Objects/unicodetype_db.h). */
static size_t space_len(const unsigned char *p, size_t n) {
  if ((p[0] >= 0x09 && p[0] <= 0x0d) || (p[0] >= 0x1c && p[0] <= 0x20)) return 1;
  if (n >= 2 && p[0] == 0xc2 && (p[1] == 0x85 || p[1] == 0xa0)) return 2;
  if (n < 3) return 0;
  unsigned cp = ((p[0] & 0x0fu) << 12) | ((p[1] & 0x3fu) << 6) | (p[2] & 0x3fu);
  if ((p[0] & 0xf0) != 0xe0) return 0;
  if (cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 ||
      cp == 0x202f || cp == 0x205f || cp == 0x3000)
    return 3;
  return 0;
}

/* Length of the whitespace character ending at byte a.n (0 if none). */
static size_t space_len_before(df_str a) {
  for (size_t k = 1; k <= 3 && k <= a.n; k++) {
    const unsigned char *p = (const unsigned char *)a.s + a.n - k;
    if ((p[0] & 0xc0) == 0x80) continue; /* a continuation byte: look further back */
    size_t l = space_len(p, k);
    return l == k ? k : 0;
  }
  return 0;
}

df_str df_str_trim(df_str a) {
  size_t l;
  while (a.n && (l = space_len((const unsigned char *)a.s, a.n))) a.s += l, a.n -= l;
  while (a.n && (l = space_len_before(a))) a.n -= l;
  return a;
}

df_str df_str_split_first(df_str a, const char *sep) {
  const char *p = find(a, sep, 0);
  if (p) a.n = (size_t)(p - a.s);
  return a;
}

df_str df_str_split_last(df_str a, const char *sep) {
  size_t n = strlen(sep);
  const char *p, *last = NULL;
  size_t from = 0;
  while ((p = find(a, sep, from))) {
    last = p;
    from = (size_t)(p - a.s) + n;
  }
  if (!last) return a;
  return (df_str){last + n, a.n - (size_t)(last + n - a.s)};
}

/* ---- json.dumps ---------------------------------------------------------- */

/* repr(float): the shortest digits that round-trip, in CPython's layout
 * (fixed notation for exponents -4..15 with at least one fractional digit,
 * else d.ddde+XX). */
static void py_float(df_out *o, double x, int kind, int msg) {
  if (isnan(x)) return df_out_cstr(o, "NaN", kind, msg);
  if (isinf(x)) return df_out_cstr(o, x < 0 ? "-Infinity" : "Infinity", kind, msg);
  char sci[40];
  for (int prec = 0; prec <= 16; prec++) {
    snprintf(sci, sizeof sci, "%.*e", prec, x);
    if (strtod(sci, NULL) == x) break;
  }
  /* sci = [-]d[.ddd]e[+-]XX */
  char digits[24];
  size_t nd = 0;
  const char *p = sci;
  bool neg = *p == '-';
  if (neg) p++;
  for (; *p && *p != 'e'; p++)
    if (*p != '.') digits[nd++] = *p;
  int exp = atoi(p + 1);
  while (nd > 1 && digits[nd - 1] == '0') nd--;
  char buf[64];
  size_t k = 0;
  if (neg) buf[k++] = '-';
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      buf[k++] = '0';
      buf[k++] = '.';
      for (int i = -1; i > exp; i--) buf[k++] = '0';
      for (size_t i = 0; i < nd; i++) buf[k++] = digits[i];
    } else {
      for (int i = 0; i <= exp; i++) buf[k++] = (size_t)i < nd ? digits[i] : '0';
      buf[k++] = '.';
      if ((size_t)exp + 1 < nd)
        for (size_t i = (size_t)exp + 1; i < nd; i++) buf[k++] = digits[i];
      else buf[k++] = '0';
    }
    buf[k] = 0;
  } else {
    buf[k++] = digits[0];
    if (nd > 1) {
      buf[k++] = '.';
      for (size_t i = 1; i < nd; i++) buf[k++] = digits[i];
    }
    snprintf(buf + k, sizeof buf - k, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
  }
  df_out_cstr(o, buf, kind, msg);
}

/* json.dumps string escaping with ensure_ascii=False: only '"', '\\' and
 * control characters below 0x20 are escaped. */
static void py_json_string(df_out *o, const char *s, size_t n, int kind, int msg) {
  df_out_put(o, "\"", 1, kind, msg);
  size_t run = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c >= 0x20 && c != '"' && c != '\\') continue;
    df_out_put(o, s + run, i - run, kind, msg);
    char esc[8];
    switch (c) {
    case '"': strcpy(esc, "\\\""); break;
    case '\\': strcpy(esc, "\\\\"); break;
    case '\n': strcpy(esc, "\\n"); break;
    case '\r': strcpy(esc, "\\r"); break;
    case '\t': strcpy(esc, "\\t"); break;
    case '\b': strcpy(esc, "\\b"); break;
    case '\f': strcpy(esc, "\\f"); break;
    default: snprintf(esc, sizeof esc, "\\u%04x", c); break;
    }
    df_out_cstr(o, esc, kind, msg);
    run = i + 1;
  }
  df_out_put(o, s + run, n - run, kind, msg);
  df_out_put(o, "\"", 1, kind, msg);
}

void df_pyjson_dump(df_out *o, const json_t *v, const char *item_sep, const char *key_sep, int kind,
                    int msg) {
  char num[32];
  switch (json_typeof(v)) {
  case JSON_OBJECT: {
    df_out_put(o, "{", 1, kind, msg);
    const char *key;
    json_t *val;
    bool first = true;
    /* jansson keeps insertion order, as Python dicts do. */
    json_object_foreach((json_t *)v, key, val) {
      if (!first) df_out_cstr(o, item_sep, kind, msg);
      first = false;
      py_json_string(o, key, strlen(key), kind, msg);
      df_out_cstr(o, key_sep, kind, msg);
      df_pyjson_dump(o, val, item_sep, key_sep, kind, msg);
    }
    df_out_put(o, "}", 1, kind, msg);
    break;
  }
  case JSON_ARRAY:
    df_out_put(o, "[", 1, kind, msg);
    for (size_t i = 0; i < json_array_size(v); i++) {
      if (i) df_out_cstr(o, item_sep, kind, msg);
      df_pyjson_dump(o, json_array_get(v, i), item_sep, key_sep, kind, msg);
    }
    df_out_put(o, "]", 1, kind, msg);
    break;
  case JSON_STRING:
    py_json_string(o, json_string_value(v), json_string_length(v), kind, msg);
    break;
  case JSON_INTEGER:
    snprintf(num, sizeof num, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
    df_out_cstr(o, num, kind, msg);
    break;
  case JSON_REAL: py_float(o, json_real_value(v), kind, msg); break;
  case JSON_TRUE: df_out_cstr(o, "true", kind, msg); break;
  case JSON_FALSE: df_out_cstr(o, "false", kind, msg); break;
  case JSON_NULL: df_out_cstr(o, "null", kind, msg); break;
  }
}

void df_pystr(df_out *o, const json_t *v, int kind, int msg) {
  switch (json_typeof(v)) {
  case JSON_STRING: df_out_put(o, json_string_value(v), json_string_length(v), kind, msg); break;
  case JSON_TRUE: df_out_cstr(o, "True", kind, msg); break;
  case JSON_FALSE: df_out_cstr(o, "False", kind, msg); break;
  case JSON_NULL: df_out_cstr(o, "None", kind, msg); break;
  case JSON_REAL: py_float(o, json_real_value(v), kind, msg); break;
  default: df_pyjson_dump(o, v, ", ", ": ", kind, msg); break;
  }
}
