/* The public trainer: parameters by name, forward/backward, AdamW with a
 * cosine schedule and global-norm clipping, anchor sampling. */
#include "backend.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "hidden/hidden.h"
#include "rng.h"

static void trainer_options_defaults(dflash_trainer_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->backend = DFLASH_BACKEND_CPU;
  o->seed = 0;
  o->lr = 6e-4;
  o->weight_decay = 0.0;
  o->beta1 = 0.9;
  o->beta2 = 0.999; /* torch.optim.AdamW's default, as the reference trainer uses */
  o->adam_eps = 1e-8;
  o->grad_clip = 1.0;
  o->warmup_ratio = 0.04;
  o->total_steps = 0;
  o->min_lr_ratio = 0.0;
  o->loss_gamma = 0.0;
  o->num_anchors = 512;
  o->vocab_chunk = 4096;
  o->init_std = 0.02;
  o->selector_loss_weight = 1.0;
  o->selector_loss_mode = DFLASH_SELECTOR_LOSS_DROP;
  o->lr_schedule = DFLASH_LR_COSINE;
  o->position_weighting = DFLASH_POSITION_WEIGHTING_DECAY;
  o->optimizer = DFLASH_OPTIMIZER_ADAMW;
  o->muon_momentum = 0.95; /* speculators' (and torch.optim.Muon's) defaults */
  o->muon_weight_decay = 0.1;
  o->muon_adjust_lr = DFLASH_MUON_ADJUST_LR_MATCH_RMS_ADAMW;
  o->dist_timeout_s = 1800; /* a hung rank is reported within half an hour */
}

DF_DEFINE_INIT(dflash_trainer_options, trainer_options_defaults)

static dflash_status check_options(const dflash_trainer_options *in, dflash_trainer_options *o) {
  dflash_trainer_options_default(o);
  dflash_status st = df_opts_in(o, in, sizeof *o, "dflash_trainer_options");
  if (st) return st;
#define NEED(cond, ...)                                                                  \
  do {                                                                                   \
    if (!(cond)) return df_error(DFLASH_E_INVALID_ARG, "trainer options: " __VA_ARGS__); \
  } while (0)
  NEED(o->backend == DFLASH_BACKEND_CPU || o->backend == DFLASH_BACKEND_CUDA, "unknown backend %d",
       o->backend);
  NEED(o->lr >= 0 && isfinite(o->lr), "lr must be finite and >= 0 (got %g)", o->lr);
  NEED(o->beta1 >= 0 && o->beta1 < 1 && o->beta2 >= 0 && o->beta2 < 1,
       "betas must be in [0, 1) (got %g, %g)", o->beta1, o->beta2);
  NEED(o->adam_eps > 0, "adam_eps must be positive (got %g)", o->adam_eps);
  NEED(o->weight_decay >= 0, "weight_decay must be >= 0 (got %g)", o->weight_decay);
  NEED(o->warmup_ratio >= 0 && o->warmup_ratio <= 1, "warmup_ratio must be in [0, 1] (got %g)",
       o->warmup_ratio);
  NEED(o->total_steps >= 0, "total_steps must be >= 0");
  NEED(o->min_lr_ratio >= 0 && o->min_lr_ratio <= 1, "min_lr_ratio must be in [0, 1]");
  NEED(o->num_anchors > 0, "num_anchors must be positive (got %d)", o->num_anchors);
  NEED(o->vocab_chunk > 0, "vocab_chunk must be positive (got %d)", o->vocab_chunk);
  NEED(o->selector_loss_weight >= 0 && isfinite(o->selector_loss_weight),
       "selector_loss_weight must be finite and >= 0 (got %g)", o->selector_loss_weight);
  NEED(o->selector_loss_mode == DFLASH_SELECTOR_LOSS_DROP ||
           o->selector_loss_mode == DFLASH_SELECTOR_LOSS_INJECT,
       "selector_loss_mode must be DFLASH_SELECTOR_LOSS_DROP (0) or _INJECT (1) (got %d)",
       o->selector_loss_mode);
  NEED(o->lr_schedule >= DFLASH_LR_COSINE && o->lr_schedule <= DFLASH_LR_CONSTANT,
       "lr_schedule must be DFLASH_LR_COSINE (0), _LINEAR (1) or _CONSTANT (2) (got %d)",
       o->lr_schedule);
  NEED(o->position_weighting == DFLASH_POSITION_WEIGHTING_DECAY ||
           o->position_weighting == DFLASH_POSITION_WEIGHTING_ADAPTIVE,
       "position_weighting must be DFLASH_POSITION_WEIGHTING_DECAY (0) or _ADAPTIVE (1) (got %d)",
       o->position_weighting);
  NEED(o->optimizer == DFLASH_OPTIMIZER_ADAMW || o->optimizer == DFLASH_OPTIMIZER_MUON,
       "optimizer must be DFLASH_OPTIMIZER_ADAMW (0) or _MUON (1) (got %d)", o->optimizer);
  NEED(o->muon_momentum >= 0 && o->muon_momentum < 1, "muon_momentum must be in [0, 1) (got %g)",
       o->muon_momentum);
  NEED(o->muon_weight_decay >= 0 && isfinite(o->muon_weight_decay),
       "muon_weight_decay must be finite and >= 0 (got %g)", o->muon_weight_decay);
  NEED(o->muon_adjust_lr == DFLASH_MUON_ADJUST_LR_MATCH_RMS_ADAMW ||
           o->muon_adjust_lr == DFLASH_MUON_ADJUST_LR_ORIGINAL,
       "muon_adjust_lr must be DFLASH_MUON_ADJUST_LR_MATCH_RMS_ADAMW (0) or _ORIGINAL (1) (got %d)",
       o->muon_adjust_lr);
  NEED(o->dist_timeout_s > 0 && o->dist_timeout_s <= 1e9,
       "dist_timeout_s must be in (0, 1e9] seconds (got %g)", o->dist_timeout_s);
#undef NEED
  if (o->backend == DFLASH_BACKEND_CUDA &&
      o->position_weighting == DFLASH_POSITION_WEIGHTING_ADAPTIVE)
    return df_error(DFLASH_E_UNSUPPORTED,
                    "trainer options: position_weighting "
                    "DFLASH_POSITION_WEIGHTING_ADAPTIVE runs on the CPU backend only "
                    "(the CUDA backend has no second LM-head pass)");
  return DFLASH_OK;
}

