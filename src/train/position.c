/* The resume position of a training run as versioned JSON (position.h), and the reader of the
 * unversioned "key=value" text states had before it. */
#include "position.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- writing ------------------------------------------------------------------------- */

static json_t *settings_json(const df_position *p) {
  json_t *o = json_object();
  for (size_t i = 0; o && i < p->n_settings; i++)
    if (json_object_set_new(o, p->settings[i].name, json_real(p->settings[i].value))) {
      json_decref(o);
      o = NULL;
    }
  return o;
}

/* The optional parts: NULL is "absent" when `present` is false, out of memory when true. */
static json_t *schedule_json(const df_position *p) {
  return p->has_schedule ? json_pack("{s:f, s:I, s:f}", "next_lr", p->next_lr, "from",
                                     (json_int_t)p->sched_from, "lr0", p->sched_lr0)
                         : NULL;
}

static json_t *spool_json(const df_position *p) {
  return p->spool ? json_pack("{s:I, s:I, s:f}", "shard", (json_int_t)p->spool_shard, "offset",
                              (json_int_t)p->spool_offset, "wait_s", p->spool_wait_s)
                  : NULL;
}

static json_t *position_json(const df_position *p) {
  char seed[24]; /* a string: jansson's integers stop at INT64_MAX, seeds do not */
  snprintf(seed, sizeof seed, "%" PRIu64, p->seed);
  json_t *settings = settings_json(p), *sched = schedule_json(p), *spool = spool_json(p);
  json_t *j = NULL;
  if (settings && (sched || !p->has_schedule) && (spool || !p->spool))
    j = json_pack("{s:s, s:i, s:i, s:I, s:I, s:I, s:s, s:I, s:f, s:O}", "format",
                  DF_POSITION_FORMAT, "version", DF_POSITION_VERSION, "epoch", p->epoch, "pos",
                  (json_int_t)p->pos, "tokens", (json_int_t)p->tokens, "metrics_bytes",
                  (json_int_t)p->metrics_bytes, "seed", seed, "samples", (json_int_t)p->samples,
                  "elapsed_s", p->elapsed_s, "settings", settings);
  if (j && sched && json_object_set(j, "schedule", sched)) json_decref(j), j = NULL;
  if (j && spool && json_object_set(j, "spool", spool)) json_decref(j), j = NULL;
  json_decref(settings), json_decref(sched), json_decref(spool);
  return j;
}

dflash_status df_position_to_json(const df_position *p, char **out) {
  *out = NULL;
  json_t *j = position_json(p);
  char *text = j ? json_dumps(j, JSON_COMPACT | JSON_REAL_PRECISION(17)) : NULL;
  json_decref(j);
  if (!text) return df_error_nomem("training state position");
  *out = text;
  return DFLASH_OK;
}

/* ---- reading JSON -------------------------------------------------------------------- */

typedef struct reader {
  const char *what;
  const char *in; /* "" or " in \"schedule\"" */
} reader;

static dflash_status bad(const reader *r, const char *key, const char *want) {
  return df_error(DFLASH_E_FORMAT, "%s: resume position field \"%s\"%s is not %s", r->what, key,
                  r->in, want);
}

static dflash_status get_int(const reader *r, const json_t *o, const char *key, int64_t min,
                             int64_t *out) {
  json_t *v = json_object_get(o, key);
  if (!json_is_integer(v) || json_integer_value(v) < min)
    return bad(r, key, min ? "a positive integer" : "an integer >= 0");
  *out = json_integer_value(v);
  return DFLASH_OK;
}

static dflash_status get_u64(const reader *r, const json_t *o, const char *key, uint64_t *out) {
  int64_t v = 0;
  dflash_status st = get_int(r, o, key, 0, &v);
  if (!st) *out = (uint64_t)v;
  return st;
}

