/* dflash_dataset_build's inputs (local or s3:// JSONL, read in batches) and side files
 * (rejected.jsonl, sources.jsonl). Everything here runs on the calling thread. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "dataset/build.h"

/* A batch also ends at this many input bytes. */
#define BATCH_BYTES ((size_t)32 << 20)

/* ---- inputs ----------------------------------------------------------------- */

/* A directory passes access() and fopen() and then reads as no lines at all. */
static dflash_status check_input(const char *path) {
  struct stat sb;
  if (access(path, R_OK) != 0 || stat(path, &sb) != 0)
    return df_error_errno(errno == ENOENT ? DFLASH_E_NOT_FOUND : DFLASH_E_IO, errno,
                          "cannot read input %s", path);
  if (S_ISDIR(sb.st_mode))
    return df_error(DFLASH_E_IO, "cannot read input %s: a directory (inputs are JSONL files)",
                    path);
  return DFLASH_OK;
}

dflash_status df_build_check_inputs(const char *const *inputs, size_t n) {
  for (size_t i = 0; i < n; i++) {
    DF_CHECK_ARG(inputs[i] && *inputs[i]);
    dflash_status st = dflash_storage_is_remote(inputs[i]) ? DFLASH_OK : check_input(inputs[i]);
    if (st) return st;
  }
  return DFLASH_OK;
}

static dflash_status storage(df_build_reader *r) {
  return r->storage ? DFLASH_OK : dflash_storage_create(NULL, &r->storage);
}

static dflash_status push(df_build_reader *r, size_t *cap, const char *name) {
  if (r->n_files == *cap) {
    size_t ncap = *cap ? 2 * *cap : 16;
    char **files = realloc(r->files, ncap * sizeof *files);
    if (!files) return df_error_nomem("dataset build: inputs");
    r->files = files, *cap = ncap;
  }
  if (!(r->files[r->n_files] = df_strdup(name))) return df_error_nomem("dataset build: inputs");
  r->n_files++;
  return DFLASH_OK;
}

static int is_jsonl(const char *loc) {
  size_t n = strlen(loc);
  return n > 6 && !strcmp(loc + n - 6, ".jsonl");
}

/* Every *.jsonl object under `prefix`, in the listing's (name) order. A listing that fails is
 * logged, rejected and counted as an unreadable input. */
static dflash_status push_listing(df_build *b, size_t *cap, const char *prefix) {
  df_build_reader *r = &b->in;
  dflash_storage_listing *l = NULL;
  if (storage(r) || dflash_storage_list(r->storage, prefix, &l)) {
    char why[1024];
    snprintf(why, sizeof why, "cannot list the prefix: %s", dflash_last_error());
    df_log(DFLASH_LOG_WARN, "%s", dflash_last_error());
    df_build_reject(b, prefix, 0, why);
    b->stats.unreadable++;
    return DFLASH_OK;
  }
  dflash_status st = DFLASH_OK;
  for (size_t e = 0; !st && e < dflash_storage_listing_count(l); e++) {
    const char *loc;
    st = dflash_storage_listing_get(l, e, &loc, NULL);
    if (!st && is_jsonl(loc)) st = push(r, cap, loc);
  }
  dflash_storage_listing_free(l);
  return st;
}

dflash_status df_build_expand_inputs(df_build *b, const char *const *inputs, size_t n) {
  size_t cap = 0;
  dflash_status st = DFLASH_OK;
  for (size_t i = 0; !st && i < n; i++) {
    size_t len = strlen(inputs[i]);
    if (dflash_storage_is_remote(inputs[i]) && inputs[i][len - 1] == '/')
      st = push_listing(b, &cap, inputs[i]);
    else st = push(&b->in, &cap, inputs[i]);
  }
  return st;
}

/* A local file, or an s3:// object read whole and parsed from memory; NULL (logged for an
 * object) when it cannot be opened. */
