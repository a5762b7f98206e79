/* One option parser for every subcommand: `--opt value` and `--opt=value`, in any order with
 * the positional arguments; an unknown option is named with the nearest valid one, a missing
 * value or a malformed number names the option. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"

static size_t min3(size_t a, size_t b, size_t c) {
  size_t m = a < b ? a : b;
  return m < c ? m : c;
}

/* Edit distance of two short option names (longer ones count as far apart). */
static size_t distance(const char *a, const char *b) {
  size_t n = strlen(a), m = strlen(b), row[64];
  if (n >= 63 || m >= 63) return 99;
  for (size_t j = 0; j <= m; j++) row[j] = j;
  for (size_t i = 1; i <= n; i++) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= m; j++) {
      size_t up = row[j];
      row[j] = min3(row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1]));
      diag = up;
    }
  }
  return row[m];
}

static const char *nearest(const cli_opt *opts, const char *name) {
  const char *best = NULL;
  size_t best_d = 4; /* at most 3 edits away, or a prefix */
  for (const cli_opt *o = opts; o->name; o++) {
    size_t d = strncmp(o->name, name, strlen(name)) ? distance(o->name, name) : 1;
    if (d < best_d) best = o->name, best_d = d;
  }
  return best;
}

static int fail(const char *cmd, const char *fmt, const char *a, const char *b) {
  fprintf(stderr, "dflash %s: ", cmd);
  fprintf(stderr, fmt, a, b);
  fprintf(stderr, "\n(`dflash %s --help` lists the options)\n", cmd);
  return 2;
}

/* A range bound as an integer: (double)INT64_MAX rounds up past INT64_MAX. */
static long long bound(double x) {
  return x >= 9.2e18 ? LLONG_MAX : x <= -9.2e18 ? LLONG_MIN : (long long)x;
}

/* Store `v` for option `o`; 0, or 2 after a message. */
static int store(const char *cmd, const cli_opt *o, const char *v) {
  bool bad = false;
  switch (o->kind) {
  case CLI_STR: *(const char **)o->dst = v; break;
  case CLI_INT: *(int *)o->dst = (int)cli_int(o->name, v, bound(o->lo), bound(o->hi), &bad); break;
  case CLI_I64: *(int64_t *)o->dst = cli_int(o->name, v, bound(o->lo), bound(o->hi), &bad); break;
  case CLI_REAL: *(double *)o->dst = cli_real(o->name, v, o->lo, o->hi, &bad); break;
  case CLI_FN:
    if (o->fn(v, o->dst)) return fail(cmd, "%s does not take '%s'", o->name, v);
    break;
  case CLI_FLAG: break;
  }
  return bad ? 2 : 0;
}

int cli_parse(const char *cmd, const char *usage, const cli_opt *opts, int argc, char **argv,
              const char **pos, int max_pos, int *n_pos) {
  *n_pos = 0;
  bool only_pos = false;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (only_pos || a[0] != '-' || !a[1]) {
      if (*n_pos >= max_pos) return fail(cmd, "unexpected argument '%s'%s", a, "");
      pos[(*n_pos)++] = a;
      continue;
    }
    if (!strcmp(a, "--")) {
      only_pos = true;
      continue;
    }
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) return fputs(usage, stdout), 1;
    const char *eq = strchr(a, '=');
    size_t len = eq ? (size_t)(eq - a) : strlen(a);
    const cli_opt *o = opts;
    while (o->name && (strlen(o->name) != len || strncmp(o->name, a, len))) o++;
    if (!o->name) {
      char name[64];
      snprintf(name, sizeof name, "%.*s", (int)len, a);
      const char *near = nearest(opts, name);
      return near ? fail(cmd, "unknown option %s (did you mean %s?)", name, near)
                  : fail(cmd, "unknown option %s%s", name, "");
    }
    if (o->kind == CLI_FLAG) {
      if (eq) return fail(cmd, "%s takes no value%s", o->name, "");
      *(int *)o->dst = 1;
      continue;
    }
    const char *v = eq ? eq + 1 : i + 1 < argc ? argv[++i] : NULL;
    if (!v) return fail(cmd, "%s needs a value%s", o->name, "");
    int rc = store(cmd, o, v);
    if (rc) return rc;
  }
  return 0;
}

int cli_parse_one(const char *cmd, const char *usage, int argc, char **argv, const char *what,
                  const char **arg) {
  static const cli_opt none[] = {{NULL, 0, NULL, 0, 0, NULL}};
  *arg = NULL;
  int n_pos, rc = cli_parse(cmd, usage, none, argc, argv, arg, 1, &n_pos);
  if (rc) return rc == 1 ? -1 : rc;
  return *arg ? 0 : cli_missing(cmd, what);
}

void cli_log_to_stderr(dflash_log_level level, const char *message, void *user) {
  (void)level;
  (void)user;
  fprintf(stderr, "%s\n", message);
}

int cli_missing(const char *cmd, const char *what) { return fail(cmd, "missing %s%s", what, ""); }
