/* Device memory arithmetic: the CUDA arena layout and `dflash train --plan`. */
#include "act_layout.h"

#include <dflash/train.h>
#include <stdio.h>
#include <string.h>

#include "train/cuda/dfcuda.h"
#include "backend.h"
#include "train/cuda/dist.h"

static size_t align_up(size_t x) { return (x + DF_ACT_ALIGN - 1) / DF_ACT_ALIGN * DF_ACT_ALIGN; }

void df_act_layout_compute(const df_act_dims *d, df_act_layout *o) {
  memset(o, 0, sizeof *o);
  /* The names act_layout.h's lists are written in. */
  const int64_t T = d->T, Sc = d->Sc, R = d->R, A = d->A, H = d->H, KH = d->KH, I = d->I;
  const int64_t QD = d->nh * d->d, KD = d->nkv * d->d, NH = d->nh, NKV = d->nkv;
  const int64_t CHUNK = d->chunk;
  /* element size * element count, in enum order */
#define BYTES_(id, bytes) bytes,
  const int64_t g[DF_ACT_COUNT] = {DF_ACTS(BYTES_)};
  const int64_t l[DF_LACT_COUNT] = {DF_LACTS(BYTES_)};
#undef BYTES_
  size_t cur = 0;
  for (int i = 0; i < DF_ACT_COUNT; i++) {
    o->off[i] = cur;
    o->bytes[i] = (size_t)g[i];
    cur += align_up((size_t)g[i]);
  }
  for (int k = 0; k < DF_LACT_COUNT; k++) o->lbytes[k] = (size_t)l[k];
  for (int64_t ly = 0; ly < d->L && ly < DF_ACT_MAX_LAYERS; ly++)
    for (int k = 0; k < DF_LACT_COUNT; k++) {
      o->loff[ly][k] = cur;
      cur += align_up((size_t)l[k]);
    }
  o->total = cur;
}

static void train_plan_options_defaults(dflash_train_plan_options *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->world_size = 1;
  o->seq_len = 3072;
  o->num_anchors = 512;
  o->batch_size = 0; /* the trainer's pick (df_cu_auto_sequences) */
  o->vocab_chunk = 8192;
  o->zero1 = 1;
  o->gpu_bytes = 80000000000ULL;
  o->reserve_bytes = 4ULL << 30;
  o->smem_per_block = 232448; /* sm_90 / sm_100: 227 KB */
  o->device = -1;
}

DF_DEFINE_INIT(dflash_train_plan_options, train_plan_options_defaults)

void df_plan_dims(const dflash_drafter_config *c, int64_t seq_len, int64_t anchors, int64_t chunk,
                  df_act_dims *d) {
  *d = (df_act_dims){.H = c->hidden_size,
                     .KH = (int64_t)c->n_target_layer_ids * c->hidden_size,
                     .nh = c->num_attention_heads,
                     .nkv = c->num_key_value_heads,
                     .d = c->head_dim,
                     .I = c->intermediate_size,
                     .L = c->num_hidden_layers,
                     .T = anchors * c->block_size,
                     .Sc = seq_len,
                     .R = anchors * (c->block_size - 1),
                     .A = anchors,
                     .chunk = chunk < c->vocab_size ? chunk : c->vocab_size};
}

static double gib(uint64_t b) { return (double)b / (double)(1ULL << 30); }

/* The attention's tiles as cuda/attention.cu picks them from the device's shared memory per
 * block (train/cuda/dfcuda.h): DFLASH_E_UNSUPPORTED naming the first kernel that does not fit. */
static dflash_status plan_attention(const dflash_drafter_config *c, uint64_t limit,
                                    dflash_train_plan *p) {
  static const char *kernel[] = {"forward", "backward dQ", "backward dK/dV"};
  int grp = c->num_attention_heads / c->num_key_value_heads;
  int Mp = df_cu_attn_rows(c->block_size, c->num_attention_heads, c->num_key_value_heads);
  int dp = (c->head_dim + 15) / 16 * 16;
  p->attention_rows = Mp;
  p->attention_key_tile = DF_CU_ATTN_MAX_N;
  for (int k = DF_CU_ATTN_FWD; k <= DF_CU_ATTN_BWD_KV; k++) {
    int N = limit ? df_cu_attn_pick_n(k, Mp, dp, (size_t)limit) : DF_CU_ATTN_MAX_N;
    uint64_t need = df_cu_attn_smem_layout(k, Mp, N ? N : 16, dp).total;
    if (!N) {
      p->attention_key_tile = 0, p->attention_smem = need;
      return df_error(DFLASH_E_UNSUPPORTED,
                      "training plan: the CUDA attention's %s needs %llu bytes of shared "
                      "memory per block at head_dim %d with %d rows per CTA (block size %d "
                      "times %d query heads per kv head); the GPU allows %llu",
                      kernel[k], (unsigned long long)need, c->head_dim, Mp, c->block_size, grp,
                      (unsigned long long)limit);
    }
    if (N < p->attention_key_tile) p->attention_key_tile = N;
    if (need > p->attention_smem) p->attention_smem = need;
  }
  return DFLASH_OK;
}

