#include <stdatomic.h>
#include <stdlib.h>

#include "core/internal.h"
#include "testutil.h"

typedef struct {
  int *hits;
  atomic_int calls;
} ctx_t;

static void mark(void *arg, size_t begin, size_t end, int worker) {
  ctx_t *c = arg;
  (void)worker;
  atomic_fetch_add(&c->calls, 1);
  for (size_t i = begin; i < end; i++) c->hits[i]++;
}

START_TEST(every_index_runs_exactly_once) {
  for (int threads = 1; threads <= 4; threads++) {
    df_pool *pool;
    ck_assert_ok(df_pool_create(threads, &pool));
    ck_assert_int_eq(df_pool_size(pool), threads);
    for (size_t n = 0; n < 300; n += 37) {
      for (int round = 0; round < 20; round++) {
        ctx_t c = {.hits = calloc(n + 1, sizeof(int))};
        df_pool_for(pool, n, 1 + (size_t)round % 5, mark, &c);
        for (size_t i = 0; i < n; i++) ck_assert_int_eq(c.hits[i], 1);
        free(c.hits);
      }
    }
    df_pool_free(pool);
  }
  ctx_t c = {.hits = calloc(10, sizeof(int))};
  df_pool_for(NULL, 10, 3, mark, &c); /* NULL pool runs inline */
  ck_assert_int_eq(c.hits[9], 1);
  ck_assert_int_eq(atomic_load(&c.calls), 4);
  free(c.hits);
}
END_TEST

TCase *tc_threadpool(void) {
  TCase *tc = tcase_create("threadpool");
  tcase_add_test(tc, every_index_runs_exactly_once);
  return tc;
}
