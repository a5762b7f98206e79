/* Backend selection helpers and the host-cache protocol (backend.h). */
#include "backend.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "train/cuda/dfcuda.h"

#include <math.h>
#include <stdio.h>

void df_adam_constants(const df_adam *a, df_adam_consts *k) {
  double n = (double)a->step;
  double bc1 = 1.0 - pow(a->beta1, n), bc2 = 1.0 - pow(a->beta2, n);
  k->decay = (float)(1.0 - a->lr * a->weight_decay);
  k->b1 = (float)a->beta1;
  k->b2 = (float)a->beta2;
  k->eps = (float)a->eps;
  k->step_size = (float)(a->lr / bc1);
  k->bc2_sqrt = (float)sqrt(bc2);
}

double df_clip_coef(double clip, double norm) {
  if (clip <= 0) return 1.0;
  double coef = clip / (norm + 1e-6);
  return coef < 1.0 ? coef : 1.0;
}

static float *host_buffer(const dflash_trainer *t, df_buf_kind kind) {
  switch (kind) {
  case DF_BUF_PARAMS: return t->m.params;
  case DF_BUF_GRADS: return t->m.grads;
  case DF_BUF_M1: return t->m1;
  case DF_BUF_M2: return t->m2;
  }
  return NULL;
}

static const df_buf_kind all_kinds[] = {DF_BUF_PARAMS, DF_BUF_GRADS, DF_BUF_M1, DF_BUF_M2};

dflash_status df_trainer_pull(const dflash_trainer *t, unsigned kinds) {
  df_backend *b = t->be;
  for (size_t i = 0; i < DF_ARRAY_LEN(all_kinds); i++) {
    df_buf_kind k = all_kinds[i];
    if (!(kinds & k & b->stale)) continue;
    dflash_status st = b->vt->pull(b, k, host_buffer(t, k));
    if (st) return st;
    b->stale &= ~(unsigned)k;
  }
  return DFLASH_OK;
}

dflash_status df_trainer_push(const dflash_trainer *t, unsigned kinds) {
  df_backend *b = t->be;
  for (size_t i = 0; i < DF_ARRAY_LEN(all_kinds); i++) {
    df_buf_kind k = all_kinds[i];
    if (!(kinds & k)) continue;
    dflash_status st = b->vt->push(b, k, host_buffer(t, k));
    if (st) return st;
    b->stale &= ~(unsigned)k;
  }
  return DFLASH_OK;
}

dflash_status df_backend_auto_sequences(int32_t backend, int world, int32_t *out, char *note,
                                        size_t note_len) {
  if (backend == DFLASH_BACKEND_CUDA)
    return df_backend_cuda_auto_sequences(world, out, note, note_len);
  *out = 1; /* the CPU's compute outlasts its TCP sums */
  snprintf(note, note_len, "1 sequence per rank per optimizer step (CPU backend)");
  return DFLASH_OK;
}

DF_PRINTF(4, 5) static void add(char *out, size_t len, size_t *at, const char *fmt, ...) {
  if (*at >= len) return;
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(out + *at, len - *at, fmt, ap);
  va_end(ap);
  if (n > 0) *at += (size_t)n < len - *at ? (size_t)n : len - *at - 1;
}

/* The NCCL settings a PCIe box is tuned with (docs/gpu.md). */
static const char *const nccl_vars[] = {"NCCL_P2P_LEVEL", "NCCL_P2P_DISABLE", "NCCL_MIN_NCHANNELS",
                                        "NCCL_ALGO",      "NCCL_PROTO",       "NCCL_GRAPH_FILE"};

static void link_advice(const df_cu_props *p, int world, const char *(*env)(const char *),
                        char *out, size_t len, size_t *at) {
  int pcie = df_cu_arch_pcie(p->major, p->minor);
  const char *ch = env("NCCL_MIN_NCHANNELS"), *lvl = env("NCCL_P2P_LEVEL"),
             *off = env("NCCL_P2P_DISABLE");
  const char *sep = "; check:";
  if (world <= 1) return;
  if (p->p2p_missing >= 0) {
    add(out, len, at,
        "%s no P2P to device %d, so NCCL goes through host memory (IOMMU and "
        "ACS off, nvidia_uvm uvm_disable_hmm=1)",
        sep, p->p2p_missing);
    sep = ",";
  }
  if (off && strcmp(off, "0")) {
    add(out, len, at, "%s NCCL_P2P_DISABLE=%s turns P2P off", sep, off);
    sep = ",";
  }
  if (pcie && (!ch || atoi(ch) < 8)) {
    add(out, len, at,
        "%s NCCL_MIN_NCHANNELS=8 (NCCL's default 2 channels measured 22 GB/s "
        "against 38 tuned on 8 RTX PRO 6000)",
        sep);
    sep = ",";
  }
  if (pcie && !lvl) add(out, len, at, "%s NCCL_P2P_LEVEL=SYS (P2P across the CPU sockets)", sep);
  if (pcie && !strcmp(sep, "; check:"))
    add(out, len, at, "; the PCIe settings of docs/gpu.md are in effect");
}

void df_link_note(const df_cu_props *p, int device, int world, const char *(*env)(const char *),
                  char *out, size_t len) {
  size_t at = 0;
  if (!len) return;
  *out = 0;
  int pcie = df_cu_arch_pcie(p->major, p->minor);
  add(out, len, &at, "device %d of %d: %s (sm_%d%d, %s); P2P to %d of %d other device(s); ", device,
      p->n_devices, p->name, p->major, p->minor, pcie ? "PCIe, no NVLink" : "NVLink", p->p2p_peers,
      p->n_devices > 0 ? p->n_devices - 1 : 0);
  if (p->nccl_version > 0)
    add(out, len, &at, "NCCL %d.%d.%d", p->nccl_version / 10000, p->nccl_version / 100 % 100,
        p->nccl_version % 100);
  else add(out, len, &at, "NCCL %s", p->nccl_version < 0 ? "not built in" : "(version unknown)");
  for (size_t i = 0; i < DF_ARRAY_LEN(nccl_vars); i++) {
    const char *v = env(nccl_vars[i]);
    add(out, len, &at, "%s %s=%s", i ? "" : ",", nccl_vars[i], v ? v : "(unset)");
  }
  link_advice(p, world, env, out, len, &at);
}
