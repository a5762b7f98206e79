// The optimizer side of the CUDA model (the twin of src/train/backend_cpu.c): zeroing and
// scaling the gradients, the step (reduce-scatter, norm and clip on the device, AdamW on
// this rank's ZeRO-1 shard, the weights' all-gather) and the copies to and from the host.
#include "model.cuh"

using namespace dfcu;

namespace {

float *shard_buf(df_cu_model *m, int kind) {
  return kind == DF_CU_PARAMS ? m->master : kind == DF_CU_M1 ? m->m1 : m->m2;
}

} // namespace

extern "C" dflash_status df_cu_zero_grad(df_cu_model *m) {
  DF_TRY(use_device(m));
  m->grads_sharded = false;
  m->pending_bwd = false; // what it would add is cleared anyway
  DF_CU(cudaMemsetAsync(m->grads, 0, 4 * m->buckets.n_padded, m->st));
  return DFLASH_OK;
}

extern "C" dflash_status df_cu_scale_grads(df_cu_model *m, double k) {
  DF_TRY(use_device(m));
  DF_TRY(flush_backward(m));
  return k_scale(m->st, m->grads, (float)k, m->buckets.n_padded);
}

extern "C" dflash_status df_cu_step_result(df_cu_model *m, double *norm) {
  DF_TRY(use_device(m));
  if (!m->step_pending)
    return df_error(DFLASH_E_STATE, "CUDA: no optimizer step is waiting for its result");
  m->step_pending = false;
  // The step only, not the sequences enqueued after it.
  DF_TRY(wait_on(m, m->st, "the optimizer step (NCCL reduce-scatter, all-reduce, all-gather)",
                 m->ev_step));
  if (norm) *norm = m->clip_pin->norm;
  if (!m->clip_pin->finite)
    return df_error(DFLASH_E_RANGE, "gradient norm is not finite; parameters left unchanged");
  return DFLASH_OK;
}

extern "C" dflash_status df_cu_step(df_cu_model *m, const df_cu_adam *a, double *norm) {
  DF_TRY(use_device(m));
  size_t nb = m->buckets.n_buckets;
  if (nb > 4096) return df_error(DFLASH_E_INTERNAL, "%zu gradient buckets", nb);
  DF_TRY(comm_usable(m));
  if (m->step_pending) DF_TRY(df_cu_step_result(m, nullptr)); // one outstanding at a time
  bool deferred = m->pending_bwd;
  m->pending_bwd = false;
  if (deferred && overlapping(m)) {
    // The last sequence's backward, each bucket reduce-scattered on comm_st as soon as the
    // backward has finished it (the same scaling and sums as below, bit for bit); the
    // optimizer waits for the last one.
    rs_issuer rs{0, a->grad_factor != 1.0, (float)a->grad_factor};
    DF_TRY(model_backward(m, &rs));
    DF_CU(cudaEventRecord(m->ev_comm, m->comm_st));
    DF_CU(cudaStreamWaitEvent(m->st, m->ev_comm, 0));
    // A waiting step drains the stream that runs the collectives here, for a dead peer's
    // timeout (so on the emulator a bucket issued without its event reads unfinished
    // gradients); one that does not wait relies on the event alone (df_cu_step_result then
    // waits on st, which has waited for comm_st).
    if (norm) DF_TRY(wait_on(m, m->comm_st, "NCCL gradient reduce-scatter (overlapped)"));
  } else {
    if (deferred) DF_TRY(model_backward(m, nullptr));
    if (a->grad_factor != 1.0)
      DF_TRY(k_scale(m->st, m->grads, (float)a->grad_factor, m->buckets.n_padded));
    for (size_t b = 0; joined(m) && b < nb; b++) DF_TRY(reduce_scatter(m, b, m->st));
  }
  m->grads_sharded = m->world > 1;
  // The norm and the clip factor on the device: sum of squares per bucket slice, their sum
  // in bucket order, summed over ranks, then sqrt and the factor (kernels.cu norm_clip).
  for (size_t b = 0; b < nb; b++) {
    size_t off, len;
    slice(m, b, &off, &len);
    DF_TRY(k_sumsq(m->st, m->grads + off, len, m->sumsq_part, m->sumsq_out + b));
  }
  DF_TRY(k_norm_sum(m->st, m->sumsq_out, (int)nb, m->clip));
#ifdef DFLASH_HAVE_NCCL
  if (m->comm) {
    ncclResult_t r = ncclAllReduce(&m->clip->ss, &m->clip->ss, 1, ncclDouble, ncclSum, m->comm,
                                   m->st);
    if (r != ncclSuccess)
      return df_error(DFLASH_E_CUDA, "NCCL all-reduce of the gradient norm: %s",
                      ncclGetErrorString(r));
  }
#endif
  DF_TRY(k_norm_clip(m->st, m->clip, a->clip));
  DF_CU(cudaMemcpyAsync(m->clip_pin, m->clip, sizeof *m->clip, cudaMemcpyDeviceToHost, m->st));
  // AdamW reads the factor on the device, and changes nothing for a non-finite norm.
  for (size_t b = 0; b < nb; b++) {
    size_t off, len, sh = m->buckets.buckets[b].shard_offset;
    slice(m, b, &off, &len);
    DF_TRY(k_adamw(m->st, m->master + sh, m->w16 + off, m->grads + off, m->m1 + sh, m->m2 + sh, len,
                   m->clip, a->decay, a->b1, a->b2, a->eps, a->step_size, a->bc2_sqrt));
    DF_TRY(k_scale_clipped(m->st, m->grads + off, m->clip, len));
  }
#ifdef DFLASH_HAVE_NCCL
  for (size_t b = 0; m->comm && b < nb; b++) {
    size_t off, len;
    slice(m, b, &off, &len);
    ncclResult_t r = ncclAllGather(m->w16 + off, m->w16 + m->buckets.buckets[b].offset, len,
                                   ncclBfloat16, m->comm, m->st);
    if (r != ncclSuccess)
      return df_error(DFLASH_E_CUDA, "NCCL all-gather of bucket %zu: %s", b, ncclGetErrorString(r));
  }
#endif
  DF_CU(cudaEventRecord(m->ev_step, m->st));
  m->step_pending = true;
  if (!norm) return DFLASH_OK; // the caller asks df_cu_step_result later
  DF_TRY(wait_stream(m, "NCCL all-gather of the updated weights"));
  return df_cu_step_result(m, norm);
}

