#include <dflash/progress.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

/* The caller's sink: the text appended to a growing buffer, one call per piece. */
typedef struct {
  char buf[8192];
  size_t len;
  int calls;
} sink;

static void to_sink(const char *text, size_t len, void *user) {
  sink *s = user;
  ck_assert_uint_lt(s->len + len, sizeof s->buf);
  memcpy(s->buf + s->len, text, len);
  s->len += len;
  s->buf[s->len] = '\0';
  s->calls++;
}

START_TEST(plain_output_when_not_a_tty) {
  sink s = {{0}, 0, 0};
  dflash_progress *p;
  ck_assert_ok(dflash_progress_create(to_sink, &s, 0, "tokenize", "samples", 200, 3600, &p));
  dflash_progress_update(p, 50, NULL); /* within the interval: nothing drawn */
  ck_assert_uint_eq(s.len, 0);
  dflash_progress_update(p, 200, "loss 1.5");
  dflash_progress_finish(p);
  dflash_progress_free(p);
  ck_assert_msg(strstr(s.buf, "tokenize: 200/200 samples (100.0%)") != NULL, "got %s", s.buf);
  ck_assert_msg(strstr(s.buf, "loss 1.5") != NULL, "got %s", s.buf);
  /* 200 done within a few microseconds: over at least 1 s, not millions per second */
  ck_assert_msg(strstr(s.buf, ", 200.0 samples/s,") != NULL, "got %s", s.buf);
  ck_assert_msg(strchr(s.buf, '\r') == NULL, "carriage return in plain output");
  ck_assert_int_eq(s.calls, 1); /* one line, one call */
}
END_TEST

START_TEST(live_bar_on_a_tty) {
  sink s = {{0}, 0, 0};
  dflash_progress *p;
  ck_assert_ok(dflash_progress_create(to_sink, &s, 1, "train", "steps", 10, 0, &p));
  dflash_progress_update(p, 5, "loss 3.2");
  dflash_progress_update(p, 10, NULL); /* within 0.1 s of the last draw: not drawn */
  dflash_progress_finish(p);           /* draws the final state */
  dflash_progress_free(p);
  /* A redrawn line (carriage return + clear), a bar and the final count, ended once. */
  ck_assert_msg(strstr(s.buf, "\r\033[Ktrain [") != NULL, "got %s", s.buf);
  ck_assert_msg(strstr(s.buf, "########################################] 100.0% 10/10 steps") !=
                    NULL,
                "got %s", s.buf);
  ck_assert_msg(s.len && s.buf[s.len - 1] == '\n' && strchr(s.buf, '\n') == s.buf + s.len - 1,
                "got %s", s.buf);
}
END_TEST

START_TEST(a_long_note_is_written_whole) {
  sink s = {{0}, 0, 0};
  char note[1000];
  memset(note, 'n', sizeof note - 1);
  note[sizeof note - 1] = '\0';
  char label[1500];
  memset(label, 'l', sizeof label - 1);
  label[sizeof label - 1] = '\0';
  dflash_progress *p;
  ck_assert_ok(dflash_progress_create(to_sink, &s, 0, label, "x", 0, 1, &p));
  dflash_progress_update(p, 7, note);
  dflash_progress_free(p); /* finishes: one plain line */
  ck_assert_int_eq(s.calls, 1);
  ck_assert_msg(strncmp(s.buf, label, sizeof label - 1) == 0, "label cut");
  ck_assert_msg(strstr(s.buf, note) != NULL && s.buf[s.len - 1] == '\n', "note cut");
}
END_TEST

TCase *tc_progress(void) {
  TCase *tc = tcase_create("progress");
  tcase_add_test(tc, plain_output_when_not_a_tty);
  tcase_add_test(tc, live_bar_on_a_tty);
  tcase_add_test(tc, a_long_note_is_written_whole);
  return tc;
}
