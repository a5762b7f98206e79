/* dflash_cuda_device_count: whether CUDA is built in and usable. It lives in train/, beside the
 * module loader it asks, so that core calls nothing above it (scripts/include-graph.sh --calls). */
#include "core/internal.h"

#include <stdio.h>

#ifdef DFLASH_HAVE_CUDA
int df_cuda_device_count(int *count, char *msg, size_t msg_len);
#endif

DFLASH_API dflash_status dflash_cuda_device_count(int32_t *count) {
  DF_CHECK_ARG(count);
  *count = 0;
#ifdef DFLASH_HAVE_CUDA
  char msg[256] = "";
  if (df_cuda_device_count(count, msg, sizeof msg) != 0)
    return df_error(DFLASH_E_NO_DEVICE, "no usable CUDA device: %s", msg);
  if (*count == 0) return df_error(DFLASH_E_NO_DEVICE, "no CUDA device found");
  return DFLASH_OK;
#else
  return df_error(DFLASH_E_UNSUPPORTED,
                  "libdflash was built without CUDA (meson -Dcuda=enabled with nvcc installed)");
#endif
}
