// Attention for the new rows of one layer, each row over the cached prefix and the new slots its
// mask row allows, in slot order: a row's bits do not depend on the rows beside it.
#include "lowbit.h"

namespace dflash_lowbit {

// The AVX-512 code works on units: the query heads of one row that share a KV head (up to three
// at a time), so that each key and value row it loads serves all of them; and a run of units of
// one KV head goes through the keys, then the values, a block of positions at a time for all of
// them, so that the block stays in the L1 cache. Each (row, head) still does exactly its own
// sequence of operations, the one a call with that row alone does, whatever unit or run it is
// in: those change the order of the heads' work, never a head's arithmetic.
//
// A position's score is a function of q and its key alone (products by lane, fma chunk by chunk,
// then the lanes summed by a fixed tree, sixteen keys at once); its weight's place in the sums
// is its place in the row's visible list (the prefix, then the row's new slots in order).

constexpr int64_t KB = 64;  // positions per block (16 KB of keys or values at dim 64)
constexpr int MAXH = 3;     // query heads per unit
constexpr int64_t SHARED = 4;  // a run of at least this many units reads a float copy of its keys and values

struct Unit {
  const float* q[MAXH];
  float* out[MAXH];
  const int64_t* fresh;  // the row's new slots, after the prefix
  int64_t count;         // visible slots
  float* scores;         // per head `count` of them, `stride` apart
  int64_t stride;
  float* state;          // per head, `state_stride` apart: the running max (16), then the weighted values' sum (dim)
  int64_t state_stride;
  float total[MAXH];
};

using Half = uint16_t;  // the K/V cache's storage (half.cpp): loaded as float, all arithmetic in float

template <typename T>
inline const T* slot_row(const T* base, int64_t ks, int64_t past, const int64_t* fresh, int64_t pos) {
  return base + (pos < past ? pos : fresh[pos - past]) * ks;
}

// The tree that sums sixteen vectors' lanes into one vector (lane i: vector i's sum): lanes 0+2
// and 1+3 within each group of four (tree1), then those two (tree2), then quarters 0+2 and 1+3
// (tree3), then those two (tree4). A lane's bits do not depend on the other vectors.
__attribute__((target("avx512f"), always_inline)) inline __m512 tree1(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}
__attribute__((target("avx512f"), always_inline)) inline __m512 tree2(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}
__attribute__((target("avx512f"), always_inline)) inline __m512 tree3(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
__attribute__((target("avx512f"), always_inline)) inline __m512 tree4(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

// q . key by lane for each head: the first chunk's products, then fma chunk by chunk; zero for no key
// sixteen keys' or values' numbers as floats: from the fp16 cache, or from a float copy of it
__attribute__((target("avx512f,f16c"), always_inline)) inline __m512 load16(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

template <int NV, int H, typename T>
__attribute__((target("avx512f,fma,f16c"), always_inline)) inline void dots(const __m512 (&qv)[H][NV], const T* kr,
                                                                       __m512 (&acc)[H]) {
  if (!kr) {
    for (int h = 0; h < H; ++h) acc[h] = _mm512_setzero_ps();
    return;
  }
  __m512 kc = load16(kr);
  asm("" : "+v"(kc));  // one load for all the heads (not one folded into each fma)
  for (int h = 0; h < H; ++h) acc[h] = _mm512_mul_ps(qv[h][0], kc);
  for (int j = 1; j < NV; ++j) {
    kc = load16(kr + 16 * j);
    asm("" : "+v"(kc));
    for (int h = 0; h < H; ++h) acc[h] = _mm512_fmadd_ps(qv[h][j], kc, acc[h]);
  }
}

// the scores of sixteen keys (rows kr[0..15], null: none), one vector a head; the tree summed
// as the pairs of keys come, so that few vectors are live at once
template <int NV, int H, typename T>
__attribute__((target("avx512f,fma,f16c"), always_inline)) inline void scores16(const __m512 (&qv)[H][NV],
                                                                                const T* const* kr, __m512 (&sc)[H]) {
  __m512 bp[H], cp[H], d0[H], d1[H];
#pragma GCC unroll 8
  for (int p = 0; p < 8; ++p) {
    __m512 a0[H], a1[H], b[H];
    dots<NV, H, T>(qv, kr[2 * p], a0);
    dots<NV, H, T>(qv, kr[2 * p + 1], a1);
    for (int h = 0; h < H; ++h) b[h] = tree1(a0[h], a1[h]);
    if (p % 2 == 0) {
      for (int h = 0; h < H; ++h) bp[h] = b[h];
    } else if (p % 4 == 1) {
      for (int h = 0; h < H; ++h) cp[h] = tree2(bp[h], b[h]);
    } else if (p == 3) {
      for (int h = 0; h < H; ++h) d0[h] = tree3(cp[h], tree2(bp[h], b[h]));
    } else {
      for (int h = 0; h < H; ++h) d1[h] = tree3(cp[h], tree2(bp[h], b[h]));
    }
  }
  for (int h = 0; h < H; ++h) sc[h] = tree4(d0[h], d1[h]);
}

// the scores of positions from..to (from a multiple of 16) and each head's running max
template <int NV, int H, typename T>
__attribute__((target("avx512f,fma,f16c")))
void scores_block(Unit& u, const T* k, int64_t ks, int64_t past, int64_t from, int64_t to, float scale) {
  __m512 qv[H][NV], most[H];
  for (int h = 0; h < H; ++h) {
    for (int j = 0; j < NV; ++j) qv[h][j] = _mm512_loadu_ps(u.q[h] + 16 * j);
    most[h] = _mm512_loadu_ps(u.state + h * u.state_stride);
  }
  const __m512 sv = _mm512_set1_ps(scale);
  const T* kr[16];
  for (int64_t i = from; i < to; i += 16) {
    const int64_t n = std::min<int64_t>(16, to - i);
    if (n == 16 && i + 16 <= past)
      for (int a = 0; a < 16; ++a) kr[a] = k + (i + a) * ks;
    else
      for (int a = 0; a < 16; ++a) kr[a] = a < n ? slot_row(k, ks, past, u.fresh, i + a) : nullptr;
    __m512 sc[H];
    scores16<NV, H, T>(qv, kr, sc);
    const __mmask16 live = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    for (int h = 0; h < H; ++h) {
      const __m512 x = _mm512_mul_ps(sc[h], sv);
      _mm512_mask_storeu_ps(u.scores + h * u.stride + i, live, x);
      most[h] = _mm512_mask_max_ps(most[h], live, most[h], x);
    }
  }
  for (int h = 0; h < H; ++h) _mm512_storeu_ps(u.state + h * u.state_stride, most[h]);
}

// a head's scores to weights (exp of score - max); returns their sum (by position mod 16, then
// the lanes)
__attribute__((target("avx512f,fma,f16c"))) inline float weights(float* scores, int64_t count, const float* most) {
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_loadu_ps(most)));
  int64_t i = 0;
  __m512 sums = _mm512_setzero_ps();
  for (; i + 16 <= count; i += 16) {
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(scores + i), top));
    _mm512_storeu_ps(scores + i, e);
    sums = _mm512_add_ps(sums, e);
  }
  if (i < count) {
    const __mmask16 tail = (__mmask16)((1u << (count - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(tail, exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + i), top)));
    _mm512_mask_storeu_ps(scores + i, tail, e);
    sums = _mm512_add_ps(sums, e);
  }
  return _mm512_reduce_add_ps(sums);
}

