/* completions.jsonl / errors.jsonl: append-only JSONL, one write() per
 * record, fsync on a schedule, repaired on open.
 *
 * A process killed mid-write can leave a last line without its '\n'; a power
 * loss can leave unsynced blocks as zeros or garbage. On open every line is
 * checked (our own lines cheaply, by their `{"id":` prefix; the last MiB and
 * anything unusual by a full JSON parse). Invalid lines at the end are cut
 * off; invalid lines followed by valid ones are moved to `<file>.corrupt` and
 * the file is rewritten atomically without them. Either way no valid record
 * is lost and none is read twice. */
#include "fetch_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define FULL_CHECK_TAIL (1u << 20)

/* Where the "id" string value of a record line that starts {"id":"..." ends (after its
 * closing quote), or 0 when the line does not start that way. */
static size_t id_string_end(const char *line, size_t len) {
  static const char head[] = "{\"id\":\"";
  size_t i = sizeof head - 1;
  if (len < i + 4 || memcmp(line, head, i)) return 0;
  while (i < len && line[i] != '"') i += line[i] == '\\' ? 2 : 1;
  return i < len ? i + 1 : 0;
}

bool df_record_id_prefix(const char *line, size_t len, char **id) {
  static const char head[] = "{\"id\":";
  size_t h = sizeof head - 1;
  *id = NULL;
  if (len < h + 5 || memcmp(line, head, h)) return false;
  if (len >= h + 4 && !memcmp(line + h, "null", 4)) return true;
  size_t end = id_string_end(line, len);
  if (!end) return false;
  json_t *s = json_loadb(line + h, end - h, JSON_DECODE_ANY, NULL);
  if (json_is_string(s)) *id = df_strdup(json_string_value(s));
  json_decref(s);
  return *id != NULL;
}

static bool is_digest(const char *d, size_t n) {
  if (n != DF_DIGEST_LEN) return false;
  for (size_t i = 0; i < n; i++)
    if (!((d[i] >= '0' && d[i] <= '9') || (d[i] >= 'a' && d[i] <= 'f'))) return false;
  return true;
}

int df_record_digest(const char *line, size_t len, char out[DF_DIGEST_LEN + 1]) {
  static const char key[] = ",\"digest\":\"";
  size_t k = sizeof key - 1, e = id_string_end(line, len);
  if (e && len > e + k + DF_DIGEST_LEN && !memcmp(line + e, key, k) &&
      line[e + k + DF_DIGEST_LEN] == '"' && is_digest(line + e + k, DF_DIGEST_LEN)) {
    memcpy(out, line + e + k, DF_DIGEST_LEN);
    out[DF_DIGEST_LEN] = 0;
    return 1;
  }
  /* Our layout ("id" then another key) without it: written before records had a digest.
   * Not parsed: a first resume of a large old output would parse every record. */
  if (e && len > e + 1 && line[e] == ',' && line[e + 1] == '"') return 0;
  /* another tool's layout */
  json_error_t err;
  json_t *r = json_loadb(line, len, 0, &err);
  if (!r && json_error_code(&err) == json_error_out_of_memory)
    return df_error_nomem("fetch record"), -1;
  const json_t *d = json_object_get(r, "digest");
  int found = json_is_string(d) && is_digest(json_string_value(d), json_string_length(d));
  if (found) memcpy(out, json_string_value(d), DF_DIGEST_LEN + 1);
  json_decref(r);
  return found;
}

/* Full check of one line: a JSON object whose "id" is a string or null (1; 0 when not, -1 out
 * of memory: a valid record taken for an invalid one would be cut or moved aside). */
static int parse_record(const char *line, size_t len, char **id, uint64_t *input_line) {
  json_error_t err;
  json_t *root = json_loadb(line, len, 0, &err);
  if (!root && json_error_code(&err) == json_error_out_of_memory) {
    df_error_nomem("fetch record");
    return -1;
  }
  const json_t *idv = json_object_get(root, "id");
  int ok = json_is_object(root) && (json_is_string(idv) || json_is_null(idv));
  if (ok && json_is_string(idv) && !(*id = df_strdup(json_string_value(idv)))) {
    df_error_nomem("fetch record id");
    ok = -1;
  }
  const json_t *ln = json_object_get(root, "line");
  if (ok > 0 && json_is_integer(ln)) *input_line = (uint64_t)json_integer_value(ln);
  json_decref(root);
  return ok;
}

