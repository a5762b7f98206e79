// The CUDA model's device memory (the twin of the CPU side's arena and create): allocation
// with the live/peak count, the activation arena and RoPE tables grown as sequences need,
// the pinned double-buffered upload of a sequence, df_cu_create in its parts, and the frees.
#include <algorithm>

#include "model.cuh"

using namespace dfcu;

namespace dfcu {

dflash_status dalloc(df_cu_model *m, void **p, size_t bytes, const char *what) {
  cudaError_t e = cudaMalloc(p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    size_t fr = 0, tot = 0;
    cudaMemGetInfo(&fr, &tot);
    return df_error(DFLASH_E_NOMEM,
                    "CUDA: cannot allocate %.2f GiB for %s (%.2f GiB free of "
                    "%.2f GiB): %s",
                    bytes / 1073741824.0, what, fr / 1073741824.0, tot / 1073741824.0,
                    cudaGetErrorString(e));
  }
  m->live += bytes;
  if (m->live > m->peak) m->peak = m->live;
  return DFLASH_OK;
}

// The current device is per host thread: every entry point makes the model's device current,
// since a caller may use the trainer from another thread than the one that created it (whose
// device may be 0 while this rank's is LOCAL_RANK).
dflash_status use_device(const df_cu_model *m) {
  cudaError_t e = cudaSetDevice(m->c.device);
  if (e != cudaSuccess)
    return df_error(DFLASH_E_CUDA, "CUDA: cannot make device %d current: %s", m->c.device,
                    cudaGetErrorString(e));
  return DFLASH_OK;
}

// Upload `n` floats from the host as bf16 through the staging buffer.
dflash_status upload_bf16(df_cu_model *m, bf16 *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n; i += kBucketElems) {
    size_t k = n - i < kBucketElems ? n - i : kBucketElems;
    DF_CU(cudaMemcpyAsync(m->tmp, src + i, 4 * k, cudaMemcpyHostToDevice, m->st));
    DF_TRY(k_f32_to_bf16(m->st, dst + i, m->tmp, k));
  }
  DF_CU(cudaStreamSynchronize(m->st));
  return DFLASH_OK;
}

} // namespace dfcu

namespace {

dflash_status ensure_rope(df_cu_model *m, int n_pos) {
  if (n_pos <= m->n_pos) return DFLASH_OK;
  int half = m->c.rot / 2;
  if (m->cos_t) cudaFree(m->cos_t), cudaFree(m->sin_t), cudaFree(m->iota);
  m->live -= (size_t)m->n_pos * (2 * half * 4 + 4);
  m->cos_t = m->sin_t = nullptr;
  m->iota = nullptr;
  m->n_pos = 0;
  DF_TRY(dalloc(m, &m->cos_t, (size_t)n_pos * half, "RoPE tables"));
  DF_TRY(dalloc(m, &m->sin_t, (size_t)n_pos * half, "RoPE tables"));
  DF_TRY(dalloc(m, &m->iota, (size_t)n_pos, "positions"));
  DF_TRY(k_rope_table(m->st, m->cos_t, m->sin_t, m->inv_freq, m->c.attn_factor, n_pos, half));
  std::vector<int32_t> io((size_t)n_pos);
  for (int i = 0; i < n_pos; i++) io[(size_t)i] = i;
  DF_CU(cudaMemcpyAsync(m->iota, io.data(), io.size() * 4, cudaMemcpyHostToDevice, m->st));
  DF_CU(cudaStreamSynchronize(m->st));
  m->n_pos = n_pos;
  return DFLASH_OK;
}

dflash_status ensure_arena(df_cu_model *m, const df_cu_batch *b) {
  df_act_dims d = {m->c.H, m->c.KH, m->c.nh, m->c.nkv,
                   m->c.d, m->c.I,  m->c.L,  b->T,
                   b->Sc,  b->R,    b->A,    m->c.vocab_chunk < m->c.V ? m->c.vocab_chunk : m->c.V};
  df_act_layout lay;
  df_act_layout_compute(&d, &lay);
  if (lay.total > m->arena_bytes) {
    if (m->arena) cudaFree(m->arena), m->live -= m->arena_bytes;
    m->arena = nullptr;
    m->arena_bytes = 0;
    DF_TRY(dalloc(m, &m->arena, lay.total, "activations (one sequence)"));
    m->arena_bytes = lay.total;
  }
  m->lay = lay;
  m->T = b->T, m->Sc = b->Sc, m->R = b->R, m->A = b->A;
  return DFLASH_OK;
}

dflash_status upload(df_cu_model *m, void *dst, const void *src, size_t bytes) {
  if (bytes) DF_CU(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, m->st));
  return DFLASH_OK;
}