// weights times values over positions from..to, added to each head's sum in position order
template <int NV, int H, typename T>
__attribute__((target("avx512f,fma,f16c")))
void values_block(Unit& u, const T* v, int64_t ks, int64_t past, int64_t from, int64_t to) {
  __m512 o[H][NV];
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < NV; ++j) o[h][j] = _mm512_loadu_ps(u.state + h * u.state_stride + 16 + 16 * j);
  const float* w[H];
  for (int h = 0; h < H; ++h) w[h] = u.scores + h * u.stride;
  for (int64_t s = from; s < to; ++s) {
    const T* vr = slot_row(v, ks, past, u.fresh, s);
    __m512 p[H];
    for (int h = 0; h < H; ++h) p[h] = _mm512_set1_ps(w[h][s]);
    for (int j = 0; j < NV; ++j) {
      __m512 vc = load16(vr + 16 * j);
      asm("" : "+v"(vc));  // one load for all the heads (not one folded into each fma)
      for (int h = 0; h < H; ++h) o[h][j] = _mm512_fmadd_ps(p[h], vc, o[h][j]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(u.state + h * u.state_stride + 16 + 16 * j, o[h][j]);
}

// a run of units that all read the keys and values k, v (one KV head), H heads each
template <int NV, int H, typename T>
__attribute__((target("avx512f,fma,f16c")))
void attend_units_avx512(Unit* units, int64_t n, const T* k, const T* v, int64_t ks, int64_t past,
                         float scale) {
  int64_t longest = 0;
  for (int64_t x = 0; x < n; ++x) {
    longest = std::max(longest, units[x].count);
    for (int h = 0; h < H; ++h) _mm512_storeu_ps(units[x].state + h * units[x].state_stride, _mm512_set1_ps(-INFINITY));
  }
  for (int64_t b = 0; b < longest; b += KB)
    for (int64_t x = 0; x < n; ++x)
      if (b < units[x].count) scores_block<NV, H, T>(units[x], k, ks, past, b, std::min(b + KB, units[x].count), scale);
  for (int64_t x = 0; x < n; ++x) {
    Unit& u = units[x];
    for (int h = 0; h < H; ++h) {
      float* st = u.state + h * u.state_stride;
      u.total[h] = weights(u.scores + h * u.stride, u.count, st);
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(st + 16 + 16 * j, _mm512_setzero_ps());
    }
  }
  for (int64_t b = 0; b < longest; b += KB)
    for (int64_t x = 0; x < n; ++x)
      if (b < units[x].count) values_block<NV, H, T>(units[x], v, ks, past, b, std::min(b + KB, units[x].count));
  for (int64_t x = 0; x < n; ++x) {
    const Unit& u = units[x];
    for (int h = 0; h < H; ++h) {
      const __m512 inv = _mm512_set1_ps(1.f / u.total[h]);
      const float* o = u.state + h * u.state_stride + 16;
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(u.out[h] + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * j), inv));
    }
  }
}

