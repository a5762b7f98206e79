#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"
#include "testutil.h"

static void ck_advice(const char *core, unsigned cpu, const char *want) {
  const char *got = df_blas_coretype_for(core, cpu);
  if (!want) ck_assert_msg(!got, "%s on cpu %u: advised %s", core ? core : "NULL", cpu, got);
  else ck_assert_msg(got && !strcmp(got, want), "%s on cpu %u: want %s", core, cpu, want);
}

START_TEST(generic_kernels_get_the_cpus_set) {
  const unsigned avx2 = DF_CPU_AVX2, avx512 = DF_CPU_AVX2 | DF_CPU_AVX512;
  ck_advice("Prescott", avx512, "SkylakeX"); /* Debian 12's OpenBLAS on an AVX-512 Xeon */
  ck_advice("Prescott", avx2, "Haswell");
  ck_advice("PRESCOTT", avx2, "Haswell"); /* a non-DYNAMIC_ARCH build's spelling */
  ck_advice("Sandybridge", avx2, "Haswell");
  ck_advice("Haswell", avx512, "SkylakeX");
  ck_advice("Zen", avx512, "SkylakeX");
  ck_advice("Prescott", DF_CPU_AVX512, "SkylakeX");
}
END_TEST

START_TEST(fitting_or_unknown_kernels_are_left_alone) {
  const unsigned avx2 = DF_CPU_AVX2, avx512 = DF_CPU_AVX2 | DF_CPU_AVX512;
  ck_advice("Prescott", 0, NULL); /* an SSE-only CPU: Prescott is right */
  ck_advice("Zen", avx2, NULL);   /* this kind of AMD EPYC */
  ck_advice("Haswell", avx2, NULL);
  ck_advice("SkylakeX", avx512, NULL);
  ck_advice("Cooperlake", avx512, NULL);
  ck_advice("SapphireRapids", avx512, NULL);
  ck_advice("NEOVERSEN1", 0, NULL);
  ck_advice("SomeFutureCore", avx512, NULL); /* newer than this table: trust it */
  ck_advice("", avx512, NULL);
  ck_advice(NULL, avx512, NULL);
}
END_TEST

START_TEST(the_cpus_own_advice_agrees) {
  const char *a = dflash_blas_coretype_advice();
  ck_advice(dflash_blas_corename(), df_blas_cpu(), a);
  if (a) ck_assert(df_blas_cpu() & (!strcmp(a, "SkylakeX") ? DF_CPU_AVX512 : DF_CPU_AVX2));
}
END_TEST

/* The trainer's pool splits the products (train/ops.c's df_sgemm), so OpenBLAS
 * runs one thread, whatever it had. */
START_TEST(setup_leaves_the_blas_one_thread) {
  int before = openblas_get_num_threads();
  openblas_set_num_threads(2);
  df_blas_setup();
  ck_assert_int_eq(openblas_get_num_threads(), 1);
  df_blas_setup();
  ck_assert_int_eq(openblas_get_num_threads(), 1);
  openblas_set_num_threads(before);
}
END_TEST

typedef struct {
  int warnings;
  char last[512];
} log_seen;

static void on_log(dflash_log_level level, const char *message, void *user) {
  log_seen *seen = user;
  if (level != DFLASH_LOG_WARN || !strstr(message, "OPENBLAS_CORETYPE")) return;
  seen->warnings++;
  snprintf(seen->last, sizeof seen->last, "%s", message);
}

/* The kernel advice is logged at most once a process, and names the fix.
 * Which way this runs depends on the machine's CPU and OpenBLAS;
 * OPENBLAS_CORETYPE=Prescott on an AVX2 CPU takes the warning branch. */
START_TEST(advice_is_logged_once) {
  log_seen seen = {0};
  dflash_set_log_callback(on_log, &seen, DFLASH_LOG_WARN);
  df_blas_setup();
  df_blas_setup();
  dflash_set_log_callback(NULL, NULL, DFLASH_LOG_ERROR);
  const char *a = dflash_blas_coretype_advice();
  ck_assert_int_eq(seen.warnings, a ? 1 : 0);
  if (a) ck_assert_ptr_nonnull(strstr(seen.last, a));
}
END_TEST

TCase *tc_blas(void) {
  TCase *tc = tcase_create("blas");
  tcase_add_test(tc, generic_kernels_get_the_cpus_set);
  tcase_add_test(tc, fitting_or_unknown_kernels_are_left_alone);
  tcase_add_test(tc, the_cpus_own_advice_agrees);
  /* first: with CK_FORK=no, a setup before it would have used the one warning */
  tcase_add_test(tc, advice_is_logged_once);
  tcase_add_test(tc, setup_leaves_the_blas_one_thread);
  return tc;
}
