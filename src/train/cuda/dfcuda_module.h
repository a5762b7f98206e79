/*
 * The boundary between libdflash and its CUDA backend module, libdflash-cuda.so (the .cu
 * files and cuda/module.c), which the library loads with dlopen on the first CUDA call
 * (src/train/cuda/cuda_module.c). So a process that never trains on CUDA maps no CUDA library,
 * and a machine without CUDA runs the library.
 *
 * Internal: the module and the library come from one build. The module exports one symbol,
 * DF_CU_MODULE_ENTRY, that takes the library's services and returns its function table;
 * the library refuses a table whose abi, version or struct sizes differ from its own.
 */
#ifndef DFLASH_CUDA_DFCUDA_MODULE_H
#define DFLASH_CUDA_DFCUDA_MODULE_H

#include "dfcuda.h"
#include "train/cuda/dist.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bump on any change below or in dfcuda.h's structs and functions. */
#define DF_CU_MODULE_ABI 8
#define DF_CU_MODULE_ENTRY "df_cuda_module_v1"
/* The file the library looks for (beside itself, then on the loader's search path). */
#define DF_CU_MODULE_FILE "libdflash-cuda.so"

/* What the module calls back into the library for: the library's thread-local error state
 * (dflash_last_error), and the layouts model.cu shares with the CPU side. */
typedef struct df_cu_host {
  dflash_status (*error)(dflash_status st, const char *msg);
  dflash_status (*bucket_layout_init)(df_bucket_layout *l, size_t n, int world,
                                      size_t bucket_elems);
  void (*bucket_layout_free)(df_bucket_layout *l);
  void (*act_layout_compute)(const df_act_dims *d, df_act_layout *o);
} df_cu_host;

#define DF_CU_MODULE_N_SIZES 9

/* dfcuda.h as a table: each entry is the function of the same name there. A function added
 * to dfcuda.h gets an entry here, in cuda/module.c's table and a forwarder in
 * src/train/cuda/cuda_module.c; without the forwarder libdflash's link fails (undefined df_cu_*),
 * and a library call added to a .cu file without a forwarder in module.c fails the
 * module's. */
typedef struct df_cu_module {
  uint32_t abi;                       /* DF_CU_MODULE_ABI */
  const char *version;                /* DFLASH_VERSION_STRING */
  size_t sizes[DF_CU_MODULE_N_SIZES]; /* DF_CU_MODULE_SIZES */
  int (*device_count)(int *count, char *msg, size_t msg_len);
  dflash_status (*create)(const df_cu_config *c, const float *params, const float *embed,
                          const float *lm_head, df_cu_model **out);
  void (*free)(df_cu_model *m);
  dflash_status (*zero_grad)(df_cu_model *m);
  dflash_status (*accumulate)(df_cu_model *m, const df_cu_batch *b, float *row_loss);
  dflash_status (*results)(df_cu_model *m, double *loss_sum, int64_t *bad, size_t n);
  dflash_status (*scale_grads)(df_cu_model *m, double k);
  dflash_status (*predict)(df_cu_model *m, const df_cu_batch *b, int32_t *pred);
  dflash_status (*step)(df_cu_model *m, const df_cu_adam *a, double *norm);
  dflash_status (*copy)(df_cu_model *m, int kind, float *host, int to_host);
  dflash_status (*nccl_unique_id)(void *id);
  dflash_status (*nccl_init)(df_cu_model *m, int rank, int world, const void *id, double timeout_s);
  dflash_status (*allreduce_host)(df_cu_model *m, double *x, int n);
  void (*memory)(const df_cu_model *m, size_t *peak, size_t *now, size_t *arena);
  dflash_status (*host_alloc)(size_t bytes, void **out);
  void (*host_free)(void *p);
  dflash_status (*step_result)(df_cu_model *m, double *norm);
  dflash_status (*device_props)(int device, df_cu_props *out);
  dflash_status (*set_draft_vocab)(df_cu_model *m, const int32_t *kept);
} df_cu_module;

/* Every struct that crosses the boundary, so a stale module from another build is refused
 * rather than read with the wrong layout. */
#define DF_CU_MODULE_SIZES                                                                        \
  {                                                                                               \
    sizeof(df_cu_host), sizeof(df_cu_module), sizeof(df_cu_config), sizeof(df_cu_batch),          \
        sizeof(df_cu_adam), sizeof(df_bucket_layout), sizeof(df_act_dims), sizeof(df_act_layout), \
        sizeof(df_cu_props)                                                                       \
  }

typedef const df_cu_module *(*df_cu_module_entry_fn)(const df_cu_host *host);

#ifdef __cplusplus
}
#endif

#endif
