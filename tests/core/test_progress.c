#include <dflash/progress.h>
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
  ck_assert_msg(strchr(buf, '\r') == NULL, "carriage return in plain output");
  free(buf);
}
END_TEST

TCase *tc_progress(void) {
  TCase *tc = tcase_create("progress");
  tcase_add_test(tc, plain_output_when_not_a_tty);
  return tc;
}