/* One tensor row (tensors.h) into the largest Muon matrix and Gram matrix so far, when Muon
 * takes it (df_muon_takes, the rule both backends pick their matrices by). */
static void muon_row(const char *name, int64_t d0, int64_t d1, int64_t d2, size_t *max_n,
                     size_t *max_gram) {
  df_tensor_info ti = {.ndim = d1 <= 0 ? 1 : d2 <= 0 ? 2 : 3, .shape = {d0, d1, d2}};
  snprintf(ti.name, sizeof ti.name, "%s", name);
  if (!df_muon_takes(&ti)) return;
  size_t n = (size_t)d0 * (size_t)d1, r = (size_t)(d0 < d1 ? d0 : d1);
  *max_n = n > *max_n ? n : *max_n;
  *max_gram = r * r > *max_gram ? r * r : *max_gram;
}

/* The CUDA Muon step's workspace (df_cu_muon_scratch_bytes) for a drafter of these dims. */
static uint64_t plan_muon_bytes(df_tensor_dims z) {
  size_t max_n = 0, max_gram = 0;
#define DF_MUON_ROW_(id, field, name, d0, d1, d2, init) \
  muon_row(name, d0, d1, d2, &max_n, &max_gram);
  DF_TENSORS_HEAD(DF_MUON_ROW_)
  DF_TENSORS_TAIL(DF_MUON_ROW_)
  if (z.L > 0) {
    DF_TENSORS_LAYER(DF_MUON_ROW_)
  }
  if (z.dflash2) {
    DF_TENSORS_CONV(DF_MUON_ROW_)
    DF_TENSORS_SELECTOR(DF_MUON_ROW_)
  }
#undef DF_MUON_ROW_
  return df_cu_muon_scratch_bytes(max_n, max_gram);
}

/* options.device: the GPU's memory, shared memory per block and links from the device. */
static dflash_status plan_device(dflash_train_plan_options *o, dflash_train_plan *p) {
  df_cu_props d;
  dflash_status st = df_backend_cuda_props(o->device, &d);
  if (st) return df_error_wrap(st, "training plan for CUDA device %d", o->device);
  o->gpu_bytes = d.total_mem;
  o->smem_per_block = d.smem_per_block;
  o->pcie = df_cu_arch_pcie(d.major, d.minor);
  snprintf(p->device_name, sizeof p->device_name, "%.80s (sm_%d%d)", d.name, d.major, d.minor);
  return DFLASH_OK;
}

