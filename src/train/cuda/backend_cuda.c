/*
 * The CUDA backend's host side: device and rank discovery, the NCCL
 * rendezvous, and per-sequence preparation (block tokens, supervised rows; the
 * hidden rows are passed as stored: the device converts and checks them) for
 * cuda/model.cu. Accumulates without a loss pointer do not wait for the
 * device: their losses and NaN/Inf checks are collected at the step. A step
 * without a norm pointer does not wait either: the norm, clip factor and
 * update run on the device and the norm comes from step_result.
 * Without CUDA in the build every entry point fails with
 * DFLASH_E_UNSUPPORTED, without a device with DFLASH_E_NO_DEVICE.
 */
#include "train/backend.h"

#include <dflash/hidden.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef DFLASH_HAVE_CUDA
#include <math.h>

#include "dfcuda.h"
#include "core/bf16.h"
#include "dist.h"
#include "train/dspark.h"

typedef struct cuda_backend {
  df_backend base;
  dflash_trainer *t;
  df_cu_model *dev;
  df_dist_env env;
  bool nccl; /* joins (or joined) NCCL: several ranks, or DFLASH_NCCL=1 */
  /* host staging, grown as needed (model.cu copies it into pinned memory) */
  int32_t *i32;
  float *f32;
  uint16_t *u16; /* DSpark: the target's final state at each row, bf16 [R, H] */
  size_t i32_cap, f32_cap, u16_cap;
  unsigned dv_gen; /* the model's draft vocabulary (df_model dv_gen) the device holds */
  /* gradient normalisation across ranks (see cuda_step) */
  double scale_used, weight_local;
  /* accumulates whose losses are still on the device (df_cu_results): sum(w), sample id */
  double *pend_w;
  char **pend_id;
  size_t n_pend, cap_pend;
} cuda_backend;

static cuda_backend *cb(df_backend *b) { return (cuda_backend *)b; }

static dflash_status grow(void **p, size_t *cap, size_t bytes) {
  if (bytes <= *cap) return DFLASH_OK;
  void *q = realloc(*p, bytes);
  if (!q) return df_error_nomem("CUDA batch staging");
  *p = q;
  *cap = bytes;
  return DFLASH_OK;
}

/* The loss weight of a row at block slot j: DSpark's exp(-j / gamma) (df_dspark_rows'), else
 * the position weight. */
static double row_weight(const df_model *m, int j) {
  if (!m->dspark) return df_position_weight(m, j);
  return m->gamma > 0 ? exp(-(double)j / m->gamma) : 1.0;
}

/* Block tokens, supervised rows and weights (df_model_rows, as the CPU backend's; DSpark's
 * anchor-first rows from df_dspark_rows, with the Markov head's previous token and the
 * target's final state at each row in bf16), as arrays for the device; the context rows as
 * given (fp32, or the stored bf16 / fp8 codes), for the device to convert. */
