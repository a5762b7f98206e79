// Device discovery for the CUDA backend. Returns plain codes; the C side
// (src/core/cuda.c) turns them into dflash_status + messages.
#include <cuda_runtime.h>
#include <stdio.h>

extern "C" int df_cuda_device_count(int *count, char *msg, size_t msg_len) {
  cudaError_t err = cudaGetDeviceCount(count);
  if (err != cudaSuccess) {
    *count = 0;
    snprintf(msg, msg_len, "%s (%s)", cudaGetErrorString(err), cudaGetErrorName(err));
    return (int)err;
  }
  return 0;
}
