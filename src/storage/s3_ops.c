/* S3 operations over df_s3_request: GET (whole and ranged), HEAD, PUT,
 * DELETE, ListObjectsV2 and multipart uploads. Query strings are written here
 * already canonical (sorted names, encoded values), as libcurl signs them
 * verbatim. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "storage_internal.h"

dflash_status df_s3_get_all(dflash_storage *st, const df_loc *l, df_buf *out) {
  df_s3_req req = {.method = "GET", .loc = l};
  df_s3_resp resp = {0};
  dflash_status s = df_s3_request(st, &req, &resp);
  if (s) {
    df_s3_resp_free(&resp);
    return s;
  }
  if (resp.has_length && resp.content_length != resp.body.len) {
    df_s3_resp_free(&resp);
    return df_error(DFLASH_E_TRUNCATED, "%s: got %zu of %llu bytes", l->text, resp.body.len,
                    (unsigned long long)resp.content_length);
  }
  *out = resp.body;
  /* Room for the NUL only (reserve(n) keeps n bytes and a NUL free): the body was allocated
   * at its size plus that byte; asking for more would double a whole object's buffer. */
  return df_buf_reserve(out, 0) ? DFLASH_E_NOMEM : (out->data[out->len] = 0, DFLASH_OK);
}

dflash_status df_s3_get_range(dflash_storage *st, const df_loc *l, uint64_t offset, void *buf,
                              size_t len, size_t *got) {
  *got = 0;
  if (len == 0) return DFLASH_OK;
  char range[64];
  snprintf(range, sizeof range, "bytes=%llu-%llu", (unsigned long long)offset,
           (unsigned long long)(offset + len - 1));
  df_s3_req req = {
      .method = "GET", .loc = l, .range = range, .buf = buf, .buf_cap = len, .buf_skip = offset};
  df_s3_resp resp = {0};
  dflash_status s = df_s3_request(st, &req, &resp);
  df_s3_resp_free(&resp);
  if (s == DFLASH_E_RANGE) { /* 416: the offset is at or past the end */
    dflash_clear_error();
    return DFLASH_OK;
  }
  if (s) return s;
  *got = resp.got;
  return DFLASH_OK;
}

dflash_status df_s3_head(dflash_storage *st, const df_loc *l, dflash_storage_info *out) {
  df_s3_req req = {.method = "HEAD", .loc = l};
  df_s3_resp resp = {0};
  dflash_status s = df_s3_request(st, &req, &resp);
  df_s3_resp_free(&resp);
  if (s) return s;
  out->size = resp.content_length;
  out->mtime = resp.mtime;
  return DFLASH_OK;
}

static dflash_status put_single(dflash_storage *st, const df_loc *l, const void *data, size_t n) {
  df_s3_req req = {.method = "PUT", .loc = l, .body = data ? data : "", .body_len = n};
  df_s3_resp resp = {0};
  dflash_status s = df_s3_request(st, &req, &resp);
  df_s3_resp_free(&resp);
  return s;
}

static dflash_status put_multipart(dflash_storage *st, const df_loc *l, const char *data,
                                   size_t n) {
  df_s3_upload u = {0};
  dflash_status s = df_s3_mpu_create(st, l, &u);
  for (size_t off = 0; !s && off < n; off += st->cfg.part_size) {
    size_t k = n - off < st->cfg.part_size ? n - off : (size_t)st->cfg.part_size;
    s = df_s3_mpu_part(st, l, &u, data + off, k);
  }
  if (!s) s = df_s3_mpu_complete(st, l, &u);
  if (s) df_s3_mpu_abort(st, l, &u);
  df_s3_upload_clear(&u);
  return s;
}

dflash_status df_s3_put(dflash_storage *st, const df_loc *l, const void *data, size_t n) {
  if (n >= st->cfg.multipart_threshold && n > st->cfg.part_size)
    return put_multipart(st, l, data, n);
  return put_single(st, l, data, n);
}

dflash_status df_s3_delete(dflash_storage *st, const df_loc *l) {
  df_s3_req req = {.method = "DELETE", .loc = l};
  df_s3_resp resp = {0};
  dflash_status s = df_s3_request(st, &req, &resp);
  df_s3_resp_free(&resp);
  return s;
}

/* ---- listing ------------------------------------------------------------- */