int df_out_check_line(const char *line, size_t len, bool full, char **id, uint64_t *input_line) {
  *id = NULL;
  *input_line = 0;
  if (!full && line[len - 1] == '}' && !memchr(line, '\0', len) &&
      df_record_id_prefix(line, len, id) && *id)
    return 1;
  free(*id);
  *id = NULL;
  return parse_record(line, len, id, input_line);
}

typedef struct scan {
  df_out_record_fn fn;
  void *ctx;
  off_t size;
  off_t first_bad; /* offset of the first invalid line, -1 when none */
  bool valid_after_bad;
  uint64_t records;
} scan;

static dflash_status scan_line(scan *s, const char *line, size_t len, off_t off) {
  char *id;
  uint64_t input_line;
  bool full = s->size - off <= (off_t)FULL_CHECK_TAIL;
  int ok = len ? df_out_check_line(line, len, full, &id, &input_line) : 0;
  if (ok < 0) return DFLASH_E_NOMEM;
  if (!ok) {
    if (s->first_bad < 0) s->first_bad = off;
    return DFLASH_OK;
  }
  if (s->first_bad >= 0) s->valid_after_bad = true;
  s->records++;
  dflash_status st = s->fn ? s->fn(s->ctx, id, input_line, line, len) : DFLASH_OK;
  free(id);
  return st;
}

/* Read the file sequentially and check every '\n'-terminated line. */
static dflash_status scan_file(int fd, const char *path, scan *s) {
  df_buf pending = {0};
  char *block = malloc(1 << 20);
  if (!block) return df_error_nomem("read buffer");
  off_t off = 0; /* file offset of pending.data[0] */
  dflash_status st = DFLASH_OK;
  for (;;) {
    ssize_t n = pread(fd, block, 1 << 20, off + (off_t)pending.len);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      st = df_error_errno(DFLASH_E_IO, errno, "%s: read failed", path);
      break;
    }
    if (n == 0) break;
    if ((st = df_buf_append(&pending, block, (size_t)n))) break;
    size_t start = 0;
    char *nl;
    while (!st && (nl = memchr(pending.data + start, '\n', pending.len - start))) {
      size_t len = (size_t)(nl - pending.data) - start;
      st = scan_line(s, pending.data + start, len, off + (off_t)start);
      start += len + 1;
    }
    memmove(pending.data, pending.data + start, pending.len - start);
    pending.len -= start;
    off += (off_t)start;
  }
  if (!st && pending.len && s->first_bad < 0) s->first_bad = off; /* torn last line */
  free(block);
  df_buf_free(&pending);
  return st;
}

