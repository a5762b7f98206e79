// Raw tensor-core and asynchronous-copy instructions for the CUDA kernels: mma.sync m16n8k16
// (bf16 in, fp32 accumulate), ldmatrix, cp.async with commit / wait groups, bf16x2 packing.
// Inline PTX under nvcc (sm_80 and later: sm_90, sm_100 and sm_120 all have them); on the
// emulated device (cuda/emu/mma_sync.cpp, fiber.cpp) the same instructions with the PTX
// ISA's fragment layouts, warp convergence checked, cp.async destinations poisoned until
// waited for.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16; g = lane / 4, t = lane % 4):
//   A (16 x 16, row-major) uint32_t a[4]: a[0] row g, columns 2t, 2t + 1; a[1] row g + 8;
//     a[2] row g, columns + 8; a[3] row g + 8, columns + 8.
//   B (16 x 8, k x n) uint32_t b[2]: b[0] k = 2t, 2t + 1 of column n = g; b[1] k + 8.
//   C, D (16 x 8) float c[4]: c[0], c[1] row g, columns 2t, 2t + 1; c[2], c[3] row g + 8.
//   A .b32 holds the lower column (k) in its low 16 bits.
//   ldmatrix: lanes 8j..8j+7 give the row addresses of 8x8 matrix j (16 bytes each, 16-byte
//   aligned, shared memory); r[j] of lane l is row l / 4, columns 2 (l % 4), + 1 (.trans:
//   of the transposed matrix).
#pragma once
#include "common.cuh"

#ifdef DFLASH_CUDA_EMU
__device__ __forceinline__ void tc_mma(float (&d)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[2], const float (&c)[4]) {
  ::dfemu::mma_m16n8k16_bf16(d, a, b, c);
}
template <int NMAT, bool TRANS>
__device__ __forceinline__ void tc_ldmatrix(uint32_t (&r)[NMAT], const void *row) {
  static_assert(NMAT == 1 || NMAT == 2 || NMAT == 4, "ldmatrix .x1, .x2 or .x4");
  ::dfemu::ldmatrix(r, NMAT, TRANS, row);
}
__device__ __forceinline__ void tc_cp_async16(void *dst, const void *src) {
  ::dfemu::cp_async(dst, src, 16);
}
__device__ __forceinline__ void tc_cp_commit() { ::dfemu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void tc_cp_wait() {
  ::dfemu::cp_async_wait(N);
}
// cvt.rn.bf16x2.f32 d, hi, lo: `lo` in the low half.
__device__ __forceinline__ uint32_t tc_pack(float lo, float hi) {
  return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
         (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16;
}
#else
__device__ __forceinline__ void tc_mma(float (&d)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[2], const float (&c)[4]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
               "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
                 "f"(c[1]), "f"(c[2]), "f"(c[3]));
}
template <int NMAT, bool TRANS>
__device__ __forceinline__ void tc_ldmatrix(uint32_t (&r)[NMAT], const void *row) {
  static_assert(NMAT == 1 || NMAT == 2 || NMAT == 4, "ldmatrix .x1, .x2 or .x4");
  unsigned at = (unsigned)__cvta_generic_to_shared(row);
  if constexpr (NMAT == 1 && !TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(at));
  else if constexpr (NMAT == 1)
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0])
                 : "r"(at));
  else if constexpr (NMAT == 2 && !TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(at));
  else if constexpr (NMAT == 2)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(at));
  else if constexpr (!TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}
__device__ __forceinline__ void tc_cp_async16(void *dst, const void *src) {
  unsigned at = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(at), "l"(src));
}
__device__ __forceinline__ void tc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void tc_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ uint32_t tc_pack(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif
