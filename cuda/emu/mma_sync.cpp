// The raw tensor-core instructions on the emulated device: mma.sync.m16n8k16 (bf16 in, fp32
// accumulate) and ldmatrix, on the fragment layouts the PTX ISA documents (the kernels index
// these fragments directly, so unlike WMMA's the layout here is the hardware's, not drawn).
// Both are warp-wide (fiber.cpp's warp_all_lanes): every lane of the warp must reach the same
// instruction, converged; the last lane to arrive does the whole warp's work.
//
// Layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16", "ldmatrix"); g = lane / 4, t = lane % 4:
//   A 16x16 row-major, 4 x .b32 a[0..3] = elements a0..a7: row g for a0, a1, a4, a5, g + 8 for
//     a2, a3, a6, a7; column 2t + (i & 1), + 8 for a4..a7.
//   B 16x8 (k x n), 2 x .b32 = b0..b3: k = 2t + (i & 1), + 8 for b2, b3; n = g.
//   C, D 16x8 fp32 c0..c3: row g for c0, c1, g + 8 for c2, c3; column 2t + (i & 1).
//   In a .b32 the element of the lower column (or k) is the low 16 bits.
#include "internal.h"

namespace dfemu {

namespace {

float lo_bf16(uint32_t v) { return __bfloat162float(__nv_bfloat16{(uint16_t)(v & 0xffffu)}); }
float hi_bf16(uint32_t v) { return __bfloat162float(__nv_bfloat16{(uint16_t)(v >> 16)}); }

struct MmaArgs {
  float *d;
  const uint32_t *a, *b;
  const float *c;
};

void do_mma(void *const *lanes, const char *) {
  float A[16][16], B[16][8], C[16][8];
  for (int l = 0; l < 32; l++) {
    const MmaArgs &m = *(const MmaArgs *)lanes[l];
    int g = l / 4, t = l % 4;
    for (int r = 0; r < 4; r++) { // a[r]: rows g / g + 8 (r odd), columns + 8 for r >= 2
      int row = g + (r & 1) * 8, col = 2 * t + (r >> 1) * 8;
      A[row][col] = lo_bf16(m.a[r]), A[row][col + 1] = hi_bf16(m.a[r]);
    }
    for (int r = 0; r < 2; r++) {
      int k = 2 * t + r * 8;
      B[k][g] = lo_bf16(m.b[r]), B[k + 1][g] = hi_bf16(m.b[r]);
    }
    for (int i = 0; i < 4; i++) C[g + (i >> 1) * 8][2 * t + (i & 1)] = m.c[i];
  }
  float D[16][8];
  for (int r = 0; r < 16; r++)
    for (int n = 0; n < 8; n++) {
      float s = 0;
      for (int k = 0; k < 16; k++) s += A[r][k] * B[k][n];
      D[r][n] = s + C[r][n];
    }
  for (int l = 0; l < 32; l++) {
    float *d = ((const MmaArgs *)lanes[l])->d;
    int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; i++) d[i] = D[g + (i >> 1) * 8][2 * t + (i & 1)];
  }
}

struct LdArgs {
  uint32_t *r;
  int nmat;
  bool trans;
  const void *p;
};

const char *ld_name(int nmat, bool trans) {
  static const char *n[2][3] = {{"ldmatrix.m8n8.x1", "ldmatrix.m8n8.x2", "ldmatrix.m8n8.x4"},
                                {"ldmatrix.m8n8.x1.trans", "ldmatrix.m8n8.x2.trans",
                                 "ldmatrix.m8n8.x4.trans"}};
  return n[trans][nmat == 1 ? 0 : nmat == 2 ? 1 : 2];
}

void do_ldmatrix(void *const *lanes, const char *what) {
  const LdArgs &a0 = *(const LdArgs *)lanes[0];
  uint16_t M[4][8][8];
  for (int l = 0; l < 32; l++) {
    const LdArgs &a = *(const LdArgs *)lanes[l];
    if (a.nmat != a0.nmat || a.trans != a0.trans)
      device_fault("%s: lane %d executes %s", what, l, ld_name(a.nmat, a.trans));
    if (l >= 8 * a0.nmat) continue; // its address is not read
    if ((uintptr_t)a.p % 16)
      device_fault("%s: lane %d's row address %p is not 16-byte aligned", what, l, a.p);
    if (!in_shared(a.p, 16))
      device_fault("%s: lane %d's row address %p is not in the block's shared memory", what, l,
                   a.p);
    std::memcpy(M[l / 8][l % 8], a.p, 16);
  }
  for (int l = 0; l < 32; l++) {
    uint32_t *r = ((const LdArgs *)lanes[l])->r;
    int row = l / 4, col = 2 * (l % 4);
    for (int j = 0; j < a0.nmat; j++) {
      uint16_t lo = a0.trans ? M[j][col][row] : M[j][row][col];
      uint16_t hi = a0.trans ? M[j][col + 1][row] : M[j][row][col + 1];
      r[j] = (uint32_t)lo | (uint32_t)hi << 16;
    }
  }
}

} // namespace

void mma_m16n8k16_bf16(float *d, const uint32_t *a, const uint32_t *b, const float *c) {
  MmaArgs m{d, a, b, c};
  warp_all_lanes(do_mma, &m, "mma.sync.m16n8k16.row.col.f32.bf16.bf16.f32");
}

void ldmatrix(uint32_t *r, int nmat, bool trans, const void *row_addr) {
  if (nmat != 1 && nmat != 2 && nmat != 4) device_fault("ldmatrix of %d matrices", nmat);
  LdArgs a{r, nmat, trans, row_addr};
  warp_all_lanes(do_ldmatrix, &a, ld_name(nmat, trans));
}

} // namespace dfemu
