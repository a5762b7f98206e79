// Device discovery for the CUDA backend. df_cuda_device_count returns plain codes (the C
// side, src/train/cuda/device_count.c, turns them into dflash_status + messages); df_cu_device_props is
// the dfcuda.h call the trainer reads a device through before it creates a model.
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#ifdef DFLASH_HAVE_NCCL
#include <nccl.h>
#endif

#include "common.cuh"

extern "C" int df_cuda_device_count(int *count, char *msg, size_t msg_len) {
  cudaError_t err = cudaGetDeviceCount(count);
  if (err != cudaSuccess) {
    *count = 0;
    snprintf(msg, msg_len, "%s (%s)", cudaGetErrorString(err), cudaGetErrorName(err));
    return (int)err;
  }
  return 0;
}

extern "C" dflash_status df_cu_device_props(int device, df_cu_props *out) {
  int n = 0;
  char msg[256] = "";
  if (df_cuda_device_count(&n, msg, sizeof msg) != 0 || device < 0 || device >= n)
    return df_error(DFLASH_E_NO_DEVICE, "CUDA device %d: %s", device,
                    *msg ? msg : "no such device");
  cudaDeviceProp p;
  DF_CU(cudaGetDeviceProperties(&p, device));
  memset(out, 0, sizeof *out);
  snprintf(out->name, sizeof out->name, "%s", p.name);
  out->major = p.major, out->minor = p.minor, out->sms = p.multiProcessorCount;
  out->smem_per_block = p.sharedMemPerBlockOptin;
  out->total_mem = p.totalGlobalMem;
  out->n_devices = n, out->p2p_missing = -1;
  for (int o = 0; o < n; o++) {
    int can = 0;
    if (o == device) continue;
    DF_CU(cudaDeviceCanAccessPeer(&can, device, o));
    if (can) out->p2p_peers++;
    else if (out->p2p_missing < 0) out->p2p_missing = o;
  }
  out->nccl_version = -1;
#ifdef DFLASH_HAVE_NCCL
  if (ncclGetVersion(&out->nccl_version) != ncclSuccess) out->nccl_version = 0;
#endif
  return DFLASH_OK;
}
