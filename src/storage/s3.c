/* The S3 request engine: builds the URL for path-style or virtual-hosted
 * addressing, lets libcurl sign with SigV4 (CURLOPT_AWS_SIGV4), retries
 * transient failures with full-jitter backoff, and maps S3 error answers to
 * dflash_status with a message that names the URL (never the secret).
 *
 * libcurl 7.88 notes (lib/http_aws_sigv4.c): it signs the path and query
 * exactly as given (no sorting, no re-encoding), so callers pass them
 * canonical; it takes the payload hash from an x-amz-content-sha256 header
 * when one is set (and would otherwise hash CURLOPT_POSTFIELDS, i.e. the empty
 * string for uploads), and it adds no such header itself, which S3 requires.
 * We therefore always send x-amz-content-sha256 with the real SHA-256 of the
 * body. Every header we set is signed, so only headers with a value are set. */
#include <curl/curl.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "storage_internal.h"

#define DF_S3_ERROR_BODY_CAP (64 * 1024)

/* ---- redaction ----------------------------------------------------------- */

static void redact_one(char *text, const char *secret) {
  if (!secret || strlen(secret) < 4) return;
  size_t n = strlen(secret);
  char *p;
  while ((p = strstr(text, secret))) {
    memcpy(p, "***", 3);
    memmove(p + 3, p + n, strlen(p + n) + 1);
  }
}

void df_storage_redact(const dflash_storage *st, char *text) {
  if (!st || !text) return;
  redact_one(text, st->cfg.secret);
  redact_one(text, st->cfg.token);
}

/* ---- curl setup ---------------------------------------------------------- */

static CURLcode g_curl_init = CURLE_OK;
static void curl_init_once(void) { g_curl_init = curl_global_init(CURL_GLOBAL_DEFAULT); }

static dflash_status curl_handle(dflash_storage *st, CURL **out) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, curl_init_once);
  if (g_curl_init != CURLE_OK) return df_error(DFLASH_E_NETWORK, "curl_global_init failed");
  if (!st->curl) st->curl = curl_easy_init();
  if (!st->curl) return df_error(DFLASH_E_NOMEM, "curl_easy_init failed");
  curl_easy_reset(st->curl);
  *out = st->curl;
  return DFLASH_OK;
}

void df_curl_cleanup(void *curl) {
  if (curl) curl_easy_cleanup(curl);
}

/* The request URL. Path-style: ENDPOINT/bucket/key; virtual-hosted:
 * SCHEME://bucket.HOST/key. The key is URI-encoded with '/' kept, which is
 * also its SigV4 canonical form (S3 does not double-encode). */
static dflash_status build_url(const dflash_storage *st, const df_s3_req *req, df_buf *url) {
  const char *ep = st->cfg.endpoint;
  const char *hostpart = strstr(ep, "://");
  hostpart = hostpart ? hostpart + 3 : ep;
  bool virt = st->cfg.addressing == DFLASH_S3_ADDRESSING_VIRTUAL && !strchr(req->loc->bucket, '.');
  dflash_status s;
  if (virt)
    s = df_buf_printf(url, "%.*s%s.%s/", (int)(hostpart - ep), ep, req->loc->bucket, hostpart);
  else s = df_buf_printf(url, "%s/%s%s", ep, req->loc->bucket, *req->loc->key ? "/" : "");
  if (!s) s = df_uri_encode(url, req->loc->key, strlen(req->loc->key), true);
  if (!s && req->query) s = df_buf_printf(url, "?%s", req->query);
  return s;
}

typedef struct xfer {
  dflash_storage *st;
  const df_s3_req *req;
  df_s3_resp *resp;
  size_t upload_pos;
  uint64_t skipped;
} xfer;

/* Receive-path sizes (bench/s3_read.py measures the client's CPU per GB). */
#define DF_S3_RECV_BUFFER (512L << 10)
#define DF_S3_PREALLOC_MAX ((uint64_t)4 << 30)

static size_t on_read(char *dst, size_t size, size_t nitems, void *user) {
  xfer *x = user;
  size_t left = x->req->body_len - x->upload_pos;
  size_t n = size * nitems < left ? size * nitems : left;
  if (n) memcpy(dst, (const char *)x->req->body + x->upload_pos, n);
  x->upload_pos += n;
  return n;
}

