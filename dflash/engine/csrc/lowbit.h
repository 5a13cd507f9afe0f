// Shared by the engine's native kernels (see qmm.cpp, attend.cpp, layer.cpp, ops.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace dflash_lowbit {

constexpr int64_t QK = 32;  // weights per block
constexpr int64_t NC = 16;  // output columns per tile
constexpr int MR = 8;       // rows per register pass

// The SIMD code the kernels run: AVX-512 VNNI where the CPU has it, else AVX2 (with FMA and F16C:
// the products only; attention and the layer's other ops run the portable code), else portable
// C++. $DFLASH_NATIVE_ISA ("avx2" or "portable") caps it: how the tests run every path on one CPU.
enum class Isa { portable = 0, avx2 = 1, avx512 = 2 };

inline Isa detect_isa() {
  const char* cap = std::getenv("DFLASH_NATIVE_ISA");
  const Isa limit = cap == nullptr ? Isa::avx512 : std::strcmp(cap, "avx2") == 0 ? Isa::avx2 : Isa::portable;
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  const Isa found = avx512 ? Isa::avx512 : avx2 ? Isa::avx2 : Isa::portable;
  return (int)found < (int)limit ? found : limit;
}

inline Isa isa() {
  static const Isa found = detect_isa();
  return found;
}

inline bool has_avx512() { return isa() == Isa::avx512; }

// IEEE half (half.cpp): exact to float; from float rounded to nearest, ties to even, on every path
float half_to_float(uint16_t h);
void to_half(const float* x, int64_t n, uint16_t* y);
void to_float(const uint16_t* x, int64_t n, float* y);

// exp by range reduction and a degree-6 polynomial (Cephes' expf): x = n ln2 + r, n = round(x /
// ln2) (ln2 in two parts), exp(r) = 1 + r + r^2 P(r), P's coefficients highest first
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

__attribute__((target("avx512f,fma")))
inline __m512 exp_avx512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x));
  __m512 p = _mm512_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// The same on 8 lanes, for AVX2 (x kept to [-87, 88], so 2^n is a normal float built from its bits)
__attribute__((target("avx2,fma")))
inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x));
  __m256 p = _mm256_set1_ps(EXP_P[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// The lanes' sum in a fixed order: halves, then pairs, then the last two
__attribute__((target("avx2"), always_inline)) inline float hsum_avx2(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

struct Weight {
  const uint8_t* u;   // (tiles, blocks, 256 or 512) bytes
  const uint16_t* d;  // (tiles, blocks, 16) fp16
  const uint16_t* m;  // (tiles, blocks, 16) fp16
  int64_t n, k, nb, block_bytes;
  bool nibbles;
};

// A weight's tensors checked against its shape (N, K) and bits, as the kernel reads them.
Weight weight_of(const at::Tensor& u, const at::Tensor& d, const at::Tensor& m, int64_t n, int64_t k, int64_t bits);

// y (rows, N) = x (rows, K) times the weight; rows independent of each other.
void qmm_into(const float* x, int64_t rows, const Weight& w, float* y);

// out (T, heads, dim) = attention of q (T, heads, dim) over the layer's k, v (groups, S, dim), fp16:
// row i over slots 0..past-1 and the new slots mask (T, T) allows (nullptr: causal).
void attend_into(const float* q, int64_t t, int64_t heads, int64_t dim, const uint16_t* k, const uint16_t* v,
                 int64_t groups, int64_t hstride, int64_t past, const bool* mask, float scale, float* out);

// the ops (ops.cpp registers them)
at::Tensor qmm(const at::Tensor& x, const at::Tensor& u, const at::Tensor& d, const at::Tensor& m, int64_t n, int64_t bits);
std::vector<at::Tensor> quantize(const at::Tensor& x);
at::Tensor half(const at::Tensor& x);
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t past,
                  const c10::optional<at::Tensor>& mask, double scale);
std::vector<at::Tensor> llama_forward(const at::Tensor& x, at::TensorList weights, at::IntArrayRef bits,
                                      const at::Tensor& norms, double eps, const at::Tensor& cos, const at::Tensor& sin,
                                      at::TensorList k_all, at::TensorList v_all, at::IntArrayRef pasts,
                                      at::IntArrayRef counts, at::TensorList masks, double scale, int64_t heads,
                                      at::IntArrayRef keep);

}  // namespace dflash_lowbit
