// The optimizer side of the CUDA model (the twin of src/train/backend_cpu.c): zeroing and
// scaling the gradients, the step (reduce-scatter, norm and clip on the device, AdamW on
// this rank's ZeRO-1 shard, the weights' all-gather) and the copies to and from the host.
#include <algorithm>
#include <utility>

#include "model.cuh"

using namespace dfcu;

namespace {

float *shard_buf(df_cu_model *m, int kind) {
  return kind == DF_CU_PARAMS ? m->master : kind == DF_CU_M1 ? m->m1 : m->m2;
}

using muon_mat = df_cu_model::muon_mat;

// Cut the flat range [lo, hi) at the Muon matrices: f(matrix or nullptr, start, end) for each
// piece in order, stopping at the first failure.
template <class F>
dflash_status muon_pieces(const df_cu_model *m, size_t lo, size_t hi, F f) {
  auto it = std::partition_point(m->muon.begin(), m->muon.end(),
                                 [lo](const muon_mat &k) { return k.off + k.n <= lo; });
  for (size_t at = lo; at < hi;) {
    if (it == m->muon.end() || it->off >= hi) return f(nullptr, at, hi);
    if (it->off > at) DF_TRY(f(nullptr, at, it->off));
    size_t e = std::min(hi, it->off + it->n);
    DF_TRY(f(&*it, std::max(at, it->off), e));
    at = e;
    ++it;
  }
  return DFLASH_OK;
}

// fp32 operands on the tensor cores: cuBLAS rounds A and B to TF32 (10 mantissa bits) and
// accumulates (and adds beta C) in fp32. TF32 rather than bf16 (torch's Muon): at half the
// bf16 peak it already puts Newton-Schulz well under the rest of the step (bench/gpu_model.py
// --optimizer muon), with 8x finer input rounding and no bf16 copies of X and its Gram matrix.
#define DF_SGEMM(ta, tb, M, N, K, al, A, lda, B, ldb, be, C, ldc)                                \
  DF_BLAS(cublasGemmEx(m->blas, ta, tb, M, N, K, al, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb, be, \
                       C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT))

// Newton-Schulz on the update of matrix k in ns_x (row-major [rows, cols], as optim_muon.c;
// the products in TF32, DF_SGEMM): the Frobenius normalisation, then DF_MUON_NS_STEPS of X = a X + (b G + c G^2) X with
// G = X X^T on the smaller side; a tall matrix (rows > cols) takes the same steps as
// X = a X + X (b A + c A^2) with A = X^T X instead of being transposed. cuBLAS is column-major:
// it sees the row-major buffer as X^T, so the products below are those transposed. *out gets
// the buffer that holds the result (ns_x or ns_y).
dflash_status newton_schulz(df_cu_model *m, const muon_mat &k, float **out) {
  const cublasOperation_t N = CUBLAS_OP_N, T = CUBLAS_OP_T;
  const float one = 1.0f, zero = 0.0f, a = DF_MUON_NS_A, b = DF_MUON_NS_B, c3 = DF_MUON_NS_C;
  bool tall = k.rows > k.cols;
  int r = tall ? k.cols : k.rows, c = tall ? k.rows : k.cols;
  size_t rr = 4 * (size_t)r * (size_t)r;
  float *x = m->ns_x, *y = m->ns_y, *g = m->ns_g, *gg = m->ns_gg;
  DF_TRY(k_sumsq(m->st, x, k.n, m->sumsq_part, m->ns_ss));
  DF_TRY(k_muon_normalize(m->st, x, k.n, m->ns_ss, DF_MUON_NS_EPS));
  for (int s = 0; s < DF_MUON_NS_STEPS; s++) {
    // wide: the buffer is Z = X^T [c, r] (ld c), G = Z^T Z; tall: Z = X^T [r, c] (ld r), A = Z Z^T
    if (tall) DF_SGEMM(N, T, r, r, c, &one, x, r, x, r, &zero, g, r);
    else DF_SGEMM(T, N, r, r, c, &one, x, c, x, c, &zero, g, r);
    DF_CU(cudaMemcpyAsync(gg, g, rr, cudaMemcpyDeviceToDevice, m->st));
    DF_SGEMM(N, N, r, r, r, &c3, g, r, g, r, &b, gg, r); // symmetric: the same in either order
    DF_CU(cudaMemcpyAsync(y, x, 4 * k.n, cudaMemcpyDeviceToDevice, m->st));
    // wide: Z' = a Z + Z P (X' = a X + P X); tall: Z' = a Z + P Z (X' = a X + X P)
    if (tall) DF_SGEMM(N, N, r, c, r, &one, gg, r, x, r, &a, y, r);
    else DF_SGEMM(N, N, c, r, r, &one, x, c, gg, r, &a, y, c);
    std::swap(x, y);
  }
  *out = x;
  return DFLASH_OK;
}
#undef DF_SGEMM

// The step of matrix k, whose orthogonalised update is o: on this rank's slices of the
// buckets it spans (from bucket b, the one it ends in, towards lower offsets).
dflash_status muon_apply_matrix(df_cu_model *m, const df_cu_adam *a, const muon_mat &k,
                                const float *o, size_t b) {
  float step = (float)(a->lr * k.lr_scale);
  for (; b < m->buckets.n_buckets; b++) {
    const df_bucket *bk = &m->buckets.buckets[b];
    if (bk->offset + bk->count <= k.off) break;
    size_t off, len;
    slice(m, b, &off, &len);
    size_t s = std::max(off, k.off), e = std::min(off + len, k.off + k.n);
    if (s < e)
      DF_TRY(k_muon_apply(m->st, m->master + bk->shard_offset + (s - off), m->w16 + s,
                          o + (s - k.off), e - s, m->clip, a->muon_decay, step));
  }
  return DFLASH_OK;
}

// Whether this rank orthogonalises matrix k: its owner, or every rank without a communicator.
bool muon_owner(const df_cu_model *m, const muon_mat &k) {
#ifdef DFLASH_HAVE_NCCL
  if (m->comm) return k.owner == m->rank;
#endif
  (void)m;
  (void)k;
  return true;
}

// The owner's orthogonalised update o of matrix k into o on every rank (in place: on the other
// ranks o is ns_x, which they left untouched); the step then reads the same bits everywhere.
dflash_status muon_share(df_cu_model *m, const muon_mat &k, float *o) {
#ifdef DFLASH_HAVE_NCCL
  if (!m->comm) return DFLASH_OK;
  ncclResult_t r = ncclBroadcast(o, o, k.n, ncclFloat, k.owner, m->comm, m->st);
  if (r != ncclSuccess)
    return df_error(DFLASH_E_CUDA, "NCCL broadcast of Muon's matrix at %zu from rank %d: %s", k.off,
                    k.owner, ncclGetErrorString(r));
#endif
  (void)m;
  (void)k;
  (void)o;
  return DFLASH_OK;
}

// Muon on the Muon matrices, AdamW on the rest, bucket by bucket in flat order (bucket
// nb - 1 starts at 0). On this rank's slice: the momentum writes each matrix's update into
// the staging buffer at the slice's place in the bucket (the rest gets AdamW); the staging
// buffer is all-gathered in place, so every rank holds the bucket's updates, which are copied
// into ns_x at their place in the matrix (on its owner rank); a matrix complete there takes
// Newton-Schulz on its owner, is broadcast from it, and takes its step on every rank. (tmp
// is free here: uploads use it on this stream, and the reduce-scatters of the bf16 path on
// comm_st finished before the optimizer, which waited for them.)
dflash_status muon_step(df_cu_model *m, const df_cu_adam *a) {
  if (m->muon.empty())
    return df_error(DFLASH_E_STATE, "CUDA: a Muon step on a model created without Muon matrices");
  for (size_t b = m->buckets.n_buckets; b-- > 0;) {
    const df_bucket *bk = &m->buckets.buckets[b];
    size_t off, len, sh = bk->shard_offset;
    slice(m, b, &off, &len);
    bool muon = false;
    DF_TRY(muon_pieces(m, off, off + len, [&](const muon_mat *k, size_t s, size_t e) {
      size_t i = sh + (s - off);
      if (!k)
        return k_adamw(m->st, m->master + i, m->w16 + s, m->grads + s, m->m1 + i, m->m2 + i, e - s,
                       m->clip, a->decay, a->b1, a->b2, a->eps, a->step_size, a->bc2_sqrt);
      return k_muon_momentum(m->st, m->m1 + i, m->tmp + (s - bk->offset), m->grads + s, e - s,
                             m->clip, a->muon_mu);
    }));
    DF_TRY(k_scale_clipped(m->st, m->grads + off, m->clip, len));
    DF_TRY(
        muon_pieces(m, bk->offset, bk->offset + bk->count, [&](const muon_mat *k, size_t, size_t) {
          muon = muon || k;
          return DFLASH_OK;
        }));
    if (!muon) continue;
#ifdef DFLASH_HAVE_NCCL
    if (m->comm) {
      ncclResult_t r = ncclAllGather(m->tmp + (off - bk->offset), m->tmp, len, ncclFloat, m->comm,
                                     m->st);
      if (r != ncclSuccess)
        return df_error(DFLASH_E_CUDA, "NCCL all-gather of Muon's update in bucket %zu: %s", b,
                        ncclGetErrorString(r));
    }
#endif
    DF_TRY(muon_pieces(m, bk->offset, bk->offset + bk->count,
                       [&](const muon_mat *k, size_t s, size_t e) -> dflash_status {
                         if (!k) return DFLASH_OK;
                         bool mine = muon_owner(m, *k);
                         if (mine)
                           DF_CU(cudaMemcpyAsync(m->ns_x + (s - k->off), m->tmp + (s - bk->offset),
                                                 4 * (e - s), cudaMemcpyDeviceToDevice, m->st));
                         if (e < k->off + k->n) return DFLASH_OK; // continues in the next bucket
                         float *o = m->ns_x;
                         if (mine) DF_TRY(newton_schulz(m, *k, &o));
                         DF_TRY(muon_share(m, *k, o));
                         return muon_apply_matrix(m, a, *k, o, b);
                       }));
  }
  return DFLASH_OK;
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
  // AdamW (and Muon) read the factor on the device, and change nothing for a non-finite norm.
  if (a->muon) DF_TRY(muon_step(m, a));
  for (size_t b = 0; !a->muon && b < nb; b++) {
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