static int on_seek(void *user, curl_off_t offset, int origin) {
  xfer *x = user;
  if (origin != SEEK_SET || offset < 0 || (uint64_t)offset > x->req->body_len)
    return CURL_SEEKFUNC_CANTSEEK;
  x->upload_pos = (size_t)offset;
  return CURL_SEEKFUNC_OK;
}

/* The body of a whole object, allocated once at its announced size (in huge pages when large:
 * one fault per 2 MiB). */
static bool prealloc_body(df_buf *b, size_t n) {
  char *p = df_alloc_large(n + 1); /* df_buf keeps a NUL after the data */
  if (!p) return false;
  b->data = p;
  b->cap = n + 1;
  b->len = 0;
  return true;
}

/* 2xx bodies go to the caller's buffer (ranged reads) or resp->body; error
 * bodies go to resp->body, capped. A server that ignores Range answers 200
 * with the whole object: skip to the wanted offset then. */
static size_t on_write(char *data, size_t size, size_t nitems, void *user) {
  xfer *x = user;
  size_t n = size * nitems;
  long code = 0;
  curl_easy_getinfo(x->st->curl, CURLINFO_RESPONSE_CODE, &code);
  bool ok = code >= 200 && code < 300;
  if (ok && x->req->buf) {
    size_t off = 0;
    if (code == 200 && x->skipped < x->req->buf_skip) {
      uint64_t want = x->req->buf_skip - x->skipped;
      off = want < n ? (size_t)want : n;
      x->skipped += off;
    }
    size_t room = x->req->buf_cap - x->resp->got;
    size_t take = n - off < room ? n - off : room;
    memcpy((char *)x->req->buf + x->resp->got, data + off, take);
    x->resp->got += take;
    return n;
  }
  if (!ok && x->resp->body.len >= DF_S3_ERROR_BODY_CAP) return n;
  /* A whole object: one allocation of its announced size, not a doubling series of copies. */
  if (ok && x->resp->has_length && !x->resp->body.data &&
      x->resp->content_length <= DF_S3_PREALLOC_MAX &&
      !prealloc_body(&x->resp->body, (size_t)x->resp->content_length))
    return 0;
  return df_buf_append(&x->resp->body, data, n) == DFLASH_OK ? n : 0;
}

static bool header_is(const char *line, size_t n, const char *name, const char **value) {
  size_t k = strlen(name);
  if (n <= k || strncasecmp(line, name, k) || line[k] != ':') return false;
  const char *v = line + k + 1;
  while (*v == ' ' || *v == '\t') v++;
  *value = v;
  return true;
}

/* Copy a header value without its CRLF. */
static void copy_value(char *dst, size_t cap, const char *v, const char *end) {
  size_t n = (size_t)(end - v);
  while (n && (v[n - 1] == '\r' || v[n - 1] == '\n' || v[n - 1] == ' ')) n--;
  if (n >= cap) n = cap - 1;
  memcpy(dst, v, n);
  dst[n] = 0;
}

static size_t on_header(char *line, size_t size, size_t nitems, void *user) {
  xfer *x = user;
  df_s3_resp *r = x->resp;
  size_t n = size * nitems;
  const char *end = line + n, *v;
  char tmp[256];
  if (n >= 5 && !strncmp(line, "HTTP/", 5)) { /* a new response (after 100 Continue) */
    r->has_length = r->has_total = false;
    r->retry_after = -1;
    r->etag[0] = r->region[0] = 0;
  } else if (header_is(line, n, "etag", &v)) {
    copy_value(r->etag, sizeof r->etag, v, end);
  } else if (header_is(line, n, "content-length", &v)) {
    r->content_length = strtoull(v, NULL, 10);
    r->has_length = true;
  } else if (header_is(line, n, "content-range", &v)) {
    const char *slash = memchr(v, '/', (size_t)(end - v));
    if (slash && slash[1] != '*') {
      r->total_size = strtoull(slash + 1, NULL, 10);
      r->has_total = true;
    }
  } else if (header_is(line, n, "retry-after", &v)) {
    copy_value(tmp, sizeof tmp, v, end);
    double secs = df_parse_retry_after(tmp, false);
    if (secs >= 0) r->retry_after = secs;
  } else if (header_is(line, n, "x-amz-bucket-region", &v)) {
    copy_value(r->region, sizeof r->region, v, end);
  } else if (header_is(line, n, "last-modified", &v)) {
    copy_value(tmp, sizeof tmp, v, end);
    time_t t = curl_getdate(tmp, NULL);
    if (t > 0) r->mtime = (int64_t)t;
  }
  return n;
}

