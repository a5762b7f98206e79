/*
 * Object storage: one API over local files and S3-compatible object stores.
 *
 * Every function here takes a "location" that is either a local path
 * ("data/out.jsonl", "/abs/x", "file:///abs/x") or an S3 URL
 * ("s3://bucket/prefix/key"). Pipeline stages accept both wherever they take a
 * path, so generation, tokenization and training can run on different
 * machines and share their files through a bucket.
 *
 * S3 requests are signed with AWS Signature V4 by libcurl. Configuration comes
 * from dflash_storage_options, and for every field left NULL/0 from the
 * standard environment:
 *   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN (optional);
 *     without that pair, the profile AWS_PROFILE (else AWS_DEFAULT_PROFILE, else
 *     "default") as the AWS CLI reads it: aws_access_key_id,
 *     aws_secret_access_key and aws_session_token of [PROFILE] in
 *     AWS_SHARED_CREDENTIALS_FILE (default ~/.aws/credentials), else of
 *     [profile PROFILE] ([default]) in AWS_CONFIG_FILE (default ~/.aws/config);
 *     instance roles, SSO, role_arn and credential_process are not read,
 *     nor a region from those files,
 *   AWS_REGION (else AWS_DEFAULT_REGION, else us-east-1),
 *   AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL (S3-compatible stores: MinIO,
 *     Ceph, R2, moto...; default https://s3.REGION.amazonaws.com),
 *   DFLASH_S3_ADDRESSING=path|virtual (default: virtual-hosted for AWS,
 *     path-style when an endpoint URL is set; bucket names with dots always
 *     use path-style, as TLS certificates cannot match them),
 *   DFLASH_S3_TRACE=1 (log every request, headers included, at
 *     DFLASH_LOG_DEBUG; the secret key is never sent and the session token
 *     and signature are redacted).
 *
 * Failures: DFLASH_E_AUTH (no credentials, InvalidAccessKeyId,
 * SignatureDoesNotMatch, AccessDenied, expired token), DFLASH_E_NOT_FOUND
 * (NoSuchBucket, NoSuchKey, a missing local file), DFLASH_E_CONFIG (bucket in
 * another region, bad endpoint), DFLASH_E_HTTP (any other error response),
 * DFLASH_E_NETWORK / DFLASH_E_TIMEOUT (after all retries). Messages name the
 * URL and the S3 error code; they never contain the secret key or token.
 *
 * Retries: 5xx, 429, SlowDown, RequestTimeout, connection failures, resets
 * and timeouts are retried up to max_attempts with full-jitter exponential
 * backoff, honouring a Retry-After header. Other 4xx answers are final.
 *
 * Thread safety: a dflash_storage (it holds a libcurl handle and its
 * connection cache) and every object made from it are single-owner; use one
 * dflash_storage per thread. Objects made from a dflash_storage borrow it: it
 * must outlive them.
 */
#ifndef DFLASH_STORAGE_H
#define DFLASH_STORAGE_H

#include <dflash/dflash.h>
#include <dflash/safetensors.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dflash_s3_addressing {
  DFLASH_S3_ADDRESSING_AUTO = 0,   /* $DFLASH_S3_ADDRESSING, else the default above */
  DFLASH_S3_ADDRESSING_PATH = 1,   /* https://endpoint/bucket/key */
  DFLASH_S3_ADDRESSING_VIRTUAL = 2 /* https://bucket.endpoint/key */
} dflash_s3_addressing;

