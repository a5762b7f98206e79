// The emulated cuBLAS: cublasGemmEx (and cublasSgemm) with cuBLAS's own argument checks, run
// in stream order. The arguments are checked as the cuBLAS documentation states (sizes not
// negative; lda >= max(1, rows of A as stored), ldb likewise, ldc >= max(1, m); supported
// type combinations), so a wrong leading dimension or transpose is CUBLAS_STATUS_INVALID_VALUE
// as on the hardware. Beyond cuBLAS, every operand's extent is checked against the live
// device allocations of the handle's device (the hardware would read out of bounds or fault
// later): a message and CUBLAS_STATUS_EXECUTION_FAILED.
//
// Arithmetic: bf16 (or fp32) inputs widened to fp32 exactly, products summed in fp32 (by
// OpenBLAS's sgemm: the order of the sum is not the tensor cores'), alpha and beta applied
// in fp32, the result rounded to the output type to nearest even. With beta == 0, C is not
// read (NaN there does not propagate), as BLAS defines.
#include <cblas.h>

#include <cstdio>
#include <vector>

#include "include/cublas_v2.h"
#include "internal.h"

namespace dfemu {
struct BlasHandle {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasPointerMode_t pointer_mode = CUBLAS_POINTER_MODE_HOST;
};
} // namespace dfemu

using namespace dfemu;

namespace {
std::mutex g_handle_mu;
std::vector<BlasHandle *> g_handles;

bool live(cublasHandle_t h) {
  std::lock_guard<std::mutex> g(g_handle_mu);
  for (auto *x : g_handles)
    if (x == h) return true;
  return false;
}

size_t type_size(cudaDataType_t t) {
  switch (t) {
  case CUDA_R_32F: return 4;
  case CUDA_R_16BF: return 2;
  default: return 0;
  }
}
const char *type_name(cudaDataType_t t) {
  switch (t) {
  case CUDA_R_32F: return "CUDA_R_32F";
  case CUDA_R_64F: return "CUDA_R_64F";
  case CUDA_R_16F: return "CUDA_R_16F";
  case CUDA_R_16BF: return "CUDA_R_16BF";
  case CUDA_R_8I: return "CUDA_R_8I";
  case CUDA_R_32I: return "CUDA_R_32I";
  case CUDA_R_8F_E4M3: return "CUDA_R_8F_E4M3";
  }
  return "?";
}

float load(const void *p, cudaDataType_t t, size_t i) {
  if (t == CUDA_R_32F) return ((const float *)p)[i];
  return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
}
void store(void *p, cudaDataType_t t, size_t i, float v) {
  if (t == CUDA_R_32F) ((float *)p)[i] = v;
  else ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
}
// Round fp32 to the input precision of a reduced-precision compute type.
float narrow(float v, cublasComputeType_t ct) {
  if (ct == CUBLAS_COMPUTE_32F_FAST_16BF) return __bfloat162float(__float2bfloat16_rn(v));
  if (ct == CUBLAS_COMPUTE_32F_FAST_TF32) { // tf32: 10 mantissa bits, nearest even
    uint32_t u;
    std::memcpy(&u, &v, 4);
    if ((u & 0x7fffffffu) <= 0x7f800000u) u = (u + 0xfffu + ((u >> 13) & 1u)) & ~0x1fffu;
    std::memcpy(&v, &u, 4);
  }
  return v;
}

struct GemmOp : Op {
  cublasOperation_t ta, tb;
  int m, n, k, lda, ldb, ldc;
  float alpha, beta;
  const float *alpha_dev = nullptr, *beta_dev = nullptr;
  const void *A, *B;
  void *C;
  cudaDataType_t at, bt, ct;
  cublasComputeType_t comp;
  bool step() override {
    if (alpha_dev) alpha = *alpha_dev;
    if (beta_dev) beta = *beta_dev;
    // op(A) as a packed column-major m x k, op(B) as k x n: widened to fp32.
    std::vector<float> a((size_t)m * k), b((size_t)k * n), c((size_t)m * n);
    for (int p = 0; p < k; p++)
      for (int i = 0; i < m; i++)
        a[(size_t)p * m + i] =
            narrow(load(A, at, ta == CUBLAS_OP_N ? (size_t)p * lda + i : (size_t)i * lda + p),
                   comp);
    for (int j = 0; j < n; j++)
      for (int p = 0; p < k; p++)
        b[(size_t)j * k + p] =
            narrow(load(B, bt, tb == CUBLAS_OP_N ? (size_t)j * ldb + p : (size_t)p * ldb + j),
                   comp);
    if (k > 0)
      cblas_sgemm(CblasColMajor, CblasNoTrans, CblasNoTrans, m, n, k, alpha, a.data(), m, b.data(),
                  k, 0.0f, c.data(), m);
    for (int j = 0; j < n; j++)
      for (int i = 0; i < m; i++) {
        size_t o = (size_t)j * ldc + i;
        float v = c[(size_t)j * m + i];
        if (beta != 0.0f) v += beta * load(C, ct, o);
        store(C, ct, o, v);
      }
    return true;
  }
};

// Extent in elements of a column-major rows x cols matrix with leading dimension ld.
size_t extent(int rows, int cols, int ld) {
  return rows && cols ? (size_t)(cols - 1) * ld + rows : 0;
}
} // namespace

