/*
 * The CUDA backend module loaded on demand (src/train/cuda/cuda_module.c), through libdflash.so
 * as a program links it: nothing of CUDA is mapped until the first CUDA call; a missing or
 * wrong module is a clear DFLASH_E_NO_DEVICE naming it; the module is found beside the
 * library; on a machine without a GPU the driver's reason comes back, never a crash.
 * Each test runs in its own process (Check's fork mode), so each sees a fresh loader.
 */
#include <dflash/dflash.h>
#include <dflash/train.h>
#include <dlfcn.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

/* Whether /proc/self/maps has a file whose name contains `needle`; its path into `path`. */
static bool mapped(const char *needle, char *path, size_t len) {
  FILE *f = fopen("/proc/self/maps", "r");
  ck_assert_ptr_nonnull(f);
  char line[4096];
  bool found = false;
  while (!found && fgets(line, sizeof line, f)) {
    char *file = strchr(line, '/');
    if (!file || !strstr(file, needle)) continue;
    file[strcspn(file, "\n")] = 0;
    if (path) snprintf(path, len, "%s", file);
    found = true;
  }
  fclose(f);
  return found;
}

static const char *const cuda_libs[] = {"libcudart", "libcublas", "libnccl", "libdflash-cuda"};

static void assert_no_cuda_mapped(const char *when) {
  for (size_t i = 0; i < sizeof cuda_libs / sizeof *cuda_libs; i++) {
    char path[4096] = "";
    ck_assert_msg(!mapped(cuda_libs[i], path, sizeof path), "%s: %s is mapped", when, path);
  }
}

/* The folder libdflash.so was loaded from. */
static void library_dir(char *out, size_t len) {
  Dl_info info;
  ck_assert(dladdr((void *)dflash_version_string, &info) && info.dli_fname);
  char copy[4096];
  snprintf(copy, sizeof copy, "%s", info.dli_fname);
  snprintf(out, len, "%s", dirname(copy));
}

static dflash_status cuda_trainer(void) {
  static const char *cfg_json =
      "{\"hidden_size\": 16, \"intermediate_size\": 24, \"num_hidden_layers\": 1,"
      "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 4,"
      "\"vocab_size\": 31, \"num_target_layers\": 8, \"block_size\": 4,"
      "\"dflash_config\": {\"mask_token_id\": 30, \"target_layer_ids\": [1, 5]}}";
  dflash_drafter_config cfg = {.struct_size = sizeof cfg};
  ck_assert_ok(dflash_drafter_config_parse(cfg_json, strlen(cfg_json), "cfg", &cfg));
  float *E = calloc(31 * 16, sizeof *E);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.backend = DFLASH_BACKEND_CUDA;
  dflash_trainer *t = NULL;
  dflash_status st = dflash_trainer_create(&cfg, E, E, &o, &t);
  dflash_trainer_free(t);
  free(E);
  return st;
}

START_TEST(nothing_cuda_at_load) {
  /* The library is loaded and working; its CPU paths map no CUDA library. */
  ck_assert_str_eq(dflash_version_string(), DFLASH_VERSION_STRING);
  ck_assert_str_eq(dflash_status_str(DFLASH_E_NO_DEVICE), "DFLASH_E_NO_DEVICE");
  assert_no_cuda_mapped("after loading libdflash");
}
END_TEST

START_TEST(missing_module_named) {
  const char *path = "/nonexistent/dflash-test/libdflash-cuda.so";
  setenv("DFLASH_CUDA_MODULE", path, 1);
  int n = -1;
  ck_assert_status(dflash_cuda_device_count(&n), DFLASH_E_NO_DEVICE, path);
  ck_assert_msg(strstr(dflash_last_error(), "not found"), "%s", dflash_last_error());
  ck_assert_int_eq(n, 0);
  /* The trainer says it too, and a failed load is retried, not cached. */
  ck_assert_status(cuda_trainer(), DFLASH_E_NO_DEVICE, path);
  assert_no_cuda_mapped("after a missing module");
}
END_TEST

START_TEST(not_a_module_refused) {
  /* An existing shared object without the module's entry point: libdflash itself. */
  char dir[4096], path[4200];
  library_dir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/libdflash.so", dir);
  setenv("DFLASH_CUDA_MODULE", path, 1);
  int n = -1;
  ck_assert_status(dflash_cuda_device_count(&n), DFLASH_E_NO_DEVICE,
                   "is not a libdflash CUDA backend module");
  ck_assert_msg(strstr(dflash_last_error(), path), "%s", dflash_last_error());
}
END_TEST

START_TEST(module_found_beside_library) {
  unsetenv("DFLASH_CUDA_MODULE");
  int n = -1;
  dflash_status st = dflash_cuda_device_count(&n);
  if (st == DFLASH_OK) {
    ck_assert_int_gt(n, 0); /* a GPU machine */
  } else {
    /* No GPU here: the driver's reason, from a module that did load. */
    ck_assert_status(st, DFLASH_E_NO_DEVICE, "no usable CUDA device");
    ck_assert_msg(!strstr(dflash_last_error(), "module"), "%s", dflash_last_error());
    ck_assert_int_eq(n, 0);
    ck_assert_status(cuda_trainer(), DFLASH_E_NO_DEVICE, "trainer backend cuda");
  }
  char dir[4096], want[4200], got[4096] = "";
  library_dir(dir, sizeof dir);
  snprintf(want, sizeof want, "%s/libdflash-cuda.so", dir);
  ck_assert_msg(mapped("libdflash-cuda.so", got, sizeof got), "module not mapped");
  char *got_real = realpath(got, NULL), *want_real = realpath(want, NULL);
  ck_assert_msg(got_real && want_real && !strcmp(got_real, want_real), "module %s, wanted %s", got,
                want);
  free(got_real);
  free(want_real);
  ck_assert_msg(mapped("libcudart", NULL, 0), "libcudart not mapped after the CUDA call");
}
END_TEST

Suite *df_test_suite(void) {
  Suite *s = suite_create("cuda-module");
  TCase *tc = tcase_create("load");
  tcase_add_test(tc, nothing_cuda_at_load);
  tcase_add_test(tc, missing_module_named);
  tcase_add_test(tc, not_a_module_refused);
  tcase_add_test(tc, module_found_beside_library);
  suite_add_tcase(s, tc);
  return s;
}