dflash_status dflash_trainer_create(const dflash_drafter_config *cfg, const float *embed,
                                    const float *lm_head, const dflash_trainer_options *opts,
                                    dflash_trainer **out) {
  return df_trainer_create(cfg, embed, lm_head, opts, NULL, out);
}

/*
 * Initial parameters: 1-D tensors (norm weights) 1, the others N(0, std^2).
 * Counter-based so the pool can fill chunks in any order: chunk c of tensor
 * i is drawn by its own generator, seeded by (seed, tensor i, chunk c), and
 * each Box-Muller draw (one 64-bit word: two 24-bit uniforms) gives two
 * values (cos and sin). The values depend on the seed and the tensor table
 * only, never on the thread count (a 0.25 B-parameter drafter: 16 s before
 * on one thread, see CHANGELOG.md).
 */
enum { INIT_CHUNK = 1 << 14 };

typedef struct init_ctx {
  const df_model *m;
  const size_t *first; /* [n_tensors + 1]: index of each tensor's first chunk */
  uint64_t seed;
  double std;
} init_ctx;

static void init_chunk(const init_ctx *c, size_t chunk) {
  size_t lo = 0, hi = c->m->n_tensors; /* the tensor holding this chunk */
  while (hi - lo > 1) {
    size_t mid = (lo + hi) / 2;
    if (c->first[mid] <= chunk) lo = mid;
    else hi = mid;
  }
  const df_tensor_info *t = &c->m->tensors[lo];
  size_t k0 = (chunk - c->first[lo]) * INIT_CHUNK;
  size_t k1 = t->numel - k0 < INIT_CHUNK ? t->numel : k0 + INIT_CHUNK;
  float *p = c->m->params + t->offset;
  if (t->init == DF_INIT_ONES || t->init == DF_INIT_ZERO) {
    for (size_t k = k0; k < k1; k++) p[k] = t->init == DF_INIT_ONES ? 1.0f : 0.0f;
    return;
  }
  if (t->init == DF_INIT_CONV_IDENTITY) { /* [2, k, H]: element (s, o, c) is 1 iff o == 0 */
    size_t H = (size_t)t->shape[2], kh = (size_t)t->shape[1] * H;
    for (size_t k = k0; k < k1; k++) p[k] = k % kh < H ? 1.0f : 0.0f;
    return;
  }
  df_rng rng;
  df_rng_seed(&rng, c->seed, ((uint64_t)lo << 40) ^ (chunk - c->first[lo]) ^ 0x1417);
  float std = (float)c->std;
  for (size_t k = k0; k < k1; k += 2) {
    /* Two 24-bit uniforms in (0, 1) from one draw; float maths (the values are floats). */
    uint64_t x = df_rng_next(&rng);
    float u = ((float)(x >> 40) + 0.5f) * 0x1p-24f;
    float v = ((float)((x >> 8) & 0xffffff) + 0.5f) * 0x1p-24f;
    float r = std * sqrtf(-2.0f * logf(u)), a = 6.2831853f * v;
    p[k] = r * cosf(a);
    if (k + 1 < k1) p[k + 1] = r * sinf(a);
  }
}

