// DFlash-masked attention on tensor cores (WMMA, bf16 in, fp32 accumulate), flash style: no
// S x S matrix, scores exist one key tile at a time in shared memory with an online softmax.
//
// The mask is ops.c's `visible`: a block with anchor a sees context rows s < a (sliding
// layers: s >= a + j - (window - 1)) and its own keys (sliding: j - (window - 1) .. j).
//
// Tiles (read by bench/gpu_model.py; every size below is in elements unless it says bytes):
//   M tile   one CTA takes one block n and one kv head g: its B query rows times the
//            grp = nh / nkv query heads sharing g, M = B * grp rows (row r = j * grp + hh:
//            consecutive in memory), padded to Mp = 16 * ceil(M / 16) <= 128.
//   N tile   keys per step: 64, or 32 / 16 when 64 does not fit the shared memory (see
//            smem_layout); context keys and the block's own keys are separate tiles.
//   K        head_dim d (QK^T, dO V^T; a multiple of 8, zero-padded to dp = 16 * ceil(d / 16)
//            in shared memory) or the N keys (PV, dS K); WMMA 16x16x16 fragments.
//   warps    W = 8 when Mp >= 64, else 4 (256 or 128 threads; from Mp 64 a backward CTA's
//            shared memory leaves room for one CTA per SM, so it brings 8 warps itself); the
//            softmax and dS work is tpr threads per row.
//   units    a warp computes rm x rn 16x16 output tiles of a product at once (warp_gemm),
//            loading rm A and rn B fragments per K step, dealt round robin (S and dP, dK and
//            dV dealt together): 2x2 for every product but the forward's S (1x2: its 64 x 64
//            alone would leave 4 of 8 warps idle) and the block's dK, dV (1x1: 16 rows);
//            clipped at the edges. Fragment bytes through shared memory per mma_sync:
//            (rm + rn) / (2 rm rn) KB: 1/2 for 2x2, 3/4 for 1x2.
//   held     accumulators kept in registers over the whole loop instead of loaded from and
//            stored to shared memory by every product: attention_backward_ctx's dK and dV when their
//            2x2 units take at most 2 per warp (Qwen3-8B N 64: 16 units / 8 warps; Kimi N
//            32: 8), attention_backward_q's dQ at most 1 per warp (Qwen3-8B: 8 units / 8 warps; not
//            Kimi's Mp 128). Otherwise in shared memory as before (template REG = false).
//   registers  (ptxas -v, CUDA 13.0; no spills) sm_90 / sm_100 / sm_120: attention_forward 114 /
//            118 / 121; attention_backward_q 164 / 226 / 246 (dQ held), 137 / 246 / 246; attention_backward_ctx
//            204 / 238 / 234 (dK, dV held), 116 / 252 / 254. At 256 threads one CTA per SM
//            (what the shared memory of the backward leaves anyway); at 128 threads two.
//   shared   bf16 rows of dp are padded to ldh = dp + 8, fp32 rows of N to ldn = N + 4, bf16
//            rows of N to ldp = N + 8, fp32 rows of dp to ldo = dp + 4 (16 bytes: consecutive
//            rows start 4 banks apart, so the 8 rows of a fragment load hit distinct banks);
//            every region starts on 128 bytes. Bytes per CTA (bf16 = 2, fp32 = 4):
//     attention_forward        2*Mp*ldh + 4*N*ldh + 4*Mp*ldn + 2*Mp*ldp + 4*Mp*ldo + 8*Mp
//     attention_backward_q      4*Mp*ldh + 4*N*ldh + 8*Mp*ldn + 4*Mp*ldp + 4*Mp*ldo + 4*N*ldo + 8*Mp
//     attention_backward_ctx    4*Mp*ldh + 4*N*ldh + 8*Mp*ldn + 4*Mp*ldp + 8*N*ldo + 8*Mp
//     (+ up to 127 bytes per region of alignment). E.g. d = 128, Mp = 64 (Qwen3-8B 32/8 at
//     B 16), N = 64: 113,152 / 190,976 / 190,976 bytes; Mp = 128 (Kimi 64/8): N = 64, 32,
//     32: 191,488 / 229,888 / 179,200 bytes (227 KiB = 232,448 on H100/H200/B200).
//   FLOPs    (tensor-core, per CTA; a tile of cnt keys costs w = 16 * ceil(cnt / 16)
//            columns; keys = the sum of w over the tiles visited: the context rows from the
//            window's start to the anchor, in tiles of N, then the B block keys)
//            forward 4 * Mp * keys * dp (QK^T, PV); attention_backward_q 6 * Mp * keys * dp (QK^T,
//            dO V^T, dS K) + 4 * Mp * B16 * dp (the block's dK, dV; B16 = 16 * ceil(B / 16));
//            attention_backward_ctx 8 * Mp * w * dp per block that sees its tile (QK^T, dO V^T,
//            dS^T Q, P^T dO; w of the tile cut at that block's anchor). QK^T and dO V^T of
//            context keys are computed in both passes: 7 products per score, not 5 (why
//            not one pass: at the foot of this comment).
//
// Kernels:
//   attention_forward      grid (n_blocks, nkv): out (bf16) and the row log-sum-exp lse (f32 [T, nh]),
//                 kept for the backward.
//   attention_backward_q    grid (n_blocks, nkv): D = rowsum(dO * O) (saved for attention_backward_ctx), dQ over
//                 every key, and the block's own dK / dV (only this block sees its keys).
//   attention_backward_ctx  grid (ceil(Sc / N), nkv): context dK / dV of one key tile, summed over the
//                 blocks that see it in block order, so results never depend on scheduling.
//
// Why two backward passes, not one: in one pass either dQ (KV-major CTAs) or the context
// dK / dV (query-major CTAs) is summed across CTAs. Deterministically, that is per-CTA
// partials reduced in a fixed order: fp32 dQ partials of Mp x d per (block, key tile) pair,
// 32 KB each at Qwen3-8B, 3.6 GB per layer (14.5 GB at Kimi, N 32), twice the size of the
// score matrix that flash attention exists not to store, in an arena this file does not
// own. fp32 atomics are not deterministic (a 1-rank NCCL run is tested bit-equal to plain
// CUDA; cuda-emu-attention compares two thread orders bit for bit); int64 fixed-point
// atomics are, but that is 0.9 G 8-byte atomics per layer at Qwen3-8B, at an L2 atomic rate
// nothing here states; CTAs spinning until their turn (flash-attention 3's deterministic
// mode) assume co-resident CTAs, which CUDA does not guarantee and the emulator (blocks one
// after another) cannot run. bench/attn_single_pass.py prices the fp32-partials pass with
// gpu_model.py's terms: 11.6 ms against these two passes' 16.2 at Qwen3-8B (the scratch's
// HBM traffic hidden under the products), 48.3 against 44.2 at Kimi.
#include <float.h>
#include <mma.h>