static dflash_status get_real(const reader *r, const json_t *o, const char *key, double *out) {
  json_t *v = json_object_get(o, key);
  if (!json_is_number(v)) return bad(r, key, "a number");
  *out = json_number_value(v);
  return DFLASH_OK;
}

static dflash_status get_seed(const reader *r, const json_t *o, uint64_t *out) {
  const char *s = json_string_value(json_object_get(o, "seed"));
  char *end = NULL;
  errno = 0;
  if (s && *s >= '0' && *s <= '9') *out = strtoull(s, &end, 10);
  if (!end || *end || errno) return bad(r, "seed", "a decimal string of an unsigned 64-bit seed");
  return DFLASH_OK;
}

/* Every key of `o` is one of `known` (a newer writer's field is refused, not ignored). */
static dflash_status only_known(const reader *r, const json_t *o, const char *const *known) {
  const char *key;
  json_t *v;
  json_object_foreach((json_t *)o, key, v) {
    const char *const *k = known;
    while (*k && strcmp(*k, key)) k++;
    if (!*k)
      return df_error(DFLASH_E_UNSUPPORTED,
                      "%s: resume position field \"%s\"%s is unknown to this libdflash (written "
                      "by a newer one?)",
                      r->what, key, r->in);
  }
  return DFLASH_OK;
}

static dflash_status read_settings(const reader *r, const json_t *o, df_position *p) {
  if (!json_is_object(o)) return bad(r, "settings", "an object");
  const char *key;
  json_t *v;
  json_object_foreach((json_t *)o, key, v) {
    if (!json_is_number(v)) return bad(r, key, "a number");
    if (p->n_settings == DF_POSITION_MAX_SETTINGS || strlen(key) >= sizeof p->settings[0].name)
      return df_error(DFLASH_E_UNSUPPORTED, "%s: resume position setting \"%s\" is unknown",
                      r->what, key);
    df_position_setting *s = &p->settings[p->n_settings++];
    snprintf(s->name, sizeof s->name, "%s", key);
    s->value = json_number_value(v);
  }
  return DFLASH_OK;
}

static dflash_status read_schedule(const reader *outer, const json_t *o, df_position *p) {
  if (!o) return DFLASH_OK;
  if (!json_is_object(o)) return bad(outer, "schedule", "an object");
  static const char *const known[] = {"next_lr", "from", "lr0", NULL};
  reader r = {outer->what, " in \"schedule\""};
  dflash_status st = only_known(&r, o, known);
  if (!st) st = get_real(&r, o, "next_lr", &p->next_lr);
  if (!st) st = get_int(&r, o, "from", 0, &p->sched_from);
  if (!st) st = get_real(&r, o, "lr0", &p->sched_lr0);
  p->has_schedule = !st;
  return st;
}

static dflash_status read_spool(const reader *outer, const json_t *o, df_position *p) {
  if (!o) return DFLASH_OK;
  if (!json_is_object(o)) return bad(outer, "spool", "an object");
  static const char *const known[] = {"shard", "offset", "wait_s", NULL};
  reader r = {outer->what, " in \"spool\""};
  dflash_status st = only_known(&r, o, known);
  if (!st) st = get_u64(&r, o, "shard", &p->spool_shard);
  if (!st) st = get_u64(&r, o, "offset", &p->spool_offset);
  if (!st) st = get_real(&r, o, "wait_s", &p->spool_wait_s);
  p->spool = !st;
  return st;
}

static dflash_status check_version(const reader *r, const json_t *j) {
  const char *format = json_string_value(json_object_get(j, "format"));
  json_t *v = json_object_get(j, "version");
  if (!format || strcmp(format, DF_POSITION_FORMAT))
    return df_error(DFLASH_E_FORMAT, "%s: the resume position is not \"%s\" (format %s%s%s)",
                    r->what, DF_POSITION_FORMAT, format ? "\"" : "", format ? format : "missing",
                    format ? "\"" : "");
  if (!json_is_integer(v) || json_integer_value(v) < 1) return bad(r, "version", "an integer >= 1");
  if (json_integer_value(v) > DF_POSITION_VERSION)
    return df_error(DFLASH_E_UNSUPPORTED,
                    "%s: resume position format version %" JSON_INTEGER_FORMAT
                    " was written by a newer libdflash; this one reads version %d",
                    r->what, json_integer_value(v), DF_POSITION_VERSION);
  return DFLASH_OK;
}

