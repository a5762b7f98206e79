/*
 * Drawing progress for long jobs (fetch, tokenize, train).
 *
 * The long jobs report through callbacks with a stats struct
 * (dflash_fetch_progress_fn, dflash_dataset_build_progress_fn,
 * dflash_train_progress_fn); a caller that wants a bar draws it from there
 * with a reporter, as the dflash command and the Python package do. The
 * library never prints by itself: a reporter hands its text to the caller's
 * write callback (or, when the caller passes none, to standard error). On a
 * terminal it redraws one live line (bar, count, rate, ETA); on anything else
 * (a log file, a pipe) it writes a plain line at most every `interval_s`
 * seconds, so logs stay readable.
 *
 * A reporter is single-owner (see dflash.h).
 */
#ifndef DFLASH_PROGRESS_H
#define DFLASH_PROGRESS_H

#include <dflash/dflash.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dflash_progress dflash_progress;

/*
 * Where a reporter's text goes: `len` bytes at `text` (not NUL-terminated),
 * called from the thread that calls dflash_progress_update / _finish. A live
 * line is redrawn with "\r\033[K"; a plain line ends with "\n".
 */
typedef void (*dflash_progress_write_fn)(const char *text, size_t len, void *user);

/*
 * Start a reporter handing its text to `write` (with `user`). `tty` 1 redraws
 * one live line (the caller writes to a terminal), 0 writes plain lines. With
 * `write` NULL the text goes to standard error, and `tty` is ignored: the
 * reporter redraws when standard error is a terminal (the choice is made
 * once, here). `label` names the job, `unit` the things counted ("samples",
 * "tok"); `total` may be 0 when unknown (no bar or ETA then). `interval_s`
 * <= 0 picks 10 s for plain output.
 */
DFLASH_API dflash_status dflash_progress_create(dflash_progress_write_fn write, void *user,
                                                int32_t tty, const char *label, const char *unit,
                                                uint64_t total, double interval_s,
                                                dflash_progress **out);
/* Report that `done` units are complete so far (absolute, not an increment).
 * `note` (may be NULL) is appended, e.g. "loss 2.31". Cheap when nothing is
 * due to be drawn. */
DFLASH_API void dflash_progress_update(dflash_progress *p, uint64_t done, const char *note);
/* Draw the final state and end the line. */
DFLASH_API void dflash_progress_finish(dflash_progress *p);
/* NULL-safe; finishes first when it was not finished. */
DFLASH_API void dflash_progress_free(dflash_progress *p);

#ifdef __cplusplus
}
#endif

#endif /* DFLASH_PROGRESS_H */
