// The emulated CUDA device (cuda/emu) checked on its own: thread-order shuffling finds a
// missing barrier, warp shuffles and votes under shuffled lanes, shared-memory poison, launch
// limits, bounds-checked copies, stream order, events, cuBLAS's checks and arithmetic, NCCL
// across ranks in threads, bf16 and fp8 conversions against src/core/bf16.h, WMMA fragments
// (products, a layout-dependent read shown wrong, NaN until loaded), mma.sync / ldmatrix /
// cp.async on the PTX ISA's layouts (three routes to the fragments exact, one index off and a
// missing wait_group wrong), and (in child processes)
// the faults it aborts on, WMMA misuse among them. Suite 'cuda-emu'.
#include <sys/wait.h>
#include <unistd.h>

#include <cfloat>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <mma.h>

#include "common.cuh"
#include "tc.cuh"
#include "nccl.h"
extern "C" {
#include "core/bf16.h"
}

static int failures;
#define CHECK(cond, ...)                                     \
  do {                                                       \
    if (!(cond)) {                                           \
      failures++;                                            \
      printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      printf(__VA_ARGS__);                                   \
      printf("\n");                                          \
    }                                                        \
  } while (0)

template <typename T>
static T *dev_alloc(size_t n) {
  void *p = nullptr;
  if (cudaMalloc(&p, n * sizeof(T))) abort();
  return (T *)p;
}

// ---- kernels ------------------------------------------------------------------------------
// ---- WMMA (mma.h) ---------------------------------------------------------------------------
namespace wmma = nvcuda::wmma;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> FragA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> FragBt;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> FragC;

// C [32 x 32] = A [32 x 48] B^T (B stored [32 x 48], so col_major) + C0, one 16x16 tile of C
// per warp (4 warps), C0 loaded col-major, C stored row-major: every load/store flavour.
__global__ void wmma_gemm(float *C, const bf16 *A, const bf16 *B, const float *C0) {
  int w = threadIdx.x / 32, m0 = w / 2 * 16, n0 = w % 2 * 16;
  FragC c;
  wmma::load_matrix_sync(c, C0 + n0 * 32 + m0, 32, wmma::mem_col_major);
  for (int k0 = 0; k0 < 48; k0 += 16) {
    FragA a;
    FragBt b;
    wmma::load_matrix_sync(a, A + m0 * 48 + k0, 48);
    wmma::load_matrix_sync(b, B + n0 * 48 + k0, 48);
    wmma::mma_sync(c, a, b, c);
  }
  for (int i = 0; i < c.num_elements; i++) c.x[i] *= 2.0f; // element-wise: any mapping
  wmma::store_matrix_sync(C + m0 * 32 + n0, c, 32, wmma::mem_row_major);
}

// Reads an accumulator's x[i] as sm_80's documented-nowhere layout (row lane / 4 + 8 * (i / 2
// % 2), column lane % 4 * 2 + i % 2 + 8 * (i / 4)): code that relies on a layout.
__global__ void wmma_assumes_layout(float *out, const float *in) {
  FragC c;
  wmma::load_matrix_sync(c, in, 16, wmma::mem_row_major);
  int lane = threadIdx.x % 32;
  for (int i = 0; i < c.num_elements; i++) {
    int r = lane / 4 + 8 * (i / 2 % 2), col = lane % 4 * 2 + i % 2 + 8 * (i / 4);
    out[r * 16 + col] = c.x[i];
  }
}

__global__ void wmma_unfilled(float *out) {
  FragC c; // neither loaded nor filled
  FragA a;
  FragBt b;
  wmma::fill_fragment(a, __float2bfloat16(1.0f));
  wmma::fill_fragment(b, __float2bfloat16(1.0f));
  wmma::mma_sync(c, a, b, c);
  wmma::store_matrix_sync(out, c, 16, wmma::mem_row_major);
}

// Every thread copies the block's shared tile to out; then warp 0 overwrites the tile through
// a run of WMMA products (zeros). barrier 0 leaves out the __syncthreads between the two, the
// race only a warp that runs far ahead of the others shows (warp-sticky blocks).
__global__ void wmma_overwrite(float *out, int barrier) {
  DF_DYN_SHARED(float, sh); // [256] floats, then [256] bf16 zeros (128-byte aligned base)
  bf16 *z = (bf16 *)(sh + 256);
  int t = threadIdx.x;
  for (int i = t; i < 256; i += blockDim.x) sh[i] = (float)(blockIdx.x + i), z[i] = bf16{0};
  __syncthreads();
  for (int i = t; i < 256; i += blockDim.x) out[blockIdx.x * 256 + i] = sh[i];
  if (barrier) __syncthreads();
  if (t >= 32) return;
  FragC c;
  wmma::fill_fragment(c, 0.0f);
  for (int k = 0; k < 8; k++) {
    FragA a;
    FragBt b;
    wmma::load_matrix_sync(a, z, 16);
    wmma::load_matrix_sync(b, z, 16);
    wmma::mma_sync(c, a, b, c);
  }
  wmma::store_matrix_sync(sh, c, 16, wmma::mem_row_major);
}

// Misuse, each aborting on the emulator (and undefined on the hardware); 32 threads, out
// holds 64 floats (256-byte aligned).
__global__ void wmma_bad_ldm(float *out) {
  FragC c;
  wmma::load_matrix_sync(c, out, 18, wmma::mem_row_major); // not a multiple of 4 floats
}
__global__ void wmma_bad_align(float *out) {
  FragC c;
  wmma::load_matrix_sync(c, out + 4, 16, wmma::mem_row_major); // 16 bytes off
}
__global__ void wmma_lane_missing(float *out) {
  FragC c;
  wmma::fill_fragment(c, 0.0f);
  if (threadIdx.x % 32 < 31) wmma::store_matrix_sync(out, c, 16, wmma::mem_row_major);
}
__global__ void wmma_lanes_disagree(float *out) {
  FragC c;
  wmma::fill_fragment(c, 0.0f);
  wmma::store_matrix_sync(out + (threadIdx.x % 2) * 8, c, 16, wmma::mem_row_major);
}
__global__ void wmma_lanes_differ_in_op(float *out) {
  FragC c;
  if (threadIdx.x % 2) wmma::load_matrix_sync(c, out, 16, wmma::mem_row_major);
  else wmma::fill_fragment(c, 0.0f), wmma::store_matrix_sync(out, c, 16, wmma::mem_row_major);
}
__global__ void wmma_partial_warp(float *out) { // launched with 16 threads
  FragC c;
  wmma::fill_fragment(c, 0.0f);
  wmma::store_matrix_sync(out, c, 16, wmma::mem_row_major);
}

