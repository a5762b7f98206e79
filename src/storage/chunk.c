/* Chunked append writer: JSONL records buffered into immutable chunk objects
 * named <prefix><name>-<seq>.jsonl. The sequence number of a chunk is fixed
 * before its first upload attempt and only advances after a successful one,
 * so a retried upload overwrites the same object instead of adding a copy. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "storage_internal.h"

struct dflash_chunk_writer {
  dflash_storage *st;
  char *prefix, *name, *suffix;
  uint64_t max_records, max_bytes;
  double max_seconds;
  df_buf buf;         /* records of the open chunk */
  uint64_t n_records; /* in buf */
  double opened_at;   /* when the first record of the open chunk came */
  uint64_t seq;       /* of the open chunk */
  char *last;         /* location of the last committed chunk */
  bool committed;     /* after dflash_chunk_writer_commit: no more records */
};

static void chunk_writer_options_defaults(dflash_chunk_writer_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->max_records = 10000;
  o->max_bytes = 64u << 20;
  o->max_seconds = 300;
  o->suffix = ".jsonl";
}

DF_DEFINE_INIT(dflash_chunk_writer_options, chunk_writer_options_defaults)

/* The sequence number in `location` when it is one of this writer's chunks. */
static bool chunk_seq(const dflash_chunk_writer *w, const char *location, const char *stem,
                      uint64_t *seq) {
  size_t n = strlen(stem);
  if (strncmp(location, stem, n)) return false;
  const char *d = location + n;
  char *end;
  if (*d < '0' || *d > '9') return false;
  unsigned long long v = strtoull(d, &end, 10);
  if (strcmp(end, w->suffix)) return false;
  *seq = v;
  return true;
}

/* Continue after the highest chunk an earlier run of this name committed. */
static dflash_status find_next_seq(dflash_chunk_writer *w) {
  char *stem = df_asprintf("%s%s-", w->prefix, w->name);
  if (!stem) return df_error_nomem("chunk name");
  dflash_storage_listing *l = NULL;
  dflash_status s = dflash_storage_list(w->st, stem, &l);
  for (size_t i = 0; !s && i < l->n; i++) {
    uint64_t seq;
    if (chunk_seq(w, l->items[i].name, stem, &seq) && seq + 1 > w->seq) {
      w->seq = seq + 1;
      free(w->last);
      w->last = df_strdup(l->items[i].name);
    }
  }
  dflash_storage_listing_free(l);
  free(stem);
  return s;
}

DFLASH_API dflash_status dflash_chunk_writer_open(dflash_storage *st, const char *prefix,
                                                  const char *name,
                                                  const dflash_chunk_writer_options *opts,
                                                  dflash_chunk_writer **out) {
  DF_CHECK_ARG(st && prefix && name && out);
  *out = NULL;
  if (!*name || strchr(name, '/'))
    return df_error(DFLASH_E_INVALID_ARG, "chunk writer name \"%s\": must be non-empty, no '/'",
                    name);
  dflash_chunk_writer_options o;
  dflash_chunk_writer_options_default(&o);
  dflash_status ost = df_opts_in(&o, opts, sizeof o, "dflash_chunk_writer_options");
  if (ost) return ost;
  dflash_chunk_writer *w = calloc(1, sizeof *w);
  if (!w) return df_error_nomem("chunk writer");
  w->st = st;
  w->prefix = df_strdup(prefix);
  w->name = df_strdup(name);
  w->suffix = df_strdup(o.suffix ? o.suffix : ".jsonl");
  w->max_records = o.max_records ? o.max_records : 10000;
  w->max_bytes = o.max_bytes ? o.max_bytes : (64u << 20);
  w->max_seconds = o.max_seconds;
  w->last = df_strdup("");
  dflash_status s = w->prefix && w->name && w->suffix && w->last ? DFLASH_OK
                                                                 : df_error_nomem("chunk writer");
  if (!s) s = find_next_seq(w);
  if (s) {
    dflash_chunk_writer_free(w);
    return df_error_wrap(s, "opening chunk writer %s%s", prefix, name);
  }
  *out = w;
  return DFLASH_OK;
}

DFLASH_API dflash_status dflash_chunk_writer_flush(dflash_chunk_writer *w) {
  DF_CHECK_ARG(w);
  if (!w->n_records) return DFLASH_OK;
  char *loc = df_asprintf("%s%s-%08llu%s", w->prefix, w->name, (unsigned long long)w->seq,
                          w->suffix);
  if (!loc) return df_error_nomem("chunk name");
  dflash_status s = dflash_storage_write(w->st, loc, w->buf.data, w->buf.len);
  if (s) {
    free(loc);
    return s; /* the chunk stays buffered under the same sequence number */
  }
  df_log(DFLASH_LOG_INFO, "chunk %s: %llu records, %zu bytes", loc,
         (unsigned long long)w->n_records, w->buf.len);
  free(w->last);
  w->last = loc;
  w->seq++;
  w->buf.len = 0;
  w->n_records = 0;
  return DFLASH_OK;
}

static bool too_old(const dflash_chunk_writer *w) {
  return w->n_records && w->max_seconds > 0 && df_now_seconds() - w->opened_at >= w->max_seconds;
}

DFLASH_API dflash_status dflash_chunk_writer_add(dflash_chunk_writer *w, const char *record,
                                                 size_t len) {
  DF_CHECK_ARG(w && record);
  if (w->committed)
    return df_error(DFLASH_E_STATE, "%s%s: chunk writer already committed", w->prefix, w->name);
  if (len && record[len - 1] == '\n') len--;
  if (!len) return df_error(DFLASH_E_FORMAT, "%s%s: empty record", w->prefix, w->name);
  if (memchr(record, '\n', len))
    return df_error(DFLASH_E_FORMAT, "%s%s: record %llu of chunk %llu contains a newline",
                    w->prefix, w->name, (unsigned long long)w->n_records + 1,
                    (unsigned long long)w->seq);
  if (!w->n_records) w->opened_at = df_now_seconds();
  dflash_status s = df_buf_append(&w->buf, record, len);
  if (!s) s = df_buf_append(&w->buf, "\n", 1);
  if (s) return s;
  w->n_records++;
  if (w->n_records >= w->max_records || w->buf.len >= w->max_bytes || too_old(w))
    return dflash_chunk_writer_flush(w);
  return DFLASH_OK;
}

DFLASH_API dflash_status dflash_chunk_writer_poll(dflash_chunk_writer *w) {
  DF_CHECK_ARG(w);
  return too_old(w) ? dflash_chunk_writer_flush(w) : DFLASH_OK;
}

DFLASH_API uint64_t dflash_chunk_writer_next_seq(const dflash_chunk_writer *w) {
  return w ? w->seq : 0;
}

DFLASH_API const char *dflash_chunk_writer_last_chunk(const dflash_chunk_writer *w) {
  return w && w->last ? w->last : "";
}

DFLASH_API dflash_status dflash_chunk_writer_commit(dflash_chunk_writer *w) {
  DF_CHECK_ARG(w);
  if (w->committed) return DFLASH_OK;
  dflash_status s = dflash_chunk_writer_flush(w);
  if (!s) w->committed = true; /* a failed upload stays buffered: commit can be retried */
  return s;
}

DFLASH_API void dflash_chunk_writer_free(dflash_chunk_writer *w) {
  if (!w) return;
  free(w->prefix);
  free(w->name);
  free(w->suffix);
  free(w->last);
  df_buf_free(&w->buf);
  free(w);
}
