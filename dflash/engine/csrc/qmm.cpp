// Low-bit products (and, in attend.cpp, attention) for the target's step on a CPU, built once per machine by
// dflash/engine/native.py (torch's C++ extension loader, the system compiler).
//
// Both kernels compute every output row with the same code and the same order of float
// operations whatever the number of rows in the call, so a verify pass over n tokens gives
// each row the bits n one-token steps give (batch invariance: speculative output equals
// plain decoding at the same precision, token for token).
//
// qmm: y (M, N) = x (M, K) times a block-quantised weight (N, K). The weight is 32-weight
// blocks, each u8 values u with an fp16 scale d and an fp16 offset m: w = d * u + m
// (GGUF Q4_1: u in 0..15; GGUF Q8_0 is q in -128..127 with m = -128 d after u = q + 128).
// The activations are quantised per row and block as llama.cpp does (int8, scale = max|x| /
// 127), so a block's dot product is an exact integer sum, scaled: d dx sum(u q) + m dx sum(q).
// Layout: 16 output columns per tile; per (tile, block) 8 groups of [16 columns x 4 weights]
// (64 bytes each), so one VNNI instruction adds 4 products to each of 16 columns; 4-bit values
// are two groups to a byte (group g in the low nibble, g + 4 in the high one). Scales and
// offsets are (tiles, blocks, 16) fp16.
//
// Code: AVX-512 VNNI, AVX2 or portable C++ (lowbit.h, isa()), the same integer sums and the same
// float operations in the same order on each, so the same bits.
//
// attend: softmax(q k^T * scale) v for the new rows of one layer, each row over the cached
// prefix and the new slots its mask row allows, taken in slot order.
#include "lowbit.h"

namespace dflash_lowbit {

// ---- activations: int8 per row and block -------------------------------------------------
// q int8 (32 a block), d, s: the scale and d * sum(q), at `slot(...)`: row-major (M, K) when
// chunks = 0, else the kernel's (blocks, chunks, MR, 32). Same bits on every path: the max is
// exact, one division, one multiply per value, round to nearest even.
inline int64_t slot(int64_t m, int64_t b, int64_t nb, int64_t chunks) {
  return chunks ? (b * chunks + m / MR) * MR + m % MR : m * nb + b;
}

void quantize_scalar(const float* x, int64_t M, int64_t K, int64_t chunks, int8_t* q, float* d, float* s) {
  const int64_t nb = K / QK;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QK;
      const int64_t at = slot(m, b, nb, chunks);
      float amax = 0.f;
      for (int64_t i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float dd = amax / 127.f;
      const float id = dd > 0.f ? 1.f / dd : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < QK; ++i) {
        const int32_t v = (int32_t)std::nearbyint(xb[i] * id);
        q[at * QK + i] = (int8_t)v;
        sum += v;
      }
      d[at] = dd;
      s[at] = dd * (float)sum;
    }
}