/* The input opened for reading; NULL with the reason in why[cap] (rejected.jsonl keeps it). */
static FILE *open_input(df_build_reader *r, const char *name, char *why, size_t cap) {
  if (!dflash_storage_is_remote(name)) {
    FILE *f = fopen(name, "r");
    if (!f) snprintf(why, cap, "cannot open file: %s", strerror(errno));
    return f;
  }
  size_t len;
  if (storage(r) || dflash_storage_read(r->storage, name, &r->object, &len)) {
    df_log(DFLASH_LOG_WARN, "%s", dflash_last_error());
    snprintf(why, cap, "cannot open file: %s", dflash_last_error());
    return NULL;
  }
  return len ? fmemopen(r->object, len, "r") : fopen("/dev/null", "r");
}

void df_build_close_input(df_build *b) {
  df_build_reader *r = &b->in;
  if (r->f) fclose(r->f);
  r->f = NULL;
  dflash_storage_buffer_free(r->object);
  r->object = NULL;
}

void df_build_free_inputs(df_build *b) {
  df_build_reader *r = &b->in;
  df_build_close_input(b);
  for (size_t i = 0; i < r->n_files; i++) free(r->files[i]);
  free(r->files);
  free(r->buf);
  dflash_storage_free(r->storage);
  memset(r, 0, sizeof *r);
}

/* The next line into r->buf (length returned, 0 at the end of every input); inputs that
 * cannot be opened become rejected lines. */
static ssize_t next_line(df_build *b) {
  df_build_reader *r = &b->in;
  for (;;) {
    if (!r->f) {
      if (r->at >= r->n_files) return 0;
      r->line = 0;
      char why[1024];
      if (!(r->f = open_input(r, r->files[r->at], why, sizeof why))) {
        df_build_reject(b, r->files[r->at++], 0, why);
        b->stats.unreadable++;
        continue;
      }
    }
    ssize_t len = getline(&r->buf, &r->cap, r->f);
    if (len > 0) return len;
    df_build_close_input(b);
    r->at++;
  }
}

void df_build_read_batch(df_build *b) {
  df_build_reader *r = &b->in;
  size_t bytes = 0;
  b->n_items = 0;
  while (b->n_items < b->opts.batch_lines && bytes < BATCH_BYTES) {
    ssize_t len = next_line(b);
    if (len <= 0) return;
    r->line++;
    b->stats.lines++;
    if (len == 1 && r->buf[0] == '\n') continue;
    df_build_item *it = &b->items[b->n_items++];
    memset(it, 0, sizeof *it);
    it->text = malloc((size_t)len);
    if (it->text) memcpy(it->text, r->buf, (size_t)len);
    it->len = it->text ? (size_t)len : 0; /* out of memory: the build fails (build.c) */
    it->file = r->files[r->at];
    it->line = r->line;
    bytes += (size_t)len;
  }
}

/* ---- side files ------------------------------------------------------------- */

/* `n` bytes as a JSON string literal (UTF-8 passes through): the bytes these files have
 * always had. */
static void json_string(FILE *f, const char *s, size_t n) {
  fputc('"', f);
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
    else if (c == '\n') fputs("\\n", f);
    else if (c < 0x20 || c == 0x7f) fprintf(f, "\\u%04x", c);
    else fputc(c, f);
  }
  fputc('"', f);
}

/* A file in the output directory, or for an s3:// output a temporary file uploaded by
 * df_build_finish_side. */
static dflash_status open_side(const char *out_dir, const char *name, FILE **out) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", out_dir, name);
  *out = dflash_storage_is_remote(out_dir) ? tmpfile() : fopen(path, "w");
  if (!*out) return df_error_errno(DFLASH_E_IO, errno, "dataset build: cannot create %s", path);
  return DFLASH_OK;
}

dflash_status df_build_open_side(df_build *b) {
  dflash_status st = open_side(b->out_dir, "rejected.jsonl", &b->rejects);
  if (!st) st = open_side(b->out_dir, "sources.jsonl", &b->sources);
  return st;
}

static void reject_start(df_build *b, const char *file, uint64_t line, const char *why) {
  b->stats.rejected++;
  fputs("{\"file\": ", b->rejects);
  json_string(b->rejects, file, strlen(file));
  fprintf(b->rejects, ", \"line\": %llu, \"reason\": ", (unsigned long long)line);
  json_string(b->rejects, why, strlen(why));
}

