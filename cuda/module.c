/*
 * The CUDA backend module's side of dfcuda_module.h: its one exported symbol, and the few
 * library functions the .cu files call, forwarded to the library that loaded the module.
 * The module links no libdflash code of its own: a second copy of df_error would record
 * messages where dflash_last_error never looks.
 */
#include <stdarg.h>
#include <stdio.h>

#include "train/cuda/dfcuda_module.h"

int df_cuda_device_count(int *count, char *msg, size_t msg_len); /* device.cu */

static const df_cu_host *host;

dflash_status df_error(dflash_status status, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return host->error(status, msg);
}

dflash_status df_bucket_layout_init(df_bucket_layout *l, size_t n, int world, size_t bucket_elems) {
  return host->bucket_layout_init(l, n, world, bucket_elems);
}

void df_bucket_layout_free(df_bucket_layout *l) { host->bucket_layout_free(l); }

void df_act_layout_compute(const df_act_dims *d, df_act_layout *o) {
  host->act_layout_compute(d, o);
}

static const df_cu_module table = {
    .abi = DF_CU_MODULE_ABI,
    .version = DFLASH_VERSION_STRING,
    .sizes = DF_CU_MODULE_SIZES,
    .device_count = df_cuda_device_count,
    .create = df_cu_create,
    .free = df_cu_free,
    .zero_grad = df_cu_zero_grad,
    .accumulate = df_cu_accumulate,
    .results = df_cu_results,
    .scale_grads = df_cu_scale_grads,
    .predict = df_cu_predict,
    .step = df_cu_step,
    .copy = df_cu_copy,
    .nccl_unique_id = df_cu_nccl_unique_id,
    .nccl_init = df_cu_nccl_init,
    .allreduce_host = df_cu_allreduce_host,
    .memory = df_cu_memory,
    .host_alloc = df_cu_host_alloc,
    .host_free = df_cu_host_free,
    .step_result = df_cu_step_result,
    .device_props = df_cu_device_props,
    .set_draft_vocab = df_cu_set_draft_vocab,
};

/* The library calls this once, before anything else, and keeps the module loaded. */
__attribute__((visibility("default"))) const df_cu_module *df_cuda_module_v1(const df_cu_host *h) {
  host = h;
  return &table;
}
