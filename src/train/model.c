/* The drafter's forward and backward over one packed sequence (see model.h). */
#include "model.h"

#include "dflash2.h"
#include "dspark.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* ---- parameters ----------------------------------------------------------- */

static dflash_status add_tensor(df_model *m, size_t *cap, const char *name, int64_t rows,
                                int64_t cols) {
  if (m->n_tensors == *cap) {
    size_t nc = *cap ? *cap * 2 : 64;
    df_tensor_info *t = realloc(m->tensors, nc * sizeof *t);
    if (!t) return df_error_nomem("drafter tensor table");
    m->tensors = t;
    *cap = nc;
  }
  df_tensor_info *t = &m->tensors[m->n_tensors++];
  snprintf(t->name, sizeof t->name, "%s", name);
  t->offset = m->n_params;
  t->shape[0] = rows;
  t->shape[1] = cols;
  t->shape[2] = 0;
  t->ndim = cols > 0 ? 2 : 1;
  t->numel = (size_t)rows * (size_t)(cols > 0 ? cols : 1);
  t->init = cols > 0 ? DF_INIT_NORMAL : DF_INIT_ONES;
  m->n_params += t->numel;
  return DFLASH_OK;
}

/* A tensor with an explicit init (and a third dim when d2 > 0). */
static dflash_status add_tensor_init(df_model *m, size_t *cap, const char *name, int64_t d0,
                                     int64_t d1, int64_t d2, df_init_kind init) {
  dflash_status st = add_tensor(m, cap, name, d0, d1 * (d2 > 0 ? d2 : 1));
  if (st) return st;
  df_tensor_info *t = &m->tensors[m->n_tensors - 1];
  if (d2 > 0) t->shape[1] = d1, t->shape[2] = d2, t->ndim = 3;
  t->init = init;
  return DFLASH_OK;
}

df_tensor_dims df_tensor_dims_of(const dflash_drafter_config *cfg, const df_config_ext *ext) {
  int dflash2 = ext && ext->dflash2;
  int64_t H = cfg->hidden_size, g = dflash2 ? ext->conv_group_size : 0;
  return (df_tensor_dims){
      .H = H,
      .KH = (int64_t)cfg->n_target_layer_ids * H,
      .QD = (int64_t)cfg->num_attention_heads * cfg->head_dim,
      .KD = (int64_t)cfg->num_key_value_heads * cfg->head_dim,
      .HD = cfg->head_dim,
      .I = cfg->intermediate_size,
      .V = cfg->vocab_size,
      .L = cfg->num_hidden_layers,
      .CK = dflash2 ? ext->conv_kernel_size : 0,
      .CP = dflash2 && g > 0 ? 2 * (int64_t)ext->conv_kernel_size * (H / g) : 0,
      .SR = dflash2 ? ext->selector_rank : 0,
      .dflash2 = dflash2,
      .MR = ext && ext->dspark ? ext->markov_rank : 0,
      .VD = ext && ext->draft_vocab > 0 ? ext->draft_vocab : cfg->vocab_size,
      .dspark = ext && ext->dspark,
      .conf = ext && ext->dspark && ext->confidence_head,
  };
}