static dflash_status prepare(cuda_backend *c, const df_seq *s, double grad_scale, df_cu_batch *b) {
  df_model *m = &c->t->m;
  int A = s->n_anchors, Sc = 0, max_pos = 0;
  int T = A * m->B, cap_r = A * (m->dspark ? m->B : m->B - 1);
  dflash_status st = grow((void **)&c->i32, &c->i32_cap, sizeof(int32_t) * ((size_t)T + 3 * cap_r));
  if (!st) st = grow((void **)&c->f32, &c->f32_cap, sizeof(float) * 2 * (size_t)cap_r);
  if (st) return st;
  int32_t *tok = c->i32, *rows_t = tok + T, *rows_target = rows_t + cap_r;
  int32_t *rows_prev = rows_target + cap_r; /* DFlash 2's selector: the true token before */
  float *coef = c->f32;
  int R = df_model_rows(m, s->ids, s->labels, s->loss_mask, s->len, s->anchors, A, grad_scale, &Sc,
                        &max_pos, tok, rows_t, rows_target, rows_prev, coef);
  const uint16_t *rows_final = NULL;
  if (m->dspark) {
    R = s->loss_mask
            ? df_dspark_rows(m->B, m->gamma, s->ids, s->labels, s->loss_mask, s->len, s->anchors, A,
                             grad_scale, rows_t, rows_target, rows_prev, NULL, coef)
            : 0;
    /* A pruned draft vocabulary: the label's draft index, -1 outside it (no CE; the CPU's
     * model_dspark.c maps them alike). The previous token stays a target id (W1 is [V, r]). */
    if (m->t2d)
      for (int r = 0; r < R; r++) rows_target[r] = m->t2d[rows_target[r]];
    if (s->final && R > 0) {
      size_t H = (size_t)m->H;
      st = grow((void **)&c->u16, &c->u16_cap, sizeof(uint16_t) * (size_t)R * H);
      if (st) return st;
      for (int r = 0; r < R; r++) {
        int t = rows_t[r];
        const float *src = s->final + (size_t)(s->anchors[t / m->B] + t % m->B) * H;
        for (size_t k = 0; k < H; k++) c->u16[(size_t)r * H + k] = df_f32_to_bf16(src[k]);
      }
      rows_final = c->u16;
    }
  }
  bool stored = s->hidden_codes != NULL;
  *b = (df_cu_batch){.T = T,
                     .Sc = Sc,
                     .R = R,
                     .A = A,
                     .max_pos = max_pos,
                     .anchors = s->anchors,
                     .block_tok = tok,
                     .rows_t = rows_t,
                     .rows_target = rows_target,
                     .coef = s->loss_mask ? coef : NULL,
                     .rows_prev = rows_prev,
                     .rows_final = rows_final,
                     .hidden_dtype = !stored                                   ? DF_CU_HIDDEN_F32
                                     : s->hidden_dtype == DFLASH_DTYPE_F8_E4M3 ? DF_CU_HIDDEN_FP8
                                                                               : DF_CU_HIDDEN_BF16,
                     .hidden_codes = stored ? s->hidden_codes : (const void *)s->hidden,
                     .hidden_scales = s->hidden_scales};
  return DFLASH_OK;
}

static void cuda_destroy(df_backend *b) {
  cuda_backend *c = cb(b);
  df_cu_free(c->dev);
  for (size_t i = 0; i < c->n_pend; i++) free(c->pend_id[i]);
  free(c->pend_w);
  free(c->pend_id);
  free(c->i32);
  free(c->f32);
  free(c->u16);
  free(c);
}

static dflash_status cuda_zero_grad(df_backend *b) {
  cb(b)->weight_local = 0;
  cb(b)->scale_used = 0;
  return df_cu_zero_grad(cb(b)->dev);
}

/*
 * Several ranks: the step undoes the callers' grad_scale (see cuda_step), so
 * the device buffer must hold sum(grad) times one scale. A sequence scaled
 * differently from the ones before first brings the buffer to its scale.
 * (A scale of 0 adds nothing and counts no weight.)
 */
static dflash_status keep_scale(cuda_backend *c, double grad_scale, const df_cu_batch *b) {
  if (c->env.world <= 1 || grad_scale == 0 || b->R == 0 || !b->coef) return DFLASH_OK;
  dflash_status st = DFLASH_OK;
  if (c->scale_used != 0 && grad_scale != c->scale_used)
    st = df_cu_scale_grads(c->dev, grad_scale / c->scale_used);
  if (!st) c->scale_used = grad_scale;
  return st;
}

/* Remember a deferred sequence: its weight and (for the error) its id. */
static dflash_status defer(cuda_backend *c, double wsum, const char *id) {
  if (c->n_pend == c->cap_pend) {
    size_t cap = c->cap_pend ? 2 * c->cap_pend : 64;
    double *w = realloc(c->pend_w, cap * sizeof *w);
    if (w) c->pend_w = w;
    char **ids = w ? realloc(c->pend_id, cap * sizeof *ids) : NULL;
    if (!ids) return df_error_nomem("deferred sequences");
    c->pend_id = ids;
    c->cap_pend = cap;
  }
  char *copy = df_strdup(id ? id : "");
  if (!copy) return df_error_nomem("deferred sequences");
  c->pend_w[c->n_pend] = wsum;
  c->pend_id[c->n_pend++] = copy;
  return DFLASH_OK;
}

/* A pruned DSpark drafter's kept ids to the device when they changed since it last had
 * them (df_model_set_draft_vocab: set, picked from the data, or loaded). */
static dflash_status sync_draft_vocab(cuda_backend *c) {
  const df_model *m = &c->t->m;
  if (!m->kept || c->dv_gen == m->dv_gen) return DFLASH_OK;
  dflash_status st = df_cu_set_draft_vocab(c->dev, m->kept);
  if (!st) c->dv_gen = m->dv_gen;
  return st;
}

