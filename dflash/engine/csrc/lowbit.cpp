// Low-bit products and attention for the target's step on a CPU, built once per machine by
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
// attend: softmax(q k^T * scale) v for the new rows of one layer, each row over the cached
// prefix and the new slots its mask row allows, taken in slot order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t QK = 32;  // weights per block
constexpr int64_t NC = 16;  // output columns per tile
constexpr int MR = 8;       // rows per register pass

bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  return ok;
}

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
struct Weight {
  const uint8_t* u;   // (tiles, blocks, 256 or 512) bytes
  const uint16_t* d;  // (tiles, blocks, 16) fp16
  const uint16_t* m;  // (tiles, blocks, 16) fp16
  int64_t n, k, nb, block_bytes;
  bool nibbles;
};

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

void tile_scalar(const Weight& w, const Acts& x, int64_t t, int64_t r0, int64_t rows, float* y) {
  const int64_t c0 = r0 / MR;
  for (int64_t r = r0; r < r0 + rows; ++r) {
    float acc[NC] = {0.f};
    for (int64_t b = 0; b < w.nb; ++b) {
      const int64_t at = (b * x.chunks + c0) * MR + (r - r0);
      const int8_t* xq = x.q + at * QK;
      const float xd = x.d[at], xs = x.s[at];
      for (int64_t c = 0; c < NC; ++c) {
        int32_t isum = 0;
        for (int64_t i = 0; i < QK; ++i) isum += weight_value(w, t, b, c, i) * (int32_t)xq[i];
        const float dw = half_to_float(w.d[(t * w.nb + b) * NC + c]);
        const float mw = half_to_float(w.m[(t * w.nb + b) * NC + c]);
        const float scale = dw * xd;
        acc[c] = std::fmaf((float)isum, scale, acc[c]);
        acc[c] = std::fmaf(mw, xs, acc[c]);
      }
    }
    for (int64_t c = 0; c < NC; ++c) y[r * w.n + t * NC + c] = acc[c];
  }
}

template <int R, bool NIB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))
void tile_avx512(const Weight& w, const Acts& x, int64_t t, int64_t r0, float* y) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < w.nb; ++b) {
    const uint8_t* p = w.u + (t * w.nb + b) * w.block_bytes;
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

void check_weight(const at::Tensor& u, const at::Tensor& d, const at::Tensor& m, int64_t n, int64_t k, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "qmm: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(n % NC == 0 && k % QK == 0, "qmm: weight (", n, ", ", k, ") needs N % 16 == 0 and K % 32 == 0");
  const int64_t block_bytes = bits == 4 ? 256 : 512;
  TORCH_CHECK(u.scalar_type() == at::kByte && u.is_contiguous() && u.numel() == (n / NC) * (k / QK) * block_bytes,
              "qmm: packed values do not match the weight's shape");
  for (const auto* t : {&d, &m})
    TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->numel() == n * (k / QK),
                "qmm: scales and offsets must be contiguous fp16 of (N / 16, K / 32, 16)");
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

at::Tensor qmm(const at::Tensor& x, const at::Tensor& u, const at::Tensor& d, const at::Tensor& m,
               int64_t n, int64_t bits) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "qmm: x must be float32");
  const int64_t k = x.size(-1);
  check_weight(u, d, m, n, k, bits);
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.numel() / k, nb = k / QK, chunks = (rows + MR - 1) / MR;
  // one buffer: q (blocks, chunks, MR, 32) int8, then d and s (blocks, chunks, MR) float; a last
  // chunk's missing rows are zero (their outputs are never stored)
  const int64_t slots = nb * chunks * MR;
  thread_local std::vector<float> buf;  // this thread's scratch, grown as needed
  buf.assign(slots * (QK / 4 + 2), 0.f);
  int8_t* xq = (int8_t*)buf.data();
  float* xd = buf.data() + slots * QK / 4;
  float* xs = xd + slots;
  quantize_into(xc.data_ptr<float>(), rows, k, chunks, xq, xd, xs);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor y = at::empty(shape, x.options());
  const Weight w{u.data_ptr<uint8_t>(), (const uint16_t*)d.data_ptr<at::Half>(), (const uint16_t*)m.data_ptr<at::Half>(),
                 n, k, k / QK, bits == 4 ? 256 : 512, bits == 4};
  const Acts a{xq, xd, xs, chunks};
  float* out = y.data_ptr<float>();
  const bool fast = has_avx512();
  const int64_t tiles = n / NC;
  const int64_t grain = std::max<int64_t>(1, tiles / (4 * at::get_num_threads()));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        const int64_t r = std::min<int64_t>(MR, rows - r0);
        if (!fast) tile_scalar(w, a, t, r0, r, out);
        else if (w.nibbles) rows_avx512<true>(w, a, t, r0, r, out);
        else rows_avx512<false>(w, a, t, r0, r, out);
      }
  });
  return y;
}

// ---- attention ----------------------------------------------------------------------------
// exp by range reduction and a degree-6 polynomial (Cephes' expf); the scalar twin gives the
// same bits (same operations, fma where the vector path fuses).
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