static void init_range(void *vc, size_t b, size_t e, int worker) {
  (void)worker;
  for (size_t i = b; i < e; i++) init_chunk(vc, i);
}

static dflash_status init_params(df_model *m, uint64_t seed, double std) {
  size_t *first = malloc(sizeof(size_t) * (m->n_tensors + 1));
  if (!first) return df_error_nomem("parameter initialisation");
  first[0] = 0;
  for (size_t i = 0; i < m->n_tensors; i++)
    first[i + 1] = first[i] + (m->tensors[i].numel + INIT_CHUNK - 1) / INIT_CHUNK;
  init_ctx c = {m, first, seed, std};
  df_pool_for(m->pool, first[m->n_tensors], 1, init_range, &c);
  free(first);
  return DFLASH_OK;
}

/* What a DSpark drafter does not train with yet, refused by name before any device is
 * looked for (so a machine without a GPU reports the same). */
static dflash_status dspark_options(const dflash_trainer *t) {
  if (t->opt.position_weighting == DFLASH_POSITION_WEIGHTING_ADAPTIVE)
    return df_dspark_unsupported(&t->m.ext, "trainer options",
                                 "position_weighting ADAPTIVE weighs DFlash's rows; DSpark "
                                 "weighs slot k by exp(-k / gamma)");
  return DFLASH_OK;
}

dflash_status df_trainer_create(const dflash_drafter_config *cfg, const float *embed,
                                const float *lm_head, const dflash_trainer_options *opts,
                                struct df_comm *comm, dflash_trainer **out) {
  DF_CHECK_ARG(cfg && embed && lm_head && out);
  *out = NULL;
  dflash_trainer *t = calloc(1, sizeof *t);
  if (!t) return df_error_nomem("trainer");
  t->comm = comm;
  dflash_status st = check_options(opts, &t->opt);
  if (!st) st = df_model_init(&t->m, cfg, t->opt.n_threads, t->opt.vocab_chunk, t->opt.loss_gamma);
  if (!st) df_blas_setup(); /* one BLAS thread: the pool splits the products (ops.c's df_sgemm) */
  if (!st) {
    t->m.sel_weight = t->opt.selector_loss_weight;
    t->m.sel_inject = t->opt.selector_loss_mode == DFLASH_SELECTOR_LOSS_INJECT;
    t->m.adaptive = t->opt.position_weighting == DFLASH_POSITION_WEIGHTING_ADAPTIVE;
  }
  if (st) {
    free(t);
    return st;
  }
  size_t vh = (size_t)t->m.V * (size_t)t->m.H;
  bool pruned = t->m.Vd < t->m.V;
  t->m.embed = malloc(vh * sizeof(float));
  /* Pruned (DSpark): the drafter's head is the kept rows of the target's, kept whole. */
  t->m.lm_head = malloc((size_t)t->m.Vd * (size_t)t->m.H * sizeof(float));
  if (pruned) t->m.lm_head_full = malloc(vh * sizeof(float));
  t->m1 = calloc(t->m.n_params, sizeof(float));
  t->m2 = calloc(t->m.n_params, sizeof(float));
  if (!t->m.embed || !t->m.lm_head || (pruned && !t->m.lm_head_full) || !t->m1 || !t->m2) {
    dflash_trainer_free(t);
    return df_error_nomem("trainer embedding, LM head and optimizer state");
  }
  memcpy(t->m.embed, embed, vh * sizeof(float));
  memcpy(pruned ? t->m.lm_head_full : t->m.lm_head, lm_head, vh * sizeof(float));
  st = df_model_set_draft_vocab(&t->m, NULL, "draft vocabulary");
  if (!st) st = init_params(&t->m, t->opt.seed, t->opt.init_std);
  if (!st) st = dspark_options(t);
  if (!st)
    st = t->opt.backend == DFLASH_BACKEND_CUDA ? df_backend_cuda_create(t, &t->be)
                                               : df_backend_cpu_create(t, &t->be);
  if (st) {
    dflash_trainer_free(t);
    return st;
  }
  *out = t;
  return DFLASH_OK;
}

void dflash_trainer_free(dflash_trainer *t) {
  if (!t) return;
  if (t->be) t->be->vt->destroy(t->be);
  df_model_free(&t->m);
  free(t->decoded);
  free(t->m1);
  free(t->m2);
  free(t);
}