size_t align_up(size_t n) { return (n + 255) & ~(size_t)255; }

// Each stage big enough for this sequence (growing waits: cudaFree and cudaFreeHost wait for
// the device; it happens while sequences grow, not per sequence).
dflash_status grow_stage(df_cu_model *m, df_cu_model::stage &s, size_t pin, size_t dev) {
  if (pin > s.pin_cap) {
    if (s.pin) cudaFreeHost(s.pin);
    s.pin = nullptr;
    s.pin_cap = 0;
    if (cudaMallocHost((void **)&s.pin, pin) != cudaSuccess)
      return df_error(DFLASH_E_NOMEM,
                      "CUDA: cannot allocate %.2f MiB of pinned host memory "
                      "for the context rows' staging",
                      pin / 1048576.0);
    s.pin_cap = pin;
  }
  if (dev > s.dev_cap) {
    if (s.dev) cudaFree(s.dev), m->live -= s.dev_cap;
    s.dev = nullptr;
    s.dev_cap = 0;
    DF_TRY(dalloc(m, &s.dev, dev, "context rows as stored (staging)"));
    s.dev_cap = dev;
  }
  return DFLASH_OK;
}

// Append `bytes` from `src` at *off of the stage's pinned buffer; its address in *at.
const void *stage_put(char *pin, size_t *off, const void *src, size_t bytes) {
  char *at = pin + *off;
  if (bytes) memcpy(at, src, bytes);
  *off += bytes;
  return at;
}

// The context rows as stored: dtype, codes, scales and their byte sizes.
struct stored_rows {
  int dtype;
  const void *codes;
  const float *scales;
  size_t n, code_bytes, scale_bytes;
};

dflash_status stored_of(const df_cu_model *m, const df_cu_batch *b, stored_rows *r) {
  r->dtype = b->hidden_codes ? b->hidden_dtype : DF_CU_HIDDEN_BF16;
  r->codes = b->hidden_codes ? b->hidden_codes : b->hidden;
  r->scales = b->hidden_scales;
  r->n = (size_t)b->Sc * m->c.KH;
  if (r->dtype != DF_CU_HIDDEN_BF16 && r->dtype != DF_CU_HIDDEN_FP8 && r->dtype != DF_CU_HIDDEN_F32)
    return df_error(DFLASH_E_INVALID_ARG, "CUDA: hidden states of unknown dtype %d", r->dtype);
  if (r->n && (!r->codes || (r->dtype == DF_CU_HIDDEN_FP8 && !r->scales)))
    return df_error(DFLASH_E_INVALID_ARG, "CUDA: %s",
                    r->codes ? "fp8 hidden states without "
                               "their scales"
                             : "no hidden states");
  r->code_bytes = r->n * (r->dtype == DF_CU_HIDDEN_FP8 ? 1 : r->dtype == DF_CU_HIDDEN_F32 ? 4 : 2);
  r->scale_bytes = r->dtype == DF_CU_HIDDEN_FP8 ? 4 * (size_t)b->Sc * (m->c.KH / m->c.H) : 0;
  return DFLASH_OK;
}

} // namespace