// ---- raw tensor-core instructions (cuda/tc.cuh: mma.sync, ldmatrix, cp.async) ----------------
// One warp: C (16 x 8) = A (16 x 32) B (32 x 8) + C0 in two k steps of m16n8k16, A and B
// brought to shared memory by cp.async. The modes reach the documented fragments by
// different routes, so a layout wrong in the emulator fails at least one of them:
//   MMA_LDSM   A row-major by ldmatrix.x4, B row-major (k x n) by ldmatrix.x2.trans
//   MMA_HAND   A, B and C0 packed by hand from global memory with the PTX ISA's formulas
//   MMA_TRANS  A^T (k x m) by ldmatrix.x4.trans, B^T (n x k) by two ldmatrix.x1
//   MMA_OFF    MMA_LDSM with one fragment index off (a[1] and a[2] swapped): must be wrong
//   MMA_NOWAIT MMA_LDSM without its cp.async.wait_group: must read poison
enum { MMA_LDSM, MMA_HAND, MMA_TRANS, MMA_OFF, MMA_NOWAIT };
__global__ void mma_gemm(float *C, const bf16 *A, const bf16 *At, const bf16 *B, const bf16 *Bt,
                         const float *C0, int mode) {
  DF_SHARED(bf16, sa, [16 * 32]); // A, or A^T [32][16]
  DF_SHARED(bf16, sb, [32 * 8]);  // B [32][8], or B^T [8][32]
  int l = threadIdx.x, g = l / 4, t = l % 4;
  const bf16 *ga = mode == MMA_TRANS ? At : A, *gb = mode == MMA_TRANS ? Bt : B;
  for (int i = l; i < 64; i += 32) tc_cp_async16(sa + i * 8, ga + i * 8);
  tc_cp_async16(sb + l * 8, gb + l * 8);
  tc_cp_commit();
  if (mode != MMA_NOWAIT) tc_cp_wait<0>();
  __syncthreads();
  float c[4];
  for (int i = 0; i < 4; i++) c[i] = C0[(g + (i >> 1) * 8) * 8 + 2 * t + (i & 1)];
  for (int ks = 0; ks < 2; ks++) {
    uint32_t a[4], b[2];
    if (mode == MMA_HAND) {
      auto at = [&](int r, int k) { return __bfloat162float(A[r * 32 + ks * 16 + k]); };
      for (int r = 0; r < 4; r++) {
        int row = g + (r & 1) * 8, col = 2 * t + (r >> 1) * 8;
        a[r] = tc_pack(at(row, col), at(row, col + 1));
      }
      for (int r = 0; r < 2; r++) {
        int k = ks * 16 + 2 * t + r * 8;
        b[r] = tc_pack(__bfloat162float(B[k * 8 + g]), __bfloat162float(B[(k + 1) * 8 + g]));
      }
    } else if (mode == MMA_TRANS) {
      // matrix j: k rows ks*16 + (j / 2) * 8 .., m columns (j % 2) * 8 .. of A^T
      int j = l / 8;
      tc_ldmatrix<4, true>(a, sa + (ks * 16 + (j / 2) * 8 + l % 8) * 16 + (j % 2) * 8);
      uint32_t b0[1], b1[1];
      tc_ldmatrix<1, false>(b0, sb + (l % 8) * 32 + ks * 16);
      tc_ldmatrix<1, false>(b1, sb + (l % 8) * 32 + ks * 16 + 8);
      b[0] = b0[0], b[1] = b1[0];
    } else {
      // matrix j: rows (j % 2) * 8 .., columns ks*16 + (j / 2) * 8 ..
      int j = l / 8;
      tc_ldmatrix<4, false>(a, sa + ((j % 2) * 8 + l % 8) * 32 + ks * 16 + (j / 2) * 8);
      tc_ldmatrix<2, true>(b, sb + (ks * 16 + l % 16) * 8);
      if (mode == MMA_OFF) std::swap(a[1], a[2]);
    }
    tc_mma(c, a, b, c);
  }
  // MMA_NOWAIT has read the poison; its copies still complete before the thread exits (a
  // thread that exits with copies in flight is a fault of its own, cp_exit_in_flight).
  if (mode == MMA_NOWAIT) tc_cp_wait<0>();
  for (int i = 0; i < 4; i++) C[(g + (i >> 1) * 8) * 8 + 2 * t + (i & 1)] = c[i];
}

// cp.async groups: two committed groups, wait_group 1 completes the first only.
__global__ void cp_groups(float *out, const bf16 *src) {
  DF_SHARED(bf16, sh, [2 * 32 * 8]);
  int l = threadIdx.x;
  tc_cp_async16(sh + l * 8, src + l * 8);
  tc_cp_commit();
  tc_cp_async16(sh + 256 + l * 8, src + 256 + l * 8);
  tc_cp_commit();
  tc_cp_wait<1>();
  out[l] = __bfloat162float(sh[l * 8]), out[32 + l] = __bfloat162float(sh[256 + l * 8]);
  tc_cp_wait<0>();
  out[64 + l] = __bfloat162float(sh[256 + l * 8]);
}

// A thread that exits with a committed cp.async never waited for (its CTA may be gone when
// the copy lands): the bug attention_backward_kv had for a context key tile no block sees.
__global__ void cp_exit_in_flight(float *out) {
  DF_SHARED(float, sh, [32 * 4]);
  int l = threadIdx.x;
  tc_cp_async16(sh + l * 4, out + l % 16 * 4);
  tc_cp_commit();
}

// Misuse the hardware would hang on or fault: one lane skips the mma, lanes at different
// ldmatrix shapes, ldmatrix from global memory.
__global__ void mma_lane_missing(float *out) {
  uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
  float c[4] = {0, 0, 0, 0};
  if (threadIdx.x != 5) tc_mma(c, a, b, c);
  out[threadIdx.x] = c[0];
}
__global__ void ldsm_lanes_differ(float *out) {
  DF_SHARED(bf16, sh, [32 * 8]);
  uint32_t r4[4], r2[2];
  if (threadIdx.x < 16) tc_ldmatrix<2, false>(r2, sh + threadIdx.x * 8);
  else tc_ldmatrix<4, false>(r4, sh + threadIdx.x * 8);
  out[threadIdx.x] = 0;
}
__global__ void ldsm_global(float *out) {
  uint32_t r[1];
  tc_ldmatrix<1, false>(r, out + (threadIdx.x % 8) * 4);
  out[threadIdx.x] = (float)r[0];
}