template <int NV, typename T>
void attend_heads(Unit* units, int64_t n, int64_t h, const T* k, const T* v, int64_t ks, int64_t past, float scale) {
  if (h == 1) attend_units_avx512<NV, 1, T>(units, n, k, v, ks, past, scale);
  else if (h == 2) attend_units_avx512<NV, 2, T>(units, n, k, v, ks, past, scale);
  else attend_units_avx512<NV, 3, T>(units, n, k, v, ks, past, scale);
}

// units of h query heads each, their vectors nv x 16 floats (nv 8: one head a unit)
template <typename T>
void attend_units(Unit* units, int64_t n, int64_t nv, int64_t h, const T* k, const T* v, int64_t ks, int64_t past,
                  float scale) {
  if (nv == 1) attend_heads<1, T>(units, n, h, k, v, ks, past, scale);
  else if (nv == 2) attend_heads<2, T>(units, n, h, k, v, ks, past, scale);
  else if (nv == 4) attend_heads<4, T>(units, n, h, k, v, ks, past, scale);
  else attend_units_avx512<8, 1, T>(units, n, k, v, ks, past, scale);
}

__attribute__((always_inline)) inline void attend_row_portable(const float* q, const Half* k, const Half* v, int64_t ks,
                                                               const int64_t* slots, int64_t count, int64_t dim,
                                                               float scale, float* scores, float* out) {
  float best = -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    const Half* kr = k + slots[i] * ks;
    float acc = 0.f;
    for (int64_t j = 0; j < dim; ++j) acc = std::fmaf(q[j], half_to_float(kr[j]), acc);
    scores[i] = acc * scale;
    best = std::max(best, scores[i]);
  }
  float total = 0.f;
  for (int64_t j = 0; j < dim; ++j) out[j] = 0.f;
  for (int64_t s = 0; s < count; ++s) {
    const float p = std::exp(scores[s] - best);
    const Half* vr = v + slots[s] * ks;
    for (int64_t j = 0; j < dim; ++j) out[j] = std::fmaf(p, half_to_float(vr[j]), out[j]);
    total += p;
  }
  const float inv = 1.f / total;
  for (int64_t j = 0; j < dim; ++j) out[j] *= inv;
}