typedef struct dflash_storage_options {
  size_t struct_size; /* sizeof(dflash_storage_options) */
  /* NULL: from the environment (see above). Copied by dflash_storage_create. */
  const char *region;
  const char *endpoint_url;
  const char *access_key_id;
  const char *secret_access_key;
  const char *session_token;
  int32_t addressing;    /* a dflash_s3_addressing */
  uint32_t max_attempts; /* tries per request, default 8 */
  /* Times in seconds (uint32_t milliseconds, *_ms, in SONAME 0); 0: the default;
   * each finite, in [0, 2e6], else DFLASH_E_CONFIG at dflash_storage_create. */
  double backoff_base_s;        /* first backoff ceiling, default 0.2 */
  double backoff_max_s;         /* backoff ceiling, default 20 (also caps Retry-After) */
  double connect_timeout_s;     /* default 10 */
  double idle_timeout_s;        /* abort an attempt that moves no byte this long; default 60 */
  double request_timeout_s;     /* whole-attempt limit, 0 (default): none */
  uint64_t part_size;           /* multipart part size, default 8 MiB (S3 minimum 5 MiB) */
  uint64_t multipart_threshold; /* objects at least this big go multipart; default 16 MiB */
  int32_t trace;                /* 1: as DFLASH_S3_TRACE=1 */
} dflash_storage_options;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_storage_options_default(&opts). */
DFLASH_API void dflash_storage_options_init(dflash_storage_options *opts, size_t size);
#define dflash_storage_options_default(opts) dflash_storage_options_init((opts), sizeof *(opts))

typedef struct dflash_storage dflash_storage;

/* Create a client. `opts` may be NULL (all defaults). Credentials are read
 * here but only required by the first S3 call (local paths need none). */
DFLASH_API dflash_status dflash_storage_create(const dflash_storage_options *opts,
                                               dflash_storage **out);
DFLASH_API void dflash_storage_free(dflash_storage *storage);

/* Whether `location` is an s3:// URL (1) or a local path (0). */
DFLASH_API int dflash_storage_is_remote(const char *location);

/* Release a buffer returned by dflash_storage_read (NULL-safe). */
DFLASH_API void dflash_storage_buffer_free(void *buf);

/* Read a whole object into a malloc'd buffer (NUL-terminated, the NUL not
 * counted in *len); free it with dflash_storage_buffer_free. */
DFLASH_API dflash_status dflash_storage_read(dflash_storage *storage, const char *location,
                                             void **data, size_t *len);

/* Read up to `len` bytes at `offset` into `buf` (an S3 ranged GET).
 * *got < len only at the end of the object; an offset past the end gives
 * *got = 0. */
DFLASH_API dflash_status dflash_storage_read_range(dflash_storage *storage, const char *location,
                                                   uint64_t offset, void *buf, size_t len,
                                                   size_t *got);

typedef struct dflash_storage_info {
  size_t struct_size; /* sizeof(dflash_storage_info) */
  uint64_t size;      /* bytes */
  int64_t mtime;      /* seconds since the epoch, 0 when unknown */
} dflash_storage_info;

/* Size of an object or file; DFLASH_E_NOT_FOUND when it does not exist. */
DFLASH_API dflash_status dflash_storage_stat(dflash_storage *storage, const char *location,
                                             dflash_storage_info *out);

/* Write a whole object atomically: readers see the old object or the whole
 * new one. Local: temporary file, fsync, rename. S3: one PUT, or a multipart
 * upload from multipart_threshold on (aborted on failure). */
DFLASH_API dflash_status dflash_storage_write(dflash_storage *storage, const char *location,
                                              const void *data, size_t len);

/* Delete an object or file. Deleting something absent succeeds (as S3 does). */
DFLASH_API dflash_status dflash_storage_delete(dflash_storage *storage, const char *location);

/*
 * List every object whose location starts with `prefix` (a plain string
 * prefix, as S3 has it: "s3://b/run1/chunk-" matches "run1/chunk-0001.jsonl";
 * end it with '/' to list a "directory"). Local prefixes walk the directory
 * tree below the prefix's directory; temporary files of unfinished atomic
 * writes ("*.tmp.<pid>") are skipped. Entries come back sorted by location,
 * spelled like the prefix ("s3://b/..." or the local path). A prefix that
 * matches nothing yields an empty listing, not an error; a missing bucket is
 * DFLASH_E_NOT_FOUND.
 */