// A block-wide sum through a shared-memory tree: `barrier` 0 leaves out the __syncthreads
// between the levels of the tree (a classic bug).
__global__ void tree_sum(const float *x, float *out, int n, int barrier) {
  DF_SHARED(float, sh, [256]);
  int t = threadIdx.x;
  float s = 0;
  for (int i = t; i < n; i += blockDim.x) s += x[i];
  sh[t] = s;
  __syncthreads();
  for (unsigned o = blockDim.x / 2; o > 0; o >>= 1) {
    if (threadIdx.x < o) sh[t] += sh[t + o];
    if (barrier) __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = sh[0];
}

__global__ void warp_ops(const int *x, int *out) {
  int t = threadIdx.x, lane = t % 32;
  unsigned m = __activemask(); // the live lanes: 16 in the partial last warp of 80 threads
  int nl = __popc(m), v = x[t];
  int sum = v;
  for (int o = nl / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(m, sum, o);
  int down = v;
  for (unsigned o = 16; o > 0; o >>= 1) {
    int u = __shfl_down_sync(m, down, o); // undefined (poison) from lanes beyond nl: unused
    if (lane + (int)o < nl) down += u;
  }
  int bcast = __shfl_sync(m, v, 3);
  int up = __shfl_up_sync(m, v, 1);
  unsigned ballot = __ballot_sync(m, v % 3 == 0);
  int any = __any_sync(m, v > 1000), all = __all_sync(m, v >= 0);
  int w8 = v;
  for (int o = 4; o > 0; o >>= 1) w8 += __shfl_xor_sync(m, w8, o, 8);
  int beyond = __shfl_sync(m, v, 31); // lane 31 does not exist in a partial warp
  __syncwarp(m);
  int *o = out + t * 9;
  o[0] = sum, o[1] = down, o[2] = bcast, o[3] = up, o[4] = (int)ballot, o[5] = any, o[6] = all;
  o[7] = w8, o[8] = beyond;
}

// Reads shared memory it never wrote: must see the poison.
__global__ void read_unwritten(float *out) {
  DF_SHARED(float, sh, [64]);
  DF_DYN_SHARED(float, dyn);
  out[threadIdx.x] = sh[threadIdx.x];
  out[64 + threadIdx.x] = dyn[threadIdx.x];
  sh[threadIdx.x] = 1.0f, dyn[threadIdx.x] = 2.0f; // the next block must not see these
}

__global__ void fill(float *p, float v, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = v;
}

__global__ void copy_k(float *dst, const float *src, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    dst[i] = src[i];
}

__global__ void big_smem(float *out) {
  DF_DYN_SHARED(float, s);
  s[threadIdx.x] = (float)threadIdx.x;
  __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % blockDim.x];
}

// Barriers in divergent code: undefined in CUDA (a hang or a wrong result on the hardware).
__global__ void divergent_barrier(float *out) {
  if (threadIdx.x < 16) __syncthreads();
  else __syncthreads();
  out[threadIdx.x] = 1;
}
// A warp op whose mask names a lane that waits at __syncthreads instead.
__global__ void warp_op_vs_barrier(float *out) {
  if (threadIdx.x == 5) __syncthreads();
  else out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 0);
}

// ---- tests --------------------------------------------------------------------------------
static void test_barrier_shuffling() {
  const int n = 4096;
  std::vector<float> hx(n);
  double ref = 0;
  for (int i = 0; i < n; i++) hx[i] = (float)((i * 37) % 101) / 8.0f, ref += hx[i];
  float *x = dev_alloc<float>(n), *out = dev_alloc<float>(8);
  cudaMemcpy(x, hx.data(), n * 4, cudaMemcpyHostToDevice);
  int wrong_with = 0, seeds = 8;
  for (int s = 1; s <= seeds; s++) {
    dfemu::set_seed((uint64_t)s * 7919);
    float good[8], bad[8];
    DF_LAUNCH(8, 256, 0, nullptr, tree_sum)(x, out, n, 1);
    cudaMemcpy(good, out, 32, cudaMemcpyDeviceToHost);
    DF_LAUNCH(8, 256, 0, nullptr, tree_sum)(x, out, n, 0);
    cudaMemcpy(bad, out, 32, cudaMemcpyDeviceToHost);
    for (int b = 0; b < 8; b++)
      CHECK(std::fabs(good[b] - ref) < 1e-3 * ref, "seed %d block %d: %f vs %f", s, b, good[b],
            ref);
    int wrong = 0;
    for (int b = 0; b < 8; b++) wrong += std::fabs(bad[b] - ref) > 1e-3 * ref;
    wrong_with += wrong > 0;
  }
  dfemu::set_seed(0);
  printf("barrier shuffling: the tree sum without its barrier is wrong under %d of %d seeds\n",
         wrong_with, seeds);
  CHECK(wrong_with == seeds, "a missing __syncthreads went unnoticed under %d seeds",
        seeds - wrong_with);
  cudaFree(x), cudaFree(out);
}

static void test_warp_ops() {
  for (int nt : {256, 80}) { // 80: a partial last warp of 16 lanes
    std::vector<int> hx(nt);
    for (int i = 0; i < nt; i++) hx[i] = (i * 7 + 3) % 50;
    int *x = dev_alloc<int>(nt), *out = dev_alloc<int>(nt * 9);
    cudaMemcpy(x, hx.data(), nt * 4, cudaMemcpyHostToDevice);
    DF_LAUNCH(2, nt, 0, nullptr, warp_ops)(x, out);
    std::vector<int> ho(nt * 9);
    cudaMemcpy(ho.data(), out, nt * 36, cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int t = 0; t < nt; t++) {
      int w0 = t / 32 * 32, lanes = nt - w0 < 32 ? nt - w0 : 32, lane = t % 32;
      int sum = 0, w8 = 0;
      unsigned ballot = 0;
      bool any = false, all = true;
      for (int l = 0; l < lanes; l++) {
        sum += hx[w0 + l];
        if (hx[w0 + l] % 3 == 0) ballot |= 1u << l;
        any |= hx[w0 + l] > 1000;
        all &= hx[w0 + l] >= 0;
      }
      for (int l = lane / 8 * 8; l < lane / 8 * 8 + 8; l++) w8 += hx[w0 + l];
      const int *o = &ho[t * 9];
      bad += o[0] != sum || (lane == 0 && o[1] != sum) || o[2] != hx[w0 + 3] ||
             o[3] != (lane ? hx[t - 1] : hx[t]) || (unsigned)o[4] != ballot || o[5] != any ||
             o[6] != all || o[7] != w8 || o[8] != (lanes == 32 ? hx[w0 + 31] : -1);
    }
    CHECK(bad == 0, "%d threads: %d wrong warp results", nt, bad);
    cudaFree(x), cudaFree(out);
  }
}

// The published figures of the emulated architectures (DFLASH_EMU_ARCH; CUDA C Programming
// Guide, compute capabilities 9.0 / 10.0 / 12.0, and the cards' datasheets), written here
// independently of cuda/emu/runtime.cpp's table.
struct ArchFigures {
  const char *name;
  size_t optin, per_sm;
  int sms, major, threads_per_sm;
  unsigned long long mib;
};
static const ArchFigures &arch_figures() {
  static const ArchFigures t[] = {{"sm_90", 232448, 233472, 132, 9, 2048, 143771},
                                  {"sm_100", 232448, 233472, 148, 10, 2048, 183105},
                                  {"sm_120", 101376, 102400, 188, 12, 1536, 97887}};
  const char *e = getenv("DFLASH_EMU_ARCH");
  for (const ArchFigures &f : t)
    if (e && !strcmp(e, f.name)) return f;
  return t[0];
}

