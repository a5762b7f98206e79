// cuda/attention.cu (WMMA tensor-core attention) on the emulated device against the CPU
// reference (src/train/ops.c) on fresh random bf16 inputs: forward output and log-sum-exp,
// dQ, dK and dV of context and block, for head_dim 64 and 128 (and 40, 8: padded to 16),
// block sizes 4, 8, 10 and 16, full and sliding layers (windows shorter and longer than the
// block), 1 to 8 query heads per kv head, anchor 0 (no context) and anchors at the end of the
// sequence, context key tiles cut by the anchor, the Qwen3-8B (32/8) and Kimi (64/8) packings
// at head_dim 128 and block 16; between them every product's register-blocked unit whole
// and clipped at an edge (head_dim 40: 3 tiles), and both accumulator paths of each
// backward kernel (held in registers: Mp <= 64 for dQ, N x dp small enough for dK / dV;
// in shared memory: Kimi's dQ, d 128 at 4 warps for dK / dV). Every output is poisoned (NaN)
// before the kernels run; each shape runs under two thread-order seeds (so two
// element-to-lane mappings of the WMMA fragments), whose results must be bit-identical (the
// kernels do not depend on scheduling).
//
// Tolerances (inputs are bf16-exact; the GPU rounds P and dS to bf16 before the tensor-core
// products and its outputs to bf16, relative step 2^-8):
//   out, dQ, dK, dV    ||gpu - cpu|| / ||cpu|| <= 0.01 per tensor (0.0017-0.0034 measured)
//   lse                |gpu - cpu| <= 0.01 (an absolute log error: a relative error of l;
//                      1.4e-3 at most measured)
// Suite 'cuda-emu'; DFLASH_GPU_SEED repeats the inputs, DFLASH_EMU_SEED the thread order.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <ctime>
#include <vector>

#include "common.cuh"
#include "dflash/train.h"
extern "C" {
#include "core/bf16.h"
#include "train/ops.h"
}

static int failures;
#define CHECK(cond, ...)                          \
  do {                                            \
    if (!(cond)) {                                \
      failures++;                                 \
      printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      printf(__VA_ARGS__);                        \
      printf("\n");                               \
    }                                             \
  } while (0)