__attribute__((target("avx512f,avx512bw,avx512vl")))
void quantize_avx512(const float* x, int64_t M, int64_t K, int64_t chunks, int8_t* q, float* d, float* s) {
  const int64_t nb = K / QK;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * K + b * QK;
      const int64_t at = slot(m, b, nb, chunks);
      const __m512 a = _mm512_loadu_ps(xb), c = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
      const float dd = amax / 127.f;
      const float id = dd > 0.f ? 1.f / dd : 0.f;
      const __m512 vid = _mm512_set1_ps(id);
      const __m512i qa = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512i qc = _mm512_cvt_roundps_epi32(_mm512_mul_ps(c, vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128((__m128i*)(q + at * QK), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128((__m128i*)(q + at * QK + 16), _mm512_cvtsepi32_epi8(qc));
      const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
      d[at] = dd;
      s[at] = dd * (float)sum;
    }
}

// ---- the product ------------------------------------------------------------------------
// Activations regrouped for the kernel: per block, per chunk of MR rows, the rows' 32 values
// (q (blocks, chunks, MR, 32)) and their scales and sums (d, s (blocks, chunks, MR)), so that
// one pointer and constant offsets reach every row of a chunk.
struct Acts {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t chunks;
};

// The unpacked value of column c, weight i (0..31) of block b in tile t.
inline int32_t weight_value(const Weight& w, int64_t t, int64_t b, int64_t c, int64_t i) {
  const uint8_t* p = w.u + (t * w.nb + b) * w.block_bytes;
  const int64_t g = i / 4, j = i % 4;
  if (!w.nibbles) return p[g * 64 + c * 4 + j];
  const uint8_t v = p[(g % 4) * 64 + c * 4 + j];
  return g < 4 ? (v & 0x0F) : (v >> 4);
}

// The portable tile: the same integer sums and the same float operations, in the same order, as
// tile_avx512 (so the same bits); a block's weights unpacked once for all the rows.
__attribute__((always_inline)) inline void tile_portable(const Weight& w, const Acts& x, int64_t t, int64_t r0,
                                                         int64_t rows, float* y) {
  float acc[MR][NC] = {};
  uint8_t wv[NC][QK];
  float dw[NC], mw[NC];
  for (int64_t b = 0; b < w.nb; ++b) {
    for (int64_t c = 0; c < NC; ++c) {
      for (int64_t i = 0; i < QK; ++i) wv[c][i] = (uint8_t)weight_value(w, t, b, c, i);
      dw[c] = half_to_float(w.d[(t * w.nb + b) * NC + c]);
      mw[c] = half_to_float(w.m[(t * w.nb + b) * NC + c]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = (b * x.chunks + r0 / MR) * MR + r;
      const int8_t* xq = x.q + at * QK;
      const float xd = x.d[at], xs = x.s[at];
      for (int64_t c = 0; c < NC; ++c) {
        int32_t isum = 0;
        for (int64_t i = 0; i < QK; ++i) isum += (int32_t)wv[c][i] * (int32_t)xq[i];
        acc[r][c] = std::fmaf((float)isum, dw[c] * xd, acc[r][c]);
        acc[r][c] = std::fmaf(mw[c], xs, acc[r][c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < NC; ++c) y[(r0 + r) * w.n + t * NC + c] = acc[r][c];
}

// with hardware fma and AVX2 where the CPU has them (fmaf is exact either way: the same bits)
__attribute__((target("avx2,fma"))) void tile_scalar_avx2(const Weight& w, const Acts& x, int64_t t, int64_t r0,
                                                           int64_t rows, float* y) {
  tile_portable(w, x, t, r0, rows, y);
}

void tile_scalar(const Weight& w, const Acts& x, int64_t t, int64_t r0, int64_t rows, float* y) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return tile_scalar_avx2(w, x, t, r0, rows, y);
  tile_portable(w, x, t, r0, rows, y);
}

constexpr int64_t PF = 16;  // blocks ahead of the one in use (4 KiB of 4-bit weights)

// Ask for the weights, scales and offsets of the block PF ahead of block b of tile t (into the
// next tiles at the end of this one; a prefetch past the end of the weight does not fault).
inline void prefetch_ahead(const Weight& w, int64_t t, int64_t b) {
  const uint8_t* ahead = w.u + (t * w.nb + b + PF) * w.block_bytes;
  for (int64_t line = 0; line < w.block_bytes; line += 64) _mm_prefetch((const char*)(ahead + line), _MM_HINT_T0);
  _mm_prefetch((const char*)(w.d + (t * w.nb + b + PF) * NC), _MM_HINT_T0);
  _mm_prefetch((const char*)(w.m + (t * w.nb + b + PF) * NC), _MM_HINT_T0);
}

template <int R, bool NIB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
void tile_avx512(const Weight& w, const Acts& x, int64_t t, int64_t r0, float* y) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* p = w.u + (t * w.nb + b) * w.block_bytes;
    if (r0 == 0) prefetch_ahead(w, t, b);  // the first pass over a tile streams its weights from memory
    __m512i u[8];
    if (NIB) {
      for (int g = 0; g < 4; ++g) {
        const __m512i v = _mm512_loadu_si512(p + 64 * g);
        u[g] = _mm512_and_si512(v, low);
        u[g + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int g = 0; g < 8; ++g) u[g] = _mm512_loadu_si512(p + 64 * g);
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w.d + (t * w.nb + b) * NC)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(w.m + (t * w.nb + b) * NC)));
    const int64_t at = (b * x.chunks + r0 / MR) * MR;  // this block's chunk of rows
    const int32_t* xq = (const int32_t*)(x.q + at * QK);
    const float* xd = x.d + at;
    const float* xs = x.s + at;
    __m512i isum[R];  // the rows' chains interleaved: each VNNI op waits on its own row's last one only
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int g = 0; g < 8; ++g)
      for (int r = 0; r < R; ++r) isum[r] = _mm512_dpbusd_epi32(isum[r], u[g], _mm512_set1_epi32(xq[r * 8 + g]));
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[r]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * w.n + t * NC, acc[r]);
}

template <bool NIB>
void rows_avx512(const Weight& w, const Acts& x, int64_t t, int64_t r0, int64_t rows, float* y) {
  switch (rows) {
    case 1: return tile_avx512<1, NIB>(w, x, t, r0, y);
    case 2: return tile_avx512<2, NIB>(w, x, t, r0, y);
    case 3: return tile_avx512<3, NIB>(w, x, t, r0, y);
    case 4: return tile_avx512<4, NIB>(w, x, t, r0, y);
    case 5: return tile_avx512<5, NIB>(w, x, t, r0, y);
    case 6: return tile_avx512<6, NIB>(w, x, t, r0, y);
    case 7: return tile_avx512<7, NIB>(w, x, t, r0, y);
    default: return tile_avx512<8, NIB>(w, x, t, r0, y);
  }
}

// The AVX2 tile: the same integer sums and float operations as tile_avx512 (so the same bits), on
// 8 columns (half h of a tile) for up to 4 rows, so that everything stays in AVX2's 16
// registers. Without VNNI a group's products are u8 x s8 pairs summed to int16 (maddubs): a pair
// of 4-bit values (0..15) times int8 activations (|q| <= 127) is at most 3810, so a block's 8
// groups add up in int16 lanes (<= 30480) and go to int32 once (madd); 8-bit values are taken as
// two nibbles, u = 16 hi + lo, each summed that way.
// Keeps a running sum in its register as the source orders it: without this GCC reassociates the
// integer adds into trees of temporaries that spill out of AVX2's 16 registers (~20% slower at 64+ rows).
__attribute__((always_inline)) inline void in_register(__m256i& v) { asm volatile("" : "+x"(v)); }

template <int R, bool NIB>
__attribute__((target("avx2,fma,f16c")))
void half_avx2(const Weight& w, const Acts& x, int64_t t, int h, int64_t r0, float* y) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* p = w.u + (t * w.nb + b) * w.block_bytes + 32 * h;
    if (r0 == 0 && h == 0) prefetch_ahead(w, t, b);  // as tile_avx512
    const int64_t at = (b * x.chunks + r0 / MR) * MR + r0 % MR;  // row r0 in this block's chunk of rows
    const int32_t* xq = (const int32_t*)(x.q + at * QK);
    __m256i isum[R];
    if (NIB) {
      __m256i s16[R];
      for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
      for (int g = 0; g < 4; ++g) {  // groups g (low nibbles) and g + 4 (high)
        const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 64 * g));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[r * 8 + g])));
          s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[r * 8 + g + 4])));
          in_register(s16[r]);
        }
      }
      for (int r = 0; r < R; ++r) isum[r] = _mm256_madd_epi16(s16[r], ones);
    } else {
      __m256i s_lo[R], s_hi[R];
      for (int r = 0; r < R; ++r) s_lo[r] = s_hi[r] = _mm256_setzero_si256();
      for (int g = 0; g < 8; ++g) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(p + 64 * g));
        const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        for (int r = 0; r < R; ++r) {
          const __m256i xr = _mm256_set1_epi32(xq[r * 8 + g]);
          s_lo[r] = _mm256_add_epi16(s_lo[r], _mm256_maddubs_epi16(lo, xr));
          s_hi[r] = _mm256_add_epi16(s_hi[r], _mm256_maddubs_epi16(hi, xr));
          in_register(s_lo[r]);
          in_register(s_hi[r]);
        }
      }
      for (int r = 0; r < R; ++r)
        isum[r] = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(s_hi[r], ones), 4),
                                   _mm256_madd_epi16(s_lo[r], ones));
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.d + (t * w.nb + b) * NC + 8 * h)));
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.m + (t * w.nb + b) * NC + 8 * h)));
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[at + r]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), scale, acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[at + r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * w.n + t * NC + 8 * h, acc[r]);
}

