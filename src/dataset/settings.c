/* dflash_dataset_build and fetch's settings.json: the request settings that decided how the
 * target rendered its prompts (family, chat_template_kwargs) are read from the file fetch
 * writes beside completions.jsonl, so that answers fetched with thinking off are not trained
 * with a supervised think block because tokenize was not told. A build option that
 * contradicts the file is refused, naming both. */
#include <dflash/storage.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "dataset/build.h"

#define SETTINGS_NAME "settings.json"
#define SUBDIR "/completions"

/* Where fetch's settings would be for `input`: beside it; for an s3:// chunk or prefix under
 * OUT/completions/ (fetch's remote layout), in OUT. */
static char *settings_location(const char *input) {
  size_t n = strlen(input), end;
  if (n && input[n - 1] == '/') {
    end = n - 1; /* an s3:// prefix: its own folder */
  } else {
    const char *slash = strrchr(input, '/');
    if (!slash) return df_strdup(SETTINGS_NAME);
    end = (size_t)(slash - input);
  }
  size_t sub = strlen(SUBDIR);
  if (dflash_storage_is_remote(input) && end > sub && !strncmp(input + end - sub, SUBDIR, sub))
    end -= sub;
  return df_asprintf("%.*s/%s", (int)end, input, SETTINGS_NAME);
}

/* The text at `loc`; DFLASH_E_NOT_FOUND when there is none. */
static dflash_status read_text(df_build *b, const char *loc, char **text, size_t *len) {
  if (!dflash_storage_is_remote(loc)) return df_read_file(loc, text, len);
  void *data = NULL;
  dflash_status st = b->in.storage ? DFLASH_OK : dflash_storage_create(NULL, &b->in.storage);
  if (!st) st = dflash_storage_read(b->in.storage, loc, &data, len);
  if (st) return st;
  *text = malloc(*len + 1);
  if (*text) memcpy(*text, data, *len), (*text)[*len] = 0;
  dflash_storage_buffer_free(data);
  return *text ? DFLASH_OK : df_error_nomem("dataset build: settings");
}

static int kwarg_bool(const json_t *kwargs, const char *key) {
  const json_t *v = json_object_get(kwargs, key);
  return json_is_boolean(v) ? json_is_true(v) : -1;
}

/* The rendering view of one "settings" object: the family, and the template switches of its
 * chat_template_kwargs with "extra"'s merged over them (fetch merges "extra" into the body
 * last, so its keys win). */
static dflash_status view_of(const json_t *s, const char *loc, df_build_fetch *v) {
  const char *family = json_string_value(json_object_get(s, "family"));
  if (!family || strlen(family) >= sizeof v->family)
    return df_error(DFLASH_E_FORMAT, "dataset build: %s has no \"family\" in its settings", loc);
  strcpy(v->family, family);
  json_t *kw = json_object();
  if (!kw) return df_error_nomem("dataset build: settings");
  json_t *base = json_object_get(s, "chat_template_kwargs");
  json_t *extra = json_object_get(json_object_get(s, "extra"), "chat_template_kwargs");
  if (json_is_object(base)) json_object_update(kw, base);
  if (json_is_object(extra)) json_object_update(kw, extra);
  /* Qwen's templates read enable_thinking, Kimi's thinking. */
  int qwen = kwarg_bool(kw, "enable_thinking"), kimi = kwarg_bool(kw, "thinking");
  bool use_qwen = strcmp(family, "kimi") && qwen >= 0;
  v->thinking = use_qwen ? qwen : kimi;
  v->thinking_key = use_qwen ? "enable_thinking" : "thinking";
  v->preserve = kwarg_bool(kw, "preserve_thinking");
  json_decref(kw);
  return DFLASH_OK;
}

static bool same_view(const df_build_fetch *a, const df_build_fetch *b) {
  return !strcmp(a->family, b->family) && a->thinking == b->thinking && a->preserve == b->preserve;
}

/* A fetch whose settings changed on the way (its "earlier" list) with another rendering: its
 * completions mix two renderings, which one build cannot reproduce. */
static dflash_status check_earlier(const json_t *doc, const char *loc, const df_build_fetch *v) {
  size_t i;
  const json_t *e;
  json_array_foreach(json_object_get(doc, "earlier"), i, e) {
    df_build_fetch old = {0};
    dflash_status st = view_of(json_object_get(e, "settings"), loc, &old);
    if (st) return st;
    if (!same_view(&old, v))
      return df_error(DFLASH_E_MISMATCH,
                      "dataset build: %s records a change of family or thinking settings "
                      "during the fetch (its \"earlier\" entry %zu): the completions mix two "
                      "renderings; tokenize each part on its own",
                      loc, i);
  }
  return DFLASH_OK;
}

/* The view recorded at `loc` into *v; v->where stays NULL when there is no fetch's file.
 * *unreadable: the failure was reading it. */
