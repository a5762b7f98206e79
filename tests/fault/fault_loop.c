/*
 * The fault-injection loop, SQLite's way (its "malloc" and "I/O error" tests): each scenario
 * of scenarios.c runs once without faults, counting its allocations, writes, fsyncs and
 * renames; then once per N with the Nth call of one kind failing. Every run must
 *   - return a status: DFLASH_E_NOMEM for an allocation, DFLASH_E_IO for a write, fsync or
 *     rename, with a message (or DFLASH_OK with the fault-free run's very outputs: a failure
 *     the code may absorb, such as a cache it does without);
 *   - never crash (a crash prints the scenario, kind and N first);
 *   - leak nothing (under ASan: LeakSanitizer after every run);
 *   - leave no file under a final name but a whole one: each file equal to the fault-free
 *     run's or to what was there before, no temporary file left behind.
 * Where a kind has more calls than DFLASH_FAULT_SAMPLES (default 120), N walks them with a
 * stride (the first and the last always), so CI time stays bounded; DFLASH_FAULT_ALL=1 tries
 * every N, DFLASH_FAULT_ONLY=scenario[:kind[:N]] narrows the loop to one scenario, kind or run
 * (with DFLASH_FAULT_ALL for an N off the stride), DFLASH_FAULT_KEEP=1 keeps the files.
 */
#include <dirent.h>
#include <dflash/safetensors.h>
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/internal.h"
#include "fault.h"
#include "fault_loop.h"
#include "testutil.h"

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FAULT_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define FAULT_ASAN 1
#endif
#ifdef FAULT_ASAN
#include <sanitizer/common_interface_defs.h>
#include <sanitizer/lsan_interface.h>
#endif

#define MAX_REPORTS 12

static char g_where[256] = "set-up";
static int g_failures;

/* ---- small file helpers (never under test) ------------------------------------------- */

void fault_die(const char *what, dflash_status st) {
  fprintf(stderr, "fault: set-up failed: %s: %s: %s\n", what, dflash_status_str(st),
          dflash_last_error());
  exit(2);
}

char *fault_path(const char *a, const char *b) {
  char *p = df_path_join(a, b);
  if (!p) fault_die("path", DFLASH_E_NOMEM);
  return p;
}

void fault_write(const char *path, const char *text) {
  if (!df_test_write(path, text, strlen(text))) fault_die(path, DFLASH_E_IO);
}

static char *slurp(const char *path, size_t *len) {
  char *text = NULL;
  dflash_status st = df_read_file(path, &text, len);
  return st ? NULL : text;
}

void fault_copy_tree(const char *from, const char *to) {
  if (mkdir(to, 0755) != 0 && errno != EEXIST) fault_die(to, DFLASH_E_IO);
  DIR *d = opendir(from);
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    char *a = fault_path(from, e->d_name), *b = fault_path(to, e->d_name);
    struct stat sb;
    if (stat(a, &sb) == 0 && S_ISDIR(sb.st_mode)) fault_copy_tree(a, b);
    else {
      size_t n;
      char *text = slurp(a, &n);
      if (!text || !df_test_write(b, text, n)) fault_die(a, DFLASH_E_IO);
      free(text);
    }
    free(a), free(b);
  }
  closedir(d);
}

/* Every regular file under `dir`, as paths relative to it ("a/b"), into `out`. */
static void list_files(const char *dir, const char *rel, df_buf *out) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    char *full = fault_path(dir, e->d_name);
    char *name = rel ? fault_path(rel, e->d_name) : df_strdup(e->d_name);
    struct stat sb;
    if (stat(full, &sb) == 0 && S_ISDIR(sb.st_mode)) list_files(full, name, out);
    else if (df_buf_append(out, name, strlen(name) + 1)) fault_die("list", DFLASH_E_NOMEM);
    free(full), free(name);
  }
  closedir(d);
}

/* ---- what a run must leave ----------------------------------------------------------- */

static const fault_scenario *g_scenario;
static int g_known;

static void report(const char *fmt, ...) DF_PRINTF(1, 2);
static void report(const char *fmt, ...) {
  char text[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt, ap);
  va_end(ap);
  for (const char *const *k = g_scenario->known; k && *k; k++)
    if (strstr(text, *k)) {
      if (!g_known++) fprintf(stderr, "KNOWN %s: %s\n", g_where, text);
      return;
    }
  if (++g_failures <= MAX_REPORTS) fprintf(stderr, "FAIL %s: %s\n", g_where, text);
}

static bool is_temp(const char *name) {
  const char *t = strstr(name, ".tmp.");
  return t && t[5] >= '0' && t[5] <= '9';
}

static bool varies(const fault_scenario *s, const char *name) {
  for (const char *const *v = s->varying; v && *v; v++)
    if (df_str_ends_with(name, *v)) return true;
  return false;
}