static void test_poison_and_smem_limits() {
  float *out = dev_alloc<float>(128);
  std::vector<float> h(128);
  for (int rep = 0; rep < 2; rep++) {
    DF_LAUNCH(3, 64, 64 * 4, nullptr, read_unwritten)(out);
    cudaMemcpy(h.data(), out, 512, cudaMemcpyDeviceToHost);
    int nan = 0;
    for (float v : h) nan += std::isnan(v);
    CHECK(nan == 128, "unwritten shared memory read as numbers (%d of 128 NaN)", nan);
  }
  // Dynamic shared memory: 48 KiB without the attribute, up to the arch's opt-in maximum
  // (227 KiB on sm_90 / sm_100, 99 KiB on sm_120) with it.
  const ArchFigures &af = arch_figures();
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0) == cudaSuccess, "properties");
  CHECK(prop.sharedMemPerBlockOptin == af.optin && prop.sharedMemPerMultiprocessor == af.per_sm &&
            prop.multiProcessorCount == af.sms && prop.major == af.major &&
            prop.regsPerBlock == 65536 && prop.maxThreadsPerMultiProcessor == af.threads_per_sm,
        "%s: %s reports %zu / %zu B shared, %d SMs, %d.%d, %d threads per SM", af.name, prop.name,
        prop.sharedMemPerBlockOptin, prop.sharedMemPerMultiprocessor, prop.multiProcessorCount,
        prop.major, prop.minor, prop.maxThreadsPerMultiProcessor);
  int attr = 0;
  cudaDeviceGetAttribute(&attr, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
  CHECK((size_t)attr == af.optin, "attribute optin %d", attr);
  cudaGetLastError();
  DF_LAUNCH(1, 64, 64 * 1024, nullptr, big_smem)(out);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue,
        "64 KiB of dynamic smem without the attribute");
  CHECK(cudaFuncSetAttribute(big_smem, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)af.optin + 1) == cudaErrorInvalidValue,
        "%zu bytes accepted", af.optin + 1);
  cudaGetLastError();
  CHECK(cudaFuncSetAttribute(big_smem, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)af.optin) == cudaSuccess,
        "%zu bytes refused", af.optin);
  DF_LAUNCH(1, 64, af.optin, nullptr, big_smem)(out);
  CHECK(cudaGetLastError() == cudaSuccess, "a launch at the opt-in maximum refused");
  DF_LAUNCH(1, 64, af.optin + 1, nullptr, big_smem)(out);
  CHECK(cudaGetLastError() == cudaErrorInvalidValue, "opt-in maximum + 1 launched");
  if (af.optin < 232448) { // what an H200 runs, refused here as the hardware refuses it
    DF_LAUNCH(1, 64, 102400, nullptr, big_smem)(out);
    CHECK(cudaGetLastError() == cudaErrorInvalidValue, "100 KiB launched on %s", af.name);
  }
  cudaDeviceSynchronize();
  cudaMemcpy(h.data(), out, 256, cudaMemcpyDeviceToHost);
  CHECK(h[0] == 1.0f && h[63] == 0.0f, "big_smem %f %f", h[0], h[63]);
  // Launch configurations.
  DF_LAUNCH(1, 1025, 0, nullptr, fill)(out, 0.0f, 1);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "1025 threads");
  CHECK(cudaGetLastError() == cudaSuccess, "cudaGetLastError does not reset");
  DF_LAUNCH(dim3(1, 65536), 32, 0, nullptr, fill)(out, 0.0f, 1);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "grid.y 65536");
  DF_LAUNCH(0, 32, 0, nullptr, fill)(out, 0.0f, 1);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "empty grid");
  DF_LAUNCH(dim3(1), dim3(8, 8, 65), 0, nullptr, fill)(out, 0.0f, 1);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration, "block.z 65");
  cudaFree(out);
}

static void test_memory_checks() {
  float *d = dev_alloc<float>(100);
  std::vector<float> h(200, 1.0f);
  CHECK(cudaMemcpy(d, h.data(), 400, cudaMemcpyHostToDevice) == cudaSuccess, "in bounds");
  CHECK(cudaMemcpy(d, h.data(), 404, cudaMemcpyHostToDevice) == cudaErrorInvalidValue,
        "a copy one float past the allocation");
  CHECK(cudaMemcpy(h.data(), d + 50, 51 * 4, cudaMemcpyDeviceToHost) == cudaErrorInvalidValue,
        "a read past the allocation");
  CHECK(cudaMemcpy(h.data(), d, 4, cudaMemcpyHostToDevice) == cudaErrorInvalidValue,
        "host pointer as the device side");
  CHECK(cudaMemcpy(d, h.data(), 4, cudaMemcpyDeviceToHost) == cudaErrorInvalidValue,
        "kinds swapped");
  CHECK(cudaMemsetAsync(d + 99, 0, 8, nullptr) == cudaErrorInvalidValue, "memset past the end");
  CHECK(cudaFree(d + 1) == cudaErrorInvalidValue, "cudaFree of an interior pointer");
  cudaGetLastError();
  size_t fr0, tot, fr1;
  cudaMemGetInfo(&fr0, &tot);
  float *e = dev_alloc<float>(1 << 20);
  cudaMemGetInfo(&fr1, &tot);
  CHECK(fr0 - fr1 == 4u << 20, "cudaMemGetInfo: %zu bytes fewer", fr0 - fr1);
  CHECK(tot == arch_figures().mib << 20, "%s total %zu", arch_figures().name, tot);
  std::vector<float> fresh(4);
  cudaMemcpy(fresh.data(), e, 16, cudaMemcpyDeviceToHost);
  CHECK(std::isnan(fresh[0]) && std::isnan(fresh[3]), "fresh device memory is not poisoned");
  cudaFree(e), cudaFree(d);
  void *big = nullptr;
  CHECK(cudaMalloc(&big, 200ull << 30) == cudaErrorMemoryAllocation, "200 GiB on one GPU");
  cudaGetLastError();
  int n = 0;
  CHECK(cudaGetDeviceCount(&n) == cudaSuccess && n == 3, "DFLASH_EMU_DEVICES=3: %d", n);
  CHECK(cudaSetDevice(3) == cudaErrorInvalidDevice, "device 3 of 3");
  cudaGetLastError();
}