static dflash_status read_fields(const reader *r, const json_t *j, df_position *p) {
  static const char *const known[] = {"format",    "version",       "epoch",    "pos",
                                      "tokens",    "metrics_bytes", "seed",     "samples",
                                      "elapsed_s", "settings",      "schedule", "spool",
                                      NULL};
  int64_t epoch = 0, pos = 0, samples = 0;
  dflash_status st = only_known(r, j, known);
  if (!st) st = get_int(r, j, "epoch", 0, &epoch);
  if (!st && epoch > INT32_MAX) st = bad(r, "epoch", "a 32-bit integer");
  if (!st) st = get_int(r, j, "pos", 0, &pos);
  if (!st) st = get_int(r, j, "tokens", 0, &p->tokens);
  if (!st) st = get_int(r, j, "metrics_bytes", 0, &p->metrics_bytes);
  if (!st) st = get_seed(r, j, &p->seed);
  if (!st) st = get_int(r, j, "samples", 0, &samples);
  if (!st) st = get_real(r, j, "elapsed_s", &p->elapsed_s);
  if (!st) st = read_settings(r, json_object_get(j, "settings"), p);
  if (!st) st = read_schedule(r, json_object_get(j, "schedule"), p);
  if (!st) st = read_spool(r, json_object_get(j, "spool"), p);
  p->epoch = (int32_t)epoch, p->pos = (uint64_t)pos, p->samples = (uint64_t)samples;
  return st;
}

static dflash_status parse_json(const char *text, size_t len, const char *what, df_position *p) {
  json_t *j;
  dflash_status st = df_json_parse(text, len, what, &j);
  if (st) return df_error_wrap(st, "%s: the resume position", what);
  reader r = {what, ""};
  if (!json_is_object(j))
    st = df_error(DFLASH_E_FORMAT,
                  "%s: the resume position is not a "
                  "JSON object",
                  what);
  if (!st) st = check_version(&r, j);
  if (!st) st = read_fields(&r, j, p);
  json_decref(j);
  return st;
}

/* ---- reading the unversioned text of earlier states ----------------------------------- */

/* "epoch=0 pos=3 tokens=96 metrics_bytes=712 seed=5 samples=8 elapsed=0.52[ spool=S,O
 * spool_wait=W][ name=value ...][ next_lr=L sched=F,G]": the seven first fields always, the
 * others as the writer of the day had them. */
static bool num(const char *s, const char *end, double *out) {
  char *e;
  errno = 0;
  *out = strtod(s, &e);
  return e == end && e != s && !errno;
}

static bool u64(const char *s, const char *end, uint64_t *out) {
  char *e;
  errno = 0;
  *out = strtoull(s, &e, 10);
  return e == end && e != s && *s != '-' && !errno;
}

/* "a,b": two unsigned integers. */
static bool two_u64(const char *s, const char *end, uint64_t *a, uint64_t *b) {
  const char *comma = memchr(s, ',', (size_t)(end - s));
  return comma && u64(s, comma, a) && u64(comma + 1, end, b);
}

enum { L_EPOCH, L_POS, L_TOKENS, L_MBYTES, L_SEED, L_SAMPLES, L_ELAPSED, L_REQUIRED };