/* Replace what follows `marker` up to the end of its line (or the first
 * character outside `keep_set` when given) with "***". */
static void mask_after(char *text, const char *marker, const char *stop_set) {
  char *p = strcasestr(text, marker);
  if (!p) return;
  p += strlen(marker);
  while (*p == ' ') p++;
  size_t n = strcspn(p, stop_set);
  if (n < 3) return;
  memcpy(p, "***", 3);
  memmove(p + 3, p + n, strlen(p + n) + 1);
}

/* DFLASH_S3_TRACE: requests and headers to the log, at DEBUG, redacted.
 * The Authorization header carries only the key id and an HMAC (the secret
 * itself is never sent); the signature is masked anyway, as is the session
 * token, and any stray copy of either secret. */
static int on_debug(CURL *h, curl_infotype type, char *data, size_t n, void *user) {
  (void)h;
  xfer *x = user;
  const char *what = type == CURLINFO_TEXT         ? "*"
                     : type == CURLINFO_HEADER_IN  ? "<"
                     : type == CURLINFO_HEADER_OUT ? ">"
                                                   : NULL;
  if (!what) return 0; /* bodies are not logged */
  char *text = df_strndup(data, n);
  if (!text) return 0;
  mask_after(text, "Signature=", ", \r\n");
  mask_after(text, "x-amz-security-token:", "\r\n");
  df_storage_redact(x->st, text);
  df_log(DFLASH_LOG_DEBUG, "s3 %s %s", what, text);
  free(text);
  return 0;
}

static dflash_status add_header(struct curl_slist **list, const char *fmt, const char *value) {
  char *h = df_asprintf(fmt, value);
  struct curl_slist *next = h ? curl_slist_append(*list, h) : NULL;
  free(h);
  if (!next) return df_error_nomem("HTTP header");
  *list = next;
  return DFLASH_OK;
}

static dflash_status build_headers(const dflash_storage *st, const df_s3_req *req,
                                   struct curl_slist **list) {
  char hash[65];
  df_sha256_hex(req->body ? req->body : "", req->body ? req->body_len : 0, hash);
  dflash_status s = add_header(list, "x-amz-content-sha256: %s", hash);
  if (!s && st->cfg.token && *st->cfg.token)
    s = add_header(list, "x-amz-security-token: %s", st->cfg.token);
  if (!s && req->range) s = add_header(list, "Range: %s", req->range);
  if (!s && req->content_type) s = add_header(list, "Content-Type: %s", req->content_type);
  return s;
}

static void set_method(CURL *c, const df_s3_req *req, xfer *x) {
  const char *m = req->method;
  if (!strcmp(m, "HEAD")) {
    curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
  } else if (!strcmp(m, "PUT")) {
    curl_easy_setopt(c, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(c, CURLOPT_READFUNCTION, on_read);
    curl_easy_setopt(c, CURLOPT_READDATA, x);
    curl_easy_setopt(c, CURLOPT_SEEKFUNCTION, on_seek);
    curl_easy_setopt(c, CURLOPT_SEEKDATA, x);
    curl_easy_setopt(c, CURLOPT_INFILESIZE_LARGE, (curl_off_t)req->body_len);
  } else if (!strcmp(m, "POST")) {
    curl_easy_setopt(c, CURLOPT_POST, 1L);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, req->body ? (const char *)req->body : "");
    curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)req->body_len);
  } else if (strcmp(m, "GET")) {
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, m);
  }
}