// A tile's rows r0 .. r0 + rows - 1 (one chunk of MR), both halves, 4 rows at a time.
template <bool NIB>
void rows_avx2(const Weight& w, const Acts& x, int64_t t, int64_t r0, int64_t rows, float* y) {
  for (int h = 0; h < 2; ++h)
    for (int64_t q = 0; q < rows; q += 4) {
      switch (std::min<int64_t>(4, rows - q)) {
        case 1: half_avx2<1, NIB>(w, x, t, h, r0 + q, y); break;
        case 2: half_avx2<2, NIB>(w, x, t, h, r0 + q, y); break;
        case 3: half_avx2<3, NIB>(w, x, t, h, r0 + q, y); break;
        default: half_avx2<4, NIB>(w, x, t, h, r0 + q, y);
      }
    }
}

Weight weight_of(const at::Tensor& u, const at::Tensor& d, const at::Tensor& m, int64_t n, int64_t k, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "qmm: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(n % NC == 0 && k % QK == 0, "qmm: weight (", n, ", ", k, ") needs N % 16 == 0 and K % 32 == 0");
  const int64_t block_bytes = bits == 4 ? 256 : 512;
  TORCH_CHECK(u.scalar_type() == at::kByte && u.is_contiguous() && u.numel() == (n / NC) * (k / QK) * block_bytes,
              "qmm: packed values do not match the weight's shape");
  for (const auto* t : {&d, &m})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == n * (k / QK),
                "qmm: scales and offsets must be contiguous fp16 of (N / 16, K / 32, 16)");
  return Weight{u.data_ptr<uint8_t>(), (const uint16_t*)d.data_ptr<at::Half>(), (const uint16_t*)m.data_ptr<at::Half>(),
                n, k, k / QK, block_bytes, bits == 4};
}

