/*
 * The spool (include/dflash/hidden.h): a bounded hidden-state store that a
 * trainer consumes while a producer writes it, as two processes that share
 * nothing but the spool's files (a local folder or an s3:// prefix), so
 * everything goes through dflash_storage and every step is crash-safe:
 *
 *   producer: wait until the shards present total < budget; PUT the shard's
 *             .ids; write the shard (local: temp, fsync, rename; s3: one PUT
 *             of a locally staged file). End of epoch: PUT eNNNNN.end.
 *   consumer: read shards in order (s3: one GET each into a reused memory buffer, the next
 *             shard read ahead on a thread while this one is used; local: mapped); after its
 *             own state is durable, PUT "consumed" (epoch, shard), then delete the shards
 *             before it. Reading ahead changes nothing in the spool.
 *
 * A restarted producer rebuilds its epoch from the .ids files: a shard whose
 * .ids exists but which is neither present nor consumed died in the crash,
 * so it is dropped and its samples are taken again. "consumed" is read after
 * the listing, and the consumer writes it before deleting, so a shard the
 * listing misses because it was just deleted is always counted as consumed.
 */
#include <dflash/storage.h>
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "hidden.h"
#include "storage/stage.h"
#include "spool_internal.h"

/* ---- names and small files ---------------------------------------------------------------- */

char *df_sp_path(const char *base, const char *name) { return df_stage_join(base, name); }

char *df_sp_shard_loc(const char *base, int32_t e, uint64_t s, const char *ext) {
  char name[64];
  snprintf(name, sizeof name, "e%05d-s%06" PRIu64 ".%s", e, s, ext);
  return df_sp_path(base, name);
}

char *df_sp_end_loc(const char *base, int32_t e) {
  char name[32];
  snprintf(name, sizeof name, "e%05d.end", e);
  return df_sp_path(base, name);
}

static bool parse_name(const char *name, sp_entry *out) {
  int e, n = 0;
  unsigned long long s;
  char ext[16];
  if (sscanf(name, "e%5d.end%n", &e, &n) == 1 && n > 0 && !name[n]) {
    *out = (sp_entry){SP_END, e, 0, 0};
    return true;
  }
  n = 0;
  if (sscanf(name, "e%5d-s%6llu.%15[a-z]%n", &e, &s, ext, &n) != 3 || name[n]) return false;
  if (!strcmp(ext, "safetensors")) *out = (sp_entry){SP_SHARD, e, s, 0};
  else if (!strcmp(ext, "ids")) *out = (sp_entry){SP_IDS, e, s, 0};
  else return false;
  return true;
}

dflash_status df_sp_scan(dflash_storage *st, const char *base, sp_scan *out) {
  memset(out, 0, sizeof *out);
  char *prefix = df_sp_path(base, "");
  dflash_storage_listing *l = NULL;
  dflash_status s = prefix ? dflash_storage_list(st, prefix, &l) : df_error_nomem("spool");
  size_t n = s ? 0 : dflash_storage_listing_count(l), plen = prefix ? strlen(prefix) : 0;
  if (!s && !(out->e = calloc(n + 1, sizeof *out->e))) s = df_error_nomem("spool listing");
  for (size_t i = 0; !s && i < n; i++) {
    const char *loc;
    uint64_t size;
    if ((s = dflash_storage_listing_get(l, i, &loc, &size))) break;
    sp_entry e;
    if (strchr(loc + plen, '/') || !parse_name(loc + plen, &e)) continue;
    e.size = size;
    out->e[out->n++] = e;
  }
  dflash_storage_listing_free(l);
  free(prefix);
  if (s) free(out->e), out->e = NULL;
  return s;
}


/* A small text object; DFLASH_E_NOT_FOUND (no message) when absent. */
dflash_status df_sp_read_small(dflash_storage *st, const char *loc, char **text) {
  size_t len;
  void *data;
  dflash_storage_info info = {.struct_size = sizeof info};
  /* Only a clear "absent" is absence: a failed request (after the client's retries) is an
   * error, never taken for a shard or marker that is not there. */
  dflash_status s = dflash_storage_stat(st, loc, &info);
  if (s == DFLASH_E_NOT_FOUND) dflash_clear_error();
  if (s) return s;
  s = dflash_storage_read(st, loc, &data, &len);
  if (s) return s;
  *text = df_strndup(data, len);
  dflash_storage_buffer_free(data);
  return *text ? DFLASH_OK : df_error_nomem("spool file");
}

bool df_sp_before(int32_t e, uint64_t s, int32_t me, uint64_t ms) {
  return e < me || (e == me && s < ms);
}

void df_sp_sleep_s(double s) {
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

/* Poll interval: quick at first, then at most a second. */
double df_sp_poll_step(double waited) { return waited < 1 ? 0.02 : waited < 10 ? 0.2 : 1.0; }