size_t dflash_trainer_param_count(const dflash_trainer *t) { return t ? t->m.n_tensors : 0; }

dflash_status dflash_trainer_param_info(const dflash_trainer *t, size_t index, const char **name,
                                        int32_t *ndim, int64_t shape[2], size_t *numel) {
  DF_CHECK_ARG(t);
  if (index >= t->m.n_tensors)
    return df_error(DFLASH_E_RANGE, "parameter index %zu is outside [0, %zu)", index,
                    t->m.n_tensors);
  const df_tensor_info *ti = &t->m.tensors[index];
  if (name) *name = ti->name;
  /* A rank-3 tensor (DFlash 2's base kernels) as [d0, d1 * d2]: the ABI has two dims. */
  if (ndim) *ndim = ti->ndim > 2 ? 2 : ti->ndim;
  if (shape)
    shape[0] = ti->shape[0], shape[1] = ti->ndim >= 2 ? (int64_t)(ti->numel / ti->shape[0]) : 1;
  if (numel) *numel = ti->numel;
  return DFLASH_OK;
}

static dflash_status find_sized(const dflash_trainer *t, const char *name, size_t n,
                                const df_tensor_info **out) {
  DF_CHECK_ARG(t && name);
  const df_tensor_info *ti = df_model_find(&t->m, name);
  if (!ti) return df_error(DFLASH_E_NOT_FOUND, "the drafter has no parameter \"%s\"", name);
  if (ti->numel != n)
    return df_error(DFLASH_E_MISMATCH, "parameter \"%s\" has %zu elements, not %zu", name,
                    ti->numel, n);
  *out = ti;
  return DFLASH_OK;
}

/* Copy tensor `name` out of `base` (params or grads). */
static dflash_status copy_out(const dflash_trainer *t, const float *base, const char *name,
                              float *out, size_t n) {
  const df_tensor_info *ti = NULL; /* gcc -O3 cannot see that find_sized sets it on success */
  dflash_status st = find_sized(t, name, n, &ti);
  if (st) return st;
  DF_CHECK_ARG(out);
  memcpy(out, base + ti->offset, n * sizeof(float));
  return DFLASH_OK;
}

dflash_status dflash_trainer_get_param(const dflash_trainer *t, const char *name, float *out,
                                       size_t n) {
  DF_CHECK_ARG(t);
  dflash_status st = df_trainer_pull(t, DF_BUF_PARAMS);
  return st ? st : copy_out(t, t->m.params, name, out, n);
}

dflash_status dflash_trainer_set_param(dflash_trainer *t, const char *name, const float *in,
                                       size_t n) {
  const df_tensor_info *ti = NULL; /* as in copy_out */
  dflash_status st = find_sized(t, name, n, &ti);
  if (st) return st;
  DF_CHECK_ARG(in);
  if ((st = df_trainer_pull(t, DF_BUF_PARAMS))) return st;
  memcpy(t->m.params + ti->offset, in, n * sizeof(float));
  return df_trainer_push(t, DF_BUF_PARAMS);
}

dflash_status dflash_trainer_get_grad(const dflash_trainer *t, const char *name, float *out,
                                      size_t n) {
  DF_CHECK_ARG(t);
  dflash_status st = df_trainer_pull(t, DF_BUF_GRADS);
  return st ? st : copy_out(t, t->m.grads, name, out, n);
}

dflash_status dflash_trainer_zero_grad(dflash_trainer *t) {
  DF_CHECK_ARG(t);
  dflash_status st = t->be->vt->zero_grad(t->be);
  t->be->stale |= DF_BUF_GRADS;
  return st;
}

/* ---- one sequence --------------------------------------------------------- */

/* The sample's id for messages ("?" when the caller set none). */
static const char *sample_id(const dflash_sample *s) { return s->id ? s->id : "?"; }

dflash_status df_sample_in(const dflash_sample *caller, dflash_sample *s) {
  if (!caller) return df_error(DFLASH_E_INVALID_ARG, "the dflash_sample is NULL");
  /* The one rule: an older caller's struct lacks the later fields (they read as none). */
  *s = (dflash_sample){.struct_size = sizeof *s};
  dflash_status st = df_opts_in(s, caller, sizeof *s, "dflash_sample");
  if (st) return st;
  if (s->len < 0)
    return df_error(DFLASH_E_INVALID_ARG, "sample %s: length %lld", sample_id(s),
                    (long long)s->len);
  if (s->n_anchors < 0 || (!s->anchors && s->n_anchors))
    return df_error(DFLASH_E_INVALID_ARG, "sample %s: %d anchors%s", sample_id(s), s->n_anchors,
                    s->anchors ? "" : " at NULL");
  for (int32_t i = 0; i < s->n_anchors; i++)
    if (s->anchors[i] < 0 || s->anchors[i] >= s->len)
      return df_error(DFLASH_E_RANGE, "sample %s: anchor %d = %d is outside the sequence [0, %lld)",
                      sample_id(s), i, s->anchors[i], (long long)s->len);
  return DFLASH_OK;
}

