/* Live progress bar on a TTY, periodic plain lines elsewhere. */
#include <dflash/progress.h>

#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct dflash_progress {
  dflash_progress_write_fn write;
  void *user;
  char *label;
  char *unit;
  uint64_t total;
  uint64_t done;
  bool tty;
  bool finished;
  double interval;
  double start;
  double last_draw;
  char note[1024]; /* fetch's note names every server (about 30 bytes each) */
};

/* The default sink: standard error, flushed after every piece. */
static void write_stderr(const char *text, size_t len, void *user) {
  (void)user;
  fwrite(text, 1, len, stderr);
  fflush(stderr);
}

DFLASH_API dflash_status dflash_progress_create(dflash_progress_write_fn write, void *user,
                                                int32_t tty, const char *label, const char *unit,
                                                uint64_t total, double interval_s,
                                                dflash_progress **out) {
  DF_CHECK_ARG(out);
  *out = NULL;
  dflash_progress *p = calloc(1, sizeof *p);
  if (!p) return df_error_nomem("progress reporter");
  p->write = write ? write : write_stderr;
  p->user = write ? user : NULL;
  p->label = df_strdup(label ? label : "");
  p->unit = df_strdup(unit ? unit : "");
  if (!p->label || !p->unit) {
    dflash_progress_free(p);
    return df_error_nomem("progress reporter");
  }
  p->total = total;
  p->tty = write ? tty != 0 : isatty(STDERR_FILENO) == 1;
  /* A terminal redraws often; a log gets one line per interval. */
  p->interval = p->tty ? 0.1 : (interval_s > 0 ? interval_s : 10.0);
  p->start = df_now_seconds();
  p->last_draw = p->start;
  *out = p;
  return DFLASH_OK;
}

static void format_duration(double s, char *buf, size_t n) {
  if (s < 0 || s > 1e8) {
    snprintf(buf, n, "?");
    return;
  }
  unsigned long t = (unsigned long)(s + 0.5);
  if (t >= 3600) snprintf(buf, n, "%lu:%02lu:%02lu", t / 3600, (t / 60) % 60, t % 60);
  else snprintf(buf, n, "%lu:%02lu", t / 60, t % 60);
}

/* One piece of text to the sink (a line is one piece; longer than the stack buffer only with
 * a very long label or unit). */
static void emit(dflash_progress *p, const char *fmt, ...) DF_PRINTF(2, 3);
static void emit(dflash_progress *p, const char *fmt, ...) {
  char small[2048], *buf = small;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(small, sizeof small, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if ((size_t)n >= sizeof small) {
    buf = malloc((size_t)n + 1);
    if (!buf) return;
    va_start(ap, fmt);
    vsnprintf(buf, (size_t)n + 1, fmt, ap);
    va_end(ap);
  }
  p->write(buf, (size_t)n, p->user);
  if (buf != small) free(buf);
}

static void draw(dflash_progress *p, double now) {
  double elapsed = now - p->start;
  /* At least 1 s: what a job finds done at once (a resume, a fast first batch) is not
   * divided by the microseconds since the start (millions of units/s). */
  double rate = (double)p->done / (elapsed > 1.0 ? elapsed : 1.0);
  char el[32], eta[32], bar[41];
  format_duration(elapsed, el, sizeof el);
  if (p->total && rate > 0)
    format_duration((double)(p->total - (p->done < p->total ? p->done : p->total)) / rate, eta,
                    sizeof eta);
  else snprintf(eta, sizeof eta, "?");
  const char *sep = p->note[0] ? "  " : "";
  if (p->tty && p->total) {
    size_t width = sizeof bar - 1,
           fill = (size_t)((double)width * (double)p->done / (double)p->total);
    if (fill > width) fill = width;
    memset(bar, '#', fill);
    memset(bar + fill, '.', width - fill);
    bar[width] = '\0';
    emit(p, "\r\033[K%s [%s] %5.1f%% %llu/%llu %s  %.1f %s/s  %s<%s%s%s", p->label, bar,
         100.0 * (double)p->done / (double)p->total, (unsigned long long)p->done,
         (unsigned long long)p->total, p->unit, rate, p->unit, el, eta, sep, p->note);
  } else if (p->tty) {
    emit(p, "\r\033[K%s %llu %s  %.1f %s/s  %s%s%s", p->label, (unsigned long long)p->done, p->unit,
         rate, p->unit, el, sep, p->note);
  } else if (p->total) {
    emit(p, "%s: %llu/%llu %s (%.1f%%), %.1f %s/s, elapsed %s, ETA %s%s%s\n", p->label,
         (unsigned long long)p->done, (unsigned long long)p->total, p->unit,
         100.0 * (double)p->done / (double)p->total, rate, p->unit, el, eta, sep, p->note);
  } else {
    emit(p, "%s: %llu %s, %.1f %s/s, elapsed %s%s%s\n", p->label, (unsigned long long)p->done,
         p->unit, rate, p->unit, el, sep, p->note);
  }
  p->last_draw = now;
}

DFLASH_API void dflash_progress_update(dflash_progress *p, uint64_t done, const char *note) {
  if (!p || p->finished) return;
  p->done = done;
  if (note) snprintf(p->note, sizeof p->note, "%s", note);
  double now = df_now_seconds();
  if (now - p->last_draw >= p->interval) draw(p, now);
}

DFLASH_API void dflash_progress_finish(dflash_progress *p) {
  if (!p || p->finished) return;
  draw(p, df_now_seconds());
  if (p->tty) p->write("\n", 1, p->user);
  p->finished = true;
}

DFLASH_API void dflash_progress_free(dflash_progress *p) {
  if (!p) return;
  if (p->label && p->unit) dflash_progress_finish(p);
  free(p->label);
  free(p->unit);
  free(p);
}