#include <cstring>
#include <initializer_list>
#include <type_traits>

#include "common.cuh"

// Loop unrolling for nvcc; the emulator's host compilers do not know the pragma (and need
// no unrolling to be right).
#ifdef DFLASH_CUDA_EMU
#define DF_UNROLL
#define DF_NO_UNROLL
#else
#define DF_UNROLL _Pragma("unroll")
#define DF_NO_UNROLL _Pragma("unroll 1")
#endif

namespace {

namespace wmma = nvcuda::wmma;

constexpr int kMaxMp = DF_CU_ATTN_MAX_ROWS; // packed rows per CTA (train/dfcuda.h)
constexpr int kMaxD = DF_CU_ATTN_MAX_D;
constexpr int kPadH = 8, kPadF = 4; // bf16 / fp32 row padding (16 bytes)

struct Shape {
  int B, Sc, nh, nkv, d, window;
  const int32_t *anchors;
  float scale;
  int grp, M, Mp, N, warps; // packing and tiles (see the header)
  int dp;                   // head_dim padded to 16 in shared memory (the WMMA K)
};

// Shared memory of one CTA: offsets in bytes, each region on 128 bytes.
struct Smem {
  size_t q, dout, k, v, s, dp, p, ds, acc, acc2, st1, st2, total;
};
enum Kind { FWD, BWD_Q, BWD_CTX };

__host__ __device__ inline size_t up128(size_t x) { return (x + 127) & ~(size_t)127; }

__host__ __device__ inline Smem smem_layout(Kind kind, int Mp, int N, int dp) {
  size_t ldh = dp + kPadH, ldn = N + kPadF, ldp = N + kPadH, ldo = dp + kPadF, at = 0;
  Smem m{};
  auto take = [&at](size_t bytes) {
    size_t o = at;
    at = up128(at + bytes);
    return o;
  };
  m.q = take(2 * Mp * ldh);
  m.dout = kind == FWD ? 0 : take(2 * Mp * ldh);
  m.k = take(2 * N * ldh);
  m.v = take(2 * N * ldh);
  m.s = take(4 * Mp * ldn);
  m.dp = kind == FWD ? 0 : take(4 * Mp * ldn);
  m.p = take(2 * Mp * ldp);
  m.ds = kind == FWD ? 0 : take(2 * Mp * ldp);
  // fwd: O [Mp][ldo]; bwd_q: dQ [Mp][ldo] and a [N][ldo] scratch; bwd_ctx: dK, dV [N][ldo].
  m.acc = take(4 * (kind == BWD_CTX ? N : Mp) * ldo);
  m.acc2 = kind == FWD ? 0 : take(4 * N * ldo);
  m.st1 = take(4 * Mp);
  m.st2 = take(4 * Mp);
  m.total = at;
  return m;
}

struct alignas(128) SmemBase {
  float f[32];
};

__device__ __forceinline__ int n_ctx(const Shape &s, int a) { return a < s.Sc ? a : s.Sc; }

// Whether query j (block with anchor a) sees key `key` (< nctx: context row, else block row
// key - nctx).
__device__ __forceinline__ bool visible(const Shape &s, int a, int nctx, int j, int key) {
  if (key < nctx) return s.window <= 0 || key >= a + j - (s.window - 1);
  int p = key - nctx;
  return s.window <= 0 || (p <= j && p >= j - (s.window - 1));
}

// First context row any query of the block can see.
__device__ __forceinline__ int ctx_lo(const Shape &s, int a) {
  if (s.window <= 0) return 0;
  int lo = a - (s.window - 1);
  return lo > 0 ? lo : 0;
}

// Threads per row for the element-wise passes: a power of two with Mp * tpr <= threads.
__device__ __forceinline__ int rows_tpr(const Shape &s) {
  int t = 1;
  while (2 * t * s.Mp <= 32 * s.warps) t *= 2;
  return t;
}

// Global row of packed row r (j = r / grp, head g * grp + r % grp) of block n.
__device__ __forceinline__ size_t q_row(const Shape &s, int n, int g, int r) {
  return ((size_t)n * s.B + r / s.grp) * s.nh + (size_t)g * s.grp + r % s.grp;
}

// 8 bf16 (16 bytes) at once: global rows are d * 2 bytes with d a multiple of 8, tensors
// 16-byte aligned (checked by the launchers), shared rows (dp + 8) * 2 bytes.
__device__ __forceinline__ void copy8(bf16 *dst, const bf16 *src) {
#ifdef DFLASH_CUDA_EMU
  if ((uintptr_t)dst % 16 || (uintptr_t)src % 16) // the hardware's misaligned address fault
    ::dfemu::device_fault("attention: 16-byte copy %p <- %p not aligned", (void *)dst,
                          (const void *)src);
  std::memcpy(dst, src, 16); // host C++: no type punning
#else
  *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
#endif
}
__device__ __forceinline__ void zero8(bf16 *dst) {
#ifdef DFLASH_CUDA_EMU
  std::memset(dst, 0, 16);
#else
  *reinterpret_cast<uint4 *>(dst) = make_uint4(0, 0, 0, 0);
#endif
}

// The block's packed query rows (q or dout) into shared bf16 [Mp][ldh]; padding rows and
// columns zero (never poison: a tensor-core product with NaN is NaN even where P is 0).
__device__ void load_q_rows(const Shape &s, bf16 *dst, const bf16 *src, int n, int g) {
  int ldh = s.dp + kPadH, per_row = s.dp / 8;
  for (int e = threadIdx.x; e < s.Mp * per_row; e += blockDim.x) {
    int r = e / per_row, c = e % per_row * 8;
    if (r < s.M && c < s.d) copy8(dst + r * ldh + c, src + q_row(s, n, g, r) * s.d + c);
    else zero8(dst + r * ldh + c);
  }
}

// cnt key / value rows of kv head g from `kc`/`vc` (row i at i * nkv + g) into shared
// [N][ldh]; rows cnt.. up to a multiple of 16 zero.
__device__ void load_kv_rows(const Shape &s, bf16 *K, bf16 *V, const bf16 *kc, const bf16 *vc,
                             size_t row0, int cnt, int g) {
  int ldh = s.dp + kPadH, rows = (cnt + 15) / 16 * 16; // rows past that are never read
  int per_row = s.dp / 8;
  for (int e = threadIdx.x; e < rows * per_row; e += blockDim.x) {
    int k = e / per_row, c = e % per_row * 8;
    size_t at = ((row0 + k) * s.nkv + g) * s.d + c;
    if (k < cnt && c < s.d) {
      copy8(K + k * ldh + c, kc + at);
      copy8(V + k * ldh + c, vc + at);
    } else {
      zero8(K + k * ldh + c);
      zero8(V + k * ldh + c);
    }
  }
}

// Register blocking of the products: a warp computes a unit of RM x RN 16x16 output tiles,
// loading RM A and RN B fragments per 16-wide K step for RM * RN mma_sync, so the fragment
// traffic through shared memory is (RM + RN) / (2 * RM * RN) of one tile per warp's: 1 (1x1),
// 3/4 (1x2), 1/2 (2x2). Each product has its unit fixed at compile time (chosen so that the
// Qwen3-8B and Kimi shapes give every warp a unit) and clipped at the matrix edge: one
// instantiation per call site, because ptxas, given a choice at run time between two units
// at each call site, took 238-255 registers with spills on sm_100. The blocking never
// changes the arithmetic: every output element is its own sum in k order whichever warp
// computes it.
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;

// c[i][j] += A(tile row tm + i) * B(tile column tn + j) over K, for i < rm, j < rn: the
// unit's rm A and rn B fragments loaded once per 16-wide K step. A_COL: A(m, k) at
// A[k * lda + m], else A[m * lda + k]; B_COL: B(k, n) at B[n * ldb + k], else B[k * ldb + n].
// The loops over the unit's tiles are unrolled so that the fragment arrays stay in
// registers (left to the compiler they were not in the larger kernels: local memory and
// spills on sm_100); the K loop is not, so that one step's fragments are live at a time.
template <bool A_COL, bool B_COL, int RM, int RN>
__device__ __forceinline__ void unit_mma(Acc (&c)[RM][RN], const bf16 *A, int lda, const bf16 *Bm,
                                         int ldb, int tm, int tn, int rm, int rn, int K) {
  typedef typename std::conditional<A_COL, wmma::col_major, wmma::row_major>::type LA;
  typedef typename std::conditional<B_COL, wmma::col_major, wmma::row_major>::type LB;
  DF_NO_UNROLL
  for (int k0 = 0; k0 < K; k0 += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, LA> fa[RM];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, LB> fb[RN];
    DF_UNROLL
    for (int i = 0; i < RM; i++) {
      int m0 = (tm + i) * 16;
      if (i < rm) wmma::load_matrix_sync(fa[i], A_COL ? A + k0 * lda + m0 : A + m0 * lda + k0, lda);
    }
    DF_UNROLL
    for (int j = 0; j < RN; j++) {
      int n0 = (tn + j) * 16;
      if (j < rn)
        wmma::load_matrix_sync(fb[j], B_COL ? Bm + n0 * ldb + k0 : Bm + k0 * ldb + n0, ldb);
    }
    DF_UNROLL
    for (int i = 0; i < RM; i++) {
      DF_UNROLL
      for (int j = 0; j < RN; j++)
        if (i < rm && j < rn) wmma::mma_sync(c[i][j], fa[i], fb[j], c[i][j]);
    }
  }
}

// C (fp32 [M][ldc]) = A (M x K) * B (K x N) (+ C when acc), all in shared memory, in units
// of RM x RN tiles clipped at the edges. The call's units are numbers u0.. of a list dealt
// round robin to the warps (so that two products issued one after the other share them).
template <bool A_COL, bool B_COL, int RM, int RN>
__device__ void gemm_units(float *C, int ldc, const bf16 *A, int lda, const bf16 *Bm, int ldb,
                           int M, int N, int K, bool acc, int u0) {
  int warp = threadIdx.x / 32, warps = blockDim.x / 32, mt = M / 16, nt = N / 16;
  int un = (nt + RN - 1) / RN, units = ((mt + RM - 1) / RM) * un;
  for (int u = ((warp - u0) % warps + warps) % warps; u < units; u += warps) {
    int tm = u / un * RM, tn = u % un * RN; // first tile row / column of the unit
    int rm = mt - tm < RM ? mt - tm : RM, rn = nt - tn < RN ? nt - tn : RN;
    Acc c[RM][RN];
    DF_UNROLL
    for (int i = 0; i < RM; i++) {
      DF_UNROLL
      for (int j = 0; j < RN; j++) {
        if (i >= rm || j >= rn) continue;
        float *Ct = C + (tm + i) * 16 * ldc + (tn + j) * 16;
        if (acc) wmma::load_matrix_sync(c[i][j], Ct, ldc, wmma::mem_row_major);
        else wmma::fill_fragment(c[i][j], 0.0f);
      }
    }
    unit_mma<A_COL, B_COL, RM, RN>(c, A, lda, Bm, ldb, tm, tn, rm, rn, K);
    DF_UNROLL
    for (int i = 0; i < RM; i++) {
      DF_UNROLL
      for (int j = 0; j < RN; j++)
        if (i < rm && j < rn)
          wmma::store_matrix_sync(C + (tm + i) * 16 * ldc + (tn + j) * 16, c[i][j], ldc,
                                  wmma::mem_row_major);
    }
  }
}

// The product in units of RM x RN; returns the unit number after its own, for a product
// dealt right after it (u0 = that number).
template <bool A_COL, bool B_COL, int RM, int RN>
__device__ int warp_gemm(float *C, int ldc, const bf16 *A, int lda, const bf16 *Bm, int ldb, int M,
                         int N, int K, bool acc, int u0 = 0) {
  gemm_units<A_COL, B_COL, RM, RN>(C, ldc, A, lda, Bm, ldb, M, N, K, acc, u0);
  return u0 + ((M / 16 + RM - 1) / RM) * ((N / 16 + RN - 1) / RN);
}

// Accumulators held in the warps' registers across a kernel's loop, so that its products
// neither load nor store them through shared memory each step: `mats` matrices of M x N
// outputs in 2x2 units, dealt round robin to the warps (unit u, of the first matrix's then
// the second's, at warp u % W in slot u / W), when every warp needs at most SLOTS slots
// (4 fragments, 32 registers each); otherwise the kernel keeps them in shared memory.
// attention_backward_ctx holds its key tile's dK and dV (N x dp, over the blocks) in 2 slots: the
// Qwen3-8B and Kimi shapes fit. attention_backward_q holds its block's dQ (Mp x dp, over the key
// tiles) in 1: Qwen3-8B fits, Kimi (Mp 128) does not (2 slots there took 255 registers
// and spilled on sm_120).
constexpr int kCtxSlots = 2, kQSlots = 1;
__host__ __device__ inline int units22(int M, int N) {
  return (M / 16 + 1) / 2 * ((N / 16 + 1) / 2);
}
__host__ __device__ inline bool held_fits(int slots, int mats, int M, int N, int warps) {
  return mats * units22(M, N) <= slots * warps;
}
template <int SLOTS>
struct Held {
  Acc c[SLOTS][2][2];
};

template <int SLOTS>
__device__ void held_zero(Held<SLOTS> &h) {
  DF_UNROLL
  for (int i = 0; i < SLOTS; i++) {
    DF_UNROLL
    for (int j = 0; j < 4; j++) wmma::fill_fragment(h.c[i][j / 2][j % 2], 0.0f);
  }
}

// This warp's unit in `slot`: its matrix and first tile row / column; false if none.
__device__ __forceinline__ bool held_slot(int mats, int M, int N, int slot, int &mat, int &tm,
                                          int &tn) {
  int per = units22(M, N), u = threadIdx.x / 32 + slot * (blockDim.x / 32);
  if (u >= mats * per) return false;
  int un = (N / 16 + 1) / 2;
  mat = u / per, tm = u % per / un * 2, tn = u % per % un * 2;
  return true;
}

// h[mat] += A_mat (M x K) * B_mat (K x N) for output rows below mvalid (the rest get
// nothing); layouts as warp_gemm's.
template <bool A_COL, bool B_COL, int SLOTS>
__device__ void held_step(Held<SLOTS> &h, int mats, int M, int N, int K, int mvalid, const bf16 *A0,
                          const bf16 *A1, int lda, const bf16 *B0, const bf16 *B1, int ldb) {
  int mt = mvalid / 16, nt = N / 16;
  DF_UNROLL
  for (int slot = 0; slot < SLOTS; slot++) {
    int mat, tm, tn;
    if (!held_slot(mats, M, N, slot, mat, tm, tn) || tm >= mt) continue;
    int rm = mt - tm < 2 ? mt - tm : 2, rn = nt - tn < 2 ? nt - tn : 2;
    unit_mma<A_COL, B_COL, 2, 2>(h.c[slot], mat ? A1 : A0, lda, mat ? B1 : B0, ldb, tm, tn, rm, rn,
                                 K);
  }
}

// The registers into C0 / C1 (fp32 [M][ldc]).
template <int SLOTS>
__device__ void held_store(const Held<SLOTS> &h, int mats, int M, int N, float *C0, float *C1,
                           int ldc) {
  int mt = M / 16, nt = N / 16;
  DF_UNROLL
  for (int slot = 0; slot < SLOTS; slot++) {
    int mat, tm, tn;
    if (!held_slot(mats, M, N, slot, mat, tm, tn)) continue;
    DF_UNROLL
    for (int i = 0; i < 2; i++) {
      DF_UNROLL
      for (int j = 0; j < 2; j++)
        if (tm + i < mt && tn + j < nt)
          wmma::store_matrix_sync((mat ? C1 : C0) + (tm + i) * 16 * ldc + (tn + j) * 16,
                                  h.c[slot][i][j], ldc, wmma::mem_row_major);
    }
  }
}

__device__ __forceinline__ float row_max(float v, int tpr) {
  for (int o = tpr / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o, tpr));
  return v;
}
__device__ __forceinline__ float row_sum(float v, int tpr) {
  for (int o = tpr / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o, tpr);
  return v;
}