static void test_stream_order() {
  const int n = 1000;
  float *a = dev_alloc<float>(n), *b = dev_alloc<float>(n);
  cudaStream_t nb, bl;
  cudaStreamCreateWithFlags(&nb, cudaStreamNonBlocking);
  cudaStreamCreate(&bl);
  std::vector<float> h(n), one(n, 1.0f);
  // A kernel on a non-blocking stream, then cudaMemcpy on the legacy stream: no ordering.
  cudaMemcpy(a, one.data(), n * 4, cudaMemcpyHostToDevice);
  cudaDeviceSynchronize();
  DF_LAUNCH(4, 256, 0, nb, fill)(a, 7.0f, n);
  cudaMemcpy(h.data(), a, n * 4, cudaMemcpyDeviceToHost);
  CHECK(h[0] == 1.0f, "legacy cudaMemcpy waited for a non-blocking stream (%f)", h[0]);
  cudaStreamSynchronize(nb);
  cudaMemcpy(h.data(), a, n * 4, cudaMemcpyDeviceToHost);
  CHECK(h[0] == 7.0f && h[n - 1] == 7.0f, "after cudaStreamSynchronize: %f", h[0]);
  // The same on a blocking stream: the legacy stream waits for it.
  DF_LAUNCH(4, 256, 0, bl, fill)(a, 8.0f, n);
  cudaMemcpy(h.data(), a, n * 4, cudaMemcpyDeviceToHost);
  CHECK(h[0] == 8.0f, "legacy cudaMemcpy did not wait for a blocking stream (%f)", h[0]);
  // cudaMemset (legacy, asynchronous) is not seen by a non-blocking stream without a sync.
  cudaMemset(a, 0, n * 4);
  DF_LAUNCH(4, 256, 0, nb, copy_k)(b, a, n);
  cudaStreamSynchronize(nb);
  cudaMemcpy(h.data(), b, n * 4, cudaMemcpyDeviceToHost);
  CHECK(h[0] == 8.0f, "a non-blocking stream saw the legacy cudaMemset (%f)", h[0]);
  // ... nor a cudaMemcpy from pageable memory, whose DMA may still be pending on return.
  cudaDeviceSynchronize();
  std::vector<float> three(n, 3.0f);
  cudaMemcpy(a, three.data(), n * 4, cudaMemcpyHostToDevice);
  DF_LAUNCH(4, 256, 0, nb, copy_k)(b, a, n);
  cudaStreamSynchronize(nb);
  cudaMemcpy(h.data(), b, n * 4, cudaMemcpyDeviceToHost);
  CHECK(h[0] == 0.0f, "a non-blocking stream saw a pending pageable cudaMemcpy (%f)", h[0]);
  cudaDeviceSynchronize();
  // cudaMemcpyAsync from pageable memory takes the source at the call.
  std::vector<float> src(n, 5.0f);
  cudaMemcpyAsync(a, src.data(), n * 4, cudaMemcpyHostToDevice, nb);
  src.assign(n, 6.0f);
  // ... and to pageable memory returns with the data.
  cudaMemcpyAsync(h.data(), a, n * 4, cudaMemcpyDeviceToHost, nb);
  CHECK(h[0] == 5.0f, "pageable async copies: %f", h[0]);
  // Pinned memory is read when the copy runs.
  float *pin = nullptr;
  cudaMallocHost(&pin, n * 4);
  for (int i = 0; i < n; i++) pin[i] = 9.0f;
  cudaMemcpyAsync(a, pin, n * 4, cudaMemcpyHostToDevice, nb);
  pin[0] = 10.0f;
  cudaMemcpyAsync(pin + 1, a, 4, cudaMemcpyDeviceToHost, nb);
  CHECK(pin[1] == 9.0f, "a pinned async copy ran before its stream was synchronised");
  cudaStreamSynchronize(nb);
  CHECK(pin[1] == 10.0f, "pinned source read at the call (%f)", pin[1]);
  // Events: a query does the work, elapsed time needs both.
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0), cudaEventCreate(&e1);
  cudaEventRecord(e0, nb);
  DF_LAUNCH(4, 256, 0, nb, fill)(b, 4.0f, n);
  cudaEventRecord(e1, nb);
  float ms = -1;
  CHECK(cudaEventElapsedTime(&ms, e0, e1) == cudaErrorNotReady, "elapsed before done");
  CHECK(cudaEventSynchronize(e1) == cudaSuccess && cudaEventQuery(e1) == cudaSuccess, "event");
  CHECK(cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess && ms >= 0, "elapsed %f", ms);
  // cudaStreamWaitEvent orders two non-blocking streams.
  cudaStream_t nb2;
  cudaStreamCreateWithFlags(&nb2, cudaStreamNonBlocking);
  DF_LAUNCH(4, 256, 0, nb, fill)(a, 11.0f, n);
  cudaEventRecord(e0, nb);
  cudaStreamWaitEvent(nb2, e0, 0);
  DF_LAUNCH(4, 256, 0, nb2, copy_k)(b, a, n);
  cudaStreamSynchronize(nb2);
  cudaMemcpy(h.data(), b, n * 4, cudaMemcpyDeviceToHost);
  CHECK(h[0] == 11.0f, "cudaStreamWaitEvent: %f", h[0]);
  // A launch on a stream of another device.
  cudaSetDevice(1);
  DF_LAUNCH(1, 32, 0, nb, fill)(a, 0.0f, 1);
  CHECK(cudaGetLastError() == cudaErrorInvalidResourceHandle, "stream of device 0 used on 1");
  cudaSetDevice(0);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  cudaStreamDestroy(nb), cudaStreamDestroy(nb2), cudaStreamDestroy(bl);
  cudaFreeHost(pin);
  cudaFree(a), cudaFree(b);
}

