/* Runs a fuzz target over every file of its committed corpus, so the corpus is
 * a regression test in every build (libFuzzer not needed). */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size);

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return 1;
  unsigned char *buf = NULL;
  size_t len = 0, cap = 0, n;
  unsigned char chunk[65536];
  while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) {
    if (len + n > cap) {
      cap = (len + n) * 2;
      buf = realloc(buf, cap);
      if (!buf) return 1;
    }
    memcpy(buf + len, chunk, n);
    len += n;
  }
  fclose(f);
  LLVMFuzzerTestOneInput(buf ? buf : (unsigned char *)"", len);
  free(buf);
  return 0;
}

int main(int argc, char **argv) {
  int files = 0;
  for (int i = 1; i < argc; i++) {
    DIR *d = opendir(argv[i]);
    if (!d) {
      if (run_file(argv[i])) return 1;
      files++;
      continue;
    }
    struct dirent *de;
    while ((de = readdir(d))) {
      if (de->d_name[0] == '.') continue;
      char path[4096];
      snprintf(path, sizeof path, "%s/%s", argv[i], de->d_name);
      if (run_file(path)) return 1;
      files++;
    }
    closedir(d);
  }
  printf("replayed %d inputs\n", files);
  return files ? 0 : 77;
}