// One key tile: keys of the tile are tile-local k < cnt; key index (for visible()) k0 + k.
struct Tile {
  bool blk;    // the block's own keys
  int k0, cnt; // first key (ctx: context row; blk: nctx + block row) and how many
};
// Columns of the tile the products cover: cnt rounded up to 16, so a block tile of B 16 in an
// N 64 tile costs 16 columns, not 64 (columns past it are neither computed nor read).
__device__ __forceinline__ int width(Tile t) { return (t.cnt + 15) / 16 * 16; }

// Tiles of block n in order: context rows [lo, nctx) in steps of N, then the block's keys.
__device__ __forceinline__ int n_tiles(const Shape &s, int lo, int nctx) {
  return (nctx - lo + s.N - 1) / s.N + (s.B + s.N - 1) / s.N;
}
__device__ __forceinline__ Tile tile_at(const Shape &s, int lo, int nctx, int i) {
  int nc = (nctx - lo + s.N - 1) / s.N;
  if (i < nc) {
    int k0 = lo + i * s.N;
    return Tile{false, k0, nctx - k0 < s.N ? nctx - k0 : s.N};
  }
  int b0 = (i - nc) * s.N;
  return Tile{true, nctx + b0, s.B - b0 < s.N ? s.B - b0 : s.N};
}