namespace dfcu {

// One sequence to the device without waiting for the one before (see df_cu_model::stage):
// the small per-row arrays from the pinned stage on st (the arena is the previous sequence's
// until st reaches them), the context rows as stored on copy_st, then decoded and checked on
// st; *bad (device) gets the lowest non-finite index, or ~0.
dflash_status upload_batch(df_cu_model *m, const df_cu_batch *b, unsigned long long *bad) {
  DF_TRY(ensure_rope(m, b->max_pos));
  DF_TRY(ensure_arena(m, b));
  stored_rows r{};
  DF_TRY(stored_of(m, b, &r));
  size_t small = 4 * ((size_t)b->A + (size_t)b->T + 2 * (size_t)b->R) +
                 (b->coef ? 4 * (size_t)b->R : 0);
  size_t dev_off = align_up(small), codes_off = align_up(r.scale_bytes);
  size_t dev_bytes = codes_off + r.code_bytes;
  df_cu_model::stage &s = m->stages[m->next_stage];
  m->next_stage ^= 1;
  // Its last readers are two sequences back (the previous sequence uses the other stage).
  if (s.armed) DF_CU(cudaEventSynchronize(s.used));
  DF_TRY(grow_stage(m, s, dev_off + dev_bytes, dev_bytes));
  size_t off = 0;
  const void *anchors = stage_put(s.pin, &off, b->anchors, 4 * (size_t)b->A);
  const void *tok = stage_put(s.pin, &off, b->block_tok, 4 * (size_t)b->T);
  const void *rows = stage_put(s.pin, &off, b->rows_t, 4 * (size_t)b->R);
  const void *target = stage_put(s.pin, &off, b->rows_target, 4 * (size_t)b->R);
  const void *coef = b->coef ? stage_put(s.pin, &off, b->coef, 4 * (size_t)b->R) : nullptr;
  off = dev_off;
  stage_put(s.pin, &off, r.scales, r.scale_bytes);
  off = dev_off + codes_off;
  stage_put(s.pin, &off, r.codes, r.code_bytes);
  if (s.armed) DF_CU(cudaStreamWaitEvent(m->copy_st, s.used, 0));
  if (dev_bytes)
    DF_CU(cudaMemcpyAsync(s.dev, s.pin + dev_off, dev_bytes, cudaMemcpyHostToDevice, m->copy_st));
  DF_CU(cudaEventRecord(s.copied, m->copy_st));
  // Tests poison the arena (0xff bytes: bf16/f32 NaN) so a read of anything
  // this call did not write shows up in the outputs.
  static const char *poison = getenv("DFLASH_CUDA_POISON");
  if (poison && *poison == '1') DF_CU(cudaMemsetAsync(m->arena, 0xff, m->lay.total, m->st));
  if (m->df2) DF_TRY(df2_reserve(m->df2, m->st, b->T, b->R, poison && *poison == '1'));
  int32_t *dtok = act<int32_t>(m, DF_ACT_TOK), *ri = act<int32_t>(m, DF_ACT_ROW_I32);
  DF_TRY(upload(m, act<int32_t>(m, DF_ACT_ANCHORS), anchors, 4 * (size_t)b->A));
  DF_TRY(upload(m, dtok, tok, 4 * (size_t)b->T));
  DF_TRY(upload(m, ri, rows, 4 * (size_t)b->R));
  DF_TRY(upload(m, ri + b->R, target, 4 * (size_t)b->R));
  if (coef)
    DF_TRY(upload(m, act<float>(m, DF_ACT_ROW_F32) + 3 * (size_t)b->R, coef, 4 * (size_t)b->R));
  DF_CU(cudaMemsetAsync(bad, 0xff, sizeof *bad, m->st));
  DF_CU(cudaStreamWaitEvent(m->st, s.copied, 0));
  DF_TRY(k_hidden_decode(m->st, act<bf16>(m, DF_ACT_HIDDEN), s.dev + codes_off,
                         (const float *)s.dev, r.dtype, r.n, m->c.H, bad));
  DF_CU(cudaEventRecord(s.used, m->st));
  s.armed = true;
  DF_TRY(k_positions(m->st, dtok + b->T, act<int32_t>(m, DF_ACT_ANCHORS), b->A, m->c.B));
  return DFLASH_OK;
}

} // namespace dfcu

