#include "testutil.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

char *df_test_tmpdir(void) {
  const char *base = getenv("TMPDIR");
  char tmpl[4096];
  snprintf(tmpl, sizeof tmpl, "%s/dflash-test-XXXXXX", base && *base ? base : "/tmp");
  char *p = mkdtemp(tmpl);
  ck_assert_msg(p != NULL, "mkdtemp failed");
  return strdup(p);
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  (void)sb;
  (void)flag;
  (void)ftw;
  remove(path);
  return 0;
}

void df_test_rmtree(const char *path) {
  if (path) nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

const char *df_test_fixtures(void) {
  const char *env = getenv("DFLASH_FIXTURES");
  const char *dir = env && *env ? env : DFLASH_TEST_FIXTURES;
  struct stat sb;
  if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
    fprintf(stderr, "note: fixtures folder %s is absent (set DFLASH_FIXTURES); skipping\n", dir);
    return NULL;
  }
  return dir;
}

char *df_test_fixture(const char *relative) {
  const char *dir = df_test_fixtures();
  if (!dir) return NULL;
  char buf[4096];
  snprintf(buf, sizeof buf, "%s/%s", dir, relative);
  if (access(buf, R_OK) != 0) {
    fprintf(stderr, "note: fixture %s is absent; skipping\n", buf);
    return NULL;
  }
  return strdup(buf);
}

bool df_test_write(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return false;
  bool ok = fwrite(data, 1, n, f) == n;
  return fclose(f) == 0 && ok;
}

dflash_status df_test_hidden_add(dflash_hidden_writer *w, const char *id, const float *states,
                                 const int32_t *target_ids, int64_t len) {
  dflash_hidden_rows r;
  dflash_hidden_rows_default(&r);
  r.len = len;
  r.states = states;
  r.target_ids = target_ids;
  return dflash_hidden_writer_add(w, id, &r);
}
