/* libFuzzer target: the incremental SSE parser (src/fetch/sse.c) on arbitrary bytes.
 * The first byte is a seed for where the stream is cut into reads (up to 7 cuts,
 * fed through one parser, as libcurl would) and after how many events the callback
 * cancels; the rest is the stream. Checks, for every input:
 *  - the events equal those of a whole-buffer reference parser written here from the
 *    WHATWG event-stream rules (lines end at CRLF, LF or CR; ':' comments; "data" lines
 *    joined by '\n'; "event" names; an empty line dispatches when data was seen; an
 *    unterminated last event is dropped);
 *  - the same events however the stream is cut, and also fed byte by byte;
 *  - each event's data is NUL-terminated at its length;
 *  - a callback that returns non-zero stops the feed with DFLASH_E_CANCELLED after
 *    exactly that event.
 * Reads are never empty here: libcurl does not call its write callback with no bytes
 * in the middle of a body (an empty read between the '\r' and '\n' of a CRLF makes
 * df_sse_feed see two line ends). Like sse.c, the reference keeps a leading BOM (the
 * spec strips one; no server sends it). */
#include <stdlib.h>
#include <string.h>

#include "fetch/fetch_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct events {
  df_buf log; /* per event: len(event) event len(data) data */
  size_t n;
  size_t stop_after; /* cancel on this event (1-based); 0: never */
} events;

static void log_event(events *e, const char *event, size_t en, const char *data, size_t dn) {
  df_buf_append(&e->log, &en, sizeof en);
  df_buf_append(&e->log, event, en);
  df_buf_append(&e->log, &dn, sizeof dn);
  df_buf_append(&e->log, data, dn);
}

static int collect(void *user, const char *event, const char *data, size_t len) {
  events *e = user;
  if (!event || !data || data[len] != '\0') __builtin_trap();
  log_event(e, event, strlen(event), data, len);
  e->n++;
  return e->stop_after && e->n == e->stop_after;
}

/* The reference: one pass over the whole stream. */
static size_t reference(const char *s, size_t n, events *e) {
  df_buf dat = {0}, ev = {0};
  bool has_data = false;
  size_t i = 0;
  while (i < n) {
    size_t j = i;
    while (j < n && s[j] != '\r' && s[j] != '\n') j++;
    if (j == n) break; /* no terminator: not a line */
    const char *line = s + i;
    size_t len = j - i;
    i = j + 1 + (s[j] == '\r' && j + 1 < n && s[j + 1] == '\n');
    if (len == 0) {
      if (has_data) {
        /* the callback takes the name as a C string: it ends at a NUL */
        log_event(e, ev.len ? ev.data : "", ev.len ? strlen(ev.data) : 0, dat.data, dat.len - 1);
        e->n++;
        if (e->stop_after && e->n == e->stop_after) break;
      }
      dat.len = ev.len = 0;
      has_data = false;
      continue;
    }
    if (line[0] == ':') continue;
    size_t name = 0;
    while (name < len && line[name] != ':') name++;
    const char *val = line + name + (name < len);
    size_t vlen = len - name - (name < len);
    if (vlen && val[0] == ' ') val++, vlen--;
    if (name == 4 && !memcmp(line, "data", 4)) {
      df_buf_append(&dat, val, vlen);
      df_buf_append(&dat, "\n", 1);
      has_data = true;
    } else if (name == 5 && !memcmp(line, "event", 5)) {
      ev.len = 0;
      df_buf_append(&ev, val, vlen);
    }
  }
  df_buf_free(&dat);
  df_buf_free(&ev);
  return e->n;
}

/* Feed the stream in pieces ending at cuts[0..n_cuts) then at n; returns the status of
 * the last feed made (feeding stops at the first non-OK one). */
static dflash_status feed(const char *s, size_t n, const size_t *cuts, size_t n_cuts, events *e) {
  df_sse p = {0};
  dflash_status st = DFLASH_OK;
  size_t at = 0;
  for (size_t k = 0; k <= n_cuts && !st; k++) {
    size_t to = k < n_cuts ? cuts[k] : n;
    if (to > at) st = df_sse_feed(&p, s + at, to - at, collect, e);
    at = to;
  }
  df_sse_free(&p);
  return st;
}

static void same(const events *a, const events *b) {
  if (a->n != b->n || a->log.len != b->log.len ||
      (a->log.len && memcmp(a->log.data, b->log.data, a->log.len)))
    __builtin_trap();
}

static int cmp_size(const void *a, const void *b) {
  size_t x = *(const size_t *)a, y = *(const size_t *)b;
  return x < y ? -1 : x > y;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > 1 << 16) return 0;
  const char *s = (const char *)data + 1;
  size_t n = size - 1;
  uint32_t rng = data[0] * 2654435761u + 1;

  events want = {0};
  reference(s, n, &want);

  /* Whole, then cut at fuzzer-derived points. */
  events whole = {0};
  if (feed(s, n, NULL, 0, &whole)) __builtin_trap();
  same(&want, &whole);
  size_t cuts[7], n_cuts = 1 + data[0] % 7;
  for (size_t k = 0; k < n_cuts; k++) {
    rng = rng * 1103515245u + 12345u;
    cuts[k] = n ? (rng >> 8) % (n + 1) : 0;
  }
  qsort(cuts, n_cuts, sizeof *cuts, cmp_size);
  events split = {0};
  if (feed(s, n, cuts, n_cuts, &split)) __builtin_trap();
  same(&want, &split);

  /* Byte by byte (bounded: quadratic in the worst case through the buffers). */
  if (n <= 4096) {
    df_sse p = {0};
    events bytes = {0};
    for (size_t i = 0; i < n; i++)
      if (df_sse_feed(&p, s + i, 1, collect, &bytes)) __builtin_trap();
    same(&want, &bytes);
    df_sse_free(&p);
    df_buf_free(&bytes.log);
  }

  /* Cancel on event k: exactly k events, then DFLASH_E_CANCELLED. */
  if (want.n) {
    size_t k = 1 + data[0] % want.n;
    events ref_k = {.stop_after = k}, got_k = {.stop_after = k};
    reference(s, n, &ref_k);
    if (feed(s, n, cuts, n_cuts, &got_k) != DFLASH_E_CANCELLED) __builtin_trap();
    same(&ref_k, &got_k);
    df_buf_free(&ref_k.log);
    df_buf_free(&got_k.log);
  }

  df_buf_free(&want.log);
  df_buf_free(&whole.log);
  df_buf_free(&split.log);
  return 0;
}