// One query row of one head over `count` visible slots (their indices in `slots`).
__attribute__((target("avx512f,fma")))
void attend_row_avx512(const float* q, const float* k, const float* v, int64_t ks, const int64_t* slots,
                       int64_t count, int64_t dim, float scale, float* scores, float* out) {
  const int64_t nv = dim / 16;
  __m512 qv[16];
  for (int64_t j = 0; j < nv; ++j) qv[j] = _mm512_loadu_ps(q + 16 * j);
  float best = -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    const float* kr = k + slots[i] * ks;
    __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
    for (int64_t j = 1; j < nv; ++j) acc = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kr + 16 * j), acc);
    scores[i] = _mm512_reduce_add_ps(acc) * scale;
    best = std::max(best, scores[i]);
  }
  int64_t i = 0;
  const __m512 top = _mm512_set1_ps(best);
  for (; i + 16 <= count; i += 16)
    _mm512_storeu_ps(scores + i, exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(scores + i), top)));
  if (i < count) {
    const __mmask16 tail = (__mmask16)((1u << (count - i)) - 1);
    _mm512_mask_storeu_ps(scores + i, tail, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + i), top)));
  }
  __m512 o[16];
  for (int64_t j = 0; j < nv; ++j) o[j] = _mm512_setzero_ps();
  float total = 0.f;
  for (int64_t s = 0; s < count; ++s) {
    const float* vr = v + slots[s] * ks;
    const __m512 p = _mm512_set1_ps(scores[s]);
    for (int64_t j = 0; j < nv; ++j) o[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * j), o[j]);
    total += scores[s];
  }
  const __m512 inv = _mm512_set1_ps(1.f / total);
  for (int64_t j = 0; j < nv; ++j) _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(o[j], inv));
}

void attend_row_scalar(const float* q, const float* k, const float* v, int64_t ks, const int64_t* slots,
                       int64_t count, int64_t dim, float scale, float* scores, float* out) {
  float best = -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    const float* kr = k + slots[i] * ks;
    float acc = 0.f;
    for (int64_t j = 0; j < dim; ++j) acc = std::fmaf(q[j], kr[j], acc);
    scores[i] = acc * scale;
    best = std::max(best, scores[i]);
  }
  float total = 0.f;
  for (int64_t j = 0; j < dim; ++j) out[j] = 0.f;
  for (int64_t s = 0; s < count; ++s) {
    const float p = std::exp(scores[s] - best);
    const float* vr = v + slots[s] * ks;
    for (int64_t j = 0; j < dim; ++j) out[j] = std::fmaf(p, vr[j], out[j]);
    total += p;
  }
  const float inv = 1.f / total;
  for (int64_t j = 0; j < dim; ++j) out[j] *= inv;
}

// q (T, NH, D); k, v (KV, S, D) with S >= past + T, the layer's buffer (rows may be strided);
// mask (T, T) bool, the new slots each new row sees (undefined: causal). Returns (T, NH, D).
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t past,
                  const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attend: q (T, NH, D), k and v (KV, S, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attend: float32 only");
  const int64_t t = q.size(0), heads = q.size(1), dim = q.size(2), groups = k.size(0);
  TORCH_CHECK(heads % groups == 0 && k.size(2) == dim && v.sizes() == k.sizes(), "attend: head shapes disagree");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == dim && v.stride(1) == dim &&
              k.stride(0) == v.stride(0), "attend: k and v rows must be contiguous");
  TORCH_CHECK(past + t <= k.size(1), "attend: ", past + t, " slots asked of a buffer of ", k.size(1));
  at::Tensor visible;
  if (mask.has_value() && mask->defined()) {
    visible = mask->to(at::kBool).contiguous();
    TORCH_CHECK(visible.size(0) == t && visible.size(1) == t, "attend: mask must be (T, T)");
  }
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty_like(qc);
  const float* qp = qc.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = visible.defined() ? visible.data_ptr<bool>() : nullptr;
  const int64_t hstride = k.stride(0), per_group = heads / groups;
  float* op = out.data_ptr<float>();
  const bool fast = has_avx512() && dim % 16 == 0 && dim <= 256;
  at::parallel_for(0, t * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots(past + t);
    std::vector<float> scores(past + t);
    int64_t built_for = -1, count = 0;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t row = job / heads, head = job % heads;
      if (row != built_for) {  // the slots this row sees: the prefix, then its new slots in order
        count = 0;
        for (int64_t s = 0; s < past; ++s) slots[count++] = s;
        for (int64_t j = 0; j < t; ++j)
          if (mp ? mp[row * t + j] : j <= row) slots[count++] = past + j;
        built_for = row;
      }
      const int64_t g = head / per_group;
      const float* qr = qp + (row * heads + head) * dim;
      float* o = op + (row * heads + head) * dim;
      if (fast) attend_row_avx512(qr, kp + g * hstride, vp + g * hstride, dim, slots.data(), count, dim, (float)scale, scores.data(), o);
      else attend_row_scalar(qr, kp + g * hstride, vp + g * hstride, dim, slots.data(), count, dim, (float)scale, scores.data(), o);
    }
  });
  return out;
}

bool fast_path() { return has_avx512(); }

}  // namespace

TORCH_LIBRARY(dflash_lowbit, lib) {
  lib.def("qmm(Tensor x, Tensor u, Tensor d, Tensor m, int n, int bits) -> Tensor");
  lib.def("quantize(Tensor x) -> Tensor[]");
  lib.def("attend(Tensor q, Tensor k, Tensor v, int past, Tensor? mask, float scale) -> Tensor");
  lib.def("fast_path() -> bool", fast_path);
}

TORCH_LIBRARY_IMPL(dflash_lowbit, CPU, lib) {
  lib.impl("qmm", qmm);
  lib.impl("quantize", quantize);
  lib.impl("attend", attend);
}