namespace {

// The device current, and the attention's tiles checked against its shared memory per block:
// a shape whose attention (forward or backward) does not fit is refused here rather than at
// the first backward.
dflash_status open_device(const df_cu_config *c) {
  cudaError_t e = cudaSetDevice(c->device);
  if (e != cudaSuccess)
    return df_error(DFLASH_E_NO_DEVICE, "CUDA: cannot use device %d: %s", c->device,
                    cudaGetErrorString(e));
  df_attn_dev shape{0, c->B, 0, c->nh, c->nkv, c->d, 0, nullptr, 0.0f};
  return k_attention_check(&shape);
}

dflash_status create_streams(df_cu_model *m) {
  if (cudaStreamCreateWithFlags(&m->st, cudaStreamNonBlocking) != cudaSuccess ||
      cudaStreamCreateWithFlags(&m->comm_st, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreateWithFlags(&m->ev_ready, cudaEventDisableTiming) != cudaSuccess ||
      cudaEventCreateWithFlags(&m->ev_comm, cudaEventDisableTiming) != cudaSuccess ||
      cudaEventCreateWithFlags(&m->ev_step, cudaEventDisableTiming) != cudaSuccess ||
      cudaStreamCreateWithFlags(&m->copy_st, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreateWithFlags(&m->stages[0].copied, cudaEventDisableTiming) != cudaSuccess ||
      cudaEventCreateWithFlags(&m->stages[0].used, cudaEventDisableTiming) != cudaSuccess ||
      cudaEventCreateWithFlags(&m->stages[1].copied, cudaEventDisableTiming) != cudaSuccess ||
      cudaEventCreateWithFlags(&m->stages[1].used, cudaEventDisableTiming) != cudaSuccess ||
      cublasCreate(&m->blas) != CUBLAS_STATUS_SUCCESS ||
      cublasSetStream(m->blas, m->st) != CUBLAS_STATUS_SUCCESS)
    return df_error(DFLASH_E_CUDA, "CUDA: cannot create the streams, events and cuBLAS handle");
  return DFLASH_OK;
}

// This rank's place: rank and world, the gradient buckets, whether the reduce-scatter
// overlaps the backward, and from[] (the lowest offset final after each tensor).
dflash_status place_rank(df_cu_model *m, const df_cu_config *c) {
  // Created as this rank's ZeRO-1 shard: no full fp32 masters and moments, on the device
  // or the host, ever exist (df_cu_nccl_init only joins the communicator).
  m->world = c->world > 1 ? c->world : 1;
  m->rank = c->rank;
  if (m->rank < 0 || m->rank >= m->world)
    return df_error(DFLASH_E_INVALID_ARG, "CUDA: rank %d of %d", c->rank, m->world);
  if (c->bucket_elems > kBucketElems)
    return df_error(DFLASH_E_INVALID_ARG, "CUDA: gradient buckets of %zu elements (at most %zu)",
                    c->bucket_elems, kBucketElems);
  DF_TRY(df_bucket_layout_init(&m->buckets, c->n_params, m->world,
                               c->bucket_elems ? c->bucket_elems : kBucketElems));
  // DFlash 2's gradients (after norm.weight in the table) are not final when the backward
  // passes their offsets, which the overlapped reduce-scatter assumes: after the backward.
  m->overlap = m->world > 1 && !c->no_overlap && !c->dflash2;
  if (c->dflash2) DF_TRY(df2_create(c, &m->df2));
  m->from.assign(m->offsets.size() + 1, c->n_params);
  for (size_t i = m->offsets.size(); i-- > 0;)
    m->from[i] = m->offsets[i] < m->from[i + 1] ? m->offsets[i] : m->from[i + 1];
  return DFLASH_OK;
}

// Each Muon matrix's owner, the one rank that runs its Newton-Schulz: the matrices by
// decreasing FLOPs (ties in offset order), each to the least loaded rank (ties to the lowest),
// so that every rank computes the same deterministic assignment from the same table.
void assign_muon_owners(df_cu_model *m) {
  std::vector<size_t> order(m->muon.size());
  std::vector<double> cost(m->muon.size()), load((size_t)m->world, 0.0);
  for (size_t i = 0; i < order.size(); i++) {
    const df_cu_model::muon_mat &k = m->muon[i];
    double r = k.rows < k.cols ? k.rows : k.cols, c = k.rows < k.cols ? k.cols : k.rows;
    cost[i] = 4 * r * r * c + 2 * r * r * r; // one iteration's FLOPs, as gpu_model.py
    order[i] = i;
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  for (size_t i : order) {
    size_t least = (size_t)(std::min_element(load.begin(), load.end()) - load.begin());
    m->muon[i].owner = (int)least;
    load[least] += cost[i];
  }
}

// Muon's matrices, checked against the parameters and sorted by offset, and its workspace
// (train/cuda/dfcuda.h's df_cu_muon_scratch_bytes counts it); nothing without Muon.
dflash_status alloc_muon(df_cu_model *m, const df_cu_config *c) {
  size_t max_n = 0, max_gram = 0;
  for (size_t i = 0; i < c->n_muon; i++) {
    const df_cu_muon_mat *k = &c->muon[i];
    if (k->rows < 2 || k->cols < 2 || k->rows > INT32_MAX || k->cols > INT32_MAX ||
        (size_t)k->rows > c->n_params / (size_t)k->cols || k->offset > c->n_params ||
        (size_t)(k->rows * k->cols) > c->n_params - k->offset)
      return df_error(DFLASH_E_INVALID_ARG,
                      "CUDA: Muon matrix %zu [%lld, %lld] at %zu is not a "
                      "matrix inside the %zu parameters",
                      i, (long long)k->rows, (long long)k->cols, k->offset, c->n_params);
    size_t n = (size_t)(k->rows * k->cols), r = (size_t)(k->rows < k->cols ? k->rows : k->cols);
    m->muon.push_back({k->offset, n, (int)k->rows, (int)k->cols, k->lr_scale, 0});
    max_n = n > max_n ? n : max_n;
    max_gram = r * r > max_gram ? r * r : max_gram;
  }
  std::sort(m->muon.begin(), m->muon.end(),
            [](const df_cu_model::muon_mat &a, const df_cu_model::muon_mat &b) {
              return a.off < b.off;
            });
  for (size_t i = 1; i < m->muon.size(); i++)
    if (m->muon[i - 1].off + m->muon[i - 1].n > m->muon[i].off)
      return df_error(DFLASH_E_INVALID_ARG, "CUDA: Muon matrices at %zu and %zu overlap",
                      m->muon[i - 1].off, m->muon[i].off);
  assign_muon_owners(m);
  if (!max_n) return DFLASH_OK;
  DF_TRY(dalloc(m, &m->ns_x, max_n, "Muon workspace"));
  DF_TRY(dalloc(m, &m->ns_y, max_n, "Muon workspace"));
  DF_TRY(dalloc(m, &m->ns_g, max_gram, "Muon workspace"));
  DF_TRY(dalloc(m, &m->ns_gg, max_gram, "Muon workspace"));
  DF_TRY(dalloc(m, &m->ns_ss, 1, "Muon workspace"));
  return DFLASH_OK;
}

// The weights, gradients, this rank's shard of masters and moments, the frozen tables and the
// fixed scratch (train/cuda/dfcuda.h's df_cu_fixed_scratch_bytes counts it for the plan).
dflash_status alloc_state(df_cu_model *m, const df_cu_config *c) {
  size_t np = m->buckets.n_padded, vh = (size_t)c->V * c->H;
  DF_TRY(dalloc(m, &m->w16, np, "bf16 weights"));
  DF_TRY(dalloc(m, &m->grads, np, "fp32 gradients"));
  DF_TRY(dalloc(m, &m->master, m->buckets.shard_len, "fp32 master weights"));
  DF_TRY(dalloc(m, &m->m1, m->buckets.shard_len, "AdamW moments"));
  DF_TRY(dalloc(m, &m->m2, m->buckets.shard_len, "AdamW moments"));
  DF_TRY(dalloc(m, &m->embed, vh, "frozen embedding"));
  DF_TRY(dalloc(m, &m->head, vh, "frozen LM head"));
  DF_TRY(dalloc(m, &m->tmp, kBucketElems, "staging"));
  DF_TRY(dalloc(m, &m->inv_freq, (size_t)m->c.rot / 2, "RoPE frequencies"));
  DF_TRY(dalloc(m, &m->dw_scratch, k_rmsnorm_backward_dw_scratch(c->H > c->d ? c->H : c->d),
                "norm scratch"));
  DF_TRY(dalloc(m, &m->sumsq_part, 1024 + 4096, "norm scratch"));
  m->sumsq_out = m->sumsq_part + 1024;
  DF_TRY(dalloc(m, &m->pend_loss, kPending, "per-sequence losses"));
  DF_TRY(dalloc(m, &m->pend_bad, kPending + 1, "per-sequence NaN/Inf checks"));
  DF_TRY(dalloc(m, &m->clip, 1, "gradient norm and clip factor"));
  if (cudaMallocHost((void **)&m->clip_pin, sizeof *m->clip_pin) != cudaSuccess)
    return df_error(DFLASH_E_NOMEM, "CUDA: cannot allocate pinned memory for the gradient norm");
  if (c->pos_weight) DF_TRY(dalloc(m, &m->wtab, (size_t)c->B, "position weights"));
  int Vd = m->c.draft_vocab;
  if (c->dspark && Vd < c->V) { // pruned: the drafter's own head (df_cu_set_draft_vocab)
    DF_TRY(dalloc(m, &m->dsp.kept, (size_t)Vd, "DSpark kept ids"));
    DF_TRY(dalloc(m, &m->dsp.head, (size_t)Vd * c->H, "DSpark draft LM head"));
  }
  return alloc_muon(m, c);
}

// The position weights, RoPE frequencies, frozen tables and weights up; gradients and
// moments zero.
dflash_status upload_state(df_cu_model *m, const df_cu_config *c, const float *params,
                           const float *embed, const float *lm_head) {
  size_t vh = (size_t)c->V * c->H;
  // Every copy and memset goes on m->st: the stream is non-blocking, so work on the legacy
  // stream (cudaMemcpy, cudaMemset) would be neither waited for nor ordered before it.
  if (c->pos_weight && cudaMemcpyAsync(m->wtab, c->pos_weight, 4 * (size_t)c->B,
                                       cudaMemcpyHostToDevice, m->st) != cudaSuccess)
    return df_error(DFLASH_E_CUDA, "CUDA: cannot upload the position weights");
  if (cudaMemcpyAsync(m->inv_freq, c->inv_freq, sizeof(double) * (m->c.rot / 2),
                      cudaMemcpyHostToDevice, m->st) != cudaSuccess)
    return df_error(DFLASH_E_CUDA, "CUDA: cannot upload RoPE frequencies");
  DF_TRY(upload_bf16(m, m->embed, embed, vh));
  DF_TRY(upload_bf16(m, m->head, lm_head, vh));
  DF_TRY(df_cu_copy(m, DF_CU_PARAMS, (float *)params, 0));
  DF_TRY(df_cu_zero_grad(m));
  if (cudaMemsetAsync(m->m1, 0, 4 * m->buckets.shard_len, m->st) != cudaSuccess ||
      cudaMemsetAsync(m->m2, 0, 4 * m->buckets.shard_len, m->st) != cudaSuccess ||
      cudaStreamSynchronize(m->st) != cudaSuccess)
    return df_error(DFLASH_E_CUDA, "CUDA: cannot clear the AdamW moments");
  return DFLASH_OK;
}

} // namespace

extern "C" dflash_status df_cu_create(const df_cu_config *c, const float *params,
                                      const float *embed, const float *lm_head, df_cu_model **out) {
  *out = nullptr;
  df_cu_model *m = new (std::nothrow) df_cu_model();
  if (!m) return df_error(DFLASH_E_NOMEM, "CUDA model");
  m->c = *c;
  if (m->c.rot <= 0) m->c.rot = m->c.d; // no partial_rotary_factor: whole heads
  if (m->c.draft_vocab <= 0 || m->c.draft_vocab > m->c.V || !m->c.dspark) m->c.draft_vocab = m->c.V;
  m->offsets.assign(c->offsets, c->offsets + c->n_tensors);
  m->c.offsets = nullptr; // the caller's arrays: copied or uploaded here, not kept
  m->c.inv_freq = nullptr;
  m->c.pos_weight = nullptr;
  m->c.muon = nullptr;
  dflash_status st = open_device(c);
  if (!st) st = create_streams(m);
  if (!st) st = place_rank(m, c);
  if (!st) st = alloc_state(m, c);
  if (!st) st = upload_state(m, c, params, embed, lm_head);
  if (st) {
    df_cu_free(m);
    return st;
  }
  *out = m;
  return DFLASH_OK;
}

extern "C" dflash_status df_cu_set_draft_vocab(df_cu_model *m, const int32_t *kept) {
  DF_TRY(use_device(m));
  int Vd = m->c.draft_vocab;
  if (!m->dsp.kept)
    return df_error(DFLASH_E_STATE,
                    "CUDA: draft vocabulary set on a drafter that is not a "
                    "pruned DSpark one (draft vocabulary %d of %d)",
                    Vd, m->c.V);
  // Checked on the host (df_draft_vocab_check) before it gets here; a bad id would read
  // outside the head.
  for (int i = 0; i < Vd; i++)
    if (kept[i] < 0 || kept[i] >= m->c.V)
      return df_error(DFLASH_E_RANGE, "CUDA: kept id %d at %d is outside [0, %d)", kept[i], i,
                      m->c.V);
  DF_CU(cudaMemcpyAsync(m->dsp.kept, kept, 4 * (size_t)Vd, cudaMemcpyHostToDevice, m->st));
  DF_TRY(k_gather_rows(m->st, m->dsp.head, m->head, m->dsp.kept, Vd, m->c.H));
  return wait_stream(m, "the draft vocabulary's LM head rows");
}

extern "C" void df_cu_free(df_cu_model *m) {
  if (!m) return;
  cudaSetDevice(m->c.device); // the frees and destroys below act on it
  if (m->st) cudaStreamSynchronize(m->st);
  if (m->comm_st) cudaStreamSynchronize(m->comm_st);
  if (m->copy_st) cudaStreamSynchronize(m->copy_st);
  void *bufs[] = {m->w16,       m->embed,    m->head,          m->grads,         m->master,
                  m->m1,        m->m2,       m->tmp,           m->inv_freq,      m->sumsq_part,
                  m->cos_t,     m->sin_t,    m->dw_scratch,    m->best,          m->iota,
                  m->best_i,    m->arena,    m->stages[0].dev, m->stages[1].dev, m->wtab,
                  m->pend_loss, m->pend_bad, m->clip,          m->ns_x,          m->ns_y,
                  m->ns_g,      m->ns_gg,    m->ns_ss,         m->dsp.prev,      m->dsp.xt,
                  m->dsp.e,     m->dsp.dz,   m->dsp.z,         m->dsp.zt,        m->dsp.de,
                  m->dsp.ds,    m->dsp.kept, m->dsp.head};
  for (void *p : bufs)
    if (p) cudaFree(p);
  df2_free(m->df2);
  if (m->clip_pin) cudaFreeHost(m->clip_pin);
  if (m->ev_step) cudaEventDestroy(m->ev_step);
  for (auto &g : m->stages) {
    if (g.pin) cudaFreeHost(g.pin);
    if (g.copied) cudaEventDestroy(g.copied);
    if (g.used) cudaEventDestroy(g.used);
  }
  if (m->copy_st) cudaStreamDestroy(m->copy_st);
#ifdef DFLASH_HAVE_NCCL
  if (m->comm) ncclCommDestroy(m->comm);
#endif
  if (m->blas) cublasDestroy(m->blas);
  if (m->ev_ready) cudaEventDestroy(m->ev_ready);
  if (m->ev_comm) cudaEventDestroy(m->ev_comm);
  if (m->comm_st) cudaStreamDestroy(m->comm_st);
  if (m->st) cudaStreamDestroy(m->st);
  df_bucket_layout_free(&m->buckets);
  delete m;
}

extern "C" void df_cu_memory(const df_cu_model *m, size_t *peak, size_t *now, size_t *arena) {
  // DFlash 2's buffers (dflash2.cu) are allocated apart from the arena.
  if (peak) *peak = m->peak + df2_bytes(m->df2);
  if (now) *now = m->live + df2_bytes(m->df2);
  if (arena) *arena = m->arena_bytes;
}

extern "C" dflash_status df_cu_host_alloc(size_t bytes, void **out) {
  DF_CU(cudaMallocHost(out, bytes ? bytes : 1));
  return DFLASH_OK;
}

extern "C" void df_cu_host_free(void *p) {
  if (p) cudaFreeHost(p);
}
