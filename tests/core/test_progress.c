#include <dflash/progress.h>
#include <pty.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

START_TEST(plain_output_when_not_a_tty) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  dflash_progress *p;
  ck_assert_ok(dflash_progress_create(f, "tokenize", "samples", 200, 3600, &p));
  dflash_progress_update(p, 50, NULL); /* within the interval: nothing drawn */
  fflush(f);
  ck_assert_uint_eq(len, 0);
  dflash_progress_update(p, 200, "loss 1.5");
  dflash_progress_finish(p);
  dflash_progress_free(p);
  fclose(f);
  ck_assert_msg(strstr(buf, "tokenize: 200/200 samples (100.0%)") != NULL, "got %s", buf);
  ck_assert_msg(strstr(buf, "loss 1.5") != NULL, "got %s", buf);
  /* 200 done within a few microseconds: over at least 1 s, not millions per second */
  ck_assert_msg(strstr(buf, ", 200.0 samples/s,") != NULL, "got %s", buf);
  ck_assert_msg(strchr(buf, '\r') == NULL, "carriage return in plain output");
  free(buf);
}
END_TEST

START_TEST(live_bar_on_a_tty) {
  int master, slave;
  ck_assert_int_eq(openpty(&master, &slave, NULL, NULL, NULL), 0);
  FILE *f = fdopen(slave, "w");
  dflash_progress *p;
  ck_assert_ok(dflash_progress_create(f, "train", "steps", 10, 0, &p));
  dflash_progress_update(p, 5, "loss 3.2");
  dflash_progress_update(p, 10, NULL); /* within 0.1 s of the last draw: not drawn */
  dflash_progress_finish(p);           /* draws the final state */
  dflash_progress_free(p);
  fclose(f);
  char buf[4096];
  ssize_t n = read(master, buf, sizeof buf - 1);
  close(master);
  ck_assert_int_gt(n, 0);
  buf[n] = '\0';
  /* A redrawn line (carriage return + clear), a bar and the final count. */
  ck_assert_msg(strstr(buf, "\r\033[Ktrain [") != NULL, "got %s", buf);
  ck_assert_msg(strstr(buf, "########################################] 100.0% 10/10 steps") != NULL,
                "got %s", buf);
}
END_TEST

TCase *tc_progress(void) {
  TCase *tc = tcase_create("progress");
  tcase_add_test(tc, plain_output_when_not_a_tty);
  tcase_add_test(tc, live_bar_on_a_tty);
  return tc;
}