static dflash_status cuda_accumulate(df_backend *b, const df_seq *s, double grad_scale,
                                     double *loss_sum, double *weight_sum) {
  cuda_backend *c = cb(b);
  df_model *m = &c->t->m;
  if (s->n_anchors < 0) return df_error(DFLASH_E_RANGE, "negative anchor count %d", s->n_anchors);
  /* Stored rows are checked for NaN/Inf on the device (fp32 ones here, as before). */
  dflash_status st = df_model_check_inputs(m, s->ids, s->len, s->hidden, s->anchors, s->n_anchors);
  if (!st && m->dspark) st = df_model_check_final(m, s->final, s->len);
  if (!st) st = df_model_draft_vocab_ready(m);
  if (!st) st = sync_draft_vocab(c);
  df_cu_batch bt;
  if (!st) st = prepare(c, s, grad_scale, &bt);
  if (st) return st;
  if ((st = keep_scale(c, grad_scale, &bt))) return st;
  double wsum = 0;
  for (int r = 0; r < bt.R; r++) wsum += row_weight(m, bt.rows_t[r] % m->B);
  if (grad_scale != 0) c->weight_local += wsum;
  if (weight_sum) *weight_sum = wsum;
  if (!loss_sum) { /* deferred: nothing waits for the device */
    if ((st = df_cu_accumulate(c->dev, &bt, NULL))) return st;
    return defer(c, wsum, s->id);
  }
  float *loss = c->f32 + bt.R; /* second half of the f32 staging */
  if ((st = df_cu_accumulate(c->dev, &bt, loss))) return st;
  double lsum = 0;
  for (int r = 0; r < bt.R; r++) lsum += row_weight(m, bt.rows_t[r] % m->B) * loss[r];
  *loss_sum = lsum;
  return DFLASH_OK;
}

/* The deferred sequences' sums (one wait for the device); a non-finite hidden row the
 * device found fails, naming the first such sample. */
static dflash_status cuda_collect(df_backend *b, double *loss_sum, double *weight_sum) {
  cuda_backend *c = cb(b);
  size_t n = c->n_pend;
  if (!n) return DFLASH_OK;
  double *loss = malloc(n * sizeof *loss);
  int64_t *bad = malloc(n * sizeof *bad);
  dflash_status st = loss && bad ? df_cu_results(c->dev, loss, bad, n)
                                 : df_error_nomem("deferred losses");
  size_t first = n;
  for (size_t i = 0; !st && i < n; i++) {
    if (bad[i] >= 0 && first == n) first = i;
    *loss_sum += loss[i];
    *weight_sum += c->pend_w[i];
  }
  if (!st && first < n) {
    int64_t KH = c->t->m.KH;
    st = df_error(DFLASH_E_FORMAT,
                  "sample %s: hidden state at position %lld, column %lld is "
                  "not finite (checked on the device)",
                  c->pend_id[first], (long long)(bad[first] / KH), (long long)(bad[first] % KH));
  }
  for (size_t i = 0; i < n; i++) free(c->pend_id[i]);
  c->n_pend = 0;
  free(loss);
  free(bad);
  return st;
}

static dflash_status cuda_predict(df_backend *b, const df_seq *s, int32_t *pred) {
  cuda_backend *c = cb(b);
  if (c->t->m.dspark) /* its drafts chain through the Markov head: model_dspark.c, CPU only */
    return df_dspark_unsupported(&c->t->m.ext, "predict (backend CUDA)",
                                 "its drafts chain through the Markov head, which only the CPU "
                                 "backend runs");
  dflash_status st = df_model_check_inputs(&c->t->m, s->ids, s->len, s->hidden, s->anchors,
                                           s->n_anchors);
  df_cu_batch bt;
  if (!st && s->n_anchors > 0) st = prepare(c, s, 0.0, &bt);
  if (st || s->n_anchors <= 0) return st;
  return df_cu_predict(c->dev, &bt, pred);
}

/*
 * Each rank scaled its gradients by its own 1/sum(w) (the caller's
 * grad_scale); the data-parallel loss is sum over ranks of sum(w*CE) over
 * the global sum(w), so before the reduction each rank's gradients are
 * multiplied by 1 / (grad_scale * global sum(w)), grad_scale being the one
 * keep_scale brought every sequence's contribution to.
 */
