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

// The AVX-512 VNNI code runs where the CPU has it, unless $DFLASH_NATIVE_PORTABLE is set (the
// portable code everywhere: how the tests check it on such a CPU).
inline bool has_avx512() {
  static const bool ok = std::getenv("DFLASH_NATIVE_PORTABLE") == nullptr &&
                         __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  return ok;
}

float half_to_float(uint16_t h);

// exp by range reduction and a degree-6 polynomial (Cephes' expf)
__attribute__((target("avx512f,fma")))
inline __m512 exp_avx512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
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

// out (T, heads, dim) = attention of q (T, heads, dim) over the layer's k, v (groups, S, dim):
// row i over slots 0..past-1 and the new slots mask (T, T) allows (nullptr: causal).
void attend_into(const float* q, int64_t t, int64_t heads, int64_t dim, const float* k, const float* v,
                 int64_t groups, int64_t hstride, int64_t past, const bool* mask, float scale, float* out);

// the ops (ops.cpp registers them)
at::Tensor qmm(const at::Tensor& x, const at::Tensor& u, const at::Tensor& d, const at::Tensor& m, int64_t n, int64_t bits);
std::vector<at::Tensor> quantize(const at::Tensor& x);
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t past,
                  const c10::optional<at::Tensor>& mask, double scale);
std::vector<at::Tensor> llama_forward(const at::Tensor& x, at::TensorList weights, at::IntArrayRef bits,
                                      const at::Tensor& norms, double eps, const at::Tensor& cos, const at::Tensor& sin,
                                      at::TensorList k_all, at::TensorList v_all, at::IntArrayRef pasts,
                                      at::IntArrayRef counts, at::TensorList masks, double scale, int64_t heads,
                                      at::IntArrayRef keep);

}  // namespace dflash_lowbit
