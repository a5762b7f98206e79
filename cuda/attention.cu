// DFlash-masked attention on tensor cores, FlashAttention-2 style: mma.sync.m16n8k16 (bf16
// in, fp32 accumulate), ldmatrix and cp.async (cuda/tc.cuh). The scores S, the
// probabilities P, dP and dS live in registers, in the accumulator layout of the mma and
// repacked to bf16 A fragments for the next product; only Q / dO / K / V tiles are in shared
// memory, so a CTA fits the 99 KB per block of sm_120 (RTX PRO 6000 Blackwell) at the Kimi
// and Qwen3-8B shapes. No S x S matrix: an online softmax over key tiles.
//
// The mask is ops.c's `visible`: a block with anchor a sees context rows s < a (sliding
// layers: s >= a + j - (window - 1)) and its own keys (sliding: j - (window - 1) .. j).
//
// Tiles (read by bench/gpu_model.py; sizes in elements unless they say bytes):
//   rows     one CTA of the forward and of attention_backward_q takes one block n and one kv
//            head g: its B query rows times the grp = nh / nkv query heads sharing g, M = B *
//            grp rows (row r = j * grp + hh), padded to Mp = 16 * ceil(M / 16) <= 128; warp w
//            owns rows 16w .. 16w + 15 (Mp / 16 warps: 8 at Kimi, 4 at Qwen3-8B).
//   keys     N per tile: 64, or 32 / 16 when 64 does not fit the device's shared memory per
//            block (pick_n, from cudaDevAttrMaxSharedMemoryPerBlockOptin when the trainer is
//            created); context keys and the block's own keys are separate tiles, a tile of
//            cnt keys costs w = 16 * ceil(cnt / 16) columns.
//   kv CTAs  attention_backward_kv takes N keys of one kv head (context keys, or a block's own
//            keys), a warp per 16 keys (swap-AB: it computes S^T = K Q^T and dP^T = V dO^T,
//            so P^T and dS^T are A fragments of dV += P^T dO and dK += dS^T Q), over the query
//            rows of each block that sees them, 32 at a time; kvg = 2 row groups of N / 16
//            warps (8 at N 64) take alternate 32-row chunks and their sums are added at the
//            end, group 0's + group 1's through shared memory over the Q / dO rows, when
//            N x dp fp32 fits there and Mp >= 64 (kv_groups), else kvg = 1.
//   shared   bf16 rows of dp = 16 * ceil(d / 16) elements; when dp is a multiple of 64 the
//            rows are unpadded and their 16-byte chunks XOR-swizzled (chunk ^ row % 8: the 8
//            rows an ldmatrix reads hit distinct banks), else padded to ld = dp + 8. Every
//            region starts on 128 bytes. Bytes per CTA:
//     attention_forward       2*Mp*ld + 4*N*ld
//     attention_backward_q    4*Mp*ld + 4*N*ld
//     attention_backward_kv   4*Mp*ld + 4*N*ld + 8*Mp
//     e.g. d 128 (ld 128), Mp 128 (Kimi 64/8 at B 16), N 64: 65,536 / 98,304 / 99,328 bytes,
//     all <= 101,376 (sm_120); Mp 64 (Qwen3-8B 32/8): 49,152 / 65,536 / 66,048.
//   registers  per lane: S (and dP) N / 2 floats, the O / dQ accumulator dp / 2 floats (dK,
//            dV dp / 2 each); kernels are instantiated for dp <= 64, 128, 256, every loop
//            over fragments unrolled to those bounds so that the arrays stay in registers.
//            ptxas -v (CUDA 13.0, sm_120, -O3; 2026-12-06) at dp <= 128: attention_forward
//            146, attention_backward_q 165, attention_backward_kv 224 (context) / 201 (block),
//            no spills (at 256 threads one CTA per SM, as the shared memory leaves it); dp
//            256 takes 255 (256 threads x 255 still fit 65,536 per block) and spills.
//   FLOPs    (tensor-core, per CTA; keys = the sum of w over the tiles visited)
//            forward 4 * Mp * keys * dp (QK^T, PV); attention_backward_q 6 * Mp * keys * dp
//            (QK^T, dO V^T, dS K); attention_backward_kv 8 * Mp * w * dp per block that sees
//            its tile (K Q^T, V dO^T, dS^T Q, P^T dO), context tiles and each block's own keys.
//
// Kernels:
//   attention_forward      grid (n_blocks, nkv): out (bf16) and the row log-sum-exp lse (f32
//                          [T, nh]), kept for the backward.
//   attention_backward_q   grid (n_blocks, nkv): D = rowsum(dO * O) (saved for the kv pass)
//                          and dQ over every key.
//   attention_backward_kv  grid (ceil(Sc / N), nkv): context dK / dV of one key tile, summed
//                          over the blocks that see it in block order; <BLK>: grid (n_blocks *
//                          ceil(B / N), nkv), a block's own dK / dV (only it sees them).
//   Every sum has a fixed order: no atomics, results never depend on scheduling.
//
// Why separate dQ and dK / dV passes: in one pass either dQ (KV-major CTAs) or the context
// dK / dV (query-major CTAs) is summed across CTAs; deterministically that is fp32 partials
// per (block, key tile) reduced in a fixed order, 14.5 GB per layer at Kimi (N 32), in an
// arena this file does not own; fp32 atomics are not deterministic (a 1-rank NCCL run is
// tested bit-equal to plain CUDA; cuda-emu-attention compares two thread orders bit for bit).
// The price is QK^T and dO V^T computed in both passes: 7 products per score, not 5.
#include <float.h>