static dflash_status cuda_step(df_backend *b, const df_adam *a, double *grad_norm) {
  cuda_backend *c = cb(b);
  if (c->n_pend) /* the trainer collects first; this only guards the parameters */
    return df_error(DFLASH_E_STATE,
                    "CUDA: %zu accumulated sequences not collected before the "
                    "step",
                    c->n_pend);
  df_adam_consts k;
  df_adam_constants(a, &k);
  df_cu_adam ca = {.decay = k.decay,
                   .b1 = k.b1,
                   .b2 = k.b2,
                   .eps = k.eps,
                   .step_size = k.step_size,
                   .bc2_sqrt = k.bc2_sqrt,
                   .clip = a->grad_clip,
                   .grad_factor = 1.0,
                   .muon = a->muon,
                   .lr = a->lr,
                   .muon_mu = (float)a->muon_momentum,
                   .muon_decay = (float)(1.0 - a->lr * a->muon_weight_decay)};
  if (c->env.world > 1) {
    double w = c->weight_local;
    dflash_status st = df_cu_allreduce_host(c->dev, &w, 1);
    if (st) return st;
    if (c->scale_used > 0 && w > 0) ca.grad_factor = 1.0 / (c->scale_used * w);
  }
  return df_cu_step(c->dev, &ca, grad_norm); /* NULL: enqueued, the norm from step_result */
}

static dflash_status cuda_step_result(df_backend *b, double *grad_norm) {
  return df_cu_step_result(cb(b)->dev, grad_norm);
}

static int cu_kind(df_buf_kind k) {
  return k == DF_BUF_PARAMS  ? DF_CU_PARAMS
         : k == DF_BUF_GRADS ? DF_CU_GRADS
         : k == DF_BUF_M1    ? DF_CU_M1
                             : DF_CU_M2;
}

static dflash_status cuda_pull(df_backend *b, df_buf_kind kind, float *host) {
  return df_cu_copy(cb(b)->dev, cu_kind(kind), b->not_on_host & kind ? NULL : host, 1);
}

static dflash_status cuda_push(df_backend *b, df_buf_kind kind, const float *host) {
  return df_cu_copy(cb(b)->dev, cu_kind(kind), (float *)host, 0);
}

static const df_backend_vt cuda_vt = {
    .name = "cuda",
    .destroy = cuda_destroy,
    .zero_grad = cuda_zero_grad,
    .accumulate = cuda_accumulate,
    .collect = cuda_collect,
    .stored_rows = true,
    .predict = cuda_predict,
    .step = cuda_step,
    .step_result = cuda_step_result,
    .pull = cuda_pull,
    .push = cuda_push,
};

/* NCCL when there are several ranks, or on request (DFLASH_NCCL=1) with one.
 * In a training run (t->comm) the id travels over the run's connections,
 * and they decide rank and world; a trainer created alone rendezvouses
 * from the environment. */
static void find_ranks(cuda_backend *c) {
  df_comm *comm = c->t->comm;
  if (comm) c->env.rank = df_comm_rank(comm), c->env.world = df_comm_world(comm);
  const char *force = getenv("DFLASH_NCCL");
  c->nccl = c->env.world > 1 || (force && !strcmp(force, "1"));
}

void df_cu_config_of(const df_model *m, size_t *offsets, df_cu_config *out) {
  *out = (df_cu_config){.H = m->H,
                        .KH = m->KH,
                        .nh = m->nh,
                        .nkv = m->nkv,
                        .d = m->d,
                        .I = m->I,
                        .V = m->V,
                        .B = m->B,
                        .L = m->L,
                        .vocab_chunk = m->vocab_chunk,
                        .eps = (float)m->cfg.rms_norm_eps,
                        .attn_factor = m->attn_factor,
                        .inv_freq = m->inv_freq,
                        .rot = m->rot,
                        .n_params = m->n_params,
                        .n_tensors = m->n_tensors,
                        .offsets = offsets,
                        .world = 1,
                        .dflash2 = m->dflash2,
                        .conv_k = m->conv_k,
                        .conv_g = m->conv_g,
                        .sel_top_k = m->ext.selector_top_k,
                        .sel_rank = m->sel_rank,
                        .sel_inject = m->sel_inject,
                        .sel_weight = m->sel_weight,
                        .dspark = m->dspark,
                        .markov_rank = m->dspark ? m->ext.markov_rank : 0,
                        .dspark_conf = m->dspark && m->ext.confidence_head,
                        .ds_alpha_ce = (float)DF_DSPARK_ALPHA_CE,
                        .ds_alpha_l1 = (float)DF_DSPARK_ALPHA_L1,
                        .ds_alpha_conf = (float)DF_DSPARK_ALPHA_CONF,
                        .draft_vocab = m->Vd};
  for (int l = 0; l < m->L; l++)
    out->window[l] = m->cfg.layer_types[l] == DFLASH_LAYER_SLIDING ? m->cfg.sliding_window : 0;
  for (size_t i = 0; i < m->n_tensors; i++) offsets[i] = m->tensors[i].offset;
}

