// IEEE half precision: the weights' fp16 scales, and the K/V cache, which the low-bit layers keep
// in fp16 (as llama.cpp does by default): half the bytes a step's attention reads. Converting a
// float rounds to the nearest half, ties to even, on every path (F16C's conversion, bit for bit),
// so the K/V written by the native layer, by the op-by-op path (torch's conversion) and by each
// SIMD path are the same bits.
#include "lowbit.h"

namespace dflash_lowbit {

float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  int32_t exp = (h >> 10) & 0x1F;
  uint32_t man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 1;
      while (!(man & 0x400)) { man <<= 1; --exp; }
      man &= 0x3FF;
      bits = sign | (uint32_t)(exp + 112) << 23 | (man << 13);
    }
  } else {
    bits = sign | (uint32_t)(exp + 112) << 23 | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

namespace {

// q, the value's bits shifted right, plus one where the `shift` bits dropped are over half, or
// exactly half and q is odd (round to nearest, ties to even)
inline uint32_t round_even(uint32_t m, int shift) {
  const uint32_t q = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  return q + (rest > half || (rest == half && (q & 1)));
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFF;
  if (ax > 0x7F800000) return sign | 0x7E00 | ((ax >> 13) & 0x3FF);  // NaN, made quiet
  if (ax >= 0x477FF000) return sign | 0x7C00;  // infinity, or rounds past 65504
  const int e = (int)(ax >> 23);
  if (e >= 113) return sign | round_even((uint32_t)(e - 112) << 23 | (ax & 0x7FFFFF), 13);  // normal
  if (ax <= 0x33000000) return sign;  // at most half the smallest subnormal (2^-25): zero
  return sign | round_even((ax & 0x7FFFFF) | 0x800000, 126 - e);  // subnormal, in units of 2^-24
}

__attribute__((target("avx512f,f16c")))
void to_half_avx512(const float* x, int64_t n, uint16_t* y) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256((__m256i*)(y + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) y[i] = float_to_half(x[i]);
}

__attribute__((target("avx2,f16c")))
void to_half_avx2(const float* x, int64_t n, uint16_t* y) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) y[i] = float_to_half(x[i]);
}

__attribute__((target("avx512f,f16c")))
void to_float_avx512(const uint16_t* x, int64_t n, float* y) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(x + i))));
  for (; i < n; ++i) y[i] = half_to_float(x[i]);
}

}  // namespace

void to_float(const uint16_t* x, int64_t n, float* y) {
  if (isa() == Isa::avx512) return to_float_avx512(x, n, y);
  for (int64_t i = 0; i < n; ++i) y[i] = half_to_float(x[i]);
}

void to_half(const float* x, int64_t n, uint16_t* y) {
  if (isa() == Isa::avx512) return to_half_avx512(x, n, y);
  if (isa() == Isa::avx2) return to_half_avx2(x, n, y);
  for (int64_t i = 0; i < n; ++i) y[i] = float_to_half(x[i]);
}

at::Tensor half(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "half: x must be float32");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty(xc.sizes(), xc.options().dtype(at::kHalf));
  to_half(xc.data_ptr<float>(), xc.numel(), reinterpret_cast<uint16_t*>(y.data_ptr<at::Half>()));
  return y;
}

}  // namespace dflash_lowbit
