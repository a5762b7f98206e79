/* Internals of the storage module: locations, the S3 client, the local
 * backend and the small helpers (URI encoding, XML fields) they use. */
#ifndef DFLASH_STORAGE_INTERNAL_H
#define DFLASH_STORAGE_INTERNAL_H

#include <dflash/storage.h>

#include "core/internal.h"

/* ---- locations (location.c) ---------------------------------------------- */

/* A parsed location: either an S3 bucket + key, or a local path. */
typedef struct df_loc {
  bool s3;
  char *bucket; /* s3 only */
  char *key;    /* s3 only; may be "" (bucket root) */
  char *path;   /* local only */
  char *text;   /* the location as the user spelled it, for messages */
} df_loc;

/* Parse "s3://bucket/key", "file:///path" or a plain path. Other schemes are
 * DFLASH_E_UNSUPPORTED; a malformed s3 URL is DFLASH_E_INVALID_ARG. */
DF_MUST_CHECK dflash_status df_loc_parse(const char *location, df_loc *out);
/* Same, and the key or path must be non-empty and not end with '/'. */
DF_MUST_CHECK dflash_status df_loc_parse_object(const char *location, df_loc *out);
void df_loc_clear(df_loc *l);

/* Append `n` bytes of `s` to `out` URI-encoded as SigV4 wants it: RFC 3986
 * unreserved characters stay, every other byte becomes %XX (upper-case
 * hex); '/' stays when `keep_slash`. */
DF_MUST_CHECK dflash_status df_uri_encode(df_buf *out, const char *s, size_t n, bool keep_slash);


/* ---- XML fields (xml.c) -------------------------------------------------- */

/* Find the next <tag>text</tag> in xml[*pos, len) and return the text with
 * entities decoded (malloc'd), advancing *pos past it; NULL when there is
 * none (or on allocation failure, which callers treat as absent). When the
 * element holds other elements (its text has a '<') it comes back as is, so
 * that reading fields from it decodes them once. */
char *df_xml_next(const char *xml, size_t len, const char *tag, size_t *pos);
/* The first <tag> text in the document, or NULL. */
char *df_xml_first(const char *xml, size_t len, const char *tag);

/* ---- the client --------------------------------------------------------- */

typedef struct df_s3_config {
  char *region;
  char *endpoint; /* scheme://host[:port] with no trailing '/' */
  char *key_id, *secret, *token;
  char *cred_note;      /* why no profile gave keys, for the "no AWS credentials" message */
  bool endpoint_custom; /* set by option or environment */
  int addressing;       /* DFLASH_S3_ADDRESSING_PATH or _VIRTUAL once resolved */
  uint32_t max_attempts, backoff_base_ms, backoff_max_ms;
  uint32_t connect_timeout_ms, idle_timeout_ms, request_timeout_ms;
  uint64_t part_size, multipart_threshold;
  bool trace;
} df_s3_config;

/* Keys from the shared AWS files (AWS_PROFILE, ~/.aws/credentials, ~/.aws/config) when the
 * options and the environment give no key pair (s3_profile.c). */
DF_MUST_CHECK dflash_status df_s3_profile_credentials(df_s3_config *c);

struct dflash_storage {
  df_s3_config cfg;
  void *curl;              /* CURL *, created on first use and reused for its connections */
  uint64_t rng;            /* backoff jitter */
  uint64_t n_requests;     /* HTTP attempts made */
  uint64_t n_retries;      /* attempts that were retries */
  uint32_t list_page_size; /* max-keys for listings; 0: the server's default (tests set it) */
};

/* Replace the secret key and session token in `text` by "***" (in place when
 * shorter, which it always is). Every message that may carry server or curl
 * text goes through this. */
void df_storage_redact(const dflash_storage *st, char *text);
/* Release the client's libcurl handle (NULL-safe). */
void df_curl_cleanup(void *curl);

/* ---- S3 operations (s3.c, s3_ops.c) -------------------------------------- */

/* One S3 request. The query string must already be canonical (sorted by
 * name, values URI-encoded, every name followed by '='): libcurl 7.88 signs
 * it as given. */
typedef struct df_s3_req {
  const char *method; /* GET HEAD PUT POST DELETE */
  const df_loc *loc;  /* bucket + key ("" for bucket-level calls) */
  const char *query;  /* NULL or canonical query */
  const char *range;  /* NULL or "bytes=a-b" */
  const void *body;   /* PUT/POST payload */
  size_t body_len;
  const char *content_type; /* NULL: none */
  void *buf;                /* when set, a 2xx body is copied here (ranged reads) */
  size_t buf_cap;
  uint64_t buf_skip; /* bytes to skip when a server ignores Range and sends 200 */
} df_s3_req;