__device__ void load_tile(const Shape &s, bf16 *K, bf16 *V, const bf16 *kc, const bf16 *vc,
                          const bf16 *kb, const bf16 *vb, int n, int nctx, Tile t, int g) {
  if (t.blk) load_kv_rows(s, K, V, kb, vb, (size_t)n * s.B + (t.k0 - nctx), t.cnt, g);
  else load_kv_rows(s, K, V, kc, vc, (size_t)t.k0, t.cnt, g);
}

// ---- forward -------------------------------------------------------------------------------
// Online softmax of one tile for the rows of this thread: S (scaled, masked) -> P (bf16),
// the row statistics m, l updated and O rescaled.
__device__ void softmax_tile(const Shape &s, float *S, bf16 *P, float *O, int a, int nctx, Tile t,
                             float &m, float &l) {
  int tpr = rows_tpr(s), r = threadIdx.x / tpr, c = threadIdx.x % tpr;
  int ldn = s.N + kPadF, ldp = s.N + kPadH, ldo = s.dp + kPadF;
  bool row = r < s.Mp, real = r < s.M;
  int j = r / s.grp;
  float mx = m;
  int nk = width(t);
  for (int k = c; row && k < nk; k += tpr) {
    float v = -FLT_MAX;
    if (real && k < t.cnt && visible(s, a, nctx, j, t.k0 + k)) v = S[r * ldn + k] * s.scale;
    S[r * ldn + k] = v;
    mx = fmaxf(mx, v);
  }
  mx = row_max(mx, tpr);
  float sum = 0;
  for (int k = c; row && k < nk; k += tpr) {
    float v = S[r * ldn + k];
    bf16 p = __float2bfloat16(v == -FLT_MAX ? 0.0f : __expf(v - mx));
    P[r * ldp + k] = p;
    sum += __bfloat162float(p); // the normaliser of exactly the P that PV multiplies
  }
  sum = row_sum(sum, tpr);
  float alpha = __expf(m - mx); // 1 while the row has seen nothing (both -FLT_MAX)
  l = l * alpha + sum;
  m = mx;
  for (int e = c; row && e < s.dp; e += tpr) O[r * ldo + e] *= alpha;
}

