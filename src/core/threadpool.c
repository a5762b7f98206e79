/*
 * A fixed pool of worker threads running parallel-for jobs. One job at a
 * time: the caller posts a range, every worker and the caller pull chunks
 * from a shared atomic counter, and the caller waits for the stragglers.
 */
#include "internal.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

struct df_pool {
  int n_workers;
  pthread_t *threads;
  pthread_mutex_t mu;
  pthread_cond_t wake;
  pthread_cond_t done;
  /* current job, guarded by mu except for the chunk counter */
  uint64_t generation;
  bool stop;
  df_range_fn fn;
  void *ctx;
  size_t n, grain;
  atomic_size_t next;
  int active;
};

static void run_chunks(df_pool *p, int worker) {
  for (;;) {
    size_t begin = atomic_fetch_add(&p->next, p->grain);
    if (begin >= p->n) return;
    size_t end = begin + p->grain < p->n ? begin + p->grain : p->n;
    p->fn(p->ctx, begin, end, worker);
  }
}

static void *worker_main(void *arg) {
  df_pool *p = arg;
  pthread_mutex_lock(&p->mu);
  int id = p->active++; /* workers number themselves 1..n; the caller is 0 */
  uint64_t seen = p->generation;
  pthread_cond_signal(&p->done);
  for (;;) {
    while (!p->stop && p->generation == seen) pthread_cond_wait(&p->wake, &p->mu);
    if (p->stop) break;
    seen = p->generation;
    pthread_mutex_unlock(&p->mu);
    run_chunks(p, id + 1);
    pthread_mutex_lock(&p->mu);
    if (--p->active == 0) pthread_cond_signal(&p->done);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

dflash_status df_pool_create(int n_threads, df_pool **out) {
  *out = NULL;
  if (n_threads <= 0) {
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    n_threads = cpus > 0 ? (int)cpus : 1;
  }
  df_pool *p = calloc(1, sizeof *p);
  if (!p) return df_error_nomem("thread pool");
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->wake, NULL);
  pthread_cond_init(&p->done, NULL);
  int workers = n_threads - 1; /* the calling thread works too */
  p->threads = calloc((size_t)(workers > 0 ? workers : 1), sizeof *p->threads);
  if (!p->threads) {
    df_pool_free(p);
    return df_error_nomem("thread pool");
  }
  for (int i = 0; i < workers; i++) {
    if (pthread_create(&p->threads[i], NULL, worker_main, p) != 0) {
      df_pool_free(p);
      return df_error(DFLASH_E_IO, "thread pool: cannot start thread %d of %d", i + 1, workers);
    }
    p->n_workers++;
  }
  /* Wait until every worker has registered, so `active` starts at 0 for jobs. */
  pthread_mutex_lock(&p->mu);
  while (p->active < p->n_workers) pthread_cond_wait(&p->done, &p->mu);
  p->active = 0;
  pthread_mutex_unlock(&p->mu);
  *out = p;
  return DFLASH_OK;
}

void df_pool_free(df_pool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = true;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->n_workers; i++) pthread_join(p->threads[i], NULL);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->wake);
  pthread_cond_destroy(&p->done);
  free(p->threads);
  free(p);
}

int df_pool_size(const df_pool *p) { return p ? p->n_workers + 1 : 1; }

void df_pool_for(df_pool *p, size_t n, size_t grain, df_range_fn fn, void *ctx) {
  if (n == 0) return;
  if (grain == 0) grain = 1;
  if (!p || p->n_workers == 0 || n <= grain) {
    for (size_t b = 0; b < n; b += grain) fn(ctx, b, b + grain < n ? b + grain : n, 0);
    return;
  }
  pthread_mutex_lock(&p->mu);
  p->fn = fn;
  p->ctx = ctx;
  p->n = n;
  p->grain = grain;
  atomic_store(&p->next, 0);
  p->active = p->n_workers;
  p->generation++;
  pthread_cond_broadcast(&p->wake);
  pthread_mutex_unlock(&p->mu);
  run_chunks(p, 0);
  pthread_mutex_lock(&p->mu);
  while (p->active > 0) pthread_cond_wait(&p->done, &p->mu);
  pthread_mutex_unlock(&p->mu);
}