typedef struct df_s3_resp {
  long status;
  df_buf body; /* the response body (unless req->buf took it) */
  size_t got;  /* bytes copied into req->buf */
  char etag[256];
  uint64_t content_length;
  bool has_length;
  uint64_t total_size; /* from Content-Range "bytes a-b/TOTAL" */
  bool has_total;
  int64_t mtime;
  double retry_after; /* seconds; < 0 when absent */
  char region[64];    /* x-amz-bucket-region */
} df_s3_resp;

/* Perform with retries; on success (2xx) resp holds the answer. Every failure
 * is mapped to a status and message naming the location. Free resp->body. */
DF_MUST_CHECK dflash_status df_s3_request(dflash_storage *st, const df_s3_req *req,
                                          df_s3_resp *resp);
void df_s3_resp_free(df_s3_resp *resp);

/* Full-jitter backoff before retry `attempt` (1-based), in seconds. */
double df_s3_backoff(dflash_storage *st, uint32_t attempt, double retry_after);

DF_MUST_CHECK dflash_status df_s3_get_all(dflash_storage *st, const df_loc *l, df_buf *out);
DF_MUST_CHECK dflash_status df_s3_get_range(dflash_storage *st, const df_loc *l, uint64_t offset,
                                            void *buf, size_t len, size_t *got);
DF_MUST_CHECK dflash_status df_s3_head(dflash_storage *st, const df_loc *l,
                                       dflash_storage_info *out);
DF_MUST_CHECK dflash_status df_s3_put(dflash_storage *st, const df_loc *l, const void *data,
                                      size_t n);
DF_MUST_CHECK dflash_status df_s3_delete(dflash_storage *st, const df_loc *l);
DF_MUST_CHECK dflash_status df_s3_list(dflash_storage *st, const df_loc *prefix,
                                       dflash_storage_listing *out);

/* A multipart upload in progress. */
typedef struct df_s3_upload {
  char *upload_id;
  char **etags; /* etags[i] belongs to part i + 1 */
  size_t n_parts, cap;
  uint64_t total;
} df_s3_upload;
DF_MUST_CHECK dflash_status df_s3_mpu_create(dflash_storage *st, const df_loc *l, df_s3_upload *u);
/* Upload the next part (number n_parts + 1). */
DF_MUST_CHECK dflash_status df_s3_mpu_part(dflash_storage *st, const df_loc *l, df_s3_upload *u,
                                           const void *data, size_t n);
DF_MUST_CHECK dflash_status df_s3_mpu_complete(dflash_storage *st, const df_loc *l,
                                               df_s3_upload *u);
/* Best effort; keeps this thread's last error as it was. Frees u's fields. */
void df_s3_mpu_abort(dflash_storage *st, const df_loc *l, df_s3_upload *u);
void df_s3_upload_clear(df_s3_upload *u);

/* ---- large buffers (storage.c) ------------------------------------------- */

/* A buffer for a whole object (free()-able): from DF_LARGE_ALLOC bytes on, aligned to 2 MiB
 * and advised as transparent huge pages, so that its first touch costs one fault per 2 MiB
 * instead of one per 4 KiB (bench/s3_read.py: the faults were a third of a read's CPU). */
#define DF_LARGE_ALLOC ((size_t)4 << 20)
void *df_alloc_large(size_t n);

/* ---- local files (local.c) ----------------------------------------------- */

DF_MUST_CHECK dflash_status df_local_read_range(const df_loc *l, uint64_t offset, void *buf,
                                                size_t len, size_t *got);
DF_MUST_CHECK dflash_status df_local_stat(const df_loc *l, dflash_storage_info *out);
/* Creates missing parent directories, then writes atomically. */
DF_MUST_CHECK dflash_status df_local_mkdirs_for(const char *path);
DF_MUST_CHECK dflash_status df_local_delete(const df_loc *l);
DF_MUST_CHECK dflash_status df_local_list(const df_loc *prefix, dflash_storage_listing *out);

/* ---- listings (storage.c) ------------------------------------------------ */

typedef struct df_list_entry {
  char *name;
  uint64_t size;
} df_list_entry;
struct dflash_storage_listing {
  df_list_entry *items;
  size_t n, cap;
};
/* Append an entry; takes ownership of `name` (freed on failure too). */
DF_MUST_CHECK dflash_status df_listing_add(dflash_storage_listing *l, char *name, uint64_t size);
void df_listing_sort(dflash_storage_listing *l);

#endif