static void test_blas() {
  cublasHandle_t h;
  CHECK(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
  const int M = 37, N = 29, K = 53;
  // Row-major C[M,N] = A[M,K] B[N,K]^T as model.cu calls it: column-major C^T = B A^T.
  std::vector<uint16_t> ha(M * K), hb(N * K);
  uint64_t s = 12345;
  auto r = [&] {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((s >> 33) % 2001) / 1000.0f - 1.0f;
  };
  for (auto &v : ha) v = df_f32_to_bf16(r());
  for (auto &v : hb) v = df_f32_to_bf16(r());
  bf16 *A = dev_alloc<bf16>(M * K), *B = dev_alloc<bf16>(N * K);
  float *C = dev_alloc<float>(M * N);
  bf16 *C16 = dev_alloc<bf16>(M * N);
  cudaMemcpy(A, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(B, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice);
  float one = 1, zero = 0;
  CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, K, A, CUDA_R_16BF,
                     K, &zero, C, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS,
        "GemmEx");
  CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, K, A, CUDA_R_16BF,
                     K, &zero, C16, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS,
        "GemmEx bf16 out");
  std::vector<float> hc(M * N);
  std::vector<uint16_t> hc16(M * N);
  cudaMemcpy(hc.data(), C, hc.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(hc16.data(), C16, hc16.size() * 2, cudaMemcpyDeviceToHost);
  double worst = 0, worst16 = 0;
  for (int i = 0; i < M; i++)
    for (int j = 0; j < N; j++) {
      double ref = 0;
      for (int p = 0; p < K; p++)
        ref += (double)df_bf16_to_f32(ha[i * K + p]) * df_bf16_to_f32(hb[j * K + p]);
      worst = std::fmax(worst, std::fabs(hc[i * N + j] - ref));
      worst16 = std::fmax(worst16, std::fabs(df_bf16_to_f32(hc16[i * N + j]) - ref) /
                                       std::fmax(std::fabs(ref), 1e-3));
    }
  CHECK(worst < 1e-4, "fp32 GEMM error %g", worst);
  CHECK(worst16 <= 1.0 / 256, "bf16 output error %g (more than one rounding)", worst16);
  // cuBLAS's own argument checks.
  CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, K - 1, A,
                     CUDA_R_16BF, K, &zero, C, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE,
        "lda < k for op T");
  CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, N - 1, A,
                     CUDA_R_16BF, K, &zero, C, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE,
        "lda < m for op N");
  CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_T, N, M, K, &one, B, CUDA_R_16BF, K, A, CUDA_R_16BF,
                     M - 1, &zero, C, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE,
        "ldb < n for op T");
  CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, K, A, CUDA_R_16BF,
                     K, &zero, C, CUDA_R_32F, N - 1, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE,
        "ldc < m");
  CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, -1, &one, B, CUDA_R_16BF, K, A, CUDA_R_16BF,
                     K, &zero, C, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_INVALID_VALUE,
        "k < 0");
  CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, K, A, CUDA_R_32F,
                     K, &zero, C, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_SUPPORTED,
        "mixed A/B types");
  // In bounds for cuBLAS, past the allocation for the emulator: an error, not a read.
  CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M + 1, K, &one, B, CUDA_R_16BF, K, A,
                     CUDA_R_16BF, K, &zero, C, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_EXECUTION_FAILED,
        "A one row past its allocation");
  // beta = 0 does not read C (poisoned), beta = 1 accumulates; in stream order.
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  cublasSetStream(h, st);
  cudaMemsetAsync(C, 0xff, M * N * 4, st);
  cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, K, A, CUDA_R_16BF, K,
               &zero, C, CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_16BF, K, A, CUDA_R_16BF, K,
               &one, C, CUDA_R_32F, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  std::vector<float> hc2(M * N);
  cudaMemcpyAsync(hc2.data(), C, hc2.size() * 4, cudaMemcpyDeviceToHost, st);
  int off = 0;
  for (int i = 0; i < M * N; i++) off += !(hc2[i] == 2 * hc[i]);
  CHECK(off == 0, "beta 0 then 1: %d of %d entries off", off, M * N);
  cublasDestroy(h);
  cudaStreamDestroy(st);
  cudaFree(A), cudaFree(B), cudaFree(C), cudaFree(C16);
}