typedef struct dflash_storage_listing dflash_storage_listing;
DFLASH_API dflash_status dflash_storage_list(dflash_storage *storage, const char *prefix,
                                             dflash_storage_listing **out);
DFLASH_API size_t dflash_storage_listing_count(const dflash_storage_listing *l);
/* Borrowed location and size of entry `index`; DFLASH_E_RANGE past the end. */
DFLASH_API dflash_status dflash_storage_listing_get(const dflash_storage_listing *l, size_t index,
                                                    const char **location, uint64_t *size);
DFLASH_API void dflash_storage_listing_free(dflash_storage_listing *l);

/*
 * Streaming writer for objects too large to hold in memory (checkpoints,
 * shards): write any number of byte runs, then commit. Nothing is visible at
 * `location` before commit. Local: a temporary file renamed on commit. S3:
 * buffers up to part_size, uploads parts as they fill (each retried), and
 * completes the multipart upload on commit (a single PUT when everything fit
 * in one part). Freeing an uncommitted writer aborts the upload / removes the
 * temporary file.
 */
typedef struct dflash_storage_writer dflash_storage_writer;
DFLASH_API dflash_status dflash_storage_writer_open(dflash_storage *storage, const char *location,
                                                    dflash_storage_writer **out);
DFLASH_API dflash_status dflash_storage_writer_write(dflash_storage_writer *w, const void *data,
                                                     size_t len);
DFLASH_API dflash_status dflash_storage_writer_commit(dflash_storage_writer *w);
DFLASH_API void dflash_storage_writer_free(dflash_storage_writer *w);

/* Copy one object or file to another location (any combination of local and
 * S3), streaming in part_size pieces; the destination is written
 * atomically. */
DFLASH_API dflash_status dflash_storage_copy(dflash_storage *storage, const char *src,
                                             const char *dst);

/*
 * Chunked append writer for JSONL outputs (completions, errors). Records are
 * buffered and written as immutable chunk objects
 *     <prefix><name>-<seq, 8 digits>.jsonl
 * (prefix used as given: end it with '/' for a folder), closing a chunk every
 * max_records records, max_bytes bytes or max_seconds seconds, whichever comes
 * first. A chunk's name is fixed before its upload starts, so retrying a
 * failed upload rewrites the same object and never duplicates a record. On
 * open, the writer lists the prefix and continues after the highest existing
 * sequence number of `name`, so a restarted worker never overwrites what an
 * earlier run committed. Give every concurrent writer its own `name` (e.g.
 * "worker-3"). Resume: list the prefix, read the chunks, skip the ids found.
 * Records not yet in a committed chunk when the process dies are simply not
 * there, and are redone on resume.
 *
 * There is no background thread: the age limit is checked on every add
 * and by dflash_chunk_writer_poll(), which an idle caller should call now and
 * then.
 */
typedef struct dflash_chunk_writer_options {
  size_t struct_size;   /* sizeof(dflash_chunk_writer_options) */
  uint64_t max_records; /* default 10000 */
  uint64_t max_bytes;   /* default 64 MiB */
  double max_seconds;   /* default 300; <= 0: no age limit */
  const char *suffix;   /* default ".jsonl" */
} dflash_chunk_writer_options;

/* The defaults, written up to `size` bytes: the caller's sizeof, which is smaller for a
 * program built against an older header. Call it as dflash_chunk_writer_options_default(&opts). */
DFLASH_API void dflash_chunk_writer_options_init(dflash_chunk_writer_options *opts, size_t size);
#define dflash_chunk_writer_options_default(opts) \
  dflash_chunk_writer_options_init((opts), sizeof *(opts))

typedef struct dflash_chunk_writer dflash_chunk_writer;
/* `opts` may be NULL. `name` must be non-empty, without '/'. */
DFLASH_API dflash_status dflash_chunk_writer_open(dflash_storage *storage, const char *prefix,
                                                  const char *name,
                                                  const dflash_chunk_writer_options *opts,
                                                  dflash_chunk_writer **out);
