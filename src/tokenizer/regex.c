/*
 * Rust-regex (tiktoken's fancy-regex, HF's patterns) to PCRE2 translation.
 *
 * Three differences matter for tokenizer patterns:
 *  - `[A&&B]` class intersection: PCRE2 has none; `(?:(?=[B])[A])` is exact.
 *  - `\p{Han}`: Rust reads a bare script name as Script, PCRE2 as
 *    Script_Extensions (which puts U+3001..U+3003 into Han); write sc=.
 *  - `\s`: Rust is Unicode White_Space; PCRE2's UCP \s also takes U+180E.
 *    We spell the White_Space set out.
 */
#include <string.h>

#include "tok_internal.h"

static const char WS_BODY[] =
    "\\t-\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}"
    "\\x{3000}";

static bool is_pcre2_script(const char *name, size_t n) {
  char buf[96];
  if (n + 8 > sizeof buf) return false;
  memcpy(buf, "\\p{sc=", 6);
  memcpy(buf + 6, name, n);
  memcpy(buf + 6 + n, "}", 2);
  int err;
  PCRE2_SIZE off;
  pcre2_code *re = pcre2_compile((PCRE2_SPTR)buf, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                 &err, &off, NULL);
  pcre2_code_free(re);
  return re != NULL;
}

/* Copy `\p{..}`, `\P{..}`, `\pL` starting at rx[i] (the backslash); returns chars used. */
static size_t copy_property(const char *rx, size_t i, df_buf *out, dflash_status *st) {
  if (rx[i + 2] != '{') {
    *st = df_buf_append(out, rx + i, rx[i + 2] ? 3 : 2);
    return rx[i + 2] ? 3 : 2;
  }
  const char *close = strchr(rx + i + 3, '}');
  if (!close) {
    *st = df_error(DFLASH_E_REGEX, "regex: unterminated \\p{ at offset %zu", i);
    return 0;
  }
  const char *name = rx + i + 3;
  size_t n = (size_t)(close - name);
  bool script = !memchr(name, '=', n) && !memchr(name, ':', n) && is_pcre2_script(name, n);
  *st = df_buf_append(out, rx + i, 3);
  if (!*st && script) *st = df_buf_append(out, "sc=", 3);
  if (!*st) *st = df_buf_append(out, name, n + 1);
  return (size_t)(close - (rx + i)) + 1;
}

/* Length of the UTF-8 character starting with byte c. */
static size_t char_len(unsigned char c) { return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4; }

/* End (index of the closing ']') of the class opening at rx[i]. */
static size_t class_end(const char *rx, size_t i, dflash_status *st) {
  size_t j = i + 1, depth = 1;
  if (rx[j] == '^') j++;
  if (rx[j] == ']') j++;
  while (rx[j]) {
    if (rx[j] == '\\' && rx[j + 1]) {
      j += 2;
      continue;
    }
    if (rx[j] == '[') {
      depth++;
      j++;
      if (rx[j] == '^') j++;
      if (rx[j] == ']') j++;
      continue;
    }
    if (rx[j] == ']' && --depth == 0) return j;
    j++;
  }
  *st = df_error(DFLASH_E_REGEX, "regex: unterminated character class at offset %zu", i);
  return 0;
}

static dflash_status translate_class(const char *rx, size_t i, size_t end, df_buf *out);

/* Translate a class body (no brackets, no top-level &&) into out; sets *has_S. */
static dflash_status translate_body(const char *rx, size_t b, size_t e, df_buf *out, bool *has_S) {
  dflash_status st = DFLASH_OK;
  size_t j = b;
  while (j < e && !st) {
    if (rx[j] == '[' && rx[j + 1] == ':') { /* POSIX [:name:], same in PCRE2 */
      const char *close = strstr(rx + j, ":]");
      size_t n = close ? (size_t)(close - (rx + j)) + 2 : e - j;
      st = df_buf_append(out, rx + j, n);
      j += n;
    } else if (rx[j] == '[') {
      return df_error(DFLASH_E_UNSUPPORTED,
                      "regex: nested character class at offset %zu (only `&&[...]` is supported)",
                      j);
    } else if (rx[j] == '\\' && (rx[j + 1] == 'p' || rx[j + 1] == 'P')) {
      j += copy_property(rx, j, out, &st);
    } else if (rx[j] == '\\' && rx[j + 1] == 's') {
      st = df_buf_append(out, WS_BODY, strlen(WS_BODY));
      j += 2;
    } else if (rx[j] == '\\' && rx[j + 1] == 'S') {
      *has_S = true;
      j += 2;
    } else if (rx[j] == '\\' && rx[j + 1]) {
      size_t n = 1 + char_len((unsigned char)rx[j + 1]);
      st = df_buf_append(out, rx + j, n);
      j += n;
    } else {
      size_t n = char_len((unsigned char)rx[j]);
      st = df_buf_append(out, rx + j, n);
      j += n;
    }
  }
  return st;
}