__global__ void attention_forward(Shape s, bf16 *out, float *lse, const bf16 *q, const bf16 *kc,
                                  const bf16 *vc, const bf16 *kb, const bf16 *vb) {
  DF_DYN_SHARED(SmemBase, smem_base);
  char *sm = (char *)smem_base;
  Smem L = smem_layout(FWD, s.Mp, s.N, s.dp);
  bf16 *Q = (bf16 *)(sm + L.q), *K = (bf16 *)(sm + L.k), *V = (bf16 *)(sm + L.v);
  bf16 *P = (bf16 *)(sm + L.p);
  float *S = (float *)(sm + L.s), *O = (float *)(sm + L.acc), *lrow = (float *)(sm + L.st1);
  float *mrow = (float *)(sm + L.st2);
  int n = blockIdx.x, g = blockIdx.y, d = s.d, dp = s.dp, ldh = dp + kPadH, ldo = dp + kPadF;
  int ldn = s.N + kPadF, ldp = s.N + kPadH;
  load_q_rows(s, Q, q, n, g);
  for (int e = threadIdx.x; e < s.Mp * ldo; e += blockDim.x) O[e] = 0.0f;
  int a = s.anchors[n], nctx = n_ctx(s, a), lo = ctx_lo(s, a) < nctx ? ctx_lo(s, a) : nctx;
  float m = -FLT_MAX, l = 0;
  for (int i = 0; i < n_tiles(s, lo, nctx); i++) {
    Tile t = tile_at(s, lo, nctx, i);
    __syncthreads(); // the previous tile's K, V and O are done with
    load_tile(s, K, V, kc, vc, kb, vb, n, nctx, t, g);
    __syncthreads();
    warp_gemm<false, true, 1, 2>(S, ldn, Q, ldh, K, ldh, s.Mp, width(t), dp, false); // QK^T
    __syncthreads();
    softmax_tile(s, S, P, O, a, nctx, t, m, l);
    __syncthreads();
    warp_gemm<false, false, 2, 2>(O, ldo, P, ldp, V, ldh, s.Mp, dp, width(t), true); // O += PV
  }
  int tpr = rows_tpr(s), r = threadIdx.x / tpr;
  if (r < s.Mp && threadIdx.x % tpr == 0) lrow[r] = l, mrow[r] = m;
  __syncthreads();
  for (int e = threadIdx.x; e < s.M * d; e += blockDim.x) {
    int rr = e / d, c = e % d;
    float lr = lrow[rr];
    out[q_row(s, n, g, rr) * d + c] = __float2bfloat16(lr > 0 ? O[rr * ldo + c] / lr : 0.0f);
  }
  for (int rr = threadIdx.x; rr < s.M; rr += blockDim.x)
    lse[q_row(s, n, g, rr)] = mrow[rr] + logf(lrow[rr]);
}

