/* Regenerates the assistant turn of every conversation in a JSONL file with
 * an OpenAI-compatible server, printing progress, then the run's summary.
 * Running it again resumes (finished ids are skipped).
 * usage: fetch BASE_URL MODEL IN.jsonl OUT_DIR    (BASE_URL like http://127.0.0.1:8000/v1) */
#include <dflash/fetch.h>
#include <stdio.h>
#include <stdlib.h>

static int fail(dflash_status st) {
  fprintf(stderr, "error: %s: %s\n", dflash_status_str(st), dflash_last_error());
  return 1;
}

/* Called on the fetch loop's thread; returning non-zero would stop the run. */
static int progress(dflash_fetch *f, const dflash_fetch_stats *s, void *user) {
  (void)user;
  fprintf(stderr, "\r%llu/%llu done, %llu failed, %llu in flight, %zu server(s)",
          (unsigned long long)(s->completed + s->skipped), (unsigned long long)s->total,
          (unsigned long long)s->failed, (unsigned long long)s->in_flight,
          dflash_fetch_server_count(f));
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 5) {
    fprintf(stderr, "usage: %s BASE_URL MODEL IN.jsonl OUT_DIR\n", argv[0]);
    return 2;
  }
  const char *servers[] = {argv[1]};
  dflash_fetch_options o;
  dflash_fetch_options_default(&o);
  o.servers = servers;
  o.n_servers = 1;
  o.model = argv[2];
  o.temperature = 0; /* greedy: the target's own most likely answer */
  o.max_tokens = 256;
  o.concurrency = 4;
  o.progress_interval_s = 0.2;
  dflash_fetch *f;
  dflash_status st = dflash_fetch_create(&o, argv[3], argv[4], &f);
  if (st) return fail(st);
  st = dflash_fetch_run(f, progress, NULL);
  fprintf(stderr, "\n");
  size_t need = 0;
  char *buf = NULL;
  if (!st || st == DFLASH_E_CANCELLED) {
    dflash_fetch_summary(f, NULL, 0, &need); /* asks for the size */
    buf = malloc(need);
    if (buf && !dflash_fetch_summary(f, buf, need, &need)) printf("%s\n", buf);
  }
  dflash_fetch_stats s = {.struct_size = sizeof s};
  if (!st) st = dflash_fetch_get_stats(f, &s);
  free(buf);
  dflash_fetch_free(f);
  if (st) return fail(st);
  printf("completions: %s/completions.jsonl, errors: %s/errors.jsonl\n", argv[4], argv[4]);
  return s.failed ? 1 : 0;
}
