/* The input scan: every line validated up front and sorted into prompts to fetch, already
 * done, repeated, in conflict (an id means one prompt: dflash_fetch_options.new_ids) or
 * malformed; and the id sets it compares with. Called by dflash_fetch_create (fetch.c). */
#include "fetch_state.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "<digest><id>": a pair of df_idset. */
static char *pair_key(const char *id, const char *digest) {
  size_t n = strlen(id); /* no printf: this runs for every line of the input */
  char *key = malloc(DF_DIGEST_LEN + n + 1);
  if (!key) return NULL;
  memcpy(key, digest, DF_DIGEST_LEN);
  memcpy(key + DF_DIGEST_LEN, id, n + 1);
  return key;
}

dflash_status df_idset_add(df_idset *s, const char *id, const char *digest) {
  char *pair = digest ? pair_key(id, digest) : NULL;
  bool ok = (!digest || pair) && df_strset_add(&s->ids, id) >= 0 &&
            (!pair || df_strset_add(&s->pairs, pair) >= 0);
  free(pair);
  return ok ? DFLASH_OK : df_error_nomem("id set");
}

typedef enum { ID_ABSENT, ID_SAME, ID_OTHER } id_state;

/* Whether `id` is in the set, and for the same messages; an id recorded without a digest
 * counts as the same (nothing to compare). -1: out of memory. */
static int idset_state(const df_idset *s, const df_strset *ids, const char *id,
                       const char *digest) {
  if (!df_strset_has(ids, id)) return ID_ABSENT;
  if (!df_strset_has(&s->ids, id)) return ID_SAME;
  char *pair = pair_key(id, digest);
  if (!pair) return df_error_nomem("id set"), -1;
  bool same = df_strset_has(&s->pairs, pair);
  free(pair);
  return same ? ID_SAME : ID_OTHER;
}

void df_idset_free(df_idset *s) {
  df_strset_free(&s->ids);
  df_strset_free(&s->pairs);
}

dflash_status df_fetch_map_input(dflash_fetch *f) {
  if (f->remote_in) { /* read whole: the scan and the jobs index into it */
    void *data;
    size_t len;
    dflash_status st = dflash_storage_read(f->storage, f->input_path, &data, &len);
    if (st) return df_error_wrap(st, "reading input");
    f->map = data;
    f->map_len = len;
    return DFLASH_OK;
  }
  const uint8_t *base;
  uint64_t size;
  dflash_status st = df_map_file(f->input_path, &base, &size);
  if (st) return df_error_wrap(st, "input");
  f->map = (const char *)base;
  f->map_len = (size_t)size;
  return DFLASH_OK;
}

static bool blank(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!isspace((unsigned char)s[i])) return false;
  return true;
}

static bool in_shard(const dflash_fetch *f, const char *id, uint64_t line) {
  if (f->o.shard_count <= 1) return true;
  uint32_t s = id ? df_shard_of(id, f->o.shard_count) : (uint32_t)(line % f->o.shard_count);
  return s == f->o.shard_index;
}

static dflash_status add_bad(dflash_fetch *f, uint64_t line, char *id, size_t *cap) {
  if (f->n_bad == *cap) {
    size_t ncap = *cap ? *cap * 2 : 16;
    df_bad_line *b = realloc(f->bad, ncap * sizeof *b);
    if (!b) return df_error_nomem("input errors");
    f->bad = b;
    *cap = ncap;
  }
  char *msg = df_strdup(dflash_last_error());
  if (!msg) return df_error_nomem("input errors");
  f->bad[f->n_bad++] = (df_bad_line){.line = line, .id = id, .message = msg};
  return DFLASH_OK;
}

static dflash_status add_prompt(dflash_fetch *f, uint64_t off, uint64_t len, uint64_t line,
                                char *id, size_t *cap) {
  if (f->n_prompts == *cap) {
    size_t ncap = *cap ? *cap * 2 : 1024;
    df_prompt *p = realloc(f->prompts, ncap * sizeof *p);
    if (!p) return free(id), df_error_nomem("prompts");
    f->prompts = p;
    *cap = ncap;
  }
  f->prompts[f->n_prompts++] = (df_prompt){off, len, line, id};
  return DFLASH_OK;
}