/* Decode stored rows into t->decoded (float32 [len, K*H]). */
static dflash_status decode_rows(dflash_trainer *t, const dflash_sample *s, const float **out) {
  if (!s->hidden_codes || (s->hidden_dtype == DFLASH_DTYPE_F8_E4M3 && !s->hidden_scales))
    return df_error(DFLASH_E_INVALID_ARG, "sample %s: no hidden states", sample_id(s));
  if (s->hidden_dtype != DFLASH_DTYPE_BF16 && s->hidden_dtype != DFLASH_DTYPE_F8_E4M3)
    return df_error(DFLASH_E_INVALID_ARG, "sample %s: hidden dtype %d", sample_id(s),
                    s->hidden_dtype);
  size_t n = (size_t)s->len * (size_t)t->m.KH;
  if (n > t->decoded_cap) {
    float *p = realloc(t->decoded, n * sizeof *p);
    if (!p) return df_error_nomem("decoded hidden states");
    t->decoded = p;
    t->decoded_cap = n;
  }
  df_hidden_decode(t->m.KH / t->m.H, t->m.H, s->hidden_dtype, s->hidden_codes, s->hidden_scales,
                   t->decoded, s->len);
  *out = t->decoded;
  return DFLASH_OK;
}

/* The sample's rows as float32: its hidden, or its stored codes decoded (into t->decoded, valid
 * until the next call on t). `stored_ok`: the backend takes the codes as they are (*out NULL). */
static dflash_status sample_hidden(dflash_trainer *t, const dflash_sample *s, bool stored_ok,
                                   const float **out) {
  *out = s->hidden;
  if (s->hidden || (stored_ok && t->be->vt->stored_rows)) return DFLASH_OK;
  return decode_rows(t, s, out);
}

dflash_status df_sample_floats(dflash_trainer *t, const dflash_sample *s, const float **hidden) {
  DF_CHECK_ARG(s->input_ids);
  return sample_hidden(t, s, false, hidden);
}

/* A backend's sequence from a checked sample, its rows as `hidden` (NULL: as stored). */
static df_seq seq_of(const dflash_sample *s, const float *hidden, const int32_t *labels) {
  df_seq q = {.ids = s->input_ids,
              .loss_mask = s->loss_mask,
              .len = s->len,
              .hidden = hidden,
              .anchors = s->anchors,
              .n_anchors = s->n_anchors,
              .labels = labels,
              .id = s->id,
              .final = s->target_final};
  if (!hidden) {
    q.hidden_dtype = s->hidden_dtype;
    q.hidden_codes = s->hidden_codes;
    q.hidden_scales = s->hidden_scales;
  }
  return q;
}

dflash_status dflash_trainer_weight_sum(const dflash_trainer *t, const dflash_sample *caller,
                                        double *weight_sum) {
  DF_CHECK_ARG(t && weight_sum);
  dflash_sample s;
  dflash_status st = df_sample_in(caller, &s);
  if (st) return st;
  DF_CHECK_ARG(s.loss_mask);
  *weight_sum = df_model_weight_sum(&t->m, s.loss_mask, s.len, s.anchors, s.n_anchors);
  return DFLASH_OK;
}

dflash_status dflash_trainer_accumulate(dflash_trainer *t, const dflash_sample *s,
                                        double grad_scale) {
  return df_trainer_accumulate_labels(t, s, NULL, grad_scale);
}

dflash_status df_trainer_accumulate_labels(dflash_trainer *t, const dflash_sample *caller,
                                           const int32_t *labels, double grad_scale) {
  DF_CHECK_ARG(t);
  dflash_sample s;
  dflash_status st = df_sample_in(caller, &s);
  if (st) return st;
  DF_CHECK_ARG(s.input_ids && s.loss_mask);
  /* Every backend reads them; a device one would not check their range itself. */
  if ((st = df_model_check_labels(&t->m, labels, s.len))) return st;
  const float *hidden;
  if ((st = sample_hidden(t, &s, true, &hidden))) return st;
  df_seq q = seq_of(&s, hidden, labels);
  t->be->stale |= DF_BUF_GRADS;
  if (t->be->vt->collect) return t->be->vt->accumulate(t->be, &q, grad_scale, NULL, NULL);
  double ls = 0, ws = 0;
  if ((st = t->be->vt->accumulate(t->be, &q, grad_scale, &ls, &ws))) return st;
  if (t->m.dflash2) t->pend_sel += t->m.sel_weight * t->m.sel_loss_sum;
  t->pend_loss += ls;
  t->pend_weight += ws;
  return DFLASH_OK;
}