#include <cstring>
#include <initializer_list>

#include "common.cuh"
#include "tc.cuh"

// Loop unrolling for nvcc; the emulator's host compilers do not know the pragma.
#ifdef DFLASH_CUDA_EMU
#define DF_UNROLL
#else
#define DF_UNROLL _Pragma("unroll")
#endif

namespace {

constexpr int kMaxMp = DF_CU_ATTN_MAX_ROWS; // packed rows per CTA (train/cuda/dfcuda.h)
constexpr int kMaxD = DF_CU_ATTN_MAX_D;
constexpr int kMaxN = DF_CU_ATTN_MAX_N; // keys per tile (S: N / 2 floats per lane)
constexpr int kRowChunk = 32;           // query rows per step of attention_backward_kv

struct Shape {
  int B, Sc, nh, nkv, d, window;
  const int32_t *anchors;
  float scale;
  int grp, M, Mp, N; // packing and key tile (see the header)
  int kvg;           // attention_backward_kv: warps per 16 keys, each on every kvg-th row chunk
  int dp, ld;        // head_dim padded to 16; shared row length (dp: swizzled, else dp + 8)
};
enum Kind { FWD = DF_CU_ATTN_FWD, BWD_Q = DF_CU_ATTN_BWD_Q, BWD_KV = DF_CU_ATTN_BWD_KV };

__host__ __device__ inline int row_len(int dp) { return df_cu_attn_row_len(dp); }

// Shared memory of one CTA (train/cuda/dfcuda.h, which the training plan reads too).
using Smem = df_cu_attn_smem;
__host__ __device__ inline Smem smem_layout(Kind kind, int Mp, int N, int dp) {
  return df_cu_attn_smem_layout((int)kind, Mp, N, dp);
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

// Global row of packed row r (j = r / grp, head g * grp + r % grp) of block n.
__device__ __forceinline__ size_t q_row(const Shape &s, int n, int g, int r) {
  return ((size_t)n * s.B + r / s.grp) * s.nh + (size_t)g * s.grp + r % s.grp;
}

// Element offset of (row, col) in a shared [rows][ld] tile; col % 8 is kept within its
// 16-byte chunk, the chunk XOR-swizzled by the row when rows are unpadded.
__device__ __forceinline__ int at(const Shape &s, int row, int col) {
  int ch = col >> 3;
  if (s.ld == s.dp) ch ^= row & 7;
  return row * s.ld + ch * 8 + (col & 7);
}

__device__ __forceinline__ void zero8(bf16 *dst) {
#ifdef DFLASH_CUDA_EMU
  std::memset(dst, 0, 16);
#else
  *reinterpret_cast<uint4 *>(dst) = make_uint4(0, 0, 0, 0);
#endif
}

// cp.async of `rows` rows of `cnt` valid ones into a shared tile: row i of the tile from
// src_row(i) (d elements, 16-byte aligned); rows past cnt and columns past d zero (never
// poison: a tensor-core product with NaN is NaN even where P is 0). Not waited for here.
template <typename F>
__device__ void load_rows(const Shape &s, bf16 *dst, int rows, int cnt, F src_row) {
  int per_row = s.dp / 8;
  for (int e = threadIdx.x; e < rows * per_row; e += blockDim.x) {
    int r = e / per_row, c = e % per_row * 8;
    if (r < cnt && c < s.d) tc_cp_async16(dst + at(s, r, c), src_row(r) + c);
    else zero8(dst + at(s, r, c));
  }
}

// The block's packed query rows (q or dout) into shared [Mp][ld].
__device__ void load_q_rows(const Shape &s, bf16 *dst, const bf16 *src, int n, int g) {
  load_rows(s, dst, s.Mp, s.M, [&](int r) { return src + q_row(s, n, g, r) * s.d; });
}

// cnt key / value rows of kv head g (row i at (row0 + i) * nkv + g) into shared [N][ld],
// rows cnt.. up to a multiple of 16 zero.
__device__ void load_kv_rows(const Shape &s, bf16 *K, bf16 *V, const bf16 *kc, const bf16 *vc,
                             size_t row0, int cnt, int g) {
  int rows = (cnt + 15) / 16 * 16;
  auto row = [&](int i) { return ((row0 + i) * s.nkv + g) * s.d; };
  load_rows(s, K, rows, cnt, [&](int i) { return kc + row(i); });
  load_rows(s, V, rows, cnt, [&](int i) { return vc + row(i); });
}

// ---- fragments (layouts: cuda/tc.cuh) --------------------------------------------------------
// A of rows m0.., columns k0.. of a row-major shared tile X.
__device__ __forceinline__ void frag_a(const Shape &s, uint32_t (&a)[4], const bf16 *X, int m0,
                                       int k0) {
  int l = threadIdx.x % 32, j = l / 8;
  tc_ldmatrix<4, false>(a, X + at(s, m0 + (j % 2) * 8 + l % 8, k0 + (j / 2) * 8));
}
// B of two n8 tiles n0.., n0 + 8.. at k0.. where B(k, n) = Y[n][k] (Y: keys or query rows by
// head_dim, for products over head_dim): b[0..1] the first tile, b[2..3] the second.
__device__ __forceinline__ void frag_b_nk(const Shape &s, uint32_t (&b)[4], const bf16 *Y, int n0,
                                          int k0) {
  int l = threadIdx.x % 32, j = l / 8;
  tc_ldmatrix<4, false>(b, Y + at(s, n0 + (j / 2) * 8 + l % 8, k0 + (j % 2) * 8));
}
// B of two n8 tiles at k0.. where B(k, n) = Z[k][n] (Z: rows by head_dim, for products
// over keys or query rows): the transposing ldmatrix.
__device__ __forceinline__ void frag_b_kn(const Shape &s, uint32_t (&b)[4], const bf16 *Z, int k0,
                                          int n0) {
  int l = threadIdx.x % 32, j = l / 8;
  tc_ldmatrix<4, true>(b, Z + at(s, k0 + (j % 2) * 8 + l % 8, n0 + (j / 2) * 8));
}
// Two adjacent n8 accumulator tiles as the A fragment of the next product (bf16, rounded).
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c0)[4],
                                         const float (&c1)[4]) {
  a[0] = tc_pack(c0[0], c0[1]);
  a[1] = tc_pack(c0[2], c0[3]);
  a[2] = tc_pack(c1[0], c1[1]);
  a[3] = tc_pack(c1[2], c1[3]);
}
__device__ __forceinline__ void mma2(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                     const uint32_t (&b)[4]) {
  uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
  tc_mma(c0, a, b0, c0);
  tc_mma(c1, a, b1, c1);
}