/* Append one record (one JSON line; a trailing '\n' is added when missing,
 * an embedded '\n' is DFLASH_E_FORMAT). May close and upload a chunk. On a
 * failed upload the chunk stays buffered and the next add, poll, flush or
 * commit tries it again under the same name. */
DFLASH_API dflash_status dflash_chunk_writer_add(dflash_chunk_writer *w, const char *record,
                                                 size_t len);
/* Close the current chunk if it is older than max_seconds. */
DFLASH_API dflash_status dflash_chunk_writer_poll(dflash_chunk_writer *w);
/* Close the current chunk now (no-op when empty). */
DFLASH_API dflash_status dflash_chunk_writer_flush(dflash_chunk_writer *w);
/* Sequence number the next chunk will get; the last committed is this - 1. */
DFLASH_API uint64_t dflash_chunk_writer_next_seq(const dflash_chunk_writer *w);
/* Location of the last committed chunk (borrowed; "" before the first). */
DFLASH_API const char *dflash_chunk_writer_last_chunk(const dflash_chunk_writer *w);
/* Flush the open chunk; the writer takes no more records (DFLASH_E_STATE). When the upload
 * fails the chunk stays buffered and commit may be called again; free the writer after it
 * either way (records never committed are lost, and redone on resume). */
DFLASH_API dflash_status dflash_chunk_writer_commit(dflash_chunk_writer *w);
/* Free without flushing (buffered records are dropped). NULL-safe. */
DFLASH_API void dflash_chunk_writer_free(dflash_chunk_writer *w);

/*
 * A safetensors file read on demand: the header comes with one ranged read
 * (two when it is larger than the read-ahead window), is validated exactly as
 * dflash_safetensors_open does, and tensors are read with ranged reads into
 * caller buffers. Reads go through a read-ahead window (default 16 MiB or the
 * tensor, whichever is larger), so tensors read in file order cost one
 * request per window, not one per tensor. Works on local paths too. Borrows
 * `storage`; single-owner.
 *
 * Tensor views (dflash_tensor) have data == NULL; `file` is the location.
 */
typedef struct dflash_storage_safetensors dflash_storage_safetensors;
/* readahead 0: default. A key that is not safetensors: DFLASH_E_FORMAT or
 * DFLASH_E_TRUNCATED naming the URL. */
DFLASH_API dflash_status dflash_storage_safetensors_open(dflash_storage *storage,
                                                         const char *location, uint64_t readahead,
                                                         dflash_storage_safetensors **out);
DFLASH_API void dflash_storage_safetensors_free(dflash_storage_safetensors *f);
/* Tensors are ordered by name, as in dflash_safetensors_get. */
DFLASH_API size_t dflash_storage_safetensors_count(const dflash_storage_safetensors *f);
DFLASH_API dflash_status dflash_storage_safetensors_get(const dflash_storage_safetensors *f,
                                                        size_t index, dflash_tensor *out);
DFLASH_API dflash_status dflash_storage_safetensors_find(const dflash_storage_safetensors *f,
                                                         const char *name, dflash_tensor *out);
/* `__metadata__` value for `key` (borrowed); DFLASH_E_NOT_FOUND when absent. */
DFLASH_API dflash_status dflash_storage_safetensors_metadata_find(
    const dflash_storage_safetensors *f, const char *key, const char **value);
/* Copy tensor `name` into `buf`; DFLASH_E_BUFFER (and *needed) when buf_len
 * is smaller than the tensor. `needed` may be NULL. */
DFLASH_API dflash_status dflash_storage_safetensors_read(dflash_storage_safetensors *f,
                                                         const char *name, void *buf,
                                                         size_t buf_len, uint64_t *needed);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_STORAGE_H */