static dflash_status join_ranks(cuda_backend *c) {
  df_comm *comm = c->t->comm;
  if (!c->nccl) return DFLASH_OK;
  unsigned char id[DF_CU_NCCL_ID_BYTES] = {0};
  double timeout = c->t->opt.dist_timeout_s;
  dflash_status st = c->env.rank == 0 ? df_cu_nccl_unique_id(id) : DFLASH_OK;
  if (!st)
    st = comm ? df_comm_broadcast(comm, id, sizeof id)
              : df_rendezvous(&c->env, id, sizeof id, timeout);
  if (!st) st = df_cu_nccl_init(c->dev, c->env.rank, c->env.world, id, timeout);
  /* ZeRO-1: every rank takes part in gathering the moments, but they reach
   * the host of rank 0 alone (the one that writes them); the masters reach
   * every rank, whose host copy of the parameters exists anyway. */
  if (!st && c->env.world > 1 && c->env.rank != 0) c->base.not_on_host = DF_BUF_M1 | DF_BUF_M2;
  return st ? df_error_wrap(st, "rank %d of %d", c->env.rank, c->env.world) : st;
}

/* The matrices Muon takes (df_muon_takes, as the CPU step), with their step factors. */
static dflash_status muon_matrices(const df_model *m, int32_t adjust, df_cu_muon_mat **out,
                                   size_t *n) {
  *n = 0;
  *out = malloc(sizeof **out * (m->n_tensors ? m->n_tensors : 1));
  if (!*out) return df_error_nomem("CUDA Muon matrices");
  for (size_t i = 0; i < m->n_tensors; i++) {
    const df_tensor_info *ti = &m->tensors[i];
    if (!df_muon_takes(ti)) continue;
    (*out)[(*n)++] =
        (df_cu_muon_mat){.offset = ti->offset,
                         .rows = ti->shape[0],
                         .cols = ti->shape[1],
                         .lr_scale = df_muon_lr_scale(adjust, ti->shape[0], ti->shape[1])};
  }
  return DFLASH_OK;
}

dflash_status df_backend_cuda_create(dflash_trainer *t, df_backend **out) {
  int n_dev = 0;
  dflash_status st = dflash_cuda_device_count(&n_dev);
  if (st) return df_error_wrap(st, "trainer backend cuda");
  cuda_backend *c = calloc(1, sizeof *c);
  if (!c) return df_error_nomem("CUDA backend");
  c->base.vt = &cuda_vt;
  c->t = t;
  st = df_dist_env_from_environ(&c->env);
  if (!st && c->env.local_rank >= n_dev)
    st = df_error(DFLASH_E_NO_DEVICE,
                  "trainer backend cuda: LOCAL_RANK %d but only %d CUDA "
                  "device(s) are visible",
                  c->env.local_rank, n_dev);
  find_ranks(c); /* the model is created as this rank's ZeRO-1 shard */
  df_model *m = &t->m;
  const char *why = df_cu_attn_shape_why(m->B, m->nh, m->nkv, m->d);
  if (!st && why)
    st = df_error(DFLASH_E_UNSUPPORTED,
                  "trainer backend cuda: block size %d, %d query / %d kv heads, head_dim %d: %s",
                  m->B, m->nh, m->nkv, m->d, why);
  df_cu_config cfg = {.world = 1};
  size_t *offs = malloc(sizeof(size_t) * m->n_tensors);
  if (offs) df_cu_config_of(m, offs, &cfg);
  cfg.device = c->env.local_rank;
  cfg.rank = c->nccl ? c->env.rank : 0;
  cfg.world = c->nccl ? c->env.world : 1;
  /* DFLASH_CUDA_OVERLAP=0: the gradient reduce-scatter after the backward, not
   * overlapping it (to compare; the results are the same to the bit). */
  const char *ovl = getenv("DFLASH_CUDA_OVERLAP");
  cfg.no_overlap = ovl && !strcmp(ovl, "0");
  /* The gradient reduce-scatter in bf16 (dfcuda.h states its error): an option, it changes
   * the results. */
  cfg.rs_bf16 = t->opt.grad_reduce_bf16 != 0;
  float *pw = malloc(sizeof(float) * (size_t)m->B);
  if (!st && (!offs || !pw)) st = df_error_nomem("CUDA tensor table");
  for (int j = 0; pw && j < m->B; j++) pw[j] = (float)row_weight(m, j);
  cfg.pos_weight = pw;
  df_cu_muon_mat *muon = NULL;
  if (!st && t->opt.optimizer == DFLASH_OPTIMIZER_MUON)
    st = muon_matrices(m, t->opt.muon_adjust_lr, &muon, &cfg.n_muon);
  cfg.muon = muon;
  /* The target's whole head: a pruned drafter's own (its kept rows) is gathered from it on
   * the device (sync_draft_vocab). */
  if (!st)
    st = df_cu_create(&cfg, m->params, m->embed, m->lm_head_full ? m->lm_head_full : m->lm_head,
                      &c->dev);
  if (!st) st = sync_draft_vocab(c);
  free(offs);
  free(pw);
  free(muon);
  if (!st) st = join_ranks(c);
  if (st) {
    cuda_destroy(&c->base);
    return st;
  }
  *out = &c->base;
  return DFLASH_OK;
}