namespace {

struct Case {
  const char *name;
  int d, B, nh, nkv, window, Sc;
  std::vector<int32_t> anchors;
};

uint64_t g_state;
float unif() {
  g_state ^= g_state << 13, g_state ^= g_state >> 7, g_state ^= g_state << 17;
  return (float)((g_state >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

// Random bf16-exact values: the float copy for the CPU, the bf16 one for the device.
struct Buf {
  std::vector<float> f;
  std::vector<uint16_t> h;
  void *dev = nullptr;
  Buf(size_t n, float scale) : f(n), h(n) {
    for (size_t i = 0; i < n; i++) {
      h[i] = df_f32_to_bf16(scale * unif());
      f[i] = df_bf16_to_f32(h[i]);
    }
    if (cudaMalloc(&dev, 2 * (n ? n : 1)) ||
        cudaMemcpy(dev, h.data(), 2 * n, cudaMemcpyHostToDevice))
      abort();
  }
  ~Buf() { cudaFree(dev); }
  bf16 *b() const { return (bf16 *)dev; }
};

// A device output of n elements of `bytes` each, NaN-poisoned.
void *out_buf(size_t n, size_t bytes) {
  void *p = nullptr;
  if (cudaMalloc(&p, bytes * (n ? n : 1)) || cudaMemset(p, 0xff, bytes * (n ? n : 1))) abort();
  return p;
}
std::vector<float> bf16_back(const void *p, size_t n) {
  std::vector<uint16_t> h(n);
  std::vector<float> f(n);
  if (n && cudaMemcpy(h.data(), p, 2 * n, cudaMemcpyDeviceToHost)) abort();
  for (size_t i = 0; i < n; i++) f[i] = df_bf16_to_f32(h[i]);
  return f;
}
std::vector<float> f32_back(const void *p, size_t n) {
  std::vector<float> f(n);
  if (n && cudaMemcpy(f.data(), p, 4 * n, cudaMemcpyDeviceToHost)) abort();
  return f;
}

double rel_l2(const std::vector<float> &got, const std::vector<float> &ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); i++) {
    double e = (double)got[i] - ref[i];
    num += e * e, den += (double)ref[i] * ref[i];
  }
  if (std::isnan(num)) return INFINITY;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

struct Result {
  std::vector<float> out, lse, dq, dkc, dvc, dkb, dvb;
};

// The GPU's forward and backward (the backward from the GPU's own output and lse).
Result run_gpu(const Case &c, const Buf &q, const Buf &kc, const Buf &vc, const Buf &kb,
               const Buf &vb, const Buf &dout) {
  int A = (int)c.anchors.size();
  size_t T = (size_t)A * c.B, qn = T * c.nh * c.d, kn = T * c.nkv * c.d;
  size_t cn = (size_t)c.Sc * c.nkv * c.d;
  int32_t *anchors = nullptr;
  if (cudaMalloc(&anchors, 4 * (size_t)A) ||
      cudaMemcpy(anchors, c.anchors.data(), 4 * (size_t)A, cudaMemcpyHostToDevice))
    abort();
  df_attn_dev a{A, c.B, c.Sc, c.nh, c.nkv, c.d, c.window, anchors, 1.0f / sqrtf((float)c.d)};
  void *out = out_buf(qn, 2), *lse = out_buf(T * c.nh, 4), *D = out_buf(T * c.nh, 4);
  void *dq = out_buf(qn, 2), *dkb = out_buf(kn, 2), *dvb = out_buf(kn, 2);
  void *dkc = out_buf(cn, 2), *dvc = out_buf(cn, 2);
  dflash_status st = k_attention_forward(nullptr, &a, (bf16 *)out, (float *)lse, q.b(), kc.b(),
                                         vc.b(), kb.b(), vb.b());
  CHECK(st == DFLASH_OK, "%s: forward: %s", c.name, dflash_last_error());
  st = k_attention_backward(nullptr, &a, (bf16 *)dq, (bf16 *)dkc, (bf16 *)dvc, (bf16 *)dkb,
                            (bf16 *)dvb, (float *)D, dout.b(), (const bf16 *)out,
                            (const float *)lse, q.b(), kc.b(), vc.b(), kb.b(), vb.b());
  CHECK(st == DFLASH_OK, "%s: backward: %s", c.name, dflash_last_error());
  Result r{bf16_back(out, qn), f32_back(lse, T * c.nh), bf16_back(dq, qn), bf16_back(dkc, cn),
           bf16_back(dvc, cn), bf16_back(dkb, kn),      bf16_back(dvb, kn)};
  for (void *p : {out, lse, D, dq, dkb, dvb, dkc, dvc, (void *)anchors}) cudaFree(p);
  return r;
}

Result run_cpu(const Case &c, const Buf &q, const Buf &kc, const Buf &vc, const Buf &kb,
               const Buf &vb, const Buf &dout) {
  int A = (int)c.anchors.size();
  size_t T = (size_t)A * c.B, qn = T * c.nh * c.d, kn = T * c.nkv * c.d;
  size_t cn = (size_t)c.Sc * c.nkv * c.d;
  df_attn_shape s{A, c.B, c.Sc, c.nh, c.nkv, c.d, c.window, c.anchors.data()};
  std::vector<float> work(df_attention_work(nullptr, &s));
  Result r{std::vector<float>(qn), std::vector<float>(T * c.nh), std::vector<float>(qn),
           std::vector<float>(cn), std::vector<float>(cn),       std::vector<float>(kn),
           std::vector<float>(kn)};
  df_attention_forward(nullptr, &s, r.out.data(), r.lse.data(), q.f.data(), kc.f.data(),
                       vc.f.data(), kb.f.data(), vb.f.data(), work.data());
  df_attention_backward(nullptr, &s, r.dq.data(), r.dkc.data(), r.dvc.data(), r.dkb.data(),
                        r.dvb.data(), work.data(), dout.f.data(), r.out.data(), r.lse.data(),
                        q.f.data(), kc.f.data(), vc.f.data(), kb.f.data(), vb.f.data());
  return r;
}

bool same_bits(const Result &x, const Result &y) {
  auto eq = [](const std::vector<float> &a, const std::vector<float> &b) {
    return a.size() == b.size() && !std::memcmp(a.data(), b.data(), 4 * a.size());
  };
  return eq(x.out, y.out) && eq(x.lse, y.lse) && eq(x.dq, y.dq) && eq(x.dkc, y.dkc) &&
         eq(x.dvc, y.dvc) && eq(x.dkb, y.dkb) && eq(x.dvb, y.dvb);
}

void run_case(const Case &c, uint64_t seed) {
  g_state = seed * 2654435761u + 88172645463325252ull;
  int A = (int)c.anchors.size();
  size_t T = (size_t)A * c.B;
  Buf q(T * c.nh * c.d, 2.0f), kc((size_t)c.Sc * c.nkv * c.d, 2.0f);
  Buf vc((size_t)c.Sc * c.nkv * c.d, 1.0f), kb(T * c.nkv * c.d, 2.0f);
  Buf vb(T * c.nkv * c.d, 1.0f), dout(T * c.nh * c.d, 1.0f);
  Result cpu = run_cpu(c, q, kc, vc, kb, vb, dout);
  uint64_t s0 = dfemu::seed();
  Result g1 = run_gpu(c, q, kc, vc, kb, vb, dout);
  dfemu::set_seed(s0 * 31 + 7); // another thread order and WMMA element mapping
  Result g2 = run_gpu(c, q, kc, vc, kb, vb, dout);
  dfemu::set_seed(0);
  CHECK(same_bits(g1, g2), "%s: results differ between two thread-order seeds", c.name);
  double lse_err = 0;
  for (size_t i = 0; i < cpu.lse.size(); i++) {
    double e = std::fabs((double)g1.lse[i] - cpu.lse[i]);
    lse_err = std::isnan(e) ? INFINITY : e > lse_err ? e : lse_err;
  }
  struct {
    const char *what;
    const std::vector<float> &g, &r;
  } t[] = {{"out", g1.out, cpu.out},    {"dq", g1.dq, cpu.dq},       {"dk ctx", g1.dkc, cpu.dkc},
           {"dv ctx", g1.dvc, cpu.dvc}, {"dk blk", g1.dkb, cpu.dkb}, {"dv blk", g1.dvb, cpu.dvb}};
  printf("%-28s lse %.1e", c.name, lse_err);
  for (auto &x : t) {
    double e = rel_l2(x.g, x.r);
    printf("  %s %.4f", x.what, e);
    CHECK(e <= 0.01, "%s: %s relative L2 error %.4f > 0.01", c.name, x.what, e);
  }
  printf("\n");
  CHECK(lse_err <= 0.01, "%s: lse error %.3g > 0.01", c.name, lse_err);
}

// Shapes whose forward or backward cannot fit a block's shared memory are refused before any
// launch, with DFLASH_E_UNSUPPORTED naming shared memory: on sm_120 (99 KB per block) head_dim
// 192 and 256 at 128 rows per CTA; everywhere more than 128 rows. On sm_90 / sm_100 (227 KB)
// head_dim 192 at 128 rows runs.
bool small_smem() {
  int v = 0;
  cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
  return v < 200000;
}
struct Bad {
  int d, B, nh, nkv;
};
void test_unsupported() {
  const Bad bad_sm120[] = {{192, 16, 8, 1},  // the forward fits, the backward does not
                           {256, 128, 1, 1}, // 128 rows of head_dim 256: 131 KB for Q and dO alone
                           {64, 16, 9, 1}},  // 144 rows per CTA
      bad_sm90[] = {{64, 16, 9, 1}};
  std::vector<Bad> bad;
  if (small_smem()) bad.assign(std::begin(bad_sm120), std::end(bad_sm120));
  else bad.assign(std::begin(bad_sm90), std::end(bad_sm90));
  for (auto &b : bad) {
    df_attn_dev a{1, b.B, 8, b.nh, b.nkv, b.d, 0, nullptr, 1.0f};
    dflash_status st = k_attention_check(&a);
    const char *msg = dflash_last_error();
    CHECK(st == DFLASH_E_UNSUPPORTED, "d %d B %d %d/%d: status %d, not unsupported", b.d, b.B, b.nh,
          b.nkv, (int)st);
    printf("refused d %d B %d %d/%d: %s\n", b.d, b.B, b.nh, b.nkv, msg);
    st = k_attention_backward(nullptr, &a, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                              nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                              nullptr);
    CHECK(st == DFLASH_E_UNSUPPORTED, "backward of d %d B %d: status %d", b.d, b.B, (int)st);
  }
  // Through the public API: the trainer is refused at create on sm_120 (it used to be
  // created, and fail with DFLASH_E_CUDA from cudaFuncSetAttribute at its first backward),
  // created on sm_90.
  dflash_drafter_config c;
  dflash_drafter_config_default(&c);
  c.hidden_size = 128, c.intermediate_size = 256, c.num_hidden_layers = 1;
  c.num_attention_heads = 8, c.num_key_value_heads = 1, c.head_dim = 192, c.vocab_size = 64;
  c.num_target_layers = 4, c.block_size = 16, c.mask_token_id = 63;
  c.n_target_layer_ids = 1, c.target_layer_ids[0] = 1;
  std::vector<float> E((size_t)c.vocab_size * c.hidden_size, 0.01f);
  dflash_trainer_options o;
  dflash_trainer_options_default(&o);
  o.backend = DFLASH_BACKEND_CUDA;
  dflash_trainer *t = nullptr;
  dflash_status st = dflash_drafter_config_validate(&c);
  CHECK(st == DFLASH_OK, "config: %s", dflash_last_error());
  st = dflash_trainer_create(&c, E.data(), E.data(), &o, &t);
  if (small_smem()) {
    CHECK(st == DFLASH_E_UNSUPPORTED && !t,
          "a CUDA trainer at head_dim 192, 8 query heads per kv head, block 16: status %d, not "
          "refused at create",
          (int)st);
    printf("trainer refused: %s\n", dflash_last_error());
  } else {
    CHECK(st == DFLASH_OK && t, "head_dim 192 at 128 rows refused on 227 KB: %s",
          dflash_last_error());
  }
  dflash_trainer_free(t);
  // The drafters' shapes fit every target: Kimi (64/8) and Qwen3-8B (32/8) at head_dim 128.
  df_attn_dev qwen{1, 16, 8, 32, 8, 128, 0, nullptr, 1.0f};
  CHECK(k_attention_check(&qwen) == DFLASH_OK, "Qwen3-8B's 32/8 x 128 at block 16 refused: %s",
        dflash_last_error());
  df_attn_dev ok{1, 16, 8, 64, 8, 128, 0, nullptr, 1.0f}; // Kimi: 128 rows, d 128
  CHECK(k_attention_check(&ok) == DFLASH_OK, "Kimi's 64/8 x 128 at block 16 refused: %s",
        dflash_last_error());
}

} // namespace

int main() {
  const char *fixed = getenv("DFLASH_GPU_SEED");
  uint64_t seed = fixed ? strtoull(fixed, nullptr, 10) : (uint64_t)time(nullptr);
  printf("input seed %llu (DFLASH_GPU_SEED reproduces), thread-order seed %llu\n",
         (unsigned long long)seed, (unsigned long long)dfemu::seed());
  test_unsupported();
  // name, d, B, nh, nkv, window, Sc, anchors
  const Case cases[] = {
      {"d64 B8 gqa4 full", 64, 8, 4, 1, 0, 150, {0, 5, 70, 140, 149}},
      {"d128 B16 gqa8 sliding24", 128, 16, 8, 1, 24, 90, {0, 33, 88, 89}},
      {"d64 B10 gqa3 sliding7", 64, 10, 6, 2, 7, 80, {3, 0, 41, 79}},
      {"d128 B10 gqa1 full", 128, 10, 2, 2, 0, 100, {99, 64, 1, 0}},
      {"d64 B16 gqa5 full", 64, 16, 5, 1, 0, 70, {69, 68, 20}},
      {"d64 B8 gqa7 sliding40", 64, 8, 14, 2, 40, 130, {129, 100, 50, 0}},
      {"d128 B8 gqa2 sliding64", 128, 8, 4, 2, 64, 140, {139, 70, 128}},
      {"d64 B16 gqa6 sliding16", 64, 16, 6, 1, 16, 60, {59, 30, 8}},
      {"d64 B8 gqa2 anchors 0", 64, 8, 4, 2, 0, 40, {0, 0}},
      {"d40 B10 gqa2 sliding12", 40, 10, 4, 2, 12, 50, {49, 20, 0}}, // head_dim padded to 48
      {"d8 B4 gqa2 full", 8, 4, 4, 2, 0, 30, {29, 9, 0}},
      // The drafters' packings: Qwen3-8B (32/8: 64 rows, 8 warps, every product's unit
      // whole) and Kimi (64/8: 128 rows), with context tiles cut by the anchor.
      {"d128 B16 gqa4 full", 128, 16, 4, 1, 0, 150, {149, 70, 0, 100}},
      {"d128 B16 gqa4 sliding48", 128, 16, 8, 2, 48, 130, {129, 64, 10}},
      {"d128 B16 gqa8 full", 128, 16, 8, 1, 0, 140, {139, 65, 3}},
  };
  for (const Case &c : cases) run_case(c, seed++);
  printf("%s (%d failures)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