/* The backend's deferred sums into the trainer's (one wait for the device). */
static dflash_status collect_backend(dflash_trainer *t) {
  if (!t->be->vt->collect) return DFLASH_OK;
  return t->be->vt->collect(t->be, &t->pend_loss, &t->pend_weight);
}

dflash_status dflash_trainer_collect(dflash_trainer *t, double *loss_sum, double *weight_sum) {
  DF_CHECK_ARG(t);
  dflash_status st = collect_backend(t);
  if (loss_sum) *loss_sum = t->pend_loss;
  if (weight_sum) *weight_sum = t->pend_weight;
  t->pend_loss = t->pend_weight = 0;
  return st;
}

dflash_status dflash_trainer_forward_backward(dflash_trainer *t, const dflash_sample *caller,
                                              double *loss) {
  DF_CHECK_ARG(t);
  dflash_sample s;
  dflash_status st = df_sample_in(caller, &s);
  if (st) return st;
  DF_CHECK_ARG(s.input_ids && s.loss_mask);
  const float *hidden;
  if ((st = sample_hidden(t, &s, false, &hidden))) return st;
  double wsum = df_model_weight_sum(&t->m, s.loss_mask, s.len, s.anchors, s.n_anchors), lsum = 0;
  if ((st = dflash_trainer_zero_grad(t))) return st;
  /* The backend's own sums (it waits for them), so that the sums collect returns are left
   * alone. */
  df_seq q = seq_of(&s, hidden, NULL);
  t->be->stale |= DF_BUF_GRADS;
  st = t->be->vt->accumulate(t->be, &q, wsum > 0 ? 1.0 / wsum : 0.0, &lsum, NULL);
  if (st) return st;
  if (loss) *loss = wsum > 0 ? lsum / wsum : 0.0;
  return DFLASH_OK;
}

/* ---- drafting ------------------------------------------------------------- */

static void propose_options_defaults(dflash_propose_options *o) {
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
}

DF_DEFINE_INIT(dflash_propose_options, propose_options_defaults)

/* What a propose call asks beyond the greedy tokens, checked (o and out: the caller's at the
 * library's size). */
static dflash_status propose_check(const dflash_trainer *t, const dflash_propose_options *o,
                                   const dflash_propose_outputs *out, bool *plain) {
  if (!(o->temperature >= 0) || !isfinite(o->temperature))
    return df_error(DFLASH_E_RANGE, "propose: temperature %g (must be finite and >= 0)",
                    o->temperature);
  bool selector = o->temperature > 0 || out->candidates || out->probs;
  if (selector && !t->m.dflash2)
    return df_error(DFLASH_E_UNSUPPORTED,
                    "propose: %s needs a DFlash 2 drafter (the candidate "
                    "selector); this one is DFlash 1",
                    o->temperature > 0 ? "sampling" : "candidates / probs");
  *plain = !selector && !out->argmax;
  return DFLASH_OK;
}

/* The caller's options and outputs (either NULL) at the library's size, checked. */
static dflash_status propose_in(const dflash_trainer *t, const dflash_propose_options *opts,
                                const dflash_propose_outputs *outs, dflash_propose_options *o,
                                dflash_propose_outputs *out, bool *plain) {
  dflash_propose_options_default(o);
  *out = (dflash_propose_outputs){.struct_size = sizeof *out};
  dflash_status st = df_opts_in(o, opts, sizeof *o, "dflash_propose_options");
  if (!st) st = df_opts_in(out, outs, sizeof *out, "dflash_propose_outputs");
  return st ? st : propose_check(t, o, out, plain);
}

dflash_status dflash_trainer_propose(dflash_trainer *t, const dflash_sample *caller,
                                     const dflash_propose_options *opts, int32_t *pred,
                                     const dflash_propose_outputs *outs) {
  DF_CHECK_ARG(t && pred);
  dflash_sample s;
  dflash_propose_options o;
  dflash_propose_outputs out;
  bool plain = true;
  const float *hidden = NULL;
  dflash_status st = df_sample_in(caller, &s);
  if (!st) st = propose_in(t, opts, outs, &o, &out, &plain);
  if (!st) st = df_sample_floats(t, &s, &hidden);
  if (st) return st;
  if (plain) {
    df_seq q = seq_of(&s, hidden, NULL);
    return t->be->vt->predict(t->be, &q, pred);
  }
  /* The float32 reference on the host copy of the parameters (the CPU
   * backend's own storage), as dflash_trainer_logits. */
  if ((st = df_trainer_pull(t, DF_BUF_PARAMS))) return st;
  return df_model_propose(&t->m, s.input_ids, s.len, hidden, s.anchors, s.n_anchors, &o, &out,
                          pred);
}

