// WMMA's fragment ops on the emulated device (include/mma.h). Each op is a warp-wide
// collective (fiber.cpp's warp_all_lanes): the last lane to arrive checks that every lane
// passed the same arguments, then does the whole warp's work with every lane's fragment.
//
// The element-to-lane mapping is unspecified in CUDA and differs between architectures;
// here it is a permutation of the 256 tile elements drawn from the thread-order seed, one
// per fragment use, so code that reads x[i] as a particular row and column is wrong under
// most seeds (element-wise code such as scaling every x[i] is fine, as on the hardware).
#include <cinttypes>
#include <mutex>

#include "internal.h"
#include "mma.h"

namespace dfemu {

namespace {

struct Mapping {
  uint64_t seed = 0;
  bool ready = false;
  uint8_t elem[3][256]; // [use][lane * 8 + i] -> row * 16 + col
};

// Drawn afresh whenever the seed changes (set_seed), so one process can try several.
const Mapping &mapping() {
  static thread_local Mapping m;
  uint64_t s = seed();
  if (m.ready && m.seed == s) return m;
  for (int u = 0; u < 3; u++) {
    uint64_t r = mix(s, 0x77a3a5ull + (uint64_t)u);
    for (int i = 0; i < 256; i++) m.elem[u][i] = (uint8_t)i;
    for (int i = 255; i > 0; i--) {
      r = mix(r, (uint64_t)i);
      int j = (int)(r % (uint64_t)(i + 1));
      std::swap(m.elem[u][i], m.elem[u][j]);
    }
  }
  m.seed = s;
  m.ready = true;
  return m;
}

struct LoadArgs {
  int use;
  void *x;
  const void *p;
  unsigned ldm;
  bool col;
  int bytes;
};
struct StoreArgs {
  void *p;
  const float *x;
  unsigned ldm;
  bool col;
};
struct MmaArgs {
  float *d;
  const __nv_bfloat16 *a, *b;
  const float *c;
};

// CUDA's rules for a fragment's memory: the pointer 256-bit aligned, ldm (in elements) a
// multiple of 16 bytes, the same on every lane.
void check_memory(const char *what, const void *p, unsigned ldm, int bytes) {
  if ((uintptr_t)p % 32)
    device_fault("%s: pointer %p is not 256-bit (32-byte) aligned, as WMMA requires", what, p);
  if (ldm == 0 || ldm % (unsigned)(16 / bytes) || ldm < 16)
    device_fault("%s: ldm %u is not a multiple of %d elements (16 bytes) of at least 16, as "
                 "WMMA requires for %d-byte elements",
                 what, ldm, 16 / bytes, bytes);
}

template <typename A>
const A &same_on_every_lane(void *const *lanes, const char *what) {
  const A &a0 = *(const A *)lanes[0];
  for (int l = 1; l < 32; l++) {
    const A &al = *(const A *)lanes[l];
    if (al.p != a0.p || al.ldm != a0.ldm || al.col != a0.col)
      device_fault("%s: lane %d passes pointer %p, ldm %u, %s while lane 0 passes %p, %u, %s "
                   "(the arguments of a WMMA op must be the same on every lane)",
                   what, l, (const void *)al.p, al.ldm, al.col ? "col-major" : "row-major",
                   (const void *)a0.p, a0.ldm, a0.col ? "col-major" : "row-major");
  }
  return a0;
}

// Offset of tile element (r, c) in memory.
size_t at(int r, int c, unsigned ldm, bool col) {
  return col ? (size_t)c * ldm + r : (size_t)r * ldm + c;
}

void do_load(void *const *lanes, const char *what) {
  const LoadArgs &a = same_on_every_lane<LoadArgs>(lanes, what);
  check_memory(what, a.p, a.ldm, a.bytes);
  const uint8_t *map = mapping().elem[a.use];
  for (int l = 0; l < 32; l++) {
    const LoadArgs &al = *(const LoadArgs *)lanes[l];
    for (int i = 0; i < kFragElems; i++) {
      int e = map[l * kFragElems + i];
      size_t off = at(e / 16, e % 16, a.ldm, a.col) * (size_t)a.bytes;
      std::memcpy((char *)al.x + (size_t)i * a.bytes, (const char *)a.p + off, (size_t)a.bytes);
    }
  }
}

void do_store(void *const *lanes, const char *what) {
  const StoreArgs &a = same_on_every_lane<StoreArgs>(lanes, what);
  check_memory(what, a.p, a.ldm, 4);
  const uint8_t *map = mapping().elem[FRAG_ACC];
  for (int l = 0; l < 32; l++) {
    const StoreArgs &al = *(const StoreArgs *)lanes[l];
    for (int i = 0; i < kFragElems; i++) {
      int e = map[l * kFragElems + i];
      ((float *)a.p)[at(e / 16, e % 16, a.ldm, a.col)] = al.x[i];
    }
  }
}

// Every lane's elements of one use gathered into a row-major 16 x 16 tile.
template <typename T, typename F>
void gather(void *const *lanes, FragUse use, F field, float *tile) {
  const uint8_t *map = mapping().elem[use];
  for (int l = 0; l < 32; l++) {
    const T *x = field(*(const MmaArgs *)lanes[l]);
    for (int i = 0; i < kFragElems; i++) {
      float v;
      if constexpr (std::is_same_v<T, float>) v = x[i];
      else v = __bfloat162float(x[i]);
      tile[map[l * kFragElems + i]] = v;
    }
  }
}

void do_mma(void *const *lanes, const char *) {
  float A[256], B[256], C[256];
  gather<__nv_bfloat16>(
      lanes, FRAG_A, [](const MmaArgs &m) { return m.a; }, A);
  gather<__nv_bfloat16>(
      lanes, FRAG_B, [](const MmaArgs &m) { return m.b; }, B);
  gather<float>(
      lanes, FRAG_ACC, [](const MmaArgs &m) { return m.c; }, C);
  float D[256];
  for (int r = 0; r < 16; r++)
    for (int c = 0; c < 16; c++) {
      float s = 0;
      for (int k = 0; k < 16; k++) s += A[r * 16 + k] * B[k * 16 + c];
      D[r * 16 + c] = s + C[r * 16 + c];
    }
  const uint8_t *map = mapping().elem[FRAG_ACC];
  for (int l = 0; l < 32; l++) {
    float *d = ((const MmaArgs *)lanes[l])->d;
    for (int i = 0; i < kFragElems; i++) d[i] = D[map[l * kFragElems + i]];
  }
}

} // namespace

int frag_element(FragUse use, unsigned lane, int i) {
  return mapping().elem[use][lane % 32 * kFragElems + i];
}

void wmma_load(FragUse use, void *x, const void *p, unsigned ldm, bool col_major, int bytes) {
  static const char *names[3] = {"wmma::load_matrix_sync(matrix_a)",
                                 "wmma::load_matrix_sync(matrix_b)",
                                 "wmma::load_matrix_sync(accumulator)"};
  LoadArgs a{use, x, p, ldm, col_major, bytes};
  warp_all_lanes(do_load, &a, names[use]);
}

void wmma_store(void *p, const float *x, unsigned ldm, bool col_major) {
  StoreArgs a{p, x, ldm, col_major};
  warp_all_lanes(do_store, &a, "wmma::store_matrix_sync");
}

void wmma_mma(float *d, const __nv_bfloat16 *a, const __nv_bfloat16 *b, const float *c) {
  MmaArgs m{d, a, b, c};
  warp_all_lanes(do_mma, &m, "wmma::mma_sync");
}

} // namespace dfemu