/* One row of tensors.h's lists, named `prefix` + `name`. */
#define ADD_(id, field, name, d0, d1, d2, init)                      \
  if (!st) {                                                         \
    snprintf(full, sizeof full, "%s%s", prefix, name);               \
    st = add_tensor_init(m, &cap, full, d0, d1, d2, DF_INIT_##init); \
  }

/* The checkpoint's tensors in buffer order (tensors.h): DFlash 2's after all of DFlash 1's,
 * whose offsets, and so the DFlash 1 path, do not depend on them. */
static dflash_status build_tensor_table(df_model *m) {
  size_t cap = 0;
  char full[96], prefix[64] = "";
  df_tensor_dims z = df_tensor_dims_of(&m->cfg, &m->ext);
  dflash_status st = DFLASH_OK;
  DF_TENSORS_HEAD(ADD_)
  for (int l = 0; l < m->L; l++) {
    snprintf(prefix, sizeof prefix, "layers.%d.", l);
    DF_TENSORS_LAYER(ADD_)
  }
  prefix[0] = 0;
  DF_TENSORS_TAIL(ADD_)
  if (z.dspark) {
    DF_TENSORS_MARKOV(ADD_)
    if (z.conf) {
      DF_TENSORS_CONF(ADD_)
    }
  }
  if (!m->dflash2) return st;
  for (int l = 0; l < m->L; l++) {
#define CONV_(id, field, name)                               \
  snprintf(prefix, sizeof prefix, "layers.%d.%s.", l, name); \
  DF_TENSORS_CONV(ADD_)
    DF_CONVS(CONV_)
#undef CONV_
  }
  prefix[0] = 0;
  DF_TENSORS_SELECTOR(ADD_)
  return st;
}
#undef ADD_

/* Point the per-tensor views of `w` into `base` (params or grads), in the table's order. */
static void bind_views(const df_model *m, float *base, df_weights *w) {
  size_t i = 0;
#define BIND_(id, field, ...) w->field = base + m->tensors[i++].offset;
  DF_TENSORS_HEAD(BIND_)
  for (int l = 0; l < m->L; l++) {
    df_layer_w *lw = &w->layer[l];
#define LAYER_BIND_(id, field, ...) lw->field = base + m->tensors[i++].offset;
    DF_TENSORS_LAYER(LAYER_BIND_)
  }
  DF_TENSORS_TAIL(BIND_)
  if (m->dspark) {
    DF_TENSORS_MARKOV(BIND_)
    if (m->ext.confidence_head) {
      DF_TENSORS_CONF(BIND_)
    }
  }
  if (!m->dflash2) return;
  for (int l = 0; l < m->L; l++) {
    df_layer_w *lw = &w->layer[l];
#define CONV_BIND_(id, field, ...) cw->field = base + m->tensors[i++].offset;
#define CONV_(id, field, name)  \
  {                             \
    df_conv_w *cw = &lw->field; \
    DF_TENSORS_CONV(CONV_BIND_) \
  }
    DF_CONVS(CONV_)
#undef CONV_
#undef CONV_BIND_
#undef LAYER_BIND_
  }
  DF_TENSORS_SELECTOR(BIND_)
#undef BIND_
}

dflash_status df_model_init(df_model *m, const dflash_drafter_config *cfg, int n_threads,
                            int vocab_chunk, double gamma) {
  memset(m, 0, sizeof *m);
  dflash_status st = df_config_in(cfg, &m->cfg);
  if (!st) st = dflash_drafter_config_validate(&m->cfg);
  df_config_ext_of(&m->cfg, &m->ext);
  if (!st) st = df_config_ext_validate(&m->cfg, &m->ext, "drafter config");
  if (st) return st;
  cfg = &m->cfg; /* the library's full struct from here on */
  m->rot = df_rotary_dims(cfg, &m->ext);
  m->H = cfg->hidden_size;
  m->KH = cfg->n_target_layer_ids * cfg->hidden_size;
  m->nh = cfg->num_attention_heads;
  m->nkv = cfg->num_key_value_heads;
  m->d = cfg->head_dim;
  m->I = cfg->intermediate_size;
  m->V = cfg->vocab_size;
  m->Vd = m->ext.draft_vocab > 0 ? m->ext.draft_vocab : m->V;
  m->B = cfg->block_size;
  m->L = cfg->num_hidden_layers;
  m->dflash2 = m->ext.dflash2 != 0;
  m->dspark = m->ext.dspark != 0;
  m->conv_k = m->ext.conv_kernel_size;
  m->conv_g = m->ext.conv_group_size;
  m->conv_groups = m->dflash2 ? m->H / m->conv_g : 0;
  m->sel_rank = m->ext.selector_rank;
  m->sel_weight = 1.0; /* dflash_trainer_options' defaults; the trainer sets its own */
  m->sel_inject = false;
  m->vocab_chunk = vocab_chunk > 0 ? vocab_chunk : 4096;
  /* DSpark's default is DeepSpec's gamma 4 at every block size (spec/dspark.md section 2). */
  m->gamma = gamma != 0 ? gamma : m->dspark ? 4.0 : dflash_trainer_default_loss_gamma(m->B);
  if ((st = build_tensor_table(m))) goto fail;
  m->params = calloc(m->n_params, sizeof(float));
  m->grads = calloc(m->n_params, sizeof(float));
  m->inv_freq = calloc((size_t)m->rot / 2, sizeof(double));
  if (!m->params || !m->grads || !m->inv_freq) {
    st = df_error_nomem("drafter parameters");
    goto fail;
  }
  bind_views(m, m->params, &m->w);
  bind_views(m, m->grads, &m->g);
  df_rope_inv_freq(cfg, m->rot, m->inv_freq, &m->attn_factor);
  if ((st = df_pool_create(n_threads, &m->pool))) goto fail;
  return DFLASH_OK;
fail:
  df_model_free(m);
  return st;
}

void df_model_free(df_model *m) {
  if (!m) return;
  free(m->tensors);
  free(m->params);
  free(m->grads);
  free(m->embed);
  free(m->lm_head);
  free(m->lm_head_full);
  free(m->kept);
  free(m->t2d);
  free(m->inv_freq);
  free(m->cos_t);
  free(m->sin_t);
  free(m->arena);
  df_pool_free(m->pool);
  memset(m, 0, sizeof *m);
}

const df_tensor_info *df_model_find(const df_model *m, const char *name) {
  for (size_t i = 0; i < m->n_tensors; i++)
    if (!strcmp(m->tensors[i].name, name)) return &m->tensors[i];
  return NULL;
}

double df_position_weight(const df_model *m, int k) {
  if (k < 1) return 0;
  return m->gamma > 0 && !m->adaptive ? exp(-(double)(k - 1) / m->gamma) : 1.0;
}

/* ---- workspace ------------------------------------------------------------ */

/* Hand out `n` floats (64-byte aligned) from the arena, or only count them. */
static float *take(float *base, size_t *cur, size_t n) {
  float *p = base ? base + *cur : NULL;
  *cur += (n + 15) & ~(size_t)15;
  return p;
}

static size_t layout(df_model *m, float *base, int T, int Sc, int R) {
  size_t cur = 0, t = (size_t)T, sc = (size_t)Sc, H = (size_t)m->H;
  size_t qd = (size_t)m->nh * m->d, kd = (size_t)m->nkv * m->d, I = (size_t)m->I;
  df_acts *a = &m->a;
  a->ctx_pre = take(base, &cur, sc * H);
  a->ctx_rstd = take(base, &cur, sc);
  a->ctx = take(base, &cur, sc * H);
  for (int l = 0; l < m->L; l++) {
    df_layer_acts *A = &a->layer[l];
    A->h_in = take(base, &cur, t * H);
    A->rstd1 = take(base, &cur, t);
    A->xn1 = take(base, &cur, t * H);
    A->q_pre = take(base, &cur, t * qd);
    A->q_rstd = take(base, &cur, t * m->nh);
    A->q = take(base, &cur, t * qd);
    A->kb_pre = take(base, &cur, t * kd);
    A->kb_rstd = take(base, &cur, t * m->nkv);
    A->kb = take(base, &cur, t * kd);
    A->vb = take(base, &cur, t * kd);
    A->kc_pre = take(base, &cur, sc * kd);
    A->kc_rstd = take(base, &cur, sc * m->nkv);
    A->kc = take(base, &cur, sc * kd);
    A->vc = take(base, &cur, sc * kd);
    A->att = take(base, &cur, t * qd);
    A->lse = take(base, &cur, t * m->nh);
    A->h_mid = take(base, &cur, t * H);
    A->rstd2 = take(base, &cur, t);
    A->xn2 = take(base, &cur, t * H);
    A->g = take(base, &cur, t * I);
    A->u = take(base, &cur, t * I);
    A->m = take(base, &cur, t * I);
    /* DFlash 2 only (0 floats, so DFlash 1's layout is unchanged). */
    size_t dyn = m->dflash2 ? t * 2 * (size_t)m->conv_k * m->conv_groups : 0;
    size_t th = m->dflash2 ? t * H : 0;
    A->att_dyn = take(base, &cur, dyn);
    A->att_x = take(base, &cur, th);
    A->att_y = take(base, &cur, th);
    A->mlp_dyn = take(base, &cur, dyn);
    A->mlp_x = take(base, &cur, th);
    A->mlp_y = take(base, &cur, th);
  }
  a->h_out = take(base, &cur, t * H);
  a->rstd_f = take(base, &cur, t);
  a->hf = take(base, &cur, t * H);
  a->dh = take(base, &cur, t * H);
  a->dx = take(base, &cur, t * H);
  a->dq = take(base, &cur, t * qd);
  a->dkb = take(base, &cur, t * kd);
  a->dvb = take(base, &cur, t * kd);
  a->dkc = take(base, &cur, sc * kd);
  a->dvc = take(base, &cur, sc * kd);
  a->datt = take(base, &cur, t * qd);
  a->dg = take(base, &cur, t * I);
  a->du = take(base, &cur, t * I);
  a->dm = take(base, &cur, t * I);
  a->dctx = take(base, &cur, sc * H);
  a->dtmp = take(base, &cur, t * (qd > kd ? qd : kd));
  a->dctx_tmp = take(base, &cur, sc * (kd > H ? kd : H));
  size_t th2 = m->dflash2 ? t * H : 0;
  a->d2_y = take(base, &cur, th2);
  a->d2_x = take(base, &cur, th2);
  a->d2_dyn = take(base, &cur, m->dflash2 ? t * 2 * (size_t)m->conv_k * m->conv_groups : 0);
  a->rows_x = take(base, &cur, (size_t)R * H);
  a->rows_dx = take(base, &cur, (size_t)R * H);
  a->coef = take(base, &cur, (size_t)R);
  a->rows_t = (int32_t *)take(base, &cur, (size_t)R);
  a->rows_target = (int32_t *)take(base, &cur, (size_t)R);
  a->row_loss = (double *)take(base, &cur, 2 * (size_t)R);
  /* DSpark only (0 floats otherwise) */
  size_t rd = m->dspark ? (size_t)R : 0;
  a->rows_prev = (int32_t *)take(base, &cur, rd);
  a->rows_w = (double *)take(base, &cur, 2 * rd);
  a->rows_xt = take(base, &cur, rd * H);
  a->pos_block = (int32_t *)take(base, &cur, t);
  a->pos_ctx = (int32_t *)take(base, &cur, sc);
  df_attn_shape s = {
      .n_blocks = T / m->B, .B = m->B, .Sc = Sc, .nh = m->nh, .nkv = m->nkv, .d = m->d};
  size_t work = df_attention_work(m->pool, &s);
  size_t ce = df_lmhead_work(R > 0 ? R : 1, m->H, m->vocab_chunk);
  a->work = take(base, &cur, work > ce ? work : ce);
  return cur;
}

static dflash_status reserve(df_model *m, int T, int Sc, int R) {
  size_t need = layout(m, NULL, T, Sc, R);
  if (need > m->arena_floats) {
    free(m->arena);
    m->arena = aligned_alloc(64, need * sizeof(float));
    m->arena_floats = m->arena ? need : 0;
    if (!m->arena) return df_error_nomem("drafter activations");
  }
  layout(m, m->arena, T, Sc, R);
  m->T = T, m->Sc = Sc, m->R = R;
  return DFLASH_OK;
}

/* cos/sin tables for positions [0, n_pos). */
static dflash_status rope_tables(df_model *m, int n_pos) {
  if (n_pos <= m->n_pos) return DFLASH_OK;
  int half = m->rot / 2;
  float *c = realloc(m->cos_t, sizeof(float) * (size_t)n_pos * half);
  if (c) m->cos_t = c;
  float *s = realloc(m->sin_t, sizeof(float) * (size_t)n_pos * half);
  if (s) m->sin_t = s;
  if (!c || !s) return df_error_nomem("RoPE tables");
  for (int p = m->n_pos; p < n_pos; p++)
    for (int i = 0; i < half; i++) {
      double ang = (double)p * m->inv_freq[i];
      m->cos_t[(size_t)p * half + i] = (float)(cos(ang) * m->attn_factor);
      m->sin_t[(size_t)p * half + i] = (float)(sin(ang) * m->attn_factor);
    }
  m->n_pos = n_pos;
  return DFLASH_OK;
}

/* ---- inputs --------------------------------------------------------------- */

dflash_status df_model_check_inputs(const df_model *m, const int32_t *ids, int64_t len,
                                    const float *hidden, const int32_t *anchors, int32_t n) {
  if (len <= 0 || len > INT32_MAX / 2)
    return df_error(DFLASH_E_RANGE, "sequence length %lld is out of range", (long long)len);
  for (int64_t i = 0; i < len; i++)
    if (ids[i] < 0 || ids[i] >= m->V)
      return df_error(DFLASH_E_RANGE, "input_ids[%lld] = %d is outside the vocabulary [0, %d)",
                      (long long)i, ids[i], m->V);
  for (int32_t i = 0; i < n; i++)
    if (anchors[i] < 0 || anchors[i] >= len)
      return df_error(DFLASH_E_RANGE, "anchor %d = %d is outside the sequence [0, %lld)", i,
                      anchors[i], (long long)len);
  size_t total = hidden ? (size_t)len * (size_t)m->KH : 0; /* NULL: stored rows, checked later */
  for (size_t i = 0; i < total; i++)
    if (!isfinite(hidden[i]))
      return df_error(DFLASH_E_FORMAT, "hidden state at position %zu, column %zu is %s",
                      i / (size_t)m->KH, i % (size_t)m->KH, isnan(hidden[i]) ? "NaN" : "Inf");
  return DFLASH_OK;
}

double df_model_weight_sum(const df_model *m, const uint8_t *loss_mask, int64_t len,
                           const int32_t *anchors, int32_t n_anchors) {
  if (m->dspark) return df_dspark_weight_sum(m->B, m->gamma, loss_mask, len, anchors, n_anchors);
  double s = 0;
  for (int32_t n = 0; n < n_anchors; n++)
    for (int k = 1; k < m->B; k++) {
      int64_t p = (int64_t)anchors[n] + k;
      if (p < len && loss_mask[p]) s += df_position_weight(m, k);
    }
  return s;
}

int df_model_rows(const df_model *m, const int32_t *ids, const int32_t *labels,
                  const uint8_t *loss_mask, int64_t len, const int32_t *anchors, int32_t n_anchors,
                  double grad_scale, int *Sc, int *max_pos, int32_t *block_tok, int32_t *rows_t,
                  int32_t *rows_target, int32_t *rows_prev, float *coef) {
  int sc = 0, mp = (int)len, R = 0;
  for (int32_t n = 0; n < n_anchors; n++) {
    sc = anchors[n] > sc ? anchors[n] : sc;
    mp = anchors[n] + m->B > mp ? anchors[n] + m->B : mp;
    for (int j = 0; j < m->B; j++) {
      int t = n * m->B + j, p = anchors[n] + j;
      if (block_tok) block_tok[t] = j == 0 ? ids[anchors[n]] : m->cfg.mask_token_id;
      if (j == 0) continue;
      if (loss_mask && !(p < len && loss_mask[p] && df_position_weight(m, j) > 0)) continue;
      if (rows_t) rows_t[R] = t;
      /* --labels target: the target's greedy token */
      if (rows_target) rows_target[R] = !loss_mask ? 0 : labels ? labels[p] : ids[p];
      if (rows_prev)
        rows_prev[R] = p - 1 >= len      ? 0 /* predict: past the end */
                       : labels && j > 1 ? labels[p - 1]
                                         : ids[p - 1];
      if (coef) coef[R] = (float)(df_position_weight(m, j) * grad_scale);
      R++;
    }
  }
  if (Sc) *Sc = sc;
  if (max_pos) *max_pos = mp;
  return R;
}

/* Sizes, positions, block tokens and supervised rows of one call (df_model_rows). */
static dflash_status prepare(df_model *m, const int32_t *ids, const int32_t *labels,
                             const uint8_t *loss_mask, int64_t len, const int32_t *anchors,
                             int32_t n_anchors) {
  int Sc = 0, max_pos = 0;
  int R = df_model_rows(m, ids, labels, loss_mask, len, anchors, n_anchors, 0, &Sc, &max_pos, NULL,
                        NULL, NULL, NULL, NULL);
  /* DSpark's rows are its own (anchor-first: slot k predicts anchor + k + 1); the context and
   * positions are DFlash's. Predicting (no loss mask) it takes no rows here: propose chains. */
  if (m->dspark)
    R = loss_mask ? df_dspark_rows(m->B, m->gamma, ids, labels, loss_mask, len, anchors, n_anchors,
                                   0, NULL, NULL, NULL, NULL, NULL)
                  : 0;
  dflash_status st = reserve(m, n_anchors * m->B, Sc, R);
  if (!st) st = rope_tables(m, max_pos);
  if (st) return st;
  df_acts *a = &m->a;
  for (int s = 0; s < Sc; s++) a->pos_ctx[s] = s;
  for (int32_t n = 0; n < n_anchors; n++)
    for (int j = 0; j < m->B; j++) {
      int t = n * m->B + j;
      a->pos_block[t] = anchors[n] + j;
      int tok = j == 0 ? ids[anchors[n]] : m->cfg.mask_token_id;
      memcpy(a->layer[0].h_in + (size_t)t * m->H, m->embed + (size_t)tok * m->H,
             sizeof(float) * m->H);
    }
  if (loss_mask && m->dspark)
    df_dspark_rows(m->B, m->gamma, ids, labels, loss_mask, len, anchors, n_anchors, 1.0, a->rows_t,
                   a->rows_target, a->rows_prev, a->rows_w, a->coef);
  else if (loss_mask)
    df_model_rows(m, ids, labels, loss_mask, len, anchors, n_anchors, 0, NULL, NULL, NULL,
                  a->rows_t, a->rows_target, NULL, NULL);
  return DFLASH_OK;
}

/* ---- forward -------------------------------------------------------------- */

static void attn_shape(const df_model *m, int l, const int32_t *anchors, df_attn_shape *s) {
  *s = (df_attn_shape){.n_blocks = m->T / m->B,
                       .B = m->B,
                       .Sc = m->Sc,
                       .nh = m->nh,
                       .nkv = m->nkv,
                       .d = m->d,
                       .anchors = anchors,
                       .window = m->cfg.layer_types[l] == DFLASH_LAYER_SLIDING
                                     ? m->cfg.sliding_window
                                     : 0};
}

/* q/k projection, per-head norm and rotation: out = rope(norm(x W^T)). */
static void qk_forward(df_model *m, float *pre, float *rstd, float *out, const float *x,
                       const float *w, const float *norm_w, const int32_t *pos, int rows,
                       int heads) {
  int hd = heads * m->d;
  df_matmul_forward(m->pool, pre, x, w, rows, hd, m->H, false);
  df_rmsnorm_forward(m->pool, out, rstd, pre, norm_w, rows * heads, m->d,
                     (float)m->cfg.rms_norm_eps);
  df_rope_forward(m->pool, out, pos, m->cos_t, m->sin_t, rows, heads, m->d, m->rot);
}

/* DFlash 2, z-lab's GroupedDynamicCausalConv.prepare: the dynamic kernels of
 * both convolutions from the normed input x, and the first convolution. */
static void conv_prepare(const df_model *m, const df_conv_w *w, float *dyn, float *out,
                         const float *x) {
  int n = 2 * m->conv_k * m->conv_groups;
  df_matmul_forward(m->pool, dyn, x, w->proj, m->T, n, m->H, false);
  df2_conv_apply(m->pool, out, x, dyn, (size_t)n, w->base, NULL, m->T, m->B, m->H, m->conv_k,
                 m->conv_g);
}

/* .finish: the second convolution (base_kernel[1], the dynamic kernels'
 * second half) of the sublayer output y, added to the residual. */
static void conv_finish(const df_model *m, const df_conv_w *w, const float *dyn, float *out,
                        const float *y, const float *residual) {
  size_t kg = (size_t)m->conv_k * m->conv_groups;
  df2_conv_apply(m->pool, out, y, dyn + kg, 2 * kg, w->base + (size_t)m->conv_k * m->H, residual,
                 m->T, m->B, m->H, m->conv_k, m->conv_g);
}

/* out = residual + sublayer output (x W^T), through the finishing
 * convolution in DFlash 2. */
static void sublayer_out(const df_model *m, const df_conv_w *cw, const float *dyn, float *y,
                         float *out, const float *residual, const float *x, const float *w, int K) {
  if (!m->dflash2) {
    memcpy(out, residual, sizeof(float) * (size_t)m->T * m->H);
    df_matmul_forward(m->pool, out, x, w, m->T, m->H, K, true);
    return;
  }
  df_matmul_forward(m->pool, y, x, w, m->T, m->H, K, false);
  conv_finish(m, cw, dyn, out, y, residual);
}

static void layer_forward(df_model *m, int l, const int32_t *anchors, float *out) {
  const df_layer_w *W = &m->w.layer[l];
  df_layer_acts *A = &m->a.layer[l];
  int T = m->T, Sc = m->Sc, H = m->H, kd = m->nkv * m->d, qd = m->nh * m->d;
  float eps = (float)m->cfg.rms_norm_eps;
  df_rmsnorm_forward(m->pool, A->xn1, A->rstd1, A->h_in, W->in_ln, T, H, eps);
  const float *xa = A->xn1; /* the attention's input (block rows) */
  if (m->dflash2) {
    conv_prepare(m, &W->att_conv, A->att_dyn, A->att_x, A->xn1);
    xa = A->att_x;
  }
  qk_forward(m, A->q_pre, A->q_rstd, A->q, xa, W->wq, W->q_norm, m->a.pos_block, T, m->nh);
  qk_forward(m, A->kb_pre, A->kb_rstd, A->kb, xa, W->wk, W->k_norm, m->a.pos_block, T, m->nkv);
  df_matmul_forward(m->pool, A->vb, xa, W->wv, T, kd, H, false);
  /* The context enters only as extra keys/values. */
  qk_forward(m, A->kc_pre, A->kc_rstd, A->kc, m->a.ctx, W->wk, W->k_norm, m->a.pos_ctx, Sc, m->nkv);
  df_matmul_forward(m->pool, A->vc, m->a.ctx, W->wv, Sc, kd, H, false);
  df_attn_shape s;
  attn_shape(m, l, anchors, &s);
  df_attention_forward(m->pool, &s, A->att, A->lse, A->q, A->kc, A->vc, A->kb, A->vb, m->a.work);
  sublayer_out(m, &W->att_conv, A->att_dyn, A->att_y, A->h_mid, A->h_in, A->att, W->wo, qd);
  df_rmsnorm_forward(m->pool, A->xn2, A->rstd2, A->h_mid, W->post_ln, T, H, eps);
  const float *xm = A->xn2; /* the MLP's input */
  if (m->dflash2) {
    conv_prepare(m, &W->mlp_conv, A->mlp_dyn, A->mlp_x, A->xn2);
    xm = A->mlp_x;
  }
  df_matmul_forward(m->pool, A->g, xm, W->wg, T, m->I, H, false);
  df_matmul_forward(m->pool, A->u, xm, W->wu, T, m->I, H, false);
  df_swiglu_forward(m->pool, A->m, A->g, A->u, (size_t)T * m->I);
  sublayer_out(m, &W->mlp_conv, A->mlp_dyn, A->mlp_y, out, A->h_mid, A->m, W->wd, m->I);
}

static void model_forward(df_model *m, const float *hidden, const int32_t *anchors) {
  df_acts *a = &m->a;
  float eps = (float)m->cfg.rms_norm_eps;
  df_matmul_forward(m->pool, a->ctx_pre, hidden, m->w.fc, m->Sc, m->H, m->KH, false);
  df_rmsnorm_forward(m->pool, a->ctx, a->ctx_rstd, a->ctx_pre, m->w.hidden_norm, m->Sc, m->H, eps);
  for (int l = 0; l < m->L; l++)
    layer_forward(m, l, anchors, l + 1 < m->L ? a->layer[l + 1].h_in : a->h_out);
  df_rmsnorm_forward(m->pool, a->hf, a->rstd_f, a->h_out, m->w.norm, m->T, m->H, eps);
}

/* ---- backward ------------------------------------------------------------- */

/* Through rope, per-head norm and projection: dW += dpre^T x, dx (+)= dpre W. */
static void qk_backward(df_model *m, float *dout, float *dpre, float *dx, float *dw, float *dnorm_w,
                        const float *pre, const float *rstd, const float *x, const float *w,
                        const float *norm_w, const int32_t *pos, int rows, int heads,
                        bool accumulate_dx) {
  df_rope_backward(m->pool, dout, pos, m->cos_t, m->sin_t, rows, heads, m->d, m->rot);
  df_rmsnorm_backward(m->pool, dpre, dnorm_w, dout, pre, norm_w, rstd, rows * heads, m->d, false);
  df_matmul_backward(m->pool, dx, dw, dpre, x, w, rows, heads * m->d, m->H, accumulate_dx);
}

/* DFlash 2: d(out) = a->dh through finish (the residual keeps a->dh):
 * returns d(sublayer output), accumulates the base kernel's gradient and
 * writes the second half of d(dynamic kernels). */
static const float *conv_finish_backward(df_model *m, const df_conv_w *W, df_conv_w *G,
                                         const float *dyn, const float *y) {
  size_t kg = (size_t)m->conv_k * m->conv_groups, kh = (size_t)m->conv_k * m->H;
  df_acts *a = &m->a;
  df2_conv_backward(m->pool, a->d2_y, a->d2_dyn + kg, G->base + kh, a->dh, y, dyn + kg, 2 * kg,
                    W->base + kh, m->T, m->B, m->H, m->conv_k, m->conv_g);
  return a->d2_y;
}

/* DFlash 2: d(convolved input) in a->d2_x through prepare: a->dx gets
 * d(normed input) (the first convolution plus the kernel projection), the
 * base kernel and projection their gradients. */
static void conv_prepare_backward(df_model *m, const df_conv_w *W, df_conv_w *G, const float *dyn,
                                  const float *xn) {
  int n = 2 * m->conv_k * m->conv_groups;
  df_acts *a = &m->a;
  df2_conv_backward(m->pool, a->dx, a->d2_dyn, G->base, a->d2_x, xn, dyn, (size_t)n, W->base, m->T,
                    m->B, m->H, m->conv_k, m->conv_g);
  df_matmul_backward(m->pool, a->dx, G->proj, a->d2_dyn, xn, W->proj, m->T, n, m->H, true);
}

/* a->dh holds d(layer output) on entry and d(layer input) on return. */
static void layer_backward(df_model *m, int l, const int32_t *anchors, const float *out) {
  (void)out;
  const df_layer_w *W = &m->w.layer[l];
  df_layer_w *G = &m->g.layer[l];
  df_layer_acts *A = &m->a.layer[l];
  df_acts *a = &m->a;
  int T = m->T, Sc = m->Sc, H = m->H, kd = m->nkv * m->d, qd = m->nh * m->d, I = m->I;
  bool c2 = m->dflash2;
  /* MLP (DFlash 2: its input is the convolved mlp_x, its output goes through finish) */
  const float *dy = c2 ? conv_finish_backward(m, &W->mlp_conv, &G->mlp_conv, A->mlp_dyn, A->mlp_y)
                       : a->dh;
  const float *xm = c2 ? A->mlp_x : A->xn2;
  float *dxm = c2 ? a->d2_x : a->dx;
  df_matmul_backward(m->pool, a->dm, G->wd, dy, A->m, W->wd, T, H, I, false);
  df_swiglu_backward(m->pool, a->dg, a->du, a->dm, A->g, A->u, (size_t)T * I);
  df_matmul_backward(m->pool, dxm, G->wg, a->dg, xm, W->wg, T, I, H, false);
  df_matmul_backward(m->pool, dxm, G->wu, a->du, xm, W->wu, T, I, H, true);
  if (c2) conv_prepare_backward(m, &W->mlp_conv, &G->mlp_conv, A->mlp_dyn, A->xn2);
  df_rmsnorm_backward(m->pool, a->dh, G->post_ln, a->dx, A->h_mid, W->post_ln, A->rstd2, T, H,
                      true);
  /* attention */
  dy = c2 ? conv_finish_backward(m, &W->att_conv, &G->att_conv, A->att_dyn, A->att_y) : a->dh;
  const float *xa = c2 ? A->att_x : A->xn1;
  float *dxa = c2 ? a->d2_x : a->dx;
  df_matmul_backward(m->pool, a->datt, G->wo, dy, A->att, W->wo, T, H, qd, false);
  df_attn_shape s;
  attn_shape(m, l, anchors, &s);
  df_attention_backward(m->pool, &s, a->dq, a->dkc, a->dvc, a->dkb, a->dvb, a->work, a->datt,
                        A->att, A->lse, A->q, A->kc, A->vc, A->kb, A->vb);
  qk_backward(m, a->dq, a->dtmp, dxa, G->wq, G->q_norm, A->q_pre, A->q_rstd, xa, W->wq, W->q_norm,
              a->pos_block, T, m->nh, false);
  qk_backward(m, a->dkb, a->dtmp, dxa, G->wk, G->k_norm, A->kb_pre, A->kb_rstd, xa, W->wk,
              W->k_norm, a->pos_block, T, m->nkv, true);
  df_matmul_backward(m->pool, dxa, G->wv, a->dvb, xa, W->wv, T, kd, H, true);
  if (c2) conv_prepare_backward(m, &W->att_conv, &G->att_conv, A->att_dyn, A->xn1);
  qk_backward(m, a->dkc, a->dctx_tmp, a->dctx, G->wk, G->k_norm, A->kc_pre, A->kc_rstd, a->ctx,
              W->wk, W->k_norm, a->pos_ctx, Sc, m->nkv, true);
  df_matmul_backward(m->pool, a->dctx, G->wv, a->dvc, a->ctx, W->wv, Sc, kd, H, true);
  df_rmsnorm_backward(m->pool, a->dh, G->in_ln, a->dx, A->h_in, W->in_ln, A->rstd1, T, H, true);
}

static void model_backward(df_model *m, const float *hidden, const int32_t *anchors) {
  df_acts *a = &m->a;
  memset(a->dh, 0, sizeof(float) * (size_t)m->T * m->H);
  for (int r = 0; r < m->R; r++)
    memcpy(a->dh + (size_t)a->rows_t[r] * m->H, a->rows_dx + (size_t)r * m->H,
           sizeof(float) * m->H);
  /* dh currently holds d(hf); turn it into d(h_out). */
  memcpy(a->dx, a->dh, sizeof(float) * (size_t)m->T * m->H);
  df_rmsnorm_backward(m->pool, a->dh, m->g.norm, a->dx, a->h_out, m->w.norm, a->rstd_f, m->T, m->H,
                      false);
  memset(a->dctx, 0, sizeof(float) * (size_t)m->Sc * m->H);
  for (int l = m->L - 1; l >= 0; l--) layer_backward(m, l, anchors, NULL);
  df_rmsnorm_backward(m->pool, a->dctx_tmp, m->g.hidden_norm, a->dctx, a->ctx_pre, m->w.hidden_norm,
                      a->ctx_rstd, m->Sc, m->H, false);
  df_matmul_backward(m->pool, NULL, m->g.fc, a->dctx_tmp, hidden, m->w.fc, m->Sc, m->H, m->KH,
                     false);
}

/* ---- entry points --------------------------------------------------------- */

/* The true token before supervised row r's position (teacher forcing):
 * the block's own token at position 1, else the previous position's label. */
static int32_t row_prev(const df_model *m, const int32_t *ids, const int32_t *labels,
                        const int32_t *anchors, int r) {
  int t = m->a.rows_t[r], j = t % m->B, p = anchors[t / m->B] + j - 1;
  return labels && j > 1 ? labels[p] : ids[p];
}

/*
 * DFlash 2's selector loss on the supervised rows (df2_selector_loss)
 * with the true previous token as predecessor, weighted like the block CE
 * and by sel_weight; *lsum gets it added. The backward feeds the codebooks,
 * hidden_projection and, through P(hf), rows_dx (the block CE's d(hf) rows,
 * which model_backward then carries into the drafter).
 */
static dflash_status selector_loss(df_model *m, const int32_t *ids, const int32_t *labels,
                                   const int32_t *anchors, const int32_t *cand, const float *unary,
                                   bool backward, double *lsum) {
  df_acts *a = &m->a;
  m->sel_loss_sum = m->sel_rows = m->sel_hits = 0;
  if (m->R == 0) return DFLASH_OK;
  int32_t *prev = malloc(sizeof(int32_t) * m->R);
  float *coef = malloc(sizeof(float) * m->R);
  double *w = malloc(sizeof(double) * m->R);
  if (!prev || !coef || !w) {
    free(prev), free(coef), free(w);
    return df_error_nomem("candidate selector loss");
  }
  for (int i = 0; i < m->R; i++) {
    prev[i] = row_prev(m, ids, labels, anchors, i);
    coef[i] = (float)(a->coef[i] * m->sel_weight);
    w[i] = m->row_w ? m->row_w[i] : df_position_weight(m, a->rows_t[i] % m->B);
  }
  df2_sel_args s = {.x = a->rows_x,
                    .E = m->lm_head,
                    .pred = m->w.sel_pred,
                    .succ = m->w.sel_succ,
                    .hproj = m->w.sel_hproj,
                    .target = a->rows_target,
                    .prev = prev,
                    .coef = coef,
                    .w = w,
                    .R = m->R,
                    .H = m->H,
                    .V = m->V,
                    .r = m->sel_rank,
                    .K = m->ext.selector_top_k,
                    .chunk = m->vocab_chunk,
                    .inject = m->sel_inject,
                    .cand = cand,
                    .unary = unary};
  if (backward)
    s.dx = a->rows_dx, s.dpred = m->g.sel_pred, s.dsucc = m->g.sel_succ, s.dhproj = m->g.sel_hproj;
  dflash_status st = df2_selector_loss(&s, &m->sel_loss_sum, &m->sel_hits);
  m->sel_rows = m->R;
  *lsum += m->sel_weight * m->sel_loss_sum;
  free(prev), free(coef), free(w);
  return st;
}

/*
 * DFLASH_POSITION_WEIGHTING_ADAPTIVE: a row's weight is the drafter's probability of reaching its
 * position in a greedy walk, prod exp(-CE) of the block's earlier supervised rows (a->row_loss of
 * this step's LM-head pass; not differentiated: it only weighs the CE), rescaled so that
 * each block's weights sum to its row count, as the unit weights dflash_trainer_weight_sum
 * counts. Rows are in block order (df_model_rows), so a block is a run of equal
 * rows_t / B.
 */
static void adaptive_weights(df_model *m, double *w) {
  df_acts *a = &m->a;
  for (int r0 = 0, r1; r0 < m->R; r0 = r1) {
    double reach = 1, sum = 0;
    for (r1 = r0; r1 < m->R && a->rows_t[r1] / m->B == a->rows_t[r0] / m->B; r1++) {
      w[r1] = reach;
      sum += reach;
      reach *= exp(-a->row_loss[r1]);
    }
    for (int r = r0; r < r1; r++) w[r] = sum > 0 ? w[r] * (double)(r1 - r0) / sum : 1.0;
  }
}

/* The block CE over the supervised rows (row_loss, and rows_dx with
 * backward), each row weighted w[r] * grad_scale (a->coef). DFlash 2 keeps
 * each row's top-K logits in the same LM-head pass: *cand / *unary [R, top_k]
 * (the caller frees them) for the selector loss, so each logits chunk is
 * computed once. The adaptive weighting replaces w from the same pass's row
 * losses before the gradient is formed: one LM-head pass a step, not two (the
 * weights are the losses' and not differentiated, so the result is the same). */
static dflash_status block_ce(df_model *m, bool backward, double *w, double grad_scale,
                              int32_t **cand, float **unary) {
  df_acts *a = &m->a;
  int K = m->dflash2 && m->R > 0 ? m->ext.selector_top_k : 0;
  if (K) {
    *cand = malloc(sizeof(int32_t) * (size_t)m->R * K);
    *unary = malloc(sizeof(float) * (size_t)m->R * K);
    if (!*cand || !*unary) return df_error_nomem("selector candidates");
  }
  df_lmhead_ce_pass(m->pool, backward, a->rows_x, m->lm_head, a->rows_target, m->R, m->H, m->V,
                    m->vocab_chunk, a->work, K, *cand, *unary);
  df_lmhead_ce_finish(m->pool, a->row_loss, NULL, m->lm_head, a->rows_target, NULL, m->R, m->H,
                      m->vocab_chunk, a->work);
  if (m->adaptive) adaptive_weights(m, w);
  for (int r = 0; r < m->R; r++) a->coef[r] = (float)(w[r] * grad_scale);
  if (backward)
    df_lmhead_ce_finish(m->pool, NULL, a->rows_dx, m->lm_head, a->rows_target, a->coef, m->R, m->H,
                        m->vocab_chunk, a->work);
  return DFLASH_OK;
}

dflash_status df_model_check_labels(const df_model *m, const int32_t *labels, int64_t len) {
  for (int64_t i = 0; labels && i < len; i++)
    if (labels[i] < 0 || labels[i] >= m->V)
      return df_error(DFLASH_E_RANGE,
                      "label (target id) at position %lld = %d is outside the "
                      "vocabulary [0, %d)",
                      (long long)i, labels[i], m->V);
  return DFLASH_OK;
}

dflash_status df_model_step(df_model *m, const int32_t *ids, const uint8_t *loss_mask, int64_t len,
                            const float *hidden, const int32_t *anchors, int32_t n_anchors,
                            double grad_scale, bool backward, double *loss_sum,
                            double *weight_sum) {
  return df_model_step_labels(m, ids, NULL, loss_mask, len, hidden, anchors, n_anchors, grad_scale,
                              backward, loss_sum, weight_sum);
}

dflash_status df_model_step_labels(df_model *m, const int32_t *ids, const int32_t *labels,
                                   const uint8_t *loss_mask, int64_t len, const float *hidden,
                                   const int32_t *anchors, int32_t n_anchors, double grad_scale,
                                   bool backward, double *loss_sum, double *weight_sum) {
  return df_model_step_final(m, ids, labels, loss_mask, len, hidden, NULL, anchors, n_anchors,
                             grad_scale, backward, loss_sum, weight_sum);
}

/* DFlash 1 and 2's loss: the block CE (position weights, adaptive or decayed) and DFlash 2's
 * selector term. */
static dflash_status dflash_loss(df_model *m, const int32_t *ids, const int32_t *labels,
                                 const int32_t *anchors, double grad_scale, bool backward,
                                 double *lsum, double *wsum) {
  df_acts *a = &m->a;
  double *w = malloc(sizeof(double) * (size_t)(m->R > 0 ? m->R : 1));
  if (!w) return df_error_nomem("position weights");
  for (int r = 0; r < m->R; r++) {
    w[r] = df_position_weight(m, a->rows_t[r] % m->B);
    memcpy(a->rows_x + (size_t)r * m->H, a->hf + (size_t)a->rows_t[r] * m->H, sizeof(float) * m->H);
  }
  int32_t *cand = NULL;
  float *unary = NULL;
  dflash_status st = block_ce(m, backward, w, grad_scale, &cand, &unary);
  for (int r = 0; !st && r < m->R; r++) {
    *lsum += w[r] * a->row_loss[r];
    *wsum += w[r];
  }
  m->row_w = m->adaptive ? w : NULL;
  if (!st && m->dflash2) st = selector_loss(m, ids, labels, anchors, cand, unary, backward, lsum);
  m->row_w = NULL;
  free(cand), free(unary), free(w);
  return st;
}

dflash_status df_model_step_final(df_model *m, const int32_t *ids, const int32_t *labels,
                                  const uint8_t *loss_mask, int64_t len, const float *hidden,
                                  const float *final, const int32_t *anchors, int32_t n_anchors,
                                  double grad_scale, bool backward, double *loss_sum,
                                  double *weight_sum) {
  if (n_anchors < 0) return df_error(DFLASH_E_RANGE, "negative anchor count %d", n_anchors);
  dflash_status st = df_model_check_inputs(m, ids, len, hidden, anchors, n_anchors);
  if (!st) st = df_model_check_labels(m, labels, len);
  if (!st && m->dspark) st = df_model_check_final(m, final, len);
  if (!st && backward) st = df_model_draft_vocab_ready(m);
  if (st) return st;
  double lsum = 0, wsum = 0;
  if (n_anchors > 0) {
    if ((st = prepare(m, ids, labels, loss_mask, len, anchors, n_anchors))) return st;
    model_forward(m, hidden, anchors);
    st = m->dspark ? df_model_dspark_loss(m, final, anchors, grad_scale, backward, &lsum, &wsum)
                   : dflash_loss(m, ids, labels, anchors, grad_scale, backward, &lsum, &wsum);
    if (st) return st;
    if (backward) model_backward(m, hidden, anchors);
  }
  if (loss_sum) *loss_sum = lsum;
  if (weight_sum) *weight_sum = wsum;
  return DFLASH_OK;
}

/* DFlash 2's prediction: the candidate selector's path through each
 * block's drafted positions 1..B-1 (hf rows n*B+1 .. n*B+B-1), from the
 * block's own token, as z-lab's propose drafts (greedy, or sampled with a
 * stream of its own per anchor position, so a draw does not depend on which
 * other blocks share the call). */
static dflash_status select_blocks(df_model *m, const int32_t *ids, const int32_t *anchors,
                                   int32_t n_anchors, const dflash_propose_options *o,
                                   const dflash_propose_outputs *out, int32_t *pred) {
  int n = m->B - 1, r = m->sel_rank, K = m->ext.selector_top_k;
  if (n <= 0) return DFLASH_OK;
  float *logits = malloc(sizeof(float) * (size_t)n * m->V);
  float *hp = malloc(sizeof(float) * (size_t)n * r);
  if (!logits || !hp) {
    free(logits), free(hp);
    return df_error_nomem("candidate selector");
  }
  df2_select_args s = {.logits = logits,
                       .hproj = hp,
                       .pred_cb = m->w.sel_pred,
                       .succ_cb = m->w.sel_succ,
                       .n = n,
                       .V = m->V,
                       .r = r,
                       .top_k = K,
                       .temperature = o ? o->temperature : 0};
  for (int32_t b = 0; b < n_anchors; b++) {
    const float *rows = m->a.hf + ((size_t)b * m->B + 1) * m->H;
    size_t at = (size_t)b * n;
    df_matmul_forward(m->pool, logits, rows, m->lm_head, n, m->V, m->H, false);
    df_matmul_forward(m->pool, hp, rows, m->w.sel_hproj, n, r, m->H, false);
    s.anchor_id = ids[anchors[b]];
    s.cand = out && out->candidates ? out->candidates + at * K : NULL;
    s.probs = out && out->probs ? out->probs + at * K : NULL;
    df_rng rng;
    df_rng_seed(&rng, o ? o->seed : 0, (uint64_t)anchors[b]);
    df2_select(&s, &rng, pred + at);
    for (int i = 0; out && out->argmax && i < n; i++)
      out->argmax[at + i] = df2_argmax(logits + (size_t)i * m->V, m->V);
  }
  free(logits), free(hp);
  return DFLASH_OK;
}

dflash_status df_model_predict(df_model *m, const int32_t *ids, int64_t len, const float *hidden,
                               const int32_t *anchors, int32_t n_anchors, int32_t *pred) {
  return df_model_propose(m, ids, len, hidden, anchors, n_anchors, NULL, NULL, pred);
}

dflash_status df_model_propose(df_model *m, const int32_t *ids, int64_t len, const float *hidden,
                               const int32_t *anchors, int32_t n_anchors,
                               const dflash_propose_options *o, const dflash_propose_outputs *out,
                               int32_t *pred) {
  dflash_status st = df_model_check_inputs(m, ids, len, hidden, anchors, n_anchors);
  if (st || n_anchors <= 0) return st;
  /* Every position 1..B-1 of every block is a row. */
  int R = n_anchors * (m->B - 1);
  if ((st = prepare(m, ids, NULL, NULL, len, anchors, n_anchors))) return st;
  model_forward(m, hidden, anchors);
  if (m->dflash2) return select_blocks(m, ids, anchors, n_anchors, o, out, pred);
  if (m->dspark) {
    st = df_model_dspark_chain(m, ids, len, NULL, anchors, n_anchors, pred, NULL, NULL);
    if (!st && out && out->argmax)
      memcpy(out->argmax, pred, sizeof(int32_t) * (size_t)n_anchors * m->B);
    return st;
  }
  df_acts *a = &m->a;
  int r = 0;
  for (int t = 0; t < m->T; t++)
    if (t % m->B)
      memcpy(a->rows_x + (size_t)r++ * m->H, a->hf + (size_t)t * m->H, sizeof(float) * m->H);
  df_lmhead_argmax(m->pool, a->rows_x, m->lm_head, pred, R, m->H, m->V, m->vocab_chunk, a->work);
  if (out && out->argmax) memcpy(out->argmax, pred, sizeof(int32_t) * (size_t)R);
  return DFLASH_OK;
}

dflash_status df_model_dspark_eval(df_model *m, const int32_t *ids, int64_t len,
                                   const float *hidden, const float *final, const int32_t *anchors,
                                   int32_t n_anchors, int32_t *pred, float *conf, double *ptau) {
  if (!m->dspark) return df_error(DFLASH_E_INVALID_ARG, "DSpark evaluation of a DFlash drafter");
  dflash_status st = df_model_check_inputs(m, ids, len, hidden, anchors, n_anchors);
  if (st || n_anchors <= 0) return st;
  if ((st = prepare(m, ids, NULL, NULL, len, anchors, n_anchors))) return st;
  model_forward(m, hidden, anchors);
  return df_model_dspark_chain(m, ids, len, final, anchors, n_anchors, pred, conf, ptau);
}

dflash_status df_model_logits(df_model *m, const int32_t *ids, int64_t len, const float *hidden,
                              const int32_t *anchors, int32_t n_anchors, float *logits) {
  dflash_status st = df_model_check_inputs(m, ids, len, hidden, anchors, n_anchors);
  if (st || n_anchors <= 0) return st;
  if ((st = prepare(m, ids, NULL, NULL, len, anchors, n_anchors))) return st;
  model_forward(m, hidden, anchors);
  /* All B rows of every block, position 0 included: [T, V] = hf [T, H] lm_head^T. */
  if (!m->kept) {
    df_matmul_forward(m->pool, logits, m->a.hf, m->lm_head, m->T, m->V, m->H, false);
    return DFLASH_OK;
  }
  /* A pruned draft vocabulary: its V_d logits scattered into V, -inf elsewhere (vLLM's). */
  float *zd = malloc(sizeof(float) * (size_t)m->T * m->Vd);
  if (!zd) return df_error_nomem("draft-vocabulary logits");
  df_matmul_forward(m->pool, zd, m->a.hf, m->lm_head, m->T, m->Vd, m->H, false);
  for (int t = 0; t < m->T; t++) {
    float *row = logits + (size_t)t * m->V;
    for (int v = 0; v < m->V; v++) row[v] = -INFINITY;
    for (int i = 0; i < m->Vd; i++) row[m->kept[i]] = zd[(size_t)t * m->Vd + i];
  }
  free(zd);
  return DFLASH_OK;
}