// ---- backward ------------------------------------------------------------------------------
// P = exp(S * scale - lse) and dS = P * (dP - D) * scale of one tile, both to bf16.
__device__ void ds_tile(const Shape &s, const float *S, const float *dP, bf16 *P, bf16 *dS,
                        const float *Ls, const float *Ds, int a, int nctx, Tile t) {
  int ldn = s.N + kPadF, ldp = s.N + kPadH, nk = width(t);
  for (int e = threadIdx.x; e < s.Mp * nk; e += blockDim.x) {
    int r = e / nk, k = e % nk;
    float p = 0, ds = 0;
    if (r < s.M && k < t.cnt && visible(s, a, nctx, r / s.grp, t.k0 + k)) {
      p = __expf(S[r * ldn + k] * s.scale - Ls[r]);
      ds = p * (dP[r * ldn + k] - Ds[r]) * s.scale;
    }
    P[r * ldp + k] = __float2bfloat16(p);
    dS[r * ldp + k] = __float2bfloat16(ds);
  }
}

// Rows [0, cnt) of the fp32 [N][ldo] tile T to bf16 rows of kv head g at dst (row i at
// (row0 + i) * nkv + g).
__device__ void store_kv_rows(const Shape &s, bf16 *dst, const float *T, size_t row0, int cnt,
                              int g) {
  int ldo = s.dp + kPadF;
  for (int e = threadIdx.x; e < cnt * s.d; e += blockDim.x) {
    int k = e / s.d, c = e % s.d;
    dst[((row0 + k) * s.nkv + g) * s.d + c] = __float2bfloat16(T[k * ldo + c]);
  }
}

// Per (block, kv head): D, dQ over every key, and the block's own dK / dV; REG: dQ held in
// registers (held_fits), else in shared memory.
template <bool REG>
__global__ void attention_backward_q(Shape s, bf16 *dq, bf16 *dkb, bf16 *dvb, float *Dg,
                                     const bf16 *dout, const bf16 *o, const float *lse,
                                     const bf16 *q, const bf16 *kc, const bf16 *vc, const bf16 *kb,
                                     const bf16 *vb) {
  DF_DYN_SHARED(SmemBase, smem_base);
  char *sm = (char *)smem_base;
  Smem L = smem_layout(BWD_Q, s.Mp, s.N, s.dp);
  bf16 *Q = (bf16 *)(sm + L.q), *dO = (bf16 *)(sm + L.dout), *K = (bf16 *)(sm + L.k);
  bf16 *V = (bf16 *)(sm + L.v), *P = (bf16 *)(sm + L.p), *dS = (bf16 *)(sm + L.ds);
  float *S = (float *)(sm + L.s), *dP = (float *)(sm + L.dp), *dQ = (float *)(sm + L.acc);
  float *T = (float *)(sm + L.acc2), *Ls = (float *)(sm + L.st1), *Ds = (float *)(sm + L.st2);
  int n = blockIdx.x, g = blockIdx.y, d = s.d, dp = s.dp, ldh = dp + kPadH, ldo = dp + kPadF;
  int ldn = s.N + kPadF, ldp = s.N + kPadH;
  load_q_rows(s, Q, q, n, g);
  load_q_rows(s, dO, dout, n, g);
  Held<kQSlots> hq;
  if (REG) held_zero(hq);
  else
    for (int e = threadIdx.x; e < s.Mp * ldo; e += blockDim.x) dQ[e] = 0.0f;
  // D = rowsum(dO * O) from the rounded output the forward stored.
  int tpr = rows_tpr(s), r = threadIdx.x / tpr, c = threadIdx.x % tpr;
  float part = 0;
  for (int e = c; r < s.M && e < d; e += tpr) {
    size_t at = q_row(s, n, g, r) * d + e;
    part += __bfloat162float(dout[at]) * __bfloat162float(o[at]);
  }
  part = row_sum(part, tpr);
  if (r < s.Mp && c == 0) {
    Ds[r] = r < s.M ? part : 0.0f;
    Ls[r] = r < s.M ? lse[q_row(s, n, g, r)] : 0.0f;
    if (r < s.M) Dg[q_row(s, n, g, r)] = part;
  }
  int a = s.anchors[n], nctx = n_ctx(s, a), lo = ctx_lo(s, a) < nctx ? ctx_lo(s, a) : nctx;
  for (int i = 0; i < n_tiles(s, lo, nctx); i++) {
    Tile t = tile_at(s, lo, nctx, i);
    __syncthreads();
    load_tile(s, K, V, kc, vc, kb, vb, n, nctx, t, g);
    __syncthreads();
    int nk = width(t);
    // S = Q K^T and dP = dO V^T dealt to the warps together
    int u = warp_gemm<false, true, 2, 2>(S, ldn, Q, ldh, K, ldh, s.Mp, nk, dp, false);
    warp_gemm<false, true, 2, 2>(dP, ldn, dO, ldh, V, ldh, s.Mp, nk, dp, false, u);
    __syncthreads();
    ds_tile(s, S, dP, P, dS, Ls, Ds, a, nctx, t);
    __syncthreads();
    if (REG) held_step<false, false>(hq, 1, s.Mp, dp, nk, s.Mp, dS, dS, ldp, K, K, ldh);
    else warp_gemm<false, false, 2, 2>(dQ, ldo, dS, ldp, K, ldh, s.Mp, dp, nk, true); // dQ += dS K
    if (!t.blk) continue;
    size_t row0 = (size_t)n * s.B + (t.k0 - nctx);
    warp_gemm<true, false, 1, 1>(T, ldo, dS, ldp, Q, ldh, nk, dp, s.Mp, false); // dK = dS^T Q
    __syncthreads();
    store_kv_rows(s, dkb, T, row0, t.cnt, g);
    __syncthreads();
    warp_gemm<true, false, 1, 1>(T, ldo, P, ldp, dO, ldh, nk, dp, s.Mp, false); // dV = P^T dO
    __syncthreads();
    store_kv_rows(s, dvb, T, row0, t.cnt, g);
  }
  if (REG) held_store(hq, 1, s.Mp, dp, dQ, dQ, ldo); // dQ is written by these stores only
  // dQ's last product done (already so when the last tile is a block tile, as it always is;
  // kept so that the order of the tiles may change).
  __syncthreads();
  for (int e = threadIdx.x; e < s.M * d; e += blockDim.x) {
    int rr = e / d, cc = e % d;
    dq[q_row(s, n, g, rr) * d + cc] = __float2bfloat16(dQ[rr * ldo + cc]);
  }
}

