// Attention for the new rows of one layer, each row over the cached prefix and the new slots its
// mask row allows, in slot order: a row's bits do not depend on the rows beside it.
#include "lowbit.h"

namespace dflash_lowbit {

// One query row of one head over `count` visible slots (their indices in `slots`); dim = 16 NV.
template <int NV>
__attribute__((target("avx512f,fma")))
void attend_row_avx512(const float* q, const float* k, const float* v, int64_t ks, const int64_t* slots,
                       int64_t count, float scale, float* scores, float* out) {
  constexpr int64_t nv = NV;
  __m512 qv[NV];
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
  __m512 sums = _mm512_setzero_ps();  // the weights' sum, by position mod 16 in the visible list
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
  const float total = _mm512_reduce_add_ps(sums);
  // sum of weights times values, four partial sums (by position mod 4) so that the additions
  // do not wait on each other; then added in a fixed order
  constexpr int P = 4;
  __m512 o[P][NV];
  for (int a = 0; a < P; ++a)
    for (int64_t j = 0; j < nv; ++j) o[a][j] = _mm512_setzero_ps();
  int64_t s = 0;
  for (; s + P <= count; s += P)
    for (int a = 0; a < P; ++a) {
      const float* vr = v + slots[s + a] * ks;
      const __m512 p = _mm512_set1_ps(scores[s + a]);
      for (int64_t j = 0; j < nv; ++j) o[a][j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * j), o[a][j]);
    }
  for (int a = 0; s < count; ++s, ++a) {
    const float* vr = v + slots[s] * ks;
    const __m512 p = _mm512_set1_ps(scores[s]);
    for (int64_t j = 0; j < nv; ++j) o[a][j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16 * j), o[a][j]);
  }
  const __m512 inv = _mm512_set1_ps(1.f / total);
  for (int64_t j = 0; j < nv; ++j) {
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(o[0][j], o[1][j]), _mm512_add_ps(o[2][j], o[3][j]));
    _mm512_storeu_ps(out + 16 * j, _mm512_mul_ps(sum, inv));
  }
}

__attribute__((always_inline)) inline void attend_row_portable(const float* q, const float* k, const float* v, int64_t ks,
                                                               const int64_t* slots, int64_t count, int64_t dim,
                                                               float scale, float* scores, float* out) {
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

// with hardware fma where the CPU has it (fmaf is exact either way: the same bits)
__attribute__((target("avx2,fma"))) void attend_row_fma(const float* q, const float* k, const float* v, int64_t ks,
                                                         const int64_t* slots, int64_t count, int64_t dim,
                                                         float scale, float* scores, float* out) {
  attend_row_portable(q, k, v, ks, slots, count, dim, scale, scores, out);
}

void attend_row_scalar(const float* q, const float* k, const float* v, int64_t ks, const int64_t* slots,
                       int64_t count, int64_t dim, float scale, float* scores, float* out) {
  static const bool fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (fma) return attend_row_fma(q, k, v, ks, slots, count, dim, scale, scores, out);
  attend_row_portable(q, k, v, ks, slots, count, dim, scale, scores, out);
}

void attend_into(const float* qp, int64_t t, int64_t heads, int64_t dim, const float* kp, const float* vp,
                 int64_t groups, int64_t hstride, int64_t past, const bool* mp, float scale, float* op) {
  const int64_t per_group = heads / groups;
  const int64_t nv = has_avx512() && dim % 16 == 0 ? dim / 16 : 0;  // 0: the portable code
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
      const float* kg = kp + g * hstride;
      const float* vg = vp + g * hstride;
      if (nv == 1) attend_row_avx512<1>(qr, kg, vg, dim, slots.data(), count, scale, scores.data(), o);
      else if (nv == 2) attend_row_avx512<2>(qr, kg, vg, dim, slots.data(), count, scale, scores.data(), o);
      else if (nv == 4) attend_row_avx512<4>(qr, kg, vg, dim, slots.data(), count, scale, scores.data(), o);
      else if (nv == 8) attend_row_avx512<8>(qr, kg, vg, dim, slots.data(), count, scale, scores.data(), o);
      else attend_row_scalar(qr, kg, vg, dim, slots.data(), count, dim, scale, scores.data(), o);
    }
  });
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
  attend_into(qc.data_ptr<float>(), t, heads, dim, k.data_ptr<float>(), v.data_ptr<float>(), groups, k.stride(0),
              past, visible.defined() ? visible.data_ptr<bool>() : nullptr, (float)scale, out.data_ptr<float>());
  return out;
}

}  // namespace dflash_lowbit