/* Whole: JSON parses, every JSONL line parses and the last one ends, safetensors opens; other
 * files by the scenario's own check. */
static const char *whole(const fault_scenario *s, const char *name, const char *path) {
  if (df_str_ends_with(path, ".safetensors")) {
    dflash_safetensors *st = NULL;
    dflash_status s = dflash_safetensors_open(path, &st);
    dflash_safetensors_free(st);
    return s ? "a safetensors file that does not open" : NULL;
  }
  size_t n;
  char *text = slurp(path, &n);
  if (!text) return "unreadable";
  const char *bad = NULL;
  if (s->whole) bad = s->whole(name, text, n);
  else if (df_str_ends_with(path, ".jsonl")) {
    if (n && text[n - 1] != '\n') bad = "a JSONL file with a torn last line";
    for (char *line = text, *nl; !bad && (nl = strchr(line, '\n')); line = nl + 1) {
      json_t *j = json_loadb(line, (size_t)(nl - line), 0, NULL);
      if (!j) bad = "a JSONL line that does not parse";
      json_decref(j);
    }
  } else if (df_str_ends_with(path, ".json")) {
    json_t *j = json_loadb(text, n, 0, NULL);
    if (!j) bad = "a JSON file that does not parse";
    json_decref(j);
  }
  free(text);
  return bad;
}

static bool same_file(const char *a, const char *b) {
  size_t na, nb;
  char *ta = slurp(a, &na), *tb = slurp(b, &nb);
  bool same = ta && tb && na == nb && !memcmp(ta, tb, na);
  free(ta), free(tb);
  return same;
}

/* Each file under out against ref (the fault-free run) and init (the set-up); with
 * `complete`, every file of ref must be there too. */
static void check_tree(const fault_scenario *s, const char *out, const char *ref, const char *init,
                       bool complete) {
  df_buf names = {0};
  list_files(out, NULL, &names);
  for (size_t at = 0; at < names.len; at += strlen(names.data + at) + 1) {
    const char *name = names.data + at;
    char *o = fault_path(out, name), *r = fault_path(ref, name), *i = fault_path(init, name);
    const char *bad = NULL;
    if (is_temp(name)) bad = "a temporary file left behind";
    else if (same_file(o, r) || same_file(o, i)) bad = NULL;
    else if (varies(s, name)) bad = whole(s, name, o);
    else if (access(r, F_OK) && access(i, F_OK)) bad = "a file the fault-free run does not write";
    else
      bad = "neither the fault-free run's bytes nor the set-up's (a partial file under a final "
            "name?)";
    if (bad) report("%s: %s", name, bad);
    free(o), free(r), free(i);
  }
  df_buf_free(&names);
  if (!complete) return;
  list_files(ref, NULL, &names);
  for (size_t at = 0; at < names.len; at += strlen(names.data + at) + 1) {
    char *o = fault_path(out, names.data + at);
    if (access(o, F_OK)) report("%s missing after a run that returned DFLASH_OK", names.data + at);
    free(o);
  }
  df_buf_free(&names);
}

static void check_leaks(void) {
#ifdef FAULT_ASAN
  if (__lsan_do_recoverable_leak_check()) report("memory leaked (LeakSanitizer's report above)");
#endif
}

static dflash_status wanted(fault_kind kind) {
  return kind == FAULT_ALLOC ? DFLASH_E_NOMEM : DFLASH_E_IO;
}

/* ---- the loop ------------------------------------------------------------------------- */

static void fresh(const char *dir) {
  df_test_rmtree(dir);
  if (mkdir(dir, 0755) != 0) fault_die(dir, DFLASH_E_IO);
}

static dflash_status run_op(const fault_scenario *s, const char *root, const char *out,
                            fault_kind kind, uint64_t n) {
  fresh(out);
  if (s->setup) s->setup(root, out);
  dflash_clear_error();
  fault_start(kind, n);
  dflash_status st = s->op(root, out);
  fault_stop();
  return st;
}

static void one_run(const fault_scenario *s, const char *root, fault_kind kind, uint64_t n) {
  char *out = fault_path(root, "out"), *ref = fault_path(root, "ref"),
       *init = fault_path(root, "init");
  snprintf(g_where, sizeof g_where, "%s:%s:%llu", s->name, fault_kind_name(kind),
           (unsigned long long)n);
  dflash_status st = run_op(s, root, out, kind, n);
  const char *msg = dflash_last_error();
  size_t w = strlen(g_where);
  snprintf(g_where + w, sizeof g_where - w, " (%s)", dflash_status_str(st));
  if (st != DFLASH_OK && !fault_fired())
    report("failed without a fault: %s: %s", dflash_status_str(st), msg);
  else if (st != DFLASH_OK && st != wanted(kind))
    report("%s where %s was due: %s", dflash_status_str(st), dflash_status_str(wanted(kind)), msg);
  else if (st != DFLASH_OK && !*msg) report("%s without a message", dflash_status_str(st));
  check_tree(s, out, ref, init, st == DFLASH_OK);
  check_leaks();
  free(out), free(ref), free(init);
}

