/*
 * The CUDA backend, loaded on demand. In a build with CUDA the .cu files live in their own
 * module, libdflash-cuda.so, linked against cudart, cuBLAS and NCCL; libdflash itself links
 * none of them. The first CUDA call (dflash_cuda_device_count, a CUDA trainer) loads the
 * module; until then a process that tokenizes or fetches maps no CUDA library, runs where
 * none is installed, and leaves the libnccl.so.2 soname free for a later `import torch`.
 *
 * Where the module is looked for, first hit wins:
 *   1. $DFLASH_CUDA_MODULE, alone when set (uninstalled builds, tests);
 *   2. libdflash-cuda.so beside the file this code was loaded from (dladdr): the installed
 *      libdir, or the build folder;
 *   3. libdflash-cuda.so through the dynamic loader (LD_LIBRARY_PATH, ld.so.cache).
 * A module that cannot be found or loaded, or its CUDA libraries or driver missing, make
 * every CUDA call fail with DFLASH_E_NO_DEVICE and the reason (as a machine without a GPU
 * does, so callers that fall back to the CPU keep doing so); a module from another build
 * is refused. A failed load is retried at the next call, a loaded module stays.
 *
 * The df_cu_* definitions below stand in for the module's in the library, so
 * backend_cuda.c calls them unchanged; each loads the module if needed and forwards.
 */
#include <dlfcn.h>
#include <libgen.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dfcuda_module.h"

static dflash_status host_error(dflash_status st, const char *msg) {
  return df_error(st, "%s", msg);
}

static const df_cu_host host_services = {
    .error = host_error,
    .bucket_layout_init = df_bucket_layout_init,
    .bucket_layout_free = df_bucket_layout_free,
    .act_layout_compute = df_act_layout_compute,
};

static _Atomic(const df_cu_module *) loaded;
static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

/* The module's table, or NULL with the reason in msg. */
static const df_cu_module *check_table(const df_cu_module *t, const char *path, char *msg,
                                       size_t len) {
  static const size_t want[DF_CU_MODULE_N_SIZES] = DF_CU_MODULE_SIZES;
  if (t && t->abi == DF_CU_MODULE_ABI && t->version && !strcmp(t->version, DFLASH_VERSION_STRING) &&
      !memcmp(t->sizes, want, sizeof want))
    return t;
  snprintf(msg, len,
           "the CUDA backend module %s is from another libdflash build (module "
           "abi %u, version %s; this library wants abi %u, version %s, and the same "
           "structs); install the module of this build",
           path, t ? t->abi : 0, t && t->version ? t->version : "?", DF_CU_MODULE_ABI,
           DFLASH_VERSION_STRING);
  return NULL;
}

/* dlopen `path` and take its table; NULL with the reason in msg. */
static const df_cu_module *open_module(const char *path, const char *how, char *msg, size_t len) {
  void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(msg, len, "cannot load the CUDA backend module %s (%s): %s", path, how, dlerror());
    return NULL;
  }
  df_cu_module_entry_fn entry = (df_cu_module_entry_fn)dlsym(h, DF_CU_MODULE_ENTRY);
  if (!entry) {
    snprintf(msg, len, "%s (%s) is not a libdflash CUDA backend module: no symbol %s", path, how,
             DF_CU_MODULE_ENTRY);
    dlclose(h);
    return NULL;
  }
  const df_cu_module *t = check_table(entry(&host_services), path, msg, len);
  if (!t) dlclose(h);
  return t; /* never closed once in use: the CUDA runtime does not unload cleanly */
}

/* The folder of the file holding this code: libdflash.so, or an executable linking the
 * static archive. False when dladdr cannot tell. */
static bool own_dir(char *out, size_t len) {
  Dl_info info;
  if (!dladdr((void *)&host_services, &info) || !info.dli_fname || !info.dli_fname[0]) return false;
  char copy[4096];
  if (snprintf(copy, sizeof copy, "%s", info.dli_fname) >= (int)sizeof copy) return false;
  return snprintf(out, len, "%s", dirname(copy)) < (int)len;
}

static const df_cu_module *find_module(char *msg, size_t len) {
  const char *env = getenv("DFLASH_CUDA_MODULE");
  if (env && env[0]) {
    if (access(env, F_OK) != 0) {
      snprintf(msg, len, "the CUDA backend module %s (DFLASH_CUDA_MODULE) was not found", env);
      return NULL;
    }
    return open_module(env, "DFLASH_CUDA_MODULE", msg, len);
  }
  char dir[4096], path[4200];
  bool have_dir = own_dir(dir, sizeof dir);
  if (have_dir) {
    snprintf(path, sizeof path, "%s/%s", dir, DF_CU_MODULE_FILE);
    if (access(path, F_OK) == 0) return open_module(path, "beside libdflash", msg, len);
  }
  const df_cu_module *t = open_module(DF_CU_MODULE_FILE, "the loader's search path", msg, len);
  if (!t && have_dir && strstr(msg, DF_CU_MODULE_FILE ": cannot open shared object file"))
    snprintf(msg, len,
             "the CUDA backend module %s was not found (not in %s, not on the "
             "loader's search path; set DFLASH_CUDA_MODULE to its path)",
             DF_CU_MODULE_FILE, dir);
  return t;
}