static bool legacy_field(const char *key, size_t klen, const char *v, const char *end,
                         df_position *p, unsigned *seen) {
  static const char *const req[L_REQUIRED] = {"epoch", "pos",     "tokens", "metrics_bytes",
                                              "seed",  "samples", "elapsed"};
  uint64_t u = 0;
  for (int i = 0; i < L_REQUIRED; i++) {
    if (strlen(req[i]) != klen || memcmp(key, req[i], klen)) continue;
    *seen |= 1u << i;
    bool ok = i == L_ELAPSED ? num(v, end, &p->elapsed_s) : u64(v, end, &u);
    if (i == L_EPOCH) ok = ok && u <= INT32_MAX, p->epoch = (int32_t)u;
    if (i == L_POS) p->pos = u;
    if (i == L_TOKENS || i == L_MBYTES) ok = ok && u <= INT64_MAX;
    if (i == L_TOKENS) p->tokens = (int64_t)u;
    if (i == L_MBYTES) p->metrics_bytes = (int64_t)u;
    if (i == L_SEED) p->seed = u;
    if (i == L_SAMPLES) p->samples = u;
    return ok;
  }
#define IS(k) (klen == strlen(k) && !memcmp(key, k, klen))
  if (IS("spool")) return p->spool = two_u64(v, end, &p->spool_shard, &p->spool_offset);
  if (IS("spool_wait")) return num(v, end, &p->spool_wait_s);
  if (IS("next_lr")) {
    *seen |= 1u << L_REQUIRED;
    return num(v, end, &p->next_lr);
  }
  if (IS("sched")) { /* "from,lr0" */
    *seen |= 2u << L_REQUIRED;
    const char *comma = memchr(v, ',', (size_t)(end - v));
    bool ok = comma && u64(v, comma, &u) && u <= INT64_MAX && num(comma + 1, end, &p->sched_lr0);
    p->sched_from = (int64_t)u;
    return ok;
  }
#undef IS
  if (klen >= sizeof p->settings[0].name || p->n_settings == DF_POSITION_MAX_SETTINGS) return false;
  df_position_setting *s = &p->settings[p->n_settings++];
  snprintf(s->name, sizeof s->name, "%.*s", (int)klen, key);
  return num(v, end, &s->value);
}

static dflash_status parse_legacy(const char *text, size_t len, const char *what, df_position *p) {
  unsigned seen = 0;
  const char *s = text, *stop = text + len;
  while (s < stop) {
    while (s < stop && *s == ' ') s++;
    const char *end = s;
    while (end < stop && *end != ' ') end++;
    if (end == s) break;
    const char *eq = memchr(s, '=', (size_t)(end - s));
    if (!eq || !legacy_field(s, (size_t)(eq - s), eq + 1, end, p, &seen))
      return df_error(DFLASH_E_FORMAT, "%s: unreadable resume position field \"%.*s\"", what,
                      (int)(end - s), s);
    s = end;
  }
  if ((seen & ((1u << L_REQUIRED) - 1)) != (1u << L_REQUIRED) - 1)
    return df_error(DFLASH_E_FORMAT, "%s: the resume position \"%.*s\" lacks a field", what,
                    (int)len, text);
  unsigned sched = seen >> L_REQUIRED;
  if (sched == 1 || sched == 2)
    return df_error(DFLASH_E_FORMAT, "%s: the resume position has half a schedule", what);
  p->has_schedule = sched == 3;
  return DFLASH_OK;
}

dflash_status df_position_parse(const char *text, size_t len, const char *what, df_position *out) {
  memset(out, 0, sizeof *out);
  while (len && text[len - 1] == '\0') len--; /* the writers stored the NUL */
  if (len > 6 && !memcmp(text, "epoch=", 6)) return parse_legacy(text, len, what, out);
  return parse_json(text, len, what, out);
}

const df_position_setting *df_position_setting_find(const df_position *p, const char *name) {
  for (size_t i = 0; i < p->n_settings; i++)
    if (!strcmp(p->settings[i].name, name)) return &p->settings[i];
  return NULL;
}