// with hardware fma where the CPU has it (fmaf is exact either way: the same bits)
__attribute__((target("avx2,fma"))) void attend_row_fma(const float* q, const Half* k, const Half* v, int64_t ks,
                                                         const int64_t* slots, int64_t count, int64_t dim,
                                                         float scale, float* scores, float* out) {
  attend_row_portable(q, k, v, ks, slots, count, dim, scale, scores, out);
}

// The AVX2 code (dim a multiple of 8, at most 128): each score's products by lane, fma chunk by
// chunk, the lanes summed in a fixed order; the weights' exp 8 at a time; their sum in slot order;
// the weighted values summed position by position in registers.
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 load8(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}

__attribute__((target("avx2,fma,f16c"))) void attend_row_avx2(const float* q, const Half* k, const Half* v, int64_t ks,
                                                          const int64_t* slots, int64_t count, int64_t dim,
                                                          float scale, float* scores, float* out) {
  const int64_t nv = dim / 8;
  __m256 qv[16];
  for (int64_t c = 0; c < nv; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
  float best = -INFINITY;
  for (int64_t i = 0; i < count; ++i) {
    const Half* kr = k + slots[i] * ks;
    __m256 acc = _mm256_mul_ps(qv[0], load8(kr));
    for (int64_t c = 1; c < nv; ++c) acc = _mm256_fmadd_ps(qv[c], load8(kr + 8 * c), acc);
    scores[i] = hsum_avx2(acc) * scale;
    best = std::max(best, scores[i]);
  }
  const __m256 top = _mm256_set1_ps(best);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(scores + i, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + i), top)));
  if (i < count) {  // the last few, through a padded copy
    float tail[8] = {};
    std::memcpy(tail, scores + i, (count - i) * sizeof(float));
    _mm256_storeu_ps(tail, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(tail), top)));
    std::memcpy(scores + i, tail, (count - i) * sizeof(float));
  }
  float total = 0.f;
  __m256 acc[16];
  for (int64_t c = 0; c < nv; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < count; ++s) {
    const __m256 p = _mm256_set1_ps(scores[s]);
    const Half* vr = v + slots[s] * ks;
    for (int64_t c = 0; c < nv; ++c) acc[c] = _mm256_fmadd_ps(p, load8(vr + 8 * c), acc[c]);
    total += scores[s];
  }
  const __m256 inv = _mm256_set1_ps(1.f / total);
  for (int64_t c = 0; c < nv; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(acc[c], inv));
}

void attend_row_scalar(const float* q, const Half* k, const Half* v, int64_t ks, const int64_t* slots,
                       int64_t count, int64_t dim, float scale, float* scores, float* out) {
  static const bool fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (isa() == Isa::avx2 && dim % 8 == 0 && dim <= 128)
    return attend_row_avx2(q, k, v, ks, slots, count, dim, scale, scores, out);
  if (fma) return attend_row_fma(q, k, v, ks, slots, count, dim, scale, scores, out);
  attend_row_portable(q, k, v, ks, slots, count, dim, scale, scores, out);
}