static dflash_status plan_fill(const dflash_drafter_config *caller,
                               const dflash_train_plan_options *opts, dflash_train_plan *p) {
  dflash_train_plan_options o;
  dflash_train_plan_options_default(&o);
  dflash_drafter_config full, *cfg = &full;
  dflash_status st = df_opts_in(&o, opts, sizeof o, "dflash_train_plan_options");
  if (!st) st = df_config_in(caller, &full);
  if (st) return st;
  opts = &o;
  st = dflash_drafter_config_validate(cfg);
  df_config_ext ext;
  df_config_ext_of(&full, &ext);
  if (!st) st = df_config_ext_validate(cfg, &ext, "drafter config");
  if (st) return st;
  const char *why = df_cu_attn_shape_why(cfg->block_size, cfg->num_attention_heads,
                                         cfg->num_key_value_heads, cfg->head_dim);
  if (why)
    return df_error(DFLASH_E_UNSUPPORTED,
                    "training plan: the CUDA trainer cannot run block size %d, %d query / %d kv "
                    "heads, head_dim %d: %s",
                    cfg->block_size, cfg->num_attention_heads, cfg->num_key_value_heads,
                    cfg->head_dim, why);
  if (opts->world_size < 1 || opts->seq_len < 1 || opts->num_anchors < 1 || opts->vocab_chunk < 1 ||
      opts->batch_size < 0)
    return df_error(DFLASH_E_INVALID_ARG,
                    "plan options: world size %d, sequence length %d, "
                    "anchors %d and vocab chunk %d must be positive, batch %d not negative",
                    opts->world_size, opts->seq_len, opts->num_anchors, opts->vocab_chunk,
                    opts->batch_size);
  if (opts->optimizer != DFLASH_OPTIMIZER_ADAMW && opts->optimizer != DFLASH_OPTIMIZER_MUON)
    return df_error(DFLASH_E_INVALID_ARG,
                    "plan options: optimizer %d is neither AdamW (%d) nor Muon (%d)",
                    opts->optimizer, DFLASH_OPTIMIZER_ADAMW, DFLASH_OPTIMIZER_MUON);
  memset(p, 0, sizeof *p);
  p->struct_size = sizeof *p;
  if (o.device >= 0 && (st = plan_device(&o, p))) return st;
  /* As cuda/model.cu lays the buffers out: padded to the gradient buckets, the fp32
   * masters and moments created as this rank's shard (so the peak is the steady state). */
  uint64_t n = df_tensor_params(df_tensor_dims_of(cfg, &ext)) /* tensors.h */;
  df_bucket_layout b;
  if ((st = df_bucket_layout_init(&b, (size_t)n, opts->zero1 ? opts->world_size : 1,
                                  DF_CU_BUCKET_ELEMS)))
    return st;
  uint64_t padded = b.n_padded, shard = b.shard_len;
  df_bucket_layout_free(&b);
  p->n_params = n;
  p->weights = 2 * padded;
  p->masters = 4 * shard;
  p->moments = 8 * shard;
  p->grads = 4 * padded;
  df_act_dims d;
  df_plan_dims(cfg, opts->seq_len, opts->num_anchors, opts->vocab_chunk, &d);
  if (ext.dspark) d.R = d.A * cfg->block_size; /* anchor-first: every slot supervised */
  df_act_layout lay;
  df_act_layout_compute(&d, &lay);
  /* The arena, plus the staging buffer and scratch the backend keeps beside it (and Muon's). */
  p->activations = lay.total + df_cu_fixed_scratch_bytes(cfg->hidden_size,
                                                         cfg->n_target_layer_ids * cfg->hidden_size,
                                                         cfg->head_dim, cfg->block_size,
                                                         opts->seq_len + cfg->block_size);
  if (opts->optimizer == DFLASH_OPTIMIZER_MUON)
    p->activations += plan_muon_bytes(df_tensor_dims_of(cfg, &ext));
  /* DSpark: its row and logit buffers, the target's final state (bf16) at each row among
   * them, and a pruned drafter's own LM head rows and kept ids; its Markov and confidence
   * tensors are in n_params (tensors.h: W2 has V_d rows). */
  if (ext.dspark)
    p->activations += df_cu_dspark_bytes((size_t)d.R, (size_t)cfg->hidden_size,
                                         (size_t)cfg->vocab_size, (size_t)ext.draft_vocab,
                                         (size_t)ext.markov_rank);
  p->frozen = 2 * 2 * (uint64_t)cfg->vocab_size * (uint64_t)cfg->hidden_size;
  p->reserve = opts->reserve_bytes;
  p->gpu_bytes = opts->gpu_bytes;
  p->total = p->weights + p->masters + p->moments + p->grads + p->activations + p->frozen +
             p->reserve;
  p->sequences_per_step = opts->batch_size
                              ? opts->batch_size
                              : df_cu_auto_sequences(opts->world_size, opts->pcie != 0);
  if ((st = plan_attention(cfg, opts->smem_per_block, p))) return st;
  if (p->total <= p->gpu_bytes) return DFLASH_OK;
  struct {
    const char *name, *fix;
    uint64_t v;
  } terms[] = {
      {"weights", "fewer or smaller layers", p->weights},
      {"master weights", "more GPUs with ZeRO-1", p->masters},
      {"AdamW moments", "more GPUs with ZeRO-1", p->moments},
      {"gradients", "fewer or smaller layers", p->grads},
      {"activations", "fewer anchors or a shorter sequence", p->activations},
      {"frozen embedding + LM head", "a GPU with more memory", p->frozen},
  };
  size_t big = 0;
  for (size_t i = 1; i < DF_ARRAY_LEN(terms); i++)
    if (terms[i].v > terms[big].v) big = i;
  return df_error(DFLASH_E_NOMEM,
                  "training plan does not fit: %.2f GiB per GPU needed, %.2f "
                  "GiB available; the largest term is %s (%.2f GiB): try %s",
                  gib(p->total), gib(p->gpu_bytes), terms[big].name, gib(terms[big].v),
                  terms[big].fix);
}

/* The plan is computed at the library's size, then written up to the caller's. */
dflash_status dflash_train_plan_compute(const dflash_drafter_config *cfg,
                                        const dflash_train_plan_options *opts,
                                        dflash_train_plan *p) {
  DF_CHECK_ARG(cfg && opts && p);
  dflash_train_plan q = {.struct_size = sizeof q};
  dflash_status st = df_opts_out(p, &q, sizeof q, "dflash_train_plan");
  if (st) return st;
  st = plan_fill(cfg, opts, &q);
  dflash_status out = df_opts_out(p, &q, sizeof q, "dflash_train_plan");
  return st ? st : out;
}