static dflash_status list_query(const char *token, const char *prefix, uint32_t page, df_buf *q) {
  dflash_status s = DFLASH_OK;
  if (token) {
    s = df_buf_printf(q, "continuation-token=");
    if (!s) s = df_uri_encode(q, token, strlen(token), false);
    if (!s) s = df_buf_printf(q, "&");
  }
  if (!s) s = df_buf_printf(q, "list-type=2&");
  if (!s && page) s = df_buf_printf(q, "max-keys=%u&", page);
  if (!s) s = df_buf_printf(q, "prefix=");
  if (!s) s = df_uri_encode(q, prefix, strlen(prefix), false);
  return s;
}

/* Add the <Contents> of one ListObjectsV2 page to `out`. */
static dflash_status list_page(const df_loc *p, const df_buf *xml, dflash_storage_listing *out) {
  size_t pos = 0;
  char *item;
  while ((item = df_xml_next(xml->data, xml->len, "Contents", &pos))) {
    char *key = df_xml_first(item, strlen(item), "Key");
    char *size = df_xml_first(item, strlen(item), "Size");
    dflash_status s = key ? df_listing_add(out, df_asprintf("s3://%s/%s", p->bucket, key),
                                           size ? strtoull(size, NULL, 10) : 0)
                          : df_error(DFLASH_E_FORMAT, "%s: listing entry without <Key>", p->text);
    free(key);
    free(size);
    free(item);
    if (s) return s;
  }
  return DFLASH_OK;
}

dflash_status df_s3_list(dflash_storage *st, const df_loc *p, dflash_storage_listing *out) {
  df_loc bucket = {.s3 = true, .bucket = p->bucket, .key = "", .text = p->text};
  char *token = NULL;
  dflash_status s;
  do {
    df_buf q = {0};
    df_s3_resp resp = {0};
    s = list_query(token, p->key, st->list_page_size, &q);
    df_s3_req req = {.method = "GET", .loc = &bucket, .query = q.data};
    if (!s) s = df_s3_request(st, &req, &resp);
    if (!s) s = list_page(p, &resp.body, out);
    free(token);
    token = NULL;
    char *truncated = s ? NULL : df_xml_first(resp.body.data, resp.body.len, "IsTruncated");
    if (truncated && !strcmp(truncated, "true")) {
      token = df_xml_first(resp.body.data, resp.body.len, "NextContinuationToken");
      if (!token)
        s = df_error(DFLASH_E_FORMAT, "%s: truncated listing without a continuation token",
                     p->text);
    }
    free(truncated);
    df_buf_free(&q);
    df_s3_resp_free(&resp);
  } while (!s && token);
  free(token);
  return s;
}

/* ---- multipart uploads --------------------------------------------------- */

void df_s3_upload_clear(df_s3_upload *u) {
  for (size_t i = 0; i < u->n_parts; i++) free(u->etags[i]);
  free(u->etags);
  free(u->upload_id);
  memset(u, 0, sizeof *u);
}

static dflash_status upload_query(const df_s3_upload *u, size_t part, df_buf *q) {
  dflash_status s = part ? df_buf_printf(q, "partNumber=%zu&", part) : DFLASH_OK;
  if (!s) s = df_buf_printf(q, "uploadId=");
  if (!s) s = df_uri_encode(q, u->upload_id, strlen(u->upload_id), false);
  return s;
}

dflash_status df_s3_mpu_create(dflash_storage *st, const df_loc *l, df_s3_upload *u) {
  memset(u, 0, sizeof *u);
  df_s3_req req = {.method = "POST", .loc = l, .query = "uploads="};
  df_s3_resp resp = {0};
  dflash_status s = df_s3_request(st, &req, &resp);
  if (!s) {
    u->upload_id = df_xml_first(resp.body.data, resp.body.len, "UploadId");
    if (!u->upload_id || !*u->upload_id)
      s = df_error(DFLASH_E_FORMAT, "%s: CreateMultipartUpload answer has no UploadId", l->text);
  }
  df_s3_resp_free(&resp);
  return s;
}

dflash_status df_s3_mpu_part(dflash_storage *st, const df_loc *l, df_s3_upload *u, const void *data,
                             size_t n) {
  if (u->n_parts == u->cap) {
    size_t cap = u->cap ? u->cap * 2 : 16;
    char **e = realloc(u->etags, cap * sizeof *e);
    if (!e) return df_error_nomem("part list");
    u->etags = e;
    u->cap = cap;
  }
  if (u->n_parts >= 10000)
    return df_error(DFLASH_E_RANGE, "%s: more than 10000 parts; raise part_size", l->text);
  df_buf q = {0};
  df_s3_resp resp = {0};
  dflash_status s = upload_query(u, u->n_parts + 1, &q);
  df_s3_req req = {.method = "PUT", .loc = l, .query = q.data, .body = data, .body_len = n};
  if (!s) s = df_s3_request(st, &req, &resp);
  if (!s && !resp.etag[0])
    s = df_error(DFLASH_E_FORMAT, "%s: part %zu: answer has no ETag", l->text, u->n_parts + 1);
  if (!s) {
    u->etags[u->n_parts] = df_strdup(resp.etag);
    if (u->etags[u->n_parts]) {
      u->n_parts++;
      u->total += n;
    } else {
      s = df_error_nomem("ETag");
    }
  }
  df_buf_free(&q);
  df_s3_resp_free(&resp);
  return s;
}

