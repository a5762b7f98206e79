/* libFuzzer target: the S3 answer scanner (src/storage/xml.c) on arbitrary bytes.
 * The first byte picks the mode and the element name (those the S3 client reads).
 * Checks, for every input:
 *  - scan: df_xml_next walks every <tag>text</tag> of the document (and, in a
 *    <Contents> or <Upload> entry, its <Key> and <Size> or <UploadId>, as s3_ops.c
 *    reads them), *pos only moving forward and within the text, each result
 *    NUL-terminated and equal to a reference decoding written here from XML's rules
 *    (the five predefined entities; decimal and hex character references of an XML
 *    character other than U+0000; anything else is copied as is; an element holding
 *    markup, a '<', comes back undecoded), never longer than the element's text;
 *    df_xml_first gives the first;
 *  - round trip: the rest of the input as an object key (bytes other than NUL), escaped
 *    the way S3 escapes keys in a listing (entities for & < > " ', numeric references
 *    for control characters), comes back unchanged from <Key>, read from the document
 *    and read from its <Contents> entry as the listing reads it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "storage/storage_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char *const TAGS[] = {"Code",     "Message", "Contents",
                                   "Key",      "Size",    "IsTruncated",
                                   "UploadId", "Upload",  "NextContinuationToken"};
#define N_TAGS (sizeof TAGS / sizeof *TAGS)

static bool put_utf8(df_buf *b, unsigned long cp) {
  char u[4];
  size_t n;
  if (cp < 0x80) u[0] = (char)cp, n = 1;
  else if (cp < 0x800) u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 0x3F)), n = 2;
  else if (cp < 0x10000) {
    u[0] = (char)(0xE0 | cp >> 12), u[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    u[2] = (char)(0x80 | (cp & 0x3F)), n = 3;
  } else {
    u[0] = (char)(0xF0 | cp >> 18), u[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    u[2] = (char)(0x80 | ((cp >> 6) & 0x3F)), u[3] = (char)(0x80 | (cp & 0x3F)), n = 4;
  }
  return df_buf_append(b, u, n) == DFLASH_OK;
}

static int digit(char c, bool hex) {
  if (c >= '0' && c <= '9') return c - '0';
  if (hex && c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (hex && c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* Length of the reference at s (s[0] == '&') and its bytes in `out`; 0: copy '&'. */
static size_t ref_entity(const char *s, size_t n, df_buf *out) {
  static const char *const names[] = {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"};
  static const char chars[] = "&<>\"'";
  for (size_t i = 0; i < 5; i++) {
    size_t k = strlen(names[i]);
    if (n >= k && !memcmp(s, names[i], k)) {
      df_buf_append(out, &chars[i], 1);
      return k;
    }
  }
  if (n < 2 || s[1] != '#') return 0;
  bool hex = n > 2 && (s[2] == 'x' || s[2] == 'X');
  size_t i = hex ? 3 : 2, first = i;
  unsigned long cp = 0;
  int d;
  while (i < n && (d = digit(s[i], hex)) >= 0) {
    cp = cp * (hex ? 16 : 10) + (unsigned long)d;
    if (cp > 0x10FFFF) cp = 0x110000; /* saturate: invalid anyway */
    i++;
  }
  if (i == first || i >= n || s[i] != ';') return 0;
  if (cp == 0 || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  put_utf8(out, cp);
  return i + 1;
}

static void ref_decode(const char *s, size_t n, df_buf *out) {
  out->len = 0;
  df_buf_append(out, "", 0);
  if (memchr(s, '<', n)) { /* markup: returned as is */
    df_buf_append(out, s, n);
    return;
  }
  for (size_t i = 0; i < n;) {
    size_t used = s[i] == '&' ? ref_entity(s + i, n - i, out) : 0;
    if (used) i += used;
    else df_buf_append(out, &s[i++], 1);
  }
}

static void scan(const char *xml, size_t len, const char *tag) {
  char open[64], close[64];
  size_t on = (size_t)snprintf(open, sizeof open, "<%s>", tag);
  size_t cn = (size_t)snprintf(close, sizeof close, "</%s>", tag);
  df_buf want = {0};
  size_t pos = 0, at = 0, count = 0;
  char *got;
  while ((got = df_xml_next(xml, len, tag, &pos))) {
    /* the element it should have found */
    const char *b = memmem(xml + at, len - at, open, on);
    if (!b) __builtin_trap();
    b += on;
    const char *e = memmem(b, len - (size_t)(b - xml), close, cn);
    if (!e) __builtin_trap();
    at = (size_t)(e - xml) + cn;
    if (pos != at) __builtin_trap();
    ref_decode(b, (size_t)(e - b), &want);
    /* a C string: a raw NUL in the text (not XML, but bytes) ends it */
    size_t gl = strlen(got);
    if (gl > (size_t)(e - b) || gl != strlen(want.data) || memcmp(got, want.data, gl))
      __builtin_trap();
    /* an entry of a listing: the fields in it, as the client reads them */
    if (!strcmp(tag, "Contents") || !strcmp(tag, "Upload")) {
      scan(got, gl, "Key");
      scan(got, gl, tag[0] == 'C' ? "Size" : "UploadId");
    }
    if (count++ == 0) {
      char *first = df_xml_first(xml, len, tag);
      if (!first || strcmp(first, got)) __builtin_trap();
      free(first);
    }
    free(got);
  }
  if (pos > len) __builtin_trap();
  /* nothing more: no complete element after `at` */
  const char *b = memmem(xml + at, len - at, open, on);
  if (b && memmem(b + on, len - (size_t)(b + on - xml), close, cn)) __builtin_trap();
  if (!count && df_xml_first(xml, len, tag)) __builtin_trap();
  df_buf_free(&want);
}

static void round_trip(const char *key, size_t n) {
  df_buf x = {0}, k = {0};
  df_buf_printf(&x, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult>"
                    "<Contents><Key>");
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)key[i];
    if (c == 0) continue; /* a key is a C string */
    df_buf_append(&k, &key[i], 1);
    switch (c) {
    case '&': df_buf_printf(&x, "&amp;"); break;
    case '<': df_buf_printf(&x, "&lt;"); break;
    case '>': df_buf_printf(&x, "&gt;"); break;
    case '"': df_buf_printf(&x, "&quot;"); break;
    case '\'': df_buf_printf(&x, "&apos;"); break;
    default:
      if (c < 0x20) df_buf_printf(&x, (c & 1) ? "&#x%X;" : "&#%u;", c);
      else df_buf_append(&x, &key[i], 1);
    }
  }
  df_buf_printf(&x, "</Key><Size>%zu</Size></Contents></ListBucketResult>", n);
  const char *want = k.data ? k.data : "";
  char *got = df_xml_first(x.data, x.len, "Key");
  if (!got || strlen(got) != k.len || memcmp(got, want, k.len)) __builtin_trap();
  free(got);
  /* as the listing reads it: the entry, then its key */
  char *entry = df_xml_first(x.data, x.len, "Contents");
  if (!entry) __builtin_trap();
  got = df_xml_first(entry, strlen(entry), "Key");
  if (!got || strlen(got) != k.len || memcmp(got, want, k.len)) __builtin_trap();
  free(got);
  free(entry);
  df_buf_free(&x);
  df_buf_free(&k);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > 1 << 16) return 0;
  const char *s = (const char *)data + 1;
  size_t n = size - 1;
  if (data[0] & 0x80) {
    round_trip(s, n);
  } else {
    scan(s, n, TAGS[data[0] % N_TAGS]);
  }
  return 0;
}
