/* The CUDA runtime and cuBLAS calls of gpu_bench.c, apart: gpu_bench_cuda.c is C and
 * C++ alike, so the emulated device (whose headers are C++) builds it through
 * gpu_bench_emu.cpp and the real one as C. */
#ifndef DFLASH_TESTS_GPU_BENCH_CUDA_H
#define DFLASH_TESTS_GPU_BENCH_CUDA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* bf16 GEMM rate of this GPU with fp32 accumulation (TFLOP/s): n x 2n x n, best of 20. */
double gb_cublas_tflops(int n);
/* One GEMM as cuda/model.cu's gemm() issues it (row-major C[M,N] = A[M,K] B[N,K]^T, bf16
 * operands, bf16 or fp32 C, beta 0 or 1): best of `reps` after a warm-up, in ms; < 0 on
 * an error. */
double gb_time_gemm(int M, int N, int K, int c32, float beta, int reps);
/* Device memory free and total (bytes). */
void gb_mem_info(size_t *free_bytes, size_t *total_bytes);

#ifdef __cplusplus
}
#endif

#endif