void quantize_into(const float* x, int64_t m, int64_t k, int64_t chunks, int8_t* q, float* d, float* s) {
  (has_avx512() ? quantize_avx512 : quantize_scalar)(x, m, k, chunks, q, d, s);
}

std::vector<at::Tensor> quantize(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quantize: x must be float32");
  const int64_t k = x.size(-1);
  TORCH_CHECK(k % QK == 0, "quantize: the last dimension (", k, ") must be a multiple of 32");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.numel() / k;
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, k / QK}, x.options());
  at::Tensor s = at::empty({m, k / QK}, x.options());
  quantize_into(xc.data_ptr<float>(), m, k, 0, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>());
  return {q, d, s};
}

void qmm_into(const float* x, int64_t rows, const Weight& w, float* out) {
  const int64_t k = w.k, nb = w.nb, chunks = (rows + MR - 1) / MR;
  // one buffer: q (blocks, chunks, MR, 32) int8, then d and s (blocks, chunks, MR) float; a last
  // chunk's missing rows are zero (their outputs are never stored)
  const int64_t slots = nb * chunks * MR;
  thread_local std::vector<float> buf;  // this thread's scratch, grown as needed
  buf.assign(slots * (QK / 4 + 2), 0.f);
  int8_t* xq = (int8_t*)buf.data();
  float* xd = buf.data() + slots * QK / 4;
  float* xs = xd + slots;
  quantize_into(x, rows, k, chunks, xq, xd, xs);
  const Acts a{xq, xd, xs, chunks};
  const Isa simd = isa();
  const int64_t tiles = w.n / NC;
  const int64_t grain = std::max<int64_t>(1, tiles / (4 * at::get_num_threads()));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        const int64_t r = std::min<int64_t>(MR, rows - r0);
        if (simd == Isa::avx512) {
          if (w.nibbles) rows_avx512<true>(w, a, t, r0, r, out);
          else rows_avx512<false>(w, a, t, r0, r, out);
        } else if (simd == Isa::avx2) {
          if (w.nibbles) rows_avx2<true>(w, a, t, r0, r, out);
          else rows_avx2<false>(w, a, t, r0, r, out);
        } else {
          tile_scalar(w, a, t, r0, r, out);
        }
      }
  });
}

at::Tensor qmm(const at::Tensor& x, const at::Tensor& u, const at::Tensor& d, const at::Tensor& m,
               int64_t n, int64_t bits) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "qmm: x must be float32");
  const int64_t k = x.size(-1);
  const Weight w = weight_of(u, d, m, n, k, bits);
  const at::Tensor xc = x.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  qmm_into(xc.data_ptr<float>(), xc.numel() / k, w, y.data_ptr<float>());
  return y;
}

}  // namespace dflash_lowbit