/* One attempt. Returns the curl result; HTTP status in resp->status. */
static CURLcode perform_once(dflash_storage *st, CURL *c, const char *url,
                             struct curl_slist *headers, xfer *x, char *errbuf) {
  const df_s3_config *cfg = &st->cfg;
  char sigv4[160];
  snprintf(sigv4, sizeof sigv4, "aws:amz:%s:s3", cfg->region);
  curl_easy_setopt(c, CURLOPT_URL, url);
  curl_easy_setopt(c, CURLOPT_PATH_AS_IS, 1L); /* keys may hold "./" or "//" */
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(c, CURLOPT_AWS_SIGV4, sigv4);
  curl_easy_setopt(c, CURLOPT_USERNAME, cfg->key_id);
  curl_easy_setopt(c, CURLOPT_PASSWORD, cfg->secret);
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  /* Bodies arrive in pieces of this size: 16 KiB by default, a read() and a callback each. */
  curl_easy_setopt(c, CURLOPT_BUFFERSIZE, DF_S3_RECV_BUFFER);
  /* Objects are bytes as stored: no Accept-Encoding, no decoding (libcurl's defaults, said
   * here because a decoder would cost CPU per byte and change what a range means). Small
   * requests (HEAD, the consumed marker) go out without Nagle's delay. */
  curl_easy_setopt(c, CURLOPT_ACCEPT_ENCODING, NULL);
  curl_easy_setopt(c, CURLOPT_HTTP_CONTENT_DECODING, 0L);
  curl_easy_setopt(c, CURLOPT_TCP_NODELAY, 1L);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_write);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, x);
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, x);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, errbuf);
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, (long)cfg->connect_timeout_ms);
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
  curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, (long)((cfg->idle_timeout_ms + 999) / 1000));
  if (cfg->request_timeout_ms)
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, (long)cfg->request_timeout_ms);
  if (cfg->trace) {
    curl_easy_setopt(c, CURLOPT_DEBUGFUNCTION, on_debug);
    curl_easy_setopt(c, CURLOPT_DEBUGDATA, x);
    curl_easy_setopt(c, CURLOPT_VERBOSE, 1L);
  }
  set_method(c, x->req, x);
  CURLcode rc = curl_easy_perform(c);
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &x->resp->status);
  return rc;
}

static bool curl_transient(CURLcode rc) {
  switch (rc) {
  case CURLE_COULDNT_RESOLVE_HOST:
  case CURLE_COULDNT_CONNECT:
  case CURLE_OPERATION_TIMEDOUT:
  case CURLE_SEND_ERROR:
  case CURLE_RECV_ERROR:
  case CURLE_GOT_NOTHING:
  case CURLE_PARTIAL_FILE:
  case CURLE_SSL_CONNECT_ERROR:
  case CURLE_HTTP2:
  case CURLE_HTTP2_STREAM: return true;
  default: return false;
  }
}

static bool code_is(const char *code, const char *const *names, size_t n) {
  for (size_t i = 0; code && i < n; i++)
    if (!strcmp(code, names[i])) return true;
  return false;
}

static bool http_transient(long status, const char *code) {
  /* The last three: the body arrived damaged or short; sending it again helps. */
  static const char *const codes[] = {"SlowDown",
                                      "InternalError",
                                      "RequestTimeout",
                                      "ServiceUnavailable",
                                      "XAmzContentSHA256Mismatch",
                                      "BadDigest",
                                      "IncompleteBody"};
  return status >= 500 || status == 429 || code_is(code, codes, DF_ARRAY_LEN(codes));
}

static dflash_status status_for(long status, const char *code) {
  static const char *const auth[] = {"InvalidAccessKeyId", "SignatureDoesNotMatch",
                                     "AccessDenied",       "ExpiredToken",
                                     "InvalidToken",       "TokenRefreshRequired",
                                     "AllAccessDisabled",  "InvalidSecurity",
                                     "AccountProblem"};
  static const char *const missing[] = {"NoSuchKey", "NoSuchBucket", "NoSuchUpload"};
  if (code_is(code, auth, DF_ARRAY_LEN(auth)) || status == 401 || status == 403)
    return DFLASH_E_AUTH;
  if (code_is(code, missing, DF_ARRAY_LEN(missing)) || status == 404) return DFLASH_E_NOT_FOUND;
  if (status == 301 || status == 307 || (code && !strcmp(code, "AuthorizationHeaderMalformed")))
    return DFLASH_E_CONFIG;
  if (status == 416) return DFLASH_E_RANGE;
  return DFLASH_E_HTTP;
}

/* "s3://b/k: GET: HTTP 404 NoSuchKey: The specified key does not exist." */
static dflash_status http_error(dflash_storage *st, const df_s3_req *req, const df_s3_resp *resp,
                                uint32_t attempts) {
  char *code = df_xml_first(resp->body.data, resp->body.len, "Code");
  char *msg = df_xml_first(resp->body.data, resp->body.len, "Message");
  dflash_status status = status_for(resp->status, code);
  char hint[200] = "";
  if (status == DFLASH_E_CONFIG && resp->region[0])
    snprintf(hint, sizeof hint, " (the bucket is in region %s; set AWS_REGION=%s)", resp->region,
             resp->region);
  else if (status == DFLASH_E_NOT_FOUND && !code)
    snprintf(hint, sizeof hint, " (no such bucket or key)");
  char *text = df_asprintf("%s: %s: HTTP %ld%s%s%s%s%s", req->loc->text, req->method, resp->status,
                           code ? " " : "", code ? code : "", msg ? ": " : "", msg ? msg : "",
                           hint);
  free(code);
  free(msg);
  if (!text) return df_error_nomem("S3 error message");
  df_storage_redact(st, text);
  if (attempts > 1) df_error(status, "%s (after %u attempts)", text, attempts);
  else df_error(status, "%s", text);
  free(text);
  return status;
}