// Per (context key tile, kv head): dK, dV of the tile over the blocks that see it; REG: the
// accumulators in registers (held_fits), else in shared memory.
template <bool REG>
__global__ void attention_backward_ctx(Shape s, int n_blocks, bf16 *dkc, bf16 *dvc, const float *Dg,
                                       const bf16 *dout, const float *lse, const bf16 *q,
                                       const bf16 *kc, const bf16 *vc) {
  DF_DYN_SHARED(SmemBase, smem_base);
  char *sm = (char *)smem_base;
  Smem L = smem_layout(BWD_CTX, s.Mp, s.N, s.dp);
  bf16 *Q = (bf16 *)(sm + L.q), *dO = (bf16 *)(sm + L.dout), *K = (bf16 *)(sm + L.k);
  bf16 *V = (bf16 *)(sm + L.v), *P = (bf16 *)(sm + L.p), *dS = (bf16 *)(sm + L.ds);
  float *S = (float *)(sm + L.s), *dP = (float *)(sm + L.dp), *dK = (float *)(sm + L.acc);
  float *dV = (float *)(sm + L.acc2), *Ls = (float *)(sm + L.st1), *Ds = (float *)(sm + L.st2);
  int p0 = blockIdx.x * s.N, g = blockIdx.y, dp = s.dp, ldh = dp + kPadH, ldo = dp + kPadF;
  int ldn = s.N + kPadF, ldp = s.N + kPadH;
  int cnt = s.Sc - p0 < s.N ? s.Sc - p0 : s.N;
  load_kv_rows(s, K, V, kc, vc, (size_t)p0, cnt, g);
  Held<kCtxSlots> kv;
  if (REG) {
    held_zero(kv);
  } else {
    for (int e = threadIdx.x; e < s.N * ldo; e += blockDim.x) dK[e] = dV[e] = 0.0f;
  }
  for (int n = 0; n < n_blocks; n++) {
    int a = s.anchors[n], nctx = n_ctx(s, a);
    if (p0 >= nctx || p0 + cnt <= ctx_lo(s, a)) continue;
    // Keys of this tile past nctx are not context for block n: the tile is cut there.
    Tile t{false, p0, nctx - p0 < cnt ? nctx - p0 : cnt};
    __syncthreads();
    load_q_rows(s, Q, q, n, g);
    load_q_rows(s, dO, dout, n, g);
    for (int r = threadIdx.x; r < s.Mp; r += blockDim.x) {
      Ls[r] = r < s.M ? lse[q_row(s, n, g, r)] : 0.0f;
      Ds[r] = r < s.M ? Dg[q_row(s, n, g, r)] : 0.0f;
    }
    __syncthreads();
    int nk = width(t);
    int u = warp_gemm<false, true, 2, 2>(S, ldn, Q, ldh, K, ldh, s.Mp, nk, dp, false);
    warp_gemm<false, true, 2, 2>(dP, ldn, dO, ldh, V, ldh, s.Mp, nk, dp, false, u);
    __syncthreads();
    ds_tile(s, S, dP, P, dS, Ls, Ds, a, nctx, t);
    __syncthreads();
    if (REG) {
      // dK += dS^T Q, dV += P^T dO: keys past nk are not this block's
      held_step<true, false>(kv, 2, s.N, dp, s.Mp, nk, dS, P, ldp, Q, dO, ldh);
    } else {
      u = warp_gemm<true, false, 2, 2>(dK, ldo, dS, ldp, Q, ldh, nk, dp, s.Mp, true); // dS^T Q
      warp_gemm<true, false, 2, 2>(dV, ldo, P, ldp, dO, ldh, nk, dp, s.Mp, true, u);  // P^T dO
    }
  }
  if (REG) held_store(kv, 2, s.N, dp, dK, dV, ldo); // dK, dV are written by these stores only
  __syncthreads();
  store_kv_rows(s, dkc, dK, (size_t)p0, cnt, g);
  store_kv_rows(s, dvc, dV, (size_t)p0, cnt, g);
}

// ---- host side -----------------------------------------------------------------------------
int max_smem() {
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return 0;
  return v;
}

// The widest key tile whose shared memory fits; 0 when none does.
int pick_n(Kind kind, int Mp, int dp, size_t limit) {
  for (int N = 64; N >= 16; N /= 2)
    if (smem_layout(kind, Mp, N, dp).total <= limit) return N;
  return 0;
}

