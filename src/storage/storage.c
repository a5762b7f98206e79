/* The public storage API: configuration from options and the environment,
 * and one function per operation dispatching to S3 or the local backend. */
#include <math.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "storage_internal.h"

static void storage_options_defaults(dflash_storage_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->max_attempts = 8;
  o->backoff_base_s = 0.2;
  o->backoff_max_s = 20;
  o->connect_timeout_s = 10;
  o->idle_timeout_s = 60;
  o->part_size = 8u << 20;
  o->multipart_threshold = 16u << 20;
}

DF_DEFINE_INIT(dflash_storage_options, storage_options_defaults)

/* An option, else the first set environment variable, else a default. */
static char *pick(const char *opt, const char *env1, const char *env2, const char *dflt) {
  const char *v = opt;
  if (!v || !*v) v = env1 ? getenv(env1) : NULL;
  if ((!v || !*v) && env2) v = getenv(env2);
  if (!v || !*v) v = dflt;
  return v ? df_strdup(v) : NULL;
}

static dflash_status resolve_addressing(df_s3_config *c, int opt) {
  if (opt == DFLASH_S3_ADDRESSING_PATH || opt == DFLASH_S3_ADDRESSING_VIRTUAL) {
    c->addressing = opt;
    return DFLASH_OK;
  }
  if (opt != DFLASH_S3_ADDRESSING_AUTO)
    return df_error(DFLASH_E_INVALID_ARG,
                    "storage options: addressing %d is not a dflash_s3_addressing", opt);
  const char *env = getenv("DFLASH_S3_ADDRESSING");
  if (env && *env) {
    if (!strcmp(env, "path")) c->addressing = DFLASH_S3_ADDRESSING_PATH;
    else if (!strcmp(env, "virtual")) c->addressing = DFLASH_S3_ADDRESSING_VIRTUAL;
    else return df_error(DFLASH_E_CONFIG, "DFLASH_S3_ADDRESSING=%s: expected path or virtual", env);
    return DFLASH_OK;
  }
  c->addressing = c->endpoint_custom ? DFLASH_S3_ADDRESSING_PATH : DFLASH_S3_ADDRESSING_VIRTUAL;
  return DFLASH_OK;
}