static dflash_status read_view(df_build *b, const char *loc, df_build_fetch *v, bool *unreadable) {
  char *text = NULL;
  size_t len = 0;
  dflash_status st = read_text(b, loc, &text, &len);
  *unreadable = st && st != DFLASH_E_NOT_FOUND && st != DFLASH_E_NOMEM;
  if (st == DFLASH_E_NOT_FOUND) {
    dflash_clear_error();
    return DFLASH_OK;
  }
  if (st) return st;
  json_t *doc = json_loadb(text, len, 0, NULL);
  free(text);
  const json_t *s = json_object_get(doc, "settings");
  if (!json_object_get(doc, "dflash_fetch_settings") || !json_is_object(s)) {
    json_decref(doc); /* another tool's settings.json: not fetch's, not read */
    return DFLASH_OK;
  }
  st = view_of(s, loc, v);
  if (!st) st = check_earlier(doc, loc, v);
  json_decref(doc);
  if (!st && !(v->where = df_strdup(loc))) st = df_error_nomem("dataset build: settings");
  return st;
}

/* An s3:// settings object that cannot be read is an unreadable input (rejected, counted and
 * refused at the end, as the inputs beside it would be): remembered until rejected.jsonl
 * exists. */
static dflash_status note_unreadable(df_build *b, const char *loc) {
  df_log(DFLASH_LOG_WARN, "%s", dflash_last_error());
  char *why = df_asprintf("cannot read fetch's settings: %s", dflash_last_error());
  char *where = df_strdup(loc);
  if (!why || !where || b->n_settings_failed == DF_ARRAY_LEN(b->settings_failed)) {
    free(why), free(where);
    return why && where ? DFLASH_OK : df_error_nomem("dataset build: settings");
  }
  b->settings_failed[b->n_settings_failed++] = (df_build_failed){where, why};
  return DFLASH_OK;
}

/* The settings at `loc`, merged into b->fetch: two fetch outputs must agree. */
static dflash_status add_location(df_build *b, const char *loc) {
  df_build_fetch v = {0};
  bool unreadable = false;
  dflash_status st = read_view(b, loc, &v, &unreadable);
  if (st && unreadable && dflash_storage_is_remote(loc)) st = note_unreadable(b, loc);
  if (!st && v.where && !b->fetch.where) b->fetch = v, v.where = NULL;
  if (!st && v.where && !same_view(&v, &b->fetch))
    st = df_error(DFLASH_E_MISMATCH,
                  "dataset build: %s and %s record other family or thinking settings: "
                  "tokenize the two fetch outputs apart",
                  b->fetch.where, v.where);
  free(v.where);
  return st;
}

/* A build option against the file: refused, naming both. */
static dflash_status check_options(df_build *b) {
  const df_build_fetch *v = &b->fetch;
  const char *tmpl = b->opts.template_name;
  bool fam_ok = !strcmp(v->family, "none") || !strncmp(tmpl, v->family, strlen(v->family));
  if (!fam_ok)
    return df_error(DFLASH_E_MISMATCH,
                    "dataset build: template \"%s\" (--template) contradicts %s: fetched for "
                    "family \"%s\" (a %s* template)",
                    tmpl, v->where, v->family, v->family);
  if (v->thinking == 1 && b->opts.no_thinking)
    return df_error(DFLASH_E_MISMATCH,
                    "dataset build: no_thinking (--no-thinking) contradicts %s: fetched with "
                    "%s true (thinking on)",
                    v->where, v->thinking_key);
  return DFLASH_OK;
}

dflash_status df_build_read_settings(df_build *b, const char *const *inputs, size_t n) {
  b->preserve_thinking = 0;
  dflash_status st = DFLASH_OK;
  char *prev = NULL; /* inputs side by side share one file: read it once */
  for (size_t i = 0; !st && i < n; i++) {
    char *loc = settings_location(inputs[i]);
    if (!loc) st = df_error_nomem("dataset build: settings");
    else if (!prev || strcmp(loc, prev)) st = add_location(b, loc);
    free(prev);
    prev = loc;
  }
  free(prev);
  if (st || !b->fetch.where) return st;
  if ((st = check_options(b))) return st;
  if (b->fetch.thinking == 0) b->opts.no_thinking = 1;
  if (b->fetch.preserve == 1) b->preserve_thinking = 1;
  df_log(DFLASH_LOG_INFO, "dataset build: rendering as fetched (%s): family %s, thinking %s%s",
         b->fetch.where, b->fetch.family, b->opts.no_thinking ? "off" : "on",
         b->preserve_thinking ? ", preserve_thinking" : "");
  return DFLASH_OK;
}

void df_build_reject_settings(df_build *b) {
  for (size_t i = 0; i < b->n_settings_failed; i++) {
    df_build_reject(b, b->settings_failed[i].where, 0, b->settings_failed[i].why);
    b->stats.unreadable++;
  }
}

void df_build_free_settings(df_build *b) {
  for (size_t i = 0; i < b->n_settings_failed; i++) {
    free(b->settings_failed[i].where);
    free(b->settings_failed[i].why);
  }
  b->n_settings_failed = 0;
  free(b->fetch.where);
  b->fetch.where = NULL;
}
