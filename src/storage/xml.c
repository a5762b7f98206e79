/* Just enough XML for S3 answers: the text of named elements (Code, Message,
 * Key, Size, UploadId...), with the five predefined entities and numeric
 * character references decoded. S3 answers are flat and machine-written, so a
 * scanner is enough; a full parser would add a dependency for nothing.
 * An element holding other elements (a listing's <Contents>, <Upload>) comes
 * back as its markup, not decoded: the fields in it are decoded once, when
 * they are read from it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "storage_internal.h"


static int digit_value(char c, bool hex) {
  if (c >= '0' && c <= '9') return c - '0';
  if (hex && c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (hex && c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* Decode one entity starting at s[0] == '&'; returns bytes consumed (0: not
 * an entity, copy the '&' as is). Output is never longer than the input.
 * A character reference is "&#" decimal digits ";" or "&#x" hex digits ";"
 * (no sign, space or "0x": strtoul's extras) naming a character other than
 * U+0000 (a C string cannot hold it) and the surrogates. */
static size_t entity(const char *s, size_t n, char *o, size_t *olen) {
  static const struct {
    const char *name;
    char c;
  } named[] = {{"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}};
  for (size_t i = 0; i < DF_ARRAY_LEN(named); i++) {
    size_t k = strlen(named[i].name);
    if (n >= k && !memcmp(s, named[i].name, k)) {
      o[0] = named[i].c;
      *olen = 1;
      return k;
    }
  }
  if (n < 4 || s[1] != '#') return 0;
  bool hex = s[2] == 'x' || s[2] == 'X';
  size_t i = hex ? 3 : 2, first = i;
  unsigned long cp = 0;
  int d;
  for (; i < n && (d = digit_value(s[i], hex)) >= 0; i++)
    if ((cp = cp * (hex ? 16 : 10) + (unsigned long)d) > 0x10FFFF) cp = 0x110000; /* invalid */
  if (i == first || i == n || s[i] != ';' || cp == 0) return 0;
  size_t k = df_utf8_put(o, (uint32_t)cp); /* cp <= 0x110000 here */
  if (!k || k > i + 1) return 0;
  *olen = k;
  return i + 1;
}

static char *decode(const char *s, size_t n) {
  char *out = malloc(n + 1);
  if (!out) return NULL;
  /* Character data never holds a '<' (it is written &lt;): this is markup, and
   * decoding it here would decode its fields twice ("&amp;lt;" in a key to "<"). */
  bool markup = memchr(s, '<', n) != NULL;
  size_t o = 0;
  for (size_t i = 0; i < n;) {
    size_t used = 0, k = 0;
    if (s[i] == '&' && !markup) used = entity(s + i, n - i, out + o, &k);
    if (used) {
      i += used;
      o += k;
    } else {
      out[o++] = s[i++];
    }
  }
  out[o] = 0;
  return out;
}

char *df_xml_next(const char *xml, size_t len, const char *tag, size_t *pos) {
  char open[80], close[80];
  int on = snprintf(open, sizeof open, "<%s>", tag);
  int cn = snprintf(close, sizeof close, "</%s>", tag);
  if (on <= 0 || cn <= 0 || (size_t)cn >= sizeof close || *pos > len) return NULL;
  const char *start = memmem(xml + *pos, len - *pos, open, (size_t)on);
  if (!start) return NULL;
  start += on;
  const char *end = memmem(start, len - (size_t)(start - xml), close, (size_t)cn);
  if (!end) return NULL;
  *pos = (size_t)(end - xml) + (size_t)cn;
  return decode(start, (size_t)(end - start));
}

char *df_xml_first(const char *xml, size_t len, const char *tag) {
  size_t pos = 0;
  return xml ? df_xml_next(xml, len, tag, &pos) : NULL;
}