static bool only(const char *what, int field) {
  const char *o = getenv("DFLASH_FAULT_ONLY");
  if (!o || !*o) return true;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", o);
  char *save = NULL, *tok = strtok_r(buf, ":", &save);
  for (int i = 0; tok && i < field; i++) tok = strtok_r(NULL, ":", &save);
  return !tok || !strcmp(tok, what);
}

static uint64_t env_u64(const char *name, uint64_t dflt) {
  const char *v = getenv(name);
  return v && *v ? strtoull(v, NULL, 10) : dflt;
}

/* N over 1..count: all of them, or DFLASH_FAULT_SAMPLES of them by a stride. */
static uint64_t loop_kind(const fault_scenario *s, const char *root, fault_kind kind,
                          uint64_t count) {
  uint64_t samples = env_u64("DFLASH_FAULT_SAMPLES", 120);
  uint64_t stride = getenv("DFLASH_FAULT_ALL") || count <= samples
                        ? 1
                        : (count + samples - 1) / samples;
  uint64_t runs = 0;
  for (uint64_t n = 1; n <= count;
       n = n == count ? count + 1 : (n + stride > count ? count : n + stride)) {
    char num[32];
    snprintf(num, sizeof num, "%llu", (unsigned long long)n);
    if (!only(num, 2)) continue;
    one_run(s, root, kind, n);
    runs++;
  }
  return runs;
}

static void run_scenario(const fault_scenario *s) {
  g_scenario = s;
  char *root = df_test_tmpdir();
  char *ref = fault_path(root, "ref"), *init = fault_path(root, "init");
  snprintf(g_where, sizeof g_where, "%s:prepare", s->name);
  s->prepare(root);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  /* Twice without faults: the first warms what a process does once (lazy tables), the
   * second counts. */
  for (int pass = 0; pass < 2; pass++) {
    snprintf(g_where, sizeof g_where, "%s:fault-free", s->name);
    dflash_status st = run_op(s, root, ref, FAULT_ALLOC, 0);
    if (st) fault_die(s->name, st);
  }
  uint64_t count[FAULT_KINDS];
  for (int k = 0; k < FAULT_KINDS; k++) count[k] = fault_count((fault_kind)k);
  fresh(init);
  if (s->setup) s->setup(root, init);
  printf("%-16s", s->name);
  for (int k = 0; k < FAULT_KINDS; k++) {
    if (!only(fault_kind_name((fault_kind)k), 1)) continue;
    uint64_t runs = loop_kind(s, root, (fault_kind)k, count[k]);
    printf(" %s %llu/%llu", fault_kind_name((fault_kind)k), (unsigned long long)runs,
           (unsigned long long)count[k]);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  if (g_known) printf("  %d known", g_known);
  printf("  (%.1f s)\n",
         (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
  fflush(stdout);
  if (getenv("DFLASH_FAULT_KEEP")) printf("kept %s\n", root); /* to look at a run's files */
  else df_test_rmtree(root);
  free(root), free(ref), free(init);
}

static void say_where(void) {
  const char *pre = "fault: crashed in ";
  if (write(2, pre, strlen(pre)) < 0 || write(2, g_where, strlen(g_where)) < 0 ||
      write(2, "\n", 1) < 0) {
  }
}

static void on_crash(int sig) {
  say_where();
  signal(sig, SIG_DFL);
  raise(sig);
}

/* One Check test per scenario: Check forks for each, so a crash fails that scenario alone. */
START_TEST(loop) {
  fault_init();
  signal(SIGSEGV, on_crash);
  signal(SIGBUS, on_crash);
#ifdef FAULT_ASAN
  __sanitizer_set_death_callback(say_where);
#endif
  const fault_scenario *s = &fault_scenarios[_i];
  if (!only(s->name, 0)) return;
  run_scenario(s);
  if (g_failures > MAX_REPORTS)
    fprintf(stderr, "... and %d more failures\n", g_failures - MAX_REPORTS);
  ck_assert_msg(!g_failures, "%s: %d fault run(s) failed (listed on stderr)", s->name, g_failures);
}
END_TEST

Suite *df_test_suite(void);
Suite *df_test_suite(void) {
  Suite *s = suite_create("fault");
  TCase *tc = tcase_create("loop");
  tcase_set_timeout(tc, 600);
  tcase_add_loop_test(tc, loop, 0, fault_n_scenarios);
  suite_add_tcase(s, tc);
  return s;
}