/* Copy valid lines to a new file and invalid ones to `path`.corrupt. */
static dflash_status rewrite_without_bad(int fd, const char *path) {
  char *text;
  size_t len;
  dflash_status st = df_read_file(path, &text, &len);
  if (st) return st;
  (void)fd;
  char *bad_path = df_asprintf("%s.corrupt", path);
  df_buf good = {0}, bad = {0};
  size_t i = 0;
  while (!st && i < len) {
    char *nl = memchr(text + i, '\n', len - i);
    size_t n = nl ? (size_t)(nl - text) - i : len - i;
    char *id;
    uint64_t ln;
    int checked = nl && n ? df_out_check_line(text + i, n, true, &id, &ln) : 0;
    if (checked < 0) {
      st = DFLASH_E_NOMEM;
      break;
    }
    bool ok = checked > 0;
    if (ok) free(id);
    df_buf *to = ok ? &good : &bad;
    if (!(st = df_buf_append(to, text + i, n))) st = df_buf_append(to, "\n", 1);
    i += n + 1;
  }
  free(text);
  if (!st && !bad_path) st = df_error_nomem("path");
  int bfd = st ? -1 : open(bad_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (!st && bfd < 0) st = df_error_errno(DFLASH_E_IO, errno, "%s: cannot open", bad_path);
  if (!st) st = df_write_all(bfd, bad.data, bad.len, bad_path);
  if (!st && fsync(bfd) != 0) st = df_error_errno(DFLASH_E_IO, errno, "%s: fsync failed", bad_path);
  if (bfd >= 0) close(bfd);
  if (!st) st = df_write_file_atomic(path, good.data ? good.data : "", good.len);
  if (!st)
    df_log(DFLASH_LOG_WARN, "%s: moved %zu bytes of invalid lines to %s", path, bad.len, bad_path);
  free(bad_path);
  df_buf_free(&good);
  df_buf_free(&bad);
  return st;
}

static dflash_status open_append(const char *path, int *fd) {
  *fd = open(path, O_RDWR | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (*fd < 0) return df_error_errno(DFLASH_E_IO, errno, "%s: cannot open", path);
  return DFLASH_OK;
}

static dflash_status repair(df_out *o, const scan *s) {
  if (s->first_bad < 0) return DFLASH_OK;
  if (!s->valid_after_bad) {
    df_log(DFLASH_LOG_WARN, "%s: cutting %lld bytes of torn or invalid records at the end", o->path,
           (long long)(s->size - s->first_bad));
    if (ftruncate(o->fd, s->first_bad) != 0 || fsync(o->fd) != 0)
      return df_error_errno(DFLASH_E_IO, errno, "%s: cannot truncate torn line", o->path);
    return DFLASH_OK;
  }
  dflash_status st = rewrite_without_bad(o->fd, o->path);
  close(o->fd);
  o->fd = -1;
  return st ? st : open_append(o->path, &o->fd);
}

dflash_status df_out_open(const char *path, df_out_record_fn fn, void *ctx, df_out *o) {
  memset(o, 0, sizeof *o);
  o->fd = -1;
  if (!(o->path = df_strdup(path))) return df_error_nomem("path");
  dflash_status st = open_append(path, &o->fd);
  struct stat sb;
  if (!st && fstat(o->fd, &sb) != 0) st = df_error_errno(DFLASH_E_IO, errno, "%s: stat", path);
  scan s = {.fn = fn, .ctx = ctx, .first_bad = -1};
  if (!st) {
    s.size = sb.st_size;
    st = scan_file(o->fd, path, &s);
  }
  if (!st) st = repair(o, &s);
  if (!st) st = df_fsync_parent(path); /* the file's creation is durable too */
  if (st) {
    df_out_close(o);
    return st;
  }
  o->records = s.records;
  o->last_sync = df_now_seconds();
  return DFLASH_OK;
}

dflash_status df_out_append(df_out *o, const json_t *record) {
  char *text = json_dumps(record, JSON_COMPACT);
  if (!text) return df_error_nomem("record");
  size_t n = strlen(text);
  if (o->cw) {
    dflash_status cs = dflash_chunk_writer_add(o->cw, text, n);
    free(text);
    if (!cs) o->records++;
    return cs;
  }
  text[n] = '\n'; /* overwrites the NUL: one write() carries the line and its end */
  off_t before = lseek(o->fd, 0, SEEK_END);
  dflash_status st = df_write_all(o->fd, text, n + 1, o->path);
  free(text);
  if (st) {
    /* Leave no partial line behind (ENOSPC mid-record); the open repair would anyway. */
    if (before >= 0 && ftruncate(o->fd, before) != 0)
      df_log(DFLASH_LOG_ERROR, "%s: truncate failed", o->path);
    return st;
  }
  o->dirty = true;
  o->records++;
  return DFLASH_OK;
}

dflash_status df_out_sync(df_out *o, double interval, double now) {
  if (o->cw) return dflash_chunk_writer_poll(o->cw); /* chunks close on their own schedule */
  if (!o->dirty || o->fd < 0 || now - o->last_sync < interval) return DFLASH_OK;
  if (fdatasync(o->fd) != 0) return df_error_errno(DFLASH_E_IO, errno, "%s: fsync failed", o->path);
  o->dirty = false;
  o->last_sync = now;
  return DFLASH_OK;
}

void df_out_close(df_out *o) {
  if (o->cw && dflash_chunk_writer_commit(o->cw))
    df_log(DFLASH_LOG_ERROR, "%s: last chunk not uploaded (its records are redone on resume): %s",
           o->path, dflash_last_error());
  dflash_chunk_writer_free(o->cw);
  if (o->fd >= 0) {
    if (o->dirty && fdatasync(o->fd) != 0) df_log(DFLASH_LOG_ERROR, "%s: fsync failed", o->path);
    close(o->fd);
  }
  free(o->path);
  memset(o, 0, sizeof *o);
  o->fd = -1;
}