// C[0 .. w/8) (16 rows m0.. of A by w columns) = A (rows of X, over head_dim) times Y^T.
template <int NT>
__device__ __forceinline__ void scores(const Shape &s, float (&C)[NT][4], const bf16 *X, int m0,
                                       const bf16 *Y, int y0, int w) {
  DF_UNROLL
  for (int i = 0; i < NT; i++) C[i][0] = C[i][1] = C[i][2] = C[i][3] = 0.0f;
  for (int k0 = 0; k0 < s.dp; k0 += 16) {
    uint32_t a[4];
    frag_a(s, a, X, m0, k0);
    DF_UNROLL
    for (int np = 0; np < NT / 2; np++) {
      if (np >= w / 16) continue;
      uint32_t b[4];
      frag_b_nk(s, b, Y, y0 + np * 16, k0);
      mma2(C[2 * np], C[2 * np + 1], a, b);
    }
  }
}

// Acc (16 rows by dp) += P (16 by w, accumulator layout) times Z[z0 .. z0 + w) (rows by
// head_dim).
template <int NT, int DT>
__device__ __forceinline__ void accumulate(const Shape &s, float (&Acc)[DT][4],
                                           const float (&P)[NT][4], const bf16 *Z, int z0, int w) {
  DF_UNROLL
  for (int kk = 0; kk < NT / 2; kk++) {
    if (kk >= w / 16) continue;
    uint32_t a[4];
    acc_to_a(a, P[2 * kk], P[2 * kk + 1]);
    DF_UNROLL
    for (int np = 0; np < DT / 2; np++) {
      if (np >= s.dp / 16) continue;
      uint32_t b[4];
      frag_b_kn(s, b, Z, z0 + kk * 16, np * 16);
      mma2(Acc[2 * np], Acc[2 * np + 1], a, b);
    }
  }
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// One key tile: keys of the tile are tile-local k < cnt; key index (for visible()) k0 + k.
struct Tile {
  bool blk;    // the block's own keys
  int k0, cnt; // first key (ctx: context row; blk: nctx + block row) and how many
};
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

// Load a tile's keys and values and wait for them (and for everything loaded before).
__device__ void load_tile(const Shape &s, bf16 *K, bf16 *V, const bf16 *kc, const bf16 *vc,
                          const bf16 *kb, const bf16 *vb, int n, int nctx, Tile t, int g) {
  if (t.blk) load_kv_rows(s, K, V, kb, vb, (size_t)n * s.B + (t.k0 - nctx), t.cnt, g);
  else load_kv_rows(s, K, V, kc, vc, (size_t)t.k0, t.cnt, g);
  tc_cp_commit();
  tc_cp_wait<0>();
  __syncthreads();
}

// The accumulator element i of n8 tile nt: its row (of 16) and column.
__device__ __forceinline__ int frag_row(int i) {
  return (int)(threadIdx.x % 32) / 4 + (i >> 1) * 8;
}
__device__ __forceinline__ int frag_col(int nt, int i) {
  return nt * 8 + 2 * (int)(threadIdx.x % 4) + (i & 1);
}

// ---- forward -------------------------------------------------------------------------------
// Online softmax of one tile for this lane's two rows (h 0: row g, 1: g + 8): S (scaled,
// masked) -> P (rounded to bf16, in place), m, l updated and O rescaled.
template <int DT>
__device__ void softmax_tile(const Shape &s, float (&S)[kMaxN / 8][4], float (&O)[DT][4], int m0,
                             int a, int nctx, Tile t, float (&m)[2], float (&l)[2]) {
  int nt_n = width(t) / 8;
  float mx[2] = {m[0], m[1]};
  DF_UNROLL
  for (int nt = 0; nt < kMaxN / 8; nt++) DF_UNROLL
  for (int i = 0; i < 4; i++) {
    if (nt >= nt_n) continue;
    int r = m0 + frag_row(i), k = frag_col(nt, i);
    float v = -FLT_MAX;
    if (r < s.M && k < t.cnt && visible(s, a, nctx, r / s.grp, t.k0 + k)) v = S[nt][i] * s.scale;
    S[nt][i] = v;
    mx[i >> 1] = fmaxf(mx[i >> 1], v);
  }
  float sum[2] = {0, 0};
  for (int h = 0; h < 2; h++) mx[h] = quad_max(mx[h]);
  DF_UNROLL
  for (int nt = 0; nt < kMaxN / 8; nt++) DF_UNROLL
  for (int i = 0; i < 4; i++) {
    if (nt >= nt_n) continue;
    float v = S[nt][i];
    float p = __bfloat162float(__float2bfloat16(v == -FLT_MAX ? 0.0f : __expf(v - mx[i >> 1])));
    S[nt][i] = p;
    sum[i >> 1] += p; // the normaliser of exactly the P that PV multiplies
  }
  for (int h = 0; h < 2; h++) {
    float alpha = __expf(m[h] - mx[h]); // 1 while the row has seen nothing (both -FLT_MAX)
    l[h] = l[h] * alpha + quad_sum(sum[h]);
    m[h] = mx[h];
    DF_UNROLL
    for (int nt = 0; nt < DT; nt++) O[nt][2 * h] *= alpha, O[nt][2 * h + 1] *= alpha;
  }
}

template <int DT>
__global__ void attention_forward(Shape s, bf16 *out, float *lse, const bf16 *q, const bf16 *kc,
                                  const bf16 *vc, const bf16 *kb, const bf16 *vb) {
  DF_DYN_SHARED(SmemBase, smem_base);
  char *sm = (char *)smem_base;
  Smem L = smem_layout(FWD, s.Mp, s.N, s.dp);
  bf16 *Q = (bf16 *)(sm + L.q), *K = (bf16 *)(sm + L.k), *V = (bf16 *)(sm + L.v);
  int n = blockIdx.x, g = blockIdx.y, m0 = (int)threadIdx.x / 32 * 16;
  load_q_rows(s, Q, q, n, g);
  tc_cp_commit(); // waited for with the first tile
  float O[DT][4], S[kMaxN / 8][4], m[2] = {-FLT_MAX, -FLT_MAX}, l[2] = {0, 0};
  DF_UNROLL
  for (int nt = 0; nt < DT; nt++) O[nt][0] = O[nt][1] = O[nt][2] = O[nt][3] = 0.0f;
  int a = s.anchors[n], nctx = n_ctx(s, a), lo = ctx_lo(s, a) < nctx ? ctx_lo(s, a) : nctx;
  for (int i = 0; i < n_tiles(s, lo, nctx); i++) {
    Tile t = tile_at(s, lo, nctx, i);
    __syncthreads(); // every warp is done with the previous tile's K and V
    load_tile(s, K, V, kc, vc, kb, vb, n, nctx, t, g);
    scores(s, S, Q, m0, K, 0, width(t)); // S = Q K^T
    softmax_tile(s, S, O, m0, a, nctx, t, m, l);
    accumulate(s, O, S, V, 0, width(t)); // O += P V
  }
  DF_UNROLL
  for (int nt = 0; nt < DT; nt++) DF_UNROLL
  for (int i = 0; i < 4; i++) {
    int r = m0 + frag_row(i), c = frag_col(nt, i);
    float lr = l[i >> 1];
    if (r < s.M && c < s.d)
      out[q_row(s, n, g, r) * s.d + c] = __float2bfloat16(lr > 0 ? O[nt][i] / lr : 0.0f);
  }
  for (int h = 0; h < 2; h++) {
    int r = m0 + frag_row(2 * h);
    if (threadIdx.x % 4 == 0 && r < s.M) lse[q_row(s, n, g, r)] = m[h] + logf(l[h]);
  }
}

// ---- backward ------------------------------------------------------------------------------
// P = exp(S * scale - lse) and dS = P * (dP - D) * scale, in place of S and dP; `seen(row,
// col)` says whether the element is visible, `lse_d(row, col, &L, &D)` gives its row's
// statistics (row and col of the 16 x w tile).
template <typename Seen, typename Stats>
__device__ __forceinline__ void p_ds(const Shape &s, float (&S)[kMaxN / 8][4],
                                     float (&dP)[kMaxN / 8][4], int w, Seen seen, Stats stats) {
  DF_UNROLL
  for (int nt = 0; nt < kMaxN / 8; nt++) DF_UNROLL
  for (int i = 0; i < 4; i++) {
    if (nt >= w / 8) continue;
    int r = frag_row(i), c = frag_col(nt, i);
    float p = 0, ds = 0, Lr, Dr;
    if (seen(r, c)) {
      stats(r, c, Lr, Dr);
      p = __expf(S[nt][i] * s.scale - Lr);
      ds = p * (dP[nt][i] - Dr) * s.scale;
    }
    S[nt][i] = p, dP[nt][i] = ds;
  }
}

// Per (block, kv head): D = rowsum(dO * O) and dQ over every key the block sees.
template <int DT>
__global__ void attention_backward_q(Shape s, bf16 *dq, float *Dg, const bf16 *dout, const bf16 *o,
                                     const float *lse, const bf16 *q, const bf16 *kc,
                                     const bf16 *vc, const bf16 *kb, const bf16 *vb) {
  DF_DYN_SHARED(SmemBase, smem_base);
  char *sm = (char *)smem_base;
  Smem L = smem_layout(BWD_Q, s.Mp, s.N, s.dp);
  bf16 *Q = (bf16 *)(sm + L.q), *dO = (bf16 *)(sm + L.dout), *K = (bf16 *)(sm + L.k);
  bf16 *V = (bf16 *)(sm + L.v);
  int n = blockIdx.x, g = blockIdx.y, m0 = (int)threadIdx.x / 32 * 16, t4 = threadIdx.x % 4;
  load_q_rows(s, Q, q, n, g);
  load_q_rows(s, dO, dout, n, g);
  tc_cp_commit();
  // D of this lane's two rows from the rounded output the forward stored (quad-summed).
  float Dr[2], Lr[2];
  for (int h = 0; h < 2; h++) {
    int r = m0 + frag_row(2 * h);
    float part = 0;
    for (int c = t4; r < s.M && c < s.d; c += 4) {
      size_t e = q_row(s, n, g, r) * s.d + c;
      part += __bfloat162float(dout[e]) * __bfloat162float(o[e]);
    }
    float tot = quad_sum(part); // every lane: a warp collective
    Dr[h] = r < s.M ? tot : 0.0f;
    Lr[h] = r < s.M ? lse[q_row(s, n, g, r)] : 0.0f;
    if (r < s.M && t4 == 0) Dg[q_row(s, n, g, r)] = Dr[h];
  }
  float dQ[DT][4], S[kMaxN / 8][4], dP[kMaxN / 8][4];
  DF_UNROLL
  for (int nt = 0; nt < DT; nt++) dQ[nt][0] = dQ[nt][1] = dQ[nt][2] = dQ[nt][3] = 0.0f;
  int a = s.anchors[n], nctx = n_ctx(s, a), lo = ctx_lo(s, a) < nctx ? ctx_lo(s, a) : nctx;
  for (int i = 0; i < n_tiles(s, lo, nctx); i++) {
    Tile t = tile_at(s, lo, nctx, i);
    __syncthreads();
    load_tile(s, K, V, kc, vc, kb, vb, n, nctx, t, g);
    int w = width(t);
    scores(s, S, Q, m0, K, 0, w);   // S = Q K^T
    scores(s, dP, dO, m0, V, 0, w); // dP = dO V^T
    p_ds(
        s, S, dP, w,
        [&](int r, int c) {
          return m0 + r < s.M && c < t.cnt && visible(s, a, nctx, (m0 + r) / s.grp, t.k0 + c);
        },
        [&](int r, int, float &Lo, float &Do) { Lo = Lr[r >> 3], Do = Dr[r >> 3]; });
    accumulate(s, dQ, dP, K, 0, w); // dQ += dS K
  }
  DF_UNROLL
  for (int nt = 0; nt < DT; nt++) DF_UNROLL
  for (int i = 0; i < 4; i++) {
    int r = m0 + frag_row(i), c = frag_col(nt, i);
    if (r < s.M && c < s.d) dq[q_row(s, n, g, r) * s.d + c] = __float2bfloat16(dQ[nt][i]);
  }
}

// acc of row group 0 += acc of row group 1 (warps with the same keys k0w), through `part`.
template <int DT>
__device__ void combine(const Shape &s, float (&acc)[DT][4], float *part, int rg, int k0w) {
  __syncthreads(); // every warp is done with the rows (and the previous combine's part)
  DF_UNROLL
  for (int nt = 0; nt < DT; nt++) DF_UNROLL
  for (int i = 0; i < 4; i++)
    if (rg == 1 && nt < s.dp / 8) part[(k0w + frag_row(i)) * s.dp + frag_col(nt, i)] = acc[nt][i];
  __syncthreads();
  DF_UNROLL
  for (int nt = 0; nt < DT; nt++) DF_UNROLL
  for (int i = 0; i < 4; i++)
    if (rg == 0 && nt < s.dp / 8) acc[nt][i] += part[(k0w + frag_row(i)) * s.dp + frag_col(nt, i)];
}

// Per (key tile, kv head): dK, dV of N keys (warp w: keys 16w..) over the query rows that see
// them: BLK false, context keys p0.. of every block that sees them, in block order; BLK true,
// block n's own keys b0...
template <int DT, bool BLK>
__global__ void attention_backward_kv(Shape s, int n_blocks, bf16 *dk, bf16 *dv, const float *Dg,
                                      const bf16 *dout, const float *lse, const bf16 *q,
                                      const bf16 *kx, const bf16 *vx) {
  DF_DYN_SHARED(SmemBase, smem_base);
  char *sm = (char *)smem_base;
  Smem L = smem_layout(BWD_KV, s.Mp, s.N, s.dp);
  bf16 *Q = (bf16 *)(sm + L.q), *dO = (bf16 *)(sm + L.dout), *K = (bf16 *)(sm + L.k);
  bf16 *V = (bf16 *)(sm + L.v);
  float *Ls = (float *)(sm + L.ls), *Ds = (float *)(sm + L.ds);
  // Warp w: keys k0w.. (16), query-row chunks rg, rg + kvg, ... of each block.
  int g = blockIdx.y, kw = s.N / 16, k0w = (int)threadIdx.x / 32 % kw * 16;
  int rg = (int)threadIdx.x / 32 / kw;
  int per = (s.B + s.N - 1) / s.N; // BLK: key tiles per block
  int nb = BLK ? (int)blockIdx.x / per : 0, b0 = BLK ? (int)blockIdx.x % per * s.N : 0;
  int p0 = BLK ? nb * s.B + b0 : (int)blockIdx.x * s.N; // first key row in kx / vx
  int lim = BLK ? s.B - b0 : s.Sc - p0, cnt = lim < s.N ? lim : s.N;
  load_kv_rows(s, K, V, kx, vx, (size_t)p0, cnt, g);
  tc_cp_commit();
  float dK[DT][4], dV[DT][4], S[kMaxN / 8][4], dP[kMaxN / 8][4];
  DF_UNROLL
  for (int nt = 0; nt < DT; nt++) DF_UNROLL
  for (int i = 0; i < 4; i++) dK[nt][i] = dV[nt][i] = 0.0f;
  for (int n = BLK ? nb : 0; n < (BLK ? nb + 1 : n_blocks); n++) {
    int a = s.anchors[n], nctx = n_ctx(s, a);
    // The keys block n sees of this tile: context keys past nctx are not its context.
    int kcnt = cnt, kbase = BLK ? nctx + b0 : p0;
    if (!BLK) {
      if (p0 >= nctx || p0 + cnt <= ctx_lo(s, a)) continue;
      kcnt = nctx - p0 < cnt ? nctx - p0 : cnt;
    }
    __syncthreads(); // every warp is done with the previous block's rows
    load_q_rows(s, Q, q, n, g);
    load_q_rows(s, dO, dout, n, g);
    for (int r = threadIdx.x; r < s.Mp; r += blockDim.x) {
      Ls[r] = r < s.M ? lse[q_row(s, n, g, r)] : 0.0f;
      Ds[r] = r < s.M ? Dg[q_row(s, n, g, r)] : 0.0f;
    }
    tc_cp_commit();
    tc_cp_wait<0>();
    __syncthreads();
    if (k0w >= kcnt) continue; // this warp's keys are past the tile's (warp-uniform)
    for (int rc = rg * kRowChunk; rc < s.Mp; rc += s.kvg * kRowChunk) {
      int w = s.Mp - rc < kRowChunk ? s.Mp - rc : kRowChunk;
      scores(s, S, K, k0w, Q, rc, w);   // S^T = K Q^T
      scores(s, dP, V, k0w, dO, rc, w); // dP^T = V dO^T
      p_ds(
          s, S, dP, w,
          [&](int r, int c) { // r: key of the warp, c: query row rc + c
            int qr = rc + c;
            return qr < s.M && k0w + r < kcnt && visible(s, a, nctx, qr / s.grp, kbase + k0w + r);
          },
          [&](int, int c, float &Lo, float &Do) { Lo = Ls[rc + c], Do = Ds[rc + c]; });
      accumulate(s, dV, S, dO, rc, w); // dV += P^T dO
      accumulate(s, dK, dP, Q, rc, w); // dK += dS^T Q
    }
  }
  // A context key tile that no block sees skips every wait above, and its CTA must not exit
  // with its K/V copies in flight (undefined in the PTX ISA; the emulator faults on it).
  tc_cp_wait<0>();
  if (s.kvg == 2) { // the second row group's sums added to the first's, in that order
    float *part = (float *)(sm + L.q); // N x dp fp32: fits the Q and dO rows (kv_groups)
    combine(s, dK, part, rg, k0w);
    combine(s, dV, part, rg, k0w);
  }
  if (rg) return;
  DF_UNROLL
  for (int nt = 0; nt < DT; nt++) DF_UNROLL
  for (int i = 0; i < 4; i++) {
    int r = k0w + frag_row(i), c = frag_col(nt, i);
    if (r < cnt && c < s.d) {
      size_t e = (((size_t)p0 + r) * s.nkv + g) * s.d + c;
      dk[e] = __float2bfloat16(dK[nt][i]);
      dv[e] = __float2bfloat16(dV[nt][i]);
    }
  }
}

// ---- host side -----------------------------------------------------------------------------
int max_smem() {
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return 0;
  return v;
}

int pick_n(Kind kind, int Mp, int dp, size_t limit) {
  return df_cu_attn_pick_n((int)kind, Mp, dp, limit);
}

// attention_backward_kv's row groups: 2 (8 warps at N 64: one CTA per SM on sm_120 brings 8
// warps itself) when the two groups' partial dK / dV (N x dp fp32) fit over the Q and dO rows,
// else 1.
int kv_groups(Kind kind, int Mp, int N, int dp) {
  if (kind != BWD_KV) return 1;
  return (size_t)4 * N * dp <= (size_t)4 * Mp * row_len(dp) && Mp >= 2 * kRowChunk ? 2 : 1;
}

// The shape checks of every pass (a forward that runs must have a backward that runs); the
// key tile of `kind` from the device's shared memory per block.
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
  int n_kind = 0;
  for (int k = FWD; k <= BWD_KV; k++) {
    int N = pick_n((Kind)k, Mp, dp, limit);
    if (!N) {
      size_t need = smem_layout((Kind)k, Mp, 16, dp).total;
      return df_error(DFLASH_E_UNSUPPORTED,
                      "CUDA attention: head_dim %d with %d rows per CTA "
                      "(block size %d times %d query heads per kv head) needs %zu bytes of "
                      "shared memory in its %s, more than the %zu this device has per block",
                      a->d, Mp, a->B, grp, need, k == FWD ? "forward" : "backward", limit);
    }
    if (k == kind) n_kind = N;
  }
  *out = Shape{a->B,
               a->Sc,
               a->nh,
               a->nkv,
               a->d,
               a->window,
               a->anchors,
               a->scale,
               grp,
               M,
               Mp,
               n_kind,
               kv_groups((Kind)kind, Mp, n_kind, dp),
               dp,
               row_len(dp)};
  return DFLASH_OK;
}