/* The input being scanned: the ids seen so far, the next line's place. */
typedef struct scan_ctx {
  df_idset seen;
  uint64_t off, len, line;
  size_t cap_p, cap_b;
} scan_ctx;

/* One more id named in a refusal (the first five; the count says how many in all). */
static void name_conflict(df_buf *names, uint64_t count, const char *id, uint64_t line) {
  if (count > 5) return;
  char *one = count == 5 ? df_strdup(", ...")
                         : df_asprintf("%s%s (line %llu)", names->len ? ", " : "", id,
                                       (unsigned long long)line);
  if (one) DF_IGNORE(df_buf_append(names, one, strlen(one)));
  free(one);
}

/* A line whose id (or suffixed id) is on disk already: skipped. */
static void skip_done(dflash_fetch *f, const char *id) {
  f->skipped++;
  if (df_strset_has(&f->err_done, id)) f->errors_earlier++;
}

/* The k-th candidate id of a valid line (its id, then "<id>#2"...): *placed when it decides
 * the line (fetched, skipped, or a conflict noted); not when other messages hold it and
 * new_ids asks for the next. */
static dflash_status try_id(dflash_fetch *f, scan_ctx *sc, const df_conv *c, const char *cand,
                            unsigned k, bool *placed) {
  *placed = true;
  int in = idset_state(&sc->seen, &sc->seen.ids, cand, c->digest);
  if (in < 0) return DFLASH_E_NOMEM;
  if (in == ID_SAME) { /* the same prompt again: nothing to add */
    f->duplicates++;
    df_log(DFLASH_LOG_WARN, "%s:%llu: id %s repeats an earlier line's messages; skipped",
           f->input_path, (unsigned long long)sc->line, cand);
    return DFLASH_OK;
  }
  if (in == ID_OTHER && k == 1 && f->guards.keep_first_duplicates) {
    f->duplicates++;
    df_log(DFLASH_LOG_WARN, "%s:%llu: id %s appeared on an earlier line; skipped (keep first)",
           f->input_path, (unsigned long long)sc->line, cand);
    return DFLASH_OK;
  }
  if (in == ID_OTHER && !f->guards.new_ids) {
    name_conflict(&f->conflicts.input_names, f->conflicts.in_input++, cand, sc->line);
    return DFLASH_OK;
  }
  int disk = in == ID_OTHER ? ID_OTHER : idset_state(&f->digests, &f->done, cand, c->digest);
  if (disk == ID_ABSENT) { /* an error moved away to be retried: fetched again, same prompt */
    int retried = idset_state(&f->retried, &f->retried.ids, cand, c->digest);
    disk = retried == ID_OTHER ? ID_OTHER : retried < 0 ? -1 : ID_ABSENT;
  }
  if (disk < 0) return DFLASH_E_NOMEM;
  if (disk == ID_OTHER && in == ID_ABSENT && !f->guards.new_ids) {
    name_conflict(&f->conflicts.disk_names, f->conflicts.on_disk++, cand, sc->line);
    return df_idset_add(&sc->seen, cand, c->digest); /* a later line is compared with this one */
  }
  if (disk == ID_OTHER) return *placed = false, DFLASH_OK;
  /* the line's own id too: a later line under it is a repeat of this one */
  dflash_status st = df_idset_add(&sc->seen, cand, c->digest);
  if (!st && k > 1) st = df_idset_add(&sc->seen, c->id, c->digest);
  if (st) return st;
  if (k > 1) f->renamed++;
  if (disk == ID_SAME) return skip_done(f, cand), DFLASH_OK;
  char *own = k > 1 ? df_strdup(cand) : NULL;
  if (k > 1 && !own) return df_error_nomem("id");
  return add_prompt(f, sc->off, sc->len, sc->line, own, &sc->cap_p);
}

/* A valid line: under its own id, or (new_ids) the first suffixed one that is free. */
static dflash_status place_prompt(dflash_fetch *f, scan_ctx *sc, const df_conv *c) {
  bool placed = false;
  dflash_status st = DFLASH_OK;
  for (unsigned k = 1; !st && !placed; k++) {
    char *cand = k == 1 ? c->id : df_asprintf("%s#%u", c->id, k);
    if (!cand) return df_error_nomem("id");
    st = try_id(f, sc, c, cand, k, &placed);
    if (k > 1) free(cand);
  }
  return st;
}

