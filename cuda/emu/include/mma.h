// Emulated device (cuda/emu): stands in for CUDA's mma.h, the WMMA fragment API of
// nvcuda::wmma, for the one shape the backend uses: 16x16x16, __nv_bfloat16 matrix_a /
// matrix_b fragments (row_major or col_major) and float accumulators.
//
// As on the hardware, load_matrix_sync, store_matrix_sync and mma_sync are warp-wide: every
// lane of the warp must reach the same call, with the same pointer, ldm and layout (a lane
// that exited, a partial warp, or lanes at different calls abort with the seed, as does a
// pointer not 256-bit aligned or an ldm that is not a multiple of 16 bytes). Which tile
// element each lane's x[i] holds is unspecified in CUDA: here it is a permutation drawn from
// the thread-order seed (dfemu::seed()), different for matrix_a, matrix_b and accumulator, so
// code that assumes a layout computes wrong results. A fragment is NaN until it is loaded or
// filled. mma_sync widens bf16 exactly and sums the 16 products of each element in fp32 in
// k order, then adds c (tensor cores sum in another order, with other rounding: bf16
// tolerances, not bit equality, in the tests). See cuda/emu/README.md.
#pragma once
#include "../cuda_emu.h"

namespace dfemu {
enum FragUse : int { FRAG_A = 0, FRAG_B = 1, FRAG_ACC = 2 };
constexpr int kFragElems = 8; // 256 elements of a 16x16 tile over 32 lanes
// Which tile element (row * 16 + col; A is m x k, B k x n, the accumulator m x n) x[i] of
// `lane` holds under this process's mapping.
int frag_element(FragUse use, unsigned lane, int i);
// The warp-wide ops; `bytes` is the element size in memory (2: bf16, 4: float).
void wmma_load(FragUse use, void *x, const void *p, unsigned ldm, bool col_major, int bytes);
void wmma_store(void *p, const float *x, unsigned ldm, bool col_major);
void wmma_mma(float *d, const __nv_bfloat16 *a, const __nv_bfloat16 *b, const float *c);
} // namespace dfemu

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {
template <typename Use>
constexpr ::dfemu::FragUse use_of() {
  if constexpr (std::is_same_v<Use, matrix_a>) return ::dfemu::FRAG_A;
  else if constexpr (std::is_same_v<Use, matrix_b>) return ::dfemu::FRAG_B;
  else return ::dfemu::FRAG_ACC;
}
} // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
class fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulator models WMMA's 16x16x16 only");
  static_assert(std::is_same_v<Use, accumulator> ? std::is_same_v<T, float>
                                                 : std::is_same_v<T, __nv_bfloat16>,
                "the emulator models bf16 matrix_a/matrix_b and float accumulators");
  static_assert(std::is_same_v<Use, accumulator> || std::is_same_v<Layout, row_major> ||
                    std::is_same_v<Layout, col_major>,
                "matrix_a and matrix_b fragments need row_major or col_major");

 public:
  static constexpr int num_elements = ::dfemu::kFragElems;
  typedef T element_type;
  T x[num_elements];
  fragment() { std::memset(x, 0xff, sizeof x); } // NaN until loaded or filled
};

template <typename Use, int M, int N, int K, typename T, typename L>
inline void fill_fragment(fragment<Use, M, N, K, T, L> &f, const T &v) {
  for (int i = 0; i < f.num_elements; i++) f.x[i] = v;
}

template <typename Use, typename L>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, __nv_bfloat16, L> &f, const __nv_bfloat16 *p,
                             unsigned ldm) {
  ::dfemu::wmma_load(detail::use_of<Use>(), f.x, p, ldm, std::is_same_v<L, col_major>, 2);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float> &f, const float *p,
                             unsigned ldm, layout_t layout) {
  ::dfemu::wmma_load(::dfemu::FRAG_ACC, f.x, p, ldm, layout == mem_col_major, 4);
}
inline void store_matrix_sync(float *p, const fragment<accumulator, 16, 16, 16, float> &f,
                              unsigned ldm, layout_t layout) {
  ::dfemu::wmma_store(p, f.x, ldm, layout == mem_col_major);
}
template <typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d,
                     const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA> &a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB> &b,
                     const fragment<accumulator, 16, 16, 16, float> &c) {
  ::dfemu::wmma_mma(d.x, a.x, b.x, c.x);
}

} // namespace wmma
} // namespace nvcuda