// n: floats per rank; above 262144 a collective takes several rounds of the 1 MiB staging.
static void test_nccl_threads(size_t n) {
  const int R = 3;
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id) == ncclSuccess, "id");
  std::vector<std::vector<float>> got(R);
  std::vector<int> status(R, -1);
  std::vector<std::thread> th;
  for (int r = 0; r < R; r++)
    th.emplace_back([&, r] {
      cudaSetDevice(r);
      ncclComm_t c;
      if (ncclCommInitRank(&c, R, id, r) != ncclSuccess) return;
      cudaStream_t st;
      cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
      float *buf = dev_alloc<float>(n * R), *ar = dev_alloc<float>(n), *bc = dev_alloc<float>(n);
      std::vector<float> h(n * R);
      for (size_t i = 0; i < n * R; i++) h[i] = (float)(r + 1) * (float)i;
      cudaMemcpyAsync(buf, h.data(), n * R * 4, cudaMemcpyHostToDevice, st);
      cudaMemcpyAsync(ar, h.data(), n * 4, cudaMemcpyHostToDevice, st);
      cudaMemcpyAsync(bc, h.data(), n * 4, cudaMemcpyHostToDevice, st);
      int ok = ncclReduceScatter(buf, buf + r * n, n, ncclFloat, ncclSum, c, st) == ncclSuccess;
      ok &= ncclAllGather(buf + r * n, buf, n, ncclFloat, c, st) == ncclSuccess;
      ok &= ncclAllReduce(ar, ar, n, ncclFloat, ncclMax, c, st) == ncclSuccess;
      ok &= ncclBroadcast(bc, bc, n, ncclFloat, 1, c, st) == ncclSuccess;
      // The result is not there before the stream runs (every rank must come first).
      while (cudaStreamQuery(st) == cudaErrorNotReady) std::this_thread::yield();
      got[r].resize(n * R + 2 * n);
      cudaMemcpy(got[r].data(), buf, n * R * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(got[r].data() + n * R, ar, n * 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(got[r].data() + n * R + n, bc, n * 4, cudaMemcpyDeviceToHost);
      status[r] = ok;
      ncclCommDestroy(c);
      cudaStreamDestroy(st);
      cudaFree(buf), cudaFree(ar), cudaFree(bc);
    });
  for (auto &t : th) t.join();
  int bad = 0;
  for (int r = 0; r < R; r++) {
    CHECK(status[r] == 1, "rank %d: collectives failed", r);
    if (status[r] != 1) continue;
    for (size_t i = 0; i < n * R; i++) bad += got[r][i] != 6.0f * (float)i; // 1 + 2 + 3
    for (size_t i = 0; i < n; i++) bad += got[r][n * R + i] != 3.0f * (float)i;
    for (size_t i = 0; i < n; i++) bad += got[r][n * R + n + i] != 2.0f * (float)i;
  }
  CHECK(bad == 0, "NCCL over 3 ranks, %zu floats each: %d wrong values", n, bad);
  if (n > 1000) return;
  // Two ranks on one device: NCCL refuses ("Duplicate GPU detected").
  ncclGetUniqueId(&id);
  ncclResult_t res[2];
  std::thread a([&] {
    cudaSetDevice(0);
    ncclComm_t c;
    res[0] = ncclCommInitRank(&c, 2, id, 0);
    if (!res[0]) ncclCommDestroy(c);
  });
  std::thread b([&] {
    cudaSetDevice(0);
    ncclComm_t c;
    res[1] = ncclCommInitRank(&c, 2, id, 1);
    if (!res[1]) ncclCommDestroy(c);
  });
  a.join(), b.join();
  CHECK(res[0] == ncclInvalidUsage || res[1] == ncclInvalidUsage, "two ranks on device 0: %d %d",
        res[0], res[1]);
}

static void test_conversions() {
  int bad = 0;
  uint64_t s = 99;
  for (int i = 0; i < 2000000; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t u = (uint32_t)(s >> 32);
    float f;
    std::memcpy(&f, &u, 4);
    uint16_t mine = __bfloat16_as_ushort(__float2bfloat16(f));
    if (std::isnan(f)) bad += mine != 0x7fff;
    else bad += mine != df_f32_to_bf16(f);
    float g = std::ldexp((float)((s >> 8) % 20000) / 10000.0f - 1.0f, (int)(s % 30) - 15);
    bad += __nv_fp8_e4m3(g).__x != df_f32_to_e4m3(g);
  }
  // Ties go to even.
  uint32_t tie = 0x3f808000u, tie2 = 0x3f818000u;
  float ft, ft2;
  std::memcpy(&ft, &tie, 4), std::memcpy(&ft2, &tie2, 4);
  bad += __bfloat16_as_ushort(__float2bfloat16(ft)) != 0x3f80;
  bad += __bfloat16_as_ushort(__float2bfloat16(ft2)) != 0x3f82;
  bad += __bfloat16_as_ushort(__float2bfloat16(FLT_MAX)) != 0x7f80; // rounds up to inf
  CHECK(bad == 0, "%d conversions differ from src/core/bf16.h", bad);
}

static void test_wmma() {
  std::vector<uint16_t> ha(32 * 48), hb(32 * 48);
  std::vector<float> hc0(32 * 32), ref(32 * 32);
  for (int i = 0; i < 32 * 48; i++) {
    ha[i] = df_f32_to_bf16((float)((i * 7) % 13 - 6) / 4.0f);
    hb[i] = df_f32_to_bf16((float)((i * 5) % 11 - 5) / 8.0f);
  }
  for (int i = 0; i < 32 * 32; i++) hc0[i] = (float)(i % 9) - 4.0f; // stored col-major
  for (int m = 0; m < 32; m++)
    for (int n = 0; n < 32; n++) {
      double acc = hc0[n * 32 + m];
      for (int k = 0; k < 48; k++)
        acc += (double)df_bf16_to_f32(ha[m * 48 + k]) * df_bf16_to_f32(hb[n * 48 + k]);
      ref[m * 32 + n] = (float)(2 * acc); // every partial sum is exact in fp32
    }
  bf16 *A = dev_alloc<bf16>(32 * 48), *B = dev_alloc<bf16>(32 * 48);
  float *C0 = dev_alloc<float>(32 * 32), *C = dev_alloc<float>(32 * 32);
  cudaMemcpy(A, ha.data(), 2 * ha.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(B, hb.data(), 2 * hb.size(), cudaMemcpyHostToDevice);
  cudaMemcpy(C0, hc0.data(), 4 * hc0.size(), cudaMemcpyHostToDevice);
  int layout_wrong = 0, seeds = 4, mapping_differs = 0;
  float *in = dev_alloc<float>(256), *out = dev_alloc<float>(256);
  std::vector<float> hin(256), hout(256);
  for (int i = 0; i < 256; i++) hin[i] = (float)i;
  cudaMemcpy(in, hin.data(), 1024, cudaMemcpyHostToDevice);
  int first[8];
  for (int s = 1; s <= seeds; s++) {
    dfemu::set_seed((uint64_t)s * 104729);
    std::vector<float> hgot(32 * 32, NAN);
    DF_LAUNCH(1, 128, 0, nullptr, wmma_gemm)(C, A, B, C0);
    cudaMemcpy(hgot.data(), C, 4 * hgot.size(), cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int i = 0; i < 32 * 32; i++) bad += hgot[i] != ref[i];
    CHECK(bad == 0, "seed %d: %d of 1024 WMMA products differ from the reference", s, bad);
    cudaMemset(out, 0, 1024);
    DF_LAUNCH(1, 32, 0, nullptr, wmma_assumes_layout)(out, in);
    cudaMemcpy(hout.data(), out, 1024, cudaMemcpyDeviceToHost);
    int misplaced = 0;
    for (int i = 0; i < 256; i++) misplaced += hout[i] != hin[i];
    layout_wrong += misplaced > 0;
    int same = 0;
    for (int i = 0; i < 8; i++) {
      int e = dfemu::frag_element(dfemu::FRAG_ACC, 0, i);
      if (s == 1) first[i] = e;
      same += first[i] == e;
    }
    mapping_differs += s > 1 && same < 8;
  }
  dfemu::set_seed(0);
  printf("wmma: products exact under %d mappings; code assuming a fragment layout wrong under "
         "%d of %d\n",
         seeds, layout_wrong, seeds);
  CHECK(layout_wrong == seeds, "code that assumes a fragment layout was right under %d seeds",
        seeds - layout_wrong);
  CHECK(mapping_differs == seeds - 1, "the element mapping did not change with the seed");
  DF_LAUNCH(1, 32, 0, nullptr, wmma_unfilled)(out);
  cudaMemcpy(hout.data(), out, 1024, cudaMemcpyDeviceToHost);
  int nan = 0;
  for (int i = 0; i < 256; i++) nan += std::isnan(hout[i]);
  CHECK(nan == 256, "an accumulator never loaded nor filled gave %d NaN of 256", nan);
  // The missing barrier before warp 0's products: caught under every seed (128 blocks, a
  // quarter of them warp-sticky, in half of those warp 0 goes first: missed with odds 4e-8).
  const int nb = 128;
  float *ow = dev_alloc<float>(nb * 256);
  std::vector<float> how(nb * 256);
  int caught = 0;
  for (int s = 1; s <= seeds; s++) {
    dfemu::set_seed((uint64_t)s * 7907);
    for (int barrier = 1; barrier >= 0; barrier--) {
      DF_LAUNCH(nb, 64, 1536, nullptr, wmma_overwrite)(ow, barrier);
      cudaMemcpy(how.data(), ow, 4 * how.size(), cudaMemcpyDeviceToHost);
      int bad = 0;
      for (int b = 0; b < nb; b++)
        for (int i = 0; i < 256; i++) bad += how[b * 256 + i] != (float)(b + i);
      if (barrier) CHECK(bad == 0, "seed %d: %d copies wrong with the barrier", s, bad);
      else caught += bad > 0;
    }
  }
  dfemu::set_seed(0);
  printf("wmma: the missing barrier before a warp's products caught under %d of %d seeds\n", caught,
         seeds);
  CHECK(caught == seeds, "a warp running ahead through WMMA ops went unnoticed under %d seeds",
        seeds - caught);
  cudaFree(ow);
  cudaFree(A), cudaFree(B), cudaFree(C0), cudaFree(C), cudaFree(in), cudaFree(out);
}

// One element past its allocation: ASan reports it at once, without ASan the canary behind
// every device allocation does at cudaFree.
__global__ void write_past_end(float *p, int n) {
  if (threadIdx.x == 0) p[n] = 1.0f;
}

static void test_mma_sync() {
  // Small integers over 8: every product and sum exact in fp32, so results must be equal.
  std::vector<bf16> A(16 * 32), At(32 * 16), B(32 * 8), Bt(8 * 32);
  std::vector<float> C0(16 * 8), ref(16 * 8);
  for (int r = 0; r < 16; r++)
    for (int k = 0; k < 32; k++)
      A[r * 32 + k] = At[k * 16 + r] = __float2bfloat16((float)((r * 7 + k * 3) % 11 - 5) / 8);
  for (int k = 0; k < 32; k++)
    for (int n = 0; n < 8; n++)
      B[k * 8 + n] = Bt[n * 32 + k] = __float2bfloat16((float)((k * 5 + n * 13) % 9 - 4) / 4);
  for (int i = 0; i < 128; i++) C0[i] = (float)(i % 17) - 8;
  for (int r = 0; r < 16; r++)
    for (int n = 0; n < 8; n++) {
      double s = C0[r * 8 + n];
      for (int k = 0; k < 32; k++)
        s += (double)__bfloat162float(A[r * 32 + k]) * __bfloat162float(B[k * 8 + n]);
      ref[r * 8 + n] = (float)s;
    }
  bf16 *dA = dev_alloc<bf16>(512), *dAt = dev_alloc<bf16>(512), *dB = dev_alloc<bf16>(256),
       *dBt = dev_alloc<bf16>(256);
  float *dC0 = dev_alloc<float>(128), *dC = dev_alloc<float>(128);
  cudaMemcpy(dA, A.data(), 1024, cudaMemcpyHostToDevice);
  cudaMemcpy(dAt, At.data(), 1024, cudaMemcpyHostToDevice);
  cudaMemcpy(dB, B.data(), 512, cudaMemcpyHostToDevice);
  cudaMemcpy(dBt, Bt.data(), 512, cudaMemcpyHostToDevice);
  cudaMemcpy(dC0, C0.data(), 512, cudaMemcpyHostToDevice);
  const char *names[] = {"ldmatrix.x4 + x2.trans", "hand-packed", "ldmatrix.x4.trans + x1",
                         "a[1]/a[2] swapped", "no cp.async.wait_group"};
  for (int mode = MMA_LDSM; mode <= MMA_NOWAIT; mode++) {
    DF_LAUNCH(1, 32, 0, nullptr, mma_gemm)(dC, dA, dAt, dB, dBt, dC0, mode);
    std::vector<float> h(128);
    cudaMemcpy(h.data(), dC, 512, cudaMemcpyDeviceToHost);
    int wrong = 0, nan = 0;
    for (int i = 0; i < 128; i++) wrong += h[i] != ref[i], nan += std::isnan(h[i]);
    printf("mma.sync %s: %d of 128 wrong (%d NaN)\n", names[mode], wrong, nan);
    if (mode <= MMA_TRANS) CHECK(wrong == 0, "%s: %d of 128 wrong", names[mode], wrong);
    else CHECK(wrong > 0, "%s: right although it should not be", names[mode]);
    if (mode == MMA_NOWAIT) CHECK(nan == 128, "without the wait %d of 128 NaN", nan);
  }
  // wait_group 1 of 2 groups: the first has landed, the second reads poison until waited.
  std::vector<bf16> src(512);
  for (int i = 0; i < 512; i++) src[i] = __float2bfloat16((float)(i % 64));
  bf16 *dsrc = dev_alloc<bf16>(512);
  float *dout = dev_alloc<float>(96);
  cudaMemcpy(dsrc, src.data(), 1024, cudaMemcpyHostToDevice);
  DF_LAUNCH(1, 32, 0, nullptr, cp_groups)(dout, dsrc);
  std::vector<float> o(96);
  cudaMemcpy(o.data(), dout, 384, cudaMemcpyDeviceToHost);
  int first = 0, second = 0, after = 0;
  for (int l = 0; l < 32; l++) {
    first += o[l] == (float)(l * 8 % 64);
    second += std::isnan(o[32 + l]);
    after += o[64 + l] == (float)((256 + l * 8) % 64);
  }
  CHECK(first == 32 && second == 32 && after == 32,
        "wait_group 1: %d of 32 of the first group landed, %d of the second poisoned, %d "
        "landed after wait_group 0",
        first, second, after);
  // bf16x2 packing: cvt.rn.bf16x2.f32 puts the first operand (hi) in the upper half.
  CHECK(tc_pack(1.0f, -2.0f) == (0xc0000000u | 0x3f80u), "tc_pack %08x", tc_pack(1.0f, -2.0f));
  cudaFree(dA), cudaFree(dAt), cudaFree(dB), cudaFree(dBt), cudaFree(dC0), cudaFree(dC);
  cudaFree(dsrc), cudaFree(dout);
}

static void expect_oob_caught() {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    float *d = dev_alloc<float>(10);
    DF_LAUNCH(1, 32, 0, nullptr, write_past_end)(d, 10);
    cudaDeviceSynchronize();
    cudaFree(d);
    _exit(0);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  CHECK(!(WIFEXITED(st) && WEXITSTATUS(st) == 0), "a kernel's write past its allocation went "
                                                  "unnoticed");
}

// A fault the hardware would hang on: the child aborts with a message naming it (`says`,
// when given, is looked for in what it writes to stderr).
static void expect_abort(const char *what, void (*k)(float *), int threads = 32,
                         const char *says = nullptr) {
  fflush(stdout);
  int fd[2];
  if (pipe(fd)) abort();
  pid_t pid = fork();
  if (pid == 0) {
    close(fd[0]);
    dup2(fd[1], 2);
    float *out = dev_alloc<float>(64);
    DF_LAUNCH(1, threads, 0, nullptr, k)(out);
    cudaDeviceSynchronize();
    _exit(0);
  }
  close(fd[1]);
  std::string err;
  char buf[512];
  for (ssize_t n; (n = read(fd[0], buf, sizeof buf)) > 0;) err.append(buf, (size_t)n);
  close(fd[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT, "%s was not caught (status %d)", what, st);
  CHECK(!says || err.find(says) != std::string::npos, "%s: the report does not say \"%s\": %s",
        what, says, err.c_str());
}

int main() {
  setenv("DFLASH_EMU_DEVICES", "3", 1);
  printf("thread-order seed %llu\n", (unsigned long long)dfemu::seed());
  test_barrier_shuffling();
  test_warp_ops();
  test_poison_and_smem_limits();
  test_memory_checks();
  test_stream_order();
  test_blas();
  test_nccl_threads(1000);
  test_nccl_threads(300001);
  test_conversions();
  expect_abort("__syncthreads in divergent code", divergent_barrier);
  expect_abort("a shuffle whose lanes wait at __syncthreads", warp_op_vs_barrier);
  expect_oob_caught();
  test_wmma();
  expect_abort("a WMMA ldm of 18 floats", wmma_bad_ldm, 32, "ldm 18 is not a multiple of 4");
  expect_abort("a WMMA pointer 16 bytes off", wmma_bad_align, 32, "not 256-bit");
  expect_abort("a WMMA store one lane skips", wmma_lane_missing, 32, "every lane of the warp");
  expect_abort("WMMA lanes passing different pointers", wmma_lanes_disagree, 32,
               "must be the same on every lane");
  expect_abort("WMMA lanes at a load and a store", wmma_lanes_differ_in_op, 32,
               "wmma::store_matrix_sync");
  expect_abort("WMMA in a partial warp", wmma_partial_warp, 16, "every lane of the warp");
  test_mma_sync();
  expect_abort("an mma.sync one lane skips", mma_lane_missing, 32, "every lane of the warp");
  expect_abort("lanes at ldmatrix.x2 and .x4", ldsm_lanes_differ, 32, "ldmatrix.m8n8.x");
  expect_abort("ldmatrix from global memory", ldsm_global, 32, "not in the block's shared memory");
  expect_abort("a thread that exits with cp.async in flight", cp_exit_in_flight, 32,
               "exited with 1 cp.async copies in flight");
  printf("%s (%d failures)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
