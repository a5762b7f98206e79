/* gpu_bench's CUDA calls (gpu_bench_cuda.h): C that also compiles as C++. */
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "gpu_bench_cuda.h"

/* Event time of one GEMM on the legacy stream, in ms (< 0 on an error). */
static double gemm_ms(cublasHandle_t h, int M, int N, int K, const void *A, const void *B, void *C,
                      int c32, float beta) {
  cudaEvent_t e0, e1;
  float one = 1.0f, ms = -1.0f;
  if (cudaEventCreate(&e0) != cudaSuccess) return -1;
  if (cudaEventCreate(&e1) != cudaSuccess) return cudaEventDestroy(e0), -1;
  cudaEventRecord(e0, 0);
  cublasStatus_t st = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, K, A,
                                   CUDA_R_16BF, K, &beta, C, c32 ? CUDA_R_32F : CUDA_R_16BF, N,
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  cudaEventRecord(e1, 0);
  if (cudaEventSynchronize(e1) != cudaSuccess || cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess)
    ms = -1.0f;
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  return st == CUBLAS_STATUS_SUCCESS ? ms : -1.0;
}

double gb_time_gemm(int M, int N, int K, int c32, float beta, int reps) {
  void *A = NULL, *B = NULL, *C = NULL;
  size_t cb = c32 ? 4 : 2;
  double best = -1;
  cublasHandle_t h;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) return -1;
  if (cudaMalloc(&A, 2 * (size_t)M * K) == cudaSuccess &&
      cudaMalloc(&B, 2 * (size_t)N * K) == cudaSuccess &&
      cudaMalloc(&C, cb * (size_t)M * N) == cudaSuccess) {
    /* 0x3c3c: bf16 ~0.0115, so sums stay finite */
    cudaMemset(A, 0x3c, 2 * (size_t)M * K), cudaMemset(B, 0x3c, 2 * (size_t)N * K);
    cudaMemset(C, 0, cb * (size_t)M * N);
    for (int i = 0; i <= reps; i++) {
      double ms = gemm_ms(h, M, N, K, A, B, C, c32, beta);
      if (ms < 0) {
        best = -1;
        break;
      }
      if (i > 0 && (best < 0 || ms < best)) best = ms;
    }
  }
  cudaFree(A), cudaFree(B), cudaFree(C);
  cublasDestroy(h);
  return best;
}

double gb_cublas_tflops(int n) {
  double ms = gb_time_gemm(2 * n, n, n, 0, 0.0f, 20);
  return ms > 0 ? 2.0 * n * 2.0 * n * n / (ms * 1e-3) / 1e12 : 0.0;
}

void gb_mem_info(size_t *free_bytes, size_t *total_bytes) {
  *free_bytes = *total_bytes = 0;
  cudaMemGetInfo(free_bytes, total_bytes);
}