/* Top-level `&&` positions inside the class body [b, e). */
static size_t find_and(const char *rx, size_t b, size_t e) {
  int depth = 0;
  for (size_t j = b; j + 1 < e; j++) {
    if (rx[j] == '\\') {
      j++;
      continue;
    }
    if (rx[j] == '[') depth++;
    else if (rx[j] == ']') depth--;
    else if (depth == 0 && rx[j] == '&' && rx[j + 1] == '&') return j;
  }
  return e;
}

/* One operand of an intersection: a whole nested class or a bare body. */
static dflash_status translate_operand(const char *rx, size_t b, size_t e, df_buf *out) {
  dflash_status st = DFLASH_OK;
  if (rx[b] == '[' && class_end(rx, b, &st) == e - 1) return translate_class(rx, b, e - 1, out);
  if (st) return st;
  bool has_S = false;
  if ((st = df_buf_append(out, "[", 1)) || (st = translate_body(rx, b, e, out, &has_S))) return st;
  if (has_S)
    return df_error(DFLASH_E_UNSUPPORTED, "regex: \\S inside an intersection at offset %zu", b);
  return df_buf_append(out, "]", 1);
}

static dflash_status translate_class(const char *rx, size_t i, size_t end, df_buf *out) {
  bool neg = rx[i + 1] == '^';
  size_t b = i + 1 + neg, e = end;
  size_t amp = find_and(rx, b, e);
  dflash_status st;
  if (amp < e) {
    if (neg) return df_error(DFLASH_E_UNSUPPORTED, "regex: negated intersection at offset %zu", i);
    /* [A&&B&&C] -> (?:(?=B)(?=C)A) */
    if ((st = df_buf_append(out, "(?:", 3))) return st;
    size_t rest = amp;
    while (rest < e) {
      size_t nb = rest + 2, ne = find_and(rx, nb, e);
      if ((st = df_buf_append(out, "(?=", 3)) || (st = translate_operand(rx, nb, ne, out)) ||
          (st = df_buf_append(out, ")", 1)))
        return st;
      rest = ne;
    }
    if ((st = translate_operand(rx, b, amp, out))) return st;
    return df_buf_append(out, ")", 1);
  }
  df_buf body = {0};
  bool has_S = false;
  if ((st = translate_body(rx, b, e, &body, &has_S))) {
    df_buf_free(&body);
    return st;
  }
  if (!has_S)
    st = df_buf_printf(out, "[%s%.*s]", neg ? "^" : "", (int)body.len, body.data ? body.data : "");
  else if (neg) /* [^\S X] = white space that is not X */
    st = body.len ? df_buf_printf(out, "(?:(?![%.*s])[%s])", (int)body.len, body.data, WS_BODY)
                  : df_buf_printf(out, "[%s]", WS_BODY);
  else /* [\S X] = X or not white space */
    st = body.len ? df_buf_printf(out, "(?:[%.*s]|[^%s])", (int)body.len, body.data, WS_BODY)
                  : df_buf_printf(out, "[^%s]", WS_BODY);
  df_buf_free(&body);
  return st;
}

dflash_status df_regex_translate(const char *rx, char **out) {
  df_buf b = {0};
  dflash_status st = df_buf_append(&b, "", 0);
  size_t i = 0;
  while (rx[i] && !st) {
    if (rx[i] == '\\' && (rx[i + 1] == 'p' || rx[i + 1] == 'P')) {
      i += copy_property(rx, i, &b, &st);
    } else if (rx[i] == '\\' && (rx[i + 1] == 's' || rx[i + 1] == 'S')) {
      st = df_buf_printf(&b, "[%s%s]", rx[i + 1] == 'S' ? "^" : "", WS_BODY);
      i += 2;
    } else if (rx[i] == '\\' && rx[i + 1]) {
      size_t n = 1 + char_len((unsigned char)rx[i + 1]);
      st = df_buf_append(&b, rx + i, n);
      i += n;
    } else if (rx[i] == '[') {
      size_t end = class_end(rx, i, &st);
      if (!st) st = translate_class(rx, i, end, &b);
      i = end + 1;
    } else {
      size_t n = char_len((unsigned char)rx[i]);
      st = df_buf_append(&b, rx + i, n);
      i += n;
    }
  }
  if (st) {
    df_buf_free(&b);
    return st;
  }
  *out = b.data;
  return DFLASH_OK;
}