void attend_into(const float* qp, int64_t t, int64_t heads, int64_t dim, const Half* kp, const Half* vp,
                 int64_t groups, int64_t hstride, int64_t past, const bool* mp, float scale, float* op) {
  const int64_t per_group = heads / groups;
  const int64_t nv = has_avx512() && dim % 16 == 0 ? dim / 16 : 0;
  // each row's new slots, in order
  std::vector<int64_t> fresh(t * t), fresh_count(t);
  for (int64_t row = 0; row < t; ++row) {
    int64_t c = 0;
    for (int64_t j = 0; j < t; ++j)
      if (mp ? mp[row * t + j] : j <= row) fresh[row * t + c++] = past + j;
    fresh_count[row] = c;
  }
  if (nv != 1 && nv != 2 && nv != 4 && nv != 8) {  // the portable code, a (row, head) at a time
    at::parallel_for(0, t * heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> slots(past + t);
      std::vector<float> scores(past + t);
      for (int64_t job = begin; job < end; ++job) {
        const int64_t row = job / heads, head = job % heads;
        int64_t count = 0;
        for (int64_t s = 0; s < past; ++s) slots[count++] = s;
        for (int64_t j = 0; j < fresh_count[row]; ++j) slots[count++] = fresh[row * t + j];
        const int64_t g = head / per_group;
        attend_row_scalar(qp + (row * heads + head) * dim, kp + g * hstride, vp + g * hstride, dim, slots.data(),
                          count, dim, scale, scores.data(), op + (row * heads + head) * dim);
      }
    });
    return;
  }
  // units in the order (KV head, chunk of its query heads, row); a thread's run of units of one
  // KV head and chunk goes together, up to `most` of them at a time
  const int64_t hmax = nv <= 4 ? MAXH : 1;  // a unit's query vectors stay in registers
  const int64_t chunks = (per_group + hmax - 1) / hmax;
  constexpr int64_t most = 16;
  const int64_t stride = (past + t + 15) / 16 * 16, state_stride = 16 + dim;
  const int64_t per_unit = hmax * (stride + state_stride);
  at::parallel_for(0, groups * chunks * t, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch, copy;
    if ((int64_t)scratch.size() < most * per_unit) scratch.resize(most * per_unit);
    Unit units[most];
    for (int64_t job = begin; job < end;) {
      const int64_t run = job / t, g = run / chunks, first = g * per_group + run % chunks * hmax;
      const int64_t h = std::min(hmax, (g + 1) * per_group - first);
      int64_t n = 0;
      for (; job < end && n < most && job / t == run; ++job, ++n) {
        const int64_t row = job % t;
        Unit& u = units[n];
        for (int64_t x = 0; x < h; ++x) {
          u.q[x] = qp + (row * heads + first + x) * dim;
          u.out[x] = op + (row * heads + first + x) * dim;
        }
        u.fresh = fresh.data() + row * t;
        u.count = past + fresh_count[row];
        u.scores = scratch.data() + n * per_unit;
        u.stride = stride;
        u.state = u.scores + hmax * stride;
        u.state_stride = state_stride;
      }
      const Half* kg = kp + g * hstride;
      const Half* vg = vp + g * hstride;
      if (n < SHARED) {
        attend_units(units, n, nv, h, kg, vg, dim, past, scale);
      } else {  // the run's rows read the same keys and values: each converted to float once, for all
        const int64_t values = (past + t) * dim;  // every slot a row of this call may see
        if ((int64_t)copy.size() < 2 * values) copy.resize(2 * values);
        to_float(kg, values, copy.data());
        to_float(vg, values, copy.data() + values);
        attend_units(units, n, nv, h, (const float*)copy.data(), (const float*)copy.data() + values, dim, past, scale);
      }
    }
  });
}

// q (T, NH, D) float32; k, v (KV, S, D) float16 with S >= past + T, the layer's buffer (rows may be strided);
// mask (T, T) bool, the new slots each new row sees (undefined: causal). Returns (T, NH, D).
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t past,
                  const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "attend: q (T, NH, D), k and v (KV, S, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kHalf && v.scalar_type() == at::kHalf,
              "attend: q float32, k and v float16 (the K/V cache's storage)");
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
  attend_into(qc.data_ptr<float>(), t, heads, dim, reinterpret_cast<const Half*>(k.data_ptr<at::Half>()),
              reinterpret_cast<const Half*>(v.data_ptr<at::Half>()), groups, k.stride(0),
              past, visible.defined() ? visible.data_ptr<bool>() : nullptr, (float)scale, out.data_ptr<float>());
  return out;
}

}  // namespace dflash_lowbit