dflash_status dflash_trainer_logits(dflash_trainer *t, const dflash_sample *caller, float *logits) {
  DF_CHECK_ARG(t && logits);
  dflash_sample s;
  const float *hidden = NULL;
  dflash_status st = df_sample_in(caller, &s);
  if (!st) st = df_sample_floats(t, &s, &hidden);
  /* The float32 reference forward on the host copy of the parameters,
   * whatever the backend (a device backend's are pulled first). */
  if (!st) st = df_trainer_pull(t, DF_BUF_PARAMS);
  return st ? st
            : df_model_logits(&t->m, s.input_ids, s.len, hidden, s.anchors, s.n_anchors, logits);
}

/* ---- optimizer ------------------------------------------------------------ */

int64_t dflash_trainer_step_count(const dflash_trainer *t) { return t ? t->step : 0; }

int64_t df_warmup_steps(const dflash_trainer_options *o) {
  return (int64_t)(o->warmup_ratio * (double)o->total_steps);
}

double dflash_trainer_lr_at(const dflash_trainer *t, int64_t step) {
  if (!t) return 0;
  const dflash_trainer_options *o = &t->opt;
  int64_t warm = df_warmup_steps(o);
  if (t->sched_from > 0 && step >= t->sched_from) { /* continued after a settings change */
    double span = (double)(o->total_steps - t->sched_from > 1 ? o->total_steps - t->sched_from : 1);
    double p = (double)(step - t->sched_from) / span;
    double left = p >= 1                                 ? 0
                  : o->lr_schedule == DFLASH_LR_CONSTANT ? 1
                  : o->lr_schedule == DFLASH_LR_LINEAR   ? 1 - p
                                                         : 0.5 * (1.0 + cos(M_PI * p));
    double floor = o->lr * o->min_lr_ratio;
    return floor + (t->sched_lr0 - floor) * left;
  }
  /* Hugging Face's get_cosine_schedule_with_warmup, with an optional floor. */
  if (step < warm) return o->lr * (double)step / (double)(warm > 1 ? warm : 1);
  if (o->total_steps <= 0 || o->lr_schedule == DFLASH_LR_CONSTANT) return o->lr;
  double span = (double)(o->total_steps - warm > 1 ? o->total_steps - warm : 1);
  /* Held at the floor past total_steps (a run_options schedule_steps shorter than the run):
   * the cosine would climb back up. */
  double progress = fmin((double)(step - warm) / span, 1.0);
  double left = o->lr_schedule == DFLASH_LR_LINEAR ? 1.0 - progress /* transformers' linear */
                                                   : 0.5 * (1.0 + cos(M_PI * progress));
  if (left < 0) left = 0;
  return o->lr * (o->min_lr_ratio + (1.0 - o->min_lr_ratio) * left);
}

/* One update: sync, or (async and a backend that can) enqueued with its norm left for
 * step_result. */
static dflash_status take_step(dflash_trainer *t, bool async, double *grad_norm, double *lr_out) {
  const dflash_trainer_options *o = &t->opt;
  /* An outstanding step first (its failure undoes it: this one does not run). */
  dflash_status st = t->step_open ? dflash_trainer_step_result(t, NULL) : DFLASH_OK;
  if (st) return st;
  double lr = dflash_trainer_lr_at(t, t->step), norm = 0;
  /* A sample the device found NaN/Inf in fails here, before any parameter changes (its
   * sums stay for dflash_trainer_collect). */
  if ((st = collect_backend(t))) return st;
  df_adam a = {.lr = lr,
               .weight_decay = o->weight_decay,
               .beta1 = o->beta1,
               .beta2 = o->beta2,
               .eps = o->adam_eps,
               .grad_clip = o->grad_clip,
               .step = t->step + 1,
               .muon = o->optimizer == DFLASH_OPTIMIZER_MUON,
               .muon_momentum = o->muon_momentum,
               .muon_weight_decay = o->muon_weight_decay,
               .muon_adjust_lr = o->muon_adjust_lr};
  bool defer = async && t->be->vt->step_result;
  st = t->be->vt->step(t->be, &a, defer ? NULL : &norm);
  if (grad_norm) *grad_norm = norm;
  if (st) return st;
  t->be->stale |= DF_BUF_PARAMS | DF_BUF_GRADS | DF_BUF_M1 | DF_BUF_M2;
  t->step = a.step;
  if (async) t->step_open = true, t->step_norm = norm;
  if (lr_out) *lr_out = lr;
  return DFLASH_OK;
}

