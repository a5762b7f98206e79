#include <dflash/train.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

START_TEST(anchors_follow_the_rule) {
  enum { S = 60, B = 4 };
  uint8_t mask[S];
  for (int i = 0; i < S; i++) mask[i] = !(i >= 10 && i < 20) && i != 33;
  int32_t out[64], n;
  ck_assert_ok(dflash_anchors_sample(mask, S, B, 64, 1, 0, out, &n));
  /* Every candidate: mask[p] && mask[p+1] && p + B <= S. */
  int expect = 0;
  for (int p = 0; p + B <= S; p++) expect += mask[p] && mask[p + 1];
  ck_assert_int_eq(n, expect);
  for (int i = 0; i < n; i++) {
    ck_assert(mask[out[i]] && mask[out[i] + 1] && out[i] + B <= S);
    if (i) ck_assert_int_lt(out[i - 1], out[i]); /* sorted, distinct */
  }
  ck_assert_ok(dflash_anchors_sample(mask, S, B, 5, 1, 0, out, &n));
  ck_assert_int_eq(n, 5);
}
END_TEST

START_TEST(anchors_deterministic_and_redrawn) {
  enum { S = 200 };
  uint8_t mask[S];
  memset(mask, 1, S);
  int32_t a[8], b[8], c[8], n;
  ck_assert_ok(dflash_anchors_sample(mask, S, 16, 8, 42, 3, a, &n));
  ck_assert_ok(dflash_anchors_sample(mask, S, 16, 8, 42, 3, b, &n));
  ck_assert_mem_eq(a, b, sizeof a);
  ck_assert_ok(dflash_anchors_sample(mask, S, 16, 8, 42, 4, c, &n)); /* next epoch */
  ck_assert(memcmp(a, c, sizeof a) != 0);
}
END_TEST

START_TEST(anchors_skip_short_samples) {
  uint8_t mask[40] = {0};
  for (int i = 0; i < 15; i++) mask[i] = 1; /* 15 < 2*8 supervised tokens */
  int32_t out[8], n = -1;
  ck_assert_ok(dflash_anchors_sample(mask, 40, 8, 8, 1, 0, out, &n));
  ck_assert_int_eq(n, 0);
  mask[20] = 1;
  ck_assert_ok(dflash_anchors_sample(mask, 40, 8, 8, 1, 0, out, &n));
  ck_assert_int_gt(n, 0);
}
END_TEST

/* Uniform among candidates: one anchor out of 10 candidates, 20000 draws. */
START_TEST(anchors_uniform) {
  enum { S = 13 };
  uint8_t mask[S];
  memset(mask, 1, S);
  int counts[S] = {0};
  for (uint64_t s = 0; s < 20000; s++) {
    int32_t a, n;
    ck_assert_ok(dflash_anchors_sample(mask, S, 4, 1, 9, s, &a, &n));
    counts[a]++;
  }
  for (int p = 0; p <= S - 4; p++)
    ck_assert_msg(counts[p] > 1800 && counts[p] < 2200, "position %d drawn %d times", p, counts[p]);
}
END_TEST

TCase *tc_anchors(void) {
  TCase *tc = tcase_create("anchors");
  tcase_add_test(tc, anchors_follow_the_rule);
  tcase_add_test(tc, anchors_deterministic_and_redrawn);
  tcase_add_test(tc, anchors_skip_short_samples);
  tcase_add_test(tc, anchors_uniform);
  return tc;
}