// The shape checks of both passes: a forward that runs must have a backward that runs.
dflash_status shape_of(const df_attn_dev *a, Kind kind, Shape *out) {
  int grp = a->nkv > 0 && a->nh % a->nkv == 0 ? a->nh / a->nkv : 0;
  int M = a->B * grp, Mp = (M + 15) / 16 * 16, dp = (a->d + 15) / 16 * 16;
  if (a->d % 8 || a->d <= 0 || a->d > kMaxD || !grp || a->B <= 0 || Mp > kMaxMp)
    return df_error(DFLASH_E_UNSUPPORTED,
                    "CUDA attention: head_dim %d (a multiple of 8, at "
                    "most %d), block size %d times %d query heads per kv head (%d over %d: at "
                    "most %d rows) are not supported together",
                    a->d, kMaxD, a->B, grp, a->nh, a->nkv, kMaxMp);
  size_t limit = (size_t)max_smem();
  int n_kind = 0, worst = 0;
  for (int k = FWD; k <= BWD_CTX; k++) {
    int N = pick_n((Kind)k, Mp, dp, limit);
    if (!N) {
      worst = k;
      size_t need = smem_layout((Kind)k, Mp, 16, dp).total;
      return df_error(DFLASH_E_UNSUPPORTED,
                      "CUDA attention: head_dim %d with %d rows per CTA "
                      "(block size %d times %d query heads per kv head) needs %zu bytes of "
                      "shared memory in its %s, more than the %zu this device has per block",
                      a->d, Mp, a->B, grp, need, worst == FWD ? "forward" : "backward", limit);
    }
    if (k == kind) n_kind = N;
  }
  *out = Shape{a->B,     a->Sc, a->nh, a->nkv, a->d,   a->window,        a->anchors,
               a->scale, grp,   M,     Mp,     n_kind, Mp >= 64 ? 8 : 4, dp};
  return DFLASH_OK;
}

// The kernels move rows 16 bytes at a time.
dflash_status check_aligned(std::initializer_list<const void *> ptrs) {
  for (const void *p : ptrs)
    if ((uintptr_t)p % 16)
      return df_error(DFLASH_E_INVALID_ARG, "CUDA attention: tensor %p is not 16-byte aligned", p);
  return DFLASH_OK;
}

template <typename K>
dflash_status launch_smem(K kernel, size_t bytes) {
  DF_CU(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
  return DFLASH_OK;
}

size_t smem_of(Kind kind, const Shape &s) { return smem_layout(kind, s.Mp, s.N, s.dp).total; }

} // namespace

dflash_status k_attention_check(const df_attn_dev *a) {
  Shape s;
  return shape_of(a, FWD, &s);
}

dflash_status k_attention_fwd(cudaStream_t st, const df_attn_dev *a, bf16 *out, float *lse,
                              const bf16 *q, const bf16 *kc, const bf16 *vc, const bf16 *kb,
                              const bf16 *vb) {
  Shape s;
  DF_TRY(shape_of(a, FWD, &s));
  if (a->n_blocks <= 0) return DFLASH_OK;
  DF_TRY(check_aligned({q, kc, vc, kb, vb}));
  size_t smem = smem_of(FWD, s);
  DF_TRY(launch_smem(attention_forward, smem));
  DF_LAUNCH(dim3(a->n_blocks, a->nkv), 32 * s.warps, smem, st, attention_forward)
  (s, out, lse, q, kc, vc, kb, vb);
  DF_CU(cudaGetLastError());
  return DFLASH_OK;
}

dflash_status k_attention_bwd(cudaStream_t st, const df_attn_dev *a, bf16 *dq, bf16 *dkc, bf16 *dvc,
                              bf16 *dkb, bf16 *dvb, float *D, const bf16 *dout, const bf16 *out,
                              const float *lse, const bf16 *q, const bf16 *kc, const bf16 *vc,
                              const bf16 *kb, const bf16 *vb) {
  Shape s1, s2;
  DF_TRY(shape_of(a, BWD_Q, &s1));
  DF_TRY(shape_of(a, BWD_CTX, &s2));
  if (a->n_blocks <= 0) return DFLASH_OK;
  DF_TRY(check_aligned({q, kc, vc, kb, vb, dout}));
  size_t smem1 = smem_of(BWD_Q, s1);
  dim3 grid1(a->n_blocks, a->nkv);
  if (held_fits(kQSlots, 1, s1.Mp, s1.dp, s1.warps)) {
    DF_TRY(launch_smem(attention_backward_q<true>, smem1));
    DF_LAUNCH(grid1, 32 * s1.warps, smem1, st, attention_backward_q<true>)
    (s1, dq, dkb, dvb, D, dout, out, lse, q, kc, vc, kb, vb);
  } else {
    DF_TRY(launch_smem(attention_backward_q<false>, smem1));
    DF_LAUNCH(grid1, 32 * s1.warps, smem1, st, attention_backward_q<false>)
    (s1, dq, dkb, dvb, D, dout, out, lse, q, kc, vc, kb, vb);
  }
  DF_CU(cudaGetLastError());
  if (a->Sc <= 0) return DFLASH_OK;
  size_t smem2 = smem_of(BWD_CTX, s2);
  dim3 grid2((a->Sc + s2.N - 1) / s2.N, a->nkv);
  if (held_fits(kCtxSlots, 2, s2.N, s2.dp, s2.warps)) {
    DF_TRY(launch_smem(attention_backward_ctx<true>, smem2));
    DF_LAUNCH(grid2, 32 * s2.warps, smem2, st, attention_backward_ctx<true>)
    (s2, a->n_blocks, dkc, dvc, D, dout, lse, q, kc, vc);
  } else {
    DF_TRY(launch_smem(attention_backward_ctx<false>, smem2));
    DF_LAUNCH(grid2, 32 * s2.warps, smem2, st, attention_backward_ctx<false>)
    (s2, a->n_blocks, dkc, dvc, D, dout, lse, q, kc, vc);
  }
  DF_CU(cudaGetLastError());
  return DFLASH_OK;
}