// The kernels move rows 16 bytes at a time.
dflash_status check_aligned(std::initializer_list<const void *> ptrs) {
  for (const void *p : ptrs)
    if ((uintptr_t)p % 16)
      return df_error(DFLASH_E_INVALID_ARG, "CUDA attention: tensor %p is not 16-byte aligned", p);
  return DFLASH_OK;
}

size_t smem_of(Kind kind, const Shape &s) { return smem_layout(kind, s.Mp, s.N, s.dp).total; }

// The launches of one pass for accumulators of DT n8 tiles (dp <= 8 * DT).
template <int DT>
struct Launch {
  static dflash_status fwd(cudaStream_t st, const df_attn_dev *a, const Shape &s, bf16 *out,
                           float *lse, const bf16 *q, const bf16 *kc, const bf16 *vc,
                           const bf16 *kb, const bf16 *vb) {
    size_t smem = smem_of(FWD, s);
    DF_CU(cudaFuncSetAttribute(attention_forward<DT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)smem));
    DF_LAUNCH(dim3(a->n_blocks, a->nkv), 2 * s.Mp, smem, st, attention_forward<DT>)
    (s, out, lse, q, kc, vc, kb, vb);
    return df_launched("attention_forward");
  }
  static dflash_status bwd_q(cudaStream_t st, const df_attn_dev *a, const Shape &s, bf16 *dq,
                             float *D, const bf16 *dout, const bf16 *out, const float *lse,
                             const bf16 *q, const bf16 *kc, const bf16 *vc, const bf16 *kb,
                             const bf16 *vb) {
    size_t smem = smem_of(BWD_Q, s);
    DF_CU(cudaFuncSetAttribute(attention_backward_q<DT>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    DF_LAUNCH(dim3(a->n_blocks, a->nkv), 2 * s.Mp, smem, st, attention_backward_q<DT>)
    (s, dq, D, dout, out, lse, q, kc, vc, kb, vb);
    return df_launched("attention_backward_q");
  }
  template <bool BLK>
  static dflash_status bwd_kv(cudaStream_t st, const df_attn_dev *a, const Shape &s, bf16 *dk,
                              bf16 *dv, const float *D, const bf16 *dout, const float *lse,
                              const bf16 *q, const bf16 *kx, const bf16 *vx) {
    size_t smem = smem_of(BWD_KV, s);
    unsigned tiles = BLK ? (unsigned)(a->n_blocks * ((s.B + s.N - 1) / s.N))
                         : (unsigned)((s.Sc + s.N - 1) / s.N);
    DF_CU(cudaFuncSetAttribute(attention_backward_kv<DT, BLK>,
                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    DF_LAUNCH(dim3(tiles, a->nkv), 2 * s.N * s.kvg, smem, st, attention_backward_kv<DT, BLK>)
    (s, a->n_blocks, dk, dv, D, dout, lse, q, kx, vx);
    return df_launched("attention_backward_kv");
  }
};

} // namespace

dflash_status k_attention_check(const df_attn_dev *a) {
  Shape s;
  return shape_of(a, FWD, &s);
}

// 2 * Mp threads: a warp per 16 rows (2 * N for the kv pass: a warp per 16 keys).
#define DF_ATTN_DISPATCH(dp, call) \
  ((dp) <= 64 ? Launch<8>::call : (dp) <= 128 ? Launch<16>::call : Launch<32>::call)

dflash_status k_attention_forward(cudaStream_t st, const df_attn_dev *a, bf16 *out, float *lse,
                                  const bf16 *q, const bf16 *kc, const bf16 *vc, const bf16 *kb,
                                  const bf16 *vb) {
  Shape s;
  DF_TRY(shape_of(a, FWD, &s));
  if (a->n_blocks <= 0) return DFLASH_OK;
  DF_TRY(check_aligned({q, kc, vc, kb, vb}));
  return DF_ATTN_DISPATCH(s.dp, fwd(st, a, s, out, lse, q, kc, vc, kb, vb));
}

dflash_status k_attention_backward(cudaStream_t st, const df_attn_dev *a, bf16 *dq, bf16 *dkc,
                                   bf16 *dvc, bf16 *dkb, bf16 *dvb, float *D, const bf16 *dout,
                                   const bf16 *out, const float *lse, const bf16 *q, const bf16 *kc,
                                   const bf16 *vc, const bf16 *kb, const bf16 *vb) {
  Shape s1, s2;
  DF_TRY(shape_of(a, BWD_Q, &s1));
  DF_TRY(shape_of(a, BWD_KV, &s2));
  if (a->n_blocks <= 0) return DFLASH_OK;
  DF_TRY(check_aligned({q, kc, vc, kb, vb, dout}));
  DF_TRY(DF_ATTN_DISPATCH(s1.dp, bwd_q(st, a, s1, dq, D, dout, out, lse, q, kc, vc, kb, vb)));
  DF_TRY(
      DF_ATTN_DISPATCH(s2.dp, template bwd_kv<true>(st, a, s2, dkb, dvb, D, dout, lse, q, kb, vb)));
  if (a->Sc <= 0) return DFLASH_OK;
  return DF_ATTN_DISPATCH(s2.dp,
                          template bwd_kv<false>(st, a, s2, dkc, dvc, D, dout, lse, q, kc, vc));
}
