/* LD_PRELOAD stand-in for OpenBLAS's openblas_get_corename, for test_train_blas.py:
 * the generic set OpenBLAS falls back to on a CPU it does not know, unless
 * OPENBLAS_CORETYPE chose one (as OpenBLAS itself would then report). */
#include <stdlib.h>

char *openblas_get_corename(void);

char *openblas_get_corename(void) {
  char *forced = getenv("OPENBLAS_CORETYPE");
  return forced && *forced ? forced : "Prescott";
}