extern "C" dflash_status df_cu_copy(df_cu_model *m, int kind, float *host, int to_host) {
  DF_TRY(use_device(m));
  DF_TRY(flush_backward(m)); // it reads the weights and writes the gradients
  size_t n = m->c.n_params;
  if (kind == DF_CU_GRADS) {
    // On m->st, after the work that wrote or reads them (zero_grad, the backward, a step).
    if (to_host && m->grads_sharded) DF_TRY(gather_grads(m));
    if (!to_host) m->grads_sharded = false;
    DF_CU(to_host ? cudaMemcpyAsync(host, m->grads, 4 * n, cudaMemcpyDeviceToHost, m->st)
                  : cudaMemcpyAsync(m->grads, host, 4 * n, cudaMemcpyHostToDevice, m->st));
    DF_CU(cudaStreamSynchronize(m->st));
    return DFLASH_OK;
  }
  float *sb = shard_buf(m, kind);
  if (to_host && m->world > 1) DF_TRY(comm_usable(m));
  for (size_t b = 0; b < m->buckets.n_buckets; b++) {
    const df_bucket *k = &m->buckets.buckets[b];
    size_t off, len;
    slice(m, b, &off, &len);
    if (to_host) {
      // Gather every rank's slice of this bucket, then keep the unpadded part.
      float *dst = m->tmp;
      if (m->world == 1)
        DF_CU(cudaMemcpyAsync(dst, sb + k->shard_offset, 4 * len, cudaMemcpyDeviceToDevice, m->st));
#ifdef DFLASH_HAVE_NCCL
      else {
        ncclResult_t r = ncclAllGather(sb + k->shard_offset, dst, len, ncclFloat, m->comm, m->st);
        if (r != ncclSuccess)
          return df_error(DFLASH_E_CUDA, "NCCL all-gather: %s", ncclGetErrorString(r));
      }
#endif
      size_t keep = k->offset >= n ? 0 : (n - k->offset < k->count ? n - k->offset : k->count);
      if (host) // NULL: this rank only takes part in the gather
        DF_CU(cudaMemcpyAsync(host + k->offset, dst, 4 * keep, cudaMemcpyDeviceToHost, m->st));
      DF_TRY(wait_stream(m, "NCCL all-gather of optimizer shards"));
    } else {
      size_t keep = off >= n ? 0 : (n - off < len ? n - off : len);
      DF_CU(cudaMemsetAsync(sb + k->shard_offset, 0, 4 * len, m->st));
      DF_CU(cudaMemcpyAsync(sb + k->shard_offset, host + off, 4 * keep, cudaMemcpyHostToDevice,
                            m->st));
    }
  }
  if (!to_host && kind == DF_CU_PARAMS) {
    DF_CU(cudaMemsetAsync(m->w16, 0, 2 * m->buckets.n_padded, m->st));
    DF_TRY(upload_bf16(m, m->w16, host, n));
  }
  DF_CU(cudaStreamSynchronize(m->st));
  return DFLASH_OK;
}