cublasStatus_t cublasCreate(cublasHandle_t *handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  int n = 0;
  if (cudaGetDeviceCount(&n) || !n) {
    cudaGetLastError();
    return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  auto *h = new BlasHandle();
  h->device = current_device();
  std::lock_guard<std::mutex> g(g_handle_mu);
  g_handles.push_back(h);
  *handle = h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t h) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  Stream *s = resolve(h->stream);
  if (s) drain(s, 0, true); // cublasDestroy synchronises
  std::lock_guard<std::mutex> g(g_handle_mu);
  for (size_t i = 0; i < g_handles.size(); i++)
    if (g_handles[i] == h) g_handles.erase(g_handles.begin() + (long)i);
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t stream) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  Stream *s = resolve(stream);
  if (!s) {
    report("cublasSetStream: %p is not a live stream", (void *)stream);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  h->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t h, cudaStream_t *stream) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!stream) return CUBLAS_STATUS_INVALID_VALUE;
  *stream = h->stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode(cublasHandle_t h, cublasPointerMode_t mode) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (mode != CUBLAS_POINTER_MODE_HOST && mode != CUBLAS_POINTER_MODE_DEVICE)
    return CUBLAS_STATUS_INVALID_VALUE;
  h->pointer_mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t mode) {
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  (void)mode;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t transa, cublasOperation_t transb,
                            int m, int n, int k, const void *alpha, const void *A,
                            cudaDataType_t Atype, int lda, const void *B, cudaDataType_t Btype,
                            int ldb, const void *beta, void *C, cudaDataType_t Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
  (void)algo;
  if (!live(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
  auto bad = [](cublasOperation_t t) {
    return t != CUBLAS_OP_N && t != CUBLAS_OP_T && t != CUBLAS_OP_C;
  };
  int rows_a = transa == CUBLAS_OP_N ? m : k, cols_a = transa == CUBLAS_OP_N ? k : m;
  int rows_b = transb == CUBLAS_OP_N ? k : n, cols_b = transb == CUBLAS_OP_N ? n : k;
  if (bad(transa) || bad(transb) || m < 0 || n < 0 || k < 0 || lda < (rows_a > 1 ? rows_a : 1) ||
      ldb < (rows_b > 1 ? rows_b : 1) || ldc < (m > 1 ? m : 1) || !alpha || !beta) {
    report("cublasGemmEx: CUBLAS_STATUS_INVALID_VALUE: op %c%c m %d n %d k %d lda %d (needs >= "
           "%d) ldb %d (needs >= %d) ldc %d (needs >= %d)",
           "NTC"[transa % 3], "NTC"[transb % 3], m, n, k, lda, rows_a > 1 ? rows_a : 1, ldb,
           rows_b > 1 ? rows_b : 1, ldc, m > 1 ? m : 1);
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  bool types_ok = Atype == Btype &&
                  ((Atype == CUDA_R_16BF && (Ctype == CUDA_R_16BF || Ctype == CUDA_R_32F)) ||
                   (Atype == CUDA_R_32F && Ctype == CUDA_R_32F));
  bool compute_ok = computeType == CUBLAS_COMPUTE_32F ||
                    computeType == CUBLAS_COMPUTE_32F_PEDANTIC ||
                    (Atype == CUDA_R_32F && (computeType == CUBLAS_COMPUTE_32F_FAST_16BF ||
                                             computeType == CUBLAS_COMPUTE_32F_FAST_TF32));
  if (!types_ok || !compute_ok) {
    report("cublasGemmEx: CUBLAS_STATUS_NOT_SUPPORTED: A %s, B %s, C %s, compute type %d",
           type_name(Atype), type_name(Btype), type_name(Ctype), (int)computeType);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (!m || !n) return CUBLAS_STATUS_SUCCESS;
  Stream *s = resolve(h->stream);
  if (!s) {
    report("cublasGemmEx: the handle's stream %p was destroyed", (void *)h->stream);
    return CUBLAS_STATUS_EXECUTION_FAILED;
  }
  size_t ea = extent(rows_a, cols_a, lda) * type_size(Atype),
         eb = extent(rows_b, cols_b, ldb) * type_size(Btype),
         ec = extent(m, n, ldc) * type_size(Ctype);
  if ((ea && !check_device(A, ea, h->device, "cublasGemmEx", "A")) ||
      (eb && !check_device(B, eb, h->device, "cublasGemmEx", "B")) ||
      !check_device(C, ec, h->device, "cublasGemmEx", "C"))
    return CUBLAS_STATUS_EXECUTION_FAILED;
  auto *op = new GemmOp();
  op->ta = transa, op->tb = transb, op->m = m, op->n = n, op->k = k;
  op->lda = lda, op->ldb = ldb, op->ldc = ldc;
  op->A = A, op->B = B, op->C = C, op->at = Atype, op->bt = Btype, op->ct = Ctype;
  op->comp = computeType;
  if (h->pointer_mode == CUBLAS_POINTER_MODE_DEVICE) {
    if (!check_device(alpha, 4, h->device, "cublasGemmEx", "alpha") ||
        !check_device(beta, 4, h->device, "cublasGemmEx", "beta")) {
      delete op;
      return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    op->alpha_dev = (const float *)alpha, op->beta_dev = (const float *)beta;
  } else {
    op->alpha = *(const float *)alpha, op->beta = *(const float *)beta;
  }
  enqueue(s, std::unique_ptr<Op>(op));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t transa, cublasOperation_t transb,
                           int m, int n, int k, const float *alpha, const float *A, int lda,
                           const float *B, int ldb, const float *beta, float *C, int ldc) {
  return cublasGemmEx(h, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb,
                      beta, C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}