double df_s3_backoff(dflash_storage *st, uint32_t attempt, double retry_after) {
  double cap = st->cfg.backoff_max_ms / 1000.0;
  return df_backoff_s(&st->rng, attempt, st->cfg.backoff_base_ms / 1000.0, cap, retry_after, cap);
}

static void sleep_seconds(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

void df_s3_resp_free(df_s3_resp *resp) { df_buf_free(&resp->body); }

static void resp_reset(df_s3_resp *resp) {
  df_buf body = resp->body;
  body.len = 0;
  memset(resp, 0, sizeof *resp);
  resp->body = body;
  resp->retry_after = -1;
}

static dflash_status check_config(const dflash_storage *st, const df_s3_req *req) {
  const df_s3_config *c = &st->cfg;
  if (!c->key_id || !*c->key_id || !c->secret || !*c->secret)
    return df_error(DFLASH_E_AUTH,
                    "%s: no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                    "or a profile in ~/.aws/credentials (AWS_PROFILE)%s%s",
                    req->loc->text, c->cred_note ? "; " : "", c->cred_note ? c->cred_note : "");
  if (strchr(c->key_id, ':'))
    return df_error(DFLASH_E_AUTH, "%s: AWS_ACCESS_KEY_ID contains ':'", req->loc->text);
  return DFLASH_OK;
}

/* Why an attempt failed, in words, for the log and the final message. */
static void describe(const df_s3_resp *resp, CURLcode rc, const char *errbuf, char *out,
                     size_t cap) {
  if (rc != CURLE_OK) snprintf(out, cap, "%s", errbuf[0] ? errbuf : curl_easy_strerror(rc));
  else snprintf(out, cap, "HTTP %ld", resp->status);
}

dflash_status df_s3_request(dflash_storage *st, const df_s3_req *req, df_s3_resp *resp) {
  resp_reset(resp);
  dflash_status s = check_config(st, req);
  if (s) return s;
  CURL *c = NULL;
  if ((s = curl_handle(st, &c))) return s;
  df_buf url = {0};
  struct curl_slist *headers = NULL;
  if ((s = build_url(st, req, &url)) || (s = build_headers(st, req, &headers))) {
    df_buf_free(&url);
    curl_slist_free_all(headers);
    return s;
  }
  char errbuf[CURL_ERROR_SIZE];
  uint32_t attempt = 0;
  for (;;) {
    attempt++;
    resp_reset(resp);
    errbuf[0] = 0;
    xfer x = {.st = st, .req = req, .resp = resp};
    st->n_requests++;
    CURLcode rc = perform_once(st, c, url.data, headers, &x, errbuf);
    if (rc == CURLE_OK && resp->status >= 200 && resp->status < 300) {
      s = DFLASH_OK;
      break;
    }
    char *code = rc == CURLE_OK ? df_xml_first(resp->body.data, resp->body.len, "Code") : NULL;
    bool retry = rc != CURLE_OK ? curl_transient(rc) : http_transient(resp->status, code);
    free(code);
    char why[CURL_ERROR_SIZE + 32];
    describe(resp, rc, errbuf, why, sizeof why);
    df_storage_redact(st, why);
    if (!retry || attempt >= st->cfg.max_attempts) {
      if (rc == CURLE_OK) s = http_error(st, req, resp, attempt);
      else
        s = df_error(rc == CURLE_OPERATION_TIMEDOUT ? DFLASH_E_TIMEOUT : DFLASH_E_NETWORK,
                     "%s: %s: %s (after %u attempt%s)", req->loc->text, req->method, why, attempt,
                     attempt == 1 ? "" : "s");
      break;
    }
    double wait = df_s3_backoff(st, attempt, resp->retry_after);
    df_log(DFLASH_LOG_INFO, "%s: %s: %s; retry %u of %u in %.3f s", req->loc->text, req->method,
           why, attempt, st->cfg.max_attempts - 1, wait);
    st->n_retries++;
    sleep_seconds(wait);
  }
  df_buf_free(&url);
  curl_slist_free_all(headers);
  return s;
}
