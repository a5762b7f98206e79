/* Incremental server-sent-events parser (the WHATWG event-stream format).
 * Network reads split events, lines and even "\r\n" pairs anywhere, so all
 * state lives in df_sse between calls. */
#include "fetch_internal.h"

#include <stdlib.h>
#include <string.h>

static dflash_status dispatch(df_sse *p, df_sse_event_fn fn, void *user) {
  dflash_status st = DFLASH_OK;
  if (p->has_data) {
    /* The last data line's '\n' is not part of the data (the spec strips one LF). */
    size_t len = p->data.len - 1;
    p->data.data[len] = '\0';
    if (fn(user, p->event.len ? p->event.data : "", p->data.data, len)) st = DFLASH_E_CANCELLED;
  }
  p->data.len = 0;
  p->event.len = 0;
  p->has_data = false;
  return st;
}

/* One complete line (without its terminator). */
static dflash_status process_line(df_sse *p, const char *s, size_t n, df_sse_event_fn fn,
                                  void *user) {
  if (n == 0) return dispatch(p, fn, user);
  if (s[0] == ':') return DFLASH_OK; /* comment: keep-alive */
  const char *colon = memchr(s, ':', n);
  size_t name_len = colon ? (size_t)(colon - s) : n;
  const char *value = colon ? colon + 1 : s + n;
  size_t value_len = (size_t)(s + n - value);
  if (value_len && value[0] == ' ') {
    value++;
    value_len--;
  }
  dflash_status st = DFLASH_OK;
  if (name_len == 4 && !memcmp(s, "data", 4)) {
    if ((st = df_buf_append(&p->data, value, value_len))) return st;
    st = df_buf_append(&p->data, "\n", 1);
    p->has_data = true;
  } else if (name_len == 5 && !memcmp(s, "event", 5)) {
    p->event.len = 0;
    st = df_buf_append(&p->event, value, value_len);
  }
  /* "id" and "retry" do not matter for a single POST stream. */
  return st;
}

dflash_status df_sse_feed(df_sse *p, const char *buf, size_t n, df_sse_event_fn fn, void *user) {
  size_t i = 0;
  if (!n) return DFLASH_OK;                /* an empty read must not forget a pending "\r" */
  if (p->last_cr && buf[0] == '\n') i = 1; /* second half of a "\r\n" split by a read */
  p->last_cr = false;
  while (i < n) {
    size_t j = i;
    while (j < n && buf[j] != '\n' && buf[j] != '\r') j++;
    if (j == n) return df_buf_append(&p->line, buf + i, n - i); /* unfinished line */
    dflash_status st;
    if (p->line.len) { /* the line began in an earlier read */
      if ((st = df_buf_append(&p->line, buf + i, j - i))) return st;
      st = process_line(p, p->line.data, p->line.len, fn, user);
      p->line.len = 0;
    } else {
      st = process_line(p, buf + i, j - i, fn, user);
    }
    if (st) return st;
    if (buf[j] == '\r') {
      if (j + 1 == n) p->last_cr = true;
      else if (buf[j + 1] == '\n') j++;
    }
    i = j + 1;
  }
  return DFLASH_OK;
}

void df_sse_reset(df_sse *p) {
  p->line.len = p->data.len = p->event.len = 0;
  p->has_data = p->last_cr = false;
}

void df_sse_free(df_sse *p) {
  df_buf_free(&p->line);
  df_buf_free(&p->data);
  df_buf_free(&p->event);
  memset(p, 0, sizeof *p);
}
