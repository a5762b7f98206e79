/*
 * The BLAS (OpenBLAS) as the trainer uses it: its thread count, and whether
 * the kernel set it picked fits the CPU.
 *
 * OpenBLAS built with DYNAMIC_ARCH (Debian's) picks its kernels once, when it
 * is loaded, from its own table of CPU models; a CPU newer than the table gets
 * an old generic set (Debian 12's 0.3.21 runs Prescott's SSE3 kernels on some
 * AVX-512 Xeons, at about half the speed). OPENBLAS_CORETYPE, read at that
 * load, overrides the choice, so the library can only say so; the command
 * line re-executes itself with it (tools/dflash/main.c).
 */
#include "internal.h"

#include <cblas.h>
#include <stdatomic.h>
#include <string.h>
#include <strings.h>

/* OpenBLAS's names (driver/others/dynamic.c) for the x86 kernel sets that
 * have no AVX2 code: a CPU with AVX2 runs faster on Haswell's. */
static const char *const pre_avx2[] = {
    "Unknown",   "Katmai",       "Coppermine",  "Northwood",  "Prescott",    "Banias",
    "Atom",      "Core2",        "Penryn",      "Dunnington", "Nehalem",     "Athlon",
    "Opteron",   "Opteron_SSE3", "Barcelona",   "Nano",       "Sandybridge", "Bobcat",
    "Bulldozer", "Piledriver",   "Steamroller", "Excavator",
};

/* The AVX2 sets, which an AVX-512 CPU outruns with SkylakeX's. */
static const char *const avx2_only[] = {"Haswell", "Zen"};

static bool named_in(const char *core, const char *const *names, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (!strcasecmp(core, names[i])) return true;
  return false;
}

#define NAMED_IN(core, list) named_in(core, list, sizeof list / sizeof *list)

const char *df_blas_coretype_for(const char *core, unsigned cpu) {
  /* An unknown name is a newer set (or another BLAS's): never second-guess it. */
  bool old = core && NAMED_IN(core, pre_avx2);
  if ((cpu & DF_CPU_AVX512) && (old || (core && NAMED_IN(core, avx2_only)))) return "SkylakeX";
  if ((cpu & DF_CPU_AVX2) && old) return "Haswell";
  return NULL;
}

unsigned df_blas_cpu(void) {
  unsigned cpu = 0;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init(); /* may run before libgcc's constructor has */
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) cpu |= DF_CPU_AVX2;
  /* SkylakeX's kernels use the F, BW, VL and DQ subsets. */
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    cpu |= DF_CPU_AVX512;
#endif
  return cpu;
}

const char *dflash_blas_corename(void) {
  const char *core = openblas_get_corename();
  return core ? core : "";
}

const char *dflash_blas_coretype_advice(void) {
  return df_blas_coretype_for(dflash_blas_corename(), df_blas_cpu());
}

void df_blas_setup(void) {
  /* One OpenBLAS thread: the trainer's pool (n_threads) cuts each large product
   * into one single-threaded call per thread of the pool (train/ops.c's df_sgemm). OpenBLAS's
   * own threads spin-yield between products, taking a core from the pool's
   * row loops (the CE's exps, AdamW): 30 % system time at --threads 2 before. OpenBLAS
   * starts one thread per CPU; the setting is process-wide. */
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
  static atomic_flag warned = ATOMIC_FLAG_INIT;
  const char *better = dflash_blas_coretype_advice();
  if (better && !atomic_flag_test_and_set(&warned))
    df_log(DFLASH_LOG_WARN,
           "OpenBLAS runs its generic %s kernels on this CPU; set OPENBLAS_CORETYPE=%s before "
           "the process starts (OpenBLAS reads it when loaded) for its %s kernels, which this "
           "CPU runs faster",
           dflash_blas_corename(), better, better);
}
