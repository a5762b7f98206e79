/* The float32 CPU reference backend: the trainer's host buffers are the
 * storage, df_model does forward/backward, AdamW runs on the thread pool (Muon, when
 * asked, on the matrices: optim_muon.c).
 * With several ranks (t->comm) it is also the CPU twin of the CUDA
 * backend's NCCL data parallelism: gradients are summed over the ranks'
 * TCP connections before the clip and AdamW. */
#include "backend.h"
#include "train/cuda/dist.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct cpu_backend {
  df_backend base;
  dflash_trainer *t;
} cpu_backend;

static dflash_trainer *trainer_of(df_backend *b) { return ((cpu_backend *)b)->t; }

static void cpu_destroy(df_backend *b) { free(b); }

static dflash_status cpu_zero_grad(df_backend *b) {
  df_model *m = &trainer_of(b)->m;
  memset(m->grads, 0, m->n_params * sizeof(float));
  return DFLASH_OK;
}

static dflash_status cpu_accumulate(df_backend *b, const df_seq *s, double grad_scale,
                                    double *loss_sum, double *weight_sum) {
  /* DFlash 2 too: df_model_step adds the candidate selector's loss; DSpark its heads'. */
  return df_model_step_final(&trainer_of(b)->m, s->ids, s->labels, s->loss_mask, s->len, s->hidden,
                             s->final, s->anchors, s->n_anchors, grad_scale, true, loss_sum,
                             weight_sum);
}

static dflash_status cpu_predict(df_backend *b, const df_seq *s, int32_t *pred) {
  return df_model_predict(&trainer_of(b)->m, s->ids, s->len, s->hidden, s->anchors, s->n_anchors,
                          pred);
}

typedef struct adam_ctx {
  float *p, *g, *m1, *m2;
  float decay, b1, b2, eps, step_size, bc2_sqrt;
} adam_ctx;

/* torch.optim.AdamW's single-tensor update, in float32 like it. The fields are read into
 * locals and the arrays through restrict pointers so that the compiler vectorizes the loop
 * (through `c` it had to assume each store could change the next element's constants): 7.6 %
 * of a demo step's CPU before. sqrtf and the division stay exact per element, so the result
 * is the scalar loop's, bit for bit. */
static void adam_range(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  const adam_ctx *c = vc;
  float *restrict p = c->p, *restrict m1 = c->m1, *restrict m2 = c->m2;
  const float *restrict gr = c->g;
  const float decay = c->decay, b1 = c->b1, b2 = c->b2, eps = c->eps;
  const float step = c->step_size, bc2 = c->bc2_sqrt;
  for (size_t i = b; i < e; i++) {
    float g = gr[i];
    p[i] *= decay;
    m1[i] += (g - m1[i]) * (1.0f - b1);
    m2[i] = m2[i] * b2 + (1.0f - b2) * g * g;
    float denom = sqrtf(m2[i]) / bc2 + eps;
    p[i] -= step * (m1[i] / denom);
  }
}

typedef struct scale_ctx {
  float *x;
  float k;
} scale_ctx;

static void scale_range(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  scale_ctx *c = vc;
  for (size_t i = b; i < e; i++) c->x[i] *= c->k;
}

/* DFLASH_OPTIMIZER_MUON: Muon on the matrices (its momentum in m1), AdamW `c` on the rest. */
static dflash_status muon_and_adam(df_model *m, float *m1, const df_adam *a, const adam_ctx *c) {
  for (size_t i = 0; i < m->n_tensors; i++) {
    const df_tensor_info *ti = &m->tensors[i];
    if (df_muon_takes(ti)) {
      dflash_status st = df_muon_update(m->pool, m->params + ti->offset, m->grads + ti->offset,
                                        m1 + ti->offset, ti->shape[0], ti->shape[1], a);
      if (st) return df_error_wrap(st, "step %lld: Muon on %s", (long long)a->step - 1, ti->name);
      continue;
    }
    adam_ctx one = *c;
    one.p += ti->offset, one.g += ti->offset, one.m1 += ti->offset, one.m2 += ti->offset;
    df_pool_for(m->pool, ti->numel, 1 << 14, adam_range, &one);
  }
  return DFLASH_OK;
}

static dflash_status cpu_step(df_backend *b, const df_adam *a, double *grad_norm) {
  dflash_trainer *t = trainer_of(b);
  df_model *m = &t->m;
  /* Data parallel: every rank gets the same (rank-ordered) sum, so the
   * norm, the clip and the update agree to the bit across ranks. */
  if (t->comm) {
    dflash_status st = df_comm_sum_f32(t->comm, m->grads, m->n_params);
    if (st) return df_error_wrap(st, "step %lld: gradient all-reduce", (long long)a->step - 1);
  }
  double norm = sqrt(df_sumsq(m->pool, m->grads, m->n_params));
  *grad_norm = norm;
  if (!isfinite(norm))
    return df_error(DFLASH_E_RANGE,
                    "step %lld: gradient norm is not finite; parameters left "
                    "unchanged",
                    (long long)a->step - 1);
  double coef = df_clip_coef(a->grad_clip, norm);
  if (coef < 1.0) {
    scale_ctx sc = {m->grads, (float)coef};
    df_pool_for(m->pool, m->n_params, 1 << 14, scale_range, &sc);
  }
  df_adam_consts k;
  df_adam_constants(a, &k);
  adam_ctx c = {.p = m->params,
                .g = m->grads,
                .m1 = t->m1,
                .m2 = t->m2,
                .decay = k.decay,
                .b1 = k.b1,
                .b2 = k.b2,
                .eps = k.eps,
                .step_size = k.step_size,
                .bc2_sqrt = k.bc2_sqrt};
  if (!a->muon) {
    df_pool_for(m->pool, m->n_params, 1 << 14, adam_range, &c);
    return DFLASH_OK;
  }
  return muon_and_adam(m, t->m1, a, &c);
}

/* The host buffers are the storage: nothing to move. */
static dflash_status cpu_pull(df_backend *b, df_buf_kind kind, float *host) {
  (void)b, (void)kind, (void)host;
  return DFLASH_OK;
}

static dflash_status cpu_push(df_backend *b, df_buf_kind kind, const float *host) {
  (void)b, (void)kind, (void)host;
  return DFLASH_OK;
}

static const df_backend_vt cpu_vt = {
    .name = "cpu",
    .destroy = cpu_destroy,
    .zero_grad = cpu_zero_grad,
    .accumulate = cpu_accumulate,
    .predict = cpu_predict,
    .step = cpu_step,
    .pull = cpu_pull,
    .push = cpu_push,
};

dflash_status df_backend_cpu_create(dflash_trainer *t, df_backend **out) {
  cpu_backend *b = calloc(1, sizeof *b);
  if (!b) return df_error_nomem("CPU backend");
  b->base.vt = &cpu_vt;
  b->t = t;
  *out = &b->base;
  return DFLASH_OK;
}
