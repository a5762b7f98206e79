/* Streaming writer (local: temporary file + rename; S3: multipart upload of
 * part_size parts, or one PUT when everything fits in one) and copy. */
#include <stdlib.h>
#include <string.h>

#include "storage_internal.h"

struct dflash_storage_writer {
  dflash_storage *st;
  df_loc loc;
  bool done;           /* committed */
  bool failed;         /* a write failed: only free is left */
  df_atomic_file file; /* local */
  df_buf part;         /* S3: bytes of the part being filled (capacity part_size) */
  df_s3_upload upload;
};

DFLASH_API dflash_status dflash_storage_writer_open(dflash_storage *st, const char *location,
                                                    dflash_storage_writer **out) {
  DF_CHECK_ARG(st && out);
  *out = NULL;
  dflash_storage_writer *w = calloc(1, sizeof *w);
  if (!w) return df_error_nomem("storage writer");
  w->st = st;
  w->file.fd = -1;
  dflash_status s = df_loc_parse_object(location, &w->loc);
  if (!s && !w->loc.s3) {
    s = df_local_mkdirs_for(w->loc.path);
    if (!s) s = df_atomic_open(w->loc.path, &w->file);
  }
  if (s) {
    dflash_storage_writer_free(w);
    return s;
  }
  *out = w;
  return DFLASH_OK;
}

static dflash_status flush_part(dflash_storage_writer *w) {
  dflash_status s = DFLASH_OK;
  if (!w->upload.upload_id) s = df_s3_mpu_create(w->st, &w->loc, &w->upload);
  if (!s) s = df_s3_mpu_part(w->st, &w->loc, &w->upload, w->part.data, w->part.len);
  w->part.len = 0;
  return s;
}

static dflash_status s3_write(dflash_storage_writer *w, const char *data, size_t len) {
  size_t part = (size_t)w->st->cfg.part_size;
  if (!w->part.cap) {
    dflash_status s = df_buf_reserve(&w->part, part);
    if (s) return s;
  }
  while (len) {
    size_t k = part - w->part.len < len ? part - w->part.len : len;
    memcpy(w->part.data + w->part.len, data, k);
    w->part.len += k;
    data += k;
    len -= k;
    if (w->part.len == part) {
      dflash_status s = flush_part(w);
      if (s) return s;
    }
  }
  return DFLASH_OK;
}

DFLASH_API dflash_status dflash_storage_writer_write(dflash_storage_writer *w, const void *data,
                                                     size_t len) {
  DF_CHECK_ARG(w && (data || !len));
  if (w->done || w->failed)
    return df_error(DFLASH_E_STATE, "%s: writer already %s", w->loc.text,
                    w->done ? "committed" : "failed");
  dflash_status s = w->loc.s3 ? s3_write(w, data, len) : df_atomic_write(&w->file, data, len);
  if (s) w->failed = true;
  return s;
}

static dflash_status s3_commit(dflash_storage_writer *w) {
  if (!w->upload.upload_id) /* everything fit in one part */
    return df_s3_put(w->st, &w->loc, w->part.data ? w->part.data : "", w->part.len);
  dflash_status s = w->part.len ? flush_part(w) : DFLASH_OK;
  if (!s) s = df_s3_mpu_complete(w->st, &w->loc, &w->upload);
  return s;
}

DFLASH_API dflash_status dflash_storage_writer_commit(dflash_storage_writer *w) {
  DF_CHECK_ARG(w);
  if (w->done || w->failed)
    return df_error(DFLASH_E_STATE, "%s: writer already %s", w->loc.text,
                    w->done ? "committed" : "failed");
  dflash_status s = w->loc.s3 ? s3_commit(w) : df_atomic_commit(&w->file);
  if (s) w->failed = true;
  else w->done = true;
  return s;
}

DFLASH_API void dflash_storage_writer_free(dflash_storage_writer *w) {
  if (!w) return;
  if (!w->done) {
    if (w->loc.s3) df_s3_mpu_abort(w->st, &w->loc, &w->upload);
    else df_atomic_abort(&w->file);
  }
  df_s3_upload_clear(&w->upload);
  df_buf_free(&w->part);
  df_loc_clear(&w->loc);
  free(w);
}

DFLASH_API dflash_status dflash_storage_copy(dflash_storage *st, const char *src, const char *dst) {
  DF_CHECK_ARG(st && src && dst);
  dflash_storage_info info = {.struct_size = sizeof info};
  dflash_status s = dflash_storage_stat(st, src, &info);
  if (s) return s;
  size_t chunk = (size_t)st->cfg.part_size;
  char *buf = malloc(chunk);
  if (!buf) return df_error_nomem("copy buffer");
  dflash_storage_writer *w = NULL;
  s = dflash_storage_writer_open(st, dst, &w);
  for (uint64_t off = 0; !s && off < info.size;) {
    size_t want = info.size - off < chunk ? (size_t)(info.size - off) : chunk, got = 0;
    s = dflash_storage_read_range(st, src, off, buf, want, &got);
    if (!s && got != want)
      s = df_error(DFLASH_E_TRUNCATED, "%s: ended at byte %llu of %llu (changed while copying?)",
                   src, (unsigned long long)(off + got), (unsigned long long)info.size);
    if (!s) s = dflash_storage_writer_write(w, buf, got);
    off += got;
  }
  if (!s) s = dflash_storage_writer_commit(w);
  if (s) df_error_wrap(s, "copying %s to %s", src, dst);
  dflash_storage_writer_free(w);
  free(buf);
  return s;
}