dflash_status df_backend_cuda_auto_sequences(int world, int32_t *out, char *note, size_t note_len) {
  df_dist_env env;
  df_cu_props p;
  dflash_status st = df_dist_env_from_environ(&env);
  if (!st) st = df_cu_device_props(env.local_rank, &p);
  if (st) return df_error_wrap(st, "trainer backend cuda: sequences per step");
  int pcie = df_cu_arch_pcie(p.major, p.minor);
  *out = df_cu_auto_sequences(world, pcie);
  const char *why = world <= 1 ? "one GPU: no collectives"
                    : pcie     ? "PCIe, no NVLink: each step's one gradient reduce-scatter and "
                                 "one weight all-gather spread over several sequences"
                               : "NVLink: the collectives hide behind one sequence";
  snprintf(note, note_len,
           "%d sequence(s) per GPU per optimizer step, chosen for %d rank(s) on %s (sm_%d%d; "
           "%s); --batch sets it",
           *out, world, p.name, p.major, p.minor, why);
  return DFLASH_OK;
}

dflash_status df_backend_cuda_props(int device, df_cu_props *out) {
  return df_cu_device_props(device, out);
}

static const char *env_var(const char *name) { return getenv(name); }

dflash_status df_backend_cuda_link_note(int world, char *out, size_t len) {
  df_dist_env env;
  df_cu_props p;
  dflash_status st = df_dist_env_from_environ(&env);
  if (!st) st = df_cu_device_props(env.local_rank, &p);
  if (st) return df_error_wrap(st, "trainer backend cuda: the devices' links");
  df_link_note(&p, env.local_rank, world, env_var, out, len);
  return DFLASH_OK;
}

#else /* no CUDA in this build */

dflash_status df_backend_cuda_create(dflash_trainer *t, df_backend **out) {
  (void)t, (void)out;
  return df_error(DFLASH_E_UNSUPPORTED, "trainer backend cuda: libdflash was built without "
                                        "CUDA (meson setup -Dcuda=enabled with nvcc installed)");
}

dflash_status df_backend_cuda_props(int device, struct df_cu_props *out) {
  (void)device, (void)out;
  return df_error(DFLASH_E_UNSUPPORTED, "libdflash was built without CUDA (meson setup "
                                        "-Dcuda=enabled with nvcc installed)");
}

dflash_status df_backend_cuda_link_note(int world, char *out, size_t len) {
  (void)world, (void)out, (void)len;
  return df_error(DFLASH_E_UNSUPPORTED, "trainer backend cuda: libdflash was built without "
                                        "CUDA (meson setup -Dcuda=enabled with nvcc installed)");
}

dflash_status df_backend_cuda_auto_sequences(int world, int32_t *out, char *note, size_t note_len) {
  (void)world, (void)note, (void)note_len;
  *out = 1;
  return df_error(DFLASH_E_UNSUPPORTED, "trainer backend cuda: libdflash was built without "
                                        "CUDA (meson setup -Dcuda=enabled with nvcc installed)");
}

#endif