/* The loaded module, loading it if needed; NULL with the reason in msg. */
static const df_cu_module *module(char *msg, size_t len) {
  const df_cu_module *t = atomic_load_explicit(&loaded, memory_order_acquire);
  if (t) return t;
  pthread_mutex_lock(&load_lock);
  t = atomic_load_explicit(&loaded, memory_order_relaxed);
  if (!t && (t = find_module(msg, len))) atomic_store_explicit(&loaded, t, memory_order_release);
  pthread_mutex_unlock(&load_lock);
  return t;
}

/* For the df_cu_* calls: the module, or NULL after recording DFLASH_E_NO_DEVICE. */
static const df_cu_module *module_or_error(void) {
  char msg[1024] = "";
  const df_cu_module *t = module(msg, sizeof msg);
  if (!t) df_error(DFLASH_E_NO_DEVICE, "%s", msg);
  return t;
}

#define FORWARD(call)                           \
  do {                                          \
    const df_cu_module *m_ = module_or_error(); \
    return m_ ? m_->call : DFLASH_E_NO_DEVICE;  \
  } while (0)

/* device_count.c turns a non-zero code and msg into DFLASH_E_NO_DEVICE. */
int df_cuda_device_count(int *count, char *msg, size_t msg_len);
int df_cuda_device_count(int *count, char *msg, size_t msg_len) {
  const df_cu_module *t = module(msg, msg_len);
  if (!t) {
    *count = 0;
    return -1;
  }
  return t->device_count(count, msg, msg_len);
}

dflash_status df_cu_create(const df_cu_config *c, const float *params, const float *embed,
                           const float *lm_head, df_cu_model **out) {
  FORWARD(create(c, params, embed, lm_head, out));
}

dflash_status df_cu_zero_grad(df_cu_model *m) { FORWARD(zero_grad(m)); }

dflash_status df_cu_accumulate(df_cu_model *m, const df_cu_batch *b, float *row_loss) {
  FORWARD(accumulate(m, b, row_loss));
}

dflash_status df_cu_results(df_cu_model *m, double *loss_sum, int64_t *bad, size_t n) {
  FORWARD(results(m, loss_sum, bad, n));
}

dflash_status df_cu_scale_grads(df_cu_model *m, double k) { FORWARD(scale_grads(m, k)); }

dflash_status df_cu_set_draft_vocab(df_cu_model *m, const int32_t *kept) {
  FORWARD(set_draft_vocab(m, kept));
}

dflash_status df_cu_predict(df_cu_model *m, const df_cu_batch *b, int32_t *pred) {
  FORWARD(predict(m, b, pred));
}

dflash_status df_cu_step(df_cu_model *m, const df_cu_adam *a, double *norm) {
  FORWARD(step(m, a, norm));
}

dflash_status df_cu_step_result(df_cu_model *m, double *norm) { FORWARD(step_result(m, norm)); }

dflash_status df_cu_device_props(int device, df_cu_props *out) {
  FORWARD(device_props(device, out));
}

dflash_status df_cu_copy(df_cu_model *m, int kind, float *host, int to_host) {
  FORWARD(copy(m, kind, host, to_host));
}

dflash_status df_cu_nccl_unique_id(void *id) { FORWARD(nccl_unique_id(id)); }

dflash_status df_cu_nccl_init(df_cu_model *m, int rank, int world, const void *id,
                              double timeout_s) {
  FORWARD(nccl_init(m, rank, world, id, timeout_s));
}

dflash_status df_cu_allreduce_host(df_cu_model *m, double *x, int n) {
  FORWARD(allreduce_host(m, x, n));
}

dflash_status df_cu_host_alloc(size_t bytes, void **out) { FORWARD(host_alloc(bytes, out)); }

/* The void calls free or report what the module made, so without a module (none loaded)
 * there is nothing to free: they do nothing rather than load it. */
void df_cu_free(df_cu_model *m) {
  const df_cu_module *t = atomic_load_explicit(&loaded, memory_order_acquire);
  if (t) t->free(m);
}

void df_cu_host_free(void *p) {
  const df_cu_module *t = atomic_load_explicit(&loaded, memory_order_acquire);
  if (t) t->host_free(p);
}

void df_cu_memory(const df_cu_model *m, size_t *peak, size_t *now, size_t *arena) {
  const df_cu_module *t = atomic_load_explicit(&loaded, memory_order_acquire);
  if (t) {
    t->memory(m, peak, now, arena);
    return;
  }
  *peak = *now = *arena = 0;
}