dflash_status dflash_trainer_step(dflash_trainer *t, double *grad_norm, double *lr_out) {
  DF_CHECK_ARG(t);
  return take_step(t, false, grad_norm, lr_out);
}

dflash_status dflash_trainer_step_async(dflash_trainer *t, double *lr) {
  DF_CHECK_ARG(t);
  return take_step(t, true, NULL, lr);
}

dflash_status dflash_trainer_step_result(dflash_trainer *t, double *grad_norm) {
  DF_CHECK_ARG(t);
  if (!t->step_open)
    return df_error(DFLASH_E_STATE, "dflash_trainer_step_result: no dflash_trainer_step_async "
                                    "is waiting for its result");
  t->step_open = false;
  double norm = t->step_norm;
  dflash_status st = t->be->vt->step_result ? t->be->vt->step_result(t->be, &norm) : DFLASH_OK;
  if (grad_norm) *grad_norm = norm;
  if (st) { /* the device left everything unchanged: the step did not happen */
    t->step--;
    return df_error_wrap(st, "step %lld", (long long)t->step);
  }
  return DFLASH_OK;
}

/* ---- anchors -------------------------------------------------------------- */

static int cmp_i32(const void *a, const void *b) {
  int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

/* block_size 0: DSpark's rule (df_anchors_sample_cfg), else DFlash's. */
static dflash_status anchors_rule(const uint8_t *loss_mask, int64_t len, int32_t block_size,
                                  int32_t max_anchors, uint64_t seed, uint64_t stream, int32_t *out,
                                  int32_t *n_out) {
  *n_out = 0;
  if (len > INT32_MAX)
    return df_error(DFLASH_E_RANGE, "sequence of %lld tokens is too long", (long long)len);
  int64_t supervised = 0;
  for (int64_t i = 0; i < len; i++) supervised += loss_mask[i] != 0;
  if (supervised < 2 * (int64_t)block_size || max_anchors == 0 || len < 2) return DFLASH_OK;
  int32_t *cand = malloc(sizeof(int32_t) * (size_t)len);
  if (!cand) return df_error_nomem("anchor candidates");
  int32_t nc = 0;
  /* DFlash: the whole block inside the sequence; DSpark: a + 1 inside it (a <= len - 2) */
  int64_t last = block_size ? len - block_size : len - 2;
  for (int64_t p = 0; p <= last; p++)
    if (loss_mask[p] && loss_mask[p + 1]) cand[nc++] = (int32_t)p;
  int32_t k = nc < max_anchors ? nc : max_anchors;
  df_rng rng;
  df_rng_seed(&rng, seed, stream);
  /* Partial Fisher-Yates: the first k entries become a uniform k-subset. */
  for (int32_t i = 0; i < k; i++) {
    int32_t j = i + (int32_t)df_rng_below(&rng, (uint64_t)(nc - i));
    int32_t tmp = cand[i];
    cand[i] = cand[j];
    cand[j] = tmp;
  }
  qsort(cand, (size_t)k, sizeof *cand, cmp_i32);
  memcpy(out, cand, sizeof(int32_t) * (size_t)k);
  free(cand);
  *n_out = k;
  return DFLASH_OK;
}

dflash_status dflash_anchors_sample(const uint8_t *loss_mask, int64_t len, int32_t block_size,
                                    int32_t max_anchors, uint64_t seed, uint64_t stream,
                                    int32_t *out, int32_t *n_out) {
  DF_CHECK_ARG(loss_mask && out && n_out && block_size >= 2 && max_anchors >= 0 && len >= 0);
  return anchors_rule(loss_mask, len, block_size, max_anchors, seed, stream, out, n_out);
}

dflash_status df_anchors_sample_cfg(const dflash_drafter_config *cfg, const uint8_t *loss_mask,
                                    int64_t len, int32_t max_anchors, uint64_t seed,
                                    uint64_t stream, int32_t *out, int32_t *n_out) {
  DF_CHECK_ARG(cfg && loss_mask && out && n_out && cfg->block_size >= 2 && max_anchors >= 0 &&
               len >= 0);
  return anchors_rule(loss_mask, len, cfg->dspark ? 0 : cfg->block_size, max_anchors, seed, stream,
                      out, n_out);
}