/* A malformed line: recorded once under its explicit id (or its line). */
static dflash_status place_bad(dflash_fetch *f, scan_ctx *sc, const char *explicit_id) {
  char key[40];
  snprintf(key, sizeof key, "\1line:%llu", (unsigned long long)sc->line);
  if (explicit_id && df_strset_has(&sc->seen.ids, explicit_id)) {
    f->duplicates++;
    df_log(DFLASH_LOG_WARN, "%s:%llu: id %s appeared on an earlier line; ignored", f->input_path,
           (unsigned long long)sc->line, explicit_id);
    return DFLASH_OK;
  }
  if (explicit_id && df_strset_add(&sc->seen.ids, explicit_id) < 0) return df_error_nomem("id set");
  if (df_strset_has(&f->done, explicit_id ? explicit_id : key)) {
    skip_done(f, explicit_id ? explicit_id : key);
    return DFLASH_OK;
  }
  char *id = explicit_id ? df_strdup(explicit_id) : NULL;
  if (explicit_id && !id) return df_error_nomem("id");
  return add_bad(f, sc->line, id, &sc->cap_b);
}

/* Validate one line fully (so errors are known up front) and sort it into
 * prompts to fetch, already done, duplicate, in conflict, or malformed. */
static dflash_status scan_one(dflash_fetch *f, scan_ctx *sc) {
  df_conv c;
  char *explicit_id;
  dflash_status st = df_conv_parse(f->map + sc->off, sc->len, f->input_path, sc->line, &c,
                                   &explicit_id);
  if (st == DFLASH_E_NOMEM) return free(explicit_id), st; /* not the line's fault */
  if (!st) {
    size_t *turns, n;
    st = df_conv_turns(c.messages, f->o.all_turns, &turns, &n);
    if (st) st = df_error_wrap(st, "%s:%llu", f->input_path, (unsigned long long)sc->line);
    else free(turns);
  }
  dflash_status out = DFLASH_OK;
  if (!in_shard(f, st ? explicit_id : c.id, sc->line)) {
  } else if (st) {
    out = place_bad(f, sc, explicit_id);
  } else {
    out = place_prompt(f, sc, &c);
  }
  free(explicit_id);
  df_conv_free(&c);
  return out;
}

/* The refusal of an input whose ids name other prompts than before (see new_ids). */
static dflash_status refuse_conflicts(dflash_fetch *f) {
  df_conflicts *k = &f->conflicts;
  if (!k->on_disk && !k->in_input) return DFLASH_OK;
  DF_IGNORE(df_buf_append(&k->disk_names, "", 1));
  DF_IGNORE(df_buf_append(&k->input_names, "", 1));
  char *disk = k->on_disk ? df_asprintf("%llu ids already in %s stand for other messages there "
                                        "(%s); ",
                                        (unsigned long long)k->on_disk, f->out_dir,
                                        k->disk_names.data ? k->disk_names.data : "")
                          : df_strdup("");
  char *input = k->in_input ? df_asprintf("%llu ids come again with other messages (%s); ",
                                          (unsigned long long)k->in_input,
                                          k->input_names.data ? k->input_names.data : "")
                            : df_strdup("");
  dflash_status st = disk && input ? DFLASH_OK : df_error_nomem("message");
  if (!st)
    st = df_error(k->on_disk ? DFLASH_E_MISMATCH : DFLASH_E_FORMAT,
                  "fetch: %s: %s%san id means one prompt: new_ids (dflash fetch --new-ids) "
                  "fetches them as \"<id>#2\"%s; nothing was sent",
                  f->input_path, disk, input,
                  k->in_input ? ", keep_first_duplicates (--keep-first) skips the later lines"
                              : "");
  free(disk);
  free(input);
  return st;
}

dflash_status df_fetch_scan_input(dflash_fetch *f) {
  scan_ctx sc = {0};
  dflash_status st = DFLASH_OK;
  for (size_t i = 0; !st && i < f->map_len;) {
    const char *nl = memchr(f->map + i, '\n', f->map_len - i);
    size_t n = nl ? (size_t)(nl - (f->map + i)) : f->map_len - i;
    sc.line++;
    sc.off = i;
    sc.len = n;
    if (!blank(f->map + i, n)) st = scan_one(f, &sc);
    i += n + 1;
  }
  df_idset_free(&sc.seen);
  return st ? st : refuse_conflicts(f);
}
