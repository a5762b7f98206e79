/* Fetch outputs on object storage (an s3:// output directory).
 *
 * Layout under the output prefix OUT:
 *   OUT/completions/<worker>-<seq>.jsonl   completion records
 *   OUT/errors/<worker>-<seq>.jsonl        error records
 *   OUT/errors.retried/<same name>         with retry_errors: the records
 *                                          moved out of an errors chunk
 * Each chunk is an immutable object written by a dflash_chunk_writer: its
 * name is fixed before the first upload attempt, so a retried upload
 * overwrites the same object. Resume lists both prefixes and reads every
 * chunk (of every worker): an id in any uploaded chunk is done. Records still
 * buffered when a process dies are in no chunk, so they are fetched again:
 * every id ends up in exactly one chunk, as long as concurrent workers have
 * distinct names and disjoint inputs (--shard). */
#include <stdlib.h>
#include <string.h>

#include "fetch_internal.h"

/* Report every valid record of one chunk; invalid lines (another program's
 * objects under the prefix) are logged and skipped, as if absent. */
static dflash_status scan_chunk(const char *loc, const char *text, size_t len, df_out_record_fn fn,
                                void *ctx, uint64_t *records) {
  dflash_status st = DFLASH_OK;
  uint64_t line = 0;
  for (size_t i = 0; !st && i < len;) {
    const char *nl = memchr(text + i, '\n', len - i);
    size_t n = nl ? (size_t)(nl - (text + i)) : len - i;
    char *id;
    uint64_t input_line;
    line++;
    int ok = n && nl ? df_out_check_line(text + i, n, false, &id, &input_line) : 0;
    if (ok < 0) st = DFLASH_E_NOMEM;
    else if (ok) {
      (*records)++;
      if (fn) st = fn(ctx, id, input_line, text + i, n);
      free(id);
    } else if (n) {
      df_log(DFLASH_LOG_WARN, "%s:%llu: not a fetch record; ignored", loc,
             (unsigned long long)line);
    }
    i += n + 1;
  }
  return st;
}

dflash_status df_out_open_remote(dflash_storage *st, const char *prefix, df_out_record_fn fn,
                                 void *ctx, df_out *o) {
  memset(o, 0, sizeof *o);
  o->fd = -1;
  if (!(o->path = df_strdup(prefix))) return df_error_nomem("path");
  dflash_storage_listing *l = NULL;
  dflash_status s = dflash_storage_list(st, prefix, &l);
  size_t n = dflash_storage_listing_count(l);
  for (size_t i = 0; !s && i < n; i++) {
    const char *loc;
    void *data;
    size_t len;
    if ((s = dflash_storage_listing_get(l, i, &loc, NULL))) break;
    if (!df_str_ends_with(loc, ".jsonl")) continue;
    if (!(s = dflash_storage_read(st, loc, &data, &len))) {
      s = scan_chunk(loc, data, len, fn, ctx, &o->records);
      dflash_storage_buffer_free(data);
    }
  }
  dflash_storage_listing_free(l);
  if (s) df_error_wrap(s, "reading earlier results under %s", prefix);
  return s;
}

dflash_status df_out_start_chunks(df_out *o, dflash_storage *st, const char *name,
                                  const dflash_chunk_writer_options *co) {
  return dflash_chunk_writer_open(st, o->path, name, co, &o->cw);
}

dflash_status df_out_flush(df_out *o) {
  return o->cw ? dflash_chunk_writer_flush(o->cw) : DFLASH_OK;
}
