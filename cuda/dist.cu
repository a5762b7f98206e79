// NCCL for the CUDA model (the twin of src/train/cuda/dist.c): the waits that give up on a dead
// peer, the gradient buckets' reduce-scatter (overlapped with the backward, issue_ready),
// the gathers, the communicator, and the all-reduce of host scalars.
#include "model.cuh"

using namespace dfcu;

namespace dfcu {

// Wait for the stream. With NCCL, a peer that died leaves the collective
// kernels spinning for ever, so give up after the collective timeout (or on
// NCCL's own asynchronous error): abort the communicator and fail, naming
// `what`; the model refuses collectives from then on.
// (With an event, what the stream had reached when it was recorded.)
dflash_status wait_on(df_cu_model *m, cudaStream_t s, const char *what, cudaEvent_t ev) {
#ifdef DFLASH_HAVE_NCCL
  if (m->comm) {
    auto start = std::chrono::steady_clock::now();
    for (;;) {
      cudaError_t e = ev ? cudaEventQuery(ev) : cudaStreamQuery(s);
      if (e == cudaSuccess) return DFLASH_OK;
      if (e != cudaErrorNotReady)
        return df_error(DFLASH_E_CUDA, "rank %d: %s: %s", m->rank, what, cudaGetErrorString(e));
      ncclResult_t ae = ncclSuccess;
      ncclCommGetAsyncError(m->comm, &ae);
      double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if ((ae != ncclSuccess && ae != ncclInProgress) || waited > m->comm_timeout) {
        ncclCommAbort(m->comm);
        m->comm = nullptr;
        m->comm_failed = true;
        if (ae != ncclSuccess && ae != ncclInProgress)
          return df_error(DFLASH_E_CUDA, "rank %d: %s: NCCL: %s", m->rank, what,
                          ncclGetErrorString(ae));
        return df_error(DFLASH_E_TIMEOUT,
                        "rank %d: %s did not finish within %.0f s: a peer rank "
                        "died or hangs (the trainer option dist_timeout_s waits longer)",
                        m->rank, what, m->comm_timeout);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
#endif
  if (m->comm_failed)
    return df_error(DFLASH_E_STATE, "rank %d: %s: NCCL was aborted after an earlier failure",
                    m->rank, what);
  DF_CU(ev ? cudaEventSynchronize(ev) : cudaStreamSynchronize(s));
  return DFLASH_OK;
}
dflash_status wait_stream(df_cu_model *m, const char *what) { return wait_on(m, m->st, what); }

// Collectives need the communicator that an earlier failure may have aborted.
dflash_status comm_usable(const df_cu_model *m) {
  if (!m->comm_failed) return DFLASH_OK;
  return df_error(DFLASH_E_STATE,
                  "rank %d: NCCL was aborted after an earlier failure; the run "
                  "cannot continue",
                  m->rank);
}

// The reduce-scatter overlaps the backward: several ranks joined over NCCL (and not turned
// off, df_cu_config.no_overlap).
bool joined(const df_cu_model *m) {
#ifdef DFLASH_HAVE_NCCL
  return m->comm != nullptr;
#else
  (void)m;
  return false;
#endif
}
bool overlapping(const df_cu_model *m) { return m->overlap && joined(m); }

// This rank's slice of bucket b: flat offset and length.
void slice(const df_cu_model *m, size_t b, size_t *off, size_t *len) {
  const df_bucket *k = &m->buckets.buckets[b];
  *len = k->count / (size_t)m->world;
  *off = k->offset + (size_t)m->rank * *len;
}

// Reduce-scatter bucket b in place on stream s: this rank's slice gets the sum. With rs_bf16
// through the fp32 staging buffer m->tmp as bf16 (kBucketElems floats hold any bucket twice
// over; nothing else uses it during a step): rounded, reduced in place there, and this
// rank's slice widened back into the gradients.
dflash_status reduce_scatter(df_cu_model *m, size_t b, cudaStream_t s) {
#ifdef DFLASH_HAVE_NCCL
  size_t off, len;
  slice(m, b, &off, &len);
  const df_bucket *k = &m->buckets.buckets[b];
  ncclResult_t r;
  if (m->c.rs_bf16) {
    bf16 *x = (bf16 *)m->tmp, *mine = x + (size_t)m->rank * len;
    DF_TRY(k_f32_to_bf16(s, x, m->grads + k->offset, k->count));
    r = ncclReduceScatter(x, mine, len, ncclBfloat16, ncclSum, m->comm, s);
    if (r == ncclSuccess) DF_TRY(k_bf16_to_f32(s, m->grads + off, mine, len));
  } else {
    r = ncclReduceScatter(m->grads + k->offset, m->grads + off, len, ncclFloat, ncclSum, m->comm,
                          s);
  }
  if (r != ncclSuccess)
    return df_error(DFLASH_E_CUDA, "NCCL reduce-scatter of bucket %zu: %s", b,
                    ncclGetErrorString(r));
#else
  (void)m, (void)b, (void)s;
#endif
  return DFLASH_OK;
}

// Every bucket whose gradients are all final (at or above flat offset `done`) to the
// communication stream, behind one event recorded on the compute stream now, i.e. after
// the dW GEMMs that wrote them; the compute stream meanwhile runs on.
dflash_status issue_ready(df_cu_model *m, rs_issuer *rs, size_t done) {
  if (!rs || rs->next >= m->buckets.n_buckets || m->buckets.buckets[rs->next].offset < done)
    return DFLASH_OK;
  DF_CU(cudaEventRecord(m->ev_ready, m->st));
  DF_CU(cudaStreamWaitEvent(m->comm_st, m->ev_ready, 0));
  for (; rs->next < m->buckets.n_buckets && m->buckets.buckets[rs->next].offset >= done;
       rs->next++) {
    const df_bucket *k = &m->buckets.buckets[rs->next];
    if (rs->scale) DF_TRY(k_scale(m->comm_st, m->grads + k->offset, rs->factor, k->count));
    DF_TRY(reduce_scatter(m, rs->next, m->comm_st));
  }
  return DFLASH_OK;
}

// Every rank's reduced slices of the gradients into every rank's buffer, in place
// (collective): what get_grad returns after a step over several ranks.
dflash_status gather_grads(df_cu_model *m) {
#ifdef DFLASH_HAVE_NCCL
  DF_TRY(comm_usable(m));
  for (size_t b = 0; m->comm && b < m->buckets.n_buckets; b++) {
    size_t off, len;
    slice(m, b, &off, &len);
    ncclResult_t r = ncclAllGather(m->grads + off, m->grads + m->buckets.buckets[b].offset, len,
                                   ncclFloat, m->comm, m->st);
    if (r != ncclSuccess)
      return df_error(DFLASH_E_CUDA, "NCCL all-gather of gradient bucket %zu: %s", b,
                      ncclGetErrorString(r));
  }
  DF_TRY(wait_stream(m, "NCCL all-gather of the reduced gradients"));
#endif
  m->grads_sharded = false;
  return DFLASH_OK;
}

} // namespace dfcu

extern "C" dflash_status df_cu_allreduce_host(df_cu_model *m, double *x, int n) {
  DF_TRY(use_device(m));
#ifdef DFLASH_HAVE_NCCL
  DF_TRY(comm_usable(m));
  if (!m->comm || n <= 0) return DFLASH_OK;
  double *d = m->sumsq_out;
  if (n > 4096) return df_error(DFLASH_E_INTERNAL, "all-reduce of %d doubles", n);
  DF_CU(cudaMemcpyAsync(d, x, 8 * (size_t)n, cudaMemcpyHostToDevice, m->st));
  ncclResult_t r = ncclAllReduce(d, d, (size_t)n, ncclDouble, ncclSum, m->comm, m->st);
  if (r != ncclSuccess)
    return df_error(DFLASH_E_CUDA, "NCCL all-reduce: %s", ncclGetErrorString(r));
  DF_CU(cudaMemcpyAsync(x, d, 8 * (size_t)n, cudaMemcpyDeviceToHost, m->st));
  DF_TRY(wait_stream(m, "NCCL all-reduce of host scalars"));
#else
  (void)m, (void)x, (void)n;
#endif
  return DFLASH_OK;
}

extern "C" dflash_status df_cu_nccl_unique_id(void *id) {
#ifdef DFLASH_HAVE_NCCL
  static_assert(sizeof(ncclUniqueId) == DF_CU_NCCL_ID_BYTES, "NCCL id size");
  ncclResult_t r = ncclGetUniqueId((ncclUniqueId *)id);
  if (r != ncclSuccess)
    return df_error(DFLASH_E_CUDA, "ncclGetUniqueId: %s", ncclGetErrorString(r));
  return DFLASH_OK;
#else
  (void)id;
  return df_error(DFLASH_E_UNSUPPORTED, "libdflash was built without NCCL");
#endif
}

extern "C" dflash_status df_cu_nccl_init(df_cu_model *m, int rank, int world, const void *id,
                                         double timeout_s) {
#ifdef DFLASH_HAVE_NCCL
  DF_TRY(use_device(m));
  // The buffers were laid out for this rank at create: the communicator must agree.
  if (rank != m->rank || world != m->world)
    return df_error(DFLASH_E_STATE,
                    "NCCL: joining as rank %d of %d, but the CUDA model was "
                    "created for rank %d of %d",
                    rank, world, m->rank, m->world);
  m->comm_timeout = timeout_s;
  ncclUniqueId uid;
  memcpy(&uid, id, sizeof uid);
  ncclResult_t r = ncclCommInitRank(&m->comm, world, uid, rank);
  if (r != ncclSuccess)
    return df_error(DFLASH_E_CUDA, "ncclCommInitRank (rank %d of %d): %s", rank, world,
                    ncclGetErrorString(r));
  return DFLASH_OK;
#else
  (void)m, (void)rank, (void)world, (void)id, (void)timeout_s;
  return df_error(DFLASH_E_UNSUPPORTED, "libdflash was built without NCCL");
#endif
}
