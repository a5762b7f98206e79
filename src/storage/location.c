/* Locations: "s3://bucket/key", "file:///path" or a plain local path, and
 * the URI encoding SigV4 canonical requests need. */
#include <stdlib.h>
#include <string.h>

#include "storage_internal.h"

void df_loc_clear(df_loc *l) {
  if (!l) return;
  free(l->bucket);
  free(l->key);
  free(l->path);
  free(l->text);
  memset(l, 0, sizeof *l);
}

/* Bucket names as S3 allows them (3-63 of [a-z0-9.-], legacy upper case and
 * '_' tolerated): anything else could not be a host name label either. */
static bool bucket_valid(const char *b, size_t n) {
  if (n == 0 || n > 255) return false;
  for (size_t i = 0; i < n; i++) {
    char c = b[i];
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '-' || c == '_';
    if (!ok) return false;
  }
  return true;
}

static dflash_status parse_s3(const char *location, df_loc *out) {
  const char *b = location + 5;
  const char *slash = strchr(b, '/');
  size_t blen = slash ? (size_t)(slash - b) : strlen(b);
  if (!bucket_valid(b, blen))
    return df_error(DFLASH_E_INVALID_ARG,
                    "%s: not a valid s3 URL (expected s3://bucket/key, bucket of [a-z0-9.-])",
                    location);
  out->s3 = true;
  out->bucket = df_strndup(b, blen);
  out->key = df_strdup(slash ? slash + 1 : "");
  return out->bucket && out->key ? DFLASH_OK : df_error_nomem("s3 location");
}

dflash_status df_loc_parse(const char *location, df_loc *out) {
  memset(out, 0, sizeof *out);
  if (!location || !*location) return df_error(DFLASH_E_INVALID_ARG, "empty location");
  out->text = df_strdup(location);
  if (!out->text) return df_error_nomem("location");
  dflash_status st;
  if (!strncmp(location, "s3://", 5)) {
    st = parse_s3(location, out);
  } else if (!strncmp(location, "file://", 7)) {
    out->path = df_strdup(location + 7);
    st = out->path ? DFLASH_OK : df_error_nomem("location");
    if (!st && !*out->path) st = df_error(DFLASH_E_INVALID_ARG, "%s: empty path", location);
  } else if (strstr(location, "://")) {
    st = df_error(DFLASH_E_UNSUPPORTED, "%s: unsupported scheme (use s3:// or a local path)",
                  location);
  } else {
    out->path = df_strdup(location);
    st = out->path ? DFLASH_OK : df_error_nomem("location");
  }
  if (st) df_loc_clear(out);
  return st;
}

dflash_status df_loc_parse_object(const char *location, df_loc *out) {
  dflash_status st = df_loc_parse(location, out);
  if (st) return st;
  const char *name = out->s3 ? out->key : out->path;
  if (!*name || name[strlen(name) - 1] == '/') {
    st = df_error(DFLASH_E_INVALID_ARG, "%s: names a folder or bucket, not an object", location);
    df_loc_clear(out);
  }
  return st;
}

static bool unreserved(unsigned char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_' || c == '.' || c == '~';
}

dflash_status df_uri_encode(df_buf *out, const char *s, size_t n, bool keep_slash) {
  static const char hex[] = "0123456789ABCDEF";
  dflash_status st = df_buf_reserve(out, n * 3 + 1);
  if (st) return st;
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (unreserved(c) || (keep_slash && c == '/')) {
      out->data[out->len++] = (char)c;
    } else {
      out->data[out->len++] = '%';
      out->data[out->len++] = hex[c >> 4];
      out->data[out->len++] = hex[c & 15];
    }
  }
  out->data[out->len] = 0;
  return DFLASH_OK;
}