void df_build_reject(df_build *b, const char *file, uint64_t line, const char *why) {
  reject_start(b, file, line, why);
  fputs("}\n", b->rejects);
}

void df_build_reject_item(df_build *b, const df_build_item *it, const char *why) {
  reject_start(b, it->file, it->line, why);
  fputs(", \"id\": ", b->rejects);
  if (it->id) json_string(b->rejects, it->id, strlen(it->id));
  else fputs("null", b->rejects);
  if (it->encoded) fprintf(b->rejects, ", \"tokens\": %zu}\n", it->n);
  else fputs(", \"tokens\": null}\n", b->rejects);
}

void df_build_write_source(df_build *b, const df_build_item *it) {
  fputs("{\"id\": ", b->sources);
  json_string(b->sources, it->id, strlen(it->id));
  fputs(", \"file\": ", b->sources);
  json_string(b->sources, it->file, strlen(it->file));
  fprintf(b->sources, ", \"line\": %llu}\n", (unsigned long long)it->line);
}

static dflash_status upload(FILE *f, const char *out_dir, const char *name) {
  long n = ftell(f);
  char *buf = n >= 0 ? malloc((size_t)n + 1) : NULL;
  rewind(f);
  size_t got = buf ? fread(buf, 1, (size_t)n, f) : 0;
  char loc[4096];
  snprintf(loc, sizeof loc, "%s%s%s", out_dir, out_dir[strlen(out_dir) - 1] == '/' ? "" : "/",
           name);
  dflash_storage *s = NULL;
  dflash_status st = DFLASH_OK;
  if (!buf || got != (size_t)n)
    st = df_error(DFLASH_E_IO, "dataset build: cannot read back %s before uploading it", name);
  if (!st) st = dflash_storage_create(NULL, &s);
  if (!st) st = dflash_storage_write(s, loc, buf, got);
  dflash_storage_free(s);
  free(buf);
  return st;
}

static dflash_status finish_side(FILE **f, const char *out_dir, const char *name) {
  if (!*f) return DFLASH_OK;
  dflash_status st = DFLASH_OK;
  if (dflash_storage_is_remote(out_dir)) st = upload(*f, out_dir, name);
  int failed = ferror(*f);
  if (fclose(*f) || failed)
    if (!st) st = df_error(DFLASH_E_IO, "dataset build: writing %s/%s failed", out_dir, name);
  *f = NULL;
  return st;
}

dflash_status df_build_finish_side(df_build *b) {
  dflash_status st = finish_side(&b->rejects, b->out_dir, "rejected.jsonl");
  dflash_status st2 = finish_side(&b->sources, b->out_dir, "sources.jsonl");
  return st ? st : st2;
}

/* A file a dataset build writes at the top of its directory (dataset.h). */
static bool dataset_file(const char *name, bool keep_rejects) {
  size_t n = strlen(name);
  return !strcmp(name, "dataset.json") || (!keep_rejects && !strcmp(name, "rejected.jsonl")) ||
         !strcmp(name, "sources.jsonl") ||
         (!strncmp(name, "shard-", 6) && n > 18 && !strcmp(name + n - 12, ".safetensors"));
}

dflash_status df_build_clear_old(const char *dir, bool keep_rejects) {
  size_t n = strlen(dir);
  char *prefix = df_asprintf("%s%s", dir, n && dir[n - 1] == '/' ? "" : "/");
  if (!prefix) return df_error_nomem("dataset build: overwrite");
  dflash_storage *st = NULL;
  dflash_storage_listing *l = NULL;
  dflash_status s = dflash_storage_create(NULL, &st);
  if (!s) s = dflash_storage_list(st, prefix, &l);
  for (size_t i = 0; !s && i < dflash_storage_listing_count(l); i++) {
    const char *loc;
    s = dflash_storage_listing_get(l, i, &loc, NULL);
    const char *name = s ? "" : loc + strlen(prefix);
    if (!s && !strchr(name, '/') && dataset_file(name, keep_rejects))
      s = dflash_storage_delete(st, loc);
  }
  dflash_storage_listing_free(l);
  dflash_storage_free(st);
  free(prefix);
  return s ? df_error_wrap(s, "dataset build: removing the dataset in %s", dir) : DFLASH_OK;
}