static dflash_status complete_body(const df_s3_upload *u, df_buf *b) {
  dflash_status s = df_buf_printf(b, "<CompleteMultipartUpload>");
  for (size_t i = 0; !s && i < u->n_parts; i++) {
    const char *e = u->etags[i];
    s = df_buf_printf(b, "<Part><PartNumber>%zu</PartNumber><ETag>", i + 1);
    for (; !s && *e; e++) s = *e == '"' ? df_buf_printf(b, "&quot;") : df_buf_append(b, e, 1);
    if (!s) s = df_buf_printf(b, "</ETag></Part>");
  }
  if (!s) s = df_buf_printf(b, "</CompleteMultipartUpload>");
  return s;
}

/* A CompleteMultipartUpload whose first answer was lost and that was retried
 * finds the upload gone (NoSuchUpload): it succeeded if the object is there
 * with the right size. */
static dflash_status completed_anyway(dflash_storage *st, const df_loc *l, const df_s3_upload *u) {
  dflash_storage_info info = {.struct_size = sizeof info};
  if (df_s3_head(st, l, &info) || info.size != u->total)
    return df_error(DFLASH_E_STATE, "%s: multipart upload vanished before completion", l->text);
  dflash_clear_error();
  return DFLASH_OK;
}

/* S3 may answer 200 and still report an error in the body (it had started
 * sending whitespace before it failed). */
static bool body_reports_error(const df_s3_resp *resp) {
  const char *b = resp->body.data ? resp->body.data : "";
  return !memmem(b, resp->body.len, "<CompleteMultipartUploadResult", 30) &&
         memmem(b, resp->body.len, "<Error>", 7);
}

dflash_status df_s3_mpu_complete(dflash_storage *st, const df_loc *l, df_s3_upload *u) {
  df_buf body = {0}, q = {0};
  dflash_status s = complete_body(u, &body);
  if (!s) s = upload_query(u, 0, &q);
  df_s3_req req = {.method = "POST",
                   .loc = l,
                   .query = q.data,
                   .body = body.data,
                   .body_len = body.len,
                   .content_type = "application/xml"};
  for (uint32_t tries = 1; !s; tries++) {
    df_s3_resp resp = {0};
    s = df_s3_request(st, &req, &resp);
    if (s == DFLASH_E_NOT_FOUND && strstr(dflash_last_error(), "NoSuchUpload"))
      s = completed_anyway(st, l, u);
    bool again = false;
    if (!s && body_reports_error(&resp)) {
      char *code = df_xml_first(resp.body.data, resp.body.len, "Code");
      again = tries < st->cfg.max_attempts;
      if (!again)
        s = df_error(DFLASH_E_HTTP, "%s: CompleteMultipartUpload: %s", l->text,
                     code ? code : "error");
      else
        df_log(DFLASH_LOG_INFO, "%s: CompleteMultipartUpload: %s in a 200 answer; retrying",
               l->text, code ? code : "error");
      free(code);
    }
    df_s3_resp_free(&resp);
    if (!again) break;
  }
  df_buf_free(&body);
  df_buf_free(&q);
  return s;
}

void df_s3_mpu_abort(dflash_storage *st, const df_loc *l, df_s3_upload *u) {
  if (!u->upload_id) return;
  char *saved = df_strdup(dflash_last_error());
  df_buf q = {0};
  df_s3_resp resp = {0};
  df_s3_req req = {.method = "DELETE", .loc = l};
  if (!upload_query(u, 0, &q)) {
    req.query = q.data;
    if (df_s3_request(st, &req, &resp))
      df_log(DFLASH_LOG_WARN, "abandoned multipart upload: %s", dflash_last_error());
  }
  df_buf_free(&q);
  df_s3_resp_free(&resp);
  if (saved) df_error(DFLASH_E_INTERNAL, "%s", saved); /* restores the text, not the status */
  free(saved);
  df_s3_upload_clear(u);
}