static dflash_status resolve_endpoint(df_s3_config *c, const char *opt) {
  char *ep = pick(opt, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", NULL);
  c->endpoint_custom = ep != NULL;
  if (!ep) ep = df_asprintf("https://s3.%s.amazonaws.com", c->region);
  if (!ep) return df_error_nomem("endpoint");
  size_t n = strlen(ep);
  while (n && ep[n - 1] == '/') ep[--n] = 0;
  c->endpoint = ep;
  if (strncmp(ep, "http://", 7) && strncmp(ep, "https://", 8))
    return df_error(DFLASH_E_CONFIG, "S3 endpoint \"%s\" must start with http:// or https://", ep);
  const char *host = strstr(ep, "://") + 3;
  if (!*host || strchr(host, '/') || strchr(host, '?'))
    return df_error(DFLASH_E_CONFIG, "S3 endpoint \"%s\": expected scheme://host[:port]", ep);
  return DFLASH_OK;
}

static uint32_t or_default(uint32_t v, uint32_t d) { return v ? v : d; }

/* Seconds (an option) to whole milliseconds, rounded up so that a positive time stays
 * positive; 0 gives `dflt_s`. DFLASH_E_CONFIG naming the field outside [0, 2e6] or NaN. */
static dflash_status seconds_ms(double s, double dflt_s, const char *name, uint32_t *ms) {
  if (!(s >= 0 && s <= 2e6))
    return df_error(DFLASH_E_CONFIG, "storage options: %s %g is not a time in seconds in [0, 2e6]",
                    name, s);
  *ms = (uint32_t)ceil((s ? s : dflt_s) * 1000.0);
  return DFLASH_OK;
}

static dflash_status configure(df_s3_config *c, const dflash_storage_options *o) {
  dflash_storage_options d;
  dflash_storage_options_default(&d);
  c->region = pick(o->region, "AWS_REGION", "AWS_DEFAULT_REGION", "us-east-1");
  c->key_id = pick(o->access_key_id, "AWS_ACCESS_KEY_ID", NULL, NULL);
  c->secret = pick(o->secret_access_key, "AWS_SECRET_ACCESS_KEY", NULL, NULL);
  c->token = pick(o->session_token, "AWS_SESSION_TOKEN", NULL, NULL);
  if (!c->region) return df_error_nomem("storage options");
  dflash_status cred = df_s3_profile_credentials(c);
  if (cred) return cred;
  if (strlen(c->region) > 64 || strchr(c->region, ':'))
    return df_error(DFLASH_E_CONFIG, "AWS region \"%s\" is not a region name", c->region);
  dflash_status s = resolve_endpoint(c, o->endpoint_url);
  if (!s) s = resolve_addressing(c, o->addressing);
  c->max_attempts = or_default(o->max_attempts, d.max_attempts);
  if (!s)
    s = seconds_ms(o->backoff_base_s, d.backoff_base_s, "backoff_base_s", &c->backoff_base_ms);
  if (!s) s = seconds_ms(o->backoff_max_s, d.backoff_max_s, "backoff_max_s", &c->backoff_max_ms);
  if (!s)
    s = seconds_ms(o->connect_timeout_s, d.connect_timeout_s, "connect_timeout_s",
                   &c->connect_timeout_ms);
  if (!s)
    s = seconds_ms(o->idle_timeout_s, d.idle_timeout_s, "idle_timeout_s", &c->idle_timeout_ms);
  if (!s) s = seconds_ms(o->request_timeout_s, 0, "request_timeout_s", &c->request_timeout_ms);
  c->part_size = o->part_size ? o->part_size : d.part_size;
  c->multipart_threshold = o->multipart_threshold ? o->multipart_threshold : d.multipart_threshold;
  const char *trace = getenv("DFLASH_S3_TRACE");
  c->trace = o->trace || (trace && *trace && strcmp(trace, "0"));
  if (!s && c->part_size < (5u << 20))
    s = df_error(DFLASH_E_CONFIG, "storage options: part_size %llu is below S3's 5 MiB minimum",
                 (unsigned long long)c->part_size);
  if (!s && c->part_size > ((uint64_t)5 << 30))
    s = df_error(DFLASH_E_CONFIG, "storage options: part_size above S3's 5 GiB maximum");
  return s;
}

static void config_clear(df_s3_config *c) {
  free(c->region);
  free(c->endpoint);
  free(c->key_id);
  free(c->secret);
  free(c->token);
  free(c->cred_note);
  memset(c, 0, sizeof *c);
}

DFLASH_API dflash_status dflash_storage_create(const dflash_storage_options *opts,
                                               dflash_storage **out) {
  DF_CHECK_ARG(out);
  *out = NULL;
  dflash_storage_options d;
  dflash_storage_options_default(&d);
  dflash_status s = df_opts_in(&d, opts, sizeof d, "dflash_storage_options");
  if (s) return s;
  dflash_storage *st = calloc(1, sizeof *st);
  if (!st) return df_error_nomem("storage client");
  s = configure(&st->cfg, &d);
  if (s) {
    dflash_storage_free(st);
    return s;
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  st->rng = ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^ ((uint64_t)getpid() << 40) ^
            (uint64_t)(uintptr_t)st;
  if (!st->rng) st->rng = 0x9E3779B97F4A7C15ull;
  *out = st;
  return DFLASH_OK;
}

DFLASH_API void dflash_storage_free(dflash_storage *st) {
  if (!st) return;
  df_curl_cleanup(st->curl);
  config_clear(&st->cfg);
  free(st);
}

DFLASH_API int dflash_storage_is_remote(const char *location) {
  return location && !strncmp(location, "s3://", 5);
}

DFLASH_API void dflash_storage_buffer_free(void *buf) { free(buf); }

void *df_alloc_large(size_t n) {
  if (n < DF_LARGE_ALLOC) return malloc(n ? n : 1);
  void *p = NULL;
  if (posix_memalign(&p, (size_t)2 << 20, n)) return NULL;
#ifdef MADV_HUGEPAGE
  madvise(p, n, MADV_HUGEPAGE); /* advice only: where THP is off nothing changes */
#endif
  return p;
}

DFLASH_API dflash_status dflash_storage_read(dflash_storage *st, const char *location, void **data,
                                             size_t *len) {
  DF_CHECK_ARG(st && data && len);
  *data = NULL;
  *len = 0;
  df_loc l;
  dflash_status s = df_loc_parse_object(location, &l);
  if (s) return s;
  if (l.s3) {
    df_buf b = {0};
    s = df_s3_get_all(st, &l, &b);
    if (!s) {
      *data = b.data;
      *len = b.len;
    } else {
      df_buf_free(&b);
    }
  } else {
    char *text;
    s = df_read_file(l.path, &text, len);
    if (!s) *data = text;
  }
  df_loc_clear(&l);
  return s;
}

DFLASH_API dflash_status dflash_storage_read_range(dflash_storage *st, const char *location,
                                                   uint64_t offset, void *buf, size_t len,
                                                   size_t *got) {
  DF_CHECK_ARG(st && got && (buf || !len));
  *got = 0;
  uint64_t end;
  if (!df_add_u64(offset, len, &end))
    return df_error(DFLASH_E_OVERFLOW, "%s: range overflows", location);
  df_loc l;
  dflash_status s = df_loc_parse_object(location, &l);
  if (s) return s;
  s = l.s3 ? df_s3_get_range(st, &l, offset, buf, len, got)
           : df_local_read_range(&l, offset, buf, len, got);
  df_loc_clear(&l);
  return s;
}

DFLASH_API dflash_status dflash_storage_stat(dflash_storage *st, const char *location,
                                             dflash_storage_info *out) {
  DF_CHECK_ARG(st && out);
  dflash_storage_info info = {.struct_size = sizeof info};
  dflash_status s = df_opts_out(out, &info, sizeof info, "dflash_storage_info");
  if (s) return s;
  df_loc l;
  s = df_loc_parse_object(location, &l);
  if (s) return s;
  s = l.s3 ? df_s3_head(st, &l, &info) : df_local_stat(&l, &info);
  df_loc_clear(&l);
  return s ? s : df_opts_out(out, &info, sizeof info, "dflash_storage_info");
}

DFLASH_API dflash_status dflash_storage_write(dflash_storage *st, const char *location,
                                              const void *data, size_t len) {
  DF_CHECK_ARG(st && (data || !len));
  df_loc l;
  dflash_status s = df_loc_parse_object(location, &l);
  if (s) return s;
  if (l.s3) s = df_s3_put(st, &l, data, len);
  else if (!(s = df_local_mkdirs_for(l.path)))
    s = df_write_file_atomic(l.path, data ? data : "", len);
  df_loc_clear(&l);
  return s;
}

DFLASH_API dflash_status dflash_storage_delete(dflash_storage *st, const char *location) {
  DF_CHECK_ARG(st);
  df_loc l;
  dflash_status s = df_loc_parse_object(location, &l);
  if (s) return s;
  s = l.s3 ? df_s3_delete(st, &l) : df_local_delete(&l);
  df_loc_clear(&l);
  return s;
}

/* ---- listings ------------------------------------------------------------ */

dflash_status df_listing_add(dflash_storage_listing *l, char *name, uint64_t size) {
  if (!name) return df_error_nomem("listing entry");
  if (l->n == l->cap) {
    size_t cap = l->cap ? l->cap * 2 : 64;
    df_list_entry *items = realloc(l->items, cap * sizeof *items);
    if (!items) {
      free(name);
      return df_error_nomem("listing");
    }
    l->items = items;
    l->cap = cap;
  }
  l->items[l->n++] = (df_list_entry){name, size};
  return DFLASH_OK;
}

static int cmp_entry(const void *a, const void *b) {
  return strcmp(((const df_list_entry *)a)->name, ((const df_list_entry *)b)->name);
}

void df_listing_sort(dflash_storage_listing *l) {
  if (l->n > 1) qsort(l->items, l->n, sizeof *l->items, cmp_entry);
}

DFLASH_API dflash_status dflash_storage_list(dflash_storage *st, const char *prefix,
                                             dflash_storage_listing **out) {
  DF_CHECK_ARG(st && out);
  *out = NULL;
  df_loc p;
  dflash_status s = df_loc_parse(prefix, &p);
  if (s) return s;
  dflash_storage_listing *l = calloc(1, sizeof *l);
  if (!l) s = df_error_nomem("listing");
  else s = p.s3 ? df_s3_list(st, &p, l) : df_local_list(&p, l);
  df_loc_clear(&p);
  if (s) {
    dflash_storage_listing_free(l);
    return s;
  }
  df_listing_sort(l);
  *out = l;
  return DFLASH_OK;
}

DFLASH_API size_t dflash_storage_listing_count(const dflash_storage_listing *l) {
  return l ? l->n : 0;
}

DFLASH_API dflash_status dflash_storage_listing_get(const dflash_storage_listing *l, size_t index,
                                                    const char **location, uint64_t *size) {
  DF_CHECK_ARG(l);
  if (index >= l->n) return df_error(DFLASH_E_RANGE, "listing entry %zu of %zu", index, l->n);
  if (location) *location = l->items[index].name;
  if (size) *size = l->items[index].size;
  return DFLASH_OK;
}

DFLASH_API void dflash_storage_listing_free(dflash_storage_listing *l) {
  if (!l) return;
  for (size_t i = 0; i < l->n; i++) free(l->items[i].name);
  free(l->items);
  free(l);
}
